"""The LayerNorm backward's kernel choice, without a GPU: every width the rule gives a vector kernel
maps to a (V, R) that covers it and that layernorm.cu instantiates.

    pytest tests/test_cuda_layernorm_choice.py
"""

from __future__ import annotations

import re

from andrea.cuda import kernels
from andrea.cuda.loader import read_source


def test_the_built_set_is_what_layernorm_cu_instantiates():
    src = read_source("layernorm.cu")
    body = src[src.index("#define LN4_ALL"):src.index("LN4_ALL(f32, float)")]
    built = {(int(v), int(r)) for v, r in re.findall(r"LNB_INST\(SUF, T, (\d+), (\d+)\)", body)}
    assert built == set(kernels.LN_BWD_BUILT)


def test_every_width_up_to_3072_gets_a_built_kernel_that_covers_it_with_few_lanes_idle():
    for C in range(4, 3073, 4):
        V, R = kernels.ln_bwd_vr(C)
        assert (V, R) in kernels.LN_BWD_BUILT, C
        assert 32 * R * (V - 1) < C // 4 <= 32 * R * V, (C, V, R)     # no float4 column left over, no V too many
        assert V <= 3
    assert kernels.ln_bwd_vr(768) == (3, 2) and kernels.ln_bwd_vr(1536) == (3, 4)   # the H200 sweep's fastest
    assert kernels.ln_bwd_vr(3076) is None                                          # the scalar kernels
