"""Causal attention through cuDNN's fused SDPA kernels (the cuDNN frontend's graph API), in place of
attention.cu's where ``train.attention`` picks it (``resolve``): the forward with its row log-sum-exp,
and cuDNN's deterministic backward, over the engine's packed bf16 qkv (B*T, 3C) and y (B*T, C).

    from andrea.cuda.cudnn_attention import CudnnAttention, resolve
    if resolve("auto", "bf16", C // H, hopper=True) == "cudnn":
        dnn = CudnnAttention(B, T, C, H, room)     # its graphs built here, once
        dnn.forward(y, lse, qkv, scratch); dnn.backward(dqkv, dy, y, lse, qkv, scratch)

Why: on the H200 at D = 64 cuDNN's Hopper kernels (wgmma, persistent, three warpgroups) run a layer's
attention in 0.39 ms against attention.cu's 0.54 (480M B=8; 0.72 against 1.01 at 120M B=32), its
deterministic backward included; at D = 32 attention.cu's are faster (docs/bench/s23_h200.md).

- The same bytes on every run: the forward has one algorithm, and the backward is asked for cuDNN's
  deterministic one (``use_deterministic_algorithm``: its dQ is reduced through a workspace of
  B H T^2 2 bytes, not by float atomics). Runs on another cuDNN version may differ in the last bits,
  so ``describe()`` names the version and the engine prints it. The price, measured on the H200 by
  ``bench/attention_det.py``: 51 us a layer over cuDNN's default backward at 480M B=16 (577 against 526),
  0.4-0.9 ms a step at 480M; the default one gave different dqkv bytes on each of five runs
  (docs/bench/s27_h200.md). ``DETERMINISTIC`` = False builds that default backward: for that bench only,
  the engine never sets it.
- ``lse`` (B*H, T) holds cuDNN's statistics, the natural-log row log-sum-exp (attention.cu keeps log2):
  only this module's backward reads it, and the engine runs both passes through one of the two.
- Memory: nothing of its own. Both passes use ``scratch``, a byte array the caller lends (the engine:
  the logits' bytes, dead during the blocks' forward and backward, or in a layer's backward the h_pre
  of that layer and the layers above, when longer); the backward runs in batch chunks of as many
  sequences as its workspace fits there (``pick_chunk``), the whole batch where it can: the whole
  batch's call is faster than its chunks'.
- Needs cuDNN and its frontend (the ``gpu`` extras, ``INSTALL``) and bf16 storage; the graphs
  are legal inside a CUDA graph capture (built before it; each call only launches).
"""

from __future__ import annotations

import functools
import math

from andrea.errors import AndreaError

CHOICES = ("auto", "cudnn", "kernels")
# auto: cuDNN where it measured faster (bf16 storage, head size 64, a compute capability 9.0 device), else
# attention.cu's kernels.
AUTO_HEAD_SIZES = (64,)
INSTALL = "pip install 'nvidia-cudnn-frontend>=1.18,<1.20' nvidia-cudnn-cu13 (nvidia-cudnn-cu12 with CUDA 12)"


@functools.cache
def _cudnn():
    """The cudnn module, or the reason it cannot be used (a str)."""
    try:
        import cudnn
        cudnn.backend_version()
    except Exception as e:  # noqa: BLE001 - ImportError, or a libcudnn the frontend cannot load
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return cudnn


def unavailable() -> str | None:
    """Why cuDNN's attention cannot run here (None: it can)."""
    m = _cudnn()
    return m if isinstance(m, str) else None


DETERMINISTIC = True    # cuDNN's deterministic backward; False (bench/attention_det.py only): its default, dQ by atomics
# The execution plan each graph runs, by cuDNN's name for it (bench/attention_plans.py times every plan cuDNN's
# heuristics offer and checks that it repeats its bytes): None = the first plan of heuristics mode A, as cuDNN
# picks. A named plan this cuDNN does not offer falls back to that first one; describe() names what was built.
# cuDNN 9.19 on an H100 at 480M B=8 (docs/bench/s48.md): the first is the fastest of each pass (forward
# eng2_k24=7, 84 us, against 1.93-2.24x for eng1's four; deterministic backward eng6_k24=26, 344 us, against
# 1.56x for eng7), so both stay None.
FWD_PLAN: str | None = None
BWD_PLAN: str | None = None


def _current_stream() -> int:
    """The current CuPy stream's handle: cuDNN launches there (inside a capture, the capturing stream)."""
    import cupy as cp

    return cp.cuda.get_current_stream().ptr


def pick_chunk(B: int, ws_of, room: int) -> int | None:
    """The largest divisor c of B whose backward workspace ``ws_of(c)`` fits ``room`` bytes; None if
    not even one sequence's does."""
    for c in sorted((d for d in range(1, B + 1) if B % d == 0), reverse=True):
        if ws_of(c) <= room:
            return c
    return None


