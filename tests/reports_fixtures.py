"""Small synthetic runs for the report tests, made through the engine's own API (no pipeline needed).

    from reports_fixtures import make_run
    r = make_run(tmp_path, train_steps=30)     # r.cfg, r.overrides, r.tokenizer, r.run, r.tokens
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from andrea.config import config_hash, load_config
from andrea.engine import checkpoint as ck
from andrea.engine.backend import NumpyBackend
from andrea.engine.engine import Engine, Hyper
from andrea.engine.model import ModelConfig
from andrea.shards import Shard, ShardWriter
from andrea.tokenizer import load as load_tokenizer
from andrea.tokenizer.harris import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ROOT / "params.yaml"
OVERRIDES = ["model.d_model=16", "model.n_head=2", "model.n_layer=1", "model.context=32",
             "train.batch_size=4", "eval.max_batches=2", "audit.max_new_tokens=12", "audit.top_k=20"]
MORPHEMES = ["the", "and", "ing", "er", "ion", "def", "return", "self", "list", "module"]
TEXTS = {
    "prose-a": ["the list and the module are here and there", "a module returns the list of things",
                "the reader and the writer are running", "nothing is returned when the list is empty"],
    "code-b": ["def f(self):\n    return self.x\n", "def g(a, b):\n    return a + b\n",
               "for i in range(10):\n    print(i)\n", "class A:\n    def m(self):\n        return 1\n"],
}


@dataclass
class SynthRun:
    cfg: dict
    overrides: list
    tokenizer: Path
    run: Path
    tokens: Path
    engine: Engine

    def cli_params(self) -> list[str]:
        return ["--params", str(PARAMS), "--profile", "tiny", *sum((["-S", o] for o in self.overrides), [])]


def make_run(tmp_path: Path, train_steps: int = 30, extra_overrides: tuple = ()) -> SynthRun:
    tok = Tokenizer(list(MORPHEMES))
    tok_path = tmp_path / "tokenizer.json"
    tok_path.write_text(tok.dumps(), encoding="utf-8")
    tok = load_tokenizer(tok_path)
    overrides = [*OVERRIDES, *extra_overrides]
    cfg = load_config(PARAMS, "tiny", overrides)
    tokens = tmp_path / "tokens"
    for split, reps in (("train", 30), ("val", 6)):
        for src, texts in TEXTS.items():
            with ShardWriter(tokens / split / f"{src}.bin", tok.vocab_size, tok.eot_id) as w:
                for r in range(reps):
                    for t in texts:
                        w.add(tok.encode(t))
    train_toks = np.concatenate([np.asarray(Shard(tokens / "train" / f"{s}.bin").tokens) for s in TEXTS]).astype(np.int32)
    mc = ModelConfig.from_cfg(cfg, tok.vocab_size)
    eng = Engine(mc, batch_size=int(cfg["train"]["batch_size"]), backend=NumpyBackend())
    eng.init_weights(seed=7)
    rng = np.random.default_rng(0)
    B, T = eng.B, eng.T
    train, val, pulls, events = [], [], [], [{"step": 0, "kind": "start", "detail": "synthetic"}]
    srcs = list(TEXTS)
    run = tmp_path / "run"
    smma, ema = None, {}                # as the trainer logs them: Wilder's average (period 5), per-source EMA
    for step in range(train_steps):
        starts = rng.integers(0, train_toks.size - T - 1, size=B)
        x = np.stack([train_toks[s:s + T] for s in starts])
        y = np.stack([train_toks[s + 1:s + T + 1] for s in starts])
        lr = 1e-2 * min(1.0, (step + 1) / 5)
        res = eng.train_step([(x, y)], lr=lr, t=step + 1, hp=Hyper())
        src = srcs[(step // 3) % 2]
        smma = res.loss if smma is None else smma + (res.loss - smma) / 5
        ema[src] = res.loss if src not in ema else 0.9 * ema[src] + 0.1 * res.loss
        train.append({"step": step, "phase": "main", "loss": res.loss, "smma": smma, "lr": lr,
                      "grad_norm": res.grad_norm, "tokens_per_s": 1000.0 + step, "source": src, "time": 1.0 * step})
        if step % 3 == 2:                                      # a pull of 3 batches ends
            pulls.append({"step": step, "source": src, "reward": 0.1, "scores": {s: 1.0 for s in srcs},
                          "ema": ema[src]})
        if step % 10 == 9:
            val.append({"step": step, "loss": res.loss, "per_source": {s: res.loss + i * 0.1 for i, s in enumerate(srcs)},
                        "unigram": 5.0})
        if step == train_steps // 2:
            ck.write_checkpoint(run / "archive" / f"model.step{step}.bin", step, eng.w, eng.m, eng.v)
    ck.write_checkpoint(run / "model.bin", train_steps, eng.w, eng.m, eng.v)
    state = {"format": "andrea.state/1", "step": train_steps, "phase": "main", "config_hash": config_hash(cfg),
             "tokenizer_sha256": tok.sha256, "n_params": eng.n_params, "halt": None,
             "model": {"vocab_size": tok.vocab_size, **{k: cfg["model"][k] for k in ("d_model", "n_head", "n_layer", "context")}},
             "config": cfg}
    (run / "model.state.json").write_text(json.dumps(state), encoding="utf-8")
    (run / "model.loss.json").write_text(json.dumps({"format": "andrea.loss/1", "train": train, "val": val,
                                                     "pulls": pulls, "events": events}), encoding="utf-8")
    (run / "model.samples.json").write_text(json.dumps({"format": "andrea.samples/1", "samples": [
        {"step": 10, "prompt": "p", "text": "t", "scores": {}}, {"step": 20, "prompt": "p", "text": "t", "scores": {}}]}),
        encoding="utf-8")
    return SynthRun(cfg, overrides, tok_path, run, tokens, eng)
