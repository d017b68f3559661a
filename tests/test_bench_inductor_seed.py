"""bench/inductor_seed.py: what max-autotune tuned on one device machine, kept and placed in the next machine's
inductor cache (the machine's own files win; another card's are passed over). CPU only: the cache dirs here
are made by hand in inductor's layout."""

from __future__ import annotations

import json

import pytest

from script_helpers import load_script

H100 = {"device": {"name": "NVIDIA H100 80GB HBM3"}, "version": {"triton": "t", "cuda": "13.0"}, "hash": "aa11"}
H200 = {"device": {"name": "NVIDIA H200"}, "version": {"triton": "t", "cuda": "13.0"}, "hash": "bb22"}


@pytest.fixture(scope="module")
def isd():
    return load_script("bench/inductor_seed.py")


def warmed_cache(root, system):
    """An inductor cache dir as max-autotune leaves it: the GEMM-timing file under cache/<hash>, two kernels'
    sources with their .best_config beside them, and a compiled artifact that is not kept."""
    (root / "cache").mkdir(parents=True)
    (root / "cache" / system["hash"]).write_text(json.dumps({"system": system, "cache": {"mm": 0.25}}))
    for sub, key, cfg in (("ab", "cabkernel1", {"XBLOCK": 128, "num_warps": 4, "found_by_coordesc": True}),
                          ("q7", "cq7kernel2", {"XBLOCK": 64, "R0_BLOCK": 8, "num_warps": 8})):
        (root / sub).mkdir()
        (root / sub / f"{key}.py").write_text("# triton kernel source\n")
        (root / sub / f"{key}x.best_config").write_text(json.dumps(cfg))
    (root / "fxgraph").mkdir()
    (root / "fxgraph" / "graph.bin").write_bytes(b"\0" * 64)
    return root


def test_kept_tuning_lands_byte_for_byte_in_a_fresh_cache_of_the_same_card(isd, tmp_path):
    src = warmed_cache(tmp_path / "src", H100)
    written = isd.keep(src, tmp_path / "kept", H100)
    assert [p.name for p in written] == ["inductor_autotune_h100.json", "inductor_best_configs_h100.json"]
    bundle = json.loads(written[1].read_text())
    assert bundle["system"] == H100 and sorted(bundle["files"]) == ["ab/cabkernel1x.best_config",
                                                                   "q7/cq7kernel2x.best_config"]
    fresh = tmp_path / "fresh"
    assert isd.seed_autotune(fresh, [written[0]]) == ["inductor_autotune_h100.json (NVIDIA H100 80GB HBM3)"]
    assert isd.seed_best_configs(fresh, [written[1]], H100["device"]["name"]) == [
        "2 kernel configs of inductor_best_configs_h100.json (NVIDIA H100 80GB HBM3)"]
    for rel in ("cache/aa11", "ab/cabkernel1x.best_config", "q7/cq7kernel2x.best_config"):
        assert (fresh / rel).read_bytes() == (src / rel).read_bytes(), rel
    assert not (fresh / "fxgraph").exists()
    assert isd.seed_best_configs(fresh, [written[1]], H100["device"]["name"]) == []          # all there already: nothing to do


def test_this_machines_own_configs_win_and_another_cards_bundle_is_passed_over(isd, tmp_path):
    kept = isd.keep(warmed_cache(tmp_path / "src", H100), tmp_path / "kept", H100)[1]
    own = tmp_path / "own"
    (own / "ab").mkdir(parents=True)
    (own / "ab" / "cabkernel1x.best_config").write_text('{"XBLOCK": 256}')
    assert isd.seed_best_configs(own, [kept], "NVIDIA H100 80GB HBM3") == [
        "1 kernel configs of inductor_best_configs_h100.json (NVIDIA H100 80GB HBM3)"]
    assert (own / "ab" / "cabkernel1x.best_config").read_text() == '{"XBLOCK": 256}'
    other = tmp_path / "h200"
    assert isd.seed_best_configs(other, [kept], "NVIDIA H200") == [] and not other.exists()
    assert isd.seed_best_configs(other, [kept], None) == [] and not other.exists()


@pytest.mark.parametrize("rel", ["../escape.best_config", "/abs/x.best_config", "ab/kernel.py", "a/b/c.best_config"])
def test_a_bundle_path_outside_the_cache_layout_is_refused_before_anything_is_written(isd, tmp_path, rel):
    bundle = tmp_path / "s99_inductor_best_configs_h100.json"
    bundle.write_text(json.dumps({"system": H100, "files": {"ab/fine.best_config": "{}", rel: "{}"}}))
    with pytest.raises(isd.AndreaError, match=r"s99_inductor_best_configs_h100.json: .* is not a <xx>/<key>"):
        isd.seed_best_configs(tmp_path / "cache", [bundle], "NVIDIA H100 80GB HBM3")
    assert not (tmp_path / "cache").exists()


