"""The Harris morpheme tokenizer as a ``transformers`` tokenizer: shipped inside every
``andrea export`` folder, loaded with ``trust_remote_code=True``.

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained("exports/tiny", trust_remote_code=True)
    ids = tok("walking home")["input_ids"]           # the same ids as andrea.tokenizer's encode
    tok.decode(ids, skip_special_tokens=True)        # the text back

This file stands alone (no ``andrea`` import): it is copied verbatim next to the weights
and reads ``harris.json``, the run's ``tokenizer.json`` byte for byte. Encoding is the one
of ``andrea/tokenizer/harris.py``: the text is split by the file's pre-token regex, and
each pre-token (as UTF-8 with surrogatepass) is cut into the fewest tokens over the
morphemes, every single byte always available; ties go to the longest first token.
``tests/test_export.py`` checks the ids equal andrea's over the whole embedded val split.
Ids 0-255 are the bytes, then the morphemes, then end-of-text (``<|endoftext|>``, never
produced by encoding: special tokens are not parsed out of text, as in andrea).

Tokens are strings in the GPT-2 byte-to-unicode alphabet (one printable character per
byte), so every id has a distinct name; ``decode`` maps them back to bytes and decodes
UTF-8 as andrea does (surrogates come back, other invalid bytes become U+FFFD).
"""

from __future__ import annotations

import codecs
import json
import os
import re

from transformers import PreTrainedTokenizer

EOT = "<|endoftext|>"


def _decode_error(exc: UnicodeDecodeError):
    """As andrea's decoder: encoded surrogates come back; other bad bytes become U+FFFD."""
    try:
        return codecs.lookup_error("surrogatepass")(exc)
    except UnicodeDecodeError:
        return "\ufffd", exc.start + 1


codecs.register_error("andrea-harris-hf", _decode_error)


def _byte_alphabet() -> list[str]:
    """byte -> one printable character (GPT-2's table): printable Latin-1 maps to itself."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


class AndreaHarrisTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "harris.json"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, **kwargs):
        with open(vocab_file, encoding="utf-8") as f:
            spec = json.load(f)
        if spec.get("format") != "andrea.tokenizer/1":
            raise ValueError(f"{vocab_file}: not an ANDREA tokenizer (format {spec.get('format')!r})")
        self._pattern = re.compile(spec["pretokenizer"])
        morphemes = spec["morphemes"]
        self._bytes = [bytes([i]) for i in range(256)] + [m.encode("utf-8", "surrogatepass") for m in morphemes]
        self._alpha = _byte_alphabet()
        self._unalpha = {c: b for b, c in enumerate(self._alpha)}
        names = ["".join(self._alpha[c] for c in b) for b in self._bytes] + [EOT]
        if len(names) != spec["vocab_size"] or len(set(names)) != len(names):
            raise ValueError(f"{vocab_file}: vocab_size {spec['vocab_size']} or names disagree with the morphemes")
        self._names = names
        self._ids = {n: i for i, n in enumerate(names)}
        self._trie: dict = {}
        for i, b in enumerate(self._bytes[256:], start=256):
            node = self._trie
            for c in b:
                node = node.setdefault(c, {})
            node[256] = i
        self._cache: dict[str, tuple[int, ...]] = {}
        kwargs.setdefault("eos_token", EOT)
        kwargs.setdefault("bos_token", EOT)
        kwargs.setdefault("pad_token", EOT)
        kwargs.setdefault("split_special_tokens", True)       # text never yields end-of-text
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        self.vocab_file = vocab_file
        super().__init__(**kwargs)

    # -- the encoder (andrea/tokenizer/harris.py: Tokenizer._encode_word)
    def _encode_word(self, word: str) -> tuple[int, ...]:
        b = word.encode("utf-8", "surrogatepass")
        n = len(b)
        best = [0] * (n + 1)
        pick = [0] * n
        for i in range(n - 1, -1, -1):
            cost, tid = best[i + 1] + 1, b[i]
            node, j = self._trie.get(b[i]), i + 1
            while node is not None and j < n:
                node = node.get(b[j])
                j += 1
                if node is None:
                    break
                t = node.get(256)
                if t is not None and best[j] + 1 <= cost:
                    cost, tid = best[j] + 1, t
            best[i], pick[i] = cost, tid
        out, i = [], 0
        while i < n:
            t = pick[i]
            out.append(t)
            i += len(self._bytes[t]) if t >= 256 else 1
        return tuple(out)

    def encode_ids(self, text: str) -> list[int]:
        out: list[int] = []
        for w in self._pattern.findall(text):
            ids = self._cache.get(w)
            if ids is None:
                ids = self._encode_word(w)
                if len(w) <= 256:
                    self._cache[w] = ids
            out.extend(ids)
        return out

    # -- the PreTrainedTokenizer interface
    @property
    def vocab_size(self) -> int:
        return len(self._names)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._ids)

    def _tokenize(self, text, **kwargs):
        return [self._names[i] for i in self.encode_ids(text)]

    def _convert_token_to_id(self, token):
        return self._ids[token]

    def _convert_id_to_token(self, index):
        return self._names[index]

    def convert_tokens_to_string(self, tokens):
        data = bytearray()
        for t in tokens:
            if t == EOT:
                continue
            data += bytes(self._unalpha[c] for c in t)
        return bytes(data).decode("utf-8", "andrea-harris-hf")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        dst = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "harris.json")
        if os.path.abspath(dst) != os.path.abspath(self.vocab_file):
            with open(self.vocab_file, "rb") as src, open(dst, "wb") as out:
                out.write(src.read())
        return (dst,)
