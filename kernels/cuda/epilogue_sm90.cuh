/*
 * epilogue_sm90 — the epilogue the Hopper GEMMs (gemm_sm90.cu, gemm_fp8_sm90.cu) share: a consumer
 * warpgroup's 64 x BN block of wgmma accumulators, activated, in 2-byte elements through a staging
 * buffer of its own in shared memory, then out to C.
 *
 * Rows that are all the expert's leave the buffer by TMA store, which runs on while the consumer
 * starts its next tile; a TMA store cannot mask rows, so an expert's last, partial rows leave by
 * 16-byte stores from the buffer instead (the rows after them are the next expert's). Either way a
 * warp writes whole 128-byte lines, where stores from the wgmma registers wrote 16 bytes into each
 * of 8 rows (docs/kernels-notes.md, "a TMA-store epilogue").
 *
 * The buffer holds MOED_CUDA_EPI_COLS output columns of the 64 rows, as boxes of 64 x 64 elements
 * with 128-byte swizzled rows: the layout the TMA store reads, and the swizzle puts a warp's 8 rows
 * on distinct banks. A tile of more output columns goes through it in rounds.
 */
#ifndef MOED_CUDA_EPILOGUE_SM90_CUH
#define MOED_CUDA_EPILOGUE_SM90_CUH

#include "gemm_common.cuh"
#include "tensor_map.h"

#include "moed_dtype.h"

#include <cuda.h>

constexpr int MOED_CUDA_EPI_ROWS = 64;  /* a consumer warpgroup's rows: wgmma's M */
constexpr int MOED_CUDA_EPI_BOX = 64;   /* columns of a store box: one 128-byte swizzle row */
constexpr int MOED_CUDA_EPI_COLS = 128; /* output columns a round stages */
constexpr int MOED_CUDA_EPI_ELEM = 2;   /* bf16 or f16 */
constexpr int MOED_CUDA_EPI_BOX_BYTES = MOED_CUDA_EPI_ROWS * MOED_CUDA_EPI_BOX * MOED_CUDA_EPI_ELEM;
/* Shared-memory bytes of one consumer's staging buffer. */
constexpr int MOED_CUDA_EPI_STAGE = MOED_CUDA_EPI_ROWS * MOED_CUDA_EPI_COLS * MOED_CUDA_EPI_ELEM;
static_assert(MOED_CUDA_EPI_BOX * MOED_CUDA_EPI_ELEM == (int)moed::ptx::sw128_row_bytes,
              "a staged row is one swizzle row");
static_assert(MOED_CUDA_EPI_COLS % MOED_CUDA_EPI_BOX == 0, "a round stages whole boxes");

/* C as the TMA store sees it: the [c_rows, output columns] matrix of the compute type, written in
 * boxes of 64 x 64. SwiGLU writes n/2 columns. 0, or MOED_EDEVICE. */
static inline int moed_cuda_epi_tensor_map(CUtensorMap *m, const moed_cuda_gemm *g)
{
    return moed_cuda_tensor_map(m, g->cdtype == MOED_BF16 ? MOED_CUDA_TM_BF16 : MOED_CUDA_TM_F16,
                                g->c, g->c_rows, moed_cuda_epi_cols(g->epi, g->n), g->ldc,
                                MOED_CUDA_EPI_BOX, MOED_CUDA_EPI_ROWS, 1);
}

/* What the launchers check of C before they build that map: 16-byte aligned rows. */
static inline bool moed_cuda_epi_c_ok(const moed_cuda_gemm *g)
{
    return g->ldc % 8 == 0 && (uintptr_t)g->c % 16 == 0 && g->c_rows >= 1;
}

/*
 * The output pairs of one warpgroup's 64 x BN block of wgmma accumulators: calls put(h, c8, v0, v1)
 * with the activated values of output columns 8*c8 + 2*(lane%4) + {0, 1} of the tile (c8 < OUT/8,
 * OUT = BN/2 for SwiGLU, else BN) in row 16*(warp%4) + lane/4 + 8h of the warpgroup's 64. Register
 * 4*c8 + 2*h + j holds column 8*c8 + 2*(lane%4) + j of that row; for SwiGLU gate blocks of
 * MOED_CUDA_GLU_BLOCK columns (GLU_C8 groups of 8) are followed by their up blocks, and output
 * block j is gate block j times up block j (moed_cuda_glu_col). Unrolled, so c8 is a constant at
 * each call.
 */
template <int EPI, int BN, typename F>
__device__ __forceinline__ void moed_cuda_wgmma_pairs(const float *acc, F &&put)
{
    constexpr int GLU_C8 = MOED_CUDA_GLU_BLOCK / 8;
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int c8 = 0; c8 < BN / 8; c8++) {
            const float v0 = acc[4 * c8 + 2 * h], v1 = acc[4 * c8 + 2 * h + 1];
            if constexpr (EPI == MOED_CUDA_EPI_SWIGLU) {
                if (c8 % (2 * GLU_C8) < GLU_C8)
                    put(h, moed_cuda_glu_col(8 * c8) / 8,
                        moed_cuda_silu(v0) * acc[4 * (c8 + GLU_C8) + 2 * h],
                        moed_cuda_silu(v1) * acc[4 * (c8 + GLU_C8) + 2 * h + 1]);
            } else {
                put(h, c8, moed_cuda_act(EPI, v0), moed_cuda_act(EPI, v1));
            }
        }
    }
}

