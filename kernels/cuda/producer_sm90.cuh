/*
 * producer_sm90 — the skeleton both Hopper GEMMs (gemm_sm90.cu: bf16/f16, gemm_fp8_sm90.cu:
 * block-scaled e4m3) are built on: the ring of shared-memory stages and its barriers, the producer
 * warpgroup that fills it, the persistent walk over tiles, and the launch. Each kernel keeps its
 * consumers (its wgmma chain and what it does with the accumulators) and picks its epilogue from
 * epilogue_sm90.cuh.
 *
 * Persistent and warp-specialised: one CTA per SM walks BM x BN tiles, each of one expert, with
 * 1 + CONSUMERS warpgroups, in clusters of MC CTAs along M (MC = 1: none). The CTAs of a cluster
 * take consecutive m-tiles at the same n-tile; when those are of one expert each CTA's producer
 * brings BN/MC rows of the weight tile and multicasts them to all, so the weights cross from L2
 * (and, where L2 would not have kept them, from HBM) once per cluster instead of once per CTA. A
 * stage is then refilled only once every consumer of the cluster has released it (the consumers
 * arrive on each CTA's empty barrier).
 *   warpgroup 0, the producer, fills STAGES stages: one thread issues the TMA copy of the weight
 *   tile, and (for the up projection) all its threads gather the token rows of A with 16-byte
 *   cp.async straight from X[token(row)] — Hopper's TMA cannot gather rows, and a permuted copy of
 *   X would cost a full extra pass over the activations. cp.async writes through the generic proxy
 *   and wgmma reads through the async proxy; how a thread's copies of a stage complete it is the
 *   batch's gather policy (moed_cuda.h, MOED_CUDA_GATHER_*). Without gather (the down projection
 *   reads its A rows in order) A also comes by TMA.
 *   warpgroups 1 .. CONSUMERS, the consumers, wait for a stage to be full, run wgmma over their 64
 *   rows of it, and release it; then run the epilogue.
 * Shared rows are 128 bytes (BK elements of the kernel's type), 128-byte swizzled: the layout TMA
 * writes with CU_TENSOR_MAP_SWIZZLE_128B, the cp.async path writes with moed_cuda_swz128, and the
 * wgmma descriptors name.
 */
#ifndef MOED_CUDA_PRODUCER_SM90_CUH
#define MOED_CUDA_PRODUCER_SM90_CUH

#include "epilogue_sm90.cuh"
#include "gemm_common.cuh"
#include "launch.cuh"
#include "tensor_map.h"

#include "moed_err.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

/* The Hopper kernels' device code exists only in the sm_90a pass; the other passes see empty
 * kernels. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOED_CUDA_SM90A 1
#endif

/* ---- the warpgroups and their budgets -------------------------------------------------------- */

constexpr int MOED_CUDA_SM90_WG = 128; /* threads of a warpgroup */
constexpr int MOED_CUDA_SM90_WARP = 32;
constexpr int MOED_CUDA_SM90_WG_WARPS = MOED_CUDA_SM90_WG / MOED_CUDA_SM90_WARP;
/* Registers per thread of the producer after setmaxnreg: it only computes addresses. */
constexpr int MOED_CUDA_SM90_PRODUCER_REGS = 56;
constexpr int MOED_CUDA_SM90_SMEM = 227 * 1024; /* shared memory a Hopper block may have */

/* Whether CONSUMERS warpgroups of REGS registers a thread (after setmaxnreg) fit the SM's register
 * file beside the producer's: the CTA is alone on its SM. */
constexpr bool moed_cuda_sm90_regs_fit(int consumers, int regs)
{
    return MOED_CUDA_SM90_WG * (MOED_CUDA_SM90_PRODUCER_REGS + consumers * regs) <= 65536;
}
static_assert(moed::ptx::valid_maxnreg<MOED_CUDA_SM90_PRODUCER_REGS>, "a setmaxnreg count");
static_assert(MOED_CUDA_SM90_WG == 128, "the epilogue's warpgroup (epilogue_sm90.cuh)");

/* A thread's fields (warpgroup, warp, lane, gather chunk) by shift and mask: every size here is a
 * power of two, and tid is never negative. */
