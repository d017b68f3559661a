// attention.cu: fused causal scaled-dot-product attention, forward and backward (the `attn` op pair).
//
// Layout: q, k, v are row-major (B*T, ld) views with head h at columns [h*D, h*D+D) (ld = 3C for a
// packed qkv buffer); y and dy are (B*T, ldy); lse2 and dvec are (B*H, T) fp32.
// The forward keeps a running max/sum per query row (online softmax) and saves only lse2 =
// log2-sum-exp of the scaled scores per row; the backward recomputes the probabilities tile by tile.
//
// Deterministic backward without atomics: dK/dV are computed per key tile by a block that walks the
// query tiles in order (k_attn_bwd_dkv_*); dQ per query tile by a block that walks the key tiles
// (k_attn_bwd_dq_*). Each output element has exactly one writer (S and dP are computed by both).
// The Hopper pair k_attn_bwd_dkvs_wg_* / k_attn_bwd_dqs_wg_* ("wgds") computes S and dP once: the
// dK/dV kernel also stores each 64 x 64 tile of dS (16-bit, the causal tiles only, in a scratch the
// caller lends), and the dQ kernel sums dS K over them in key order; D_i comes from k_attn_dvec16_<t>.
//
// Three implementations with the same contract:
//   *_simt_<t>_d<D>: one thread per row, fp32 FMA; any storage type; D in {8, 16, 32, 64, 128};
//                    D_i = sum dy y comes from k_attn_dvec_<t>.
//   *_mma_<t>_d<D>:  tensor cores (mma.sync m16n8k16, fp32 accumulate), bf16/fp16 storage,
//                    D in {32, 64}; blocks of 4 warps own 128 rows, 32 per warp (two m16 tiles, so
//                    each B fragment loaded from shared memory feeds two mma); the other operand
//                    streams through cp.async double-buffered 64-row tiles, B fragments by ldmatrix.x4
//                    (.trans where the product needs it: no transposed copies); only tiles crossing
//                    the diagonal are masked; P and dS are rounded to the storage type before their
//                    matmuls (as FlashAttention does). The dQ kernel also writes D_i (launched first).
//   *_wg_<t>_d<D>:   the same with warpgroup MMA (wgmma.mma_async, sm_90a: compiled only where the
//                    loader targets it), 64 rows per warpgroup; see "Hopper versions" below.
// sl2 = log2(e) / sqrt(D): scores are kept in the log2 domain so exp2f can be used.

// ---------------------------------------------------------------------------------------------
// D_i = sum_d dy[i, d] * y[i, d]  (per row and head), the softmax-backward correction term.
template <typename T>
__device__ void attn_dvec(const T* __restrict__ y, const T* __restrict__ dy, int ldy, float* __restrict__ dvec,
                          int B, int Tn, int H, int D) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // over B*H*T
    if (i >= (long long)B * H * Tn) return;
    const int t = (int)(i % Tn);
    const int bh = (int)(i / Tn);
    const int b = bh / H, h = bh % H;
    const long long off = ((long long)b * Tn + t) * ldy + (long long)h * D;
    float s = 0.0f;
    for (int d = 0; d < D; ++d) s += to_f(dy[off + d]) * to_f(y[off + d]);
    dvec[i] = s;
}

// ---------------------------------------------------------------------------------------------
// SIMT versions: a block of TILE threads; thread = one query row (fwd, dq) or one key row (dkv).
// Rows r0 .. r0+TILE-1 of two (B*T, ld) head views into shared fp32 tiles (rows >= Tn are 0),
// between two barriers so no thread still reads the previous tiles.
template <typename T, int D, int TILE>
__device__ __forceinline__ void simt_tiles(float (*As)[D], const T* __restrict__ a, int lda, float (*Bs)[D],
                                           const T* __restrict__ b, int ldb, long long base, int r0, int Tn,
                                           int h) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < TILE * D; idx += TILE) {
        const int r = idx / D, d = idx % D, row = r0 + r;
        As[r][d] = row < Tn ? to_f(a[(base + row) * lda + h * D + d]) : 0.0f;
        Bs[r][d] = row < Tn ? to_f(b[(base + row) * ldb + h * D + d]) : 0.0f;
    }
    __syncthreads();
}

template <typename T, int D, int TILE>
__device__ void attn_fwd_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, int ld,
                              T* __restrict__ y, int ldy, float* __restrict__ lse2, int Tn, int H, float sl2) {
    __shared__ float Ks[TILE][D];
    __shared__ float Vs[TILE][D];
    const int tid = threadIdx.x;
    const int bh = blockIdx.y, b = bh / H, h = bh % H;
    const long long base = (long long)b * Tn;
    const int qi = blockIdx.x * TILE + tid;
    float qr[D], o[D];
    float m = -ANDREA_INF, l = 0.0f;
#pragma unroll
    for (int d = 0; d < D; ++d) {
        qr[d] = (qi < Tn) ? to_f(q[(base + qi) * ld + h * D + d]) * sl2 : 0.0f;
        o[d] = 0.0f;
    }
    const int last = min(Tn, (int)(blockIdx.x + 1) * TILE) - 1;
    for (int kt = 0; kt * TILE <= last; ++kt) {
        simt_tiles<T, D, TILE>(Ks, k, ld, Vs, v, ld, base, kt * TILE, Tn, h);
        if (qi < Tn) {
            const int jmax = min(TILE, qi - kt * TILE + 1);
            for (int j = 0; j < jmax; ++j) {
                float s = 0.0f;
#pragma unroll
                for (int d = 0; d < D; ++d) s += qr[d] * Ks[j][d];
                if (s > m) {
                    const float corr = exp2f(m - s);
                    l *= corr;
#pragma unroll
                    for (int d = 0; d < D; ++d) o[d] *= corr;
                    m = s;
                }
                const float p = exp2f(s - m);
                l += p;
#pragma unroll
                for (int d = 0; d < D; ++d) o[d] += p * Vs[j][d];
            }
        }
    }
    if (qi < Tn) {
        const float inv = 1.0f / l;
#pragma unroll
        for (int d = 0; d < D; ++d) y[(base + qi) * ldy + h * D + d] = from_f<T>(o[d] * inv);
        lse2[(long long)bh * Tn + qi] = m + log2f(l);
    }
}

template <typename T, int D, int TILE>
__device__ void attn_bwd_dq_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                 int ld, const T* __restrict__ dy, int ldy, const float* __restrict__ lse2,
                                 const float* __restrict__ dvec, T* __restrict__ dq, int Tn, int H, float sl2,
                                 float scale, int accumulate) {
    __shared__ float Ks[TILE][D];
    __shared__ float Vs[TILE][D];
    const int tid = threadIdx.x;
    const int bh = blockIdx.y, b = bh / H, h = bh % H;
    const long long base = (long long)b * Tn;
    const int qi = blockIdx.x * TILE + tid;
    float qr[D], dor[D], acc[D];
    float l2 = 0.0f, di = 0.0f;
#pragma unroll
    for (int d = 0; d < D; ++d) {
        qr[d] = (qi < Tn) ? to_f(q[(base + qi) * ld + h * D + d]) * sl2 : 0.0f;
        dor[d] = (qi < Tn) ? to_f(dy[(base + qi) * ldy + h * D + d]) : 0.0f;
        acc[d] = 0.0f;
    }
    if (qi < Tn) { l2 = lse2[(long long)bh * Tn + qi]; di = dvec[(long long)bh * Tn + qi]; }
    const int last = min(Tn, (int)(blockIdx.x + 1) * TILE) - 1;
    for (int kt = 0; kt * TILE <= last; ++kt) {
        simt_tiles<T, D, TILE>(Ks, k, ld, Vs, v, ld, base, kt * TILE, Tn, h);
        if (qi < Tn) {
            const int jmax = min(TILE, qi - kt * TILE + 1);
            for (int j = 0; j < jmax; ++j) {
                float s = 0.0f, dp = 0.0f;
#pragma unroll
                for (int d = 0; d < D; ++d) { s += qr[d] * Ks[j][d]; dp += dor[d] * Vs[j][d]; }
                const float p = exp2f(s - l2);
                const float ds = p * (dp - di);
#pragma unroll
                for (int d = 0; d < D; ++d) acc[d] += ds * Ks[j][d];
            }
        }
    }
    if (qi < Tn) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const long long o = (base + qi) * ld + h * D + d;
            const float prev = accumulate ? to_f(dq[o]) : 0.0f;
            dq[o] = from_f<T>(prev + acc[d] * scale);
        }
    }
}

