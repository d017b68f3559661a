# ANDREA: Snakemake front end. Thin by design: every rule runs one `andrea <stage>` command.
#
#   snakemake --cores 1                 # default: the whole DAG for the `tiny` profile (CPU, minutes)
#   snakemake --cores 1 train_120m      # up to a trained ANDREA-120M (also train_12m, train_480m)
#   snakemake -n train_120m             # list what that would run
#
# Every profile's merged params are validated against workflow/schemas/params.schema.yaml
# before any rule runs (see workflow/rules/common.smk).

from snakemake.utils import min_version

min_version("8.10")


configfile: "params.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/tokenizer.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/reports.smk"


rule all:
    default_target: True
    input:
        "reports/tiny/eval.html",
        "reports/tiny/metrics.json",
        "reports/tiny/audit.md",
        "reports/tiny/diet.md",


rule train_12m:
    input:
        "runs/andrea-12m/main/model.bin",


rule train_120m:
    input:
        "runs/andrea-120m/main/model.bin",


rule train_480m:
    input:
        "runs/andrea-480m/main/model.bin",
