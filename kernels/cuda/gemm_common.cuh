/*
 * gemm_common — what both grouped-GEMM kernel families share: the walk from a CTA's index to its
 * (expert, m-tile, n-tile), the epilogue arithmetic, and the 128-byte swizzle of shared rows (the
 * instructions themselves are in ptx/).
 *
 * Tile order: CTAs are numbered over (m-tile, n-tile) in bands of MOED_CUDA_GROUP_M m-tiles, m
 * fastest within a band, so the CTAs resident at one time share a few A row blocks and a few weight
 * column blocks and both stay in L2 (without it every m-tile re-reads a whole expert from HBM).
 */
#ifndef MOED_CUDA_GEMM_COMMON_CUH
#define MOED_CUDA_GEMM_COMMON_CUH

#include "moed_cuda.h"
#include "ptx/ptx.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define MOED_CUDA_GROUP_M 8

struct moed_cuda_tile {
    int e;         /* expert */
    int row0;      /* first sorted row of the tile */
    int row_end;   /* one past the last row of the expert's segment */
    int nt;        /* n-tile */
    bool shared_b; /* clusters: every CTA of the cluster has this expert's weight tile */
};

/*
 * Maps work unit `id` to the tile of the CTA of rank `rank` in a cluster of MC CTAs along M; false
 * when the unit is past the m-tiles in use (the CTA, and its whole cluster, is done). A unit is MC
 * consecutive m-tiles at one n-tile, one a CTA; route prep lists m-tiles in expert order, so they
 * share the weight tile (shared_b) when the unit's first and last are of one expert. A rank past
 * the last m-tile gets a tile with no rows of the unit's expert: it still loads its slice of the
 * weights for the others. Bands hold MOED_CUDA_GROUP_M m-tiles whatever MC is.
 */
template <int MC = 1>
__device__ __forceinline__ bool moed_cuda_tile_of(const moed_cuda_gemm &g, int num_n, int id,
                                                  moed_cuda_tile &t, int rank = 0)
{
    constexpr int GROUP = MOED_CUDA_GROUP_M / MC;
    static_assert(GROUP * MC == MOED_CUDA_GROUP_M, "a band holds whole units");
    const int units = (g.max_tiles + MC - 1) / MC;
    const int band = GROUP * num_n;
    const int first_u = (id / band) * GROUP;
    const int units_in_band = min(units - first_u, GROUP);
    const int within = id % band;
    const int mt0 = (first_u + within % units_in_band) * MC, mt = mt0 + rank;
    t.nt = within / units_in_band;
    t.shared_b = true;
    if (g.tile_exp) {
        const int n = *g.n_tiles;
        if (mt0 >= n) return false;
        if (mt < n) {
            t.e = g.tile_exp[mt];
            t.row0 = g.tile_row[mt];
        } else {
            t.e = g.tile_exp[mt0];
            t.row0 = g.exp_off[t.e + 1];
        }
        t.row_end = g.exp_off[t.e + 1];
        if constexpr (MC > 1) t.shared_b = g.tile_exp[min(mt0 + MC, n) - 1] == g.tile_exp[mt0];
    } else {
        if (mt0 * g.bm >= g.identity_rows) return false;
        t.row0 = mt * g.bm;
        t.e = 0;
        t.row_end = g.identity_rows;
    }
    return true;
}

/* silu through the fast intrinsics: the result is rounded to bf16/f16 right after, far coarser than
 * their few-ulp error, and the unrolled epilogue stays small enough for the instruction cache. For
 * a very negative a the divisor overflows and __fdividef returns 0, which is silu's limit. */
__device__ __forceinline__ float moed_cuda_silu(float a)
{
    return __fdividef(a, 1.0f + __expf(-a));
}

__device__ __forceinline__ float moed_cuda_act(int epi, float a)
{
    if (epi == MOED_CUDA_EPI_GELU) return 0.5f * a * (1.0f + erff(a * 0.70710678118654752f));
    if (epi == MOED_CUDA_EPI_RELU) return fmaxf(a, 0.0f);
    return a;
}

/* Two adjacent columns of one row as they are stored: the 32 bits of a T pair. */
template <typename T> __device__ __forceinline__ uint32_t moed_cuda_pack2(float v0, float v1);
template <> __device__ __forceinline__ uint32_t moed_cuda_pack2<__nv_bfloat16>(float v0, float v1)
{
    const __nv_bfloat162 b = __floats2bfloat162_rn(v0, v1);
    return *reinterpret_cast<const uint32_t *>(&b);
}
template <> __device__ __forceinline__ uint32_t moed_cuda_pack2<__half>(float v0, float v1)
{
    const __half2 b = __floats2half2_rn(v0, v1);
    return *reinterpret_cast<const uint32_t *>(&b);
}

