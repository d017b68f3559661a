"""Benchmark: the MLP's GELU fused into cuBLASLt's epilogues against the separate passes, one layer.

    PYTHONPATH=. python3 bench/gelu_epilogue.py --variants andrea-12m:8 andrea-120m:32 andrea-480m:8

For each shape (N = B T rows, C, F = 4C), bf16, ms per call (CUDA events, the median of 5 windows of
``--reps`` calls, each after one untimed call) of:
- fwd separate: the fc GEMM (N x F, K = C) writing h_pre, then k_gelu_fwd writing h_act;
- fwd fused:    one GEMM with CUBLASLT_EPILOGUE_GELU_AUX writing h_act and its aux h_pre;
- bwd separate: the proj dgrad GEMM (N x F, K = C) writing dh, then k_gelu_bwd in place;
- bwd fused:    one GEMM with CUBLASLT_EPILOGUE_DGELU reading the aux h_pre;
- recompute:    k_gelu_fwd alone (what the backward pays per layer when h_act is not kept);
then the largest |fused - separate| of h_act and dh (bf16 values). Figures: docs/bench/gelu_epilogue_h200.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_gpu import event_ms, exit_gpu_main, parse_variants, variant_shapes  # noqa: E402


def bf16_host(a) -> np.ndarray:
    import cupy as cp

    return (cp.asnumpy(a).astype(np.uint32) << 16).view(np.float32)


def timed(fn, reps: int) -> float:
    """ms per call: the median of 5 ``event_ms`` windows of ``reps`` calls."""
    return float(np.median([event_ms(fn, reps) for _ in range(5)]))


def one(N: int, C: int, reps: int) -> dict:
    import cupy as cp

    from andrea.cuda.cublaslt import CUDA_R_16BF, EPILOGUE_DGELU, EPILOGUE_GELU_AUX, Lt
    from andrea.cuda.kernels import k_gelu_bwd, k_gelu_fwd

    F = 4 * C
    rng = cp.random.default_rng(0)
    bf = lambda shape, std: ((rng.standard_normal(shape, dtype=cp.float32) * std).view(cp.uint32) >> 16).astype(cp.uint16)
    x, w_fc, dout, w_proj = bf((N, C), 1.0), bf((C, F), 1 / C ** 0.5), bf((N, C), 1.0), bf((F, C), 1 / C ** 0.5)
    h_pre, h_act, h_pre2, h_act2, dh, dh2 = (cp.empty((N, F), cp.uint16) for _ in range(6))
    lt = Lt(cp.zeros(32 << 20, dtype=cp.uint8))
    st = lambda: cp.cuda.get_current_stream().ptr
    mm = lambda *a, **k: lt.mm(*a, lowtype=CUDA_R_16BF, stream=st(), **k)

    def fwd_sep():
        mm(h_pre, x, w_fc)
        k_gelu_fwd("bf16", h_act, h_pre, N * F)

    fwd_fused = lambda: mm(h_act2, x, w_fc, epilogue=EPILOGUE_GELU_AUX, aux=h_pre2)

    def bwd_sep():
        mm(dh, dout, w_proj, tb=True)
        k_gelu_bwd("bf16", dh, dh, h_pre, N * F)

    bwd_fused = lambda: mm(dh2, dout, w_proj, tb=True, epilogue=EPILOGUE_DGELU, aux=h_pre2)
    res = {"fwd separate": timed(fwd_sep, reps), "fwd fused": timed(fwd_fused, reps),
           "bwd separate": timed(bwd_sep, reps), "bwd fused": timed(bwd_fused, reps),
           "recompute": timed(lambda: k_gelu_fwd("bf16", h_act, h_pre, N * F), reps)}
    fwd_sep(), fwd_fused(), bwd_sep(), bwd_fused()
    cp.cuda.Device().synchronize()
    res["max |h_act fused - separate|"] = float(np.abs(bf16_host(h_act2) - bf16_host(h_act)).max())
    res["max |dh fused - separate|"] = float(np.abs(bf16_host(dh2) - bf16_host(dh)).max())
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["andrea-12m:8", "andrea-120m:32", "andrea-480m:8"])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    for v, B in parse_variants(args.variants, 8):
        s = variant_shapes(v)
        r = one(B * s["T"], s["C"], args.reps)
        L = s["L"]
        print(f"{v}:B{B} (N={B * s['T']}, C={s['C']}, L={L}), ms per layer: " + "; ".join(
            f"{k} {x:.3f}" if not k.startswith("max") else f"{k} {x:.3g}" for k, x in r.items()))
        saved = (r["fwd separate"] - r["fwd fused"] + r["bwd separate"] - r["bwd fused"]) * L
        print(f"  per step (x L): fused saves {saved:.2f} ms; keeping h_act saves another {r['recompute'] * L:.2f} ms")
    return 0


if __name__ == "__main__":
    exit_gpu_main(main, "gelu_epilogue")
