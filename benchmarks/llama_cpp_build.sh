#!/usr/bin/env bash
# llama.cpp for issue 42's comparisons, built once into $LLAMA_CPP_DIR (default
# ~/.cache/graphserve/llama.cpp) from the source inside the llama-cpp-python sdist (from the
# package index): Release, this machine's instruction sets, llama-server, llama-quantize and the
# shared libraries llama-cpp-python's bindings load (LLAMA_CPP_LIB_PATH=$LLAMA_CPP_DIR/build/bin,
# PYTHONPATH=$LLAMA_CPP_DIR/python: the sdist's package and its one missing dependency).
#
#   bash benchmarks/llama_cpp_build.sh      # prints $LLAMA_CPP_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-$HOME/.cache/graphserve/llama.cpp}
BIN="$LLAMA_CPP_DIR/build/bin"

if [ ! -x "$BIN/llama-server" ] || [ ! -x "$BIN/llama-quantize" ]; then
  mkdir -p "$LLAMA_CPP_DIR"
  if ! compgen -G "$LLAMA_CPP_DIR/sdist/llama_cpp_python-*/vendor/llama.cpp" >/dev/null; then
    "$PY" -m pip download --no-deps --no-binary :all: llama-cpp-python -d "$LLAMA_CPP_DIR/sdist" -q
    tar xzf "$(ls "$LLAMA_CPP_DIR"/sdist/llama_cpp_python-*.tar.gz | sort -V | tail -1)" -C "$LLAMA_CPP_DIR/sdist"
  fi
  SRC=$(ls -d "$LLAMA_CPP_DIR"/sdist/llama_cpp_python-*/vendor/llama.cpp | sort -V | tail -1)
  # this machine's instruction sets, as GGML_NATIVE would pick them, but without AMX: with -march=native
  # ggml's AMX matmul crashes here (SIGSEGV in ggml_backend_amx_mul_mat, llama.cpp 0.3.36's vendor copy)
  cmake -S "$SRC" -B "$LLAMA_CPP_DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON \
    -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
  cmake --build "$LLAMA_CPP_DIR/build" --target llama-server llama-quantize -j "$(nproc)" >/dev/null
fi

if [ ! -d "$LLAMA_CPP_DIR/python/llama_cpp" ]; then
  rm -rf "$LLAMA_CPP_DIR/python.tmp"
  "$PY" -m pip install -q --target "$LLAMA_CPP_DIR/python.tmp" diskcache
  cp -r "$(ls -d "$LLAMA_CPP_DIR"/sdist/llama_cpp_python-*/llama_cpp | sort -V | tail -1)" "$LLAMA_CPP_DIR/python.tmp/"
  mv "$LLAMA_CPP_DIR/python.tmp" "$LLAMA_CPP_DIR/python"
fi
echo "$LLAMA_CPP_DIR"