template <typename T, int D, int TILE>
__device__ void attn_bwd_dkv_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                  int ld, const T* __restrict__ dy, int ldy, const float* __restrict__ lse2,
                                  const float* __restrict__ dvec, T* __restrict__ dk, T* __restrict__ dv, int Tn,
                                  int H, float sl2, float scale, int accumulate) {
    __shared__ float Qs[TILE][D];
    __shared__ float Ds[TILE][D];
    __shared__ float Ls[TILE];
    __shared__ float Es[TILE];
    const int tid = threadIdx.x;
    const int bh = blockIdx.y, b = bh / H, h = bh % H;
    const long long base = (long long)b * Tn;
    const int kj = blockIdx.x * TILE + tid;
    float kr[D], vr[D], dkr[D], dvr[D];
#pragma unroll
    for (int d = 0; d < D; ++d) {
        kr[d] = (kj < Tn) ? to_f(k[(base + kj) * ld + h * D + d]) * sl2 : 0.0f;
        vr[d] = (kj < Tn) ? to_f(v[(base + kj) * ld + h * D + d]) : 0.0f;
        dkr[d] = 0.0f;
        dvr[d] = 0.0f;
    }
    const int ntiles = (Tn + TILE - 1) / TILE;
    for (int qt = blockIdx.x; qt < ntiles; ++qt) {
        {
            const int qq = qt * TILE + tid;
            const float lq = qq < Tn ? lse2[(long long)bh * Tn + qq] : 0.0f;
            const float eq = qq < Tn ? dvec[(long long)bh * Tn + qq] : 0.0f;
            simt_tiles<T, D, TILE>(Qs, q, ld, Ds, dy, ldy, base, qt * TILE, Tn, h);
            Ls[tid] = lq;
            Es[tid] = eq;
        }
        __syncthreads();
        if (kj < Tn) {
            const int i0 = max(0, kj - qt * TILE);
            const int i1 = min(TILE, Tn - qt * TILE);
            for (int i = i0; i < i1; ++i) {
                float s = 0.0f, dp = 0.0f;
#pragma unroll
                for (int d = 0; d < D; ++d) { s += kr[d] * Qs[i][d]; dp += vr[d] * Ds[i][d]; }
                const float p = exp2f(s - Ls[i]);
                const float ds = p * (dp - Es[i]);
#pragma unroll
                for (int d = 0; d < D; ++d) { dvr[d] += p * Ds[i][d]; dkr[d] += ds * Qs[i][d]; }
            }
        }
    }
    if (kj < Tn) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const long long o = (base + kj) * ld + h * D + d;
            const float pk = accumulate ? to_f(dk[o]) : 0.0f;
            const float pv = accumulate ? to_f(dv[o]) : 0.0f;
            dk[o] = from_f<T>(pk + dkr[d] * scale);
            dv[o] = from_f<T>(pv + dvr[d]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core versions (bf16 / fp16 storage). Fragment layout of mma.m16n8k16 (g = lane/4, t = lane%4):
//   A 16x16 row: a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16x8 col:  b0 (k=2t..2t+1, n=g)  b1 (k=2t+8.., n=g)
//   C 16x8:      c0,c1 (g, 2t..2t+1)  c2,c3 (g+8, 2t..2t+1)
// Two neighbouring C tiles (n = 8j..8j+15) in registers are exactly the A fragment of a k16 slice.

template <bool BF>
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    if (BF) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Pack two floats into a 32-bit pair: lo in the low half (the lower column index).
template <bool BF>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    if (BF) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <bool BF>
__device__ __forceinline__ float lo_f(unsigned u) {
    if (BF) return __uint_as_float(u << 16);
    float f; unsigned short h = (unsigned short)(u & 0xffffu);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
template <bool BF>
__device__ __forceinline__ float hi_f(unsigned u) {
    if (BF) return __uint_as_float(u & 0xffff0000u);
    float f; unsigned short h = (unsigned short)(u >> 16);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

typedef unsigned short u16;
#define ATT_PAD 8  // row padding (16 bytes) of shared tiles: conflict-free ldmatrix rows

// ldmatrix x4: four 8x8 b16 matrices, lanes 8i..8i+7 give the row addresses of matrix i.
// Two B fragments (n8 blocks j, j+1 of one k16 slice) of "A x X^T", X row-major [n][k] in shared
// memory: lane -> row (j + lane/16) * 8 + lane % 8, column k0 + (lane/8 % 2) * 8 (ldsm_x4);
// of "A x X", X row-major [k][n]: lane -> row k0 + lane % 16, column (n + lane/16) * 8 (ldsm_x4_t).
// Either way r0, r1 are (b0, b1) of the first n8 block and r2, r3 those of the second.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const u16* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const u16* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// Asynchronous copy (cp.async, 16 bytes per thread and step) of a 64-row tile into shared memory;
// rows >= Tn are zero-filled (0 source bytes). Completed by cp_async_wait + __syncthreads.
template <int D>
__device__ __forceinline__ void async_tile(const u16* __restrict__ src, long long row_base, int r0, int Tn, int ld,
                                           u16 (*dst)[D + ATT_PAD]) {
    for (int idx = threadIdx.x; idx < 64 * D / 8; idx += blockDim.x) {
        const int r = idx / (D / 8), c8 = (idx % (D / 8)) * 8;
        const bool ok = r0 + r < Tn;
        const u16* gp = src + (row_base + (ok ? r0 + r : 0)) * ld + c8;
        const unsigned sa = (unsigned)__cvta_generic_to_shared(&dst[r][c8]);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gp), "r"(ok ? 16 : 0));
    }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// A fragment (16 rows x D) of rows ra/rb straight from global memory, as KS k16 slices.
template <int D>
__device__ __forceinline__ void load_afrag(const u16* __restrict__ src, long long row_base, int ra, int rb, int Tn,
                                           int ld, int t4, unsigned (*a)[4]) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int c = kk * 16 + 2 * t4;
        a[kk][0] = ra < Tn ? *reinterpret_cast<const unsigned*>(src + (row_base + ra) * ld + c) : 0u;
        a[kk][1] = rb < Tn ? *reinterpret_cast<const unsigned*>(src + (row_base + rb) * ld + c) : 0u;
        a[kk][2] = ra < Tn ? *reinterpret_cast<const unsigned*>(src + (row_base + ra) * ld + c + 8) : 0u;
        a[kk][3] = rb < Tn ? *reinterpret_cast<const unsigned*>(src + (row_base + rb) * ld + c + 8) : 0u;
    }
}

template <int N>
__device__ __forceinline__ void zero_frags(float (*c)[4]) {
#pragma unroll
    for (int n = 0; n < N; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
}

// The A fragment of a k16 slice made of two neighbouring C tiles (n8 blocks), rounded to the storage type.
template <bool BF>
__device__ __forceinline__ void c_to_afrag(const float* c0, const float* c1, unsigned (&a)[4]) {
    a[0] = pack2<BF>(c0[0], c0[1]);
    a[1] = pack2<BF>(c0[2], c0[3]);
    a[2] = pack2<BF>(c1[0], c1[1]);
    a[3] = pack2<BF>(c1[2], c1[3]);
}

// Two neighbouring outputs (a, b) * scale added to (accumulate) or written over *p.
template <bool BF>
__device__ __forceinline__ void store_pair(u16* p, float a, float b, float scale, int accumulate) {
    unsigned* q = reinterpret_cast<unsigned*>(p);
    const unsigned old = accumulate ? *q : 0u;
    *q = pack2<BF>(lo_f<BF>(old) + a * scale, hi_f<BF>(old) + b * scale);
}

// The C fragments acc (n8 blocks n = 0 .. ND-1 as acc[4n + e]) of rows ra (e = 0, 1) and rc (e = 2, 3)
// times scale, added to (accumulate) or written over those rows of dst at columns col + 8n (col holds
// the lane's 2 t4); rows >= Tn are skipped.
template <bool BF, int ND>
__device__ __forceinline__ void store_rows(u16* dst, long long rb, int ra, int rc, int Tn, int ld, int col,
                                           const float* acc, float scale, int accumulate) {
#pragma unroll
    for (int n = 0; n < ND; ++n) {
        const int c = col + n * 8;
        if (ra < Tn) store_pair<BF>(dst + (rb + ra) * ld + c, acc[4 * n], acc[4 * n + 1], scale, accumulate);
        if (rc < Tn) store_pair<BF>(dst + (rb + rc) * ld + c, acc[4 * n + 2], acc[4 * n + 3], scale, accumulate);
    }
}

// Two E4M3 codes (q8: column c in the low byte, c + 1 in the high) of row r into a transposing stage of
// `rows` rows a column: byte (c, r) at c * rows + r.
__device__ __forceinline__ void stage_pair(unsigned char* t8, int c, int r, int rows, unsigned q8) {
    t8[c * rows + r] = (unsigned char)(q8 & 0xffu);
    t8[(c + 1) * rows + r] = (unsigned char)(q8 >> 8);
}

// Two bf16 outputs w (the first in the low half) as E4M3 codes at scale s (fp8.cu's cast, fp8_pair) into
// p, m the running max |bf16 value|; t8 non-null: also into a transposing stage at (tc, tr) (stage_pair).
__device__ __forceinline__ void put_e4m3_pair(unsigned char* p, unsigned w, float s, float& m, unsigned char* t8,
                                              int tc, int tr, int rows) {
    const unsigned lo = w & 0xffffu, hi = w >> 16, q8 = fp8_pair(lo, hi, s);
    m = fmaxf(m, fmaxf(bf16_absf(lo), bf16_absf(hi)));
    *reinterpret_cast<unsigned short*>(p) = (unsigned short)q8;
    if (t8 != nullptr) stage_pair(t8, tc, tr, rows, q8);
}

// store_rows' E4M3 form (fp8 under delayed scaling: the dqkv gradient written by its producer, accumulate
// off): each output rounded to bf16 exactly as store_rows rounds it (0 + a scale), then E4M3 at *sc into
// the byte matrix d8 (leading dimension ld), and the warp's max |bf16| over the finite outputs
// atomicMax-ed into *rec: the bytes of store_rows followed by fp8.cu's cast at that scale. t8 non-null:
// the codes also into a transposing stage (stage_pair; columns from col0, rows from row0).
template <int ND>
__device__ __forceinline__ void store_rows_e4m3(unsigned char* d8, long long rb, int ra, int rc, int Tn, int ld,
                                                int col, const float* acc, float scale, const float* sc, float* rec,
                                                unsigned char* t8 = nullptr, int col0 = 0, int row0 = 0,
                                                int rows = 0) {
    const float s = *sc;
    float m = 0.0f;
#pragma unroll
    for (int n = 0; n < ND; ++n) {
        const int c = col + n * 8;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = half ? rc : ra;
            if (r < Tn) {
                const unsigned w = pack2<true>(0.0f + acc[4 * n + 2 * half] * scale,
                                               0.0f + acc[4 * n + 2 * half + 1] * scale);
                put_e4m3_pair(d8 + (rb + r) * ld + c, w, s, m, t8, c - col0, r - row0, rows);
            }
        }
    }
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<int*>(rec), __float_as_int(m));
}

// The block's staged codes (stage_pair: D columns x `rows` rows, column-major) -> out_t (the transposed
// E4M3 matrix, ldt apart): its rows col0 .. col0 + D - 1, columns rb + row0 .. up to the sequence's end,
// 16 bytes a store where aligned. After a __syncthreads that follows the staging.
template <int D>
__device__ __forceinline__ void stage_to_t(const unsigned char* t8, int rows, unsigned char* out_t, long long ldt,
                                           long long rb, int row0, int Tn, int col0) {
    const int valid = min(rows, Tn - row0);
    for (int idx = threadIdx.x; idx < D * (rows / 16); idx += blockDim.x) {
        const int d = idx / (rows / 16), c16 = (idx % (rows / 16)) * 16;
        unsigned char* dst = out_t + (long long)(col0 + d) * ldt + rb + row0 + c16;
        const unsigned char* src = t8 + d * rows + c16;
        if (c16 + 16 <= valid && ((size_t)dst & 15) == 0) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
            for (int e = 0; e < 16 && c16 + e < valid; ++e) dst[e] = src[e];
        }
    }
}

// The forward's epilogue of rows ra / rc: y = o / l (16-bit, layout as store_rows) and lse2 = m + log2 l
// (lse_bh: this head's lse2 row), l first summed over the 4 lanes that share a row.
// y8 non-null (fp8, bf16 only): y also as E4M3 codes of those bf16 values at scale s8 into y8 (ldy apart),
// m8 the running max |bf16 value|, and, t8 non-null, into the shared stage t8 (put_e4m3_pair; columns from
// col0, rows from row0: attn_fwd_wg writes it out as y8^T).
template <bool BF, int ND>
__device__ __forceinline__ void fwd_store(u16* y, long long rb, int ra, int rc, int Tn, int ldy, int col, int t4,
                                          const float* o, float m0, float m1, float l0, float l1, float* lse_bh,
                                          unsigned char* y8 = nullptr, float s8 = 1.0f, float* m8 = nullptr,
                                          unsigned char* t8 = nullptr, int col0 = 0, int row0 = 0, int rows = 0) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float i0 = 1.0f / l0, i1 = 1.0f / l1;
