// layernorm.cu: LayerNorm over the last axis, forward and backward (the `layernorm` op pair).
//
// k_layernorm_fwd_<t>:  x (N, C) fp32 -> y (N, C) in storage type t; saves mean, rstd (N,) fp32.
//                        One warp per row; two passes over the row (mean, then variance).
// k_layernorm_bwd_<t>:  dx (N, C) fp32 += d/dx; one warp per row.
// k_layernorm_bwd_wpart_<t>: per-column partial sums of dy*xhat and dy over a chunk of rows:
//                        part (n_chunks, 2, C). Thread per column, rows in order.
// k_layernorm_bwd_wsum: dw[c] += sum over chunks in order; db likewise. No atomics anywhere.
//
// Vectorized versions (C % 4 == 0, C <= 128 V, 16-byte aligned rows; kernels.py picks them):
// k_layernorm_fwd4_<t>_v<V>: one warp per row, float4 loads, the row kept in registers (one read).
// k_layernorm_bwd4_<t>_v<V>: dx and the per-column partials in one kernel: a block of 8 warps owns
//                        a chunk of rows (warp w takes rows w, w+8, ...), each lane keeps its columns'
//                        partial sums in registers, and the 8 warps' partials are added in warp order
//                        through shared memory -> part (n_chunks, 2, C), then k_layernorm_bwd_wsum.

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

extern "C" __global__ void k_layernorm_bwd_wsum(const float* __restrict__ part, float* __restrict__ dw,
                                                float* __restrict__ db, int n_chunks, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float sw = 0.0f, sb = 0.0f;
    for (int k = 0; k < n_chunks; ++k) {
        sw += part[((long long)k * 2) * C + c];
        sb += part[((long long)k * 2 + 1) * C + c];
    }
    dw[c] += sw;
    db[c] += sb;
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

template <typename T, int V>
__device__ void layernorm_fwd4(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                               T* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd, int N, int C,
                               float eps) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const int C4 = C >> 2;
    const float* xr = x + (long long)row * C;
    float4 xv[V];
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const int c4 = k * 32 + lane;
        xv[k] = c4 < C4 ? load4(xr + 4 * c4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        s += (xv[k].x + xv[k].y) + (xv[k].z + xv[k].w);
    }
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
    T* yr = y + (long long)row * C;
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const int c4 = k * 32 + lane;
        if (c4 < C4) {
            const float4 w4 = load4(w + 4 * c4), b4 = load4(b + 4 * c4);
            store4(yr + 4 * c4, make_float4((xv[k].x - mu) * rs * w4.x + b4.x, (xv[k].y - mu) * rs * w4.y + b4.y,
                                            (xv[k].z - mu) * rs * w4.z + b4.z, (xv[k].w - mu) * rs * w4.w + b4.w));
        }
    }
    if (lane == 0) { mean[row] = mu; rstd[row] = rs; }
}

template <typename T, int V>
__device__ void layernorm_bwd4(const float* __restrict__ x, const float* __restrict__ w,
                               const float* __restrict__ mean, const float* __restrict__ rstd,
                               const T* __restrict__ dy, float* __restrict__ dx, float* __restrict__ part, int N,
                               int C, int rows_per_chunk) {
    __shared__ __align__(16) float red[8][V * 128];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;  // blockDim.x == 256
    const int C4 = C >> 2;
    float4 wv[V], pw[V], pb[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const int c4 = k * 32 + lane;
        wv[k] = c4 < C4 ? load4(w + 4 * c4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        pw[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        pb[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    const int r0 = blockIdx.x * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    for (int r = r0 + warp; r < r1; r += 8) {
        const float mu = mean[r], rs = rstd[r];
        const float* xr = x + (long long)r * C;
        const T* dr = dy + (long long)r * C;
        float a = 0.0f, bs = 0.0f;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int c4 = k * 32 + lane;
            if (c4 < C4) {
                const float4 x4 = load4(xr + 4 * c4), d4 = load4(dr + 4 * c4);
                const float h0 = (x4.x - mu) * rs, h1 = (x4.y - mu) * rs, h2 = (x4.z - mu) * rs, h3 = (x4.w - mu) * rs;
                const float g0 = d4.x * wv[k].x, g1 = d4.y * wv[k].y, g2 = d4.z * wv[k].z, g3 = d4.w * wv[k].w;
                a += (g0 + g1) + (g2 + g3);
                bs += (g0 * h0 + g1 * h1) + (g2 * h2 + g3 * h3);
                pw[k].x += d4.x * h0; pw[k].y += d4.y * h1; pw[k].z += d4.z * h2; pw[k].w += d4.w * h3;
                pb[k].x += d4.x; pb[k].y += d4.y; pb[k].z += d4.z; pb[k].w += d4.w;
            }
        }
        const float mg = warp_sum(a) / C, mgx = warp_sum(bs) / C;
        float* dxr = dx + (long long)r * C;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int c4 = k * 32 + lane;
            if (c4 < C4) {
                const float4 x4 = load4(xr + 4 * c4), d4 = load4(dr + 4 * c4);
                float4 o = load4(dxr + 4 * c4);
                o.x += rs * (d4.x * wv[k].x - mg - (x4.x - mu) * rs * mgx);
                o.y += rs * (d4.y * wv[k].y - mg - (x4.y - mu) * rs * mgx);
                o.z += rs * (d4.z * wv[k].z - mg - (x4.z - mu) * rs * mgx);
                o.w += rs * (d4.w * wv[k].w - mg - (x4.w - mu) * rs * mgx);
                store4(dxr + 4 * c4, o);
            }
        }
    }
    // partials of this chunk: warps in order, through shared memory (dw first, then db)
#pragma unroll
    for (int which = 0; which < 2; ++which) {
        if (which) __syncthreads();                     // every thread has read the dw partials
#pragma unroll
        for (int k = 0; k < V; ++k) store4(&red[warp][4 * (k * 32 + lane)], which ? pb[k] : pw[k]);
        __syncthreads();
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float t = 0.0f;
#pragma unroll
            for (int q = 0; q < 8; ++q) t += red[q][c];
            part[((long long)blockIdx.x * 2 + which) * C + c] = t;
        }
    }
}

#define LN4_INST(SUF, T, V)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) k_layernorm_fwd4_##SUF##_v##V(                         \
        const float* x, const float* w, const float* b, T* y, float* mean, float* rstd, int N, int C,        \
        float eps) {                                                                                         \
        layernorm_fwd4<T, V>(x, w, b, y, mean, rstd, N, C, eps);                                             \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) k_layernorm_bwd4_##SUF##_v##V(                         \
        const float* x, const float* w, const float* mean, const float* rstd, const T* dy, float* dx,        \
        float* part, int N, int C, int rows_per_chunk) {                                                     \
        layernorm_bwd4<T, V>(x, w, mean, rstd, dy, dx, part, N, C, rows_per_chunk);                          \
    }
#define LN4_ALL(SUF, T) LN4_INST(SUF, T, 1) LN4_INST(SUF, T, 2) LN4_INST(SUF, T, 3) LN4_INST(SUF, T, 6) \
    LN4_INST(SUF, T, 12)

LN4_ALL(f32, float)
LN4_ALL(bf16, bf16_t)
LN4_ALL(f16, f16_t)

