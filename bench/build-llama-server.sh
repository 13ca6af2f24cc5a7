#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the CPU peer to measure against, side by side in one run) from the source
# that the llama-cpp-python sdist vendors, and prints the binary's path. About 10 minutes on 2 cores, once per
# machine: the result is kept under ${LLAMA_SERVER_HOME:-$HOME/.cache/llama-server-0.3.36} and reused.
# `python -m bench.run --llama-server auto` runs it; by hand:  bin=$(bench/build-llama-server.sh)  then e.g.
#   "$bin" -m MODEL.gguf --host 127.0.0.1 --port 18600 -t 2 -np 64 -c 16384 --cont-batching
# (64 slots of 256 tokens, continuous batching; OpenAI-style /v1/completions and /v1/chat/completions).
set -euo pipefail
VER=0.3.36
HOME_DIR=${LLAMA_SERVER_HOME:-$HOME/.cache/llama-server-$VER}
BIN=$HOME_DIR/src/vendor/llama.cpp/build/bin/llama-server
if [ ! -x "$BIN" ] || grep -q "GGML_NATIVE:BOOL=ON" "$HOME_DIR/src/vendor/llama.cpp/build/CMakeCache.txt" 2>/dev/null; then
  mkdir -p "$HOME_DIR" && cd "$HOME_DIR"
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VER" -d . >&2
  rm -rf src && mkdir src && tar xzf "llama_cpp_python-$VER.tar.gz" -C src --strip-components=1
  cd src/vendor/llama.cpp
  # The instruction sets of this CPU, without AMX: some virtual machines report AMX but fault on it (SIGILL
  # at the first matrix product), so a -march=native build can crash where this one runs.
  f=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
  isa=(-DGGML_NATIVE=OFF)
  for pair in sse4_2:SSE42 f16c:F16C fma:FMA bmi2:BMI2 avx:AVX avx2:AVX2 avx_vnni:AVX_VNNI avx512f:AVX512 \
      avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    case " $f " in *" ${pair%%:*} "*) isa+=("-DGGML_${pair#*:}=ON") ;; *) isa+=("-DGGML_${pair#*:}=OFF") ;; esac
  done
  [ -n "$f" ] || isa=(-DGGML_NATIVE=ON)
  cmake -B build -DCMAKE_BUILD_TYPE=Release "${isa[@]}" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF >&2
  cmake --build build --target llama-server -j"$(nproc)" >&2
fi
echo "$BIN"
