"""Load a script of the repository that is not a package module (bench/*.py, workflow/cluster/*.py)
as a fresh module, for the tests that call its functions.

    from script_helpers import load_script
    eg = load_script("bench/engine_gpu.py")
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str):
    """A new module object of ROOT/relpath, executed (each call its own copy: monkeypatches stay local)."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_device_clock(monkeypatch, calls: list[int], ms_per_call: float = 0.5) -> types.SimpleNamespace:
    """A stand-in ``cupy`` module (in sys.modules) whose CUDA events read ``calls[0]``, a count the caller's
    fake kernel launches bump: the elapsed time between two events is ``ms_per_call`` a launch between
    them. Its ``cuda`` namespace is returned for more attributes."""
    class Event:
        def record(self, stream=None):
            self.n = calls[0]

        def synchronize(self):
            pass

    cuda = types.SimpleNamespace(Event=Event, get_elapsed_time=lambda a, b: ms_per_call * (b.n - a.n))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    return cuda


def cupy_with_cudnn():
    """CuPy, where it finds a CUDA device and cuDNN's frontend loads; else the test is skipped, saying why
    (the GPU tests of cuDNN's attention and of the benches over it)."""
    import pytest

    from andrea.cuda import cudnn_attention as ca
    from andrea.cuda.loader import cupy_or_none

    cp = cupy_or_none()
    if cp is None:
        pytest.skip("CuPy cannot be imported or finds no CUDA device")
    if ca.unavailable() is not None:
        pytest.skip(f"cuDNN's frontend cannot be loaded ({ca.unavailable()})")
    return cp
