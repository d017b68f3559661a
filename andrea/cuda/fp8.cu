// fp8.cu: the fp8 engine's casts, bf16 -> FP8 E4M3 with per-tensor current or delayed scaling.
// NumPy twin: andrea/engine/fp8_numpy.py (amax, scale_of, encode, quantize_delayed); launchers:
// andrea/cuda/fp8.py.
//
// Current scaling, two launches per tensor:
//   k_fp8_amax_bf16    P blocks (fixed), each writes the max |x| of its grid-stride share of the
//                      finite entries to part[block] (no atomics: the same bits every run);
//   k_fp8_cast[_t]_bf16 with part: every block reduces part[0..P) to amax, takes scale = 448 / amax
//                      (1 for an all-zero tensor); block 0 writes inv = 1 / scale, the GEMM's
//                      dequantization factor, and (when rec is set) atomicMax-es amax into *rec.
// Delayed scaling, one launch per tensor:
//   k_fp8_cast[_t]_bf16 with part = null: scale = *sc (448 / the max of the tensor's amax history,
//                      written with inv by the host, andrea/engine/fp8_numpy.AmaxHistory); the same
//                      pass reduces the max |x| of the finite entries per block and atomicMax-es it
//                      into *rec (the float bits of a non-negative float order as integers, and a max
//                      does not depend on the order: the same bits every run).
// Both: E4M3(x * scale), round to nearest even, saturating at +-448; a non-finite x writes NaN 0x7F
// so the step stays non-finite and the engine's guard skips it. The _t kernel also (or only)
// writes the transpose, which Hopper's FP8 GEMM needs (both operands K-contiguous).
//
// k_fp8_amax_dgelu_bf16 / k_fp8_dgelu_cast_t_bf16: the same two kernels over bf16(x * gelu'(hp)), the
// MLP's dL/dh_pre exactly as k_gelu_bwd_bf16 rounds it, so the fp8 backward casts the output gradient
// of the fc GEMM straight from the GELU backward and never stores it in bf16 (Fp8Gemm.cast_dgelu).
// k_fp8_dgelu8_cast_t_bf16: the same cast with h_pre in E4M3 at the fixed scale 1 / hinv (the fc GEMM's aux,
// fp8.py HPRE_E4M3): gelu' of decode(hp) * hinv, which is a bf16 value (3 mantissa bits, hinv a power of
// two), so the codes are those of k_fp8_dgelu_cast_t_bf16 over that bf16 h_pre; gelu' comes from a
// 256-entry table per block (hpre_lut); k_fp8_dgelu8_cast_t2_bf16 is the same over 64 x 128 tiles.
// k_fp8_t_u8 / k_fp8_t_u8_s: the byte transpose of an E4M3 matrix a producer wrote, folding the GEMM's amax
// into its site (k_fp8_t_u8_s: through shared memory, C a multiple of 256).
// k_fp8_wamax + k_fp8_wcast: every matmul weight's two E4M3 copies (current scaling) in two launches
// instead of two per weight; the same bytes as k_fp8_amax_bf16 + k_fp8_cast_t_bf16 on each weight.
// k_adamw_w8_bf16 + k_fp8_wamax_roll: delayed scaling's optimizer step over the same weights, writing their
// E4M3 copies itself at the scale of the weights before the step (fp8.py ADAMW_E4M3).

// bf16_finite, bf16_absf and fp8_pair (two bf16 -> two E4M3 codes) are in common.cuh.

// 8 bf16 (one uint4) -> 8 E4M3 bytes (one uint2), element order kept.
__device__ __forceinline__ uint2 fp8_pack8(uint4 v, float s) {
    uint2 o;
    o.x = fp8_pair(v.x & 0xffffu, v.x >> 16, s) | (fp8_pair(v.y & 0xffffu, v.y >> 16, s) << 16);
    o.y = fp8_pair(v.z & 0xffffu, v.z >> 16, s) | (fp8_pair(v.w & 0xffffu, v.w >> 16, s) << 16);
    return o;
}


__device__ __forceinline__ float amax8(uint4 v) {
    return fmaxf(fmaxf(fmaxf(bf16_absf(v.x & 0xffffu), bf16_absf(v.x >> 16)),
                       fmaxf(bf16_absf(v.y & 0xffffu), bf16_absf(v.y >> 16))),
                 fmaxf(fmaxf(bf16_absf(v.z & 0xffffu), bf16_absf(v.z >> 16)),
                       fmaxf(bf16_absf(v.w & 0xffffu), bf16_absf(v.w >> 16))));
}

