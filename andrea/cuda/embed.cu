// embed.cu: token + position embedding, forward and backward (the `embed` op pair).
//
// k_embed_fwd:      out (B*T, C) fp32 = wte[tok] + wpe[t]
// k_embed_bwd_wte:  dwte[v] += sum of dout rows whose token is v. Deterministic without atomics:
//                   the host sorts the token positions (stable), so one block owns one token id
//                   and adds its rows in position order. Grid = B*T blocks; blocks past the
//                   number of distinct ids (read from device memory) return at once, so the
//                   launch shape is fixed and a CUDA graph can replay it.
// k_embed_bwd_wpe:  dwpe[t] += sum over b of dout[b, t] (b in order).

extern "C" __global__ void k_embed_fwd(const int* __restrict__ tok, const float* __restrict__ wte,
                                       const float* __restrict__ wpe, float* __restrict__ out,
                                       int BT, int T, int C, int V) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n = (long long)BT * C;
    if (i >= n) return;
    const int row = (int)(i / C), c = (int)(i % C);
    int v = tok[row];
    v = v < 0 ? 0 : (v >= V ? V - 1 : v);  // the host validates ids; clamp keeps a bad id in bounds
    out[i] = wte[(long long)v * C + c] + wpe[(long long)(row % T) * C + c];
}

extern "C" __global__ void k_embed_bwd_wte(const float* __restrict__ dout, const int* __restrict__ sorted_pos,
                                           const int* __restrict__ seg_start, const int* __restrict__ seg_tok,
                                           const int* __restrict__ n_seg, float* __restrict__ dwte, int C) {
    const int s = blockIdx.x;
    if (s >= n_seg[0]) return;
    const int a = seg_start[s], b = seg_start[s + 1];
    const long long v = seg_tok[s];
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = a; j < b; ++j) acc += dout[(long long)sorted_pos[j] * C + c];
        dwte[v * C + c] += acc;
    }
}

extern "C" __global__ void k_embed_bwd_wpe(const float* __restrict__ dout, float* __restrict__ dwpe,
                                           int B, int T, int C) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * C) return;
    float acc = 0.0f;
    for (int b = 0; b < B; ++b) acc += dout[(long long)b * T * C + i];
    dwpe[i] += acc;
}
