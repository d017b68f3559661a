"""fp8 against bf16 at equal steps: the same model, seed and batch order, both curves and the
final held-out loss (issue 12's quality target: fp8 within 1% of bf16, no halted run).

    PYTHONPATH=. python3 bench/fp8_quality.py --tokenizer .cache/d12/tokenizer/tokenizer.json \
        --tokens .cache/d12/tokens --out $OUT/fp8q --steps 2000           # on the GPU, ~2-3 min

Model: the andrea-120m shapes (C 768, H 12, L 12, T 1024) with the tokenizer's vocabulary (the
12M embedded-corpus tokenizer here, V = its vocab_size, so not the 120M profile's V). Data: the
train shards concatenated (sources in name order); batch t is B windows of T + 1 tokens at
starts drawn by ``numpy.random.default_rng(seed + t)``, identical for both precisions. AdamW
(andrea's Hyper: betas 0.9/0.95, wd 0.1, clip 1.0), lr warmup 100 steps to ``--lr`` then cosine
to lr/10. Held-out: the eval stage's own code (``andrea.reports.evaluate.heldout``) on the val
shards every ``--eval-every`` steps and at the end. Skipped (non-finite) steps are counted.
Writes ``<out>/curves.csv`` (step, precision, train loss, held-out loss), ``<out>/summary.json``
and, where matplotlib imports, ``<out>/curves.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_gpu import patched  # noqa: E402

from andrea.engine.engine import Hyper  # noqa: E402
from andrea.engine.model import ModelConfig  # noqa: E402
from andrea.reports.evaluate import heldout, val_shards  # noqa: E402


def lr_at(t: int, steps: int, lr: float, warm: int = 100) -> float:
    if t <= warm:
        return lr * t / warm
    p = (t - warm) / max(1, steps - warm)
    return lr / 10 + 0.5 * (lr - lr / 10) * (1 + math.cos(math.pi * p))


def train(prec: str, mc: ModelConfig, B: int, data: np.ndarray, val: dict, byte_len, eot: int, args) -> dict:
    """One precision's run; ``prec`` may end in +SWITCH...: those andrea/cuda/fp8.py booleans flipped for it."""
    import andrea.cuda.fp8 as k8

    base, *flips = prec.split("+")
    for sw in flips:
        if not isinstance(getattr(k8, sw, None), bool):
            raise SystemExit(f"fp8_quality: --precisions {prec}: {sw} is not a boolean switch of andrea/cuda/fp8.py")
    with patched(k8, **{sw: not getattr(k8, sw) for sw in flips}):
        return _train(prec, base, mc, B, data, val, byte_len, eot, args)


def _train(prec: str, base: str, mc: ModelConfig, B: int, data: np.ndarray, val: dict, byte_len, eot: int,
           args) -> dict:
    from andrea.cuda.backend import make_backend

    precision, _, scaling = base.partition(":")          # fp8:delayed = train.fp8_scaling=delayed
    eng = make_backend().make_engine(mc, B, precision=precision, **({"fp8_scaling": scaling} if scaling else {}))
    eng.init_weights(args.seed)
    hp = Hyper(grad_clip=1.0)
    T = mc.context
    curve, skipped, t0 = [], 0, time.perf_counter()
    for t in range(1, args.steps + 1):
        rng = np.random.default_rng(args.seed + t)
        starts = rng.integers(0, data.size - T - 1, B)
        w = np.stack([data[s:s + T + 1] for s in starts]).astype(np.int32)
        res = eng.train_step([(w[:, :-1], w[:, 1:])], lr_at(t, args.steps, args.lr), t, hp)
        skipped += 0 if res.ok else 1
        row = {"step": t, "precision": prec, "train_loss": res.loss, "heldout_loss": None}
        if t % args.eval_every == 0 or t == args.steps:
            row["heldout_loss"] = heldout(eng, val, byte_len, eot, args.eval_batches)["overall"]["loss"]
            print(f"{prec} step {t}: train {res.loss:.4f} held-out {row['heldout_loss']:.4f} "
                  f"({time.perf_counter() - t0:.0f}s, skipped {skipped})", flush=True)
        curve.append(row)
    final = [r for r in curve if r["heldout_loss"] is not None][-1]["heldout_loss"]
    return {"curve": curve, "skipped_steps": skipped, "final_heldout_loss": final,
            "wall_s": time.perf_counter() - t0, "attention": eng.attention}   # train.attention's pick (auto)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp8"],
                    help="bf16, fp8 (current scaling), fp8:delayed (train.fp8_scaling=delayed); a suffix "
                         "+SWITCH flips that andrea/cuda/fp8.py boolean for the run, e.g. fp8:delayed+FC_E4M3")
    ap.add_argument("--shape", default="768,12,12,1024", help="C,H,L,T (default: the andrea-120m shapes)")
    args = ap.parse_args(argv)
    from andrea.shards import Shard
    from andrea.tokenizer import load as load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    byte_len = np.array([len(tok.token_bytes(i)) for i in range(tok.vocab_size)], dtype=np.int64)
    C, H, L, T = (int(x) for x in args.shape.split(","))
    mc = ModelConfig(tok.vocab_size, C, H, L, T)
    train_dir = Path(args.tokens) / "train"
    data = np.concatenate([np.asarray(Shard(p).tokens) for p in sorted(train_dir.glob("*.bin"))])
    val = val_shards(Path(args.tokens))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"model V={mc.vocab_size} C={C} H={H} L={L} T={T}, batch {args.batch}; {data.size:,} train tokens; "
          f"{args.steps} steps", flush=True)
    runs = {p: train(p, mc, args.batch, data, val, byte_len, tok.eot_id, args) for p in args.precisions}
    with open(out / "curves.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "precision", "train_loss", "heldout_loss"])
        w.writeheader()
        for r in runs.values():
            w.writerows(r["curve"])
    ref = runs[args.precisions[0]]["final_heldout_loss"]
    summary = {p: {k: v for k, v in r.items() if k != "curve"} | {"ratio_to_" + args.precisions[0]:
                                                                    r["final_heldout_loss"] / ref}
               for p, r in runs.items()}
    summary["setup"] = {"V": mc.vocab_size, "C": C, "H": H, "L": L, "T": T, "batch": args.batch, "steps": args.steps,
                        "lr": args.lr, "seed": args.seed, "train_tokens": int(data.size)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for p, r in runs.items():
        print(f"{p}: final held-out loss {r['final_heldout_loss']:.4f} ({r['final_heldout_loss'] / ref:.4f}x "
              f"{args.precisions[0]}), skipped steps {r['skipped_steps']}, {r['wall_s']:.0f}s, "
              f"attention {r['attention']}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for p, r in runs.items():
            tr = [(x["step"], x["train_loss"]) for x in r["curve"] if math.isfinite(x["train_loss"])]
            ax.plot(*zip(*tr), lw=0.6, alpha=0.5, label=f"{p} train")
            ho = [(x["step"], x["heldout_loss"]) for x in r["curve"] if x["heldout_loss"] is not None]
            ax.plot(*zip(*ho), marker="o", ms=3, label=f"{p} held-out")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_ylim(top=min(ax.get_ylim()[1], 8))
        ax.legend()
        ax.set_title(f"bf16 vs fp8, {C}x{L} (V={mc.vocab_size}), B={args.batch}")
        fig.tight_layout()
        fig.savefig(out / "curves.png", dpi=120)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
