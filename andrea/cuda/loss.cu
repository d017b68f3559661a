// loss.cu: cross-entropy over the vocabulary with a fused softmax (the `loss` op pair).
//
// k_loss_fwd_<t>:  logits (N, V) storage t, targets (N,) int32 -> lse (N,) fp32 and
//                  losses (N,) fp32 = lse - logit[target]. One block per row, fixed reduction order.
// k_loss_mean:     out[0] = sum(losses) / N, one block, fixed order (deterministic).
// k_loss_bwd_<t>:  dlogits (N, V) t = (softmax(logits) - onehot(target)) * dscale, where
//                  dscale = dloss / N (times the fp16 loss scale). dlogits may alias logits.

template <typename T>
__device__ void loss_fwd(const T* __restrict__ logits, const int* __restrict__ targets, float* __restrict__ lse,
                         float* __restrict__ losses, int N, int V) {
    __shared__ float buf[32];
    const int row = blockIdx.x;
    if (row >= N) return;
    const T* lr = logits + (long long)row * V;
    float m = -ANDREA_INF;
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, to_f(lr[j]));
    m = block_max(m, buf);
    float s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(to_f(lr[j]) - m);
    s = block_sum(s, buf);
    if (threadIdx.x == 0) {
        const float l = m + logf(s);
        lse[row] = l;
        const int t = targets[row];
        losses[row] = l - to_f(lr[t]);
    }
}

template <typename T>
__device__ void loss_bwd(const T* logits, const int* __restrict__ targets, const float* __restrict__ lse,
                         T* dlogits, float dscale, int N, int V) {
    const int row = blockIdx.x;
    if (row >= N) return;
    const long long base = (long long)row * V;
    const float l = lse[row];
    const int t = targets[row];
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float p = expf(to_f(logits[base + j]) - l);
        dlogits[base + j] = from_f<T>((p - (j == t ? 1.0f : 0.0f)) * dscale);
    }
}

extern "C" __global__ void k_loss_mean(const float* __restrict__ losses, float* __restrict__ out, int N) {
    __shared__ float buf[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < N; i += blockDim.x) s += losses[i];
    s = block_sum(s, buf);
    if (threadIdx.x == 0) out[0] = s / N;
}

#define LOSS_INST(SUF, T)                                                                               \
    extern "C" __global__ void k_loss_fwd_##SUF(const T* logits, const int* targets, float* lse,        \
                                                float* losses, int N, int V) {                          \
        loss_fwd<T>(logits, targets, lse, losses, N, V);                                                \
    }                                                                                                   \
    extern "C" __global__ void k_loss_bwd_##SUF(const T* logits, const int* targets, const float* lse,  \
                                                T* dlogits, float dscale, int N, int V) {               \
        loss_bwd<T>(logits, targets, lse, dlogits, dscale, N, V);                                       \
    }

LOSS_INST(f32, float)
LOSS_INST(bf16, bf16_t)
LOSS_INST(f16, f16_t)

// The NumPy twin keeps probs = softmax(logits) (N, V) from the forward and turns it into dlogits in
// the backward: these two kernels do the same on the device (used by the op-for-op mirror).
template <typename T>
__device__ void softmax_rows(const T* __restrict__ logits, const float* __restrict__ lse, T* __restrict__ probs,
                             int N, int V) {
    const int row = blockIdx.x;
    if (row >= N) return;
    const long long base = (long long)row * V;
    const float l = lse[row];
    for (int j = threadIdx.x; j < V; j += blockDim.x) probs[base + j] = from_f<T>(expf(to_f(logits[base + j]) - l));
}
template <typename T>
__device__ void probs_to_dlogits(T* __restrict__ probs, const int* __restrict__ targets, float dscale, int N, int V) {
    const int row = blockIdx.x;
    if (row >= N) return;
    const long long base = (long long)row * V;
    const int t = targets[row];
    for (int j = threadIdx.x; j < V; j += blockDim.x)
        probs[base + j] = from_f<T>((to_f(probs[base + j]) - (j == t ? 1.0f : 0.0f)) * dscale);
}
extern "C" __global__ void k_softmax_f32(const float* logits, const float* lse, float* probs, int N, int V) {
    softmax_rows<float>(logits, lse, probs, N, V);
}
extern "C" __global__ void k_probs_to_dlogits_f32(float* probs, const int* targets, float dscale, int N, int V) {
    probs_to_dlogits<float>(probs, targets, dscale, N, V);
}
