"""Token windows from one source's shard, with every document tracked one by one.

A ``SourceStream`` wraps one ``Shard`` (documents stored back to back, each followed by
its end-of-text id) and draws training windows of ``T + 1`` tokens from it:

    stream = SourceStream("py-topics", Shard("data/tokens/tiny/train/py-topics.bin"))
    w = stream.draw(rng, B=16, T=128, bonus=1.3)       # (B, T + 1) int64
    x, y = w[:, :-1], w[:, 1:]                        # (B, T) each; y is x shifted by one

Where a window starts: at a uniformly random token of the shard (so every token is
equally likely, as in plain next-token training), except that with a coverage
``bonus`` > 1 the tokens of documents not yet seen in the current pass weigh ``bonus``
times more than the tokens of seen ones. A window runs on across document boundaries
and wraps from the end of the shard to its start (a shard shorter than a window is
tiled).

Bookkeeping, all of it in ``state_dict()`` (JSON-able):
  * ``seen``: a bitset (one bit per document) of the documents any window has touched
    in the current coverage pass; when every document has been seen, the pass is
    complete (``passes`` + 1) and the bitset clears, so freshness means "not yet seen
    in this pass".
  * ``tokens_drawn``: training targets drawn (B * T per batch); ``epochs`` =
    tokens_drawn // n_tokens, the completed passes over the source's tokens, which is
    what the bandit's epoch penalty counts.

``sequential_windows`` gives the fixed, non-overlapping windows the evaluation uses.
No test runs this file directly: ``pytest tests/test_curriculum.py``.
"""

from __future__ import annotations

import base64

import numpy as np

from andrea.errors import AndreaError
from andrea.shards import Shard

# Rejection sampling of a start token inside one class (seen / unseen) is used while
# that class holds at least this share of the tokens; below it, an exact O(n_docs) draw.
_REJECT_MIN_SHARE = 1.0 / 32
_REJECT_TRIES = 256


