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
//   k_gate_finite:       gstate[2] = 0 where the step's loss is not finite.
// k_adamw: one thread per parameter; skips everything when gstate[2] == 0 (a NaN/inf step never
// reaches the weights, also inside a replayed CUDA graph). Weight decay on the prefix [0, n_decay)
// of the flat layout (andrea/engine/model.py puts every decayed matrix first).
// Optionally writes a low-precision copy of the new weights (bf16/fp16 compute weights).

extern "C" __global__ void k_grad_norm_partial(const float* __restrict__ g, long long n, float* __restrict__ partial) {
    __shared__ float buf[32];
    float s = 0.0f;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 7 * stride < n; i += 8 * stride) {      // 8 loads in flight, then summed in the same order
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = g[i + u * stride];
#pragma unroll
        for (int u = 0; u < 8; ++u) s += v[u] * v[u];
    }
    for (; i < n; i += stride) {
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

// k_gate_finite: gstate[2] = 0 where the step's last loss (loss[0]) is NaN or inf, so that k_adamw skips
// the step as for a non-finite norm: the engine reads that loss back only after the update is queued.
extern "C" __global__ void k_gate_finite(const float* __restrict__ loss, float* __restrict__ gstate) {
    if (threadIdx.x == 0 && !isfinite(loss[0])) gstate[2] = 0.0f;
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

// adamw_pinned (one parameter's update, each rounding spelled out) is in common.cuh: fp8.cu's k_adamw_w8_bf16
// runs the same arithmetic.

// Parameter j in place: g (times the clip scale gs with apply_gscale), m, v, w and its compute copy.
// hp (device, so a replayed CUDA graph sees new values): [lr, weight_decay, step_size = lr / bc1,
// inv_sqrt_bc2 = 1 / sqrt(bc2), beta1, beta2, eps]; weight decay on [0, n_decay).
template <typename T>
__device__ __forceinline__ void adamw_at(long long j, float* __restrict__ w, const float* __restrict__ g,
                                         float* __restrict__ m, float* __restrict__ v, T* __restrict__ wlow,
                                         const float* __restrict__ hp, float gs, long long n_decay,
                                         int apply_gscale) {
    float gj = g[j], mj = m[j], vj = v[j], wj = w[j];
    if (apply_gscale) gj = __fmul_rn(gj, gs);
    adamw_pinned(wj, gj, mj, vj, j < n_decay, hp[0], hp[1], hp[2], hp[3], hp[4], hp[5], hp[6]);
    m[j] = mj;
    v[j] = vj;
    w[j] = wj;
    if (wlow != nullptr) wlow[j] = from_f<T>(wj);
}

template <typename T>
__device__ void adamw(float* __restrict__ w, const float* __restrict__ g, float* __restrict__ m,
                      float* __restrict__ v, T* __restrict__ wlow, long long n, const float* __restrict__ hp,
                      const float* __restrict__ gstate, long long n_decay, int apply_gscale) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || gstate[2] == 0.0f) return;
    adamw_at(i, w, g, m, v, wlow, hp, gstate[1], n_decay, apply_gscale);
}

// |x| of a 16-bit compute value, 0 for inf/NaN (bf16_absf's rule): the weights' amax for fp8's casts.
template <typename T>
__device__ __forceinline__ float low_abs(T x) {
    const float a = fabsf(to_f(x));
    return a <= 3.402823466e38f ? a : 0.0f;
}

