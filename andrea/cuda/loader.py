"""The one loader of ANDREA's CUDA kernels: read a ``.cu`` file shipped as package data, compile it
at run time with CuPy (``cupy.RawModule``, NVRTC), cache the module, hand out kernels by name.

    from andrea.cuda.loader import kernel
    k = kernel("layernorm.cu", "k_layernorm_fwd_bf16")
    k((grid,), (block,), (x, w, b, y, mean, rstd, np.int32(N), np.int32(C), np.float32(eps)))

Every module is ``common.cuh`` followed by the ``.cu`` file; each part starts with a
``#line 1 "<file>"`` directive so a compiler error names the real file and line. A failed
compile raises AndreaError with NVRTC's log. CuPy keeps compiled binaries in its own disk
cache (``~/.cupy/kernel_cache``), keyed by the source text, so a second run skips NVRTC.

Without a GPU, ``python -m andrea.cuda.loader [--arch sm_90]`` compiles every kernel file the same
way (NVRTC through ``cuda-bindings``: ``pip install cuda-bindings nvidia-cuda-nvrtc``, no driver
needed) and prints NVRTC's log of each that fails: a compile error costs no device time. With
``--resources`` (and ``pip install nvidia-cuda-cuobjdump``) it also prints each kernel's registers and
stack (spill) bytes, the figures that set how many blocks an SM holds; ``--define NAME[=VALUE]`` compiles a
kernel experiment kept behind an #ifdef (bench/attention_variants.py times it on the device).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
from importlib import resources
from pathlib import Path

from andrea.errors import AndreaError

COMMON = "common.cuh"
OPTIONS = ("--std=c++17",)
# Files with kernels for Hopper's arch-specific features (wgmma), behind `#if __CUDA_ARCH_FEAT_SM90_ALL`:
# compiled for sm_90a on a compute capability 9.0 device (the option goes before CuPy's own -arch=sm_90,
# and NVRTC keeps the first), for the plain target elsewhere.
SM90A_FILES = ("attention.cu", "mm_dgelu.cu")
# What CuPy's RawModule adds to those options on an NVRTC of CUDA 12 or later (cupy/cuda/compiler.py): the
# offline compile (``_nvrtc``) passes them too, so that it compiles what ``build`` compiles. Without the first,
# CUDA 13.0's NVRTC refuses the generic lambdas of the attention kernels as host functions.
CUPY_ADDS = ("--device-as-default-execution-space", "-ftz=true")

_lock = threading.Lock()
_modules: dict[str, object] = {}


def cupy_or_none():
    """The cupy module when it imports and sees at least one CUDA device, else None."""
    try:
        import cupy  # noqa: PLC0415

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # ImportError, CUDARuntimeError (no driver), ...
        return None


def options(filename: str, cc: str) -> tuple[str, ...]:
    """NVRTC options of ``filename`` on a device of compute capability ``cc`` ("90" for the H100/H200)."""
    return ("-arch=sm_90a",) + OPTIONS if cc == "90" and filename in SM90A_FILES else OPTIONS


def read_source(filename: str, defines: tuple[str, ...] = ()) -> str:
    """The text compiled for ``filename``: common.cuh, then the file, each behind a #line directive;
    ``defines`` ("NAME" or "NAME=VALUE", for kernel experiments timed against the plain build:
    bench/attention_variants.py) go first as #define lines."""
    pkg = resources.files("andrea.cuda")
    parts = [define_lines(defines)] if defines else []
    for name in (COMMON, filename):
        f = pkg / name
        if not f.is_file():
            raise AndreaError(f"andrea/cuda/{name}: kernel source not found in the installed package")
        parts.append(f'#line 1 "andrea/cuda/{name}"\n' + f.read_text(encoding="utf-8"))
    return "\n".join(parts)


def define_lines(defines: tuple[str, ...]) -> str:
    """``#define NAME VALUE`` lines of "NAME" / "NAME=VALUE" items; a malformed one raises AndreaError."""
    out = []
    for d in defines:
        name, _, value = d.partition("=")
        if not name.isidentifier() or "\n" in value:
            raise AndreaError(f"kernel define {d!r}: expected NAME or NAME=VALUE (NAME a C identifier, one line)")
        out.append(f"#define {name} {value}".rstrip())
    return "\n".join(out)


def build(filename: str, defines: tuple[str, ...] = ()):
    """A newly compiled ``cupy.RawModule`` of ``filename`` (``defines`` first), uncached."""
    import cupy  # noqa: PLC0415

    src = read_source(filename, defines)
    try:
        mod = cupy.RawModule(code=src, options=options(filename, cupy.cuda.Device().compute_capability),
                             backend="nvrtc")
        mod.compile()
    except cupy.cuda.compiler.CompileException as e:  # noqa: F821 - attribute of cupy
        raise AndreaError(f"andrea/cuda/{filename}: compile failed:\n{e.get_message()}") from None
    return mod


def swap(filename: str, mod):
    """Make ``mod`` the module ``kernel`` hands out for ``filename`` (a benchmark comparing builds in one
    process); returns the one it replaces (None if none was compiled yet)."""
    with _lock:
        old = _modules.get(filename)
        _modules[filename] = mod
        return old


def module(filename: str):
    """The compiled ``cupy.RawModule`` of ``filename`` (compiled once per process)."""
    with _lock:
        mod = _modules.get(filename)
        if mod is None:
            mod = _modules[filename] = build(filename)
        return mod


