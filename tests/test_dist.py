"""Data-parallel training on the CPU (andrea/dist.py): the launcher's environment, the shard
arithmetic, ZeRO-1 over N in-process ranks against the unsharded update, and the one curriculum
seen by every rank. The NCCL path itself: tests/test_dist_gpu.py. Run: pytest tests/test_dist.py"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from andrea import dist
from andrea.errors import AndreaError, ConfigError
from dist_helpers import NumpyZero1, run_ranks


# ----------------------------------------------------------------------------- the launcher
def test_launch_env_reads_torchrun_mpi_and_slurm_and_nothing_is_one_process():
    assert dist.launch_env({}) is None
    t = dist.launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                         "TORCHELASTIC_RUN_ID": "abc"})
    assert (t.rank, t.world, t.local_rank, t.local_world, t.launcher, t.key) == (3, 4, 1, 2, "torchrun", "abc")
    one = dist.launch_env({"RANK": "0", "WORLD_SIZE": "1"})          # one rank through the NCCL path
    assert (one.rank, one.world, one.local_rank) == (0, 1, 0)
    m = dist.launch_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8",
                         "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"})
    assert (m.rank, m.world, m.local_rank, m.launcher) == (2, 8, 2, "mpi")
    s = dist.launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                         "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"})
    assert (s.rank, s.world, s.local_rank, s.local_world, s.key) == (5, 8, 1, 4, "77.0")
    assert dist.launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None   # every batch job has these


def test_launch_env_and_world_refusals_name_the_variable_or_key():
    with pytest.raises(ConfigError, match="WORLD_SIZE='x'"):
        dist.launch_env({"RANK": "0", "WORLD_SIZE": "x"})
    with pytest.raises(ConfigError, match="rank 4 of world size 4"):
        dist.launch_env({"RANK": "4", "WORLD_SIZE": "4"})
    launch = dist.launch_env({"RANK": "0", "WORLD_SIZE": "2"})
    assert dist.check_world(2, launch) == 2 and dist.check_world(1, None) == 1
    with pytest.raises(ConfigError, match="train.gpus=2 but no launcher.*nproc_per_node=2"):
        dist.check_world(2, None)
    with pytest.raises(ConfigError, match="train.gpus=4 but the torchrun launcher started 2"):
        dist.check_world(4, launch)
    assert dist.local_batch(16, 4) == 4
    with pytest.raises(ConfigError, match="train.batch_size=6 does not split over 4 GPUs"):
        dist.local_batch(6, 4)


def test_nccl_env_keeps_multicast_off_and_loopback_on_one_host_without_overriding():
    env = {}
    dist.nccl_env(dist.Launch(0, 2, 0, 2, "torchrun", "k"), env)
    assert env == {"NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": "lo"}
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    dist.nccl_env(dist.Launch(0, 8, 0, 4, "slurm", "k"), env)          # two hosts: the caller's interface
    assert env == {"NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": "ib0"}


def test_each_rank_takes_its_local_gpu_or_the_one_its_launcher_left_visible():
    launch = dist.Launch(5, 8, 1, 4, "slurm", "k")
    assert dist.device_of(launch, 4) == 1
    assert dist.device_of(launch, 1) == 0                       # srun --gpus-per-task=1
    with pytest.raises(AndreaError, match="local rank 3 but this process sees 2 GPU"):
        dist.device_of(dist.Launch(3, 4, 3, 4, "torchrun", "k"), 2)


# ----------------------------------------------------------------------------- shard arithmetic
@pytest.mark.parametrize("n", [1, 63, 64, 1000, 123_457, 7_000_001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shards_tile_the_buffer_once_aligned_and_padding_is_small(n, world):
    s = dist.shard_size(n, world)
    if world == 1:
        assert s == n                                   # one rank: the arena is the plain engine's
    else:
        assert s % dist.SHARD_ALIGN == 0 and world * s >= n
        assert world * s - n < world * dist.SHARD_ALIGN + world
    covered = np.zeros(n, dtype=np.int32)
    n_decay = (2 * n) // 3
    decay = 0
    for r in range(world):
        off, length = dist.shard_range(n, world, r)
        assert off == r * s and 0 <= length <= s
        covered[off:off + length] += 1
        d = dist.decay_in_shard(n_decay, off, length)
        assert 0 <= d <= length and (d == length or off + d == n_decay or d == 0)
        decay += d
    assert covered.min() == 1 and covered.max() == 1
    assert decay == n_decay


def test_rank_rows_split_the_microbatch_and_global_mean_is_rank_ordered():
    x = np.arange(24).reshape(8, 3)
    parts = [dist.rank_rows(x, r, 4) for r in range(4)]
    np.testing.assert_array_equal(np.concatenate(parts), x)
    for b in (0, 1, 3, 8, 11):                            # a short held-out batch: shares, some empty
        x = np.arange(b * 2).reshape(b, 2)
        np.testing.assert_array_equal(np.concatenate([dist.rank_share(x, r, 4) for r in range(4)]), x)
    assert run_ranks(3, lambda c: dist.sum_over_ranks(c, [c.rank + 0.5, 2])) == [[4.5, 6.0]] * 3
    assert dist.global_mean([2.5]) == 2.5
    vals = [0.1, 0.2, 0.7]
    assert dist.global_mean(vals) == ((0.0 + 0.1) + 0.2 + 0.7) / 3


# ----------------------------------------------------------------------------- N ranks in one process
def _state(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n).astype(np.float32), (rng.standard_normal(n) * 1e-2).astype(np.float32),
            (rng.random(n) * 1e-3).astype(np.float32))


def zero1_run(world, n, n_decay, grads, clip, w0, m0, v0, n_micro=2):
    """Every rank's (w, gathered m, gathered v, gstate, padded w) after one ZeRO-1 step whose rank r
    accumulated grads[r]."""
    s = dist.shard_size(n, world)

    def rank(comm):
        off, length = dist.shard_range(n, world, comm.rank)
        pad = lambda a: np.concatenate([a, np.zeros(world * s - n, np.float32)])
        w, g = pad(w0), pad(grads[comm.rank])
        m, v = np.zeros(s, np.float32), np.zeros(s, np.float32)
        m[:length], v[:length] = m0[off:off + length], v0[off:off + length]
        k = NumpyZero1(w, g, m, v, world, clip, 1.0 / (n_micro * world))
        dist.zero1_update(comm, k, n, n_decay)
        mg, vg = np.zeros(world * s, np.float32), np.zeros(world * s, np.float32)
        comm.all_gather(m, mg)
        comm.all_gather(v, vg)
        return w[:n].copy(), mg[:n], vg[:n], k.gstate, w[n:].copy()

    return run_ranks(world, rank)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero1_update_is_the_unsharded_update_bit_for_bit_without_clipping(world):
    n, n_decay = 1000, 700
    w0, m0, v0 = _state(n, 1)
    rng = np.random.default_rng(2)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    total = grads[0].copy()
    for gr in grads[1:]:                    # the unsharded step's gradient: the same sum, in rank order
        total += gr
    (w1, m1, v1, st1, _), = zero1_run(1, n, n_decay, [total], 0.0, w0, m0, v0, n_micro=2 * world)
    got = zero1_run(world, n, n_decay, grads, 0.0, w0, m0, v0)
    for w, m, v, st, wpad in got:           # every rank: the same weights; the moments gathered whole
        assert w.tobytes() == w1.tobytes() and m.tobytes() == m1.tobytes() and v.tobytes() == v1.tobytes()
        assert not wpad.any()               # the padding is never updated
        assert st[2] and st[0] == pytest.approx(st1[0], rel=1e-12)
    assert w1.tobytes() != w0.tobytes()


def test_zero1_clips_on_the_global_norm_the_same_on_every_rank():
    n, n_decay, world = 777, 500, 4
    w0, m0, v0 = _state(n, 3)
    rng = np.random.default_rng(4)
    grads = [(rng.standard_normal(n) * 10).astype(np.float32) for _ in range(world)]
    total = grads[0].copy()
    for gr in grads[1:]:
        total += gr
    want = float(np.linalg.norm(total.astype(np.float64))) / (2 * world)
    (w1, m1, v1, st1, _), = zero1_run(1, n, n_decay, [total], 1.0, w0, m0, v0, n_micro=2 * world)
    got = zero1_run(world, n, n_decay, grads, 1.0, w0, m0, v0)
    assert st1[0] == pytest.approx(want, rel=1e-12) and st1[0] > 1.0     # the clip is active
    norms = {st[0] for *_, st, _ in got}
    assert len(norms) == 1 and norms.pop() == pytest.approx(want, rel=1e-12)    # one float on every rank
    for w, m, v, st, _ in got:
        assert w.tobytes() == got[0][0].tobytes()
        np.testing.assert_allclose(w, w1, rtol=1e-6, atol=1e-7)          # the norm's sum order only
        np.testing.assert_allclose(m, m1, rtol=1e-6, atol=1e-9)


def test_zero1_skips_the_step_on_every_rank_when_one_rank_has_a_nan():
    n, world = 300, 3
    w0, m0, v0 = _state(n, 5)
    grads = [np.ones(n, np.float32) for _ in range(world)]
    grads[1][17] = np.nan                   # only rank 1's shard holds it: every rank must still skip
    got = zero1_run(world, n, 200, grads, 1.0, w0, m0, v0)
    for w, m, v, st, _ in got:
        assert not st[2]
        assert w.tobytes() == w0.tobytes() and m.tobytes() == m0.tobytes() and v.tobytes() == v0.tobytes()


def test_agree_flags_makes_one_ranks_signal_every_ranks():
    got = run_ranks(3, lambda c: dist.agree_flags(c, [0, int(c.rank == 2)]))
    assert got == [[0, 1]] * 3
    assert dist.agree_flags(None, [1, 0]) == [1, 0]


# ----------------------------------------------------------------------------- one curriculum
def test_every_rank_runs_one_curriculum_and_draws_its_own_rows(tmp_path):
    """The trainer's rule (andrea/train.py _one_step + GpuEngine.micro_step): each rank draws the
    whole microbatch, keeps its rows, and observes the rank-ordered mean loss; every rank's bandit
    state, pulls and coverage stay those of a single process drawing the same batches."""
    from andrea.curriculum import make_curriculum
    from andrea.settings import Settings
    from train_helpers import make_data, micro_cfg
    from andrea.train import load_shards

    tok, tokens = make_data(tmp_path)
    cfg = micro_cfg(0, 40, **{"bandit.policy": "ucb1", "bandit.dice_main": 3})
    st = Settings.from_dict(cfg)
    shards = load_shards(tokens, "train", 280)
    world, B, T = 4, 8, 16

    def loss_of(x):                          # a deterministic stand-in for the model's loss of these rows
        return float(np.mean(x % 7)) / 3.0

    single = make_curriculum(st.curriculum, st.bandit, shards, "main", st.seed)
    ranks = [make_curriculum(st.curriculum, st.bandit, shards, "main", st.seed) for _ in range(world)]
    pulls_single, pulls_ranks = [], [[] for _ in range(world)]
    for step in range(60):
        src, x, _ = single.next_batch(B, T)
        drawn = [c.next_batch(B, T) for c in ranks]
        rows = [dist.rank_rows(x_r, r, world) for r, (_, x_r, _) in enumerate(drawn)]
        assert all(s == src for s, _, _ in drawn)
        np.testing.assert_array_equal(np.concatenate(rows), x)           # the ranks' rows are the batch
        assert len({r.tobytes() for r in rows}) == world                 # each rank trains on other windows
        loss = dist.global_mean([loss_of(r) for r in rows])
        rec = single.observe(step, src, loss)
        if rec:
            pulls_single.append(rec)
        for r, c in enumerate(ranks):
            rr = c.observe(step, src, loss)
            if rr:
                pulls_ranks[r].append(rr)
    want = single.state_dict()
    for r, c in enumerate(ranks):
        assert c.state_dict() == want and pulls_ranks[r] == pulls_single
    assert len(pulls_single) > 5
    drawn_tokens = sum(s["tokens_drawn"] for s in want["sources"].values())
    assert drawn_tokens == 60 * B * T                                    # the whole global batch is counted


# ----------------------------------------------------------------------------- the trainer's refusals
def test_trainer_refuses_gpus_without_a_launcher_and_numpy_under_one(tmp_path, monkeypatch):
    from andrea.train import Trainer
    from train_helpers import make_data, micro_cfg

    tok, tokens = make_data(tmp_path)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match="train.gpus=2 but no launcher"):
        Trainer(micro_cfg(0, 4, **{"train.gpus": 2}), "warmup", tok, tokens, tmp_path / "run")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="train.gpus=1 but the torchrun launcher started 2"):
        Trainer(micro_cfg(0, 4), "warmup", tok, tokens, tmp_path / "run")
    monkeypatch.setattr(dist.NcclComm, "create", classmethod(lambda cls, launch, rdv: object()))
    with pytest.raises(AndreaError, match="runs on the cupy backend with NCCL, not on numpy"):
        Trainer(micro_cfg(0, 4, **{"train.gpus": 2}), "warmup", tok, tokens, tmp_path / "run")


def test_zero1_arena_holds_one_shard_of_m_and_v_and_one_rank_is_the_plain_arena():
    """Optimizer memory per GPU falls as 1/N (the target: at N = 8 at most 1/6 of one GPU's)."""
    from andrea.cuda.engine import arena_layout
    from andrea.engine.model import ModelConfig

    mc = ModelConfig(vocab_size=50257, d_model=768, n_head=12, n_layer=12, context=1024)   # andrea-120m's shape
    one = arena_layout(mc, 8, "bf16")
    assert arena_layout(mc, 8, "bf16", world=1) == one
    sizes = lambda a: {name: int(np.prod(shape)) for name, shape, _ in a.spec}
    n = sizes(one)["m"]
    for world in (2, 4, 8):
        a = sizes(arena_layout(mc, 8, "bf16", world))
        s = dist.shard_size(n, world)
        assert a["m"] == a["v"] == s and a["w"] == a["g"] == world * s
        assert a["norm_all"] == world * sizes(one)["norm_part"] and a["loss_all"] == world
    a8 = sizes(arena_layout(mc, 8, "bf16", 8))
    assert (a8["m"] + a8["v"]) * 6 <= 2 * n


# ----------------------------------------------------------------------------- launch from the stage command
def test_the_stage_command_becomes_torchrun_when_train_gpus_asks_for_more(monkeypatch, tmp_path):
    """`andrea train ...` with train.gpus = 4 and no launcher execs torchrun with the same arguments
    (Snakemake, DVC and a SLURM job run the one stage command); without torchrun the refusal names
    the other launchers."""
    import os
    import sys as _sys

    import andrea.train as T
    from train_helpers import micro_cfg

    assert T.launcher_cmd(4, ["train", "--phase", "warmup"], which=lambda _: "/x/torchrun", torch_here=False) == [
        "/x/torchrun", "--standalone", "--nproc_per_node=4", "-m", "andrea", "train", "--phase", "warmup"]
    assert T.launcher_cmd(2, ["train"], torch_here=True) == [
        _sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "andrea", "train"]
    with pytest.raises(AndreaError, match="mpirun -np 2 andrea train.*srun --ntasks=2"):
        T.launcher_cmd(2, ["train"], which=lambda _: None, torch_here=False)
    for k in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    execd = []

    class Exec(Exception):
        pass

    def fake_exec(path, cmd):
        execd.append(cmd)
        raise Exec

    monkeypatch.setattr(T, "CLI_PROCESS", True)
    monkeypatch.setattr(os, "execvp", fake_exec)
    monkeypatch.setattr(T, "launcher_cmd", lambda g, argv: ["torchrun", f"--nproc_per_node={g}", "-m", "andrea", *argv])
    monkeypatch.setattr(_sys, "argv", ["andrea", "train", "--phase", "warmup", "-S", "train.gpus=4"])
    import signal

    old = signal.getsignal(signal.SIGUSR1)
    try:
        with pytest.raises(Exec):
            T.run(None, micro_cfg(0, 4, **{"train.gpus": 4}))
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN     # torchrun inherits it: never dies of one
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert execd == [["torchrun", "--nproc_per_node=4", "-m", "andrea", "train", "--phase", "warmup", "-S",
                      "train.gpus=4"]]
    monkeypatch.setattr(T, "EARLY_SIGNALS", [15])
    assert T.run(None, micro_cfg(0, 4, **{"train.gpus": 4})) == T.STOPPED     # a SIGTERM before it: stopped


def test_a_training_job_asks_the_scheduler_for_train_gpus_gpus():
    from andrea.resources import stage_resources
    from train_helpers import micro_cfg

    one = stage_resources("train", micro_cfg(0, 4, **{"train.backend": "cupy"}), phase="warmup")
    four = stage_resources("train", micro_cfg(0, 4, **{"train.backend": "cupy", "train.gpus": 4}), phase="warmup")
    assert one["gpu"] == 1 and four["gpu"] == 4
    assert four["threads"] == 4 * one["threads"] and four["mem_mb"] >= 4 * one["mem_mb"] - 4


def test_rank_0s_nccl_id_reaches_the_others_through_a_file_beside_the_run_folder(tmp_path, monkeypatch):
    uid = tuple(range(-64, 64))
    launches = [dist.Launch(r, 3, r, 3, "torchrun", "run:1/x") for r in range(3)]
    path = dist.rendezvous_path(tmp_path / "runs" / "main", launches[0])
    assert path.parent == tmp_path / "runs" and path.name == ".main.nccl-run_1_x"     # no separator from the key
    got = [None] * 3

    def rank(r):
        got[r] = dist._share_id(launches[r], uid if r == 0 else None, path)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]    # the readers start first
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [uid] * 3
    path.unlink()
    monkeypatch.setenv("ANDREA_NCCL_TIMEOUT", "0.2")
    with pytest.raises(AndreaError, match=r"\.main\.nccl-run_1_x: rank 0's NCCL id did not appear within 0 s"):
        dist._share_id(launches[1], None, path)
    monkeypatch.setenv("ANDREA_NCCL_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="ANDREA_NCCL_TIMEOUT='soon'"):
        dist._share_id(launches[1], None, path)