#pragma unroll
    for (int n = 0; n < ND; ++n) {
        const int c = col + n * 8;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = half ? rc : ra;
            const float inv = half ? i1 : i0;
            if (r >= Tn) continue;
            const unsigned w = pack2<BF>(o[4 * n + 2 * half] * inv, o[4 * n + 2 * half + 1] * inv);
            *reinterpret_cast<unsigned*>(y + (rb + r) * ldy + c) = w;
            if (y8 != nullptr) put_e4m3_pair(y8 + (rb + r) * ldy + c, w, s8, *m8, t8, c - col0, r - row0, rows);
        }
    }
    if (t4 == 0) {
        if (ra < Tn) lse_bh[ra] = m0 + log2f(l0);
        if (rc < Tn) lse_bh[rc] = m1 + log2f(l1);
    }
}

// D_i = sum_d dy y of rows g and g+8 from their A fragments (KS k16 slices), summed over the row's 4 lanes.
template <bool BF, int KS>
__device__ __forceinline__ void dvec_rows(const unsigned (*da)[4], const unsigned (*ya)[4], float& e0, float& e1) {
    e0 = 0.0f;
    e1 = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; i += 2) {
            e0 += lo_f<BF>(da[kk][i]) * lo_f<BF>(ya[kk][i]) + hi_f<BF>(da[kk][i]) * hi_f<BF>(ya[kk][i]);
            e1 += lo_f<BF>(da[kk][i + 1]) * lo_f<BF>(ya[kk][i + 1]) + hi_f<BF>(da[kk][i + 1]) * hi_f<BF>(ya[kk][i + 1]);
        }
    }
    e0 += __shfl_xor_sync(0xffffffffu, e0, 1);
    e0 += __shfl_xor_sync(0xffffffffu, e0, 2);
    e1 += __shfl_xor_sync(0xffffffffu, e1, 1);
    e1 += __shfl_xor_sync(0xffffffffu, e1, 2);
}

// Start the copy of 64-row tiles t of a and b (rows t*64 ..) into buffers t & 1.
template <int D>
__device__ __forceinline__ void issue_pair(const u16* a, int lda, const u16* b, int ldb, long long rb, int t, int Tn,
                                           u16 (*As2)[64][D + ATT_PAD], u16 (*Bs2)[64][D + ATT_PAD]) {
    async_tile<D>(a, rb, t * 64, Tn, lda, As2[t & 1]);
    async_tile<D>(b, rb, t * 64, Tn, ldb, Bs2[t & 1]);
    cp_async_commit();
}

// Before tile t is used: put tile t+1 in flight (if t+1 < nt) and wait for tile t.
template <int D>
__device__ __forceinline__ void next_pair(const u16* a, int lda, const u16* b, int ldb, long long rb, int t, int nt,
                                          int Tn, u16 (*As2)[64][D + ATT_PAD], u16 (*Bs2)[64][D + ATT_PAD]) {
    if (t + 1 < nt) {
        issue_pair<D>(a, lda, b, ldb, rb, t + 1, Tn, As2, Bs2);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    __syncthreads();
}

// Blocks of 4 warps own BM = 64 MT rows (queries: fwd, dq; keys: dkv): warp w rows w0 = tile*BM +
// RW w .. w0+RW-1 (RW = 16 MT) as MT m16 tiles (mt), so every B fragment read from shared memory
// feeds MT mma (MT = 2: more reuse, more registers; MT = 1: more blocks). The other side streams
// through double-buffered 64-row tiles (cp.async). Only tiles that cross the diagonal (or the end
// Tn) are masked; a warp skips a tile (or a 16-wide chunk of it) whose every pair is masked.

template <bool BF, int D, int MT>
__device__ void attn_fwd_mma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                             int ld, u16* __restrict__ y, int ldy, float* __restrict__ lse2, int Tn, int H,
                             float sl2) {
    constexpr int KS = D / 16, ND = D / 8, RW = 16 * MT, BM = 64 * MT;
    __shared__ __align__(16) u16 Ks2[2][64][D + ATT_PAD];   // double-buffered: tile kt+1 is in flight
    __shared__ __align__(16) u16 Vs2[2][64][D + ATT_PAD];   // while tile kt is used
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;  // longest rows first
    const long long rb = (long long)b * Tn;
    const int w0 = qt * BM + warp * RW;
    const u16 *kh = k + h * D, *vh = v + h * D;
    issue_pair<D>(kh, ld, vh, ld, rb, 0, Tn, Ks2, Vs2);
    unsigned qa[MT][KS][4];
    float o[MT][ND][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        load_afrag<D>(q + h * D, rb, w0 + mt * 16 + g, w0 + mt * 16 + g + 8, Tn, ld, t4, qa[mt]);
        zero_frags<ND>(o[mt]);
        m[mt][0] = m[mt][1] = -ANDREA_INF;
        l[mt][0] = l[mt][1] = 0.0f;
    }
    const int last = min(Tn, qt * BM + BM) - 1;
    const int nkt = last / 64 + 1;
    for (int kt = 0; kt < nkt; ++kt) {
        next_pair<D>(kh, ld, vh, ld, rb, kt, nkt, Tn, Ks2, Vs2);
        const u16(*Ks)[D + ATT_PAD] = Ks2[kt & 1];
        const u16(*Vs)[D + ATT_PAD] = Vs2[kt & 1];
        const int k0 = kt * 64;
        if (k0 <= w0 + RW - 1 && w0 < Tn) {
            const bool diag = k0 + 63 > w0 || k0 + 64 > Tn;
            float s[MT][8][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) zero_frags<8>(s[mt]);
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
                for (int jp = 0; jp < 4; ++jp) {
                    unsigned bf[4];
                    ldsm_x4(bf, &Ks[(2 * jp + (lane >> 4)) * 8 + (lane & 7)][kk * 16 + ((lane >> 3) & 1) * 8]);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816<BF>(s[mt][2 * jp], qa[mt][kk], bf[0], bf[1]);
                        mma16816<BF>(s[mt][2 * jp + 1], qa[mt][kk], bf[2], bf[3]);
                    }
                }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int ra = w0 + mt * 16 + g, rc = ra + 8;
                if (diag) {
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int key = k0 + j * 8 + 2 * t4 + (e & 1);
                            if (!(key <= (e < 2 ? ra : rc) && key < Tn)) s[mt][j][e] = -ANDREA_INF;
                        }
                    }
                }
                float mx0 = -ANDREA_INF, mx1 = -ANDREA_INF;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    mx0 = fmaxf(mx0, fmaxf(s[mt][j][0], s[mt][j][1]));
                    mx1 = fmaxf(mx1, fmaxf(s[mt][j][2], s[mt][j][3]));
                }
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
                const float n0 = fmaxf(m[mt][0], mx0 * sl2), n1 = fmaxf(m[mt][1], mx1 * sl2);  // log2 domain
                const float z0 = (n0 == -ANDREA_INF) ? 0.0f : n0, z1 = (n1 == -ANDREA_INF) ? 0.0f : n1;
                const float c0 = exp2f(m[mt][0] - z0), c1 = exp2f(m[mt][1] - z1);
                m[mt][0] = n0;
                m[mt][1] = n1;
                float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    s[mt][j][0] = exp2f(fmaf(s[mt][j][0], sl2, -z0));
                    s[mt][j][1] = exp2f(fmaf(s[mt][j][1], sl2, -z0));
                    s[mt][j][2] = exp2f(fmaf(s[mt][j][2], sl2, -z1));
                    s[mt][j][3] = exp2f(fmaf(s[mt][j][3], sl2, -z1));
                    ps0 += s[mt][j][0] + s[mt][j][1];
                    ps1 += s[mt][j][2] + s[mt][j][3];
                }
                l[mt][0] = l[mt][0] * c0 + ps0;
                l[mt][1] = l[mt][1] * c1 + ps1;
#pragma unroll
                for (int n = 0; n < ND; ++n) {
                    o[mt][n][0] *= c0; o[mt][n][1] *= c0; o[mt][n][2] *= c1; o[mt][n][3] *= c1;
                }
            }
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                unsigned pa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) c_to_afrag<BF>(s[mt][2 * kk], s[mt][2 * kk + 1], pa[mt]);
#pragma unroll
                for (int np = 0; np < ND / 2; ++np) {
                    unsigned bf[4];
                    ldsm_x4_t(bf, &Vs[kk * 16 + (lane & 15)][(2 * np + (lane >> 4)) * 8]);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816<BF>(o[mt][2 * np], pa[mt], bf[0], bf[1]);
                        mma16816<BF>(o[mt][2 * np + 1], pa[mt], bf[2], bf[3]);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int ra = w0 + mt * 16 + g;
        fwd_store<BF, ND>(y, rb, ra, ra + 8, Tn, ldy, h * D + 2 * t4, t4, &o[mt][0][0], m[mt][0], m[mt][1], l[mt][0],
                          l[mt][1], lse2 + (long long)bh * Tn);
    }
}