def kernel(filename: str, name: str):
    """The kernel ``name`` (an ``extern "C"`` symbol) of ``filename``."""
    mod = module(filename)
    try:
        return mod.get_function(name)
    except Exception as e:
        raise AndreaError(f"andrea/cuda/{filename}: no kernel named {name!r} ({e})") from None


def kernel_files() -> list[str]:
    """Every kernel source shipped in the package (``*.cu``; common.cuh is part of each)."""
    return sorted(f.name for f in resources.files("andrea.cuda").iterdir() if f.name.endswith(".cu"))


def _nvrtc(filename: str, arch: str, defines: tuple[str, ...]) -> tuple[str | None, bytes]:
    """(None, the cubin) when ``filename`` compiles for ``arch`` with NVRTC as ``build`` compiles it (with
    ``defines``), else (NVRTC's log, b""). Uses ``cuda.bindings.nvrtc`` (no GPU needed)."""
    try:
        from cuda.bindings import nvrtc  # noqa: PLC0415
    except ImportError:
        raise AndreaError("compile check: cuda-bindings is not installed "
                          "(pip install cuda-bindings nvidia-cuda-nvrtc)") from None
    err, prog = nvrtc.nvrtcCreateProgram(read_source(filename, defines).encode(), filename.encode(), 0, [], [])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise AndreaError(f"compile check: NVRTC could not start ({err}); is nvidia-cuda-nvrtc installed?")
    try:
        cc = arch.removeprefix("sm_").removesuffix("a")
        opts = [o.encode() for o in options(filename, cc) + CUPY_ADDS] + [f"-arch={arch}".encode()]
        (rc,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if rc == nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, n = nvrtc.nvrtcGetCUBINSize(prog)
            cubin = b" " * n
            nvrtc.nvrtcGetCUBIN(prog, cubin)
            return None, cubin
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        return log.decode(errors="replace").rstrip("\x00 \n") or f"NVRTC status {rc}", b""
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_log(filename: str, arch: str = "sm_90", defines: tuple[str, ...] = ()) -> str | None:
    """None when ``filename`` compiles for ``arch`` with NVRTC as ``build`` compiles it (with ``defines``);
    else NVRTC's log. Uses ``cuda.bindings.nvrtc`` (no GPU or driver needed)."""
    return _nvrtc(filename, arch, defines)[0]


def _cuobjdump() -> str:
    """cuobjdump on PATH, else the one of the nvidia-cuda-cuobjdump wheel; AndreaError if neither."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    wheel = next((p for base in sys.path for p in sorted(Path(base).glob("nvidia/*/bin/cuobjdump"))), None)
    if wheel is not None:
        return str(wheel)
    raise AndreaError("resource usage: cuobjdump is not installed (pip install nvidia-cuda-cuobjdump)")


def resource_usage(filename: str, arch: str = "sm_90", defines: tuple[str, ...] = ()) -> dict[str, dict[str, int]]:
    """Per kernel of ``filename`` as ``build`` compiles it for ``arch`` (NVRTC, then ``cuobjdump
    -res-usage`` on the cubin; no GPU needed): {"registers", "shared", "local", "stack"} as cuobjdump
    reports them, bytes per thread for the last two (register spills and local arrays land in the stack
    frame). Registers are what CuPy's kernel attributes report on the device (session 21: 214 / 123 / 74
    for the three attention kernels it profiled); shared includes the 1 KB per block sm_90 reserves."""
    log, cubin = _nvrtc(filename, arch, defines)
    if log is not None:
        raise AndreaError(f"andrea/cuda/{filename}: compile failed:\n{log}")
    return cubin_usage(cubin)


def cubin_usage(cubin: bytes) -> dict[str, dict[str, int]]:
    """``resource_usage``'s table of a compiled cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([_cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    usage, name = {}, None
    for line in out.splitlines():
        if "Function " in line:
            name = line.split("Function ", 1)[1].strip().rstrip(":")
        elif name is not None and "REG:" in line:
            fields = dict(f.split(":", 1) for f in line.split() if ":" in f)
            usage[name] = {"registers": int(fields["REG"]), "shared": int(fields["SHARED"]),
                           "local": int(fields["LOCAL"]), "stack": int(fields["STACK"])}
            name = None
    return usage


def main(argv=None) -> int:
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(description="compile every andrea/cuda kernel file with NVRTC, no GPU needed")
    ap.add_argument("--arch", default="sm_90", help="the target (default sm_90, the H100/H200)")
    ap.add_argument("--resources", action="store_true",
                    help="also print each kernel's registers, shared, local and stack (spill) bytes (needs cuobjdump)")
    ap.add_argument("--match", default="", help="with --resources: only kernels whose name contains this")
    ap.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                    help="compile with this #define first (a kernel experiment); repeatable")
    ap.add_argument("files", nargs="*", help="kernel files (default: all)")
    args = ap.parse_args(argv)
    defines = tuple(args.define)
    try:
        define_lines(defines)
        bad = 0
        for f in args.files or kernel_files():
            log, cubin = _nvrtc(f, args.arch, defines)
            bad += log is not None
            print(f"andrea/cuda/{f}: " + ("ok" if log is None else f"FAILED\n{log}"), flush=True)
            if args.resources and log is None:
                for name, u in sorted(cubin_usage(cubin).items()):
                    if args.match in name:
                        print(f"  {name}: {u['registers']} registers, {u['shared']} B shared, {u['local']} B local, "
                              f"{u['stack']} B stack", flush=True)
    except AndreaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
