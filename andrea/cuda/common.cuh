// common.cuh: helpers shared by every ANDREA kernel file (the loader prepends this file).
//
// Storage types: float (fp32), bf16_t and f16_t (16-bit payloads, converted with PTX cvt,
// so no CUDA header is needed under NVRTC). Arithmetic is always fp32.
// Reductions use fixed shapes and fixed orders (warp shuffles, then shared memory in
// warp order): the same launch geometry gives the same bits on every run. No float atomics.

#define ANDREA_INF __int_as_float(0x7f800000)

struct bf16_t { unsigned short x; };
struct f16_t { unsigned short x; };

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16_t v) { return __uint_as_float(((unsigned)v.x) << 16); }
__device__ __forceinline__ float to_f(f16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
    return f;
}

template <typename T> __device__ __forceinline__ T from_f(float f);
template <> __device__ __forceinline__ float from_f<float>(float f) { return f; }
template <> __device__ __forceinline__ bf16_t from_f<bf16_t>(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    bf16_t r; r.x = h; return r;
}
template <> __device__ __forceinline__ f16_t from_f<f16_t>(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    f16_t r; r.x = h; return r;
}

// 16 bytes of storage type T as floats (4 fp32 or 8 16-bit values, in memory order), and back
// (from_f's rounding): one vector access per 16 bytes.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4 u, float* f) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if constexpr (sizeof(T) == 4) {
            f[i] = __uint_as_float(w[i]);
        } else {
            T lo, hi;
            lo.x = (unsigned short)(w[i] & 0xffffu);
            hi.x = (unsigned short)(w[i] >> 16);
            f[2 * i] = to_f(lo);
            f[2 * i + 1] = to_f(hi);
        }
    }
}
template <typename T>
__device__ __forceinline__ uint4 pack16(const float* f) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if constexpr (sizeof(T) == 4) {
            w[i] = __float_as_uint(f[i]);
        } else {
            w[i] = (unsigned)from_f<T>(f[2 * i]).x | ((unsigned)from_f<T>(f[2 * i + 1]).x << 16);
        }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum (or max) over a block of blockDim.x threads (a multiple of 32, at most 1024); every
// thread gets the result. `buf` holds 32 floats of shared memory. Fixed order: warps, then warp 0.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* buf) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) buf[wid] = v;
    __syncthreads();
    const float r = (lane < nw) ? buf[lane] : (MAX ? -ANDREA_INF : 0.0f);
    return MAX ? warp_max(r) : warp_sum(r);
}
__device__ __forceinline__ float block_sum(float v, float* buf) { return block_reduce<false>(v, buf); }
__device__ __forceinline__ float block_max(float v, float* buf) { return block_reduce<true>(v, buf); }

// bf16 bits -> FP8 E4M3 (fp8.cu's casts, and the fp8 engine's LayerNorm forwards in layernorm.cu):
// E4M3(bf16 value * s), round to nearest even, saturating at +-448; a non-finite bf16 gives NaN 0x7F.
__device__ __forceinline__ bool bf16_finite(unsigned h) { return (h & 0x7f80u) != 0x7f80u; }
__device__ __forceinline__ float bf16_absf(unsigned h) {
    return bf16_finite(h) ? __uint_as_float((h & 0x7fffu) << 16) : 0.0f;
}

// Two floats -> two E4M3 codes in one 16-bit word, `lo` in the low byte: round to nearest even,
// saturating at +-448 (an infinity too); the callers below turn a non-finite input into NaN 0x7F.
__device__ __forceinline__ unsigned e4m3x2(float lo, float hi) {
    unsigned short r;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));   // first operand -> high byte
#else
    r = 0x7f7f;   // no FP8 conversion before sm_89 (the fp8 engine refuses those GPUs: fp8.require_fp8)
#endif
    return r;
}
__device__ __forceinline__ unsigned nan_where(unsigned w, bool lo_ok, bool hi_ok) {
    if (!lo_ok) w = (w & 0xff00u) | 0x7fu;
    if (!hi_ok) w = (w & 0x00ffu) | 0x7f00u;
    return w;
}