class SourceStream:
    """One source: its shard, its document offsets and the per-document coverage state."""

    def __init__(self, name: str, shard: Shard):
        self.name = name
        self.shard = shard
        self.path = str(getattr(shard, "path", name))
        self.n_tokens = int(shard.n_tokens)
        self.n_docs = int(shard.n_docs)
        if self.n_docs < 1 or self.n_tokens < 1:
            raise AndreaError(f"{self.path}: source {name!r} has no documents; the curriculum cannot draw from it")
        self.tokens = shard.tokens
        self.offsets = np.asarray(shard.offsets, dtype=np.int64)  # (n_docs + 1,)
        if self.offsets[0] != 0 or self.offsets[-1] != self.n_tokens or np.any(np.diff(self.offsets) < 1):
            raise AndreaError(f"{self.path}: document offsets of source {name!r} are not increasing from 0 to n_tokens")
        self.doc_len = np.diff(self.offsets)  # (n_docs,)
        self.seen = np.zeros(self.n_docs, dtype=bool)
        self.n_seen = 0
        self.unseen_tokens = self.n_tokens
        self.passes = 0
        self.tokens_drawn = 0

    # ---- derived figures -------------------------------------------------------------
    @property
    def epochs(self) -> int:
        """Completed passes over the source's tokens."""
        return self.tokens_drawn // self.n_tokens

    @property
    def unseen_share(self) -> float:
        """Share of documents not yet seen in the current coverage pass."""
        return 1.0 - self.n_seen / self.n_docs

    def doc_of(self, pos) -> np.ndarray | int:
        """Index of the document holding token position(s) ``pos``."""
        return np.searchsorted(self.offsets, pos, side="right") - 1

    # ---- drawing ---------------------------------------------------------------------
    def draw(self, rng: np.random.Generator, B: int, T: int, bonus: float = 1.0) -> np.ndarray:
        """``B`` windows of ``T + 1`` tokens, (B, T + 1) int64; marks the documents they touch."""
        if B < 1 or T < 1:
            raise AndreaError(f"source {self.name!r}: batch size and context must be >= 1 (got B={B}, T={T})")
        span = np.arange(T + 1, dtype=np.int64)  # (T + 1,)
        out = np.empty((B, T + 1), dtype=np.int64)
        for b in range(B):
            start = self._start(rng, bonus)
            out[b] = self.tokens[(start + span) % self.n_tokens]
            self._mark(start, T + 1)
        self.tokens_drawn += B * T
        return out

    def _start(self, rng: np.random.Generator, bonus: float) -> int:
        unseen, n = self.unseen_tokens, self.n_tokens
        if bonus == 1.0 or unseen in (0, n):
            return int(rng.integers(n))
        seen_tok = n - unseen
        want_unseen = bool(rng.random() < bonus * unseen / (bonus * unseen + seen_tok))
        share = (unseen if want_unseen else seen_tok) / n
        if share >= _REJECT_MIN_SHARE:
            for _ in range(_REJECT_TRIES):
                p = int(rng.integers(n))
                if self.seen[self.doc_of(p)] != want_unseen:
                    return p
        docs = np.flatnonzero(self.seen != want_unseen)  # the class's documents
        lens = self.doc_len[docs]
        cum = np.cumsum(lens)
        r = int(rng.integers(cum[-1]))
        k = int(np.searchsorted(cum, r, side="right"))
        return int(self.offsets[docs[k]] + r - (cum[k] - lens[k]))

    def _mark(self, start: int, length: int) -> None:
        if length >= self.n_tokens:
            self._mark_range(0, self.n_docs)
            return
        end = start + length - 1  # last position, inclusive, before wrapping
        d0 = int(self.doc_of(start))
        if end < self.n_tokens:
            self._mark_range(d0, int(self.doc_of(end)) + 1)
        else:
            self._mark_range(d0, self.n_docs)
            self._mark_range(0, int(self.doc_of(end - self.n_tokens)) + 1)

    def _mark_range(self, a: int, b: int) -> None:
        fresh = ~self.seen[a:b]
        k = int(fresh.sum())
        if not k:
            return
        self.unseen_tokens -= int(self.doc_len[a:b][fresh].sum())
        self.seen[a:b] = True
        self.n_seen += k
        if self.n_seen == self.n_docs:  # a full coverage pass: freshness starts over
            self.passes += 1
            self.seen[:] = False
            self.n_seen = 0
            self.unseen_tokens = self.n_tokens

    # ---- state -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "n_docs": self.n_docs,
            "n_tokens": self.n_tokens,
            "tokens_drawn": self.tokens_drawn,
            "passes": self.passes,
            "seen": base64.b64encode(np.packbits(self.seen).tobytes()).decode("ascii"),
        }

    def load_state_dict(self, d: dict) -> None:
        try:
            n_docs, n_tokens = int(d["n_docs"]), int(d["n_tokens"])
            bits = np.frombuffer(base64.b64decode(d["seen"]), dtype=np.uint8)
            tokens_drawn, passes = int(d["tokens_drawn"]), int(d["passes"])
        except (KeyError, TypeError, ValueError) as e:
            raise AndreaError(f"curriculum state of source {self.name!r}: malformed ({e})") from None
        if (n_docs, n_tokens) != (self.n_docs, self.n_tokens):
            raise AndreaError(
                f"{self.path}: curriculum state of source {self.name!r} was made for {n_docs} documents / "
                f"{n_tokens} tokens, the shard has {self.n_docs} / {self.n_tokens}")
        seen = np.unpackbits(bits, count=self.n_docs).astype(bool) if bits.size * 8 >= self.n_docs else None
        if seen is None:
            raise AndreaError(f"curriculum state of source {self.name!r}: coverage bitset too short")
        self.seen = seen
        self.n_seen = int(seen.sum())
        self.unseen_tokens = int(self.doc_len[~seen].sum())
        self.tokens_drawn, self.passes = tokens_drawn, passes


def sequential_windows(shard: Shard, B: int, T: int, max_batches: int | None = None):
    """Fixed evaluation batches: consecutive, non-overlapping windows from the shard's start.

    Yields ``(x, y)`` int32 (b, T) pairs (b <= B on the last batch), y shifted by one;
    every target token is scored at most once. Stops after ``max_batches`` batches or
    when fewer than T + 1 tokens remain.
    """
    n = int(shard.n_tokens)
    n_win = (n - 1) // T
    if max_batches is not None:
        n_win = min(n_win, max_batches * B)
    span = np.arange(T + 1, dtype=np.int64)
    for i in range(0, n_win, B):
        starts = np.arange(i, min(i + B, n_win), dtype=np.int64) * T  # (b,)
        w = np.asarray(shard.tokens[starts[:, None] + span[None, :]], dtype=np.int64)  # (b, T + 1)
        yield w[:, :-1].astype(np.int32), w[:, 1:].astype(np.int32)
