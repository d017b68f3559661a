"""The backend contract, and ``NumpyBackend``, its reference: which array library and which op
pairs run the engine. Which backend a run gets is decided in one place, ``andrea.backends``.
NumpyBackend's ops are ``andrea.engine.ops_cpu``: the reference ops of ``ops_numpy`` with the
per-row work compiled (Numba), tested op by op against them.

    from andrea.engine.backend import NumpyBackend
    eng = Engine(mc, batch_size=16, backend=NumpyBackend())

A backend is any object with these attributes (the CuPy one is ``andrea.cuda.backend.CupyBackend``,
which also has ``make_engine(mc, B, precision)``: its own fused engine with the same surface):

    name: str                          "numpy" | "cupy"
    xp                                 the array module (numpy or cupy)
    ops                                namespace with every function of andrea.engine.ops_numpy,
                                       same names, same arguments, same += semantics
    precisions: tuple[str, ...]        the train.precision values it supports
    att_shape(B, H, T) -> tuple        what attn_forward saves per layer
    work_elems(B, T, C, H, V) -> int   scratch the ops need
    row_slots(B) -> [(b0, b1), ...]    the engine's batch slices (NumPy: BATCH_SLICES, fixed)
    run_parallel(fn, n)                fn(0), ..., fn(n - 1) at once (or in turn), then return
    zeros(shape, dtype) -> array       a zeroed array the engine's buffers are carved from (NumPy:
                                       its first byte on a cache line, ``aligned_zeros``)
    to_host(a) -> numpy.ndarray        (a copy for a device array; the array itself on numpy)
    copy_from_host(dst, src)           dst (device) <- src (host numpy), same shape
    synchronize()                      wait for queued work (no-op on numpy)
    free_memory() -> (bytes, where) | None   what a new engine can allocate there, and where that
                                       is (NumPy: andrea.preflight.host_free_memory; None: unknown)

"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from andrea.engine import ops_cpu, ops_numpy, pool

# The NumPy engine's buffers start on a 64-byte cache line. NumPy's own allocations start 16 bytes
# past one, so every row of every buffer straddled a line: each 64-byte vector load of the Numba
# kernels and of OpenBLAS's packing touched two. Aligned, the tiny step took 2.3-3.4% less time at
# 1 thread (paired rounds, session 43, docs/bench/s43.md) and every trained bit stayed the same.
ALIGN = 64


def aligned_zeros(shape, dtype) -> np.ndarray:
    """np.zeros(shape, dtype) whose first byte lies on an ``ALIGN``-byte boundary (a view into a
    slightly larger zeroed byte buffer, which it keeps alive)."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dt).reshape(shape)


class NumpyBackend:
    name = "numpy"
    xp = np
    ops: ModuleType = ops_cpu
    precisions = ("fp32",)

    @staticmethod
    def att_shape(B: int, H: int, T: int) -> tuple[int, ...]:
        return ops_numpy.att_shape(B, H, T)

    @staticmethod
    def work_elems(B: int, T: int, C: int, H: int, V: int) -> int:
        """ops_numpy's need, rounded up to whole cache lines of fp32: the next slice's scratch, which
        follows this one in the flat buffer, then starts on a line too."""
        line = ALIGN // 4
        return -(-ops_numpy.work_elems(B, T, C, H, V) // line) * line

    @staticmethod
    def row_slots(B: int) -> list[tuple[int, int]]:
        return pool.batch_slices(B)

    @staticmethod
    def run_parallel(fn, n: int) -> None:
        ops_numpy.run_parallel(fn, n)

    zeros = staticmethod(aligned_zeros)

    @staticmethod
    def to_host(a) -> np.ndarray:
        return a

    @staticmethod
    def copy_from_host(dst, src) -> None:
        np.copyto(dst, src, casting="same_kind")

    @staticmethod
    def synchronize() -> None:
        return None

    @staticmethod
    def free_memory() -> tuple[int, str] | None:
        from andrea.preflight import host_free_memory  # noqa: PLC0415 - preflight imports the shards

        return host_free_memory()
