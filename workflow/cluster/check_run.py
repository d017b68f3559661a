"""Checks of a DAG run through SLURM against a local run (workflow/cluster/slurm_local.sh calls it).

    python workflow/cluster/check_run.py --log cluster.log --sacct sacct.txt --jobcomp jobcomp.txt \\
        --local LOCAL_COPY --cluster CLUSTER_COPY

1. Every job Snakemake ran (``rule X:`` in its log; ``localrule`` ones run in Snakemake itself)
   was submitted with sbatch, and SLURM's job-completion records (``sacct -c``) show it
   COMPLETED with exit code 0:0.
2. SLURM gave each job what its rule declared: --cpus-per-task = threads, --mem = mem_mb,
   the time limit = runtime (minutes).
3. The outputs (data/ but the checked-in data/embedded, runs/, reports/; not the run folders'
   wall-clock sidecar model.perf.jsonl) are the same files with the same bytes in both copies;
   wall-clock fields that run folders made before that sidecar still carry are left out: the keys
   ``time``, ``tokens_per_s`` and ``train_tokens_per_s`` of JSON files, the tokens/s lines of
   Markdown reports, and the tokens/s cell and Throughput plot of HTML reports.
Exit 0 when all hold; otherwise 1 and one line per problem.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

VOLATILE_KEYS = {"time", "tokens_per_s", "train_tokens_per_s"}
VOLATILE_LINE = re.compile(r"tokens/s|tok/s")
VOLATILE_HTML = [(re.compile(r"<section><h2>Throughput</h2>.*?</section>", re.S), ""),
                 (re.compile(r"(tokens/s</td><td>)[\d.,]+"), r"\1#")]
# the wall-clock sidecar of a run folder (andrea/runs.py PERF; .dvcignore keeps it out of DVC's hashes too)
SKIP_NAMES = {".snakemake_timestamp", "model.perf.jsonl"}


def parse_log(text: str) -> dict[int, dict]:
    """Snakemake jobid -> {rule, local, threads, resources, slurm: [SLURM job ids]}."""
    jobs: dict[int, dict] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"^(local)?rule (\w+):$", line)
        if m:
            cur = {"rule": m.group(2), "local": bool(m.group(1)), "threads": 1, "resources": {}, "slurm": []}
            continue
        if cur is not None:
            m = re.match(r"^\s+jobid: (\d+)$", line)
            if m:
                jobs.setdefault(int(m.group(1)), cur)
                cur["jobid"] = int(m.group(1))
                continue
            m = re.match(r"^\s+threads: (\d+)$", line)
            if m:
                cur["threads"] = int(m.group(1))
                continue
            m = re.match(r"^\s+resources: (.*)$", line)
            if m:
                for item in m.group(1).split(", "):
                    k, _, v = item.partition("=")
                    cur["resources"][k] = v
                continue
            if not line.startswith(" "):
                cur = None
        m = re.match(r"^Job (\d+) has been submitted with SLURM jobid (\d+)", line)
        if m and int(m.group(1)) in jobs:
            jobs[int(m.group(1))]["slurm"].append(m.group(2))
    return jobs


def minutes(limit: str) -> int:
    """A SLURM time limit (``MM``, ``HH:MM:SS``, ``D-HH:MM:SS``) in minutes."""
    days, _, rest = limit.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if len(parts) == 1:
        return int(days or 0) * 1440 + parts[0]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts
    return int(days or 0) * 1440 + h * 60 + m + (1 if s else 0)


def check_jobs(log: str, sacct: str, jobcomp: str) -> tuple[list[str], list[str]]:
    problems, lines = [], []
    jobs = parse_log(log)
    rows = {}
    for row in sacct.splitlines()[1:]:
        f = row.split("|")
        if len(f) >= 6:
            rows[f[0]] = {"name": f[1], "state": f[2], "exit": f[3], "ncpus": f[4], "limit": f[5]}
    scale = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 ** 2}  # SLURM writes 2048M as 2G
    mem = {m.group(1): int(float(m.group(2)) * scale[m.group(3)])
           for m in re.finditer(r"JobId=(\d+) .*?Tres=\S*?mem=([\d.]+)([KMGT])", jobcomp)}
    remote = [j for j in jobs.values() if not j["local"]]
    if not remote:
        problems.append("no job ran through SLURM (no 'rule X:' in the Snakemake log)")
    for j in sorted(remote, key=lambda j: int(j["slurm"][0]) if j["slurm"] else 0):
        name = j["rule"]
        if not j["slurm"]:
            problems.append(f"{name}: never submitted with sbatch")
            continue
        for sid in j["slurm"]:
            r = rows.get(sid)
            if r is None:
                problems.append(f"{name}: SLURM job {sid} is not in sacct -c")
                continue
            if (r["state"], r["exit"]) != ("COMPLETED", "0:0"):
                problems.append(f"{name}: SLURM job {sid} {r['state']} exit {r['exit']}")
            res = j["resources"]
            want = {"cpus": j["threads"], "mem_mb": int(res.get("mem_mb", -1)), "runtime": int(res.get("runtime", -1))}
            got = {"cpus": int(r["ncpus"]), "mem_mb": mem.get(sid, -2), "runtime": minutes(r["limit"])}
            if want != got:
                problems.append(f"{name}: SLURM job {sid} got {got}, the rule declared {want}")
            lines.append(f"{name:<16} slurm job {sid:>4} {r['state']:<9} cpus {got['cpus']} mem {got['mem_mb']} MB "
                         f"limit {got['runtime']} min")
    return problems, lines


def normalised(path: Path) -> bytes:
    data = path.read_bytes()
    if path.suffix == ".json":
        def strip(x):
            if isinstance(x, dict):
                return {k: strip(v) for k, v in x.items() if k not in VOLATILE_KEYS}
            if isinstance(x, list):
                return [strip(v) for v in x]
            return x
        return json.dumps(strip(json.loads(data)), sort_keys=True).encode()
    if path.suffix == ".md":
        return b"\n".join(ln for ln in data.splitlines() if not VOLATILE_LINE.search(ln.decode("utf-8", "replace")))
    if path.suffix == ".html":
        text = data.decode("utf-8", "replace")
        for pat, repl in VOLATILE_HTML:
            text = pat.sub(repl, text)
        return text.encode()
    return data


def outputs(root: Path) -> dict[str, Path]:
    out = {}
    for top in ("data", "runs", "reports"):
        for p in sorted((root / top).rglob("*")):
            rel = p.relative_to(root).as_posix()
            if p.is_file() and p.name not in SKIP_NAMES and not rel.startswith("data/embedded/"):
                out[rel] = p
    return out


def check_outputs(local: Path, cluster: Path) -> tuple[list[str], list[str]]:
    a, b = outputs(local), outputs(cluster)
    problems = [f"{k}: only in the local run" for k in sorted(set(a) - set(b))]
    problems += [f"{k}: only in the SLURM run" for k in sorted(set(b) - set(a))]
    same_bytes = same_norm = 0
    for k in sorted(set(a) & set(b)):
        if a[k].read_bytes() == b[k].read_bytes():
            same_bytes += 1
        elif normalised(a[k]) == normalised(b[k]):
            same_norm += 1
        else:
            problems.append(f"{k}: differs (sha256 {hashlib.sha256(a[k].read_bytes()).hexdigest()[:12]} local, "
                            f"{hashlib.sha256(b[k].read_bytes()).hexdigest()[:12]} SLURM)")
    return problems, [f"outputs: {same_bytes} files byte-identical, {same_norm} identical but for wall-clock fields, "
                      f"of {len(set(a) | set(b))}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log", required=True, type=Path)
    p.add_argument("--sacct", required=True, type=Path)
    p.add_argument("--jobcomp", required=True, type=Path)
    p.add_argument("--local", required=True, type=Path)
    p.add_argument("--cluster", required=True, type=Path)
    a = p.parse_args(argv)
    problems, lines = check_jobs(a.log.read_text(), a.sacct.read_text(), a.jobcomp.read_text())
    p2, l2 = check_outputs(a.local, a.cluster)
    for line in lines + l2:
        print(line)
    for prob in problems + p2:
        print(f"problem: {prob}")
    return 1 if problems or p2 else 0


if __name__ == "__main__":
    sys.exit(main())
