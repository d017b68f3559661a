// optim.cu: gradient clipping (k_grad_norm_partial, k_grad_norm_final, k_grad_scale) and a fused
// AdamW over the flat fp32 buffers.
//
// Global L2 norm, deterministic in two passes and without atomics:
//   k_grad_norm_partial: G blocks (G fixed by the host), block k sums g[i]^2 over its grid-stride
//                        slice in a fixed order -> partial[k].
//   k_grad_norm_final:   one block sums partial[0..G) in a fixed order and writes
//                        gstate = [norm, scale, finite]: norm = sqrt(sum) * inv_loss_scale,
//                        scale = inv_loss_scale * min(1, clip / (norm + 1e-6)) (clip <= 0: no clipping),
//                        finite = 1 if the norm is finite else 0.
//   k_grad_scale:        g *= gstate[1].
// k_adamw: one thread per parameter; skips everything when gstate[2] == 0 (a NaN/inf step never
// reaches the weights, also inside a replayed CUDA graph). Weight decay per tensor from a segment
// table: seg_end (n_seg,) int64 cumulative ends, seg_decay (n_seg,) fp32 in {0, 1}.
// Optionally writes a low-precision copy of the new weights (bf16/fp16 compute weights).

extern "C" __global__ void k_grad_norm_partial(const float* __restrict__ g, long long n, float* __restrict__ partial) {
    __shared__ float buf[32];
    float s = 0.0f;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float v = g[i];
        s += v * v;
    }
    s = block_sum(s, buf);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

extern "C" __global__ void k_grad_norm_final(const float* __restrict__ partial, int G, float clip,
                                             float inv_loss_scale, float* __restrict__ gstate) {
    __shared__ float buf[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < G; i += blockDim.x) s += partial[i];
    s = block_sum(s, buf);
    if (threadIdx.x == 0) {
        const float norm = sqrtf(s) * inv_loss_scale;
        const bool finite = fabsf(norm) <= 3.402823e38f;  // false for NaN and inf
        float scale = inv_loss_scale;
        if (clip > 0.0f && finite && norm > clip) scale = inv_loss_scale * (clip / (norm + 1e-6f));
        gstate[0] = norm;
        gstate[1] = scale;
        gstate[2] = finite ? 1.0f : 0.0f;
    }
}

extern "C" __global__ void k_grad_scale(float* __restrict__ g, long long n, const float* __restrict__ gstate) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    g[i] *= gstate[1];
}

extern "C" __global__ void k_scale(float* __restrict__ g, long long n, float s) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    g[i] *= s;
}

__device__ __forceinline__ float seg_decay_of(long long i, const long long* __restrict__ seg_end,
                                              const float* __restrict__ seg_decay, int n_seg) {
    int lo = 0, hi = n_seg - 1;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (i < seg_end[mid]) hi = mid; else lo = mid + 1;
    }
    return seg_decay[lo];
}

template <typename T>
__device__ void adamw(float* __restrict__ w, const float* __restrict__ g, float* __restrict__ m,
                      float* __restrict__ v, T* __restrict__ wlow, long long n, float lr, float beta1,
                      float beta2, float eps, float wd, float bc1, float bc2, const float* __restrict__ gstate,
                      const long long* __restrict__ seg_end, const float* __restrict__ seg_decay, int n_seg,
                      int apply_gscale) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (gstate[2] == 0.0f) return;
    float gi = g[i];
    if (apply_gscale) gi *= gstate[1];
    const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float mhat = mi / bc1;
    const float vhat = vi / bc2;
    float wi = w[i];
    const float dec = seg_decay_of(i, seg_end, seg_decay, n_seg);
    wi = wi - lr * (mhat / (sqrtf(vhat) + eps) + wd * dec * wi);
    w[i] = wi;
    if (wlow != nullptr) wlow[i] = from_f<T>(wi);
}

#define ADAMW_INST(SUF, T)                                                                                 \
    extern "C" __global__ void k_adamw_##SUF(float* w, const float* g, float* m, float* v, T* wlow,        \
                                             long long n, float lr, float beta1, float beta2, float eps,   \
                                             float wd, float bc1, float bc2, const float* gstate,          \
                                             const long long* seg_end, const float* seg_decay, int n_seg,  \
                                             int apply_gscale) {                                           \
        adamw<T>(w, g, m, v, wlow, n, lr, beta1, beta2, eps, wd, bc1, bc2, gstate, seg_end, seg_decay,     \
                 n_seg, apply_gscale);                                                                     \
    }

ADAMW_INST(f32, float)
ADAMW_INST(bf16, bf16_t)
ADAMW_INST(f16, f16_t)
