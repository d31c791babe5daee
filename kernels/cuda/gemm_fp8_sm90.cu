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
 * Structure as gemm_sm90.cu: persistent, one CTA per SM over BM x BN tiles of one expert each,
 * warp-specialised. Warpgroup 0 produces STAGES shared-memory stages: one thread issues the TMA
 * copies of the weight tile (and, for rows in order, of the A tile); for the up projection all its
 * threads gather the token rows of A with cp.async (TMA cannot gather), each fencing the proxies
 * before it arrives. BM / 64 consumer warpgroups of 64 rows each run the K blocks and the
 * epilogue (epilogue_sm90.cuh's, in bf16: staged and stored by TMA at BM = 128, straight from the
 * registers at BM = 64); each thread reads the scales it needs (its two rows' and the tile's four
 * column groups') straight from the tables in global memory, one K block ahead, so shared memory
 * holds only what the Tensor Cores read and no ordinary load races the producer's copies. BM is 64
 * (batches of few rows per expert: the kernel streams weights, one consumer, eight stages deep) or
 * 128 (two consumers, whose wgmma and promotion interleave). A stage's rows are 128 e4m3 bytes,
 * swizzled like the bf16 kernel's 64 two-byte elements, so the same descriptors and the same
 * 32-byte K step serve.
 */
#include "epilogue_sm90.cuh"
#include "gemm_common.cuh"
#include "tensor_map.h"

#include "moed_dtype.h"
#include "moed_err.h"

#include <cuda.h>
#include <cuda_runtime.h>

namespace
{

namespace ptx = moed::ptx;

/* ---- the tile, the warpgroups and their budgets --------------------------------------------- */

constexpr int BK = MOED_CUDA_FP8_K; /* k of a stage: one scale block */
constexpr int BN = 128;             /* columns of a tile; fits acc + promoted sums in registers */
constexpr int ROW_BYTES = BK;       /* e4m3: one byte an element */
static_assert(ROW_BYTES == (int)ptx::sw128_row_bytes, "a stage row is one 128-byte swizzle row");
static_assert(BN % MOED_CUDA_FP8_SROWS == 0, "whole scale groups per tile");
static_assert(MOED_CUDA_FP8_SROWS % 8 == 0, "a scale group covers whole accumulator columns of 8");

constexpr int WG_THREADS = 128;
constexpr int WGMMA_M = 64, WGMMA_K = 32; /* the e4m3 instruction's shape (N is BN) */
static_assert(WGMMA_M == MOED_CUDA_EPI_ROWS && WG_THREADS == 128, "the epilogue's warpgroup");
static_assert(BK % WGMMA_K == 0, "whole wgmma k-steps per stage");

/* Per BM: consumers, stages, register budgets. The producer only computes addresses; a consumer
 * holds NACC fresh accumulators and NACC promoted sums (128 registers) plus the epilogue's
 * temporaries. */
template <int BM> struct tile_cfg {
    static constexpr int CONSUMERS = BM / WGMMA_M;
    static constexpr int THREADS = (1 + CONSUMERS) * WG_THREADS;
    static constexpr int STAGES = BM == 64 ? 8 : 6;
    /* The staged epilogue at BM = 128 (H200, against the direct one, alternated: +0.6..+9% at
     * T >= 4096 on every layer but DBRX at 16384, -1.2%); at BM = 64 its one consumer waiting on
     * each staging round cost 0.4-7% (NOTES, issue 16, step 10). */
    static constexpr bool STAGED = BM == 128;
    static constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = CONSUMERS == 1 ? 232 : 224;
    static_assert(BM == 64 || BM == 128, "one or two consumer warpgroups");
    static_assert(ptx::valid_maxnreg<PRODUCER_REGS> && ptx::valid_maxnreg<CONSUMER_REGS>,
                  "setmaxnreg counts");
    static_assert(WG_THREADS * (PRODUCER_REGS + CONSUMERS * CONSUMER_REGS) <= 65536,
                  "the register budgets exceed the register file");
};

/* The shared-memory layout, from a base aligned to the swizzle atom: STAGES A stages, STAGES B
 * stages, each consumer's epilogue staging, then the full and empty barriers of each stage. */
template <int BM> struct smem_layout {
    static constexpr int STAGES = tile_cfg<BM>::STAGES;
    static constexpr int a_stage = BM * ROW_BYTES, b_stage = BN * ROW_BYTES;
    static constexpr int a = 0, b = a + STAGES * a_stage;
    static constexpr int epi = b + STAGES * b_stage;
    static constexpr int full =
        epi + (tile_cfg<BM>::STAGED ? tile_cfg<BM>::CONSUMERS * MOED_CUDA_EPI_STAGE : 0);
    static constexpr int empty = full + STAGES * (int)ptx::mbar_bytes;
    static constexpr int end = empty + STAGES * (int)ptx::mbar_bytes;
    static constexpr int align = ptx::sw128_atom_bytes;
    static constexpr int bytes = align + end;
    static_assert(a_stage % align == 0 && b_stage % align == 0 && MOED_CUDA_EPI_STAGE % align == 0,
                  "stages and staging buffers start on swizzle atoms");
    static_assert(full % ptx::mbar_bytes == 0, "barriers are 8-byte aligned");
    static_assert(bytes <= 227 * 1024, "over the 227 KiB of shared memory a Hopper block may have");
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOED_CUDA_FP8_SM90_ENABLED 1

constexpr int WARP = 32, WG_WARPS = WG_THREADS / WARP;
constexpr int B_GROUPS = BN / MOED_CUDA_FP8_SROWS; /* weight scales of a tile per K block */

constexpr int log2_of(int v)
{
    return v > 1 ? 1 + log2_of(v / 2) : 0;
}

/* The gathering producer: each thread copies one 16-byte chunk of a row per pass, a pass covering
 * ROWS_PER_PASS rows. */
constexpr int CHUNK = 16, ROW_CHUNKS = ROW_BYTES / CHUNK;
constexpr int ROWS_PER_PASS = WG_THREADS / ROW_CHUNKS;
constexpr int WG_SHIFT = log2_of(WG_THREADS), WARP_SHIFT = log2_of(WARP);
constexpr int CHUNK_SHIFT = log2_of(ROW_CHUNKS);
static_assert((1 << WG_SHIFT) == WG_THREADS && (1 << WARP_SHIFT) == WARP &&
                  (1 << CHUNK_SHIFT) == ROW_CHUNKS && (WG_WARPS & (WG_WARPS - 1)) == 0,
              "powers of two");
/* Stages a gathering thread keeps in flight before it waits for the oldest and signals it: all but
 * two of the ring, since a stage is half as much work as the bf16 kernel's and its copies still
 * need a memory round trip's time to land. Counted across tiles, so a tile's first stages never
 * wait for the last ones of the tile before. */
template <int BM> constexpr int LAG_OF = tile_cfg<BM>::STAGES - 2;

/* Arrivals that complete a stage's barriers: `full` once the stage has landed (the TMA thread's
 * expect_tx, plus every gathering thread after its copies), `empty` once the consumers have read
 * it (lane 0 of each consumer warp). */
template <bool GATHER> constexpr int FULL_ARRIVALS = GATHER ? WG_THREADS + 1 : 1;

/* The A row (token) behind sorted row r of tile t, or -1 past the tile's rows or A's. */
__device__ __forceinline__ int a_source(const moed_cuda_gemm &g, const moed_cuda_tile &t, int r)
{
    int s = -1;
    if (r < t.row_end) s = g.a_rows ? g.a_rows[r] : r;
    return s >= 0 && s < g.a_rows_total ? s : -1;
}
#endif

template <int BM, bool GATHER, int EPI>
__global__ void __launch_bounds__(tile_cfg<BM>::THREADS, 1)
    gemm_fp8_sm90_kernel(const __grid_constant__ CUtensorMap tm_b,
                         const __grid_constant__ CUtensorMap tm_a,
                         const __grid_constant__ CUtensorMap tm_c, const moed_cuda_gemm g,
                         int num_n, int total)
{
#ifdef MOED_CUDA_FP8_SM90_ENABLED
    using C = tile_cfg<BM>;
    using L = smem_layout<BM>;
    constexpr int NACC = WGMMA_M * BN / WG_THREADS; /* fp32 accumulators per consumer thread */
    constexpr int STAGES = C::STAGES, A_PASSES = BM / ROWS_PER_PASS;
    constexpr int EMPTY_ARRIVALS = C::CONSUMERS * WG_WARPS;
    constexpr uint32_t BAR = ptx::mbar_bytes;
    constexpr int LAG = LAG_OF<BM>;
    static_assert(BM % ROWS_PER_PASS == 0 && LAG < STAGES, "the gather's split and its lag");

    extern __shared__ uint8_t smem_raw[];
    const uint32_t base = (ptx::smem_addr(smem_raw) + L::align - 1) & ~(uint32_t)(L::align - 1);
    const uint32_t sA = base + L::a, sB = base + L::b;
    const uint32_t full = base + L::full, empty = base + L::empty;
    const int tid = threadIdx.x, wg = tid >> WG_SHIFT, lane = tid & (WARP - 1);
    const int ktiles = g.k / BK;

    if (tid == 0) {
        for (int s = 0; s < STAGES; s++) {
            ptx::mbar_init(full + BAR * s, FULL_ARRIVALS<GATHER>);
            ptx::mbar_init(empty + BAR * s, EMPTY_ARRIVALS);
        }
        ptx::mbar_fence_init();
        ptx::fence_proxy_async();
    }
    __syncthreads();

    int it = 0, id = blockIdx.x;
    moed_cuda_tile cur, nxt;
    bool have = moed_cuda_next_tile(g, num_n, total, id, cur);
    if (wg == 0) {
        ptx::setmaxnreg_dec<C::PRODUCER_REGS>();
        if (!GATHER && tid != 0) return; /* TMA alone: one thread issues everything */
        const int kc = tid & (ROW_CHUNKS - 1);
        while (have) {
            int src[GATHER ? A_PASSES : 1];
            if constexpr (GATHER) {
#pragma unroll
                for (int i = 0; i < A_PASSES; i++)
                    src[i] = a_source(g, cur, cur.row0 + (tid >> CHUNK_SHIFT) + ROWS_PER_PASS * i);
            }
            const int b_row = cur.e * g.n + cur.nt * BN;
            bool have_next = false;
            for (int kt = 0; kt < ktiles; kt++, it++) {
                const int s = it % STAGES;
                ptx::mbar_wait(empty + BAR * s, ((it / STAGES) & 1) ^ 1);
                if (tid == 0) {
                    ptx::mbar_arrive_expect_tx(full + BAR * s,
                                               L::b_stage + (GATHER ? 0 : L::a_stage));
                    ptx::tma_load_2d(sB + s * L::b_stage, &tm_b, full + BAR * s, kt * BK, b_row);
                    if constexpr (!GATHER)
                        ptx::tma_load_2d(sA + s * L::a_stage, &tm_a, full + BAR * s, kt * BK,
                                         cur.row0);
                }
                if constexpr (GATHER) {
                    const uint8_t *a = static_cast<const uint8_t *>(g.a) + kt * BK + kc * CHUNK;
#pragma unroll
                    for (int i = 0; i < A_PASSES; i++) {
                        const int row = (tid >> CHUNK_SHIFT) + ROWS_PER_PASS * i;
                        ptx::cp_async16(sA + s * L::a_stage + moed_cuda_swz128(row, kc),
                                        a + (int64_t)(src[i] < 0 ? 0 : src[i]) * g.lda,
                                        src[i] < 0 ? 0 : CHUNK);
                    }
                    ptx::cp_async_commit();
                    if (it >= LAG) {
                        ptx::cp_async_wait<LAG>();
                        ptx::fence_proxy_async();
                        ptx::mbar_arrive(full + BAR * ((it - LAG) % STAGES));
                    }
                }
                if (kt == 0) {
                    id += gridDim.x;
                    have_next = moed_cuda_next_tile(g, num_n, total, id, nxt);
                }
            }
            cur = nxt;
            have = have_next;
        }
        if constexpr (GATHER) { /* signal the last stages */
            ptx::cp_async_wait<0>();
            ptx::fence_proxy_async();
            for (int j = it - (it < LAG ? it : LAG); j < it; j++)
                ptx::mbar_arrive(full + BAR * (j % STAGES));
        }
        return;
    }

    ptx::setmaxnreg_inc<C::CONSUMER_REGS>();
    const int cw = wg - 1; /* this consumer's WGMMA_M rows of each tile */
    const uint32_t st = base + L::epi + cw * MOED_CUDA_EPI_STAGE; /* its epilogue's staging */
    uint8_t *const stp = smem_raw + (st - ptx::smem_addr(smem_raw));
    const int wrow = ((tid >> WARP_SHIFT) & (WG_WARPS - 1)) * 16 + (lane >> 2); /* and h = 0 */
    const int64_t bs_ld = (int64_t)g.b_experts * g.n / MOED_CUDA_FP8_SROWS;
    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; i++) acc[i] = 0.0f; /* defined before the first wgmma names them */
    while (have) {
        /* this thread's two rows' A rows, and where the tile's weight scales start */
        const int r0 = cur.row0 + cw * WGMMA_M + wrow;
        const int src0 = a_source(g, cur, r0), src1 = a_source(g, cur, r0 + 8);
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
        bool have_next = false;
        for (int kt = 0; kt < ktiles; kt++, it++) {
            float sc[2 + B_GROUPS];
#pragma unroll
            for (int i = 0; i < 2 + B_GROUPS; i++) sc[i] = next[i];
            if (kt + 1 < ktiles) scales(kt + 1, next); /* in flight during this block */
            const int s = it % STAGES;
            ptx::mbar_wait(full + BAR * s, (it / STAGES) & 1);
            ptx::wgmma_fence_operands(acc);
            ptx::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / WGMMA_K; kk++)
                ptx::wgmma_m64k32_e4m3<BN>(
                    acc,
                    ptx::wgmma_desc_sw128(sA + s * L::a_stage + cw * WGMMA_M * ROW_BYTES +
                                          kk * WGMMA_K),
                    ptx::wgmma_desc_sw128(sB + s * L::b_stage + kk * WGMMA_K), kk);
            ptx::wgmma_commit();
            if (kt == 0) {
                id += gridDim.x;
                have_next = moed_cuda_next_tile(g, num_n, total, id, nxt);
            }
            ptx::wgmma_wait<0>();
            ptx::wgmma_fence_operands(acc);
            if (lane == 0) ptx::mbar_arrive(empty + BAR * s); /* the stage is read: refill it */
                /* promotion: register 4*c8 + 2*h + j is row wrow + 8h, column 8*c8 + ...; the
                 * columns of one scale group are MOED_CUDA_FP8_SROWS / 8 consecutive c8 */
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
                                                              tid & (WG_THREADS - 1));
        else
            moed_cuda_direct_epilogue<__nv_bfloat16, EPI, BN>(g, sum, r0, cur.row_end, cur.nt * BN,
                                                              lane);
        cur = nxt;
        have = have_next;
    }
    if (C::STAGED && (tid & (WG_THREADS - 1)) == 0) ptx::bulk_wait<0>(); /* the last stores */
#endif
}

template <int BM, bool GATHER, int EPI> int launch(const moed_cuda_gemm *g, moed_cuda_stream s)
{
    using L = smem_layout<BM>;
    CUtensorMap tm_b, tm_a, tm_c;
    int rc = moed_cuda_tensor_map(&tm_b, MOED_CUDA_TM_E4M3, g->b, (int64_t)g->b_experts * g->n,
                                  g->k, g->k, BK, BN, 1);
    if (rc) return rc;
    if (!tile_cfg<BM>::STAGED)
        tm_c = tm_b; /* unused: the direct epilogue */
    else if ((rc = moed_cuda_epi_tensor_map(&tm_c, g)))
        return rc;
    if (GATHER)
        tm_a = tm_b; /* unused */
    else if ((rc = moed_cuda_tensor_map(&tm_a, MOED_CUDA_TM_E4M3, g->a, g->a_rows_total, g->k,
                                        g->lda, BK, BM, 1)))
        return rc;
    auto kern = gemm_fp8_sm90_kernel<BM, GATHER, EPI>;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, L::bytes) !=
        cudaSuccess)
        return MOED_EDEVICE;
    const int num_n = g->n / BN;
    const int64_t tiles = (int64_t)num_n * g->max_tiles;
    if (tiles <= 0) return 0;
    if (tiles > 0x7fffffff) return MOED_EINVAL;
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int grid = (int)(tiles < sms ? tiles : sms); /* one resident CTA per SM walks the tiles */
    kern<<<grid, tile_cfg<BM>::THREADS, L::bytes, (cudaStream_t)s>>>(tm_b, tm_a, tm_c, *g, num_n,
                                                                     (int)tiles);
    return cudaGetLastError() == cudaSuccess ? 0 : MOED_EDEVICE;
}

/* The instantiations: gathered A only for the up projection's epilogues. */
template <int BM> int dispatch(const moed_cuda_gemm *g, moed_cuda_stream s)
{
    const bool gather = g->a_rows != nullptr;
    return moed_cuda_epi_dispatch(g->epi, [&]<int EPI>() -> int {
        if constexpr (EPI == MOED_CUDA_EPI_STORE)
            return gather ? MOED_EINVAL : launch<BM, false, EPI>(g, s);
        else
            return gather ? launch<BM, true, EPI>(g, s) : launch<BM, false, EPI>(g, s);
    });
}

} // namespace

extern "C" int moed_cuda_gemm_fp8_sm90(const moed_cuda_gemm *g, moed_cuda_stream s)
{
    if (!g->a_scale || !g->b_scale || g->cdtype != MOED_BF16 || g->n % BN || g->k % BK ||
        g->lda % 16 || !moed_cuda_epi_c_ok(g))
        return MOED_EINVAL;
    if (g->bm == 128) return dispatch<128>(g, s);
    if (g->bm == 64) return dispatch<64>(g, s);
    return MOED_EINVAL;
}
