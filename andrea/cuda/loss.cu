// loss.cu: cross-entropy over the vocabulary with a fused softmax (the `loss` op pair).
//
// k_loss_fwd_<t>:  logits (N, V) storage t, rows ld >= V elements apart (the engine pads them to a
//                  multiple of 64), targets (N,) int32 -> lse (N,) fp32 and
//                  losses (N,) fp32 = lse - logit[target]. One warp per row (LOSS_ROWS rows a block
//                  of 32 LOSS_ROWS threads), one pass (online max / sum of exp), fixed merge order.
// k_loss_mean:     out[0] = sum(losses) / N, one block, fixed order (deterministic).
// k_loss_bwd_<t>:  dlogits (N, V) t = (softmax(logits) - onehot(target)) * dscale, where
//                  dscale = dloss / N (times the fp16 loss scale). dlogits may alias logits (same
//                  layout required: every element is read and written by the same thread).
// k_loss_bwd_e4m3: the fp8 engine's tied head (andrea/cuda/fp8.py FP8_HEAD): bf16 logits rows of ld
//                  elements (ld % 8 == 0, 16-byte aligned rows) -> d8 (N, ld) E4M3 codes of
//                  (softmax - onehot) * 448, columns >= V written 0, and inv[0] = dscale / 448, the
//                  GEMMs' dequantization factor. |softmax - onehot| <= 1, so this fixed scale never
//                  saturates and needs no amax; E4M3 round to nearest even, a non-finite value -> NaN
//                  0x7F (the step guard skips that step). NumPy twin: fp8_numpy.loss_dlogits_e4m3.

// Rows are read in 16-byte vectors (uint4: 8 bf16/fp16 or 4 fp32 values); a row of odd V starts
// anywhere, so its elements before the first 16-byte boundary (head) and after the last one
// (tail) are taken one by one. The forward is one pass: each lane keeps a running (max, sum of exp)
// pair, the pairs are merged in a fixed order (the lanes' xor shuffles).
template <typename T>
struct Vec16 {
    static constexpr int n = 16 / sizeof(T);
};

// Elements of row r before its first 16-byte boundary (at most V), and the whole vectors after it.
template <typename T>
__device__ __forceinline__ void row_split(const T* r, int V, int& head, int& nvec) {
    const int mis = (int)(((unsigned long long)r & 15ull) / sizeof(T));
    head = min(V, mis ? Vec16<T>::n - mis : 0);
    nvec = (V - head) / Vec16<T>::n;
}

__device__ __forceinline__ void ms_add(float& m, float& s, float x) {
    if (x > m) {
        s = s * expf(m - x) + 1.0f;
        m = x;
    } else {
        s += expf(x - m);
    }
}
__device__ __forceinline__ void ms_merge(float& m, float& s, float mo, float so) {
    const float n = fmaxf(m, mo);
    s = (n == -ANDREA_INF) ? 0.0f : s * expf(m - n) + so * expf(mo - n);
    m = n;
}

// The forward: one warp a row, LOSS_ROWS rows a block. A row's running (max, sum of exp) pairs are
// merged across its 32 lanes by shuffles only, so a block has no barrier and no serial merge by one
// thread (a block of 512 threads a row spent most of its time there: 0.39 ms at 120M B=32 for 553 MB of
// logits, H200). Each lane loads four 16-byte vectors before it reduces them, in a fixed order.
template <typename T>
__device__ __forceinline__ void ms_vec(float& m, float& s, const uint4& u) {
    constexpr int VN = Vec16<T>::n;
    float f[VN];
    unpack16<T>(u, f);
    float vm = f[0];
#pragma unroll
    for (int i = 1; i < VN; ++i) vm = fmaxf(vm, f[i]);
    if (vm > m) {
        s *= expf(m - vm);
        m = vm;
    }
#pragma unroll
    for (int i = 0; i < VN; ++i) s += expf(f[i] - m);
}