// dQ per 128 query rows; also writes dvec (D_i = sum_d dy y of its rows, from the same fragments)
// for the dK/dV kernel launched after it. Keys stream in 64-row tiles, processed 16 at a time
// (S, dP, dS of a 16-key chunk live only in registers: no row max is needed in the backward).
template <bool BF, int D, int MT>
__device__ void attn_bwd_dq_mma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                                int ld, const u16* __restrict__ dy, const u16* __restrict__ y, int ldy,
                                const float* __restrict__ lse2, float* __restrict__ dvec, u16* __restrict__ dq,
                                int Tn, int H, float sl2, float scale, int accumulate) {
    constexpr int KS = D / 16, ND = D / 8, RW = 16 * MT, BM = 64 * MT;
    __shared__ __align__(16) u16 Ks2[2][64][D + ATT_PAD];
    __shared__ __align__(16) u16 Vs2[2][64][D + ATT_PAD];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;  // longest rows first
    const long long rb = (long long)b * Tn;
    const int w0 = qt * BM + warp * RW;
    const u16 *kh = k + h * D, *vh = v + h * D;
    issue_pair<D>(kh, ld, vh, ld, rb, 0, Tn, Ks2, Vs2);
    unsigned qa[MT][KS][4], da[MT][KS][4];
    float L[MT][2], E[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int ra = w0 + mt * 16 + g, rc = ra + 8;
        load_afrag<D>(q + h * D, rb, ra, rc, Tn, ld, t4, qa[mt]);
        load_afrag<D>(dy + h * D, rb, ra, rc, Tn, ldy, t4, da[mt]);
        unsigned ya[KS][4];
        load_afrag<D>(y + h * D, rb, ra, rc, Tn, ldy, t4, ya);
        float e0, e1;
        dvec_rows<BF, KS>(da[mt], ya, e0, e1);
        E[mt][0] = e0;
        E[mt][1] = e1;
        if (t4 == 0) {
            if (ra < Tn) dvec[(long long)bh * Tn + ra] = e0;
            if (rc < Tn) dvec[(long long)bh * Tn + rc] = e1;
        }
        L[mt][0] = ra < Tn ? lse2[(long long)bh * Tn + ra] : 0.0f;
        L[mt][1] = rc < Tn ? lse2[(long long)bh * Tn + rc] : 0.0f;
    }
    float acc[MT][ND][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) zero_frags<ND>(acc[mt]);
    const int last = min(Tn, qt * BM + BM) - 1;
    const int nkt = last / 64 + 1;
    for (int kt = 0; kt < nkt; ++kt) {
        next_pair<D>(kh, ld, vh, ld, rb, kt, nkt, Tn, Ks2, Vs2);
        const u16(*Ks)[D + ATT_PAD] = Ks2[kt & 1];
        const u16(*Vs)[D + ATT_PAD] = Vs2[kt & 1];
        const int k0 = kt * 64;
        if (k0 <= w0 + RW - 1 && w0 < Tn) {
            const bool diag = k0 + 63 > w0 || k0 + 64 > Tn;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                if (k0 + c * 16 > w0 + RW - 1) break;  // this chunk and the later ones are above the diagonal
                float s[MT][2][4], dp[MT][2][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    zero_frags<2>(s[mt]);
                    zero_frags<2>(dp[mt]);
                }
#pragma unroll
                for (int kk = 0; kk < KS; ++kk) {
                    unsigned bk[4], bv[4];
                    const int row = c * 16 + (lane >> 4) * 8 + (lane & 7), col = kk * 16 + ((lane >> 3) & 1) * 8;
                    ldsm_x4(bk, &Ks[row][col]);
                    ldsm_x4(bv, &Vs[row][col]);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816<BF>(s[mt][0], qa[mt][kk], bk[0], bk[1]);
                        mma16816<BF>(s[mt][1], qa[mt][kk], bk[2], bk[3]);
                        mma16816<BF>(dp[mt][0], da[mt][kk], bv[0], bv[1]);
                        mma16816<BF>(dp[mt][1], da[mt][kk], bv[2], bv[3]);
                    }
                }
                unsigned sa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const int ra = w0 + mt * 16 + g, rc = ra + 8;
#pragma unroll
                    for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int key = k0 + c * 16 + jj * 8 + 2 * t4 + (e & 1);
                            const bool ok = !diag || (key <= (e < 2 ? ra : rc) && key < Tn);
                            const float p = ok ? exp2f(fmaf(s[mt][jj][e], sl2, -L[mt][e >> 1])) : 0.0f;
                            s[mt][jj][e] = p * (dp[mt][jj][e] - E[mt][e >> 1]);  // dS
                        }
                    }
                    c_to_afrag<BF>(s[mt][0], s[mt][1], sa[mt]);
                }
#pragma unroll
                for (int np = 0; np < ND / 2; ++np) {
                    unsigned bf[4];
                    ldsm_x4_t(bf, &Ks[c * 16 + (lane & 15)][(2 * np + (lane >> 4)) * 8]);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816<BF>(acc[mt][2 * np], sa[mt], bf[0], bf[1]);
                        mma16816<BF>(acc[mt][2 * np + 1], sa[mt], bf[2], bf[3]);
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int ra = w0 + mt * 16 + g;
        store_rows<BF, ND>(dq, rb, ra, ra + 8, Tn, ld, h * D + 2 * t4, &acc[mt][0][0], scale, accumulate);
    }
}

// dK, dV per 128 key rows; queries (with their dy rows, lse2 and dvec) stream in 64-row tiles
// from the diagonal down, processed 16 at a time.
template <bool BF, int D, int MT>
__device__ void attn_bwd_dkv_mma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                                 int ld, const u16* __restrict__ dy, int ldy, const float* __restrict__ lse2,
                                 const float* __restrict__ dvec, u16* __restrict__ dk, u16* __restrict__ dv, int Tn,
                                 int H, float sl2, float scale, int accumulate) {
    constexpr int KS = D / 16, ND = D / 8, RW = 16 * MT, BM = 64 * MT;
    __shared__ __align__(16) u16 Qs2[2][64][D + ATT_PAD];
    __shared__ __align__(16) u16 Os2[2][64][D + ATT_PAD];
    __shared__ float Ls2[2][64];
    __shared__ float Es2[2][64];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int kt = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
    const long long rb = (long long)b * Tn;
    const int w0 = kt * BM + warp * RW;
    const u16 *qh = q + h * D, *oh = dy + h * D;
    unsigned ka[MT][KS][4], va[MT][KS][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        load_afrag<D>(k + h * D, rb, w0 + mt * 16 + g, w0 + mt * 16 + g + 8, Tn, ld, t4, ka[mt]);
        load_afrag<D>(v + h * D, rb, w0 + mt * 16 + g, w0 + mt * 16 + g + 8, Tn, ld, t4, va[mt]);
    }
    float dka[MT][ND][4], dva[MT][ND][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        zero_frags<ND>(dka[mt]);
        zero_frags<ND>(dva[mt]);
    }
    const int ntiles = (Tn + 63) / 64;
    const int qt0 = kt * (MT);
    auto issue = [&](int qt) {  // q, dy rows and their lse2 / dvec entries, all through cp.async
        async_tile<D>(qh, rb, qt * 64, Tn, ld, Qs2[qt & 1]);
        async_tile<D>(oh, rb, qt * 64, Tn, ldy, Os2[qt & 1]);
        const int r = tid & 63, qq = qt * 64 + r;
        const float* src = (tid < 64 ? lse2 : dvec) + (long long)bh * Tn + (qq < Tn ? qq : 0);
        const unsigned dst = (unsigned)__cvta_generic_to_shared(tid < 64 ? &Ls2[qt & 1][r] : &Es2[qt & 1][r]);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(qq < Tn ? 4 : 0));
        cp_async_commit();
    };
    if (qt0 < ntiles) issue(qt0);
    for (int qt = qt0; qt < ntiles; ++qt) {
        if (qt + 1 < ntiles) {
            issue(qt + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16(*Qs)[D + ATT_PAD] = Qs2[qt & 1];
        const u16(*Os)[D + ATT_PAD] = Os2[qt & 1];
        const float* Ls = Ls2[qt & 1];
        const float* Es = Es2[qt & 1];
        const int q0 = qt * 64;
        if (q0 + 63 >= w0 && w0 < Tn) {
            const bool diag = q0 < w0 + RW - 1 || q0 + 64 > Tn;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                if (q0 + c * 16 + 15 < w0) continue;  // every query of this chunk precedes every key of the warp
                float s[MT][2][4], dp[MT][2][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    zero_frags<2>(s[mt]);
                    zero_frags<2>(dp[mt]);
                }
#pragma unroll
                for (int kk = 0; kk < KS; ++kk) {
                    unsigned bq[4], bo[4];
                    const int row = c * 16 + (lane >> 4) * 8 + (lane & 7), col = kk * 16 + ((lane >> 3) & 1) * 8;
                    ldsm_x4(bq, &Qs[row][col]);
                    ldsm_x4(bo, &Os[row][col]);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816<BF>(s[mt][0], ka[mt][kk], bq[0], bq[1]);   // S^T = K Q^T
                        mma16816<BF>(s[mt][1], ka[mt][kk], bq[2], bq[3]);
                        mma16816<BF>(dp[mt][0], va[mt][kk], bo[0], bo[1]);  // dP^T = V dy^T
                        mma16816<BF>(dp[mt][1], va[mt][kk], bo[2], bo[3]);
                    }
                }
                float Lq[2][2], Eq[2][2];
#pragma unroll
                for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        Lq[jj][u] = Ls[c * 16 + jj * 8 + 2 * t4 + u];
                        Eq[jj][u] = Es[c * 16 + jj * 8 + 2 * t4 + u];
                    }
                }
                unsigned pa[MT][4], sa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const int ka0 = w0 + mt * 16 + g, ka1 = ka0 + 8;
#pragma unroll
                    for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int qq = q0 + c * 16 + jj * 8 + 2 * t4 + (e & 1);
                            const bool ok = !diag || (qq >= (e < 2 ? ka0 : ka1) && qq < Tn);
                            const float p = ok ? exp2f(fmaf(s[mt][jj][e], sl2, -Lq[jj][e & 1])) : 0.0f;
                            s[mt][jj][e] = p;                                    // P^T
                            dp[mt][jj][e] = p * (dp[mt][jj][e] - Eq[jj][e & 1]);  // dS^T
                        }
                    }
                    c_to_afrag<BF>(s[mt][0], s[mt][1], pa[mt]);
                    c_to_afrag<BF>(dp[mt][0], dp[mt][1], sa[mt]);
                }
#pragma unroll
                for (int np = 0; np < ND / 2; ++np) {
                    unsigned bo[4], bq[4];
                    ldsm_x4_t(bo, &Os[c * 16 + (lane & 15)][(2 * np + (lane >> 4)) * 8]);
                    ldsm_x4_t(bq, &Qs[c * 16 + (lane & 15)][(2 * np + (lane >> 4)) * 8]);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816<BF>(dva[mt][2 * np], pa[mt], bo[0], bo[1]);      // dV += P^T dy
                        mma16816<BF>(dva[mt][2 * np + 1], pa[mt], bo[2], bo[3]);
                        mma16816<BF>(dka[mt][2 * np], sa[mt], bq[0], bq[1]);      // dK += dS^T Q
                        mma16816<BF>(dka[mt][2 * np + 1], sa[mt], bq[2], bq[3]);
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int ka0 = w0 + mt * 16 + g;
        store_rows<BF, ND>(dk, rb, ka0, ka0 + 8, Tn, ld, h * D + 2 * t4, &dka[mt][0][0], scale, accumulate);
        store_rows<BF, ND>(dv, rb, ka0, ka0 + 8, Tn, ld, h * D + 2 * t4, &dva[mt][0][0], 1.0f, accumulate);
    }
}

// ---------------------------------------------------------------------------------------------
// extern "C" entry points, one per (implementation, storage type, head dim).

#define ATTN_SIMT_INST(SUF, T, D, TILE)                                                                      \
    extern "C" __global__ void __launch_bounds__(TILE) k_attn_fwd_simt_##SUF##_d##D(                         \
        const T* q, const T* k, const T* v, int ld, T* y, int ldy, float* lse2, int Tn, int H, float sl2) {  \
        attn_fwd_simt<T, D, TILE>(q, k, v, ld, y, ldy, lse2, Tn, H, sl2);                                    \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(TILE) k_attn_bwd_dq_simt_##SUF##_d##D(                      \
        const T* q, const T* k, const T* v, int ld, const T* dy, int ldy, const float* lse2,                 \
        const float* dvec, T* dq, int Tn, int H, float sl2, float scale, int accumulate) {                   \
        attn_bwd_dq_simt<T, D, TILE>(q, k, v, ld, dy, ldy, lse2, dvec, dq, Tn, H, sl2, scale, accumulate);   \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(TILE) k_attn_bwd_dkv_simt_##SUF##_d##D(                     \
        const T* q, const T* k, const T* v, int ld, const T* dy, int ldy, const float* lse2,                 \
        const float* dvec, T* dk, T* dv, int Tn, int H, float sl2, float scale, int accumulate) {            \
        attn_bwd_dkv_simt<T, D, TILE>(q, k, v, ld, dy, ldy, lse2, dvec, dk, dv, Tn, H, sl2, scale,           \
                                      accumulate);                                                           \
    }

