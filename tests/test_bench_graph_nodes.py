"""bench/graph_nodes.py's bookkeeping without a GPU: reading a graph's nodes through a stand-in driver, the
counts it prints, the problem names it parses and the memset-free pick.

    pytest tests/test_bench_graph_nodes.py

Nothing here touches a device; the driver calls are replaced by a fake graph.
"""

from __future__ import annotations

import pytest

from script_helpers import load_script


@pytest.fixture()
def gn():
    return load_script("bench/graph_nodes.py")


class FakeDriver:
    """A captured chain: memset -> GEMM -> kernel -> memset -> cuDNN kernel -> event record; node handles are
    ints, listed out of chain order as a driver may list them."""

    def __init__(self):
        self.kind = {11: "memset", 12: "kernel", 13: "kernel", 14: "memset", 15: "kernel", 16: "event record"}
        self.names = {12: "void nvjet_sm90_tst_256x128_TNT", 13: "k_layernorm_bwd4", 15: "cudnn_sdpa_bprop"}
        self.deps = {11: [12], 14: [15]}

    def nodes(self, graph):
        return [14, 11, 12, 13, 15, 16]

    def node_type(self, h):
        return self.kind[h]

    def kernel_name(self, h):
        return self.names[h]

    def memset(self, h):
        return {"dst": 0x1000 * h, "bytes": 4096 if h == 11 else 64, "value": 0}

    def dependents(self, h):
        return self.deps.get(h)


def test_read_graph_names_the_kernel_each_memset_comes_before(gn):
    rows = gn.read_graph(FakeDriver(), 0)
    mem = [r for r in rows if r["type"] == "memset"]
    # by the dependency edge, not by list order (node 14 is listed first, before node 11)
    assert [(r["bytes"], r["next"]) for r in mem] == [(64, "cudnn_sdpa_bprop"), (4096, "void nvjet_sm90_tst_256x128_TNT")]
    s = gn.summarise(rows)
    assert s["nodes"] == 6
    assert s["by_type"] == {"kernel": 3, "memset": 2, "event record": 1}
    assert s["memset_bytes"] == {"64": 1, "4096": 1}
    assert s["memset_before"] == {"cudnn_sdpa_bprop": 1, "nvjet_sm90_tst_256x128_TNT": 1}


def test_without_dependency_edges_the_next_listed_kernel_is_named(gn):
    drv = FakeDriver()
    drv.dependents = lambda h: None                  # an old driver without cuGraphNodeGetDependentNodes
    rows = gn.read_graph(drv, 0)
    assert [r.get("next") for r in rows if r["type"] == "memset"] == ["void nvjet_sm90_tst_256x128_TNT",
                                                                       "void nvjet_sm90_tst_256x128_TNT"]


def test_memsets_are_counted_by_the_buffer_they_clear(gn):
    rows = gn.read_graph(FakeDriver(), 0)                    # memsets at 0xB000 (4096 bytes) and 0xE000 (64)
    regions = {"cuBLASLt workspace": (0xE000, 0x100), "engine arena": (0x0, 0x100000)}
    assert gn.summarise(rows, regions)["memset_in"] == {"cuBLASLt workspace": 1, "engine arena": 1}
    assert gn.summarise(rows)["memset_in"] == {"other": 2}
    assert gn.region_of(None, regions) == "other"


def test_the_memset_free_pick(gn):
    cands = [{"choice": 0, "ws": 1, "memsets": 1, "ms": 0.10},
             {"choice": 1, "ws": 1, "memsets": 0, "ms": 0.12},
             {"choice": "w0:0", "ws": 0, "memsets": 0, "ms": 0.11},
             {"choice": "w0:1", "ws": 0, "memsets": None, "ms": None}]
    assert gn.best_free(cands) == cands[2]
    assert gn.best_free(cands[:1]) is None


def test_without_cupy_it_says_what_it_needs(gn, monkeypatch, capsys):
    import builtins

    real = builtins.__import__

    def no_cupy(name, *a, **k):
        if name == "cupy":
            raise ImportError("No module named 'cupy'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    assert gn.main(["--variants", "andrea-12m:8"]) == 2
    assert "needs CuPy and an NVIDIA driver" in capsys.readouterr().err


def test_a_failing_part_is_reported_and_the_other_still_runs(gn, monkeypatch, capsys):
    """one_shape: the graphs part failing (here: a capture that fell back to eager launches) costs only its
    own figures; the calls part's still land in the result, and the failure is one line naming the shape."""
    import sys
    import types

    freed = []
    fake = types.SimpleNamespace(get_default_memory_pool=lambda: types.SimpleNamespace(
        free_all_blocks=lambda: freed.append(1)))
    monkeypatch.setitem(sys.modules, "cupy", fake)

    def graphs(*a):
        raise RuntimeError("the engine runs without a CUDA graph")

    monkeypatch.setattr(gn, "step_graphs", graphs)
    monkeypatch.setattr(gn, "library_calls", lambda *a: {"gemms": [], "memsets_a_step": {"cublaslt": 0, "cudnn": 0}})
    res = gn.one_shape(None, "andrea-12m", 8, None)
    assert res["graphs_error"] == "RuntimeError: the engine runs without a CUDA graph"
    assert res["gemms"] == [] and len(freed) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["graph_nodes: andrea-12m:B8: the graphs part failed (RuntimeError: the engine runs without a "
                   "CUDA graph)"]
