"""bench/device_queue.sh, run here with stand-ins for the device's python3, pip and nvidia-smi on PATH: the jobs
run in order under one deadline (a job past it is stopped, the next skipped), and everything comes back as one
tarball in $OUT, the kept inductor tuning included; with REQUIRE_CARD naming another card nothing runs."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$*" in
  *"import jsonschema"*) exit 0 ;;
  *"import torch, cupy"*) echo "torch T cupy C" ;;
  *engine_gpu.py*)
    while [ $# -gt 0 ]; do case $1 in --json) json=$2; shift ;; --variants) v=$2; shift ;; esac; shift; done
    echo "$v" > "$json"
    echo "$v ours | best=compile-max-autotune: 1.12x (paired windows 1.12x)"
    case $v in *slow*) sleep 30 ;; esac ;;
  *inductor_seed.py*) mkdir -p "$3" && echo '{"system": {}}' > "$3/inductor_autotune_h100.json" ;;
  *) echo "unexpected python3 $*" >&2; exit 9 ;;
esac
"""


def _stand_ins(tmp_path, calls=None):
    """bin/ with the stand-ins (python3 also appends its arguments to ``calls`` when given), out/, and the env."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    py = FAKE_PYTHON if calls is None else FAKE_PYTHON.replace("case \"$*\" in", f'echo "$*" >> {calls}\ncase "$*" in', 1)
    for name, body in (("python3", py), ("pip", "#!/usr/bin/env bash\nexit 0\n"),
                       ("nvidia-smi", "#!/usr/bin/env bash\necho 'NVIDIA H100 80GB HBM3, 580, 700.00 W, 1980 MHz'\n")):
        (bin_ / name).write_text(body)
        (bin_ / name).chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    return out, {"PATH": f"{bin_}:/usr/bin:/bin", "OUT": str(out), "QUEUE_DIR": str(tmp_path / "q"), "MIN_JOB_S": "1"}


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_jobs_run_under_one_deadline_and_come_back_as_one_tarball(tmp_path):
    out, env = _stand_ins(tmp_path)
    env["REQUIRE_CARD"] = "H100"                                            # the card it gets: runs as without
    r = subprocess.run(["bash", str(ROOT / "bench/device_queue.sh"), "c1", "3", "andrea-12m:8@fast",
                        "slow-480m:16@slow", "andrea-120m:32@late"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "NVIDIA H100 80GB HBM3, 580, 700.00 W, 1980 MHz" and lines[1] == "torch T cupy C"
    assert any(ln.startswith("fast: rc=0 at") for ln in lines)
    assert any(ln.startswith("slow: rc=124 at") for ln in lines)           # stopped at the deadline
    assert any(ln.startswith("late: skipped,") for ln in lines)
    assert "best=compile-max-autotune: 1.12x" in r.stdout
    assert [p.name for p in out.iterdir()] == ["c1.tgz"]
    with tarfile.open(out / "c1.tgz") as t:
        names = sorted(m.name.removeprefix("./") for m in t.getmembers() if m.isfile())
        assert t.extractfile("./fast.json").read().decode().strip() == "andrea-12m:8"
    assert names == ["fast.json", "fast.log", "kept/inductor_autotune_h100.json", "slow.json", "slow.log"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_another_card_than_required_runs_nothing(tmp_path):
    calls = tmp_path / "calls.txt"
    out, env = _stand_ins(tmp_path, calls)
    env["REQUIRE_CARD"] = "H200"
    r = subprocess.run(["bash", str(ROOT / "bench/device_queue.sh"), "c1", "60", "andrea-480m:8@m8r1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["NVIDIA H100 80GB HBM3, 580, 700.00 W, 1980 MHz is not the card REQUIRE_CARD "
                                     "names (H200): nothing run"]
    assert not calls.exists() and list(out.iterdir()) == []
