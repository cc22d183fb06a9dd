#!/usr/bin/env bash
# Experiment: does the decode attention's cost depend on the KV cache it was laid out for? The
# attention grid is (heads, ctx / ATTN_CHUNK) blocks; at a short position most of them exit at
# once. Same model, same positions, `thin bench --profile` at several --ctx, into $OUT/ctx.jsonl.
#   MODELS="smollm2-135m llama3.2-1b" CTXS="256 1024 4096" bash bench/attn_ctx.sh
set -uo pipefail
OUT=${OUT:-/tmp/thin-out}; mkdir -p "$OUT"
BIN=${THIN_BIN:-.bin/thin}
MODELS=${MODELS:-"smollm2-135m llama3.2-1b"}
CTXS=${CTXS:-"256 1024 4096"}
W=${WORK:-/tmp/thin-bench}
export PYTHONUNBUFFERED=1 THIN_CACHE_DIR=$W/cache
. bench/cuda_libs.sh
python3 bench/make_models.py "$W/hf" $MODELS 2>&1 | grep -v Warning
for m in $MODELS; do
  "$BIN" convert "$W/hf/$m" -o "$W/$m.thin" --profile bf16 --quiet || continue
  "$BIN" bench "$W/$m.thin" --json --steps 20 --reps 1 --pp 16 --tg 16 > /dev/null  # compile into the cache
  for c in $CTXS; do
    pp=$(( c < 640 ? 128 : 512 )); tg=$(( c < 640 ? 64 : 128 ))
    "$BIN" bench "$W/$m.thin" --json --ctx $c --pp $pp --tg $tg --reps 3 --profile | python3 -c "
import json,sys
r=json.loads(sys.stdin.read()); r['ctx']=$c
print(json.dumps(r))" | tee -a "$OUT/ctx.jsonl" | python3 -c "
import json,sys
r=json.loads(sys.stdin.read())
att=[k for k in r['kernels'] if k['kernel']=='attn_decode'][0]
print(r['model'], 'ctx', r['ctx'], 'decode', r['decode_tok_s'], 'tg', round(r['tg']['mean'],1), 'attn us', round(att['us_per_launch'],2), 'peak', round(r['peak_gib'],3))"
  done
done
