"""Checkpoint I/O: the fixed binary checkpoint and the run files beside it.

    from andrea.engine import checkpoint as ck
    ck.write_checkpoint(path, step, w, m, v)           # atomic (temp file, fsync, rename)
    step, w, m, v = ck.read_checkpoint(path, n_params)  # float32 host arrays; refuses bad files
    step, w = ck.read_weights(path, n_params)           # weights only (inference)

File layout, little-endian, exactly:
    [int32 step][int32 n_params][n_params x f32 weights][n_params x f32 m][n_params x f32 v]
so its size is 8 + 12 * n_params bytes. A file of another size (truncated, or made for
another model), a negative step or an n_params other than the model's is refused with an
AndreaError naming the file.

Beside ``model.bin``: ``model.state.json`` (everything else a resume needs; see
andrea/train.py) and ``model.loss.json`` (the history). ``run_paths(out)`` names them.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from andrea.errors import AndreaError
from andrea.fsutil import atomic_open

HEAD = struct.Struct("<ii")
F32 = np.dtype("<f4")


def run_paths(out: str | Path) -> dict[str, Path]:
    out = Path(out)
    return {"bin": out / "model.bin", "state": out / "model.state.json", "loss": out / "model.loss.json",
            "samples": out / "model.samples.json"}


def write_checkpoint(path: str | Path, step: int, w: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
    """Write the checkpoint atomically. w, m, v: host float32 arrays of n_params each."""
    n = int(w.size)
    if not 0 <= step < 2 ** 31 or n >= 2 ** 31:
        raise AndreaError(f"{path}: step {step} / n_params {n} do not fit the int32 header")
    for name, a in (("weights", w), ("m", m), ("v", v)):
        if a.dtype != F32 or a.size != n:
            raise AndreaError(f"{path}: {name} must be {n} little-endian float32 values, got {a.dtype} x {a.size}")
    with atomic_open(path, "wb") as f:
        f.write(HEAD.pack(int(step), n))
        for a in (w, m, v):
            f.write(memoryview(np.ascontiguousarray(a)).cast("B"))


def _open_checked(path: Path, n_params: int | None) -> tuple[int, int]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEAD.size)
    except FileNotFoundError:
        raise AndreaError(f"{path}: checkpoint not found") from None
    if len(head) < HEAD.size:
        raise AndreaError(f"{path}: {size} bytes, too short for a checkpoint header (truncated?)")
    step, n = HEAD.unpack(head)
    if n <= 0 or step < 0:
        raise AndreaError(f"{path}: bad header (step {step}, n_params {n}): not an ANDREA checkpoint")
    if n_params is not None and n != n_params:
        raise AndreaError(f"{path}: n_params {n:,} in the file, but the model has {n_params:,} "
                          "(another model shape or vocabulary)")
    expect = HEAD.size + 12 * n
    if size != expect:
        raise AndreaError(f"{path}: {size} bytes, expected {expect} for n_params {n:,} (truncated or corrupt)")
    return step, n


def read_checkpoint(path: str | Path, n_params: int | None) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    path = Path(path)
    step, n = _open_checked(path, n_params)
    with open(path, "rb") as f:
        f.seek(HEAD.size)
        data = np.fromfile(f, dtype=F32, count=3 * n)
    if data.size != 3 * n:
        raise AndreaError(f"{path}: short read ({data.size} of {3 * n} values)")
    return step, data[:n], data[n:2 * n], data[2 * n:]


def read_weights(path: str | Path, n_params: int | None) -> tuple[int, np.ndarray]:
    path = Path(path)
    step, n = _open_checked(path, n_params)
    with open(path, "rb") as f:
        f.seek(HEAD.size)
        w = np.fromfile(f, dtype=F32, count=n)
    return step, w


