// elementwise.cu: GELU (inside the `mlp` op pair), the `residual_add` pair, and dtype casts.
//
// k_gelu_fwd_<t>:      y = gelu_tanh(x), elementwise, (n,)
// k_gelu_bwd_<t>:      dx = dy * gelu_tanh'(x) (written, not accumulated: dx is scratch)
// k_residual_add_<t>:  out (n,) fp32 = a fp32 + b (storage t)
// k_residual_add_bwd:  da (n,) fp32 += dout   (the residual branch's gradient is dout itself,
//                      cast to the branch's storage type by k_cast_<t>)
// k_cast_<t>:          dst (n,) t = src fp32
// k_add_<t>:           dst (n,) t += src t (in fp32 arithmetic)

#define GELU_K 0.7978845608028654f  // sqrt(2/pi)
#define GELU_C 0.044715f

template <typename T>
__device__ void gelu_fwd(const T* __restrict__ x, T* __restrict__ y, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = to_f(x[i]);
    const float u = GELU_K * (v + GELU_C * v * v * v);
    y[i] = from_f<T>(0.5f * v * (1.0f + tanhf(u)));
}

template <typename T>
__device__ void gelu_bwd(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = to_f(x[i]);
    const float u = GELU_K * (v + GELU_C * v * v * v);
    const float th = tanhf(u);
    const float du = GELU_K * (1.0f + 3.0f * GELU_C * v * v);
    const float g = 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du;
    dx[i] = from_f<T>(to_f(dy[i]) * g);
}

template <typename T>
__device__ void residual_add(const float* __restrict__ a, const T* __restrict__ b, float* __restrict__ out,
                             long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = a[i] + to_f(b[i]);
}

template <typename T>
__device__ void cast_from_f32(const float* __restrict__ src, T* __restrict__ dst, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    dst[i] = from_f<T>(src[i]);
}

template <typename T>
__device__ void add_inplace(T* __restrict__ dst, const T* __restrict__ src, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    dst[i] = from_f<T>(to_f(dst[i]) + to_f(src[i]));
}

extern "C" __global__ void k_residual_add_bwd(const float* __restrict__ dout, float* __restrict__ da, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    da[i] += dout[i];
}

#define EW_INST(SUF, T)                                                                                 \
    extern "C" __global__ void k_gelu_fwd_##SUF(const T* x, T* y, long long n) { gelu_fwd<T>(x, y, n); } \
    extern "C" __global__ void k_gelu_bwd_##SUF(const T* x, const T* dy, T* dx, long long n) {           \
        gelu_bwd<T>(x, dy, dx, n);                                                                       \
    }                                                                                                    \
    extern "C" __global__ void k_residual_add_##SUF(const float* a, const T* b, float* out, long long n) { \
        residual_add<T>(a, b, out, n);                                                                   \
    }                                                                                                    \
    extern "C" __global__ void k_cast_##SUF(const float* src, T* dst, long long n) {                     \
        cast_from_f32<T>(src, dst, n);                                                                   \
    }                                                                                                    \
    extern "C" __global__ void k_add_##SUF(T* dst, const T* src, long long n) { add_inplace<T>(dst, src, n); }

EW_INST(f32, float)
EW_INST(bf16, bf16_t)
EW_INST(f16, f16_t)
