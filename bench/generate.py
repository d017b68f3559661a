"""Benchmark: KV-cache generation against re-running the whole window for every new token.

    python bench/generate.py                        # tiny profile shape, NumPy backend
    python bench/generate.py --shape 12m --backend cupy --tokens 256

Both paths use the same InferenceModel and weights; the anchor ("no cache") resets the
cache and feeds the whole sequence for each new token, which is what generation costs
without one. Prints tokens/s of each and the ratio cache / no-cache measured in the same
run (greedy, so both produce the same tokens; the script checks that they do).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from andrea.backends import select_backend
from andrea.engine.engine import Engine
from andrea.engine.model import ModelConfig
from andrea.generate import InferenceModel, SamplingOptions, draw, generate, next_token_probs

SHAPES = {"tiny": ModelConfig(1281, 128, 4, 4, 128), "12m": ModelConfig(4353, 384, 12, 6, 1024),
          "120m": ModelConfig(8449, 768, 12, 12, 1024)}


def no_cache(im: InferenceModel, prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    rng = np.random.default_rng(0)
    for _ in range(n):
        im.reset()
        row = im.be.to_host(im.forward(seq[-im.context:])[-1])
        t = draw(next_token_probs(row, 0.0), rng)
        out.append(t)
        seq.append(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--backend", choices=["numpy", "cupy", "auto"], default="numpy")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    args = ap.parse_args()
    mc = SHAPES[args.shape]
    be, why = select_backend(args.backend)
    host = Engine(mc, batch_size=1, backend=select_backend("numpy")[0])
    host.init_weights(seed=1)
    w = be.xp.asarray(host.w) if be.name != "numpy" else host.w
    im = InferenceModel(mc, w, be)
    prompt = list(np.random.default_rng(2).integers(0, mc.vocab_size, args.prompt))
    n = min(args.tokens, mc.context - args.prompt)
    greedy = SamplingOptions(max_new_tokens=n, temperature=0, stop_at_eot=False)
    generate(im, prompt, SamplingOptions(max_new_tokens=4, temperature=0, stop_at_eot=False), 0)   # warm up
    be.synchronize()
    t0 = time.perf_counter()
    a = generate(im, prompt, greedy, 0).ids
    be.synchronize()
    t_cache = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = no_cache(im, prompt, n)
    be.synchronize()
    t_full = time.perf_counter() - t0
    same = sum(x == y for x, y in zip(a, b))
    print(f"shape {args.shape} ({mc}), backend {be.name} ({why}), prompt {args.prompt}, {n} new tokens")
    print(f"kv-cache : {n / t_cache:10.1f} tokens/s")
    print(f"no cache : {n / t_full:10.1f} tokens/s   (anchor)")
    print(f"ratio    : {t_full / t_cache:10.2f}x   (same greedy tokens: {same}/{n})")


if __name__ == "__main__":
    main()
