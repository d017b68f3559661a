"""The polish (the last curriculum.polish_steps of the main run, andrea/phases.py) and the SMMA of
the training loss: the phase table and its LR shape, the pivot's checkpoint and archive, bit-exact
resume across the pivot (stopped before it, at it, after it), polish off, the one-line refusals.

    pytest tests/test_polish.py
"""

from __future__ import annotations

import json
import math
import re
import signal
from dataclasses import replace

import numpy as np
import pytest
from rich.console import Console

from andrea import cli
from andrea.config import load_config
from andrea.engine.schedule import cosine, lr_at
from andrea.errors import ConfigError
from andrea.phases import phase_at, phase_table
from andrea.settings import Settings
from andrea.train import STOPPED, Hook, Trainer, smma_update
from train_helpers import ROOT, make_data, micro_cfg

WARMUP, TOTAL, POLISH = 10, 60, 15
PIVOT = TOTAL - POLISH
POLISH_SOURCES = ["chat-system", "py-code"]
ON = {"curriculum.polish_steps": POLISH, "curriculum.polish_sources": "[chat-system, py-code]",
      "bandit.policy": "ucb1", "train.smma_period": 7}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def warm(data, tmp_path_factory):
    """One warmup run per config, shared by the tests (``key``: polish on or off)."""
    made = {}

    def get(key: str):
        if key not in made:
            out = tmp_path_factory.mktemp(f"warmup-{key}")
            assert _trainer(_cfg(key), "warmup", data, out).run() == 0
            made[key] = out
        return made[key]
    return get


def _cfg(key: str) -> dict:
    return micro_cfg(WARMUP, TOTAL, **(ON if key == "on" else {**ON, "curriculum.polish_steps": 0}))


def _trainer(cfg, phase, data, out, init=None):
    tok, tokens = data
    return Trainer(cfg, phase, tok, tokens, out, init, console=Console(stderr=True, force_terminal=False))


def _stop_at(step: int) -> Hook:
    """A hook that raises SIGTERM in the loop after ``step`` (the real signal path: checkpoint, exit)."""
    return Hook("stop", step, lambda tr, s: tr._signals.append(signal.SIGTERM) if s == step else None)


def _main(data, warm, out, key="on", stop: int | None = None) -> int:
    tr = _trainer(_cfg(key), "main", data, out, init=warm(key))
    if stop is not None:
        tr.hooks.append(_stop_at(stop))
    return tr.run()


def _loss(out) -> dict:
    return json.loads((out / "model.loss.json").read_text())


# ---------------------------------------------------------------- the table and the LR shape
def test_phase_table_and_the_polish_lr_shape():
    s = Settings.from_dict(load_config(ROOT / "params.yaml", "tiny"))
    table = phase_table(s.train, s.curriculum)
    assert [(r.name, r.stage, r.start, r.end, r.lr) for r in table] == [
        ("warmup", "warmup", 0, 150, "cosine"), ("main", "main", 150, 550, "cosine"),
        ("polish", "main", 550, 600, "to-min")]
    assert table[2].sources == ("chat-system", "chat-single", "chat-multi") and table[2].archive == "polish"
    assert table[1].sources is None
    assert phase_at(table, 549).name == "main" and phase_at(table, 550).name == "polish"
    t = s.train
    lrs = [lr_at(k, t, table) for k in range(600)]
    assert lrs[:550] == [cosine(k, t) for k in range(550)]          # before the polish: the bits of the base
    assert lrs[550] == cosine(550, t) and lrs[599] == t.min_lr          # continuous in, the floor on the last step
    d = np.diff(lrs[550:])
    assert np.allclose(d, d[0], rtol=0, atol=1e-15) and d[0] < 0        # a straight line down
    assert lr_at(123, t) == cosine(123, t)                              # no table: the base
    off = phase_table(t, replace(s.curriculum, polish_steps=0))
    assert [r.name for r in off] == ["warmup", "main"] and off[-1].end == 600