constexpr int moed_cuda_log2(int v)
{
    return v > 1 ? 1 + moed_cuda_log2(v / 2) : 0;
}
constexpr int MOED_CUDA_SM90_WG_SHIFT = moed_cuda_log2(MOED_CUDA_SM90_WG);
constexpr int MOED_CUDA_SM90_WARP_SHIFT = moed_cuda_log2(MOED_CUDA_SM90_WARP);

/* The gathering producer: each thread copies one 16-byte chunk of a row per pass, a pass covering
 * ROWS_PER_PASS rows. */
constexpr int MOED_CUDA_SM90_CHUNK = 16;
constexpr int MOED_CUDA_SM90_ROW_CHUNKS = (int)moed::ptx::sw128_row_bytes / MOED_CUDA_SM90_CHUNK;
constexpr int MOED_CUDA_SM90_ROWS_PER_PASS = MOED_CUDA_SM90_WG / MOED_CUDA_SM90_ROW_CHUNKS;
constexpr int MOED_CUDA_SM90_CHUNK_SHIFT = moed_cuda_log2(MOED_CUDA_SM90_ROW_CHUNKS);
static_assert((1 << MOED_CUDA_SM90_WG_SHIFT) == MOED_CUDA_SM90_WG &&
                  (1 << MOED_CUDA_SM90_WARP_SHIFT) == MOED_CUDA_SM90_WARP &&
                  (1 << MOED_CUDA_SM90_CHUNK_SHIFT) == MOED_CUDA_SM90_ROW_CHUNKS &&
                  (MOED_CUDA_SM90_WG_WARPS & (MOED_CUDA_SM90_WG_WARPS - 1)) == 0 &&
                  MOED_CUDA_SM90_WG % MOED_CUDA_SM90_ROW_CHUNKS == 0,
              "powers of two, and the gather's split");

/* ---- the ring -------------------------------------------------------------------------------- */

/*
 * The ring of one kernel: STAGES stages of BM rows of A and BN rows of B, each row 128 bytes (BK
 * elements of E), for CONSUMERS consumer warpgroups (each with an epilogue staging buffer when
 * STAGED) in clusters of MC CTAs. The layout, from a base aligned to the swizzle atom: the A
 * stages, the B stages, the staging buffers, then the full and empty barriers of each stage; the
 * launcher reads the size here. On the device it holds the shared addresses and this CTA's place in
 * its cluster.
 */
template <typename E, int BM_, int BN_, int STAGES_, int CONSUMERS_, bool STAGED, int MC_>
struct moed_cuda_sm90_ring {
    using elem = E;
    static constexpr int BM = BM_, BN = BN_, STAGES = STAGES_, CONSUMERS = CONSUMERS_, MC = MC_;
    static constexpr int ROW_BYTES = moed::ptx::sw128_row_bytes;
    static constexpr int BK = ROW_BYTES / (int)sizeof(E); /* k of a stage */
    static constexpr int THREADS = (1 + CONSUMERS) * MOED_CUDA_SM90_WG;
    static constexpr int BAR = moed::ptx::mbar_bytes;
    static constexpr int A_STAGE = BM * ROW_BYTES, B_STAGE = BN * ROW_BYTES;
    static constexpr int B_SLICE = B_STAGE / MC; /* the weight rows one CTA of a cluster brings */
    static constexpr int A_AT = 0, B_AT = A_AT + STAGES * A_STAGE;
    static constexpr int EPI_AT = B_AT + STAGES * B_STAGE;
    static constexpr int FULL_AT = EPI_AT + (STAGED ? CONSUMERS * MOED_CUDA_EPI_STAGE : 0);
    static constexpr int EMPTY_AT = FULL_AT + STAGES * BAR;
    static constexpr int END = EMPTY_AT + STAGES * BAR;
    static constexpr int ALIGN = moed::ptx::sw128_atom_bytes;
    /* What the launch asks for: the layout, and the slack that aligns its base. */
    static constexpr int BYTES = ALIGN + END;
    /* Arrivals that complete a stage's `empty` barrier: once the consumers of every CTA of the
     * cluster have read it (lane 0 of each consumer warp). */
    static constexpr int EMPTY_ARRIVALS = MC * CONSUMERS * MOED_CUDA_SM90_WG_WARPS;
    static_assert(A_STAGE % ALIGN == 0 && B_SLICE % ALIGN == 0 && MOED_CUDA_EPI_STAGE % ALIGN == 0,
                  "stages, slices and staging buffers start on swizzle atoms");
    static_assert(B_SLICE * MC == B_STAGE && BN % MC == 0, "a cluster splits the weight tile");
    static_assert(BM % MOED_CUDA_SM90_ROWS_PER_PASS == 0, "whole gather passes per tile");
    static_assert(FULL_AT % BAR == 0, "barriers are 8-byte aligned");
    static_assert(BYTES <= MOED_CUDA_SM90_SMEM,
                  "over the 227 KiB of shared memory a Hopper block may have");

