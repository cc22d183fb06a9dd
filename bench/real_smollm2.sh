#!/usr/bin/env bash
# The real SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) on the GPU machine, over two device calls:
# one call carries at most 64 MiB, so the GGUF travels in parts (split -b 45000000 of the file in
# tests/common's model cache: .gl/smol.part.aa, .ab, .ac), the first with the binary. The second
# call must find the machine still warm (the device keeps it ~30 s after a call), where the first
# left its part in /tmp.
#   call 1, carry [".bin/thin", ".gl/smol.part.aa"]:                  bash bench/real_smollm2.sh stage
#   call 2, carry [".gl/smol.part.ab", ".gl/smol.part.ac", ".whl"]:   bash bench/real_smollm2.sh run > $OUT/log.txt 2>&1
# `run` joins and checks the file, converts it with `thin convert` (dequantized to bf16, the
# weights HF's GGUF loader gives), runs `thin run --backend cuda` on a chat prompt, `thin bench`,
# and bench/fidelity.py against HF bf16 on the same dequantized weights; results under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/thin-out}
R=/tmp/thin-real
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
BIN=${THIN_BIN:-.bin/thin}
mkdir -p "$R" "$OUT"
case "${1:-}" in
  stage)
    cp .gl/smol.part.aa "$R/" && cp "$BIN" "$R/thin" && echo "staged $(stat -c %s "$R/smol.part.aa") bytes in $R"
    ;;
  run)
    [ -f "$R/smol.part.aa" ] || { echo "no $R/smol.part.aa: the machine was not warm (run the stage call again, then this one at once)"; exit 2; }
    [ -x "$BIN" ] || BIN=$R/thin
    mkdir -p "$R/hf"
    cat "$R/smol.part.aa" .gl/smol.part.a[b-z] > "$R/hf/model.gguf"
    echo "$SHA  $R/hf/model.gguf" | sha256sum -c - || exit 3
    # Into a folder of its own for the python that runs transformers (a bare `pip` may be another
    # interpreter's: HF then finds no gguf).
    python3 -m pip install --no-index --no-deps -q --target "$R/py" .whl/gguf-*.whl 2>&1 | grep -v "root user" | tail -1
    export PYTHONPATH="$R/py${PYTHONPATH:+:$PYTHONPATH}"
    . bench/cuda_libs.sh
    export THIN_CACHE_DIR=$R/cache PYTHONUNBUFFERED=1
    "$BIN" convert "$R/hf/model.gguf" -o "$R/smol.thin" --profile bf16 --quiet || exit 4
    "$BIN" run "$R/smol.thin" --backend cuda --chat --prompt "What is the capital of France?" --max-tokens 48 2>&1 | tee "$OUT/run.txt"
    "$BIN" bench "$R/smol.thin" --json | tee "$OUT/thin.jsonl"
    python3 bench/fidelity.py "$R/hf" "$BIN" "$R/smol.thin" smollm2-135m-real --gguf model.gguf --cpu-check 200 2>&1 | grep -v Warning | tee "$OUT/fidelity.jsonl"
    ;;
  *) echo "usage: bench/real_smollm2.sh stage|run"; exit 1 ;;
esac
