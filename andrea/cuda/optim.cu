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
// reaches the weights, also inside a replayed CUDA graph). Weight decay on the prefix [0, n_decay)
// of the flat layout (andrea/engine/model.py puts every decayed matrix first).
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

template <typename T>
__device__ void adamw(float* __restrict__ w, const float* __restrict__ g, float* __restrict__ m,
                      float* __restrict__ v, T* __restrict__ wlow, long long n, const float* __restrict__ hp,
                      const float* __restrict__ gstate, long long n_decay, int apply_gscale) {
    // hp (device, so a replayed CUDA graph sees new values): [lr, weight_decay, step_size = lr / bc1,
    //     inv_sqrt_bc2 = 1 / sqrt(bc2), beta1, beta2, eps]. Same arithmetic as ops_numpy.adamw:
    // w[:n_decay] *= 1 - lr wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
    // w -= step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps)
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (gstate[2] == 0.0f) return;
    const float lr = hp[0], wd = hp[1], step = hp[2], isb2 = hp[3], b1 = hp[4], b2 = hp[5], eps = hp[6];
    float gi = g[i];
    if (apply_gscale) gi *= gstate[1];
    const float mi = b1 * m[i] + (1.0f - b1) * gi;
    const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    float wi = w[i];
    if (i < n_decay) wi *= (1.0f - lr * wd);
    wi -= step * (mi / (sqrtf(vi) * isb2 + eps));
    w[i] = wi;
    if (wlow != nullptr) wlow[i] = from_f<T>(wi);
}

#define ADAMW_INST(SUF, T)                                                                                 \
    extern "C" __global__ void k_adamw_##SUF(float* w, const float* g, float* m, float* v, T* wlow,        \
                                             long long n, const float* hp, const float* gstate,           \
                                             long long n_decay, int apply_gscale) {                        \
        adamw<T>(w, g, m, v, wlow, n, hp, gstate, n_decay, apply_gscale);                                  \
    }

ADAMW_INST(f32, float)
ADAMW_INST(bf16, bf16_t)
ADAMW_INST(f16, f16_t)

// The NumPy twin of grad_norm_partial writes float64 partials: partial[i] = sum of squares of
// chunk i = [i*chunk, (i+1)*chunk) of the flat grads, one block per chunk, fp32 accumulation.
extern "C" __global__ void k_grad_norm_partial_chunks(const float* __restrict__ g, long long n, long long chunk,
                                                      double* __restrict__ partial) {
    __shared__ float buf[32];
    const long long a = (long long)blockIdx.x * chunk;
    const long long b = min(n, a + chunk);
    float s = 0.0f;
    for (long long i = a + threadIdx.x; i < b; i += blockDim.x) { const float v = g[i]; s += v * v; }
    s = block_sum(s, buf);
    if (threadIdx.x == 0) partial[blockIdx.x] = (double)s;
}
