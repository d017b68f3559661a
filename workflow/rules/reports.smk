# Reading a run: the sample audit, then the eval report with DVC-style metrics.


rule audit_samples:
    input:
        tokenizer="data/tokenizer/{variant}/tokenizer.json",
        model="runs/{variant}/main/model.bin",
        warmup="runs/{variant}/warmup/model.bin",
    output:
        json="reports/{variant}/audit.json",
        md="reports/{variant}/audit.md",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/audit_samples/{variant}.log",
    params:
        cfg=lambda w: section_hash(w.variant, "audit", "coherence", "seed", "model", "train"),
    shell:
        "andrea audit --profile {wildcards.variant} --run runs/{wildcards.variant}/main"
        " --extra-checkpoint runs/{wildcards.variant}/warmup --tokenizer {input.tokenizer}"
        " --out reports/{wildcards.variant} > {log} 2>&1"


rule eval_model:
    input:
        tokenizer="data/tokenizer/{variant}/tokenizer.json",
        tokens="data/tokens/{variant}",
        model="runs/{variant}/main/model.bin",
        audit="reports/{variant}/audit.json",
    output:
        html="reports/{variant}/eval.html",
        md="reports/{variant}/eval.md",
        metrics="reports/{variant}/metrics.json",
        loss="reports/{variant}/loss.csv",
        val_loss="reports/{variant}/val_loss.csv",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/eval_model/{variant}.log",
    threads: workflow.cores
    params:
        cfg=lambda w: section_hash(w.variant, "eval", "model", "train"),
    shell:
        "andrea eval --profile {wildcards.variant} --run runs/{wildcards.variant}/main --tokenizer {input.tokenizer}"
        " --tokens {input.tokens} --audit {input.audit} --out reports/{wildcards.variant} > {log} 2>&1"
