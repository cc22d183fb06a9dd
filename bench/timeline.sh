#!/usr/bin/env bash
# The decode step's in-graph timeline: each kernel's cost inside the replayed step (the kernels
# stamp the global timer when their wait returns; `thin bench --timeline` builds that module), next to a
# plain run of the same binary (the stamps' own cost), into $OUT/timeline.jsonl.
#   MODELS="smollm2-135m llama3.2-1b smollm3-3b" bash bench/timeline.sh
set -uo pipefail
OUT=${OUT:-/tmp/thin-out}; mkdir -p "$OUT"
BIN=${THIN_BIN:-.bin/thin}
MODELS=${MODELS:-"smollm2-135m llama3.2-1b smollm3-3b"}
W=${WORK:-/tmp/thin-bench}
export PYTHONUNBUFFERED=1 THIN_CACHE_DIR=$W/cache
. bench/cuda_libs.sh
for m in $MODELS; do
  [ -d "$W/hf/$m" ] || python3 bench/make_models.py "$W/hf" $m 2>&1 | grep -v Warning | grep made
  [ -f "$W/$m.thin" ] || "$BIN" convert "$W/hf/$m" -o "$W/$m.thin" --profile bf16 --quiet || continue
  "$BIN" bench "$W/$m.thin" --json --reps 1 --pp 16 --tg 16 ${BENCH_ARGS:-} | tee -a "$OUT/timeline.jsonl" | python3 -c "
import json,sys; r=json.loads(sys.stdin.read()); print(r['model'], 'plain decode', r['decode_tok_s'])"
  "$BIN" bench "$W/$m.thin" --json --reps 1 --pp 16 --tg 16 --timeline ${BENCH_ARGS:-} | tee -a "$OUT/timeline.jsonl" | python3 -c "
import json,sys
r=json.loads(sys.stdin.read()); t=r['timeline']
print(r['model'], 'stamped decode', r['decode_tok_s'], 'span us', round(t['first_to_last_start_us'],1))
for k in t['kernels']: print('   %-14s %3d x %6.2f us = %7.1f us' % (k['kernel'], k['launches'], k['us_per_launch'], k['us_per_step']))"
done