// The cast's scale: current (part set: 448 / the max of part[0..P), amax to *m_out) or delayed (*sc).
__device__ __forceinline__ float fp8_scale(const float* __restrict__ part, int P, const float* __restrict__ sc,
                                           float* buf, float* m_out) {
    if (part == nullptr) return sc[0];
    float m = 0.0f;
    for (int i = threadIdx.x; i < P; i += blockDim.x) m = fmaxf(m, part[i]);
    m = block_max(m, buf);
    *m_out = m;
    return m > 1e-30f ? 448.0f / m : 1.0f;
}

// After the cast: current: block 0 writes inv and records amax; delayed: every block records its max.
__device__ __forceinline__ void fp8_finish(bool current, float s, float m_cur, float m_local, float* buf,
                                           float* __restrict__ inv, float* __restrict__ rec, bool first) {
    if (current) {
        if (first && threadIdx.x == 0) {
            inv[0] = 1.0f / s;
            if (rec) atomicMax(reinterpret_cast<int*>(rec), __float_as_int(m_cur));
        }
        return;
    }
    const float m = block_max(m_local, buf);
    if (threadIdx.x == 0 && rec) atomicMax(reinterpret_cast<int*>(rec), __float_as_int(m));
}

// bf16(x * gelu'(hp)) of 8 consecutive elements (bf16 bits), k_gelu_bwd_bf16's rounding.
__device__ __forceinline__ uint4 dgelu8(uint4 v, uint4 h) {
    float d[8], f[8];
    unpack16<bf16_t>(v, d);
    unpack16<bf16_t>(h, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) d[j] *= gelu_grad_f(f[j]);
    return pack16<bf16_t>(d);
}

// Two E4M3 codes (the low byte first) -> two floats, exactly (through f16).
__device__ __forceinline__ void e4m3x2_to_f(unsigned short c, float& lo, float& hi) {
    unsigned h2;
    unsigned short a, b;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(c));                   // low byte -> low half
#else
    h2 = 0x7fff7fffu;                                                          // no FP8 before sm_89: NaN
#endif
    a = (unsigned short)(h2 & 0xffffu);
    b = (unsigned short)(h2 >> 16);
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(a));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(b));
}

// bf16(x * gelu'(decode(h) * hinv)) of 8 consecutive elements, h their E4M3 h_pre codes (one uint2), the
// derivative looked up in lut (256 entries: gelu_grad_f of every code's value, hpre_lut): a code has 256
// values, so the table replaces the decode and gelu' (about 20 instructions an element) by a load.
__device__ __forceinline__ uint4 dgelu8_h8(uint4 v, uint2 h, const float* lut) {
    float d[8];
    unpack16<bf16_t>(v, d);
#pragma unroll
    for (int j = 0; j < 8; ++j) d[j] *= lut[((j < 4 ? h.x : h.y) >> (8 * (j & 3))) & 0xffu];
    return pack16<bf16_t>(d);
}

// A block's gelu' table of the 256 E4M3 codes at the scale 1 / hinv (blockDim.x >= 256), the same fp32
// values as gelu_grad_f(decode(code) * hinv) computed per element; NaN for the NaN codes.
__device__ __forceinline__ void hpre_lut(float* lut, float hinv) {
    if (threadIdx.x < 256) {
        float lo, hi;
        e4m3x2_to_f((unsigned short)threadIdx.x, lo, hi);
        lut[threadIdx.x] = gelu_grad_f(lo * hinv);
    }
    __syncthreads();
}

// 8 consecutive inputs of a cast from element at on, as bf16 bits: x itself, or (DG) bf16(x * gelu'(hp)).
template <bool DG>
__device__ __forceinline__ uint4 cast_in(const unsigned short* __restrict__ x, const unsigned short* __restrict__ hp,
                                         size_t at) {
    const uint4 v = *reinterpret_cast<const uint4*>(x + at);
    if constexpr (!DG) return v;
    else return dgelu8(v, *reinterpret_cast<const uint4*>(hp + at));
}

template <bool DG>
__device__ __forceinline__ void amax_body(const unsigned short* __restrict__ x, const unsigned short* __restrict__ hp,
                                          long long n8, float* __restrict__ part) {
    __shared__ float buf[32];
    float m = 0.0f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (long long)gridDim.x * blockDim.x)
        m = fmaxf(m, amax8(cast_in<DG>(x, hp, 8 * i)));
    m = block_max(m, buf);
    if (threadIdx.x == 0) part[blockIdx.x] = m;
}
extern "C" __global__ void k_fp8_amax_bf16(const unsigned short* __restrict__ x, long long n8, float* __restrict__ part) {
    amax_body<false>(x, nullptr, n8, part);
}
extern "C" __global__ void k_fp8_amax_dgelu_bf16(const unsigned short* __restrict__ x,
                                                 const unsigned short* __restrict__ hp, long long n8,
                                                 float* __restrict__ part) {
    amax_body<true>(x, hp, n8, part);
}

