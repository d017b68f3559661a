// attention.cu: fused causal scaled-dot-product attention, forward and backward (the `attn` op pair).
//
// Layout: q, k, v are row-major (B*T, ld) views with head h at columns [h*D, h*D+D) (ld = 3C for a
// packed qkv buffer); y and dy are (B*T, ldy); lse2 and dvec are (B*H, T) fp32.
// No T x T matrix is ever stored: the forward keeps a running max/sum per query row (online softmax)
// and saves only lse2 = log2-sum-exp of the scaled scores per row; the backward recomputes the
// probabilities tile by tile.
//
// Deterministic backward without atomics: dK/dV are computed per key tile by a block that walks the
// query tiles in order (k_attn_bwd_dkv_*); dQ per query tile by a block that walks the key tiles
// (k_attn_bwd_dq_*). Each output element has exactly one writer.
//
// Two implementations with the same contract:
//   *_simt_<t>_d<D>: one thread per row, fp32 FMA; any storage type; D in {8, 16, 32, 64, 128}.
//   *_mma_<t>_d<D>:  tensor cores (mma.sync m16n8k16, fp32 accumulate), bf16/fp16 storage,
//                    D in {32, 64}; 4 warps x 16 rows = 64-row tiles; B operands that need a transpose
//                    come through ldmatrix.trans (no transposed copies); P and dS are rounded to the
//                    storage type before their matmuls (as FlashAttention does).
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
#define ATT_PAD 8  // row padding (16 bytes) of shared tiles: conflict-free fragment loads

// B fragment (k16 x n8) of a row-major [k][n] tile in shared memory, transposed by ldmatrix:
// lanes 0-15 give the addresses of rows k0 .. k0+15 at column n0 (16-byte aligned rows).
__device__ __forceinline__ void ldsm_x2_trans(unsigned& b0, unsigned& b1, const u16* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(b0), "=r"(b1) : "r"(a));
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

// c[j] = A (16 rows, KS k16 slices) x X[8j .. 8j+7]^T for the 8 n8 column tiles of a 64-row
// shared tile X: one row of scores (or of dP) per 64 keys / queries.
template <bool BF, int D>
__device__ __forceinline__ void tile_products(float (&c)[8][4], const unsigned (*a)[4], const u16 (*X)[D + ATT_PAD],
                                              int g, int t4) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const unsigned b0 = *reinterpret_cast<const unsigned*>(&X[j * 8 + g][kk * 16 + 2 * t4]);
            const unsigned b1 = *reinterpret_cast<const unsigned*>(&X[j * 8 + g][kk * 16 + 8 + 2 * t4]);
            mma16816<BF>(c[j], a[kk], b0, b1);
        }
    }
}

