"""The train stage: ``andrea train --phase warmup|main``.

    andrea train --phase warmup --profile tiny --tokenizer data/tokenizer/tiny/tokenizer.json \\
                 --tokens data/tokens/tiny --out runs/tiny/warmup
    andrea train --phase main   --profile tiny --tokenizer data/tokenizer/tiny/tokenizer.json \\
                 --tokens data/tokens/tiny --init runs/tiny/warmup --out runs/tiny/main

(About 700 lines on purpose: the phases and the polish pivot, resume checks, signals, held-out
loss, hooks and the perf sidecar are one loop's contract, read as a whole; the run folder is
andrea/runs.py, the phase table andrea/phases.py, the step andrea/engine, the batches
andrea/curriculum.)

Steps count globally across the two phases: the warmup phase runs global steps
[0, curriculum.warmup_steps) drawing only from ``curriculum.warmup_sources``; the main
phase starts from the warmup checkpoint (weights, Adam m/v, curriculum state, step) and
runs [curriculum.warmup_steps, train.max_steps) over every source, except its last
``curriculum.polish_steps``, the polish, which draw only ``curriculum.polish_sources`` with
the LR going linearly down to train.min_lr. Those stretches are the rows of one table
(andrea/phases.py) that the curriculum and the LR schedule (andrea/engine/schedule.py) look
up; before each step the loop enters the row of that step. Entering the polish (the pivot)
writes a checkpoint as SIGUSR1 does, with ``archive/polish-step<N>.{state,samples}.json``
landing in the same unit (andrea/runs.py), so the archive exists exactly once: a run resumed
past the pivot has it and does not redo it, one resumed before it makes it on the way.
The LR schedule and AdamW's step count use the global step, so warmup + main
is one run cut in two. One step = ``train.grad_accum`` microbatches of
``train.batch_size`` x ``model.context`` tokens.

Run folder (``--out``, andrea/runs.py): ``model.bin`` (the fixed checkpoint,
andrea/engine/checkpoint.py), ``model.state.json``, ``model.loss.json``, ``model.samples.json``;
a checkpoint and its three JSON files land as one unit, so a kill -9 at any moment leaves the
previous checkpoint or the new one, and the next start repairs the folder (finishes or drops
an interrupted commit, removes stale temp files). If ``model.bin`` exists the run resumes
from it, bit-exactly; it must have the same
tokenizer (sha256), the same train shards (sizes) and the same trajectory config: the
``seed``, ``model``, ``train``, ``curriculum``, ``bandit`` and ``coherence`` sections,
where only train.log_every / checkpoint_every / eval_every / eval_batches may differ
(``trajectory_hash``). A finished run is left as it is.

Signals: SIGTERM writes a checkpoint and exits ``STOPPED`` (143, as a process ended by SIGTERM:
the run is not finished, so Snakemake, DVC and a scheduler never take it for done; run the same
command again to resume); SIGUSR1 writes a checkpoint and goes
on. Both are caught from the first lines of the process (before numpy, the config, the data
and the engine load); one that comes before the first step acts once the run is set up (a
resumed run's checkpoint is already current and is left as it is). A full disk or another
I/O error while checkpointing ends the run with one line naming the file and the step that
survives (exit 2). An engine with ``extra_state()`` / ``load_extra_state(d)`` (the fp16 loss
scale of the CUDA engine) has that dict saved in ``.state.json`` "engine" and restored on
resume and from the warmup run. Checkpoints are also written every ``train.checkpoint_every`` steps and at the end.
A step whose loss or gradient norm is NaN/inf is skipped (the weights, m and v are not
touched) and counted; ``train.max_bad_steps`` in a row halt the run: the checkpoint
holds the last good weights and ``.state.json`` the reason (exit 2). Hooks every N steps
(the coherence check of andrea/coherence.py is one) may halt the run with a reason
(checkpoint, exit 0).

Every train record in ``.loss.json`` carries ``smma``, Wilder's smoothed moving average of the
training loss: seeded with the first finite loss, then ``smma += (loss - smma) / train.smma_period``
at every step with a finite loss (logged or not); it is part of the run state, so a resumed run
carries the same value on.

Held-out loss: every ``train.eval_every`` steps and at the end, ``train.eval_batches``
fixed batches per val shard; ``.loss.json`` "val" gets the mean over sources, the loss
per source, and the unigram baseline (train-split token frequencies, add-one smoothed)
on the very same tokens.
"""

from __future__ import annotations

import signal
import sys

