"""Inductor's autotuning carried from one device machine to the next: what the torch.compile max-autotune anchor
of bench/engine_gpu.py tuned on an earlier machine of the same card, placed in a fresh machine's inductor cache
so it does not spend minutes of a 30-minute device session tuning it again (issue 19).

    python3 bench/inductor_seed.py keep /tmp/o     # on the device, after engine_gpu.py's max-autotune runs
    # here: docs/bench/sNN_<name> for each file it wrote (a card's newer file replaces its older one)
    python3 bench/engine_gpu.py --autotune-seed ... # places every kept file that fits the machine

Two kinds of kept file, in docs/bench/; each was made on one card model under one torch, Triton and CUDA:
- ``*_inductor_autotune_*.json``: inductor's own GEMM-timing file, ``$TORCHINDUCTOR_CACHE_DIR/cache/<system
  hash>``, as inductor wrote it. The hash covers the card's name and the Triton and CUDA versions, so inductor
  reads only the file made on this card with this software (``seed_autotune``).
- ``*_inductor_best_configs_*.json``: coordinate descent's choice for each Triton kernel (max-autotune turns
  coordinate descent on): the ``<xx>/<key>.best_config`` files inductor keeps beside each kernel's source, by
  their path in the cache dir, with the system record (card, versions, hash) of the machine that made them. A
  key hashes the kernel's source and torch's own, so only that kernel under that torch reads it; the card is
  checked here (``seed_best_configs``), as a config tuned on one card model is no measure of another's.
Inductor's choice among its candidates stays its own: a kept timing or config is what it would have found on a
machine it had warmed itself, as the second and third runs of a device session are.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from andrea.errors import AndreaError, exit_main  # noqa: E402
from andrea.fsutil import atomic_write_bytes, atomic_write_json, read_json  # noqa: E402

AUTOTUNE_SEEDS = "docs/bench/*_inductor_autotune_*.json"          # inductor's GEMM timings, one file a card
BEST_CONFIG_SEEDS = "docs/bench/*_inductor_best_configs_*.json"    # coordinate descent's kernel configs
DEFAULT_CACHE = "/tmp/andrea-inductor"                             # engine_gpu's $TORCHINDUCTOR_CACHE_DIR default


def this_system() -> dict:
    """Inductor's system record of this machine: {"device": {"name"}, "version", "hash"} (only "hash" where
    no CUDA device answers)."""
    from torch._inductor.codecache import CacheBase

    return CacheBase.get_system()


def _add_missing(dest: dict, seed: dict) -> int:
    """Put into ``dest`` every entry of ``seed`` it lacks, recursing where both hold a dict; dest's own values
    win. Returns how many entries were added."""
    added = 0
    for k, v in seed.items():
        if k not in dest:
            dest[k] = v
            added += 1
        elif isinstance(dest[k], dict) and isinstance(v, dict):
            added += _add_missing(dest[k], v)
    return added


def seed_autotune(cache_dir: Path, seeds: list[Path]) -> list[str]:
    """Place each kept GEMM-timing file (``AUTOTUNE_SEEDS``) where inductor looks for it,
    ``cache_dir/cache/<its system hash>``. Where inductor has a file there already (this machine's own
    timings), add to its "cache" only the entries it lacks: this machine's own timings win, and a file there
    that is not such an object is left as it is. max-autotune then benchmarks only the GEMMs neither holds.
    Returns what was placed or added; AndreaError names a seed that is not such a file."""
    placed = []
    for f in seeds:
        try:
            data = f.read_bytes()
            d = json.loads(data)
            h, dev = d["system"]["hash"], d["system"]["device"]["name"]
            if not isinstance(d["cache"], dict):
                raise TypeError("cache is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise AndreaError(f"{f}: not an inductor autotune cache file (system.hash, system.device.name, "
                              f"cache) ({e}); remove it or drop --autotune-seed") from None
        dest = cache_dir / "cache" / h
        if not dest.exists():
            atomic_write_bytes(dest, data)
            placed.append(f"{f.name} ({dev})")
            continue
        try:
            own = json.loads(dest.read_bytes())
        except (OSError, ValueError):
            continue                                   # not a file we can read as JSON: inductor's to handle
        if not (isinstance(own, dict) and isinstance(own.get("cache"), dict)):
            continue
        added = _add_missing(own["cache"], d["cache"])
        if added:
            atomic_write_json(dest, own)
            placed.append(f"{added} entries of {f.name} ({dev}) beside this machine's")
    return placed


def _kept_path(f: Path, rel) -> PurePosixPath:
    """A best-config path of bundle ``f``, checked: relative, inside the cache dir, a .best_config file."""
    p = PurePosixPath(rel) if isinstance(rel, str) else None
    if p is None or p.is_absolute() or ".." in p.parts or p.suffix != ".best_config" or len(p.parts) != 2:
        raise AndreaError(f"{f}: {rel!r} is not a <xx>/<key>.best_config path inside the cache dir; "
                          "remove the bundle or drop --autotune-seed")
    return p


def seed_best_configs(cache_dir: Path, bundles: list[Path], card: str | None) -> list[str]:
    """Place the .best_config files of each kept bundle (``BEST_CONFIG_SEEDS``) made on a ``card`` (its CUDA
    device name; None: no device, nothing placed) at their paths under ``cache_dir`` where no file is yet
    (this machine's own win); a bundle from another card is passed over. Returns what was placed; AndreaError
    names a bundle that is not one."""
    placed = []
    for f in bundles:
        b = read_json(f, "inductor best-config bundle")
        files, made_on = b.get("files"), b.get("system")
        if not (isinstance(files, dict) and isinstance(made_on, dict) and isinstance(made_on.get("device"), dict)
                and all(isinstance(t, str) for t in files.values())):
            raise AndreaError(f"{f}: not an inductor best-config bundle (system.device.name, files of text); "
                              "remove it or drop --autotune-seed")
        paths = [(_kept_path(f, rel), text) for rel, text in files.items()]
        if card is None or made_on["device"].get("name") != card:
            continue
        n = 0
        for rel, text in paths:
            dest = cache_dir.joinpath(*rel.parts)
            if not dest.exists():
                atomic_write_bytes(dest, text.encode())
                n += 1
        if n:
            placed.append(f"{n} kernel configs of {f.name} ({card})")
    return placed


def seed_all(cache_dir: Path, root: Path, card) -> list[str]:
    """``seed_autotune`` with every GEMM-timing file kept under ``root``, then ``seed_best_configs`` with every
    bundle, on the card ``card()`` names (asked only where a bundle is kept). Returns what was placed."""
    placed = seed_autotune(cache_dir, sorted(root.glob(AUTOTUNE_SEEDS)))
    if bundles := sorted(root.glob(BEST_CONFIG_SEEDS)):
        placed += seed_best_configs(cache_dir, bundles, card())
    return placed


def card_tag(name: str) -> str:
    """The short card name kept files carry: "NVIDIA H100 80GB HBM3" -> "h100"; else the name, lower-cased,
    with each run of other characters as one "_"."""
    m = re.search(r"\b([A-Z]\d{2,4})\b", name)
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def keep(cache_dir: Path, out_dir: Path, system: dict) -> list[Path]:
    """Write this machine's tuning, for the next machine of its card: its GEMM-timing file (as inductor wrote
    it) as ``inductor_autotune_<card>.json`` and every .best_config under ``cache_dir`` in one bundle,
    ``inductor_best_configs_<card>.json``, each where there is something to keep. Returns the files written."""
    name = (system.get("device") or {}).get("name")
    if not name:
        raise AndreaError("inductor sees no CUDA device here: its tuning is made and kept on the device machine")
    tag, written = card_tag(name), []
    gemm = cache_dir / "cache" / system["hash"]
    if gemm.is_file():
        written.append(out_dir / f"inductor_autotune_{tag}.json")
        atomic_write_bytes(written[-1], gemm.read_bytes())
    files = {p.relative_to(cache_dir).as_posix(): p.read_text()
             for p in sorted(cache_dir.glob("*/*.best_config"))}
    if files:
        written.append(out_dir / f"inductor_best_configs_{tag}.json")
        atomic_write_json(written[-1], {"system": system, "files": files})
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("keep", help="write this machine's inductor tuning into OUT, one file of each kind")
    k.add_argument("out", type=Path)
    k.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", DEFAULT_CACHE)),
                   help="inductor's cache dir ($TORCHINDUCTOR_CACHE_DIR, else engine_gpu.py's default)")
    args = ap.parse_args(argv)
    written = keep(args.cache_dir, args.out, this_system())
    for p in written:
        print(f"{p}: {p.stat().st_size:,} bytes")
    if not written:
        print(f"{args.cache_dir}: no GEMM timings nor kernel configs to keep (has max-autotune run here?)")
    return 0


if __name__ == "__main__":
    exit_main(main, "inductor_seed")
