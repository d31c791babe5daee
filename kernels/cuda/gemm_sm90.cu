/*
 * gemm_sm90 — the Hopper grouped GEMM (sm_90a): wgmma with both operands in shared memory, weight
 * tiles brought by the tensor memory accelerator (TMA), warp-specialised.
 *
 * Persistent: one CTA per SM walks the BM x BN tiles (BN = 128 or 256), each of one expert, with
 * 1 + CONSUMERS warpgroups. Launched in clusters of MC CTAs along M (MC = 2 at BN = 256: the
 * table in tile_config.c), the CTAs of a cluster take consecutive m-tiles at the same n-tile; when
 * those are of one expert each CTA's producer brings BN/MC rows of the weight tile and multicasts
 * them to all, so the weights cross from L2 (and, where L2 would not have kept them, from HBM)
 * once per cluster instead of once per CTA. A stage is then refilled only once every consumer of
 * the cluster has released it (the consumers arrive on each CTA's empty barrier).
 *   warpgroup 0, the producer, fills STAGES shared-memory stages: one thread issues the TMA copy of
 *   the weight tile, and (for the up projection) all its threads gather the token rows of A with
 *   16-byte cp.async straight from X[token(row)] — Hopper's TMA cannot gather rows, and a permuted
 *   copy of X would cost a full extra pass over the activations. cp.async writes through the
 *   generic proxy and wgmma reads through the async proxy, so each producer thread waits for its
 *   copies of a stage (LAG stages behind the newest), fences the proxies, and only then arrives on
 *   the stage's barrier. Without gather (the down projection reads H in order) A also comes by TMA.
 *   warpgroups 1 .. CONSUMERS, the consumers, each run m64nBNk16 wgmma over 64 of the tile's rows,
 *   keep one wgmma group in flight, release a stage once the group that read it has finished, and
 *   run the epilogue of epilogue_sm90.cuh: through a staging buffer of their own, out by TMA
 *   store.
 * Shared rows are 128 bytes (BK = 64 two-byte elements), 128-byte swizzled: the layout TMA writes
 * with CU_TENSOR_MAP_SWIZZLE_128B, the cp.async path writes with moed_cuda_swz128, and the wgmma
 * descriptors name. Each output element is one fixed-order sum over K, independent of the tile's
 * other rows.
 */
#include "epilogue_sm90.cuh"
#include "gemm_common.cuh"
#include "launch.cuh"
#include "tensor_map.h"

#include "moed_dtype.h"
#include "moed_err.h"

#include <atomic>
#include <cuda.h>
#include <cuda_runtime.h>

