// decode.cu: the one-token decode step's kernels (andrea/cuda/decode.py), static shapes so the
// whole step is one CUDA graph of 5 launches per layer. The position and the token live on the
// device in `state` (int32: [0] the token to feed, [1] its position, [2] how many ids `out` holds).
// NumPy twins: the ref_* functions of andrea/cuda/decode.py (tests/test_generate_decode_gpu.py),
// and for the whole step andrea.generate.InferenceModel.forward of one token.
//
// Matrices are read transposed, W^T (N, K) in storage type t (row n = the K weights of output n),
// one warp per output row with 16-byte loads along K (K % (16 / sizeof t) == 0, rows 16-byte
// aligned): every weight is read once, coalesced. Dot products: each lane adds its chunks in
// order, then a fixed warp tree: the same bits on every run.
//
// k_dec_embed:          x (C,) fp32 = wte[state[0]] + wpe[state[1]]                    (fp32 weights)
// k_dec_ln_gemv_<t>:    h = round_t(LayerNorm(x) * g + b) (fp32 statistics, eps), acc = W^T h, then by mode:
//                       0 (qkv): n < C: q[n] = round_t(acc); n in [C, 2C): the k cache (H, Tmax, D) at
//                                state[1]; [2C, 3C): the v cache
//                       1 (gelu): out[n] = round_t(gelu(round_t(acc)))
//                       2 (logits): out[n] (fp32) = acc
// k_dec_gemv_res_<t>:   x[n] (fp32) += round_t(W^T a), a (K,) storage t (attention output, MLP hidden)
// k_dec_attn_<t>:       y (C,) storage t = softmax(q k^T / sqrt(D)) v over positions 0..state[1] of the
//                       caches; grid (H, S): block (h, s) takes positions [s CH, (s+1) CH), writes its
//                       max m, sum l = sum exp(score - m) and unnormalised sum of p v to part (H, S, D+2);
//                       the last block of head h to finish (an int ticket, reset after) combines the S
//                       partials in order s = 0..S-1: y = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s
// k_dec_argmax:         state[0] = argmax(logits (V,) fp32) (NaN as -inf; the first of ties); out[state[2]++] = it;
//                       state[1] += advance
// k_dec_advance:        state[1] += 1
// k_dec_sample:         one token drawn from logits (V,) fp32 by andrea.generate's rule, on the device:
//                       opts (4,) fp32 [temperature, top_p, top_k, 0]; rng (2,) uint64 [seed, counter];
//                       the uniform is u = (splitmix64(seed + counter * golden) >> 40) / 2^24 and
//                       counter += 1. temperature 0: the arg-max (first of ties). Else: top-k keeps the
//                       logits >= the k-th largest (ties kept; exact, on order-preserving integer keys);
//                       e = exp((logit - max) / temperature) over them, S = sum e; top-p keeps the most
//                       likely tokens, ties in index order, up to the first whose mass reaches top_p S;
//                       then the first index whose prefix sum (index order) of the kept e exceeds u W.
//                       One block; thread t owns the contiguous indices [t per, (t+1) per); every sum
//                       has a fixed order. Then as k_dec_argmax: state[0] = it, out[state[2]++] = it,
//                       state[1] += advance. e (V,) fp32 is scratch. NumPy twin: ref_sample.

#define DEC_CH 64        // positions per attention block
#define DEC_PF 4         // 16-byte weight chunks per lane loaded before the LayerNorm prologue

extern "C" __global__ void k_dec_embed(const float* __restrict__ wte, const float* __restrict__ wpe,
                                       const int* __restrict__ state, float* __restrict__ x, int C) {
    const long long tok = state[0], pos = state[1];
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x)
        x[c] = wte[tok * C + c] + wpe[pos * C + c];
}

template <typename T> __device__ __forceinline__ T round_t(float v) { return from_f<T>(v); }

// acc += the 16-byte chunk u of a weight row times a[c * VE ..] (a in shared memory)
template <typename T>
__device__ __forceinline__ float chunk_dot(const uint4 u, const float* __restrict__ a, float acc) {
    constexpr int VE = 16 / sizeof(T);
    float f[VE];
    unpack16<T>(u, f);
#pragma unroll
    for (int j = 0; j < VE; ++j) acc = fmaf(f[j], a[j], acc);
    return acc;
}

