"""Benchmark: the audit's sampling wall time, every sample one by one (the anchor: ``generate``
per sample, as the audit ran before) against one batch (``generate_batch``, as it runs now),
same model, same prompts, same run; the two must give the same records.

    python bench/audit.py                                  # NumPy, tiny shape, random weights
    python bench/audit.py --backend cupy --shape 120m      # on the GPU (InferenceModel on CuPy)
    python bench/audit.py --run runs/tiny/main --tokenizer data/tokenizer/tiny/tokenizer.json

The prompts are the shipped sets (andrea/prompts), the options the params' audit section
(``-S audit.max_new_tokens=32`` style overrides are not parsed: use --max-new-tokens). Without
--run the weights are the bench/generate.py random ones of ``--shape`` and the tokenizer is bytes
(id i < 256 is byte i), so samples run to the token limit unless a stop string comes up.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from andrea.backends import select_backend  # noqa: E402
from andrea.config import load_config  # noqa: E402
from andrea.generate import InferenceModel  # noqa: E402
from andrea.reports import audit  # noqa: E402
from andrea.settings import Settings  # noqa: E402


class ByteTokenizer:
    """ids < 256 are bytes; the last id is EOT; other ids decode to nothing."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eot_id = vocab_size, vocab_size - 1

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def token_bytes(self, i: int) -> bytes:
        return bytes([i]) if i < 256 else b""

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["numpy", "cupy"], default="numpy")
    ap.add_argument("--shape", default="tiny", help="bench/generate.py shape for random weights")
    ap.add_argument("--run", default=None, help="a run folder: its final checkpoint and config instead")
    ap.add_argument("--tokenizer", default=None, help="the run's tokenizer.json (with --run)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the params' audit.max_new_tokens")
    ap.add_argument("--slots", type=int, default=audit.AUDIT_SLOTS)
    args = ap.parse_args()
    cfg = load_config("params.yaml", profile="tiny")
    be, why = select_backend(args.backend)
    if args.run:
        from andrea.generate import load_model, resolve_run

        ns = argparse.Namespace(run=args.run, run_opt=None, overrides=[], profile=None, tokenizer=args.tokenizer)
        run, cfg, tok_path = resolve_run(ns, cfg)
        lm = load_model(run, tok_path, cfg, be)
        mc, flat, tok = lm.config, lm.model.params, lm.tokenizer
        label = args.run
    else:
        from generate import SHAPES, host_weights

        mc = SHAPES[args.shape]
        flat = host_weights(mc)
        flat = be.xp.asarray(flat) if be.xp is not np else flat
        tok = ByteTokenizer(mc.vocab_size)
        label = f"{args.shape} random weights, byte tokenizer"
    settings = Settings.from_dict(cfg)
    if args.max_new_tokens is not None:
        settings = dataclasses.replace(settings, audit=dataclasses.replace(settings.audit,
                                                                         max_new_tokens=args.max_new_tokens))
    prompts = audit.load_prompts()
    n = len(prompts) * settings.audit.samples_per_prompt
    sync = be.synchronize
    times, recs = {}, {}
    for slots in (1, min(args.slots, n)):
        model = InferenceModel(mc, flat, be, slots=slots)
        sync()
        t0 = time.perf_counter()
        recs[slots] = audit.sample_checkpoint(_Alone(model) if slots == 1 else model, tok, prompts, settings)
        sync()
        times[slots] = time.perf_counter() - t0
    one, many = times[1], times[min(args.slots, n)]
    same = recs[1] == recs[min(args.slots, n)]
    n_tok = sum(r["n_tokens"] for r in recs[1])
    print(f"| audit sampling | {label} | {be.name} | {n} samples, {n_tok} tokens | one by one {one:.2f} s | "
          f"batch of {min(args.slots, n)} {many:.2f} s | {one / many:.2f}x | same records: {same} |", flush=True)
    if not same:
        raise SystemExit("the batch changed the records")


class _Alone:
    """The model without ``forward_rows``: generate_batch then runs ``generate`` per sample."""

    def __init__(self, model):
        self._m = model

    def __getattr__(self, name):
        if name == "forward_rows":
            raise AttributeError(name)
        return getattr(self._m, name)


if __name__ == "__main__":
    main()
