# Data stages, keyed by corpus (= hermes3.source), so the embedded and hub data live side by side.
# Their params come from the default profile (no profile changes them) plus this run's overrides.


rule pull_hermes3:
    input:
        "data/embedded/PROVENANCE.json",
        code=code("pull_hermes3"),
    output:
        "data/raw/hermes3/{corpus}/MANIFEST.json",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/pull_hermes3/{corpus}.log",
    resources:
        **rule_resources("pull-hermes3", lambda w: DATA[w.corpus]),
    params:
        cfg=params_hash("pull_hermes3"),
        set=SET,
        profile=DEFAULT,
    shell:
        "andrea pull-hermes3 --profile {params.profile} {params.set} -S hermes3.source={wildcards.corpus}"
        " --embedded data/embedded --out data/raw/hermes3/{wildcards.corpus} 2>&1 | tee {log}"


rule prep_megachat:
    input:
        "data/raw/hermes3/{corpus}/MANIFEST.json",
        "data/embedded/PROVENANCE.json",
        code=code("prep_megachat"),
    output:
        "data/megachat/{corpus}/train.parquet",
        "data/megachat/{corpus}/val.parquet",
        "data/megachat/{corpus}/prep_report.json",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/prep_megachat/{corpus}.log",
    resources:
        **rule_resources("prep-megachat", lambda w: DATA[w.corpus]),
    params:
        cfg=params_hash("prep_megachat"),
        set=SET,
        profile=DEFAULT,
    shell:
        "andrea prep-megachat --profile {params.profile} {params.set} -S hermes3.source={wildcards.corpus}"
        " --raw data/raw/hermes3/{wildcards.corpus} --embedded data/embedded --out data/megachat/{wildcards.corpus}"
        " 2>&1 | tee {log}"
