"""The two front ends run one pipeline, the stage table in andrea/stages.py: dvc.yaml is generated
from it (and must not drift), every Snakemake job is a table stage under the same name with the
same `andrea` command, inputs, outputs and code deps, and --config overrides reach every command.

    pytest tests/test_frontends.py

Both front ends are read in a scratch copy of the workflow files (nothing runs): Snakemake
through a forced dry run, DVC through its own stage loader with params.yaml set to the profile.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from andrea.config import load_config
from andrea.reports import render as R
from andrea.stages import BY_NAME, STAGES, TRAJECTORY, drift, stage_code

ROOT = Path(__file__).resolve().parents[1]
FILES = ["Snakefile", "workflow", "params", "params.yaml", "dvc.yaml", "andrea"]
CONFIG_FLAGS = re.compile(r"\s(--profile\s+\S+|-S\s+('[^']*'|\S+))")


@pytest.fixture()
def scratch(tmp_path):
    for name in FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, tmp_path / name)
    (tmp_path / "data/embedded").mkdir(parents=True)
    (tmp_path / "data/embedded/PROVENANCE.json").write_text("{}")
    return tmp_path


def snakemake_jobs(cwd: Path, target: str, *extra: str) -> list[dict]:
    exe = Path(sys.executable).with_name("snakemake")
    r = subprocess.run([str(exe), "-n", "-p", "--forceall", "--cores", "1", target, *extra], cwd=cwd,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    jobs, job = [], None
    for line in r.stdout.splitlines():
        if m := re.match(r"rule (\w+):$", line):
            job = {"rule": m.group(1), "input": [], "output": [], "wildcards": {}}
            jobs.append(job)
        elif job and (m := re.match(r"\s+(input|output): (.*)$", line)):
            job[m.group(1)] = [p.strip() for p in m.group(2).split(",")]
        elif job and (m := re.match(r"\s+wildcards: (.*)$", line)):
            job["wildcards"] = dict(kv.strip().split("=", 1) for kv in m.group(1).split(","))
        elif job and line.startswith("Shell command: "):
            job["cmd"] = line[len("Shell command: "):]
    return [j for j in jobs if j.get("cmd", "None") != "None"]  # target rules have no command


def dvc_stages(cwd: Path, profile: str, source: str) -> list[dict]:
    from dvc.repo import Repo

    cfg = load_config(ROOT / "params.yaml", profile, [f"hermes3.source={source}"])
    (cwd / "params.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    if not (cwd / ".dvc").exists():
        Repo.init(str(cwd), no_scm=True)
    repo = Repo(str(cwd))
    stages = []
    for st in repo.index.stages:
        paths = lambda items: [str(Path(o.def_path)) for o in items if not type(o).__name__.startswith("Params")]
        params = [k for d in st.deps if type(d).__name__.startswith("Params") for k in d.params]
        stages.append({"name": st.name, "cmd": st.cmd, "deps": paths(st.deps), "outs": paths(st.outs),
                       "params": params})
    return stages


def strip_config(cmd: str) -> str:
    """The command without its config selection (--profile, -S) and Snakemake's log tee."""
    cmd = re.sub(r"\s*2>&1\s*\|\s*tee\s+\S+\s*$", "", cmd)
    return " ".join(CONFIG_FLAGS.sub(" ", " " + cmd).split())


def fill(text: str, variant: str, corpus: str) -> str:
    return text.replace("{variant}", variant).replace("{corpus}", corpus)


def within(path: str, roots: list[str]) -> bool:
    """`path` is one of `roots` or inside one; Snakemake's marker of a run folder (runs/V/main.done,
    see workflow/rules/train.smk) stands for that folder."""
    path = path.removesuffix(".done") if path.startswith("runs/") else path
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def test_generated_files_match_the_table():
    assert drift() == [], "run `andrea stages --write`"


@pytest.mark.parametrize("target,profile,source", [("all", "tiny", "embedded"),
                                                   ("train_12m", "andrea-12m", "hub")])
def test_snakemake_jobs_are_table_stages(scratch, target, profile, source):
    jobs = snakemake_jobs(scratch, target)
    assert jobs, "the Snakemake dry run listed no jobs"
    assert {j["rule"] for j in jobs} == set(BY_NAME), "every stage, and only table stages, in the DAG"
    for job in jobs:
        st = BY_NAME[job["rule"]]
        want = fill(f"andrea {st.command} {st.args}", profile, source)
        assert strip_config(job["cmd"]) == " ".join(want.split()), f"rule {st.name}: command differs from the table"
        code = stage_code(st)
        data_in = [p for p in job["input"] if p not in code]
        assert sorted(set(job["input"]) - set(data_in)) == code, f"rule {st.name}: code inputs differ from the table"
        for p in data_in:
            assert within(p, [fill(i, profile, source) for i in st.inputs]), f"rule {st.name}: input {p} not in table"
        outs = [fill(o.path, profile, source) for o in st.outputs]
        if any(o.persist for o in st.outputs):  # a run folder: Snakemake must never delete model.bin
            assert job["output"] == [f"{outs[0]}.done"], f"rule {st.name}: only the marker is an output"
        for p in job["output"]:
            assert within(p, outs), f"rule {st.name}: output {p} not in the table"


