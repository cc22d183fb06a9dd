"""A random-weight GGUF of a Llama or SmolLM3 description that llama.cpp and thin both read (issue 29 point 4).

    python3 bench/make_gguf.py tokenizer SRC.gguf OUT.json.gz
        every `tokenizer.*` key of a llama.cpp GGUF (tokens, merges, token types, pre, ids, chat
        template) into a small gzipped JSON, with each value's GGUF type;
    python3 bench/make_gguf.py model OUT.gguf --tokenizer TOK.json.gz [--arch archs/llama3.2-1b.toml]
            [--tiny] [--seed 0] [--jobs N]
        a BF16 GGUF of the description's shapes laid out as llama.cpp's convert_hf_to_gguf.py
        writes a Llama (or SmolLM3) model: `<arch>.*` hyperparameters, the tokenizer's keys with its token list
        padded to the description's vocab_size with `[PAD<i>]` tokens of type UNUSED (what the
        converter does for a padded vocabulary), tied embeddings (no output.weight), F32 norms, and
        for `rope_type = "llama3"` the `rope_freqs.weight` factors the converter computes (llama.cpp
        reads Llama 3 scaling from that tensor, not from metadata). `--tiny` keeps the family and
        tokenizer but shrinks the layers (hidden 64, 2 layers) for a quick check of both readers.

Weights: normal(0, 0.02) per matrix (an init's scale), norms 1; each tensor from its own seed
(seed, tensor index), written in parallel into the mapped file, so the bytes do not depend on
--jobs. Needs numpy and llama.cpp's gguf-py (PYTHONPATH=<llama.cpp>/gguf-py).
"""
import argparse, gzip, json, math, multiprocessing as mp, os, sys, time

import numpy as np

try:
    import tomllib
except ImportError:  # python < 3.11
    tomllib = None

import gguf

STD = 0.02


def extract_tokenizer(src, out):
    r = gguf.GGUFReader(src)
    keys = {}
    for name, f in r.fields.items():
        if not name.startswith("tokenizer."):
            continue
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            else:
                val = [f.parts[i].tolist()[0] for i in f.data]
            keys[name] = {"type": t.name, "sub_type": sub.name, "value": val}
        elif t == gguf.GGUFValueType.STRING:
            keys[name] = {"type": t.name, "value": bytes(f.parts[f.data[0]]).decode("utf-8")}
        else:
            keys[name] = {"type": t.name, "value": f.parts[f.data[0]].tolist()[0]}
    with gzip.open(out, "wt", encoding="utf-8") as fo:
        json.dump({"source": os.path.basename(src), "keys": keys}, fo)
    n = len(keys.get("tokenizer.ggml.tokens", {}).get("value", []))
    print(json.dumps({"tokenizer": out, "keys": len(keys), "tokens": n, "bytes": os.path.getsize(out)}))


def load_arch(path, tiny):
    with open(path, "rb") as f:
        d = tomllib.load(f) if tomllib else None
    if d is None:
        raise SystemExit("python >= 3.11 (tomllib) is needed to read the description")
    # SmolLM3 is a Llama layout to llama.cpp (its graph skips RoPE on every 4th layer by itself).
    if d["model"]["family"] not in ("llama", "smollm3"):
        raise SystemExit(f"{path}: family {d['model']['family']!r}; only llama and smollm3 are written")
    a = dict(name=d["model"]["name"], family=d["model"]["family"], vocab=d["dims"]["vocab_size"], hidden=d["dims"]["hidden_size"],
             layers=d["dims"]["num_layers"], ff=d["dims"]["intermediate_size"], ctx=d["dims"]["max_position_embeddings"],
             heads=d["attention"]["num_heads"], kv_heads=d["attention"]["num_kv_heads"], head_dim=d["attention"]["head_dim"],
             theta=d["rope"]["theta"], scaling=d["rope"].get("scaling"), eps=d["norm"]["eps"],
             tied=d["embedding"]["tie_word_embeddings"])
    if tiny:
        a.update(name=a["name"] + "-tiny", hidden=64, layers=2, ff=128, heads=4, kv_heads=2, head_dim=16)
    return a


