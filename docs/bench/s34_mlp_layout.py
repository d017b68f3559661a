"""Scratch record (session 34, ran once on the H200; kept beside its output s34_mlp_layout_h200.json, not a
maintained bench): the MLP's six GEMMs with h_pre / h_act / dh stored (M, 4C) as the engine stores them
("row") against the same products with those three stored transposed, (4C, M) ("col"), to see whether
cuBLASLt has a faster kernel for the GELU_AUX / DGELU epilogues in the other orientation. Each problem runs
under every heuristic candidate (bench/lt_algos.time_candidates, 150 ms back to back first, as in a step).
Result: no: "col" was 0.3-0.8% slower in total at every shape (s34_h200.md).

    PYTHONPATH=. python3 docs/bench/s34_mlp_layout.py layout.json      # on the GPU, ~100 s
"""
import json, sys
from pathlib import Path
sys.path.insert(0, "."); sys.path.insert(0, "bench")
import cupy as cp, numpy as np
from andrea.cuda.cublaslt import Lt, EPILOGUE_GELU_AUX, EPILOGUE_DGELU
import lt_algos as la

def bf(shape, rng):
    x = (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(np.float32)
    return cp.asarray((x.view(np.uint32) >> 16).astype(np.uint16))

out = {}
for name, M, C in (("480m:16", 16384, 1536), ("480m:8", 8192, 1536), ("120m:32", 32768, 768)):
    N, K = 4 * C, C
    rng = np.random.default_rng(0)
    x, dout, wfc, wproj = bf((M, K), rng), bf((M, K), rng), bf((K, N), rng), bf((N, K), rng)
    hpre, hact, dh = bf((M, N), rng), bf((M, N), rng), bf((M, N), rng)
    hpreT, hactT, dhT = bf((N, M), rng), bf((N, M), rng), bf((N, M), rng)
    o16, dx = cp.zeros((M, K), cp.uint16), cp.zeros((M, K), cp.uint16)
    dwp, dwf = cp.zeros((N, K), cp.float32), cp.zeros((K, N), cp.float32)
    lt = Lt(cp.zeros(32 << 20, cp.uint8))
    probs = {
      "row": [("fc fwd+gelu", hact, x, wfc, {"epilogue": EPILOGUE_GELU_AUX, "aux": hpre}),
              ("proj fwd", o16, hact, wproj, {}),
              ("proj dgrad+dgelu", dh, dout, wproj, {"tb": True, "epilogue": EPILOGUE_DGELU, "aux": hpre}),
              ("proj wgrad", dwp, hact, dout, {"ta": True}),
              ("fc wgrad", dwf, x, dh, {"ta": True}),
              ("fc dgrad", dx, dh, wfc, {"tb": True})],
      "col": [("fc fwd+gelu", hactT, wfc, x, {"ta": True, "tb": True, "epilogue": EPILOGUE_GELU_AUX, "aux": hpreT}),
              ("proj fwd", o16, hactT, wproj, {"ta": True}),
              ("proj dgrad+dgelu", dhT, wproj, dout, {"tb": True, "epilogue": EPILOGUE_DGELU, "aux": hpreT}),
              ("proj wgrad", dwp, hactT, dout, {}),
              ("fc wgrad", dwf, x, dhT, {"ta": True, "tb": True}),
              ("fc dgrad", dx, dhT, wfc, {"ta": True, "tb": True})]}
    res = {}
    for lay, plist in probs.items():
        for tag, Cm, A, B, kw in plist:
            n0 = len(lt.plans16)
            lt.mm(Cm, A, B, **kw)
            cp.cuda.Device().synchronize()
            plan = list(lt.plans16.values())[-1] if len(lt.plans16) > n0 else None
            ts = la.time_candidates(lt, plan, (B.data.ptr, A.data.ptr, Cm.data.ptr, 0.0, None), 20, 150.0)
            first = ts[0]; best = min(t for t in ts if t is not None)
            res[f"{lay} {tag}"] = {"first_us": None if first is None else first * 1e3, "best_us": best * 1e3,
                                   "all_us": [None if t is None else round(t * 1e3, 1) for t in ts]}
            print(name, lay, tag, "first", None if first is None else round(first * 1e3, 1), "best", round(best * 1e3, 1), flush=True)
        tot = sum(v["best_us"] for k, v in res.items() if k.startswith(lay))
        print(name, lay, "MLP total best us", round(tot, 1), flush=True)
    out[name] = res
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