// x (n8 * 8,) bf16 -> out (n8 * 8,) E4M3, same order.
extern "C" __global__ void k_fp8_cast_bf16(const uint4* __restrict__ x, long long n8, const float* __restrict__ part,
                                           int P, const float* __restrict__ sc, float* __restrict__ rec,
                                           uint2* __restrict__ out, float* __restrict__ inv) {
    __shared__ float buf[32];
    float m_cur = 0.0f, m = 0.0f;
    const float s = fp8_scale(part, P, sc, buf, &m_cur);
    const bool delayed = part == nullptr;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = x[i];
        if (delayed) m = fmaxf(m, amax8(v));
        out[i] = fp8_pack8(v, s);
    }
    fp8_finish(!delayed, s, m_cur, m, buf, inv, rec, blockIdx.x == 0);
}

// A block's 64 x 64 tile of E4M3 codes (tile[row][column], rows r0.., columns c0.. of an (R, .) matrix) into
// out_t (., R) transposed: thread (j, seg) writes 16 bytes of out_t row c0 + j, columns r0 + seg ... 256 threads,
// after the barrier that completes the tile.
__device__ __forceinline__ void store_tile_t(const unsigned char (*tile)[72], unsigned char* __restrict__ out_t,
                                             int R, int r0, int c0) {
    const int j = threadIdx.x >> 2, seg = (threadIdx.x & 3) * 16;
    unsigned w[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
        w[u] = (unsigned)tile[seg + 4 * u][j] | ((unsigned)tile[seg + 4 * u + 1][j] << 8) |
               ((unsigned)tile[seg + 4 * u + 2][j] << 16) | ((unsigned)tile[seg + 4 * u + 3][j] << 24);
    *reinterpret_cast<uint4*>(out_t + (size_t)(c0 + j) * R + r0 + seg) = make_uint4(w[0], w[1], w[2], w[3]);
}

// One 64 x W tile (rows r0.., columns c0..; W = 64 or 128) of x (R, C) bf16 row-major (or DG: of
// bf16(x * gelu'(hp))): E4M3 at scale s into out_t (C, R) and, unless out is null, out (R, C); m: the running
// max |input| of the finite entries (delayed). 256 threads, W / 32 chunks of 8 columns a thread, every load in
// flight before any use; the tile's 64 x 64 halves go out transposed between one pair of barriers (tile holds
// W rows: half h's row r at h * 64 + r). Every thread passes the two barriers.
// H8: hp holds E4M3 codes (bytes) at the scale 1 / hinv instead of bf16 (k_fp8_dgelu8_cast_t_bf16).
template <bool DG, bool H8 = false, int W = 64>
__device__ __forceinline__ void cast_tile(const unsigned short* __restrict__ x, const void* __restrict__ hp,
                                          int R, int C, int r0, int c0, float s, bool delayed, float& m,
                                          unsigned char* __restrict__ out, unsigned char* __restrict__ out_t,
                                          unsigned char (*tile)[72], const float* lut = nullptr) {
    constexpr int U = W / 32, CH = W / 8;                       // loads a thread, 8-column chunks a row
    uint4 xv[U], hv[U];
    uint2 h8[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = threadIdx.x + 256 * u;
        const size_t at = (size_t)(r0 + k / CH) * C + c0 + (k % CH) * 8;
        xv[u] = *reinterpret_cast<const uint4*>(x + at);
        if constexpr (DG && H8) h8[u] = *reinterpret_cast<const uint2*>(static_cast<const unsigned char*>(hp) + at);
        else if constexpr (DG) hv[u] = *reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(hp) + at);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = threadIdx.x + 256 * u, rr = k / CH, cc = (k % CH) * 8;
        const size_t at = (size_t)(r0 + rr) * C + c0 + cc;
        uint4 v = xv[u];
        if constexpr (DG && H8) v = dgelu8_h8(v, h8[u], lut);
        else if constexpr (DG) v = dgelu8(v, hv[u]);
        if (delayed) m = fmaxf(m, amax8(v));
        const uint2 q = fp8_pack8(v, s);
        if (out) *reinterpret_cast<uint2*>(out + at) = q;
        *reinterpret_cast<uint2*>(&tile[(cc >> 6) * 64 + rr][cc & 63]) = q;
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < W / 64; ++h) store_tile_t(tile + 64 * h, out_t, R, r0, c0 + 64 * h);
    __syncthreads();
}

