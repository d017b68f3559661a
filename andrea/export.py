"""``andrea export``: a run as a Hugging Face ``transformers`` GPT-2 folder with a model card.

    andrea export runs/tiny/main --out exports/tiny
    python -c "from transformers import AutoModelForCausalLM as M, AutoTokenizer as T; \\
        m = M.from_pretrained('exports/tiny'); t = T.from_pretrained('exports/tiny', trust_remote_code=True); \\
        print(t.decode(m.generate(**t('def ', return_tensors='pt'), max_new_tokens=20)[0]))"

The folder (written in a temp sibling and renamed into place: it lands whole or not at all):

    config.json              GPT2LMHeadModel: n_positions = context, n_inner = 4C, gelu_new (the
                             tanh GELU), layer_norm_epsilon = ops_numpy.LN_EPS, tied head, no dropout
    model.safetensors        the checkpoint's fp32 weights under GPT-2's names; the linear layers'
                             biases (ANDREA has none) are exported as zeros. GPT-2's Conv1D stores
                             (C_in, C_out) like andrea.engine.model, so no matrix is transposed
    generation_config.json   the params' audit section (what sample/chat/audit default to)
    harris.json              the run's tokenizer.json, byte for byte (sha256 in the card)
    tokenization_andrea.py   the tokenizer class for AutoTokenizer(trust_remote_code=True)
    tokenizer_config.json    its auto_map; special_tokens_map.json
    README.md                the model card: Hub YAML metadata, then the recipe (resolved params),
                             data provenance and hashes, size, precision, steps, held-out bits/byte
                             per source, the unigram baseline and the audit's flags

Why a shipped tokenizer class and not a ``tokenizers`` JSON: the Harris encoder cuts each
pre-token into the FEWEST tokens (a dynamic program over bytes, ties to the longest first
token); none of the ``tokenizers`` models does that (BPE applies merges, WordPiece takes
the longest match greedily, Unigram maximises a likelihood with its own tie order), so it
would not give the same ids. The class is andrea's encoder in ~60 lines without andrea;
``tests/test_export.py`` checks it against andrea over the whole embedded val split.

The run's own resolved config (``model.state.json`` "config") is the recipe (no --profile:
the run says what it is); reports come
from ``reports/<variant>/`` (metrics.json of ``andrea eval``, audit.json of ``andrea audit``)
and provenance from ``data/`` when they are there; the card says which were missing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from andrea.engine.model import ModelConfig, param_layout
from andrea.engine.ops_numpy import LN_EPS
from andrea.errors import AndreaError
from andrea.fsutil import atomic_dir, json_text, ordinary_mode, sha256_file

TOKENIZER_CLASS = "AndreaHarrisTokenizer"
SHIPPED = Path(__file__).resolve().parent / "hf" / "tokenization_andrea.py"


def add_arguments(p) -> None:
    p.add_argument("run", help="run folder (holding model.bin + model.state.json), e.g. runs/tiny/main")
    p.add_argument("--out", required=True, help="export folder to write (replaced whole if it exists)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json (default: data/tokenizer/<variant>/tokenizer.json, checked by the run's sha256)")
    p.add_argument("--reports", default=None, help="reports folder for the card (default: reports/<variant>)")
    p.add_argument("--data", default="data", help="data folder holding embedded/ and raw/ (default: %(default)s)")
    p.add_argument("--name", default=None, help="model name in the card (default: andrea-<variant>)")


# ----------------------------------------------------------------------- weights
def hf_tensors(mc: ModelConfig, flat: np.ndarray) -> dict[str, np.ndarray]:
    """GPT-2 (``GPT2LMHeadModel``) state dict of the flat fp32 buffer, as contiguous fp32 arrays."""
    lay = param_layout(mc)
    if flat.shape != (lay.n_params,):
        raise AndreaError(f"export: expected {lay.n_params} weights for {mc}, got shape {flat.shape}")

    def w(name):
        t = lay.by_name[name]
        return np.ascontiguousarray(flat[t.offset:t.offset + t.size].reshape(t.shape), dtype=np.float32)

    C = mc.d_model
    out = {"transformer.wte.weight": w("wte"), "transformer.wpe.weight": w("wpe"),
           "transformer.ln_f.weight": w("lnf.g"), "transformer.ln_f.bias": w("lnf.b")}
    for l in range(mc.n_layer):
        p, q = f"h.{l}.", f"transformer.h.{l}."
        out.update({
            q + "ln_1.weight": w(p + "ln1.g"), q + "ln_1.bias": w(p + "ln1.b"),
            q + "attn.c_attn.weight": w(p + "attn.w_qkv"), q + "attn.c_attn.bias": np.zeros(3 * C, np.float32),
            q + "attn.c_proj.weight": w(p + "attn.w_o"), q + "attn.c_proj.bias": np.zeros(C, np.float32),
            q + "ln_2.weight": w(p + "ln2.g"), q + "ln_2.bias": w(p + "ln2.b"),
            q + "mlp.c_fc.weight": w(p + "mlp.w_fc"), q + "mlp.c_fc.bias": np.zeros(4 * C, np.float32),
            q + "mlp.c_proj.weight": w(p + "mlp.w_proj"), q + "mlp.c_proj.bias": np.zeros(C, np.float32),
        })
    return out


def hf_config(mc: ModelConfig, eot_id: int) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": mc.vocab_size,
            "n_positions": mc.context, "n_embd": mc.d_model, "n_layer": mc.n_layer, "n_head": mc.n_head,
            "n_inner": 4 * mc.d_model, "activation_function": "gelu_new", "layer_norm_epsilon": LN_EPS,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_first_dropout": 0.0,
            "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "use_cache": True, "tie_word_embeddings": True,
            "bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": eot_id, "dtype": "float32"}


def generation_config(section: dict, eot_id: int) -> dict:
    """The sampling defaults of sample/chat/audit (``audit`` params) in transformers' terms.
    Temperature 0 (greedy here) is ``do_sample: false``; top_k 0 and top_p 1 are no cut in both."""
    t = float(section.get("temperature", 0.8))
    g = {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": eot_id,
         "max_new_tokens": int(section.get("max_new_tokens", 64)), "do_sample": t > 0,
         "top_k": int(section.get("top_k", 0)), "top_p": float(section.get("top_p", 1.0))}
    if t > 0:
        g["temperature"] = t
    return g


# ------------------------------------------------------------------ the model card
def _read(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        raise AndreaError(f"{path}: not valid JSON (re-run the stage that writes it)") from None


def _last_val(loss_path: Path) -> dict | None:
    from andrea import runs

    val = runs.read_history(loss_path)["val"]
    return val[-1] if val else None


def card_facts(run_dir: Path, state: dict, cfg: dict, tok, tok_path: Path, reports: Path, data: Path) -> dict:
    """Everything the card states, gathered from the run folder, the reports and the data."""
    corpus = cfg.get("hermes3", {}).get("source")
    prov_path, man_path = data / "embedded" / "PROVENANCE.json", data / "raw" / "hermes3" / str(corpus) / "MANIFEST.json"
    prov, manifest = _read(prov_path), _read(man_path)
    metrics, audit = _read(reports / "metrics.json"), _read(reports / "audit.json")
    last_val = _last_val(run_dir / "model.loss.json")
    return {"corpus": corpus, "provenance": prov, "provenance_path": str(prov_path), "manifest": manifest,
            "manifest_path": str(man_path), "metrics": metrics, "metrics_path": str(reports / "metrics.json"),
            "audit": audit, "audit_path": str(reports / "audit.json"), "last_val": last_val,
            "tokenizer_sha256": sha256_file(tok_path), "tokenizer_path": str(tok_path)}


def _fmt(x, nd=4):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def model_card(name: str, mc: ModelConfig, state: dict, cfg: dict, f: dict, n_params: int, n_hf: int,
               weights_sha: str) -> str:
    import yaml

    from andrea.reports.render import md_table

    metrics, audit, val = f["metrics"], f["audit"], f["last_val"]
    results = []
    if metrics:
        ms = [{"type": "bits_per_byte", "name": "held-out bits/byte (all sources)", "value": metrics.get("val_bpb")},
              {"type": "bits_per_byte", "name": "unigram baseline bits/byte", "value": metrics.get("unigram_bpb")}]
        ms += [{"type": "bits_per_byte", "name": f"held-out bits/byte: {s}", "value": v.get("bpb")}
               for s, v in sorted((metrics.get("per_source") or {}).items())]
        results = [{"task": {"type": "text-generation"},
                    "dataset": {"type": "megachat", "name": f"megachat/{f['corpus']} val split"},
                    "metrics": [m for m in ms if m["value"] is not None]}]
    meta = {"library_name": "transformers", "pipeline_tag": "text-generation",
            "tags": ["andrea", "gpt2", "harris-tokenizer", "custom_code"],
            "license": "other", "language": ["en"],
            "datasets": [f"andrea/megachat-{f['corpus']}"],
            "model-index": [{"name": name, "results": results}] if results else None,
            "andrea": {"step": state.get("step"), "phase": state.get("phase"), "config_hash": state.get("config_hash"),
                       "checkpoint_sha256": state.get("checkpoint_sha256"), "tokenizer_sha256": f["tokenizer_sha256"],
                       "model_safetensors_sha256": weights_sha, "precision": state.get("precision"),
                       "backend": state.get("backend"), "n_params": n_params}}
    meta = {k: v for k, v in meta.items() if v is not None}
    lines = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(), "---", "",
             f"# {name}", "",
             f"A {n_params:,}-parameter decoder-only GPT trained by ANDREA (profile `{cfg.get('profile')}`), "
             "exported to the `transformers` GPT-2 layout by `andrea export`. Pre-LN, learned positions, "
             "GELU (tanh), tied embeddings, no linear biases (exported as zeros).", "",
             "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
             'model = AutoModelForCausalLM.from_pretrained("PATH")',
             'tok = AutoTokenizer.from_pretrained("PATH", trust_remote_code=True)   # the Harris tokenizer, shipped here',
             'ids = tok("def ", return_tensors="pt")',
             "print(tok.decode(model.generate(**ids)[0], skip_special_tokens=True))   # generation_config.json: the audit's sampling",
             "```", "",
             "The tokenizer is `tokenization_andrea.py` (a `PreTrainedTokenizer` reading `harris.json`, the run's "
             "tokenizer.json byte for byte): the Harris encoder takes the fewest tokens per pre-token, which no "
             "`tokenizers` model reproduces, so it needs `trust_remote_code=True`. Its ids equal ANDREA's.", "",
             "## Model", "",
             md_table(["", ""], [
                 ["parameters (ANDREA, tied, no biases)", f"{n_params:,}"],
                 ["parameters in the transformers model (with the zero biases)", f"{n_hf:,}"],
                 ["layers / heads / d_model / context / vocab", f"{mc.n_layer} / {mc.n_head} / {mc.d_model} / {mc.context} / {mc.vocab_size}"],
                 ["training precision (backend)", f"{state.get('precision', '-')} ({state.get('backend', '-')})"],
                 ["exported weights", "float32 (the fp32 master weights of the checkpoint)"],
                 ["training steps", f"{state.get('step')} ({state.get('phase')} phase; steps {json.dumps(state.get('steps'))})"],
                 ["halt", json.dumps(state.get("halt"))],
                 ["config_hash", f"`{state.get('config_hash')}`"],
                 ["checkpoint sha256 (model.bin: w, m, v)", f"`{state.get('checkpoint_sha256')}`"],
                 ["model.safetensors sha256", f"`{weights_sha}`"],
                 ["tokenizer sha256", f"`{f['tokenizer_sha256']}`"],
             ]), ""]
    lines += ["## Evaluation", ""]
    if metrics:
        rows = [["all sources", _fmt(metrics.get("val_loss")), _fmt(metrics.get("val_bpb"))]]
        rows += [[s, _fmt(v.get("loss")), _fmt(v.get("bpb"))] for s, v in sorted((metrics.get("per_source") or {}).items())]
        rows += [["unigram baseline (add-one, train-split frequencies)", "-", _fmt(metrics.get("unigram_bpb"))]]
        lines += [f"Held-out (val split) from `{f['metrics_path']}` (andrea eval, step {metrics.get('step')}):", "",
                  md_table(["source", "loss (nats/token)", "bits/byte"], rows), ""]
        extra = {k: metrics[k] for k in ("judge_score", "val_bytes_per_token") if k in metrics}
        if extra:
            lines += [md_table(["metric", "value"], [[k, _fmt(v)] for k, v in extra.items()]), ""]
    else:
        lines += [f"No `{f['metrics_path']}` (run `andrea eval`): no held-out bits/byte in this card.", ""]
    if val:
        rows = [["all sources", _fmt(val.get("loss")), _fmt(val.get("unigram"))]]
        rows += [[s, _fmt(v), _fmt((val.get("unigram_per_source") or {}).get(s))] for s, v in sorted((val.get("per_source") or {}).items())]
        lines += [f"The training run's last validation (step {val.get('step')}, model.loss.json; nats/token):", "",
                  md_table(["source", "val loss", "unigram baseline"], rows), ""]
    lines += ["## Audit", ""]
    if audit:
        summ = (audit.get("final") or {}).get("summary") or {}
        lines += [f"From `{f['audit_path']}` (andrea audit, step {(audit.get('final') or {}).get('step')}, "
                  f"options {json.dumps(audit.get('options'))}): {summ.get('n_flagged', '-')} of "
                  f"{summ.get('n_samples', '-')} samples flagged.", ""]
        flags = audit.get("flags") or []
        if flags:
            lines += [md_table(["prompt", "domain", "sample", "flags"],
                               [[x.get("id"), x.get("domain"), x.get("sample"), "; ".join(x.get("flags", []))] for x in flags]), ""]
        else:
            lines += ["No sample of the final checkpoint was flagged.", ""]
    else:
        lines += [f"No `{f['audit_path']}` (run `andrea audit`): the audit's flags are not in this card.", ""]
    lines += ["## Data", ""]
    if f["manifest"]:
        m = f["manifest"]
        lines += [f"Corpus `{f['corpus']}`, `{f['manifest_path']}`: source {m.get('source')}, repo "
                  f"{m.get('repo_id')}, revision `{m.get('revision')}`, {m.get('rows')} rows.", "",
                  md_table(["file", "rows", "bytes", "sha256"],
                           [[x.get("file"), x.get("rows"), x.get("bytes"), f"`{x.get('sha256')}`"] for x in m.get("files", [])]), ""]
    else:
        lines += [f"No `{f['manifest_path']}` here (the corpus's MANIFEST.json).", ""]
    if f["provenance"]:
        p = f["provenance"]
        lines += [f"Embedded sources, `{f['provenance_path']}` ({json.dumps(p.get('python'))}); license: {p.get('license')}", "",
                  md_table(["source", "kind", "rows", "text bytes", "sha256"],
                           [[s.get("name"), s.get("kind"), s.get("rows"), s.get("text_bytes"), f"`{s.get('sha256')}`"]
                            for s in p.get("sources", [])]), ""]
    else:
        lines += [f"No `{f['provenance_path']}` here.", ""]
    shards = state.get("train_shards")
    if shards:
        lines += ["Train token shards the run was fingerprinted with (`train_shards`):", "",
                  md_table(["source", "fingerprint"], [[s, json.dumps(v)] for s, v in sorted(shards.items())]), ""]
    lines += ["## Recipe", "", "The resolved params this run trained with (`model.state.json` \"config\"); "
              "`andrea train` with them (and the same data and tokenizer) gives the same bytes.", "",
              "```yaml", yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True).rstrip(), "```", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------ export
def export(run: str | Path, out: str | Path, tokenizer: str | Path | None = None, reports: str | Path | None = None,
           data: str | Path = "data", name: str | None = None, cfg_fallback: dict | None = None) -> Path:
    """Write the export folder ``out`` for the run folder ``run``; return ``out``."""
    from safetensors.numpy import save_file

    from andrea import runs
    from andrea.engine import checkpoint as ckio
    from andrea.generate import find_tokenizer
    from andrea.tokenizer import load as load_tokenizer

    ckpt = runs.find_checkpoint(run)
    run_dir = ckpt.parent
    state = runs.read_state_beside(ckpt)
    if state is None:
        raise AndreaError(f"{runs.state_path_beside(ckpt)}: run state not found; an export needs the run's "
                          "model.state.json (its config is the model card's recipe)")
    cfg = state.get("config") if isinstance(state.get("config"), dict) else cfg_fallback
    if cfg is None:
        raise AndreaError(f"{runs.state_path_beside(ckpt)}: no 'config' in the run state (made before andrea "
                          "recorded it?): the card's recipe would be unknown; re-train the run to export it")
    tok_path = find_tokenizer(run_dir, state, tokenizer)
    tok = load_tokenizer(tok_path)
    runs.check_for_inference(state, runs.state_path_beside(ckpt), cfg, tok)
    mc = ModelConfig.from_cfg(cfg, tok.vocab_size)
    n_params = param_layout(mc).n_params
    step, weights = ckio.read_weights(ckpt, n_params)
    if state.get("step") is not None and state["step"] != step:
        raise AndreaError(f"{ckpt}: holds step {step}, its state says {state['step']} (a split pair): not exported")
    if not np.isfinite(weights).all():
        raise AndreaError(f"{ckpt}: weights hold NaN or inf; not exported")
    variant = cfg.get("profile") or run_dir.parent.name
    reports = Path(reports) if reports is not None else Path("reports") / str(variant)
    name = name or f"andrea-{variant}"
    tensors = hf_tensors(mc, weights)
    n_hf = sum(a.size for a in tensors.values())
    facts = card_facts(run_dir, state, cfg, tok, tok_path, reports, Path(data))
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        ordinary_mode(tmp / "model.safetensors")
        weights_sha = sha256_file(tmp / "model.safetensors")
        (tmp / "config.json").write_text(json_text(hf_config(mc, tok.eot_id), indent=2), encoding="utf-8")
        (tmp / "generation_config.json").write_text(json_text(generation_config(cfg.get("audit", {}), tok.eot_id), indent=2),
                                                    encoding="utf-8")
        shutil.copyfile(tok_path, tmp / "harris.json")
        shutil.copyfile(SHIPPED, tmp / "tokenization_andrea.py")
        (tmp / "tokenizer_config.json").write_text(json_text({
            "tokenizer_class": TOKENIZER_CLASS,
            "auto_map": {"AutoTokenizer": [f"tokenization_andrea.{TOKENIZER_CLASS}", None]},
            "model_max_length": mc.context, "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>", "split_special_tokens": True, "clean_up_tokenization_spaces": False},
            indent=2), encoding="utf-8")
        (tmp / "special_tokens_map.json").write_text(json_text({
            "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, indent=2),
            encoding="utf-8")
        (tmp / "README.md").write_text(model_card(name, mc, state, cfg, facts, n_params, n_hf, weights_sha),
                                       encoding="utf-8")
    return Path(out)


def run(args, cfg) -> int:
    out = export(args.run, args.out, args.tokenizer, args.reports, args.data, args.name, cfg_fallback=cfg)
    print(f"andrea export: {args.run} -> {out} (config.json, model.safetensors, generation_config.json, "
          "tokenizer, README.md)")
    return 0
