"""workflow/cluster/check_run.py: the checks of a DAG run through SLURM, on made-up logs and trees."""

import json
from pathlib import Path

import pytest

from script_helpers import load_script

check_run = load_script("workflow/cluster/check_run.py")

LOG = """\
rule train:
    output: runs/tiny/main.done
    jobid: 6
    threads: 2
    resources: tmpdir=/tmp, runtime=12, gpu=0, mem_mb=799, mem=799 MB, mem_mib=762
Shell command: andrea train ...
Job 6 has been submitted with SLURM jobid 7 (log: x/7.log).
rule audit:
    jobid: 8
    resources: tmpdir=/tmp, runtime=13, gpu=0, mem_mb=522, mem=522 MB, mem_mib=498
Job 8 has been submitted with SLURM jobid 8 (log: x/8.log).
localrule all:
    jobid: 0
"""
SACCT = """JobID|JobName|State|ExitCode|NCPUS|Timelimit|Elapsed
7|uuid|COMPLETED|0:0|2|12|00:02:01
8|uuid|COMPLETED|0:0|1|13|00:00:09
"""
JOBCOMP = """JobId=7 UserId=root(0) Name=uuid JobState=COMPLETED Tres=cpu=2,mem=799M,node=1 X=1
JobId=8 UserId=root(0) Name=uuid JobState=COMPLETED Tres=cpu=1,mem=522M,node=1 X=1
"""


def test_a_clean_run_passes():
    problems, lines = check_run.check_jobs(LOG, SACCT, JOBCOMP)
    assert problems == [] and len(lines) == 2


def test_a_job_that_ran_outside_slurm_is_caught():
    log = LOG.replace("Job 8 has been submitted with SLURM jobid 8 (log: x/8.log).\n", "")
    problems, _ = check_run.check_jobs(log, SACCT, JOBCOMP)
    assert problems == ["audit: never submitted with sbatch"]


@pytest.mark.parametrize("sacct,jobcomp,want", [
    (SACCT.replace("7|uuid|COMPLETED|0:0", "7|uuid|FAILED|1:0"), JOBCOMP, "FAILED exit 1:0"),
    (SACCT.replace("|2|12|", "|1|12|"), JOBCOMP, "'cpus': 1"),
    (SACCT, JOBCOMP.replace("mem=799M", "mem=2048M"), "'mem_mb': 2048"),
    (SACCT.replace("|2|12|", "|2|01:00:00|"), JOBCOMP, "'runtime': 60"),
    (SACCT.replace("7|uuid", "70|uuid"), JOBCOMP, "SLURM job 7 is not in sacct -c"),
])
def test_what_slurm_did_must_match_what_the_rule_declared(sacct, jobcomp, want):
    problems, _ = check_run.check_jobs(LOG, sacct, jobcomp)
    assert len(problems) == 1 and want in problems[0] and problems[0].startswith("train:")


def test_memory_in_slurms_units():
    log = LOG.replace("mem_mb=799,", "mem_mb=2048,")
    problems, _ = check_run.check_jobs(log, SACCT, JOBCOMP.replace("mem=799M", "mem=2G"))
    assert problems == []


def test_time_limits_in_every_slurm_format():
    assert [check_run.minutes(s) for s in ("15", "01:30:00", "1-00:00:00", "00:10:30")] == [15, 90, 1440, 11]


def _tree(root: Path, state_time: float, weights: bytes) -> Path:
    (root / "runs/tiny/main").mkdir(parents=True)
    (root / "data/embedded").mkdir(parents=True)
    (root / "reports/tiny").mkdir(parents=True)
    (root / "runs/tiny/main/model.bin").write_bytes(weights)
    (root / "runs/tiny/main/model.state.json").write_text(json.dumps({"step": 600, "time": state_time}))
    (root / "data/embedded/only-here.parquet").write_bytes(b"checked-in input, not an output")
    (root / "reports/tiny/eval.md").write_text(f"# eval\nval loss 3.92\n| median tokens/s | {state_time:.1f} |\n")
    (root / "reports/tiny/eval.html").write_text(
        f"<td>held-out loss</td><td>3.92</td><td>median tokens/s</td><td>{state_time:.1f}</td>"
        f"<section><h2>Throughput</h2><svg>{state_time}</svg></section><p>end</p>")
    return root


def test_outputs_equal_but_for_wall_clock_fields(tmp_path):
    a, b = _tree(tmp_path / "a", 1.0, b"w" * 8), _tree(tmp_path / "b", 2.0, b"w" * 8)
    (a / "data/embedded/extra").write_text("inputs are not compared")
    problems, lines = check_run.check_outputs(a, b)
    assert problems == [] and "1 files byte-identical, 3 identical but for wall-clock fields, of 4" in lines[0]


def test_the_wall_clock_sidecar_is_not_an_output(tmp_path):
    a, b = _tree(tmp_path / "a", 1.0, b"w" * 8), _tree(tmp_path / "b", 1.0, b"w" * 8)
    (a / "runs/tiny/main/model.perf.jsonl").write_text('{"step": 0, "time": 1.0, "tokens_per_s": 10.0}\n')
    (b / "runs/tiny/main/model.perf.jsonl").write_text('{"step": 0, "time": 2.0, "tokens_per_s": 12.0}\n')
    problems, lines = check_run.check_outputs(a, b)
    assert problems == [] and "of 4" in lines[0]


def test_different_weights_or_a_missing_file_fail(tmp_path):
    a, b = _tree(tmp_path / "a", 1.0, b"w" * 8), _tree(tmp_path / "b", 1.0, b"v" * 8)
    (b / "reports/tiny/eval.md").write_text("# eval\nval loss 3.95\n")
    (b / "reports/tiny/eval.html").write_text((a / "reports/tiny/eval.html").read_text().replace("3.92", "3.95"))
    (a / "runs/tiny/main/model.loss.json").write_text("{}")
    problems, _ = check_run.check_outputs(a, b)
    assert [p.split(":")[0] for p in problems] == ["runs/tiny/main/model.loss.json", "reports/tiny/eval.html",
                                                    "reports/tiny/eval.md", "runs/tiny/main/model.bin"]
