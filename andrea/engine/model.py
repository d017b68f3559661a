"""Model layout: parameter names, shapes and offsets in one flat fp32 buffer, and the
activation buffer plan (declared once for every engine). Pure arithmetic on shapes: nothing
here allocates. The op sequence that uses them is ``andrea/engine/recipe.py``.

    from andrea.engine.model import ModelConfig, PlanPolicy, param_layout, activation_plan
    mc = ModelConfig(vocab_size=1281, d_model=128, n_head=4, n_layer=4, context=128)
    mc = ModelConfig.of(settings.model, vocab_size=1281)  # the same from the typed config (andrea/settings.py)
    layout = param_layout(mc)          # layout.n_params, layout.n_decay, layout.tensors
    plan = activation_plan(mc, 16, PlanPolicy(att_shape=(16, 128, 4, 128), loss_saved=(16 * 128, 1281)))

The model (decoder-only GPT, pre-LN, no biases except LayerNorm beta):

    x = wte[idx] + wpe[:T]                                    embed         (B, T, C)
    for each layer l:
        x = x + attn_out(attn(attn_qkv(ln1(x))))              pre-LN attention
        x = x + mlp(ln2(x))                                   pre-LN MLP, GELU(tanh), width 4C
    logits = lnf(x) @ wte.T                                   tied output projection (B, T, V)
    loss = mean cross-entropy(logits, targets)

Flat parameter layout, in this order (offsets are element offsets into the flat buffer).
Everything that gets weight decay comes first, so AdamW decays the prefix ``[0, n_decay)``:

    wte                (V, C)        token embedding, also the output projection
    wpe                (context, C)  learned position embedding
    h.{l}.attn.w_qkv   (C, 3C)       columns [q | k | v], each split into H heads of D
    h.{l}.attn.w_o     (C, C)
    h.{l}.mlp.w_fc     (C, 4C)
    h.{l}.mlp.w_proj   (4C, C)
    --- n_decay ---
    h.{l}.ln1.g, h.{l}.ln1.b, h.{l}.ln2.g, h.{l}.ln2.b   (C,) each
    lnf.g, lnf.b       (C,)

Matrices are (C_in, C_out): a linear layer is ``y = x @ W`` on row-major (N, C_in) rows.
Gradients, Adam m and Adam v use the same layout in their own flat buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from andrea.errors import AndreaError, ConfigError
from andrea.settings import ModelSettings, section


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_head: int
    n_layer: int
    context: int

    def __post_init__(self):
        for k in ("vocab_size", "d_model", "n_head", "n_layer", "context"):
            if int(getattr(self, k)) < 1:
                raise AndreaError(f"model.{k}: must be >= 1, got {getattr(self, k)}")
        if self.d_model % self.n_head:
            raise AndreaError(f"model.d_model: {self.d_model} is not divisible by model.n_head={self.n_head}")

    @classmethod
    def of(cls, model: ModelSettings, vocab_size: int) -> "ModelConfig":
        """The model of the typed ``model`` section with the tokenizer's vocabulary."""
        return cls(int(vocab_size), model.d_model, model.n_head, model.n_layer, model.context)

    @classmethod
    def from_cfg(cls, cfg: dict, vocab_size: int) -> "ModelConfig":
        """For a caller that holds only the raw config dict (andrea/generate.py's load_model)."""
        return cls.of(section(ModelSettings, cfg["model"], "model"), vocab_size)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    offset: int
    decay: bool

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParamLayout:
    tensors: tuple[Tensor, ...]
    n_params: int
    n_decay: int
    by_name: dict = field(default_factory=dict, compare=False, repr=False)


def param_layout(mc: ModelConfig) -> ParamLayout:
    C, V, L = mc.d_model, mc.vocab_size, mc.n_layer
    decayed: list[tuple[str, tuple[int, ...]]] = [("wte", (V, C)), ("wpe", (mc.context, C))]
    for l in range(L):
        decayed += [(f"h.{l}.attn.w_qkv", (C, 3 * C)), (f"h.{l}.attn.w_o", (C, C)),
                    (f"h.{l}.mlp.w_fc", (C, 4 * C)), (f"h.{l}.mlp.w_proj", (4 * C, C))]
    plain: list[tuple[str, tuple[int, ...]]] = []
    for l in range(L):
        plain += [(f"h.{l}.ln1.g", (C,)), (f"h.{l}.ln1.b", (C,)), (f"h.{l}.ln2.g", (C,)), (f"h.{l}.ln2.b", (C,))]
    plain += [("lnf.g", (C,)), ("lnf.b", (C,))]
    tensors, off = [], 0
    for group, decay in ((decayed, True), (plain, False)):
        for name, shape in group:
            t = Tensor(name, shape, off, decay)
            tensors.append(t)
            off += t.size
        if decay:
            n_decay = off
    layout = ParamLayout(tuple(tensors), off, n_decay)
    layout.by_name.update({t.name: t for t in tensors})
    return layout


def contiguous_span(layout: ParamLayout, names) -> tuple[int, int]:
    """[first, end) of the flat parameters that the tensors ``names`` cover, each starting where the one
    before it ends (the GPU engine steps and writes such a range in one piece); an AndreaError names the
    first tensor that does not."""
    ts = [layout.by_name[n] for n in names]
    end = ts[0].offset
    for t in ts:
        if t.offset != end:
            raise AndreaError(f"parameter layout: {t.name} starts at element {t.offset}, not where the tensor "
                              f"before it ends ({end}); these must lie one after the other")
        end += t.size
    return ts[0].offset, end