@pytest.mark.parametrize("profile,source", [("tiny", "embedded"), ("andrea-120m", "hub")])
def test_dvc_stages_are_table_stages(scratch, profile, source):
    stages = dvc_stages(scratch, profile, source)
    assert [s["name"] for s in stages] == [s.name for s in STAGES]
    for got in stages:
        st = BY_NAME[got["name"]]
        assert " ".join(got["cmd"].split()) == " ".join(fill(f"andrea {st.command} {st.args}", profile, source).split())
        assert got["deps"] == [fill(i, profile, source) for i in st.inputs] + stage_code(st)
        assert got["outs"] == [fill(o.path, profile, source) for o in st.outputs]
        assert got["params"] == list(st.params)


def test_training_depends_on_every_cuda_file():
    cuda = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "andrea/cuda").iterdir()
                  if p.suffix in (".py", ".cu", ".cuh"))
    for name in ("warmup", "train", "audit", "eval"):
        assert set(cuda) <= set(stage_code(BY_NAME[name])), name
    from andrea.train import TRAJECTORY_SECTIONS

    assert BY_NAME["warmup"].params == BY_NAME["train"].params == TRAJECTORY == TRAJECTORY_SECTIONS
    assert not any(p.startswith("andrea/cuda") for p in stage_code(BY_NAME["tokenizer"]))


def test_train_12m_reaches_the_reports(scratch):
    rules = [j["rule"] for j in snakemake_jobs(scratch, "train_12m")]
    assert {"audit", "eval", "train", "warmup"} <= set(rules)
    assert [j["rule"] for j in snakemake_jobs(scratch, "checkpoint_12m")][-1] == "train"


def test_config_overrides_reach_every_command(scratch):
    jobs = snakemake_jobs(scratch, "train_120m", "--config", "hermes3={source: embedded}",
                          "model={d_model: 64, n_head: 2}")
    assert {j["rule"] for j in jobs} == set(BY_NAME)
    for job in jobs:
        assert "-S hermes3.source=embedded -S model.d_model=64 -S model.n_head=2" in job["cmd"], job["rule"]
        assert "hub" not in job["cmd"], f"rule {job['rule']} still reads the hub corpus"
    train = next(j for j in jobs if j["rule"] == "train")["cmd"]
    assert train.startswith("andrea train --profile andrea-120m ")
    # the same command line composes the config Snakemake validated: d_model 64 over the 120m profile
    cfg = load_config(ROOT / "params.yaml", "andrea-120m", ["hermes3.source=embedded", "model.d_model=64",
                                                             "model.n_head=2"])
    assert (cfg["model"]["d_model"], cfg["model"]["n_layer"], cfg["train"]["precision"]) == (64, 12, "bf16")


def test_configfile_overrides_keep_their_types(scratch):
    (scratch / "over.yaml").write_text("train: {lr: 1.0e-3, batch_size: 4}\ndiet: {sweep: [64, 128]}\n")
    jobs = snakemake_jobs(scratch, "all", "--configfile", "over.yaml")
    cmd = next(j for j in jobs if j["rule"] == "warmup")["cmd"]
    assert "-S train.lr=0.001 -S train.batch_size=4 -S 'diet.sweep=[64, 128]'" in cmd


def test_bad_override_stops_before_any_job(scratch):
    exe = Path(sys.executable).with_name("snakemake")
    for bad, msg in ((["train={lr: .nan}"], "train.lr: nan is not a finite number"),
                     (["model={d_model: big}"], "model.d_model:"),
                     (["profile=tiny"], "the target picks the variant")):
        r = subprocess.run([str(exe), "-n", "--cores", "1", "--config", *bad], cwd=scratch,
                           capture_output=True, text=True)
        assert r.returncode != 0 and msg in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "rule " not in r.stdout


