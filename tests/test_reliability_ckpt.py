"""Crash safety of a run folder, driven from outside with real processes and real files:
a kill -9 at every file-system call of a checkpoint and at random moments, stale temp
files, SIGTERM in the first fraction of a second, a full disk (simulated ENOSPC and a
real small tmpfs), a run state that cannot be written (NaN), and a pair split by a crash
of an older version (resume and --on-mismatch restart must not get stuck).

    pytest tests/test_reliability_ckpt.py           # ~1-2 min on 2 cores
    python bench/kill_resume.py --kills 100         # the long version, prints counts
"""

from __future__ import annotations

import errno
import json
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest
from rich.console import Console

from andrea.engine import checkpoint as ck
from andrea.errors import AndreaError
from andrea.train import Trainer
from script_helpers import load_script
from train_helpers import andrea_cmd, child_env, make_data, micro_cfg, micro_overrides, run_cli, run_killed

FILES = {"model.bin", "model.state.json", "model.loss.json", "model.samples.json",
         "model.perf.jsonl"}          # the wall-clock sidecar (andrea/runs.py PERF) belongs to the folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data"))


def _bench():
    return load_script("bench/kill_resume.py")


def _trainer(cfg, data, out, **kw):
    tok, tokens = data
    return Trainer(cfg, "warmup", tok, tokens, out, console=Console(stderr=True, force_terminal=False), **kw)


def _extras(out: Path) -> set[str]:
    return {p.name for p in out.iterdir()} - FILES


def _pair_step(out: Path) -> tuple[int, int]:
    st = json.loads((out / "model.state.json").read_text())
    return st["step"], ck.read_checkpoint(out / "model.bin", None)[0]


# ------------------------------------------------------------ kill -9 at every fs call

@pytest.mark.slow
def test_kill_at_every_fs_call_of_a_checkpoint_leaves_a_resumable_folder(data, tmp_path):
    tok, tokens = data
    ov = micro_overrides(4, 4, **{"train.checkpoint_every": 2})
    ref_dir = tmp_path / "ref"
    r = run_cli("warmup", tok, tokens, ref_dir, ov)
    assert r.returncode == 0, r.stderr
    ref = (ref_dir / "model.bin").read_bytes()

    def killed_run(out, kill_at):
        return run_killed("step=2", kill_at, "warmup", tok, tokens, out, ov)

    probe = killed_run(tmp_path / "probe", 10 ** 9)
    assert probe.returncode == 0, probe.stderr
    n_calls = int(probe.stderr.split("FS-CALLS ")[1].split()[0])
    assert n_calls >= 3
    failures = []
    for k in range(1, n_calls + 1):
        out = tmp_path / f"k{k}"
        r = killed_run(out, k)
        assert r.returncode == 137, r.stderr
        r = run_cli("warmup", tok, tokens, out, ov)
        if r.returncode != 0:
            failures.append(f"killed before fs call {k}/{n_calls}: resume exit {r.returncode}: {r.stderr.strip()[-300:]}")
            continue
        if (out / "model.bin").read_bytes() != ref:
            failures.append(f"killed before fs call {k}/{n_calls}: the resumed run differs from the straight run")
        if _extras(out):
            failures.append(f"killed before fs call {k}/{n_calls}: stray files after the resume: {_extras(out)}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_random_sigkills_during_checkpoint_writes(data, tmp_path):
    """The bounded CI version of bench/kill_resume.py: ~20 real SIGKILLs, every chain resumes
    to the straight run's bytes, nothing torn, nothing stray."""
    kr = _bench()
    counts = kr.campaign(tmp_path, kills=20, steps=30, seed=1234, data=data)
    assert counts["kills"] >= 20
    assert counts["torn"] == 0, counts
    assert counts["unresumable"] == 0, counts
    assert counts["stray_after_next_start"] == 0, counts
    assert counts["chains_identical"] == counts["chains"], counts


# ------------------------------------------------------------ stale temps
def test_stale_temp_files_are_removed_on_start_and_nothing_else(data, tmp_path):
    cfg = micro_cfg(4, 4)
    out = tmp_path / "w"
    assert _trainer(cfg, data, out).run() == 0
    stale = [out / ".model.bin.k3j2_x.tmp", out / ".model.state.json.ab12cd.tmp", out / ".model.loss.json.zz.tmp",
             out / ".model.samples.json.q.tmp"]
    for p in stale:
        p.write_bytes(b"\0" * 1000)
    (out / ".checkpoint.pending").mkdir()
    (out / ".checkpoint.pending" / "model.bin").write_bytes(b"\0" * 10)
    (out / "notes.txt").write_text("mine")
    (out / ".model.bin.keep").write_text("mine too")
    assert _trainer(cfg, data, out).run() == 0
    assert not [p for p in stale if p.exists()]
    assert not (out / ".checkpoint.pending").exists()
    assert (out / "notes.txt").read_text() == "mine" and (out / ".model.bin.keep").exists()


# ------------------------------------------------------------ SIGTERM early
@pytest.mark.slow
def _wait_until_sigterm_is_caught(pid: int) -> None:
    """Until the child's SIGTERM disposition is a handler (Linux /proc; elsewhere 0.3 s). Before
    that the interpreter and `import andrea.cli` start (~0.1 s), and no stage code has run."""
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        time.sleep(0.3)
        return
    t0 = time.time()
    while time.time() - t0 < 10:
        try:
            caught = int(next(ln for ln in status.read_text().splitlines() if ln.startswith("SigCgt")).split()[1], 16)
        except (FileNotFoundError, StopIteration):
            return
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.001)


