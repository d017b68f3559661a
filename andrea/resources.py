"""What each pipeline stage asks a scheduler for: threads, memory, runtime and GPUs, from the
validated params. Snakemake rules declare these as ``threads:`` and ``resources:`` so an
executor plugin (SLURM: workflow/profiles/slurm) requests the right allocation per job.

    from andrea.resources import stage_resources
    stage_resources("train", cfg, phase="warmup")
    # {'threads': 2, 'mem_mb': 768, 'runtime': 13, 'gpu': 0}   (tiny: the NumPy engine's two batch slices)

    python -m andrea.resources                      # the table for every profile in params/profile/

In a rule (``CFG`` = the merged params per profile, as in workflow/rules/common.smk)::

    threads: rule_threads("train", lambda w: CFG[w.variant])
    resources: **rule_resources("train", lambda w: CFG[w.variant], phase="warmup")

Keys: ``threads`` (cores; Snakemake caps it by --cores locally and passes it to sbatch as
--cpus-per-task), ``mem_mb`` (host memory, sbatch --mem), ``runtime`` (minutes, sbatch -t),
``gpu`` (sbatch --gpus; 0 = none). Memory and runtime grow with Snakemake's ``attempt``, so a
retried job (profile ``retries``) asks for more after an out-of-memory or time-limit kill.

How the figures are made (estimates with the assumptions named here, not measurements):

* train on the NumPy engine: memory = Engine.planned_bytes (the same activation plan, computed
  without allocating) + the interpreter; threads = one per batch slice (the slices are fixed,
  andrea/engine/pool.py's BATCH_SLICES: more threads would idle, fewer run the slices in turn).
* train with backend auto | cupy: one GPU (auto means "the GPU where there is one"; set
  train.backend=numpy for a CPU node). Host memory holds the fp32 weights, m and v the
  checkpoint reads back, plus the CUDA context; the engine's arena lives on the GPU.
* runtime = steps x tokens/step x FLOPs/token / the throughput assumed below, x ``SAFETY``,
  plus ``OVERHEAD_MIN`` for start-up, held-out evals, coherence checks and checkpoints.
* data stages stream their input in batches (andrea/data/megachat.py): memory is a base
  plus the batch or sample the params bound; runtime is a base per corpus kind.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable

from andrea.errors import AndreaError, ConfigError
from andrea.preflight import HEADROOM  # 1.25 on every computed memory figure: the memory preflight's rule

MIB = 1 << 20
STAGES = ("pull-hermes3", "prep-megachat", "tokenizer", "diet-alignment", "train", "audit", "eval")

GPU_HOST_THREADS = 4             # a GPU job's host side: batches, checkpoints, logging
BASE_MB = 512                    # Python + NumPy + pyarrow + the andrea modules, measured ~200 MB
CUDA_BASE_MB = 3072              # + CuPy and the CUDA context on the host
# Throughput assumptions (sustained FLOP/s). CPU: ~40 GFLOP/s per thread was seen on the
# tiny run of this machine; 10 leaves room for slower nodes. GPU: the H200 bench of the CuPy
# engine does ~250 TFLOP/s at 120M bf16; 100 (bf16/fp16) and 20 (fp32) cover A100-class cards.
# fp8 measured 0.89-1.07x bf16's tokens/s on the H200 (docs/FP8.md), so it gets bf16's figure.
CPU_FLOPS_PER_THREAD = 10e9
GPU_FLOPS = {"fp32": 20e12, "bf16": 100e12, "fp16": 100e12, "fp8": 100e12}
SAFETY = 1.5
OVERHEAD_MIN = 10
UNIGRAM_MB = 80                  # train's unigram baseline counts (10M tokens as int64, per shard)
MEAN_DOC_BYTES = 16 << 10        # assumed mean document size in an Arrow batch
AUDIT_PROMPTS = 64               # at most this many fixed prompts (andrea/prompts)
EVAL_SOURCES = 16                # at most this many val shards (megachat.sources)


def _vocab(cfg: dict) -> int:
    return 256 + int(cfg["tokenizer"]["n_morphemes"]) + 1  # bytes + morphemes + end-of-text (harris.py)


def model_config(cfg: dict):
    from andrea.engine.model import ModelConfig

    return ModelConfig.from_cfg(cfg, _vocab(cfg))


def _n_params(cfg: dict) -> int:
    from andrea.engine.model import param_layout

    return param_layout(model_config(cfg)).n_params


def uses_gpu(cfg: dict) -> bool:
    """train.backend numpy runs on CPU; auto and cupy ask for a GPU."""
    return cfg["train"]["backend"] != "numpy"


def numpy_slots(batch_size: int) -> list[tuple[int, int]]:
    """The NumPy engine's batch slices (fixed, whatever the thread count: the bits depend on them)."""
    from andrea.engine.pool import batch_slices

    return batch_slices(int(batch_size))