// The dot of row n of W^T (N, K) with the vector a (K,) fp32 in shared memory, for one warp; the
// first DEC_PF chunks of each lane were loaded into `pre` by the caller (before its prologue).
template <typename T>
__device__ __forceinline__ float warp_row_dot(const uint4* __restrict__ w4, const uint4* pre, int nch,
                                              const float* __restrict__ a, int lane) {
    constexpr int VE = 16 / sizeof(T);
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < DEC_PF; ++i) {
        const int c = lane + 32 * i;
        if (c < nch) acc = chunk_dot<T>(pre[i], a + c * VE, acc);
    }
#pragma unroll 4
    for (int c = lane + 32 * DEC_PF; c < nch; c += 32) acc = chunk_dot<T>(__ldg(w4 + c), a + c * VE, acc);
    return warp_sum(acc);
}

template <typename T>
__device__ __forceinline__ void prefetch_row(const uint4* __restrict__ w4, int nch, int lane, bool live, uint4* pre) {
#pragma unroll
    for (int i = 0; i < DEC_PF; ++i) {
        const int c = lane + 32 * i;
        if (live && c < nch) pre[i] = __ldg(w4 + c);
    }
}

template <typename T>
__device__ void dec_ln_gemv(const float* __restrict__ x, const float* __restrict__ g, const float* __restrict__ b,
                            const T* __restrict__ W, int N, int K, int mode, void* __restrict__ out,
                            T* __restrict__ kc, T* __restrict__ vc, const int* __restrict__ state, int D, int Tmax,
                            float eps) {
    extern __shared__ float a[];                 // (K,) the rounded LayerNorm output
    __shared__ float red[32];
    constexpr int VE = 16 / sizeof(T);
    const int lane = threadIdx.x & 31, n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int nch = K / VE;
    const bool live = n < N;
    const uint4* w4 = reinterpret_cast<const uint4*>(W + (long long)(live ? n : 0) * K);
    uint4 pre[DEC_PF];
    prefetch_row<T>(w4, nch, lane, live, pre);
    float s = 0.0f;
    for (int k = threadIdx.x; k < K; k += blockDim.x) s += x[k];
    const float mu = block_sum(s, red) / K;
    float s2 = 0.0f;
    for (int k = threadIdx.x; k < K; k += blockDim.x) { const float d = x[k] - mu; s2 += d * d; }
    const float rs = rsqrtf(block_sum(s2, red) / K + eps);
    for (int k = threadIdx.x; k < K; k += blockDim.x) a[k] = to_f(round_t<T>((x[k] - mu) * rs * g[k] + b[k]));
    __syncthreads();
    if (!live) return;
    const float acc = warp_row_dot<T>(w4, pre, nch, a, lane);
    if (lane) return;
    if (mode == 2) {
        reinterpret_cast<float*>(out)[n] = acc;
    } else if (mode == 1) {
        reinterpret_cast<T*>(out)[n] = round_t<T>(gelu_f(to_f(round_t<T>(acc))));
    } else {
        const int C = N / 3;
        if (n < C) {
            reinterpret_cast<T*>(out)[n] = round_t<T>(acc);
        } else {
            const int r = n < 2 * C ? n - C : n - 2 * C, h = r / D, d = r % D;
            T* cache = n < 2 * C ? kc : vc;
            cache[((long long)h * Tmax + state[1]) * D + d] = round_t<T>(acc);
        }
    }
}

template <typename T>
__device__ void dec_gemv_res(const T* __restrict__ av, const T* __restrict__ W, int N, int K, float* __restrict__ x) {
    extern __shared__ float a[];                 // (K,) the input vector as floats
    constexpr int VE = 16 / sizeof(T);
    const int lane = threadIdx.x & 31, n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int nch = K / VE;
    const bool live = n < N;
    const uint4* w4 = reinterpret_cast<const uint4*>(W + (long long)(live ? n : 0) * K);
    uint4 pre[DEC_PF];
    prefetch_row<T>(w4, nch, lane, live, pre);
    for (int k = threadIdx.x; k < K; k += blockDim.x) a[k] = to_f(av[k]);
    __syncthreads();
    if (!live) return;
    const float acc = warp_row_dot<T>(w4, pre, nch, a, lane);
    if (lane == 0) x[n] = x[n] + to_f(round_t<T>(acc));
}

