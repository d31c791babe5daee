/*
 * gemm_sm80 — the portable grouped GEMM (sm_80 and newer): mma.sync m16n8k16 on Tensor Cores with
 * fp32 accumulation, a cp.async pipeline of STAGES shared-memory stages, ldmatrix fragment loads.
 *
 * One CTA computes one (expert, m-tile, n-tile). A's rows are gathered in the load itself: each
 * 16-byte chunk is fetched from X[token(row)] (or from H[row] when there is no gather), so no
 * permuted copy of the activations is ever written. Rows past the expert's segment are
 * zero-filled and never stored. Every output element is one fixed-order sum over K computed by one
 * thread's mma sequence, so a row's result does not depend on the other rows of its tile.
 *
 * The tile shapes are compile-time (one instantiation per shape the heuristic table can pick):
 *   bm 128: 8 warps as 4 x 2, warp tile 32 x 64 (large batches, compute-bound)
 *   bm  64: 4 warps as 2 x 2, warp tile 32 x 64
 *   bm  32: 4 warps as 2 x 2, warp tile 16 x 64, 5 stages (12-24 rows per expert: one m-tile holds
 *           an expert's rows where bm 16 would often need two, each streaming the same weights;
 *           5 stages of 20 KB keep two CTAs on an SM, where 6 would leave one)
 *   bm  16: 2 warps as 1 x 2, warp tile 16 x 64, 6 stages (few rows per expert: the kernel streams
 *           weights, and the deep pipeline keeps enough bytes in flight to run at HBM speed); 4
 *           stages when K <= 1024, where CTAs are short-lived and three per SM hide each other's
 *           start.
 * Every warp tile is 64 columns wide, aligned to 64: the SwiGLU epilogue finds each gate column's
 * up column (32 further, see MOED_CUDA_GLU_BLOCK) in the same thread's registers.
 *
 * FP8 weights (W8: g.b_scale set; A and C bf16): the portable path for block-scaled e4m3 layers.
 * The stage holds the tile's raw e4m3 bytes (64 a row) and its MOED_CUDA_FP8_SROWS-row scales;
 * after the stage lands, the threads dequantize it into one bf16 tile, each weight rounded once
 * from e4m3 x scale (float32), and the MMAs read that. The e4m3 decode is exact integer and float32
 * arithmetic, so it runs on GPUs without FP8 instructions.
 */
#include "gemm_common.cuh"
#include "launch.cuh"

#include "moed_dtype.h"
#include "moed_err.h"

#include <cuda_runtime.h>

#include <type_traits>

namespace
{

namespace ptx = moed::ptx;

constexpr int BK = 64; /* 128-byte shared rows */

/* Bytes of one stage: A rows, then B rows (bf16/f16: 128 bytes; W8: 64 e4m3 bytes, then the
 * tile's scales in one 16-byte chunk, padded so stages stay 128-byte aligned). */
template <int BM, int BN, bool W8> __host__ __device__ constexpr int stage_bytes()
{
    return BM * 128 + (W8 ? BN * BK + 128 : BN * 128);
}

/* Shared bytes of the kernel: the stages, and for W8 the dequantized bf16 B tile. */
template <int BM, int BN, int STAGES, bool W8> __host__ __device__ constexpr int smem_bytes()
{
    return STAGES * stage_bytes<BM, BN, W8>() + (W8 ? BN * 128 : 0);
}

/* e4m3 byte b to float32, exactly: its exponent and mantissa bits placed in a float32's, which is
 * then 2^-120 times the value (a float32 subnormal for e4m3's subnormals); the load refuses NaN
 * codes, so every code is a number. */
__device__ __forceinline__ float e4m3_value(uint32_t b)
{
    const float mag = __uint_as_float((b & 0x7fu) << 20) * 0x1p120f;
    return (b & 0x80u) ? -mag : mag;
}

/* 16 e4m3 weights times their scale, as 16 bf16 (two 16-byte chunks). */
__device__ __forceinline__ void dequant16(uint4 raw, float scale, uint4 out[2])
{
    const uint32_t w[4] = { raw.x, raw.y, raw.z, raw.w };
    uint32_t *o = reinterpret_cast<uint32_t *>(out);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const uint32_t word = w[i / 2] >> (16 * (i % 2));
        const __nv_bfloat162 p = __floats2bfloat162_rn(e4m3_value(word & 0xffu) * scale,
                                                       e4m3_value((word >> 8) & 0xffu) * scale);
        o[i] = *reinterpret_cast<const uint32_t *>(&p);
    }
}

