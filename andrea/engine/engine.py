"""The engine: every buffer allocated once, the model of ``andrea/engine/recipe.py`` run on
``backend.xp`` / ``backend.ops`` (NumPy here, the fp32 CuPy mirror in andrea/cuda), and THE
training step (``train_step``: the one microbatch loop; the GPU engine borrows it).

    from andrea.engine.engine import Engine, Hyper
    from andrea.engine.backend import NumpyBackend
    eng = Engine(ModelConfig(1281, 128, 4, 4, 128), batch_size=16, backend=NumpyBackend())
    eng.init_weights(seed=1337)
    print(eng.describe())                                   # true parameter count + planned bytes
    engine_bytes(mc, 16, NumpyBackend())                    # the same planned bytes, nothing allocated
    res = eng.train_step([(x, y)], lr=3e-3, t=1, hp=Hyper())   # x, y: int32 (B, T) host arrays
    loss = eng.forward(x, y)                                # evaluation only (no grads touched)

Memory: the constructor first compares its plan (``engine_bytes``) with ``backend.free_memory()``
and refuses one that does not fit (andrea/preflight.py ``check_memory``: AndreaError, exit 2,
naming the largest batch that does) before it allocates anything.

Shapes: B = batch_size (one microbatch), T = context, C = d_model, H = n_head, V = vocab,
N = B * T. Saved activations and activation gradients are (N, C)-row buffers from the plan
in ``andrea/engine/model.py``; the attention ops see the same memory as (B, T, C).

Step (``train_step``): zero_grads -> for each microbatch: forward + backward(dloss = 1/N)
(a microbatch whose loss is NaN/inf adds no gradient, and every microbatch is still drawn
and reported, so the data stream does not depend on a bad step) -> grad_scale(1/n_micro) ->
grad_norm -> skip the update if the mean loss or the norm is not finite -> clip to
``grad_clip`` by grad_scale -> AdamW. Nothing is allocated in it beyond Python scalars and
O(N)-element reduction temporaries (tests/test_engine_alloc.py).

Threads: the forward and the backward run once per batch slice (``backend.row_slots``: the
fixed ``pool.BATCH_SLICES`` on NumPy, whatever the thread count; one on a device), executed by
the backend's threads (``backend.run_parallel``: at once, or in turn on fewer threads); every
op in a slice sees only its rows. Slices after the first add their parameter gradients into
their own buffer, summed into ``g`` in slice order after the backward, so the bits follow the
slice count, never the thread count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import numpy as np

from andrea.engine import recipe
from andrea.engine.model import Buffer, ModelConfig, PlanPolicy, activation_plan, param_layout, recompute_set
from andrea.preflight import check_memory
from andrea.settings import TrainSettings


@dataclass(frozen=True)
class Hyper:
    """Optimizer hyperparameters (``train.*`` in params.yaml)."""

    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    @classmethod
    def of(cls, train: TrainSettings) -> "Hyper":
        return cls(train.beta1, train.beta2, train.eps, train.weight_decay, train.grad_clip)


def init_params(mc: ModelConfig, seed: int) -> np.ndarray:
    """GPT-2 init as a host float32 flat buffer (n_params,), from a seeded PCG64: N(0, 0.02)
    matrices and embeddings, the residual projections (w_o, w_proj) scaled by 1/sqrt(2 L),
    LayerNorm g = 1, b = 0. Drawn in float32, so a float64 engine holds the same values."""
    layout = param_layout(mc)
    rng = np.random.Generator(np.random.PCG64(seed))
    host = np.zeros(layout.n_params, dtype=np.float32)
    resid_std = 0.02 / math.sqrt(2 * mc.n_layer)
    for t in layout.tensors:
        view = host[t.offset:t.offset + t.size]
        if t.name.endswith(".g"):
            view.fill(1.0)
        elif t.name.endswith(".b"):
            view.fill(0.0)
        else:
            rng.standard_normal(dtype=np.float32, out=view)
            view *= np.float32(resid_std if t.name.endswith(("w_o", "w_proj")) else 0.02)
    return host


@dataclass(frozen=True)
class StepResult:
    loss: float          # mean train loss over the microbatches (nan/inf when bad)
    grad_norm: float     # global L2 norm before clipping (nan when bad)
    ok: bool             # False: the update was skipped, the weights are untouched


def engine_plan(mc: ModelConfig, batch_size: int, backend, slots, n_partials: int = 64, recompute: str = "auto"
                ) -> tuple[PlanPolicy, list[Buffer]]:
    """The policy and activation plan of an Engine on ``backend`` whose batch runs as the row
    ranges ``slots`` at once: each slice has its own scratch and, after the first, its own
    gradient buffer; activations are rows of the shared buffers. Engine.__init__ allocates it;
    andrea/resources.py sizes a cluster job by it without allocating. ``recompute``:
    train.recompute (this engine's own choice, "auto", keeps every activation)."""
    T, C, H, V = mc.context, mc.d_model, mc.n_head, mc.vocab_size
    scratch = [Buffer(f"work.{i}", (backend.work_elems(b1 - b0, T, C, H, V),), "work")
               for i, (b0, b1) in enumerate(slots)]
    scratch += [Buffer("mask", (T, T), "const"), Buffer("partials", (n_partials,), "stat", "float64")]
    if len(slots) > 1:
        scratch.append(Buffer("slot_grads", (len(slots) - 1, param_layout(mc).n_params), "slot_grads", "acc"))
    policy = PlanPolicy(att_shape=tuple(backend.att_shape(batch_size, H, T)), loss_saved=(batch_size * T, V),
                        recompute=recompute_set(recompute, frozenset()), scratch=tuple(scratch))
    return policy, activation_plan(mc, batch_size, policy)


def buffer_bytes(b: Buffer, itemsize: int) -> int:
    """Bytes of a planned buffer in an engine whose float is ``itemsize`` bytes (int32 index
    buffers, float64 statistics)."""
    return b.size * (4 if b.dtype == "int32" else 8 if b.dtype == "float64" else itemsize)


def engine_bytes(mc: ModelConfig, batch_size: int, backend, dtype: str = "float32", n_partials: int = 64,
                 recompute: str = "auto") -> int:
    """``Engine(mc, batch_size, backend, dtype, n_partials, recompute).planned_bytes`` without
    allocating: w, g, m, v and the plan of ``engine_plan``. The memory preflight searches batch
    sizes with it."""
    _, plan = engine_plan(mc, int(batch_size), backend, backend.row_slots(int(batch_size)), n_partials, recompute)
    item = np.dtype(dtype).itemsize
    return 4 * param_layout(mc).n_params * item + sum(buffer_bytes(b, item) for b in plan)


class Engine:
    def __init__(self, mc: ModelConfig, batch_size: int, backend, dtype: str = "float32",
                 n_partials: int = 64, recompute: str = "auto"):
        self.mc, self.B, self.be = mc, int(batch_size), backend
        self.T, self.N = mc.context, self.B * mc.context
        self.ops = backend.ops
        self.dtype = np.dtype(dtype)
        self.layout = param_layout(mc)
        self.n_params = self.layout.n_params
        # Batch slices (NumPy: pool.BATCH_SLICES, fixed; a device backend: one), run by the
        # backend's threads. Each slice has its own scratch and, after the first,
        # its own gradient buffer; activations are rows of the shared buffers.
        self.slots = backend.row_slots(self.B)
        self.policy, self.plan = engine_plan(mc, self.B, backend, self.slots, n_partials, recompute)
        # refuse a plan the backend's memory cannot hold, before allocating anything (exit 2)
        lighter = None if recompute == "gelu" else (
            "train.recompute=gelu", lambda b: engine_bytes(mc, b, backend, dtype, n_partials, "gelu"))
        check_memory(lambda b: engine_bytes(mc, b, backend, dtype, n_partials, recompute), self.B,
                     backend.free_memory(), f"{backend.name} {self.dtype.name} engine", lighter)

        # --- parameters, gradients, Adam moments: four flat buffers
        n = self.n_params
        self.w = backend.zeros(n, self.dtype)
        self.g = backend.zeros(n, self.dtype)
        self.m = backend.zeros(n, self.dtype)
        self.v = backend.zeros(n, self.dtype)
        self.W = {t.name: self.w[t.offset:t.offset + t.size].reshape(t.shape) for t in self.layout.tensors}
        self.G = {t.name: self.g[t.offset:t.offset + t.size].reshape(t.shape) for t in self.layout.tensors}

        # --- activations: one flat buffer per kind, one view per planned buffer
        self.a = {}
        self._flat = {}
        for kind in ("saved", "dgrad", "const", "work", "slot_grads"):
            items = [b for b in self.plan if b.kind == kind]
            if not items:
                continue
            flat = backend.zeros(sum(b.size for b in items), self.dtype)
            self._flat[kind], off = flat, 0
            for b in items:
                self.a[b.name] = flat[off:off + b.size].reshape(b.shape)
                off += b.size
        for b in self.plan:
            if b.kind == "index":
                self.a[b.name] = backend.zeros(b.shape, np.int32)
            elif b.kind == "stat":
                self.a[b.name] = backend.zeros(b.shape, np.float64)
        mask = np.triu(np.full((self.T, self.T), -np.inf, dtype=self.dtype), k=1)
        backend.copy_from_host(self.a["mask"], mask)
        self._pad = (np.zeros((self.B, self.T), np.int32), np.zeros((self.B, self.T), np.int32))  # eval_batch
        self.slices = []
        for i, rows in enumerate(self.slots):
            g = self.g if i == 0 else self.a["slot_grads"][i - 1]
            G = {t.name: g[t.offset:t.offset + t.size].reshape(t.shape) for t in self.layout.tensors}
            z = recipe.views(self.a, self.W, self.W, G, mc, rows, work=self.a[f"work.{i}"], mask=self.a["mask"])
            z.g = g
            self.slices.append(z)

    # ------------------------------------------------------------------ bookkeeping
    def buffers(self) -> dict:
        """Every array the engine owns (the allocation test walks these)."""
        out = {"w": self.w, "g": self.g, "m": self.m, "v": self.v, "partials": self.a["partials"],
               "idx": self.a["idx"], "targets": self.a["targets"]}
        out.update({f"flat.{k}": v for k, v in self._flat.items()})
        return out

    def _nbytes(self, b: Buffer) -> int:
        return buffer_bytes(b, self.dtype.itemsize)

    @property
    def planned_bytes(self) -> int:
        return 4 * self.n_params * self.dtype.itemsize + sum(self._nbytes(b) for b in self.plan)

    @property
    def allocated_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.buffers().values())

    def describe(self) -> str:
        mc = self.mc
        by_kind: dict[str, int] = {}
        for b in self.plan:
            by_kind[b.kind] = by_kind.get(b.kind, 0) + self._nbytes(b)
        mib = 1 << 20
        kinds = ", ".join(f"{k} {v / mib:.1f}" for k, v in by_kind.items())
        return (f"model: {self.n_params:,} parameters (V={mc.vocab_size} C={mc.d_model} H={mc.n_head} "
                f"L={mc.n_layer} T={mc.context}); batch {self.B}x{self.T}; backend {self.be.name} {self.dtype.name}\n"
                f"planned bytes: {self.planned_bytes:,} ({self.planned_bytes / mib:.1f} MiB) = weights+grads+m+v "
                f"{4 * self.n_params * self.dtype.itemsize / mib:.1f} MiB; {kinds} MiB")

    # --------------------------------------------------------------------- weights
    def init_weights(self, seed: int) -> None:
        """Weights from ``init_params`` (seeded); m = v = g = 0."""
        self.be.copy_from_host(self.w, init_params(self.mc, seed))
        self.m.fill(0)
        self.v.fill(0)
        self.g.fill(0)

    def load_state(self, w: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
        for dst, src in ((self.w, w), (self.m, m), (self.v, v)):
            self.be.copy_from_host(dst, src)

    def settle(self) -> None:
        """Return once every queued optimizer step has reached w, m and v, for a reader of them outside the
        engine's own methods (the coherence check samples from ``w``). Here every step is done when it
        returns; GpuEngine's may run on beside the next step (OVERLAP_UPDATE)."""

    def state_host(self):
        """The whole fp32 w, m, v on the host (what a checkpoint saves; GpuEngine's has the same name)."""
        return tuple(self.be.to_host(x) for x in (self.w, self.m, self.v))

    def extra_state(self) -> dict:
        """Optimizer state beyond w, m, v that later steps depend on (none here; the fp16 GPU
        engine has its loss scale). JSON-able; ``load_extra_state`` takes it back."""
        return {}

    def load_extra_state(self, d: dict) -> None:
        if d:
            raise ValueError(f"the {self.be.name} engine keeps no extra state, got keys {sorted(d)}")

    # ------------------------------------------------------------- forward/backward
    def forward(self, x=None, y=None) -> float | None:
        """Run the model on (B, T) int32 ids ``x`` (host; None = the ids already loaded).
        With targets ``y`` return the mean loss as a float; without, leave logits (N, V) in
        ``self.a['logits']`` and return None."""
        a, be, H = self.a, self.be, self.mc.n_head
        if x is not None:
            be.copy_from_host(a["idx"], x)
        if y is not None:
            be.copy_from_host(a["targets"], y)
        be.run_parallel(lambda i: recipe.forward(self.ops, self.slices[i], H, y is not None), len(self.slices))
        if y is None:
            return None
        return float(a["losses"].sum(dtype=np.float64)) / self.N

    def backward(self, dloss: float) -> None:
        """Accumulate (+=) dL/dparams into ``self.g`` for the last forward with targets, where
        L = dloss * sum(losses) (dloss = 1/N gives the gradient of the mean loss).
        Consumes ``probs``; activation gradients are scratch. Slice 0 adds into ``self.g``
        directly, the others into their own zeroed buffers, summed into it after in slice
        order (so the bits depend on the number of slices, never on timing)."""
        be, S, H = self.be, len(self.slices), self.mc.n_head

        def run(i: int) -> None:
            z = self.slices[i]
            if z.g is not self.g:
                z.g.fill(0)
            recipe.backward(self.ops, z, H, dloss, self.policy.recompute)

        be.run_parallel(run, S)
        if S > 1:
            n, g, extra = self.n_params, self.g, self.a["slot_grads"]

            def add(i: int) -> None:                    # element ranges: any split, same bits
                p0, p1 = n * i // S, n * (i + 1) // S
                for j in range(S - 1):
                    g[p0:p1] += extra[j, p0:p1]

            be.run_parallel(add, S)

    # -------------------------------------------------------------------- optimizer
    def zero_grads(self) -> None:
        self.g.fill(0)

    def grad_norm(self) -> float:
        self.ops.grad_norm_partial(self.a["partials"], self.g)
        return self.ops.grad_norm_final(self.a["partials"])

    def micro_step(self, x, y) -> float:
        """Forward + backward of one microbatch, accumulating (+=) its mean-loss gradient into
        ``self.g``. Returns the microbatch's mean loss (nan/inf: nothing was accumulated)."""
        loss = self.forward(x, y)
        if math.isfinite(loss):
            self.backward(1.0 / self.N)
        return loss

    def apply_update(self, n_micro: int, loss: float, lr: float, t: int, hp: Hyper) -> StepResult:
        """Average the accumulated gradients over ``n_micro`` microbatches, clip, AdamW step.
        A non-finite ``loss`` or gradient norm skips the update: the weights, m and v are untouched."""
        if not math.isfinite(loss):
            return StepResult(loss, float("nan"), False)
        if n_micro > 1:
            self.ops.grad_scale(self.g, 1.0 / n_micro)
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return StepResult(loss, norm, False)
        if hp.grad_clip > 0 and norm > hp.grad_clip:
            self.ops.grad_scale(self.g, hp.grad_clip / (norm + 1e-6))
        self.ops.adamw(self.w, self.g, self.m, self.v, self.layout.n_decay, t, lr,
                       hp.beta1, hp.beta2, hp.eps, hp.weight_decay)
        return StepResult(loss, norm, True)

    def train_step(self, batches, lr: float, t: int, hp: Hyper, n_micro: int | None = None,
                   on_loss=None) -> StepResult:
        """THE step: one optimizer step over ``batches``, an iterable of (x, y) int32 (B, T)
        microbatches (drawn lazily, one after the other's loss is known), ``n_micro`` of them
        (default ``len(batches)``). ``t`` is the 1-based AdamW step count (global step + 1).
        ``on_loss(loss)`` is called after each microbatch (the curriculum observes it). Every
        microbatch runs even after a NaN/inf loss; the step's loss is the mean of theirs."""
        n = len(batches) if n_micro is None else int(n_micro)
        self.zero_grads()
        loss = 0.0
        for x, y in batches:
            li = self.micro_step(x, y)
            if on_loss is not None:
                on_loss(li)
            loss += li / n
        return self.apply_update(n, loss, lr, t, hp)

    def eval_batch(self, x: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        """Summed loss and token count of b <= B rows (b < B is padded with row 0 and the
        padding is not counted). Touches activations only, never weights or gradients."""
        b = x.shape[0]
        if b == self.B:
            return self.forward(x, y) * self.N, self.N
        px, py = self._pad
        px[:b], py[:b] = x, y
        px[b:], py[b:] = x[0], y[0]
        self.forward(px, py)
        losses = self.be.to_host(self.a["losses"])
        return float(np.asarray(losses[:b * self.T], dtype=np.float64).sum()), b * self.T
