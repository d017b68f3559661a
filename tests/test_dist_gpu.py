"""The NCCL data-parallel path on one GPU (andrea/dist.py, GpuEngine with a comm): world size 1
through NCCL (reduce-scatter, gathered norm partials, sharded AdamW, all-gather) is byte-identical
to the plain engine, step by step and as a whole `andrea train` run under the launcher's
environment (RANK/WORLD_SIZE set by hand, and torchrun --nproc_per_node=1 where it is installed).

    PYTHONPATH=. python3 -m pytest -m gpu tests/test_dist_gpu.py      # on a machine with a GPU

Also on one GPU: the world > 1 arena and sharded kernels with 2 and 3 ranks as threads over an
in-process CuPy communicator (NCCL refuses two ranks on one device), against one engine of the
whole batch. On two GPUs or more (skipped below that): real NCCL at N = 2 under torchrun, the
1-GPU run's windows, one checkpoint per signal, bit-exact resume after SIGTERM. Skipped cleanly
without CuPy, a CUDA device or CuPy's NCCL. The targets (scaling, 200-step loss, memory at N = 8):
bench/multi_gpu.py on an x2/x4/x8 machine.
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
    from train_helpers import andrea_cmd, child_env, make_data, micro_overrides

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


class CupyGroup:
    """N ranks as threads on one GPU (NCCL refuses two ranks on a device): each collective copies
    on the caller's stream, waits for it, meets the others at a barrier, sums in rank order."""

    def __init__(self, n):
        import threading

        self.n, self.bar, self.slots = n, threading.Barrier(n, timeout=120), [None] * n

    def comm(self, rank):
        return CupyFakeComm(self, rank)


class CupyFakeComm:
    def __init__(self, group, rank):
        self.g, self.rank, self.size = group, rank, group.n

    def _exchange(self, x):
        mine = cp.array(x, copy=True)
        cp.cuda.get_current_stream().synchronize()
        self.g.slots[self.rank] = mine
        self.g.bar.wait()
        out = list(self.g.slots)
        self.g.bar.wait()
        return out

    def reduce_scatter(self, full, shard):
        parts, s = self._exchange(full), shard.size
        acc = parts[0][self.rank * s:(self.rank + 1) * s].copy()
        for p in parts[1:]:
            acc += p[self.rank * s:(self.rank + 1) * s]
        shard[...] = acc

    def all_gather(self, shard, full):
        full[...] = cp.concatenate(self._exchange(shard))

    def allreduce_max(self, host):
        return np.max(np.stack([cp.asnumpy(p) for p in self._exchange(cp.asarray(host))]), axis=0)

    def barrier(self):
        self._exchange(cp.zeros(1, dtype=np.int32))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("prec,rtol", [("fp32", 2e-3), ("bf16", 3e-2)])
