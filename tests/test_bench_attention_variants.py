"""bench/attention_variants.py without a GPU: a variant's #defines go first in the compiled text, a
malformed variant is refused in one line, the rounds alternate their order, and outputs are compared
bit for bit.

    pytest tests/test_bench_attention_variants.py

Nothing here times a kernel; the GPU half of the script runs only on the device.
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from andrea.cuda import loader
from andrea.errors import AndreaError
from script_helpers import load_script


def test_defines_go_first_and_the_plain_text_is_unchanged():
    plain = loader.read_source("attention.cu")
    got = loader.read_source("attention.cu", ("ATTN_EX2_FTZ", "ATTN_DKVS_MINB=3"))
    assert got == "#define ATTN_EX2_FTZ\n#define ATTN_DKVS_MINB 3\n" + plain
    assert plain.startswith('#line 1 "andrea/cuda/common.cuh"')      # the cached build's text as before


def test_the_loader_builds_once_and_swap_replaces_the_module_it_hands_out(monkeypatch):
    """loader.module / build / swap / kernel over a stand-in cupy (no GPU): one compile per file with the
    loader's options, a variant's text with its defines first, and kernel() taking the swapped module."""
    built = []

    class RawModule:
        def __init__(self, code, options, backend):
            built.append((code, options, backend))
            self.code = code

        def compile(self):
            pass

        def get_function(self, name):
            return self, name

    cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(compute_capability="90"),
                                 compiler=types.SimpleNamespace(CompileException=RuntimeError))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=RawModule, cuda=cuda))
    monkeypatch.setattr(loader, "_modules", {})
    plain = loader.module("attention.cu")
    assert loader.module("attention.cu") is plain
    assert built == [(loader.read_source("attention.cu"), loader.options("attention.cu", "90"), "nvrtc")]
    assert loader.options("attention.cu", "90")[0] == "-arch=sm_90a"
    variant = loader.build("attention.cu", ("ATTN_DS_LATE",))
    assert variant.code.startswith("#define ATTN_DS_LATE\n#line 1") and len(built) == 2
    assert loader.swap("attention.cu", variant) is plain
    assert loader.kernel("attention.cu", "k_x") == (variant, "k_x")
    assert loader.swap("attention.cu", plain) is variant and len(built) == 2


@pytest.mark.parametrize("bad", ["1X", "A-B=2", "X=1\n#include <x>", ""])
def test_a_malformed_define_is_refused(bad):
    with pytest.raises(AndreaError, match="expected NAME or NAME=VALUE"):
        loader.define_lines((bad,))


def test_variants_parse_and_bad_ones_exit_with_one_line(capsys, monkeypatch):
    av = load_script("bench/attention_variants.py")
    assert av.parse_variant("late=ATTN_DS_LATE,ATTN_DKVS_MINB=3") == ("late", ("ATTN_DS_LATE", "ATTN_DKVS_MINB=3"))
    for bad in ("late", "base=X", "=X", "v=", "v=9X"):
        with pytest.raises(AndreaError):
            av.parse_variant(bad)
    assert av.main(["--variant", "nodefs"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --variant 'nodefs'") and "\n" not in err
    assert av.main(["--variant", "v=X", "--shapes", "andrea-7b"]) == 2
    assert "andrea-7b: not in" in capsys.readouterr().err
    monkeypatch.setattr("andrea.cuda.loader.cupy_or_none", lambda: None)
    assert av.main(["--variant", "v=X"]) == 2
    assert capsys.readouterr().err.strip() == ("error: attention variants: needs CuPy and a CUDA device "
                                               "(pip install -e '.[gpu]')")


def test_rounds_alternate():
    av = load_script("bench/attention_variants.py")
    assert [av.round_order(["base", "a", "b"], r) for r in range(3)] == [["base", "a", "b"], ["b", "a", "base"],
                                                                          ["base", "a", "b"]]


def test_outputs_are_compared_bit_for_bit():
    av = load_script("bench/attention_variants.py")
    bf = np.array([0x3F80, 0x4000, 0x7FC0], dtype=np.uint16)            # 1, 2, NaN in bf16
    assert av.compare(bf, bf.copy(), np) == "same bytes"                 # NaN against the same NaN bits
    moved = bf.copy()
    moved[1] = 0x4001                                                    # 2 -> the next bf16 up
    assert av.compare(moved, bf, np) == "1 elements differ, max |diff| = 7.81e-03 of max |value|"
    f32 = np.array([0.0, -0.0], dtype=np.float32)
    assert av.compare(f32[::-1].copy(), f32, np).startswith("2 elements differ")   # -0 is not +0 in bytes


@pytest.mark.gpu
def test_an_unused_define_builds_the_same_bytes_on_the_device(tmp_path):
    from andrea.cuda.loader import cupy_or_none

    if cupy_or_none() is None:
        pytest.skip("needs CuPy and a CUDA device")
    av = load_script("bench/attention_variants.py")
    out = tmp_path / "av.json"
    assert av.main(["--variant", "same=ATTN_UNUSED_SWITCH=1", "--shapes", "andrea-12m", "--rounds", "2",
                    "--reps", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())["andrea-12m:B8"]
    assert got["same"]["outputs"] == {"y": "same bytes", "lse2": "same bytes", "dqkv": "same bytes"}
    assert len(got["same"]["fwd_ms"]) == len(got["base"]["bwd_ms"]) == 2


def test_a_variant_compiles_with_nvrtc_when_it_is_installed():
    pytest.importorskip("cuda.bindings.nvrtc")
    assert loader.compile_log("attention.cu", "sm_90a", ("ATTN_SOME_UNUSED_SWITCH=1",)) is None
    log = loader.compile_log("attention.cu", "sm_90a", ("float=int",))   # a define that breaks the file
    assert log is not None
