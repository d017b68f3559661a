# Reading a run: the sample audit, then the eval report with DVC-style metrics.


rule audit:
    input:
        tokenizer="data/tokenizer/{variant}/tokenizer.json",
        model="runs/{variant}/main.done",
        warmup="runs/{variant}/warmup.done",
        code=code("audit"),
    output:
        json="reports/{variant}/audit.json",
        md="reports/{variant}/audit.md",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/audit/{variant}.log",
    resources:
        **rule_resources("audit", lambda w: CFG[w.variant]),
    threads: rule_threads("audit", lambda w: CFG[w.variant])
    params:
        cfg=params_hash("audit"),
        set=SET,
    shell:
        "andrea audit --profile {wildcards.variant} {params.set} --run runs/{wildcards.variant}/main"
        " --extra-checkpoint runs/{wildcards.variant}/warmup --tokenizer {input.tokenizer}"
        " --out reports/{wildcards.variant} 2>&1 | tee {log}"


rule eval:
    input:
        tokenizer="data/tokenizer/{variant}/tokenizer.json",
        tokens="data/tokens/{variant}",
        model="runs/{variant}/main.done",
        audit="reports/{variant}/audit.json",
        code=code("eval"),
    output:
        html="reports/{variant}/eval.html",
        md="reports/{variant}/eval.md",
        metrics="reports/{variant}/metrics.json",
        loss="reports/{variant}/loss.csv",
        val_loss="reports/{variant}/val_loss.csv",
        val_per_source="reports/{variant}/val_per_source.csv",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/eval/{variant}.log",
    resources:
        **rule_resources("eval", lambda w: CFG[w.variant]),
    threads: rule_threads("eval", lambda w: CFG[w.variant])
    params:
        cfg=params_hash("eval"),
        set=SET,
    shell:
        "andrea eval --profile {wildcards.variant} {params.set} --run runs/{wildcards.variant}/main"
        " --tokenizer {input.tokenizer} --tokens {input.tokens} --audit {input.audit}"
        " --out reports/{wildcards.variant} 2>&1 | tee {log}"
