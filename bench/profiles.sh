#!/usr/bin/env bash
# Every profile of each model in one device run: random-weight real-shape HF models (made by
# bench/make_models.py), converted once per profile, then `thin bench` on each archive, the
# profiles interleaved per round so drift hits all alike. `thin bench` reports decode tok/s, the
# weight bytes read per token, the copy rate measured in the same run and the roofline %. One
# JSON line per run into $OUT/profiles.jsonl, a table at the end.
#   MODELS="smollm2-135m llama3.2-1b smollm3-3b" PROFILES="bf16 fp8" ROUNDS=2 bash bench/profiles.sh
set -uo pipefail
OUT=${OUT:-/tmp/thin-out}; mkdir -p "$OUT"
BIN=${THIN_BIN:-.bin/thin}
MODELS=${MODELS:-"smollm2-135m llama3.2-1b smollm3-3b"}
PROFILES=${PROFILES:-"bf16 fp8"}
ROUNDS=${ROUNDS:-2}
W=${WORK:-/tmp/thin-bench}
export PYTHONUNBUFFERED=1 THIN_CACHE_DIR=$W/cache
. bench/cuda_libs.sh
for m in $MODELS; do
  [ -d "$W/hf/$m" ] || python3 bench/make_models.py "$W/hf" $m 2>&1 | grep -v Warning | grep made
  for p in $PROFILES; do
    [ -f "$W/$m-$p.thin" ] || "$BIN" convert "$W/hf/$m" -o "$W/$m-$p.thin" --profile "$p" --quiet || echo "$m $p: convert failed"
  done
  for round in $(seq "$ROUNDS"); do
    for p in $PROFILES; do
      [ -f "$W/$m-$p.thin" ] || continue
      "$BIN" bench "$W/$m-$p.thin" --json --reps 1 --pp 128 --tg 16 ${BENCH_ARGS:-} >> "$OUT/profiles.jsonl" || echo "$m $p: bench failed"
    done
  done
done
python3 - "$OUT/profiles.jsonl" <<'PY'
import json, sys, collections
rows = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); rows[(r['model'], r['profile'])].append(r)
print('%-14s %-8s %10s %12s %10s %9s %8s %9s' % ('model', 'profile', 'MB/token', 'decode tok/s', 'copy GB/s', 'roofline', '% roof', 'peak GiB'))
for (m, p), rs in rows.items():
    r = rs[-1]
    print('%-14s %-8s %10.1f %12s %10.0f %9.0f %8s %9.3f' % (m, p, r['weight_bytes_per_token'] / 1e6, ' '.join('%.1f' % x['decode_tok_s'] for x in rs), r['copy_gb_s'] or 0, r['roofline_tok_s'] or 0, ' '.join('%.1f' % (x['roofline_pct'] or 0) for x in rs), r['peak_gib'] or 0))
PY