/* Stores two adjacent columns of one row. */
template <typename T> __device__ __forceinline__ void moed_cuda_store2(T *p, float v0, float v1)
{
    *reinterpret_cast<uint32_t *>(p) = moed_cuda_pack2<T>(v0, v1);
}

/* The column of H that gate column n of the up projection (n % (2 * MOED_CUDA_GLU_BLOCK) <
 * MOED_CUDA_GLU_BLOCK) and its up column n + MOED_CUDA_GLU_BLOCK produce: W13 interleaves gate and
 * up blocks of MOED_CUDA_GLU_BLOCK rows. */
__host__ __device__ constexpr int moed_cuda_glu_col(int n)
{
    return n / (2 * MOED_CUDA_GLU_BLOCK) * MOED_CUDA_GLU_BLOCK + n % (2 * MOED_CUDA_GLU_BLOCK);
}

/* The columns of C that the first n columns of the GEMM give under epilogue epi: half of them
 * under SwiGLU (a gate and an up column make one), else all. */
__host__ __device__ constexpr int moed_cuda_epi_cols(int epi, int n)
{
    return epi == MOED_CUDA_EPI_SWIGLU ? n / 2 : n;
}

/*
 * The epilogue of one accumulator pair: columns n, n+1 (global, even) of tile row `row`, with
 * (u0, u1) the same row's columns n + MOED_CUDA_GLU_BLOCK for SwiGLU (the matching up projection:
 * W13 interleaves gate and up blocks of MOED_CUDA_GLU_BLOCK rows). Callers pass only gate columns
 * for SwiGLU. EPI is a template parameter: each kernel carries only its own epilogue (a runtime
 * switch in a fully unrolled epilogue made the Hopper kernels too large for the instruction cache).
 * moed_cuda_epilogue_pack2 gives the pair's values as stored, moed_cuda_epilogue_col the column of
 * C they go to (consecutive for consecutive gate columns of one block), moed_cuda_epilogue2 stores
 * them; a kernel that gathers several pairs into a wider store uses the first two.
 */
template <typename T, int EPI>
__device__ __forceinline__ uint32_t moed_cuda_epilogue_pack2(float v0, float v1, float u0, float u1)
{
    if constexpr (EPI == MOED_CUDA_EPI_SWIGLU)
        return moed_cuda_pack2<T>(moed_cuda_silu(v0) * u0, moed_cuda_silu(v1) * u1);
    else
        return moed_cuda_pack2<T>(moed_cuda_act(EPI, v0), moed_cuda_act(EPI, v1));
}
template <int EPI> __device__ __forceinline__ int moed_cuda_epilogue_col(int n)
{
    return EPI == MOED_CUDA_EPI_SWIGLU ? moed_cuda_glu_col(n) : n;
}
template <typename T, int EPI>
__device__ __forceinline__ void moed_cuda_epilogue2(const moed_cuda_gemm &g, int64_t row, int n,
                                                    float v0, float v1, float u0, float u1)
{
    *reinterpret_cast<uint32_t *>(static_cast<T *>(g.c) + row * g.ldc +
                                  moed_cuda_epilogue_col<EPI>(n)) =
        moed_cuda_epilogue_pack2<T, EPI>(v0, v1, u0, u1);
}

/* Calls f.template operator()<EPI>() for the runtime epilogue kind: the one place the kinds are
 * listed for the launchers. */
template <typename F> __host__ __forceinline__ int moed_cuda_epi_dispatch(int epi, F &&f)
{
    switch (epi) {
    case MOED_CUDA_EPI_SWIGLU:
        return f.template operator()<MOED_CUDA_EPI_SWIGLU>();
    case MOED_CUDA_EPI_GELU:
        return f.template operator()<MOED_CUDA_EPI_GELU>();
    case MOED_CUDA_EPI_RELU:
        return f.template operator()<MOED_CUDA_EPI_RELU>();
    case MOED_CUDA_EPI_STORE:
        return f.template operator()<MOED_CUDA_EPI_STORE>();
    }
    return -1;
}

/* The first tile in use at or after unit id, stepping by the grid's clusters; false when none is
 * left. */
template <int MC = 1>
__device__ __forceinline__ bool moed_cuda_next_tile(const moed_cuda_gemm &g, int num_n, int total,
                                                    int &id, moed_cuda_tile &t, int rank = 0)
{
    for (; id < total; id += gridDim.x / MC)
        if (moed_cuda_tile_of<MC>(g, num_n, id, t, rank)) return true;
    return false;
}

/* 128-byte shared rows of 8 16-byte chunks, chunk index XOR (row mod 8): the layout both ldmatrix
 * (conflict-free) and wgmma's 128-byte swizzle mode expect. */
__device__ __forceinline__ uint32_t moed_cuda_swz128(int row, int chunk)
{
    return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

#endif
