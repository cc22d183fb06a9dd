#!/usr/bin/env bash
# The real Gemma 3 270M on the GPU (issue 27 point 1). The Q4_K_M GGUF (253 MB) cannot ride one
# device call (64 MiB each way), so it goes in parts over consecutive calls on one warm machine
# (the machine keeps /tmp while warm; a call every few seconds keeps it so), then one call:
#   - `thin convert --profile bf16` of the joined file (its sha256 checked first);
#   - `thin run --backend cuda` greedily on the four prompts of tests/fixtures/gemma3_hf_greedy.json
#     (HF transformers' greedy continuations from the same GGUF, fp32, recorded on the CPU),
#     32 tokens each: the ids against HF's, one JSON line per prompt;
#   - the GPU engine against the CPU engine (the oracle) on the same archive: `thin logits` over
#     each prompt + HF's continuation, teacher-forced: min cosine and top-1 per prompt;
#   - `thin bench` (decode tok/s, peak memory).
# Rows into $OUT/gemma_gpu.jsonl.
# Here, once:  bash bench/gemma_gpu.sh split        (.llama/gemma/part0..5 of at most 45,000,000 bytes)
# Device, one call per part, back to back:
#   carry [".llama/gemma/partK"]:                    bash bench/gemma_gpu.sh stage
# then carry [".bin/thin"]:                          bash bench/gemma_gpu.sh run
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/thin-out}; mkdir -p "$OUT"
BIN=${THIN_BIN:-.bin/thin}
W=${WORK:-/tmp/thin-bench}/gemma
SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
REF=tests/fixtures/gemma3_hf_greedy.json
mkdir -p "$W"
case "${1:-}" in
  split)
    g=$(bash scripts/fetch-gemma3.sh) || exit 1
    echo "$SHA  $g" | sha256sum -c - || exit 1
    rm -rf .llama/gemma && mkdir -p .llama/gemma && split -b "${2:-45000000}" --numeric-suffixes=0 -a 1 "$g" .llama/gemma/part && ls -la .llama/gemma
    exit $? ;;
  stage)
    for p in .llama/gemma/part*; do [ -f "$p" ] && cp "$p" "$W/" && echo "staged $p ($(stat -c %s "$p") bytes)"; done
    echo "$W holds: $(cd "$W" && ls part* 2>/dev/null | tr '\n' ' ')"
    exit 0 ;;
  run) ;;
  *) echo "usage: bash bench/gemma_gpu.sh split|stage|run" >&2; exit 1 ;;
esac
. bench/cuda_libs.sh
export THIN_CACHE_DIR=${WORK:-/tmp/thin-bench}/cache
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
g=$W/gemma-3-270m-q4_k_m.gguf
if [ ! -f "$g" ]; then
  cat "$W"/part* > "$g.tmp" 2>/dev/null
  if echo "$SHA  $g.tmp" | sha256sum -c - >/dev/null 2>&1; then mv "$g.tmp" "$g"; else
    echo "the parts in $W ($(stat -c %s "$g.tmp" 2>/dev/null) of 253113024 bytes) do not make the GGUF: stage every part on this machine first"; rm -f "$g.tmp"; exit 5
  fi
fi
a=$W/gemma3-270m-bf16.thin
[ -f "$a" ] || "$BIN" convert "$g" -o "$a" --profile bf16 --quiet || exit 6
ROWS=$OUT/gemma_gpu.jsonl
n=$(python3 -c "import json; print(len(json.load(open('$REF'))['cases']))")
for i in $(seq 0 $((n - 1))); do
  prompt=$(python3 -c "import json; print(json.load(open('$REF'))['cases'][$i]['prompt'])")
  "$BIN" run "$a" --backend cuda --prompt "$prompt" --max-tokens 32 --format jsonl > "$W/run.jsonl" 2> "$W/run.err" || { echo "thin run failed: $(tail -3 "$W/run.err")"; continue; }
  python3 - "$REF" "$i" "$W/run.jsonl" "$W/ids.json" <<'PY' | tee -a "$ROWS"
import json, sys
case = json.load(open(sys.argv[1]))["cases"][int(sys.argv[2])]
lines = [json.loads(l) for l in open(sys.argv[3]) if l.strip()]
prompt_ids, got = lines[0]["prompt_ids"], [l["id"] for l in lines[1:-1]]
want = case["greedy_ids"]
same = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
print(json.dumps({"check": "thin run --backend cuda greedy against HF's greedy (fp32, same GGUF)", "prompt": case["prompt"],
                  "prompt_ids_equal": prompt_ids == case["prompt_ids"], "generated": len(got), "equal_prefix": same,
                  "all_equal": got == want[:len(got)] and len(got) == len(want), "stats": lines[-1]}))
# The prompt and HF's continuation, for the teacher-forced comparison below.
json.dump(case["prompt_ids"] + want, open(sys.argv[4], "w"))
PY
  plen=$(python3 -c "import json; print(len(json.load(open('$REF'))['cases'][$i]['prompt_ids']))")
  "$BIN" logits "$a" --ids "$W/ids.json" --prompt-len "$plen" -o "$W/gpu.f32" 2>/dev/null
  "$BIN" logits "$a" --ids "$W/ids.json" --prompt-len "$plen" -o "$W/cpu.f32" --cpu 2>/dev/null
  python3 bench/compare_logits.py "$W/gpu.f32" "$W/cpu.f32" 262144 \
    "check=thin logits: GPU against the CPU engine, same bf16 archive, prompt + HF's continuation teacher-forced" "case=$i" | tee -a "$ROWS"
  rm -f "$W/gpu.f32" "$W/cpu.f32"
done
"$BIN" bench "$a" --json | tee -a "$ROWS" | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print('decode', r['decode_tok_s'], 'prefill', r['prefill_tok_s'], 'peak GiB', r['peak_gib'])"