// x (R, C) bf16 row-major, R a multiple of 64 and C of W -> out_t (C, R) E4M3 and, unless out is null,
// out (R, C) E4M3. 256 threads a block, 64 x W tiles in grid-stride order (fewer blocks than tiles
// keep the delayed path's atomics few).
template <bool DG, bool H8 = false, int W = 64>
__device__ __forceinline__ void cast_t_body(const unsigned short* __restrict__ x, const void* __restrict__ hp,
                                            int R, int C, const float* __restrict__ part, int P,
                                            const float* __restrict__ sc, float* __restrict__ rec,
                                            unsigned char* __restrict__ out, unsigned char* __restrict__ out_t,
                                            float* __restrict__ inv, float hinv = 1.0f) {
    __shared__ float buf[32];
    __shared__ __align__(16) unsigned char tile[W][72];
    __shared__ float lut[H8 ? 256 : 1];
    if constexpr (H8) hpre_lut(lut, hinv);
    float m_cur = 0.0f, m = 0.0f;
    const float s = fp8_scale(part, P, sc, buf, &m_cur);
    const bool delayed = part == nullptr;
    const int tc = C / W, n_tiles = tc * (R / 64);
    for (int t = blockIdx.x; t < n_tiles; t += gridDim.x)
        cast_tile<DG, H8, W>(x, hp, R, C, (t / tc) * 64, (t % tc) * W, s, delayed, m, out, out_t, tile, lut);
    fp8_finish(!delayed, s, m_cur, m, buf, inv, rec, blockIdx.x == 0);
}
extern "C" __global__ void k_fp8_cast_t_bf16(const unsigned short* __restrict__ x, int R, int C,
                                             const float* __restrict__ part, int P, const float* __restrict__ sc,
                                             float* __restrict__ rec, unsigned char* __restrict__ out,
                                             unsigned char* __restrict__ out_t, float* __restrict__ inv) {
    cast_t_body<false>(x, nullptr, R, C, part, P, sc, rec, out, out_t, inv);
}
extern "C" __global__ void k_fp8_dgelu_cast_t_bf16(const unsigned short* __restrict__ x,
                                                   const unsigned short* __restrict__ hp, int R, int C,
                                                   const float* __restrict__ part, int P, const float* __restrict__ sc,
                                                   float* __restrict__ rec, unsigned char* __restrict__ out,
                                                   unsigned char* __restrict__ out_t, float* __restrict__ inv) {
    cast_t_body<true>(x, hp, R, C, part, P, sc, rec, out, out_t, inv);
}
#define DGELU8_CAST_T(NAME, W)                                                                               \
    extern "C" __global__ void NAME(const unsigned short* __restrict__ x, const unsigned char* __restrict__ hp, \
                                    float hinv, int R, int C, const float* __restrict__ part, int P,          \
                                    const float* __restrict__ sc, float* __restrict__ rec,                   \
                                    unsigned char* __restrict__ out, unsigned char* __restrict__ out_t,      \
                                    float* __restrict__ inv) {                                               \
        cast_t_body<true, true, W>(x, hp, R, C, part, P, sc, rec, out, out_t, inv, hinv);                    \
    }
// k_fp8_dgelu8_cast_t2_bf16: the same over 64 x 128 tiles (C a multiple of 128): four 16-byte loads of x and
// four 8-byte loads of h_pre in flight a thread, one barrier pair for two transposed halves. The same bytes.
DGELU8_CAST_T(k_fp8_dgelu8_cast_t_bf16, 64)
DGELU8_CAST_T(k_fp8_dgelu8_cast_t2_bf16, 128)

// The same cast (k_fp8_cast_t_w_bf16) with a 64 x 64 tile per warp and no shared memory or barrier:
// lane (c8 = lane % 8, rg = lane / 8) converts rows 16 rg .. 16 rg + 15 of the tile's 8-column chunk c8
// (16 loads of 16 bytes, a warp's load covering 4 rows x 128 bytes), writes them in place (8 bytes a
// row) and, transposed in registers by byte permutes (4 x 4 blocks), 16 bytes of each of its 8
// columns' rows in out_t (a warp's store covering 8 rows x 64 bytes). The same
// bytes as cast_t_body; fp8.py CAST_T picks one. On the H200 it moves 0.82-0.83 of a device copy's GB/s
// against the shared-memory kernel's 0.74-0.76 (bench/fp8_casts.py); its GELU-backward form ran at 0.41
// against 0.61 (twice the loads in flight: 78 registers), so that cast keeps the shared-memory kernel.
// 4 x 4 bytes: out word j = byte j of a0, a1, a2, a3 (a0's in the low byte)
__device__ __forceinline__ void t4x4(unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned& b0, unsigned& b1,
                                     unsigned& b2, unsigned& b3) {
    const unsigned t0 = __byte_perm(a0, a1, 0x5140), t1 = __byte_perm(a0, a1, 0x7362);   // a0[0] a1[0] a0[1] a1[1]
    const unsigned t2 = __byte_perm(a2, a3, 0x5140), t3 = __byte_perm(a2, a3, 0x7362);
    b0 = __byte_perm(t0, t2, 0x5410);
    b1 = __byte_perm(t0, t2, 0x7632);
    b2 = __byte_perm(t1, t3, 0x5410);
    b3 = __byte_perm(t1, t3, 0x7632);
}

