"""Chat with a checkpoint in ANDREA's chat template: ``andrea chat``.

    andrea chat --profile tiny --run runs/tiny/main --tokenizer data/tokenizer/tiny/tokenizer.json
    printf 'What does len do?\\nAnd print?\\n' | andrea chat --profile tiny --run runs/tiny/main --tokenizer ...

Each line you type is a human turn; the conversation so far is rendered with
``andrea.data.template.render_prompt`` and the model's answer is sampled until the
template's end tag (or another role tag, or end-of-text, or ``--max-new-tokens``). The
answer joins the conversation as a gpt turn. When the rendered conversation no longer
fits the context (minus room for the answer), the oldest exchanges are dropped (a system
prompt is kept). Commands: ``/reset`` forgets the conversation, ``/system TEXT`` sets
the system prompt, ``/quit`` (or end of input) leaves. With input from a pipe, each line
is echoed as ``you: ...`` so the output reads as a transcript (an answer's further lines
are indented). Sampling options default
to the params' ``audit`` section; ``--seed`` makes a session reproducible.
"""

from __future__ import annotations

import sys

import numpy as np

from andrea.generate import add_sampling_arguments, generate, load_model, options_from
from andrea.reports.audit import answer_stops


def add_arguments(p) -> None:
    p.add_argument("--run", required=True, help="run folder (holding model.bin) or a checkpoint file")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json the run was trained with")
    p.add_argument("--system", default=None, help="system prompt for the conversation")
    add_sampling_arguments(p)


def fit_turns(turns: list[dict], tok, budget: int) -> list[dict]:
    """The latest turns whose rendered prompt fits ``budget`` tokens (a system turn is kept)."""
    from andrea.data.template import render_prompt

    system = [t for t in turns[:1] if t["from"] == "system"]
    body = turns[len(system):]
    while body:
        if len(tok.encode(render_prompt(system + body))) <= budget:
            return system + body
        body = body[2:] if len(body) > 1 else []          # drop the oldest human/gpt exchange
    return system + turns[-1:]


def run(args, cfg) -> int:
    from dataclasses import replace

    from andrea.data.template import render_prompt
    from andrea.backends import select_backend

    be, _ = select_backend(args.backend or cfg["train"]["backend"])
    lm = load_model(args.run, args.tokenizer, cfg, be)
    tok = lm.tokenizer
    opts = replace(options_from(args, cfg["audit"]), stop_strings=answer_stops())
    rng = np.random.default_rng(cfg["seed"] if args.seed is None else args.seed)
    budget = max(8, lm.config.context - opts.max_new_tokens)
    interactive = sys.stdin.isatty()
    system = args.system
    turns: list[dict] = []
    out = sys.stdout
    out.write(f"andrea chat: {lm.checkpoint} (step {lm.step}, {lm.model.n_params:,} parameters); "
              "/reset, /system TEXT, /quit\n")
    out.flush()
    while True:
        if interactive:
            out.write("you> ")
            out.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if not interactive:
            out.write(f"you: {line}\n")
        if line.strip() == "/quit":
            break
        if line.strip() == "/reset":
            turns = []
            out.write("(conversation cleared)\n")
            continue
        if line.startswith("/system"):
            system = line[len("/system"):].strip() or None
            turns = []
            out.write(f"(system prompt {'set' if system else 'cleared'}; conversation cleared)\n")
            continue
        convo = ([{"from": "system", "value": system}] if system else []) + turns + [{"from": "human", "value": line}]
        convo = fit_turns(convo, tok, budget)
        g = generate(lm.model, tok.encode(render_prompt(convo)), opts, rng, eot_id=tok.eot_id, tokenizer=tok)
        answer = g.text.strip() if g.text is not None else ""
        out.write("andrea: " + answer.replace("\n", "\n        ") + "\n")   # continuation lines indented
        out.flush()
        turns = [t for t in convo if t["from"] != "system"] + [{"from": "gpt", "value": answer or " "}]
    return 0
