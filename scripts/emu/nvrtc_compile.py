#!/usr/bin/env python3
"""Compile rendered kernel sources with NVRTC as the runtime does (thin-core/src/cuda/runtime.rs:
`--gpu-architecture=<target> --std=c++17 --fmad=true`, one `#define THIN_WEIGHTS_<type> 1` in
front), without a GPU: NVRTC needs no device. One compile per arch and weight type; prints the
log of any that fails (and warnings) and exits 1 if one did.

    pip install nvidia-cuda-nvrtc-cu12     # libnvrtc without a toolkit
    python3 scripts/emu/nvrtc_compile.py [--target sm_90] [arch_dir ...]   (default: every arch with kernels)
NVRTC_LIB=path/to/libnvrtc.so.12 overrides where the library is looked for.
"""
import ctypes, glob, os, sys

TYPES = ["bf16", "f32", "f8_e4m3", "mxfp4", "q8_0", "q4_1"]


def find_lib():
    if os.environ.get("NVRTC_LIB"):
        return os.environ["NVRTC_LIB"]
    for base in sys.path:
        hits = sorted(glob.glob(os.path.join(base, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
        hits = [h for h in hits if "alt" not in h and "builtins" not in h]
        if hits:
            return hits[0]
    return "libnvrtc.so"


def compile_one(lib, src, name, target):
    prog = ctypes.c_void_p()
    r = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None)
    if r != 0:
        return False, f"nvrtcCreateProgram: {r}"
    opts = [f"--gpu-architecture={target}", "--std=c++17", "--fmad=true"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    r = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return r == 0, log.value.decode(errors="replace").strip()


def main():
    args = sys.argv[1:]
    target = "sm_90"
    if args[:1] == ["--target"]:
        target, args = args[1], args[2:]
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    archs = args or sorted(os.path.basename(os.path.dirname(os.path.dirname(p))) for p in glob.glob(os.path.join(root, "generated", "*", "kernels", "decode.cu")))
    lib = ctypes.CDLL(find_lib())
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    print(f"NVRTC {major.value}.{minor.value}, {target}")
    failed = 0
    for a in archs:
        text = open(os.path.join(root, "generated", a, "kernels", "decode.cu")).read()
        for t in TYPES:
            ok, log = compile_one(lib, f"#define THIN_WEIGHTS_{t} 1\n{text}", f"{a}.cu", target)
            status = "ok" if ok else "FAILED"
            print(f"{a} {t}: {status}")
            if log:
                print("  " + log.replace("\n", "\n  "))
            failed += not ok
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