@pytest.mark.parametrize("resume", [False, True])
def test_sigterm_in_the_first_fraction_of_a_second_ends_cleanly(data, tmp_path, resume):
    """SIGTERM while the process imports, reads params, loads data and builds the engine:
    exit 0, no traceback, a consistent pair (a resumed run's checkpoint left as it was)."""
    tok, tokens = data
    ov = micro_overrides(200, 200)
    out = tmp_path / "w"
    before = None
    if resume:
        tr = _trainer(micro_cfg(200, 200), data, out)
        tr.end = 3                                  # a run of this config stopped at step 3
        assert tr.run() == 0
        before = (out / "model.bin").read_bytes()
    expect = 3 if resume else 0
    for delay in (0.0, 0.05, 0.15, 0.3):      # seconds after the handler is in place
        p = subprocess.Popen(andrea_cmd("warmup", tok, tokens, out, ov), env=child_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        _wait_until_sigterm_is_caught(p.pid)
        time.sleep(delay)
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=120)[1]
        assert p.returncode == 143, f"SIGTERM at {delay}s: exit {p.returncode}\n{err}"
        assert "Traceback" not in err
        early = "SIGTERM before the first step" in err
        if delay <= 0.05:            # still importing numpy / reading params: always before the first step
            assert early, err
        st, sb = _pair_step(out)
        assert st == sb
        if early:
            assert st == expect
            if before is not None:
                assert (out / "model.bin").read_bytes() == before      # the previous state, untouched
        else:                        # the setup was quicker than the delay: a SIGTERM in the loop
            assert "SIGTERM: checkpoint at step" in err and st > expect, err
            expect = st
        before = (out / "model.bin").read_bytes()
        assert not _extras(out)
    r = run_cli("warmup", tok, tokens, out, ov)                     # and the folder runs to the end
    assert r.returncode == 0, r.stderr
    assert _pair_step(out) == (200, 200)