template <typename T>
__device__ void dec_attn(const T* __restrict__ qv, const T* __restrict__ kc, const T* __restrict__ vc,
                         T* __restrict__ y, const int* __restrict__ state, float* __restrict__ part,
                         int* __restrict__ ticket, int H, int Tmax, int D, float scale) {
    constexpr int VE = 16 / sizeof(T);
    extern __shared__ float sh[];
    const int S = gridDim.y, NV = D / VE, G = blockDim.x / NV;
    float* q = sh;                   // (D,) scaled query
    float* p = q + D;                // (DEC_CH,) scores, then exp(score - m)
    float* pa = p + DEC_CH;          // (G, D) per-group partial sums of p v
    float* wsum = pa + G * D;        // (S,) combine weights
    float* red = wsum + S;           // (32,) block reductions
    __shared__ int last;
    const int h = blockIdx.x, s = blockIdx.y, tid = threadIdx.x, n = state[1] + 1;
    const int t0 = s * DEC_CH, m_n = min(n - t0, DEC_CH);   // positions of this block (<= 0: none)
    const T* kh = kc + (long long)h * Tmax * D;
    const T* vh = vc + (long long)h * Tmax * D;
    float* mine = part + ((long long)h * S + s) * (D + 2);
    if (m_n > 0) {                   // uniform over the block
        for (int d = tid; d < D; d += blockDim.x) q[d] = to_f(qv[h * D + d]) * scale;
        __syncthreads();
        float sc = -ANDREA_INF;
        if (tid < m_n) {
            const uint4* kr = reinterpret_cast<const uint4*>(kh + (long long)(t0 + tid) * D);
            float acc = 0.0f;
#pragma unroll 8
            for (int c = 0; c < NV; ++c) acc = chunk_dot<T>(__ldg(kr + c), q + c * VE, acc);
            sc = acc;
        }
        const float m = block_max(sc, red);
        const float e = tid < m_n ? __expf(sc - m) : 0.0f;
        if (tid < DEC_CH) p[tid] = e;
        const float l = block_sum(e, red);          // its __syncthreads also orders the p[] writes
        const int g = tid / NV, c = tid % NV;
        float acc[VE];
#pragma unroll
        for (int j = 0; j < VE; ++j) acc[j] = 0.0f;
        if (g < G) {
            for (int i = g; i < m_n; i += G) {
                float f[VE];
                unpack16<T>(__ldg(reinterpret_cast<const uint4*>(vh + (long long)(t0 + i) * D) + c), f);
                const float pi = p[i];
#pragma unroll
                for (int j = 0; j < VE; ++j) acc[j] = fmaf(pi, f[j], acc[j]);
            }
#pragma unroll
            for (int j = 0; j < VE; ++j) pa[g * D + c * VE + j] = acc[j];
        }
        __syncthreads();
        for (int d = tid; d < D; d += blockDim.x) {
            float tot = 0.0f;
            for (int k = 0; k < G; ++k) tot += pa[k * D + d];
            mine[d] = tot;
        }
        if (tid == 0) { mine[D] = m; mine[D + 1] = l; }
    } else if (tid == 0) {
        mine[D] = -ANDREA_INF;
        mine[D + 1] = 0.0f;
    }
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(ticket + h, 1) == S - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* ph = part + (long long)h * S * (D + 2);
    float M = -ANDREA_INF;
    for (int k = 0; k < S; ++k) M = fmaxf(M, __ldcg(ph + k * (D + 2) + D));
    for (int k = tid; k < S; k += blockDim.x) {
        const float mk = __ldcg(ph + k * (D + 2) + D);
        wsum[k] = mk == -ANDREA_INF ? 0.0f : __expf(mk - M);
    }
    __syncthreads();
    float L = 0.0f;
    for (int k = 0; k < S; ++k) L += wsum[k] * __ldcg(ph + k * (D + 2) + D + 1);
    const float inv = 1.0f / L;
    for (int d = tid; d < D; d += blockDim.x) {
        float tot = 0.0f;
        for (int k = 0; k < S; ++k) tot += wsum[k] * __ldcg(ph + k * (D + 2) + d);
        y[h * D + d] = round_t<T>(tot * inv);
    }
    if (tid == 0) ticket[h] = 0;
}

