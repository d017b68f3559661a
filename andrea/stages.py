"""The pipeline's stage table: each stage declared once; ``dvc.yaml`` is generated from it and
the Snakemake rules are checked against it (tests/test_frontends.py).

    andrea stages              # the table: name, command, params, inputs, outputs, code deps
    andrea stages --check      # exit 1 when dvc.yaml or params.yaml differ from what the table gives
    andrea stages --write      # regenerate dvc.yaml and params.yaml (the composed default profile)

A stage's name is the same in both front ends (DVC stage = Snakemake rule); its command is an
``andrea`` subcommand (andrea/cli.py) with paths in which ``{variant}`` is the profile and
``{corpus}`` the corpus (``hermes3.source``). Its code dependencies are not typed by hand: they
are the modules its command's module imports, followed transitively through ``andrea.*``
(function-level and ``importlib.import_module("andrea...")`` imports included), plus the
package data (``.cu``, ``.cuh``, ``.html``, ``.js``, ``.json``) of every package reached, so a
CUDA kernel change marks the trained weights stale.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from andrea.errors import AndreaError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DATA = (".cu", ".cuh", ".html", ".js", ".json")

# The params a run's trajectory depends on: both training phases read exactly these. The same
# tuple as andrea.train.TRAJECTORY_SECTIONS (which the run state's hash covers; a test keeps the
# two equal), not imported from there so that reading this table stays cheap for the Snakefile.
TRAJECTORY = ("seed", "model", "train", "curriculum", "bandit", "coherence")


@dataclass(frozen=True)
class Out:
    path: str
    persist: bool = False     # kept by DVC before the command runs (training resumes into it)
    cache: bool = True
    metric: bool = False


@dataclass(frozen=True)
class Stage:
    name: str                 # the dvc.yaml stage and the Snakemake rule
    command: str              # andrea subcommand (a key of andrea.cli.COMMANDS)
    args: str                 # its arguments; {variant} = profile, {corpus} = hermes3.source
    params: tuple[str, ...]   # params sections or dotted keys it reads
    inputs: tuple[str, ...]   # data it reads (files or folders)
    outputs: tuple[Out, ...]
    per: str = "variant"      # "variant": one per profile; "corpus": one per hermes3.source


_TOK = "data/tokenizer/{variant}"
_TOKS = "data/tokens/{variant}"
_MEGA = "data/megachat/{corpus}"

STAGES: tuple[Stage, ...] = (
    Stage("pull_hermes3", "pull-hermes3", "--embedded data/embedded --out data/raw/hermes3/{corpus}",
          ("hermes3",), ("data/embedded",), (Out("data/raw/hermes3/{corpus}"),), per="corpus"),
    Stage("prep_megachat", "prep-megachat",
          "--raw data/raw/hermes3/{corpus} --embedded data/embedded --out " + _MEGA,
          ("hermes3.source", "megachat"), ("data/raw/hermes3/{corpus}", "data/embedded"), (Out(_MEGA),),
          per="corpus"),
    Stage("tokenizer", "tokenizer", f"--train {_MEGA}/train.parquet --out {_TOK}",
          ("tokenizer",), (_MEGA,), (Out(_TOK),)),
    Stage("diet_alignment", "diet-alignment",
          f"--tokenizer {_TOK}/tokenizer.json --megachat {_MEGA} --tokens {_TOKS} --report reports/{{variant}}",
          ("diet", "tokenizer"), (_TOK, _MEGA),
          (Out(_TOKS), Out("reports/{variant}/diet.md"), Out("reports/{variant}/diet.json"))),
    Stage("warmup", "train",
          f"--phase warmup --tokenizer {_TOK}/tokenizer.json --tokens {_TOKS} --out runs/{{variant}}/warmup"
          " --on-mismatch restart",
          TRAJECTORY, (_TOK, _TOKS), (Out("runs/{variant}/warmup", persist=True),)),
    Stage("train", "train",
          f"--phase main --tokenizer {_TOK}/tokenizer.json --tokens {_TOKS} --init runs/{{variant}}/warmup"
          " --out runs/{variant}/main --on-mismatch restart",
          TRAJECTORY, (_TOK, _TOKS, "runs/{variant}/warmup"), (Out("runs/{variant}/main", persist=True),)),
    Stage("audit", "audit",
          f"--run runs/{{variant}}/main --extra-checkpoint runs/{{variant}}/warmup --tokenizer {_TOK}/tokenizer.json"
          " --out reports/{variant}",
          ("seed", "model", "train.backend", "audit", "coherence"),
          (_TOK, "runs/{variant}/main", "runs/{variant}/warmup"),
          (Out("reports/{variant}/audit.md"), Out("reports/{variant}/audit.json"))),
    Stage("eval", "eval",
          f"--run runs/{{variant}}/main --tokenizer {_TOK}/tokenizer.json --tokens {_TOKS}"
          " --audit reports/{variant}/audit.json --out reports/{variant}",
          ("model", "train.batch_size", "train.backend", "eval"),
          (_TOK, _TOKS, "runs/{variant}/main", "reports/{variant}/audit.json"),
          (Out("reports/{variant}/eval.html"), Out("reports/{variant}/eval.md"), Out("reports/{variant}/loss.csv"),
           Out("reports/{variant}/val_loss.csv"), Out("reports/{variant}/val_per_source.csv"),
           Out("reports/{variant}/metrics.json", metric=True))),
)

BY_NAME = {s.name: s for s in STAGES}


# --- code dependencies ------------------------------------------------------------------------

def _module_file(name: str) -> Path | None:
    rel = Path(*name.split("."))
    for cand in (ROOT / rel.with_suffix(".py"), ROOT / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _imports(path: Path, modname: str) -> set[str]:
    """Every ``andrea.*`` module named by an import anywhere in ``path`` (functions included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    pkg = modname if path.name == "__init__.py" else modname.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import submodule`
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return {m for m in found if m == "andrea" or m.startswith("andrea.")}


def code_deps(module: str) -> list[str]:
    """Files (relative to the repo) that ``module`` runs: its transitive andrea imports, the
    ``__init__.py`` of every package on the way, and the package data of the packages reached."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
            prefix = ".".join(parts[:i])
            if prefix in seen or _module_file(prefix) is None:
                continue
            seen.add(prefix)
            todo.extend(_imports(_module_file(prefix), prefix))
    files: set[Path] = set()
    for name in seen:
        f = _module_file(name)
        files.add(f)
        if f.name == "__init__.py":
            files.update(p for p in f.parent.iterdir() if p.suffix in PACKAGE_DATA and p.is_file())
    return sorted(p.relative_to(ROOT).as_posix() for p in files)


def stage_code(stage: Stage) -> list[str]:
    from andrea.cli import COMMANDS

    return code_deps(COMMANDS[stage.command].module)


# --- dvc.yaml and params.yaml -----------------------------------------------------------------

DVC_HEADER = """\
# GENERATED from the stage table in andrea/stages.py by `andrea stages --write`: edit the table,
# not this file (tests/test_frontends.py fails when the two differ). The DVC front end; the
# Snakemake rules in workflow/rules/ run the same stages under the same names.
#
#   dvc exp run -S profile=tiny -S hermes3.source=embedded     # the CPU demo, offline (~3 min here)
#   dvc exp run -S profile=tiny -S model.d_model=64 -S model.n_head=2   # any key, over any profile
#   dvc exp show                                                # the params that trained, per experiment
#
# params.yaml is the effective config: DVC's Hydra composition (.dvc/config) writes it from
# params/config.yaml + params/profile/<profile>.yaml + the -S overrides before an experiment
# runs; `${profile}` names the per-variant outputs and `${hermes3.source}` the corpus.
"""


def _dvc_path(p: str) -> str:
    return p.replace("{variant}", "${profile}").replace("{corpus}", "${hermes3.source}")


def _default_sources() -> list[str]:
    """The sources of the composed default config, in its order: the per-source plot's fields (the
    eval writes a column for each, so a field is never missing; workflow/plots.html gives field i
    the look render.style_at(i), the same as eval.html's)."""
    from andrea.config import default_profile, load_config
    from andrea.reports.render import config_sources

    return config_sources(load_config(ROOT / "params.yaml", default_profile(ROOT / "params")))


def dvc_yaml_text() -> str:
    stages = {}
    for st in STAGES:
        outs, metrics = [], []
        for o in st.outputs:
            opts = {k: v for k, v in (("persist", o.persist), ("cache", o.cache)) if v != Out.__dataclass_fields__[k].default}
            entry = {_dvc_path(o.path): opts} if opts else _dvc_path(o.path)
            (metrics if o.metric else outs).append(entry)
        body = {"cmd": f"andrea {st.command} {_dvc_path(st.args)}",
                "deps": [*(_dvc_path(p) for p in st.inputs), *stage_code(st)],
                "params": list(st.params), "outs": outs}
        if metrics:
            body["metrics"] = metrics
        stages[st.name] = body
    plots = [
        {"train loss (every logged step) and its SMMA": {
            "template": "linear", "x": "step", "y": {"reports/${profile}/loss.csv": ["loss", "smma"]},
            "y_label": "train loss (nats/token)"}},
        {"held-out loss, in-training estimate (train.eval_batches batches)": {
            "template": "linear", "x": "step", "y": {"reports/${profile}/val_loss.csv": "val_loss"},
            "y_label": "held-out loss (nats/token)"}},
        {"held-out loss per source, in-training estimate": {
            "template": "linear", "x": "step", "y": {"reports/${profile}/val_per_source.csv": _default_sources()},
            "y_label": "held-out loss (nats/token)"}},
    ]
    text = yaml.safe_dump({"stages": stages, "plots": plots}, sort_keys=False, width=120)
    return DVC_HEADER + text


PARAMS_HEADER = """\
# GENERATED by `andrea stages --write`: params/config.yaml composed with its default profile
# (params/profile/andrea-12m.yaml), the effective config `dvc repro` trains. Do not edit: change
# params/config.yaml or a profile. `dvc exp run -S ...` rewrites this file (DVC's Hydra
# composition) with the config that experiment trains, so `dvc exp show` lists what trained.
"""


def params_yaml_text() -> str:
    from andrea.config import default_profile, load_config

    cfg = load_config(ROOT / "params.yaml", default_profile(ROOT / "params"))
    return PARAMS_HEADER + yaml.safe_dump(cfg, sort_keys=False, width=120)


GENERATED = {"dvc.yaml": dvc_yaml_text, "params.yaml": params_yaml_text}


def drift() -> list[str]:
    """The generated files whose committed text differs from what the table gives."""
    out = []
    for name, make in GENERATED.items():
        path = ROOT / name
        if not path.is_file() or path.read_text(encoding="utf-8") != make():
            out.append(name)
    return out


# --- the stage's CLI --------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="exit 1 if dvc.yaml or params.yaml is out of date")
    g.add_argument("--write", action="store_true", help="regenerate dvc.yaml and params.yaml from the table")


def run(args: argparse.Namespace, cfg: dict | None) -> int:
    if args.write:
        from andrea.fsutil import atomic_write_text

        for name, make in GENERATED.items():
            atomic_write_text(ROOT / name, make())
            print(f"wrote {name}")
        return 0
    if args.check:
        stale = drift()
        if stale:
            raise AndreaError(f"{', '.join(stale)} out of date with andrea/stages.py: run `andrea stages --write`")
        print("dvc.yaml and params.yaml match the stage table")
        return 0
    for st in STAGES:
        print(f"{st.name} (per {st.per}): andrea {st.command} {st.args}")
        print(f"  params: {', '.join(st.params)}")
        print(f"  inputs: {', '.join(st.inputs)}")
        print(f"  outputs: {', '.join(o.path for o in st.outputs)}")
        print(f"  code: {len(stage_code(st))} files")
    return 0


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace(check="--check" in sys.argv, write="--write" in sys.argv), None))
