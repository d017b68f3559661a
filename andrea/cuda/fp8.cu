// fp8.cu: the fp8 engine's casts, bf16 -> FP8 E4M3 with per-tensor current scaling.
// NumPy twin: andrea/engine/fp8_numpy.py (amax, scale_of, encode); launchers: andrea/cuda/fp8.py.
//
// One tensor is cast in two launches:
//   k_fp8_amax_bf16    P blocks (fixed), each writes the max |x| of its grid-stride share of the
//                      finite entries to part[block] (no atomics: the same bits every run);
//   k_fp8_cast[_t]_bf16 every block reduces part[0..P) to amax, takes scale = 448 / amax (1 for an
//                      all-zero tensor) and writes E4M3(x * scale) (round to nearest even, saturating
//                      at +-448; a non-finite x writes NaN 0x7F so the step stays non-finite); block 0
//                      writes inv = 1 / scale, the GEMM's dequantization factor. The _t kernel also
//                      (or only) writes the transpose, which Hopper's FP8 GEMM needs (both operands
//                      K-contiguous).

__device__ __forceinline__ bool bf16_finite(unsigned h) { return (h & 0x7f80u) != 0x7f80u; }
__device__ __forceinline__ float bf16_absf(unsigned h) {
    return bf16_finite(h) ? __uint_as_float((h & 0x7fffu) << 16) : 0.0f;
}

// Two E4M3 codes in one 16-bit word: `lo` (bf16 bits of the first element) in the low byte.
__device__ __forceinline__ unsigned fp8_pair(unsigned lo, unsigned hi, float s) {
    const float a = __uint_as_float(lo << 16) * s, b = __uint_as_float(hi << 16) * s;
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(b), "f"(a));   // first operand -> high byte
    unsigned w = r;
    if (!bf16_finite(lo)) w = (w & 0xff00u) | 0x7fu;
    if (!bf16_finite(hi)) w = (w & 0x00ffu) | 0x7f00u;
    return w;
}

// 8 bf16 (one uint4) -> 8 E4M3 bytes (one uint2), element order kept.
__device__ __forceinline__ uint2 fp8_pack8(uint4 v, float s) {
    uint2 o;
    o.x = fp8_pair(v.x & 0xffffu, v.x >> 16, s) | (fp8_pair(v.y & 0xffffu, v.y >> 16, s) << 16);
    o.y = fp8_pair(v.z & 0xffffu, v.z >> 16, s) | (fp8_pair(v.w & 0xffffu, v.w >> 16, s) << 16);
    return o;
}

__device__ __forceinline__ float fp8_scale(const float* __restrict__ part, int P, float* buf) {
    float m = 0.0f;
    for (int i = threadIdx.x; i < P; i += blockDim.x) m = fmaxf(m, part[i]);
    m = block_max(m, buf);
    return m > 1e-30f ? 448.0f / m : 1.0f;
}

extern "C" __global__ void k_fp8_amax_bf16(const uint4* __restrict__ x, long long n8, float* __restrict__ part) {
    __shared__ float buf[32];
    float m = 0.0f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = x[i];
        m = fmaxf(m, fmaxf(fmaxf(bf16_absf(v.x & 0xffffu), bf16_absf(v.x >> 16)),
                           fmaxf(bf16_absf(v.y & 0xffffu), bf16_absf(v.y >> 16))));
        m = fmaxf(m, fmaxf(fmaxf(bf16_absf(v.z & 0xffffu), bf16_absf(v.z >> 16)),
                           fmaxf(bf16_absf(v.w & 0xffffu), bf16_absf(v.w >> 16))));
    }
    m = block_max(m, buf);
    if (threadIdx.x == 0) part[blockIdx.x] = m;
}

// x (n8 * 8,) bf16 -> out (n8 * 8,) E4M3, same order.
extern "C" __global__ void k_fp8_cast_bf16(const uint4* __restrict__ x, long long n8, const float* __restrict__ part,
                                           int P, uint2* __restrict__ out, float* __restrict__ inv) {
    __shared__ float buf[32];
    const float s = fp8_scale(part, P, buf);
    if (blockIdx.x == 0 && threadIdx.x == 0) inv[0] = 1.0f / s;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (long long)gridDim.x * blockDim.x)
        out[i] = fp8_pack8(x[i], s);
}

// x (R, C) bf16 row-major, R and C multiples of 64 -> out_t (C, R) E4M3 and, unless out is null,
// out (R, C) E4M3. Grid (C / 64, R / 64), 256 threads; one 64 x 64 tile per block.
extern "C" __global__ void k_fp8_cast_t_bf16(const unsigned short* __restrict__ x, int R, int C,
                                             const float* __restrict__ part, int P, unsigned char* __restrict__ out,
                                             unsigned char* __restrict__ out_t, float* __restrict__ inv) {
    __shared__ float buf[32];
    __shared__ __align__(16) unsigned char tile[64][72];
    const float s = fp8_scale(part, P, buf);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) inv[0] = 1.0f / s;
    const int r0 = blockIdx.y * 64, c0 = blockIdx.x * 64;
#pragma unroll
    for (int k = threadIdx.x; k < 512; k += 256) {              // 64 rows x 8 chunks of 8 columns
        const int rr = k >> 3, cc = (k & 7) * 8;
        const size_t at = (size_t)(r0 + rr) * C + c0 + cc;
        const uint2 q = fp8_pack8(*reinterpret_cast<const uint4*>(x + at), s);
        if (out) *reinterpret_cast<uint2*>(out + at) = q;
        *reinterpret_cast<uint2*>(&tile[rr][cc]) = q;
    }
    __syncthreads();
    const int j = threadIdx.x >> 2, seg = (threadIdx.x & 3) * 16;   // out_t row c0 + j, columns r0 + seg ..
    unsigned w[4];
#pragma unroll
    for (int t = 0; t < 4; ++t)
        w[t] = (unsigned)tile[seg + 4 * t][j] | ((unsigned)tile[seg + 4 * t + 1][j] << 8) |
               ((unsigned)tile[seg + 4 * t + 2][j] << 16) | ((unsigned)tile[seg + 4 * t + 3][j] << 24);
    *reinterpret_cast<uint4*>(out_t + (size_t)(c0 + j) * R + r0 + seg) = make_uint4(w[0], w[1], w[2], w[3]);
}
