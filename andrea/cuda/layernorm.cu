// layernorm.cu: LayerNorm over the last axis, forward and backward (the `layernorm` op pair).
//
// k_layernorm_fwd_<t>:  x (N, C) fp32 -> y (N, C) in storage type t; saves mean, rstd (N,) fp32.
//                        One warp per row; two passes over the row (mean, then variance).
// k_layernorm_bwd_<t>:  dx (N, C) fp32 += d/dx; one warp per row.
// k_layernorm_bwd_wpart_<t>: per-column partial sums of dy*xhat and dy over a chunk of rows:
//                        part (n_chunks, 2, C). Thread per column, rows in order.
// k_layernorm_bwd_wsum: dw[c] += sum over chunks in order; db likewise. No atomics anywhere.

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
