/*
 * gemm_fp8_sm90 — the Hopper grouped GEMM for block-scaled FP8 (sm_90a): e4m3 activations times
 * e4m3 weights on the FP8 Tensor Cores, with fp32 accumulation promoted through the scales once
 * per 128-deep K block (the recipe of DeepSeek-V3 and DeepGEMM).
 *
 * The numbers: A (activations, quantized per row per 128 channels by quant_fp8.cu) has one float32
 * scale per (row, K block); B (an expert's weights, as the checkpoint ships them) one per (32 rows,
 * K block): moed_cuda.h's scale tables. Per K block of BK = 128, each consumer warpgroup chains
 * four m64n128k32 wgmma into fresh accumulators (the first overwrites them), waits for them, then
 * adds them into the promoted sums with CUDA cores:
 *
 *     out[r, n] += a_scale[r] * b_scale[n / 32] * acc[r, n]          (fp32, every K block)
 *
 * so the Tensor Cores' reduced-precision accumulation never runs past 128 products, and every
 * output element is a fixed-order sum whatever tile, batch or other rows it shares.
 *
 * On the skeleton of producer_sm90.cuh, as gemm_sm90.cu: persistent, one CTA per SM over BM x
 * BN tiles of one expert each, warp-specialised, weight tiles by TMA, token rows gathered by
 * cp.async or, in order, by TMA. BM / 64 consumer warpgroups of 64 rows each run the K blocks and
 * the epilogue (epilogue_sm90.cuh's, in bf16: staged and stored by TMA at BM = 128, straight from
 * the registers at BM = 64); each thread reads the scales it needs (its two rows' and the tile's
 * four column groups') straight from the tables in global memory, one K block ahead, so shared
 * memory holds only what the Tensor Cores read and no ordinary load races the producer's copies. BM
 * is 64 (batches of few rows per expert: the kernel streams weights, one consumer, eight stages
 * deep) or 128 (two consumers, whose wgmma and promotion interleave; launched in clusters of two
 * CTAs that share the weight tile where the table asks). A stage's rows are 128 e4m3
 * bytes, swizzled like the bf16 kernel's 64 two-byte elements, so the same descriptors and the same
 * 32-byte K step serve.
 */
#include "producer_sm90.cuh"

#include "moed_dtype.h"
#include "moed_err.h"

