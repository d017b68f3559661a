// layernorm.cu: LayerNorm over the last axis, forward and backward (the `layernorm` op pair), and
// the residual add fused with the LayerNorm that reads its sum (`residual_layernorm_forward`).
//
// k_layernorm_fwd_<t>:  x (N, C) fp32 -> y (N, C) in storage type t; saves mean, rstd (N,) fp32.
//                        One warp per row; two passes over the row (mean, then variance).
// k_layernorm_bwd_<t>:  dx (N, C) fp32 += d/dx; one warp per row.
// k_layernorm_bwd_wpart_<t>: per-column partial sums of dy*xhat and dy over a chunk of rows:
//                        part (n_chunks, 2, C). Thread per column, rows in order.
// k_layernorm_bwd_wsum: dw[c] += the n_chunks partials of column c, db likewise: a block of 32 x 32
//                        threads per 32 columns, thread row ty adding chunks ty, ty + 32, ... in order,
//                        then the 32 sums added in ty order (shared memory). No atomics anywhere.
//
// Vectorized versions (C % 4 == 0, C <= 4 * 32 * R * V, 16-byte aligned rows; kernels.py picks V, R):
// k_layernorm_fwd4_<t>_v<V>: one warp per row, float4 loads, the row kept in registers (one read).
// k_residual_layernorm_fwd4_<t>_v<V>: xo = a + br (fp32 = fp32 + t, written), then the forward of xo
//                        from the same registers: the sum is never read back.
// k_layernorm_bwd4_<t>_v<V>_r<R>: dx and the per-column partials in one kernel, each row read once:
//                        a block of 8 warps owns a chunk of rows; R warps share a row (lane l of warp
//                        s of a group owns float4 columns k * 32 R + 32 s + l, k < V; the R warp sums
//                        of a row are added in warp order through shared memory); x, dy and dx of the
//                        row stay in registers between the row sums and the dx update; each lane keeps
//                        its columns' partial sums in registers, and the 8 / R groups' partials are
//                        added in group order through shared memory -> part (n_chunks, 2, C), then
//                        k_layernorm_bwd_wsum. With dlow != 0 it also writes dlow (N, C) t = the
//                        updated dx (the `residual_add_backward` cast of the branch gradient).

template <typename T>
__device__ void layernorm_fwd(const float* __restrict__ x, const float* __restrict__ w,
                              const float* __restrict__ b, T* __restrict__ y, float* __restrict__ mean,
                              float* __restrict__ rstd, int N, int C, float eps) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const float* xr = x + (long long)row * C;
    float s = 0.0f;
    for (int c = lane; c < C; c += 32) s += xr[c];
    const float mu = warp_sum(s) / C;
    float s2 = 0.0f;
    for (int c = lane; c < C; c += 32) { const float d = xr[c] - mu; s2 += d * d; }
    const float rs = rsqrtf(warp_sum(s2) / C + eps);
    T* yr = y + (long long)row * C;
    for (int c = lane; c < C; c += 32) yr[c] = from_f<T>((xr[c] - mu) * rs * w[c] + b[c]);
    if (lane == 0) { mean[row] = mu; rstd[row] = rs; }
}

template <typename T>
__device__ void layernorm_bwd(const float* __restrict__ x, const float* __restrict__ w,
                              const float* __restrict__ mean, const float* __restrict__ rstd,
                              const T* __restrict__ dy, float* __restrict__ dx, int N, int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const float* xr = x + (long long)row * C;
    const T* dyr = dy + (long long)row * C;
    const float mu = mean[row], rs = rstd[row];
    float a = 0.0f, bsum = 0.0f;
    for (int c = lane; c < C; c += 32) {
        const float xh = (xr[c] - mu) * rs;
        const float g = to_f(dyr[c]) * w[c];
        a += g;
        bsum += g * xh;
    }
    const float mg = warp_sum(a) / C, mgx = warp_sum(bsum) / C;
    float* dxr = dx + (long long)row * C;
    for (int c = lane; c < C; c += 32) {
        const float xh = (xr[c] - mu) * rs;
        const float g = to_f(dyr[c]) * w[c];
        dxr[c] += rs * (g - mg - xh * mgx);
    }
}

