"""Preflight: refuse a batch or context the token shards cannot feed, and a batch the memory
cannot hold, before any slow work or any allocation.

    from andrea.preflight import check_data, check_memory, check_schedule
    for w in check_data(train_shards, val_shards, batch_size=16, context=128):
        print("warning:", w)                 # raises ConfigError (exit 3) for what cannot work
    for w in check_schedule(warmup_steps=2000, max_steps=3000):
        print("warning:", w)                 # the LR would still be rising past the run's midpoint
    check_memory(lambda b: planned_bytes_at(b), 64, (free_bytes, "GPU 0"), "cupy bf16 engine")
                                             # raises AndreaError (exit 2) when the plan does not fit

``andrea train`` calls it once the shards are open and before the engine allocates its
buffers. Training draws one microbatch of ``batch_size`` windows of ``context + 1`` tokens
from a single source (andrea/curriculum/sampler.py), so:

* a train source shorter than one window (``context + 1`` tokens), or than one microbatch
  (``batch_size * (context + 1)`` tokens: the windows would wrap around the source and
  repeat it), is refused, naming the source, its size, and the largest setting that fits;
* the held-out loss scores consecutive windows of each val shard
  (``curriculum.sequential_windows``): a val shard shorter than ``context + 1`` tokens gives
  none and would silently drop out of the mean, so that is a warning naming each such
  source, and a refusal when it is true of every val shard (no held-out loss at all).

Every message carries the numbers. Shards are read only through their headers.

Schedule (``check_schedule``): a run shortened with ``-S train.max_steps=...`` keeps the
recipe's ``train.warmup_steps``; when that is more than half the run, the learning rate is
still rising past its midpoint (2000 of 3000 steps peaks at two thirds of the run, which
bounded the curriculum comparison of docs/FIREHOSE-BANDIT.md), so that is a warning with the
numbers and a setting that keeps warmup to a few percent of the run.

Memory (``check_memory``): the engines call it with their own plan (``Engine``: the plan
``engine_plan`` gives; ``GpuEngine``: its arena, ``andrea.cuda.engine.arena_layout``) and
their backend's ``free_memory()`` (CuPy: ``cudaMemGetInfo`` of the current device; NumPy:
``host_free_memory``, MemAvailable capped by the cgroup's memory.max), right after
``check_data`` and before they allocate anything, so ``andrea train`` (and the Snakemake and DVC
jobs that run it) stop with one line and exit 2 instead of an out-of-memory traceback or a
kill. A plan fits when planned x ``HEADROOM`` (1.25, the rule andrea/resources.py sizes jobs by:
the CUDA context, cuBLAS's workspace and the interpreter live outside the plan) <= the free bytes; the
refusal gives both numbers and the largest batch that fits, found by search over the planner.
``python -m andrea.memory`` prints the same plans as tables (docs/ANDREA.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from andrea.errors import AndreaError, ConfigError
from andrea.shards import Shard

# The one headroom rule, on every computed memory figure: a plan needs HEADROOM x its bytes.
# andrea/resources.py sizes cluster jobs with it; check_memory and the tables of docs/ANDREA.md
# apply it to free memory.
HEADROOM = 1.25


def _sizes(shards: dict[str, Shard]) -> list[tuple[int, str, str]]:
    return sorted((int(s.n_tokens), name, str(s.path)) for name, s in shards.items())


def _below(sizes: list[tuple[int, str, str]], need: int) -> tuple | None:
    """(tokens, name, path, "(and k more ...)") of the smallest train source under ``need`` tokens."""
    under = [x for x in sizes if x[0] < need]
    if not under:
        return None
    others = f" (and {len(under) - 1} more train source(s))" if len(under) > 1 else ""
    return (*under[0], others)


def check_data(train: dict[str, Shard], val: dict[str, Shard], batch_size: int, context: int) -> list[str]:
    """ConfigError for a batch/context that the shards cannot hold; the warnings (one line each) otherwise."""
    B, T = int(batch_size), int(context)
    window, micro = T + 1, B * (T + 1)
    sizes = _sizes(train)
    short = _below(sizes, window)
    if short:
        n, name, path, others = short
        raise ConfigError(f"model.context={T}: one training window is {window} tokens, but train source {name} "
                          f"holds {n} ({path}){others}; lower model.context to at most {max(n - 1, 0)} "
                          "or add data to that source")
    small = _below(sizes, micro)
    if small:
        n, name, path, others = small
        raise ConfigError(f"train.batch_size={B}: one microbatch takes {B} x (model.context+1={window}) = {micro:,} "
                          f"tokens from one source, but train source {name} holds {n:,} ({path}){others}; "
                          f"lower train.batch_size to at most {n // window} (use train.grad_accum for a larger step)")
    warnings = []
    vsizes = _sizes(val)
    dropped = [(n, name) for n, name, _ in vsizes if n < window]
    if vsizes and len(dropped) == len(vsizes):
        n, name, _ = vsizes[-1]
        raise ConfigError(f"model.context={T}: every val shard is shorter than one window of {window} tokens "
                          f"(the longest, {name}, holds {n}), so there would be no held-out loss; "
                          f"lower model.context to at most {max(n - 1, 0)} or give the val split more data")
    if dropped:
        listed = ", ".join(f"{name} ({n} tokens)" for n, name in dropped)
        warnings.append(f"model.context={T}: {len(dropped)} of {len(vsizes)} val shards are shorter than one window "
                        f"of {window} tokens and are left out of the held-out loss: {listed}")
    return warnings


def check_schedule(warmup_steps: int, max_steps: int) -> list[str]:
    """A one-line warning when the LR warmup covers more than half of the run, else []."""
    W, total = int(warmup_steps), int(max_steps)
    if total <= 0 or 2 * W <= total:
        return []
    return [f"train.warmup_steps={W} is {W / total:.0%} of train.max_steps={total}: the learning rate still rises "
            f"past the run's midpoint and peaks at step {min(W, total)}; a short run usually warms up over a few "
            f"percent of its steps (e.g. -S train.warmup_steps={max(1, total // 50)})"]


# ----------------------------------------------------------------------------------- memory
def fmt_bytes(n: float) -> str:
    """1.50 GiB, 312.0 MiB: what the refusal and the tables print."""
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def fits(planned: int, free: int) -> bool:
    """The one rule: a plan fits when it and its headroom (``HEADROOM``) are at most ``free``."""
    return planned * HEADROOM <= free


def largest_batch(planned_of: Callable[[int], int], free: int) -> int:
    """The largest batch B with ``fits(planned_of(B), free)``, 0 when not even B = 1 fits.
    ``planned_of`` must not decrease with B (every planned buffer grows with the batch):
    doubling, then bisection."""
    if not fits(planned_of(1), free):
        return 0
    lo, hi = 1, 2
    while fits(planned_of(hi), free):
        lo, hi = hi, hi * 2
    while hi - lo > 1:                           # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(planned_of(mid), free) else (lo, mid)
    return lo


def check_memory(planned_of: Callable[[int], int], batch_size: int, free: tuple[int, str] | None,
                 engine: str, instead: tuple[str, Callable[[int], int]] | None = None,
                 accum_of: Callable[[int], int] | None = None) -> None:
    """AndreaError (exit 2, one line) when the plan of ``batch_size`` does not fit ``free``
    = (bytes, where), the answer of a backend's ``free_memory()`` (None: unknown, no check).
    ``planned_of(B)`` is the engine's planned bytes at batch B, computed without allocating;
    ``instead`` = (setting, its planned_of): a setting that plans less (train.recompute=gelu),
    named in the refusal when the batch fits with it. ``accum_of(B)``: the planned bytes at batch B with
    more than one microbatch a step, where they differ (the GPU engine's ACTS_IN_GRADS): the batch the
    refusal offers, with train.grad_accum raised, is the largest that fits by it."""
    if free is None:
        return
    nbytes, where = free
    B, need = int(batch_size), planned_of(int(batch_size))
    if fits(need, nbytes):
        return
    fit = largest_batch(accum_of or planned_of, nbytes)
    head = (f"train.batch_size={B}: the {engine} plans {fmt_bytes(need)} ({fmt_bytes(need * HEADROOM)} with the "
            f"x{HEADROOM} headroom) but {where} has {fmt_bytes(nbytes)} free")
    if instead is not None:
        lighter = instead[1](B)
        if fits(lighter, nbytes):
            head += f"; -S {instead[0]} keeps this batch ({fmt_bytes(lighter)})"
    if fit:
        k = -(-B // fit)
        raise AndreaError(f"{head}; the largest batch that fits is {fit}: set -S train.batch_size={fit} "
                          f"(and multiply train.grad_accum by {k} to keep about the same tokens per step)")
    one = planned_of(1)
    raise AndreaError(f"{head}; even train.batch_size=1 needs {fmt_bytes(one)} ({fmt_bytes(one * HEADROOM)} "
                      f"with the headroom): use a smaller model (model.d_model, model.n_layer) or a device "
                      f"with more memory")


def host_free_memory(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/proc/self/cgroup",
                     cgroup_root: str | Path = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """(bytes, where) the NumPy engine can get on Linux: MemAvailable of /proc/meminfo, capped
    by this process's cgroup memory limit when it has one (v2 memory.max, v1
    memory.limit_in_bytes: a SLURM job's --mem, a container's limit). The limit is taken whole
    (what the process already holds is covered by the headroom), so the check refuses only what
    cannot fit. None where neither is readable (not Linux): no check."""
    best = None
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                best = (int(line.split()[1]) * 1024, "this host (MemAvailable)")
    except (OSError, ValueError, IndexError):
        pass
    try:
        lines = Path(cgroup).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:                          # "0::/path" (v2) or "4:memory:/path" (v1)
        parts = line.split(":", 2)
        if len(parts) != 3 or not (parts[:2] == ["0", ""] or "memory" in parts[1].split(",")):
            continue
        v2 = parts[1] == ""
        folder = Path(cgroup_root) / ("" if v2 else "memory") / parts[2].strip().lstrip("/")
        try:
            text = (folder / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
            limit = int(text) if text != "max" else None
        except (OSError, ValueError):
            continue
        if limit is not None and limit < 1 << 60 and (best is None or limit < best[0]):   # v1 "no limit" is ~2^63
            best = (limit, f"this process's cgroup (memory limit {fmt_bytes(limit)})")
    return best
