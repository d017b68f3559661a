"""The one loader of ANDREA's CUDA kernels: read a ``.cu`` file shipped as package data, compile it
at run time with CuPy (``cupy.RawModule``, NVRTC), cache the module, hand out kernels by name.

    from andrea.cuda.loader import kernel
    k = kernel("layernorm.cu", "k_layernorm_fwd_bf16")
    k((grid,), (block,), (x, w, b, y, mean, rstd, np.int32(N), np.int32(C), np.float32(eps)))

Every module is ``common.cuh`` followed by the ``.cu`` file; each part starts with a
``#line 1 "<file>"`` directive so a compiler error names the real file and line. A failed
compile raises AndreaError with NVRTC's log. CuPy keeps compiled binaries in its own disk
cache (``~/.cupy/kernel_cache``), keyed by the source text, so a second run skips NVRTC.
"""

from __future__ import annotations

import threading
from importlib import resources

from andrea.errors import AndreaError

COMMON = "common.cuh"
OPTIONS = ("--std=c++17",)

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


def read_source(filename: str) -> str:
    """The text compiled for ``filename``: common.cuh, then the file, each behind a #line directive."""
    pkg = resources.files("andrea.cuda")
    parts = []
    for name in (COMMON, filename):
        f = pkg / name
        if not f.is_file():
            raise AndreaError(f"andrea/cuda/{name}: kernel source not found in the installed package")
        parts.append(f'#line 1 "andrea/cuda/{name}"\n' + f.read_text(encoding="utf-8"))
    return "\n".join(parts)


def module(filename: str):
    """The compiled ``cupy.RawModule`` of ``filename`` (compiled once per process)."""
    with _lock:
        mod = _modules.get(filename)
        if mod is not None:
            return mod
        import cupy  # noqa: PLC0415

        src = read_source(filename)
        try:
            mod = cupy.RawModule(code=src, options=OPTIONS, backend="nvrtc")
            mod.compile()
        except cupy.cuda.compiler.CompileException as e:  # noqa: F821 - attribute of cupy
            raise AndreaError(f"andrea/cuda/{filename}: compile failed:\n{e.get_message()}") from None
        _modules[filename] = mod
        return mod


def kernel(filename: str, name: str):
    """The kernel ``name`` (an ``extern "C"`` symbol) of ``filename``."""
    mod = module(filename)
    try:
        return mod.get_function(name)
    except Exception as e:
        raise AndreaError(f"andrea/cuda/{filename}: no kernel named {name!r} ({e})") from None
