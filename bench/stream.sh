#!/usr/bin/env bash
# Weight streaming on the device (issue 28), one call:
# (0) if the kernel-test binary was built and carried (cargo test --release --features
#     cuda,<archs> --test cuda_kernels --no-run, copied to .bin/cuda_kernels), its
#     *_stream_equals_all tests: whole prefill passes and decode graphs with layers streamed
#     against every weight resident, bit for bit, on random weights;
# (1) the same on a real-shape archive through the CLI: `thin logits` (128 prompt ids, then 64
#     teacher-forced) with --residency all, and with --residency stream under each --gpu-mem,
#     compared byte for byte: one JSON line per case into $OUT/stream_logits.jsonl;
# (2) speed: `thin bench` with --residency stream at each --gpu-mem and all-resident, interleaved
#     per round; each row carries residency, gpu_mem_limit, streamed_bytes_per_token, link_gbps
#     (pinned host-to-device, measured in the same run with the ring's own copies),
#     link_bound_tok_s and link_bound_fraction. Rows into $OUT/stream.jsonl, a table at the end;
# (3) the HF peer at each --gpu-mem on the same bf16 weights (bench/hf_peer.py offload:
#     device_map="auto", max_memory) into $OUT/stream_hf.jsonl (NO_HF=1 leaves it out).
#   MODELS="smollm3-3b" PROFILES="bf16 fp8" GPU_MEMS="2GiB 4GiB" ROUNDS=2 bash bench/stream.sh
set -uo pipefail
OUT=${OUT:-/tmp/thin-out}; mkdir -p "$OUT"
BIN=${THIN_BIN:-.bin/thin}
MODELS=${MODELS:-"smollm3-3b"}
PROFILES=${PROFILES:-"bf16 fp8"}
GPU_MEMS=${GPU_MEMS:-"2GiB 4GiB"}
ROUNDS=${ROUNDS:-2}
BENCH_ARGS=${BENCH_ARGS:-"--steps 64 --warmup 4 --reps 2 --pp 128 --tg 32"}
W=${WORK:-/tmp/thin-bench}
export PYTHONUNBUFFERED=1 THIN_CACHE_DIR=$W/cache
. bench/cuda_libs.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -x "${KERNEL_TESTS:-.bin/cuda_kernels}" ]; then
  "${KERNEL_TESTS:-.bin/cuda_kernels}" stream_equals_all --test-threads=1 --nocapture 2>&1 | grep -E "streamed|skipped|FAIL|panicked|test result" | tee "$OUT/stream_kernel_tests.txt"
fi
python3 bench/make_models.py "$W/hf" $MODELS 2>&1 | grep -v Warning | grep made
python3 -c "import random, json; random.seed(7); print(json.dumps([random.randrange(1000) for _ in range(192)]))" > "$W/stream_ids.json"
for m in $MODELS; do
  for p in $PROFILES; do
    a="$W/$m-$p.thin"
    [ -f "$a" ] || "$BIN" convert "$W/hf/$m" -o "$a" --profile "$p" --quiet || { echo "$m $p: convert failed"; continue; }
    "$BIN" plan "$a" --gpu-mem "${GPU_MEMS%% *}" | tail -4
    # The first start compiles the kernels into the cache.
    "$BIN" logits "$a" --ids "$W/stream_ids.json" --prompt-len 128 -o "$W/all.f32" --residency all 2>/dev/null
    for g in $GPU_MEMS; do
      "$BIN" logits "$a" --ids "$W/stream_ids.json" --prompt-len 128 -o "$W/stream.f32" --residency stream --gpu-mem "$g" 2>"$W/stream.err"
      python3 - "$W/all.f32" "$W/stream.f32" "$m" "$p" "$g" "$W/stream.err" <<'PY' | tee -a "$OUT/stream_logits.jsonl"
import json, os, sys, numpy as np
a, b = (np.fromfile(f, dtype=np.float32) if os.path.exists(f) else None for f in sys.argv[1:3])
r = {"model": sys.argv[3], "profile": sys.argv[4], "gpu_mem": sys.argv[5], "compare": "thin logits --residency stream vs all, 128 prompt ids + 64 teacher-forced"}
if a is None or b is None or a.size != b.size or a.size == 0:
    r["error"] = open(sys.argv[6]).read()[-400:]
else:
    r.update(values=int(a.size), identical=bool(a.tobytes() == b.tobytes()), max_abs_diff=float(np.max(np.abs(a - b))))
print(json.dumps(r))
PY
      rm -f "$W/stream.f32"
    done
    rm -f "$W/all.f32"
  done
  for round in $(seq "$ROUNDS"); do
    for p in $PROFILES; do
      a="$W/$m-$p.thin"
      [ -f "$a" ] || continue
      "$BIN" bench "$a" --json --residency all $BENCH_ARGS >> "$OUT/stream.jsonl" || echo "$m $p all: bench failed"
      for g in $GPU_MEMS; do
        "$BIN" bench "$a" --json --residency stream --gpu-mem "$g" $BENCH_ARGS >> "$OUT/stream.jsonl" || echo "$m $p $g: bench failed"
      done
    done
  done
  # The HF peer on the same weights (bf16) at each limit: device_map="auto" with max_memory.
  if [ -z "${NO_HF:-}" ]; then
    for g in $GPU_MEMS; do
      timeout "${HF_TIMEOUT:-240}" python3 bench/hf_peer.py offload "$g" "$W/hf/$m" 2>/dev/null | grep '"mode"' | tee -a "$OUT/stream_hf.jsonl"
    done
  fi
done
python3 - "$OUT/stream.jsonl" "$OUT/stream_hf.jsonl" <<'PY'
import json, os, sys
print('%-12s %-6s %-9s %8s %10s %12s %9s %10s %8s %9s' % ('model', 'prof', 'gpu_mem', 'streamed', 'MB/token', 'decode tok/s', 'link GB/s', 'bound t/s', '% bound', 'peak GiB'))
for l in open(sys.argv[1]):
    r = json.loads(l)
    p = r.get('plan') or {}
    g = r.get('gpu_mem_limit')
    print('%-12s %-6s %-9s %8s %10.1f %12.2f %9s %10s %8s %9.3f' % (r['model'], r['profile'], '%.2fGiB' % (g / 2**30) if g else '-', len(p.get('streamed_layers', [])),
          (r.get('streamed_bytes_per_token') or 0) / 1e6, r['decode_tok_s'], '%.1f' % r['link_gbps'] if r.get('link_gbps') else '-',
          '%.2f' % r['link_bound_tok_s'] if r.get('link_bound_tok_s') else '-', '%.1f' % (100 * r['link_bound_fraction']) if r.get('link_bound_fraction') else '-', r.get('peak_gib') or 0))
for l in open(sys.argv[2]) if os.path.exists(sys.argv[2]) else []:
    r = json.loads(l)
    print('%-12s %-6s %-9s %8s %10s %12s   HF device_map="auto" %s' % (r['model'], 'hf', r['gpu_mem_limit'], '', '', r.get('tok_s', '-'), r.get('error') or r.get('device_map_modules')))
PY