namespace
{

namespace ptx = moed::ptx;

/* ---- the tile, the warpgroups and their budgets --------------------------------------------- */

constexpr int BM = 128;               /* rows of a tile */
constexpr int BK = 64;                /* k of a stage */
constexpr int STAGES = 4;             /* shared-memory stages in the producer/consumer ring */
constexpr int ELEM = MOED_CUDA_CSIZE; /* bytes of a bf16 or f16 element */
constexpr int ROW_BYTES = BK * ELEM;
static_assert(ROW_BYTES == (int)ptx::sw128_row_bytes, "a stage row is one 128-byte swizzle row");

constexpr int WG_THREADS = 128;
constexpr int CONSUMERS = 2; /* consumer warpgroups, after the one producer */
constexpr int THREADS = (1 + CONSUMERS) * WG_THREADS;
constexpr int WGMMA_M = 64, WGMMA_K = 16; /* the instruction's shape (N is the tile's BN) */
static_assert(BM == CONSUMERS * WGMMA_M, "each consumer warpgroup owns 64 rows of the tile");
static_assert(WGMMA_M == MOED_CUDA_EPI_ROWS && WG_THREADS == 128, "the epilogue's warpgroup");
static_assert(BK % WGMMA_K == 0, "whole wgmma k-steps per stage");

/* Registers per thread after setmaxnreg: the producer only computes addresses; a consumer holds
 * BN/2 fp32 accumulators (128 at BN = 256) plus the epilogue's temporaries. Together they must fit
 * the SM's register file, since the CTA is alone on its SM. */
constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;
static_assert(ptx::valid_maxnreg<PRODUCER_REGS> && ptx::valid_maxnreg<CONSUMER_REGS>,
              "setmaxnreg counts");
static_assert(WG_THREADS * (PRODUCER_REGS + CONSUMERS * CONSUMER_REGS) <= 65536,
              "the register budgets exceed the register file");

/* The shared-memory layout, from a base aligned to the swizzle atom: STAGES A stages, STAGES B
 * stages, each consumer's epilogue staging, then the full and empty barriers of each stage. Kernel
 * and launcher both read it here. */
template <int BN> struct smem_layout {
    static constexpr int a_stage = BM * ROW_BYTES, b_stage = BN * ROW_BYTES;
    static constexpr int a = 0, b = a + STAGES * a_stage;
    static constexpr int epi = b + STAGES * b_stage;
    static constexpr int full = epi + CONSUMERS * MOED_CUDA_EPI_STAGE;
    static constexpr int empty = full + STAGES * (int)ptx::mbar_bytes;
    static constexpr int end = empty + STAGES * (int)ptx::mbar_bytes;
    static constexpr int align = ptx::sw128_atom_bytes;
    /* What the launch asks for: the layout plus the slack to align its base. */
    static constexpr int bytes = align + end;
    static_assert(a_stage % align == 0 && b_stage % align == 0 && MOED_CUDA_EPI_STAGE % align == 0,
                  "stages and staging buffers start on swizzle atoms");
    static_assert(full % ptx::mbar_bytes == 0, "barriers are 8-byte aligned");
    static_assert(bytes <= 227 * 1024, "over the 227 KiB of shared memory a Hopper block may have");
};

/* The device code, and the constants only it uses, exist only in the sm_90a pass; the other passes
 * see an empty kernel. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOED_CUDA_SM90_ENABLED 1

constexpr int WARP = 32, WG_WARPS = WG_THREADS / WARP;

/* A thread's fields (warpgroup, warp, lane, gather chunk) by shift and mask: every size here is a
 * power of two, and tid is never negative. */
constexpr int log2_of(int v)
{
    return v > 1 ? 1 + log2_of(v / 2) : 0;
}

/* The gathering producer: each thread copies one 16-byte chunk of a row per pass, a pass covers
 * ROWS_PER_PASS rows, A_PASSES passes the tile. */
constexpr int CHUNK = 16, ROW_CHUNKS = ROW_BYTES / CHUNK;
constexpr int ROWS_PER_PASS = WG_THREADS / ROW_CHUNKS, A_PASSES = BM / ROWS_PER_PASS;
static_assert(WG_THREADS % ROW_CHUNKS == 0 && BM % ROWS_PER_PASS == 0, "the gather's split");
constexpr int WG_SHIFT = log2_of(WG_THREADS), WARP_SHIFT = log2_of(WARP);
constexpr int CHUNK_SHIFT = log2_of(ROW_CHUNKS);
static_assert((1 << WG_SHIFT) == WG_THREADS && (1 << WARP_SHIFT) == WARP &&
                  (1 << CHUNK_SHIFT) == ROW_CHUNKS && (WG_WARPS & (WG_WARPS - 1)) == 0,
              "powers of two");
constexpr int LAG = 2; /* stages a producer thread keeps in flight before signalling the oldest */
/* The gathering producer signals stage i - LAG once it may fill stage i, which waits for use
 * i - STAGES to be released; a consumer releases a use only once the next one is full. So
 * LAG = STAGES - 1 would wait in a circle. */
static_assert(LAG + 2 <= STAGES, "the producer signals a stage before it needs that one released");

/* Arrivals that complete a stage's barriers: `full` once the stage has landed (the TMA thread's
 * expect_tx, plus every gathering thread after its copies; the bytes multicast by the cluster's
 * other CTAs count down the same expect_tx), `empty` once the consumers of every CTA of the
 * cluster have read it (lane 0 of each consumer warp). */
template <bool GATHER> constexpr int FULL_ARRIVALS = GATHER ? WG_THREADS + 1 : 1;
__device__ constexpr int empty_arrivals(int mc)
{
    return mc * CONSUMERS * WG_WARPS;
}
#endif

template <typename T, int BN, bool GATHER, int EPI, int MC>
__global__ void __launch_bounds__(THREADS, 1)
    gemm_sm90_kernel(const __grid_constant__ CUtensorMap tm_b,
                     const __grid_constant__ CUtensorMap tm_a,
                     const __grid_constant__ CUtensorMap tm_c, const moed_cuda_gemm g, int num_n,
                     int total)
{
#ifdef MOED_CUDA_SM90_ENABLED
    using L = smem_layout<BN>;
    constexpr int NACC = WGMMA_M * BN / WG_THREADS; /* fp32 accumulators per consumer thread */
    constexpr uint32_t BAR = ptx::mbar_bytes;
    constexpr int B_SLICE = L::b_stage / MC; /* the weight rows one CTA of a cluster brings */
    static_assert(B_SLICE % L::align == 0, "each slice starts on a swizzle atom");

    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (ptx::smem_addr(smem_raw) + L::align - 1) & ~(uint32_t)(L::align - 1);
    const uint32_t sA = base + L::a, sB = base + L::b;
    const uint32_t full = base + L::full, empty = base + L::empty;
    const int tid = threadIdx.x, wg = tid >> WG_SHIFT, lane = tid & (WARP - 1);
    const int ktiles = g.k / BK;

    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            ptx::mbar_init(full + BAR * s, FULL_ARRIVALS<GATHER>);
            ptx::mbar_init(empty + BAR * s, empty_arrivals(MC));
        }
        ptx::mbar_fence_init();
        ptx::fence_proxy_async();
    }
    /* The cluster's other CTAs arrive on these barriers: they must exist before any CTA starts. */
    if constexpr (MC > 1)
        ptx::cluster_sync();
    else
        __syncthreads();
    const int rank = MC > 1 ? (int)ptx::cluster_rank() : 0;
    /* A consumer warp's release of a stage, on the barrier of every CTA of the cluster. One lane
     * arrives on all of them: a lane-dependent target would move the stage barriers out of
     * uniform registers (NOTES, issue 16). */
    uint32_t empty_of[MC]; /* each CTA's empty barriers, in the cluster's shared window */
