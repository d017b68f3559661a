# Training: curriculum warmup, then the main run from the warmup checkpoint. A run folder left by
# other params is moved aside (<out>.stale-<hash>) and training starts over; the same params resume.
# Training takes every core Snakemake was given (--cores): the NumPy engine splits each batch over
# that many threads (Snakemake passes the count as OPENBLAS_NUM_THREADS / OMP_NUM_THREADS).


rule train_warmup:
    input:
        tokenizer="data/tokenizer/{variant}/tokenizer.json",
        tokens="data/tokens/{variant}",
    output:
        "runs/{variant}/warmup/model.bin",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/train_warmup/{variant}.log",
    threads: workflow.cores
    params:
        cfg=lambda w: section_hash(w.variant, "model", "train", "curriculum", "bandit", "coherence", "seed"),
    shell:
        "andrea train --phase warmup --profile {wildcards.variant} --tokenizer {input.tokenizer}"
        " --tokens {input.tokens} --out runs/{wildcards.variant}/warmup --on-mismatch restart > {log} 2>&1"


rule train_main:
    input:
        tokenizer="data/tokenizer/{variant}/tokenizer.json",
        tokens="data/tokens/{variant}",
        warmup="runs/{variant}/warmup/model.bin",
    output:
        "runs/{variant}/main/model.bin",
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/train_main/{variant}.log",
    threads: workflow.cores
    params:
        cfg=lambda w: section_hash(w.variant, "model", "train", "curriculum", "bandit", "coherence", "seed"),
    shell:
        "andrea train --phase main --profile {wildcards.variant} --tokenizer {input.tokenizer}"
        " --tokens {input.tokens} --init runs/{wildcards.variant}/warmup --out runs/{wildcards.variant}/main"
        " --on-mismatch restart > {log} 2>&1"