@pytest.mark.parametrize("override, match", [
    ("curriculum.polish_steps=451", r"curriculum\.polish_steps=451 > the main phase's 450 steps"),
    ("curriculum.polish_sources=[chat-system, chat-robot]", r"curriculum\.polish_sources\[1\]: unknown source 'chat-robot'"),
    ("curriculum.polish_sources=[]", r"curriculum\.polish_sources: \[\] should be non-empty"),
    ("curriculum.polish_steps=-1", r"curriculum\.polish_steps: -1 is less than the minimum of 0"),
    ("train.smma_period=0", r"train\.smma_period: 0 is less than the minimum of 1"),
    ("bandit.floors.chat-robot=0.1", r"bandit\.floors\.chat-robot: unknown source"),
    ("bandit.floors.chat-multi=1.5", r"bandit\.floors\.chat-multi: 1\.5 is greater than the maximum of 1"),
])
def test_bad_polish_params_are_one_line_config_errors(override, match, capsys, monkeypatch, data, tmp_path):
    if "unknown source" in match:       # the train stage's check (other stages may rename the sources)
        with pytest.raises(ConfigError, match=match):
            _trainer(load_config(ROOT / "params.yaml", "tiny", [override]), "warmup", data, tmp_path / "w")
    else:
        with pytest.raises(ConfigError, match=match):
            load_config(ROOT / "params.yaml", "tiny", [override])
    monkeypatch.chdir(ROOT)
    rc = cli.main(["train", "--phase", "main", "--profile", "tiny", "-S", override, "--tokenizer", "t.json",
                   "--tokens", "none", "--out", "none"])
    err = capsys.readouterr().err.strip()
    assert rc == 3 and "\n" not in err and "Traceback" not in err and re.search(match, err), err
    assert load_config(ROOT / "params.yaml", "tiny", ["curriculum.polish_steps=450"])   # the whole main phase is fine


# ---------------------------------------------------------------- SMMA
def _smma_ref(losses, n):
    s = None
    for x in np.asarray(losses, dtype=np.float64):
        if np.isfinite(x):
            s = x if s is None else s + (x - s) / np.float64(n)
        yield None if s is None else float(s)


def test_smma_update_matches_a_numpy_reference_and_skips_non_finite():
    rng = np.random.default_rng(3)
    losses = list(5.0 * np.exp(-np.arange(300) / 80) + rng.normal(0, 0.3, 300))
    losses[0:2] = [math.nan, math.inf]           # not seeded by a non-finite loss
    losses[50] = math.nan
    s, got = None, []
    for x in losses:
        s = smma_update(s, x, 20)
        got.append(s)
    assert got == list(_smma_ref(losses, 20))
    assert got[0] is None and got[1] is None and got[2] == losses[2] and got[50] == got[49]


# ---------------------------------------------------------------- the pivot, in a run
def test_polish_pivot_archives_once_and_draws_only_its_sources(data, warm, tmp_path):
    out = tmp_path / "a"
    assert _main(data, warm, out) == 0
    loss = _loss(out)
    train = loss["train"]
    assert [r["step"] for r in train] == list(range(TOTAL))
    assert {r["source"] for r in train[PIVOT:]} <= set(POLISH_SOURCES)
    assert "py-topics" in {r["source"] for r in train[WARMUP:PIVOT]}
    t = Settings.from_dict(_cfg("on")).train
    assert train[PIVOT]["lr"] == cosine(PIVOT, t) and train[-1]["lr"] == t.min_lr
    # the smma field: Wilder's SMMA of every step's loss (log_every=1 here), warmup carried into main
    assert [r["smma"] for r in train] == list(_smma_ref([r["loss"] for r in train], 7))
    ev = [e for e in loss["events"] if e["step"] == PIVOT]
    assert [e["kind"] for e in ev] == ["phase", "checkpoint"]
    assert ev[1]["detail"] == "polish pivot: archive/polish-step45.{state,samples}.json"
    assert sorted(p.name for p in (out / "archive").iterdir()) == ["polish-step45.samples.json",
                                                                    "polish-step45.state.json"]
    st = json.loads((out / "archive" / "polish-step45.state.json").read_text())
    assert st["step"] == PIVOT and st["phase"] == "main" and st["saved_because"].startswith("polish pivot")
    assert st["curriculum"]["row"] == "polish" and st["curriculum"]["eligible"] == POLISH_SOURCES
    assert st["smma"] == train[PIVOT - 1]["smma"]
    assert json.loads((out / "archive" / "polish-step45.samples.json").read_text())["format"] == "andrea.samples/1"
    final = json.loads((out / "model.state.json").read_text())
    assert final["step"] == TOTAL and final["curriculum"]["row"] == "polish"
    # a pull open at the pivot was closed there: every pull after it is of a polish source
    assert all(p["source"] in POLISH_SOURCES for p in loss["pulls"] if p["step"] >= PIVOT)


