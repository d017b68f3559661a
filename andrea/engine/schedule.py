"""Learning-rate schedule: linear warmup, then cosine decay to ``train.min_lr``.

    from andrea.engine.schedule import lr_at
    lr = lr_at(step, settings.train)    # step: 0-based global step (warmup and main phases share it)

    step < warmup_steps:  lr * (step + 1) / warmup_steps
    then:                 min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * p)),
                          p = (step - warmup_steps) / max(1, max_steps - warmup_steps), clamped to [0, 1]

One schedule spans the whole run: the warmup phase (curriculum.warmup_steps steps) and
the main phase (up to train.max_steps) are two stretches of the same global step counter.
"""

from __future__ import annotations

import math

from andrea.settings import TrainSettings


def lr_at(step: int, train: TrainSettings) -> float:
    """The learning rate of the 0-based global ``step`` (``train``: lr, min_lr, warmup_steps, max_steps)."""
    lr, min_lr, warm, total = train.lr, train.min_lr, train.warmup_steps, train.max_steps
    if step < warm:
        return lr * (step + 1) / warm
    p = min(1.0, max(0.0, (step - warm) / max(1, total - warm)))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