def numpy_threads(cfg: dict) -> int:
    """One thread per batch slice: the most the NumPy engine can use."""
    return len(numpy_slots(cfg["train"]["batch_size"]))


def numpy_planned_bytes(cfg: dict) -> int:
    """Engine.planned_bytes of the NumPy engine: the same plan (andrea.engine.engine.engine_plan),
    computed without allocating."""
    from andrea.engine.backend import NumpyBackend
    from andrea.engine.engine import engine_bytes

    return engine_bytes(model_config(cfg), int(cfg["train"]["batch_size"]), NumpyBackend)


def flops_per_token(cfg: dict) -> float:
    """Training FLOPs per token: 6 x parameters (forward + backward matmuls) + causal attention."""
    mc = model_config(cfg)
    return 6.0 * _n_params(cfg) + 6.0 * mc.n_layer * mc.context * mc.d_model


def train_steps(cfg: dict, phase: str) -> int:
    W, total = int(cfg["curriculum"]["warmup_steps"]), int(cfg["train"]["max_steps"])
    if phase == "warmup":
        return W
    if phase == "main":
        return max(0, total - W)
    raise ConfigError(f"train phase {phase!r}: expected warmup or main")


def _minutes(flops: float, rate: float) -> int:
    return int(math.ceil(SAFETY * flops / rate / 60.0)) + OVERHEAD_MIN


def _mb(nbytes: float) -> int:
    return int(math.ceil(nbytes * HEADROOM / MIB))


def _model_job(cfg: dict, flops: float) -> dict:
    """train / eval / audit: threads, memory, runtime and GPUs for a job running the model."""
    if uses_gpu(cfg):
        n = _n_params(cfg)
        prec = cfg["train"]["precision"]
        g = int(cfg["train"].get("gpus", 1))            # data parallel: one process per GPU (andrea/dist.py)
        return {"threads": GPU_HOST_THREADS * g, "mem_mb": g * (CUDA_BASE_MB + _mb(16 * n)),
                "runtime": _minutes(flops, GPU_FLOPS[prec] * g), "gpu": g}
    threads = numpy_threads(cfg)
    return {"threads": threads, "mem_mb": BASE_MB + UNIGRAM_MB + _mb(numpy_planned_bytes(cfg)),
            "runtime": _minutes(flops, CPU_FLOPS_PER_THREAD * threads), "gpu": 0}