# ------------------------------------------------------------ disk full
def test_enospc_while_checkpointing_is_one_line_and_keeps_the_previous_pair(data, tmp_path, monkeypatch):
    cfg = micro_cfg(6, 6, **{"train.checkpoint_every": 2})
    out = tmp_path / "w"
    tr = _trainer(cfg, data, out)
    real_write = ck.write_checkpoint
    calls = []
    import io

    class FullFile(io.FileIO):
        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_after_first(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            return real_write(*a, **k)
        import builtins
        real_open = builtins.open

        def open_full(f, mode="r", *x, **y):
            if "w" in mode and "b" in mode:
                return FullFile(f, "w")
            return real_open(f, mode, *x, **y)
        monkeypatch.setattr(builtins, "open", open_full)
        try:
            return real_write(*a, **k)
        finally:
            monkeypatch.setattr(builtins, "open", real_open)

    monkeypatch.setattr(ck, "write_checkpoint", full_after_first)
    with pytest.raises(AndreaError) as ei:
        tr.run()
    msg = str(ei.value)
    assert "\n" not in msg and "model.bin" in msg and "space" in msg.lower(), msg
    assert "step 2" in msg, msg                               # names the checkpoint that survives
    assert _pair_step(out) == (2, 2)
    assert not _extras(out)
    monkeypatch.setattr(ck, "write_checkpoint", real_write)
    assert _trainer(cfg, data, out).run() == 0
    assert _pair_step(out) == (6, 6)


def _mount_tmpfs(path: Path, size: str) -> str | None:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exit {r.returncode}")


@pytest.mark.slow
def test_real_full_disk_on_a_small_tmpfs(data, tmp_path):
    tok, tokens = data
    ov = micro_overrides(8, 8, **{"train.checkpoint_every": 2})
    mnt = tmp_path / "mnt"
    why = _mount_tmpfs(mnt, "700k")      # one checkpoint (~420 kB) + its files fit, a second copy does not
    if why:
        pytest.skip(f"cannot mount a tmpfs here ({why})")
    try:
        out = mnt / "w"
        r = run_cli("warmup", tok, tokens, out, ov)
        err = r.stderr.strip()
        assert r.returncode == 2, err
        assert "Traceback" not in err
        last = err.splitlines()[-1]
        assert last.startswith("andrea train: error:") and "model.bin" in last and "space" in last.lower(), last
        st, sb = _pair_step(out)
        assert st == sb == 2
        assert not _extras(out)
        subprocess.run(["mount", "-o", "remount,size=4m", str(mnt)], check=True)
        r = run_cli("warmup", tok, tokens, out, ov)
        assert r.returncode == 0, r.stderr
        assert _pair_step(out) == (8, 8)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


# ------------------------------------------------------------ a state that cannot be written
def test_a_nan_in_the_run_state_never_leaves_a_half_written_pair(data, tmp_path, monkeypatch):
    cfg = micro_cfg(6, 6, **{"train.checkpoint_every": 2})
    out = tmp_path / "w"
    tr = _trainer(cfg, data, out)
    orig = Trainer.checkpoint
    seen = []

    def checkpoint(self, why):
        seen.append(self.step)
        if self.step == 4:
            real = self.cur.state_dict
            self.cur.state_dict = lambda: {**real(), "reward_ema": float("nan")}
        return orig(self, why)

    monkeypatch.setattr(Trainer, "checkpoint", checkpoint)
    with pytest.raises(AndreaError) as ei:
        tr.run()
    assert "NaN" in str(ei.value) or "nan" in str(ei.value), str(ei.value)
    assert _pair_step(out) == (2, 2)
    assert not _extras(out)


# ------------------------------------------------------------ a pair split by an older version
def _split(out: Path) -> None:
    """Make model.bin one step ahead of model.state.json, as the old writer left it."""
    raw = bytearray((out / "model.bin").read_bytes())
    step, n = struct.unpack("<ii", raw[:8])
    raw[:8] = struct.pack("<ii", step + 1, n)
    (out / "model.bin").write_bytes(bytes(raw))


def test_a_split_pair_is_refused_clearly_and_restart_moves_it_aside(data, tmp_path):
    cfg = micro_cfg(4, 4)
    out = tmp_path / "w"
    assert _trainer(cfg, data, out).run() == 0
    _split(out)
    with pytest.raises(AndreaError, match="--on-mismatch restart"):
        _trainer(cfg, data, out).run()
    assert _trainer(cfg, data, out, on_mismatch="restart").run() == 0
    assert _pair_step(out) == (4, 4)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("w.stale-")]
    # a model.bin with no state at all (the very first checkpoint, split)
    (out / "model.state.json").unlink()
    assert _trainer(cfg, data, out, on_mismatch="restart").run() == 0
    assert _pair_step(out) == (4, 4)


def test_a_nan_param_failing_mid_run_keeps_the_last_whole_pair(data, tmp_path, monkeypatch):
    """A NaN learning rate from step 3 on (what `-S train.lr=.nan` did before the schema refused it)
    reaches the history; the run ends in one line naming the key, the step-2 pair untouched."""
    import andrea.train as T

    real = T.lr_at
    monkeypatch.setattr(T, "lr_at", lambda step, *a: float("nan") if step >= 3 else real(step, *a))
    cfg = micro_cfg(8, 8, **{"train.checkpoint_every": 2})
    out = tmp_path / "w"
    with pytest.raises(AndreaError) as ei:
        _trainer(cfg, data, out).run()
    msg = str(ei.value)
    assert "\n" not in msg and "lr=nan" in msg and "step 2" in msg, msg
    assert _pair_step(out) == (2, 2)
    assert not _extras(out)
    monkeypatch.setattr(T, "lr_at", real)
    assert _trainer(cfg, data, out).run() == 0            # and it resumes from there
    assert _pair_step(out) == (8, 8)


def test_enospc_while_writing_the_history_between_checkpoints(data, tmp_path, monkeypatch):
    from andrea import runs

    cfg = micro_cfg(6, 6, **{"train.checkpoint_every": 2})
    out = tmp_path / "w"
    tr = _trainer(cfg, data, out)
    real = runs.atomic_write_bytes
    orig_ck = Trainer.checkpoint

    def checkpoint(self, why):
        orig_ck(self, why)
        if self.step == 2:               # the disk fills up right after the step-2 checkpoint
            def full(path, data):
                raise OSError(errno.ENOSPC, "No space left on device")
            monkeypatch.setattr(runs, "atomic_write_bytes", full)
            self._last_loss_write = 0.0  # the next logged step writes the history
    monkeypatch.setattr(Trainer, "checkpoint", checkpoint)
    with pytest.raises(AndreaError) as ei:
        tr.run()
    msg = str(ei.value)
    assert "\n" not in msg and "model.loss.json" in msg and "no space left" in msg and "step 2" in msg, msg
    assert _pair_step(out) == (2, 2)
    monkeypatch.setattr(runs, "atomic_write_bytes", real)
    monkeypatch.setattr(Trainer, "checkpoint", orig_ck)
    assert _trainer(cfg, data, out).run() == 0
    assert _pair_step(out) == (6, 6)
