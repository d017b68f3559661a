"""Atomic writes never leave a torn or half-written result; token shards round-trip and a
damaged shard is refused with an error naming the file.

    pytest tests/test_fsutil_shards.py
"""

from __future__ import annotations

import numpy as np
import pytest

from andrea.errors import AndreaError
from andrea.fsutil import atomic_dir, atomic_open, atomic_write_json, sha256_file
from andrea.shards import HEADER, Shard, ShardWriter


def test_atomic_write_keeps_old_file_on_error(tmp_path):
    target = tmp_path / "result.json"
    atomic_write_json(target, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_open(target, "w") as f:
            f.write('{"v": 2')
            raise RuntimeError("crash mid-write")
    assert target.read_text() == '{\n "v": 1\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_atomic_dir_replaces_whole_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out) as d:
        (d / "a.txt").write_text("first")
    with pytest.raises(ValueError):
        with atomic_dir(out) as d:
            (d / "b.txt").write_text("partial")
            raise ValueError("stage failed")
    assert sorted(p.name for p in out.iterdir()) == ["a.txt"]
    with atomic_dir(out) as d:
        (d / "c.txt").write_text("second")
    assert sorted(p.name for p in out.iterdir()) == ["c.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_sha256_file(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(b"abc")
    assert sha256_file(p) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


@pytest.mark.parametrize("vocab", [300, 70000])
def test_shard_round_trip(tmp_path, vocab):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab - 1, size=n) for n in (5, 0, 17, 1)]
    path = tmp_path / "train" / "src.bin"
    with ShardWriter(path, vocab_size=vocab, eot_id=vocab - 1) as w:
        for d in docs:
            w.add(d)
    s = Shard(path)
    assert (s.n_docs, s.n_tokens, s.vocab_size) == (4, sum(map(len, docs)) + 4, vocab)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(s.doc(i), np.append(d, vocab - 1))
    assert s.tokens.dtype == (np.uint16 if vocab <= 65536 else np.uint32)


def test_shard_writer_aborts_cleanly(tmp_path):
    path = tmp_path / "s.bin"
    with pytest.raises(AndreaError, match="outside"):
        with ShardWriter(path, vocab_size=10, eot_id=9) as w:
            w.add([1, 2])
            w.add([10])
    assert list(tmp_path.iterdir()) == []


def test_damaged_shards_are_refused(tmp_path):
    path = tmp_path / "s.bin"
    with ShardWriter(path, vocab_size=10, eot_id=9) as w:
        w.add([1, 2, 3])
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    with pytest.raises(AndreaError, match=r"s.bin: size 85 != 88 .*truncated"):
        Shard(path)
    path.write_bytes(b"NOTASHRD" + data[8:])
    with pytest.raises(AndreaError, match="bad magic"):
        Shard(path)
    path.write_bytes(data[: HEADER.size - 1])
    with pytest.raises(AndreaError, match="too short"):
        Shard(path)
    with pytest.raises(AndreaError, match="not found"):
        Shard(tmp_path / "missing.bin")


def test_results_have_ordinary_permissions(tmp_path):
    import os
    umask = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "out") as d:
            (d / "a").write_text("x")
        atomic_write_json(tmp_path / "r.json", {})
        with ShardWriter(tmp_path / "s.bin", vocab_size=10, eot_id=9) as w:
            w.add([1])
    finally:
        os.umask(umask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "s.bin").stat().st_mode & 0o777 == 0o644
