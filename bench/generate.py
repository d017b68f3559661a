"""Benchmark: generation tokens/s, batch 1, greedy, against anchors measured in the same run.

    python bench/generate.py                                   # NumPy: KV cache vs no cache, every shape
    python bench/generate.py --backend cupy --tokens 256       # GPU: ours vs transformers on the export

NumPy (``--backend numpy``): the KV cache (``InferenceModel``) against re-running the whole
window for every new token (the anchor), at each shape of ``--shapes``.

GPU (``--backend cupy``): per shape, the same random weights (seeded) run by
- ``graph``: ``andrea.cuda.decode.GraphDecoder`` (one CUDA graph per token, arg-max on the
  device), in bf16 and fp32;
- ``graph-sample``: the same decoder sampling ON THE DEVICE (temperature 0.8, top-k 40, top-p
  0.95: the params' audit options), against transformers ``generate(do_sample=True)`` with them;
- ``eager``: ``InferenceModel`` on CuPy (fp32, one launch per op: the previous path);
- ``transformers``: the weights exported by ``andrea.export`` (``hf_tensors`` + ``hf_config``,
  the functions ``andrea export`` writes with, saved as model.safetensors + config.json) and
  loaded with ``AutoModelForCausalLM.from_pretrained``, eager ``generate`` (greedy, KV cache),
  in bf16 and fp32: the anchor. Ratios are ours / transformers at the same precision.
Every path produces the same number of tokens; the fp32 paths' first tokens are compared.
``--profile`` adds, per GPU shape, each decode kernel's time as a graph node (CUDA events around
a graph of 200 launches of it, at position ``--prompt + --tokens``) and the bytes it reads per second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from andrea.backends import select_backend
from andrea.engine.engine import Engine
from andrea.engine.model import ModelConfig
from andrea.generate import InferenceModel, SamplingOptions, draw, generate, next_token_probs

SAMPLED = SamplingOptions(max_new_tokens=0, temperature=0.8, top_k=40, top_p=0.95, stop_at_eot=False)   # the audit's
SHAPES = {"tiny": ModelConfig(1281, 128, 4, 4, 128), "12m": ModelConfig(4353, 384, 12, 6, 1024),
          "120m": ModelConfig(8449, 768, 12, 12, 1024)}


def no_cache(im: InferenceModel, prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    rng = np.random.default_rng(0)
    for _ in range(n):
        im.reset()
        row = im.be.to_host(im.forward(seq[-im.context:])[-1])
        t = draw(next_token_probs(row, 0.0), rng)
        out.append(t)
        seq.append(t)
    return out


def host_weights(mc: ModelConfig) -> np.ndarray:
    eng = Engine(mc, batch_size=1, backend=select_backend("numpy")[0])
    eng.init_weights(seed=1)
    w = eng.w.copy()
    w += 0.02 * np.random.default_rng(3).standard_normal(w.size).astype(np.float32)   # less flat than init
    return w


def timed(fn, sync):
    fn()                                    # warm up (compiles, captures, allocates)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def bench_numpy(name: str, mc: ModelConfig, n: int, plen: int) -> None:
    be, _ = select_backend("numpy")
    im = InferenceModel(mc, host_weights(mc), be)
    prompt = list(np.random.default_rng(2).integers(0, mc.vocab_size, plen))
    greedy = SamplingOptions(max_new_tokens=n, temperature=0, stop_at_eot=False)
    a, t_cache = timed(lambda: generate(im, prompt, greedy, 0).ids, be.synchronize)
    b, t_full = timed(lambda: no_cache(im, prompt, n), be.synchronize)
    same = sum(x == y for x, y in zip(a, b))
    print(f"| {name} | numpy | fp32 | kv-cache | {n / t_cache:.1f} | {t_full / t_cache:.2f}x vs no cache "
          f"({n / t_full:.1f} tok/s; same tokens {same}/{n}) |", flush=True)


def export_folder(mc: ModelConfig, w: np.ndarray, root: Path) -> Path:
    from safetensors.numpy import save_file

    from andrea.export import hf_config, hf_tensors

    out = root / "export"
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_tensors(mc, w), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(mc, mc.vocab_size - 1)))
    return out


def profile_decoder(name: str, dec, pos: int, reps: int = 200) -> None:
    """Microseconds per launch of each kernel of one decode step, as a node of a CUDA graph."""
    import cupy as cp

    from andrea.cuda.decode import MODE_GELU, MODE_LOGITS, MODE_QKV

    mc, W, WT = dec.mc, dec.W, dec.WT
    dec.state[:] = cp.asarray([1, pos, 0, 0], dtype=np.int32)
    cp.cuda.Device().synchronize()            # the decoder's own stream does not wait for this copy
    kinds = {
        "ln+qkv": (lambda: dec.ln_gemv(dec.x, W["h.0.ln1.g"], W["h.0.ln1.b"], WT["h.0.attn.w_qkv"], MODE_QKV, dec.q,
                                       dec.k_cache[0], dec.v_cache[0]), WT["h.0.attn.w_qkv"].nbytes),
        "attention": (lambda: dec.attn(dec.k_cache[0], dec.v_cache[0]), 2 * dec.k_cache[0].nbytes * (pos + 1) // mc.context),
        "out+res": (lambda: dec.gemv_res(dec.y, WT["h.0.attn.w_o"], dec.x), WT["h.0.attn.w_o"].nbytes),
        "ln+fc+gelu": (lambda: dec.ln_gemv(dec.x, W["h.0.ln2.g"], W["h.0.ln2.b"], WT["h.0.mlp.w_fc"], MODE_GELU,
                                           dec.h_act), WT["h.0.mlp.w_fc"].nbytes),
        "proj+res": (lambda: dec.gemv_res(dec.h_act, WT["h.0.mlp.w_proj"], dec.x), WT["h.0.mlp.w_proj"].nbytes),
        "lnf+head": (lambda: dec.ln_gemv(dec.x, W["lnf.g"], W["lnf.b"], WT["wte"], MODE_LOGITS, dec.logits),
                     WT["wte"].nbytes),
    }
    total = 0.0
    stream = dec.stream
    for kind, (fn, nbytes) in kinds.items():
        with stream:                          # reps launches of the kernel as one graph: its cost as a graph node
            fn()
            stream.begin_capture()
            try:
                for _ in range(reps):
                    fn()
            finally:
                graph = stream.end_capture()
            graph.launch(stream)
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            graph.launch(stream)
            b.record(stream)
        b.synchronize()
        us = cp.cuda.get_elapsed_time(a, b) * 1e3 / reps
        per_token = us * (1 if kind == "lnf+head" else mc.n_layer)
        total += per_token
        print(f"  {name} {dec.prec} {kind:11s} {us:7.2f} us/launch  {nbytes / us / 1e3:7.1f} GB/s  "
              f"x{1 if kind == 'lnf+head' else mc.n_layer} = {per_token:7.1f} us/token", flush=True)
    print(f"  {name} {dec.prec} sum over one step's kernels: {total:.1f} us/token (+ embed, arg-max)", flush=True)
    dec.reset()


def bench_cupy(name: str, mc: ModelConfig, n: int, plen: int, hf: bool, profile: bool = False) -> None:
    import cupy as cp

    from andrea.cuda.decode import GraphDecoder

    be, _ = select_backend("cupy")
    w = host_weights(mc)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, mc.vocab_size - 1, plen)]
    sync = cp.cuda.Device().synchronize
    rows, ids = {}, {}
    wd = cp.asarray(w)
    for prec in ("bf16", "fp32"):
        dec = GraphDecoder(mc, wd, precision=prec)
        ids[("graph", prec)], t = timed(lambda: dec.greedy(prompt, n), sync)
        rows[("graph", prec)] = n / t
        if profile:
            print(f"  {name} {prec} graph: {1e6 * t / n:.1f} us/token", flush=True)
            profile_decoder(name, dec, min(plen + n, mc.context - 1))
        if prec == "bf16":                    # sampling on the device (k_dec_sample in the graph)
            sampled = dataclasses.replace(SAMPLED, max_new_tokens=n)
            ids[("graph-sample", prec)], t = timed(lambda: generate(dec, prompt, sampled, 1).ids, sync)
            rows[("graph-sample", prec)] = n / t
        del dec
    im = InferenceModel(mc, wd, be)
    greedy = SamplingOptions(max_new_tokens=n, temperature=0, stop_at_eot=False)
    ids[("eager", "fp32")], t = timed(lambda: generate(im, prompt, greedy, 0).ids, sync)
    rows[("eager", "fp32")] = n / t
    del im
    if hf:
        import torch
        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory() as tmp:
            folder = export_folder(mc, w, Path(tmp))
            for prec, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dt).cuda().eval()
                x = torch.tensor([prompt], device="cuda")

                def run(sample=False):
                    with torch.no_grad():
                        kw = dict(do_sample=True, temperature=SAMPLED.temperature, top_k=SAMPLED.top_k,
                                  top_p=SAMPLED.top_p) if sample else dict(do_sample=False)
                        o = model.generate(x, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                                           **kw)
                    return o[0, len(prompt):].tolist()

                ids[("transformers", prec)], t = timed(run, torch.cuda.synchronize)
                rows[("transformers", prec)] = n / t
                if prec == "bf16":
                    torch.manual_seed(1)
                    ids[("transformers-sample", prec)], t = timed(lambda: run(True), torch.cuda.synchronize)
                    rows[("transformers-sample", prec)] = n / t
                del model
                torch.cuda.empty_cache()
    ref = ids[("eager", "fp32")]
    for (impl, prec), tps in rows.items():
        got = ids[(impl, prec)]
        agree = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        anchor_impl = "transformers-sample" if impl.endswith("sample") else "transformers"
        anchor = rows.get((anchor_impl, prec))
        ratio = f"{tps / anchor:.2f}x {anchor_impl} {prec}" if anchor and not impl.startswith("transformers") \
            else "anchor" if impl.startswith("transformers") else "-"
        check = f"{len(got)} tokens (sampled)" if impl.endswith("sample") else f"first {agree}/{n} tokens = eager fp32"
        print(f"| {name} | cupy | {prec} | {impl} | {tps:.1f} | {ratio} | {check} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tiny,12m,120m", help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--backend", choices=["numpy", "cupy"], default="numpy")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens (default: 256 on cupy, 32 on numpy)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers anchor")
    ap.add_argument("--profile", action="store_true", help="GPU: time each decode kernel (see above)")
    args = ap.parse_args()
    hf = not args.no_transformers
    if args.backend == "cupy" and hf:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as e:
            print(f"(transformers anchor skipped: {e})")
            hf = False
    print("| shape | backend | precision | path | tokens/s | ratio | check |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        mc = SHAPES[name]
        n = min(args.tokens or (256 if args.backend == "cupy" else 32), mc.context - args.prompt)
        if args.backend == "numpy":
            bench_numpy(name, mc, n, args.prompt)
        else:
            bench_cupy(name, mc, n, args.prompt, hf, args.profile)


if __name__ == "__main__":
    main()
