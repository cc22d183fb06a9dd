#!/usr/bin/env bash
# CPU emulation of the quantized matvec kernels as rendered for an arch (see scripts/emu/run.sh for
# the emulator): for FP8 (e4m3 + f32 row scale), MXFP4 (e2m1 + e8m0 per 32 + bf16 postscale) and
# Q8_0 (int8 + f16 per 32) and Q4_1 (nibbles + f16 d, m per 32), in the layouts the runtime uploads,
# down_residual and norm_gateup against a float64 reference over every code, and the prefill
# dequant to bf16.
#   bash scripts/emu/run_quant.sh [arch_dir ...]   (default smollm2_135m)
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
for a in ${@:-smollm2_135m}; do
  for t in fp8:f8_e4m3 mxfp4:mxfp4 q8_0:q8_0 q4_1:q4_1; do
    { echo '#include "emu.h"'; echo "#define THIN_WEIGHTS_${t#*:} 1"; cat "generated/$a/kernels/decode.cu"; echo; cat "scripts/emu/${t%%:*}_matvec_check.cpp"; } > "$tmp/$a.cpp"
    g++ -std=c++20 -O2 -pthread -w -I scripts/emu "$tmp/$a.cpp" -o "$tmp/$a"
    echo -n "$a ${t%%:*}: "; "$tmp/$a"
  done
done
