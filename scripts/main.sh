#!/usr/bin/env bash
# The main job, end to end on the real SmolLM2-135M-Instruct weights: fetch, build, convert, inspect, verify.
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$(bash scripts/fetch-smollm2.sh)
cargo build --release --locked
mkdir -p .cache/models
./target/release/thin convert "$gguf" -o .cache/models/smollm2-135m.thin --profile bf16
./target/release/thin inspect .cache/models/smollm2-135m.thin
./target/release/thin verify .cache/models/smollm2-135m.thin
