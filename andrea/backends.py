"""Backend selection, in one place: every caller that runs the model (train, eval, audit, sample,
chat, the benches) asks here which backend ``train.backend`` means on this machine.

    from andrea.backends import select_backend
    be, why = select_backend("auto")       # -> (backend, "numpy: train.backend=auto and cupy is not usable (...)")

``train.backend`` is the one visible switch: ``numpy`` and ``cupy`` mean exactly that (``cupy``
fails with a clear error where no device is usable; it never falls back), and ``auto`` picks
cupy where a device is usable, else numpy. The choice and its reason are printed at start by
the train stage. This module sits above ``andrea.engine`` (the NumPy backend) and
``andrea.cuda`` (the CuPy one), so neither package imports the other to choose.
"""

from __future__ import annotations

from andrea.engine.backend import NumpyBackend
from andrea.errors import AndreaError


def _cupy_backend():
    """``(andrea.cuda.backend, None)`` where a CUDA device is usable, else ``(None, reason)``."""
    try:
        from andrea.cuda import backend as cuda_backend  # noqa: PLC0415 - only where asked for
    except ImportError as e:
        return None, f"andrea.cuda.backend cannot be imported ({e})"
    reason = cuda_backend.probe()
    return (cuda_backend, None) if reason is None else (None, reason)


def select_backend(name: str):
    """Return ``(backend, reason)`` for ``train.backend`` = auto | numpy | cupy."""
    if name == "numpy":
        return NumpyBackend(), "numpy: train.backend=numpy"
    if name == "cupy":
        mod, reason = _cupy_backend()
        if mod is None:
            raise AndreaError(f"train.backend=cupy: no usable CUDA backend: {reason}")
        return mod.make_backend(), "cupy: train.backend=cupy"
    if name == "auto":
        mod, reason = _cupy_backend()
        if mod is None:
            return NumpyBackend(), f"numpy: train.backend=auto and cupy is not usable ({reason})"
        return mod.make_backend(), "cupy: train.backend=auto found a usable CUDA device"
    raise AndreaError(f"train.backend: unknown backend {name!r} (auto | numpy | cupy)")