def test_sharded_kernels_at_several_ranks_track_one_engine_of_the_whole_batch(world, prec, rtol):
    """The world > 1 arena and kernels (padded w/g, m/v shards, offset AdamW with its 16-bit copy,
    the gathered norm partials, the losses' mean, m/v gathered and loaded back): N ranks on one GPU
    agree bit for bit with each other and track one engine that trains on the whole batch."""
    import threading

    from andrea.cuda.backend import make_backend

    be, rows = make_backend(), 6
    ref = be.make_engine(MC, rows, prec, cuda_graph=False)
    ref.init_weights(7)
    group = CupyGroup(world)
    engines = [be.make_engine(MC, rows // world, prec, cuda_graph=False, comm=group.comm(r)) for r in range(world)]
    for e in engines:
        e.init_weights(7)
    hp = Hyper(grad_clip=1.0)
    got, errs = [[] for _ in range(world)], []

    def body(r, data, t):
        try:
            part = [(x[r * (rows // world):(r + 1) * (rows // world)], y[r * (rows // world):(r + 1) * (rows // world)])
                    for x, y in data]
            got[r].append(engines[r].train_step(iter(part), 1e-3, t, hp, n_micro=len(part)))
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
            group.bar.abort()

    want = []
    for step in range(3):
        data = batches(100 + step, 2, b=rows)
        want.append(ref.train_step(iter(data), 1e-3, step + 1, hp, n_micro=2))
        ts = [threading.Thread(target=body, args=(r, data, step + 1)) for r in range(world)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errs, errs
    for step in range(3):
        rs = [got[r][step] for r in range(world)]
        assert len({(x.loss, x.grad_norm, x.ok) for x in rs}) == 1          # one float on every rank
        assert rs[0].loss == pytest.approx(want[step].loss, rel=rtol)
        assert rs[0].grad_norm == pytest.approx(want[step].grad_norm, rel=10 * rtol)
    states = [None] * world

    def gather(r):
        with engines[r].stream:
            states[r] = engines[r].state_host()

    ts = [threading.Thread(target=gather, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    w_ref, m_ref, v_ref = ref.state_host()
    for r in range(world):
        for a, b in zip(states[r], states[0]):
            assert a.tobytes() == b.tobytes()
    # an element whose gradient is near zero may take Adam's step the other way (the sums round
    # differently), so: nearly every element close, and none further than three steps of the lr
    w, m = states[0][0], states[0][1]
    assert np.mean(np.isclose(w, w_ref, rtol=rtol, atol=1e-4)) > 0.99
    assert np.max(np.abs(w - w_ref)) <= 3 * 6 * 1e-3
    assert np.mean(np.isclose(m, m_ref, rtol=10 * rtol, atol=1e-5)) > 0.99
    assert np.abs(w - init_w()).max() > 1e-4                               # the ranks did train
    for r, e in enumerate(engines):                                        # load_state keeps this rank's shard
        e.load_state(*states[0])
        off, length = dist_shard(e)
        assert cp.asnumpy(e.m)[:length].tobytes() == states[0][1][off:off + length].tobytes()
        assert not cp.asnumpy(e.m)[length:].any()


def init_w():
    from andrea.engine.engine import init_params

    return init_params(MC, 7)


def dist_shard(e):
    from andrea import dist

    return dist.shard_range(e.n_params, e.comm.size, e.comm.rank)


def _n_gpus() -> int:
    try:
        return int(cp.cuda.runtime.getDeviceCount()) if cp is not None else 0
    except Exception:  # noqa: BLE001
        return 0


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return sorted(out)


@pytest.mark.skipif(_n_gpus() < 2 or shutil.which("torchrun") is None, reason="needs 2 GPUs and torchrun")
def test_two_gpus_draw_the_one_gpu_runs_windows_and_a_signalled_job_resumes_bit_exactly(tmp_path):
    """Real NCCL at N = 2 (an x2 host): the 1-GPU run's windows, close losses; SIGUSR1 to one rank is
    one checkpoint, SIGTERM to torchrun stops every rank after its checkpoint, the rerun finishes
    with the straight N = 2 run's model.bin."""
    import json
    import signal
    import time

    from train_helpers import andrea_cmd, child_env, make_data, micro_overrides

    tok, tokens = make_data(tmp_path)
    env = dict(child_env(), PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)

    def cmd(out, n):
        ov = micro_overrides(300, 300, **{"train.backend": "cupy", "train.precision": "bf16", "train.grad_accum": 2,
                                          "train.gpus": n, "train.eval_every": 100})
        c = andrea_cmd("warmup", tok, tokens, out, ov)
        return c if n == 1 else ["torchrun", "--standalone", f"--nproc_per_node={n}", "-m", "andrea"] + c[3:]

    for out, n in ((tmp_path / "one", 1), (tmp_path / "two", 2)):
        r = _run(cmd(out, n), env)
        assert r.returncode == 0, r.stdout + r.stderr
    l1, l2 = (json.loads((tmp_path / d / "model.loss.json").read_text()) for d in ("one", "two"))
    assert [r["source"] for r in l1["train"]] == [r["source"] for r in l2["train"]]
    a1, a2 = (np.array([r["loss"] for r in x["train"]]) for x in (l1, l2))
    np.testing.assert_allclose(a2, a1, rtol=1e-1)                  # the sums' rounding only (bf16)
    assert abs(a2[-50:].mean() - a1[-50:].mean()) <= 2e-2 * a1[-50:].mean()
    assert json.loads((tmp_path / "two" / "model.state.json").read_text())["world_size"] == 2

    cut = tmp_path / "cut"
    p = subprocess.Popen(cmd(cut, 2), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sent, t0 = [], time.time()
    for line in p.stdout:
        if "warmup step 50/" in line and not sent:
            os.kill(_children(p.pid)[-1], signal.SIGUSR1)           # one rank (the last one started)
            sent.append("usr1")
        if "warmup step 120/" in line and len(sent) == 1:
            p.send_signal(signal.SIGTERM)                           # the launcher forwards it to every rank
            sent.append("term")
        assert time.time() - t0 < 240
    assert p.wait(timeout=120) != 0 and sent == ["usr1", "term"]
    st = json.loads((cut / "model.state.json").read_text())
    assert 120 <= st["step"] < 300
    ev = json.loads((cut / "model.loss.json").read_text())["events"]
    assert len([e for e in ev if e["detail"] == "SIGUSR1"]) == 1 and len([e for e in ev if e["detail"] == "SIGTERM"]) == 1
    r = _run(cmd(cut, 2), env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (cut / "model.bin").read_bytes() == (tmp_path / "two" / "model.bin").read_bytes()
