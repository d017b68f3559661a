// mm_dgelu.cu: the MLP's proj dgrad with gelu' in the GEMM's epilogue, for Hopper (sm_90a: TMA, wgmma,
// mbarriers, clusters):
//
//   D (M, N) = bf16( (A (M, K) . B (N, K)^T) * g ),   g = fp16(gelu'(X (M, N)))
//
// all bf16 row-major, fp32 accumulation, gelu' = common.cuh's gelu_grad_f. In the engine's backward
// A = dout, B = w_proj viewed (4C, C), X = h_pre and D = dh: the call cuBLASLt makes with its DGELU
// epilogue, which only its xmma kernels carry (75 us a layer slower than its plain GEMM at 480M B=16,
// docs/bench/s28_h200.md). kernels.mm_dgelu_reference is the NumPy twin, kernels.MmDgelu the launcher
// (it encodes the four TMA maps), bench/dgelu_gemm.py times it against both cuBLASLt calls:
//
//   python3 bench/dgelu_gemm.py --variants andrea-480m:8,16 andrea-120m:32 --configs MM_CLUSTER=2
//
// One CTA an SM, persistent over MM_BM x MM_BN output tiles, 384 threads:
//   warp 0, lane 0   the producer: TMA loads of A (MM_BM x 64) and B (MM_BN x 64), 128-byte swizzle,
//                    into an MM_STAGES-deep ring (mbarriers full[s] / empty[s]);
//   warps 1-3        the gelu' warps: the tile's X lands by TMA in xbuf (MM_BM x MM_BN, boxes of 64
//                    columns, 128-byte swizzle); while the main loop runs they turn it in place into
//                    fp16 g and arrive on gready. Lane 0 of warp 1 also drives xbuf's TMA: the store of
//                    the finished tile (after dready), then the load of the next tile's X (xfull);
//   warps 4-11       two consumer warpgroups, rows 0-63 and 64-127 of the tile: wgmma m64nMM_BNk16 from
//                    the ring, then bf16(acc * g) written over g in xbuf (each value where its g was),
//                    a proxy fence, and dready.
// So gelu' and X's traffic run beside the tensor cores. With MM_CLUSTER = 2 the two CTAs of a cluster
// take vertically adjacent tiles of one B tile: each loads half of B and multicasts it to both, so the
// ring's L2 reads fall from MM_BM + MM_BN to MM_BM + MM_BN / 2 rows a k step (session 29: the single
// CTA's main loop is bound by those reads); a stage is then free once the consumers of both CTAs
// released it (one arrival per warpgroup and CTA, as cuBLAS-like kernels do, not one per thread).
// Deterministic: every output element is one fixed-order accumulation (no split K, no atomics).
//
// The defines are the variants bench/dgelu_gemm.py --configs compares (kernels.MM_DGELU holds the
// launcher's copy of the defaults; a test compares them):
//   MM_BN        256 | 192, the tile's columns (the step's N, 6144 and 3072, are multiples of 2 x either);
//   MM_STAGES    the ring's depth (3 at MM_BN 256, 4 at 192 fill the shared memory);
//   MM_CLUSTER   1 | 2, CTAs a cluster along M, sharing B;
//   MM_CLUSTER_N 1 | 2, along N, sharing A (2 x 2 clusters read a quarter less again);
//   MM_GROUP     unit rows a group of the schedule, for L2 reuse;
//   MM_LDSM      1: the epilogue moves g and D with ldmatrix / stmatrix (8 values an instruction, not 2);
//   MM_XREG      1: the gelu' warps read X's tile from global memory into registers and write only g into
//                xbuf (no TMA load of X into shared memory, no in-place pass over it);
//   MM_WATCHDOG  the ns after which a barrier wait traps (4 s);
//   MM_HANG      1: the producer issues no load, so the consumers' first wait never ends, as a broken
//                barrier's would (tests only: with a small MM_WATCHDOG the launch must fail, not hang).

