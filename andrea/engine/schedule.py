"""Learning-rate schedule: linear warmup, cosine decay to ``train.min_lr``, and the polish's decay.

    from andrea.engine.schedule import lr_at
    lr = lr_at(step, settings.train, table)   # step: 0-based global step (every phase shares it);
                                              # table: andrea.phases.phase_table(...), or None

The base shape (``cosine``), one curve over the whole run:
    step < warmup_steps:  lr * (step + 1) / warmup_steps
    then:                 min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * p)),
                          p = (step - warmup_steps) / max(1, max_steps - warmup_steps), clamped to [0, 1]
A phase-table row (andrea/phases.py) whose ``lr`` is ``to-min`` (the polish) replaces it on its
steps [a, b) by a straight line from the base value at a down to min_lr at b - 1:
                          min_lr + (base(a) - min_lr) * (b - 1 - step) / max(1, b - 1 - a)
so the steps before the row keep the base schedule's values to the bit, the LR is continuous
into the row, and its last step trains at the floor. Without a table (or on a ``cosine`` row)
the base shape holds.
"""

from __future__ import annotations

import math

from andrea.phases import phase_at
from andrea.settings import TrainSettings


def cosine(step: int, train: TrainSettings) -> float:
    """The base schedule of the 0-based global ``step`` (``train``: lr, min_lr, warmup_steps, max_steps)."""
    lr, min_lr, warm, total = train.lr, train.min_lr, train.warmup_steps, train.max_steps
    if step < warm:
        return lr * (step + 1) / warm
    p = min(1.0, max(0.0, (step - warm) / max(1, total - warm)))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


def lr_at(step: int, train: TrainSettings, table=None) -> float:
    """The learning rate of global ``step``: the shape of the phase-table row holding it."""
    if table:
        row = phase_at(table, step)
        if row.lr == "to-min":
            a, b = row.start, row.end
            top = cosine(a, train)
            return train.min_lr + (top - train.min_lr) * max(0, b - 1 - step) / max(1, b - 1 - a)
    return cosine(step, train)
