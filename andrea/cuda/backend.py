"""The CuPy backend of the ANDREA engine: what ``andrea.backends.select_backend`` hands out where a
CUDA device is usable. Its ``ops`` are the fp32 op mirror (``andrea/cuda/mirror.py``), so the
NumPy engine runs on it unchanged; ``make_engine`` builds the fast mixed-precision ``GpuEngine``
(``andrea/cuda/engine.py``), which the train stage uses.

    from andrea.cuda.backend import probe, make_backend
    if probe() is None:                       # None: a CUDA device is usable
        be = make_backend()
        eng = be.make_engine(mc, batch_size=8, precision="bf16")   # GpuEngine

The modules of andrea/cuda by job: ``loader`` (compile .cu, hand out kernels), ``kernels`` (launch
geometry, argument checks, cuBLAS), ``mirror`` (ops_numpy's contract in fp32), ``engine`` (the
GPU engine and its op set), ``backend`` (this: the backend object). Importing this module needs
neither CuPy nor a GPU: ``probe()`` says why one is not usable.
"""

from __future__ import annotations

import numpy as np

from andrea.cuda.engine import GpuEngine
from andrea.cuda.kernels import cp
from andrea.cuda.loader import cupy_or_none
from andrea.cuda.mirror import MirrorOps
from andrea.engine.model import ModelConfig
from andrea.errors import AndreaError


def probe() -> str | None:
    """None when CuPy imports and sees a CUDA device; otherwise the reason, in words."""
    try:
        import cupy  # noqa: F401, PLC0415
    except Exception as e:  # ImportError and friends
        return f"cupy cannot be imported ({type(e).__name__}: {e})"
    if cupy_or_none() is None:
        return "cupy finds no usable CUDA device"
    return None


class CupyBackend:
    name = "cupy"
    precisions = ("fp32", "bf16", "fp16", "fp8")

    def __init__(self):
        self.xp = cp()
        self.ops = MirrorOps()

    @staticmethod
    def att_shape(B: int, H: int, T: int) -> tuple[int, ...]:
        return (B, H, T)

    @staticmethod
    def work_elems(B: int, T: int, C: int, H: int, V: int) -> int:
        return MirrorOps.work_elems(B, T, C, H, V)

    @staticmethod
    def row_slots(B: int) -> list[tuple[int, int]]:
        """One slice: the device runs the whole batch per launch."""
        return [(0, B)]

    @staticmethod
    def run_parallel(fn, n: int) -> None:
        for i in range(n):
            fn(i)

    def zeros(self, shape, dtype):
        return self.xp.zeros(shape, dtype=dtype)        # CuPy's pool hands out 512-byte aligned blocks

    def to_host(self, a) -> np.ndarray:
        return self.xp.asnumpy(a)

    def copy_from_host(self, dst, src) -> None:
        src = np.ascontiguousarray(src, dtype=dst.dtype).reshape(dst.shape)
        if dst.flags.c_contiguous:
            dst.set(src)
        else:
            dst[...] = self.xp.asarray(src)

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

    def free_memory(self) -> tuple[int, str]:
        """(bytes, where) a new arena can get on the current device: cudaMemGetInfo's free after
        CuPy's pool has handed its cached free blocks back (what the pool does itself before it
        fails an allocation), capped by the pool's limit when one is set."""
        xp = self.xp
        pool = xp.get_default_memory_pool()
        pool.free_all_blocks()
        free, total = (int(x) for x in xp.cuda.runtime.memGetInfo())
        limit = int(pool.get_limit())
        if limit:
            free = min(free, max(limit - int(pool.total_bytes()), 0))
        dev = xp.cuda.runtime.getDevice()
        return free, f"GPU {dev} ({total / (1 << 30):.1f} GiB in all{', pool limit' if limit else ''})"

    def make_engine(self, mc: ModelConfig, batch_size: int, precision: str = "fp32", cuda_graph: bool = True,
                    comm=None, **kw):
        """``comm``: an andrea.dist.NcclComm for the data-parallel (ZeRO-1) engine of one rank;
        ``kw``: recompute, attention, fp8_scaling, fp8_amax_history (GpuEngine)."""
        return GpuEngine(self, mc, batch_size, precision=precision, cuda_graph=cuda_graph, comm=comm, **kw)


def make_backend() -> CupyBackend:
    reason = probe()
    if reason is not None:
        raise AndreaError(f"cupy backend: {reason}")
    return CupyBackend()


