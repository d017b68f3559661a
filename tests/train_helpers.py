"""Helpers for the train tests: a synthetic tokenizer + learnable token shards, and the
micro config. Not a test module itself (imported by tests/test_train*.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from andrea.config import load_config
from andrea.shards import ShardWriter
from andrea.tokenizer.harris import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("chat-system", "py-topics", "py-code")    # py-code is not a warmup source
MORPHEMES = [f"m{i:02d}" for i in range(23)]          # V = 256 + 23 + 1 = 280


def micro_overrides(warmup: int, total: int, **extra) -> list[str]:
    o = {"model.d_model": 32, "model.n_head": 2, "model.n_layer": 2, "model.context": 32,
         "train.batch_size": 4, "train.max_steps": total, "train.warmup_steps": 5, "train.lr": 1e-2,
         "train.min_lr": 1e-3, "train.log_every": 1, "train.eval_every": 10, "train.eval_batches": 2,
         "train.checkpoint_every": 1000, "train.backend": "numpy", "curriculum.warmup_steps": warmup,
         "curriculum.warmup_sources": "[chat-system, py-topics]", "coherence.every": 100000,
         "bandit.policy": "uniform", "curriculum.polish_steps": 0}
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def micro_cfg(warmup: int, total: int, **extra) -> dict:
    return load_config(ROOT / "params.yaml", "tiny", micro_overrides(warmup, total, **extra))


def make_data(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """tokenizer.json and shards: per source a sparse Markov chain over 40 ids (learnable,
    so the model beats the unigram baseline quickly)."""
    tok = Tokenizer(MORPHEMES)
    tok_path = root / "tokenizer" / "tokenizer.json"
    tok_path.parent.mkdir(parents=True, exist_ok=True)
    tok_path.write_text(tok.dumps(), encoding="utf-8")
    V, eot = tok.vocab_size, tok.eot_id
    rng = np.random.default_rng(seed)
    tokens = root / "tokens"
    for k, src in enumerate(SOURCES):
        ids = rng.choice(V - 1, size=40, replace=False)
        nxt = rng.integers(0, 40, size=(40, 3))
        for split, n_docs in (("train", 60), ("val", 8)):
            with ShardWriter(tokens / split / f"{src}.bin", V, eot) as w:
                for _ in range(n_docs):
                    n = int(rng.integers(40, 160))
                    s = np.empty(n, dtype=np.int64)
                    s[0] = rng.integers(40)
                    for i in range(1, n):
                        s[i] = nxt[s[i - 1], rng.integers(3)]
                    w.add(ids[s])
    return tok_path, tokens


def andrea_cmd(phase: str, tok: Path, tokens: Path, out: Path, overrides: list[str], init: Path | None = None):
    cmd = [sys.executable, "-m", "andrea", "train", "--phase", phase, "--params", str(ROOT / "params.yaml"),
           "--profile", "tiny", "--tokenizer", str(tok), "--tokens", str(tokens), "--out", str(out)]
    if init is not None:
        cmd += ["--init", str(init)]
    for o in overrides:
        cmd += ["-S", o]
    return cmd


def child_env() -> dict:
    env = dict(os.environ)
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", COLUMNS="200")
    return env


def run_cli(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(andrea_cmd(*args, **kw), env=child_env(), capture_output=True, text=True, timeout=300)


# A child `andrea train` that dies with os._exit (no cleanup, like SIGKILL) just before its
# KILL_AT-th file-system call inside one checkpoint: ARM "step=N" picks the checkpoint at step N,
# ARM "archive" the one that carries an archive (the polish pivot). With KILL_AT past the end it
# runs through and prints "FS-CALLS <n>", the count of calls that checkpoint made.
KILL_DRIVER = r"""
import os, sys
import andrea.train as T
arm, kill_at = sys.argv[1], int(sys.argv[2])
state = {"armed": False, "n": 0}
def wrap(name):
    f = getattr(os, name)
    def g(*a, **k):
        if state["armed"]:
            state["n"] += 1
            if state["n"] == kill_at:
                os._exit(137)
        return f(*a, **k)
    setattr(os, name, g)
for name in ("fsync", "replace", "rename", "unlink", "rmdir", "mkdir"):
    wrap(name)
orig = T.Trainer.checkpoint
def checkpoint(self, why, archive=None):
    state["armed"] = archive is not None if arm == "archive" else self.step == int(arm.split("=")[1])
    orig(self, why, archive)
    if state["armed"]:
        print(f"FS-CALLS {state['n']}", file=sys.stderr, flush=True)
    state["armed"] = False
T.Trainer.checkpoint = checkpoint
from andrea.cli import main
sys.exit(main(sys.argv[3:]))
"""


def run_killed(arm: str, kill_at: int, *args, **kw) -> subprocess.CompletedProcess:
    """``run_cli(*args, **kw)`` under KILL_DRIVER (see above)."""
    cmd = [sys.executable, "-c", KILL_DRIVER, arm, str(kill_at)] + andrea_cmd(*args, **kw)[3:]
    return subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
