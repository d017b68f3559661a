"""Held-out figures of the eval stage on the CuPy engine against the NumPy engine (same weights, same shards).

    PYTHONPATH=. python3 -m pytest -m gpu tests/test_reports_gpu.py      # on a machine with a GPU

Skipped cleanly where CuPy cannot be imported or finds no CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest

from andrea.cuda.loader import cupy_or_none
from andrea.engine.backend import NumpyBackend
from andrea.engine.engine import Engine
from andrea.engine.model import ModelConfig
from andrea.reports.evaluate import heldout
from andrea.shards import Shard, ShardWriter

cp = cupy_or_none()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="CuPy cannot be imported or finds no CUDA device")]

MC = ModelConfig(vocab_size=300, d_model=64, n_head=4, n_layer=2, context=32)


def test_heldout_on_cupy_matches_numpy(tmp_path):
    from andrea.cuda.backend import make_backend

    rng = np.random.default_rng(0)
    shards = {}
    for src, n_docs in (("a", 40), ("b", 3)):
        with ShardWriter(tmp_path / f"{src}.bin", MC.vocab_size, MC.vocab_size - 1) as w:
            for _ in range(n_docs):
                w.add(rng.integers(0, MC.vocab_size - 1, size=int(rng.integers(5, 60))))
        shards[src] = Shard(tmp_path / f"{src}.bin")
    byte_len = rng.integers(1, 5, size=MC.vocab_size)
    cpu = Engine(MC, batch_size=4, backend=NumpyBackend())
    cpu.init_weights(seed=2)
    be = make_backend()
    gpu = Engine(MC, batch_size=4, backend=be)
    be.copy_from_host(gpu.w, cpu.w)
    a = heldout(cpu, shards, byte_len, MC.vocab_size - 1, max_batches=3)
    b = heldout(gpu, shards, byte_len, MC.vocab_size - 1, max_batches=3)
    for src in ("a", "b"):
        assert a["per_source"][src]["tokens"] == b["per_source"][src]["tokens"] > 0
        assert b["per_source"][src]["bpb"] == pytest.approx(a["per_source"][src]["bpb"], rel=1e-4)
    assert b["overall"]["loss"] == pytest.approx(a["overall"]["loss"], rel=1e-4)