template <typename T>
__device__ void layernorm_bwd_wpart(const float* __restrict__ x, const float* __restrict__ mean,
                                    const float* __restrict__ rstd, const T* __restrict__ dy,
                                    float* __restrict__ part, int N, int C, int rows_per_chunk) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int chunk = blockIdx.y;
    if (c >= C) return;
    const int r0 = chunk * rows_per_chunk;
    const int r1 = min(N, r0 + rows_per_chunk);
    float sw = 0.0f, sb = 0.0f;
    for (int r = r0; r < r1; ++r) {
        const float d = to_f(dy[(long long)r * C + c]);
        sw += d * (x[(long long)r * C + c] - mean[r]) * rstd[r];
        sb += d;
    }
    part[((long long)chunk * 2) * C + c] = sw;
    part[((long long)chunk * 2 + 1) * C + c] = sb;
}

extern "C" __global__ void __launch_bounds__(1024) k_layernorm_bwd_wsum(const float* __restrict__ part,
                                                                       float* __restrict__ dw,
                                                                       float* __restrict__ db, int n_chunks,
                                                                       int C) {
    __shared__ float s[2][32][33];                     // blockDim (32, 32): column tx, chunk stripe ty
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int c = blockIdx.x * 32 + tx;
    float sw = 0.0f, sb = 0.0f;
    if (c < C) {
#pragma unroll 8                                       // 8 chunks' loads in flight; the adds stay in order
        for (int k = ty; k < n_chunks; k += 32) {
            sw += part[((long long)k * 2) * C + c];
            sb += part[((long long)k * 2 + 1) * C + c];
        }
    }
    s[0][ty][tx] = sw;
    s[1][ty][tx] = sb;
    __syncthreads();
    if (ty < 2 && c < C) {                             // warp 0 sums dw's stripes, warp 1 db's, in order
        float t = 0.0f;
#pragma unroll 8
        for (int q = 0; q < 32; ++q) t += s[ty][q][tx];
        if (ty == 0) dw[c] += t; else db[c] += t;
    }
}

#define LN_INST(SUF, T)                                                                               \
    extern "C" __global__ void k_layernorm_fwd_##SUF(const float* x, const float* w, const float* b,   \
                                                     T* y, float* mean, float* rstd, int N, int C,     \
                                                     float eps) {                                      \
        layernorm_fwd<T>(x, w, b, y, mean, rstd, N, C, eps);                                           \
    }                                                                                                  \
    extern "C" __global__ void k_layernorm_bwd_##SUF(const float* x, const float* w, const float* mean, \
                                                     const float* rstd, const T* dy, float* dx, int N, \
                                                     int C) {                                          \
        layernorm_bwd<T>(x, w, mean, rstd, dy, dx, N, C);                                              \
    }                                                                                                  \
    extern "C" __global__ void k_layernorm_bwd_wpart_##SUF(const float* x, const float* mean,          \
                                                           const float* rstd, const T* dy, float* part, \
                                                           int N, int C, int rows_per_chunk) {         \
        layernorm_bwd_wpart<T>(x, mean, rstd, dy, part, N, C, rows_per_chunk);                         \
    }

LN_INST(f32, float)
LN_INST(bf16, bf16_t)
LN_INST(f16, f16_t)

// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
template <typename T>
__device__ __forceinline__ float4 load4(const T* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    T a, b, c, d;
    a.x = (unsigned short)(u.x & 0xffffu); b.x = (unsigned short)(u.x >> 16);
    c.x = (unsigned short)(u.y & 0xffffu); d.x = (unsigned short)(u.y >> 16);
    return make_float4(to_f(a), to_f(b), to_f(c), to_f(d));
}
__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
template <typename T>
__device__ __forceinline__ void store4(T* p, float4 v) {
    uint2 u;
    u.x = (unsigned)from_f<T>(v.x).x | ((unsigned)from_f<T>(v.y).x << 16);
    u.y = (unsigned)from_f<T>(v.z).x | ((unsigned)from_f<T>(v.w).x << 16);
    *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ float4 add4(float4 a, float4 b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }
// The forward's store: a storage type (store4), or E4M3 bytes at scale s (the fp8 forwards below: the bf16
// value the bf16 kernel stores, cast as fp8.cu's k_fp8_cast_bf16 casts it; m the running max |bf16 value|).
template <typename T>
__device__ __forceinline__ void put4(T* p, float4 v, float, float&) { store4(p, v); }
__device__ __forceinline__ void put4(unsigned char* p, float4 v, float s, float& m) {
    const unsigned a = from_f<bf16_t>(v.x).x, b = from_f<bf16_t>(v.y).x, c = from_f<bf16_t>(v.z).x,
                   d = from_f<bf16_t>(v.w).x;
    m = fmaxf(m, fmaxf(fmaxf(bf16_absf(a), bf16_absf(b)), fmaxf(bf16_absf(c), bf16_absf(d))));
    *reinterpret_cast<unsigned*>(p) = fp8_pair(a, b, s) | (fp8_pair(c, d, s) << 16);
}

// The forward of one row held in registers (xv: lane's float4 columns k * 32 + lane), one warp; Y
// unsigned char: E4M3 out at scale s (put4), m the lane's running max |bf16 value|.
template <typename T, int V, typename Y>
__device__ __forceinline__ void layernorm_row4(const float4* xv, const float* __restrict__ w,
                                               const float* __restrict__ b, Y* __restrict__ yr, float* mean,
                                               float* rstd, int row, int C, float eps, float sc, float& m) {
    const int lane = threadIdx.x & 31, C4 = C >> 2;
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < V; ++k) s += (xv[k].x + xv[k].y) + (xv[k].z + xv[k].w);
    const float mu = warp_sum(s) / C;
    float s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < V; ++k) {
        if (k * 32 + lane < C4) {
            const float a = xv[k].x - mu, bb = xv[k].y - mu, c = xv[k].z - mu, d = xv[k].w - mu;
            s2 += (a * a + bb * bb) + (c * c + d * d);
        }
    }
    const float rs = rsqrtf(warp_sum(s2) / C + eps);
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const int c4 = k * 32 + lane;
        if (c4 < C4) {
            const float4 w4 = load4(w + 4 * c4), b4 = load4(b + 4 * c4);
            put4(yr + 4 * c4, make_float4((xv[k].x - mu) * rs * w4.x + b4.x, (xv[k].y - mu) * rs * w4.y + b4.y,
                                          (xv[k].z - mu) * rs * w4.z + b4.z, (xv[k].w - mu) * rs * w4.w + b4.w), sc, m);
        }
    }
    if (lane == 0) { mean[row] = mu; rstd[row] = rs; }
}

// Y unsigned char (the _e4m3 kernels): y is E4M3 at scale *sc, and the block's max |bf16 value| is
// atomicMax-ed into *rec; N a multiple of 8 (the launcher's check: every warp of a block has a row).
template <typename T, int V, typename Y>
__device__ __forceinline__ void fwd4_amax(float m, float* __restrict__ rec) {
    if constexpr (sizeof(Y) == 1) {
        __shared__ float buf[32];
        m = block_max(m, buf);
        if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(rec), __float_as_int(m));
    }
}