// adamw, four parameters a thread (16-byte accesses: w, g, m, v 16-byte aligned, wlow 8, the launcher
// checks), ADAMW_CHUNK = 4 * 256 parameters a block. With part: part[block] = the max |wlow| of the
// block's parameters after the step (finite values; the unchanged copy on a skipped step), so fp8's
// weight casts (k_fp8_wamax_parts) need not read wlow again for their amax.
template <typename T>
__device__ void adamw4(float* __restrict__ w, const float* __restrict__ g, float* __restrict__ m,
                       float* __restrict__ v, T* __restrict__ wlow, long long n, const float* __restrict__ hp,
                       const float* __restrict__ gstate, long long n_decay, int apply_gscale,
                       float* __restrict__ part) {
    __shared__ float buf[32];
    const long long i = 4 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
    const bool ok = gstate[2] != 0.0f;
    const float lr = hp[0], wd = hp[1], step = hp[2], isb2 = hp[3], b1 = hp[4], b2 = hp[5], eps = hp[6];
    const float gs = gstate[1];
    float am = 0.0f;
    if (i < n && i + 4 > n) {  // the tail: one at a time
        for (long long j = i; j < n; ++j) {
            if (ok) adamw_at(j, w, g, m, v, wlow, hp, gs, n_decay, apply_gscale);
            if (part != nullptr) am = fmaxf(am, low_abs(wlow[j]));
        }
    } else if (i < n) {
        T lo[4];
        if (ok) {
            float4 g4 = *reinterpret_cast<const float4*>(g + i), m4 = *reinterpret_cast<const float4*>(m + i),
                   v4 = *reinterpret_cast<const float4*>(v + i), w4 = *reinterpret_cast<const float4*>(w + i);
            if (apply_gscale) {
                g4.x = __fmul_rn(g4.x, gs); g4.y = __fmul_rn(g4.y, gs);
                g4.z = __fmul_rn(g4.z, gs); g4.w = __fmul_rn(g4.w, gs);
            }
            adamw_pinned(w4.x, g4.x, m4.x, v4.x, i < n_decay, lr, wd, step, isb2, b1, b2, eps);
            adamw_pinned(w4.y, g4.y, m4.y, v4.y, i + 1 < n_decay, lr, wd, step, isb2, b1, b2, eps);
            adamw_pinned(w4.z, g4.z, m4.z, v4.z, i + 2 < n_decay, lr, wd, step, isb2, b1, b2, eps);
            adamw_pinned(w4.w, g4.w, m4.w, v4.w, i + 3 < n_decay, lr, wd, step, isb2, b1, b2, eps);
            *reinterpret_cast<float4*>(m + i) = m4;
            *reinterpret_cast<float4*>(v + i) = v4;
            *reinterpret_cast<float4*>(w + i) = w4;
            lo[0] = from_f<T>(w4.x); lo[1] = from_f<T>(w4.y); lo[2] = from_f<T>(w4.z); lo[3] = from_f<T>(w4.w);
            if (wlow != nullptr) {
                if constexpr (sizeof(T) == 2) {
                    uint2 o;
                    o.x = (unsigned)lo[0].x | ((unsigned)lo[1].x << 16);
                    o.y = (unsigned)lo[2].x | ((unsigned)lo[3].x << 16);
                    *reinterpret_cast<uint2*>(wlow + i) = o;
                } else {
                    *reinterpret_cast<float4*>(wlow + i) = w4;
                }
            }
        } else if (part != nullptr) {
#pragma unroll
            for (int k = 0; k < 4; ++k) lo[k] = wlow[i + k];
        }
        if (part != nullptr)
            am = fmaxf(fmaxf(low_abs(lo[0]), low_abs(lo[1])), fmaxf(low_abs(lo[2]), low_abs(lo[3])));
    }
    if (part != nullptr) {  // every thread of the block takes part in the reduction
        am = block_max(am, buf);
        if (threadIdx.x == 0) part[blockIdx.x] = am;
    }
}

#define ADAMW_INST(SUF, T)                                                                                 \
    extern "C" __global__ void k_adamw_##SUF(float* w, const float* g, float* m, float* v, T* wlow,        \
                                             long long n, const float* hp, const float* gstate,           \
                                             long long n_decay, int apply_gscale) {                        \
        adamw<T>(w, g, m, v, wlow, n, hp, gstate, n_decay, apply_gscale);                                  \
    }                                                                                                      \
    extern "C" __global__ void k_adamw4_##SUF(float* w, const float* g, float* m, float* v, T* wlow,       \
                                              long long n, const float* hp, const float* gstate,          \
                                              long long n_decay, int apply_gscale, float* part) {          \
        adamw4<T>(w, g, m, v, wlow, n, hp, gstate, n_decay, apply_gscale, part);                           \
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
