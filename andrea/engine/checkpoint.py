"""Checkpoint I/O: the fixed binary checkpoint and the run files beside it.

    from andrea.engine import checkpoint as ck
    sha = ck.write_checkpoint(path, step, w, m, v)     # atomic (temp file, fsync, rename); its sha256
    step, w, m, v = ck.read_checkpoint(path, n_params)  # float32 host arrays; refuses bad files
    step, w = ck.read_weights(path, n_params)           # weights only (inference)
    step, n = ck.read_header(path)                      # the checked header alone

File layout, little-endian, exactly:
    [int32 step][int32 n_params][n_params x f32 weights][n_params x f32 m][n_params x f32 v]
so its size is 8 + 12 * n_params bytes. A file of another size (truncated, or made for
another model), a negative step or an n_params other than the model's is refused with an
AndreaError naming the file.

This module is the file format only; the run folder around it (the state, the history,
how a checkpoint and its state land together) is andrea/runs.py.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from andrea.errors import AndreaError
from andrea.fsutil import atomic_open

HEAD = struct.Struct("<ii")
F32 = np.dtype("<f4")


def write_checkpoint(path: str | Path, step: int, w: np.ndarray, m: np.ndarray, v: np.ndarray,
                     atomic: bool = True) -> str:
    """Write the checkpoint (atomically unless ``atomic=False``: then plainly, fsynced, for a
    folder that lands as a whole) and return the file's sha256. w, m, v: host float32 arrays
    of n_params each."""
    n = int(w.size)
    if not 0 <= step < 2 ** 31 or n >= 2 ** 31:
        raise AndreaError(f"{path}: step {step} / n_params {n} do not fit the int32 header")
    for name, a in (("weights", w), ("m", m), ("v", v)):
        if a.dtype != F32 or a.size != n:
            raise AndreaError(f"{path}: {name} must be {n} little-endian float32 values, got {a.dtype} x {a.size}")
    h = hashlib.sha256()
    with atomic_open(path, "wb") if atomic else open(path, "wb") as f:
        for block in [HEAD.pack(int(step), n)] + [memoryview(np.ascontiguousarray(a)).cast("B") for a in (w, m, v)]:
            f.write(block)
            h.update(block)
        if not atomic:
            f.flush()
            os.fsync(f.fileno())
    return h.hexdigest()


def read_header(path: str | Path, n_params: int | None = None) -> tuple[int, int]:
    """``(step, n_params)`` of a checkpoint whose header and size are right; else an AndreaError naming it."""
    path = Path(path)
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
    step, n = read_header(path, n_params)
    with open(path, "rb") as f:
        f.seek(HEAD.size)
        data = np.fromfile(f, dtype=F32, count=3 * n)
    if data.size != 3 * n:
        raise AndreaError(f"{path}: short read ({data.size} of {3 * n} values)")
    return step, data[:n], data[n:2 * n], data[2 * n:]


def read_weights(path: str | Path, n_params: int | None) -> tuple[int, np.ndarray]:
    path = Path(path)
    step, n = read_header(path, n_params)
    with open(path, "rb") as f:
        f.seek(HEAD.size)
        w = np.fromfile(f, dtype=F32, count=n)
    return step, w


