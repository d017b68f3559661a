"""The NCCL data-parallel path on one GPU (andrea/dist.py, GpuEngine with a comm): world size 1
through NCCL (reduce-scatter, gathered norm partials, sharded AdamW, all-gather) is byte-identical
to the plain engine, step by step and as a whole `andrea train` run under the launcher's
environment (RANK/WORLD_SIZE set by hand, and torchrun --nproc_per_node=1 where it is installed).

    PYTHONPATH=. python3 -m pytest -m gpu tests/test_dist_gpu.py      # on a machine with a GPU

Skipped cleanly without CuPy, a CUDA device or CuPy's NCCL. Several ranks need several GPUs
(NCCL refuses two ranks on one device): bench/multi_gpu.py runs those on an x2/x4/x8 machine.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from andrea.cuda.loader import cupy_or_none
from andrea.engine.engine import Hyper
from andrea.engine.model import ModelConfig

cp = cupy_or_none()


def _nccl_ok() -> bool:
    if cp is None:
        return False
    try:
        from cupy.cuda import nccl
    except ImportError:
        return False
    return bool(getattr(nccl, "available", False))


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _nccl_ok(), reason="no CuPy, CUDA device or CuPy NCCL")]

MC = ModelConfig(vocab_size=97, d_model=64, n_head=2, n_layer=2, context=128)


def one_rank_comm():
    from cupy.cuda import nccl

    from andrea.dist import NcclComm

    return NcclComm(nccl.NcclCommunicator(1, nccl.get_unique_id(), 0), 0, 1)


def batches(seed, n, b=2):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, MC.vocab_size, (b, MC.context)).astype(np.int32),
             rng.integers(0, MC.vocab_size, (b, MC.context)).astype(np.int32)) for _ in range(n)]


@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("clip", [1.0, 1e-3])          # 1e-3: the clip is active at every step
def test_one_rank_through_nccl_is_byte_identical_to_the_plain_engine(prec, clip):
    from andrea.cuda.backend import make_backend

    be = make_backend()
    plain = be.make_engine(MC, 2, prec)
    ranked = be.make_engine(MC, 2, prec, comm=one_rank_comm())
    assert ranked.planned_bytes == plain.planned_bytes          # one rank: the plain arena
    hp = Hyper(grad_clip=clip)
    for e in (plain, ranked):
        e.init_weights(1337)
    for step in range(4):
        data = batches(step, 2)
        r1 = plain.train_step(iter(data), 1e-3, step + 1, hp, n_micro=2)
        r2 = ranked.train_step(iter(data), 1e-3, step + 1, hp, n_micro=2)
        assert (r1.loss, r1.grad_norm, r1.ok) == (r2.loss, r2.grad_norm, r2.ok), step
    for a, b in zip(plain.state_host(), ranked.state_host()):
        assert a.tobytes() == b.tobytes()
    assert plain.extra_state() == ranked.extra_state()


def test_state_host_and_load_state_round_trip_through_the_sharded_engine():
    from andrea.cuda.backend import make_backend

    e = make_backend().make_engine(MC, 2, "bf16", comm=one_rank_comm())
    rng = np.random.default_rng(0)
    w, m, v = (rng.standard_normal(e.n_params).astype(np.float32) for _ in range(3))
    e.load_state(w, m, np.abs(v))
    got = e.state_host()
    for a, b in zip(got, (w, m, np.abs(v))):
        assert a.tobytes() == b.tobytes()


def _run(cmd, env):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_a_one_rank_launch_writes_the_plain_runs_files(tmp_path):
    """`andrea train` with RANK=0 WORLD_SIZE=1 (and under torchrun) trains through NCCL; its
    model.bin, state, loss and samples are the plain single process's, byte for byte."""
    from tests.train_helpers import andrea_cmd, child_env, make_data, micro_overrides

    tok, tokens = make_data(tmp_path)
    ov = micro_overrides(0, 12, **{"train.backend": "cupy", "train.precision": "bf16", "train.grad_accum": 2,
                                   "bandit.policy": "ucb1", "train.eval_every": 5})
    runs = {}
    base = child_env()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        base.pop(k, None)
    plain = _run(andrea_cmd("warmup", tok, tokens, tmp_path / "plain", ov), base)
    assert plain.returncode == 0, plain.stderr
    runs["plain"] = tmp_path / "plain"
    env = dict(base, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    manual = _run(andrea_cmd("warmup", tok, tokens, tmp_path / "manual", ov), env)
    assert manual.returncode == 0, manual.stderr
    runs["manual"] = tmp_path / "manual"
    torchrun = shutil.which("torchrun")
    if torchrun:
        cmd = andrea_cmd("warmup", tok, tokens, tmp_path / "torchrun", ov)
        cmd = [torchrun, "--standalone", "--nproc_per_node=1", "-m", "andrea"] + cmd[3:]
        tr = _run(cmd, base)
        assert tr.returncode == 0, tr.stdout + tr.stderr
        runs["torchrun"] = tmp_path / "torchrun"
    names = ("model.bin", "model.state.json", "model.loss.json", "model.samples.json")
    want = {n: _sha(runs["plain"] / n) for n in names}
    for k, d in runs.items():
        assert {n: _sha(d / n) for n in names} == want, k
        assert not list(tmp_path.glob(".*.nccl-*")), "the rendezvous file is removed once every rank has it"
    print(f"one-rank launch byte-identical: {sorted(runs)}", file=sys.stderr)
    assert os.environ.get("NCCL_NVLS_ENABLE", "0") == "0"
