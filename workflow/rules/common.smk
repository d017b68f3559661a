# Shared helpers for the rules: the merged params of each profile (validated here, before any
# rule runs), the corpus a profile reads, and per-section hashes so a changed param reruns a rule.
import hashlib
import json

from snakemake.utils import validate

from andrea.config import load_config

validate(config, "../schemas/params.schema.yaml")

VARIANTS = ["tiny", "andrea-12m", "andrea-120m", "andrea-480m"]
CORPORA = ["hub", "local", "embedded"]
CFG = {v: load_config("params.yaml", v) for v in VARIANTS}


wildcard_constraints:
    variant="|".join(VARIANTS),
    corpus="|".join(CORPORA),
    phase="warmup|main",


def corpus(variant):
    """The corpus (hermes3.source) a profile trains on."""
    return CFG[variant]["hermes3"]["source"]


def section_hash(variant, *sections):
    """A short hash of some params sections: a change reruns the rule that names it."""
    blob = json.dumps([CFG[variant][s] for s in sections], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def megachat_dir(w):
    return f"data/megachat/{corpus(w.variant)}"