template <typename T>
__device__ void loss_fwd(const T* __restrict__ logits, const int* __restrict__ targets, float* __restrict__ lse,
                         float* __restrict__ losses, int N, int V, int ld) {
    constexpr int VN = Vec16<T>::n;
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const T* lr = logits + (long long)row * ld;
    int head, nvec;
    row_split(lr, V, head, nvec);
    const int tail0 = head + nvec * VN;
    float m = -ANDREA_INF, s = 0.0f;
    for (int j = lane; j < head; j += 32) ms_add(m, s, to_f(lr[j]));
    const uint4* body = reinterpret_cast<const uint4*>(lr + head);
    int k = lane;
    for (; k + 96 < nvec; k += 128) {
        const uint4 a = body[k], b = body[k + 32], c = body[k + 64], d = body[k + 96];
        ms_vec<T>(m, s, a);
        ms_vec<T>(m, s, b);
        ms_vec<T>(m, s, c);
        ms_vec<T>(m, s, d);
    }
    for (; k < nvec; k += 32) ms_vec<T>(m, s, body[k]);
    for (int j = tail0 + lane; j < V; j += 32) ms_add(m, s, to_f(lr[j]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float mo = __shfl_xor_sync(0xffffffffu, m, o), so = __shfl_xor_sync(0xffffffffu, s, o);
        ms_merge(m, s, mo, so);
    }
    if (lane == 0) {
        const float l = m + logf(s);
        lse[row] = l;
        losses[row] = l - to_f(lr[targets[row]]);
    }
}

template <typename T>
__device__ void loss_bwd(const T* logits, const int* __restrict__ targets, const float* __restrict__ lse,
                         T* dlogits, float dscale, int N, int V, int ld) {
    constexpr int VN = Vec16<T>::n;
    const int row = blockIdx.x;
    if (row >= N) return;
    const long long base = (long long)row * ld;
    const float l = lse[row];
    const int t = targets[row];
    int head, nvec;
    row_split(logits + base, V, head, nvec);   // dlogits rows have the same alignment (same layout)
    const int tail0 = head + nvec * VN;
    for (int j = threadIdx.x; j < head; j += blockDim.x)
        dlogits[base + j] = from_f<T>((expf(to_f(logits[base + j]) - l) - (j == t ? 1.0f : 0.0f)) * dscale);
    const uint4* src = reinterpret_cast<const uint4*>(logits + base + head);
    uint4* dst = reinterpret_cast<uint4*>(dlogits + base + head);
    for (int k = threadIdx.x; k < nvec; k += blockDim.x) {
        float f[VN];
        unpack16<T>(src[k], f);
        const int j0 = head + k * VN;
#pragma unroll
        for (int i = 0; i < VN; ++i) f[i] = (expf(f[i] - l) - (j0 + i == t ? 1.0f : 0.0f)) * dscale;
        dst[k] = pack16<T>(f);
    }
    for (int j = tail0 + threadIdx.x; j < V; j += blockDim.x)
        dlogits[base + j] = from_f<T>((expf(to_f(logits[base + j]) - l) - (j == t ? 1.0f : 0.0f)) * dscale);
}

extern "C" __global__ void k_loss_bwd_e4m3(const bf16_t* __restrict__ logits, const int* __restrict__ targets,
                                           const float* __restrict__ lse, unsigned char* __restrict__ d8,
                                           float* __restrict__ inv, float dscale, int N, int V, int ld) {
    const int row = blockIdx.x;
    if (row >= N) return;
    if (row == 0 && threadIdx.x == 0) inv[0] = dscale / 448.0f;
    const long long base = (long long)row * ld;
    const float l = lse[row];
    const int t = targets[row];
    const uint4* src = reinterpret_cast<const uint4*>(logits + base);
    uint2* dst = reinterpret_cast<uint2*>(d8 + base);
    for (int k = threadIdx.x; k < ld / 8; k += blockDim.x) {
        float f[8];
        unpack16<bf16_t>(src[k], f);
        const int j0 = k * 8;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            f[i] = j0 + i < V ? (expf(f[i] - l) - (j0 + i == t ? 1.0f : 0.0f)) * 448.0f : 0.0f;
        uint2 o;
        o.x = fp8_pair_f(f[0], f[1]) | (fp8_pair_f(f[2], f[3]) << 16);
        o.y = fp8_pair_f(f[4], f[5]) | (fp8_pair_f(f[6], f[7]) << 16);
        dst[k] = o;
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
                                                float* losses, int N, int V, int ld) {                  \
        loss_fwd<T>(logits, targets, lse, losses, N, V, ld);                                            \
    }                                                                                                   \
    extern "C" __global__ void k_loss_bwd_##SUF(const T* logits, const int* targets, const float* lse,  \
                                                T* dlogits, float dscale, int N, int V, int ld) {       \
        loss_bwd<T>(logits, targets, lse, dlogits, dscale, N, V, ld);                                   \
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
