#!/usr/bin/env bash
# CPU emulation of the attention-side kernels (qk_rope_kv; attn_decode with attend and merge_splits) as
# rendered for an arch: every CUDA block run in turn, one std::thread per CUDA thread, barriers
# for __syncthreads and warp shuffles. Checks qk_rope_kv (QK-norm where the arch has it, RoPE, the
# cache rows), and for attn_decode the new KV-cache row, the attention output against
# a float64 softmax over the cache and the per-head counter reset, over positions (past 256
# rows, up to the last of a 4096 cache), with and without RoPE and sliding windows. It checks the
# kernel's logic, not the GPU's memory ordering between blocks (blocks never run at once here).
#   bash scripts/emu/run.sh [arch_dir ...]   (default llama3_2_1b smollm3_3b gemma3_270m; QUICK=0 for all cases)
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
for a in ${@:-llama3_2_1b smollm3_3b gemma3_270m}; do
  { echo '#include "emu.h"'; echo "#define THIN_WEIGHTS_bf16 1"; cat "generated/$a/kernels/decode.cu"; echo; cat scripts/emu/attn_decode_check.cpp; } > "$tmp/$a.cpp"
  qk=$(grep -q 'rsqrtf(warp_sum(ss) / HEAD_DIM' "generated/$a/kernels/decode.cu" && echo 1 || echo 0)
  g++ -std=c++20 -O2 -pthread -w -DQK_NORM=$qk -I scripts/emu "$tmp/$a.cpp" -o "$tmp/$a"
  echo -n "$a: "; "$tmp/$a" $([ "${QUICK:-1}" = 1 ] && echo quick)
done