@pytest.mark.parametrize("stop", [30, PIVOT, PIVOT + 5])
def test_resume_across_the_pivot_is_bit_exact(data, warm, tmp_path, stop):
    """Stopped by SIGTERM before the pivot, exactly at it (the pivot not yet done) and after it,
    then resumed: the same model.bin, run state, archive and train records as a straight run."""
    ref, out = tmp_path / "ref", tmp_path / "stopped"
    assert _main(data, warm, ref) == 0
    assert _main(data, warm, out, stop=stop) == STOPPED
    assert json.loads((out / "model.state.json").read_text())["step"] == stop
    assert (out / "archive").exists() == (stop > PIVOT)
    assert _main(data, warm, out) == 0
    for name in ("model.bin", "model.state.json", "model.samples.json", "archive/polish-step45.state.json",
                 "archive/polish-step45.samples.json"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    a, b = _loss(ref), _loss(out)
    assert b["train"] == a["train"] and b["pulls"] == a["pulls"] and b["val"] == a["val"]
    pivots = [e for e in b["events"] if e["detail"].startswith("polish pivot")]
    assert len(pivots) == 1 and pivots[0]["step"] == PIVOT       # archived once, never redone


def test_polish_off_changes_nothing_before_the_pivot_and_archives_nothing(data, warm, tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    assert _main(data, warm, on) == 0
    assert _main(data, warm, off, key="off") == 0
    assert not (off / "archive").exists()
    a, b = _loss(on)["train"], _loss(off)["train"]
    assert a[:PIVOT] == b[:PIVOT]                                    # the same trajectory up to the pivot
    assert a[PIVOT:] != b[PIVOT:]
    assert {r["source"] for r in a[PIVOT:]} <= set(POLISH_SOURCES)     # on: only the polish sources
    cur = json.loads((off / "model.state.json").read_text())["curriculum"]
    assert set(cur["eligible"]) - set(POLISH_SOURCES)                # off: every source stays eligible
    assert [r["lr"] for r in b] == [lr_at(r["step"], Settings.from_dict(_cfg("off")).train) for r in b]
    assert not [e for e in _loss(off)["events"] if e["kind"] == "phase" and e["detail"].startswith("polish")]
    assert json.loads((off / "model.state.json").read_text())["curriculum"]["row"] == "main"


# ---------------------------------------------------------------- the curriculum over the restricted arms
def test_curriculum_enter_cuts_the_open_pull_keeps_the_other_arms_and_resumes(tmp_path):
    from andrea.curriculum import make_curriculum
    from andrea.phases import Phase
    from andrea.shards import Shard, ShardWriter

    shards = {}
    for i, name in enumerate(("chat-a", "chat-b", "prose")):
        with ShardWriter(tmp_path / f"{name}.bin", vocab_size=500, eot_id=499) as w:
            for d in range(30):
                w.add((i * 100 + np.arange(20 + d)) % 499)
        shards[name] = Shard(tmp_path / f"{name}.bin")
    s = Settings.from_dict(load_config(ROOT / "params.yaml", "tiny", ["bandit.dice_main=4"]))
    cur = make_curriculum(s.curriculum, s.bandit, shards, "main", 5)
    polish = Phase("polish", "main", 40, 60, ("chat-a", "chat-b", "missing"), "to-min", "polish")
    step = 0
    while True:                                   # run until a pull of "prose" is open with batches left
        src, _, _ = cur.next_batch(2, 8)
        cur.observe(step, src, 3.0 - 0.01 * step)
        step += 1
        p = cur.policy.pull
        if p is not None and p["source"] == "prose" and p["left"] > 0 and step > 10:
            break
    drawn = p["dwell"] - p["left"]
    before = cur.policy.state_dict()
    rec = cur.enter(polish, step)
    assert rec["source"] == "prose" and rec["dwell"] == drawn and rec["step"] == step - 1
    assert cur.policy.pull is None and cur.eligible == ["chat-a", "chat-b"] and cur.row == "polish"
    assert cur.enter(polish, step) is None                       # entering twice is nothing
    after = cur.policy.state_dict()
    assert after["n"]["prose"] == before["n"]["prose"] + 1       # the cut pull counted, as a cut dwell is
    saved = json.loads(json.dumps(cur.state_dict()))
    seq = []
    for k in range(30):
        src, x, _ = cur.next_batch(2, 8)
        seq.append((src, x.tobytes()))
        cur.observe(step + k, src, 2.0)
    assert {src for src, _ in seq} == {"chat-a", "chat-b"}
    assert cur.policy.state_dict()["rewards"]["ema"]["prose"] == after["rewards"]["ema"]["prose"]   # frozen arm
    again = make_curriculum(s.curriculum, s.bandit, shards, "main", 5)
    again.load_state_dict(saved)
    assert again.row == "polish" and again.eligible == ["chat-a", "chat-b"]
    for k, (src, xb) in enumerate(seq):
        got, x, _ = again.next_batch(2, 8)
        assert (got, x.tobytes()) == (src, xb)
        again.observe(step + k, got, 2.0)


# ---------------------------------------------------------------- kill -9 inside the pivot's commit

@pytest.mark.slow
def test_kill_at_every_fs_call_of_the_pivot_leaves_the_archive_exactly_once(data, tmp_path):
    from train_helpers import micro_overrides, run_cli, run_killed

    tok, tokens = data
    ov = micro_overrides(4, 12, **{"curriculum.polish_steps": 4, "curriculum.polish_sources": "[chat-system, py-code]",
                                   "train.eval_every": 100})
    warm, ref = tmp_path / "warm", tmp_path / "ref"
    assert run_cli("warmup", tok, tokens, warm, ov).returncode == 0
    r = run_cli("main", tok, tokens, ref, ov, init=warm)
    assert r.returncode == 0, r.stderr
    names = ["model.bin", "model.state.json", "archive/polish-step8.state.json", "archive/polish-step8.samples.json"]
    want = {n: (ref / n).read_bytes() for n in names}

    def killed(out, k):
        return run_killed("archive", k, "main", tok, tokens, out, ov, init=warm)

    probe = killed(tmp_path / "probe", 10 ** 9)
    assert probe.returncode == 0, probe.stderr
    n_calls = int(probe.stderr.split("FS-CALLS ")[1].split()[0])
    assert n_calls >= 10
    failures = []
    for k in range(1, n_calls + 1):
        out = tmp_path / f"k{k}"
        assert killed(out, k).returncode == 137
        arch = sorted(p.name for p in (out / "archive").iterdir()) if (out / "archive").is_dir() else []
        if arch not in ([], ["polish-step8.samples.json", "polish-step8.state.json"]) and not (out / ".checkpoint.commit").is_dir():
            failures.append(f"kill before fs call {k}/{n_calls}: a half archive {arch} with no commit to finish")
        r = run_cli("main", tok, tokens, out, ov, init=warm)
        if r.returncode != 0:
            failures.append(f"kill before fs call {k}/{n_calls}: resume exit {r.returncode}: {r.stderr.strip()[-300:]}")
            continue
        got = {n: (out / n).read_bytes() if (out / n).exists() else None for n in names}
        if got != want:
            failures.append(f"kill before fs call {k}/{n_calls}: differs from the straight run: "
                            f"{[n for n in names if got[n] != want[n]]}")
        pivots = [e for e in json.loads((out / "model.loss.json").read_text())["events"]
                  if e["detail"].startswith("polish pivot")]
        if len(pivots) != 1:
            failures.append(f"kill before fs call {k}/{n_calls}: {len(pivots)} pivot events")
        stray = {p.name for p in out.iterdir()} - {"model.bin", "model.state.json", "model.loss.json",
                                                     "model.samples.json", "model.perf.jsonl", "archive"}
        if stray:
            failures.append(f"kill before fs call {k}/{n_calls}: stray files {stray}")
    assert not failures, "\n".join(failures)


def test_run_folder_commit_lands_the_archive_and_move_aside_takes_it(tmp_path):
    from andrea import runs

    rf = runs.RunFolder(tmp_path / "run")
    w = np.arange(6, dtype=np.float32)
    state = {"format": runs.STATE_FORMAT, "step": 3, "phase": "main"}
    samples = {"format": runs.SAMPLES_FORMAT, "samples": [{"step": 3, "text": "hi"}]}
    loss = {"format": runs.LOSS_FORMAT, "train": [], "val": [], "pulls": [], "events": []}
    with rf.writing():
        rf.commit(3, w, w, w, state=state, loss=loss, samples=samples, archive="polish-step3")
        st_path, sa_path = rf.archived("polish-step3")
        assert st_path.read_bytes() == rf.state.read_bytes() and sa_path.read_bytes() == rf.samples.read_bytes()
        assert json.loads(st_path.read_text())["checkpoint_sha256"]          # the state as committed, sha filled in
        rf.commit(4, w, w, w, state={**state, "step": 4}, loss=loss, samples=samples)   # later ones leave it alone
        assert json.loads(st_path.read_text())["step"] == 3
    assert sorted(p.name for p in rf.dir.iterdir()) == ["archive", "model.bin", "model.loss.json",
                                                         "model.samples.json", "model.state.json"]
    dest = rf.move_aside("abc")                     # --on-mismatch restart: the archive goes with its run
    assert (dest / "archive" / "polish-step3.state.json").is_file() and not (rf.dir / "archive").exists()
