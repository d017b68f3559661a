"""The memory preflight on a real device: an absurd batch is refused in one line that names the
device's free memory (cudaMemGetInfo) and the largest batch that fits, with nothing allocated,
and that batch is built; ``andrea train`` with a model the GPU cannot hold exits 2, not with
an out-of-memory traceback.

    PYTHONPATH=. python3 -m pytest -m gpu tests/test_memory_gpu.py      # on a machine with a GPU

Skipped cleanly where CuPy cannot be imported or finds no CUDA device. The arithmetic of the
search and the text of the refusal are tested without a GPU in tests/test_memory.py.
"""

from __future__ import annotations

import gc
import re

import pytest

from andrea.cuda.loader import cupy_or_none
from andrea.engine.model import ModelConfig
from andrea.errors import AndreaError
from train_helpers import make_data, micro_overrides, run_cli

cp = cupy_or_none()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="CuPy cannot be imported or finds no CUDA device")]

MC = ModelConfig(vocab_size=8449, d_model=768, n_head=12, n_layer=12, context=1024)   # the andrea-120m shapes


def test_an_absurd_batch_is_refused_with_nothing_allocated_and_the_named_batch_is_built():
    from andrea.cuda.backend import make_backend
    from andrea.cuda.engine import arena_layout
    from andrea.preflight import HEADROOM

    be = make_backend()
    pool = cp.get_default_memory_pool()
    free, total = cp.cuda.runtime.memGetInfo()
    gc.collect()                   # earlier tests' dead arrays would leave the pool inside the refusal
    used = pool.used_bytes()
    with pytest.raises(AndreaError) as e:
        be.make_engine(MC, 1_000_000, precision="bf16")
    msg = str(e.value)
    assert pool.used_bytes() == used                                   # refused before the arena
    assert "\n" not in msg and e.value.exit_code == 2
    assert msg.startswith("train.batch_size=1000000: the cupy bf16 engine plans ")
    assert f"GPU {cp.cuda.runtime.getDevice()} ({total / (1 << 30):.1f} GiB in all) has " in msg, msg
    fit = int(re.search(r"the largest batch that fits is (\d+): set -S train\.batch_size=\1 ", msg).group(1))
    assert arena_layout(MC, fit, "bf16").nbytes * HEADROOM <= be.free_memory()[0] + (256 << 20)
    eng = be.make_engine(MC, fit, precision="bf16", cuda_graph=False)   # what the message names is built
    try:
        assert eng.planned_bytes == arena_layout(MC, fit, "bf16").nbytes == eng.allocated_bytes
    finally:
        del eng
        gc.collect()
        pool.free_all_blocks()                                          # the next tests get the memory back


def test_train_refuses_a_model_the_gpu_cannot_hold_with_exit_2(tmp_path):
    tok, tokens = make_data(tmp_path)
    huge = {"model.d_model": 16384, "model.n_head": 128, "model.n_layer": 64,     # ~206e9 parameters
            "train.backend": "cupy", "train.precision": "bf16"}
    r = run_cli("warmup", tok, tokens, tmp_path / "run", micro_overrides(5, 10, **huge))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and "OutOfMemory" not in r.stderr, r.stderr
    assert re.search(r"andrea train: error: train\.batch_size=4: the cupy bf16 engine plans [\d.]+ GiB .* GPU \d+ "
                     r"\([\d.]+ GiB in all\) has [\d.]+ GiB free; even train\.batch_size=1 needs", lines[-1]), r.stderr
    assert not (tmp_path / "run").exists()
