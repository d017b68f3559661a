# ANDREA: Snakemake front end. Thin by design: every rule runs one `andrea <stage>` command; the
# stages, their names, params and code deps are declared once in andrea/stages.py (dvc.yaml is
# generated from it; tests/test_frontends.py checks these rules against it).
#
#   snakemake --cores 1                   # default: the whole DAG for the `tiny` profile (CPU, ~3 min)
#   snakemake --cores 1 train_120m        # ANDREA-120M trained, audited, evaluated (also train_12m, train_480m)
#   snakemake --cores 1 checkpoint_120m   # only the trained checkpoint (runs/andrea-120m/main/)
#   snakemake --cores 1 train_120m --config hermes3='{source: embedded}'   # any key, every stage
#   snakemake -n -p train_120m            # list what that would run, with the commands
#
# No `configfile:`: each variant's params are composed from params/ (params/config.yaml +
# params/profile/<variant>.yaml, as `andrea --profile` and DVC's Hydra composition do), then
# this run's --config / --configfile overrides (nested keys, e.g. --config model='{d_model: 64}')
# are applied to every variant and passed to every command as -S flags. All variants are
# validated against workflow/schemas/params.schema.yaml before any job (workflow/rules/common.smk).

from snakemake.utils import min_version

min_version("8.10")


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/tokenizer.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/reports.smk"


def reports(variant):
    return [f"reports/{variant}/{name}" for name in ("eval.html", "metrics.json", "audit.md", "diet.md")]


rule all:
    default_target: True
    input:
        reports("tiny"),


rule train_12m:
    input:
        reports("andrea-12m"),


rule train_120m:
    input:
        reports("andrea-120m"),


rule train_480m:
    input:
        reports("andrea-480m"),


rule checkpoint_12m:
    input:
        "runs/andrea-12m/main.done",


rule checkpoint_120m:
    input:
        "runs/andrea-120m/main.done",


rule checkpoint_480m:
    input:
        "runs/andrea-480m/main.done",
