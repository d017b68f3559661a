"""Load a script of the repository that is not a package module (bench/*.py, workflow/cluster/*.py)
as a fresh module, for the tests that call its functions.

    from script_helpers import load_script
    eg = load_script("bench/engine_gpu.py")
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str):
    """A new module object of ROOT/relpath, executed (each call its own copy: monkeypatches stay local)."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
