# Tokenizer and diet alignment, per variant (profile).


rule tokenizer:
    input:
        train=lambda w: f"{megachat_dir(w)}/train.parquet",
        code=code("tokenizer"),
    output:
        "data/tokenizer/{variant}/tokenizer.json",
        "data/tokenizer/{variant}/tokenizer.json.sha256",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/tokenizer/{variant}.log",
    resources:
        **rule_resources("tokenizer", lambda w: CFG[w.variant]),
    params:
        cfg=params_hash("tokenizer"),
        set=SET,
    shell:
        "andrea tokenizer --profile {wildcards.variant} {params.set} --train {input.train}"
        " --out data/tokenizer/{wildcards.variant} 2>&1 | tee {log}"


rule diet_alignment:
    input:
        tokenizer="data/tokenizer/{variant}/tokenizer.json",
        train=lambda w: f"{megachat_dir(w)}/train.parquet",
        val=lambda w: f"{megachat_dir(w)}/val.parquet",
        code=code("diet_alignment"),
    output:
        tokens=directory("data/tokens/{variant}"),
        json="reports/{variant}/diet.json",
        md="reports/{variant}/diet.md",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/diet_alignment/{variant}.log",
    resources:
        **rule_resources("diet-alignment", lambda w: CFG[w.variant]),
    params:
        cfg=params_hash("diet_alignment"),
        set=SET,
        megachat=megachat_dir,
    shell:
        "andrea diet-alignment --profile {wildcards.variant} {params.set} --tokenizer {input.tokenizer}"
        " --megachat {params.megachat} --tokens {output.tokens} --report reports/{wildcards.variant} 2>&1 | tee {log}"
