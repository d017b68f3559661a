"""The trained bits do not depend on the CPU thread count: the engine splits each batch into
the fixed ``BATCH_SLICES`` slices, and the threads only execute them.

    pytest tests/test_thread_bits.py
"""

from __future__ import annotations

import pytest
from rich.console import Console
from threadpoolctl import threadpool_limits

from andrea.engine import pool
from andrea.train import Trainer
from train_helpers import make_data, micro_cfg


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data"))


def _train_on(threads: int, data, out) -> bytes:
    """Warmup on a fresh pool of ``threads`` threads (BLAS limited to as many)."""
    saved = pool._POOL
    with threadpool_limits(threads, user_api="blas"):
        pool._POOL = None                               # the pool is sized from BLAS's threads
        try:
            assert pool.n_threads() == threads
            tok, tokens = data
            tr = Trainer(micro_cfg(6, 12), "warmup", tok, tokens, out, console=Console(stderr=True))
            assert tr.run() == 0
            assert len(tr.engine.slices) == min(pool.BATCH_SLICES, tr.B)
        finally:
            pool._POOL = saved
    return (out / "model.bin").read_bytes()


def test_one_two_and_three_threads_train_the_same_bytes(data, tmp_path):
    one = _train_on(1, data, tmp_path / "t1")
    assert _train_on(2, data, tmp_path / "t2") == one
    assert _train_on(3, data, tmp_path / "t3") == one    # more threads than slices: some idle


def test_slices_run_in_turn_on_fewer_threads_in_a_fixed_order():
    """Four calls on a pool of two: each call exactly once, inline (its ops unsplit)."""
    saved = pool._POOL
    seen = []
    with threadpool_limits(2, user_api="blas"):
        pool._POOL = None
        try:
            pool.run_parallel(lambda i: seen.append((i, pool.n_threads())), 4)
        finally:
            pool._POOL = saved
    assert sorted(seen) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert pool.batch_slices(16) == [(0, 8), (8, 16)] and pool.batch_slices(1) == [(0, 1)]