#define ATTN_SIMT_ALL(SUF, T)          \
    ATTN_SIMT_INST(SUF, T, 8, 64)      \
    ATTN_SIMT_INST(SUF, T, 16, 64)     \
    ATTN_SIMT_INST(SUF, T, 32, 64)     \
    ATTN_SIMT_INST(SUF, T, 64, 64)     \
    ATTN_SIMT_INST(SUF, T, 128, 32)    \
    extern "C" __global__ void k_attn_dvec_##SUF(const T* y, const T* dy, int ldy, float* dvec, int B, int Tn, \
                                                 int H, int D) {                                             \
        attn_dvec<T>(y, dy, ldy, dvec, B, Tn, H, D);                                                         \
    }

// s + the products of J 16-byte pairs in d order, every load in flight before the first product (D = 32, 64,
// 128 take one call; another D calls it a pair at a time: the same order, the same bits).
template <typename T, int J>
__device__ __forceinline__ float dvec_sum(const uint4* __restrict__ a, const uint4* __restrict__ c, float s) {
    uint4 u[J], w[J];
#pragma unroll
    for (int j = 0; j < J; ++j) { u[j] = a[j]; w[j] = c[j]; }
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const T* pu = reinterpret_cast<const T*>(&u[j]);
        const T* pw = reinterpret_cast<const T*>(&w[j]);
#pragma unroll
        for (int e = 0; e < 8; ++e) s += to_f(pu[e]) * to_f(pw[e]);
    }
    return s;
}
// D_i for 16-bit storage: one thread per (row, head), heads fastest, 16-byte loads (D % 8 == 0): the
// first pass of the dQ-from-dS backward ("wgds"), whose dK/dV kernel reads D_i of every query tile.
template <typename T>
__device__ void attn_dvec16(const T* __restrict__ y, const T* __restrict__ dy, int ldy, float* __restrict__ dvec,
                            int B, int Tn, int H, int D) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // over B*T*H
    if (i >= (long long)B * H * Tn) return;
    const int h = (int)(i % H);
    const long long n = i / H;
    const int b = (int)(n / Tn), t = (int)(n % Tn);
    const uint4* a = reinterpret_cast<const uint4*>(dy + n * ldy + (long long)h * D);
    const uint4* c = reinterpret_cast<const uint4*>(y + n * ldy + (long long)h * D);
    float s = 0.0f;
    if (D == 64) s = dvec_sum<T, 8>(a, c, s);
    else if (D == 128) s = dvec_sum<T, 16>(a, c, s);
    else if (D == 32) s = dvec_sum<T, 4>(a, c, s);
    else for (int j = 0; j < D / 8; ++j) s = dvec_sum<T, 1>(a + j, c + j, s);
    dvec[((long long)b * H + h) * Tn + t] = s;
}
extern "C" __global__ void k_attn_dvec16_bf16(const bf16_t* y, const bf16_t* dy, int ldy, float* dvec, int B, int Tn,
                                              int H, int D) {
    attn_dvec16<bf16_t>(y, dy, ldy, dvec, B, Tn, H, D);
}
extern "C" __global__ void k_attn_dvec16_f16(const f16_t* y, const f16_t* dy, int ldy, float* dvec, int B, int Tn,
                                             int H, int D) {
    attn_dvec16<f16_t>(y, dy, ldy, dvec, B, Tn, H, D);
}

ATTN_SIMT_ALL(f32, float)
ATTN_SIMT_ALL(bf16, bf16_t)
ATTN_SIMT_ALL(f16, f16_t)

// Tensor-core kernels: k_attn_<fwd|bwd_dq|bwd_dkv>_<IMPL>_<t>_d<D>_r<BM>, IMPL mma (P = MT: BM = 64 MT
// rows per block of 4 warps) or wg (P = WG warpgroups of 64 rows, below); NT threads per block.
#define ATTN_TC_INST(IMPL, SUF, BF, D, P, BM, NT)                                                            \
    extern "C" __global__ void __launch_bounds__(NT) k_attn_fwd_##IMPL##_##SUF##_d##D##_r##BM(               \
        const u16* q, const u16* k, const u16* v, int ld, u16* y, int ldy, float* lse2, int Tn, int H,       \
        float sl2) {                                                                                         \
        attn_fwd_##IMPL<BF, D, P>(q, k, v, ld, y, ldy, lse2, Tn, H, sl2);                                    \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(NT) k_attn_bwd_dq_##IMPL##_##SUF##_d##D##_r##BM(            \
        const u16* q, const u16* k, const u16* v, int ld, const u16* dy, const u16* y, int ldy,              \
        const float* lse2, float* dvec, u16* dq, int Tn, int H, float sl2, float scale, int accumulate) {    \
        attn_bwd_dq_##IMPL<BF, D, P>(q, k, v, ld, dy, y, ldy, lse2, dvec, dq, Tn, H, sl2, scale, accumulate); \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(NT) k_attn_bwd_dkv_##IMPL##_##SUF##_d##D##_r##BM(           \
        const u16* q, const u16* k, const u16* v, int ld, const u16* dy, int ldy, const float* lse2,         \
        const float* dvec, u16* dk, u16* dv, int Tn, int H, float sl2, float scale, int accumulate) {        \
        attn_bwd_dkv_##IMPL<BF, D, P>(q, k, v, ld, dy, ldy, lse2, dvec, dk, dv, Tn, H, sl2, scale,           \
                                      accumulate);                                                           \
    }
// NT64 / NT128: the threads of a block of 64 / 128 rows
#define ATTN_TC_ALL(IMPL, NT64, NT128)                                                                       \
    ATTN_TC_INST(IMPL, bf16, true, 32, 1, 64, NT64) ATTN_TC_INST(IMPL, bf16, true, 32, 2, 128, NT128)         \
    ATTN_TC_INST(IMPL, bf16, true, 64, 1, 64, NT64) ATTN_TC_INST(IMPL, bf16, true, 64, 2, 128, NT128)         \
    ATTN_TC_INST(IMPL, f16, false, 32, 1, 64, NT64) ATTN_TC_INST(IMPL, f16, false, 32, 2, 128, NT128)         \
    ATTN_TC_INST(IMPL, f16, false, 64, 1, 64, NT64) ATTN_TC_INST(IMPL, f16, false, 64, 2, 128, NT128)

ATTN_TC_ALL(mma, 128, 128)

// ---------------------------------------------------------------------------------------------
// Hopper versions (*_wg_<t>_d<D>): the same three kernels and contract as *_mma_*, with warpgroup
// MMA (wgmma.mma_async, sm_90a only: the loader compiles this file for sm_90a on a compute
// capability 9.0 device, and kernels.attn_impl picks them there). A block is one warpgroup (4 warps)
// owning 64 rows; warp w holds rows 16w.. in the same fragment layout as the m16n8k16 kernels, so the
// softmax and masking code is theirs. The register operand A (q, dy, k, v rows; P, dS) comes from
// registers, the streamed operand B from a 64-row shared tile stored as 8x8 "core matrices" (no
// swizzle): the 16-byte chunk (r, c8) of the tile lies at element ((r/8) (D/8) + c8) 64 + (r%8) 8.
// One tile serves both products: A X^T (X K-major: LBO = 128 B along d, SBO = 16 D bytes along
// rows) and A X (X MN-major: LBO = 16 D bytes along rows, SBO = 128 B along d).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

#define WG_MMA_N64(TY)                                                                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"                                        \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, "  \
                 "%36, p, 1, 1, %37;\n}\n"                                                             \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])  \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TR), "r"(acc))
#define WG_MMA_N32(TY)                                                                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %22, 0;\n"                                        \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, "  \
                 "%20, p, 1, 1, %21;\n}\n"                                                             \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])  \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TR), "r"(acc))

// d (64 x N fp32 per warpgroup, 4 N/8 registers per thread) (+)= a (64 x 16, registers) x the k16
// slice of B described by desc; TR = 1 reads B as MN-major.
template <bool BF, int N, int TR>
__device__ __forceinline__ void wgmma_rs(float* d, const unsigned* a, unsigned long long desc, int acc) {
    if constexpr (N == 64) {
        if constexpr (BF) WG_MMA_N64("bf16"); else WG_MMA_N64("f16");
    } else {
        static_assert(N == 32, "wgmma_rs: N is 32 or 64");
        if constexpr (BF) WG_MMA_N32("bf16"); else WG_MMA_N32("f16");
    }
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// wait until at most N of the committed groups are still running (they complete in order)
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void wg_commit_wait() {
    wg_commit();
    wg_wait<0>();
}
// the accumulators are read only after the wait: keep the compiler from moving their uses above it
template <int N>
__device__ __forceinline__ void wg_regs(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// cp.async wrote the tiles through the generic proxy; wgmma reads them through the async proxy
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// a compile-time flag for generic lambdas: the masked and the unmasked tile are two specialized copies
template <bool B>
struct Flag {
    static constexpr bool value = B;
};

__device__ __forceinline__ unsigned long long wg_desc(const u16* p, unsigned lbo, unsigned sbo) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    return (unsigned long long)((a & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32);
}
// k16 slice kk of X^T (X = tile [64 rows][D], k = d) and of X (k = rows 16 kk ..)
template <int D>
__device__ __forceinline__ unsigned long long desc_xt(const u16* tile, int kk) {
    return wg_desc(tile + kk * 128, 128, 16 * D);
}
template <int D>
__device__ __forceinline__ unsigned long long desc_x(const u16* tile, int kk) {
    return wg_desc(tile + kk * 2 * (D / 8) * 64, 16 * D, 128);
}

// cp.async of rows r0 .. r0+63 of a (B*T, ld) head view into a core-matrix tile (rows >= Tn zero);
// consecutive threads fill consecutive 16-byte chunks of the tile (no bank conflicts).
template <int D>
__device__ __forceinline__ void async_tile_cm(const u16* __restrict__ src, long long row_base, int r0, int Tn, int ld,
                                              u16* dst) {
    for (int idx = threadIdx.x; idx < 64 * D / 8; idx += blockDim.x) {
        const int r8 = idx & 7, c8 = (idx >> 3) % (D / 8), rg = (idx >> 3) / (D / 8), r = rg * 8 + r8;
        const bool ok = r0 + r < Tn;
        const u16* gp = src + (row_base + (ok ? r0 + r : 0)) * ld + c8 * 8;
        const unsigned sa = (unsigned)__cvta_generic_to_shared(dst + (rg * (D / 8) + c8) * 64 + r8 * 8);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gp), "r"(ok ? 16 : 0));
    }
}

