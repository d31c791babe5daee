/*
 * route_prep — turns a batch's (token, expert, weight) pairs into what the grouped GEMMs walk, on
 * the GPU and with no host round trip: per-expert counts, their exclusive scan (each expert's
 * segment of sorted rows), the slot of every pair in that order, and the list of m-tiles
 * (expert, first row) for a tile height of bm rows. Three launches (count, scan, scatter), or one
 * for small batches.
 *
 * Slots within an expert's segment are taken with atomics, so their order varies from run to run;
 * that is harmless because each sorted row is computed independently of the rows around it and the
 * combine reads the pairs back in route order.
 *
 * Null pairs (expert E: moed_cuda.h) are counted and scattered as an expert E that has no m-tile:
 * their rows follow every real row (so slot_tok names a real token for all P rows, which the
 * pre-permuting gather reads), no GEMM computes them, and pair_slot names null_row, the zero row
 * the combine reads for them. The loops over pairs are the ones a route without null pairs always
 * ran: the counts have room for E + 1 experts, and the scatter picks the pair's slot or null_row
 * with a select.
 */
#include "moed_cuda.h"
#include "ptx/griddep.cuh"

#include "moed_err.h"

#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

namespace
{

constexpr int SCAN_THREADS = 1024, SCAN_ITEMS = 4; /* up to 4096 experts */
constexpr int SMALL_P = 16384;                     /* one launch up to this many pairs */

__global__ void count_kernel(const int32_t *pair_exp, int P, int E, int32_t *cnt)
{
    extern __shared__ int32_t hist[]; /* [E + 1]: null pairs counted at E, never flushed */
    for (int e = threadIdx.x; e <= E; e += blockDim.x) hist[e] = 0;
    __syncthreads();
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < P; p += gridDim.x * blockDim.x)
        atomicAdd(&hist[pair_exp[p]], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        if (hist[e]) atomicAdd(&cnt[e], hist[e]);
}

/* Exclusive scans of the per-expert counts (rows, then m-tiles), written as exp_off, the tile
 * lists, n_tiles, and each expert's first row into cursor (where scatter starts), null pairs' rows
 * starting at cursor[E] = exp_off[E]. One block. */
__device__ __forceinline__ void scan_counts(const moed_cuda_route_dev &r, const int32_t *counts,
                                            int32_t *cursor)
{
    typedef cub::BlockScan<int32_t, SCAN_THREADS> scan_t;
    __shared__ typename scan_t::TempStorage tmp;
    int32_t cnt[SCAN_ITEMS], tiles[SCAN_ITEMS], row_off[SCAN_ITEMS], tile_off[SCAN_ITEMS];
#pragma unroll
    for (int i = 0; i < SCAN_ITEMS; i++) {
        const int e = threadIdx.x * SCAN_ITEMS + i;
        cnt[i] = e < r.E ? counts[e] : 0;
        tiles[i] = (cnt[i] + r.bm - 1) / r.bm;
    }
    int32_t total_rows, total_tiles;
    scan_t(tmp).ExclusiveSum(cnt, row_off, total_rows);
    __syncthreads();
    scan_t(tmp).ExclusiveSum(tiles, tile_off, total_tiles);
    __syncthreads(); /* every thread has read counts before cursor (which may alias it) is written
                      */
#pragma unroll
    for (int i = 0; i < SCAN_ITEMS; i++) {
        const int e = threadIdx.x * SCAN_ITEMS + i;
        if (e >= r.E) continue;
        r.exp_off[e] = row_off[i];
        cursor[e] = row_off[i];
        for (int j = 0; j < tiles[i]; j++) {
            r.tile_exp[tile_off[i] + j] = e;
            r.tile_row[tile_off[i] + j] = row_off[i] + j * r.bm;
        }
    }
    if (threadIdx.x == 0) {
        r.exp_off[r.E] = total_rows;
        cursor[r.E] = total_rows;
        *r.n_tiles = total_tiles;
    }
}

__global__ void __launch_bounds__(SCAN_THREADS) scan_kernel(moed_cuda_route_dev r)
{
    scan_counts(r, r.cursor, r.cursor);
}

/* Small batches: count, scan and scatter in one block and one launch, with the counts and cursors
 * in shared memory — at a few dozen pairs the three launches cost more than the work. */
__global__ void __launch_bounds__(SCAN_THREADS) small_kernel(moed_cuda_route_dev r)
{
    moed::ptx::griddep_launch_dependents(); /* the GEMM after it may start (ptx/griddep.cuh) */
    __shared__ int32_t cnt[SCAN_THREADS * SCAN_ITEMS + 1];
    for (int e = threadIdx.x; e <= r.E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < r.P; p += blockDim.x) atomicAdd(&cnt[r.pair_exp[p]], 1);
    __syncthreads();
    scan_counts(r, cnt, cnt);
    __syncthreads();
    for (int p = threadIdx.x; p < r.P; p += blockDim.x) {
        const int e = r.pair_exp[p], slot = atomicAdd(&cnt[e], 1);
        r.slot_tok[slot] = r.pair_tok[p];
        r.pair_slot[p] = e < r.E ? slot : r.null_row;
    }
}

__global__ void scatter_kernel(moed_cuda_route_dev r)
{
    moed::ptx::griddep_launch_dependents(); /* the GEMM after it may start (ptx/griddep.cuh) */
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < r.P; p += gridDim.x * blockDim.x) {
        const int e = r.pair_exp[p], slot = atomicAdd(&r.cursor[e], 1);
        r.slot_tok[slot] = r.pair_tok[p];
        r.pair_slot[p] = e < r.E ? slot : r.null_row;
    }
}

} // namespace

extern "C" int moed_cuda_route_prep(const moed_cuda_route_dev *r, moed_cuda_stream s)
{
    cudaStream_t st = (cudaStream_t)s;
    if (r->E < 1 || r->E > SCAN_THREADS * SCAN_ITEMS || r->bm < 1) return MOED_EINVAL;
    if (r->P == 0) {
        cudaMemsetAsync(r->n_tiles, 0, sizeof(int32_t), st);
        cudaMemsetAsync(r->exp_off, 0, sizeof(int32_t) * (r->E + 1), st);
        return cudaGetLastError() == cudaSuccess ? 0 : MOED_EDEVICE;
    }
    if (r->P <= SMALL_P) {
        small_kernel<<<1, SCAN_THREADS, 0, st>>>(*r);
        return cudaGetLastError() == cudaSuccess ? 0 : MOED_EDEVICE;
    }
    const int blocks = (int)((r->P + 255) / 256 < 1024 ? (r->P + 255) / 256 : 1024);
    cudaMemsetAsync(r->cursor, 0, sizeof(int32_t) * r->E, st);
    count_kernel<<<blocks, 256, sizeof(int32_t) * (r->E + 1), st>>>(r->pair_exp, r->P, r->E,
                                                                    r->cursor);
    scan_kernel<<<1, SCAN_THREADS, 0, st>>>(*r);
    scatter_kernel<<<blocks, 256, 0, st>>>(*r);
    return cudaGetLastError() == cudaSuccess ? 0 : MOED_EDEVICE;
}
