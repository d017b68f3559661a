"""An independent PyTorch implementation of the ANDREA model: the oracle of the engine tests
and the anchor of bench/engine_cpu.py. Needs torch (the optional ``oracle`` extra); nothing
in the pipeline imports it.

    from andrea.engine.oracle_torch import TorchGPT
    ref = TorchGPT(mc)                       # same parameter names and shapes as the engine layout
    ref.load_flat(engine_weights)            # (n_params,) numpy, the engine's flat layout
    logits, loss = ref(idx, targets)         # idx, targets: torch int64 (B, T); logits (B, T, V)
    grads = ref.flat_grads()                 # (n_params,) numpy, same layout, after loss.backward()
    opt = ref.adamw(lr, beta1, beta2, eps, weight_decay)   # decay on matrices/embeddings only

Built from torch's own primitives (F.layer_norm, F.scaled_dot_product_attention with
is_causal, F.gelu(approximate="tanh"), F.cross_entropy, autograd, torch.optim.AdamW), so
it shares no code with andrea.engine.ops_numpy.
"""

from __future__ import annotations

import numpy as np

from andrea.engine.model import ModelConfig, param_layout

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # pragma: no cover - exercised only where torch is absent
    raise ImportError("andrea.engine.oracle_torch needs torch (pip install 'andrea[oracle]')") from e


class TorchGPT(torch.nn.Module):
    def __init__(self, mc: ModelConfig, dtype=torch.float32):
        super().__init__()
        self.mc = mc
        self.layout = param_layout(mc)
        self.names = [t.name for t in self.layout.tensors]
        self.p = torch.nn.ParameterDict({
            n.replace(".", "_"): torch.nn.Parameter(torch.zeros(t.shape, dtype=dtype))
            for n, t in zip(self.names, self.layout.tensors)})

    def P(self, name: str) -> torch.nn.Parameter:
        return self.p[name.replace(".", "_")]

    def load_flat(self, w: np.ndarray) -> None:
        with torch.no_grad():
            for t in self.layout.tensors:
                self.P(t.name).copy_(torch.from_numpy(np.ascontiguousarray(
                    w[t.offset:t.offset + t.size]).reshape(t.shape)))

    def flat(self, attr: str = "data") -> np.ndarray:
        parts = []
        for n in self.names:
            x = getattr(self.P(n), attr)
            parts.append(np.zeros(self.layout.by_name[n].size) if x is None else x.detach().reshape(-1).numpy())
        return np.concatenate(parts)

    def flat_grads(self) -> np.ndarray:
        return self.flat("grad")

    def forward(self, idx, targets=None):
        mc = self.mc
        B, T = idx.shape
        C, H = mc.d_model, mc.n_head
        x = self.P("wte")[idx] + self.P("wpe")[:T]
        for l in range(mc.n_layer):
            P = lambda k: self.P(f"h.{l}.{k}")  # noqa: E731
            h = F.layer_norm(x, (C,), P("ln1.g"), P("ln1.b"), eps=1e-5)
            q, k, v = (h @ P("attn.w_qkv")).split(C, dim=-1)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + y.transpose(1, 2).reshape(B, T, C) @ P("attn.w_o")
            h = F.layer_norm(x, (C,), P("ln2.g"), P("ln2.b"), eps=1e-5)
            x = x + F.gelu(h @ P("mlp.w_fc"), approximate="tanh") @ P("mlp.w_proj")
        x = F.layer_norm(x, (C,), self.P("lnf.g"), self.P("lnf.b"), eps=1e-5)
        logits = x @ self.P("wte").T
        loss = None if targets is None else F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1))
        return logits, loss

    def adamw(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, **kw):
        decay = [self.P(t.name) for t in self.layout.tensors if t.decay]
        plain = [self.P(t.name) for t in self.layout.tensors if not t.decay]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": plain, "weight_decay": 0.0}],
                                 lr=lr, betas=(beta1, beta2), eps=eps, **kw)
