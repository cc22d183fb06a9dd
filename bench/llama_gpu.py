"""Rows and the table of bench/llama_gpu.sh (thin against llama.cpp on the GPU, issue 29 point 4).

    python3 bench/llama_gpu.py bpt FILE.gguf
        weight bytes one decode step reads, by thin's rule (Manifest::weight_bytes_per_token):
        every tensor whole, except the token embedding (one row, plus the whole table again when
        tied - no output.weight - as the LM head) and llama.cpp's rope_freqs (not a weight).
        Needs gguf-py on PYTHONPATH.
    python3 bench/llama_gpu.py thin JSON_FILE KEY=VALUE...    one row from `thin bench --json`
    python3 bench/llama_gpu.py llama JSONL_FILE KEY=VALUE...  one row from `llama-bench -o jsonl`
    python3 bench/llama_gpu.py table ROWS.jsonl               thin profiles against llama.cpp types
    python3 bench/llama_gpu.py ngl FILE.gguf 2GiB              llama-bench -ngl for a device-memory budget
KEY=VALUE pairs are added to the row (numbers parsed); rows go to stdout.
"""
import json, sys


def kv(args):
    out = {}
    for a in args:
        k, v = a.split("=", 1)
        try:
            v = int(v)
        except ValueError:
            try:
                v = float(v)
            except ValueError:
                pass
        out[k] = v
    return out