// A lane's 16 rows x 8 bytes (q[i]: row r0 + i, columns c0 .. c0 + 7) transposed in registers and
// stored as 8 rows of out_t (C, R), 16 bytes each: column c0 + j's rows r0 .. r0 + 15.
__device__ __forceinline__ void store_t16x8(const uint2 (&q)[16], unsigned char* __restrict__ out_t, int R, int r0,
                                            int c0) {
    unsigned w[8][4];                                        // column j's 16 rows, 4 bytes a word
#pragma unroll
    for (int g = 0; g < 4; ++g) {
        t4x4(q[4 * g].x, q[4 * g + 1].x, q[4 * g + 2].x, q[4 * g + 3].x, w[0][g], w[1][g], w[2][g], w[3][g]);
        t4x4(q[4 * g].y, q[4 * g + 1].y, q[4 * g + 2].y, q[4 * g + 3].y, w[4][g], w[5][g], w[6][g], w[7][g]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
        *reinterpret_cast<uint4*>(out_t + (size_t)(c0 + j) * R + r0) = make_uint4(w[j][0], w[j][1], w[j][2], w[j][3]);
}

// Every warp of the grid walks 64 x 64 tiles of an (R, C) matrix, R and C multiples of 64: lane (c8 =
// lane % 8, rg = lane / 8) has rows 16 rg .. 16 rg + 15 of the tile's 8-column chunk c8; load(r0, c0, q)
// puts those 16 rows x 8 bytes into q, and their transpose goes to out_t (C, R).
template <class Load>
__device__ __forceinline__ void warp_tiles_t(int R, int C, unsigned char* __restrict__ out_t, Load load) {
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5, c8 = lane & 7, rg = lane >> 3;
    const int tc = C / 64, n_tiles = tc * (R / 64);
    for (int t = blockIdx.x * nw + (threadIdx.x >> 5); t < n_tiles; t += gridDim.x * nw) {
        const int r0 = (t / tc) * 64 + rg * 16, c0 = (t % tc) * 64 + c8 * 8;
        uint2 q[16];
        load(r0, c0, q);
        store_t16x8(q, out_t, R, r0, c0);
    }
}

__device__ __forceinline__ void cast_t_warps(const unsigned short* __restrict__ x, int R, int C,
                                             const float* __restrict__ part, int P, const float* __restrict__ sc, float* __restrict__ rec,
                                             unsigned char* __restrict__ out, unsigned char* __restrict__ out_t,
                                             float* __restrict__ inv) {
    __shared__ float buf[32];
    float m_cur = 0.0f, m = 0.0f;
    const float s = fp8_scale(part, P, sc, buf, &m_cur);
    const bool delayed = part == nullptr;
    warp_tiles_t(R, C, out_t, [&](int r0, int c0, uint2 (&q)[16]) {
#pragma unroll
        for (int h = 0; h < 16; h += 8) {                    // 8 rows' loads in flight before any use
            uint4 v[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = cast_in<false>(x, nullptr, (size_t)(r0 + h + i) * C + c0);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                if (delayed) m = fmaxf(m, amax8(v[i]));
                q[h + i] = fp8_pack8(v[i], s);
                if (out) *reinterpret_cast<uint2*>(out + (size_t)(r0 + h + i) * C + c0) = q[h + i];
            }
        }
    });
    fp8_finish(!delayed, s, m_cur, m, buf, inv, rec, blockIdx.x == 0);
}
extern "C" __global__ void k_fp8_cast_t_w_bf16(const unsigned short* __restrict__ x, int R, int C,
                                               const float* __restrict__ part, int P, const float* __restrict__ sc,
                                               float* __restrict__ rec, unsigned char* __restrict__ out,
                                               unsigned char* __restrict__ out_t, float* __restrict__ inv) {
    cast_t_warps(x, R, C, part, P, sc, rec, out, out_t, inv);
}

// Block 0's thread 0 atomicMax-es a GEMM's amax *am (cuBLASLt's AMAX_D, which each GEMM overwrites) into
// the site's *rec (unless rec is null), a non-finite one as 0 (that step is non-finite: the guard skips it).
__device__ __forceinline__ void fold_amax(const float* __restrict__ am, float* __restrict__ rec) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && rec) {
        const float a = *am;
        atomicMax(reinterpret_cast<int*>(rec), __float_as_int(a <= 3.402823466e38f ? a : 0.0f));   // NaN, inf: 0
    }
}

