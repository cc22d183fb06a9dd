#!/usr/bin/env bash
# The decode matvec kernels alone, per weight type, at one arch's shapes (device machine: needs
# nvcc): bench/matvec.cu built against a rendered decode.cu (default Llama-3.2-1B's), weight GB/s
# beside the copy rate. With BASE=<another decode.cu> (made here, e.g. `git show
# 4449c3b^:generated/llama3_2_1b/kernels/decode.cu > .bin/base.cu`), both builds run in turn, two
# rounds, and each kernel's outputs are compared between them. JSON lines into $OUT/matvec.jsonl.
#   bash bench/matvec.sh [decode.cu]        BASE=.bin/base.cu bash bench/matvec.sh
set -euo pipefail
OUT=${OUT:-/tmp/thin-out}; mkdir -p "$OUT"
K=$(realpath "${1:-generated/llama3_2_1b/kernels/decode.cu}")
W=$(mktemp -d)
nvcc -O3 -arch=sm_90 -std=c++17 -w -DKSRC="\"$K\"" bench/matvec.cu -o "$W/new"
builds=new
if [ -n "${BASE:-}" ]; then
  nvcc -O3 -arch=sm_90 -std=c++17 -w -DKSRC="\"$(realpath "$BASE")\"" bench/matvec.cu -o "$W/base"
  builds="base new"
fi
for round in 1 2; do
  for b in $builds; do "$W/$b" "$b" "$W" >> "$OUT/matvec.jsonl"; done
done
python3 - "$OUT/matvec.jsonl" "$W" "$builds" <<'PY'
import json, sys, os, numpy as np
rows = [json.loads(l) for l in open(sys.argv[1])]
print('%-5s %-14s %-8s %9s %9s' % ('build', 'kernel', 'type', 'us', 'GB/s'))
for r in rows:
    if 'kernel' in r:
        print('%-5s %-14s %-8s %9.2f %9d' % (r['tag'], r['kernel'], r['type'], r['us'], r['weight_gb_s']))
    else:
        print(r)
if sys.argv[3] == 'base new':
    d = sys.argv[2]
    for f in sorted(os.listdir(d)):
        if f.startswith('new_') and f.endswith('.f32'):
            a, b = np.fromfile(os.path.join(d, f), np.float32), np.fromfile(os.path.join(d, 'base_' + f[4:]), np.float32)
            print(f[4:-4], 'max |new - base| / max |base| = %.3g' % (np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
PY
