"""The GPU benches run as scripts where they cannot run (bench/engine_gpu.py's exit_gpu_main): an AndreaError,
a missing cupy or torch, and CuPy finding no device are one line and exit 2; anything else keeps its traceback.

    python -m pytest -q tests/test_bench_gpu_cli.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from script_helpers import load_script

from andrea.errors import AndreaError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def eg():
    return load_script("bench/engine_gpu.py")


def _exit(eg, main):
    with pytest.raises(SystemExit) as e:
        eg.exit_gpu_main(main, "tool")
    return e.value.code


def test_a_return_value_is_the_exit_code_and_an_andrea_error_one_line(eg, capsys):
    assert _exit(eg, lambda: 0) == 0
    assert _exit(eg, lambda: 3) == 3

    def bad():
        raise AndreaError("--variants andrea-9m: no such profile")
    assert _exit(eg, bad) == 2
    assert capsys.readouterr().err == "tool: error: --variants andrea-9m: no such profile\n"


def test_missing_cupy_or_torch_is_one_line_and_any_other_module_goes_through(eg, capsys):
    def needs(name):
        def main():
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return main
    assert _exit(eg, needs("cupy.cuda")) == 2
    err = capsys.readouterr().err
    assert err.startswith("tool: error: needs cupy, which this Python cannot import") and err.count("\n") == 1
    assert err.rstrip().endswith("and a CUDA GPU is")
    assert _exit(eg, needs("torch")) == 2
    assert capsys.readouterr().err.rstrip().endswith("run it where torch is installed")
    with pytest.raises(ModuleNotFoundError):         # a module the benches do not need: a bug, with its traceback
        eg.exit_gpu_main(needs("yaml"), "tool")


class CUDARuntimeError(RuntimeError):
    """Named as CuPy's (cupy_backends.cuda.api.runtime.CUDARuntimeError)."""


def test_cupy_finding_no_device_is_one_line_and_other_cuda_errors_go_through(eg, capsys):
    def no_device():
        raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    def crash():
        raise CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    assert _exit(eg, no_device) == 2
    assert capsys.readouterr().err.startswith("tool: error: CuPy finds no usable CUDA device (cudaErrorNoDevice")
    with pytest.raises(CUDARuntimeError):
        eg.exit_gpu_main(crash, "tool")


@pytest.mark.parametrize("bench,args", [("engine_gpu.py", []), ("engine_ab.py", ["--flip", "STREAM_PRIORITY=True"]),
                                        ("lt_algos.py", []), ("kernel_profile.py", []), ("optim_gpu.py", []),
                                        ("multi_gpu.py", ["--out", "OUT"])])
def test_a_gpu_bench_without_cupy_says_so_in_one_line(bench, args, tmp_path):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is importable here: the benches would run")
    except ImportError:
        pass
    args = [str(tmp_path) if a == "OUT" else a for a in args]
    out = subprocess.run([sys.executable, str(ROOT / "bench" / bench), *args], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"{bench[:-3]}: error: needs cupy, which this Python cannot import "
                                                f"(No module named 'cupy'); run it where cupy is installed and a "
                                                f"CUDA GPU is"]
    assert not any(tmp_path.iterdir())               # multi_gpu: refused before it built any data