#ifndef MM_BN
#define MM_BN 256
#endif
#ifndef MM_STAGES
#define MM_STAGES 3
#endif
#ifndef MM_CLUSTER
#define MM_CLUSTER 1
#endif
#ifndef MM_CLUSTER_N
#define MM_CLUSTER_N 1
#endif
#ifndef MM_GROUP
#define MM_GROUP 8
#endif
#ifndef MM_LDSM
#define MM_LDSM 0
#endif
#ifndef MM_XREG
#define MM_XREG 0
#endif
#ifndef MM_WATCHDOG
#define MM_WATCHDOG 4000000000
#endif
#ifndef MM_HANG
#define MM_HANG 0
#endif
#define MM_BM 128
#define MM_BK 64
#define MM_CS (MM_CLUSTER * MM_CLUSTER_N)               // CTAs a cluster
#define MM_PEERS (MM_CLUSTER + MM_CLUSTER_N - 1)         // CTAs whose loads land in a CTA's ring, itself included
#define MM_THREADS 384

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// CUtensorMap's storage (cuda.h is not needed under NVRTC): 128 opaque bytes the host encodes
struct __align__(64) TmaDesc { unsigned long long v[16]; };

#define MM_A_BYTES (MM_BM * MM_BK * 2)
#define MM_B_BYTES (MM_BN * MM_BK * 2)
#define MM_X_BYTES (MM_BM * MM_BN * 2)
#define MM_GELU_THREADS 96

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// arrive on the barrier at the same offset in CTA `cta` of this cluster
__device__ __forceinline__ void mbar_arrive_cta(unsigned bar, unsigned cta) {
    asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
                 "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar), "r"(cta) : "memory");
}
// until the phase of parity `parity` has completed. A wait that never ends (a barrier count or phase gone
// wrong) traps once it has lasted MM_WATCHDOG ns by the global timer (read every 1024 polls: a try_wait may
// itself suspend for a while), so the launch fails with an error where it would hang the process; no wait
// of a working launch comes near it.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    unsigned done, polls = 0;
    unsigned long long t0 = 0;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        if (!done && (++polls & 1023u) == 0) {
            unsigned long long now;
            asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
            if (t0 == 0) t0 = now;
            else if (now - t0 > (unsigned long long)MM_WATCHDOG) __trap();
        }
    } while (!done);
}

// 2-D TMA: box at (c0 = column, c1 = row) of the map's tensor into shared memory, completing on bar
__device__ __forceinline__ void tma_load(unsigned dst, const TmaDesc* map, unsigned bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
                 ::"r"(dst), "l"(map), "r"(bar), "r"(c0), "r"(c1) : "memory");
}
// the same box into every CTA of `mask` (same offsets there), completing on each one's bar
__device__ __forceinline__ void tma_load_mc(unsigned dst, const TmaDesc* map, unsigned bar, int c0, int c1,
                                            unsigned short mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%3, %4}], [%2], %5;\n"
                 ::"r"(dst), "l"(map), "r"(bar), "r"(c0), "r"(c1), "h"(mask) : "memory");
}
__device__ __forceinline__ void tma_store(const TmaDesc* map, unsigned src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n"
                 ::"l"(map), "r"(src), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// the committed stores have read their shared memory / have completed
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// wgmma shared-memory descriptor of a K-major tile with 128-byte swizzle (rows of 64 bf16, 8-row groups
// 1024 bytes apart, the tile 1024-byte aligned): start >> 4, LBO 16 (unused when swizzled), SBO 1024,
// layout type 1 (128B). The k16 slice kk starts 32 kk bytes into the row.
__device__ __forceinline__ unsigned long long sw128_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

#define WG_SS_N256                                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                        \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "  \
                 "%128, %129, p, 1, 1, 0, 0;\n}\n"                                                    \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])  \
                 : "l"(da), "l"(db), "r"(scale_d))
#define WG_SS_N192                                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"                                        \
                 "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "  \
                 "%96, %97, p, 1, 1, 0, 0;\n}\n"                                                    \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])  \
                 : "l"(da), "l"(db), "r"(scale_d))