def test_a_file_that_is_not_a_bundle_is_named(isd, tmp_path):
    bad = tmp_path / "s99_inductor_best_configs_x.json"
    bad.write_text(json.dumps({"files": {"ab/k.best_config": {"XBLOCK": 1}}}))
    with pytest.raises(isd.AndreaError, match="s99_inductor_best_configs_x.json: not an inductor best-config bundle"):
        isd.seed_best_configs(tmp_path / "cache", [bad], "NVIDIA H100 80GB HBM3")


def test_keep_needs_a_device_and_says_so_where_nothing_was_tuned(isd, tmp_path, monkeypatch, capsys):
    with pytest.raises(isd.AndreaError, match="inductor sees no CUDA device here"):
        isd.keep(tmp_path, tmp_path / "out", {"hash": "cpu"})
    monkeypatch.setattr(isd, "this_system", lambda: H200)
    assert isd.main(["keep", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "empty")]) == 0
    assert "no GEMM timings nor kernel configs to keep" in capsys.readouterr().out
    warmed_cache(tmp_path / "warm", H200)
    assert isd.main(["keep", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "warm")]) == 0
    out = capsys.readouterr().out
    assert "inductor_autotune_h200.json" in out and "inductor_best_configs_h200.json" in out


def test_autotune_seed_adds_to_this_machines_file_what_it_lacks(isd, tmp_path):
    """Where this machine's inductor already wrote a file under the seed's hash, the seed's timings it lacks are
    added to it (recursing into nested entries) and its own timings stay; a second seeding adds nothing."""
    seed = tmp_path / "s98_inductor_autotune_x.json"
    system = {"hash": "abc", "device": {"name": "Card"}}
    seed.write_text(json.dumps({"system": system, "cache": {"mm A": 0.5, "mm B": 0.7, "op": {"x": 1.0, "y": 2.0}}}))
    own = tmp_path / "inductor" / "cache" / "abc"
    own.parent.mkdir(parents=True)
    own.write_text(json.dumps({"system": system, "cache": {"mm A": 0.4, "op": {"x": 0.9}}}))
    assert isd.seed_autotune(tmp_path / "inductor", [seed]) == ["2 entries of s98_inductor_autotune_x.json (Card) beside this machine's"]
    got = json.loads(own.read_text())
    assert got == {"system": system, "cache": {"mm A": 0.4, "mm B": 0.7, "op": {"x": 0.9, "y": 2.0}}}
    assert isd.seed_autotune(tmp_path / "inductor", [seed]) == []
    assert json.loads(own.read_text()) == got


def test_a_seed_that_is_not_an_autotune_file_is_named(isd, tmp_path):
    bad = tmp_path / "s99_inductor_autotune_x.json"
    bad.write_text("{\"cache\": {}}")
    with pytest.raises(isd.AndreaError, match="s99_inductor_autotune_x.json: not an inductor autotune cache file"):
        isd.seed_autotune(tmp_path / "inductor", [bad])
    assert not (tmp_path / "inductor").exists()


def test_card_tags(isd):
    assert isd.card_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert isd.card_tag("NVIDIA H200") == "h200"
    assert isd.card_tag("NVIDIA A100-SXM4-80GB") == "a100"
    assert isd.card_tag("NVIDIA GeForce RTX 4090") == "nvidia_geforce_rtx_4090"


def test_the_committed_seeds_are_what_their_names_say(isd):
    """Every kept file in docs/bench parses as its kind, and a card has one GEMM file (its newest)."""
    gemm = sorted(isd.ROOT.glob(isd.AUTOTUNE_SEEDS))
    hashes = [json.loads(f.read_text())["system"]["hash"] for f in gemm]
    assert gemm and len(hashes) == len(set(hashes))
    for f in sorted(isd.ROOT.glob(isd.BEST_CONFIG_SEEDS)):
        assert isd.seed_best_configs(isd.ROOT / "nowhere", [f], None) == []


def test_seed_all_asks_the_card_only_where_a_bundle_is_kept(isd, tmp_path):
    """engine_gpu --autotune-seed's one call: the GEMM files under root, then the bundles for the card named; a
    tree with no bundle never asks for the card (no device query on a machine that has no use for it)."""
    src = warmed_cache(tmp_path / "src", H100)
    kept = tmp_path / "root" / "docs" / "bench"
    for p in isd.keep(src, tmp_path / "k", H100):
        (kept / f"s99_{p.name}").parent.mkdir(parents=True, exist_ok=True)
        (kept / f"s99_{p.name}").write_bytes(p.read_bytes())
    asked = []
    got = isd.seed_all(tmp_path / "c1", tmp_path / "root", lambda: asked.append(1) or "NVIDIA H100 80GB HBM3")
    assert got == ["s99_inductor_autotune_h100.json (NVIDIA H100 80GB HBM3)",
                   "2 kernel configs of s99_inductor_best_configs_h100.json (NVIDIA H100 80GB HBM3)"] and asked == [1]
    (kept / "s99_inductor_best_configs_h100.json").unlink()
    assert isd.seed_all(tmp_path / "c2", tmp_path / "root", lambda: 1 / 0) == [
        "s99_inductor_autotune_h100.json (NVIDIA H100 80GB HBM3)"]