// The A fragment of k16 slice kk made of C tiles 2kk and 2kk+1, rounded to the storage type.
template <bool BF>
__device__ __forceinline__ void c_to_afrag(const float (&c)[8][4], int kk, unsigned (&a)[4]) {
    a[0] = pack2<BF>(c[2 * kk][0], c[2 * kk][1]);
    a[1] = pack2<BF>(c[2 * kk][2], c[2 * kk][3]);
    a[2] = pack2<BF>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = pack2<BF>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// Two neighbouring outputs (a, b) * scale added to (accumulate) or written over *p.
template <bool BF>
__device__ __forceinline__ void store_pair(u16* p, float a, float b, float scale, int accumulate) {
    unsigned* q = reinterpret_cast<unsigned*>(p);
    const unsigned old = accumulate ? *q : 0u;
    *q = pack2<BF>(lo_f<BF>(old) + a * scale, hi_f<BF>(old) + b * scale);
}

// Start the copy of key/value tile kt (rows kt*64 ..) into buffer kt & 1.
template <int D>
__device__ __forceinline__ void issue_kv(const u16* k, const u16* v, long long rb, int kt, int Tn, int ld,
                                         u16 (*Ks2)[64][D + ATT_PAD], u16 (*Vs2)[64][D + ATT_PAD]) {
    async_tile<D>(k, rb, kt * 64, Tn, ld, Ks2[kt & 1]);
    async_tile<D>(v, rb, kt * 64, Tn, ld, Vs2[kt & 1]);
    cp_async_commit();
}

// Before tile kt is used: put tile kt+1 in flight (if any) and wait for tile kt.
template <int D>
__device__ __forceinline__ void next_kv(const u16* k, const u16* v, long long rb, int kt, int nkt, int Tn, int ld,
                                        u16 (*Ks2)[64][D + ATT_PAD], u16 (*Vs2)[64][D + ATT_PAD]) {
    if (kt + 1 < nkt) {
        issue_kv<D>(k, v, rb, kt + 1, Tn, ld, Ks2, Vs2);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    __syncthreads();
}


template <bool BF, int D>
__device__ void attn_fwd_mma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                             int ld, u16* __restrict__ y, int ldy, float* __restrict__ lse2, int Tn, int H,
                             float sl2) {
    constexpr int KS = D / 16, ND = D / 8;
    __shared__ __align__(16) u16 Ks2[2][64][D + ATT_PAD];   // double-buffered: tile kt+1 is in flight
    __shared__ __align__(16) u16 Vs2[2][64][D + ATT_PAD];   // while tile kt is used
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;  // longest rows first
    const long long rb = (long long)b * Tn;
    const int r0 = qt * 64 + warp * 16 + g, r1 = r0 + 8;
    issue_kv<D>(k + h * D, v + h * D, rb, 0, Tn, ld, Ks2, Vs2);
    unsigned qa[KS][4];
    load_afrag<D>(q + h * D, rb, r0, r1, Tn, ld, t4, qa);
    float o[ND][4];
    zero_frags<ND>(o);
    float m0 = -ANDREA_INF, m1 = -ANDREA_INF, l0 = 0.0f, l1 = 0.0f;
    const int last = min(Tn, qt * 64 + 64) - 1;
    const int nkt = last / 64 + 1;
    for (int kt = 0; kt < nkt; ++kt) {
        next_kv<D>(k + h * D, v + h * D, rb, kt, nkt, Tn, ld, Ks2, Vs2);
        u16(*Ks)[D + ATT_PAD] = Ks2[kt & 1];
        u16(*Vs)[D + ATT_PAD] = Vs2[kt & 1];
        float s[8][4];
        tile_products<BF, D>(s, qa, Ks, g, t4);
        float mx0 = -ANDREA_INF, mx1 = -ANDREA_INF;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = kt * 64 + j * 8 + 2 * t4 + (e & 1);
                const int row = e < 2 ? r0 : r1;
                s[j][e] = (key <= row && key < Tn) ? s[j][e] * sl2 : -ANDREA_INF;
            }
            mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
            mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        const float z0 = (n0 == -ANDREA_INF) ? 0.0f : n0, z1 = (n1 == -ANDREA_INF) ? 0.0f : n1;
        const float c0 = exp2f(m0 - z0), c1 = exp2f(m1 - z1);
        m0 = n0; m1 = n1;
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            s[j][0] = exp2f(s[j][0] - z0); s[j][1] = exp2f(s[j][1] - z0);
            s[j][2] = exp2f(s[j][2] - z1); s[j][3] = exp2f(s[j][3] - z1);
            ps0 += s[j][0] + s[j][1];
            ps1 += s[j][2] + s[j][3];
        }
        l0 = l0 * c0 + ps0;
        l1 = l1 * c1 + ps1;
#pragma unroll
        for (int n = 0; n < ND; ++n) { o[n][0] *= c0; o[n][1] *= c0; o[n][2] *= c1; o[n][3] *= c1; }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            unsigned pa[4];
            c_to_afrag<BF>(s, kk, pa);
#pragma unroll
            for (int n = 0; n < ND; ++n) {
                unsigned b0, b1;
                ldsm_x2_trans(b0, b1, &Vs[kk * 16 + (lane & 15)][n * 8]);
                mma16816<BF>(o[n], pa, b0, b1);
            }
        }
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float i0 = 1.0f / l0, i1 = 1.0f / l1;
#pragma unroll
    for (int n = 0; n < ND; ++n) {
        const int c = h * D + n * 8 + 2 * t4;
        if (r0 < Tn) *reinterpret_cast<unsigned*>(y + (rb + r0) * ldy + c) = pack2<BF>(o[n][0] * i0, o[n][1] * i0);
        if (r1 < Tn) *reinterpret_cast<unsigned*>(y + (rb + r1) * ldy + c) = pack2<BF>(o[n][2] * i1, o[n][3] * i1);
    }
    if (t4 == 0) {
        if (r0 < Tn) lse2[(long long)bh * Tn + r0] = m0 + log2f(l0);
        if (r1 < Tn) lse2[(long long)bh * Tn + r1] = m1 + log2f(l1);
    }
}