def resolve(choice: str, prec: str, D: int, hopper: bool) -> str:
    """"cudnn" or "kernels" for ``train.attention`` = ``choice`` at storage type ``prec`` and head size
    ``D``; a choice that cannot run is refused in one line."""
    if choice not in CHOICES:
        raise AndreaError(f"train.attention: {choice!r} is not one of {' | '.join(CHOICES)}")
    if choice == "kernels":
        return "kernels"
    if choice == "cudnn":
        if prec != "bf16":
            raise AndreaError(f"train.attention=cudnn needs bf16 storage (train.precision bf16 or fp8), "
                              f"not {prec}: use train.attention=kernels")
        if (why := unavailable()) is not None:
            raise AndreaError(f"train.attention=cudnn: cuDNN's frontend cannot be loaded ({why}); {INSTALL}, "
                              f"or use train.attention=kernels")
        return "cudnn"
    # auto: the import (a fraction of a second) only where cuDNN's would be picked
    return "cudnn" if prec == "bf16" and D in AUTO_HEAD_SIZES and hopper and unavailable() is None else "kernels"


class CudnnAttention:
    """cuDNN's causal SDPA forward and deterministic backward for one (B, T, C, H): the forward graph
    over the whole batch, the backward's over as many sequences a call as fit the scratch it is given.
    ``room``: the fewest scratch bytes a call will get; ``AndreaError`` if one sequence does not fit."""

    def __init__(self, B: int, T: int, C: int, H: int, room: int):
        m = _cudnn()
        if isinstance(m, str):
            raise AndreaError(f"cuDNN attention: the frontend cannot be loaded ({m}); {INSTALL}")
        self.cudnn, self.B, self.T, self.C, self.H = m, B, T, C, H
        self.scale = 1.0 / math.sqrt(C // H)
        self.deterministic = DETERMINISTIC            # as the backward graphs are built
        self.want = {False: FWD_PLAN, True: BWD_PLAN}  # the plans asked for, read once like DETERMINISTIC
        self.built = {}                               # backward -> the name of the plan built (None: unnamed)
        self.handle = m.create_handle()
        self.fwd = self._graph(B, backward=False)
        if self.fwd[1] > room:
            raise AndreaError(f"cuDNN attention: its forward needs {self.fwd[1]} bytes of workspace, "
                              f"the scratch holds {room}")
        self.bwd, self._chunks = {}, {}               # backward graphs by chunk; chunk by scratch bytes
        self.chunk = self._chunk(room)
        if self.chunk is None:
            raise AndreaError(f"cuDNN attention: one sequence's backward needs {self._ws(1)} bytes of workspace "
                              f"(H T^2 2 at T={T}), the scratch holds {room}: use train.attention=kernels")

    def _ws(self, c: int) -> int:
        if c not in self.bwd:
            self.bwd[c] = self._graph(c, backward=True)
        return self.bwd[c][1]

    def _chunk(self, room: int) -> int | None:
        """Sequences a backward call over ``room`` scratch bytes takes (built on first use: the engine's
        eager pass runs before its CUDA graph capture)."""
        if room not in self._chunks:
            self._chunks[room] = pick_chunk(self.B, self._ws, room)
        return self._chunks[room]

    def describe(self) -> str:
        v = self.cudnn.backend_version()
        kind = "deterministic" if self.deterministic else "NON-DETERMINISTIC (atomic dQ)"
        plans = "".join(f", {what} plan {self.built[b]}" for b, what in ((False, "forward"), (True, "backward"))
                        if self.built.get(b))
        return (f"attention: cuDNN {v // 10000}.{v // 100 % 100}.{v % 100} SDPA, {kind} backward "
                f"over {self.chunk} to {self.B} of {self.B} sequences a call, as the free bytes fit{plans}")

    def _graph(self, B: int, backward: bool):
        """(graph, workspace bytes, tensors in execute order) of the forward or backward over B sequences."""
        g, tensors = self._ops(B, backward)
        self._build(g, backward)
        return g, int(g.get_workspace_size()), tensors

    def offered(self, backward: bool) -> list[str]:
        """The plans cuDNN's heuristics A, B and its fallback offer for the forward or backward graph over the
        whole batch, by name, each once, in their order: what FWD_PLAN / BWD_PLAN may name
        (bench/attention_plans.py)."""
        names = self._offer(self._ops(self.B, backward)[0])
        return list(dict.fromkeys(names))           # heuristics A and B offer some of the same plans

    def _offer(self, g) -> list[str]:
        """Asks heuristics A, B and the fallback for ``g``'s plans; their names in the order offered."""
        m = self.cudnn
        g.create_execution_plans([m.heur_mode.A, m.heur_mode.B, m.heur_mode.FALLBACK])
        g.check_support()
        return [g.get_plan_name_at_index(i) for i in range(g.get_execution_plan_count())]

    def _ops(self, B: int, backward: bool):
        """(graph, tensors in execute order) of the forward or backward over B sequences, no plan yet."""
        m, T, C, H = self.cudnn, self.T, self.C, self.H
        D, bf, fl = C // H, m.data_type.BFLOAT16, m.data_type.FLOAT
        dim = [B, H, T, D]
        packed, rows, stats = [T * 3 * C, D, 3 * C, 1], [T * C, D, C, 1], [H * T, T, 1, 1]    # (B, H, T, D) strides
        g = m.pygraph(handle=self.handle, io_data_type=bf, intermediate_data_type=fl, compute_data_type=fl)
        q, k, v = (g.tensor(name=n, dim=dim, stride=packed, data_type=bf) for n in "qkv")
        causal = dict(attn_scale=self.scale, diagonal_alignment=m.diagonal_alignment.TOP_LEFT,
                      diagonal_band_right_bound=0)
        if not backward:
            o, lse = g.sdpa(name="attn", q=q, k=k, v=v, generate_stats=True, **causal)
            o.set_output(True).set_dim(dim).set_stride(rows).set_data_type(bf)
            lse.set_output(True).set_dim([B, H, T, 1]).set_stride(stats).set_data_type(fl)
            tensors = (q, k, v, o, lse)
        else:
            o = g.tensor(name="o", dim=dim, stride=rows, data_type=bf)
            do = g.tensor(name="do", dim=dim, stride=rows, data_type=bf)
            lse = g.tensor(name="lse", dim=[B, H, T, 1], stride=stats, data_type=fl)
            dq, dk, dv = g.sdpa_backward(name="attn_bwd", q=q, k=k, v=v, o=o, dO=do, stats=lse,
                                         use_deterministic_algorithm=self.deterministic, **causal)
            for t in (dq, dk, dv):
                t.set_output(True).set_dim(dim).set_stride(packed).set_data_type(bf)
            tensors = (q, k, v, o, do, lse, dq, dk, dv)
        g.validate()
        g.build_operation_graph()
        return g, tensors

    def _build(self, g, backward: bool) -> None:
        """Builds ``g``'s plan: the one named in FWD_PLAN / BWD_PLAN (at construction) where cuDNN's
        heuristics A, B or its fallback offer it, else the first of mode A's; records its name."""
        m, want = self.cudnn, self.want[backward]
        if want is None:
            g.create_execution_plans([m.heur_mode.A, m.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
            return
        names = self._offer(g)
        why = "is not offered here"
        if want in names:
            try:
                g.build_plan_at_index(names.index(want))
                self.built[backward] = want
                return
            except Exception as e:  # noqa: BLE001 - offered, but cuDNN cannot build it for this graph
                why = f"did not build: {str(e).splitlines()[0][:120]}"
        g.build_plans()
        self.built[backward] = f"{names[0] if names else '?'} (cuDNN's first: {want} {why})"

    def _run(self, graph, ptrs, scratch) -> None:
        g, _, tensors = graph
        self.cudnn.set_stream(handle=self.handle, stream=_current_stream())
        g.execute(dict(zip(tensors, ptrs)), scratch.data.ptr, handle=self.handle)

    def forward(self, y, lse, qkv, scratch) -> None:
        """y (B*T, C) = causal attention of qkv (B*T, 3C); lse (B*H, T) = its rows' log-sum-exp (natural
        log). ``scratch``: a device array of at least the forward's workspace."""
        C, p = self.C, qkv.data.ptr
        self._run(self.fwd, (p, p + 2 * C, p + 4 * C, y.data.ptr, lse.data.ptr), scratch)

    def backward(self, dqkv, dy, y, lse, qkv, scratch) -> None:
        """dqkv (B*T, 3C) = d/dqkv given dy (B*T, C), the forward's y and lse; as many sequences a call as
        the backward's workspace fits in ``scratch`` (at least the ``room`` given at construction)."""
        c, T, C, H = self._chunk(scratch.nbytes), self.T, self.C, self.H
        if c is None:
            raise AndreaError(f"cuDNN attention: a scratch of {scratch.nbytes} bytes holds no sequence's backward")
        graph = self.bwd[c]
        for b0 in range(0, self.B, c):
            p3, p1 = qkv.data.ptr + b0 * T * 6 * C, b0 * T * 2 * C
            d3, pl = dqkv.data.ptr + b0 * T * 6 * C, lse.data.ptr + b0 * H * T * 4
            self._run(graph, (p3, p3 + 2 * C, p3 + 4 * C, y.data.ptr + p1, dy.data.ptr + p1, pl,
                                 d3, d3 + 2 * C, d3 + 4 * C), scratch)