#pragma unroll
    for (int c = 0; c < MC; c++) empty_of[c] = MC > 1 ? ptx::cluster_map(empty, c) : empty;
    auto release = [&](int stage) {
        if (lane != 0) return;
        if constexpr (MC == 1)
            ptx::mbar_arrive(empty + BAR * stage);
        else
#pragma unroll
            for (int c = 0; c < MC; c++) ptx::mbar_arrive_cluster(empty_of[c] + BAR * stage);
    };

    /* Persistent: every cluster walks units id = blockIdx.x / MC, + gridDim.x / MC, ..., each CTA
     * taking its rank's tile of the unit; producer and consumers walk the same sequence, each
     * resolving its next tile (dependent loads of the tile tables) during the current tile's first
     * k-step so the latency hides behind it; `it` counts k-steps across tiles so stage and phase
     * carry over, and the producer fills the next tile's first stages while the consumers run this
     * tile's epilogue. */
    int it = 0, id = blockIdx.x / MC;
    moed_cuda_tile cur, nxt;
    bool have = moed_cuda_next_tile<MC>(g, num_n, total, id, cur, rank);
    if (wg == 0) {
        ptx::setmaxnreg_dec<PRODUCER_REGS>();
        if (!GATHER && tid != 0) return; /* TMA alone: one thread issues everything */
        const int kc = tid & (ROW_CHUNKS - 1);
        while (have) {
            int src[GATHER ? A_PASSES : 1];
            if constexpr (GATHER) {
#pragma unroll
                for (int i = 0; i < A_PASSES; i++) {
                    const int r = cur.row0 + (tid >> CHUNK_SHIFT) + ROWS_PER_PASS * i;
                    int s = -1;
                    if (r < cur.row_end) s = g.a_rows ? g.a_rows[r] : r;
                    src[i] = (s >= 0 && s < g.a_rows_total) ? s : -1;
                }
            }
            const int b_row = cur.e * g.n + cur.nt * BN;
            bool have_next = false;
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const int s = it % STAGES;
                ptx::mbar_wait(empty + BAR * s, ((it / STAGES) & 1) ^ 1);
                if (tid == 0) {
                    ptx::mbar_arrive_expect_tx(full + BAR * s,
                                               L::b_stage + (GATHER ? 0 : L::a_stage));
                    if (MC == 1 || !cur.shared_b) /* the whole tile, for this CTA alone */
                        for (int j = 0; j < MC; j++)
                            ptx::tma_load_2d(sB + s * L::b_stage + j * B_SLICE, &tm_b,
                                             full + BAR * s, kt * BK, b_row + j * (BN / MC));
                    else
                        ptx::tma_load_2d_multicast(sB + s * L::b_stage + rank * B_SLICE, &tm_b,
                                                   full + BAR * s, kt * BK,
                                                   b_row + rank * (BN / MC), (1u << MC) - 1);
                    if constexpr (!GATHER)
                        ptx::tma_load_2d(sA + s * L::a_stage, &tm_a, full + BAR * s, kt * BK,
                                         cur.row0);
                }
                if constexpr (GATHER) {
                    const T *a = static_cast<const T *>(g.a) + kt * BK + kc * (CHUNK / ELEM);
#pragma unroll
                    for (int i = 0; i < A_PASSES; i++) {
                        const int row = (tid >> CHUNK_SHIFT) + ROWS_PER_PASS * i;
                        ptx::cp_async16(sA + s * L::a_stage + moed_cuda_swz128(row, kc),
                                        a + (int64_t)(src[i] < 0 ? 0 : src[i]) * g.lda,
                                        src[i] < 0 ? 0 : CHUNK);
                    }
                    ptx::cp_async_commit();
                    if (kt >= LAG) {
                        ptx::cp_async_wait<LAG>();
                        ptx::fence_proxy_async();
                        ptx::mbar_arrive(full + BAR * ((it - LAG) % STAGES));
                    }
                }
                if (kt == 0) {
                    id += gridDim.x / MC;
                    have_next = moed_cuda_next_tile<MC>(g, num_n, total, id, nxt, rank);
                }
            }
            if constexpr (GATHER) { /* signal the tile's last stages before moving on */
                ptx::cp_async_wait<0>();
                ptx::fence_proxy_async();
                for (int j = it - (ktiles < LAG ? ktiles : LAG); j < it; j++)
                    ptx::mbar_arrive(full + BAR * (j % STAGES));
            }
            cur = nxt;
            have = have_next;
        }
        /* The CTA must outlive the other CTAs' arrivals on its barriers: wait until the last use
         * of every stage has been released by the whole cluster. */
        if (MC > 1 && tid == 0)
            for (int j = 0; j < STAGES; j++, it++)
                ptx::mbar_wait(empty + BAR * (it % STAGES), ((it / STAGES) & 1) ^ 1);
        return;
    }

    ptx::setmaxnreg_inc<CONSUMER_REGS>();
    const int cw = wg - 1; /* this consumer's WGMMA_M rows of each tile */
    const uint32_t st = base + L::epi + cw * MOED_CUDA_EPI_STAGE; /* its epilogue's staging */
    uint8_t *const stp = smem_raw + (st - ptx::smem_addr(smem_raw));
    while (have) {
        float acc[NACC];
#pragma unroll
        for (int i = 0; i < NACC; i++) acc[i] = 0.0f;
        bool have_next = false;
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % STAGES;
            ptx::mbar_wait(full + BAR * s, (it / STAGES) & 1);
            ptx::wgmma_fence_operands(acc);
            ptx::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / WGMMA_K; kk++)
                ptx::wgmma_m64k16<T, BN>(
                    acc,
                    ptx::wgmma_desc_sw128(sA + s * L::a_stage + cw * WGMMA_M * ROW_BYTES +
                                          kk * WGMMA_K * ELEM),
                    ptx::wgmma_desc_sw128(sB + s * L::b_stage + kk * WGMMA_K * ELEM));
            ptx::wgmma_commit();
            if (kt == 0) {
                id += gridDim.x / MC;
                have_next = moed_cuda_next_tile<MC>(g, num_n, total, id, nxt, rank);
            }
            ptx::wgmma_wait<1>();
            ptx::wgmma_fence_operands(acc);
            if (kt > 0) release((it - 1) % STAGES);
        }
        ptx::wgmma_wait<0>();
        ptx::wgmma_fence_operands(acc);
        release((it - 1) % STAGES); /* the producers may refill it now */

        moed_cuda_staged_epilogue<T, EPI, BN>(g, &tm_c, acc, cur, cw, st, stp,
                                              tid & (WG_THREADS - 1));
        cur = nxt;
        have = have_next;
    }
    if ((tid & (WG_THREADS - 1)) == 0) ptx::bulk_wait<0>(); /* the last tile's stores */
