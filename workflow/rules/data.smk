# Data stages, keyed by corpus (= hermes3.source), so the embedded and hub data live side by side.


rule pull_hermes3:
    input:
        "data/embedded/PROVENANCE.json",
    output:
        "data/raw/hermes3/{corpus}/MANIFEST.json",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/pull_hermes3/{corpus}.log",
    params:
        cfg=lambda w: section_hash(config["profile"], "hermes3"),
    shell:
        "andrea pull-hermes3 -S hermes3.source={wildcards.corpus}"
        " --embedded data/embedded --out data/raw/hermes3/{wildcards.corpus} > {log} 2>&1"


rule prep_megachat:
    input:
        "data/raw/hermes3/{corpus}/MANIFEST.json",
        "data/embedded/PROVENANCE.json",
    output:
        "data/megachat/{corpus}/train.parquet",
        "data/megachat/{corpus}/val.parquet",
        "data/megachat/{corpus}/prep_report.json",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/prep_megachat/{corpus}.log",
    params:
        cfg=lambda w: section_hash(config["profile"], "megachat"),
    shell:
        "andrea prep-megachat -S hermes3.source={wildcards.corpus} --raw data/raw/hermes3/{wildcards.corpus}"
        " --embedded data/embedded --out data/megachat/{wildcards.corpus} > {log} 2>&1"