template <typename T, int BM, int BN, int WM, int WN, int STAGES, int EPI, bool W8>
__global__ void __launch_bounds__(WM *WN * 32) gemm_sm80_kernel(const moed_cuda_gemm g, int num_n)
{
    constexpr int THREADS = WM * WN * 32;
    constexpr int WTM = BM / WM, WTN = BN / WN;
    constexpr int MI = WTM / 16, NI = WTN / 8;
    constexpr int B_ROW_CHUNKS = W8 ? BK / 16 : 8; /* 16-byte chunks of a B row in the stage */
    constexpr int A_CHUNKS = BM * 8 / THREADS, B_CHUNKS = BN * B_ROW_CHUNKS / THREADS;
    constexpr int A_STAGE = BM * 128, STAGE = stage_bytes<BM, BN, W8>();
    constexpr int B_GROUPS = BN / MOED_CUDA_FP8_SROWS; /* W8: scales of a tile per K block */
    static_assert(WTN == 64, "the SwiGLU epilogue needs 64-column warp tiles");
    static_assert(A_CHUNKS >= 1 && BM * 8 % THREADS == 0 && BN * B_ROW_CHUNKS % THREADS == 0,
                  "load split");
    static_assert(!W8 || (B_GROUPS * 4 == 16 && MOED_CUDA_FP8_K % BK == 0),
                  "W8: a tile's scales are one 16-byte chunk, K blocks whole stages");

    /* Started early (moed_cuda.h, MOED_CUDA_OVERLAP_*). With WEIGHTS the first weight stages load
     * before the wait, while the kernel before drains. A CTA without a tile exits at once: the
     * others' wait already keeps the grid from finishing before that kernel. Each CTA lets the
     * next kernel start only after its own wait, so a kernel started early always finds the one
     * two before it finished (the next GEMM reads route prep's tables before its wait). */
    const bool weights_first = g.overlap == MOED_CUDA_OVERLAP_WEIGHTS;
    if (!weights_first) {
        ptx::griddep_wait();
        ptx::griddep_launch_dependents();
    }
    moed_cuda_tile t;
    if (!moed_cuda_tile_of(g, num_n, blockIdx.x, t)) return;

    extern __shared__ __align__(1024) uint8_t smem[];
    const uint32_t sbase = ptx::smem_addr(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;

    /* Each thread's chunks: fixed shared offsets, and global sources that advance by BK per k-tile.
     */
    const T *a_src[A_CHUNKS];
    uint32_t a_dst[A_CHUNKS];
    int a_bytes[A_CHUNKS];
#pragma unroll
    for (int i = 0; i < A_CHUNKS; i++) {
        const int c = tid + i * THREADS, row = c >> 3, kc = c & 7;
        const int r = t.row0 + row;
        const bool ok = r < t.row_end;
        int64_t src = ok ? (g.a_rows ? g.a_rows[r] : r) : 0;
        if (src >= g.a_rows_total) src = 0; /* defensive: never read outside A */
        a_src[i] = static_cast<const T *>(g.a) + src * g.lda + kc * 8;
        a_dst[i] = moed_cuda_swz128(row, kc);
        a_bytes[i] = ok ? 16 : 0;
    }
    using TB = typename std::conditional<W8, uint8_t, T>::type; /* B's element in global memory */
    const TB *b_base = static_cast<const TB *>(g.b) + t.e * g.b_estride + (int64_t)t.nt * BN * g.k;
    const int ktiles = g.k / BK;
    /* W8: the tile's scales, 16 bytes from column (e·n + nt·BN) / SROWS of K block kb's row */
    const float *sc_base =
        W8 ? g.b_scale + ((int64_t)t.e * g.n + (int64_t)t.nt * BN) / MOED_CUDA_FP8_SROWS : nullptr;
    const int64_t sc_ld = (int64_t)g.b_experts * g.n / MOED_CUDA_FP8_SROWS;

    auto load_a = [&](int stage, int kt) {
        const uint32_t sa = sbase + stage * STAGE;
#pragma unroll
        for (int i = 0; i < A_CHUNKS; i++)
            ptx::cp_async16(sa + a_dst[i], a_src[i] + kt * BK, a_bytes[i]);
    };
    auto load_b = [&](int stage, int kt) {
        const uint32_t sb = sbase + stage * STAGE + A_STAGE;
#pragma unroll
        for (int i = 0; i < B_CHUNKS; i++) {
            const int c = tid + i * THREADS, row = c / B_ROW_CHUNKS, kc = c % B_ROW_CHUNKS;
            if constexpr (W8) /* raw rows of BK bytes, unswizzled: the dequant reads them */
                ptx::cp_async16(sb + row * BK + kc * 16,
                                b_base + (int64_t)row * g.k + kt * BK + kc * 16, 16);
            else
                ptx::cp_async16(sb + moed_cuda_swz128(row, kc),
                                b_base + (int64_t)row * g.k + kt * BK + kc * 8, 16);
        }
        if constexpr (W8)
            if (tid == 0)
                ptx::cp_async16(sb + BN * BK,
                                sc_base + (int64_t)(kt * BK / MOED_CUDA_FP8_K) * sc_ld, 16);
    };
    /* W8: the landed stage's weights, dequantized into the bf16 tile at sbase + STAGES·STAGE */
    auto dequant_stage = [&](int stage) {
        const uint8_t *raw = smem + stage * STAGE + A_STAGE;
        const float *sc = reinterpret_cast<const float *>(raw + BN * BK);
#pragma unroll
        for (int i = 0; i < B_CHUNKS; i++) {
            const int c = tid + i * THREADS, row = c / B_ROW_CHUNKS, kc = c % B_ROW_CHUNKS;
            uint4 out[2];
            dequant16(*reinterpret_cast<const uint4 *>(raw + row * BK + kc * 16),
                      sc[row / MOED_CUDA_FP8_SROWS], out);
            uint8_t *dst = smem + STAGES * STAGE;
            *reinterpret_cast<uint4 *>(dst + moed_cuda_swz128(row, 2 * kc)) = out[0];
            *reinterpret_cast<uint4 *>(dst + moed_cuda_swz128(row, 2 * kc + 1)) = out[1];
        }
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[mi][ni][j] = 0.0f;

    /* The prologue's weight stages join the first cp.async group, so waiting for stage 0 also
     * waits for them; each later group holds one stage's A. */
    if (weights_first) {
#pragma unroll
        for (int s = 0; s < STAGES - 1; s++)
            if (s < ktiles) load_b(s, s);
        ptx::griddep_wait();
        ptx::griddep_launch_dependents();
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ktiles) {
            load_a(s, s);
            if (!weights_first) load_b(s, s);
        }
        ptx::cp_async_commit();
    }

    for (int kt = 0; kt < ktiles; kt++) {
        ptx::cp_async_wait<STAGES - 2>();
        __syncthreads(); /* stage kt landed for everyone; stage kt-1 is free to refill */
        const int nk = kt + STAGES - 1;
        if (nk < ktiles) {
            load_a(nk % STAGES, nk);
            load_b(nk % STAGES, nk);
        }
        ptx::cp_async_commit();
        if constexpr (W8) {
            dequant_stage(kt % STAGES);
            __syncthreads(); /* the bf16 tile is whole before any warp reads it */
        }

        const uint32_t sa = sbase + (kt % STAGES) * STAGE,
                       sb = W8 ? sbase + STAGES * STAGE : sa + A_STAGE;
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            uint32_t af[MI][4], bf[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                const int row = wm * WTM + mi * 16 + (lane & 15);
                ptx::ldmatrix_x4(af[mi], sa + moed_cuda_swz128(row, kk * 2 + (lane >> 4)));
            }
#pragma unroll
            for (int nj = 0; nj < NI / 2; nj++) {
                const int row = wn * WTN + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
                uint32_t r[4];
                ptx::ldmatrix_x4(r, sb + moed_cuda_swz128(row, kk * 2 + ((lane >> 3) & 1)));
                bf[2 * nj][0] = r[0];
                bf[2 * nj][1] = r[1];
                bf[2 * nj + 1][0] = r[2];
                bf[2 * nj + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int ni = 0; ni < NI; ni++) ptx::mma_m16n8k16<T>(acc[mi][ni], af[mi], bf[ni]);
        }
    }
    ptx::cp_async_wait<0>();

    /* Accumulator (mi, ni, j): row wm*WTM + mi*16 + lane/4 (+8 for j >= 2), column
     * wn*64 + ni*8 + 2*(lane%4) (+1 for odd j). Gate columns are ni < 4, their up columns ni + 4.
     */
    constexpr int NOUT = NI / 2;
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = t.row0 + wm * WTM + mi * 16 + (lane >> 2) + h * 8;
            if (r >= t.row_end) continue;
#pragma unroll
            for (int ni = 0; ni < NI; ni++) {
                const int n = t.nt * BN + wn * WTN + ni * 8 + 2 * (lane & 3);
                const float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
                if constexpr (EPI == MOED_CUDA_EPI_SWIGLU) {
                    if (ni < NOUT)
                        moed_cuda_epilogue2<T, EPI>(g, r, n, v0, v1, acc[mi][ni + NOUT][2 * h],
                                                    acc[mi][ni + NOUT][2 * h + 1]);
                } else {
                    moed_cuda_epilogue2<T, EPI>(g, r, n, v0, v1, 0.0f, 0.0f);
                }
            }
        }
}

