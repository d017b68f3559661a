"""The training step under several engine settings in alternating rounds of one process, and the torch
anchor once: the A/B that bench/attention_det.py, bench/dgelu_gemm.py and bench/engine_ab.py each print
(not a script: they import it).

    from step_rounds import add_step_args, anchor_of, print_step, step_ab
    res = step_ab(eg.variant_shapes("andrea-480m"), 8, rounds, steps, warmup, "compile-reduce-overhead",
                  {"committed": contextlib.nullcontext, "flip": lambda: eg.patched(ce, OVERLAP_UPDATE=False)})

With ``--power`` (``power_log_of``) each arm also gets the SM clock, board power and energy a step over its
own timed steps, medians of its rounds: where the card runs at its power cap, an arm that saves joules buys
clock back, and the ms alone do not say why.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_gpu as eg  # noqa: E402
from fp8_ab import round_order  # noqa: E402  (A B, B A, ...)


def alternate(rounds: int, names: list[str], measure) -> dict[str, list[float]]:
    """``measure(name)`` for every name, ``rounds`` times, the order reversed every other round (so
    neither setting always runs on the cooler card) -> {name: [one value a round]}."""
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in round_order(names, r):
            out[n].append(measure(n))
    return out


def add_step_args(ap) -> None:
    """The step's options (--steps, --warmup, --anchor) of each bench that runs ``step_ab``; ``anchor_of``
    turns --anchor into step_ab's argument."""
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--anchor", default="compile-reduce-overhead", help="a torch anchor of engine_gpu, or none")
    ap.add_argument("--power", action="store_true",
                    help="also each arm's SM clock, board power and J a step over its timed steps (nvidia-smi)")


def anchor_of(args) -> str | None:
    return None if args.anchor == "none" else args.anchor


@contextlib.contextmanager
def power_log_of(args, when: bool = True):
    """``with power_log_of(args) as plog``: engine_gpu's PowerLog where --power asks for one and ``when``
    (the bench runs the step), None otherwise or where nvidia-smi cannot run; closed on the way out.
    step_ab's ``plog``."""
    plog = eg.open_power_log() if args.power and when else None
    try:
        yield plog
    finally:
        if plog:
            plog.close()


POWER_KEYS = ("sm_mhz", "power_w", "joules_per_step")


def step_ab(s: dict, B: int, rounds: int, steps: int, warmup: int, anchor: str | None, settings: dict,
            plog=None, **ours) -> dict:
    """The engine's bf16 step (``engine_gpu.bench_ours``, keywords ``ours``) under each of ``settings``
    ({name: a no-argument callable giving the context the run goes in}), ``rounds`` alternating rounds;
    the anchor once; each setting's median ms, MFU and ratio of tokens/s against the anchor. With ``plog``
    (a PowerLog) each round's clock, power and J a step (``power_rounds``; None where no sample fell in
    its steps) and their medians over the rounds that have them, the anchor's from its one run."""
    n_params, power = [], {n: [] for n in settings}

    def measure(name: str) -> float:
        with settings[name]():
            r = eg.bench_ours(s, B, steps, warmup, "bf16", **ours)
        n_params.append(r["n_params"])
        if plog:
            power[name].append(eg.power_of(plog, r))
        return r["ms"]

    res = {n: {"ms": statistics.median(v), "ms_rounds": v} for n, v in alternate(rounds, list(settings), measure).items()}
    fpt = eg.flops_per_token(s, n_params[0])
    for x in res.values():
        x["mfu"] = fpt * B * s["T"] / (x["ms"] / 1e3) / eg.PEAK_BF16
    for n, per_round in power.items() if plog else ():
        res[n]["power_rounds"] = per_round
        if got := [p for p in per_round if p]:
            res[n].update({k: statistics.median(p[k] for p in got) for k in POWER_KEYS})
    if anchor:
        a = eg.bench_torch(s, B, steps, warmup, anchor)
        res["anchor"] = {"name": anchor, "ms": a["ms"]}
        if plog and (pw := eg.power_of(plog, a)):
            res["anchor"].update({k: pw[k] for k in POWER_KEYS})
        for n in settings:
            res[n]["ratio_vs_anchor"] = a["ms"] / res[n]["ms"]
    return res


def _power(x: dict) -> str:
    """', 1665 MHz, 31.20 J' where step_ab measured them."""
    return f", {x['sm_mhz']:.0f} MHz, {x['joules_per_step']:.2f} J" if "sm_mhz" in x else ""


def print_step(key: str, r: dict, names) -> None:
    """One line: each setting's ms, MFU and ratio (and clock and J a step with --power), then the anchor's
    ms (step_ab's result)."""
    anchor = "anchor" in r
    vs = f"; {r['anchor']['name']} {r['anchor']['ms']:.2f} ms{_power(r['anchor'])}" if anchor else ""
    print(f"{key} step: " + ", ".join(
        f"{n} {r[n]['ms']:.2f} ms (MFU {r[n]['mfu']:.1%}" + _power(r[n])
        + (f", {r[n]['ratio_vs_anchor']:.3f}x)" if anchor else ")") for n in names) + vs, flush=True)
