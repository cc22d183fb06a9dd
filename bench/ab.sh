#!/usr/bin/env bash
# A/B of builds in one device run: each config is "name:BIN=path" (a binary carried in .bin;
# further VAR=v items are environment for `thin bench`), run on each model in turn, configs
# interleaved per model, ROUNDS times (each build on an archive it converted itself); one JSON line per run with "config" added, into
# $OUT/ab.jsonl, and a table at the end. Experiments live in branches: build each, carry both.
#   CONFIGS="base:BIN=.bin/thin-base new:BIN=.bin/thin" ROUNDS=2 bash bench/ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/thin-out}; mkdir -p "$OUT"
BIN=${THIN_BIN:-.bin/thin}
MODELS=${MODELS:-"smollm2-135m llama3.2-1b smollm3-3b"}
CONFIGS=${CONFIGS:-"base:"}
ROUNDS=${ROUNDS:-1}
W=${WORK:-/tmp/thin-bench}
export PYTHONUNBUFFERED=1 THIN_CACHE_DIR=$W/cache
. bench/cuda_libs.sh
for m in $MODELS; do
  [ -d "$W/hf/$m" ] || python3 bench/make_models.py "$W/hf" $m 2>&1 | grep -v Warning | grep made
  for round in $(seq "$ROUNDS"); do
    for c in $CONFIGS; do
      name=${c%%:*}; bin=$BIN; envs=()
      for v in $(echo "${c#*:}" | tr ',' ' '); do case $v in BIN=*) bin=${v#BIN=} ;; *) envs+=("$v") ;; esac; done
      # Each build converts its own archive: the format may differ between the two.
      a="$W/$m-ab-$name.thin"
      [ -f "$a" ] || "$bin" convert "$W/hf/$m" -o "$a" --profile bf16 --quiet || { echo "$m $name: convert failed"; continue; }
      env ${envs[@]+"${envs[@]}"} "$bin" bench "$a" --json --reps 1 --pp 16 --tg 16 ${BENCH_ARGS:-} \
        | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['config']='$name'; print(json.dumps(r))" >> "$OUT/ab.jsonl" \
        || echo "$m $name: failed"
    done
  done
done
python3 - "$OUT/ab.jsonl" <<'PY'
import json, sys, collections
rows = collections.defaultdict(list)
for l in open(sys.argv[1]):
    r = json.loads(l); rows[(r['model'], r['config'])].append(r['decode_tok_s'])
for (m, c), v in rows.items():
    print('%-14s %-22s decode tok/s %s' % (m, c, ' '.join('%.1f' % x for x in v)))
PY