template <bool BF, int D>
__device__ void attn_bwd_dq_mma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                                int ld, const u16* __restrict__ dy, int ldy, const float* __restrict__ lse2,
                                const float* __restrict__ dvec, u16* __restrict__ dq, int Tn, int H, float sl2,
                                float scale, int accumulate) {
    constexpr int KS = D / 16, ND = D / 8;
    __shared__ __align__(16) u16 Ks2[2][64][D + ATT_PAD];
    __shared__ __align__(16) u16 Vs2[2][64][D + ATT_PAD];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;  // longest rows first
    const long long rb = (long long)b * Tn;
    const int r0 = qt * 64 + warp * 16 + g, r1 = r0 + 8;
    issue_kv<D>(k + h * D, v + h * D, rb, 0, Tn, ld, Ks2, Vs2);
    unsigned qa[KS][4], da[KS][4];
    load_afrag<D>(q + h * D, rb, r0, r1, Tn, ld, t4, qa);
    load_afrag<D>(dy + h * D, rb, r0, r1, Tn, ldy, t4, da);
    const float L0 = r0 < Tn ? lse2[(long long)bh * Tn + r0] : 0.0f;
    const float L1 = r1 < Tn ? lse2[(long long)bh * Tn + r1] : 0.0f;
    const float E0 = r0 < Tn ? dvec[(long long)bh * Tn + r0] : 0.0f;
    const float E1 = r1 < Tn ? dvec[(long long)bh * Tn + r1] : 0.0f;
    float acc[ND][4];
    zero_frags<ND>(acc);
    const int last = min(Tn, qt * 64 + 64) - 1;
    const int nkt = last / 64 + 1;
    for (int kt = 0; kt < nkt; ++kt) {
        next_kv<D>(k + h * D, v + h * D, rb, kt, nkt, Tn, ld, Ks2, Vs2);
        u16(*Ks)[D + ATT_PAD] = Ks2[kt & 1];
        u16(*Vs)[D + ATT_PAD] = Vs2[kt & 1];
        float s[8][4], dp[8][4];
        tile_products<BF, D>(s, qa, Ks, g, t4);
        tile_products<BF, D>(dp, da, Vs, g, t4);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = kt * 64 + j * 8 + 2 * t4 + (e & 1);
                const int row = e < 2 ? r0 : r1;
                const float p = (key <= row && key < Tn) ? exp2f(s[j][e] * sl2 - (e < 2 ? L0 : L1)) : 0.0f;
                s[j][e] = p * (dp[j][e] - (e < 2 ? E0 : E1));  // dS
            }
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            unsigned pa[4];
            c_to_afrag<BF>(s, kk, pa);
#pragma unroll
            for (int n = 0; n < ND; ++n) {
                unsigned b0, b1;
                ldsm_x2_trans(b0, b1, &Ks[kk * 16 + (lane & 15)][n * 8]);
                mma16816<BF>(acc[n], pa, b0, b1);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int n = 0; n < ND; ++n) {
        const int c = h * D + n * 8 + 2 * t4;
        if (r0 < Tn) store_pair<BF>(dq + (rb + r0) * ld + c, acc[n][0], acc[n][1], scale, accumulate);
        if (r1 < Tn) store_pair<BF>(dq + (rb + r1) * ld + c, acc[n][2], acc[n][3], scale, accumulate);
    }
}

