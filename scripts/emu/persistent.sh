#!/usr/bin/env bash
# CPU emulation (scripts/emu/emu.h) of the persistent decode step against the kernel-per-op step:
# one whole step of an arch's rendered bf16 kernels on random weights, both ways, compared
# exactly (see persistent_check.cpp), in grids of 1 and of 3 blocks; with 3, each block is a
# process of its own running at the same time as the others (device buffers in one shared
# mapping), so the grid barrier and the phases' hand-offs between blocks are exercised for real
# on the CPU's memory model. Not the GPU's: its memory ordering is checked only on a GPU. ~11 min
# for SmolLM2 on 2 cores.
#   bash scripts/emu/persistent.sh [arch_dir ...]   (default smollm2_135m)
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
for a in ${@:-smollm2_135m}; do
  grep -q decode_persistent "generated/$a/kernels/decode_bf16.cu" || { echo "$a: no persistent step rendered"; continue; }
  { echo '#include "emu.h"'; cat "generated/$a/kernels/decode_bf16.cu"; echo; cat scripts/emu/persistent_check.cpp; } > "$tmp/$a.cpp"
  g++ -std=c++20 -O2 -pthread -w -I scripts/emu "$tmp/$a.cpp" -o "$tmp/$a"
  echo -n "$a: "; "$tmp/$a"
done
