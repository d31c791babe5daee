/*
 * gemm_sm90 — the Hopper grouped GEMM for bf16 and f16 (sm_90a): wgmma with both operands in
 * shared memory, on the skeleton of producer_sm90.cuh (persistent, warp-specialised, weight tiles
 * by TMA, token rows gathered by cp.async or, in order, by TMA).
 *
 * Tiles of BM x BN = 128 x 256, STAGES = 4 stages of BK = 64 two-byte elements, two consumer
 * warpgroups of 64 rows each. Launched in clusters of MC = 2 CTAs (the table in tile_config.c; one
 * where clusters are turned off), which share the weight tile by multicast. Each consumer runs
 * m64n256k16 wgmma over its rows, keeps one wgmma group in flight, releases a stage once the group
 * that read it has finished, and runs the epilogue of epilogue_sm90.cuh: through a staging buffer
 * of its own, out by TMA store. Each output element is one fixed-order sum over K, independent of
 * the tile's other rows. N is a multiple of 128: the last n-tile may be half of one, whose other
 * half reads the next expert's weight rows (TMA's zeros after the last) into columns never stored
 * (the epilogue stops at N). That half tile measured faster than a whole layer at BN = 128, which
 * moves 1.33x the bytes per FLOP and ran without clusters (docs/kernels-notes.md, step 15).
 */
#include "producer_sm90.cuh"

#include "moed_dtype.h"
#include "moed_err.h"

namespace
{

namespace ptx = moed::ptx;

/* ---- the tile, the warpgroups and their budgets --------------------------------------------- */

constexpr int BM = 128;               /* rows of a tile */
constexpr int BN = 256;               /* columns of a tile */
constexpr int STAGES = 4;             /* shared-memory stages in the producer/consumer ring */
constexpr int ELEM = MOED_CUDA_CSIZE; /* bytes of a bf16 or f16 element */
constexpr int BK = (int)ptx::sw128_row_bytes / ELEM; /* k of a stage: one 128-byte swizzle row */
constexpr int CONSUMERS = 2;              /* consumer warpgroups, after the one producer */
constexpr int WGMMA_M = 64, WGMMA_K = 16; /* the instruction's shape (N is the tile's BN) */
static_assert(BM == CONSUMERS * WGMMA_M, "each consumer warpgroup owns 64 rows of the tile");
static_assert(WGMMA_M == MOED_CUDA_EPI_ROWS, "the epilogue's rows");
static_assert(BK % WGMMA_K == 0, "whole wgmma k-steps per stage");

/* A consumer holds BN/2 = 128 fp32 accumulators plus the epilogue's temporaries. */
constexpr int CONSUMER_REGS = 224;
static_assert(moed::ptx::valid_maxnreg<CONSUMER_REGS> &&
                  moed_cuda_sm90_regs_fit(CONSUMERS, CONSUMER_REGS),
              "the register budgets exceed the register file");

/* The ring: A and B stages, each consumer's epilogue staging, the barriers. Kernel and launcher
 * both read it here. */
template <typename T, int MC>
using ring = moed_cuda_sm90_ring<T, BM, BN, STAGES, CONSUMERS, true, MC>;
constexpr int THREADS = ring<__nv_bfloat16, 1>::THREADS;
static_assert(ring<__nv_bfloat16, 1>::BK == BK, "the ring's rows are the kernel's");

template <typename T, bool GATHER, int POLICY, int EPI, int MC>
__global__ void __launch_bounds__(THREADS, 1)
    gemm_sm90_kernel(const __grid_constant__ CUtensorMap tm_b,
                     const __grid_constant__ CUtensorMap tm_a,
                     const __grid_constant__ CUtensorMap tm_c, const moed_cuda_gemm g, int num_n,
                     int total)
{
#ifdef MOED_CUDA_SM90A
    using R = ring<T, MC>;
    static_assert(sizeof(T) == ELEM, "two-byte elements");
    constexpr int NACC = WGMMA_M * BN / MOED_CUDA_SM90_WG; /* fp32 accumulators a consumer thread */

    extern __shared__ uint8_t smem_raw[];
    R rg(smem_raw);
    const int tid = threadIdx.x, wg = tid >> MOED_CUDA_SM90_WG_SHIFT;
    const int lane = tid & (MOED_CUDA_SM90_WARP - 1);
    const int ktiles = g.k / BK;
    rg.template init<GATHER>(tid);

    moed_cuda_sm90_walk<MC> w(g, num_n, total, rg.rank);
    if (wg == 0) {
        moed_cuda_sm90_produce<R, GATHER, POLICY>(rg, g, &tm_b, &tm_a, w, ktiles, tid);
        return;
    }

    ptx::setmaxnreg_inc<CONSUMER_REGS>();
    const int cw = wg - 1; /* this consumer's WGMMA_M rows of each tile */
    const uint32_t st = rg.staging(cw);
    uint8_t *const stp = smem_raw + (st - ptx::smem_addr(smem_raw));
    int it = 0; /* k-steps across tiles, as the producer counts them */
    while (w.have) {
        float acc[NACC];
#pragma unroll
        for (int i = 0; i < NACC; i++) acc[i] = 0.0f;
        for (int kt = 0; kt < ktiles; kt++, it++) {
            const int s = it % STAGES;
            rg.template wait_full<POLICY>(it);
            ptx::wgmma_fence_operands(acc);
            ptx::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / WGMMA_K; kk++)
                ptx::wgmma_m64k16<T, BN>(acc,
                                         ptx::wgmma_desc_sw128(rg.a_at(s) +
                                                               cw * WGMMA_M * R::ROW_BYTES +
                                                               kk * WGMMA_K * ELEM),
                                         ptx::wgmma_desc_sw128(rg.b_at(s) + kk * WGMMA_K * ELEM));
            ptx::wgmma_commit();
            if (kt == 0) w.fetch_next();
            ptx::wgmma_wait<1>();
            ptx::wgmma_fence_operands(acc);
            if (kt > 0) rg.release((it - 1) % STAGES, lane);
        }
        ptx::wgmma_wait<0>();
        ptx::wgmma_fence_operands(acc);
        rg.release((it - 1) % STAGES, lane); /* the producers may refill it now */

        moed_cuda_staged_epilogue<T, EPI, BN>(g, &tm_c, acc, w.cur, cw, st, stp,
                                              tid & (MOED_CUDA_SM90_WG - 1));
        w.advance();
    }
    if ((tid & (MOED_CUDA_SM90_WG - 1)) == 0) ptx::bulk_wait<0>(); /* the last tile's stores */
#endif
}