template <typename T, int BM, int BN, int WM, int WN, int STAGES, int EPI, bool W8>
int launch_epi(const moed_cuda_gemm *g, moed_cuda_stream s)
{
    constexpr int smem = smem_bytes<BM, BN, STAGES, W8>();
    auto kern = gemm_sm80_kernel<T, BM, BN, WM, WN, STAGES, EPI, W8>;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
        cudaSuccess)
        return MOED_EDEVICE;
    const int num_n = g->n / BN;
    const int64_t ctas = (int64_t)num_n * g->max_tiles;
    if (ctas <= 0) return 0;
    if (ctas > 0x7fffffff) return MOED_EINVAL;
    return moed_cuda_launch(kern, { dim3((unsigned)ctas), dim3(WM * WN * 32), smem, 1 },
                            (cudaStream_t)s, g->overlap != MOED_CUDA_OVERLAP_NONE, *g, num_n);
}

template <typename T, int BM, int BN, int WM, int WN, int STAGES>
int launch(const moed_cuda_gemm *g, moed_cuda_stream s)
{
    return moed_cuda_epi_dispatch(g->epi, [&]<int EPI>() {
        if constexpr (std::is_same<T, __nv_bfloat16>::value)
            if (g->b_scale) return launch_epi<T, BM, BN, WM, WN, STAGES, EPI, true>(g, s);
        return launch_epi<T, BM, BN, WM, WN, STAGES, EPI, false>(g, s);
    });
}

template <typename T> int dispatch(const moed_cuda_gemm *g, moed_cuda_stream s)
{
    switch (g->bm) {
    case 128:
        return launch<T, 128, 128, 4, 2, 4>(g, s);
    case 64:
        return launch<T, 64, 128, 2, 2, 4>(g, s);
    case 32:
        return launch<T, 32, 128, 2, 2, 5>(g, s);
    case 16: /* short K: a few CTAs more per SM beat a deeper pipeline */
        return g->k <= 1024 ? launch<T, 16, 128, 1, 2, 4>(g, s) : launch<T, 16, 128, 1, 2, 6>(g, s);
    }
    return MOED_EINVAL;
}

} // namespace

extern "C" int moed_cuda_gemm_sm80(const moed_cuda_gemm *g, int bn, moed_cuda_stream s)
{
    if (bn != 128 || g->n % 128 || g->k % BK || g->a_scale ||
        (g->b_scale && g->cdtype != MOED_BF16))
        return MOED_EINVAL;
    if (g->cdtype == MOED_BF16) return dispatch<__nv_bfloat16>(g, s);
    if (g->cdtype == MOED_F16) return dispatch<__half>(g, s);
    return MOED_EINVAL;
}
