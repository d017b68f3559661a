"""FP8 E4M3 in NumPy: the reference twin of the GPU engine's fp8 casts (``andrea/cuda/fp8.cu``)
and of the dequantized FP8 GEMM (``andrea/cuda/cublaslt.py``). No ml_dtypes: the encoding is
written out by hand and is bit-exact with the hardware's ``cvt.rn.satfinite.e4m3x2.f32``.

    from andrea.engine import fp8_numpy as f8
    q, inv = f8.quantize(x)                 # x float32 (or bf16 payloads widened), q uint8 E4M3 bits
    x_hat = f8.dequantize(q, inv)           # float32, |x_hat - x| <= |x| / 16 + 2**-10 * inv

E4M3 (OCP FP8, NVIDIA's ``__nv_fp8_e4m3``): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa
bits; no infinities; 0x7F / 0xFF are NaN; largest finite 448 (0x7E), smallest subnormal 2**-9.
Per-tensor *current* scaling (``train.fp8_scaling: current``): amax = max |x| over the finite
entries; scale = 448 / amax (1 when amax is 0); q = E4M3(x * scale) rounded to nearest, ties to
even, saturating at +-448; a non-finite x gives NaN (0x7F), so a step that overflowed upstream
stays non-finite and the engine's step guard skips it. The GEMM reads ``inv = 1 / scale`` (fp32).

*Delayed* scaling (``train.fp8_scaling: delayed``): each cast site keeps the amaxes of its last
``train.fp8_amax_history`` steps (``AmaxHistory``, which the engine itself runs on the host: the
rule has no CUDA copy); its scale is ``scale_of(max of that history)``; the cast
(``quantize_delayed``) multiplies by that scale, saturates what lies beyond 448 and reports the
tensor's own amax, which enters the history after the step. While a history is empty (the first
step of a run) the casts use current scaling and record their amaxes the same way.
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
AMAX_TINY = np.float32(1e-30)     # an amax at or below it (an all-zero tensor) gets scale 1 (fp8.cu's 1e-30f)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 payloads -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values -> uint16 bf16 payloads, rounded to nearest even (finite inputs)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def amax(x: np.ndarray) -> np.float32:
    """max |x| over the finite entries (0 for none), float32."""
    a = np.abs(np.asarray(x, dtype=np.float32))
    a = a[np.isfinite(a)]
    return np.float32(a.max()) if a.size else np.float32(0.0)


def scale_of(am) -> tuple[np.float32, np.float32]:
    """(scale, inv) for a tensor of amax ``am``: fp32 448 / amax and its fp32 reciprocal, like
    the kernel (IEEE division, round to nearest). amax <= 1e-30 (all zero) gives scale 1."""
    am = np.float32(am)
    s = np.float32(E4M3_MAX) / am if am > AMAX_TINY else np.float32(1.0)
    return np.float32(s), np.float32(np.float32(1.0) / np.float32(s))


def encode(y: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 bits (uint8): round to nearest even, saturate at +-448, NaN/inf -> 0x7F."""
    y = np.asarray(y, dtype=np.float32)
    sign = np.signbit(y).astype(np.uint8) << 7
    a = np.abs(y).astype(np.float64)                      # exact copy; every step below is exact
    fin = np.isfinite(a)
    a = np.where(fin, a, 0.0)
    _, e2 = np.frexp(np.where(a > 0, a, 1.0))               # a = f * 2**e2, f in [0.5, 1)
    e = np.maximum(e2.astype(np.int64) - 1, -6)             # unbiased exponent; subnormals share -6
    q = np.ldexp(1.0, (e - 3).astype(np.int32))             # the spacing of E4M3 values at a
    r = np.rint(a / q)                                      # ties to even (a / q is exact)
    bits = np.where(a >= 2.0 ** -6, (e + 7) * 8 + (r.astype(np.int64) - 8), r.astype(np.int64))
    bits = np.where(a >= E4M3_MAX, 0x7E, np.minimum(bits, 0x7E))   # saturate (0x7F would be NaN)
    out = bits.astype(np.uint8) | sign
    return np.where(fin, out, np.uint8(E4M3_NAN)).astype(np.uint8)


def decode(q: np.ndarray) -> np.ndarray:
    """E4M3 bits (uint8) -> float32 (exact); 0x7F / 0xFF -> NaN."""
    q = np.asarray(q, dtype=np.uint8).astype(np.int64)
    e, m = (q >> 3) & 15, q & 7
    mag = np.where(e == 0, np.ldexp(m.astype(np.float64), -9), np.ldexp((8 + m).astype(np.float64),
                                                                        (e - 10).astype(np.int32)))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(q & 0x80, -mag, mag).astype(np.float32)