template <typename T, int MC>
int dispatch_mc(const moed_cuda_gemm *g, int policy, moed_cuda_stream s)
{
    const int tm = g->cdtype == MOED_BF16 ? MOED_CUDA_TM_BF16 : MOED_CUDA_TM_F16;
    return moed_cuda_sm90_dispatch<MOED_CUDA_GATHER_LAG_TILE, MOED_CUDA_GATHER_ARRIVE>(
        g, policy, [&]<bool GATHER, int POLICY, int EPI>() -> int {
            return moed_cuda_sm90_launch<gemm_sm90_kernel<T, GATHER, POLICY, EPI, MC>, ring<T, MC>,
                                         GATHER, true>(g, tm, s);
        });
}

template <typename T> int dispatch(const moed_cuda_gemm *g, int mc, int policy, moed_cuda_stream s)
{
    return mc == 2 ? dispatch_mc<T, 2>(g, policy, s) : dispatch_mc<T, 1>(g, policy, s);
}

} // namespace

extern "C" int moed_cuda_gemm_sm90(const moed_cuda_gemm *g, int cluster, int policy,
                                   moed_cuda_stream s)
{
    /* TMA reads A and B and writes C: 16-byte aligned rows */
    if (g->bm != BM || g->n % (BN / 2) || g->k % BK || g->lda % 8 || !moed_cuda_epi_c_ok(g) ||
        (cluster != 1 && cluster != 2))
        return MOED_EINVAL;
    if (g->cdtype == MOED_BF16) return dispatch<__nv_bfloat16>(g, cluster, policy, s);
    if (g->cdtype == MOED_F16) return dispatch<__half>(g, cluster, policy, s);
    return MOED_EINVAL;
}
