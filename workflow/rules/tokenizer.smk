# Tokenizer and diet alignment, per variant (profile).


rule train_tokenizer:
    input:
        train=lambda w: f"{megachat_dir(w)}/train.parquet",
    output:
        "data/tokenizer/{variant}/tokenizer.json",
        "data/tokenizer/{variant}/tokenizer.json.sha256",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/train_tokenizer/{variant}.log",
    params:
        cfg=lambda w: section_hash(w.variant, "tokenizer"),
    shell:
        "andrea tokenizer --profile {wildcards.variant} --train {input.train}"
        " --out data/tokenizer/{wildcards.variant} > {log} 2>&1"


rule align_diet:
    input:
        tokenizer="data/tokenizer/{variant}/tokenizer.json",
        train=lambda w: f"{megachat_dir(w)}/train.parquet",
        val=lambda w: f"{megachat_dir(w)}/val.parquet",
    output:
        tokens=directory("data/tokens/{variant}"),
        json="reports/{variant}/diet.json",
        md="reports/{variant}/diet.md",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/align_diet/{variant}.log",
    params:
        cfg=lambda w: section_hash(w.variant, "diet", "tokenizer"),
        megachat=megachat_dir,
    shell:
        "andrea diet-alignment --profile {wildcards.variant} --tokenizer {input.tokenizer}"
        " --megachat {params.megachat} --tokens {output.tokens} --report reports/{wildcards.variant} > {log} 2>&1"
