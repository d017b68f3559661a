"""The Harris morpheme tokenizer: distributional segmentation by successor variety.

Training (Zellig Harris, "From phoneme to morpheme", 1955; Hafer & Weiss 1974):

1. Text is pre-split by ``PRETOKEN_PATTERN`` into words (a ``<|tag|>``, a letter run, up
   to three digits, a punctuation run, an underscore run -- each with at most one leading
   space -- or a whitespace run). Word counts are streamed: only the ``Counter`` of
   distinct words is kept, pruned of its rarest entries whenever it grows past
   ``max_word_types``.
2. For the letter words seen at least ``min_count`` times (their "core", without the
   leading space) the successor variety SV(p) -- how many distinct characters (or the
   end of the word) follow the prefix p among word types -- and the predecessor variety
   PV(s) -- how many distinct characters (or the start) precede the suffix s -- are
   counted. A morpheme boundary lies after position i of a word where SV rises
   (SV(w[:i]) > SV(w[:i-1]): a stem just ended) while PV, read from the right, rises too
   (PV(w[i:]) > PV(w[i+1:]): an affix starts; see ``segment``): ``walking`` -> ``walk|ing``,
   ``returns`` -> ``return|s``, ``documented`` -> ``document|ed``.
3. Every word type is cut at those boundaries (non-letter words stay whole); the first
   piece keeps the word's leading space. Pieces are counted, weighted by word frequency,
   and scored by the bytes they save over byte fallback: ``count * (len(utf8) - 1)``.
   The N best (ties by their bytes) are the first vocabulary.
4. Refinement (``refine_rounds``): every counted word is encoded with the vocabulary by
   the encoder below, which gives each morpheme's exact use; the 10% that save the
   fewest bytes give way to the next candidates; the round whose vocabulary encodes the
   counted text in the fewest tokens wins. Its morphemes, by bytes saved, become ids
   256..256+N-1 above the 256 byte ids; id 256+N is end-of-text: ``vocab_size = 256 + N + 1``.

Encoding: each word is cut into the fewest tokens by dynamic programming over the
morpheme vocabulary, with every single byte always available (byte fallback), so any
``str`` round-trips exactly (UTF-8 with ``surrogatepass``: lone surrogates too). Ties go to
the longest first token, so encoding is deterministic. Encoded words are cached; the
per-text cost is one regex pass, one dict lookup per word and one flatten.

    from andrea.tokenizer.harris import train_ranking, Tokenizer
    ranking = train_ranking(texts, max_morpheme_len=16, min_count=5)
    tok = Tokenizer.from_ranking(ranking, n_morphemes=4096, refine_rounds=4)
    ids = tok.encode("walking home")   # np.ndarray int32 (T,)
    assert tok.decode(ids) == "walking home"
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from typing import Callable, Iterable

import numpy as np

from andrea.errors import AndreaError

FORMAT = "andrea.tokenizer/1"
N_BYTES = 256
# Covers every character: a markup tag ``<|name|>`` (the chat template's) whole, letters (\w
# minus digits and "_"), 1-3 digits, punctuation (neither word nor space; a run never
# swallows a "<", which starts its own run so that a tag after punctuation stays whole),
# "_" runs, whitespace runs (the last space of a run joins the next word).
PRETOKEN_PATTERN = r"<\|[a-z_]{1,16}\|>| ?[^\W\d_]+| ?\d{1,3}| ?[^\w\s<]+| ?<[^\w\s<]*| ?_+|\s+(?!\S)|\s+"
_LETTER_RE = re.compile(r"[^\W\d_]+\Z")
HARRIS_MAX_CORE = 64        # longer letter runs are not segmented (no candidate comes from them)
CACHE_MAX_WORD = 256        # longer words are encoded every time, never cached
CACHE_MAX_ENTRIES = 1 << 20  # the word cache is cleared when it grows past this


def _decode_error(exc: UnicodeDecodeError):
    """Decode handler: encoded surrogates come back (round trip); other bad bytes become U+FFFD."""
    try:
        return codecs.lookup_error("surrogatepass")(exc)
    except UnicodeDecodeError:
        return "\ufffd", exc.start + 1


codecs.register_error("andrea-harris", _decode_error)


def utf8(s: str) -> bytes:
    return s.encode("utf-8", "surrogatepass")


# ----------------------------------------------------------------------------- training


class WordCounter:
    """Streaming word counts: memory is bounded by ``max_types`` distinct words.

    When the counter passes ``max_types`` entries, the words at or below the count that
    would leave at most half of them are dropped (lossy counting: a word's count is then
    a lower bound; frequent words are unaffected).
    """

    def __init__(self, max_types: int = 2_000_000):
        self.pattern = re.compile(PRETOKEN_PATTERN)
        self.counts: Counter[str] = Counter()
        self.max_types = int(max_types)
        self.n_bytes = 0
        self.n_docs = 0
        self.n_pruned = 0

    def add(self, text: str) -> None:
        self.counts.update(self.pattern.findall(text))
        self.n_bytes += len(utf8(text))
        self.n_docs += 1
        if len(self.counts) > self.max_types:
            self._prune()

    def _prune(self) -> None:
        hist = Counter(self.counts.values())
        keep_target, kept, cut = self.max_types // 2, len(self.counts), 0
        for c in sorted(hist):
            if kept <= keep_target:
                break
            kept -= hist[c]
            cut = c
        drop = [w for w, c in self.counts.items() if c <= cut]
        for w in drop:
            del self.counts[w]
        self.n_pruned += len(drop)


def _strict_utf8(s: str) -> bool:
    """No lone surrogates: a morpheme must be writable to tokenizer.json as UTF-8."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _core(word: str) -> tuple[bool, str]:
    return (True, word[1:]) if word[:1] == " " and len(word) > 1 else (False, word)


