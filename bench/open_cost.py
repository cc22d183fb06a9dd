#!/usr/bin/env python3
"""Wall time of opening an archive, two builds side by side (bench/README.md, "Opening a Gemma
archive"): `thin inspect` and `thin run --backend cpu --max-tokens 1`, each build on its own
archive (the format may differ between them), the two interleaved; appends one JSON line per
command and build to OUT, with the archive's manifest size (from `thin inspect --json`).

    python3 bench/open_cost.py RUNS OUT.jsonl BEFORE_COMMIT BEFORE_BIN BEFORE_ARCHIVE AFTER_COMMIT AFTER_BIN AFTER_ARCHIVE
"""
import json
import os
import statistics
import subprocess
import sys
import time


def main():
    runs, out = int(sys.argv[1]), sys.argv[2]
    cases = [("before", *sys.argv[3:6]), ("after", *sys.argv[6:9])]  # (label, commit, binary, archive)
    cmds = {
        "inspect": lambda b, a: [b, "inspect", a],
        "run": lambda b, a: [b, "run", a, "--backend", "cpu", "--prompt", "Paris is", "--max-tokens", "1"],
    }
    manifest = {a: json.loads(subprocess.run([b, "inspect", a, "--json"], check=True, capture_output=True).stdout)["header"]["manifest_len"] for _, _, b, a in cases}
    rows = []
    for mk in cmds.values():
        times = {label: [] for label, *_ in cases}
        la0 = os.getloadavg()
        for _ in range(runs):
            for label, _, b, a in cases:
                t = time.perf_counter()
                subprocess.run(mk(b, a), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                times[label].append(time.perf_counter() - t)
        la1 = os.getloadavg()
        for label, commit, b, a in cases:
            ts = times[label]
            row = {
                "date": time.strftime("%Y-%m-%d"), "commit": commit, "machine": "dev: 2 cores, shared", "case": label,
                "archive": a, "manifest_bytes": manifest[a], "command": " ".join(mk("thin", os.path.basename(a))),
                "runs": runs, "wall_s_median": round(statistics.median(ts), 3), "wall_s_min": round(min(ts), 3), "wall_s_max": round(max(ts), 3),
                "loadavg_before": [round(x, 2) for x in la0], "loadavg_after": [round(x, 2) for x in la1],
            }
            rows.append(row)
            print(json.dumps(row))
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
