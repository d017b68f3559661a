"""Preflight (andrea/preflight.py): a batch or context the shards cannot feed is refused before any work.

    pytest tests/test_reliability_input_preflight.py

Unit cases on shards written here with exact sizes, then ``andrea train`` as a real process:
``train.batch_size`` larger than a source, a context longer than some val shards (a warning
naming them, instead of their silent absence from the held-out loss) and than all of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from andrea.errors import ConfigError
from andrea.preflight import check_data, check_schedule
from andrea.shards import Shard, ShardWriter
from train_helpers import SOURCES, make_data, micro_overrides, run_cli


def shard(path: Path, n_tokens: int) -> Shard:
    """A shard of exactly ``n_tokens`` tokens (one document: n - 1 ids and its end-of-text)."""
    with ShardWriter(path, vocab_size=64, eot_id=63) as w:
        w.add(np.arange(n_tokens - 1) % 60)
    s = Shard(path)
    assert s.n_tokens == n_tokens
    return s


@pytest.fixture
def shards(tmp_path):
    def make(split: str, **sizes: int) -> dict[str, Shard]:
        return {k: shard(tmp_path / split / f"{k}.bin", n) for k, n in sizes.items()}
    return make


def test_what_fits_passes_without_a_word(shards):
    train = shards("train", a=1000, b=33 * 4)                 # b holds exactly one 4 x 33 microbatch
    val = shards("val", a=33, b=500)                          # a: exactly one window of 33
    assert check_data(train, val, batch_size=4, context=32) == []
    assert check_data(train, {}, batch_size=4, context=32) == []   # no val split at all is allowed


def test_a_batch_larger_than_a_source_is_refused_with_the_numbers(shards):
    train = shards("train", big=200_000, notes=5_000, tiny=3_000)
    with pytest.raises(ConfigError) as e:
        check_data(train, {}, batch_size=1000, context=128)
    msg = str(e.value)
    assert msg.startswith("train.batch_size=1000: one microbatch takes 1000 x (model.context+1=129) = 129,000 tokens")
    assert "train source tiny holds 3,000" in msg and "(and 1 more train source(s))" in msg
    assert "lower train.batch_size to at most 23" in msg                  # 3000 // 129
    assert check_data(train, {}, batch_size=23, context=128) == []       # and that indeed fits


def test_a_context_longer_than_a_train_source_is_refused(shards):
    train = shards("train", a=10_000, b=100)
    with pytest.raises(ConfigError, match=r"model.context=128: one training window is 129 tokens, but train source b "
                                          r"holds 100 .*at most 99"):
        check_data(train, {}, batch_size=1, context=128)


def test_val_shards_shorter_than_the_context_are_named_in_a_warning(shards):
    train = shards("train", a=10_000)
    val = shards("val", a=5_000, b=100, c=129, d=128)
    (w,) = check_data(train, val, batch_size=2, context=128)
    assert w == ("model.context=128: 2 of 4 val shards are shorter than one window of 129 tokens and are left out "
                 "of the held-out loss: b (100 tokens), d (128 tokens)")


def test_every_val_shard_shorter_than_the_context_is_refused(shards):
    train = shards("train", a=10_000)
    val = shards("val", a=50, b=100)
    with pytest.raises(ConfigError, match=r"every val shard is shorter than one window of 129 tokens "
                                          r"\(the longest, b, holds 100\).*at most 99"):
        check_data(train, val, batch_size=2, context=128)


# ----------------------------------------------------------------- through `andrea train`
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("preflight"))


def test_train_refuses_a_batch_larger_than_the_data_before_any_work(data, tmp_path):
    tok, tokens = data
    smallest = min(Shard(tokens / "train" / f"{s}.bin").n_tokens for s in SOURCES)
    B = smallest // 33 + 1                                       # one microbatch more than the smallest source
    r = run_cli("warmup", tok, tokens, tmp_path / "run", micro_overrides(5, 10, **{"train.batch_size": B}))
    assert r.returncode == 3, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"train.batch_size={B}" in lines[0] and f"at most {smallest // 33}" in lines[0]
    assert not (tmp_path / "run").exists()                       # nothing was started


def test_train_warns_about_val_shards_it_cannot_score(data, tmp_path):
    tok, tokens = data
    val = tmp_path / "tokens"
    for split in ("train", "val"):                               # the same data, one val shard cut to 20 tokens
        (val / split).mkdir(parents=True)
        for f in (tokens / split).glob("*.bin"):
            (val / split / f.name).write_bytes(f.read_bytes())
    short = Shard(tokens / "val" / "py-code.bin")
    with ShardWriter(val / "val" / "py-code.bin", short.vocab_size, int(short.tokens[short.n_tokens - 1])) as w:
        w.add(np.asarray(short.tokens[:19]))
    r = run_cli("warmup", tok, val, tmp_path / "run", micro_overrides(5, 10))
    assert r.returncode == 0, r.stderr
    assert "warning: model.context=32: 1 of 3 val shards are shorter than one window of 33 tokens" in r.stderr
    assert "py-code (20 tokens)" in r.stderr
    rec = json.loads((tmp_path / "run" / "model.loss.json").read_text())["val"][-1]
    assert sorted(rec["per_source"]) == ["chat-system", "py-topics"]     # what the warning said


def test_a_warmup_longer_than_half_the_run_is_a_warning_with_the_numbers():
    assert check_schedule(warmup_steps=50, max_steps=600) == []           # tiny's recipe: 8%
    assert check_schedule(warmup_steps=1500, max_steps=3000) == []        # exactly half: still quiet
    (w,) = check_schedule(warmup_steps=2000, max_steps=3000)              # the recipe's 2000 in a shortened run
    assert w.startswith("train.warmup_steps=2000 is 67% of train.max_steps=3000:") and "peaks at step 2000" in w
    assert w.endswith("(e.g. -S train.warmup_steps=60)")


def test_train_warns_when_the_lr_warmup_outlasts_half_the_run(data, tmp_path):
    tok, tokens = data
    r = run_cli("warmup", tok, tokens, tmp_path / "run", micro_overrides(5, 8, **{"train.warmup_steps": 6}))
    assert r.returncode == 0, r.stderr
    assert "warning: train.warmup_steps=6 is 75% of train.max_steps=8:" in r.stderr
    r = run_cli("warmup", tok, tokens, tmp_path / "run2", micro_overrides(5, 8, **{"train.warmup_steps": 4}))
    assert r.returncode == 0 and "train.warmup_steps" not in r.stderr, r.stderr