// d (64 x MM_BN fp32 a warpgroup, MM_BN / 2 registers a thread) (+)= A (64 x 16) B (MM_BN x 16)^T, both
// from shared memory; scale_d = 0 overwrites d.
__device__ __forceinline__ void wgmma_ss(float* d, unsigned long long da, unsigned long long db, int scale_d) {
#if MM_BN == 256
    WG_SS_N256;
#elif MM_BN == 192
    WG_SS_N192;
#else
#error "mm_dgelu.cu: MM_BN is 256 or 192"
#endif
}
__device__ __forceinline__ void mm_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void mm_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// until at most N committed groups run; with N = 0 the accumulators are final, and the empty asm keeps
// the compiler from moving their uses above the wait (with a group still running nothing may touch them)
template <int N>
__device__ __forceinline__ void mm_wait(float* d) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
    if constexpr (N == 0) {
#pragma unroll
        for (int i = 0; i < MM_BN / 2; ++i) asm volatile("" : "+f"(d[i])::"memory");
    }
}

// Unit u of the persistent schedule (MM_CLUSTER x MM_CLUSTER_N tiles, one per CTA of a cluster), in groups
// of MM_GROUP unit rows that walk N column by column, so the CTAs running at once share A and B in L2.
__device__ __forceinline__ void unit_at(int u, int units_m, int units_n, int& um, int& un) {
    const int per = MM_GROUP * units_n, first = (u / per) * MM_GROUP, rows = min(MM_GROUP, units_m - first);
    const int r = u % per;
    um = first + r % rows;
    un = r / rows;
}

// g of two bf16 x (one 32-bit word) as two fp16 (one word): gelu_grad_f in fp32, rounded to nearest
__device__ __forceinline__ unsigned gelu_grad_pair(unsigned w) {
    const float lo = gelu_grad_f(__uint_as_float(w << 16)), hi = gelu_grad_f(__uint_as_float(w & 0xFFFF0000u));
    return (unsigned)from_f<f16_t>(lo).x | ((unsigned)from_f<f16_t>(hi).x << 16);
}

// bf16(a0 * g0), bf16(a1 * g1) as one word, from two fp16 g in one word (the epilogue's product, rounded once)
__device__ __forceinline__ unsigned mul_pair(float a0, float a1, unsigned gw) {
    f16_t lo, hi;
    lo.x = (unsigned short)(gw & 0xFFFFu);
    hi.x = (unsigned short)(gw >> 16);
    return (unsigned)from_f<bf16_t>(__fmul_rn(a0, to_f(lo))).x | ((unsigned)from_f<bf16_t>(__fmul_rn(a1, to_f(hi))).x << 16);
}

// Thread t < MM_PEERS of a consumer warpgroup frees a stage in peer t: t < MM_CLUSTER the CTAs of its column
// (B's sources, itself at t = ry), then the others of its row (A's sources).
__device__ __forceinline__ void release(unsigned bar, int t, int ry, int rx) {
#if MM_CS > 1
    const int peer = t < MM_CLUSTER ? t + MM_CLUSTER * rx
                                    : ry + MM_CLUSTER * ((t - MM_CLUSTER) + ((t - MM_CLUSTER) >= rx ? 1 : 0));
    mbar_arrive_cta(bar, (unsigned)peer);
#else
    mbar_arrive(bar);
#endif
}

// Cluster rank r sits at (ry, rx) = (r % MM_CLUSTER, r / MM_CLUSTER) of its unit: tile rows m0 = (MM_CLUSTER um
// + ry) MM_BM, columns n0 = (MM_CLUSTER_N un + rx) MM_BN. The MM_CLUSTER CTAs of one rx share a B tile and
// each loads its part ry, multicast to them; the MM_CLUSTER_N CTAs of one ry share an A tile, part rx. So a
// stage of a CTA's ring is written by its MM_PEERS peers (its column and its row) and freed by theirs.
// maps: A (box 64 x MM_BM / MM_CLUSTER_N), B (box 64 x MM_BN / MM_CLUSTER), X and D (box 64 x MM_BM): the
// launcher encodes them in global memory (kernels.MmDgelu.maps). M % (MM_BM MM_CLUSTER) == N % (MM_BN
// MM_CLUSTER_N) == K % 64 == 0; gridDim.x a multiple of MM_CS; dynamic shared memory kernels.mm_dgelu_smem.
extern "C" __global__ void __launch_bounds__(MM_THREADS, 1)
#if MM_CS > 1
__cluster_dims__(MM_CS, 1, 1)
#endif
k_mm_dgelu(const TmaDesc* __restrict__ maps, int M, int N, int K, const uint4* __restrict__ xg) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const unsigned raw = smem_u32(smem), base = (raw + 1023u) & ~1023u;  // 128B swizzle: 1024-aligned tiles
    const unsigned sA = base, sB = sA + MM_STAGES * MM_A_BYTES, sX = sB + MM_STAGES * MM_B_BYTES;
    const unsigned bars = sX + MM_X_BYTES;
