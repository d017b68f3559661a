# Shared helpers for the rules: the effective params of each variant (composed from params/ like
# `andrea --profile`, plus this run's --config/--configfile overrides, validated before any job),
# the corpus a variant reads, the override flags every command gets, and per-stage params hashes
# (from the stage table in andrea/stages.py) so a changed param reruns exactly the rules that read it.
import hashlib
import json
import re
import shlex
import sys

from andrea.config import check_backend, default_profile, get, load_config
from andrea.errors import ConfigError
from andrea.resources import rule_resources, rule_threads  # threads/mem_mb/runtime/gpu per job (SLURM)
from andrea.stages import BY_NAME, stage_code

VARIANTS = ["tiny", "andrea-12m", "andrea-120m", "andrea-480m"]
CORPORA = ["hub", "local", "embedded"]
DEFAULT = default_profile(Path("params"))  # the profile the data stages read their sections from


def dotted_overrides(node, prefix=""):
    """--config/--configfile as `-S` overrides: nested keys dotted; a string stays as typed (the
    command line's --config gives strings: `64` is parsed as a number, as `-S` does), anything
    else is written as JSON (YAML flow), so lists and numbers from a --configfile keep their type."""
    out = []
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out += dotted_overrides(v, key + ".")
        else:
            out.append(f"{key}={v if isinstance(v, str) else json.dumps(v)}")
    return out


def _fail(msg):
    print(f"snakemake: {msg}", file=sys.stderr)
    sys.exit(3)


if "profile" in config:
    _fail("--config profile=...: the target picks the variant (train_12m, train_120m, ...); override other keys")
OVERRIDES = dotted_overrides(config)
SET = " ".join(f"-S {shlex.quote(o)}" for o in OVERRIDES)
try:
    CFG = {v: load_config("params.yaml", v, OVERRIDES) for v in VARIANTS}
    DATA = {c: load_config("params.yaml", DEFAULT, [*OVERRIDES, f"hermes3.source={c}"]) for c in CORPORA}
except ConfigError as e:
    _fail(e)


# The GPU path fails first: a variant this machine cannot train stops the run with one line naming
# train.backend/train.precision and the install command, before any job; `auto` says here what
# it will pick. Checked while the Snakefile is read for the variants named on the command line
# (train_120m, runs/andrea-120m/...), then once the DAG is known for every variant it will run
# (onstart: real runs only; a dry run -n lists the jobs of any variant).
def _check(variants):
    for v in sorted(variants):
        try:
            note = check_backend(CFG[v])
        except ConfigError as e:
            _fail(e)
        if note:
            print(note, file=sys.stderr)


def _named_variants(argv):
    if any(a in ("--dry-run", "--dryrun") or re.fullmatch(r"-[a-zA-Z]*n[a-zA-Z]*", a) for a in argv):
        return set()
    named = set()
    for a in argv:
        for v in VARIANTS:
            if re.fullmatch(rf"(train|checkpoint)_{v.removeprefix('andrea-')}", a) or f"/{v}/" in a:
                named.add(v)
    return named


_check(_named_variants(sys.argv[1:]))


onstart:
    _check({j.wildcards.get("variant") for j in workflow.dag.needrun_jobs()} - {None})


wildcard_constraints:
    variant="|".join(VARIANTS),
    corpus="|".join(CORPORA),


def corpus(variant):
    """The corpus (hermes3.source) a variant trains on."""
    return CFG[variant]["hermes3"]["source"]


def megachat_dir(w):
    return f"data/megachat/{corpus(w.variant)}"


def params_hash(stage):
    """A short hash of the params the stage table says `stage` reads: a change reruns it."""
    st = BY_NAME[stage]

    def f(w):
        cfg = DATA[w.corpus] if st.per == "corpus" else CFG[w.variant]
        blob = json.dumps([get(cfg, key) for key in st.params], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    return f


def code(stage):
    """The andrea source files the stage runs (andrea/stages.py derives them from its imports)."""
    return stage_code(BY_NAME[stage])
