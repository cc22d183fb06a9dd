"""Two `thin logits` outputs (little-endian f32 rows of VOCAB logits) compared row by row: the
minimum and mean cosine and the share of rows whose argmax agrees, as one JSON line with the given
key=value fields first (an "error" field instead when a file is missing or the sizes differ).

    python3 bench/compare_logits.py A.f32 B.f32 VOCAB [key=value ...]
"""
import json, os, sys

import numpy as np


def main(a_path, b_path, vocab, *fields):
    r = {}
    for f in fields:
        k, v = f.split("=", 1)
        r[k] = int(v) if v.lstrip("-").isdigit() else v
    v = int(vocab)
    a, b = (np.fromfile(p, dtype=np.float32) if os.path.exists(p) else None for p in (a_path, b_path))
    if a is None or b is None or a.size != b.size or a.size == 0 or a.size % v:
        r["error"] = "missing or different sizes"
    else:
        a, b = a.reshape(-1, v).astype(np.float64), b.reshape(-1, v).astype(np.float64)
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        r.update(rows=int(a.shape[0]), min_cosine=float(cos.min()), mean_cosine=float(cos.mean()), top1=float((a.argmax(1) == b.argmax(1)).mean()))
    print(json.dumps(r))


if __name__ == "__main__":
    main(*sys.argv[1:])
