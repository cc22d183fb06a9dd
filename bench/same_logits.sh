#!/usr/bin/env bash
# Whether two builds of thin give the same GPU logits, bit for bit: teacher-forced rows (`thin
# logits`) after a prompt of 128 ids and after one of 1 id, then 64 more ids, on each model that
# bench/ab.sh or bench/h200.sh converted into $WORK. One JSON line per model and prompt into
# $OUT/same_logits.jsonl. For refactors that must not change a value:
#   A=.bin/thin-base B=.bin/thin MODELS="smollm2-135m llama3.2-1b" bash bench/same_logits.sh
set -uo pipefail
OUT=${OUT:-/tmp/thin-out}; mkdir -p "$OUT"
W=${WORK:-/tmp/thin-bench}
MODELS=${MODELS:-"smollm2-135m llama3.2-1b smollm3-3b"}
export THIN_CACHE_DIR=$W/cache
for m in $MODELS; do
  [ -f "$W/$m.thin" ] || { echo "{\"model\":\"$m\",\"error\":\"no $W/$m.thin\"}" >> "$OUT/same_logits.jsonl"; continue; }
  for p in 1 128; do
    python3 -c "import random, json; random.seed(7); print(json.dumps([random.randrange(1000) for _ in range($p + 64)]))" > "$W/ids.json"
    "$A" logits "$W/$m.thin" --ids "$W/ids.json" --prompt-len $p -o "$W/a.f32" 2>/dev/null
    "$B" logits "$W/$m.thin" --ids "$W/ids.json" --prompt-len $p -o "$W/b.f32" 2>/dev/null
    python3 - "$W/a.f32" "$W/b.f32" "$m" "$p" <<'PY' >> "$OUT/same_logits.jsonl"
import json, sys, numpy as np
a, b = (np.fromfile(f, dtype=np.float32) if __import__('os').path.exists(f) else None for f in sys.argv[1:3])
r = {"model": sys.argv[3], "prompt": int(sys.argv[4])}
if a is None or b is None or a.size != b.size or a.size == 0:
    r["error"] = "missing or different sizes"
else:
    r.update(values=int(a.size), identical=bool(a.tobytes() == b.tobytes()), max_abs_diff=float(np.max(np.abs(a - b))))
print(json.dumps(r))
PY
    rm -f "$W/a.f32" "$W/b.f32"
  done
done
cat "$OUT/same_logits.jsonl"