#define FULL(s) (bars + 8u * (s))
#define EMPTY(s) (bars + 8u * (MM_STAGES + (s)))
#define XFULL (bars + 16u * MM_STAGES)
#define GREADY (XFULL + 8u)
#define DREADY (XFULL + 16u)
    unsigned char* const xbuf = smem + (sX - raw);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned rank = MM_CS > 1 ? cluster_rank() : 0u;
    const int ry = (int)rank % MM_CLUSTER, rx = (int)rank / MM_CLUSTER;
    const int units_m = M / (MM_BM * MM_CLUSTER), units_n = N / (MM_BN * MM_CLUSTER_N), units = units_m * units_n;
    const int first = blockIdx.x / MM_CS, step = gridDim.x / MM_CS, kbs = K / MM_BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < MM_STAGES; ++s) {
            mbar_init(FULL(s), 1);
            mbar_init(EMPTY(s), 2 * MM_PEERS);  // one arrival per consumer warpgroup of each CTA it feeds
        }
        mbar_init(XFULL, 1);
        mbar_init(GREADY, MM_GELU_THREADS);
        mbar_init(DREADY, 256);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
#if MM_CS > 1
    cluster_sync();  // the peer's barriers exist before any multicast or remote arrival reaches them
#else
    __syncthreads();