def hpre_codes(p: np.ndarray, hscale) -> np.ndarray:
    """The fp8 engine's E4M3 h_pre (andrea/cuda/fp8.py HPRE_E4M3): the fc GEMM's fp32 pre-activation p
    at the fixed scale ``hscale``, saturating at +-448 / hscale (cuBLASLt's aux scale)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return encode(np.asarray(p, dtype=np.float32) * np.float32(hscale))


def hpre_values(codes: np.ndarray, hscale) -> np.ndarray:
    """What the GELU-backward cast takes gelu' of (fp8.cu k_fp8_dgelu8_cast_t_bf16): decode(codes) /
    hscale, exact in float32 and, hscale a power of two, a bf16 value."""
    return decode(codes) * np.float32(1.0 / float(hscale))


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """The engine's cast of one tensor: (E4M3 bits of x * scale, inv) with current scaling."""
    x = np.asarray(x, dtype=np.float32)
    s, inv = scale_of(amax(x))
    with np.errstate(invalid="ignore", over="ignore"):
        y = x * s                                           # one fp32 multiply, as on the GPU
    return encode(y), inv


def dequantize(q: np.ndarray, inv) -> np.ndarray:
    """float32 values the GEMM multiplies: decode(q) * inv."""
    return decode(q) * np.float32(inv)


def gemm_nt(x8: np.ndarray, x_inv, y8: np.ndarray, y_inv) -> np.ndarray:
    """Reference of the FP8 GEMM D (M, N) = (x8 * x_inv) (M, K) @ ((y8 * y_inv) (N, K))^T in float64
    (the GPU accumulates in fp32 and rounds D to its storage type)."""
    a = decode(x8).astype(np.float64)
    b = decode(y8).astype(np.float64)
    return (a @ b.T) * (float(x_inv) * float(y_inv))


def quantize_delayed(x: np.ndarray, scale) -> tuple[np.ndarray, np.float32, bool]:
    """The delayed cast of one tensor with a given fp32 ``scale``: (E4M3 bits of x * scale,
    saturating at +-448; amax of x, which the kernel reduces in the same pass; whether the cast
    clipped, i.e. amax * scale > 448 in fp32)."""
    x = np.asarray(x, dtype=np.float32)
    s = np.float32(scale)
    with np.errstate(invalid="ignore", over="ignore"):
        y = x * s
    am = amax(x)
    return encode(y), am, bool(np.float32(am * s) > np.float32(E4M3_MAX))


def loss_dlogits_e4m3(logits: np.ndarray, targets: np.ndarray, lse: np.ndarray, dscale, ld: int | None = None):
    """The fp8 tied head's output gradient (loss.cu ``k_loss_bwd_e4m3``): (E4M3 bits (N, ld) of
    (softmax(logits) - onehot(targets)) * 448, zero past V; inv = dscale / 448). ``logits`` float32
    (N, V) (bf16 payloads widened), ``lse`` (N,) its row log-sum-exp. |softmax - onehot| <= 1, so the
    fixed scale 448 never saturates and needs no amax; the dequantized value is dscale * (p - y)."""
    x = np.asarray(logits, dtype=np.float32)
    N, V = x.shape
    ld = V if ld is None else int(ld)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.exp(x - np.asarray(lse, np.float32)[:, None])
        d[np.arange(N), np.asarray(targets, np.int64)] -= np.float32(1.0)
        y = np.zeros((N, ld), np.float32)
        y[:, :V] = d * np.float32(E4M3_MAX)
    return encode(y), np.float32(np.float32(dscale) / np.float32(E4M3_MAX))

WCHUNK, WTILE = 16384, 64        # fp8.cu's k_fp8_wamax chunk and k_fp8_wcast tile