// Start the copy of 64-row tiles t of a and b (both with leading dimension ld) into buffers t & 1.
template <int D>
__device__ __forceinline__ void issue_pair_cm(const u16* a, const u16* b, int ld, long long rb, int t, int Tn,
                                              u16 (*As2)[64 * D], u16 (*Bs2)[64 * D]) {
    async_tile_cm<D>(a, rb, t * 64, Tn, ld, As2[t & 1]);
    async_tile_cm<D>(b, rb, t * 64, Tn, ld, Bs2[t & 1]);
    cp_async_commit();
}

// Wait for the tile pair of step t (putting step t+1's in flight first when there is one) and make it
// visible to wgmma.
template <typename Issue>
__device__ __forceinline__ void wg_next(Issue issue, int t, int nt) {
    if (t + 1 < nt) {
        issue(t + 1);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    fence_async_smem();
    __syncthreads();
}

// The forward as FlashAttention-3 orders one warpgroup's work: S_{j+1} = Q K_{j+1}^T and then
// O += P_j V_j go to the tensor cores together, and the softmax of S_{j+1} runs while P_j V_j is
// multiplied. Shared stage t holds K tile t and V tile t-1 (the pair one step uses), double-buffered:
// stage t+2 is in flight while stage t+1 is used. Step j = -1 only starts S_0; a warpgroup is active
// on key tiles 0 .. its diagonal (the block's other warpgroup may need one tile more).
// y8 non-null (fp8: kernels.k_attn_fwd's e4m3, bf16 only): y also in E4M3 at *sc into y8 (ldy apart), and,
// y8t non-null, transposed into y8t (C, ldt), through shared memory (Ks2, free after the last product);
// the block's max |bf16 value| atomicMax-ed into *rec: the bytes of the bf16 y followed by fp8.cu's cast.
template <bool BF, int D, int WG>
__device__ void attn_fwd_wg(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, int ld,
                            u16* __restrict__ y, int ldy, float* __restrict__ lse2, int Tn, int H, float sl2,
                            unsigned char* __restrict__ y8 = nullptr, unsigned char* __restrict__ y8t = nullptr,
                            long long ldt = 0, const float* __restrict__ sc = nullptr, float* __restrict__ rec = nullptr) {
    constexpr int KS = D / 16, ND = D / 8;
    __shared__ __align__(128) u16 Ks2[2][64 * D];
    __shared__ __align__(128) u16 Vs2[2][64 * D];
    // wgi through a shuffle: ptxas then knows it is warp-uniform (no wgmma serialized on divergent paths)
    const int tid = threadIdx.x, wgi = __shfl_sync(0xffffffffu, tid >> 7, 0), warp = (tid >> 5) & 3,
              lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;  // longest rows first
    const long long rb = (long long)b * Tn;
    const int r0 = qt * 64 * WG + wgi * 64, ra = r0 + warp * 16 + g, rc = ra + 8;  // r0: this warpgroup's rows
    const u16 *kh = k + h * D, *vh = v + h * D;
    const int nkt = (min(Tn, qt * 64 * WG + 64 * WG) - 1) / 64 + 1;  // the block's key tiles
    const int nact = min(nkt, r0 / 64 + 1);                            // this warpgroup's: 0 .. nact-1
    auto stage = [&](int t) {  // K tile t (t < nkt) and V tile t-1 (t >= 1) into buffers t & 1
        if (t < nkt) async_tile_cm<D>(kh, rb, t * 64, Tn, ld, Ks2[t & 1]);
        if (t >= 1) async_tile_cm<D>(vh, rb, (t - 1) * 64, Tn, ld, Vs2[t & 1]);
        cp_async_commit();
    };
    stage(0);
    unsigned qa[KS][4], pa[4][4];
    load_afrag<D>(q + h * D, rb, ra, rc, Tn, ld, t4, qa);
    float o[ND * 4], s[32];
#pragma unroll
    for (int i = 0; i < ND * 4; ++i) o[i] = 0.0f;
    float m0 = -ANDREA_INF, m1 = -ANDREA_INF, l0 = 0.0f, l1 = 0.0f, c0 = 1.0f, c1 = 1.0f;
    auto top = [&](int j) {  // step j uses stage j+1; every warp has finished step j-1 past the barrier
        cp_async_wait<0>();
        fence_async_smem();
        __syncthreads();
        if (j + 2 <= nkt) stage(j + 2);
    };
    auto issue_s = [&](int j) {  // S_{j+1} = Q K_{j+1}^T
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) wgmma_rs<BF, 64, 0>(s, qa[kk], desc_xt<D>(Ks2[(j + 1) & 1], kk), kk);
        wg_commit();
    };
    auto issue_pv = [&](int j) {  // O += P_j V_j
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs<BF, D, 1>(o, pa[kk], desc_x<D>(Vs2[(j + 1) & 1], kk), 1);
        wg_commit();
    };
    auto softmax = [&](int kt) {  // S_kt (in s) -> unnormalized P_kt; m, l and the factor c for o
        const int k0 = kt * 64;
        if (k0 + 63 > r0 || k0 + 64 > Tn) {
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int key = k0 + (i >> 2) * 8 + 2 * t4 + (i & 1);
                if (!(key <= ((i & 2) ? rc : ra) && key < Tn)) s[i] = -ANDREA_INF;
            }
        }
        float mx0 = -ANDREA_INF, mx1 = -ANDREA_INF;
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            mx0 = fmaxf(mx0, fmaxf(s[4 * jj], s[4 * jj + 1]));
            mx1 = fmaxf(mx1, fmaxf(s[4 * jj + 2], s[4 * jj + 3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float n0 = fmaxf(m0, mx0 * sl2), n1 = fmaxf(m1, mx1 * sl2);  // log2 domain
        const float z0 = (n0 == -ANDREA_INF) ? 0.0f : n0, z1 = (n1 == -ANDREA_INF) ? 0.0f : n1;
        c0 = exp2f(m0 - z0);
        c1 = exp2f(m1 - z1);
        m0 = n0;
        m1 = n1;
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            s[4 * jj] = exp2f(fmaf(s[4 * jj], sl2, -z0));
            s[4 * jj + 1] = exp2f(fmaf(s[4 * jj + 1], sl2, -z0));
            s[4 * jj + 2] = exp2f(fmaf(s[4 * jj + 2], sl2, -z1));
            s[4 * jj + 3] = exp2f(fmaf(s[4 * jj + 3], sl2, -z1));
            ps0 += s[4 * jj] + s[4 * jj + 1];
            ps1 += s[4 * jj + 2] + s[4 * jj + 3];
        }
        l0 = l0 * c0 + ps0;
        l1 = l1 * c1 + ps1;
    };
    auto rescale_pack = [&]() {  // o to the new maximum; P into A fragments (the last P V is done)
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            o[4 * n] *= c0; o[4 * n + 1] *= c0; o[4 * n + 2] *= c1; o[4 * n + 3] *= c1;
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) c_to_afrag<BF>(&s[8 * kk], &s[8 * kk + 4], pa[kk]);
    };
    // step -1: S_0 alone (nact >= 1)
    top(-1);
    wg_fence();
    issue_s(-1);
    wg_wait<0>();
    wg_regs<32>(s);
    softmax(0);
    rescale_pack();
    // steps 0 .. nact-2: S_{j+1} and P_j V_j in flight together, the softmax of S_{j+1} under P_j V_j
    int j = 0;
    for (; j < nact - 1; ++j) {
        top(j);
        wg_fence();
        issue_s(j);
        issue_pv(j);
        wg_wait<1>();
        wg_regs<32>(s);
        softmax(j + 1);
        wg_wait<0>();
        wg_regs<ND * 4>(o);
        rescale_pack();
    }
    // the last step of this warpgroup: P V alone; then the block's remaining steps (the other
    // warpgroup's diagonal tile) only keep the stages and barriers in step
    top(j);
    wg_fence();
    issue_pv(j);
    wg_wait<0>();
    wg_regs<ND * 4>(o);
    for (++j; j < nkt; ++j) top(j);
    if (y8 == nullptr) {
        fwd_store<BF, ND>(y, rb, ra, rc, Tn, ldy, h * D + 2 * t4, t4, o, m0, m1, l0, l1, lse2 + (long long)bh * Tn);
        return;
    }
    constexpr int ROWS = 64 * WG;                      // the block's rows; the stage: D x ROWS bytes <= Ks2's
    static_assert(D * ROWS <= (int)sizeof(Ks2), "the transposed E4M3 stage must fit in Ks2");
    unsigned char* t8 = y8t != nullptr ? reinterpret_cast<unsigned char*>(&Ks2[0][0]) : nullptr;
    const int row0 = qt * ROWS;
    if (t8 != nullptr) __syncthreads();                // every warpgroup's last product has read Ks2
    float m8 = 0.0f;
    fwd_store<BF, ND>(y, rb, ra, rc, Tn, ldy, h * D + 2 * t4, t4, o, m0, m1, l0, l1, lse2 + (long long)bh * Tn,
                      y8, *sc, &m8, t8, h * D, row0, ROWS);
    __shared__ float red8[32];
    m8 = block_max(m8, red8);
    if (tid == 0) atomicMax(reinterpret_cast<int*>(rec), __float_as_int(m8));
    if (t8 == nullptr) return;
    __syncthreads();
    stage_to_t<D>(t8, ROWS, y8t, ldt, rb, row0, Tn, h * D);
}


