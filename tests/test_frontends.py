"""The two front ends run one pipeline: every Snakemake job has a DVC stage with the same
`andrea` command, and its inputs/outputs lie within that stage's deps/outs.

    pytest tests/test_frontends.py

Both front ends are read in a scratch copy of the workflow files (nothing runs): Snakemake
through a forced dry run, DVC through its own stage loader with params.yaml set to the profile.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FILES = ["Snakefile", "workflow", "params", "params.yaml", "dvc.yaml"]


@pytest.fixture()
def scratch(tmp_path):
    for name in FILES:
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    (tmp_path / "data/embedded").mkdir(parents=True)
    (tmp_path / "data/embedded/PROVENANCE.json").write_text("{}")
    return tmp_path


def snakemake_jobs(cwd: Path, target: str) -> list[dict]:
    exe = Path(sys.executable).with_name("snakemake")
    out = subprocess.run([str(exe), "-n", "-p", "--forceall", "--cores", "1", target], cwd=cwd,
                         capture_output=True, text=True, check=True).stdout
    jobs, job = [], None
    for line in out.splitlines():
        if m := re.match(r"rule (\w+):$", line):
            job = {"rule": m.group(1), "input": [], "output": []}
            jobs.append(job)
        elif job and (m := re.match(r"\s+(input|output): (.*)$", line)):
            job[m.group(1)] = [p.strip() for p in m.group(2).split(",")]
        elif job and line.startswith("Shell command: "):
            job["cmd"] = line[len("Shell command: "):]
    return [j for j in jobs if j.get("cmd", "None") != "None"]  # target rules have no command


def dvc_stages(cwd: Path, profile: str, source: str) -> list[dict]:
    from dvc.repo import Repo

    params = yaml.safe_load((cwd / "params.yaml").read_text())
    params["profile"], params["hermes3"]["source"] = profile, source
    (cwd / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if not (cwd / ".dvc").exists():
        Repo.init(str(cwd), no_scm=True)
    repo = Repo(str(cwd))
    stages = []
    for st in repo.index.stages:
        paths = lambda items: [str(Path(o.def_path)) for o in items if not type(o).__name__.startswith("Params")]
        stages.append({"name": st.name, "cmd": st.cmd, "deps": paths(st.deps), "outs": paths(st.outs)})
    return stages


def norm(cmd: str) -> str:
    cmd = re.sub(r"\s*>\s*\S+\s+2>&1\s*$", "", cmd)  # Snakemake's log redirect
    return " ".join(cmd.split())


def within(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@pytest.mark.parametrize("target,profile,source", [("all", "tiny", "embedded"),
                                                   ("train_12m", "andrea-12m", "hub")])
def test_same_commands_inputs_outputs(scratch, target, profile, source):
    jobs = snakemake_jobs(scratch, target)
    stages = {norm(s["cmd"]): s for s in dvc_stages(scratch, profile, source)}
    assert jobs, "the Snakemake dry run listed no jobs"
    matched = set()
    for job in jobs:
        cmd = norm(job["cmd"])
        assert cmd in stages, f"rule {job['rule']}: no dvc.yaml stage runs `{cmd}`"
        st = stages[cmd]
        matched.add(st["name"])
        for p in job["input"]:
            assert within(p, st["deps"]), f"rule {job['rule']}: input {p} not among stage {st['name']} deps"
        for p in job["output"]:
            assert within(p, st["outs"]), f"rule {job['rule']}: output {p} not among stage {st['name']} outs"
    if target == "all":
        assert matched == {s["name"] for s in stages.values()}, "dvc.yaml has stages the Snakemake DAG lacks"


def test_train_120m_dry_run_lists_data_stages(scratch):
    rules = [j["rule"] for j in snakemake_jobs(scratch, "train_120m")]
    for rule in ("pull_hermes3", "prep_megachat", "train_tokenizer", "align_diet", "train_warmup", "train_main"):
        assert rule in rules