#define DEC_INST(SUF, T)                                                                                         \
    extern "C" __global__ void k_dec_ln_gemv_##SUF(const float* x, const float* g, const float* b, const T* W,     \
                                                   int N, int K, int mode, void* out, T* kc, T* vc,               \
                                                   const int* state, int D, int Tmax, float eps) {                \
        dec_ln_gemv<T>(x, g, b, W, N, K, mode, out, kc, vc, state, D, Tmax, eps);                                  \
    }                                                                                                              \
    extern "C" __global__ void k_dec_gemv_res_##SUF(const T* a, const T* W, int N, int K, float* x) {            \
        dec_gemv_res<T>(a, W, N, K, x);                                                                            \
    }                                                                                                              \
    extern "C" __global__ void k_dec_attn_##SUF(const T* q, const T* kc, const T* vc, T* y, const int* state,     \
                                                float* part, int* ticket, int H, int Tmax, int D, float scale) {  \
        dec_attn<T>(q, kc, vc, y, state, part, ticket, H, Tmax, D, scale);                                         \
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

// ------------------------------------------------------------------------------ sampling
__device__ __forceinline__ unsigned okey(float v) {          // order-preserving key; NaN sorts as -inf
    if (v != v) v = -ANDREA_INF;
    const unsigned u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float okey_value(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

template <typename V>
__device__ __forceinline__ V block_reduce_any(V v, V* buf, int op) {   // op: 0 sum, 1 max, 2 min; fixed order
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const V w = __shfl_xor_sync(0xffffffffu, v, o);
        v = op == 0 ? v + w : op == 1 ? (w > v ? w : v) : (w < v ? w : v);
    }
    __syncthreads();
    if (lane == 0) buf[wid] = v;
    __syncthreads();
    V r = buf[0];
    for (int k = 1; k < nw; ++k) {
        const V w = buf[k];
        r = op == 0 ? r + w : op == 1 ? (w > r ? w : r) : (w < r ? w : r);
    }
    return r;
}

// exclusive prefix sum over the block in thread order (warp scans, then the warp totals in order);
// *total gets the sum of all. `buf` holds 32 floats.
__device__ __forceinline__ float block_exclusive_scan(float v, float* buf, float* total) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float w = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += w;
    }
    __syncthreads();
    if (lane == 31) buf[wid] = inc;
    __syncthreads();
    float before = 0.0f, all = 0.0f;
    for (int k = 0; k < nw; ++k) {
        if (k == wid) before = all;
        all += buf[k];
    }
    *total = all;
    return before + inc - v;
}

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