template <typename T, int V, typename Y = T>
__device__ void layernorm_fwd4(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                               Y* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd, int N, int C,
                               float eps, const float* __restrict__ sc = nullptr, float* __restrict__ rec = nullptr) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const int C4 = C >> 2;
    const float* xr = x + (long long)row * C;
    float4 xv[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const int c4 = k * 32 + lane;
        xv[k] = c4 < C4 ? load4(xr + 4 * c4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float m = 0.0f;
    layernorm_row4<T, V, Y>(xv, w, b, y + (long long)row * C, mean, rstd, row, C, eps, sizeof(Y) == 1 ? sc[0] : 1.0f, m);
    fwd4_amax<T, V, Y>(m, rec);
}

template <typename T, int V, typename Y = T>
__device__ void residual_layernorm_fwd4(const float* __restrict__ a, const T* __restrict__ br,
                                        float* __restrict__ xo, const float* __restrict__ w,
                                        const float* __restrict__ b, Y* __restrict__ y, float* __restrict__ mean,
                                        float* __restrict__ rstd, int N, int C, float eps,
                                        const float* __restrict__ sc = nullptr, float* __restrict__ rec = nullptr) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const int C4 = C >> 2;
    const long long o = (long long)row * C;
    float4 xv[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const int c4 = k * 32 + lane;
        xv[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (c4 < C4) {
            xv[k] = add4(load4(a + o + 4 * c4), load4(br + o + 4 * c4));
            store4(xo + o + 4 * c4, xv[k]);
        }
    }
    float m = 0.0f;
    layernorm_row4<T, V, Y>(xv, w, b, y + o, mean, rstd, row, C, eps, sizeof(Y) == 1 ? sc[0] : 1.0f, m);
    fwd4_amax<T, V, Y>(m, rec);
}

// Y unsigned char (the _e4m3 kernels, fp8.LNB_E4M3): dlow is E4M3 at scale *sc (bf16 rounding first, as
// put4 does) and the block's max |bf16 value| is atomicMax-ed into *rec.
template <typename T, int V, int R, typename Y = T>
__device__ void layernorm_bwd4(const float* __restrict__ x, const float* __restrict__ w,
                               const float* __restrict__ mean, const float* __restrict__ rstd,
                               const T* __restrict__ dy, float* __restrict__ dx, Y* __restrict__ dlow,
                               float* __restrict__ part, int N, int C, int rows_per_chunk,
                               const float* __restrict__ sc = nullptr, float* __restrict__ rec = nullptr) {
    constexpr int NW = 8, G = NW / R;                   // blockDim.x == 256: 8 warps, G rows at a time
    __shared__ __align__(16) float red[G][V * 128 * R];
    __shared__ float rsum[2][2][NW];                    // [iteration parity][a, bs][warp]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = warp / R, gl = (warp % R) * 32 + lane;
    const int C4 = C >> 2;
    float4 pw[V], pb[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
        pw[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        pb[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    const int r0 = blockIdx.x * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    const float s8 = sizeof(Y) == 1 ? sc[0] : 1.0f;
    float m8 = 0.0f;                                    // E4M3: the thread's max |bf16 value| of dlow
    int it = 0;
    for (int rb = r0; rb < r0 + rows_per_chunk; rb += G, ++it) {   // the same trip count in every warp
        const int r = rb + grp;
        const bool live = r < r1;
        const float mu = live ? mean[r] : 0.0f, rs = live ? rstd[r] : 0.0f;
        const long long ro = (long long)(live ? r : 0) * C;
        float4 xv[V], dv[V], ov[V];
        float a = 0.0f, bs = 0.0f;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int c4 = k * 32 * R + gl;
            if (live && c4 < C4) {
                xv[k] = load4(x + ro + 4 * c4);
                dv[k] = load4(dy + ro + 4 * c4);
                ov[k] = load4(dx + ro + 4 * c4);
            }
        }
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int c4 = k * 32 * R + gl;
            if (live && c4 < C4) {
                const float4 w4 = load4(w + 4 * c4), x4 = xv[k], d4 = dv[k];
                const float h0 = (x4.x - mu) * rs, h1 = (x4.y - mu) * rs, h2 = (x4.z - mu) * rs, h3 = (x4.w - mu) * rs;
                const float g0 = d4.x * w4.x, g1 = d4.y * w4.y, g2 = d4.z * w4.z, g3 = d4.w * w4.w;
                a += (g0 + g1) + (g2 + g3);
                bs += (g0 * h0 + g1 * h1) + (g2 * h2 + g3 * h3);
                pw[k].x += d4.x * h0; pw[k].y += d4.y * h1; pw[k].z += d4.z * h2; pw[k].w += d4.w * h3;
                pb[k].x += d4.x; pb[k].y += d4.y; pb[k].z += d4.z; pb[k].w += d4.w;
            }
        }
        a = warp_sum(a);
        bs = warp_sum(bs);
        if constexpr (R > 1) {                          // the row's R warp sums, in warp order
            if (lane == 0) { rsum[it & 1][0][warp] = a; rsum[it & 1][1][warp] = bs; }
            __syncthreads();
            a = 0.0f; bs = 0.0f;
#pragma unroll
            for (int q = 0; q < R; ++q) { a += rsum[it & 1][0][grp * R + q]; bs += rsum[it & 1][1][grp * R + q]; }
        }
        const float mg = a / C, mgx = bs / C;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int c4 = k * 32 * R + gl;
            if (live && c4 < C4) {
                const float4 w4 = load4(w + 4 * c4), x4 = xv[k], d4 = dv[k];
                float4 o = ov[k];
                o.x += rs * (d4.x * w4.x - mg - (x4.x - mu) * rs * mgx);
                o.y += rs * (d4.y * w4.y - mg - (x4.y - mu) * rs * mgx);
                o.z += rs * (d4.z * w4.z - mg - (x4.z - mu) * rs * mgx);
                o.w += rs * (d4.w * w4.w - mg - (x4.w - mu) * rs * mgx);
                store4(dx + ro + 4 * c4, o);
                if (dlow != nullptr) put4(dlow + ro + 4 * c4, o, s8, m8);
            }
        }
    }
    // partials of this chunk: row groups in order, through shared memory (dw first, then db)
#pragma unroll
    for (int which = 0; which < 2; ++which) {
        __syncthreads();                                // rsum / the dw partials are no longer read
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int c4 = k * 32 * R + gl;
            store4(&red[grp][4 * c4], which ? pb[k] : pw[k]);
        }
        __syncthreads();
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float t = 0.0f;
#pragma unroll
            for (int q = 0; q < G; ++q) t += red[q][c];
            part[((long long)blockIdx.x * 2 + which) * C + c] = t;
        }
    }
    fwd4_amax<T, V, Y>(m8, rec);
}