// k_fp8_t_u8: the transpose of an E4M3 matrix that a GEMM wrote itself (the fc forward's h_act under
// delayed scaling, fp8.py FC_E4M3): in (R, C) -> out_t (C, R), R and C multiples of 64, a 64 x 64
// tile per warp transposed in registers as in cast_t_warps (lane c8 = lane % 8, rg = lane / 8: rows
// 16 rg .. 16 rg + 15 of the tile's 8-byte column chunk c8); it also folds the GEMM's amax (fold_amax).
// out_t null: only that.
extern "C" __global__ void k_fp8_t_u8(const unsigned char* __restrict__ in, int R, int C, const float* __restrict__ am,
                                      float* __restrict__ rec, unsigned char* __restrict__ out_t) {
    fold_amax(am, rec);
    if (out_t == nullptr) return;
    warp_tiles_t(R, C, out_t, [&](int r0, int c0, uint2 (&q)[16]) {
#pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = *reinterpret_cast<const uint2*>(in + (size_t)(r0 + i) * C + c0);
    });
}

// k_fp8_t_u8_s: k_fp8_t_u8 for C a multiple of 256, through shared memory with 16-byte accesses on both
// sides (H200, session 16 scratch sweep: 0.87-1.01 of a device copy's GB/s at the 120M / 480M shapes against
// the per-warp kernel's 0.80-0.98, and 8.9 against 13.5 us at 8192 x 1536): a block walks 64 x 256 byte tiles; its 256 threads load a tile as 1024 uint4 (4 a
// thread) into 64 rows x 64 words of shared memory, word w of row r stored at w ^ 8 ((r / 16) % 4), so
// that phase 2 reads without bank conflicts; there thread (g = column group of 4, seg = 16-row segment)
// reads its 16 words, transposes 4 x 4 byte blocks and stores 16 bytes into each of its 4 out_t rows.
extern "C" __global__ void __launch_bounds__(256) k_fp8_t_u8_s(const unsigned char* __restrict__ in, int R, int C,
                                                               const float* __restrict__ am, float* __restrict__ rec,
                                                               unsigned char* __restrict__ out_t) {
    __shared__ __align__(16) unsigned tile[64 * 64];
    fold_amax(am, rec);
    const int tc = C / 256, n_tiles = tc * (R / 64), g = threadIdx.x >> 2, seg = threadIdx.x & 3;
    for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
        const int r0 = (t / tc) * 64, c0 = (t % tc) * 256;
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {                          // every load in flight before any store
            const int k = threadIdx.x + 256 * u;
            v[u] = *reinterpret_cast<const uint4*>(in + (size_t)(r0 + (k >> 4)) * C + c0 + (k & 15) * 16);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int k = threadIdx.x + 256 * u, r = k >> 4;
            *reinterpret_cast<uint4*>(&tile[r * 64 + (((k & 15) * 4) ^ (8 * ((r >> 4) & 3)))]) = v[u];
        }
        __syncthreads();
        unsigned w[16], o[4][4];                               // o[j][q]: column 4 g + j, rows 16 seg + 4 q ..
#pragma unroll
        for (int i = 0; i < 16; ++i) w[i] = tile[(16 * seg + i) * 64 + (g ^ (8 * seg))];
#pragma unroll
        for (int q = 0; q < 4; ++q)
            t4x4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3], o[0][q], o[1][q], o[2][q], o[3][q]);
#pragma unroll
        for (int j = 0; j < 4; ++j)
            *reinterpret_cast<uint4*>(out_t + (size_t)(c0 + 4 * g + j) * R + r0 + 16 * seg) =
                make_uint4(o[j][0], o[j][1], o[j][2], o[j][3]);
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------------
// The weights' casts, all matmul weights in two launches. wd: 8 int64 per weight, in w8's order:
// [0] its first element in w (a multiple of 8), [1] R, [2] C (multiples of 64), [3] the byte offset
// of its (R, C) E4M3 copy in w8, [4] of its (C, R) copy, [5] its factor's float index in inv,
// [6] its first WCHUNK-element chunk and [7] its first 64 x 64 tile, both counted over the weights
// before it (so block b's weight is the number of weights i >= 1 with first chunk / tile <= b).
#define WCHUNK 16384

// The weight whose first unit ([6] chunks or [7] tiles) <= blockIdx.x is the last: every thread gets it.
__device__ __forceinline__ int weight_of(const long long* __restrict__ wd, int nw, int col) {
    int sel = 0;
    for (int base = 1; base < nw; base += blockDim.x)
        sel += __syncthreads_count(base + (int)threadIdx.x < nw && wd[8 * (base + threadIdx.x) + col] <= blockIdx.x);
    return sel;
}

// amax[i] (zeroed before) = max |w_i| over the finite entries: one block per chunk, atomicMax on the
// float bits (non-negative floats order as integers; a max does not depend on the order).
extern "C" __global__ void k_fp8_wamax(const unsigned short* __restrict__ w, const long long* __restrict__ wd, int nw,
                                       float* __restrict__ amax) {
    __shared__ float buf[32];
    const int sel = weight_of(wd, nw, 6);
    const long long* d = wd + 8 * sel;
    const long long n8 = d[1] * d[2] / 8, c = blockIdx.x - d[6];
    const uint4* x = reinterpret_cast<const uint4*>(w + d[0]);
    const long long end = min(n8, (c + 1) * (WCHUNK / 8));
    float m = 0.0f;
    for (long long i = c * (WCHUNK / 8) + threadIdx.x; i < end; i += blockDim.x) m = fmaxf(m, amax8(x[i]));
    m = block_max(m, buf);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax + sel), __float_as_int(m));
}