extern "C" __global__ void __launch_bounds__(1024) k_dec_sample(const float* __restrict__ logits, int V,
        const float* __restrict__ opts, unsigned long long* __restrict__ rng, int* __restrict__ state,
        int* __restrict__ out, float* __restrict__ e, int advance) {
    __shared__ float fbuf[32];
    __shared__ unsigned ubuf[32];
    __shared__ int ibuf[32];
    const int tid = threadIdx.x, nt = blockDim.x;
    const int per = (V + nt - 1) / nt, i0 = min(V, tid * per), i1 = min(V, i0 + per);
    const float temp = opts[0], top_p = opts[1];
    const int top_k = (int)opts[2];
    const unsigned long long seed = rng[0], counter = rng[1];
    const float u = (float)(splitmix64(seed + counter * 0x9E3779B97F4A7C15ull) >> 40) * (1.0f / 16777216.0f);
    unsigned km = 0;
    for (int i = i0; i < i1; ++i) km = max(km, okey(logits[i]));
    km = block_reduce_any<unsigned>(km, ubuf, 1);
    int tok = 0x7fffffff;
    if (temp == 0.0f) {
        for (int i = i0; i < i1 && tok == 0x7fffffff; ++i) if (okey(logits[i]) == km) tok = i;
        tok = block_reduce_any<int>(tok, ibuf, 2);
    } else {
        unsigned thr = 0;                                   // top-k: the k-th largest key
        if (top_k > 0 && top_k < V) {
            for (int b = 31; b >= 0; --b) {
                const unsigned c = thr | (1u << b);
                int n = 0;
                for (int i = i0; i < i1; ++i) n += okey(logits[i]) >= c;
                if (block_reduce_any<int>(n, ibuf, 0) >= top_k) thr = c;
            }
        }
        const float lmax = okey_value(km);
        float cs = 0.0f;
        for (int i = i0; i < i1; ++i) {
            const float l = logits[i];
            const float v = (okey(l) >= thr && l == l) ? expf((l - lmax) / temp) : 0.0f;
            e[i] = v;
            cs += v;
        }
        const float S = block_reduce_any<float>(cs, fbuf, 0);
        unsigned tau = 0;                                   // top-p: the key of the last token kept
        int keep_tied = 0x7fffffff;                         // tied at tau: keep those with index < keep_tied
        if (top_p < 1.0f) {
            const float target = top_p * S;
            for (int b = 30; b >= 0; --b) {
                const unsigned c = tau | (1u << b);
                float m = 0.0f;
                for (int i = i0; i < i1; ++i) if (__float_as_uint(e[i]) >= c) m += e[i];
                if (block_reduce_any<float>(m, fbuf, 0) >= target) tau = c;
            }
            float mg = 0.0f;
            int nt_own = 0;
            for (int i = i0; i < i1; ++i) {
                const unsigned k = __float_as_uint(e[i]);
                if (k > tau) mg += e[i];
                nt_own += k == tau;
            }
            const float mass_gt = block_reduce_any<float>(mg, fbuf, 0);
            const int n_tied = block_reduce_any<int>(nt_own, ibuf, 0);
            const float tv = __uint_as_float(tau);
            int m_tied = n_tied;
            if (n_tied > 1) m_tied = min(n_tied, max(1, (int)ceilf((target - mass_gt) / tv)));
            if (m_tied < n_tied) {                          // the m_tied-th tied index, in index order
                float all;
                int seen = (int)block_exclusive_scan((float)nt_own, fbuf, &all);   // tied before this chunk
                int cut = 0x7fffffff;
                for (int i = i0; i < i1; ++i)
                    if (__float_as_uint(e[i]) == tau && ++seen == m_tied) cut = i + 1;
                keep_tied = block_reduce_any<int>(cut, ibuf, 2);
            }
        }
#define KEPT(i) (__float_as_uint(e[i]) != 0u && (__float_as_uint(e[i]) > tau || (__float_as_uint(e[i]) == tau && (i) < keep_tied)))
        float ws = 0.0f;                                    // kept weights of this chunk, index order
        for (int i = i0; i < i1; ++i) if (KEPT(i)) ws += e[i];
        float W;
        const float pre = block_exclusive_scan(ws, fbuf, &W);
        const float r = u * W;
        float acc = pre;
        int last = -1;
        for (int i = i0; i < i1 && tok == 0x7fffffff; ++i) {
            if (KEPT(i)) {
                acc += e[i];
                last = i;
                if (acc > r) tok = i;
            }
        }
        for (int i = i1 - 1; i >= i0 && last < 0; --i) if (KEPT(i)) last = i;
#undef KEPT
        tok = block_reduce_any<int>(tok, ibuf, 2);
        const int lastk = block_reduce_any<int>(last, ibuf, 1);
        if (tok == 0x7fffffff) tok = lastk < 0 ? 0 : lastk;  // float edge at the very top of the CDF
    }
    if (tid == 0) {
        state[0] = tok;
        out[state[2]] = tok;
        state[2] += 1;
        state[1] += advance;
        rng[1] = counter + 1;
    }
}
