"""The tiny DAG on a real one-node SLURM cluster (workflow/cluster/slurm_local.sh), and a
training job preempted by SLURM that resumes from its checkpoint when resubmitted.

    pip install -e '.[test,slurm]' && pytest -m slow tests/test_slurm_cluster.py   # as root

Runs where the machine allows it (root, apt-get or slurm-wlm already installed, the SLURM
executor plugin installed, no SLURM configuration of its own); otherwise it skips and says
why, including the line the script printed when a sandbox stopped munged, slurmctld or slurmd.
"""

import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "workflow" / "cluster" / "slurm_local.sh"


def _cannot_run() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root: it installs slurm-wlm and starts slurmctld/slurmd"
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        return "snakemake-executor-plugin-slurm is not installed (pip install -e '.[slurm]')"
    for tool in ("git", "snakemake", "andrea"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    if shutil.which("slurmd") is None and shutil.which("apt-get") is None:
        return "slurm-wlm is not installed and there is no apt-get to install it"
    if Path("/etc/slurm/slurm.conf").exists() and "slurm_local.sh" not in Path("/etc/slurm/slurm.conf").read_text():
        return "/etc/slurm/slurm.conf exists: this machine has a SLURM setup of its own; not touching it"
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode != 0:
        return f"{ROOT} is not a git work tree (the script copies the tracked files)"
    return None


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tiny_dag_through_slurm_and_a_preempted_training_resumes():
    why = _cannot_run()
    if why:
        pytest.skip(why)
    state = tempfile.mkdtemp(prefix="andrea-slurm-", dir="/tmp")  # short: the munge socket path has a limit
    passed = False
    try:
        out = subprocess.run(["bash", str(SCRIPT), "all"], env={**os.environ, "ANDREA_SLURM_STATE": state},
                             capture_output=True, text=True, timeout=1700)
        log = out.stdout + out.stderr
        print(log)  # the figures (run times, jobs, preemption) show with pytest -rA or -s
        if out.returncode == 77:
            passed = True
            pytest.skip(next((ln for ln in log.splitlines() if ln.startswith("SKIP:")), "SKIP: (no reason printed)"))
        assert out.returncode == 0, log[-6000:]
        assert "PASS" in log
        assert "problem:" not in log
        assert "resumed model.bin == the DAG's uninterrupted" in log
        passed = True
    finally:
        subprocess.run(["bash", str(SCRIPT), "down"], env={**os.environ, "ANDREA_SLURM_STATE": state},
                       capture_output=True, timeout=120)
        if passed:
            shutil.rmtree(state, ignore_errors=True)
        else:  # the logs, both copies of the tree and sacct's records, for a look
            print(f"kept {state}")


def test_the_reasons_to_skip_are_named(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert _cannot_run() == "needs root: it installs slurm-wlm and starts slurmctld/slurmd"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "pip install -e '.[slurm]'" in _cannot_run()


def test_the_script_skips_with_exit_77_when_not_root(tmp_path):
    """The script's own guard, run as an unprivileged user where the machine has one."""
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to drop to another uid")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", str(SCRIPT), "up"],
                         env={**os.environ, "ANDREA_SLURM_STATE": str(tmp_path / "s")}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 77, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == "SKIP: needs root (installs packages, starts slurmctld/slurmd as root), uid is 65534"
