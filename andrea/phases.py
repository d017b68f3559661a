"""The run's phases as data: which global steps each covers, what it draws, its learning-rate shape.

    from andrea.phases import phase_table, phase_at
    table = phase_table(settings.train, settings.curriculum)  # (Phase, ...), in step order
    row = phase_at(table, step)   # the row of the 0-based global step: row.name, .sources, .lr, ...

    name    stage   global steps                                   sources                    lr       archive
    warmup  warmup  [0, curriculum.warmup_steps)                   curriculum.warmup_sources  cosine   -
    main    main    [curriculum.warmup_steps, max_steps - polish)  every shard                cosine   -
    polish  main    [max_steps - curriculum.polish_steps, max)     curriculum.polish_sources  to-min   polish

``stage`` is the ``andrea train --phase`` that runs the row (polish is the last stretch of the
main run, in the same process and run folder). ``lr`` names a shape of andrea/engine/schedule.py:
``cosine`` is the run's one warmup + cosine schedule over [0, train.max_steps); ``to-min`` goes
linearly from that schedule's value at the row's first step down to ``train.min_lr`` on its last.
``archive``: entering the row writes a checkpoint (the SIGUSR1 path) that also lands
``archive/<archive>-step<start>.{state,samples}.json`` in the run folder (andrea/runs.py).
A row with no steps (warmup_steps 0, polish_steps 0) is left out. The curriculum
(andrea/curriculum) draws a row's sources and the schedule looks up its shape; train.py enters
the row that holds each step. Tests: ``pytest tests/test_polish.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from andrea.errors import ConfigError
from andrea.settings import CurriculumSettings, TrainSettings

LR_SHAPES = ("cosine", "to-min")


@dataclass(frozen=True)
class Phase:
    name: str
    stage: str                          # the `andrea train --phase` that runs it: warmup | main
    start: int                          # first global step
    end: int                            # one past the last
    sources: tuple[str, ...] | None     # what the curriculum draws; None = every shard
    lr: str                             # one of LR_SHAPES
    archive: str | None = None          # entering it archives the run state as archive/<archive>-step<start>.*


def phase_table(train: TrainSettings, curriculum: CurriculumSettings) -> tuple[Phase, ...]:
    """The rows with steps, in step order; a ConfigError naming the key when they do not fit."""
    W, total, P = curriculum.warmup_steps, train.max_steps, curriculum.polish_steps
    if W > total:
        raise ConfigError(f"curriculum.warmup_steps={W} > train.max_steps={total}: the main phase would have no steps")
    if P > total - W:
        raise ConfigError(f"curriculum.polish_steps={P} > the main phase's {total - W} steps (train.max_steps={total} "
                          f"- curriculum.warmup_steps={W}): lower it (0 = no polish)")
    if P and not curriculum.polish_sources:
        raise ConfigError("curriculum.polish_sources: empty; name the sources the polish draws (e.g. the chat ones)")
    rows = (Phase("warmup", "warmup", 0, W, tuple(curriculum.warmup_sources), "cosine"),
            Phase("main", "main", W, total - P, None, "cosine"),
            Phase("polish", "main", total - P, total, tuple(curriculum.polish_sources), "to-min", archive="polish"))
    return tuple(r for r in rows if r.end > r.start)


def phase_at(table: tuple[Phase, ...], step: int) -> Phase:
    """The row holding global ``step``; a step past the end belongs to the last row."""
    for r in table:
        if r.start <= step < r.end:
            return r
    if not table:
        raise ConfigError("train.max_steps: the run has no steps")
    return table[-1] if step >= table[-1].end else table[0]


def stage_rows(table: tuple[Phase, ...], stage: str) -> tuple[Phase, ...]:
    """The rows one `andrea train --phase` runs, in order."""
    return tuple(r for r in table if r.stage == stage)
