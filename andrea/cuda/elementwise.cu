// elementwise.cu: GELU (inside the `mlp` op pair), the `residual_add` pair, and dtype casts.
//
// k_gelu_fwd_<t>:      y = gelu_tanh(x), elementwise, (n,)
// k_gelu_bwd_<t>:      dx = dy * gelu_tanh'(x) (written, not accumulated: dx is scratch)
// k_residual_add_<t>:  out (n,) fp32 = a fp32 + b (storage t)
// k_cast_<t>:          dst (n,) t = src fp32   (the residual branch's gradient: dres cast to the
//                      branch's storage type; the stream's gradient itself passes through in place)
// k_*8_<t>:            the same, 8 consecutive elements per thread with 16-byte accesses (n % 8 == 0,
//                      16-byte aligned buffers; the launchers in kernels.py choose them)
// GELU is evaluated as x * sigmoid(2u) (one expf), the same function as 0.5 x (1 + tanh u).

// (gelu_f, gelu_grad_f: common.cuh)

// 8 consecutive elements per thread: one 16-byte access for 16-bit storage, two for fp32.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* f) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    unpack16<T>(q[0], f);
    if constexpr (sizeof(T) == 4) unpack16<T>(q[1], f + 4);
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const float* f) {
    uint4* q = reinterpret_cast<uint4*>(p);
    q[0] = pack16<T>(f);
    if constexpr (sizeof(T) == 4) q[1] = pack16<T>(f + 4);
}

template <typename T>
__device__ void gelu_fwd8(const T* __restrict__ x, T* __restrict__ y, long long n8) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n8) return;
    float f[8];
    load8(x + 8 * i, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = gelu_f(f[j]);
    store8(y + 8 * i, f);
}
template <typename T>
__device__ void gelu_bwd8(const T* __restrict__ x, const T* dy, T* dx, long long n8) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n8) return;
    float f[8], d[8];
    load8(x + 8 * i, f);
    load8(dy + 8 * i, d);
#pragma unroll
    for (int j = 0; j < 8; ++j) d[j] *= gelu_grad_f(f[j]);
    store8(dx + 8 * i, d);
}
template <typename T>
__device__ void residual_add8(const float* __restrict__ a, const T* __restrict__ b, float* __restrict__ out, long long n8) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n8) return;
    float fa[8], fb[8];
    load8(a + 8 * i, fa);
    load8(b + 8 * i, fb);
#pragma unroll
    for (int j = 0; j < 8; ++j) fa[j] += fb[j];
    store8(out + 8 * i, fa);
}
template <typename T>
__device__ void cast8(const float* __restrict__ src, T* __restrict__ dst, long long n8) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n8) return;
    float f[8];
    load8(src + 8 * i, f);
    store8(dst + 8 * i, f);
}

template <typename T>
__device__ void gelu_fwd(const T* __restrict__ x, T* __restrict__ y, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    y[i] = from_f<T>(gelu_f(to_f(x[i])));
}

template <typename T>
__device__ void gelu_bwd(const T* __restrict__ x, const T* dy, T* dx, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    dx[i] = from_f<T>(to_f(dy[i]) * gelu_grad_f(to_f(x[i])));
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
    extern "C" __global__ void k_gelu_fwd8_##SUF(const T* x, T* y, long long n8) { gelu_fwd8<T>(x, y, n8); } \
    extern "C" __global__ void k_gelu_bwd8_##SUF(const T* x, const T* dy, T* dx, long long n8) {         \
        gelu_bwd8<T>(x, dy, dx, n8);                                                                     \
    }                                                                                                    \
    extern "C" __global__ void k_residual_add8_##SUF(const float* a, const T* b, float* out, long long n8) { \
        residual_add8<T>(a, b, out, n8);                                                                 \
    }                                                                                                    \
    extern "C" __global__ void k_cast8_##SUF(const float* src, T* dst, long long n8) { cast8<T>(src, dst, n8); }

EW_INST(f32, float)
EW_INST(bf16, bf16_t)
EW_INST(f16, f16_t)
