"""Chat with a checkpoint in ANDREA's chat template: ``andrea chat``.

    andrea chat runs/tiny/main
    printf 'What does len do?\\nAnd print?\\n' | andrea chat runs/tiny/main --seed 1

The profile and tokenizer come from the run folder (``model.state.json``'s config, and
``data/tokenizer/<variant>/tokenizer.json`` checked by the recorded sha256); ``--profile``
and ``--tokenizer`` override them. Each line you type is a human turn; the conversation so
far is rendered with ``andrea.data.template.render_prompt`` and the answer is sampled until
the template's end tag (or another role tag, or end-of-text, or the token limit), printed
token by token as it is made (``AnswerStream``: only whole characters, never a piece of a
stop tag, the answer stripped of leading/trailing space). It joins the conversation as a
gpt turn. When the conversation no longer fits the context (minus room for the answer),
the oldest exchanges are dropped (a system prompt is kept). At a terminal, input has line
editing and history (readline). With input from a pipe, each line is echoed as
``you: ...`` so the output reads as a transcript (an answer's further lines are indented).
Sampling options default to the params' ``audit`` section (as ``sample``, the audit and the
export's generation_config.json); ``--seed`` makes a session reproducible. Commands:
"""

from __future__ import annotations

import codecs
import sys
from dataclasses import replace

import numpy as np

from andrea.errors import AndreaError
from andrea.generate import (add_decode_arguments, add_run_arguments, add_sampling_arguments, fast_model, generate,
                             load_model, options_from, resolve_run)
from andrea.reports.audit import answer_stops

COMMANDS = {
    "/help": "list these commands",
    "/reset": "forget the conversation",
    "/system TEXT": "set the system prompt (no TEXT: clear it); forgets the conversation",
    "/temp T": "sampling temperature (0 = greedy)",
    "/top_k K": "keep the K most likely tokens (0 = no cut)",
    "/top_p P": "nucleus: the most likely tokens reaching mass P (1 = no cut)",
    "/max N": "at most N new tokens per answer",
    "/seed S": "restart the sampling RNG from seed S",
    "/settings": "show the sampling options",
    "/quit": "leave (end of input too)",
}
__doc__ += "\n" + "\n".join(f"    {k:<14} {v}" for k, v in COMMANDS.items()) + "\n"
INDENT = " " * len("andrea: ")


def add_arguments(p) -> None:
    add_run_arguments(p)
    p.add_argument("--system", default=None, help="system prompt for the conversation")
    add_sampling_arguments(p)
    add_decode_arguments(p)


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


class AnswerStream:
    """Writes an answer while its tokens arrive, so that what is written is always a prefix
    of the final answer (``generate``'s text, cut at the stop string, stripped): an incomplete
    UTF-8 character, a tail that could still become a stop string, and whitespace not yet
    followed by a visible character are held back. New lines are indented by ``indent``."""

    def __init__(self, tokenizer, stops, write, indent: str = INDENT):
        self.tok, self.stops, self.write, self.indent = tokenizer, [s for s in stops if s], write, indent
        self.dec = codecs.getincrementaldecoder("utf-8")("andrea-harris")
        self.text = ""            # decoded so far
        self.written = ""         # the prefix of the stripped answer written so far
        self.chunks = 0           # writes made (the answer streamed in this many pieces)

    def _emit(self, upto: str) -> None:
        if len(upto) > len(self.written):
            self.write(upto[len(self.written):].replace("\n", "\n" + self.indent))
            self.written = upto
            self.chunks += 1

    def feed(self, token_id: int) -> None:
        self.text += self.dec.decode(self.tok.token_bytes(token_id))
        text = self.text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            text = text[:min(hits)]
        else:
            hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        self._emit(text.strip())

    def finish(self, answer: str) -> None:
        """Write the rest of the final ``answer`` (stripped)."""
        answer = answer.strip()
        if answer.startswith(self.written):
            self._emit(answer)
        else:                      # cannot happen by construction; never lose the answer
            self.write("\n" + self.indent + answer.replace("\n", "\n" + self.indent))


