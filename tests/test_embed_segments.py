"""embed_segments, the host side of the GPU engine's deterministic embedding backward (pure NumPy,
no GPU): the 16-bit radix-sort path and the int32 path give the stable token-id order."""
import numpy as np
import pytest

from andrea.cuda.kernels import embed_segments


def reference(x):
    flat = x.reshape(-1).astype(np.int64)
    order = sorted(range(flat.size), key=lambda i: (flat[i], i))   # stable by construction
    s = flat[order]
    starts = [i for i in range(s.size) if i == 0 or s[i] != s[i - 1]]
    return np.array(order), np.array(starts), s[starts]


@pytest.mark.parametrize("V", [7, 4353, 65536, 70000])   # 70000: ids past 16 bits, the int32 sort
def test_embed_segments_is_the_stable_token_order(V):
    x = np.random.default_rng(V).integers(0, V, (4, 300)).astype(np.int32)
    if V > 65536:
        x[0, :5] = [65535, 65536, 69999, 65536, 0]    # ids on both sides of 2**16 in one batch
    order, seg_start, seg_tok, n_seg = embed_segments(x)
    ro, rs, rt = reference(x)
    N, n = x.size, rs.size
    assert order.dtype == seg_start.dtype == seg_tok.dtype == np.int32
    assert (order == ro).all()
    assert int(n_seg[0]) == n
    assert (seg_start[:n] == rs).all() and (seg_start[n:] == N).all() and seg_start.size == N + 1
    assert (seg_tok[:n] == rt).all() and (seg_tok[n:] == 0).all()