// dQ per 64 query rows (and dvec, as the mma dQ kernel); key tiles 0 .. the diagonal.
template <bool BF, int D, int WG>
__device__ void attn_bwd_dq_wg(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                               int ld, const u16* __restrict__ dy, const u16* __restrict__ y, int ldy,
                               const float* __restrict__ lse2, float* __restrict__ dvec, u16* __restrict__ dq,
                               int Tn, int H, float sl2, float scale, int accumulate) {
    constexpr int KS = D / 16, ND = D / 8;
    __shared__ __align__(128) u16 Ks2[2][64 * D];
    __shared__ __align__(128) u16 Vs2[2][64 * D];
    const int tid = threadIdx.x, wgi = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2,
              t4 = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
    const long long rb = (long long)b * Tn;
    const int r0 = qt * 64 * WG + wgi * 64, ra = r0 + warp * 16 + g, rc = ra + 8;  // r0: this warpgroup's rows
    const u16 *kh = k + h * D, *vh = v + h * D;
    auto issue = [&](int t) { issue_pair_cm<D>(kh, vh, ld, rb, t, Tn, Ks2, Vs2); };
    issue(0);
    unsigned qa[KS][4], da[KS][4], ya[KS][4];
    load_afrag<D>(q + h * D, rb, ra, rc, Tn, ld, t4, qa);
    load_afrag<D>(dy + h * D, rb, ra, rc, Tn, ldy, t4, da);
    load_afrag<D>(y + h * D, rb, ra, rc, Tn, ldy, t4, ya);
    float e0, e1;
    dvec_rows<BF, KS>(da, ya, e0, e1);
    if (t4 == 0) {
        if (ra < Tn) dvec[(long long)bh * Tn + ra] = e0;
        if (rc < Tn) dvec[(long long)bh * Tn + rc] = e1;
    }
    const float L0 = ra < Tn ? lse2[(long long)bh * Tn + ra] : 0.0f;
    const float L1 = rc < Tn ? lse2[(long long)bh * Tn + rc] : 0.0f;
    float acc[ND * 4];
#pragma unroll
    for (int i = 0; i < ND * 4; ++i) acc[i] = 0.0f;
    const int nkt = (min(Tn, qt * 64 * WG + 64 * WG) - 1) / 64 + 1;
    for (int kt = 0; kt < nkt; ++kt) {
        wg_next(issue, kt, nkt);
        const u16* Ks = Ks2[kt & 1];
        const u16* Vs = Vs2[kt & 1];
        const int k0 = kt * 64;
        if (k0 > r0 + 63) {
            __syncthreads();
            continue;
        }
        float s[32], dp[32];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) wgmma_rs<BF, 64, 0>(s, qa[kk], desc_xt<D>(Ks, kk), kk);
        wg_commit();
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) wgmma_rs<BF, 64, 0>(dp, da[kk], desc_xt<D>(Vs, kk), kk);
        wg_commit();
        wg_wait<1>();  // S is in; P's exp runs while dP is multiplied
        wg_regs<32>(s);
        auto probs = [&](auto masked) {  // only a tile crossing the diagonal or Tn is masked
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int key = k0 + (i >> 2) * 8 + 2 * t4 + (i & 1);
                const float e = exp2f(fmaf(s[i], sl2, -((i & 2) ? L1 : L0)));  // always: a select, not a branch
                if constexpr (decltype(masked)::value) s[i] = (key <= ((i & 2) ? rc : ra) && key < Tn) ? e : 0.0f;
                else s[i] = e;
            }
        };
        if (k0 + 63 > r0 || k0 + 64 > Tn) probs(Flag<true>{});
        else probs(Flag<false>{});
        wg_wait<0>();
        wg_regs<32>(dp);
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] *= dp[i] - ((i & 2) ? e1 : e0);  // dS
        unsigned sa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) c_to_afrag<BF>(&s[8 * kk], &s[8 * kk + 4], sa[kk]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs<BF, D, 1>(acc, sa[kk], desc_x<D>(Ks, kk), 1);
        wg_commit_wait();
        wg_regs<ND * 4>(acc);
        __syncthreads();
    }
    store_rows<BF, ND>(dq, rb, ra, rc, Tn, ld, h * D + 2 * t4, acc, scale, accumulate);
}

// The stored dS^T tiles (attn_bwd_dkv_wg<..., DS = true>, read by attn_bwd_dqs_wg): per head of the
// launch, the causal tile pairs (query tile i, key tile j <= i) at i (i + 1) / 2 + j, each 64 x 64
// 16-bit values as 8x8 core matrices with key rows: element (key r, query c) at
// ((r / 8) 8 + c / 8) 64 + (r % 8) 8 + c % 8. A warp stores whole 128-byte core matrices.
// The launch's heads 0 .. n1 - 1 keep their tiles in ds, the rest in ds2 (two scratch buffers, so that
// one launch can take every head where neither buffer alone holds them).
template <typename U>
__device__ __forceinline__ U* ds_head(U* ds, U* ds2, int n1, int y, int ntiles) {
    const long long per = (long long)(ntiles * (ntiles + 1) / 2) * 4096;
    return y < n1 ? ds + y * per : ds2 + (y - n1) * per;
}
__device__ __forceinline__ void ds_store_t(u16* dst, const unsigned (*sa)[4], int warp, int g, int t4) {
    unsigned* d32 = reinterpret_cast<unsigned*>(dst);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // sa[kk][e]: key rows 16 warp + g (+8: e odd), queries 16 kk + 2 t4 (+8: e >= 2)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = warp * 16 + g + ((e & 1) ? 8 : 0), c = kk * 16 + ((e & 2) ? 8 : 0) + 2 * t4;
            d32[(((r >> 3) * 8 + (c >> 3)) * 64 + (r & 7) * 8 + (c & 7)) >> 1] = sa[kk][e];
        }
    }
}

// dQ per 64 query rows from the stored dS^T tiles: dQ = scale sum_j dS_ij K_j over key tiles j from 0
// to the diagonal, one product per tile (the dS^T tiles and K tiles double-buffered in shared memory,
// dS's A fragments by ldmatrix.trans of the key-row core matrices).
template <bool BF, int D, int WG>
__device__ void attn_bwd_dqs_wg(const u16* __restrict__ k, int ld, const u16* __restrict__ ds, u16* __restrict__ dq,
                                int Tn, int H, float scale, int accumulate, int bh0,
                                unsigned char* __restrict__ dq8, const float* __restrict__ sc, float* __restrict__ rec,
                                const u16* __restrict__ ds2, int n1, unsigned char* __restrict__ dq8t = nullptr,
                                long long ldt = 0) {
    constexpr int ND = D / 8;
    __shared__ __align__(128) u16 Ks2[2][64 * D];
    __shared__ __align__(128) u16 Ds2[2][WG][64 * 64];
    const int tid = threadIdx.x, wgi = __shfl_sync(0xffffffffu, tid >> 7, 0), warp = (tid >> 5) & 3,
              lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x, bh = bh0 + blockIdx.y, b = bh / H, h = bh % H;
    const long long rb = (long long)b * Tn;
    const int r0 = qt * 64 * WG + wgi * 64, ra = r0 + warp * 16 + g, rc = ra + 8;
    const int ntiles = (Tn + 63) / 64, nkt = (min(Tn, qt * 64 * WG + 64 * WG) - 1) / 64 + 1;
    const u16* dsh = ds_head(ds, ds2, n1, blockIdx.y, ntiles);
    const u16* kh = k + h * D;
    auto issue = [&](int t) {  // K tile t, and each warpgroup's dS^T tile (its query tile, t) below the diagonal
        async_tile_cm<D>(kh, rb, t * 64, Tn, ld, Ks2[t & 1]);
        for (int idx = tid; idx < WG * 512; idx += blockDim.x) {
            const int w = idx >> 9, c = idx & 511, qw = qt * WG + w;
            if (qw < ntiles && t <= qw) {
                const unsigned sa = (unsigned)__cvta_generic_to_shared(&Ds2[t & 1][w][c * 8]);
                const u16* gp = dsh + ((long long)(qw * (qw + 1) / 2 + t)) * 4096 + c * 8;
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gp));
            }
        }
        cp_async_commit();
    };
    issue(0);
    float acc[ND * 4];
#pragma unroll
    for (int i = 0; i < ND * 4; ++i) acc[i] = 0.0f;
    // ldmatrix.trans: lanes 8m .. 8m+7 address the rows of core matrix m = (key group 2 kk + m / 2,
    // query group 2 warp + m % 2), which gives the A fragment of rows 16 warp + g (+8), keys 16 kk + 2 t4 (+8)
    const int m = lane >> 3, lrow = lane & 7;
    const int moff = (((m >> 1) * 8 + 2 * warp + (m & 1)) * 64 + lrow * 8);
    for (int kt = 0; kt < nkt; ++kt) {
        wg_next(issue, kt, nkt);
        if (kt * 64 <= r0 + 63 && r0 < Tn) {
            const u16* Dt = Ds2[kt & 1][wgi];
            unsigned sa[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) ldsm_x4_t(sa[kk], Dt + kk * 2 * 8 * 64 + moff);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wgmma_rs<BF, D, 1>(acc, sa[kk], desc_x<D>(Ks2[kt & 1], kk), 1);
            wg_commit_wait();
            wg_regs<ND * 4>(acc);
        }
        __syncthreads();
    }
    if (dq8 != nullptr) {  // the loop ended on a barrier: Ks2 is free for the transposing stage
        constexpr int ROWS = 64 * WG;
        static_assert(D * ROWS <= (int)sizeof(Ks2), "the transposed E4M3 stage must fit in Ks2");
        unsigned char* t8 = dq8t != nullptr ? reinterpret_cast<unsigned char*>(&Ks2[0][0]) : nullptr;
        const int row0 = qt * ROWS;
        store_rows_e4m3<ND>(dq8, rb, ra, rc, Tn, ld, h * D + 2 * t4, acc, scale, sc, rec, t8, h * D, row0, ROWS);
        if (t8 != nullptr) {
            __syncthreads();
            stage_to_t<D>(t8, ROWS, dq8t, ldt, rb, row0, Tn, h * D);
        }
        return;
    }
    store_rows<BF, ND>(dq, rb, ra, rc, Tn, ld, h * D + 2 * t4, acc, scale, accumulate);
}

// dK, dV per 64 key rows; query tiles (with dy, lse2, dvec) from the diagonal down.
// DS: also store each tile's dS^T (16-bit, as the dK product rounds it) into ds, for the dQ kernel
// attn_bwd_dqs_wg; bh0: the first head of this launch (ds, then ds2 past its n1 heads: ds_head).
template <bool BF, int D, int WG, bool DS = false>
__device__ void attn_bwd_dkv_wg(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                                int ld, const u16* __restrict__ dy, int ldy, const float* __restrict__ lse2,
                                const float* __restrict__ dvec, u16* __restrict__ dk, u16* __restrict__ dv, int Tn,
                                int H, float sl2, float scale, int accumulate, u16* __restrict__ ds = nullptr,
                                int bh0 = 0, unsigned char* __restrict__ dk8 = nullptr,
                                unsigned char* __restrict__ dv8 = nullptr, const float* __restrict__ sc = nullptr,
                                float* __restrict__ rec = nullptr, u16* __restrict__ ds2 = nullptr,
                                int n1 = 0x7fffffff, unsigned char* __restrict__ dk8t = nullptr,
                                unsigned char* __restrict__ dv8t = nullptr, long long ldt = 0) {
    constexpr int KS = D / 16, ND = D / 8;
    __shared__ __align__(128) u16 Qs2[2][64 * D];
    __shared__ __align__(128) u16 Os2[2][64 * D];
    __shared__ float Ls2[2][64];
    __shared__ float Es2[2][64];
    const int tid = threadIdx.x, wgi = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2,
              t4 = lane & 3;
    const int kt = blockIdx.x, bh = bh0 + blockIdx.y, b = bh / H, h = bh % H;
    const long long rb = (long long)b * Tn;
    const int k0 = kt * 64 * WG + wgi * 64, ka0 = k0 + warp * 16 + g, ka1 = ka0 + 8;  // k0: this warpgroup's keys
    const u16 *qh = q + h * D, *oh = dy + h * D;
    auto issue = [&](int qt) {
        async_tile_cm<D>(qh, rb, qt * 64, Tn, ld, Qs2[qt & 1]);
        async_tile_cm<D>(oh, rb, qt * 64, Tn, ldy, Os2[qt & 1]);
        const int r = tid & 63, qq = qt * 64 + r;
        if (tid < 128) {
            const float* src = (tid < 64 ? lse2 : dvec) + (long long)bh * Tn + (qq < Tn ? qq : 0);
            const unsigned dst = (unsigned)__cvta_generic_to_shared(tid < 64 ? &Ls2[qt & 1][r] : &Es2[qt & 1][r]);
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(qq < Tn ? 4 : 0));
        }
        cp_async_commit();
    };
    const int ntiles = (Tn + 63) / 64, qt0 = kt * WG;
    issue(qt0);
    unsigned ka[KS][4], va[KS][4];
    load_afrag<D>(k + h * D, rb, ka0, ka1, Tn, ld, t4, ka);
    load_afrag<D>(v + h * D, rb, ka0, ka1, Tn, ld, t4, va);
    float dka[ND * 4], dva[ND * 4];
