"""The Harris morpheme tokenizer (see ``harris.py``) and how to load a trained one.

    from andrea.tokenizer import load
    tok = load("data/tokenizer/tiny/tokenizer.json")
    ids = tok.encode("hello")          # np.ndarray int32 (T,); ids 0-255 are bytes
    tok.decode(ids) == "hello"; tok.vocab_size == 256 + N + 1; tok.eot_id == tok.vocab_size - 1
    tok.token_bytes(ids[0]); tok.sha256   # sha256 of tokenizer.json

Train one with ``andrea tokenizer --train data/megachat/<corpus>/train.parquet --out data/tokenizer/<variant>``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from andrea.errors import AndreaError
from andrea.tokenizer.harris import FORMAT, Tokenizer

__all__ = ["FORMAT", "Tokenizer", "load"]


def load(path: str | Path) -> Tokenizer:
    """Read a tokenizer.json; if a ``tokenizer.json.sha256`` sits beside it, it must match."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise AndreaError(f"{path}: tokenizer not found (run `andrea tokenizer` first)") from None
    digest = hashlib.sha256(raw).hexdigest()
    side = path.with_name(path.name + ".sha256")
    if side.is_file():
        recorded = side.read_text(encoding="utf-8").split()[:1]
        if recorded != [digest]:
            raise AndreaError(f"{path}: sha256 {digest} does not match {side} ({recorded[0] if recorded else 'empty'})")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AndreaError(f"{path}: not valid JSON: {e}") from None
    return Tokenizer.from_json(obj, where=str(path), sha256=digest)