// amax[i] = max |w_i| over the finite entries from k_adamw4_*'s partials: part[c] is the max |w| of
// w[c * chunk, (c + 1) * chunk) (chunk = kernels.ADAMW_CHUNK, w the flat bf16 copy the table's offsets
// index). One block per weight: the partials of the chunks inside the weight, w itself at its two
// ragged ends. The same amax as k_fp8_wamax (a max does not depend on the order), written, not maxed.
extern "C" __global__ void k_fp8_wamax_parts(const unsigned short* __restrict__ w, const long long* __restrict__ wd,
                                             const float* __restrict__ part, long long chunk,
                                             float* __restrict__ amax) {
    __shared__ float buf[32];
    const long long* d = wd + 8 * blockIdx.x;
    const long long a = d[0], b = a + d[1] * d[2];
    long long c0 = (a + chunk - 1) / chunk, c1 = b / chunk;   // chunks [c0, c1) lie inside [a, b)
    if (c0 > c1) c0 = c1 = b / chunk;                        // a weight inside one chunk: w alone
    float m = 0.0f;
    for (long long c = c0 + threadIdx.x; c < c1; c += blockDim.x) m = fmaxf(m, part[c]);
    for (long long i = a + threadIdx.x; i < min(b, c0 * chunk); i += blockDim.x) m = fmaxf(m, bf16_absf(w[i]));
    for (long long i = max(a, c1 * chunk) + threadIdx.x; i < b; i += blockDim.x) m = fmaxf(m, bf16_absf(w[i]));
    m = block_max(m, buf);
    if (threadIdx.x == 0) amax[blockIdx.x] = m;
}

// One block per 64 x 64 tile of every weight: scale 448 / amax[i] (1 for an all-zero weight), both
// E4M3 copies; the block of a weight's first tile writes its factor inv = 1 / scale.
extern "C" __global__ void k_fp8_wcast(const unsigned short* __restrict__ w, const long long* __restrict__ wd, int nw,
                                       const float* __restrict__ amax, unsigned char* __restrict__ w8,
                                       float* __restrict__ inv) {
    __shared__ __align__(16) unsigned char tile[64][72];
    const int sel = weight_of(wd, nw, 7);
    const long long* d = wd + 8 * sel;
    const int R = (int)d[1], C = (int)d[2], t = (int)(blockIdx.x - d[7]), tc = C / 64;
    const float am = amax[sel], s = am > 1e-30f ? 448.0f / am : 1.0f;
    float m = 0.0f;
    cast_tile<false>(w + d[0], nullptr, R, C, (t / tc) * 64, (t % tc) * 64, s, false, m, w8 + d[3], w8 + d[4], tile);
    if (t == 0 && threadIdx.x == 0) inv[d[5]] = 1.0f / s;
}

