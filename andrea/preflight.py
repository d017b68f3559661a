"""Preflight: refuse a batch or context the token shards cannot feed, before any slow work.

    from andrea.preflight import check_data
    for w in check_data(train_shards, val_shards, batch_size=16, context=128):
        print("warning:", w)                 # raises ConfigError (exit 3) for what cannot work

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
"""

from __future__ import annotations

from andrea.errors import ConfigError
from andrea.shards import Shard


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
