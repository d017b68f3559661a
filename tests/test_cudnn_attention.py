"""cuDNN's attention path (andrea/cuda/cudnn_attention.py): the choice and its refusals, the batch chunks
and their pointers (CPU, over a stand-in cudnn module), and on a GPU with cuDNN's frontend installed the
forward and backward against the NumPy twin (ops_numpy, float64) with the bf16 tolerance of
tests/test_cuda_kernels.py, the backward's bytes repeated, and the chunked backward's bytes equal to
the whole batch's."""

from __future__ import annotations

import numpy as np
import pytest

from andrea.cuda import cudnn_attention as ca
from andrea.errors import AndreaError
from script_helpers import cupy_with_cudnn


def test_pick_chunk_takes_the_largest_divisor_whose_workspace_fits():
    ws = lambda c: 100 * c  # noqa: E731
    assert ca.pick_chunk(8, ws, 10_000) == 8
    assert ca.pick_chunk(8, ws, 250) == 2
    assert ca.pick_chunk(6, ws, 450) == 3          # 4 fits but does not divide 6
    assert ca.pick_chunk(8, ws, 99) is None


@pytest.fixture
def fake_cudnn(monkeypatch):
    """A stand-in cudnn module: graphs record their tensors and every execute's pointers (and, in
    ``.plans``, whether it was a backward, the plan it ran and the heuristic modes it asked)."""
    calls = type("Calls", (list,), {})()
    calls.plans = plans_run = []

    class T:
        def __init__(self, name, dim=None, stride=None):
            self.name, self.dim, self.stride = name, dim, stride

        def set_output(self, _):
            return self

        def set_dim(self, d):
            self.dim = d
            return self

        def set_stride(self, s):
            self.stride = s
            return self

        def set_data_type(self, _):
            return self

    class G:
        plans = ("eng_first", "eng_other", "eng_first")   # what the fake heuristics A, B offer, in order

        def __init__(self, **kw):
            self.det, self.B, self.plan, self.modes = None, None, None, None

        def tensor(self, name, dim, stride, data_type):
            self.B = dim[0]
            return T(name, dim, stride)

        def sdpa(self, name, q, k, v, generate_stats, **kw):
            assert generate_stats and kw["diagonal_band_right_bound"] == 0
            return T("o"), T("lse")

        def sdpa_backward(self, name, use_deterministic_algorithm, **kw):
            self.det = use_deterministic_algorithm
            return T("dq"), T("dk"), T("dv")

        validate = build_operation_graph = check_support = lambda self: None

        def create_execution_plans(self, modes):
            self.modes = modes

        def get_execution_plan_count(self):
            return len(self.plans)

        def get_plan_name_at_index(self, i):
            return self.plans[i]

        def build_plan_at_index(self, i):
            self.plan = self.plans[i]

        def build_plans(self):
            self.plan = self.plans[0]

        def get_workspace_size(self):
            return 256 if self.det is None else 1000 * self.B

        def execute(self, pack, ws, handle):
            calls.append(({t.name: p for t, p in pack.items()}, ws, self.det))
            plans_run.append((self.det is not None, self.plan, tuple(self.modes)))

    class M:
        data_type = type("dt", (), {"BFLOAT16": 1, "FLOAT": 2})
        heur_mode = type("hm", (), {"A": "A", "B": "B", "FALLBACK": "F"})
        diagonal_alignment = type("da", (), {"TOP_LEFT": 0})
        pygraph = G

        @staticmethod
        def create_handle():
            return 7

        @staticmethod
        def set_stream(handle, stream):
            assert (handle, stream) == (7, 99)

        @staticmethod
        def backend_version():
            return 91900

    monkeypatch.setattr(ca, "_cudnn", lambda: M)
    monkeypatch.setattr(ca, "_current_stream", lambda: 99)
    return calls


class Buf:
    def __init__(self, ptr, nbytes=0):
        self.data, self.nbytes = type("d", (), {"ptr": ptr}), nbytes


