"""andrea.errors.exit_main: what a script run on its own prints instead of a traceback (an AndreaError; for
the GPU benches, a missing CuPy or torch, or CuPy finding no device), and what it lets through.

    python -m pytest -q tests/test_errors.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from andrea.errors import AndreaError, exit_main

ROOT = Path(__file__).resolve().parents[1]


def _exit(main, **kw):
    with pytest.raises(SystemExit) as e:
        exit_main(main, "tool", **kw)
    return e.value.code


def test_a_return_value_is_the_exit_code_and_an_andrea_error_one_line(capsys):
    assert _exit(lambda: 0) == 0
    assert _exit(lambda: 3) == 3

    def bad():
        raise AndreaError("data/x.csv row 4: key 'lr' is not a number")
    assert _exit(bad) == 2
    assert capsys.readouterr().err == "tool: error: data/x.csv row 4: key 'lr' is not a number\n"


def test_a_missing_library_the_script_needs_is_one_line_and_any_other_goes_through(capsys):
    def needs_cupy():
        import cupy_is_not_here.cuda  # noqa: F401 - stands for cupy where it is absent
    assert _exit(needs_cupy, needs=("cupy_is_not_here",)) == 2
    err = capsys.readouterr().err
    assert err.startswith("tool: error: needs cupy_is_not_here, which this Python cannot import") and err.count("\n") == 1
    with pytest.raises(ModuleNotFoundError):         # not one of needs: a bug, with its traceback
        exit_main(needs_cupy, "tool", needs=("torch",))


class CUDARuntimeError(RuntimeError):
    """Named as CuPy's (cupy_backends.cuda.api.runtime.CUDARuntimeError)."""


def test_cupy_finding_no_device_is_one_line_and_other_cuda_errors_go_through(capsys):
    def no_device():
        raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    def crash():
        raise CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    assert _exit(no_device, needs=("cupy",)) == 2
    assert capsys.readouterr().err.startswith("tool: error: CuPy finds no usable CUDA device (cudaErrorNoDevice")
    with pytest.raises(CUDARuntimeError):
        exit_main(crash, "tool", needs=("cupy",))
    with pytest.raises(CUDARuntimeError):            # a script that does not run on CuPy: its own error
        exit_main(no_device, "tool")


@pytest.mark.parametrize("bench,args", [("engine_gpu.py", []), ("engine_ab.py", ["--flip", "STREAM_PRIORITY=True"]),
                                        ("lt_algos.py", []), ("kernel_profile.py", [])])
def test_a_gpu_bench_without_cupy_says_so_in_one_line(bench, args):
    pytest.importorskip("yaml")
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is importable here: the benches would run")
    except ImportError:
        pass
    out = subprocess.run([sys.executable, str(ROOT / "bench" / bench), *args], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"{bench[:-3]}: error: needs cupy, which this Python cannot import "
                                                f"(No module named 'cupy'); run it where cupy is installed and a "
                                                f"CUDA GPU is"]