// Two E4M3 codes of bf16 values times s: `lo` (bf16 bits of the first element) in the low byte; a
// non-finite bf16 gives NaN (a finite one that overflows by the scale saturates).
__device__ __forceinline__ unsigned fp8_pair(unsigned lo, unsigned hi, float s) {
    return nan_where(e4m3x2(__uint_as_float(lo << 16) * s, __uint_as_float(hi << 16) * s), bf16_finite(lo),
                     bf16_finite(hi));
}

// Two E4M3 codes of fp32 values (the fp8 head's dlogits, loss.cu): a non-finite value gives NaN.
__device__ __forceinline__ unsigned fp8_pair_f(float lo, float hi) {
    return nan_where(e4m3x2(lo, hi), isfinite(lo), isfinite(hi));
}

// The MLP's GELU (tanh form) and its derivative, shared by the training kernels (elementwise.cu),
// the fp8 gradient cast (fp8.cu) and decoding (decode.cu):
// gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = k (x + a x^3): one expf, no tanhf.
#define GELU_K 0.7978845608028654f  // sqrt(2/pi)
#define GELU_C 0.044715f
__device__ __forceinline__ float gelu_f(float x) {
    const float u = GELU_K * (x + GELU_C * x * x * x);
    return x / (1.0f + expf(-2.0f * u));
}
// d gelu / dx = s + x s (1 - s) 2 u', s = sigmoid(2u), u' = k (1 + 3a x^2). The exponential is the
// hardware one (__expf: MUFU.EX2 after one multiply, relative error ~1e-6 for |2u| < 10, far under a
// bf16 ULP; expf's range reduction is ~8 more instructions), and so is the reciprocal (__fdividef(1, y):
// MUFU.RCP, within 2 ulp; 0 for y > 2^126, where s < 1e-38 and gelu' rounds to 0 in bf16 anyway). The fp8
// GELU-backward cast runs this on every element of dL/dh and is instruction-bound (H200, 32768 x 3072:
// expf 214 us, __expf 193 (session 13), __frcp_rn -> __fdividef 216 -> 202 us in the engine's launch with
// no E4M3 code changed on 100M random inputs (session 16); the bytes' floor 157; docs/FP8.md).
__device__ __forceinline__ float gelu_grad_f(float x) {
    const float u = GELU_K * (x + GELU_C * x * x * x);
    const float s = __fdividef(1.0f, 1.0f + __expf(-2.0f * u));
    return s + x * s * (1.0f - s) * 2.0f * GELU_K * (1.0f + 3.0f * GELU_C * x * x);
}

// AdamW on one parameter, each rounding spelled out (the same arithmetic as ops_numpy.adamw; optim.cu's
// k_adamw* and fp8.cu's k_adamw_w8_bf16):
// m = fma(1 - b1, g, b1 m), v = fma((1 - b2) g, g, b2 v), the decay factor fma(-lr, wd, 1),
// w = fma(-step, m / fma(sqrt(v), isb2, eps), w). These are the operations NVRTC (CUDA 13) compiled the
// one-a-thread kernel's plain expressions to (its SASS, session 14), so the bits are the ones it always
// gave, and no surrounding code (the four-a-thread loads) can make the compiler contract differently.
__device__ __forceinline__ void adamw_pinned(float& w, float g, float& m, float& v, bool decay, float lr, float wd,
                                             float step, float isb2, float b1, float b2, float eps) {
    m = __fmaf_rn(1.0f - b1, g, __fmul_rn(b1, m));
    v = __fmaf_rn(__fmul_rn(1.0f - b2, g), g, __fmul_rn(b2, v));
    if (decay) w = __fmul_rn(w, __fmaf_rn(-lr, wd, 1.0f));
    w = __fmaf_rn(-step, __fdiv_rn(m, __fmaf_rn(__fsqrt_rn(v), isb2, eps)), w);
}