def test_snakemake_refuses_a_gpu_profile_first(scratch):
    """No CuPy here: train_120m (bf16) and the fp32 12M recipe on `auto` stop at parse time with
    the install hint; `train.backend=numpy` lets the 12M recipe through (it is the user's call)."""
    pytest.importorskip("snakemake")
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed: nothing to refuse")
    except ImportError:
        pass
    exe = Path(sys.executable).with_name("snakemake")
    r = subprocess.run([str(exe), "--cores", "1", "train_120m"], cwd=scratch, capture_output=True, text=True)
    assert r.returncode == 3
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "train.precision=bf16" in lines[0] and "pip install -e '.[gpu-cuda13]'" in lines[0]
    r = subprocess.run([str(exe), "--cores", "1", "checkpoint_12m"], cwd=scratch, capture_output=True, text=True)
    assert r.returncode == 3 and "train.backend=auto" in r.stderr and "train.backend=numpy" in r.stderr
    assert not (scratch / "data/raw").exists() and not (scratch / "logs").exists(), "a job ran"
    r = subprocess.run([str(exe), "-n", "--cores", "1", "checkpoint_12m", "--config", "train={backend: numpy}"],
                       cwd=scratch, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _plots_page(scratch: Path) -> list[str]:
    """`dvc plots show -o out` in the scratch copy over small report CSVs; the tiny profile's sources."""
    dvc_stages(scratch, "tiny", "embedded")  # a DVC repo without git: the committed config, plus no_scm
    (scratch / ".dvc/config").write_text((ROOT / ".dvc/config").read_text().replace("[core]", "[core]\n    no_scm = true"))
    (scratch / "reports/tiny").mkdir(parents=True)
    (scratch / "reports/tiny/loss.csv").write_text("step,loss,smma\n1,7.0,\n2,6.5,6.8\n3,6.1,6.5\n")
    (scratch / "reports/tiny/val_loss.csv").write_text("step,val_loss\n2,6.9\n3,6.4\n")
    sources = R.config_sources(load_config(ROOT / "params.yaml", "tiny"))
    (scratch / "reports/tiny/val_per_source.csv").write_text(      # as the eval writes it: a column per source
        "step," + ",".join(sources) + "\n" + "".join(f"{s}," + ",".join(f"{5 + i / 10 - s}" for i in range(len(sources)))
                                               + "\n" for s in (1, 2, 3)))
    exe = Path(sys.executable).with_name("dvc")
    r = subprocess.run([str(exe), "plots", "show", "-o", "out"], cwd=scratch, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return sources


def test_dvc_plots_page_reads_offline(scratch):
    """`dvc plots show` uses workflow/plots.html (.dvc/config): no script from the network, the
    data inline, and a local stand-in for vegaEmbed that draws it."""
    _plots_page(scratch)
    page = (scratch / "out/index.html").read_text()
    assert "function vegaEmbed" in page and "in-training estimate" in page
    assert not re.search(r"<script[^>]+src=", page), "a script loaded from elsewhere"
    assert "cdn." not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert '"val_loss": "6.4"' in page or '"val_loss": 6.4' in page
    assert "held-out loss per source" in page and "smma" in page
    plots_html = (ROOT / "workflow/plots.html").read_text()
    assert f"var HUES = {json.dumps(list(R.HUES))};" in plots_html          # the copy of render.py's looks
    assert f"var DASHES = {json.dumps(list(R.DASHES))};" in plots_html


def test_dvc_plots_page_draws_each_source_in_its_look(scratch):
    """In a real chromium: the per-source plot draws the config's i-th source as render.style_at(i),
    the look eval.html and the dashboard give it; an empty cell (an old run's smma) is no point."""
    from selenium.webdriver.chrome.service import Service

    from test_dashboard import _browser_or_skip

    webdriver, chrome, driver_path = _browser_or_skip()
    sources = _plots_page(scratch)
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for a in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
              f"--user-data-dir={scratch / 'chromium-profile'}"):
        opts.add_argument(a)
    drv = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    try:
        drv.get((scratch / "out/index.html").as_uri())
        lines = {l.get_attribute("data-series"): l for l in drv.find_elements("css selector", "polyline")}
        for i, src in enumerate(sources):
            line = next(l for k, l in lines.items() if k.endswith(" · " + src))
            assert (line.get_attribute("stroke"), line.get_attribute("stroke-dasharray") or "") == R.style_at(i), src
        smma = next(l for k, l in lines.items() if k.endswith("smma"))
        assert len(smma.get_attribute("points").split()) == 2          # the empty cell drew nothing
    finally:
        drv.quit()


def test_a_kernel_edit_marks_the_training_stages_changed(scratch):
    """A real DVC lock (outputs faked, committed with `dvc commit`), then one line added to a .cu
    file: `dvc status` reports exactly the stages that run the CUDA code as changed."""
    stages = dvc_stages(scratch, "tiny", "embedded")
    for st in stages:
        for out in st["outs"]:
            p = scratch / out
            if p.suffix:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(f"{out}\n")
            else:
                p.mkdir(parents=True, exist_ok=True)
                (p / "part").write_text(f"{out}\n")
    exe = str(Path(sys.executable).with_name("dvc"))
    r = subprocess.run([exe, "commit", "-f", "-q"], cwd=scratch, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "up to date" in subprocess.run([exe, "status"], cwd=scratch, capture_output=True, text=True).stdout
    with open(scratch / "andrea/cuda/optim.cu", "a") as f:
        f.write("// a kernel edit\n")
    out = subprocess.run([exe, "status"], cwd=scratch, capture_output=True, text=True).stdout
    changed = set(re.findall(r"^(\w+):", out, re.M))
    assert changed == {"warmup", "train", "audit", "eval"}, out