def read_gguf(path):
    """(scalar metadata, [(name, dims innermost first, bytes)]) from a GGUF's header, skipping the
    arrays (gguf-py's reader parses every token string: seconds on a 128k vocabulary)."""
    import mmap, struct
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    f = open(path, "rb")
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, m, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def string():
        nonlocal pos
        n = take("Q")
        pos += n
        return bytes(m[pos - n:pos]).decode("utf-8", "replace")

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(t):
        nonlocal pos
        if t == 8:
            return string()
        if t == 9:
            st, n = take("I"), take("Q")
            if st in scalar:
                pos += n * struct.calcsize(scalar[st])
            else:
                for _ in range(n):
                    value(st)
            return None
        return take(scalar[t])

    assert m[:4] == b"GGUF", path
    pos = 4
    _, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    meta = {}
    for _ in range(n_kv):
        k = string()
        meta[k] = value(take("I"))
    tensors = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        ty, _ = take("I"), take("Q")
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ty)]
        n = 1
        for d in dims:
            n *= d
        tensors.append((name, dims, n // block * size))
    return meta, tensors


def bpt(path):
    _, tensors = read_gguf(path)
    tied = not any(name == "output.weight" for name, _, _ in tensors)
    total, size = 0, 0
    for name, dims, n in tensors:
        size += n
        if name == "rope_freqs.weight":
            continue
        if name == "token_embd.weight":
            rows = dims[-1]  # GGUF lists dims innermost first
            total += (n + n // rows) if tied else n // rows
        else:
            total += n
    print(json.dumps({"weight_bytes_per_token": total, "tensor_bytes": size, "tied": tied}))


def size_bytes(text):
    """'2GiB' -> 2147483648, '512MB' -> 512000000; None for anything else ('all', None)."""
    units = {"gib": 2**30, "mib": 2**20, "gb": 10**9, "mb": 10**6}
    t = str(text or "").lower()
    return next((int(float(t[: -len(u)]) * f) for u, f in units.items() if t.endswith(u)), None)


def ngl(path, budget):
    """The most layers llama.cpp can offload within `budget` (e.g. 2GiB) of device memory: the
    layers' weights and their f16 KV cache for 4096 positions, less a fixed 0.5 GiB for its compute
    buffers and cuBLAS workspace (the row records what the run really took, read by nvidia-smi)."""
    limit = size_bytes(budget) or float(budget)
    meta, tensors = read_gguf(path)
    arch = meta["general.architecture"]
    n_layer, heads = meta[f"{arch}.block_count"], meta[f"{arch}.attention.head_count"]
    kv = meta.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta.get(f"{arch}.attention.key_length") or meta[f"{arch}.embedding_length"] // heads
    layer = [0] * n_layer
    for name, _, n in tensors:
        if name.startswith("blk."):
            layer[int(name.split(".")[1])] += n
    kv_bytes = 4096 * kv * head_dim * 2 * 2
    per = max(layer) + kv_bytes
    n = int(max(0, limit - 0.5 * 2**30) // per)
    if n > n_layer:  # all layers fit: the output layer (-ngl n_layer + 1) too, if its bytes do
        names = {name: n for name, _, n in tensors}
        out = names.get("output.weight", names.get("token_embd.weight", 0))
        n = n_layer + 1 if limit - 0.5 * 2**30 - n_layer * per >= out else n_layer
    print(json.dumps({"n_gpu_layers": n, "n_layer": n_layer, "layer_bytes": max(layer), "kv_bytes_per_layer": kv_bytes, "budget_bytes": int(limit)}))


def thin_row(path, extra):
    j = json.load(open(path))
    row = dict(engine="thin", model=j["model"], profile=j["profile"],
               weight_bytes_per_token=j["weight_bytes_per_token"],
               decode_tok_s=j["decode_tok_s"], decode_method=j["decode_method"],
               tg=j["tg"]["n"], tg_tok_s=round(j["tg"]["mean"], 2), tg_sd=round(j["tg"]["sd"], 2),
               pp=j["pp"]["n"], pp_tok_s=round(j["pp"]["mean"], 2), pp_sd=round(j["pp"]["sd"], 2),
               peak_gib=j.get("peak_gib"), copy_gb_s=j.get("copy_gb_s"), roofline_pct=j.get("roofline_pct"),
               cold_start_s=j.get("cold_start_to_first_token_s"))
    row.update(extra)
    print(json.dumps(row))


def llama_row(path, extra):
    row = dict(engine="llama.cpp")
    for l in open(path):
        if not l.strip().startswith("{"):
            continue
        r = json.loads(l)
        row.update(type=r.get("model_type"), model_size=r.get("model_size"), n_params=r.get("model_n_params"),
                   n_gpu_layers=r.get("n_gpu_layers"), flash_attn=r.get("flash_attn"), gpu_info=r.get("gpu_info"),
                   backends=r.get("backends"), build_commit=r.get("build_commit"))
        test = "pp" if r["n_prompt"] > 0 else "tg"
        row[test] = r["n_prompt"] or r["n_gen"]
        row[test + "_tok_s"] = round(r["avg_ts"], 2)
        row[test + "_sd"] = round(r["stddev_ts"], 2)
    if "tg_tok_s" not in row and "pp_tok_s" not in row:
        return
    row["decode_tok_s"] = row.get("tg_tok_s")
    row.update(extra)
    print(json.dumps(row))


def table(path):
    rows = [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    by = {}
    for r in rows:
        if r.get("tg_tok_s") is None:
            continue
        name = r["profile"] if r["engine"] == "thin" else r["quant"]
        if name == "native" and r.get("source_quant"):
            name += ":" + r["source_quant"]  # the GGUF type whose blocks it keeps
        key = (r["model"], r.get("gpu_mem") or "all", r["engine"], name)
        by.setdefault(key, []).append(r)
    avg = lambda rs, k: sum(x[k] for x in rs) / len(rs)
    for model in sorted({k[0] for k in by}):
        for mem in sorted({k[1] for k in by if k[0] == model}):
            thin = {k[3]: v for k, v in by.items() if k[0] == model and k[1] == mem and k[2] == "thin"}
            llama = {k[3]: v for k, v in by.items() if k[0] == model and k[1] == mem and k[2] == "llama.cpp"}
            print(f"\n{model}{'' if mem == 'all' else ', --gpu-mem ' + mem}: tg tok/s (mean of rounds), "
                  "thin profile against the llama.cpp type of equal or fewer bytes a token")
            print("%-14s %9s %9s %8s | %-8s %9s %9s | %6s %s" % ("thin", "MB/token", "tg tok/s", "ref dec", "llama", "MB/token", "tg tok/s", "ratio", ""))
            for p, rs in sorted(thin.items(), key=lambda kv: -kv[1][0]["weight_bytes_per_token"]):
                b = rs[0]["weight_bytes_per_token"]
                cands = [(v[0]["weight_bytes_per_token"], q) for q, v in llama.items() if v[0]["weight_bytes_per_token"] <= b * 1.02]
                note = ""
                if not cands and llama:
                    cands = [min((v[0]["weight_bytes_per_token"], q) for q, v in llama.items())]
                    note = "(every llama.cpp type reads more)"
                t = avg(rs, "tg_tok_s")
                line = "%-14s %9.1f %9.1f %8.1f" % (p, b / 1e6, t, avg(rs, "decode_tok_s"))
                if cands:
                    lb, q = max(cands)
                    lt = avg(llama[q], "tg_tok_s")
                    ok = "faster" if t > lt else "SLOWER"
                    line += " | %-8s %9.1f %9.1f | %6.2f %s %s" % (q, lb / 1e6, lt, t / lt, ok, note)
                print(line)
            for q, rs in sorted(llama.items(), key=lambda kv: -kv[1][0]["weight_bytes_per_token"]):
                print("%-14s %9s %9s %8s | %-8s %9.1f %9.1f | pp %s tok/s" % ("", "", "", "", q, rs[0]["weight_bytes_per_token"] / 1e6,
                      avg(rs, "tg_tok_s"), "%.0f" % avg(rs, "pp_tok_s") if all(x.get("pp_tok_s") for x in rs) else "-"))


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "bpt":
        bpt(args[0])
    elif cmd == "thin":
        thin_row(args[0], kv(args[1:]))
    elif cmd == "llama":
        llama_row(args[0], kv(args[1:]))
    elif cmd == "ngl":
        ngl(args[0], args[1])
    elif cmd == "table":
        table(args[0])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