namespace
{

namespace ptx = moed::ptx;

/* ---- the tile, the warpgroups and their budgets --------------------------------------------- */

constexpr int BK = MOED_CUDA_FP8_K; /* k of a stage: one scale block */
constexpr int BN = 128;             /* columns of a tile; fits acc + promoted sums in registers */
static_assert(BK == (int)ptx::sw128_row_bytes, "a stage row is one 128-byte swizzle row of e4m3");
static_assert(BN % MOED_CUDA_FP8_SROWS == 0, "whole scale groups per tile");
static_assert(MOED_CUDA_FP8_SROWS % 8 == 0, "a scale group covers whole accumulator columns of 8");

constexpr int WGMMA_M = 64, WGMMA_K = 32; /* the e4m3 instruction's shape (N is BN) */
static_assert(WGMMA_M == MOED_CUDA_EPI_ROWS, "the epilogue's rows");
static_assert(BK % WGMMA_K == 0, "whole wgmma k-steps per stage");

/* Per BM: consumers, stages, the epilogue, register budgets. A consumer holds
 * NACC fresh accumulators and NACC promoted sums (128 registers) plus the epilogue's temporaries.
 */
template <int BM> struct tile_cfg {
    static constexpr int CONSUMERS = BM / WGMMA_M;
    static constexpr int STAGES = BM == 64 ? 8 : 6;
    /* The staged epilogue at BM = 128 (+0.6..+9% at T >= 4096 against the direct one); at BM = 64
     * its one consumer waiting on each staging round cost 0.4-7% (docs/kernels-notes.md, "a
     * TMA-store epilogue"). */
    static constexpr bool STAGED = BM == 128;
    static constexpr int CONSUMER_REGS = CONSUMERS == 1 ? 232 : 224;
    static_assert(BM == 64 || BM == 128, "one or two consumer warpgroups");
    static_assert(moed::ptx::valid_maxnreg<CONSUMER_REGS> &&
                      moed_cuda_sm90_regs_fit(CONSUMERS, CONSUMER_REGS),
                  "the register budgets exceed the register file");
};

/* The ring: A and B stages of e4m3 bytes, the consumers' staging where the epilogue is staged,
 * the barriers, for clusters of MC CTAs. */
template <int BM, int MC>
using ring = moed_cuda_sm90_ring<uint8_t, BM, BN, tile_cfg<BM>::STAGES, tile_cfg<BM>::CONSUMERS,
                                 tile_cfg<BM>::STAGED, MC>;
static_assert(ring<64, 1>::BK == BK && ring<128, 1>::BK == BK,
              "the ring's rows are one scale block");

template <int BM, int MC, bool GATHER, int POLICY, int EPI>
__global__ void __launch_bounds__(ring<BM, MC>::THREADS, 1)
    gemm_fp8_sm90_kernel(const __grid_constant__ CUtensorMap tm_b,
                         const __grid_constant__ CUtensorMap tm_a,
                         const __grid_constant__ CUtensorMap tm_c, const moed_cuda_gemm g,
                         int num_n, int total)
{
#ifdef MOED_CUDA_SM90A
    using C = tile_cfg<BM>;
    using R = ring<BM, MC>;
    constexpr int NACC = WGMMA_M * BN / MOED_CUDA_SM90_WG; /* fp32 accumulators a consumer thread */
    constexpr int STAGES = C::STAGES, WG_WARPS = MOED_CUDA_SM90_WG_WARPS;
    constexpr int B_GROUPS = BN / MOED_CUDA_FP8_SROWS; /* weight scales of a tile per K block */

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

    ptx::setmaxnreg_inc<C::CONSUMER_REGS>();
    const int cw = wg - 1; /* this consumer's WGMMA_M rows of each tile */
    const uint32_t st = rg.staging(cw);
    uint8_t *const stp = smem_raw + (st - ptx::smem_addr(smem_raw));
    const int wrow =
        ((tid >> MOED_CUDA_SM90_WARP_SHIFT) & (WG_WARPS - 1)) * 16 + (lane >> 2); /* and h = 0 */
    const int64_t bs_ld = (int64_t)g.b_experts * g.n / MOED_CUDA_FP8_SROWS;
    int it = 0; /* k-steps across tiles, as the producer counts them */
    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; i++) acc[i] = 0.0f; /* defined before the first wgmma names them */
    while (w.have) {
        const moed_cuda_tile &cur = w.cur;
        /* this thread's two rows' A rows, and where the tile's weight scales start */
        const int r0 = cur.row0 + cw * WGMMA_M + wrow;
        const int src0 = moed_cuda_sm90_a_source(g, cur, r0);
        const int src1 = moed_cuda_sm90_a_source(g, cur, r0 + 8);
        const float *bsc = g.b_scale + ((int64_t)cur.e * g.n + cur.nt * BN) / MOED_CUDA_FP8_SROWS;
        /* a K block's scales: A row 0, A row 1, the B_GROUPS column groups (0 for absent rows) */
        auto scales = [&](int kt, float(&v)[2 + B_GROUPS]) {
            const float *as = g.a_scale + (int64_t)kt * g.a_scale_ld;
            v[0] = src0 < 0 ? 0.0f : __ldg(as + src0);
            v[1] = src1 < 0 ? 0.0f : __ldg(as + src1);
#pragma unroll
            for (int q = 0; q < B_GROUPS; q++) v[2 + q] = __ldg(bsc + (int64_t)kt * bs_ld + q);
        };
        float sum[NACC], next[2 + B_GROUPS];
#pragma unroll
        for (int i = 0; i < NACC; i++) sum[i] = 0.0f;
        scales(0, next);
        for (int kt = 0; kt < ktiles; kt++, it++) {
            float sc[2 + B_GROUPS];
#pragma unroll
            for (int i = 0; i < 2 + B_GROUPS; i++) sc[i] = next[i];
            if (kt + 1 < ktiles) scales(kt + 1, next); /* in flight during this block */
            const int s = it % STAGES;
            rg.template wait_full<POLICY>(it);
            ptx::wgmma_fence_operands(acc);
            ptx::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / WGMMA_K; kk++)
                ptx::wgmma_m64k32_e4m3<BN>(
                    acc,
                    ptx::wgmma_desc_sw128(rg.a_at(s) + cw * WGMMA_M * R::ROW_BYTES + kk * WGMMA_K),
                    ptx::wgmma_desc_sw128(rg.b_at(s) + kk * WGMMA_K), kk);
            ptx::wgmma_commit();
            if (kt == 0) w.fetch_next();
            ptx::wgmma_wait<0>();
            ptx::wgmma_fence_operands(acc);
            rg.release(s, lane); /* the stage is read: refill it */
            /* promotion: register 4*c8 + 2*h + j is row wrow + 8h, column 8*c8 + ...; the columns
             * of one scale group are MOED_CUDA_FP8_SROWS / 8 consecutive c8 */
#pragma unroll
            for (int q = 0; q < B_GROUPS; q++) {
                const float f0 = sc[0] * sc[2 + q], f1 = sc[1] * sc[2 + q];
#pragma unroll
                for (int c = 0; c < MOED_CUDA_FP8_SROWS / 8; c++) {
                    const int c8 = q * (MOED_CUDA_FP8_SROWS / 8) + c;
                    sum[4 * c8 + 0] += f0 * acc[4 * c8 + 0];
                    sum[4 * c8 + 1] += f0 * acc[4 * c8 + 1];
                    sum[4 * c8 + 2] += f1 * acc[4 * c8 + 2];
                    sum[4 * c8 + 3] += f1 * acc[4 * c8 + 3];
                }
            }
        }
        if constexpr (C::STAGED)
            moed_cuda_staged_epilogue<__nv_bfloat16, EPI, BN>(g, &tm_c, sum, cur, cw, st, stp,
                                                              tid & (MOED_CUDA_SM90_WG - 1));
        else
            moed_cuda_direct_epilogue<__nv_bfloat16, EPI, BN>(g, sum, r0, cur.row_end, cur.nt * BN,
                                                              lane);
        w.advance();
    }
    if (C::STAGED && (tid & (MOED_CUDA_SM90_WG - 1)) == 0)
        ptx::bulk_wait<0>(); /* the last stores */