#endif
}

/* A row-major [rows, cols] matrix of ELEM-byte elements, read in boxes of box_rows x BK columns. */
int tensor_map(CUtensorMap *m, int cdtype, const void *p, int64_t rows, int64_t cols, int64_t ld,
               int box_rows)
{
    return moed_cuda_tensor_map(m, cdtype == MOED_BF16 ? MOED_CUDA_TM_BF16 : MOED_CUDA_TM_F16, p,
                                rows, cols, ld, BK, box_rows, 1);
}

/* Clusters of MC CTAs (each alone on its SM) that fit on the current device at once: MC > 1 needs
 * MC SMs of one GPC, so it can be fewer than SMs / MC. The occupancy query depends only on the
 * kernel and the device: the caller keeps one cache per kernel, an entry per device. */
constexpr int CACHED_DEVICES = 16;
template <typename K>
int resident_clusters(K kern, int mc, int smem, std::atomic<int> (&cached)[CACHED_DEVICES])
{
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (mc == 1) return sms;
    const bool cacheable = dev >= 0 && dev < CACHED_DEVICES;
    if (cacheable && cached[dev].load(std::memory_order_relaxed) > 0)
        return cached[dev].load(std::memory_order_relaxed);
    cudaLaunchAttribute attrs[2];
    const cudaLaunchConfig_t cfg = moed_cuda_config(
        attrs, { dim3(sms / mc * mc), dim3(THREADS), (size_t)smem, mc }, nullptr, false);
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kern, &cfg) != cudaSuccess || n < 1) n = sms / mc;
    if (cacheable) cached[dev].store(n, std::memory_order_relaxed);
    return n;
}