/* The epilogue straight from the wgmma registers to C, each warp store 16 bytes into each of 8
 * rows: for a kernel whose one consumer should not wait on a staging round (the FP8 kernel at bm
 * 64, where staging cost up to 7%: docs/kernels-notes.md, "a TMA-store epilogue"). rbase is the row
 * of h = 0 (the warpgroup's first row + 16*(warp%4) + lane/4), n0 the tile's first column of B;
 * rows at or past row_end are not stored. */
template <typename T, int EPI, int BN>
__device__ __forceinline__ void moed_cuda_direct_epilogue(const moed_cuda_gemm &g, const float *acc,
                                                          int rbase, int row_end, int n0, int lane)
{
    T *c = static_cast<T *>(g.c) + moed_cuda_epi_cols(EPI, n0) + 2 * (lane & 3);
    moed_cuda_wgmma_pairs<EPI, BN>(acc, [&](int h, int c8, float v0, float v1) {
        const int r = rbase + 8 * h;
        if (r < row_end) moed_cuda_store2<T>(c + (int64_t)r * g.ldc + 8 * c8, v0, v1);
    });
}

/*
 * Consumer cw's epilogue (thread wt of its 128) for tile t: acc are its wgmma accumulators
 * (64 x BN), st and stp its staging buffer's shared address and generic pointer, tm_c
 * moed_cuda_epi_tensor_map's map. Each round first waits until the last round's stores have read
 * the buffer (the TMA store's issuer waits for its bulk group, then the warpgroup meets at its
 * named barrier 1 + cw), writes the round, and meets again before the rows leave. The thread that
 * issues the TMA stores (wt 0) must wait for its bulk groups before the CTA exits.
 */
template <typename T, int EPI, int BN>
__device__ __forceinline__ void
moed_cuda_staged_epilogue(const moed_cuda_gemm &g, const CUtensorMap *tm_c, const float *acc,
                          const moed_cuda_tile &t, int cw, uint32_t st, uint8_t *stp, int wt)
{
    namespace ptx = moed::ptx;
    constexpr int ROWS = MOED_CUDA_EPI_ROWS, BOX = MOED_CUDA_EPI_BOX, THREADS = 128;
    constexpr int OUT = moed_cuda_epi_cols(EPI, BN);
    constexpr int RCOLS = OUT < MOED_CUDA_EPI_COLS ? OUT : MOED_CUDA_EPI_COLS, ROUNDS = OUT / RCOLS;
    constexpr int R_C8 = RCOLS / 8, BOX_C8 = BOX / 8;
    static_assert(sizeof(T) == MOED_CUDA_EPI_ELEM, "2-byte output elements");
    static_assert(RCOLS % BOX == 0 && OUT % RCOLS == 0, "whole boxes, whole rounds");
    const int row0 = t.row0 + cw * ROWS;
    const int rows = min(t.row_end - row0, ROWS);
    if (rows <= 0) return; /* a cluster's spare rank, or consumer 1 of a tile of <= 64 rows */
    const int col0 = t.nt * OUT, width = moed_cuda_epi_cols(EPI, g.n);
    const int r = (wt >> 5) * 16 + ((wt & 31) >> 2); /* this thread's h = 0 row */
#pragma unroll
    for (int round = 0; round < ROUNDS; round++) {
        if (wt == 0) ptx::bulk_wait_read<0>();
        ptx::bar_sync(1 + cw, THREADS); /* named barrier 0 is __syncthreads' */
        moed_cuda_wgmma_pairs<EPI, BN>(acc, [&](int h, int c8, float v0, float v1) {
            if (c8 / R_C8 != round) return;
            const int c = c8 % R_C8;
            moed_cuda_store2<T>(reinterpret_cast<T *>(stp + (c / BOX_C8) * MOED_CUDA_EPI_BOX_BYTES +
                                                      moed_cuda_swz128(r + 8 * h, c % BOX_C8)) +
                                    2 * (wt & 3),
                                v0, v1);
        });
        ptx::fence_proxy_async();
        ptx::bar_sync(1 + cw, THREADS);
        const int c_round = col0 + round * RCOLS;
        if (rows == ROWS) {
            if (wt == 0) {
#pragma unroll
                for (int b = 0; b < RCOLS / BOX; b++)
                    ptx::tma_store_2d(tm_c, st + b * MOED_CUDA_EPI_BOX_BYTES, c_round + b * BOX,
                                      row0);
                ptx::bulk_commit();
            }
        } else { /* stopping at the C map's width, as the TMA store does (a clipped n-tile) */
            const int c8s = min(RCOLS, width - c_round) / 8;
            T *c = static_cast<T *>(g.c) + (int64_t)row0 * g.ldc + c_round;
            for (int i = wt; i < rows * c8s; i += THREADS) {
                const int ri = i / c8s, ci = i % c8s;
                *reinterpret_cast<uint4 *>(c + (int64_t)ri * g.ldc + 8 * ci) =
                    *reinterpret_cast<const uint4 *>(stp + (ci / BOX_C8) * MOED_CUDA_EPI_BOX_BYTES +
                                                     moed_cuda_swz128(ri, ci % BOX_C8));
            }
        }
    }
}

#endif