#define LNF_INST(SUF, T, V)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) k_layernorm_fwd4_##SUF##_v##V(                         \
        const float* x, const float* w, const float* b, T* y, float* mean, float* rstd, int N, int C,        \
        float eps) {                                                                                         \
        layernorm_fwd4<T, V>(x, w, b, y, mean, rstd, N, C, eps);                                             \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) k_residual_layernorm_fwd4_##SUF##_v##V(                \
        const float* a, const T* br, float* xo, const float* w, const float* b, T* y, float* mean,           \
        float* rstd, int N, int C, float eps) {                                                              \
        residual_layernorm_fwd4<T, V>(a, br, xo, w, b, y, mean, rstd, N, C, eps);                            \
    }
#define LNB_INST(SUF, T, V, R)                                                                               \
    extern "C" __global__ void __launch_bounds__(256) k_layernorm_bwd4_##SUF##_v##V##_r##R(                  \
        const float* x, const float* w, const float* mean, const float* rstd, const T* dy, float* dx,        \
        T* dlow, float* part, int N, int C, int rows_per_chunk) {                                            \
        layernorm_bwd4<T, V, R>(x, w, mean, rstd, dy, dx, dlow, part, N, C, rows_per_chunk);                 \
    }
// forward: V float4 per lane (C <= 128 V); backward: (V, R) with C <= 128 R V, the choices of kernels.py
// forward: V float4 per lane (C <= 128 V); backward: (V, R) with C <= 128 R V (kernels.ln_bwd_vr picks)
#define LN4_ALL(SUF, T) LNF_INST(SUF, T, 1) LNF_INST(SUF, T, 2) LNF_INST(SUF, T, 3) LNF_INST(SUF, T, 6)          \
    LNF_INST(SUF, T, 12) LNF_INST(SUF, T, 16)                                                               \
    LNB_INST(SUF, T, 1, 1) LNB_INST(SUF, T, 2, 1) LNB_INST(SUF, T, 3, 1) LNB_INST(SUF, T, 6, 1)             \
    LNB_INST(SUF, T, 2, 2) LNB_INST(SUF, T, 3, 2) LNB_INST(SUF, T, 6, 2) LNB_INST(SUF, T, 2, 4)             \
    LNB_INST(SUF, T, 3, 4) LNB_INST(SUF, T, 4, 4) LNB_INST(SUF, T, 2, 8) LNB_INST(SUF, T, 3, 8)

