"""The audit stage: sample the fixed prompt sets from a run's checkpoints and score coherence.

    andrea audit --profile tiny --run runs/tiny/main --tokenizer data/tokenizer/tiny/tokenizer.json --out reports/tiny

Reads the final checkpoint ``RUN/model.bin`` and every archived checkpoint found under the
run folder (any other ``*.bin`` in the checkpoint format, ordered by its step), the fixed
prompt sets shipped in ``andrea/prompts/*.json`` (one per domain: chat-shaped prompts
rendered with the chat template, prose and code openings), and the run's
``model.samples.json`` / ``model.state.json`` when present.

Every prompt is sampled ``audit.samples_per_prompt`` times (all samples decoded as one batch of
up to ``AUDIT_SLOTS`` sequences, each with the tokens it would get alone) with ``audit.max_new_tokens``,
``audit.temperature``, ``audit.top_k`` and ``audit.top_p``; sample j of prompt i draws from
a Generator seeded by ``(seed, i, j)``, so every checkpoint answers under the same dice and
a re-run gives the same bytes. Chat answers stop at the template's end tag. Each sample
gets the coherence figures of ``andrea.coherence.scores`` (repeated bigram / trigram /
word / char rates, distinct-n) and flags: every rate over ``coherence.max_repeat`` (word
n-gram rates from 8 words on, the char rate from 16 characters on),
``empty`` (nothing but white space) and ``mojibake`` (over 5% U+FFFD from invalid UTF-8).

Writes ``OUT/audit.json`` (format ``andrea.audit/1``: per checkpoint the samples, their
scores and flags and per-domain means; the final checkpoint's summary and flags) and
``OUT/audit.md`` (the same as tables plus the final checkpoint's transcripts).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from andrea import coherence, runs
from andrea.errors import AndreaError
from andrea.fsutil import atomic_write_json, atomic_write_text, read_json
from andrea.settings import MaxRepeat, Settings

FORMAT = "andrea.audit/1"
PROMPTS_FORMAT = "andrea.prompts/1"
MOJIBAKE_SHARE = 0.05
MIN_WORDS = 8
MIN_CHARS = 16
AUDIT_SLOTS = 32          # samples decoded together (KV-cache slots; bench/audit.py measures the gain)
MEAN_KEYS = ("bigram", "trigram", "word", "char", "distinct_1", "distinct_2", "distinct_3")


@dataclass(frozen=True)
class Prompt:
    id: str
    domain: str
    text: str             # what the model is fed (chat: rendered with the template)
    shown: str            # what a reader is shown (chat: the last user turn)
    stop_strings: tuple[str, ...]


def _prompt_files() -> list[tuple[str, str]]:
    root = resources.files("andrea") / "prompts"
    return sorted((p.name, p.read_text(encoding="utf-8")) for p in root.iterdir() if p.name.endswith(".json"))


def load_prompts(files: list[tuple[str, str]] | None = None) -> list[Prompt]:
    """Every prompt of the shipped sets, in file then list order. Bad files raise naming file and row."""
    from andrea.data.template import conversation_problem, render_prompt

    out: list[Prompt] = []
    seen: set[str] = set()
    for name, raw in files if files is not None else _prompt_files():
        where = f"andrea/prompts/{name}"
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as e:
            raise AndreaError(f"{where}: not valid JSON: {e}") from None
        if not isinstance(d, dict) or d.get("format") != PROMPTS_FORMAT:
            raise AndreaError(f"{where}: format must be {PROMPTS_FORMAT!r}")
        domain, kind = d.get("domain"), d.get("kind")
        if kind not in ("chat", "prose", "code") or not isinstance(domain, str) or not domain:
            raise AndreaError(f"{where}: needs a 'domain' name and a 'kind' of chat | prose | code")
        items = d.get("prompts")
        if not isinstance(items, list) or not items:
            raise AndreaError(f"{where}: 'prompts' must be a non-empty list")
        for row, item in enumerate(items):
            pid = item.get("id") if isinstance(item, dict) else None
            if not isinstance(pid, str) or not pid or pid in seen:
                raise AndreaError(f"{where}: prompt {row}: missing or repeated 'id'")
            seen.add(pid)
            if kind == "chat":
                turns = item.get("turns")
                # a prompt is a conversation minus its final answer: check it with a stand-in answer
                problem = conversation_problem(list(turns or []) + [{"from": "gpt", "value": "x"}])
                if problem:
                    raise AndreaError(f"{where}: prompt {row} ({pid}): turns are not a usable conversation ({problem})")
                out.append(Prompt(pid, domain, render_prompt(turns), turns[-1]["value"], answer_stops()))
            else:
                text = item.get("text")
                if not isinstance(text, str) or not text:
                    raise AndreaError(f"{where}: prompt {row} ({pid}): 'text' must be a non-empty string")
                out.append(Prompt(pid, domain, text, text, ()))
    if not out:
        raise AndreaError("andrea/prompts: no prompt sets found")
    return out


def answer_stops() -> tuple[str, ...]:
    """Where a chat answer ends: the template's stop strings plus any role tag (a new assistant
    tag too: an answer never contains one, a small model sometimes starts a second turn)."""
    from andrea.data.template import ROLE_TAGS, STOP_STRINGS

    return tuple(dict.fromkeys([*STOP_STRINGS, *ROLE_TAGS.values()]))


def sample_flags(text: str, s: dict, max_repeat: MaxRepeat) -> list[str]:
    """Why a sample looks degenerate: repetition rates over their limits (word n-gram rates only
    from ``MIN_WORDS`` words on, the char rate from ``MIN_CHARS`` characters on: in a handful of
    words one repeat is already a high rate), ``empty``, ``mojibake``."""
    flags = [f for f in coherence.reasons(s, max_repeat)
             if (s["n_chars"] >= MIN_CHARS if f.startswith("char") else s["n_words"] >= MIN_WORDS)]
    if not text.strip():
        flags.append("empty")
    elif text.count("\ufffd") > MOJIBAKE_SHARE * len(text):
        flags.append("mojibake")
    return flags


def summarize(samples: list[dict]) -> dict:
    """Per-domain and overall means of the coherence figures, sample and flag counts."""
    groups: dict[str, list[dict]] = {"all": samples}
    for s in samples:
        groups.setdefault(s["domain"], []).append(s)
    out = {}
    for name, items in groups.items():
        if not items:
            continue
        row = {k: round(float(np.mean([s["scores"][k] for s in items])), 6) for k in MEAN_KEYS}
        row["n_tokens"] = round(float(np.mean([s["n_tokens"] for s in items])), 3)
        row["n_samples"] = len(items)
        row["n_flagged"] = sum(1 for s in items if s["flags"])
        row["flag_rate"] = round(row["n_flagged"] / len(items), 6)
        out[name] = row
    return out


def sample_checkpoint(model, tok, prompts: list[Prompt], settings: Settings, progress=None, task=None) -> list[dict]:
    """Every sample of every prompt, decoded as one batch (``andrea.generate.generate_batch``:
    each sample gets the tokens it gets alone, so the batch size never changes the report)."""
    from andrea.generate import SamplingOptions, generate_batch

    a, max_repeat = settings.audit, settings.coherence.max_repeat
    jobs, meta = [], []
    for i, p in enumerate(prompts):
        opts = SamplingOptions(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                               top_p=a.top_p, stop_strings=p.stop_strings)
        ids = tok.encode(p.text)
        for j in range(a.samples_per_prompt):
            jobs.append((ids, opts, np.random.default_rng([settings.seed, i, j])))
            meta.append((p, j))
    recs = []
    for (p, j), g in zip(meta, generate_batch(model, jobs, eot_id=tok.eot_id, tokenizer=tok)):
        s = coherence.scores(g.text)
        recs.append({"id": p.id, "domain": p.domain, "sample": j, "prompt": p.shown, "input": p.text, "text": g.text,
                     "n_tokens": len(g.ids), "stop": g.stop, "scores": s,
                     "flags": sample_flags(g.text, s, max_repeat)})
        if progress is not None:
            progress.advance(task)
    return recs


def training_summary(run: Path) -> dict:
    """What the run itself recorded: its coherence checks (.samples.json) and any halt (.state.json)."""
    out: dict = {"coherence_checks": 0, "samples": 0, "last_check_step": None, "halt": None}
    rf = runs.RunFolder(run)
    if rf.samples.is_file():
        samples = runs.read_samples(rf.samples)
        steps = sorted({int(s["step"]) for s in samples if isinstance(s, dict) and "step" in s})
        out.update(coherence_checks=len(steps), samples=len(samples), last_check_step=steps[-1] if steps else None)
    if rf.state.is_file():
        out["halt"] = read_json(rf.state, "run state").get("halt")
    return out


def _fence(text: str) -> str:
    run, longest = 0, 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    f = "`" * max(3, longest + 1)
    return f"{f}text\n{text}\n{f}"


def render_md(audit: dict) -> str:
    from andrea.reports.render import fmt, md_table

    o = audit["options"]
    lines = [f"# Audit of `{audit['run']}`", "",
             f"Prompts: {audit['n_prompts']} in {len(audit['domains'])} domains ({', '.join(audit['domains'])}); "
             f"{o['samples_per_prompt']} sample(s) each, up to {o['max_new_tokens']} tokens, temperature "
             f"{o['temperature']:g}, top-k {o['top_k']}, top-p {o['top_p']:g}, seed {audit['seed']}. "
             f"Flags: a repetition rate over `coherence.max_repeat` "
             f"({', '.join(f'{k} {v:g}' for k, v in audit['max_repeat'].items())}), `empty`, `mojibake`.", "",
             "## Coherence by checkpoint", ""]
    rows = []
    for c in audit["checkpoints"]:
        for dom, s in c["summary"].items():
            rows.append([c["step"], "final" if c["final"] else "archived", dom, s["bigram"], s["trigram"], s["word"],
                         s["char"], s["distinct_2"], s["n_tokens"], f"{s['n_flagged']}/{s['n_samples']}"])
    lines += [md_table(["step", "checkpoint", "domain", "bigram", "trigram", "word", "char", "distinct-2",
                        "tokens", "flagged"], rows), ""]
    tr = audit["training"]
    lines += ["## What the run recorded", "",
              f"- coherence checks during training: {tr['coherence_checks']} ({tr['samples']} samples), "
              f"last at step {fmt(tr['last_check_step'])}",
              f"- halt: {tr['halt']['reason'] + ' (step ' + str(tr['halt']['step']) + ')' if tr['halt'] else 'none'}", ""]
    fin = audit["final"]
    lines += [f"## Flags on the final checkpoint (step {fin['step']})", ""]
    if audit["flags"]:
        lines += [md_table(["prompt", "domain", "sample", "flags"],
                           [[f["id"], f["domain"], f["sample"], "; ".join(f["flags"])] for f in audit["flags"]]), ""]
    else:
        lines += ["No sample was flagged.", ""]
    lines += [f"## Transcripts (final checkpoint, step {fin['step']})", ""]
    final = next(c for c in audit["checkpoints"] if c["final"])
    for s in final["samples"]:
        sc = s["scores"]
        flag = f" — **flagged: {'; '.join(s['flags'])}**" if s["flags"] else ""
        lines += [f"### {s['id']} ({s['domain']}, sample {s['sample']}){flag}", "",
                  "Prompt:", "", _fence(s["prompt"]), "",
                  f"Output ({s['n_tokens']} tokens, stop: {s['stop']}; bigram {sc['bigram']:.2f}, trigram "
                  f"{sc['trigram']:.2f}, word {sc['word']:.2f}, char {sc['char']:.2f}, distinct-2 {sc['distinct_2']:.2f}):",
                  "", _fence(s["text"]), ""]
    return "\n".join(lines).rstrip() + "\n"


def add_arguments(p) -> None:
    p.add_argument("--run", required=True, help="run folder (final model.bin + state/samples files), e.g. runs/tiny/main")
    p.add_argument("--tokenizer", required=True, help="the run's tokenizer.json")
    p.add_argument("--out", required=True, help="report folder: writes audit.json and audit.md there")
    p.add_argument("--extra-checkpoint", action="append", default=[], metavar="PATH",
                   help="also audit this checkpoint (file or run folder, e.g. runs/tiny/warmup); repeatable")
    p.add_argument("--final-only", action="store_true", help="skip archived and extra checkpoints")


def run(args, cfg) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from andrea.engine import checkpoint as ckio
    from andrea.backends import select_backend
    from andrea.generate import load_model

    run_dir, out = Path(args.run), Path(args.out)
    console = Console(stderr=True)
    ckpts = runs.find_checkpoints(run_dir, args.extra_checkpoint)
    if args.final_only:
        ckpts = [c for c in ckpts if c[2]]
    settings = Settings.from_dict(cfg)
    be, why = select_backend(settings.train.backend)
    prompts = load_prompts()
    lm = load_model(run_dir, args.tokenizer, cfg, be, slots=min(AUDIT_SLOTS, len(prompts) * settings.audit.samples_per_prompt))
    console.print(f"audit: backend {why}")
    n_per = len(prompts) * settings.audit.samples_per_prompt
    checkpoints = []
    with Progress(console=console, transient=False) as progress:
        task = progress.add_task(f"audit {run_dir}", total=n_per * len(ckpts))
        for step, path, final in ckpts:
            _, w = ckio.read_weights(path, lm.model.n_params)
            lm.model.load_weights(w)
            samples = sample_checkpoint(lm.model, lm.tokenizer, prompts, settings, progress, task)
            label = path.relative_to(run_dir).as_posix() if path.is_relative_to(run_dir) else path.as_posix()
            checkpoints.append({"path": label, "step": int(step), "final": final,
                                "summary": summarize(samples), "samples": samples})
    final = checkpoints[-1]
    audit = {
        "format": FORMAT, "run": args.run, "tokenizer_sha256": lm.tokenizer.sha256, "seed": settings.seed,
        "backend": be.name,
        "options": dataclasses.asdict(settings.audit),
        "max_repeat": dataclasses.asdict(settings.coherence.max_repeat),
        "domains": sorted({p.domain for p in prompts}), "n_prompts": len(prompts),
        "checkpoints": checkpoints,
        "final": {"step": final["step"], "summary": final["summary"]["all"],
                  "by_domain": {k: v for k, v in final["summary"].items() if k != "all"}},
        "flags": [{"step": final["step"], "id": s["id"], "domain": s["domain"], "sample": s["sample"], "flags": s["flags"]}
                  for s in final["samples"] if s["flags"]],
        "training": training_summary(run_dir),
    }
    atomic_write_json(out / "audit.json", audit)
    atomic_write_text(out / "audit.md", render_md(audit))
    s = audit["final"]["summary"]
    console.print(f"audit: {len(ckpts)} checkpoint(s), final step {final['step']}: {s['n_flagged']}/{s['n_samples']} "
                  f"samples flagged; mean trigram repeat {s['trigram']:.3f}, distinct-2 {s['distinct_2']:.3f} "
                  f"-> {out / 'audit.json'}, {out / 'audit.md'}")
    return 0

