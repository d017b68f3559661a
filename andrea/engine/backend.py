"""The backend switch: which array library and which op pairs run the engine.

    from andrea.engine.backend import select_backend
    be, why = select_backend("auto")       # -> (Backend, "numpy: train.backend=auto and no usable CUDA device")

A backend is any object with these attributes (``NumpyBackend`` below is the reference;
the CuPy backend lives in ``andrea.cuda.backend`` and exposes ``make_backend() -> Backend``
plus ``probe() -> str | None`` (None when a device is usable, else the reason)):

    name: str                          "numpy" | "cupy"
    xp                                 the array module (numpy or cupy)
    ops                                namespace with every function of andrea.engine.ops_numpy,
                                       same names, same arguments, same += semantics
    precisions: tuple[str, ...]        the train.precision values it supports
    att_shape(B, H, T) -> tuple        what attn_forward saves per layer
    work_elems(B, T, C, H, V) -> int   scratch the ops need
    row_slots(B) -> [(b0, b1), ...]    batch slices the engine runs at once (one per thread)
    run_parallel(fn, n)                fn(0), ..., fn(n - 1) at once (or in turn), then return
    to_host(a) -> numpy.ndarray        (a copy for a device array; the array itself on numpy)
    copy_from_host(dst, src)           dst (device) <- src (host numpy), same shape
    synchronize()                      wait for queued work (no-op on numpy)

``train.backend`` is the one visible switch: ``numpy`` and ``cupy`` mean exactly that
(``cupy`` fails with a clear error where no device is usable; it never falls back), and
``auto`` picks cupy where a device is usable, else numpy. The choice and its reason are
printed at start by the train stage.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np

from andrea.engine import ops_numpy
from andrea.errors import AndreaError


class NumpyBackend:
    name = "numpy"
    xp = np
    ops: ModuleType = ops_numpy
    precisions = ("fp32",)

    @staticmethod
    def att_shape(B: int, H: int, T: int) -> tuple[int, ...]:
        return ops_numpy.att_shape(B, H, T)

    @staticmethod
    def work_elems(B: int, T: int, C: int, H: int, V: int) -> int:
        return ops_numpy.work_elems(B, T, C, H, V)

    @staticmethod
    def row_slots(B: int) -> list[tuple[int, int]]:
        return ops_numpy.row_ranges(B)

    @staticmethod
    def run_parallel(fn, n: int) -> None:
        ops_numpy.run_parallel(fn, n)

    @staticmethod
    def to_host(a) -> np.ndarray:
        return a

    @staticmethod
    def copy_from_host(dst, src) -> None:
        np.copyto(dst, src, casting="same_kind")

    @staticmethod
    def synchronize() -> None:
        return None


def _cupy_module():
    """Import the CuPy backend module, or return the reason it is not usable."""
    try:
        mod = importlib.import_module("andrea.cuda.backend")
    except ImportError as e:
        return None, f"andrea.cuda.backend cannot be imported ({e})"
    reason = mod.probe()
    return (mod, None) if reason is None else (None, reason)


def select_backend(name: str):
    """Return ``(backend, reason)`` for ``train.backend`` = auto | numpy | cupy."""
    if name == "numpy":
        return NumpyBackend(), "numpy: train.backend=numpy"
    if name == "cupy":
        mod, reason = _cupy_module()
        if mod is None:
            raise AndreaError(f"train.backend=cupy: no usable CUDA backend: {reason}")
        return mod.make_backend(), "cupy: train.backend=cupy"
    if name == "auto":
        mod, reason = _cupy_module()
        if mod is None:
            return NumpyBackend(), f"numpy: train.backend=auto and cupy is not usable ({reason})"
        return mod.make_backend(), "cupy: train.backend=auto found a usable CUDA device"
    raise AndreaError(f"train.backend: unknown backend {name!r} (auto | numpy | cupy)")
