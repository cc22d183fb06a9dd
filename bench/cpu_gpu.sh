#!/usr/bin/env bash
# The GPU engine against the CPU engine (the oracle) on the same archive: teacher-forced logits
# (`thin logits`, with and without --cpu) after a prompt of 1 and of 128 ids, then STEPS more; per
# row the cosine and whether the argmax agrees. Archives converted from $WORK/hf/<model> (made by
# bench/make_models.py) with each profile. One JSON line per model, profile and prompt into
# $OUT/cpu_gpu.jsonl.
#   PROFILES="bf16 bf16-f32edges" MODELS="smollm2-135m llama3.2-1b" bash bench/cpu_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/thin-out}; mkdir -p "$OUT"
W=${WORK:-/tmp/thin-bench}
BIN=${THIN_BIN:-.bin/thin}
MODELS=${MODELS:-"smollm2-135m"}
PROFILES=${PROFILES:-"bf16-f32edges"}
STEPS=${STEPS:-64}
export THIN_CACHE_DIR=$W/cache
for m in $MODELS; do
  for prof in $PROFILES; do
    a="$W/$m-$prof.thin"
    [ -f "$a" ] || "$BIN" convert "$W/hf/$m" -o "$a" --profile "$prof" --quiet || { echo "{\"model\":\"$m\",\"profile\":\"$prof\",\"error\":\"convert\"}" >> "$OUT/cpu_gpu.jsonl"; continue; }
    for p in 1 128; do
      python3 -c "import random, json; random.seed(11); print(json.dumps([random.randrange(1000) for _ in range($p + $STEPS)]))" > "$W/ids.json"
      "$BIN" logits "$a" --ids "$W/ids.json" --prompt-len $p -o "$W/gpu.f32" 2>/dev/null
      "$BIN" logits "$a" --ids "$W/ids.json" --prompt-len $p -o "$W/cpu.f32" --cpu 2>/dev/null
      vocab=$(python3 -c "import json; print(json.load(open('$W/hf/$m/config.json'))['vocab_size'])")
      python3 bench/compare_logits.py "$W/gpu.f32" "$W/cpu.f32" "$vocab" "model=$m" "profile=$prof" "prompt=$p" >> "$OUT/cpu_gpu.jsonl"
      rm -f "$W/gpu.f32" "$W/cpu.f32"
    done
  done
done
cat "$OUT/cpu_gpu.jsonl"