#pragma unroll
    for (int i = 0; i < ND * 4; ++i) dka[i] = dva[i] = 0.0f;
    for (int qt = qt0; qt < ntiles; ++qt) {
        wg_next(issue, qt, ntiles);
        const u16* Qs = Qs2[qt & 1];
        const u16* Os = Os2[qt & 1];
        const float* Ls = Ls2[qt & 1];
        const float* Es = Es2[qt & 1];
        const int q0 = qt * 64;
        if (q0 + 63 < k0) {  // every query of this tile precedes every key of this warpgroup
            __syncthreads();
            continue;
        }
        float s[32], dp[32];
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) wgmma_rs<BF, 64, 0>(s, ka[kk], desc_xt<D>(Qs, kk), kk);   // S^T = K Q^T
        wg_commit();
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) wgmma_rs<BF, 64, 0>(dp, va[kk], desc_xt<D>(Os, kk), kk);  // dP^T = V dy^T
        wg_commit();
        // Three overlaps per tile: P's exp runs while dP is multiplied, dS while dV is, and the
        // next tile's wait after dK is issued. Groups complete in order.
        wg_wait<1>();
        wg_regs<32>(s);
        auto probs = [&](auto masked) {  // P^T; only a tile crossing the diagonal or Tn is masked
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int c = (i >> 2) * 8 + 2 * t4 + (i & 1), qq = q0 + c;
                const float e = exp2f(fmaf(s[i], sl2, -Ls[c]));  // always: a select, not a branch
                if constexpr (decltype(masked)::value) s[i] = (qq >= ((i & 2) ? ka1 : ka0) && qq < Tn) ? e : 0.0f;
                else s[i] = e;
            }
        };
        if (q0 < k0 + 63 || q0 + 64 > Tn) probs(Flag<true>{});
        else probs(Flag<false>{});
        unsigned pa[4][4], sa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) c_to_afrag<BF>(&s[8 * kk], &s[8 * kk + 4], pa[kk]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs<BF, D, 1>(dva, pa[kk], desc_x<D>(Os, kk), 1);  // dV += P^T dy
        wg_commit();
        wg_wait<1>();
        wg_regs<32>(dp);
#pragma unroll
        for (int i = 0; i < 32; ++i) dp[i] = s[i] * (dp[i] - Es[(i >> 2) * 8 + 2 * t4 + (i & 1)]);  // dS^T
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) c_to_afrag<BF>(&dp[8 * kk], &dp[8 * kk + 4], sa[kk]);
        if constexpr (DS) {  // the tile (query tile qt, key tile k0 / 64) for the dQ kernel
            u16* dst = ds_head(ds, ds2, n1, blockIdx.y, ntiles) + (long long)(qt * (qt + 1) / 2 + k0 / 64) * 4096;
            ds_store_t(dst, sa, warp, g, t4);
        }
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs<BF, D, 1>(dka, sa[kk], desc_x<D>(Qs, kk), 1);  // dK += dS^T Q
        wg_commit_wait();
        wg_regs<ND * 4>(dva);
        wg_regs<ND * 4>(dka);
        __syncthreads();
    }
    if (dk8 != nullptr) {  // fp8: dK, dV in E4M3 (bf16 storage only: the launcher's check); with dk8t (and
        // dv8t) also transposed, staged in Qs2 (free: the loop ended on a barrier)
        constexpr int ROWS = 64 * WG;
        static_assert(2 * D * ROWS <= (int)sizeof(Qs2), "the transposed E4M3 stages must fit in Qs2");
        unsigned char* t8 = dk8t != nullptr ? reinterpret_cast<unsigned char*>(&Qs2[0][0]) : nullptr;
        const int row0 = kt * ROWS;
        store_rows_e4m3<ND>(dk8, rb, ka0, ka1, Tn, ld, h * D + 2 * t4, dka, scale, sc, rec, t8, h * D, row0, ROWS);
        store_rows_e4m3<ND>(dv8, rb, ka0, ka1, Tn, ld, h * D + 2 * t4, dva, 1.0f, sc, rec,
                            t8 == nullptr ? nullptr : t8 + D * ROWS, h * D, row0, ROWS);
        if (t8 != nullptr) {
            __syncthreads();
            stage_to_t<D>(t8, ROWS, dk8t, ldt, rb, row0, Tn, h * D);
            stage_to_t<D>(t8 + D * ROWS, ROWS, dv8t, ldt, rb, row0, Tn, h * D);
        }
        return;
    }
    store_rows<BF, ND>(dk, rb, ka0, ka1, Tn, ld, h * D + 2 * t4, dka, scale, accumulate);
    store_rows<BF, ND>(dv, rb, ka0, ka1, Tn, ld, h * D + 2 * t4, dva, 1.0f, accumulate);
}

ATTN_TC_ALL(wg, 128, 256)  // 128 threads per warpgroup
// The wgmma forward also with 4 warpgroups a block (256 rows, 512 threads): each K/V tile the block
// loads then serves 256 query rows instead of 128 (kernels.ATTN_WG_ROWS picks the rows per head size).
#define ATTN_WG_FWD256_INST(SUF, BF, D)                                                                      \
    extern "C" __global__ void __launch_bounds__(512) k_attn_fwd_wg_##SUF##_d##D##_r256(                     \
        const u16* q, const u16* k, const u16* v, int ld, u16* y, int ldy, float* lse2, int Tn, int H,       \
        float sl2) {                                                                                         \
        attn_fwd_wg<BF, D, 4>(q, k, v, ld, y, ldy, lse2, Tn, H, sl2);                                        \
    }
ATTN_WG_FWD256_INST(bf16, true, 32) ATTN_WG_FWD256_INST(bf16, true, 64)
ATTN_WG_FWD256_INST(f16, false, 32) ATTN_WG_FWD256_INST(f16, false, 64)
// The fp8 engine's forward (fp8.ATTN_FWD_E4M3): the wgmma forward also writing y in E4M3 (attn_fwd_wg's y8).
#define ATTN_WG_FWD8_INST(D, WG, BM, NT)                                                                     \
    extern "C" __global__ void __launch_bounds__(NT) k_attn_fwd8_wg_bf16_d##D##_r##BM(                       \
        const u16* q, const u16* k, const u16* v, int ld, u16* y, int ldy, float* lse2, int Tn, int H,       \
        float sl2, unsigned char* y8, unsigned char* y8t, long long ldt, const float* sc, float* rec) {      \
        attn_fwd_wg<true, D, WG>(q, k, v, ld, y, ldy, lse2, Tn, H, sl2, y8, y8t, ldt, sc, rec);               \
    }
ATTN_WG_FWD8_INST(32, 1, 64, 128) ATTN_WG_FWD8_INST(32, 2, 128, 256) ATTN_WG_FWD8_INST(32, 4, 256, 512)
ATTN_WG_FWD8_INST(64, 1, 64, 128) ATTN_WG_FWD8_INST(64, 2, 128, 256) ATTN_WG_FWD8_INST(64, 4, 256, 512)

// The dQ-from-dS pair (impl "wgds"): k_attn_bwd_dkvs_wg_* (the dK/dV kernel, also storing dS^T) then
// k_attn_bwd_dqs_wg_*, for the heads bh0 .. bh0 + gridDim.y - 1 (their tiles: the first n1 in ds, the
// rest in ds2).
// dk8/dv8/dq8 non-null (fp8, bf16 storage): the outputs in E4M3 at *sc there instead, amax into *rec;
// dk8t/dv8t/dq8t non-null: also transposed there (rows h D + d, ldt apart).
#define ATTN_WGDS_INST(SUF, BF, D, P, BM, NT)                                                                \
    extern "C" __global__ void __launch_bounds__(NT) k_attn_bwd_dkvs_wg_##SUF##_d##D##_r##BM(                \
        const u16* q, const u16* k, const u16* v, int ld, const u16* dy, int ldy, const float* lse2,         \
        const float* dvec, u16* dk, u16* dv, int Tn, int H, float sl2, float scale, int accumulate, u16* ds, \
        int bh0, unsigned char* dk8, unsigned char* dv8, const float* sc, float* rec, u16* ds2, int n1,      \
        unsigned char* dk8t, unsigned char* dv8t, long long ldt) {                                           \
        attn_bwd_dkv_wg<BF, D, P, true>(q, k, v, ld, dy, ldy, lse2, dvec, dk, dv, Tn, H, sl2, scale,          \
                                        accumulate, ds, bh0, dk8, dv8, sc, rec, ds2, n1, dk8t, dv8t, ldt);   \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(NT) k_attn_bwd_dqs_wg_##SUF##_d##D##_r##BM(                 \
        const u16* k, int ld, const u16* ds, u16* dq, int Tn, int H, float scale, int accumulate, int bh0,   \
        unsigned char* dq8, const float* sc, float* rec, const u16* ds2, int n1, unsigned char* dq8t,        \
        long long ldt) {                                                                                     \
        attn_bwd_dqs_wg<BF, D, P>(k, ld, ds, dq, Tn, H, scale, accumulate, bh0, dq8, sc, rec, ds2, n1, dq8t,  \
                                  ldt);                                                                      \
    }
ATTN_WGDS_INST(bf16, true, 32, 1, 64, 128) ATTN_WGDS_INST(bf16, true, 32, 2, 128, 256)
ATTN_WGDS_INST(bf16, true, 64, 1, 64, 128) ATTN_WGDS_INST(bf16, true, 64, 2, 128, 256)
ATTN_WGDS_INST(f16, false, 32, 1, 64, 128) ATTN_WGDS_INST(f16, false, 32, 2, 128, 256)
ATTN_WGDS_INST(f16, false, 64, 1, 64, 128) ATTN_WGDS_INST(f16, false, 64, 2, 128, 256)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
