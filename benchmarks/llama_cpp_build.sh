#!/usr/bin/env bash
# llama.cpp for the CPU comparisons, built once into $LLAMA_CPP_DIR (default
# ~/.cache/graphserve/llama.cpp) from the source inside the llama-cpp-python sdist (from the
# package index): Release, llama-server, llama-quantize and the shared libraries llama-cpp-python's
# bindings load (LLAMA_CPP_LIB_PATH=$LLAMA_CPP_DIR/build/bin, PYTHONPATH=$LLAMA_CPP_DIR/python: the
# sdist's package and its one missing dependency).
#
# Instruction sets: the machine's own (GGML_NATIVE=ON), with AMX taken out only on a CPU that has
# it (ggml's AMX matmul crashed there: SIGSEGV in ggml_backend_amx_mul_mat, llama.cpp 0.3.36's
# vendor copy). LLAMA_CPP_ISA=avx2 caps them as GRAPHSERVE_CPU_ISA=avx2 caps graphserve's kernels
# (native minus AVX-512 and AVX-VNNI: what an AVX2-only machine builds), into build-avx2/.
#
#   bash benchmarks/llama_cpp_build.sh      # prints the build's bin folder
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-$HOME/.cache/graphserve/llama.cpp}
ISA=${LLAMA_CPP_ISA:-native}
case "$ISA" in
  native) BUILD="$LLAMA_CPP_DIR/build"; CAP="" ;;
  avx2) BUILD="$LLAMA_CPP_DIR/build-avx2"; CAP="-mno-avx512f -mno-avxvnni" ;;
  *) echo "LLAMA_CPP_ISA=$ISA: expected native or avx2" >&2; exit 2 ;;
esac
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  CAP="$CAP -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
BIN="$BUILD/bin"

if [ ! -x "$BIN/llama-server" ] || [ ! -x "$BIN/llama-quantize" ]; then
  mkdir -p "$LLAMA_CPP_DIR"
  if ! compgen -G "$LLAMA_CPP_DIR/sdist/llama_cpp_python-*/vendor/llama.cpp" >/dev/null; then
    "$PY" -m pip download --no-deps --no-binary :all: llama-cpp-python -d "$LLAMA_CPP_DIR/sdist" -q
    tar xzf "$(ls "$LLAMA_CPP_DIR"/sdist/llama_cpp_python-*.tar.gz | sort -V | tail -1)" -C "$LLAMA_CPP_DIR/sdist"
  fi
  SRC=$(ls -d "$LLAMA_CPP_DIR"/sdist/llama_cpp_python-*/vendor/llama.cpp | sort -V | tail -1)
  GENERATOR=(); command -v ninja >/dev/null && GENERATOR=(-G Ninja)
  cmake -S "$SRC" -B "$BUILD" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$CAP" -DCMAKE_CXX_FLAGS="$CAP" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
  cmake --build "$BUILD" --target llama-server llama-quantize -j "$(nproc)" >/dev/null
fi

if [ ! -d "$LLAMA_CPP_DIR/python/llama_cpp" ]; then
  rm -rf "$LLAMA_CPP_DIR/python.tmp"
  "$PY" -m pip install -q --target "$LLAMA_CPP_DIR/python.tmp" diskcache
  cp -r "$(ls -d "$LLAMA_CPP_DIR"/sdist/llama_cpp_python-*/llama_cpp | sort -V | tail -1)" "$LLAMA_CPP_DIR/python.tmp/"
  mv "$LLAMA_CPP_DIR/python.tmp" "$LLAMA_CPP_DIR/python"
fi
echo "$BIN"
