"""Test doubles for data-parallel tests: N in-process ranks over threads (``FakeGroup``,
``FakeComm``, ``run_ranks``) and the NumPy twin of the GPU engine's ZeRO-1 kernels (``NumpyZero1``).
Used by tests/test_dist.py and tests/test_dist_train.py."""

from __future__ import annotations

import math
import threading

import numpy as np

from andrea.engine import ops_numpy


class FakeGroup:
    """N in-process ranks (one thread each): every collective is an exchange at a barrier, and the
    sums run in rank order, as the NCCL ring does for a fixed world size."""

    def __init__(self, n: int):
        self.n, self.bar, self.slots = n, threading.Barrier(n, timeout=60), [None] * n

    def comm(self, rank: int) -> "FakeComm":
        return FakeComm(self, rank)


class FakeComm:
    def __init__(self, group: FakeGroup, rank: int):
        self.g, self.rank, self.size = group, rank, group.n

    def _exchange(self, x) -> list:
        self.g.slots[self.rank] = np.array(x, copy=True)
        self.g.bar.wait()
        out = list(self.g.slots)
        self.g.bar.wait()
        return out

    def reduce_scatter(self, full, shard) -> None:
        parts, s = self._exchange(full), shard.size
        acc = parts[0][self.rank * s:(self.rank + 1) * s].copy()
        for p in parts[1:]:
            acc += p[self.rank * s:(self.rank + 1) * s]
        shard[...] = acc

    def all_gather(self, shard, full) -> None:
        full[...] = np.concatenate(self._exchange(shard))

    def allreduce_max(self, host):
        return np.max(np.stack(self._exchange(host)), axis=0)

    def all_gather_host(self, host):
        return np.stack(self._exchange(np.asarray(host, dtype=np.float64).reshape(-1)))

    def barrier(self) -> None:
        self._exchange(0)


def on_threads(n: int, fn, group: FakeGroup) -> list:
    """fn(rank) on n threads, their results in rank order; an exception in any rank breaks the
    group's barrier (so the others stop waiting) and is raised."""
    out, errs = [None] * n, []

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)
            group.bar.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errs:
        raise errs[0]
    return out


def run_ranks(n: int, fn) -> list:
    """fn(comm) on n threads over one FakeGroup; their results in rank order."""
    group = FakeGroup(n)
    return on_threads(n, lambda r: fn(group.comm(r)), group)


class NumpyZero1:
    """The GPU engine's ZeRO-1 kernels' NumPy twins (andrea/cuda/engine.py _Zero1Kernels): chunked
    float64 partial sums of squares, the clip rule of optim.cu k_grad_norm_final, ops_numpy.adamw."""

    P = 4

    def __init__(self, w, g, m, v, world, clip, inv, t=3, lr=1e-2, hp=None):
        from andrea.engine.engine import Hyper

        self.hp = hp or Hyper()
        self.w, self.g, self.m, self.v = w, g, m, v
        self.part, self.part_all = np.zeros(self.P), np.zeros(self.P * world)
        self.clip, self.inv, self.t, self.lr = clip, inv, t, lr
        self.gstate = None

    def sumsq(self, g_shard, length):
        for i in range(self.P):
            c = g_shard[length * i // self.P:length * (i + 1) // self.P].astype(np.float64)
            self.part[i] = float(np.dot(c, c))

    def finish(self):
        s = 0.0
        for p in self.part_all:
            s += float(p)
        norm = math.sqrt(s) * self.inv
        ok = math.isfinite(norm)
        scale = self.inv * (self.clip / (norm + 1e-6) if self.clip > 0 and ok and norm > self.clip else 1.0)
        self.gstate = (norm, scale, ok)

    def adamw(self, w_shard, g_shard, length, n_decay):
        norm, scale, ok = self.gstate
        if not ok or not length:
            return
        gg = (g_shard[:length] * np.float32(scale)).astype(np.float32)
        hp = self.hp
        ops_numpy.adamw(w_shard[:length], gg, self.m[:length], self.v[:length], n_decay, self.t, self.lr,
                        hp.beta1, hp.beta2, hp.eps, hp.weight_decay)

    def refresh(self):
        pass