def varieties(types: Iterable[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Successor variety of every prefix and predecessor variety of every suffix.

    ``sv[p]`` = number of distinct characters (the end of word counts as one) that follow
    the prefix ``p`` among ``types``; ``pv[s]`` likewise for what precedes the suffix ``s``.
    Uses "\\0" as the word-boundary mark, so types must not contain it.
    """
    prefixes: set[str] = set()
    suffixes: set[str] = set()
    for w in types:
        we, sw = w + "\0", "\0" + w
        n = len(we)
        prefixes.update(we[:i] for i in range(1, n + 1))
        suffixes.update(sw[i:] for i in range(n))
    sv = Counter(p[:-1] for p in prefixes)
    pv = Counter(s[1:] for s in suffixes)
    return dict(sv), dict(pv)


def segment(word: str, sv: dict[str, int], pv: dict[str, int]) -> list[str]:
    """Cut ``word`` where successor variety rises and predecessor variety falls.

    A cut after ``word[:i]`` needs SV(word[:i]) > SV(word[:i-1]) (more ways to go on after
    the longer prefix: a stem just ended), PV(word[i:]) >= 3 (the rest is reached from
    several stems) and PV(word[i:]) > PV(word[i+1:]) (more ways to reach the suffix than the
    shorter one: an affix begins here). That last test is skipped when the shorter suffix
    is a single letter, whose PV (nearly every letter precedes it) says nothing. No cut
    leaves a one-letter first piece; a one-letter last piece needs SV >= 3 before it.
    ``walking`` -> ``walk|ing``, ``documented`` -> ``document|ed``.
    """
    n = len(word)
    if n <= 2:
        return [word]
    get_s, get_p = sv.get, pv.get
    s = [get_s(word[:i], 0) for i in range(n)]
    p = [get_p(word[i:], 0) for i in range(n)] + [0]
    out, j = [], 0
    for i in range(2, n):
        shorter = p[i + 1] if i + 1 <= n - 2 else 0
        if s[i] > s[i - 1] and p[i] >= 3 and p[i] > shorter and (i < n - 1 or s[i] >= 3):
            out.append(word[j:i])
            j = i
    out.append(word[j:])
    return out


@dataclass
class Ranking:
    """Candidate morphemes, best first, with what training saw."""

    morphemes: list[str]
    counts: list[int]
    scores: list[int]
    n_frequent: int              # how many candidates reach min_count (the rest are relaxed)
    stats: dict = field(default_factory=dict)
    word_counts: Counter | None = field(default=None, repr=False)  # what training counted (for selection)


def rank_candidates(counts: Counter, max_morpheme_len: int, min_count: int,
                    progress: Callable[[str], None] | None = None) -> Ranking:
    """Harris-segment the counted words and rank the pieces by bytes saved."""
    cores: Counter[str] = Counter()
    for w, c in counts.items():
        cores[_core(w)[1]] += c
    types = [w for w, c in cores.items()
             if c >= min_count and len(w) <= HARRIS_MAX_CORE and "\0" not in w and _LETTER_RE.match(w)]
    if progress:
        progress(f"varieties over {len(types)} word types")
    sv, pv = varieties(types)
    if progress:
        progress(f"segmenting {len(cores)} word cores")
    pieces_of: dict[str, list[str]] = {}
    cand: Counter[str] = Counter()
    for w, c in counts.items():
        spaced, core = _core(w)
        pieces = pieces_of.get(core)
        if pieces is None:
            if len(core) <= HARRIS_MAX_CORE and "\0" not in core and _LETTER_RE.match(core):
                pieces = segment(core, sv, pv)
            else:
                pieces = [core]
            pieces_of[core] = pieces
        first = " " + pieces[0] if spaced else pieces[0]
        cand[first] += c
        for p in pieces[1:]:
            cand[p] += c
    scored = []
    for m, c in cand.items():
        nb = len(utf8(m))
        if nb >= 2 and len(m) <= max_morpheme_len and _strict_utf8(m):
            scored.append((c >= min_count, c * (nb - 1), utf8(m), m, c))
    scored.sort(key=lambda r: (not r[0], -r[1], r[2]))
    return Ranking(morphemes=[r[3] for r in scored], counts=[r[4] for r in scored],
                   scores=[r[1] for r in scored], n_frequent=sum(1 for r in scored if r[0]),
                   stats={"word_types": len(counts), "core_types": len(cores), "harris_types": len(types),
                          "candidates": len(scored)})


def train_ranking(texts: Iterable[str], max_morpheme_len: int = 16, min_count: int = 5,
                  max_word_types: int = 2_000_000, max_bytes: int | None = None,
                  progress: Callable[[str], None] | None = None) -> Ranking:
    """Stream ``texts`` (stopping after ``max_bytes``) into word counts, then rank candidates."""
    wc = WordCounter(max_word_types)
    for t in texts:
        if max_bytes is not None and wc.n_bytes >= max_bytes:
            break
        wc.add(t)
    r = rank_candidates(wc.counts, max_morpheme_len, min_count, progress)
    r.stats.update({"train_bytes": wc.n_bytes, "train_docs": wc.n_docs, "pruned_word_types": wc.n_pruned})
    r.word_counts = wc.counts
    return r


@dataclass
class Selection:
    """The N morphemes chosen, ordered by the bytes they save in the counted text."""

    morphemes: list[str]
    uses: list[int]              # occurrences of each in the encoded training words
    total_tokens: list[int]      # tokens of the whole counted text after each round (round 0: static top N)


def select_morphemes(ranking: Ranking, n: int, rounds: int = 0, swap: float = 0.1) -> Selection:
    """The ``n`` most useful candidates: the static top ``n``, then ``rounds`` of usage-based swaps.

    Each round encodes every counted word with the current vocabulary (the encoder's own
    dynamic program), so a morpheme's use is exact; the ``swap`` share that saves the
    fewest bytes gives way to the next candidates of the ranking. The vocabulary with the
    fewest tokens over the counted text wins (so a round never makes things worse).
    """
    if len(ranking.morphemes) < n:
        raise AndreaError(f"tokenizer: the training text yields only {len(ranking.morphemes)} candidate "
                          f"morphemes, fewer than tokenizer.n_morphemes={n}; give more text or a smaller N")
    vocab, nxt = list(ranking.morphemes[:n]), n
    items = list((ranking.word_counts or {}).items())
    if not items or rounds <= 0:
        return Selection(vocab, [0] * n, [])
    best: tuple[int, list[str], np.ndarray] | None = None
    totals = []
    for r in range(rounds + 1):
        tok = Tokenizer(vocab)
        ids_all: list[int] = []
        weights: list[int] = []
        total = 0
        for w, c in items:
            ids = tok._cache[w]
            ids_all.extend(ids)
            weights.extend([c] * len(ids))
            total += c * len(ids)
        use = np.bincount(np.asarray(ids_all, dtype=np.int64), weights=np.asarray(weights, dtype=np.float64),
                          minlength=tok.vocab_size)[N_BYTES:N_BYTES + n].astype(np.int64)
        totals.append(total)
        if best is None or total < best[0]:
            best = (total, vocab, use)
        k = min(max(1, int(n * swap)), len(ranking.morphemes) - nxt)
        if r == rounds or k <= 0:
            break
        saved = use * np.array([len(utf8(m)) - 1 for m in vocab], dtype=np.int64)
        order = sorted(range(n), key=lambda i: (int(saved[i]), utf8(vocab[i])))
        drop = set(order[:k])
        vocab = [m for i, m in enumerate(vocab) if i not in drop] + list(ranking.morphemes[nxt:nxt + k])
        nxt += k
    _, vocab, use = best
    saved = [int(u) * (len(utf8(m)) - 1) for m, u in zip(vocab, use)]
    order = sorted(range(n), key=lambda i: (-saved[i], utf8(vocab[i])))
    return Selection([vocab[i] for i in order], [int(use[i]) for i in order], totals)


# ----------------------------------------------------------------------------- encoding


class _WordCache(dict):
    """word -> tuple of ids; a miss encodes the word (and caches it when short)."""

    def __init__(self, encode_word: Callable[[str], tuple[int, ...]]):
        super().__init__()
        self._encode_word = encode_word

    def __missing__(self, word: str) -> tuple[int, ...]:
        ids = self._encode_word(word)
        if len(word) <= CACHE_MAX_WORD:
            if len(self) >= CACHE_MAX_ENTRIES:
                self.clear()
            self[word] = ids
        return ids


class Tokenizer:
    """Harris morpheme tokenizer: ids 0-255 bytes, 256..256+N-1 morphemes, 256+N end-of-text.

    ``encode(str) -> np.ndarray[int32] (T,)``, ``decode(ids) -> str``, ``vocab_size``,
    ``eot_id``, ``token_bytes(id)``, ``sha256`` (of the tokenizer.json it was loaded from,
    or of its canonical JSON when built in memory).
    """

    def __init__(self, morphemes: list[str], pattern: str = PRETOKEN_PATTERN,
                 meta: dict | None = None, sha256: str | None = None):
        self.morphemes = list(morphemes)
        self.n_morphemes = len(self.morphemes)
        self.vocab_size = N_BYTES + self.n_morphemes + 1
        self.eot_id = self.vocab_size - 1
        self.pattern = pattern
        self.meta = dict(meta or {})
        self._re = re.compile(pattern)
        self._bytes: list[bytes] = [bytes([i]) for i in range(N_BYTES)] + [utf8(m) for m in self.morphemes] + [b""]
        self._vocab: dict[bytes, int] = {}
        for i, b in enumerate(self._bytes[N_BYTES:-1], start=N_BYTES):
            if len(b) < 2 or b in self._vocab:
                raise AndreaError(f"tokenizer: morpheme id {i} ({b!r}) is shorter than 2 bytes or repeated")
            self._vocab[b] = i
        self._trie: dict = {}  # byte -> child node; key 256 holds the id of the morpheme ending here
        for b, i in self._vocab.items():
            node = self._trie
            for c in b:
                node = node.setdefault(c, {})
            node[N_BYTES] = i
        self._cache = _WordCache(self._encode_word)
        self._sha256 = sha256

    # -- construction / persistence
    @classmethod
    def from_ranking(cls, ranking: Ranking, n_morphemes: int, meta: dict | None = None,
                     refine_rounds: int = 0) -> "Tokenizer":
        """The tokenizer of the ``n_morphemes`` most useful candidates (see ``select_morphemes``)."""
        return cls(select_morphemes(ranking, n_morphemes, refine_rounds).morphemes, meta=meta)

    def to_json(self) -> dict:
        return {"format": FORMAT, "type": "harris-morpheme", "n_morphemes": self.n_morphemes,
                "vocab_size": self.vocab_size, "eot_id": self.eot_id, "byte_ids": [0, N_BYTES - 1],
                "text_encoding": "utf-8 (surrogatepass)", "pretokenizer": self.pattern,
                "encoder": "fewest tokens per pre-token by dynamic programming; ties -> longest first token",
                "morphemes": self.morphemes, **({"training": self.meta} if self.meta else {})}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), ensure_ascii=False, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, obj: dict, where: str = "tokenizer.json", sha256: str | None = None) -> "Tokenizer":
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise AndreaError(f"{where}: not an ANDREA tokenizer (format {obj.get('format') if isinstance(obj, dict) else None!r}, "
                              f"expected {FORMAT!r})")
        for key in ("n_morphemes", "vocab_size", "eot_id", "pretokenizer", "morphemes"):
            if key not in obj:
                raise AndreaError(f"{where}: missing key {key!r}")
        ms = obj["morphemes"]
        if not isinstance(ms, list) or not all(isinstance(m, str) for m in ms) or len(ms) != obj["n_morphemes"]:
            raise AndreaError(f"{where}: 'morphemes' must be a list of {obj['n_morphemes']} strings")
        tok = cls(ms, pattern=obj["pretokenizer"], meta=obj.get("training"), sha256=sha256)
        if tok.vocab_size != obj["vocab_size"] or tok.eot_id != obj["eot_id"]:
            raise AndreaError(f"{where}: vocab_size/eot_id {obj['vocab_size']}/{obj['eot_id']} disagree with "
                              f"256 + {tok.n_morphemes} + 1")
        return tok

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            self._sha256 = hashlib.sha256(self.dumps().encode("utf-8")).hexdigest()
        return self._sha256

    # -- encoding
    def _encode_word(self, word: str) -> tuple[int, ...]:
        """Fewest tokens for one pre-token (a walk of the morpheme trie from every byte);
        ties -> the longest first token."""
        b = utf8(word)
        n = len(b)
        root = self._trie
        best = [0] * (n + 1)
        pick = [0] * n
        for i in range(n - 1, -1, -1):
            cost, tid = best[i + 1] + 1, b[i]
            node, j = root.get(b[i]), i + 1
            while node is not None and j < n:
                node = node.get(b[j])
                j += 1
                if node is None:
                    break
                t = node.get(N_BYTES)
                if t is not None and best[j] + 1 <= cost:
                    cost, tid = best[j] + 1, t
            best[i], pick[i] = cost, tid
        out, i, tb = [], 0, self._bytes
        while i < n:
            t = pick[i]
            out.append(t)
            i += len(tb[t]) if t >= N_BYTES else 1
        return tuple(out)

    def encode_words(self, text: str) -> list[tuple[int, ...]]:
        """The pre-tokens of ``text``, each as its tuple of ids."""
        return list(map(self._cache.__getitem__, self._re.findall(text)))

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> int32 ids (T,); never emits the end-of-text id."""
        if not isinstance(text, str):
            raise AndreaError(f"tokenizer.encode: expected str, got {type(text).__name__}")
        words = self._re.findall(text)
        return np.fromiter(chain.from_iterable(map(self._cache.__getitem__, words)), dtype=np.int32)

    def token_bytes(self, i: int) -> bytes:
        """The bytes of id ``i`` (end-of-text: empty)."""
        if not 0 <= int(i) < self.vocab_size:
            raise AndreaError(f"tokenizer: id {i} outside [0, {self.vocab_size})")
        return self._bytes[int(i)]

    def decode_bytes(self, ids) -> bytes:
        arr = np.asarray(ids).ravel()
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = arr[(arr < 0) | (arr >= self.vocab_size)][0]
            raise AndreaError(f"tokenizer.decode: id {int(bad)} outside [0, {self.vocab_size})")
        return b"".join(map(self._bytes.__getitem__, arr.tolist()))

    def decode(self, ids) -> str:
        """ids -> text; the end-of-text id decodes to nothing; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", "andrea-harris")

    def __repr__(self) -> str:
        return f"Tokenizer(harris, N={self.n_morphemes}, vocab_size={self.vocab_size})"