def llama3_rope_factors(a):
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, in numpy float32 like its torch."""
    s = a["scaling"]
    dim, base = a["head_dim"], a["theta"]
    freqs = 1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factor, lo, hi, old = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    low_wl, high_wl = old / lo, old / hi
    out = []
    for freq in freqs:
        wl = 2 * math.pi / freq
        if wl < high_wl:
            out.append(1)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (old / wl - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def tensor_plan(a):
    """(name, numpy shape outermost first, kind) in the converter's order."""
    h, qd, kvd, ff = a["hidden"], a["heads"] * a["head_dim"], a["kv_heads"] * a["head_dim"], a["ff"]
    plan = []
    if a["scaling"] and a["scaling"].get("rope_type") == "llama3":
        plan.append(("rope_freqs.weight", (a["head_dim"] // 2,), "rope"))
    plan.append(("token_embd.weight", (a["vocab"], h), "w"))
    for l in range(a["layers"]):
        p = f"blk.{l}."
        plan += [(p + "attn_norm.weight", (h,), "norm"), (p + "ffn_down.weight", (h, ff), "w"),
                 (p + "ffn_gate.weight", (ff, h), "w"), (p + "ffn_up.weight", (ff, h), "w"),
                 (p + "ffn_norm.weight", (h,), "norm"), (p + "attn_k.weight", (kvd, h), "w"),
                 (p + "attn_output.weight", (h, qd), "w"), (p + "attn_q.weight", (qd, h), "w"),
                 (p + "attn_v.weight", (kvd, h), "w")]
    plan.append(("output_norm.weight", (h,), "norm"))
    if not a["tied"]:
        plan.append(("output.weight", (a["vocab"], h), "w"))
    return plan


def to_bf16(x):
    """float32 -> bf16 bits, round to nearest even (as gguf-py's quants.py does)."""
    u = x.view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


ROWS_PER_CHUNK = 4096


def fill(job):
    path, offset, shape, seed, index = job
    rng = np.random.default_rng([seed, index])
    rows, cols = shape
    mm = np.memmap(path, dtype=np.uint16, mode="r+", offset=offset, shape=shape)
    for r0 in range(0, rows, ROWS_PER_CHUNK):
        r1 = min(rows, r0 + ROWS_PER_CHUNK)
        x = rng.standard_normal((r1 - r0, cols), dtype=np.float32)
        x *= np.float32(STD)
        mm[r0:r1] = to_bf16(x)
    mm.flush()
    del mm
    return index


def write_model(out, tok_path, arch_path, tiny, seed, jobs):
    t0 = time.time()
    a = load_arch(arch_path, tiny)
    with gzip.open(tok_path, "rt", encoding="utf-8") as f:
        tok = json.load(f)["keys"]
    tokens = tok["tokenizer.ggml.tokens"]["value"]
    if len(tokens) > a["vocab"]:
        raise SystemExit(f"the tokenizer has {len(tokens)} tokens, more than vocab_size {a['vocab']}")
    pad = a["vocab"] - len(tokens)
    w = gguf.GGUFWriter(out, a["family"])
    w.add_type("model")
    w.add_name(f"{a['name']} random (seed {seed}, normal std {STD})")
    w.add_block_count(a["layers"])
    w.add_context_length(a["ctx"])
    w.add_embedding_length(a["hidden"])
    w.add_feed_forward_length(a["ff"])
    w.add_head_count(a["heads"])
    w.add_head_count_kv(a["kv_heads"])
    w.add_rope_freq_base(float(a["theta"]))
    w.add_layer_norm_rms_eps(float(a["eps"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_vocab_size(a["vocab"])
    w.add_rope_dimension_count(a["head_dim"])
    if a["head_dim"] != a["hidden"] // a["heads"]:
        w.add_key_length(a["head_dim"])
        w.add_value_length(a["head_dim"])
    for key, v in tok.items():
        val = v["value"]
        if key == "tokenizer.ggml.tokens":
            val = val + [f"[PAD{i}]" for i in range(len(tokens), a["vocab"])]
        elif key == "tokenizer.ggml.token_type":
            val = val + [int(gguf.TokenType.UNUSED)] * pad
        elif key == "tokenizer.ggml.scores":
            val = val + [-10000.0] * pad
        t = gguf.GGUFValueType[v["type"]]
        w.add_key_value(key, val, t, sub_type=gguf.GGUFValueType[v["sub_type"]] if "sub_type" in v else None)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    plan = tensor_plan(a)
    for name, shape, kind in plan:
        if kind == "w":
            w.add_tensor_info(name, shape, np.dtype(np.uint16), int(np.prod(shape)) * 2, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    align = w.data_alignment
    data_start = GGUF_pad(fout.tell(), align)
    # The small F32 tensors are written in order through the writer's own file; the matrices'
    # regions are left for the workers (the file is extended to its full size first).
    offsets, pos = [], data_start
    for name, shape, kind in plan:
        offsets.append(pos)
        pos = GGUF_pad(pos + int(np.prod(shape)) * (2 if kind == "w" else 4), align)
    total = pos
    fout.flush()
    factors = llama3_rope_factors(a) if plan[0][2] == "rope" else None
    for (name, shape, kind), off in zip(plan, offsets):
        if kind == "w":
            continue
        fout.seek(off)
        (factors if kind == "rope" else np.ones(shape, dtype=np.float32)).tofile(fout)
    fout.truncate(total)
    fout.close()
    w.fout = None
    mats = [(out, off, shape, seed, i) for i, ((name, shape, kind), off) in enumerate(zip(plan, offsets)) if kind == "w"]
    # Largest first, so the embedding does not start last.
    mats.sort(key=lambda j: -j[2][0] * j[2][1])
    with mp.Pool(jobs) as pool:
        for _ in pool.imap_unordered(fill, mats):
            pass
    params = sum(int(np.prod(s)) for _, s, _ in plan)
    print(json.dumps({"made": out, "arch": a["name"], "params": params, "bytes": os.path.getsize(out), "vocab": a["vocab"],
                      "tokenizer_tokens": len(tokens), "padded": pad, "rope_freqs": factors is not None,
                      "seconds": round(time.time() - t0, 1), "jobs": jobs}), flush=True)


def GGUF_pad(x, n):
    return ((x + n - 1) // n) * n


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer")
    t.add_argument("src")
    t.add_argument("out")
    m = sub.add_parser("model")
    m.add_argument("out")
    m.add_argument("--tokenizer", required=True)
    m.add_argument("--arch", default=os.path.join(os.path.dirname(__file__), "..", "archs", "llama3.2-1b.toml"))
    m.add_argument("--tiny", action="store_true")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--jobs", type=int, default=os.cpu_count())
    args = p.parse_args()
    if args.cmd == "tokenizer":
        extract_tokenizer(args.src, args.out)
    else:
        write_model(args.out, args.tokenizer, args.arch, args.tiny, args.seed, args.jobs)


if __name__ == "__main__":
    main()
