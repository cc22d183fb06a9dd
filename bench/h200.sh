#!/usr/bin/env bash
# One device run: random-weight real-shape HF models -> thin convert -> thin bench + fidelity vs HF
# bf16 -> (PEER=1) the HF peer, eager and compiled, on the same shapes in the same run.
# Writes JSON lines under $OUT; bench/collect.py turns them into bench/results/h200.jsonl rows.
#   MODELS="smollm2-135m llama3.2-1b smollm3-3b" PEER=1 bash bench/h200.sh
# FIDELITY=0 skips the HF comparison; BENCH_ARGS go to the timed `thin bench` (e.g. --profile);
# THIN=0 runs only the kernel tests and the peer (all of it for four models takes ~5 min: split a
# run over two calls under the device's 10-minute limit). At most 8 files come back from a run:
# keep $OUT to these.
set -uo pipefail
OUT=${OUT:-/tmp/thin-out}
mkdir -p "$OUT"
BIN=${THIN_BIN:-.bin/thin}
MODELS=${MODELS:-"smollm2-135m llama3.2-1b smollm3-3b"}
W=${WORK:-/tmp/thin-bench}
export PYTHONUNBUFFERED=1 THIN_CACHE_DIR=$W/cache
. bench/cuda_libs.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
# The kernel tests (tests/cuda_kernels.rs, every kernel against the CPU ops on random inputs), if
# their binary was built here and carried: cargo test --release --features cuda,<archs> --test cuda_kernels --no-run
if [ -x "${KERNEL_TESTS:-.bin/cuda_kernels}" ]; then
  THIN_KERNEL_REPORT="$OUT/kernels.jsonl" "${KERNEL_TESTS:-.bin/cuda_kernels}" --test-threads=1 2>&1 | grep -E "FAIL|panicked|test result"
  echo "kernel tests: $(grep -c '"pass":true' "$OUT/kernels.jsonl" 2>/dev/null) passed, $(grep -c '"pass":false' "$OUT/kernels.jsonl" 2>/dev/null) failed"
fi
[ "${THIN:-1}" = 1 ] && python3 bench/make_models.py "$W/hf" $MODELS 2>&1 | grep -v Warning
for m in $([ "${THIN:-1}" = 1 ] && echo $MODELS); do
  "$BIN" convert "$W/hf/$m" -o "$W/$m.thin" --profile bf16 --quiet || { echo "{\"model\":\"$m\",\"error\":\"convert\"}" | tee -a "$OUT/thin.jsonl"; continue; }
  # First start compiles the kernels into the cache; the timed run below starts warm.
  "$BIN" bench "$W/$m.thin" --json --steps 20 --reps 1 --pp 16 --tg 16 >> "$OUT/cold.jsonl"
  "$BIN" bench "$W/$m.thin" --json ${BENCH_ARGS:-} | tee -a "$OUT/thin.jsonl"
  [ "${FIDELITY:-1}" = 1 ] && python3 bench/fidelity.py "$W/hf/$m" "$BIN" "$W/$m.thin" "$m" ${FIDELITY_ARGS:-} 2>&1 | grep -v Warning | tee -a "$OUT/fidelity.jsonl"
done
if [ "${PEER:-0}" = 1 ]; then
  python3 bench/hf_peer.py eager $MODELS 2>&1 | grep '^{' | tee "$OUT/peer_eager.jsonl"
  python3 bench/hf_peer.py compiled $MODELS 2>&1 | grep '^{' | tee "$OUT/peer_compiled.jsonl"
fi
