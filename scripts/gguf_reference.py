#!/usr/bin/env python3
"""Reference values for thin-core/tests/gguf_real.rs, computed independently with gguf-py.

Usage (from the repo root):
    python3 -m venv .cache/venv && .cache/venv/bin/pip install gguf numpy blake3
    scripts/fetch-smollm2.sh
    .cache/venv/bin/python scripts/gguf_reference.py [path.gguf] [out.json]
"""
import hashlib
import json
import os
import sys

import numpy as np
from blake3 import blake3
import gguf
from gguf.quants import dequantize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
dst = sys.argv[2] if len(sys.argv) > 2 else os.path.join(REPO, "tests/fixtures/smollm2_gguf_ref.json")

r = gguf.GGUFReader(src)


def field(name):
    f = r.fields.get(name)
    if f is None:
        return None
    v = f.contents()
    return v


by_type = {}
for t in r.tensors:
    by_type.setdefault(t.tensor_type.name, []).append(t)

wanted = []
for ty, ts in sorted(by_type.items()):
    pick = [t for t in ts if t.name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight")]
    step = max(1, len(ts) // 8)
    for t in ts[::step]:
        if len(pick) >= 8:
            break
        if t not in pick:
            pick.append(t)
    wanted.extend(pick)

tensors = []
for t in wanted:
    raw = bytes(t.data.tobytes())
    vals = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
    n = vals.size
    stride = max(1, n // 64)
    idx = list(range(0, n, stride))[:64]
    v64 = vals.astype(np.float64)
    tensors.append({
        "name": t.name,
        "ggml_type": int(t.tensor_type),
        "type_name": t.tensor_type.name,
        "dims": [int(d) for d in t.shape],  # as stored, innermost first
        "n_elements": int(n),
        "n_bytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "blake3": blake3(raw).hexdigest(),
        "first": [float(x) for x in vals[:64]],
        "stride": stride,
        "strided": [float(vals[i]) for i in idx],
        "sum": float(v64.sum()),
        "sum_sq": float((v64 * v64).sum()),
    })

tmpl = field("tokenizer.chat_template") or ""
arch = field("general.architecture")
meta = {
    "gguf_version": int(field("GGUF.version")),
    "tensor_count": len(r.tensors),
    "architecture": arch,
    "name": field("general.name"),
    "file_type": int(field("general.file_type")),
    "block_count": int(field(f"{arch}.block_count")),
    "context_length": int(field(f"{arch}.context_length")),
    "embedding_length": int(field(f"{arch}.embedding_length")),
    "feed_forward_length": int(field(f"{arch}.feed_forward_length")),
    "head_count": int(field(f"{arch}.attention.head_count")),
    "head_count_kv": int(field(f"{arch}.attention.head_count_kv")),
    "rope_freq_base": float(field(f"{arch}.rope.freq_base")),
    "rms_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
    "tokenizer_model": field("tokenizer.ggml.model"),
    "vocab_size": len(r.fields["tokenizer.ggml.tokens"].data),
    "merges": len(r.fields["tokenizer.ggml.merges"].data),
    "bos_token_id": int(field("tokenizer.ggml.bos_token_id")),
    "eos_token_id": int(field("tokenizer.ggml.eos_token_id")),
    "add_bos_token": bool(field("tokenizer.ggml.add_bos_token")),
    "chat_template_sha256": hashlib.sha256(tmpl.encode()).hexdigest(),
    "tensor_type_counts": {k: len(v) for k, v in sorted(by_type.items())},
    "has_output_weight": any(t.name == "output.weight" for t in r.tensors),
}

# Random blocks of every format thin-core decodes (finite f16 scales), dequantized by gguf-py:
# cross-checks the K-quants, which the SmolLM2 file does not contain.
rng = np.random.default_rng(1234)
T = gguf.GGMLQuantizationType
scale_at = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
synthetic = []
for ty, offs in scale_at.items():
    per, size = gguf.GGML_QUANT_SIZES[ty]
    nblk = 2 if per == 256 else 8
    raw = bytearray(rng.integers(0, 256, size=nblk * size, dtype=np.uint8).tobytes())
    for b in range(nblk):
        for o in offs:
            v = np.float16(rng.uniform(-0.05, 0.05)).tobytes()
            raw[b * size + o: b * size + o + 2] = v
    vals = dequantize(np.frombuffer(bytes(raw), dtype=np.uint8), ty).astype(np.float32).reshape(-1)
    synthetic.append({"type_name": ty.name, "ggml_type": int(ty), "bytes_hex": bytes(raw).hex(),
                      "values": [float(x) for x in vals]})

out = {"source": os.path.basename(src), "generator": "scripts/gguf_reference.py (gguf-py)", "metadata": meta, "tensors": tensors, "synthetic_blocks": synthetic}
with open(dst, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
print(dst, os.path.getsize(dst), "bytes,", len(tensors), "tensors")