#endif

    if (warp == 0) {
        // ------------------------------------------------------------------ producer: the A/B ring
        if (lane == 0 && !MM_HANG) {
            unsigned short row_mask = 0, col_mask = 0;
            for (int i = 0; i < MM_CLUSTER_N; ++i) row_mask |= (unsigned short)(1u << (ry + MM_CLUSTER * i));
            for (int i = 0; i < MM_CLUSTER; ++i) col_mask |= (unsigned short)(1u << (i + MM_CLUSTER * rx));
            int it = 0;
            for (int u = first; u < units; u += step) {
                int um, un;
                unit_at(u, units_m, units_n, um, un);
                const int m0 = (um * MM_CLUSTER + ry) * MM_BM, n0 = (un * MM_CLUSTER_N + rx) * MM_BN;
                for (int kb = 0; kb < kbs; ++kb, ++it) {
                    const int s = it % MM_STAGES;
                    mbar_wait(EMPTY(s), ((it / MM_STAGES) & 1) ^ 1);  // the first pass finds every stage free
                    mbar_expect_tx(FULL(s), MM_A_BYTES + MM_B_BYTES);
#if MM_CLUSTER_N > 1  // part rx of A to the CTAs of row ry
                    tma_load_mc(sA + s * MM_A_BYTES + rx * (MM_A_BYTES / MM_CLUSTER_N), maps + 0, FULL(s), kb * MM_BK,
                                m0 + rx * (MM_BM / MM_CLUSTER_N), row_mask);
#else
                    tma_load(sA + s * MM_A_BYTES, maps + 0, FULL(s), kb * MM_BK, m0);
#endif
#if MM_CLUSTER > 1    // part ry of B to the CTAs of column rx
                    tma_load_mc(sB + s * MM_B_BYTES + ry * (MM_B_BYTES / MM_CLUSTER), maps + 1, FULL(s), kb * MM_BK,
                                n0 + ry * (MM_BN / MM_CLUSTER), col_mask);
#else
                    tma_load(sB + s * MM_B_BYTES, maps + 1, FULL(s), kb * MM_BK, n0);
#endif
                }
            }
        }
    } else if (warp < 4) {
        // ------------------------------------------------------------------ gelu' warps and xbuf's TMA
        const int gt = threadIdx.x - 32;
        int j = 0, pm0 = 0, pn0 = 0;
        for (int u = first; u < units; u += step, ++j) {
            int um, un;
            unit_at(u, units_m, units_n, um, un);
            const int m0 = (um * MM_CLUSTER + ry) * MM_BM, n0 = (un * MM_CLUSTER_N + rx) * MM_BN;
            if (gt == 0) {
                if (j > 0) {  // the previous tile's D out first: xbuf is free once the store has read it
                    mbar_wait(DREADY, (j - 1) & 1);
                    for (int b = 0; b < MM_BN / 64; ++b) tma_store(maps + 3, sX + b * (MM_BM * 128), pn0 + 64 * b, pm0);
                    bulk_commit();
                    bulk_wait_read();
                }
#if MM_XREG
                mbar_arrive(XFULL);  // xbuf is free for this tile's g: the gelu' warps read X themselves
#else
                mbar_expect_tx(XFULL, MM_X_BYTES);
                for (int b = 0; b < MM_BN / 64; ++b) tma_load(sX + b * (MM_BM * 128), maps + 2, XFULL, n0 + 64 * b, m0);
#endif
            }
            pm0 = m0;
            pn0 = n0;
            mbar_wait(XFULL, j & 1);
#if MM_XREG
            // X's tile from global memory, 16 bytes a load, row by row; g goes where TMA's 128-byte swizzle
            // would have put X: box k / 8 (64 columns each), row r, chunk (k % 8) ^ (r % 8)
            constexpr int CPR = MM_BN / 8;  // 16-byte chunks a tile row
            const uint4* const xt = xg + ((size_t)m0 * (size_t)N + (size_t)n0) / 8;
            const size_t rowc = (size_t)N / 8;
#pragma unroll 4
            for (int c = gt; c < MM_BM * CPR; c += MM_GELU_THREADS) {
                const int r = c / CPR, k = c % CPR;
                uint4 v = __ldg(xt + (size_t)r * rowc + k);
                v.x = gelu_grad_pair(v.x);
                v.y = gelu_grad_pair(v.y);
                v.z = gelu_grad_pair(v.z);
                v.w = gelu_grad_pair(v.w);
                *reinterpret_cast<uint4*>(xbuf + (k >> 3) * (MM_BM * 128) + r * 128 + (((k & 7) ^ (r & 7)) << 4)) = v;
            }
#else
            uint4* const xv = reinterpret_cast<uint4*>(xbuf);  // in place, position by position: no swizzle needed
            for (int c = gt; c < MM_X_BYTES / 16; c += MM_GELU_THREADS) {
                uint4 v = xv[c];
                v.x = gelu_grad_pair(v.x);
                v.y = gelu_grad_pair(v.y);
                v.z = gelu_grad_pair(v.z);
                v.w = gelu_grad_pair(v.w);
                xv[c] = v;
            }
#endif
            mbar_arrive(GREADY);
        }
        if (gt == 0 && j > 0) {
            mbar_wait(DREADY, (j - 1) & 1);
            for (int b = 0; b < MM_BN / 64; ++b) tma_store(maps + 3, sX + b * (MM_BM * 128), pn0 + 64 * b, pm0);
            bulk_commit();
            bulk_wait_all();
        }
    } else {
        // ------------------------------------------------------------------ consumers: wgmma, epilogue
        const int wg = (warp - 4) >> 2, t = threadIdx.x - 128 * (1 + wg);
        float acc[MM_BN / 2];
#pragma unroll
        for (int i = 0; i < MM_BN / 2; ++i) acc[i] = 0.0f;
        int it = 0, j = 0;
        for (int u = first; u < units; u += step, ++j) {
            int prev = -1;
            for (int kb = 0; kb < kbs; ++kb, ++it) {
                const int s = it % MM_STAGES;
                mbar_wait(FULL(s), (it / MM_STAGES) & 1);
                mm_fence();
                const unsigned a0 = sA + s * MM_A_BYTES + wg * (64 * 128), b0 = sB + s * MM_B_BYTES;
#pragma unroll
                for (int kk = 0; kk < MM_BK / 16; ++kk)
                    wgmma_ss(acc, sw128_desc(a0 + 32 * kk), sw128_desc(b0 + 32 * kk), (kb | kk) != 0);
                mm_commit();
                if (prev >= 0) {  // the previous stage's MMAs are done: release it to every CTA that fills it
                    mm_wait<1>(acc);
                    if (t < MM_PEERS) release(EMPTY(prev), t, ry, rx);
                }
                prev = s;
            }
            mm_wait<0>(acc);
            if (t < MM_PEERS) release(EMPTY(prev), t, ry, rx);
            // epilogue: the accumulator layout of m64nNk16 is, for thread (warp w, lane l) of the warpgroup,
            // rows 16 w + l / 4 (+ 8) and columns 8 n + 2 (l % 4) (+ 1): acc[4 n + 2 h + e]
            // xbuf holds MM_BN / 64 boxes of [MM_BM rows][64 columns]; TMA's 128-byte swizzle puts the 16-byte
            // chunk k of row r at chunk k ^ (r % 8).
            mbar_wait(GREADY, j & 1);
#if MM_LDSM
            // ldmatrix / stmatrix .x4: an 8x8 16-bit matrix is the m16n8 accumulator layout (thread l: row l / 4,
            // columns 2 (l % 4), + 1), so one instruction moves 8 values a thread. Lane i gives the address of
            // row i % 8 of matrix i / 8: rows + 8 for the odd matrices, chunk n + 1 for the upper two.
            {
                const int rr = lane & 7, mi = lane >> 3;
                unsigned char* const rowp = xbuf + (64 * wg + 16 * ((warp - 4) & 3) + rr + 8 * (mi & 1)) * 128;
#pragma unroll
                for (int n = 0; n < MM_BN / 8; n += 2) {
                    const int ch = n + (mi >> 1);
                    const unsigned at = smem_u32(rowp + (ch >> 3) * (MM_BM * 128) + ((((unsigned)ch & 7u) ^ (unsigned)rr) << 4));
                    unsigned g0, g1, g2, g3;
                    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                                 : "=r"(g0), "=r"(g1), "=r"(g2), "=r"(g3) : "r"(at) : "memory");
                    const unsigned o0 = mul_pair(acc[4 * n], acc[4 * n + 1], g0);
                    const unsigned o1 = mul_pair(acc[4 * n + 2], acc[4 * n + 3], g1);
                    const unsigned o2 = mul_pair(acc[4 * n + 4], acc[4 * n + 5], g2);
                    const unsigned o3 = mul_pair(acc[4 * n + 6], acc[4 * n + 7], g3);
                    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                                 ::"r"(at), "r"(o0), "r"(o1), "r"(o2), "r"(o3) : "memory");
                }
            }
#else
            // one 32-bit pair at a time; r % 8 = l / 4 for both rows of a thread. The addresses are formed here, at
            // use, from two values: hoisted, they cost 40 spilled registers.
            {
                const unsigned sw = (unsigned)(lane >> 2) << 4;
                unsigned char* const row0 = xbuf + (64 * wg + 16 * ((warp - 4) & 3) + (lane >> 2)) * 128 + 4 * (lane & 3);
#pragma unroll
                for (int n = 0; n < MM_BN / 8; ++n) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        unsigned* const p = reinterpret_cast<unsigned*>(row0 + h * (8 * 128) + (n >> 3) * (MM_BM * 128) +
                                                                       ((((unsigned)n & 7u) << 4) ^ sw));
                        *p = mul_pair(acc[4 * n + 2 * h], acc[4 * n + 2 * h + 1], *p);
                    }
                }
            }
#endif
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the TMA store reads these writes
            mbar_arrive(DREADY);
        }
    }
#if MM_CS > 1
    cluster_sync();  // no CTA leaves while its peer may still multicast into it or arrive on its barriers
#endif
#undef FULL
#undef EMPTY
#undef XFULL
#undef GREADY
#undef DREADY
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL
