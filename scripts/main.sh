#!/usr/bin/env bash
# The main job, end to end on the real SmolLM2-135M-Instruct weights: fetch, build (with the
# smollm2-135m engine), convert, inspect, verify, then generate text with `thin run`.
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$(bash scripts/fetch-smollm2.sh)
cargo build --release --locked --features smollm2-135m
mkdir -p .cache/models
./target/release/thin convert "$gguf" -o .cache/models/smollm2-135m.thin --profile bf16
./target/release/thin inspect .cache/models/smollm2-135m.thin
./target/release/thin verify .cache/models/smollm2-135m.thin
./target/release/thin run .cache/models/smollm2-135m.thin --chat --max-tokens 64 \
  --prompt "Write a short poem about the sea."
