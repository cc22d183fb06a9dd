#!/usr/bin/env bash
# CPU emulation of the FP8 (e4m3 + f32 row scale) matvec kernels as rendered for an arch (see
# scripts/emu/run.sh for the emulator): down_residual and norm_gateup against a float64
# reference over every e4m3 code but NaN, and the prefill dequant to bf16.
#   bash scripts/emu/run_fp8.sh [arch_dir ...]   (default smollm2_135m)
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
for a in ${@:-smollm2_135m}; do
  { echo '#include "emu.h"'; echo "#define THIN_WEIGHTS_f8_e4m3 1"; cat "generated/$a/kernels/decode.cu"; echo; cat scripts/emu/fp8_matvec_check.cpp; } > "$tmp/$a.cpp"
  g++ -std=c++20 -O2 -pthread -w -I scripts/emu "$tmp/$a.cpp" -o "$tmp/$a"
  echo -n "$a: "; "$tmp/$a"
done