    /* Shared addresses: the aligned base, the first A and B stages, the first barriers. */
    uint32_t base, a, b, full, empty;
    int rank;              /* this CTA's in its cluster */
    uint32_t empty_of[MC]; /* each CTA's empty barriers, in the cluster's shared window */

    __device__ __forceinline__ explicit moed_cuda_sm90_ring(const uint8_t *smem)
        : base((moed::ptx::smem_addr(smem) + ALIGN - 1) & ~(uint32_t)(ALIGN - 1)), a(base + A_AT),
          b(base + B_AT), full(base + FULL_AT), empty(base + EMPTY_AT)
    {
    }

    __device__ __forceinline__ uint32_t a_at(int s) const
    {
        return a + s * A_STAGE;
    }
    __device__ __forceinline__ uint32_t b_at(int s) const
    {
        return b + s * B_STAGE;
    }
    __device__ __forceinline__ uint32_t full_at(int s) const
    {
        return full + BAR * s;
    }
    __device__ __forceinline__ uint32_t empty_at(int s) const
    {
        return empty + BAR * s;
    }
    /* Consumer cw's epilogue staging buffer (STAGED). */
    __device__ __forceinline__ uint32_t staging(int cw) const
    {
        return base + EPI_AT + cw * MOED_CUDA_EPI_STAGE;
    }

    /* Thread 0 initialises the barriers (`full` completes on the TMA thread's expect_tx, plus with
     * GATHER every producer thread's arrival after its copies; the bytes multicast by the
     * cluster's other CTAs count down the same expect_tx); then every CTA of the cluster waits for
     * all, since the others arrive on these barriers. */
    template <bool GATHER> __device__ __forceinline__ void init(int tid)
    {
        namespace ptx = moed::ptx;
        if (tid == 0) {
            for (int s = 0; s < STAGES; s++) {
                ptx::mbar_init(full_at(s), GATHER ? MOED_CUDA_SM90_WG + 1 : 1);
                ptx::mbar_init(empty_at(s), EMPTY_ARRIVALS);
            }
            ptx::mbar_fence_init();
            ptx::fence_proxy_async();
        }
        if constexpr (MC > 1)
            ptx::cluster_sync();
        else
            __syncthreads();
        rank = MC > 1 ? (int)ptx::cluster_rank() : 0;
#pragma unroll
        for (int c = 0; c < MC; c++) empty_of[c] = MC > 1 ? ptx::cluster_map(empty, c) : empty;
    }

    /* Use `it` of the ring (k-steps counted across tiles): its stage, and the parity of the phase
     * that fills it (a producer waits for the phase before it to be released). A consumer of
     * stages gathered under POLICY ARRIVE then fences the proxies: cp.async wrote them through the
     * generic proxy, and wgmma reads through the async one. */
    template <int POLICY = MOED_CUDA_GATHER_LAG_TILE>
    __device__ __forceinline__ void wait_full(int it) const
    {
        moed::ptx::mbar_wait(full_at(it % STAGES), (it / STAGES) & 1);
        if constexpr (POLICY == MOED_CUDA_GATHER_ARRIVE) moed::ptx::fence_proxy_async();
    }
    __device__ __forceinline__ void wait_empty(int it) const
    {
        moed::ptx::mbar_wait(empty_at(it % STAGES), ((it / STAGES) & 1) ^ 1);
    }