# `andrea train` catches SIGTERM/SIGUSR1 from here on, before the slow imports, the config and
# the data load; Trainer.run takes them over. Only in the CLI process of this stage.
EARLY_SIGNALS: list[int] = []
CLI_PROCESS = (sys.argv[1:2] == ["train"] and "andrea.cli" in sys.modules
               and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
if CLI_PROCESS:
    for _sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(_sig, lambda signum, _frame: EARLY_SIGNALS.append(signum))

import argparse  # noqa: E402  (after the early signal handlers, on purpose)
import contextlib  # noqa: E402
import copy  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np  # noqa: E402

from andrea import dist, runs  # noqa: E402
from andrea.config import check_source_names, config_hash  # noqa: E402
from andrea.backends import select_backend  # noqa: E402
from andrea.engine.engine import Engine, Hyper  # noqa: E402
from andrea.engine.model import ModelConfig  # noqa: E402
from andrea.engine.schedule import lr_at  # noqa: E402
from andrea.phases import phase_at, phase_table, stage_rows  # noqa: E402
from andrea.errors import AndreaError  # noqa: E402
from andrea.runs import LOSS_FORMAT, SAMPLES_FORMAT, STATE_FORMAT, RunMismatch, SplitPair  # noqa: E402,F401
from andrea.preflight import check_data, check_schedule  # noqa: E402
from andrea.settings import Settings  # noqa: E402
from andrea.shards import Shard  # noqa: E402

# The config sections that decide the trajectory of the weights (the data sections act
# through the tokenizer and the shards, which are checked by sha256 and fingerprint) ...
# Exit status of a run stopped by SIGTERM after its checkpoint landed: 128 + 15, what a shell and
# SLURM report for a process the signal ended, so no front end marks the unfinished stage done.
STOPPED = 143
TRAJECTORY_SECTIONS = ("seed", "model", "train", "curriculum", "bandit", "coherence")
# ... minus the keys that only change what is logged, or how often
TRAJECTORY_FREE = (("train", "log_every"), ("train", "checkpoint_every"), ("train", "eval_every"),
                   ("train", "eval_batches"), ("train", "gpus"))   # gpus: the same windows, only the sums' rounding
UNIGRAM_MAX_TOKENS = 10_000_000  # per train shard, for the baseline's token counts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phase", required=True, choices=["warmup", "main"], help="which stretch of the run")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json the shards were encoded with")
    p.add_argument("--tokens", required=True, help="token shard folder: <tokens>/{train,val}/<source>.bin")
    p.add_argument("--out", required=True, help="run folder: model.bin, model.{state,loss,samples}.json")
    p.add_argument("--init", default=None, help="(--phase main) the finished warmup run folder to start from")
    p.add_argument("--on-mismatch", choices=["refuse", "restart"], default="refuse",
                   help="when --out holds a run of another config/tokenizer/data: refuse (default), or move it "
                        "aside to <out>.stale-<its config hash> and start over (for `dvc exp run -S ...` with "
                        "persisted outputs)")


def trajectory_hash(cfg: dict) -> str:
    """config_hash of the TRAJECTORY_SECTIONS of the merged config, without TRAJECTORY_FREE."""
    c = copy.deepcopy({k: cfg[k] for k in TRAJECTORY_SECTIONS if k in cfg})
    for path in TRAJECTORY_FREE:
        node = c
        for k in path[:-1]:
            node = node.get(k, {})
        node.pop(path[-1], None)
    return config_hash(c)


def shard_fingerprint(shards: dict[str, Shard]) -> dict:
    """{source: [n_tokens, n_docs, file bytes]}: a cheap identity of the train shards."""
    return {k: [int(s.n_tokens), int(s.n_docs), s.path.stat().st_size] for k, s in sorted(shards.items())}


def load_shards(tokens: str | Path, split: str, vocab_size: int, required: bool = True) -> dict[str, Shard]:
    folder = Path(tokens) / split
    files = sorted(folder.glob("*.bin"))
    if not files:
        if required:
            raise AndreaError(f"{folder}: no token shards (run `andrea diet-alignment` first)")
        return {}
    out = {}
    for f in files:
        s = Shard(f)
        if s.vocab_size != vocab_size:
            raise AndreaError(f"{f}: shard vocab_size {s.vocab_size} != the tokenizer's {vocab_size} "
                              "(shards from another tokenizer?)")
        out[f.stem] = s
    return out


@dataclass
class Hook:
    """Runs after every ``every``-th completed step: ``fn(trainer, step) -> None | {"reason", "step"}``;
    a dict halts the run (checkpoint, reason in .state.json, exit 0). ``state``/``load`` persist
    the hook's own state in .state.json "hooks"."""

    name: str
    every: int
    fn: Callable
    state: Callable[[], dict] | None = None
    load: Callable[[dict], None] | None = None
    observe: Callable[[int, float, str], dict | None] | None = None   # every step: (step, loss, source) -> halt or None


@dataclass
class History:
    train: list = field(default_factory=list)
    val: list = field(default_factory=list)
    pulls: list = field(default_factory=list)
    events: list = field(default_factory=list)
    samples: list = field(default_factory=list)

    def truncate(self, step: int) -> None:
        """Drop what a crashed process logged past the checkpoint at ``step`` (resume redoes it)."""
        self.train = [r for r in self.train if r["step"] < step]
        self.val = [r for r in self.val if r["step"] <= step]
        self.pulls = [r for r in self.pulls if r["step"] < step]
        self.events = [r for r in self.events if r["step"] <= step]
        self.samples = [r for r in self.samples if r["step"] <= step]

    def load(self, folder: runs.RunFolder) -> None:
        d = runs.read_history(folder.loss)
        # a folder of an older version has wall-clock fields in its train records: not carried on
        self.train = [{k: v for k, v in r.items() if k not in runs.WALL_CLOCK} for r in d["train"]]
        self.val, self.pulls, self.events = d["val"], d["pulls"], d["events"]
        self.samples = list(runs.read_samples(folder.samples))

    def loss_doc(self) -> dict:
        return {"format": LOSS_FORMAT, "train": self.train, "val": self.val, "pulls": self.pulls, "events": self.events}

    def samples_doc(self) -> dict:
        return {"format": SAMPLES_FORMAT, "samples": self.samples}


class Trainer:
    def __init__(self, cfg: dict, phase: str, tokenizer: str | Path, tokens: str | Path, out: str | Path,
                 init: str | Path | None = None, console=None, on_mismatch: str = "refuse"):
        from rich.console import Console

        from andrea.tokenizer import load as load_tokenizer

        # the raw dict is what the run state records (config, config_hash); the code reads the typed one
        self.cfg, self.phase = cfg, phase
        self.settings = st = Settings.from_dict(cfg)
        check_source_names(cfg)
        tc = st.train
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.out, self.folder = Path(out), runs.RunFolder(out)
        self.tok = load_tokenizer(tokenizer)
        self.shards = load_shards(tokens, "train", self.tok.vocab_size)
        self.val_shards = load_shards(tokens, "val", self.tok.vocab_size, required=False)
        W, total = st.curriculum.warmup_steps, tc.max_steps
        self.table = phase_table(tc, st.curriculum)   # the rows (warmup, main, polish) the loop enters
        self.start, self.end = (0, W) if phase == "warmup" else (W, total)
        # data-parallel (andrea/dist.py): one process per GPU under a launcher; rank 0 writes the folder
        self.launch = dist.launch_env()
        self.world = dist.check_world(tc.gpus, self.launch)
        self.rank = 0 if self.launch is None else self.launch.rank
        self.comm = None if self.launch is None else dist.NcclComm.create(self.launch, self.out)
        self.console.quiet = self.console.quiet or self.rank != 0
        be, self.backend_reason = select_backend(tc.backend)
        if tc.precision not in be.precisions:
            raise AndreaError(f"train.precision={tc.precision}: the {be.name} backend supports "
                              f"{', '.join(be.precisions)}")
        self.mc = ModelConfig.of(st.model, self.tok.vocab_size)
        self.B, self.T, self.accum = tc.batch_size, self.mc.context, tc.grad_accum
        for w in check_data(self.shards, self.val_shards, self.B, self.T) + \
                check_schedule(tc.warmup_steps, tc.max_steps):
            self.console.print(f"warning: {w}", markup=False, highlight=False)
        # a backend may bring its own engine with the same surface (the CuPy one: fused, mixed precision)
        make = getattr(be, "make_engine", None)
        if self.comm is not None and make is None:
            raise AndreaError(f"train.gpus={self.world} (a {self.launch.launcher} launch): the data-parallel path runs on "
                              f"the cupy backend with NCCL, not on {be.name} (set train.backend: cupy)")
        eb = dist.local_batch(self.B, self.world)     # this rank's rows of every microbatch
        kw = {"comm": self.comm} if self.comm else {}
        if tc.precision == "fp8":                      # train.fp8_scaling (docs/FP8.md)
            kw.update(fp8_scaling=tc.fp8_scaling, fp8_amax_history=tc.fp8_amax_history)
        if make is not None:                           # train.attention, train.grad_accum: the GPU engine's
            kw.update(attention=tc.attention, grad_accum=self.accum)   # (cudnn_attention.py; ACTS_IN_GRADS)
        self.engine = (make(self.mc, eb, tc.precision, recompute=tc.recompute, **kw) if make
                       else Engine(self.mc, self.B, be, recompute=tc.recompute))
        self.hp = Hyper.of(tc)
        self.hash = trajectory_hash(cfg)
        self.seed = st.seed
        self.rng = np.random.Generator(np.random.PCG64([self.seed, 2]))  # for hooks that need randomness
        self.hooks: list[Hook] = []
        self.hist = History()
        self.bad = {"consecutive": 0, "total": 0}
        self.halt: dict | None = None
        self.step = 0
        self.smma: float | None = None     # Wilder's smoothed training loss (train.smma_period)
        self.cur = None
        self._init = init
        self.on_mismatch = on_mismatch
        self._signals: list[int] = []
        self._last_loss_write = 0.0
        self._perf: list[dict] = []     # wall-clock records not yet in model.perf.jsonl (runs.PERF)
        self._unigram_logp: np.ndarray | None = None

    # ------------------------------------------------------------------ state
    def _load_run(self, folder: runs.RunFolder, want_phase: str) -> tuple[dict, int]:
        state = folder.read_state()
        runs.check_resume(state, folder.state, phase=want_phase, tokenizer_sha256=self.tok.sha256,
                          config_hash=self.hash, train_shards=shard_fingerprint(self.shards),
                          n_params=self.engine.n_params)
        step, w, m, v = folder.read_checkpoint(state, self.engine.n_params)
        self.engine.load_state(w, m, v)
        extra = state.get("engine")
        if extra is not None:
            load = getattr(self.engine, "load_extra_state", None)
            try:
                if load is None:
                    raise ValueError("no load_extra_state")
                load(extra)
            except ValueError as e:
                raise AndreaError(f"{folder.state}: holds engine state ({', '.join(sorted(extra))}) that the "
                                  f"{self.engine.be.name} engine cannot restore: {e} (made with another "
                                  "train.precision, backend or version?)") from None
        return state, step

    def _slices(self) -> int:
        """Batch slices per step (the NumPy engine: ``pool.BATCH_SLICES``, whatever the thread
        count; a device engine: 1). The bits of a step depend on it, so the run state records it."""
        return len(getattr(self.engine, "slices", (None,)))

    def _curriculum(self, phase: str):
        from andrea.curriculum import make_curriculum

        return make_curriculum(self.settings.curriculum, self.settings.bandit, self.shards, phase, self.seed)

    def restore(self) -> str:
        """Fresh start, resume, or (main) start from the warmup run. Returns what happened."""
        stale = ""
        if self.folder.exists() and self.on_mismatch == "restart":
            try:
                self._load_run(self.folder, self.phase)
            except (RunMismatch, SplitPair) as e:
                stale = self._move_aside(str(e))
        if self.folder.exists():
            state, step = self._load_run(self.folder, self.phase)
            self.cur = self._curriculum(self.phase)
            self.cur.load_state_dict(state["curriculum"])
            self.rng.bit_generator.state = state["rng"]["train"]
            self.bad, self.halt, self.step = dict(state["bad_steps"]), state.get("halt"), step
            self.smma = state.get("smma")
            for h in self.hooks:
                if h.load and h.name in state.get("hooks", {}):
                    h.load(state["hooks"][h.name])
            self.hist.load(self.folder)
            self.hist.truncate(step)
            self.hist.events.append({"step": step, "kind": "resume", "detail": f"resumed from {self.folder.bin}"})
            was = state.get("batch_slices", self._slices())
            if was != self._slices():
                note = (f"the run so far split each batch into {was} slice(s), this version into "
                        f"{self._slices()}: the continuation is sound but not bit-identical to a straight run "
                        "(a run folder of an older version, which split by the thread count)")
                self.console.print(f"note: {note}")
                self.hist.events.append({"step": step, "kind": "threads", "detail": note})
            was = state.get("world_size", 1)
            if was != self.world:
                note = (f"the run so far trained on {was} GPU(s), this start on {self.world}: the same batches, but the "
                        "gradient sums round differently, so the continuation is sound but not bit-identical")
                self.console.print(f"note: {note}")
                self.hist.events.append({"step": step, "kind": "world_size", "detail": note})
            return f"resuming {self.phase} at step {step}"
        if self.phase == "main":
            if self._init is None:
                raise AndreaError("--phase main needs --init <the warmup run folder>")
            init = runs.RunFolder(self._init)
            if not init.bin.is_file():
                raise AndreaError(f"{init.bin}: warmup checkpoint not found (run --phase warmup first)")
            state, step = self._load_run(init, "warmup")
            if state.get("halt"):
                raise AndreaError(f"{init.state}: the warmup run halted at step {state['halt'].get('step')}: "
                                  f"{state['halt'].get('reason')}")
            if step != self.start:
                raise AndreaError(f"{init.bin}: warmup checkpoint at step {step}, expected "
                                  f"curriculum.warmup_steps={self.start} (warmup unfinished?)")
            self.cur = self._curriculum("main")
            self.cur.load_state_dict(state["curriculum"])
            self.rng.bit_generator.state = state["rng"]["train"]
            for h in self.hooks:
                if h.load and h.name in state.get("hooks", {}):
                    h.load(state["hooks"][h.name])
            self.step = step
            self.smma = state.get("smma")
            self.hist.load(init)
            self.hist.truncate(step)
            self._perf = [r for s, r in sorted(runs.read_perf(init.perf).items()) if s < step]   # the warmup's
            self.hist.events.append({"step": step, "kind": "phase", "detail": f"main starts from {init.bin}"})
            return stale + f"main phase from {init.bin} at step {step}"
        self.engine.init_weights(self.seed)
        self.cur = self._curriculum("warmup")
        self.step = 0
        self.hist.events.append({"step": 0, "kind": "start", "detail": "fresh warmup run"})
        return stale + "fresh warmup run from seeded init"

    def _move_aside(self, why: str) -> str:
        """Move the run files of a mismatched run to a sibling folder (nothing is deleted)."""
        try:
            old_hash = str(self.folder.read_state().get("config_hash", "unknown"))[:12]
        except AndreaError:
            old_hash = "unknown"
        dest = self.folder.move_aside(old_hash)
        self.console.print(f"--on-mismatch restart: moved the old run to {dest} ({why})")
        return f"old run moved to {dest}; "

    def checkpoint(self, why: str, archive: str | None = None) -> None:
        """model.bin, model.state.json, model.loss.json, model.samples.json: one unit (andrea/runs.py);
        with ``archive``, archive/<archive>.{state,samples}.json in the same unit."""
        # with ranks, every rank calls it: the m and v shards are gathered (a collective)
        host = [np.ascontiguousarray(a, dtype=np.float32) for a in self.engine.state_host()]
        state = {
            "format": STATE_FORMAT, "step": self.step, "phase": self.phase,
            "config_hash": self.hash, "tokenizer_sha256": self.tok.sha256,
            "n_params": self.engine.n_params, "checkpoint_sha256": None,   # filled in by the commit
            "train_shards": shard_fingerprint(self.shards),
            "model": {"vocab_size": self.mc.vocab_size, "d_model": self.mc.d_model, "n_head": self.mc.n_head,
                      "n_layer": self.mc.n_layer, "context": self.mc.context},
            "steps": {"phase_start": self.start, "phase_end": self.end, "max_steps": self.settings.train.max_steps},
            "rng": {"train": self.rng.bit_generator.state},
            "curriculum": self.cur.state_dict(),
            "hooks": {h.name: h.state() for h in self.hooks if h.state},
            "bad_steps": dict(self.bad), "halt": self.halt, "smma": self.smma,
            "backend": self.engine.be.name, "precision": self.settings.train.precision,
            "batch_slices": self._slices(),
            "saved_because": why, "config": self.cfg,
        }
        if self.world > 1:
            state["world_size"] = self.world
        if self.rank != 0:                   # rank 0 writes the whole job's checkpoint
            return
        extra = getattr(self.engine, "extra_state", None)
        if callable(extra):
            state["engine"] = extra()
        self.folder.commit(self.step, *host, state=state, loss=self.hist.loss_doc(), samples=self.hist.samples_doc(),
                           archive=archive)
        self._last_loss_write = time.time()
        self._flush_perf()

    def write_history(self) -> None:
        if self.rank != 0:
            return
        self.folder.write_history(self.hist.loss_doc(), self.hist.samples_doc())
        self._last_loss_write = time.time()
        self._flush_perf()

    def _flush_perf(self) -> None:
        """Wall-clock figures (time, tokens/s) go beside the run files, never into them: the
        tracked files hold only what the params determine (andrea/runs.py)."""
        self.folder.append_perf(self._perf)
        self._perf = []

    # ------------------------------------------------------------------ eval
    def _unigram(self) -> np.ndarray:
        if self._unigram_logp is None:
            counts = np.ones(self.mc.vocab_size, dtype=np.float64)  # add-one smoothing
            for s in self.shards.values():
                counts += np.bincount(np.asarray(s.tokens[:UNIGRAM_MAX_TOKENS]), minlength=self.mc.vocab_size)
            self._unigram_logp = np.log(counts / counts.sum())
        return self._unigram_logp

    def evaluate(self) -> dict | None:
        """Held-out loss per val source (train.eval_batches fixed batches each); None without val shards."""
        from andrea.curriculum import sequential_windows

        if not self.val_shards:
            return None
        logp = self._unigram()
        per, uni = {}, {}
        for src, shard in sorted(self.val_shards.items()):
            tot, n, utot = 0.0, 0, 0.0
            for x, y in sequential_windows(shard, self.B, self.T, self.settings.train.eval_batches):
                xs, ys = dist.rank_share(x, self.rank, self.world), dist.rank_share(y, self.rank, self.world)
                if xs.shape[0]:                # this rank's share of the rows (all of them at world 1), summed below
                    s, k = self.engine.eval_batch(xs, ys)
                    tot, n = tot + s, n + k
                utot -= float(logp[y].sum())
            if self.world > 1:
                tot, n = dist.sum_over_ranks(self.comm, [tot, n])
                n = int(n)
            if n:
                per[src], uni[src] = tot / n, utot / n
        if not per:
            return None
        rec = {"step": self.step, "loss": float(np.mean(list(per.values()))), "per_source": per,
               "unigram": float(np.mean(list(uni.values()))), "unigram_per_source": uni}
        self.hist.val.append(rec)
        return rec

    # ------------------------------------------------------------------ loop
    def _on_signal(self, signum, _frame) -> None:
        self._signals.append(signum)

    def _one_step(self) -> tuple:
        eng, cur, srcs = self.engine, self.cur, []
        t0 = time.perf_counter()

        def draws():                                   # lazily: the curriculum sees each loss first
            for _ in range(self.accum):
                src, x, y = cur.next_batch(self.B, self.T)
                srcs.append(src)
                # every rank draws the whole microbatch and keeps its rows (all of them at world 1)
                x, y = dist.rank_rows(x, self.rank, self.world), dist.rank_rows(y, self.rank, self.world)
                yield x, y

        def observe(li: float) -> None:
            pull = cur.observe(self.step, srcs[-1], li)
            if pull:
                self.hist.pulls.append(pull)

        lr = lr_at(self.step, self.settings.train, self.table)
        res = eng.train_step(draws(), lr, self.step + 1, self.hp, n_micro=self.accum, on_loss=observe)
        eng.be.synchronize()
        dt = time.perf_counter() - t0
        return res, lr, "+".join(sorted(set(srcs))), self.accum * self.B * self.T / max(dt, 1e-9)

    def run(self) -> int:
        """Restore, train to the phase's end (or a signal / halt), checkpoint. The signal handlers
        are this object's from the first line to the last; the folder is locked meanwhile."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGUSR1)}
        self._signals += EARLY_SIGNALS
        EARLY_SIGNALS.clear()
        try:
            with self.folder.writing() if self.rank == 0 else contextlib.nullcontext([]) as repaired:
                for note in repaired:
                    self.console.print(f"{self.folder.dir}: {note}")
                return self._run()
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _run(self) -> int:
        what = self._restore_in_turn()
        c = self.console
        c.print(f"train {self.phase}: {what}; backend {self.backend_reason}")
        c.print(self.engine.describe())
        c.print(f"steps {self.start} -> {self.end} of train.max_steps={self.settings.train.max_steps} (global); "
                f"{self.accum}x{self.B}x{self.T} tokens/step; sources: {', '.join(self.cur.eligible)}")
        rows = stage_rows(self.table, self.phase)
        if len(rows) > 1:
            c.print("phases: " + "; ".join(f"{r.name} [{r.start}, {r.end}) "
                                          f"{'every source' if r.sources is None else ', '.join(r.sources)}"
                                          for r in rows), highlight=False)
        if self.halt:
            msg = f"{self.folder.state}: run halted at step {self.halt.get('step')}: {self.halt.get('reason')}"
            if self.halt.get("kind") == "bad_steps":
                raise AndreaError(msg)
            c.print(msg + " (nothing to do)")
            return 0
        if self.step >= self.end:
            c.print(f"{self.folder.bin}: already at step {self.step} >= {self.end}; nothing to do")
            if not self.folder.bin.exists():
                self.checkpoint("phase has no steps")
            return 0
        if self._early_signals():
            return STOPPED
        return self._loop()

    def _restore_in_turn(self) -> str:
        """restore(); with ranks, rank 0 first (it repairs the folder and may move it aside), then the others."""
        if self.comm is None:
            return self.restore()
        if self.rank:
            self.comm.barrier()
        what = self.restore()
        if not self.rank:
            self.comm.barrier()
        return what

    def _agreed(self, sigs: list[int]) -> list[int]:
        """The signals any rank caught, on every rank (andrea/dist.py agree_flags): the job acts once."""
        if self.comm is None:
            return sigs
        usr1, term = dist.agree_flags(self.comm, [signal.SIGUSR1 in sigs, signal.SIGTERM in sigs])
        return [s for s, f in ((signal.SIGUSR1, usr1), (signal.SIGTERM, term)) if f]

    def _early_signals(self) -> bool:
        """Signals that came while the run was set up; True when SIGTERM says stop. A run resumed
        from this folder has its checkpoint on disk already; a fresh one gets its first."""
        sigs, self._signals = self._signals, []
        sigs = self._agreed(sigs)
        if not sigs:
            return False
        current = self.folder.committed_step == self.step
        if self.comm is not None:            # rank 0's folder decides
            current = not dist.agree_flags(self.comm, [int(self.rank == 0 and not current)])[0]
        name = "SIGTERM" if signal.SIGTERM in sigs else "SIGUSR1"
        if current:
            self.console.print(f"{name} before the first step: {self.folder.bin} (step {self.step}) is current")
        else:
            self.hist.events.append({"step": self.step, "kind": "checkpoint", "detail": f"{name} before the first step"})
            self.checkpoint(f"{name} before the first step")
            self.console.print(f"{name} before the first step: checkpoint at step {self.step}")
        if signal.SIGTERM in sigs:
            self.console.print("SIGTERM: exiting")
            return True
        return False

    def checkpoint_now(self, why: str, archive: str | None = None) -> None:
        """A checkpoint out of the periodic rhythm (SIGUSR1, SIGTERM, the polish pivot), with its event."""
        self.hist.events.append({"step": self.step, "kind": "checkpoint", "detail": why})
        self.checkpoint(why, archive)

    def _enter_row(self) -> None:
        """Before the step ``self.step``: enter its phase-table row (andrea/phases.py) if the
        curriculum is not drawing for it yet. A row with an ``archive`` (the polish) is entered with
        a checkpoint that lands its archive; the curriculum state in it names the row, so a run
        resumed from it (or from any later checkpoint) is in the row already and archives nothing."""
        row = phase_at(self.table, self.step)
        if row.name == self.cur.row:
            return
        pull = self.cur.enter(row, self.step)
        if pull:
            self.hist.pulls.append(pull)
        lr_shape = "linear to train.min_lr" if row.lr == "to-min" else "the cosine schedule"
        self.hist.events.append({"step": self.step, "kind": "phase",
                                 "detail": f"{row.name}: steps [{row.start}, {row.end}) from "
                                           f"{', '.join(self.cur.eligible)}; lr {lr_shape}"})
        self.console.print(f"{row.name} from step {self.step}: sources {', '.join(self.cur.eligible)}; lr {lr_shape}",
                           highlight=False)
        if row.archive:
            name = f"{row.archive}-step{self.step}"
            self.checkpoint_now(f"{row.name} pivot: {runs.ARCHIVE}/{name}.{{state,samples}}.json", archive=name)
            self.console.print(f"{row.name} pivot: checkpoint at step {self.step}, run state archived as "
                               f"{self.folder.dir / runs.ARCHIVE / name}.{{state,samples}}.json, continuing",
                               highlight=False)

    def _loop(self) -> int:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        c, tc = self.console, self.settings.train
        log_every, eval_every, ck_every, max_bad = tc.log_every, tc.eval_every, tc.checkpoint_every, tc.max_bad_steps
        live = c.is_terminal
        prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TextColumn("loss {task.fields[loss]}"), TextColumn("smma {task.fields[smma]}"),
                        TextColumn("lr {task.fields[lr]}"),
                        TextColumn("{task.fields[tps]} tok/s"), TextColumn("{task.fields[src]}"),
                        TimeRemainingColumn(), console=c, disable=not live)
        t_start, s_start = time.time(), self.step
        tps_ema = None
        with prog:
            task = prog.add_task(self.phase, total=self.end, completed=self.step, loss="-", smma="-", lr="-", tps="-",
                                 src="-")
            while self.step < self.end:
                self._enter_row()
                s = self.step
                res, lr, src, tps = self._one_step()
                self.step += 1
                self.smma = smma_update(self.smma, res.loss, tc.smma_period)   # at every step, logged or not
                tps_ema = tps if tps_ema is None else 0.9 * tps_ema + 0.1 * tps
                if res.ok:
                    self.bad["consecutive"] = 0
                else:
                    self.bad["consecutive"] += 1
                    self.bad["total"] += 1
                    self.hist.events.append({"step": s, "kind": "bad_step",
                                             "detail": f"loss {res.loss!r} grad_norm {res.grad_norm!r}: update skipped"})
                    if self.bad["consecutive"] >= max_bad:
                        self.halt = {"kind": "bad_steps", "step": self.step,
                                     "reason": f"{self.bad['consecutive']} consecutive steps with a NaN/inf loss or "
                                               f"gradient (train.max_bad_steps={max_bad}); weights are the last good ones"}
                        self.checkpoint("halt: bad steps")
                        raise AndreaError(f"{self.folder.state}: halted at step {self.step}: {self.halt['reason']}")
                if s % log_every == 0 or self.step == self.end or not res.ok:
                    self.hist.train.append({"step": s, "phase": self.phase, "loss": _num(res.loss), "lr": lr,
                                            "grad_norm": _num(res.grad_norm), "source": src,
                                            "smma": None if self.smma is None else _num(self.smma)})
                    clipped = getattr(self.engine, "fp8_clipped_total", None)   # fp8 delayed scaling only
                    if clipped is not None:
                        self.hist.train[-1]["fp8_clipped"] = clipped
                    self._perf.append({"step": s, "phase": self.phase, "time": round(time.time(), 3),
                                       "tokens_per_s": round(tps, 1)})
                    if live:
                        prog.update(task, completed=self.step, loss=f"{res.loss:.4f}", smma=_fmt(self.smma), lr=f"{lr:.2e}",
                                    tps=f"{tps_ema:,.0f}", src=src)
                    else:
                        eta = (time.time() - t_start) / max(1, self.step - s_start) * (self.end - self.step)
                        c.print(f"{self.phase} step {self.step}/{self.end} loss {res.loss:.4f} smma {_fmt(self.smma)} "
                                f"lr {lr:.2e} "
                                f"tok/s {tps_ema:,.0f} src {src} eta {eta:,.0f}s", highlight=False)
                    if time.time() - self._last_loss_write > 10:
                        self.write_history()
                for h in self.hooks:
                    halt = h.observe(self.step, res.loss, src) if h.observe else None
                    if not halt and self.step % h.every == 0:
                        halt = h.fn(self, self.step)
                    if halt:
                        self.halt = {"kind": h.name, **halt}
                        self.hist.events.append({"step": self.step, "kind": "halt", "detail": halt["reason"]})
                        self.evaluate()
                        self.checkpoint(f"halt: {h.name}")
                        c.print(f"halted at step {self.step}: {halt['reason']}")
                        return 0
                if self.step % eval_every == 0 and self.step < self.end:
                    self._print_val(self.evaluate())
                sigs, self._signals = self._signals, []
                sigs = self._agreed(sigs)
                if signal.SIGUSR1 in sigs:
                    self.checkpoint_now("SIGUSR1")
                    c.print(f"SIGUSR1: checkpoint at step {self.step}, continuing")
                if signal.SIGTERM in sigs:
                    self.checkpoint_now("SIGTERM")
                    c.print(f"SIGTERM: checkpoint at step {self.step}, exiting (run again to resume)")
                    return STOPPED
                if self.step % ck_every == 0 and self.step < self.end:
                    self.checkpoint("periodic")
        rec = self.evaluate()
        self.hist.events.append({"step": self.step, "kind": "end", "detail": f"{self.phase} phase complete"})
        self.checkpoint("end of phase")
        recent = [r["loss"] for r in self.hist.train[-10:] if r["loss"] is not None]
        c.print(f"{self.phase} done: step {self.step}, {time.time() - t_start:.1f}s, "
                f"train loss (last logged) {np.mean(recent) if recent else float('nan'):.4f}")
        self._print_val(rec)
        return 0

    def _print_val(self, rec: dict | None) -> None:
        if rec:
            per = " ".join(f"{k} {v:.3f}" for k, v in rec["per_source"].items())
            self.console.print(f"val step {rec['step']}: loss {rec['loss']:.4f} (unigram baseline {rec['unigram']:.4f}) | {per}",
                               highlight=False)


def smma_update(smma: float | None, loss: float, n: int) -> float | None:
    """Wilder's smoothed moving average: the first finite loss seeds it, then
    ``smma + (loss - smma) / n``; a non-finite loss leaves it as it is."""
    if not math.isfinite(loss):
        return smma
    loss = float(loss)
    return loss if smma is None else smma + (loss - smma) / n


def _num(x: float):
    return float(x) if math.isfinite(x) else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def coherence_hook(trainer: Trainer) -> Hook:
    """The early stop of andrea/coherence.py: sample the fixed prompts every coherence.every
    steps from the training weights; halt after coherence.patience degenerate checks."""
    from andrea.coherence import PROMPTS, CoherenceMonitor
    from andrea.generate import InferenceModel

    mon = CoherenceMonitor(trainer.settings.coherence)
    model = InferenceModel(trainer.mc, trainer.engine.w, trainer.engine.be, slots=len(PROMPTS))   # one batch

    def fn(tr: Trainer, step: int):
        tr.engine.settle()                      # the model reads the training weights themselves
        out = mon.sample_check(step, model, tr.tok, tr.seed)
        tr.hist.samples.extend(out["samples"])
        tr.hist.events.append({"step": step, "kind": "coherence",
                               "detail": f"degenerate={out['degenerate']} streak={out['streak']}"})
        if out["halt"]:
            return out["halt"]
        return None

    return Hook("coherence", mon.every, fn, mon.state_dict, mon.load_state_dict, mon.observe_loss)


def launcher_cmd(gpus: int, argv: list[str], which=None, torch_here: bool | None = None) -> list[str]:
    """The command that starts this ``andrea train`` as ``gpus`` processes on this host: torchrun,
    the standard launcher (the stage command stays ``andrea train ...`` for Snakemake and DVC); this
    interpreter's (``python -m torch.distributed.run``) where it has torch, so the ranks run the same
    Python, else the ``torchrun`` on PATH."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("torch") is not None if torch_here is None else torch_here:
        base = [sys.executable, "-m", "torch.distributed.run"]
    else:
        torchrun = (which or shutil.which)("torchrun")
        if torchrun is None:
            raise AndreaError(f"train.gpus={gpus}: no launcher (torchrun, from `pip install torch`); or start "
                              f"one process per GPU yourself: mpirun -np {gpus} andrea {' '.join(argv)}, "
                              f"srun --ntasks={gpus} --gpus-per-task=1 andrea {' '.join(argv)}")
        base = [torchrun]
    return base + ["--standalone", f"--nproc_per_node={gpus}", "-m", "andrea", *argv]


def run(args: argparse.Namespace, cfg: dict) -> int:
    gpus = Settings.from_dict(cfg).train.gpus
    if CLI_PROCESS and gpus > 1 and dist.launch_env() is None:
        # train.gpus > 1 and no launcher yet: become torchrun, which starts the ranks and forwards
        # SIGTERM to them (a SIGTERM that came already stops here, as in the run). torchrun would die
        # of a SIGUSR1 and orphan the ranks: it ignores it (the ranks catch their own, a signal to the
        # process group reaches them all; one rank's is the whole job's)
        if signal.SIGTERM in EARLY_SIGNALS:
            return STOPPED
        import os

        cmd = launcher_cmd(gpus, sys.argv[1:])
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        sys.stderr.write(f"train.gpus={gpus}: {' '.join(cmd)}\n")
        sys.stderr.flush()
        os.execvp(cmd[0], cmd)
    try:
        tr = Trainer(cfg, args.phase, args.tokenizer, args.tokens, args.out, args.init,
                     on_mismatch=getattr(args, "on_mismatch", "refuse"))
        tr.hooks.append(coherence_hook(tr))
        return tr.run()
    finally:
        if CLI_PROCESS:
            _ignore_signals_on_exit()


def _ignore_signals_on_exit() -> None:
    # the stage is over (its checkpoint landed, or it failed with its message): a SIGTERM
    # during the interpreter's exit has nothing left to save and must not turn exit 0 into -15
    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, signal.SIG_IGN)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run through the CLI: andrea train --help")
