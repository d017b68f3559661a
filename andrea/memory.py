"""The model family's parameter counts and training memory, from the engines' own planners: the
tables of docs/ANDREA.md, regenerated here so the doc cannot drift from the code.

    python -m andrea.memory                          # every table (Markdown) on stdout
    python -m andrea.memory --write docs/ANDREA.md   # refresh the doc's generated blocks in place
    python -m andrea.memory --check docs/ANDREA.md   # exit 1 naming each block that drifted

    from andrea.memory import plan_items
    plan_items(mc, 8, "bf16")   # {'master': ..., 'copy': ..., 'grads': ..., 'adam': ..., 'saved': ..., ...}

Nothing is measured or allocated: the NumPy engine's bytes are ``Engine.planned_bytes``
(``andrea.engine.engine.engine_bytes``: w, g, m, v + ``engine_plan``), the GPU engine's are its
arena (``andrea.cuda.engine.arena_layout``; importing it needs neither CuPy nor a GPU), split
by what each buffer holds. A card fits a batch by the memory preflight's rule
(``andrea.preflight.fits``: planned x HEADROOM <= free), its free memory taken as its size less
``CONTEXT_RESERVE``. The shapes come from params/ (every params/profile/*.yaml), V from the
tokenizer config (256 bytes + tokenizer.n_morphemes + end-of-text).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import numpy as np

from andrea.errors import AndreaError

GIB = 1 << 30
BATCHES = (1, 8, 16, 32, 64)
CARDS = (8, 24, 80)                       # GiB: RTX 3060/3070-class, RTX 3090/4090, A100/H100 80 GB
CONTEXT_RESERVE = 512 << 20               # assumed: the CUDA context, cuBLAS and the driver's share of a card
ENGINES = (("numpy", "fp32"), ("cupy", "fp32"), ("cupy", "bf16"), ("cupy", "fp16"), ("cupy", "fp8"))
GPT2_VOCAB = 50257
# What the seeds (/work/shared/seeds, "Семья из трёх") call each variant, and the count they give.
SEED_NAMES = {"andrea-12m": ("ANDREA-12M", 12.8e6), "andrea-120m": ("ANDREA-120M", 120e6),
              "andrea-480m": ("ANDREA-480M", 480e6)}
ITEMS = (("master", "fp32 weights (master)"), ("copy", "weight copies (16-bit; + E4M3 in fp8)"), ("grads", "gradients"),
         ("adam", "Adam m + v"), ("saved", "saved activations"), ("dgrad", "activation gradients"),
         ("work", "workspace"))


# ------------------------------------------------------------------------------ the planners
def plan_items(mc, batch_size: int, precision: str, engine: str = "cupy", recompute: str = "auto",
               grad_accum: int | None = 1) -> dict[str, int]:
    """Planned bytes of one training engine by item (keys of ``ITEMS``); their sum is the
    engine's planned_bytes. ``engine``: cupy (GpuEngine, fp32 | bf16 | fp16 | fp8) or numpy (Engine,
    fp32); ``recompute``: train.recompute; ``grad_accum``: train.grad_accum (the GPU engine's bf16/fp16
    lay activations in the gradients' bytes at 1, ACTS_IN_GRADS; None: any number)."""
    B = int(batch_size)
    out = {k: 0 for k, _ in ITEMS}
    if engine == "numpy":
        from andrea.engine.backend import NumpyBackend
        from andrea.engine.engine import buffer_bytes, engine_plan
        from andrea.engine.model import param_layout

        if precision != "fp32":
            raise AndreaError(f"the numpy engine trains in fp32 only, not {precision}")
        n = param_layout(mc).n_params
        out.update(master=4 * n, grads=4 * n, adam=8 * n)
        _, plan = engine_plan(mc, B, NumpyBackend, NumpyBackend.row_slots(B), recompute=recompute)
        for b in plan:
            key = {"saved": "saved", "dgrad": "dgrad", "slot_grads": "grads"}.get(b.kind, "work")
            out[key] += buffer_bytes(b, 4)
        return out
    from andrea.cuda.engine import arena_layout

    arena = arena_layout(mc, B, precision, recompute=recompute, grad_accum=grad_accum)
    kind = {b.name: b.kind for b in arena.plan}
    for name, shape, dt in arena.spec:                 # each entry with its 256-byte alignment
        key = {"w": "master", "wlow": "copy", "w8": "copy", "wte_pad": "copy", "g": "grads", "m": "adam", "v": "adam"}.get(name)
        key = key or {"saved": "saved", "dgrad": "dgrad"}.get(kind.get(name), "work")
        out[key] += -(-math.prod(shape) * np.dtype(dt).itemsize // 256) * 256
    out["work"] += arena.nbytes - sum(out.values())    # the arena's own 512-byte rounding
    return out


def planned_bytes(mc, batch_size: int, precision: str, engine: str = "cupy", recompute: str = "auto",
                  grad_accum: int | None = 1) -> int:
    return sum(plan_items(mc, batch_size, precision, engine, recompute, grad_accum).values())


def card_batch(mc, precision: str, card_gib: int, recompute: str = "auto") -> int:
    """The largest batch the GPU engine fits on a card of ``card_gib`` GiB (0: none)."""
    from andrea.preflight import largest_batch

    return largest_batch(lambda b: planned_bytes(mc, b, precision, recompute=recompute), card_gib * GIB - CONTEXT_RESERVE)


# ------------------------------------------------------------------------------ the variants
class Variant:
    """One profile: its shapes and the parameter counts of its layout."""

    def __init__(self, profile: str, cfg: dict):
        from andrea.engine.model import param_layout
        from andrea.resources import model_config

        self.profile, self.cfg = profile, cfg
        self.mc = mc = model_config(cfg)
        self.n_morphemes = int(cfg["tokenizer"]["n_morphemes"])
        self.batch_size, self.precision = int(cfg["train"]["batch_size"]), cfg["train"]["precision"]
        self.n = param_layout(mc).n_params
        C = mc.d_model
        self.wte, self.wpe = mc.vocab_size * C, mc.context * C
        self.readings = {                          # parameter counts under other conventions
            "the code (tied output head)": self.n,
            "without the token embedding": self.n - self.wte,
            "non-embedding (without wte and wpe)": self.n - self.wte - self.wpe,
            "an untied output head": self.n + self.wte,
            "GPT-2's vocabulary (50,257, tied)": self.n + (GPT2_VOCAB - mc.vocab_size) * C,
        }


def load_variants(params: str | Path = "params.yaml") -> list[Variant]:
    """Every params/profile/*.yaml beside ``params``, smallest model first."""
    from andrea.config import load_config

    folder = Path(params).parent / "params" / "profile"
    profiles = sorted(f.stem for f in folder.glob("*.yaml"))
    if not profiles:
        raise AndreaError(f"{folder}: no profiles (*.yaml) to tabulate")
    return sorted((Variant(p, load_config(params, p)) for p in profiles), key=lambda v: v.n)


# ------------------------------------------------------------------------------ the tables
def _m(n: float) -> str:
    return f"{n / 1e6:.2f}M"


def _g(n: float) -> str:
    return f"{n / GIB:.2f}"


def _b(n: float) -> str:
    from andrea.preflight import fmt_bytes

    return fmt_bytes(n) if n else "-"


def _engine(engine: str, precision: str) -> str:
    return "numpy fp32 (host)" if engine == "numpy" else f"cupy {precision}"


def table_family(vs: list[Variant]) -> str:
    rows = ["| profile | d_model | heads | head dim | layers | context | V = 256 + N + 1 | parameters "
            "(the code) | without wte | non-embedding | untied head would be | with GPT-2's vocabulary |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in vs:
        mc, r = v.mc, list(v.readings.values())
        rows.append(f"| {v.profile} | {mc.d_model} | {mc.n_head} | {mc.head_dim} | {mc.n_layer} | {mc.context} | "
                    f"{mc.vocab_size:,} (N = {v.n_morphemes:,}) | {v.n:,} ({_m(v.n)}) | {_m(r[1])} | {_m(r[2])} | "
                    f"{_m(r[3])} | {_m(r[4])} |")
    return "\n".join(rows)


def table_names(vs: list[Variant]) -> str:
    rows = ["| the seeds' name | the seeds' count | profile | the code counts | code / name | the reading nearest "
            "the name |", "|---|---|---|---|---|---|"]
    for v in vs:
        if v.profile not in SEED_NAMES:
            continue
        name, said = SEED_NAMES[v.profile]
        reading, n = min(v.readings.items(), key=lambda kv: abs(kv[1] - said))
        rows.append(f"| {name} | {_m(said)} | {v.profile} | {v.n:,} ({_m(v.n)}) | {v.n / said:.2f} | "
                    f"{reading}: {_m(n)} |")
    return "\n".join(rows)


def table_fixed(vs: list[Variant]) -> str:
    rows = ["| profile | engine | fp32 weights (master) | 16-bit weight copy | gradients (fp32) | Adam m + v (fp32) "
            "| total | bytes / parameter |", "|---|---|---|---|---|---|---|---|"]
    for v in vs:
        for eng, prec in ENGINES:
            it = plan_items(v.mc, 1, prec, eng)
            fixed = {k: it[k] for k in ("master", "copy", "adam")}
            fixed["grads"] = 4 * v.n                  # g alone: the NumPy slices' own gradients grow with B
            tot = sum(fixed.values())
            rows.append(f"| {v.profile} | {_engine(eng, prec)} | {_b(fixed['master'])} | {_b(fixed['copy'])} | "
                        f"{_b(fixed['grads'])} | {_b(fixed['adam'])} | {_b(tot)} | {tot / v.n:.0f} |")
    return "\n".join(rows)


def table_items(vs: list[Variant]) -> str:
    rows = ["| profile | engine | batch | " + " | ".join(label for _, label in ITEMS) + " | total |",
            "|---|---|---|" + "---|" * len(ITEMS) + "---|"]
    for v in vs:
        for eng, prec in ENGINES:
            it = plan_items(v.mc, v.batch_size, prec, eng)
            cells = " | ".join(_b(it[k]) for k, _ in ITEMS)
            rows.append(f"| {v.profile} | {_engine(eng, prec)} | {v.batch_size} | {cells} | {_b(sum(it.values()))} |")
    return "\n".join(rows)


def table_batches(vs: list[Variant]) -> str:
    rows = ["| profile | engine | " + " | ".join(f"B = {b} (GiB)" for b in BATCHES) + " |",
            "|---|---|" + "---|" * len(BATCHES)]
    for v in vs:
        for eng, prec in ENGINES:
            rows.append(f"| {v.profile} | {_engine(eng, prec)} | "
                        + " | ".join(_g(planned_bytes(v.mc, b, prec, eng)) for b in BATCHES) + " |")
    return "\n".join(rows)


def table_cards(vs: list[Variant]) -> str:
    """The largest batch per card, per GPU precision; bf16 also with train.recompute=gelu (the GELU
    output recomputed in the backward instead of kept per layer)."""
    rows = ["| profile | engine | " + " | ".join(f"{c} GiB card" for c in CARDS) + " |",
            "|---|---|" + "---|" * len(CARDS)]
    runs = [(prec, "auto") for eng, prec in ENGINES if eng == "cupy"]
    runs.insert(runs.index(("bf16", "auto")) + 1, ("bf16", "gelu"))
    for v in vs:
        for prec, rc in runs:
            cells = []
            for c in CARDS:
                b = card_batch(v.mc, prec, c, rc)
                cells.append(f"{b:,} ({_g(planned_bytes(v.mc, b, prec, recompute=rc))} GiB)" if b else "none")
            label = _engine("cupy", prec) + ("" if rc == "auto" else f", train.recompute={rc}")
            rows.append(f"| {v.profile} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def table_own(vs: list[Variant]) -> str:
    """Which profile fits each card at its own train.precision and train.batch_size (on the GPU engine)."""
    from andrea.preflight import fits

    out = []
    for c in CARDS:
        free = c * GIB - CONTEXT_RESERVE
        cells = []
        for v in vs:
            need = planned_bytes(v.mc, v.batch_size, v.precision)
            cells.append(f"{v.profile} ({v.precision}, batch {v.batch_size}: {_b(need)}) "
                         f"{'fits' if fits(need, free) else 'does not fit'}")
        out.append(f"- {c} GiB card: " + "; ".join(cells) + ".")
    return "\n".join(out)


def example_refusal(vs: list[Variant]) -> str:
    """The preflight's refusal, word for word, for the largest profile at batch 64 on a 24 GiB card."""
    from andrea.preflight import check_memory

    v = vs[-1]
    try:
        check_memory(lambda b: planned_bytes(v.mc, b, "bf16"), 64, (24 * GIB - CONTEXT_RESERVE, "GPU 0 (24.0 GiB in all)"),
                     "cupy bf16 engine", accum_of=lambda b: planned_bytes(v.mc, b, "bf16", grad_accum=None))
    except AndreaError as e:
        return f"```\nandrea train: error: {e}\n```"
    return f"(batch 64 of {v.profile} fits a 24 GiB card: no refusal to show)"


def table_seeds(vs: list[Variant]) -> str:
    """The seeds' memory claims beside the planner's figure for the same setting."""
    by = {v.profile: v for v in vs}
    out = []
    if "andrea-120m" in by:
        mc = by["andrea-120m"].mc
        fp16 = plan_items(mc, 8, "fp16")
        act = fp16["saved"] + fp16["dgrad"] + fp16["work"]
        out.append(f"- ANDREA-120M in FP16 at batch 8: the seeds estimate ~240 MB x 4 buffers + 5-10 GB of "
                   f"activations = 10-12 GB; the GPU engine plans {_b(sum(fp16.values()))}: "
                   f"{_b(sum(fp16.values()) - act)} of weights, gradients and Adam state (fp32 master, gradients, "
                   f"m and v, and the 16-bit copy) and {_b(act)} of activations and workspace.")
        np32 = planned_bytes(mc, 8, "fp32", "numpy")
        out.append(f"- The same batch on the NumPy engine (fp32; it saves the attention probabilities "
                   f"(B, T, H, T) and the softmax (N, V) of every step) plans {_b(np32)}.")
    if "andrea-12m" in by:
        mc = by["andrea-12m"].mc
        out.append(f"- ANDREA-12M \"trained in 1.4 GB\": the GPU engine plans {_b(planned_bytes(mc, 8, 'fp32'))} "
                   f"in fp32 and {_b(planned_bytes(mc, 8, 'bf16'))} in bf16 at batch 8 (the CUDA context comes on "
                   f"top of either).")
    return "\n".join(out)


BLOCKS = {"family": table_family, "names": table_names, "fixed": table_fixed, "items": table_items,
          "batches": table_batches, "cards": table_cards, "own": table_own, "refusal": example_refusal,
          "seeds": table_seeds}
MARK = re.compile(r"(<!-- memory:(\w+) begin[^>]*-->\n)(.*?)(<!-- memory:\2 end -->)", re.S)


def render(vs: list[Variant]) -> dict[str, str]:
    return {name: fn(vs) for name, fn in BLOCKS.items()}


def refresh(doc: str, blocks: dict[str, str]) -> tuple[str, list[str], list[str]]:
    """``doc`` with every generated block replaced by ``blocks``, the names that changed, and
    the names with no begin/end pair in ``doc``. A marked name this module does not make is an
    error."""
    changed, seen = [], []

    def sub(m: re.Match) -> str:
        name, text = m.group(2), blocks.get(m.group(2))
        if text is None:
            raise AndreaError(f"generated block memory:{name}: no such table (known: {', '.join(blocks)})")
        seen.append(name)
        text = f"\n{text}\n\n"                   # blank lines: Markdown sees the table apart from the comments
        if m.group(3) != text:
            changed.append(name)
        return m.group(1) + text + m.group(4)

    new = MARK.sub(sub, doc)
    return new, changed, [n for n in blocks if n not in seen]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m andrea.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", default="params.yaml", help="params.yaml beside params/ (default: %(default)s)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", metavar="DOC", help="replace the generated blocks of DOC (docs/ANDREA.md)")
    g.add_argument("--check", metavar="DOC", help="exit 1 when a generated block of DOC differs")
    args = p.parse_args(argv)
    try:
        blocks = render(load_variants(args.params))
        if not (args.write or args.check):
            for name, text in blocks.items():
                print(f"<!-- memory:{name} -->\n{text}\n")
            return 0
        path = Path(args.write or args.check)
        doc = path.read_text(encoding="utf-8")
        new, changed, missing = refresh(doc, blocks)
    except (AndreaError, OSError) as e:
        print(f"python -m andrea.memory: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    if args.check:
        if changed or missing:
            print(f"python -m andrea.memory: {path}: generated blocks out of date: {', '.join(changed + missing)} "
                  f"(run python -m andrea.memory --write {path})", file=sys.stderr)
            return 1
        return 0
    if missing:
        print(f"python -m andrea.memory: {path}: no marked place for {', '.join(missing)} (add the lines "
              f"<!-- memory:NAME begin --> and <!-- memory:NAME end -->)", file=sys.stderr)
        return 2
    if changed:
        from andrea.fsutil import atomic_write_text

        atomic_write_text(path, new)
    print(f"{path}: {len(changed)} block(s) rewritten ({', '.join(changed) or 'none'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