    /* A consumer warp's release of stage s, on the barrier of every CTA of the cluster. One lane
     * arrives on all of them: a lane-dependent target would move the stage barriers out of uniform
     * registers (docs/kernels-notes.md, "two-CTA clusters share the weight tile"). */
    __device__ __forceinline__ void release(int s, int lane) const
    {
        if (lane != 0) return;
        if constexpr (MC == 1)
            moed::ptx::mbar_arrive(empty_at(s));
        else
#pragma unroll
            for (int c = 0; c < MC; c++) moed::ptx::mbar_arrive_cluster(empty_of[c] + BAR * s);
    }
};

/* ---- the walk over tiles --------------------------------------------------------------------- */

/*
 * The persistent walk: every cluster takes units id = blockIdx.x / MC, + gridDim.x / MC, ..., each
 * CTA its rank's tile of the unit (moed_cuda_next_tile). Producer and consumers walk the same
 * sequence, each resolving its next tile (dependent loads of the tile tables) during the current
 * tile's first k-step (fetch_next), so the latency hides behind it.
 */
template <int MC> struct moed_cuda_sm90_walk {
    const moed_cuda_gemm &g;
    const int num_n, total, rank;
    int id;
    moed_cuda_tile cur, nxt;
    bool have, have_next;

    __device__ __forceinline__ moed_cuda_sm90_walk(const moed_cuda_gemm &g, int num_n, int total,
                                                   int rank)
        : g(g), num_n(num_n), total(total), rank(rank), id(blockIdx.x / MC), have_next(false)
    {
        have = moed_cuda_next_tile<MC>(g, num_n, total, id, cur, rank);
    }
    __device__ __forceinline__ void fetch_next()
    {
        id += gridDim.x / MC;
        have_next = moed_cuda_next_tile<MC>(g, num_n, total, id, nxt, rank);
    }
    /* To the tile fetch_next found (none when k is 0: no k-step ran, and the walk ends). */
    __device__ __forceinline__ void advance()
    {
        cur = nxt;
        have = have_next;
        have_next = false;
    }
};

/* The A row (token) behind sorted row r of tile t, or -1 past the tile's rows or A's. */
__device__ __forceinline__ int moed_cuda_sm90_a_source(const moed_cuda_gemm &g,
                                                       const moed_cuda_tile &t, int r)
{
    int s = -1;
    if (r < t.row_end) s = g.a_rows ? g.a_rows[r] : r;
    return s >= 0 && s < g.a_rows_total ? s : -1;
}

/* ---- the producer ---------------------------------------------------------------------------- */

/*
 * Warpgroup 0 of a kernel over ring R (thread tid of it): gives registers back, then fills the ring
 * for every tile of walk w, ktiles k-steps a tile, counting k-steps across tiles so stage and phase
 * carry over and the next tile's first stages fill while the consumers run this tile's epilogue.
 * Without GATHER one thread issues every copy and the others return at once. With GATHER each
 * thread's copies of a stage complete it by POLICY (MOED_CUDA_GATHER_*).
 */
