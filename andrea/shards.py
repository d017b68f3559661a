"""Token shards: the headered binary files diet-alignment writes and training reads.

One file per (split, source): ``data/tokens/<variant>/<split>/<source>.bin``.

Layout, little-endian::

    [0:8)    magic  b"ANDRTOK\\x00"
    [8:12)   u32    format version (1)
    [12:16)  u32    dtype code (1 = uint16, 2 = uint32)
    [16:24)  u64    n_tokens
    [24:32)  u64    n_docs
    [32:36)  u32    vocab_size
    [36:64)         zero padding
    [64: ...)       n_tokens token ids of the dtype
    then            (n_docs + 1) u64 document offsets; document i is tokens[off[i]:off[i+1]]

Each document is stored followed by the end-of-text id, so concatenating documents
needs no separator. Written through a temp file and renamed: never torn.

    with ShardWriter(path, vocab_size=4353, eot_id=4352) as w:
        w.add(ids)                       # one document, without its EOT
    s = Shard(path); s.doc(0); s.tokens  # memory-mapped
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

import numpy as np

from andrea.errors import AndreaError
from andrea.fsutil import ordinary_mode

MAGIC = b"ANDRTOK\x00"
VERSION = 1
HEADER = struct.Struct("<8sIIQQI28x")
assert HEADER.size == 64
DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}


def dtype_for(vocab_size: int) -> tuple[int, np.dtype]:
    return (1, DTYPES[1]) if vocab_size <= 1 << 16 else (2, DTYPES[2])


class ShardWriter:
    """Stream documents into a shard; the file appears (atomically) on ``close()``."""

    def __init__(self, path: str | Path, vocab_size: int, eot_id: int):
        self.path = Path(path)
        self.vocab_size, self.eot_id = int(vocab_size), int(eot_id)
        if not 0 <= self.eot_id < self.vocab_size:
            raise AndreaError(f"{self.path}: eot_id {eot_id} outside vocab of {vocab_size}")
        self.code, self.dtype = dtype_for(self.vocab_size)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        ordinary_mode(self._tmp)
        self._f = os.fdopen(fd, "wb")
        self._f.write(b"\0" * HEADER.size)
        self._offsets = [0]
        self._eot = np.array([self.eot_id], dtype=self.dtype)

    def add(self, ids) -> None:
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise AndreaError(f"{self.path}: document {len(self._offsets) - 1} has ids outside [0, {self.vocab_size})")
        self._f.write(arr.astype(self.dtype, copy=False).tobytes())
        self._f.write(self._eot.tobytes())
        self._offsets.append(self._offsets[-1] + arr.size + 1)

    @property
    def n_tokens(self) -> int:
        return self._offsets[-1]

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.write(np.asarray(self._offsets, dtype="<u8").tobytes())
        self._f.seek(0)
        self._f.write(HEADER.pack(MAGIC, VERSION, self.code, self.n_tokens, len(self._offsets) - 1, self.vocab_size))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, *_):
        self.abort() if exc_type else self.close()


class Shard:
    """A memory-mapped shard: ``tokens`` (n_tokens,), ``offsets`` (n_docs + 1,)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(HEADER.size)
        except FileNotFoundError:
            raise AndreaError(f"{self.path}: token shard not found") from None
        if len(head) < HEADER.size:
            raise AndreaError(f"{self.path}: too short for a token shard header ({size} bytes)")
        magic, version, code, n_tokens, n_docs, vocab = HEADER.unpack(head)
        if magic != MAGIC:
            raise AndreaError(f"{self.path}: not a token shard (bad magic {magic!r})")
        if version != VERSION or code not in DTYPES:
            raise AndreaError(f"{self.path}: unsupported shard version {version} / dtype code {code}")
        dt = DTYPES[code]
        expect = HEADER.size + n_tokens * dt.itemsize + (n_docs + 1) * 8
        if size != expect:
            raise AndreaError(f"{self.path}: size {size} != {expect} expected from its header (truncated?)")
        self.vocab_size, self.n_tokens, self.n_docs = vocab, n_tokens, n_docs
        self.tokens = np.memmap(self.path, dtype=dt, mode="r", offset=HEADER.size, shape=(n_tokens,))
        self.offsets = np.memmap(self.path, dtype="<u8", mode="r", offset=HEADER.size + n_tokens * dt.itemsize,
                                 shape=(n_docs + 1,))

    def doc(self, i: int) -> np.ndarray:
        """Document ``i`` including its trailing end-of-text id."""
        return self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])]

    def __len__(self) -> int:
        return self.n_docs
