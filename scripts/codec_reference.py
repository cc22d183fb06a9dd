#!/usr/bin/env python3
"""Reference values for thin-core/tests/codecs.rs, computed independently with ml_dtypes and gguf-py.

Regenerate (from the repo root; the venv lives in the ignored .cache/):
    python3 -m venv .cache/venv && .cache/venv/bin/pip install numpy ml_dtypes gguf
    .cache/venv/bin/python scripts/codec_reference.py
It writes thin-core/tests/fixtures/codecs/{index.json,data.bin}: every array little-endian in
data.bin, index.json names each one with its offset, length in bytes, dtype and shape. The data
is seeded, so a rerun with the same library versions writes the same bytes.

What comes from where:
- FP8 e4m3: per-row scale = amax / 448 in f32 (1.0 when that is 0), values
  ml_dtypes.float8_e4m3fn(clip(x / scale, -448, 448)); ml_dtypes rounds to nearest even but
  overflows to NaN instead of saturating, hence the clip.
- MXFP4: ml_dtypes has the e2m1 and e8m0 types but no MX block quantizer, so the OCP rule is
  written here in numpy: shared_exp = floor(log2(amax)) - 2, floor(log2) exact through np.frexp,
  clamped to [-127, 127], 0 for an all-zero block; values ml_dtypes.float4_e2m1fn(clip(x / 2^e,
  -6, 6)). Postscale p = <w, q> / <q, q> (f64, summed in element order), to f32, to bf16.
  Also gguf-py's own MXFP4 (ggml's rule: nearest code, ties to the lower index) for cross-checks.
- Q8_0, Q4_1: gguf.quants.quantize / dequantize. gguf-py's quantizers compute the same bytes as
  ggml's quantize_row_q8_0_ref / quantize_row_q4_1_ref (roundf; trunc(x + 0.5)).
"""
import importlib.metadata
import json
import os

import ml_dtypes
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "thin-core/tests/fixtures/codecs")

ROWS, COLS = 6, 256
rng = np.random.default_rng(23)

# Weights: rows of different magnitude, outliers, a row with a zero block and tiny values.
w = rng.standard_normal((ROWS, COLS)).astype(np.float32)
w[0] *= 0.02
w[1] *= 0.05
w[1, 17] = 3.5  # an outlier far above the row
w[2] *= 100.0
w[3] *= 1e-4
w[3, 32:64] = 0.0  # an all-zero block
w[4] = rng.uniform(-1, 1, COLS).astype(np.float32) * np.float32(0.7)
w[4, 200] = -40.0
w[5] = rng.standard_normal(COLS).astype(np.float32) * np.float32(0.01) + np.float32(0.003)
w = w.astype(np.float32)
x = rng.standard_normal(COLS).astype(np.float32)

arrays = {}


def put(name, a):
    arrays[name] = np.ascontiguousarray(a)


put("w", w)
put("x", x)

# Every e4m3 and e2m1 code as ml_dtypes decodes it.
put("e4m3_decoded", np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
put("e2m1_decoded", np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32))

# Encoder probes: exact ties, subnormals, saturation, signed zeros, and random values over many
# binades.
ties = []
for c in range(0x7E):
    a = float(np.uint8(c).view(ml_dtypes.float8_e4m3fn))
    b = float(np.uint8(c + 1).view(ml_dtypes.float8_e4m3fn))
    ties.append((a + b) / 2)
e2 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
ties += [(a + b) / 2 for a, b in zip(e2, e2[1:])]
probes = np.array(ties + [448.0, 460.0, 464.0, 1e6, 6.5, 8.0, 0.0, -0.0, 2.0**-9, 2.0**-10, 1e-30], dtype=np.float32)
probes = np.concatenate([probes, -probes, (rng.standard_normal(600) * 2.0 ** rng.integers(-12, 10, 600)).astype(np.float32)])
put("probes", probes)
put("probes_e4m3", np.clip(probes, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
put("probes_e2m1", np.clip(probes, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8))

# FP8 e4m3, one scale per row.
amax = np.abs(w).max(axis=1)
scale = (amax / np.float32(448.0)).astype(np.float32)
scale[scale == 0] = np.float32(1.0)
fp8 = np.clip(w / scale[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
put("fp8_values", fp8.view(np.uint8))
put("fp8_scales", scale)
put("fp8_dequant", fp8.astype(np.float32) * scale[:, None])

# MXFP4, the OCP rule.
blocks = w.reshape(ROWS, COLS // 32, 32)
bmax = np.abs(blocks).max(axis=2)
_, exp = np.frexp(bmax)  # bmax = m * 2^exp, m in [0.5, 1): floor(log2(bmax)) = exp - 1, exactly
shared = np.clip(exp.astype(np.int32) - 1 - 2, -127, 127)
e8m0 = np.where(bmax > 0, shared + 127, 0).astype(np.uint8)
block_scale = e8m0.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
codes = np.clip(blocks / block_scale[:, :, None], -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(ROWS, COLS)
put("mxfp4_values", (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8))
put("mxfp4_scales", e8m0)
q = (codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32).reshape(ROWS, COLS // 32, 32) * block_scale[:, :, None]).reshape(ROWS, COLS)
put("mxfp4_dequant", q)
post = []
for r in range(ROWS):
    wq = np.cumsum(w[r].astype(np.float64) * q[r].astype(np.float64))[-1]
    qq = np.cumsum(q[r].astype(np.float64) ** 2)[-1]
    p = np.float32(wq / qq) if qq > 0 and wq > 0 else np.float32(1.0)
    pb = np.array([p], dtype=np.float32).astype(ml_dtypes.bfloat16)
    if not (np.isfinite(pb.astype(np.float32)[0]) and pb.astype(np.float32)[0] > 0):
        pb = np.array([1.0], dtype=ml_dtypes.bfloat16)
    post.append(pb[0])
post = np.array(post, dtype=ml_dtypes.bfloat16)
put("mxfp4_postscale", post.view(np.uint16))
put("mxfp4_dequant_post", q * post.astype(np.float32)[:, None])

# gguf-py's MXFP4 (ggml's rule and block layout).
g = quantize(w, GGMLQuantizationType.MXFP4)
put("ggml_mxfp4_blocks", g)
put("ggml_mxfp4_dequant", dequantize(g, GGMLQuantizationType.MXFP4).astype(np.float32))

for name, qt in (("q8_0", GGMLQuantizationType.Q8_0), ("q4_1", GGMLQuantizationType.Q4_1)):
    b = quantize(w, qt)
    put(f"{name}_blocks", b)
    put(f"{name}_dequant", dequantize(b, qt).astype(np.float32))

os.makedirs(OUT, exist_ok=True)
index = {
    "generator": "scripts/codec_reference.py",
    "versions": {"numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__, "gguf": importlib.metadata.version("gguf")},
    "arrays": {},
}
offset = 0
with open(os.path.join(OUT, "data.bin"), "wb") as f:
    for name, a in arrays.items():
        raw = a.astype(a.dtype.newbyteorder("<")).tobytes()
        index["arrays"][name] = {"offset": offset, "len": len(raw), "dtype": str(a.dtype), "shape": list(a.shape)}
        f.write(raw)
        offset += len(raw)
with open(os.path.join(OUT, "index.json"), "w") as f:
    json.dump(index, f, indent=1)
    f.write("\n")
print(f"wrote {len(arrays)} arrays, {offset} bytes, to {OUT}")