@dataclass(frozen=True)
class Buffer:
    """One planned buffer. ``kind``: saved (forward activations kept for the backward), dgrad
    (activation gradients), work (op scratch), slot_grads (the parameter gradients of the batch
    slices after the first), index (int32 token ids), const (built once), stat (float64
    reduction partials). ``dtype``: act (the compute dtype: the engine's float on NumPy; fp32,
    bf16 or fp16 on the fast GPU engine), acc (the accumulation dtype: the engine's float on
    NumPy, fp32 on the GPU), int32 or float64."""

    name: str
    shape: tuple[int, ...]
    kind: str
    dtype: str = "act"

    @property
    def size(self) -> int:
        return math.prod(self.shape)


# train.recompute: what the backward recomputes instead of keeping per layer (llm.c's -r). "auto":
# the engine's own choice (PlanPolicy.recompute as the backend sets it); "gelu": also h_act =
# gelu(h_pre), one buffer for all layers instead of L (the GPU's bf16 at 120M B=32: -2.1 GiB).
RECOMPUTE_CHOICES = ("auto", "gelu")


def recompute_set(choice: str, auto: frozenset) -> frozenset:
    """PlanPolicy.recompute for train.recompute = ``choice`` where the engine's own choice is ``auto``."""
    if choice not in RECOMPUTE_CHOICES:
        raise ConfigError(f"train.recompute={choice!r}: expected one of {', '.join(RECOMPUTE_CHOICES)}")
    return auto if choice == "auto" else auto | {"gelu"}


@dataclass(frozen=True)
class PlanPolicy:
    """What a backend decides about the activation plan (the model's buffers are the same):

    att_shape    what attn_forward saves per layer: the probabilities (B, T, H, T) on NumPy,
                 the row log-sum-exp (B, H, T) where the kernel is fused
    loss_saved   what loss_forward saves for loss_backward: the softmax (N, V) on NumPy, the row
                 log-sum-exp (N,) where the backward rebuilds dlogits in place in the logits
    recompute    saved activations kept in ONE buffer for all layers and refilled by the backward
                 (the recipe re-runs their forward op): "ln" (ln1, ln2), "gelu" (h_act)
    shared       saved activations kept in ONE buffer for all layers and NOT refilled: the backward
                 never reads them, the engine keeps what it needs of them in its own form (the GPU's
                 fp8 keeps their E4M3 transposes for the weight gradients)
    cast_branch  the branch gradient dbranch is its own compute-dtype buffer, cast from dres
                 (else dbranch IS dres: no copy)
    scratch      the ops' own buffers (work, constants), declared by the backend
    logits_pad   the logits' rows are V rounded up to a multiple of this many elements (1: (N, V);
                 the GPU's 16-bit engines pad to 64 so the head GEMMs' rows start 128-byte aligned;
                 the ops see the (N, V) view of the first V columns)
    """

    att_shape: tuple[int, ...]
    loss_saved: tuple[int, ...]
    recompute: frozenset = frozenset()
    shared: frozenset = frozenset()
    cast_branch: bool = False
    scratch: tuple[Buffer, ...] = ()
    logits_pad: int = 1


def activation_plan(mc: ModelConfig, batch_size: int, policy: PlanPolicy) -> list[Buffer]:
    """Every non-parameter buffer one training step needs, for microbatch (B, T=context): the
    model's saved tensors and activation gradients, declared once for every engine, then the
    backend's scratch (``policy.scratch``)."""
    B, T, C, V, L = batch_size, mc.context, mc.d_model, mc.vocab_size, mc.n_layer
    N = B * T
    one = policy.recompute | policy.shared              # one buffer: refilled per layer, or never read back
    Lln = 1 if "ln" in one else L
    Lgelu = 1 if "gelu" in one else L
    return [
        Buffer("idx", (B, T), "index", "int32"),
        Buffer("targets", (B, T), "index", "int32"),
        # saved activations
        Buffer("res", (2 * L + 1, N, C), "saved", "acc"),  # residual stream: embed, then after each sublayer
        Buffer("ln1", (Lln, N, C), "saved"),
        Buffer("ln1_mean", (L, N), "saved", "acc"),
        Buffer("ln1_rstd", (L, N), "saved", "acc"),
        Buffer("qkv", (L, N, 3 * C), "saved"),
        Buffer("att", (L, *policy.att_shape), "saved", "acc"),
        Buffer("atty", (L, N, C), "saved"),              # attention heads concatenated, before w_o
        Buffer("ln2", (Lln, N, C), "saved"),
        Buffer("ln2_mean", (L, N), "saved", "acc"),
        Buffer("ln2_rstd", (L, N), "saved", "acc"),
        Buffer("h_pre", (L, N, 4 * C), "saved"),
        Buffer("h_act", (Lgelu, N, 4 * C), "saved"),
        Buffer("branch", (N, C), "saved"),               # sublayer output before its residual add
        Buffer("lnf", (N, C), "saved"),
        Buffer("lnf_mean", (N,), "saved", "acc"),
        Buffer("lnf_rstd", (N,), "saved", "acc"),
        Buffer("logits", (N, -(-V // policy.logits_pad) * policy.logits_pad), "saved"),
        Buffer("probs", policy.loss_saved, "saved", "acc" if len(policy.loss_saved) == 1 else "act"),
        Buffer("losses", (N,), "saved", "acc"),
        # activation gradients (reused layer after layer)
        Buffer("dres", (N, C), "dgrad", "acc"),          # grad of the residual stream, accumulated in place
        *([Buffer("dbranch", (N, C), "dgrad")] if policy.cast_branch else []),
        Buffer("dln", (N, C), "dgrad"),
        Buffer("dqkv", (N, 3 * C), "dgrad"),
        Buffer("datty", (N, C), "dgrad"),
        *policy.scratch,
    ]