def cast_weights_table(wlow: np.ndarray, table: np.ndarray, n_chunks: int, n_tiles: int, w8: np.ndarray,
                       inv: np.ndarray, at: np.ndarray | None = None) -> np.ndarray:
    """Twin of fp8.cu's k_fp8_wamax + k_fp8_wcast (``andrea.cuda.fp8.weight_table``'s rows: first
    element, R, C, w8 offsets of the (R, C) and (C, R) copies, inv index, first chunk, first tile),
    block by block as the kernels split the work: each weight's amax over its chunks, then each
    tile of its two E4M3 copies at scale_of(amax), and the factor 1 / scale into inv. ``wlow``
    (bf16 payloads), ``w8`` (uint8) and ``inv`` (float32) are flat. ``at``: cast at these amaxes
    instead (one a weight; k_adamw_w8_bf16's codes, made at the amax of the weights before the step).
    Returns the amax of each weight in wlow (its finite entries)."""
    def owner(b, col):                    # fp8.cu's weight_of: the weights i >= 1 starting at or before b
        return int(np.count_nonzero(table[1:, col] <= b))

    am = np.zeros(len(table), np.float32)
    for b in range(n_chunks):
        i = owner(b, 6)
        first, R, C = (int(v) for v in table[i, :3])
        c = b - int(table[i, 6])
        lo, hi = first + c * WCHUNK, first + min(R * C, (c + 1) * WCHUNK)
        if lo >= hi:
            raise ValueError(f"weight table: block {b} lies past weight {i}'s last chunk")
        am[i] = max(am[i], amax(bf16_to_f32(wlow[lo:hi])))
    for b in range(n_tiles):
        i = owner(b, 7)
        first, R, C, o, ot, k = (int(v) for v in table[i, :6])
        t, tc = b - int(table[i, 7]), C // WTILE
        r0, c0 = (t // tc) * WTILE, (t % tc) * WTILE
        if r0 >= R:
            raise ValueError(f"weight table: block {b} lies past weight {i}'s last tile")
        s, iv = scale_of(am[i] if at is None else at[i])
        x = bf16_to_f32(wlow[first:first + R * C].reshape(R, C)[r0:r0 + WTILE, c0:c0 + WTILE])
        with np.errstate(invalid="ignore", over="ignore"):
            q = encode(x * s)
        w8[o:o + R * C].reshape(R, C)[r0:r0 + WTILE, c0:c0 + WTILE] = q
        w8[ot:ot + R * C].reshape(C, R)[c0:c0 + WTILE, r0:r0 + WTILE] = q.T
        if t == 0:
            inv[k] = iv
    return am


class AmaxHistory:
    """The delayed-scaling state of ``n`` cast sites: the amaxes of their last ``length`` steps
    (a ring, float32) and the count of steps pushed. JSON-able through ``state``/``load``.

        h = AmaxHistory(n_sites, 16)
        scale, inv = h.scales()              # float32 (n,) each; only valid once h.steps > 0
        clipped = h.push(amax_this_step)     # how many sites' amax exceeded 448 / their scale
    """

    def __init__(self, n: int, length: int):
        if int(length) < 1:
            raise ValueError(f"train.fp8_amax_history: {length} (needs at least 1)")
        self.hist = np.zeros((int(n), int(length)), dtype=np.float32)
        self.steps = 0
        self.clipped_total = 0

    @property
    def empty(self) -> bool:
        return self.steps == 0

    def scales(self) -> tuple[np.ndarray, np.ndarray]:
        """Per site (scale, inv) = scale_of(max over its history), as the kernels and GEMMs read them."""
        am = self.hist.max(axis=1)                       # scale_of over every site at once (fp32 IEEE ops)
        with np.errstate(divide="ignore", over="ignore"):    # the masked-out lanes may overflow
            scale = np.where(am > AMAX_TINY, np.float32(E4M3_MAX) / am, np.float32(1.0)).astype(np.float32)
        return scale, (np.float32(1.0) / scale).astype(np.float32)

    def push(self, am: np.ndarray) -> int:
        """One step's amaxes (n,) into the ring; returns how many of them clipped under the scales
        this step used (0 for the first step, cast with current scaling): a site clips when its
        amax exceeds the history's max that its scale was made from (448 with scale 1), not when
        amax * scale > 448 in fp32, which fl(448 / a) * a is for about one amax in eleven: the
        history's own amax maps onto 448 give or take an ulp and loses nothing."""
        am = np.asarray(am, dtype=np.float32).reshape(-1)
        if am.shape != (self.hist.shape[0],):
            raise ValueError(f"fp8 amax: {am.shape[0]} sites, the history has {self.hist.shape[0]}")
        clipped = 0
        if not self.empty:
            top = self.hist.max(axis=1)
            limit = np.where(top > AMAX_TINY, top, np.float32(E4M3_MAX))     # scales(): scale 1 at AMAX_TINY
            clipped = int(np.count_nonzero(~(am <= limit)))                          # NaN/inf amax: clipped
        self.hist[:, self.steps % self.hist.shape[1]] = am
        self.steps += 1
        self.clipped_total += clipped
        return clipped

    def state(self) -> dict:
        return {"amax_history": self.hist.tolist(), "steps": int(self.steps), "clipped_total": int(self.clipped_total)}

    def load(self, d: dict) -> None:
        h = np.asarray(d["amax_history"], dtype=np.float32)
        if h.shape != self.hist.shape:
            raise ValueError(f"fp8 amax history of shape {h.shape}, this engine's is {self.hist.shape} "
                             "(another model or train.fp8_amax_history? or saved before the E4M3 head's 2 sites, "
                             "andrea/cuda/fp8.py FP8_HEAD)")
        self.hist = h.copy()
        self.steps, self.clipped_total = int(d["steps"]), int(d["clipped_total"])
