# graphserve: OpenAI-compatible LLM inference server, GPU image.
#
#   docker build -t graphserve .
#   docker run --gpus all -p 8000:8000 -v /path/to/models:/models graphserve --model /models/NAME
#
# The install steps are the Makefile's own targets (`make deps`, `make install`, `make model`),
# the same commands a developer and CI run: nothing here installs packages on its own.
# The base image carries CUDA and the same torch release the Makefile pins for CPU
# machines (TORCH_SPEC); `make install` sees `import torch` succeed and reuses it
# through --system-site-packages.
FROM pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GRAPHSERVE_CACHE=/var/cache/graphserve \
    TRITON_CACHE_DIR=/var/cache/graphserve/triton \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# `make` is all the build needs beyond the base image (every Python dependency ships
# wheels; the base image already has the C compiler Triton uses at run time).
# make 4.3 is the version in Ubuntu 22.04 and 24.04 alike.
RUN apt-get update \
    && apt-get install -y --no-install-recommends 'make=4.3-*' \
    && rm -rf /var/lib/apt/lists/*

# Non-root user with a fixed numeric id (Kubernetes runAsNonRoot checks the number).
RUN groupadd --gid 10001 graphserve \
    && useradd -l --uid 10001 --gid 10001 --create-home --home-dir /home/graphserve \
       --shell /usr/sbin/nologin graphserve \
    && mkdir -p /app /models "${GRAPHSERVE_CACHE}" "${TRITON_CACHE_DIR}" \
    && chown graphserve:graphserve /app /models "${GRAPHSERVE_CACHE}" "${TRITON_CACHE_DIR}"

WORKDIR /app
USER 10001:10001
# The Makefile's VENV (.venv) under WORKDIR; its bin first on PATH gives `graphserve`.
ENV VIRTUAL_ENV=/app/.venv \
    PATH=/app/.venv/bin:${PATH}

# Dependency layer: rebuilt only when pyproject.toml or the Makefile change.
# README.md is pyproject's `readme`; a placeholder stands in until the sources come.
COPY --chown=10001:10001 pyproject.toml Makefile ./
RUN touch README.md \
    && make deps VENV_FLAGS=--system-site-packages EXTRAS=gpu

# Sources, then `make install`: the dependencies are already there, so this only links
# graphserve's sources into the venv (the Makefile's `link`). Then the embedded default model is
# converted into GRAPHSERVE_CACHE (offline, like every later start: HF_HUB_OFFLINE).
COPY --chown=10001:10001 . .
RUN make install VENV_FLAGS=--system-site-packages EXTRAS=gpu \
    && make model VENV_FLAGS=--system-site-packages EXTRAS=gpu

# Mount models at /models (owned by the image user; mount read-only is fine).
EXPOSE 8000

# Model loading and CUDA-graph capture take a while: failures in the start period
# do not count. /health answers 503 while draining or when the engine is broken.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# Exec form: graphserve is PID 1 and receives SIGTERM itself (graceful shutdown).
STOPSIGNAL SIGTERM
ENTRYPOINT ["graphserve", "serve", "--host", "0.0.0.0"]
CMD []
