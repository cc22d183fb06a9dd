#!/usr/bin/env bash
# NVRTC without a CUDA toolkit or GPU, for compiling the rendered kernels in CI
# (scripts/emu/nvrtc_compile.py): the nvidia-cuda-nvrtc-cu12 wheel from PyPI, pinned, downloaded
# once into the cache and unpacked beside it. Prints the path of libnvrtc.so.12. Idempotent.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${THIN_CACHE:-$REPO/.cache}"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$REPO/.cache/pip-http}"
PKG=nvidia-cuda-nvrtc-cu12
VER=12.9.86
DIR="$CACHE/nvrtc-$VER"
LIB="$DIR/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
if [ ! -f "$LIB" ]; then
  mkdir -p "$CACHE/pip"
  WHEEL=$(ls "$CACHE/pip"/nvidia_cuda_nvrtc_cu12-"$VER"-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$WHEEL" ]; then
    python3 -m pip download --no-deps --only-binary=:all: "$PKG==$VER" -d "$CACHE/pip" >&2
    WHEEL=$(ls "$CACHE/pip"/nvidia_cuda_nvrtc_cu12-"$VER"-*.whl 2>/dev/null | head -n1 || true)
  fi
  [ -n "$WHEEL" ] || { echo "fetch-nvrtc: no wheel for $PKG==$VER in $CACHE/pip" >&2; exit 1; }
  rm -rf "$DIR.tmp" && mkdir -p "$DIR.tmp"
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$WHEEL" "$DIR.tmp"
  rm -rf "$DIR" && mv "$DIR.tmp" "$DIR"
fi
[ -f "$LIB" ] || { echo "fetch-nvrtc: $LIB missing after unpacking" >&2; exit 1; }
echo "$LIB"
