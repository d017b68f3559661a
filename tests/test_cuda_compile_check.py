"""The GPU-less compile check of the kernels (``python -m andrea.cuda.loader``).

    pytest tests/test_cuda_compile_check.py

With cuda-bindings + nvidia-cuda-nvrtc installed, NVRTC compiles a shipped kernel file and reports
a broken one with its file and line; without them the check says in one line what to install.
"""

from __future__ import annotations

import sys

import pytest

from andrea.cuda import loader
from andrea.errors import AndreaError


def _nvrtc_ok() -> bool:
    try:
        from cuda.bindings import nvrtc

        return nvrtc.nvrtcVersion()[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
    except Exception:  # ImportError, or the NVRTC library missing
        return False


def test_without_cuda_bindings_the_check_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(AndreaError, match="pip install cuda-bindings nvidia-cuda-nvrtc"):
        loader.compile_log("embed.cu")
    assert loader.main(["embed.cu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cuda-bindings is not installed" in err[0]


def test_every_shipped_kernel_file_is_found():
    files = loader.kernel_files()
    assert {"attention.cu", "embed.cu", "fp8.cu", "optim.cu"} <= set(files) and "common.cuh" not in files


@pytest.mark.skipif(not _nvrtc_ok(), reason="cuda-bindings / nvidia-cuda-nvrtc not installed")
def test_nvrtc_compiles_a_kernel_file_and_names_the_line_of_a_broken_one(monkeypatch, capsys):
    assert loader.compile_log("embed.cu") is None
    real = loader.read_source
    bad = '\n#line 7 "andrea/cuda/bad.cu"\nextern "C" __global__ void k_bad(float* x) { x[0] = undefined_name; }\n'
    monkeypatch.setattr(loader, "read_source", lambda f, defines=(): real("embed.cu") + bad)
    log = loader.compile_log("bad.cu")
    assert log is not None and "andrea/cuda/bad.cu(7)" in log and "undefined_name" in log
    assert loader.main(["bad.cu"]) == 1
    assert "andrea/cuda/bad.cu: FAILED" in capsys.readouterr().out


def test_the_wgmma_file_targets_sm_90a_only_on_a_compute_capability_9_device():
    # CuPy appends its own -arch=sm_90 after these options; NVRTC keeps the first, so on an H100/H200
    # attention.cu is built for sm_90a (wgmma) and every other file, or device, keeps the plain target
    assert loader.options("attention.cu", "90")[0] == "-arch=sm_90a"
    assert not any("arch" in o for o in loader.options("attention.cu", "80"))
    assert not any("arch" in o for o in loader.options("layernorm.cu", "90"))