def test_backward_runs_in_chunks_that_fit_the_scratch_at_the_right_offsets(fake_cudnn):
    B, T, C, H = 4, 8, 16, 2
    att = ca.CudnnAttention(B, T, C, H, room=2500)        # the backward's workspace 1000 a sequence: chunks of 2
    assert att.chunk == 2 and "over 2 to 4 of 4 sequences" in att.describe() and "cuDNN 9.19.0" in att.describe()
    qkv, dqkv, y, dy, lse = (Buf(p) for p in (10_000, 20_000, 30_000, 40_000, 50_000))
    scratch = Buf(60_000, 2500)
    att.forward(y, lse, qkv, scratch)
    att.backward(dqkv, dy, y, lse, qkv, scratch)
    att.backward(dqkv, dy, y, lse, qkv, Buf(70_000, 4000))          # room for the whole batch: one call
    (f, ws, det), *bwd, whole = fake_cudnn
    assert whole[0]["q"] == 10_000 and whole[0]["dv"] == 20_000 + 4 * C and whole[1] == 70_000
    assert det is None and ws == 60_000
    assert f == {"q": 10_000, "k": 10_000 + 2 * C, "v": 10_000 + 4 * C, "o": 30_000, "lse": 50_000}
    assert len(bwd) == 2 and all(d is True for _, _, d in bwd)    # the deterministic backward, twice
    for i, (p, _, _) in enumerate(bwd):
        s3, s1 = i * 2 * T * 3 * C * 2, i * 2 * T * C * 2           # two sequences of bf16 rows a chunk
        assert p == {"q": 10_000 + s3, "k": 10_000 + s3 + 2 * C, "v": 10_000 + s3 + 4 * C, "o": 30_000 + s1,
                     "do": 40_000 + s1, "lse": 50_000 + i * 2 * H * T * 4, "dq": 20_000 + s3,
                     "dk": 20_000 + s3 + 2 * C, "dv": 20_000 + s3 + 4 * C}


def test_the_bench_only_switch_is_read_once_when_the_graphs_are_built(fake_cudnn, monkeypatch):
    """DETERMINISTIC = False (bench/attention_det.py) builds cuDNN's default backward and says so; an
    object built under it keeps it after the switch is put back, and one built after is deterministic."""
    B, T, C, H = 4, 8, 16, 2
    scratch = Buf(60_000, 8000)
    monkeypatch.setattr(ca, "DETERMINISTIC", False)
    other = ca.CudnnAttention(B, T, C, H, room=8000)
    monkeypatch.setattr(ca, "DETERMINISTIC", True)
    plain = ca.CudnnAttention(B, T, C, H, room=8000)
    qkv, dqkv, y, dy, lse = (Buf(p) for p in (10_000, 20_000, 30_000, 40_000, 50_000))
    other.backward(dqkv, dy, y, lse, qkv, scratch)
    other.backward(dqkv, dy, y, lse, qkv, Buf(70_000, 2000))       # a new chunk's graph, built now
    plain.backward(dqkv, dy, y, lse, qkv, scratch)
    assert [d for _, _, d in fake_cudnn] == [False] * 3 + [True]    # 1 + 2 calls of chunk 2, then one
    assert "NON-DETERMINISTIC" in other.describe() and "NON-" not in plain.describe()