// The fp8 engine's ln1 / ln2 forwards under delayed scaling (andrea/cuda/fp8.py LN_E4M3): bf16 rounding,
// then E4M3 at scale *sc, amax into *rec; the bytes of the bf16 kernel followed by k_fp8_cast_bf16.
#define LNF8_INST(V)                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) k_layernorm_fwd4_e4m3_v##V(                            \
        const float* x, const float* w, const float* b, unsigned char* y, float* mean, float* rstd, int N,   \
        int C, float eps, const float* sc, float* rec) {                                                     \
        layernorm_fwd4<bf16_t, V, unsigned char>(x, w, b, y, mean, rstd, N, C, eps, sc, rec);                \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) k_residual_layernorm_fwd4_e4m3_v##V(                   \
        const float* a, const bf16_t* br, float* xo, const float* w, const float* b, unsigned char* y,       \
        float* mean, float* rstd, int N, int C, float eps, const float* sc, float* rec) {                    \
        residual_layernorm_fwd4<bf16_t, V, unsigned char>(a, br, xo, w, b, y, mean, rstd, N, C, eps, sc, rec); \
    }
LNF8_INST(1) LNF8_INST(2) LNF8_INST(3) LNF8_INST(6) LNF8_INST(12) LNF8_INST(16)
// ... and the residual LayerNorm backwards' branch gradient (fp8.LNB_E4M3): dlow in E4M3 at *sc, amax into
// *rec; the bytes of the bf16 kernel's dlow followed by k_fp8_cast_bf16.
#define LNB8_INST(V, R)                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) k_layernorm_bwd4_e4m3_v##V##_r##R(                     \
        const float* x, const float* w, const float* mean, const float* rstd, const bf16_t* dy, float* dx,   \
        unsigned char* dlow, float* part, int N, int C, int rows_per_chunk, const float* sc, float* rec) {   \
        layernorm_bwd4<bf16_t, V, R, unsigned char>(x, w, mean, rstd, dy, dx, dlow, part, N, C,              \
                                                    rows_per_chunk, sc, rec);                                \
    }
LNB8_INST(1, 1) LNB8_INST(2, 1) LNB8_INST(3, 1) LNB8_INST(6, 1) LNB8_INST(2, 2) LNB8_INST(3, 2) LNB8_INST(6, 2)
LNB8_INST(2, 4) LNB8_INST(3, 4) LNB8_INST(4, 4) LNB8_INST(2, 8) LNB8_INST(3, 8)

LN4_ALL(f32, float)
LN4_ALL(bf16, bf16_t)
LN4_ALL(f16, f16_t)