#endif
}

template <int BM, int MC> int dispatch(const moed_cuda_gemm *g, int policy, moed_cuda_stream s)
{
    return moed_cuda_sm90_dispatch<MOED_CUDA_GATHER_LAG_RUN>(
        g, policy, [&]<bool GATHER, int POLICY, int EPI>() -> int {
            return moed_cuda_sm90_launch<gemm_fp8_sm90_kernel<BM, MC, GATHER, POLICY, EPI>,
                                         ring<BM, MC>, GATHER, tile_cfg<BM>::STAGED>(
                g, MOED_CUDA_TM_E4M3, s);
        });
}

} // namespace

/* Clusters only at bm 128: at bm 64 (few rows an expert) two m-tiles rarely share an expert. */
extern "C" int moed_cuda_gemm_fp8_sm90(const moed_cuda_gemm *g, int cluster, int policy,
                                       moed_cuda_stream s)
{
    if (!g->a_scale || !g->b_scale || g->cdtype != MOED_BF16 || g->n % BN || g->k % BK ||
        g->lda % 16 || !moed_cuda_epi_c_ok(g) || (cluster != 1 && !(cluster == 2 && g->bm == 128)))
        return MOED_EINVAL;
    if (g->bm == 128)
        return cluster == 2 ? dispatch<128, 2>(g, policy, s) : dispatch<128, 1>(g, policy, s);
    if (g->bm == 64) return dispatch<64, 1>(g, policy, s);
    return MOED_EINVAL;
}
