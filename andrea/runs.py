"""The run folder: the files of a training run, how a checkpoint lands in it, how to read it back.

    from andrea import runs
    rf = runs.RunFolder("runs/tiny/warmup")
    rf.bin, rf.state, rf.loss, rf.samples        # model.bin, model.{state,loss,samples}.json
    rf.perf                                      # model.perf.jsonl: wall-clock, not tracked
    with rf.writing() as notes:                  # the one writer: lock, finish or drop an interrupted
        rf.commit(step, w, m, v, state, loss, samples)   # checkpoint, stale temps; then land 4 files as one
        rf.commit(..., archive="polish-step550")     # ... and archive/polish-step550.{state,samples}.json with them
    state = rf.read_state(); runs.check_resume(state, rf.state, ...)
    step, w, m, v = rf.read_checkpoint(state, n_params)  # checked against its state (step, sha256)
    runs.find_checkpoint(run) / runs.find_checkpoints(run, extra) / runs.read_state_beside(ckpt)
    runs.check_for_inference(state, where, cfg, tokenizer) / runs.read_history(path)
    rf.append_perf([{"step", "phase", "time", "tokens_per_s"}, ...]); runs.read_perf(path)

This module alone knows a run folder; training, generation, audit, eval and the dashboard
call it. The files users, DVC and Snakemake see are always the four at the top of the
folder: ``model.bin`` (the binary format of andrea/engine/checkpoint.py, unchanged),
``model.state.json`` (everything else a resume needs, format ``andrea.state/1``),
``model.loss.json`` (the history, ``andrea.loss/1``) and ``model.samples.json``. They hold
only what the params determine, so the same params give the same bytes. What the machine
determines (when a step ended, tokens/s) goes to a fifth file beside them, ``model.perf.jsonl``
(one JSON line per logged step, appended best effort, outside the checkpoint unit and its
checks; ``.dvcignore`` keeps it out of DVC's hash of the folder). The dashboard reads it.

A checkpoint may carry an archive: ``archive/<name>.state.json`` and ``archive/<name>.samples.json``,
byte copies of its run state and samples, which later checkpoints never touch (the polish pivot of
andrea/phases.py keeps the run state at the pivot this way; ``model.loss.json`` is never archived:
it accumulates the whole history anyway). They land in the same unit as the four files, so the
archive exists exactly when the checkpoint that wrote it has landed.

How a checkpoint lands (a redo log of one entry; a kill -9 at any moment is safe):
  1. the four files (and the archive's two, under ``archive/``) are written into
     ``.checkpoint.pending/`` and fsynced, with the folder;
  2. ``.checkpoint.pending`` is renamed to ``.checkpoint.commit``: the commit point;
  3. each file is renamed from ``.checkpoint.commit/`` over its name at the top (the archive's
     into ``archive/``); then the empty ``.checkpoint.commit`` is removed.
A writer that starts (``writing()``) first finishes a ``.checkpoint.commit`` it finds (step 3
again; each rename is done at most once) and removes a ``.checkpoint.pending`` (an unfinished
attempt: the previous pair at the top is intact), and the temp files of ``fsutil.atomic_open``
that a killed process left beside the four files. So the top holds the previous pair or the
new one; between two renames of step 3 (microseconds) a reader could see them mixed, which
``read_checkpoint`` refuses as ``SplitPair`` and the next writer repairs. A writer holds an
exclusive ``flock`` on the folder, so two trainers never share one. Readers never modify.

A disk that fills up, or any other OSError while writing, removes the pending folder and
raises one ``AndreaError`` naming the file, the step that survives and what to do; a run
state that JSON cannot hold (NaN/inf) is refused the same way, naming the key.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from andrea.engine import checkpoint as ck
from andrea.errors import AndreaError
from andrea.fsutil import atomic_write_bytes, fsync_dir, json_text, read_json

BIN, STATE, LOSS, SAMPLES = "model.bin", "model.state.json", "model.loss.json", "model.samples.json"
PERF = "model.perf.jsonl"       # wall-clock sidecar: never hashed by DVC, never checked, best effort
WALL_CLOCK = ("time", "tokens_per_s")   # train-record fields older versions wrote into model.loss.json
FILES = (BIN, STATE, LOSS, SAMPLES)
PENDING, COMMITTED = ".checkpoint.pending", ".checkpoint.commit"
ARCHIVE = "archive"             # copies of a checkpoint's state and samples kept at a pivot (the polish)
STATE_FORMAT = "andrea.state/1"
LOSS_FORMAT = "andrea.loss/1"
SAMPLES_FORMAT = "andrea.samples/1"
HISTORY_KEYS = ("train", "val", "pulls", "events")
# what fsutil.atomic_open leaves when killed mid-write: .<name>.<random>.tmp
_STALE_TEMP = re.compile(r"^\.(" + "|".join(re.escape(n) for n in FILES) + r")\.[A-Za-z0-9_]+\.tmp$")


class RunMismatch(AndreaError):
    """The run folder holds a run of another trajectory config, tokenizer, data or model size."""


class SplitPair(AndreaError):
    """model.bin and model.state.json do not belong together (a crash of an older version, or a
    hand edit): the run cannot be resumed. ``--on-mismatch restart`` moves such a run aside."""


def _no_space(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def _nonfinite(obj: Any, where: str = "") -> str | None:
    """The dotted key of the first NaN/inf float in ``obj``, or None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return f"{where or '(top)'}={obj}"
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for k, v in items:
        hit = _nonfinite(v, f"{where}.{k}" if where else str(k))
        if hit:
            return hit
    return None


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class RunFolder:
    """One run folder (``--out`` of ``andrea train``); see the module docstring."""

    def __init__(self, out: str | Path):
        self.dir = Path(out)
        self.bin, self.state = self.dir / BIN, self.dir / STATE
        self.loss, self.samples = self.dir / LOSS, self.dir / SAMPLES
        self.perf = self.dir / PERF
        self.committed_step: int | None = None     # the step of the pair at the top, once known
        self._lock: int | None = None

    def files(self) -> list[Path]:
        return [self.dir / n for n in FILES]

    def exists(self) -> bool:
        """A checkpoint or a run state is there (a run to resume, or a split pair to refuse)."""
        return self.bin.exists() or self.state.exists()

    # ------------------------------------------------------------ the writer
    @contextlib.contextmanager
    def writing(self) -> Iterator[list[str]]:
        """Lock the folder for this process and repair it; yields what the repair did."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AndreaError(f"{self.dir}: another `andrea train` is writing this run folder; "
                              "wait for it to end (or stop it) and run again") from None
        except OSError:
            pass                  # a file system without locks (ENOLCK): go on unlocked, as before
        self._lock = fd
        try:
            yield self.recover()
        finally:
            self._lock = None
            os.close(fd)

    def recover(self) -> list[str]:
        """Finish an interrupted commit, drop an unfinished one, remove stale temp files."""
        notes = []
        if (self.dir / COMMITTED).is_dir():
            moved = self._roll_forward()
            notes.append(f"finished an interrupted checkpoint commit ({', '.join(moved) or 'nothing left to move'})")
        if (self.dir / PENDING).exists():
            shutil.rmtree(self.dir / PENDING, ignore_errors=True)
            notes.append(f"removed an unfinished checkpoint ({PENDING}); the previous one stands")
        stale = [p for p in self.dir.iterdir() if _STALE_TEMP.match(p.name) and p.is_file()]
        for p in stale:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        if stale:
            notes.append(f"removed {len(stale)} stale temp file(s) of a killed write")
        return notes

    def _roll_forward(self) -> list[str]:
        done = self.dir / COMMITTED
        moved = []
        if (done / ARCHIVE).is_dir():
            (self.dir / ARCHIVE).mkdir(exist_ok=True)
            for p in sorted((done / ARCHIVE).iterdir()):
                os.replace(p, self.dir / ARCHIVE / p.name)
                moved.append(f"{ARCHIVE}/{p.name}")
            fsync_dir(self.dir / ARCHIVE)
            os.rmdir(done / ARCHIVE)
        for name in FILES:
            if (done / name).exists():
                os.replace(done / name, self.dir / name)
                moved.append(name)
        fsync_dir(self.dir)
        os.rmdir(done)
        return moved

    def archived(self, name: str) -> list[Path]:
        """The two files ``commit(..., archive=name)`` lands: archive/<name>.state.json, .samples.json."""
        return [self.dir / ARCHIVE / f"{name}.state.json", self.dir / ARCHIVE / f"{name}.samples.json"]

    def commit(self, step: int, w: np.ndarray, m: np.ndarray, v: np.ndarray, state: dict, loss: dict,
               samples: dict, archive: str | None = None) -> None:
        """Land model.bin, model.state.json (its ``checkpoint_sha256`` filled in here),
        model.loss.json and model.samples.json as one unit; with ``archive``, byte copies of the
        state and samples as ``archive/<archive>.{state,samples}.json`` in the same unit."""
        pend = self.dir / PENDING
        if (self.dir / COMMITTED).exists():
            self._roll_forward()
        shutil.rmtree(pend, ignore_errors=True)
        current = pend / BIN
        try:
            pend.mkdir(parents=True)
            state = dict(state)
            state["checkpoint_sha256"] = ck.write_checkpoint(current, step, w, m, v, atomic=False)
            for name, doc, what in ((STATE, state, "run state"), (LOSS, loss, "loss history"),
                                    (SAMPLES, samples, "samples")):
                current = pend / name
                try:
                    text = json_text(doc)
                except ValueError:
                    raise AndreaError(f"{self.dir / name}: the {what} of step {step} holds "
                                      f"{_nonfinite(doc) or 'a value JSON cannot store'}, so the checkpoint of step "
                                      f"{step} was not written; {self._survivor()}; look for a NaN/inf param "
                                      "feeding it") from None
                _write_synced(current, text.encode("utf-8"))
            if archive:
                (pend / ARCHIVE).mkdir()
                for src, dst in zip((pend / STATE, pend / SAMPLES), self.archived(archive)):
                    current = pend / ARCHIVE / dst.name
                    _write_synced(current, src.read_bytes())
                fsync_dir(pend / ARCHIVE)
            fsync_dir(pend)
            os.rename(pend, self.dir / COMMITTED)
            fsync_dir(self.dir)
        except OSError as e:
            shutil.rmtree(pend, ignore_errors=True)
            raise self._io_error(e, self.dir / current.relative_to(pend), f"writing the checkpoint of step {step}") from None
        except BaseException:
            shutil.rmtree(pend, ignore_errors=True)
            raise
        try:
            self._roll_forward()
        except OSError as e:
            raise self._io_error(e, self.dir / COMMITTED, f"moving the checkpoint of step {step} into place "
                                 "(the next start finishes it)") from None
        self.committed_step = step

    def write_history(self, loss: dict, samples: dict) -> None:
        """The history between checkpoints (each file atomic; ahead of the pair is fine: a resume
        drops what lies past its step)."""
        for path, doc in ((self.loss, loss), (self.samples, samples)):
            try:
                text = json_text(doc)
            except ValueError:
                raise AndreaError(f"{path}: the history holds {_nonfinite(doc) or 'a value JSON cannot store'}, so it "
                                  f"was not written; {self._survivor()}; look for a NaN/inf param feeding it") from None
            try:
                atomic_write_bytes(path, text.encode("utf-8"))
            except OSError as e:
                raise self._io_error(e, path, "writing the history") from None

    def _survivor(self) -> str:
        if self.committed_step is None:
            return f"no checkpoint was saved in {self.dir} yet"
        return f"{self.bin} still holds step {self.committed_step}, intact"

    def _io_error(self, e: OSError, path: Path, doing: str) -> AndreaError:
        if _no_space(e):
            what = f"no space left on the device while {doing}"
            todo = f"free space on {self.dir} (a checkpoint needs about twice the size of model.bin) and run again to resume"
        else:
            what = f"{e.strerror or e} while {doing}"
            todo = "fix the cause and run again to resume"
        return AndreaError(f"{path}: {what}; {self._survivor()}: {todo}")

    def move_aside(self, config_hash: str) -> Path:
        """Move the run files to a sibling ``<out>.stale-<hash>[-k]`` folder (nothing is deleted)."""
        dest = self.dir.with_name(f"{self.dir.name}.stale-{config_hash}")
        k = 1
        while dest.exists():
            k += 1
            dest = self.dir.with_name(f"{self.dir.name}.stale-{config_hash}-{k}")
        dest.mkdir(parents=True)
        for p in self.files() + [self.perf, self.dir / ARCHIVE]:
            if p.exists():
                p.replace(dest / p.name)
        self.committed_step = None
        return dest

    def append_perf(self, records: list[dict]) -> None:
        """Append wall-clock records (one JSON line each) to ``model.perf.jsonl``. Best effort: a
        failed write loses throughput figures only, never the run, so it is ignored."""
        if not records:
            return
        try:
            with open(self.perf, "a+b") as f:
                f.seek(0, os.SEEK_END)
                torn = f.tell() > 0 and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n"
                text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in records)
                f.write((("\n" if torn else "") + text).encode("utf-8"))   # a killed write's torn line ends
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------ reading the pair
    def _split(self, what: str) -> SplitPair:
        if (self.dir / COMMITTED).is_dir():
            return SplitPair(f"{what}: a checkpoint commit was interrupted ({self.dir / COMMITTED} holds the rest); "
                             f"`andrea train` with this --out finishes it (or move its files up by hand)")
        return SplitPair(f"{what} (split by a crash of an older version?): it cannot be resumed; "
                         "`--on-mismatch restart` moves it aside, or delete the folder")

    def read_state(self) -> dict:
        """The run state; a checkpoint without its state (or the reverse) is a SplitPair."""
        if self.bin.exists() != self.state.exists():
            have, lack = (self.bin, self.state) if self.bin.exists() else (self.state, self.bin)
            raise self._split(f"{have}: found without {lack.name}")
        state = read_json(self.state, "run state")
        if state.get("format") != STATE_FORMAT:
            raise AndreaError(f"{self.state}: format {state.get('format')!r}, expected {STATE_FORMAT!r}")
        return state

    def read_checkpoint(self, state: dict, n_params: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """model.bin, refused unless it is the checkpoint ``state`` describes (step and sha256)."""
        step, w, m, v = ck.read_checkpoint(self.bin, n_params)
        if state.get("step") != step:
            raise self._split(f"{self.state}: step {state.get('step')} but {self.bin} holds step {step}")
        want = state.get("checkpoint_sha256")
        if want is not None:
            h = hashlib.sha256(ck.HEAD.pack(step, w.size))
            for a in (w, m, v):
                h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
            if h.hexdigest() != want:
                raise AndreaError(f"{self.bin}: sha256 differs from the one in {self.state} (modified or corrupt)")
        self.committed_step = step
        return step, w, m, v


def check_resume(state: dict, where: Path, *, phase: str, tokenizer_sha256: str, config_hash: str,
                 train_shards: dict, n_params: int) -> None:
    """Refuse to continue a run state of another phase, tokenizer, trajectory config, data or size."""
    if state.get("phase") != phase:
        raise AndreaError(f"{where}: a {state.get('phase')!r} run, expected {phase!r}")
    if state.get("tokenizer_sha256") != tokenizer_sha256:
        raise RunMismatch(f"{where}: trained with tokenizer {str(state.get('tokenizer_sha256'))[:12]}..., "
                          f"but --tokenizer is {tokenizer_sha256[:12]}...")
    if state.get("config_hash") != config_hash:
        raise RunMismatch(f"{where}: trained with another config (config_hash {str(state.get('config_hash'))[:12]}... "
                          f"!= {config_hash[:12]}...); only train.log_every/checkpoint_every/eval_every/eval_batches "
                          "may change on resume: use the same params or a new --out")
    fp = state.get("train_shards")
    if fp is not None and fp != train_shards:
        raise RunMismatch(f"{where}: the train token shards changed since this run was made "
                          f"({fp} != {train_shards}): re-run from scratch with a new --out")
    if state.get("n_params") != n_params:
        raise RunMismatch(f"{where}: n_params {state.get('n_params')} != the model's {n_params}")


# ------------------------------------------------------------ readers (inference, reports)
def find_checkpoint(run: str | Path) -> Path:
    """``run`` may be a checkpoint file or a run folder holding ``model.bin``."""
    p = Path(run)
    if p.is_dir():
        p = p / BIN
    if not p.is_file():
        raise AndreaError(f"{p}: checkpoint not found (train the run first, or pass a model.bin)")
    return p


def state_path_beside(ckpt: Path) -> Path:
    return ckpt.with_name(ckpt.stem + ".state.json")     # model.bin -> model.state.json


def read_state_beside(ckpt: Path) -> dict | None:
    """The ``.state.json`` beside a checkpoint, or None."""
    sp = state_path_beside(ckpt)
    return read_json(sp, "run state") if sp.is_file() else None


def check_for_inference(state: dict | None, state_path: Path, cfg: dict, tokenizer) -> None:
    """Refuse a checkpoint whose ``.state.json`` names another tokenizer or model shape."""
    if state is None:
        return
    sha = state.get("tokenizer_sha256")
    if sha and sha != tokenizer.sha256:
        raise AndreaError(f"{state_path}: tokenizer_sha256 {sha[:12]}... does not match the tokenizer given "
                          f"({tokenizer.sha256[:12]}...): this checkpoint was trained with another tokenizer")
    recorded = []
    if isinstance(state.get("model"), dict):
        recorded.append(state["model"])
    saved = state.get("config")
    if isinstance(saved, dict) and isinstance(saved.get("model"), dict):
        recorded.append(saved["model"])
    for model in recorded:
        for k, v in model.items():
            if k == "vocab_size":
                if v != tokenizer.vocab_size:
                    raise AndreaError(f"{state_path}: vocab_size {v} in the run, {tokenizer.vocab_size} in the tokenizer given")
            elif k in cfg["model"] and cfg["model"][k] != v:
                raise AndreaError(f"{state_path}: model.{k}={v} in the run, but the config says "
                                  f"model.{k}={cfg['model'][k]} (wrong --profile?)")


def find_checkpoints(run: Path, extra: list[str] | tuple = ()) -> list[tuple[int, Path, bool]]:
    """``[(step, path, is_final)]``: archived checkpoints (any other ``*.bin`` in the checkpoint
    format under the run folder, outside hidden folders, plus ``extra`` files such as the warmup
    run's ``model.bin``) ordered by step, then the final ``model.bin``."""
    run = Path(run)
    final = run / BIN
    if not final.is_file():
        raise AndreaError(f"{final}: final checkpoint not found (train the run first)")
    extras = []
    for e in extra:
        ep = Path(e)
        ep = ep / BIN if ep.is_dir() else ep
        if not ep.is_file():
            raise AndreaError(f"{ep}: extra checkpoint not found")
        extras.append(ep)
    found = []
    archived = [p for p in sorted(run.rglob("*.bin")) if not any(s.startswith(".") for s in p.relative_to(run).parts)]
    for p in archived + extras:
        if p == final:
            continue
        try:
            step, _ = ck.read_header(p)
        except AndreaError:
            if p in extras:
                raise
            continue                      # another kind of .bin under the run folder
        found.append((step, p, False))
    found.sort(key=lambda t: (t[0], str(t[1])))
    return found + [(ck.read_header(final)[0], final, True)]


def _reject_constant(name: str):
    raise ValueError(f"holds {name}, which is not JSON (the training loop writes null for a non-finite value)")


_HISTORY_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _kind(x) -> str:
    return "null" if x is None else f"a JSON {type(x).__name__}"


def parse_history(text: str) -> dict:
    """The text of ``model.loss.json`` as ``{key: [record, ...]}`` for HISTORY_KEYS; a ValueError
    saying what is wrong for anything training does not write (NaN/Infinity, a list that is not a
    list of objects, a top level that is not an object, nesting too deep to parse)."""
    try:
        d = _HISTORY_DECODER.decode(text)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None
    if not isinstance(d, dict):
        raise ValueError(f"a JSON {type(d).__name__}, not an object")
    out = {}
    for k in HISTORY_KEYS:
        recs = d.get(k, [])
        if not isinstance(recs, list):
            raise ValueError(f"\"{k}\" is {_kind(recs)}, not a list of records")
        for i, r in enumerate(recs):
            if not isinstance(r, dict):
                raise ValueError(f"\"{k}\"[{i}] is {_kind(r)}, not a record (an object)")
        out[k] = recs
    return out


def read_history(path: str | Path) -> dict:
    """``model.loss.json`` parsed by ``parse_history``; a missing file is an empty history, an
    unreadable one an AndreaError naming the file and what is wrong."""
    path = Path(path)
    try:
        return parse_history(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {k: [] for k in HISTORY_KEYS}
    except UnicodeDecodeError:
        raise AndreaError(f"{path}: loss history is unreadable: not UTF-8") from None
    except ValueError as e:
        raise AndreaError(f"{path}: loss history is unreadable: {e}") from None


def read_perf(path: str | Path) -> dict[int, dict]:
    """``model.perf.jsonl`` as ``{step: record}`` (a later line for a step wins: a resume redoes
    the steps a crash logged past its checkpoint). Best effort: a missing file is ``{}``; a
    line that is not a record with an integer step (a write torn by a kill) is skipped."""
    out: dict[int, dict] = {}
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            r = _HISTORY_DECODER.decode(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(r, dict) and isinstance(r.get("step"), int):
            out[r["step"]] = r
    return out


def read_samples(path: str | Path) -> list:
    """``model.samples.json`` "samples" (a missing file: none)."""
    path = Path(path)
    if not path.is_file():
        return []
    s = read_json(path, "samples").get("samples", [])
    if not isinstance(s, list):
        raise AndreaError(f"{path}: 'samples' must be a list")
    return s
