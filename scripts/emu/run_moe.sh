#!/usr/bin/env bash
# CPU emulation of the mixture-of-experts kernels (see scripts/emu/run.sh for the emulator):
# moe_router, moe_topk, the decode step's moe_gateup and moe_down, and prefill's grouped path
# (moe_group, moe_gateup_grouped, moe_down_grouped, moe_combine) with bf16 and FP8 weights against
# float64 over 1, 3 and 17 rows, weights plain and renormalised, the unchosen experts' rows
# unmapped so that reading one is a segfault (scripts/emu/moe_check.cpp); and OLMoE's whole-projection
# q/k norm (qk_norm_whole) in its decode grid (a block for q, one for k) and its prefill grid.
# By default on OLMoE-1B-7B's description at smaller shapes (hidden 256, ffn 128, 16 experts, top 4;
# rendered by `thin-codegen kernels`): the emulator runs a thread per CUDA thread, and the real
# shapes take minutes per type. FULL=1 runs the real generated/olmoe_1b_7b kernels too (bf16).
#   bash scripts/emu/run_moe.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
sed -e 's/^name = "olmoe-1b-7b"/name = "olmoe-emu"/' -e 's/^hidden_size = 2048/hidden_size = 256/' -e 's/^intermediate_size = 1024/intermediate_size = 128/' \
    -e 's/^num_heads = 16/num_heads = 4/' -e 's/^num_kv_heads = 16/num_kv_heads = 4/' -e 's/^head_dim = 128/head_dim = 64/' \
    -e 's/^num_experts = 64/num_experts = 16/' -e 's/^top_k = 8/top_k = 4/' -e 's/^vocab_size = 50304/vocab_size = 512/' archs/olmoe-1b-7b.toml > "$tmp/olmoe-emu.toml"
cargo run -q -p thin-codegen -- kernels "$tmp/olmoe-emu.toml" > "$tmp/olmoe-emu.cu"
grep -q 'constexpr int EXPERTS = 16;' "$tmp/olmoe-emu.cu"
runs="$tmp/olmoe-emu.cu:bf16:olmoe-emu $tmp/olmoe-emu.cu:fp8:olmoe-emu"
[ "${FULL:-0}" = 1 ] && runs="$runs generated/olmoe_1b_7b/kernels/decode.cu:bf16:olmoe_1b_7b"
for r in $runs; do
  IFS=: read -r src t label <<< "$r"
  case $t in bf16) def=bf16 flag= ;; fp8) def=f8_e4m3 flag=-DMOE_FP8 ;; esac
  { echo '#include "emu.h"'; echo "#define THIN_WEIGHTS_${def} 1"; cat "$src"; echo; cat scripts/emu/moe_check.cpp; } > "$tmp/moe.cpp"
  g++ -std=c++20 -O2 -pthread -w $flag -I scripts/emu "$tmp/moe.cpp" -o "$tmp/moe"
  echo -n "$label: "; "$tmp/moe"
done
