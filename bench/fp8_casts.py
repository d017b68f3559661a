"""Benchmark: the fp8 engine's E4M3 casts alone on the GPU, ms and GB/s of the bytes each must move,
beside a device copy of the same bf16 tensor (the bandwidth anchor), same run.

    PYTHONPATH=. python3 bench/fp8_casts.py --variants andrea-120m:32 andrea-480m:8 --json out.json

For each shape the engine casts in a step (N = B T rows; C, 3C, 4C columns), delayed scaling (a
given scale, the amax atomicMax-ed), ms per call (CUDA events, the median of 5 windows of ``--reps``
calls after one untimed call) of:
- copy:       cupy's device copy of the bf16 (N, cols) tensor (reads 2, writes 2 bytes an element);
- both K:     the transposing cast writing the natural and the transposed E4M3 copies (2 + 1 + 1), with
              each kernel K of fp8.CAST_T: smem (k_fp8_cast_t_bf16) and warp (k_fp8_cast_t_w_bf16);
- dgelu K:    the same over dL/dh_act and h_pre (k_fp8_dgelu_cast_t*: 2 + 2 + 1 + 1), 4C columns only;
- flat:       k_fp8_cast_bf16, the natural copy only (2 + 1);
- transpose:  k_fp8_t_u8, the byte transpose of that E4M3 copy (1 + 1; the kept transpose of a tensor its
              producer wrote in E4M3: the shared-memory kernel where cols % 256 == 0, else the per-warp one);
and, once per variant, the two-launch weight casts (k_fp8_wamax + k_fp8_wcast: 2 + 2 + 1 + 1) against
the weight-by-weight casts. Before any timing every kernel's output is checked against the NumPy twin
(andrea/engine/fp8_numpy.py) on the first 64 rows: bit-exact. The ratio column is the cast's GB/s over
the copy's: 1.0 is as fast as moving the same bytes can be here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_gpu import event_ms, exit_gpu_main, parse_variants, patched, release_pool, variant_shapes  # noqa: E402

from andrea.engine import fp8_numpy as f8  # noqa: E402
from andrea.fsutil import atomic_write_json  # noqa: E402


def median_ms(fn, reps: int, windows: int = 5) -> float:
    return float(np.median([event_ms(fn, reps) for _ in range(windows)]))


def bf16_random(cp, rows: int, cols: int, seed: int, scale: float = 1.0):
    g = np.random.default_rng(seed)
    x = (g.standard_normal((rows, cols)).astype(np.float32) * scale).view(np.uint32)
    return cp.asarray(((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16))


def check(name: str, got, want) -> None:
    if not np.array_equal(got, want):
        bad = int((got != want).sum())
        raise SystemExit(f"fp8_casts: {name} differs from the NumPy twin in {bad} codes; not timing it")


def shape_rows(cp, k8, N: int, cols: int, reps: int, dgelu: bool) -> dict:
    """The casts of one (N, cols) tensor, validated on its first 64 rows, then timed."""
    x = bf16_random(cp, N, cols, 1, 0.05)
    hp = bf16_random(cp, N, cols, 2) if dgelu else None
    scale = np.float32(f8.scale_of(np.float32(0.2))[0])
    sc, rec = cp.asarray(np.array([scale], np.float32)), cp.zeros(1, np.float32)
    part, inv = cp.zeros(k8.AMAX_BLOCKS, np.float32), cp.zeros(1, np.float32)
    nat, tr, flat, out = (cp.empty((N, cols), np.uint8), cp.empty((cols, N), np.uint8),
                          cp.empty(N * cols, np.uint8), cp.empty_like(x))
    want, _, _ = f8.quantize_delayed(f8.bf16_to_f32(cp.asnumpy(x[:64])), scale)
    k8.quantize(flat, None, x, part, inv, scale=sc, rec=rec)
    check("flat", cp.asnumpy(flat[:64 * cols]).reshape(64, cols), want)
    row = {"copy": median_ms(lambda: cp.copyto(out, x), reps),
           "flat": median_ms(lambda: k8.quantize(flat, None, x, part, inv, scale=sc, rec=rec), reps)}
    moved = {"copy": 4, "flat": 3}
    codes = flat.reshape(N, cols)                   # the byte transpose of E4M3 a producer wrote (k_fp8_t_u8)
    tr.fill(0)
    k8.k_fp8_t_u8(codes, tr, N, cols, part[:1], None)
    check("transpose", cp.asnumpy(tr[:, :64]).T, cp.asnumpy(codes[:64]))
    row["transpose"] = median_ms(lambda: k8.k_fp8_t_u8(codes, tr, N, cols, part[:1], None), reps)
    moved["transpose"] = 2
    if dgelu:
        from andrea.cuda.kernels import k_gelu_bwd

        ref = cp.empty_like(x)                       # the twin of the fused input: k_gelu_bwd's bf16, tested
        k_gelu_bwd("bf16", ref, x, hp, x.size)       # bit-exact against the fused kernel in test_fp8_gpu.py
        want_dg, _, _ = f8.quantize_delayed(f8.bf16_to_f32(cp.asnumpy(ref[:64])), scale)
    for kern in ("smem", "warp"):                    # fp8.CAST_T: the two transposing casts, the same bytes
        with patched(k8, CAST_T=kern):
            nat.fill(0)
            tr.fill(0)
            k8.quantize(nat, tr, x, part, inv, N, cols, scale=sc, rec=rec)
            check(f"both {kern} (natural)", cp.asnumpy(nat[:64]), want)
            check(f"both {kern} (transposed)", cp.asnumpy(tr[:, :64]).T, want)
            row[f"both {kern}"] = median_ms(lambda: k8.quantize(nat, tr, x, part, inv, N, cols, scale=sc, rec=rec),
                                            reps)
            moved[f"both {kern}"] = 4
            if dgelu:
                k8.quantize(nat, tr, x, part, inv, N, cols, scale=sc, rec=rec, hp=hp)
                check(f"dgelu {kern}", cp.asnumpy(nat[:64]), want_dg)
                check(f"dgelu {kern} (transposed)", cp.asnumpy(tr[:, :64]).T, want_dg)
                row[f"dgelu {kern}"] = median_ms(lambda: k8.quantize(nat, tr, x, part, inv, N, cols, scale=sc,
                                                                     rec=rec, hp=hp), reps)
                moved[f"dgelu {kern}"] = 6
    return {k: {"ms": ms, "GBps": moved[k] * N * cols / ms / 1e6} for k, ms in row.items()}


def weight_rows(cp, s: dict, B: int, reps: int) -> dict:
    """The weights' casts after an optimizer step: the two launches against one amax + cast per weight."""
    from andrea.cuda.backend import make_backend
    from andrea.engine.model import ModelConfig

    mc = ModelConfig(s["V"], s["C"], s["H"], s["L"], s["T"])
    eng = make_backend().make_engine(mc, 1, precision="fp8", cuda_graph=False)
    eng.init_weights(1)
    n = 12 * s["L"] * s["C"] ** 2
    with eng.stream:
        out = {"weights two launches": median_ms(eng.f8.cast_weights, reps),
               "weights one by one": median_ms(eng.f8.cast_weights_each, reps)}
    del eng
    release_pool()
    return {k: {"ms": ms, "GBps": 6 * n / ms / 1e6} for k, ms in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", default=["andrea-120m:32", "andrea-480m:8"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import cupy as cp

    import andrea.cuda.fp8 as k8

    res = {}
    for v, B in parse_variants(args.variants, 8):
        s = variant_shapes(v)
        N, C = B * s["T"], s["C"]
        key = f"{v}:B{B}"
        res[key] = {f"{N}x{c}": shape_rows(cp, k8, N, c, args.reps, dgelu=c == 4 * C) for c in (C, 3 * C, 4 * C)}
        res[key]["weights"] = weight_rows(cp, s, B, max(2, args.reps // 4))
        print(f"\n{key}: ms per call, GB/s of the bytes it must move, GB/s over the copy's")
        for shape, rows in res[key].items():
            copy = rows.get("copy", {}).get("GBps")
            for k, r in rows.items():
                ratio = f"{r['GBps'] / copy:5.2f}" if copy and k != "copy" else ""
                print(f"  {shape:<12} {k:<22} {r['ms']:8.3f} {r['GBps']:8.0f} {ratio}")
        if args.json:
            atomic_write_json(Path(args.json), res)
    return 0


if __name__ == "__main__":
    exit_gpu_main(main, "fp8_casts")
