#!/usr/bin/env python3
"""What the page check at load costs (issue 24 point 4): the wall time of `thin run ... --max-tokens 1`
(open, page check, engine load, prefill, first token) with and without `--no-verify`, the two
interleaved, on each archive given; appends one JSON line per archive and mode to OUT.

    cargo build --release --features smollm2-135m
    python3 bench/verify_cost.py OUT.jsonl RUNS ARCHIVE.thin [ARCHIVE.thin ...]

The hashing runs on rayon's threads: RAYON_NUM_THREADS defaults to 2 here (the development
machine's cores). On the device machine pass its threads, as a user's run has them:
RAYON_NUM_THREADS=$(nproc) THIN_BIN=.bin/thin BACKEND=cuda COMMIT=<hash> MACHINE="H100" (the tree
there has no .git and the binary is carried).
"""
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIN = os.environ.get("THIN_BIN", os.path.join(REPO, "target", "release", "thin"))
BACKEND = os.environ.get("BACKEND", "cpu")


def main():
    out, runs, archives = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    commit = os.environ.get("COMMIT") or subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = os.environ.get("MACHINE", "dev: AMD EPYC (Zen 4), 2 cores, shared")
    env = dict(os.environ, RAYON_NUM_THREADS=os.environ.get("RAYON_NUM_THREADS", "2"))
    rows = []
    for path in archives:
        name = os.path.basename(path)
        base = [THIN, "run", path, "--backend", BACKEND, "--prompt", "The sea is", "--max-tokens", "1", "--format", "jsonl"]
        subprocess.run(base, capture_output=True, env=env)  # the page cache warm for both modes
        load_before = open("/proc/loadavg").read().split()[:3]
        times = {"verify": [], "no-verify": []}
        for i in range(runs):
            for mode in (["verify", "no-verify"] if i % 2 == 0 else ["no-verify", "verify"]):
                args = base + (["--no-verify"] if mode == "no-verify" else [])
                start = time.perf_counter()
                o = subprocess.run(args, capture_output=True, env=env)
                times[mode].append(time.perf_counter() - start)
                if o.returncode != 0:
                    sys.exit(f"{args}: {o.stderr.decode()}")
        load_after = open("/proc/loadavg").read().split()[:3]
        for mode, v in times.items():
            rows.append({
                "date": datetime.date.today().isoformat(), "commit": commit, "machine": machine,
                "archive": name, "bytes": os.path.getsize(path), "mode": mode, "runs": runs,
                "command": f"RAYON_NUM_THREADS={env['RAYON_NUM_THREADS']} thin run {name} --backend {BACKEND} --prompt 'The sea is' --max-tokens 1 --format jsonl"
                + (" --no-verify" if mode == "no-verify" else ""),
                "wall_s_median": round(statistics.median(v), 4), "wall_s_min": round(min(v), 4), "wall_s_max": round(max(v), 4),
                "loadavg_before": load_before, "loadavg_after": load_after,
            })
        m = {r["mode"]: r["wall_s_median"] for r in rows if r["archive"] == name}
        print(f"{name}: median {m['no-verify']:.3f} s without the check, {m['verify']:.3f} s with it "
              f"(+{(m['verify'] - m['no-verify']) * 1e3:.0f} ms); load average {load_before[0]} -> {load_after[0]}", flush=True)
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