template <class R, bool GATHER, int POLICY>
__device__ __forceinline__ void
moed_cuda_sm90_produce(const R &ring, const moed_cuda_gemm &g, const CUtensorMap *tm_b,
                       const CUtensorMap *tm_a, moed_cuda_sm90_walk<R::MC> &w, int ktiles, int tid)
{
    namespace ptx = moed::ptx;
    using E = typename R::elem;
    constexpr int STAGES = R::STAGES, MC = R::MC, BK = R::BK, BN = R::BN;
    constexpr int CHUNK = MOED_CUDA_SM90_CHUNK, ROWS_PER_PASS = MOED_CUDA_SM90_ROWS_PER_PASS;
    constexpr int A_PASSES = R::BM / ROWS_PER_PASS;
    /* A lagging thread signals stage i - LAG once it may fill stage i, which waits for use
     * i - STAGES to be released; a consumer may release a use only once the next one is full. So
     * LAG = STAGES - 1 could wait in a circle. */
    constexpr int LAG = STAGES - 2;
    constexpr bool ARRIVE = POLICY == MOED_CUDA_GATHER_ARRIVE;
    constexpr bool LAG_ACROSS_TILES = POLICY == MOED_CUDA_GATHER_LAG_RUN;
    static_assert(LAG >= 0 && LAG + 2 <= STAGES, "a stage is signalled before it must be free");
    /* The last LAG stages of the gathering threads: once every copy has landed. */
    auto signal_last = [&](int it, int n) {
        ptx::cp_async_wait<0>();
        ptx::fence_proxy_async();
        for (int j = it - n; j < it; j++) ptx::mbar_arrive(ring.full_at(j % STAGES));
    };

    ptx::setmaxnreg_dec<MOED_CUDA_SM90_PRODUCER_REGS>();
    if (!GATHER && tid != 0) return; /* TMA alone: one thread issues everything */
    const int kc = tid & (MOED_CUDA_SM90_ROW_CHUNKS - 1);
    int it = 0;
    while (w.have) {
        int src[GATHER ? A_PASSES : 1];
        if constexpr (GATHER) {
#pragma unroll
            for (int i = 0; i < A_PASSES; i++)
                src[i] = moed_cuda_sm90_a_source(
                    g, w.cur, w.cur.row0 + (tid >> MOED_CUDA_SM90_CHUNK_SHIFT) + ROWS_PER_PASS * i);
        }
        const int b_row = w.cur.e * g.n + w.cur.nt * BN;
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % STAGES;
            ring.wait_empty(it);
            if (tid == 0) {
                ptx::mbar_arrive_expect_tx(ring.full_at(s), R::B_STAGE + (GATHER ? 0 : R::A_STAGE));
                if (MC == 1 || !w.cur.shared_b) /* the whole tile, for this CTA alone */
                    for (int j = 0; j < MC; j++)
                        ptx::tma_load_2d(ring.b_at(s) + j * R::B_SLICE, tm_b, ring.full_at(s),
                                         kt * BK, b_row + j * (BN / MC));
                else
                    ptx::tma_load_2d_multicast(ring.b_at(s) + ring.rank * R::B_SLICE, tm_b,
                                               ring.full_at(s), kt * BK,
                                               b_row + ring.rank * (BN / MC), (1u << MC) - 1);
                if constexpr (!GATHER)
                    ptx::tma_load_2d(ring.a_at(s), tm_a, ring.full_at(s), kt * BK, w.cur.row0);
            }
            if constexpr (GATHER) {
                const E *a = static_cast<const E *>(g.a) + kt * BK + kc * (CHUNK / (int)sizeof(E));
#pragma unroll
                for (int i = 0; i < A_PASSES; i++) {
                    const int row = (tid >> MOED_CUDA_SM90_CHUNK_SHIFT) + ROWS_PER_PASS * i;
                    ptx::cp_async16(ring.a_at(s) + moed_cuda_swz128(row, kc),
                                    a + (int64_t)(src[i] < 0 ? 0 : src[i]) * g.lda,
                                    src[i] < 0 ? 0 : CHUNK);
                }
                if constexpr (ARRIVE) {
                    ptx::cp_async_mbar_arrive(ring.full_at(s));
                } else {
                    ptx::cp_async_commit();
                    if ((LAG_ACROSS_TILES ? it : kt) >= LAG) {
                        ptx::cp_async_wait<LAG>();
                        ptx::fence_proxy_async();
                        ptx::mbar_arrive(ring.full_at((it - LAG) % STAGES));
                    }
                }
            }
            if (kt == 0) w.fetch_next();
        }
        if constexpr (GATHER && POLICY == MOED_CUDA_GATHER_LAG_TILE)
            signal_last(it, ktiles < LAG ? ktiles : LAG);
        w.advance();
    }
    if constexpr (GATHER && LAG_ACROSS_TILES) signal_last(it, it < LAG ? it : LAG);
    if constexpr (GATHER && ARRIVE) { /* no thread leaves copies in flight */
        ptx::cp_async_commit();
        ptx::cp_async_wait<0>();
    }
    /* The CTA must outlive the other CTAs' arrivals on its barriers: wait until the last use of
     * every stage has been released by the whole cluster. */
    if (MC > 1 && tid == 0)
        for (int j = 0; j < STAGES; j++, it++) ring.wait_empty(it);
}

/* ---- the launch ------------------------------------------------------------------------------ */