def _set_option(opts, cmd: str, arg: str):
    """The sampling options with one field changed by a /command (AndreaError on a bad value)."""
    field, kind = {"/temp": ("temperature", float), "/top_k": ("top_k", int), "/top_p": ("top_p", float),
                   "/max": ("max_new_tokens", int)}[cmd]
    try:
        value = kind(arg)
    except ValueError:
        raise AndreaError(f"{cmd}: expected a number, got {arg!r}") from None
    return replace(opts, **{field: value})


def _read_line(interactive: bool, out) -> str | None:
    if interactive:
        try:
            return input("you> ")
        except EOFError:
            out.write("\n")
            return None
    line = sys.stdin.readline()
    return line.rstrip("\n") if line else None


def run(args, cfg) -> int:
    from andrea.backends import select_backend
    from andrea.data.template import render_prompt

    run_path, cfg, tok_path = resolve_run(args, cfg)
    be, _ = select_backend(args.backend or cfg["train"]["backend"])
    lm = fast_model(load_model(run_path, tok_path, cfg, be), be, args.decode_precision)
    tok = lm.tokenizer
    opts = replace(options_from(args, cfg["audit"]), stop_strings=answer_stops())
    seed = cfg["seed"] if args.seed is None else args.seed
    rng = np.random.default_rng(seed)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (input() gets line editing and history)
        except ImportError:
            pass
    system = args.system
    turns: list[dict] = []
    out = sys.stdout
    out.write(f"andrea chat: {lm.checkpoint} (step {lm.step}, {lm.model.n_params:,} parameters); /help for commands\n")
    out.flush()
    while True:
        line = _read_line(interactive, out)
        if line is None:
            break
        if not line.strip():
            continue
        if not interactive:
            out.write(f"you: {line}\n")
        cmd, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if cmd in ("/quit", "/exit"):
            break
        if cmd.startswith("/"):
            if cmd == "/help":
                out.write("".join(f"  {k:<14} {v}\n" for k, v in COMMANDS.items()))
            elif cmd == "/reset":
                turns = []
                out.write("(conversation cleared)\n")
            elif cmd == "/system":
                system, turns = (arg or None), []
                out.write(f"(system prompt {'set' if system else 'cleared'}; conversation cleared)\n")
            elif cmd in ("/temp", "/top_k", "/top_p", "/max"):
                try:
                    opts = _set_option(opts, cmd, arg)
                    out.write(f"(temperature {opts.temperature}, top_k {opts.top_k}, top_p {opts.top_p}, "
                              f"max {opts.max_new_tokens})\n")
                except AndreaError as e:
                    out.write(f"({e})\n")
            elif cmd == "/seed":
                try:
                    seed = int(arg)
                    rng = np.random.default_rng(seed)
                    out.write(f"(seed {seed})\n")
                except ValueError:
                    out.write(f"(/seed: expected an integer, got {arg!r})\n")
            elif cmd == "/settings":
                out.write(f"(temperature {opts.temperature}, top_k {opts.top_k}, top_p {opts.top_p}, "
                          f"max {opts.max_new_tokens}, seed {seed}, system {system!r})\n")
            else:
                out.write(f"(unknown command {cmd}; /help lists them)\n")
            out.flush()
            continue
        budget = max(8, lm.config.context - opts.max_new_tokens)
        convo = ([{"from": "system", "value": system}] if system else []) + turns + [{"from": "human", "value": line}]
        convo = fit_turns(convo, tok, budget)
        out.write("andrea: ")
        out.flush()

        def write(s):
            out.write(s)
            out.flush()

        stream = AnswerStream(tok, opts.stop_strings, write)
        g = generate(lm.model, tok.encode(render_prompt(convo)), opts, rng, eot_id=tok.eot_id, tokenizer=tok,
                     on_token=stream.feed)
        answer = (g.text or "").strip()
        stream.finish(answer)
        out.write("\n")
        out.flush()
        turns = [t for t in convo if t["from"] != "system"] + [{"from": "gpt", "value": answer or " "}]
    return 0
