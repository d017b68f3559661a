"""Benchmark: data-parallel training over NCCL on one multi-GPU host (x2 / x4 / x8), the targets of
issue 15, each as one command. Every run is a real `andrea train` under torchrun, one process per GPU.

    PYTHONPATH=. python3 bench/multi_gpu.py --gpus 1,2,4,8 --out /tmp/mg --json /tmp/mg/result.json
    PYTHONPATH=. python3 bench/multi_gpu.py --gpus 1,2 --only scaling --variants andrea-120m --steps 30

What it measures (N = 1 is the baseline, through the same launcher and the same NCCL path):
 1. scaling (--variants, default andrea-120m and andrea-480m): ``train.batch_size = B N`` (B rows per
    GPU, --batch 8), --steps steps; tokens/s = the median over the perf sidecar's logged steps after
    the first --skip; efficiency = tps_N / (N tps_1). Targets: >= 0.90 (120m), >= 0.95 (480m).
 2. loss (andrea-120m, --loss-steps 200): N GPUs at batch B N against one GPU at batch B with
    grad_accum N (the same tokens per step, other windows: each microbatch is its own draw), the
    mean train loss over the last quarter within --loss-tol (relative, default 0.02); and against one
    GPU at batch B N, grad_accum 1, which draws the very windows the N-GPU run draws (the world size
    changes only the sums' rounding): per-step losses within --exact-tol (relative, default 0.02, bf16).
 3. memory: m + v bytes per GPU of the engine's arena (``arena_layout``, what GpuEngine allocates,
    tests/test_memory_gpu.py) at N against N = 1; target at N = 8: <= 1/6.

Runs left (no multi-GPU host has been lent yet), in order, on an x2 / x4 / x8 H200 host:
    PYTHONPATH=. python3 -m pytest -m gpu tests/test_dist_gpu.py        # the ranks on one GPU, real NCCL at N = 2
    PYTHONPATH=. python3 bench/multi_gpu.py --gpus 1,2 --json /tmp/mg/x2.json       # x2
    PYTHONPATH=. python3 bench/multi_gpu.py --gpus 1,2,4 --json /tmp/mg/x4.json     # x4
    PYTHONPATH=. python3 bench/multi_gpu.py --gpus 1,2,4,8 --json /tmp/mg/x8.json   # x8: all targets

Data: synthetic shards at the profile's vocabulary (documents that repeat a random phrase, so the
loss falls), written once under --out; or --tokenizer/--tokens of a real prep. Prints a table of
same-run ratios and PASS/FAIL per target; exit 1 when a target fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_gpu import exit_gpu_main  # noqa: E402

from andrea.errors import AndreaError  # noqa: E402

TARGET_EFF = {"andrea-120m": 0.90, "andrea-480m": 0.95}


def profile(name: str) -> dict:
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    over = yaml.safe_load((ROOT / "params" / "profile" / f"{name}.yaml").read_text()) or {}
    return {"n_morphemes": over.get("tokenizer", {}).get("n_morphemes", base["tokenizer"]["n_morphemes"]),
            "model": {**base["model"], **over.get("model", {})}}


def synth_data(root: Path, n_morphemes: int, tokens_per_source: int = 4_000_000) -> tuple[Path, Path]:
    from andrea.shards import ShardWriter
    from andrea.tokenizer.harris import Tokenizer

    tok = Tokenizer([f"m{i:05d}" for i in range(n_morphemes)])
    tok_path = root / "tokenizer.json"
    if tok_path.exists():
        return tok_path, root / "tokens"
    root.mkdir(parents=True, exist_ok=True)
    V, eot = tok.vocab_size, tok.eot_id
    rng = np.random.default_rng(0)
    for src in ("alpha", "beta", "gamma"):
        for split, total in (("train", tokens_per_source), ("val", tokens_per_source // 50)):
            with ShardWriter(root / "tokens" / split / f"{src}.bin", V, eot) as w:
                n = 0
                while n < total:
                    phrase = rng.integers(0, V - 1, size=int(rng.integers(8, 64)))
                    doc = np.tile(phrase, int(rng.integers(4, 32)))
                    w.add(doc)
                    n += doc.size + 1
    tok_path.write_text(tok.dumps(), encoding="utf-8")
    return tok_path, root / "tokens"


def train(out: Path, n: int, variant: str, tok: Path, tokens: Path, steps: int, batch: int, accum: int,
          gpus_visible: str | None = None) -> dict:
    """One `andrea train` under torchrun at world size n; its perf records and train losses."""
    if out.exists():
        shutil.rmtree(out)
    over = {"train.backend": "cupy", "train.precision": "bf16", "train.gpus": n, "train.batch_size": batch,
            "train.grad_accum": accum, "train.max_steps": steps, "train.warmup_steps": max(1, steps // 10),
            "train.log_every": 1, "train.eval_every": 10 * steps, "train.checkpoint_every": 10 * steps,
            "curriculum.warmup_steps": steps, "curriculum.warmup_sources": "[alpha, beta, gamma]",
            "curriculum.polish_steps": 0, "coherence.every": 10 * steps}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "-m", "andrea",
           "train", "--phase", "warmup",
           "--params", str(ROOT / "params.yaml"), "--profile", variant, "--tokenizer", str(tok),
           "--tokens", str(tokens), "--out", str(out)]
    for k, v in over.items():
        cmd += ["-S", f"{k}={v}"]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if gpus_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus_visible
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (out.parent / f"{out.name}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {p.returncode}; see {out.parent / (out.name + '.log')}")
    perf = [json.loads(line) for line in (out / "model.perf.jsonl").read_text().splitlines() if line.strip()]
    loss = json.loads((out / "model.loss.json").read_text())["train"]
    return {"perf": perf, "loss": [r["loss"] for r in sorted(loss, key=lambda r: r["step"])]}


def opt_bytes(variant: str, world: int, batch: int, vocab: int) -> int:
    from andrea.cuda.engine import arena_layout
    from andrea.engine.model import ModelConfig

    m = profile(variant)["model"]
    mc = ModelConfig(vocab, int(m["d_model"]), int(m["n_head"]), int(m["n_layer"]), int(m["context"]))
    a = arena_layout(mc, batch, "bf16", world)
    return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for name, shape, dt in a.spec if name in ("m", "v"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="1,2,4,8")
    ap.add_argument("--variants", default="andrea-120m,andrea-480m")
    ap.add_argument("--only", choices=["scaling", "loss", "memory"], action="append")
    ap.add_argument("--batch", type=int, default=8, help="rows per GPU")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=10, help="logged steps left out of the tokens/s median")
    ap.add_argument("--loss-steps", type=int, default=200)
    ap.add_argument("--loss-tol", type=float, default=0.02)
    ap.add_argument("--exact-tol", type=float, default=0.02)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--tokens", type=Path)
    ap.add_argument("--out", type=Path, default=Path("/tmp/andrea-multi-gpu"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    gpus = [int(x) for x in a.gpus.split(",")]
    if 1 not in gpus:
        gpus = [1] + gpus
    import cupy as cp        # before any data is built: no CuPy or too few devices is one line (exit_gpu_main)

    if max(gpus) > (have := cp.cuda.runtime.getDeviceCount()):
        raise AndreaError(f"--gpus {a.gpus}: this machine has {have} CUDA device(s); name at most that many")
    variants = a.variants.split(",")
    todo = a.only or ["scaling", "loss", "memory"]
    res: dict = {"scaling": {}, "loss": {}, "memory": {}}
    fails = []

    def data(variant):
        if a.tokenizer:
            return a.tokenizer, a.tokens
        return synth_data(a.out / f"data-{profile(variant)['n_morphemes']}", int(profile(variant)["n_morphemes"]))

    if "scaling" in todo:
        for v in variants:
            tok, tokens = data(v)
            tps = {}
            for n in gpus:
                r = train(a.out / f"scale-{v}-N{n}", n, v, tok, tokens, a.steps, a.batch * n, 1)
                tps[n] = statistics.median(p["tokens_per_s"] for p in r["perf"][a.skip:])
            for n in gpus:
                eff = tps[n] / (n * tps[1])
                res["scaling"][f"{v} N={n}"] = {"tokens_per_s": round(tps[n], 1), "efficiency": round(eff, 4)}
                print(f"scaling {v} N={n}: {tps[n]:,.0f} tok/s, efficiency {eff:.3f}", flush=True)
                if n > 1 and eff < TARGET_EFF.get(v, 0.9):
                    fails.append(f"scaling {v} N={n}: {eff:.3f} < {TARGET_EFF.get(v, 0.9)}")
    if "loss" in todo:
        v = "andrea-120m"
        tok, tokens = data(v)
        for n in [g for g in gpus if g > 1]:
            dp = train(a.out / f"loss-N{n}", n, v, tok, tokens, a.loss_steps, a.batch * n, 1)["loss"]
            acc = train(a.out / f"loss-1x{n}accum", 1, v, tok, tokens, a.loss_steps, a.batch, n)["loss"]
            same = train(a.out / f"loss-1xB{n}", 1, v, tok, tokens, a.loss_steps, a.batch * n, 1)["loss"]
            q = max(1, a.loss_steps // 4)
            m_dp, m_acc = float(np.mean(dp[-q:])), float(np.mean(acc[-q:]))
            rel = abs(m_dp - m_acc) / m_acc
            worst = max(abs(x - y) / abs(y) for x, y in zip(dp, same))
            res["loss"][f"N={n}"] = {"last_quarter_mean": m_dp, "accum_mean": m_acc, "rel_diff_vs_accum": rel,
                                     "max_rel_step_diff_vs_same_windows": worst}
            print(f"loss N={n}: last-quarter mean {m_dp:.4f} vs 1 GPU grad_accum={n} {m_acc:.4f} (rel {rel:.4f}); "
                  f"per-step vs 1 GPU batch {a.batch * n}: max rel {worst:.4f}", flush=True)
            if rel > a.loss_tol:
                fails.append(f"loss N={n}: {rel:.4f} > {a.loss_tol}")
            if worst > a.exact_tol:
                fails.append(f"loss N={n} same windows: {worst:.4f} > {a.exact_tol}")
    if "memory" in todo:
        from andrea.tokenizer.harris import Tokenizer

        for v in variants:
            vocab = Tokenizer([f"m{i:05d}" for i in range(int(profile(v)["n_morphemes"]))]).vocab_size
            one = opt_bytes(v, 1, a.batch, vocab)
            for n in gpus:
                b = opt_bytes(v, n, a.batch, vocab)
                res["memory"][f"{v} N={n}"] = {"m_v_bytes_per_gpu": b, "ratio_to_1": round(b / one, 4)}
                print(f"memory {v} N={n}: m+v {b / 2**20:,.1f} MiB per GPU, {b / one:.3f} of one GPU's", flush=True)
                if n == 8 and b * 6 > one:
                    fails.append(f"memory {v} N=8: {b / one:.3f} > 1/6")
    res["fails"] = fails
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1))
    print("PASS" if not fails else "FAIL: " + "; ".join(fails))
    return 1 if fails else 0


if __name__ == "__main__":
    exit_gpu_main(main, "multi_gpu")
