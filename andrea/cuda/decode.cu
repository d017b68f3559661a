// decode.cu: the one-token decode step's own kernels (andrea/cuda/decode.py), static shapes so
// the whole step is one CUDA graph. The position and the token live on the device in
// `state` (int32: [0] the token to feed, [1] its position, [2] how many ids `out` holds).
// NumPy twin: andrea.generate.InferenceModel.forward of one token (embed at wpe[pos], append
// k, v to the cache, attend to positions 0..pos) and np.argmax (first index on ties).
//
// k_dec_embed:        x (C,) fp32 = wte[state[0]] + wpe[state[1]]                       (fp32 weights)
// k_dec_attn_<t>:     qkv (3C,) storage t -> k/v cache (H, Tmax, D) at state[1]; y (C,) = softmax(q k^T / sqrt(D)) v
//                     one block per head (blockDim a multiple of D); scores in fp32 in dynamic shared
//                     memory: max(Tmax, blockDim) + D + 32 floats
// k_dec_argmax:       state[0] = argmax(logits (V,) fp32) (NaN as -inf; the first of ties); out[state[2]++] = it;
//                     state[1] += advance
// k_dec_advance:      state[1] += 1

extern "C" __global__ void k_dec_embed(const float* __restrict__ wte, const float* __restrict__ wpe,
                                       const int* __restrict__ state, float* __restrict__ x, int C) {
    const long long tok = state[0], pos = state[1];
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x)
        x[c] = wte[tok * C + c] + wpe[pos * C + c];
}

template <typename T>
__device__ void dec_attn(const T* __restrict__ qkv, T* __restrict__ kc, T* __restrict__ vc, T* __restrict__ y,
                         const int* __restrict__ state, int H, int Tmax, int D, float scale) {
    extern __shared__ float sh[];
    const int ns = Tmax > (int)blockDim.x ? Tmax : (int)blockDim.x;
    float* s = sh;                 // (ns,) scores, then probabilities, then partial sums
    float* q = sh + ns;            // (D,)
    float* red = q + D;            // (32,) block reductions
    const int h = blockIdx.x, C = H * D, pos = state[1], n = pos + 1;
    T* kh = kc + (long long)h * Tmax * D;
    T* vh = vc + (long long)h * Tmax * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        kh[(long long)pos * D + d] = qkv[C + h * D + d];
        vh[(long long)pos * D + d] = qkv[2 * C + h * D + d];
        q[d] = to_f(qkv[h * D + d]);
    }
    __syncthreads();
    float mx = -ANDREA_INF;
    for (int t = threadIdx.x; t < n; t += blockDim.x) {
        const T* kr = kh + (long long)t * D;
        float acc = 0.0f;
        for (int d = 0; d < D; ++d) acc += q[d] * to_f(kr[d]);
        acc *= scale;
        s[t] = acc;
        mx = fmaxf(mx, acc);
    }
    mx = block_max(mx, red);
    float sum = 0.0f;
    for (int t = threadIdx.x; t < n; t += blockDim.x) {
        const float e = __expf(s[t] - mx);
        s[t] = e;
        sum += e;
    }
    sum = block_sum(sum, red);       // block_reduce's __syncthreads also orders the s[] writes
    const float inv = 1.0f / sum;
    // y[d]: the G = blockDim / D thread groups split the positions; their partial sums meet in
    // s[g * D + d] (s holds max(Tmax, blockDim) floats), added in group order
    const int G = blockDim.x / D, g = threadIdx.x / D, d = threadIdx.x % D;
    float acc = 0.0f;
    if (g < G)
        for (int t = g; t < n; t += G) acc += s[t] * to_f(vh[(long long)t * D + d]);
    __syncthreads();
    if (g < G) s[g * D + d] = acc;
    __syncthreads();
    if (threadIdx.x < D) {
        float tot = 0.0f;
        for (int k = 0; k < G; ++k) tot += s[k * D + threadIdx.x];
        y[h * D + threadIdx.x] = from_f<T>(tot * inv);
    }
}

#define DEC_INST(SUF, T)                                                                                  \
    extern "C" __global__ void k_dec_attn_##SUF(const T* qkv, T* kc, T* vc, T* y, const int* state, int H, \
                                                int Tmax, int D, float scale) {                             \
        dec_attn<T>(qkv, kc, vc, y, state, H, Tmax, D, scale);                                              \
    }
DEC_INST(f32, float)
DEC_INST(bf16, bf16_t)
DEC_INST(f16, f16_t)

extern "C" __global__ void k_dec_argmax(const float* __restrict__ logits, int V, int* __restrict__ state,
                                        int* __restrict__ out, int advance) {
    __shared__ float bv[1024];
    __shared__ int bi[1024];
    float best = -ANDREA_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float v = logits[i];
        if (v != v) v = -ANDREA_INF;
        if (v > best || (v == best && i < idx)) { best = v; idx = i; }
    }
    bv[threadIdx.x] = best;
    bi[threadIdx.x] = idx;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const float ov = bv[threadIdx.x + stride];
            const int oi = bi[threadIdx.x + stride];
            if (ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bi[threadIdx.x])) {
                bv[threadIdx.x] = ov;
                bi[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const int t = bi[0] == 0x7fffffff ? 0 : bi[0];
        state[0] = t;
        out[state[2]] = t;
        state[2] += 1;
        state[1] += advance;
    }
}

extern "C" __global__ void k_dec_advance(int* state) {
    if (threadIdx.x == 0 && blockIdx.x == 0) state[1] += 1;
}
