"""Benchmark: the bf16 training step with engine switches flipped, against the engine as committed, in
alternating rounds of one process, and the torch anchor once: what a switch of andrea/cuda/engine.py
(OVERLAP_UPDATE, OWN_DGELU, ...) does to the figures issue 19 holds.

    PYTHONPATH=. python3 bench/engine_ab.py --variants andrea-480m:8,16 andrea-120m:32 \
        --flip OVERLAP_UPDATE=False "OWN_DGELU=True,OWN_DGELU_DEFINES=('MM_CLUSTER=2',)" --json ab.json

Each --flip is one arm: comma-separated NAME=VALUE, NAME an upper-case setting of andrea.cuda.engine (or,
as cublaslt.NAME, of andrea.cuda.cublaslt: ``"cublaslt.CHOICES='t.json'"`` runs the engine on another
algorithm table, such as one ``bench/lt_algos.py --write-table`` wrote; as cudnn_attention.NAME, of
andrea.cuda.cudnn_attention: ``"cudnn_attention.BWD_PLAN='eng7_k24=26'"`` another plan of its backward,
one ``bench/attention_plans.py`` lists) and VALUE a Python literal; both are
checked before any GPU work. Per variant and batch: ``engine_gpu.bench_ours``
(one microbatch a step, CUDA graph) under each arm, ``--rounds`` rounds with the order reversed every
other round, the median; then the ``--anchor`` (``none``: no anchor). Printed: each arm's ms, MFU and ratio
of tokens/s to the anchor; with ``--power`` also its SM clock and J a step (``step_rounds``: at the card's
power cap, a switch that saves energy shows as clock). ``--json`` is written after every shape.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import engine_gpu as eg  # noqa: E402
from step_rounds import add_step_args, anchor_of, power_log_of, print_step, step_ab  # noqa: E402

from andrea.errors import AndreaError  # noqa: E402
from andrea.fsutil import atomic_write_json  # noqa: E402

COMMITTED = "committed"


def modules() -> dict:
    """The modules a flip may set, by the prefix that names them ("": andrea.cuda.engine)."""
    import andrea.cuda.cublaslt as ltm
    import andrea.cuda.cudnn_attention as cam
    import andrea.cuda.engine as ce

    return {"": ce, "cublaslt.": ltm, "cudnn_attention.": cam}


def parse_flip(item: str) -> dict:
    """{NAME: value} of one --flip item (NAME as given: ``cublaslt.`` / ``cudnn_attention.`` name those modules'
    settings); AndreaError names a setting the module does not have or a value that is not a literal."""
    mods = modules()
    out = {}
    for part in re.split(r",(?=(?:[a-z_]+\.)?[A-Z_][A-Z0-9_]*=)", item):
        name, eq, text = part.partition("=")
        pre = name[:name.index(".") + 1] if "." in name else ""
        bare = name[len(pre):]
        if not eq or pre not in mods or not re.fullmatch(r"[A-Z][A-Z0-9_]*", bare) or not hasattr(mods[pre], bare):
            where = (f"andrea/cuda/{pre[:-1]}.py" if pre in mods and pre else
                     "andrea/cuda/engine.py (cublaslt.NAME: andrea/cuda/cublaslt.py, cudnn_attention.NAME: "
                     "andrea/cuda/cudnn_attention.py)")
            raise AndreaError(f"--flip {item!r}: {bare!r} is not an upper-case setting of {where}")
        try:
            out[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise AndreaError(f"--flip {item!r}: {text!r} is not a Python literal (True, 3, ('A=1',), ...)") from None
    return out


@contextlib.contextmanager
def flipped(values: dict):
    """Each of ``parse_flip``'s settings patched into its module inside the block, put back after it."""
    with contextlib.ExitStack() as stack:
        for pre, mod in modules().items():
            mine = {k[len(pre):]: v for k, v in values.items() if (k.startswith(pre) if pre else "." not in k)}
            if mine:
                stack.enter_context(eg.patched(mod, **mine))
        yield


def settings_of(flips: dict[str, dict]) -> dict:
    """step_ab's settings: the committed engine, then each flip patched into its modules."""
    out = {COMMITTED: contextlib.nullcontext}
    for name, values in flips.items():
        out[name] = (lambda v=values: flipped(v))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["andrea-480m:8"])
    ap.add_argument("--batch", type=int, default=8, help="batch of a variant named without ':B'")
    ap.add_argument("--flip", nargs="+", required=True, help="NAME=VALUE[,NAME=VALUE...]: one arm each")
    ap.add_argument("--rounds", type=int, default=3)
    add_step_args(ap)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        flips = {item: parse_flip(item) for item in args.flip}
    except AndreaError as e:
        print(f"engine_ab: {e}", file=sys.stderr)
        return 2
    anchor, settings, out = anchor_of(args), settings_of(flips), {}
    with power_log_of(args) as plog:
        for v, B in eg.parse_variants(args.variants, args.batch):
            key = f"{v}:B{B}"
            out[key] = step_ab(eg.variant_shapes(v), B, args.rounds, args.steps, args.warmup, anchor, settings, plog)
            print_step(key, out[key], list(settings))
            if args.json:
                atomic_write_json(Path(args.json), out)
    return 0


if __name__ == "__main__":
    eg.exit_gpu_main(main, "engine_ab")