def stage_resources(stage: str, cfg: dict, phase: str | None = None, corpus: str | None = None,
                    attempt: int = 1) -> dict:
    """threads, mem_mb, runtime (minutes) and gpu for one ``andrea <stage>`` job on ``cfg``
    (a merged, validated config). ``phase``: warmup | main for train; ``corpus``: the
    hermes3.source a data job reads when it is not the config's own; ``attempt`` (1, 2, ...)
    multiplies memory and runtime."""
    if stage not in STAGES:
        raise ConfigError(f"stage {stage!r}: no resources known (stages: {', '.join(STAGES)})")
    if attempt < 1:
        raise ConfigError(f"attempt {attempt}: must be >= 1")
    src = corpus or cfg["hermes3"]["source"]
    hub = src == "hub"
    mc = cfg["megachat"]
    batch_mb = _mb(2 * int(mc["batch_rows"]) * min(int(mc["max_doc_bytes"]), MEAN_DOC_BYTES))
    if stage == "pull-hermes3":
        res = {"threads": 1, "mem_mb": BASE_MB + batch_mb, "runtime": 120 if hub else 15, "gpu": 0}
    elif stage == "prep-megachat":
        rows = int(cfg["hermes3"]["max_rows"]) or 10_000_000  # 0 = all rows: assume up to 10M documents
        res = {"threads": 1, "mem_mb": BASE_MB + 2 * batch_mb + _mb(8 * rows), "runtime": 60 if hub else 15,
               "gpu": 0}
    elif stage == "tokenizer":
        t = cfg["tokenizer"]
        # the training text, its word counts (~200 bytes a word type in Python) and the ranking
        need = 3 * int(t["max_train_bytes"]) + 200 * int(t["max_word_types"])
        minutes = OVERHEAD_MIN + int(math.ceil(SAFETY * int(t["max_train_bytes"]) / 0.5e6 / 60))  # 0.5 MB/s
        res = {"threads": 1, "mem_mb": BASE_MB + _mb(need), "runtime": minutes, "gpu": 0}
    elif stage == "diet-alignment":
        d = cfg["diet"]
        need = 4 * int(d["max_sample_bytes"]) + 2 * int(mc["batch_rows"]) * MEAN_DOC_BYTES
        minutes = OVERHEAD_MIN + int(math.ceil(SAFETY * len(d["sweep"]) * int(d["max_sample_bytes"]) / 0.5e6 / 60))
        res = {"threads": 1, "mem_mb": BASE_MB + _mb(need), "runtime": minutes + (60 if hub else 0), "gpu": 0}
    elif stage == "train":
        if phase is None:
            raise ConfigError("stage train: give phase='warmup' or 'main'")
        t = cfg["train"]
        tokens = train_steps(cfg, phase) * int(t["grad_accum"]) * int(t["batch_size"]) * int(cfg["model"]["context"])
        res = _model_job(cfg, tokens * flops_per_token(cfg))
    elif stage == "eval":
        t = cfg["train"]
        tokens = int(cfg["eval"]["max_batches"]) * int(t["batch_size"]) * int(cfg["model"]["context"]) * EVAL_SOURCES
        res = _model_job(cfg, tokens * flops_per_token(cfg) / 3)  # forward only: a third of a training step
        res["runtime"] += 20  # the judge: timeouts and retries over the network
    else:  # audit: sampling the fixed prompts, one token at a time over the whole context
        a = cfg["audit"]
        tokens = AUDIT_PROMPTS * int(a["samples_per_prompt"]) * int(a["max_new_tokens"]) * int(cfg["model"]["context"])
        res = _model_job(cfg, tokens * flops_per_token(cfg) / 3)
        if not uses_gpu(cfg):  # one thread (as today); the weights of two checkpoints and a KV cache
            res.update(threads=1, mem_mb=BASE_MB + _mb(8 * _n_params(cfg)),
                       runtime=_minutes(tokens * flops_per_token(cfg) / 3, CPU_FLOPS_PER_THREAD))
    res["mem_mb"] *= attempt
    res["runtime"] *= attempt
    return res


def rule_resources(stage: str, cfg_of: Callable, phase: str | None = None,
                   corpus_of: Callable | None = None) -> dict[str, Callable]:
    """``resources: **rule_resources(...)`` for a Snakemake rule: mem_mb, runtime and gpu as
    functions of (wildcards, attempt); ``cfg_of(wildcards)`` gives the merged params."""

    def one(key):
        def get(wildcards, attempt):
            corpus = corpus_of(wildcards) if corpus_of else None
            return stage_resources(stage, cfg_of(wildcards), phase, corpus, attempt)[key]
        return get

    return {k: one(k) for k in ("mem_mb", "runtime", "gpu")}


def rule_threads(stage: str, cfg_of: Callable, phase: str | None = None) -> Callable:
    """``threads: rule_threads(...)`` for a Snakemake rule (a function of the wildcards)."""
    return lambda wildcards: stage_resources(stage, cfg_of(wildcards), phase)["threads"]


def main(argv: list[str] | None = None) -> int:
    from andrea.config import load_config

    p = argparse.ArgumentParser(prog="python -m andrea.resources", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--profile", action="append",
                   help="a profile (repeatable; default: every params/profile/*.yaml)")
    args = p.parse_args(argv)
    profiles = args.profile or sorted(f.stem for f in (Path(args.params).parent / "params" / "profile").glob("*.yaml"))
    try:
        cfgs = {prof: load_config(args.params, prof) for prof in profiles}
    except AndreaError as e:
        print(f"python -m andrea.resources: {e}", file=sys.stderr)
        return e.exit_code
    print(f"{'profile':<12} {'stage':<16} {'threads':>7} {'mem_mb':>8} {'runtime':>8} {'gpu':>4}")
    for prof, cfg in cfgs.items():
        for stage in STAGES:
            for phase in (("warmup", "main") if stage == "train" else (None,)):
                r = stage_resources(stage, cfg, phase)
                name = f"{stage} {phase}" if phase else stage
                print(f"{prof:<12} {name:<16} {r['threads']:>7} {r['mem_mb']:>8} {r['runtime']:>8} {r['gpu']:>4}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