def test_a_named_plan_is_built_where_cudnn_offers_it_and_described(fake_cudnn, monkeypatch):
    """BWD_PLAN names the backward's plan (read at construction); the forward keeps cuDNN's first and
    asks only heuristics A and the fallback; a name cuDNN does not offer falls back to its first, and
    describe() says which plan each graph built."""
    B, T, C, H = 4, 8, 16, 2
    qkv, dqkv, y, dy, lse = (Buf(p) for p in (10_000, 20_000, 30_000, 40_000, 50_000))
    monkeypatch.setattr(ca, "BWD_PLAN", "eng_other")
    named = ca.CudnnAttention(B, T, C, H, room=8000)
    monkeypatch.setattr(ca, "BWD_PLAN", "eng_gone")
    gone = ca.CudnnAttention(B, T, C, H, room=8000)
    monkeypatch.setattr(ca, "BWD_PLAN", None)
    for att in (named, gone):
        att.forward(y, lse, qkv, Buf(60_000, 8000))
        att.backward(dqkv, dy, y, lse, qkv, Buf(60_000, 8000))
    assert fake_cudnn.plans == [(False, "eng_first", ("A", "F")), (True, "eng_other", ("A", "B", "F")),
                         (False, "eng_first", ("A", "F")), (True, "eng_first", ("A", "B", "F"))]
    assert named.describe().endswith("backward plan eng_other") and "forward plan" not in named.describe()
    assert gone.describe().endswith("backward plan eng_first (cuDNN's first: eng_gone is not offered here)")
    plain = ca.CudnnAttention(B, T, C, H, room=8000)
    assert "plan" not in plain.describe()
    assert plain.offered(True) == plain.offered(False) == ["eng_first", "eng_other"]     # each once, in order


def test_a_scratch_too_small_for_one_sequence_is_refused_in_one_line(fake_cudnn):
    with pytest.raises(AndreaError, match="train.attention=kernels") as e:
        ca.CudnnAttention(4, 8, 16, 2, room=999)
    assert "\n" not in str(e.value)


def test_resolve_picks_cudnn_only_where_it_measured_faster_and_refuses_what_cannot_run(monkeypatch):
    monkeypatch.setattr(ca, "_cudnn", lambda: object())                # installed
    assert ca.resolve("auto", "bf16", 64, True) == "cudnn"
    assert ca.resolve("auto", "bf16", 32, True) == "kernels"           # D = 32: attention.cu's are faster
    assert ca.resolve("auto", "bf16", 64, False) == "kernels"          # measured on Hopper only
    assert ca.resolve("auto", "fp16", 64, True) == "kernels"
    assert ca.resolve("cudnn", "bf16", 32, False) == "cudnn"           # asked for: wherever it runs
    assert ca.resolve("kernels", "bf16", 64, True) == "kernels"
    with pytest.raises(AndreaError, match="bf16 storage"):
        ca.resolve("cudnn", "fp32", 64, True)
    with pytest.raises(AndreaError, match="'flash' is not one of auto"):
        ca.resolve("flash", "bf16", 64, True)
    monkeypatch.setattr(ca, "_cudnn", lambda: "ModuleNotFoundError: No module named 'cudnn'")
    assert ca.resolve("auto", "bf16", 64, True) == "kernels"
    with pytest.raises(AndreaError, match="pip install 'nvidia-cudnn-frontend>=1.18") as e:
        ca.resolve("cudnn", "bf16", 64, True)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(ca, "_cudnn", lambda: pytest.fail("auto imported cudnn where it cannot be picked"))
    assert [ca.resolve("auto", p, d, h) for p, d, h in (("fp32", 64, True), ("bf16", 32, True), ("bf16", 64, False))] \
        == ["kernels"] * 3


def test_train_attention_is_optional_and_checked_by_the_schema():
    from andrea.errors import ConfigError
    from andrea.settings import Settings
    from train_helpers import micro_cfg

    assert Settings.from_dict(micro_cfg(2, 2)).train.attention == "auto"
    assert Settings.from_dict(micro_cfg(2, 2, **{"train.attention": "kernels"})).train.attention == "kernels"
    with pytest.raises(ConfigError, match="attention"):
        micro_cfg(2, 2, **{"train.attention": "flash"})