template <typename T, int BN, bool GATHER, int EPI, int MC>
int launch(const moed_cuda_gemm *g, moed_cuda_stream s)
{
    CUtensorMap tm_b, tm_a, tm_c;
    int rc = tensor_map(&tm_b, g->cdtype, g->b, (int64_t)g->b_experts * g->n, g->k, g->k, BN / MC);
    if (!rc) rc = moed_cuda_epi_tensor_map(&tm_c, g);
    if (rc) return rc;
    if (GATHER)
        tm_a = tm_b; /* unused */
    else if ((rc = tensor_map(&tm_a, g->cdtype, g->a, g->a_rows_total, g->k, g->lda, BM)))
        return rc;

    constexpr int smem = smem_layout<BN>::bytes;
    auto kern = gemm_sm90_kernel<T, BN, GATHER, EPI, MC>;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
        cudaSuccess)
        return MOED_EDEVICE;
    const int num_n = g->n / BN;
    const int64_t units = (int64_t)num_n * ((g->max_tiles + MC - 1) / MC);
    if (units <= 0) return 0;
    if (units > 0x7fffffff) return MOED_EINVAL;
    /* Persistent: as many clusters as are resident at once walk the units. */
    static std::atomic<int> cached[CACHED_DEVICES];
    const int resident = resident_clusters(kern, MC, smem, cached);
    const int clusters = (int)(units < resident ? units : resident);
    return moed_cuda_launch(kern, { dim3(clusters * MC), dim3(THREADS), (size_t)smem, MC },
                            (cudaStream_t)s, false, tm_b, tm_a, tm_c, *g, num_n, (int)units);
}

/* The instantiations: gathered A only for the up projection's epilogues. */
template <typename T, int BN, int MC> int dispatch_bn(const moed_cuda_gemm *g, moed_cuda_stream s)
{
    const bool gather = g->a_rows != nullptr;
    return moed_cuda_epi_dispatch(g->epi, [&]<int EPI>() -> int {
        if constexpr (EPI == MOED_CUDA_EPI_STORE)
            return gather ? MOED_EINVAL : launch<T, BN, false, EPI, MC>(g, s);
        else
            return gather ? launch<T, BN, true, EPI, MC>(g, s)
                          : launch<T, BN, false, EPI, MC>(g, s);
    });
}

/* Clusters only at bn 256: at bn 128 they measured slower, and the table never asks for them. */
template <typename T> int dispatch(const moed_cuda_gemm *g, int bn, int mc, moed_cuda_stream s)
{
    if (mc == 2) return dispatch_bn<T, 256, 2>(g, s);
    return bn == 256 ? dispatch_bn<T, 256, 1>(g, s) : dispatch_bn<T, 128, 1>(g, s);
}

} // namespace

extern "C" int moed_cuda_gemm_sm90(const moed_cuda_gemm *g, int bn, int cluster, moed_cuda_stream s)
{
    /* TMA reads A and B and writes C: 16-byte aligned rows */
    if (g->bm != BM || (bn != 128 && bn != 256) || g->n % bn || g->k % BK || g->lda % 8 ||
        !moed_cuda_epi_c_ok(g) || (cluster != 1 && !(cluster == 2 && bn == 256)))
        return MOED_EINVAL;
    if (g->cdtype == MOED_BF16) return dispatch<__nv_bfloat16>(g, bn, cluster, s);
    if (g->cdtype == MOED_F16) return dispatch<__half>(g, bn, cluster, s);
    return MOED_EINVAL;
}