/* The TMA maps of a kernel over ring R, elements of type tm (MOED_CUDA_TM_*): B (every expert as
 * one matrix, in boxes of the BN/MC rows a CTA brings), A when it comes by TMA (boxes of BM rows),
 * C when the epilogue stores by TMA (C_MAP); a map the kernel never reads is a copy of B's. 0, or
 * MOED_EDEVICE. */
template <class R, bool GATHER, bool C_MAP>
int moed_cuda_sm90_maps(const moed_cuda_gemm *g, int tm, CUtensorMap *tm_b, CUtensorMap *tm_a,
                        CUtensorMap *tm_c)
{
    int rc = moed_cuda_tensor_map(tm_b, tm, g->b, (int64_t)g->b_experts * g->n, g->k, g->k, R::BK,
                                  R::BN / R::MC, 1);
    if (rc) return rc;
    if (!C_MAP)
        *tm_c = *tm_b;
    else if ((rc = moed_cuda_epi_tensor_map(tm_c, g)))
        return rc;
    if (GATHER)
        *tm_a = *tm_b;
    else if ((rc = moed_cuda_tensor_map(tm_a, tm, g->a, g->a_rows_total, g->k, g->lda, R::BK, R::BM,
                                        1)))
        return rc;
    return 0;
}

/* Starts KERN, a kernel over ring R, for g on s: its maps (moed_cuda_sm90_maps), then as many
 * clusters as are resident at once, never more than the units (MC consecutive m-tiles at one
 * n-tile), walk the units. Plainly, never early: started early, the large batches the Hopper
 * kernels run were slower (docs/kernels-notes.md, "each small-batch kernel starts while the one
 * before drains"). */
template <auto KERN, class R, bool GATHER, bool C_MAP>
int moed_cuda_sm90_launch(const moed_cuda_gemm *g, int tm, moed_cuda_stream s)
{
    CUtensorMap tm_b, tm_a, tm_c;
    int rc = moed_cuda_sm90_maps<R, GATHER, C_MAP>(g, tm, &tm_b, &tm_a, &tm_c);
    if (rc) return rc;
    if (cudaFuncSetAttribute(KERN, cudaFuncAttributeMaxDynamicSharedMemorySize, R::BYTES) !=
        cudaSuccess)
        return MOED_EDEVICE;
    const int num_n = (g->n + R::BN - 1) / R::BN; /* the last may be clipped (gemm_sm90.cu) */
    const int64_t units = (int64_t)num_n * ((g->max_tiles + R::MC - 1) / R::MC);
    if (units <= 0) return 0;
    if (units > 0x7fffffff) return MOED_EINVAL;
    moed_cuda_shape sh = { dim3(), dim3(R::THREADS), (size_t)R::BYTES, R::MC };
    const int resident = moed_cuda_resident_clusters<KERN>(sh);
    sh.grid = dim3((unsigned)((units < resident ? units : resident) * R::MC));
    return moed_cuda_launch(KERN, sh, (cudaStream_t)s, false, tm_b, tm_a, tm_c, *g, num_n,
                            (int)units);
}

/* Calls f.template operator()<GATHER, POLICY, EPI>() for g's epilogue kind: gathered A (g->a_rows
 * set) only for the up projection's epilogues, completed by the gather policy `policy`
 * (MOED_CUDA_GATHER_*), one of the kernel's POLICIES (another is MOED_EINVAL). */
template <int... POLICIES, typename F>
int moed_cuda_sm90_dispatch(const moed_cuda_gemm *g, int policy, F &&f)
{
    const bool gather = g->a_rows != nullptr;
    constexpr int NONE = MOED_CUDA_GATHER_LAG_TILE; /* rows by TMA: no policy applies */
    return moed_cuda_epi_dispatch(g->epi, [&]<int EPI>() -> int {
        if constexpr (EPI == MOED_CUDA_EPI_STORE) {
            return gather ? MOED_EINVAL : f.template operator()<false, NONE, EPI>();
        } else {
            if (!gather) return f.template operator()<false, NONE, EPI>();
            int rc = MOED_EINVAL;
            (void)((policy == POLICIES &&
                    (rc = f.template operator()<true, POLICIES, EPI>(), true)) ||
                   ...);
            return rc;
        }
    });
}

#endif
