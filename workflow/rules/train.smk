# Training: curriculum warmup, then the main run from the warmup checkpoint. A run folder left by
# other params is moved aside (<out>.stale-<hash>) and training starts over; the same params resume
# (so a folder DVC trained with the same params is picked up, not redone).
# Training asks for the threads, memory, runtime and GPU that andrea/resources.py derives from the
# params (capped by --cores locally; sbatch's --cpus-per-task/--mem/-t/--gpus under the SLURM profile).
# Progress (a line per train.log_every steps: step, loss, tok/s, ETA) goes to the terminal and the log.
#
# The output Snakemake tracks is a marker beside the run folder (runs/<variant>/<phase>.done,
# touched when the command succeeds), not model.bin: Snakemake deletes a job's outputs before it
# runs, and a run folder must never lose its checkpoint (to a rerun, or to a folder DVC trained
# with the same params: the command resumes it and has nothing to do). DVC tracks the folder.


rule warmup:
    input:
        tokenizer="data/tokenizer/{variant}/tokenizer.json",
        tokens="data/tokens/{variant}",
        code=code("warmup"),
    output:
        touch("runs/{variant}/warmup.done"),
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/warmup/{variant}.log",
    resources:
        **rule_resources("train", lambda w: CFG[w.variant], phase="warmup"),
    threads: rule_threads("train", lambda w: CFG[w.variant], phase="warmup")
    params:
        cfg=params_hash("warmup"),
        set=SET,
    shell:
        "andrea train --profile {wildcards.variant} {params.set} --phase warmup --tokenizer {input.tokenizer}"
        " --tokens {input.tokens} --out runs/{wildcards.variant}/warmup --on-mismatch restart 2>&1 | tee {log}"


rule train:
    input:
        tokenizer="data/tokenizer/{variant}/tokenizer.json",
        tokens="data/tokens/{variant}",
        warmup="runs/{variant}/warmup.done",
        code=code("train"),
    output:
        touch("runs/{variant}/main.done"),
    conda:
        "../envs/andrea.yaml"
    log:
        "logs/train/{variant}.log",
    resources:
        **rule_resources("train", lambda w: CFG[w.variant], phase="main"),
    threads: rule_threads("train", lambda w: CFG[w.variant], phase="main")
    params:
        cfg=params_hash("train"),
        set=SET,
    shell:
        "andrea train --profile {wildcards.variant} {params.set} --phase main --tokenizer {input.tokenizer}"
        " --tokens {input.tokens} --init runs/{wildcards.variant}/warmup --out runs/{wildcards.variant}/main"
        " --on-mismatch restart 2>&1 | tee {log}"
