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


def _cuobjdump_ok() -> bool:
    try:
        loader._cuobjdump()
        return True
    except AndreaError:
        return False


@pytest.mark.skipif(not (_nvrtc_ok() and _cuobjdump_ok()),
                    reason="cuda-bindings / nvidia-cuda-nvrtc / nvidia-cuda-cuobjdump not installed")
def test_resource_usage_reports_registers_and_the_stack_bytes_of_a_local_array(monkeypatch, capsys):
    src = ('#line 1 "andrea/cuda/res.cu"\n'
           'extern "C" __global__ void k_plain(float* x) { x[threadIdx.x] *= 2.0f; }\n'
           'extern "C" __global__ void k_local(float* x, int i) {\n'
           '    float a[64];\n'
           '    for (int j = 0; j < 64; ++j) a[j] = x[j];\n'
           '    a[i & 63] += 1.0f;  // run-time indices: the array lives in local memory\n'
           '    for (int j = 0; j < 64; ++j) x[j] = a[(j * i) & 63];\n'
           '}\n')
    monkeypatch.setattr(loader, "read_source", lambda f, defines=(): src)
    got = loader.resource_usage("res.cu")
    assert set(got) == {"k_plain", "k_local"}
    assert got["k_plain"]["stack"] == 0 and 0 < got["k_plain"]["registers"] <= 32
    assert got["k_local"]["stack"] == 256                        # 64 floats in the stack frame
    assert loader.main(["--resources", "--match", "local", "res.cu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "andrea/cuda/res.cu: ok" and len(out) == 2 and out[1].startswith("  k_local: ")
    assert "256 B stack" in out[1]


def test_resources_without_cuobjdump_and_a_bad_define_are_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(loader.shutil, "which", lambda name: None)
    monkeypatch.setattr(loader.sys, "path", [])
    with pytest.raises(AndreaError, match="pip install nvidia-cuda-cuobjdump"):
        loader._cuobjdump()
    assert loader.main(["--define", "9X", "embed.cu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kernel define '9X'" in err[0]
