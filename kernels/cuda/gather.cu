/*
 * gather — copies rows picked by index into a contiguous matrix: dst[s] = src[idx[s]], each row
 * row_bytes long. Two callers: the Hopper up projection on large experts, whose token rows are
 * laid out expert-sorted first (xp[s] = xc[slot_tok[s]]) where letting TMA stream A in 128-row
 * boxes beats gathering rows with cp.async inside the GEMM by more than this extra pass costs (the
 * heuristic table, tile_config.c, decides from measurements); and a split layer's part, which
 * takes only the rows of its own tokens from the home GPU's x (over peer access). The widest
 * copies the row length and addresses allow (16 bytes for every compute-type row).
 *
 * FP8 rows carry their scales in a table of one column per row ([groups][ld], moed_cuda.h), so
 * pre-permuting them gathers that table's columns by the same index.
 */
#include "moed_cuda.h"

#include "moed_err.h"

#include <cuda_runtime.h>
#include <stdint.h>

namespace
{

template <typename U>
__global__ void gather_kernel(U *dst, const U *src, const int32_t *idx, int n, int64_t row_units)
{
    for (int s = blockIdx.x; s < n; s += gridDim.x) {
        const U *from = src + (int64_t)idx[s] * row_units;
        U *to = dst + (int64_t)s * row_units;
        for (int64_t c = threadIdx.x; c < row_units; c += blockDim.x) to[c] = from[c];
    }
}

template <typename U>
int launch(void *dst, const void *src, const int32_t *idx, int n, size_t row_bytes, cudaStream_t s)
{
    const int grid = n < 65536 ? n : 65536; /* (clang-format misreads a `<` inside <<<...>>>) */
    gather_kernel<U>
        <<<grid, 128, 0, s>>>((U *)dst, (const U *)src, idx, n, (int64_t)(row_bytes / sizeof(U)));
    return cudaGetLastError() == cudaSuccess ? 0 : MOED_EDEVICE;
}

__global__ void gather_cols_kernel(float *dst, int64_t dst_ld, const float *src, int64_t src_ld,
                                   const int32_t *idx, int n, int64_t total)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c = i / n, s = i - c * n;
        dst[c * dst_ld + s] = src[c * src_ld + idx[s]];
    }
}

} // namespace

extern "C" int moed_cuda_gather_cols(float *dst, int64_t dst_ld, const float *src, int64_t src_ld,
                                     const int32_t *idx, int n, int groups, moed_cuda_stream s)
{
    const int64_t total = (int64_t)n * groups;
    if (total <= 0) return 0;
    const int64_t want = (total + 255) / 256;
    gather_cols_kernel<<<(int)(want < 65536 ? want : 65536), 256, 0, (cudaStream_t)s>>>(
        dst, dst_ld, src, src_ld, idx, n, total);
    return cudaGetLastError() == cudaSuccess ? 0 : MOED_EDEVICE;
}

extern "C" int moed_cuda_gather_rows(void *dst, const void *src, const int32_t *idx, int n,
                                     size_t row_bytes, moed_cuda_stream s)
{
    if (n <= 0) return 0;
    const uintptr_t a = (uintptr_t)dst | (uintptr_t)src | row_bytes;
    cudaStream_t st = (cudaStream_t)s;
    if (a % 16 == 0) return launch<uint4>(dst, src, idx, n, row_bytes, st);
    if (a % 4 == 0) return launch<uint32_t>(dst, src, idx, n, row_bytes, st);
    if (a % 2 == 0) return launch<uint16_t>(dst, src, idx, n, row_bytes, st);
    return launch<uint8_t>(dst, src, idx, n, row_bytes, st);
}
