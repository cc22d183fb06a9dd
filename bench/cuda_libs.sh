# Sourced by the device scripts: puts the CUDA driver-side libraries the `thin` binary loads at run
# time (cudarc: libcuda, NVRTC, cuBLAS) on LD_LIBRARY_PATH - the toolkit's, then the ones pip's
# nvidia packages bring (cuda_nvrtc, cu13) - and exports it.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c "import nvidia, os; print(' '.join(os.path.join(p, s, 'lib') for p in nvidia.__path__ for s in ('cuda_nvrtc', 'cu13')))" 2>/dev/null); do
  [ -d "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH
