"""Interleaved wall times of `thin inspect` and `thin run --max-tokens 1` (bench/README.md, "Opening a Gemma archive").

Usage: python3 bench/open_cost.py RUNS OUT.jsonl BEFORE_COMMIT AFTER_COMMIT; the before binary at /tmp/thin-before opens /tmp/g.thin (its own
commit's conversion), the after binary /tmp/g2.thin.
"""
import json, os, subprocess, sys, time, statistics
runs = int(sys.argv[1]); out = sys.argv[2]; commits = {"before": sys.argv[3], "after": sys.argv[4]}
cases = [  # (label, binary, archive)
    ("before", "/tmp/thin-before", "/tmp/g.thin"),
    ("after", "/work/tokfast-target/release/thin", "/tmp/g2.thin"),
]
cmds = {
    "inspect": lambda b, a: [b, "inspect", a],
    "run": lambda b, a: [b, "run", a, "--backend", "cpu", "--prompt", "Paris is", "--max-tokens", "1"],
}
rows = []
for what, mk in cmds.items():
    times = {l: [] for l, _, _ in cases}
    la0 = os.getloadavg()
    for _ in range(runs):
        for label, b, a in cases:
            t = time.perf_counter()
            subprocess.run(mk(b, a), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times[label].append(time.perf_counter() - t)
    la1 = os.getloadavg()
    for label, b, a in cases:
        ts = times[label]
        row = {"date": time.strftime("%Y-%m-%d"), "commit": commits[label], "machine": "dev: 2 cores, shared",
               "case": label, "archive": a, "manifest_bytes": {"/tmp/g.thin": 17178112, "/tmp/g2.thin": 6228004}[a], "command": " ".join(mk("thin", os.path.basename(a))),
               "runs": runs, "wall_s_median": round(statistics.median(ts), 3), "wall_s_min": round(min(ts), 3), "wall_s_max": round(max(ts), 3),
               "loadavg_before": [round(x, 2) for x in la0], "loadavg_after": [round(x, 2) for x in la1]}
        rows.append(row)
        print(json.dumps(row))
with open(out, "a") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
