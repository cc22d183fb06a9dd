"""Turn one device run's outputs (bench/h200.sh's $OUT) into rows of bench/results/h200.jsonl.

    python3 bench/collect.py OUT_DIR COMMIT [RESULTS_FILE]
One row per (model, engine): run_id, commit, date, gpu, model, profile, engine, decode_tok_s,
prefill_tok_s (pp512), peak_gib, min_cosine, top1_match, top5_set (fidelity: the worst of the
prompt lengths measured; HF rows are the reference and carry none).

    AB_CONFIG=name python3 bench/collect.py OUT_DIR COMMIT
also takes bench/ab.sh's rows of that config from OUT_DIR/ab.jsonl, one row per round, with
"config" and "method" added: decode only (ab.sh runs --pp 16 --tg 16, so prefill_tok_s is None).
bench/profiles.sh's rows (OUT_DIR/profiles.jsonl) are taken as they are, one per round, with the
bytes per token, copy rate and roofline beside the speed.
bench/llama_gpu.sh's rows (OUT_DIR/llama_gpu.jsonl: thin profiles and llama.cpp types, engine
"thin" or "llama.cpp", "profile" or "quant", weight_bytes_per_token, tg/pp tok/s) likewise, with
prefill_tok_s set from pp_tok_s; their own commit and gpu fields are kept (bench/stream.sh's
OUT_DIR/stream_llama.jsonl too: llama-bench at an -ngl for each --gpu-mem, with device_mib):
    python3 bench/collect.py OUT_DIR COMMIT bench/results/llama_gpu.jsonl
bench/stream.sh's thin rows (OUT_DIR/stream.jsonl: residency, gpu_mem_limit, link_gbps,
link_bound_fraction, ... as `thin bench --json` wrote them) and its HF offload rows
(OUT_DIR/stream_hf.jsonl, engine "hf-offload") are taken too, with gpu_mem_limit in bytes on every
row (the llama.cpp rows' "gpu_mem" read as well), so one call's streaming comparison is
    python3 bench/collect.py OUT_DIR COMMIT bench/results/stream.jsonl
"""
import datetime, json, os, sys

from llama_gpu import size_bytes  # bench/ is the script's directory, first on sys.path


def lines(path):
    if not os.path.exists(path):
        return []
    return [json.loads(l) for l in open(path) if l.strip().startswith("{")]


def main(out, commit, results="bench/results/h200.jsonl"):
    gpu = open(os.path.join(out, "gpu.txt")).read().split(",")[0].strip() if os.path.exists(os.path.join(out, "gpu.txt")) else "?"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    run_id = f"{date}-{commit[:8]}"
    fid = {}
    for r in lines(os.path.join(out, "fidelity.jsonl")):
        # Only the rows against HF bf16: not the GPU-vs-CPU-oracle checks, not the fp32 references.
        if "check" not in r and "reference" not in r:
            fid.setdefault(r["model"], []).append(r)
    rows = []
    for r in lines(os.path.join(out, "thin.jsonl")):
        if "error" in r:
            continue
        f = fid.get(r["model"], [])
        rows.append(dict(run_id=run_id, commit=commit, date=date, gpu=gpu, model=r["model"], profile=r["profile"], engine="thin",
                         decode_tok_s=r["decode_tok_s"], prefill_tok_s=r["prefill_tok_s"], peak_gib=r["peak_gib"],
                         min_cosine=min((x["min_cosine"] for x in f), default=None),
                         top1_match=min((x["top1_match"] for x in f), default=None),
                         top5_set=min((x["top5_set"] for x in f), default=None),
                         tg128=r["tg"]["mean"], tg128_sd=r["tg"]["sd"], pp512_sd=r["pp"]["sd"],
                         cold_start_s=r.get("cold_start_to_first_token_s")))
    ab = os.environ.get("AB_CONFIG")
    for r in lines(os.path.join(out, "ab.jsonl")) if ab else []:
        if r.get("config") != ab:
            continue
        rows.append(dict(run_id=run_id, commit=commit, date=date, gpu=gpu, model=r["model"], profile=r["profile"], engine="thin",
                         decode_tok_s=r["decode_tok_s"], prefill_tok_s=None, peak_gib=r["peak_gib"],
                         min_cosine=None, top1_match=None, top5_set=None,
                         config=ab, method="bench/ab.sh: thin bench --reps 1 --pp 16 --tg 16 (reference decode method)"))
    # bench/profiles.sh: every profile of a model, with its bytes per token and roofline.
    for r in lines(os.path.join(out, "profiles.jsonl")):
        rows.append(dict(run_id=run_id, commit=commit, date=date, gpu=gpu, model=r["model"], profile=r["profile"], engine="thin",
                         decode_tok_s=r["decode_tok_s"], prefill_tok_s=r["prefill_tok_s"], peak_gib=r["peak_gib"],
                         weight_bytes_per_token=r["weight_bytes_per_token"], copy_gb_s=r["copy_gb_s"],
                         roofline_tok_s=r["roofline_tok_s"], roofline_pct=r["roofline_pct"],
                         method="bench/profiles.sh: thin bench --reps 1 --pp 128 --tg 16 (reference decode method)"))
    # bench/llama_gpu.sh: thin against llama.cpp, each row already complete.
    # bench/stream.sh's llama.cpp rows (-ngl for each --gpu-mem) likewise.
    for r in lines(os.path.join(out, "llama_gpu.jsonl")) + lines(os.path.join(out, "stream_llama.jsonl")):
        row = dict(run_id=run_id, commit=commit, date=date, gpu=gpu)
        row.update({k: v for k, v in r.items() if not (k in ("commit", "gpu") and v in (None, "", "unknown"))})
        row.setdefault("prefill_tok_s", r.get("pp_tok_s"))
        if "gpu_mem" in r:
            row["gpu_mem_limit"] = size_bytes(r["gpu_mem"])
        rows.append(row)
    # bench/stream.sh: thin at each residency and --gpu-mem, and HF's device_map="auto" beside it.
    for r in lines(os.path.join(out, "stream.jsonl")):
        row = dict(run_id=run_id, commit=commit, date=date, gpu=gpu, method="bench/stream.sh: thin bench --residency all|stream --gpu-mem ...")
        row.update(r)
        rows.append(row)
    for r in lines(os.path.join(out, "stream_hf.jsonl")):
        if r.get("mode") != "offload":
            continue
        rows.append(dict(run_id=run_id, commit=commit, date=date, gpu=gpu, model=r["model"], profile="bf16", engine="hf-offload",
                         residency="offload", gpu_mem_limit=size_bytes(r["gpu_mem_limit"]), decode_tok_s=r.get("tok_s"),
                         peak_gib=r.get("peak_gib"), device_map_modules=r.get("device_map_modules"), error=r.get("error"),
                         method='bench/hf_peer.py offload: from_pretrained(device_map="auto", max_memory={0: GPU_MEM, "cpu": "100GiB"}), eager decode, 16 timed steps'))
    for mode in ("compiled", "eager"):
        for r in lines(os.path.join(out, f"peer_{mode}.jsonl")):
            if "model" not in r or "tok_s" not in r:
                continue
            rows.append(dict(run_id=run_id, commit=commit, date=date, gpu=gpu, model=r["model"], profile="bf16", engine=f"hf-{mode}",
                             decode_tok_s=r["tok_s"], prefill_tok_s=None, peak_gib=r["peak_gib"],
                             min_cosine=None, top1_match=None, top5_set=None))
    os.makedirs(os.path.dirname(results), exist_ok=True)
    with open(results, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main(*sys.argv[1:])