# ----------------------------------------------------------------------------------------------- GPU
def _bf16(cp, x):
    """(device bf16 bits, the float64 values they hold): round-to-nearest-even."""
    b = np.asarray(x, np.float32).view(np.uint32)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return cp.asarray(b), (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _f64(cp, a):
    return (cp.asnumpy(a).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,D", [(2, 200, 2, 64), (3, 1024, 2, 64), (2, 130, 4, 32)])
def test_cudnn_attention_matches_the_numpy_twin_and_repeats_its_bytes(B, T, H, D):
    cp = cupy_with_cudnn()
    from andrea.engine import ops_numpy as ops

    C, N = H * D, B * T
    rng = np.random.default_rng(T + D)
    qkv, qkv64 = _bf16(cp, rng.normal(0, 1, (N, 3 * C)))
    dy, dy64 = _bf16(cp, rng.normal(0, 1, (N, C)))
    nan16 = lambda shape: cp.full(shape, 0x7FC0, cp.uint16)  # noqa: E731 - bf16 NaN, every output poisoned
    y, dqkv, lse = nan16((N, C)), nan16((N, 3 * C)), cp.full(B * H * T, np.nan, cp.float32)
    whole = ca.CudnnAttention(B, T, C, H, room=1 << 30)
    scratch = cp.empty(1 << 30, cp.uint8)
    whole.forward(y, lse, qkv, scratch)
    whole.backward(dqkv, dy, y, lse, qkv, scratch)
    ry, att = np.zeros((B, T, C)), np.zeros(ops.att_shape(B, H, T))
    work = np.zeros(ops.work_elems(B, T, C, H, 1))
    ops.attn_forward(ry, att, qkv64.reshape(B, T, 3 * C), np.triu(np.full((T, T), -np.inf), k=1), H, work)
    rd = np.zeros((B, T, 3 * C))
    ops.attn_backward(rd, dy64.reshape(B, T, C), qkv64.reshape(B, T, 3 * C), att, ry, H, work)
    for got, ref, what in ((_f64(cp, y), ry.reshape(N, C), "y"), (_f64(cp, dqkv), rd.reshape(N, 3 * C), "dqkv")):
        scale = float(np.abs(ref).max())
        bound = 2e-2 * scale + 2e-2 * np.abs(ref)          # tests/test_cuda_kernels.py's bf16 (atol, rtol)
        assert np.isfinite(got).all(), what
        assert (np.abs(got - ref) <= bound).all(), f"{what}: max error {np.abs(got - ref).max():.3g} (scale {scale:.3g})"
    first = dqkv.copy()
    dqkv.fill(0x7FC0)
    whole.backward(dqkv, dy, y, lse, qkv, scratch)
    assert bool((dqkv == first).all()), "the deterministic backward gave other bytes on a repeat"
    if B > 1:                                   # one sequence a call: the workspace of one, the same bytes
        small = scratch[:whole._ws(B) - 1]
        one = ca.CudnnAttention(B, T, C, H, room=small.nbytes)
        assert one.chunk < B
        dqkv.fill(0x7FC0)
        one.backward(dqkv, dy, y, lse, qkv, small)
        assert bool((dqkv == first).all()), "the chunked backward gave other bytes than the whole batch's"


# the engine with train.attention=cudnn: D = 64, as the engine's auto picks it on an H200
def _mc():
    from andrea.engine.model import ModelConfig

    return ModelConfig(vocab_size=1000, d_model=128, n_head=2, n_layer=2, context=128)  # logits hold the workspace


def _batch(seed, mc, b=2):
    x = np.random.default_rng(seed).integers(0, mc.vocab_size, (b, mc.context)).astype(np.int32)
    return x, np.roll(x, -1, axis=1)


@pytest.mark.gpu
def test_engine_with_cudnn_attention_matches_numpy_in_the_loss_and_every_gradient():
    cupy_with_cudnn()
    from andrea.cuda.backend import make_backend
    from andrea.engine.backend import NumpyBackend
    from andrea.engine.engine import Engine

    mc = _mc()
    ref = Engine(mc, 2, NumpyBackend())
    ref.init_weights(0)
    gpu = make_backend().make_engine(mc, 2, precision="bf16", attention="cudnn")
    assert gpu.attention == "cudnn" and "attention: cuDNN" in gpu.describe()
    gpu.init_weights(0)
    x, y = _batch(2, mc)
    ref.zero_grads()
    l_ref = ref.forward(x, y)
    ref.backward(1.0 / ref.N)
    l_gpu = gpu.compute_grads(x, y)
    assert abs(l_gpu - l_ref) <= 2e-2 * max(1.0, abs(l_ref))
    g = gpu.grads_host()
    for t in ref.layout.tensors:                 # tests/test_cuda_engine.py's bf16 bound: 6% of the largest entry
        a, r = g[t.offset:t.offset + t.size], ref.g[t.offset:t.offset + t.size]
        scale = float(np.abs(r).max()) or 1.0
        assert float(np.abs(a - r).max()) <= 6e-2 * scale, t.name


def _run(prec, steps, start=None, graph=True, **kw):
    from andrea.cuda.backend import make_backend
    from andrea.engine.engine import Hyper

    mc = _mc()
    eng = make_backend().make_engine(mc, 2, precision=prec, cuda_graph=graph, attention="cudnn", **kw)
    t0 = 0
    if start is None:
        eng.init_weights(0)
    else:
        t0, w, m, v, extra = start
        eng.load_state(w, m, v)
        if extra:
            eng.load_extra_state(extra)
    for t in range(t0 + 1, t0 + steps + 1):
        eng.train_step([_batch(300 + 7 * t, mc)], 3e-3, t, Hyper(grad_clip=1.0))
    return (t0 + steps, *eng.state_host(), eng.extra_state())


@pytest.mark.gpu
@pytest.mark.parametrize("prec,kw", [("bf16", {}), ("fp8", {"fp8_scaling": "delayed", "fp8_amax_history": 4})])
def test_cudnn_attention_runs_repeat_resume_and_replay_the_same_bytes(prec, kw):
    cupy_with_cudnn()
    if prec == "fp8":
        from andrea.cuda.loader import cupy_or_none

        if cupy_or_none().cuda.Device().compute_capability < "89":
            pytest.skip("fp8 needs compute capability 8.9+")
    a, b = _run(prec, 6, **kw), _run(prec, 6, **kw)
    for x, y in zip(a[1:4], b[1:4]):
        assert x.tobytes() == y.tobytes()
    resumed = _run(prec, 3, start=_run(prec, 3, **kw), **kw)
    for x, y in zip(a[1:4], resumed[1:4]):
        assert x.tobytes() == y.tobytes()
    eager = _run(prec, 6, graph=False, **kw)      # the CUDA graph replays exactly the eager launches
    for x, y in zip(a[1:4], eager[1:4]):
        assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("prec", ["bf16", "fp8", "fp32"])
def test_arena_puts_what_no_block_backward_reads_behind_h_pre_at_no_cost(prec, monkeypatch):
    # engine.AFTER_H_PRE: the logits, dh, cuBLASLt's workspace, branch and lnf follow h_pre in the arena,
    # each where the one before it ends (256-byte aligned), so spare_run reaches through all of them;
    # the arena is no larger than in the plan's order
    import andrea.cuda.engine as ce
    from andrea.engine.model import ModelConfig

    mc = ModelConfig(vocab_size=97, d_model=64, n_head=2, n_layer=3, context=128)
    lay = ce.arena_layout(mc, 2, prec)
    size = {n: int(np.prod(s)) * np.dtype(dt).itemsize for n, s, dt in lay.spec}
    span = lambda n: (lay.offsets[n], size[n]) if n in size else None  # noqa: E731
    names = [n for n in ce.AFTER_H_PRE if n in size]
    assert [n for n, _, _ in lay.spec][[n for n, _, _ in lay.spec].index("h_pre") + 1:][:len(names)] == names
    assert names[:2] == ["logits", "dh"] and ("lt_ws" in names) == (prec != "fp32")
    h0, hn = span("h_pre")
    last = span(names[-1])
    assert ce.spare_run(span, 1, 3) == (h0 + hn // 3, last[0] + last[1])
    monkeypatch.setattr(ce, "AFTER_H_PRE", ())
    plain = ce.arena_layout(mc, 2, prec)
    assert plain.nbytes == lay.nbytes
    p0 = plain.offsets["h_pre"]                   # h_act follows h_pre there: the run is the h_pre tail
    assert ce.spare_run(lambda n: (plain.offsets[n], size[n]) if n in size else None, 1, 3) == (p0 + hn // 3, p0 + hn)


def test_the_480m_top_layers_run_their_deterministic_backward_in_fewer_calls(monkeypatch):
    # the calls cuDNN's backward takes in each layer at 480M B=8, over the larger of the logits and the
    # layer's free run: in the plan's order the top four layers took 4, 4, 2, 2 calls on the H200
    # (docs/bench/s23_h200.md); behind h_pre, every layer one, but the top layer's two once dh lies in the
    # logits (DH_IN_LOGITS: the run loses dh's own bytes). The workspace is modelled as a little more than
    # B H T^2 2 bytes: those 4 calls say that layer 14's h_pre run, exactly 4 H T^2 2 bytes, held fewer
    # than 4 sequences
    import andrea.cuda.engine as ce
    from andrea.memory import load_variants

    mc = next(v.mc for v in load_variants() if v.profile == "andrea-480m")
    B, H, T, L = 8, mc.n_head, mc.context, mc.n_layer

    def calls():
        lay = ce.arena_layout(mc, B, "bf16")
        size = {n: int(np.prod(s)) * np.dtype(dt).itemsize for n, s, dt in lay.spec}
        span = lambda n: (lay.offsets[n], size[n]) if n in size else None  # noqa: E731
        out = []
        for l in reversed(range(L)):
            start, end = ce.spare_run(span, l, L)
            c = ca.pick_chunk(B, lambda c: c * H * T * T * 2 + 4096, max(end - start, size["logits"]))
            out.append(B // c)
        return out

    assert calls()[:5] == [2, 1, 1, 1, 1]
    monkeypatch.setattr(ce, "DH_IN_LOGITS", False)
    assert calls()[:5] == [1, 1, 1, 1, 1]
    monkeypatch.setattr(ce, "AFTER_H_PRE", ())
    assert calls()[:5] == [4, 4, 2, 2, 1]


@pytest.mark.parametrize("prec", ["bf16", "fp32", "fp8"])
def test_dh_lies_in_the_logits_bytes_where_it_fits(prec, monkeypatch):
    # engine.DH_IN_LOGITS: the MLP backward's dL/dh (N, 4C) takes the first bytes of the logits (N, Vp) where
    # it fits, in the logits' dtype, and the arena shrinks by its bytes; not in fp8 (its E4M3 head writes the
    # logits' bytes in the backward), nor where 4C > Vp; the memory report follows the arena
    import andrea.cuda.engine as ce
    from andrea.engine.model import ModelConfig
    from andrea.memory import plan_items

    for V, fits in ((1000, prec != "fp8"), (97, False)):        # 4C = 256 against Vp = 1024 (fp32 1000), 128
        mc = ModelConfig(vocab_size=V, d_model=64, n_head=2, n_layer=2, context=128)
        monkeypatch.setattr(ce, "DH_IN_LOGITS", True)
        lay = ce.arena_layout(mc, 2, prec)
        monkeypatch.setattr(ce, "DH_IN_LOGITS", False)
        off = ce.arena_layout(mc, 2, prec)
        dh = next(e for e in off.spec if e[0] == "dh")
        assert ("dh" not in [e[0] for e in lay.spec]) == fits
        assert lay.aliases == ((*dh, "logits", 0),) if fits else lay.aliases == ()
        assert off.nbytes - lay.nbytes == (-(-int(np.prod(dh[1])) * np.dtype(dh[2]).itemsize // 256) * 256 if fits else 0)
        monkeypatch.setattr(ce, "DH_IN_LOGITS", True)
        assert sum(plan_items(mc, 2, prec, grad_accum=None).values()) == lay.nbytes
