"""What a user of the package expects: a LICENSE matching pyproject's, `andrea --version`,
declared dependencies that match the imports, and --help texts that fit a screen.

    pytest tests/test_packaging.py
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from andrea import __version__
from andrea.cli import COMMANDS

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# import name -> distribution name, where they differ
DIST = {"yaml": "pyyaml", "hydra": "hydra-core"}
# declared for the front ends and their tooling, not imported by the andrea package
TOOLS = {"snakemake", "dvc", "hydra-core"}
# optional: imported only where their extra is installed (gpu, oracle), guarded by ImportError
OPTIONAL = {"cupy", "torch", "tokenizers", "transformers",  # transformers: the shipped HF tokenizer (oracle)
            "mpi4py",  # mpi4py: shares NCCL's id under mpirun (andrea/dist.py), else a file
            "cuda",  # cuda-bindings: NVRTC for the GPU-less compile check (python -m andrea.cuda.loader)
            "cudnn"}  # nvidia-cudnn-frontend (gpu extras): cuDNN's attention (andrea/cuda/cudnn_attention.py)


def test_license_matches_pyproject():
    assert PYPROJECT["project"]["license"] == {"text": "MIT"}
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_version():
    r = subprocess.run([sys.executable, "-m", "andrea", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == f"andrea {__version__}"
    assert __version__ == PYPROJECT["project"]["version"]


def third_party_imports() -> set[str]:
    stdlib = set(sys.stdlib_module_names)
    found = set()
    for path in (ROOT / "andrea").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            found.update(n.split(".")[0] for n in names)
    return {n for n in found if n not in stdlib and n != "andrea"}


def test_declared_dependencies_match_the_imports():
    declared = {re.split(r"[<>=\[ ]", d, maxsplit=1)[0].lower() for d in PYPROJECT["project"]["dependencies"]}
    imported = {DIST.get(n, n).lower() for n in third_party_imports()} - OPTIONAL
    assert imported <= declared, f"imported but not declared: {sorted(imported - declared)}"
    assert declared - TOOLS <= imported, f"declared but never imported: {sorted(declared - TOOLS - imported)}"


@pytest.mark.parametrize("stage", sorted(COMMANDS))
def test_stage_help_fits_a_screen(stage):
    r = subprocess.run([sys.executable, "-m", "andrea", stage, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) <= 50, f"andrea {stage} --help: {len(lines)} lines"
    assert not any(re.match(r"\s*(from \w+ import|import \w+|>>>)", ln) for ln in lines), "API code in --help"
