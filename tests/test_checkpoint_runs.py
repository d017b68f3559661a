"""The run-folder module (andrea/runs.py) as its readers see it: one strict loss-history
reader behind eval and the dashboard, checkpoint discovery that ignores the hidden commit
folders, and the commit protocol's repair of each interrupted stage.

    pytest tests/test_checkpoint_runs.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from andrea import runs
from andrea.engine import checkpoint as ck
from andrea.errors import AndreaError
from andrea.reports.dashboard import History as DashHistory
from andrea.reports.evaluate import load_history

BAD_HISTORIES = {
    "nan": '{"train": [{"step": 0, "loss": NaN}], "val": []}',
    "infinity": '{"train": [{"step": 0, "loss": Infinity}]}',
    "wrong type": '{"train": 5}',
    "null list": '{"train": null}',
    "deep": '{"train": ' + "[" * 100000 + "]" * 100000 + "}",
    "cut short": '{"train": [{"step": 0, "lo',
    "not an object": "[1, 2]",
}


@pytest.mark.parametrize("name", sorted(BAD_HISTORIES))
def test_a_bad_loss_history_is_one_clear_error_for_eval_and_an_error_state_for_the_dashboard(tmp_path, name):
    (tmp_path / "model.loss.json").write_text(BAD_HISTORIES[name], encoding="utf-8")
    with pytest.raises(AndreaError, match="model.loss.json"):
        load_history(tmp_path)
    data, why = DashHistory(tmp_path).load()
    assert data is None and "unreadable" in why and "model.loss.json" in why


def test_a_good_history_keeps_its_records_and_a_non_record_is_refused(tmp_path):
    good = {"format": "andrea.loss/1", "train": [{"step": 0, "loss": 1.5}], "val": [], "events": [{"step": 0}]}
    (tmp_path / "model.loss.json").write_text(json.dumps(good))
    h = runs.read_history(tmp_path / "model.loss.json")
    assert h == {"train": [{"step": 0, "loss": 1.5}], "val": [], "pulls": [], "events": [{"step": 0}]}
    assert runs.read_history(tmp_path / "absent.json") == {"train": [], "val": [], "pulls": [], "events": []}
    # one reader for training, eval and the dashboard: a record that is not an object is not skipped
    (tmp_path / "model.loss.json").write_text(json.dumps({**good, "train": [{"step": 0}, 7]}))
    with pytest.raises(AndreaError, match=r'model.loss.json: loss history is unreadable: "train"\[1\] is a JSON int'):
        runs.read_history(tmp_path / "model.loss.json")


def _ckpt(path, step, n=4):
    z = np.zeros(n, dtype=np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    ck.write_checkpoint(path, step, z, z, z)


def test_find_checkpoints_orders_archives_and_skips_hidden_folders_and_other_bins(tmp_path):
    _ckpt(tmp_path / "model.bin", 30)
    _ckpt(tmp_path / "archive" / "step10.bin", 10)
    _ckpt(tmp_path / "archive" / "step20.bin", 20)
    _ckpt(tmp_path / runs.COMMITTED / "model.bin", 31)      # an interrupted commit is not an archive
    _ckpt(tmp_path / runs.PENDING / "model.bin", 31)
    (tmp_path / "archive" / "other.bin").write_bytes(b"not a checkpoint")
    found = runs.find_checkpoints(tmp_path)
    assert [(s, p.relative_to(tmp_path).as_posix(), f) for s, p, f in found] == [
        (10, "archive/step10.bin", False), (20, "archive/step20.bin", False), (30, "model.bin", True)]
    with pytest.raises(AndreaError, match="other.bin"):
        runs.find_checkpoints(tmp_path, [str(tmp_path / "archive" / "other.bin")])


def _commit(rf, step, n=4):
    w = np.full(n, float(step), dtype=np.float32)
    rf.commit(step, w, w, w, state={"format": runs.STATE_FORMAT, "step": step, "checkpoint_sha256": None},
              loss={"format": runs.LOSS_FORMAT, "train": [{"step": step}]}, samples={"samples": []})


def test_repair_finishes_a_half_moved_commit_and_drops_an_unfinished_one(tmp_path, monkeypatch):
    rf = runs.RunFolder(tmp_path / "run")
    with rf.writing():
        _commit(rf, 1)
    # killed during step 3 after model.bin moved: the top is split, the rest waits in .checkpoint.commit
    import os
    real = os.replace
    moved = []

    def replace_once(a, b):
        if moved:
            raise KeyboardInterrupt                   # stands in for the kill
        moved.append(b)
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace_once)
    with pytest.raises(KeyboardInterrupt):
        with rf.writing():
            _commit(rf, 2)
    monkeypatch.setattr(os, "replace", real)
    with pytest.raises(runs.SplitPair):
        rf.read_checkpoint(rf.read_state(), 4)
    with rf.writing() as notes:
        assert any("finished an interrupted checkpoint commit" in n for n in notes)
    st = rf.read_state()
    assert st["step"] == 2 and rf.read_checkpoint(st, 4)[0] == 2
    assert runs.read_history(rf.loss)["train"] == [{"step": 2}]
    assert sorted(p.name for p in rf.dir.iterdir()) == sorted(runs.FILES)
    # an unfinished pending folder is dropped, the pair stays
    (rf.dir / runs.PENDING).mkdir()
    (rf.dir / runs.PENDING / "model.bin").write_bytes(b"\0" * 5)
    with rf.writing() as notes:
        assert any("unfinished" in n for n in notes)
    assert rf.read_state()["step"] == 2 and not (rf.dir / runs.PENDING).exists()


def test_a_second_writer_is_refused_while_the_first_holds_the_folder(tmp_path):
    a, b = runs.RunFolder(tmp_path / "run"), runs.RunFolder(tmp_path / "run")
    with a.writing():
        with pytest.raises(AndreaError, match="another `andrea train` is writing"):
            with b.writing():
                pass
    with b.writing():
        pass