template <bool BF, int D>
__device__ void attn_bwd_dkv_mma(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
                                 int ld, const u16* __restrict__ dy, int ldy, const float* __restrict__ lse2,
                                 const float* __restrict__ dvec, u16* __restrict__ dk, u16* __restrict__ dv, int Tn,
                                 int H, float sl2, float scale, int accumulate) {
    constexpr int KS = D / 16, ND = D / 8;
    __shared__ __align__(16) u16 Qs2[2][64][D + ATT_PAD];
    __shared__ __align__(16) u16 Os2[2][64][D + ATT_PAD];
    __shared__ float Ls2[2][64];
    __shared__ float Es2[2][64];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int kt = blockIdx.x, bh = blockIdx.y, b = bh / H, h = bh % H;
    const long long rb = (long long)b * Tn;
    const int k0 = kt * 64 + warp * 16 + g, k1 = k0 + 8;
    unsigned ka[KS][4], va[KS][4];
    load_afrag<D>(k + h * D, rb, k0, k1, Tn, ld, t4, ka);
    load_afrag<D>(v + h * D, rb, k0, k1, Tn, ld, t4, va);
    float dka[ND][4], dva[ND][4];
    zero_frags<ND>(dka);
    zero_frags<ND>(dva);
    const int ntiles = (Tn + 63) / 64;
    auto issue = [&](int qt) {
        const int bf = qt & 1;
        async_tile<D>(q + h * D, rb, qt * 64, Tn, ld, Qs2[bf]);
        async_tile<D>(dy + h * D, rb, qt * 64, Tn, ldy, Os2[bf]);
        cp_async_commit();
        if (tid < 64) {
            const int qq = qt * 64 + tid;
            Ls2[bf][tid] = qq < Tn ? lse2[(long long)bh * Tn + qq] : 0.0f;
            Es2[bf][tid] = qq < Tn ? dvec[(long long)bh * Tn + qq] : 0.0f;
        }
    };
    issue(kt);
    for (int qt = kt; qt < ntiles; ++qt) {
        if (qt + 1 < ntiles) {
            issue(qt + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        u16(*Qs)[D + ATT_PAD] = Qs2[qt & 1];
        u16(*Os)[D + ATT_PAD] = Os2[qt & 1];
        const float* Ls = Ls2[qt & 1];
        const float* Es = Es2[qt & 1];
        float s[8][4], dp[8][4];
        tile_products<BF, D>(s, ka, Qs, g, t4);
        tile_products<BF, D>(dp, va, Os, g, t4);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int ql = j * 8 + 2 * t4 + (e & 1);
                const int qq = qt * 64 + ql;
                const int key = e < 2 ? k0 : k1;
                const float p = (qq >= key && qq < Tn) ? exp2f(s[j][e] * sl2 - Ls[ql]) : 0.0f;
                s[j][e] = p;                        // P^T
                dp[j][e] = p * (dp[j][e] - Es[ql]);  // dS^T
            }
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            unsigned pa[4], sa[4];
            c_to_afrag<BF>(s, kk, pa);
            c_to_afrag<BF>(dp, kk, sa);
#pragma unroll
            for (int n = 0; n < ND; ++n) {
                unsigned b0, b1, c0, c1;
                ldsm_x2_trans(b0, b1, &Os[kk * 16 + (lane & 15)][n * 8]);
                mma16816<BF>(dva[n], pa, b0, b1);
                ldsm_x2_trans(c0, c1, &Qs[kk * 16 + (lane & 15)][n * 8]);
                mma16816<BF>(dka[n], sa, c0, c1);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int n = 0; n < ND; ++n) {
        const int c = h * D + n * 8 + 2 * t4;
        if (k0 < Tn) {
            store_pair<BF>(dk + (rb + k0) * ld + c, dka[n][0], dka[n][1], scale, accumulate);
            store_pair<BF>(dv + (rb + k0) * ld + c, dva[n][0], dva[n][1], 1.0f, accumulate);
        }
        if (k1 < Tn) {
            store_pair<BF>(dk + (rb + k1) * ld + c, dka[n][2], dka[n][3], scale, accumulate);
            store_pair<BF>(dv + (rb + k1) * ld + c, dva[n][2], dva[n][3], 1.0f, accumulate);
        }
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

ATTN_SIMT_ALL(f32, float)
ATTN_SIMT_ALL(bf16, bf16_t)
ATTN_SIMT_ALL(f16, f16_t)

#define ATTN_MMA_INST(SUF, BF, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(128) k_attn_fwd_mma_##SUF##_d##D(                           \
        const u16* q, const u16* k, const u16* v, int ld, u16* y, int ldy, float* lse2, int Tn, int H,       \
        float sl2) {                                                                                         \
        attn_fwd_mma<BF, D>(q, k, v, ld, y, ldy, lse2, Tn, H, sl2);                                          \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) k_attn_bwd_dq_mma_##SUF##_d##D(                        \
        const u16* q, const u16* k, const u16* v, int ld, const u16* dy, int ldy, const float* lse2,         \
        const float* dvec, u16* dq, int Tn, int H, float sl2, float scale, int accumulate) {                 \
        attn_bwd_dq_mma<BF, D>(q, k, v, ld, dy, ldy, lse2, dvec, dq, Tn, H, sl2, scale, accumulate);         \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(128) k_attn_bwd_dkv_mma_##SUF##_d##D(                       \
        const u16* q, const u16* k, const u16* v, int ld, const u16* dy, int ldy, const float* lse2,         \
        const float* dvec, u16* dk, u16* dv, int Tn, int H, float sl2, float scale, int accumulate) {        \
        attn_bwd_dkv_mma<BF, D>(q, k, v, ld, dy, ldy, lse2, dvec, dk, dv, Tn, H, sl2, scale, accumulate);    \
    }

ATTN_MMA_INST(bf16, true, 32)
ATTN_MMA_INST(bf16, true, 64)
ATTN_MMA_INST(f16, false, 32)
ATTN_MMA_INST(f16, false, 64)
