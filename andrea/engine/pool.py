"""The NumPy engine's thread pool: fixed contiguous row ranges of a batch, one per thread, with
BLAS single-threaded meanwhile (the op pairs of ``andrea/engine/ops_numpy.py`` split their rows
through ``split_batch``; the engine hands whole batch slices to ``run_parallel``).

    from andrea.engine.pool import batch_slices, row_ranges, run_parallel
    batch_slices(16)                     # [(0, 8), (8, 16)]: BATCH_SLICES, whatever the threads
    row_ranges(16)                       # [(0, 8), (8, 16)] on 2 threads
    run_parallel(lambda i: work(i), 4)   # work(0), work(2) here, work(1), work(3) on the pool

The engine's batch slices are fixed (``BATCH_SLICES``, never the thread count): each slice's
parameter gradients go to its own buffer, summed in slice order, so the trained bits are the
same on 1 thread or 64. The threads only execute the slices: thread j runs slices j, j + n,
... (n = the threads used), each inline with BLAS single-threaded, and with fewer threads
than slices they run in turn.

Row ranges run on one persistent pool, with BLAS single-threaded meanwhile. A multi-threaded
BLAS splits each GEMM across its threads and pays a thread handshake per call (the attention
alone is B*H small GEMMs; with a busy second core it ran ~100x slower at 2 BLAS threads than at
1), so the ops split rows instead: fixed contiguous ranges, one per pool thread. Rows are
independent and each GEMM is the same single-threaded call whatever the split, so the bits
depend only on the thread count. ``run_parallel`` hands a whole function (the engine runs its
forward + backward per batch slice this way) to the pool; inside it every op runs inline on its
thread, so a step pays a handful of handoffs instead of one per op.
"""

from __future__ import annotations

import contextlib
import os
import threading

_POOL: tuple | None = None          # (pid, n_threads, workers, BLAS controllers)
MAX_THREADS = 64                    # scratch for per-thread partial sums is sized for this many
# The engine's batch slices: the trained bits follow this number, never the thread count (the
# state records it as batch_slices). 2 keeps a 2-core box busy and costs ~nothing on 1 thread
# (bench/engine_cpu.py); more would only pay on more cores.
BATCH_SLICES = 2
_LOCAL = threading.local()          # .inline: this thread is running one range of a parallel call
_POOL_LOCK = threading.Lock()       # one caller at a time hands work to the pool


class _Worker:
    """One pool thread. The handoff is a pair of locks (a release wakes the waiter with one
    futex call): on a 2-vCPU VM a round trip costs ~60 us this way, ~130 us through
    concurrent.futures."""

    def __init__(self, name: str):
        self.go, self.done = threading.Lock(), threading.Lock()
        self.go.acquire()
        self.done.acquire()
        self.task: tuple | None = None
        self.error: BaseException | None = None
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        _LOCAL.inline = True
        while True:
            self.go.acquire()
            fn, args = self.task
            try:
                fn(*args)
            except BaseException as e:                  # handed back to the caller by wait()
                self.error = e
            self.task = None
            self.done.release()

    def start(self, fn, args: tuple) -> None:
        self.task = (fn, args)
        self.go.release()

    def wait(self) -> None:
        self.done.acquire()
        if self.error is not None:
            e, self.error = self.error, None
            raise e


def _pool() -> tuple:
    """The process's worker pool, created once (again after a fork): as many threads as BLAS
    was given (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, else the core count), at most 64."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        from threadpoolctl import ThreadpoolController

        ctl = ThreadpoolController().select(user_api="blas").lib_controllers
        n = min(max([int(c.num_threads) for c in ctl] or [1]), MAX_THREADS)
        workers = [_Worker(f"andrea-ops-{i}") for i in range(1, n)]
        _POOL = (os.getpid(), n, workers, ctl)
    return _POOL


def n_threads() -> int:
    """How many ranges a parallel call splits into here (1 inside a parallel call)."""
    return 1 if getattr(_LOCAL, "inline", False) else _pool()[1]


def row_ranges(B: int) -> list[tuple[int, int]]:
    """The fixed contiguous ranges covering [0, B) that ``split_batch`` hands out."""
    n = max(1, min(n_threads(), B))
    return [(B * i // n, B * (i + 1) // n) for i in range(n)]


def batch_slices(B: int, n: int = BATCH_SLICES) -> list[tuple[int, int]]:
    """The engine's fixed batch slices: n contiguous ranges covering [0, B) (fewer when B < n),
    the same whatever the thread count."""
    n = max(1, min(n, B))
    return [(B * i // n, B * (i + 1) // n) for i in range(n)]


def run_parallel(fn, n: int) -> None:
    """Call fn(0), ..., fn(n - 1), each running its ops inline (unsplit), with BLAS
    single-threaded meanwhile: on k = min(n, pool threads) threads, thread j takes fn(j),
    fn(j + k), ... (the caller is thread 0). One pool thread, a call from inside a parallel
    call, or a call while another thread holds the pool run them in turn on this thread, still
    inline (same bits: each call's work does not depend on where or with what it runs)."""
    if n < 1:
        return
    if getattr(_LOCAL, "inline", False):
        for i in range(n):
            fn(i)
        return
    if n < 2 or _pool()[1] < 2 or not _POOL_LOCK.acquire(blocking=False):
        _run_here(fn, n)
        return
    try:
        _run_on_pool(fn, n)
    finally:
        _POOL_LOCK.release()


def _run_here(fn, n: int) -> None:
    """fn(0), ..., fn(n - 1) in turn on this thread, inline. BLAS keeps its threads: only the
    pool's holder changes them (process-wide), and a pool of one thread has one BLAS thread."""
    _LOCAL.inline = True
    try:
        for i in range(n):
            fn(i)
    finally:
        _LOCAL.inline = False


def _run_on_pool(fn, n: int) -> None:
    _, size, workers, ctl = _pool()
    k = min(n, size)
    saved = [c.num_threads for c in ctl]
    for c in ctl:
        c.set_num_threads(1)

    def turn(j: int) -> None:
        for i in range(j, n, k):
            fn(i)

    try:
        for j in range(1, k):
            workers[j - 1].start(turn, (j,))
        _LOCAL.inline = True
        try:
            turn(0)
        finally:
            _LOCAL.inline = False
            for w in workers[:k - 1]:
                w.wait()
    finally:
        for c, k_ in zip(ctl, saved):
            c.set_num_threads(k_)


@contextlib.contextmanager
def blas_single_threaded():
    """BLAS on one thread inside the block (process-wide, restored after): for callers whose ops
    do not split (one row: ``split_batch`` runs it inline), where each multi-threaded GEMV would
    pay a thread handshake (one-token decode at 12M ran ~50x slower with a busy second core).
    Inside a parallel call, or while another thread holds the pool, it changes nothing."""
    if getattr(_LOCAL, "inline", False) or not _POOL_LOCK.acquire(blocking=False):
        yield
        return
    try:
        ctl = _pool()[3]
        saved = [c.num_threads for c in ctl]
        for c in ctl:
            c.set_num_threads(1)
        try:
            yield
        finally:
            for c, k_ in zip(ctl, saved):
                c.set_num_threads(k_)
    finally:
        _POOL_LOCK.release()


def split_batch(fn, B: int) -> None:
    """Call fn(b0, b1) on the ranges of ``row_ranges(B)``, one per pool thread (the caller takes
    the first); inside a parallel call, fn(0, B) on this thread."""
    ranges = row_ranges(B)
    if len(ranges) == 1:
        fn(0, B)
        return
    run_parallel(lambda i: fn(*ranges[i]), len(ranges))
