"""The ``andrea`` command line: one subcommand per pipeline stage.

    andrea --help
    andrea --version
    andrea prep-megachat --help
    andrea train --phase warmup --profile tiny -S train.max_steps=50 ...

Each stage lives in its own module exposing ``add_arguments(parser)`` and
``run(args, cfg) -> int``; this file only knows the table below and imports the
one module a call needs, so start-up stays fast. Every stage that reads params
gets the same three options: ``--profile`` (compose the config from ``params/``:
``params/config.yaml`` + ``params/profile/<PROFILE>.yaml``, as DVC's Hydra composition does),
``--params`` (without ``--profile``: the effective config file to read as is, default
``params.yaml``, which ``dvc exp run`` writes) and ``-S/--set key=value`` (dotted keys, as in
``dvc exp run -S``; ``-S profile=P`` is ``--profile P``). The config is validated against the
schema before the stage starts; stages that train refuse at once a config this machine cannot
train (no CuPy for a bf16 or large profile).

Exit codes: 0 ok; 2 bad input or unmet precondition; 3 invalid config;
130 interrupted; 143 training stopped by SIGTERM after its checkpoint (run again to resume). Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

from andrea import __version__
from andrea.errors import AndreaError


@dataclass(frozen=True)
class Command:
    module: str
    help: str
    needs_config: bool = True
    checks_backend: bool = False  # refuse at once a config this machine cannot train (config.check_backend)


COMMANDS: dict[str, Command] = {
    "build-embedded": Command("andrea.data.embedded", "build the embedded corpus from text that ships with CPython", False),
    "pull-hermes3": Command("andrea.data.hermes3", "fetch Hermes-3 (hub | local | embedded) into Parquet + MANIFEST.json"),
    "prep-megachat": Command("andrea.data.megachat", "merge, filter, dedupe and split the sources into megachat"),
    "tokenizer": Command("andrea.tokenizer.stage", "train the Harris morpheme tokenizer", checks_backend=True),
    "diet-alignment": Command("andrea.diet", "measure the tokenizer against the data diet; write token shards",
                              checks_backend=True),
    "train": Command("andrea.train", "train a model (--phase warmup | main)", checks_backend=True),
    "audit": Command("andrea.reports.audit", "sample fixed prompts from a run and score coherence"),
    "eval": Command("andrea.reports.evaluate", "held-out bits per byte, coherence, judge; eval.html + metrics.json"),
    "sample": Command("andrea.generate", "sample text from a checkpoint"),
    "chat": Command("andrea.chat", "chat with a checkpoint in the chat template"),
    "export": Command("andrea.export", "a run as a transformers GPT-2 folder (safetensors, config, tokenizer, model card)",
                      False),
    "dashboard": Command("andrea.reports.dashboard", "serve a live loss dashboard for a run on 127.0.0.1", False),
    "stages": Command("andrea.stages", "the pipeline's stage table; --write regenerates dvc.yaml and params.yaml", False),
}


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="andrea",
        description="ANDREA pipeline stages. `andrea STAGE --help` for one stage.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="stages:\n" + "\n".join(f"  {name:<16} {c.help}" for name, c in COMMANDS.items()),
    )
    p.add_argument("--version", action="version", version=f"andrea {__version__}")
    p.add_argument("stage", choices=sorted(COMMANDS), metavar="STAGE")
    return p


def summary(doc: str | None, fallback: str) -> str:
    """A stage's --help description: the first paragraph of its module docstring (the rest is
    for readers of the code: usage examples, API notes), so every --help fits a screen."""
    first = (doc or "").strip().split("\n\n", 1)[0].strip()
    return first or fallback


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("params")
    g.add_argument("--params", default="params.yaml",
                   help="effective params file, read as is without --profile (default: %(default)s)")
    g.add_argument("--profile", default=None,
                   help="compose params/config.yaml + params/profile/<PROFILE>.yaml instead (tiny, andrea-12m, ...)")
    g.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one dotted key, e.g. -S bandit.coverage_bonus=1.3 (repeatable)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--version") or argv[0] not in COMMANDS:
        _top_parser().parse_args(argv or ["--help"])  # prints help/version or a clear "invalid choice" and exits
        return 2
    name, rest = argv[0], argv[1:]
    cmd = COMMANDS[name]
    module = importlib.import_module(cmd.module)
    parser = argparse.ArgumentParser(prog=f"andrea {name}", description=summary(module.__doc__, cmd.help),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    if cmd.needs_config:
        add_config_arguments(parser)
    args = parser.parse_args(rest)
    try:
        cfg = None
        if cmd.needs_config:
            from andrea.config import load_config

            cfg = load_config(args.params, args.profile, args.overrides)
            if cmd.checks_backend:
                from andrea.config import check_backend

                if note := check_backend(cfg):
                    print(f"andrea {name}: {note}", file=sys.stderr)
        return int(module.run(args, cfg) or 0)
    except AndreaError as e:
        print(f"andrea {name}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"andrea {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