// Delayed scaling's optimizer step over the weight table (fp8.py ADAMW_E4M3), in place of k_adamw4_bf16 on the
// matmul weights followed by k_fp8_wamax_parts + k_fp8_wcast. One block per 64 x 64 tile of every weight (the
// table's tile column); thread (rr, cc) steps the 4 parameters (r0 + rr + 16 p, c0 + cc ..) for p < 4, at flat
// index first + r C + c, with k_adamw4's arithmetic (adamw_pinned, g times the clip scale gstate[1], decay where
// the index < n_decay), writes w, m, v and (unless wlow is null) the bf16 copy, and the new bf16 weights' E4M3
// codes in both
// orientations at scale 448 / amax[nw + i] (1 at or below 1e-30): the amax of the weights *before* the step.
// A weight moves by about lr a step, so a value beyond that amax is rare; it saturates at +-448, and
// k_fp8_wamax_roll counts the weight. The tile's max |bf16 w| (finite entries) is atomicMax-ed into
// amax[2 nw + i] (zero before), the block of a weight's first tile writes its factor inv = 1 / scale. A skipped
// step (gstate[2] == 0) writes nothing. amax's three rows of nw: [0] the amax the E4M3 copies were made at,
// [1] the bf16 weights' own, [2] the new weights' (this kernel); k_fp8_wamax_roll moves them on.
extern "C" __global__ void __launch_bounds__(256) k_adamw_w8_bf16(
        float* __restrict__ w, const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
        unsigned short* __restrict__ wlow, const long long* __restrict__ wd, int nw, const float* __restrict__ hp,
        const float* __restrict__ gstate, long long n_decay, float* __restrict__ amax,
        unsigned char* __restrict__ w8, float* __restrict__ inv) {
    __shared__ __align__(16) unsigned char tile[64][72];
    __shared__ float buf[32];
    const int sel = weight_of(wd, nw, 7);
    if (gstate[2] == 0.0f) return;                                  // the same for every thread of the block
    const long long* d = wd + 8 * sel;
    const int C = (int)d[2], t = (int)(blockIdx.x - d[7]), tc = C / 64, r0 = (t / tc) * 64, c0 = (t % tc) * 64;
    const float am = amax[nw + sel], s = am > 1e-30f ? 448.0f / am : 1.0f;
    const float lr = hp[0], wdk = hp[1], step = hp[2], isb2 = hp[3], b1 = hp[4], b2 = hp[5], eps = hp[6];
    const float gs = gstate[1];
    const int cc = (threadIdx.x & 15) * 4;
    float mx = 0.0f;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int rr = (threadIdx.x >> 4) + 16 * p;
        const long long at = (long long)(r0 + rr) * C + c0 + cc, i = d[0] + at;
        float4 g4 = *reinterpret_cast<const float4*>(g + i), m4 = *reinterpret_cast<const float4*>(m + i),
               v4 = *reinterpret_cast<const float4*>(v + i), w4 = *reinterpret_cast<const float4*>(w + i);
        g4.x = __fmul_rn(g4.x, gs); g4.y = __fmul_rn(g4.y, gs); g4.z = __fmul_rn(g4.z, gs); g4.w = __fmul_rn(g4.w, gs);
        adamw_pinned(w4.x, g4.x, m4.x, v4.x, i < n_decay, lr, wdk, step, isb2, b1, b2, eps);
        adamw_pinned(w4.y, g4.y, m4.y, v4.y, i + 1 < n_decay, lr, wdk, step, isb2, b1, b2, eps);
        adamw_pinned(w4.z, g4.z, m4.z, v4.z, i + 2 < n_decay, lr, wdk, step, isb2, b1, b2, eps);
        adamw_pinned(w4.w, g4.w, m4.w, v4.w, i + 3 < n_decay, lr, wdk, step, isb2, b1, b2, eps);
        *reinterpret_cast<float4*>(m + i) = m4;
        *reinterpret_cast<float4*>(v + i) = v4;
        *reinterpret_cast<float4*>(w + i) = w4;
        const unsigned h0 = from_f<bf16_t>(w4.x).x, h1 = from_f<bf16_t>(w4.y).x, h2 = from_f<bf16_t>(w4.z).x,
                       h3 = from_f<bf16_t>(w4.w).x;
        if (wlow != nullptr) *reinterpret_cast<uint2*>(wlow + i) = make_uint2(h0 | (h1 << 16), h2 | (h3 << 16));
        mx = fmaxf(mx, fmaxf(fmaxf(bf16_absf(h0), bf16_absf(h1)), fmaxf(bf16_absf(h2), bf16_absf(h3))));
        const unsigned q = fp8_pair(h0, h1, s) | (fp8_pair(h2, h3, s) << 16);
        *reinterpret_cast<unsigned*>(w8 + d[3] + at) = q;
        *reinterpret_cast<unsigned*>(&tile[rr][cc]) = q;
    }
    __syncthreads();
    store_tile_t(tile, w8 + d[4], (int)d[1], r0, c0);
    mx = block_max(mx, buf);
    if (threadIdx.x == 0) {
        atomicMax(reinterpret_cast<int*>(amax + 2 * nw + sel), __float_as_int(mx));
        if (t == 0) inv[d[5]] = 1.0f / s;
    }
}

// After k_adamw_w8_bf16, one block: on a good step (gstate[2] != 0) the rows move on ([0] = [1]: the copies
// were made at it; [1] = [2]) and gstate[3] = how many weights' new amax exceeds the amax their scale came from
// (448 at scale 1), i.e. saturated somewhere, as fp8_numpy.AmaxHistory.push counts a site; row [2] is zeroed
// either way (gstate[3] = 0 on a skipped step).
extern "C" __global__ void k_fp8_wamax_roll(float* __restrict__ amax, int nw, float* __restrict__ gstate) {
    __shared__ float buf[32];
    const bool ok = gstate[2] != 0.0f;
    float n = 0.0f;
    for (int i = threadIdx.x; i < nw; i += blockDim.x) {
        const float prev = amax[nw + i], now = amax[2 * nw + i];
        if (ok) {
            n += now > (prev > 1e-30f ? prev : 448.0f) ? 1.0f : 0.0f;
            amax[i] = prev;
            amax[nw + i] = now;
        }
        amax[2 * nw + i] = 0.0f;
    }
    n = block_sum(n, buf);
    if (threadIdx.x == 0) gstate[3] = ok ? n : 0.0f;
}
