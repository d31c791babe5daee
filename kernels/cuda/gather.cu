/*
 * gather — copies each sorted row's token row out of X into a contiguous, expert-sorted matrix:
 * xp[s] = xc[slot_tok[s]] (compute-type rows). Only for the Hopper up projection on large experts,
 * where letting TMA stream A in 128-row boxes beats gathering rows with cp.async inside the GEMM by
 * more than this extra pass costs; the heuristic table (tile_config.c) decides, from measurements.
 * 16-byte copies.
 */
#include "moed_cuda.h"

#include "moed_err.h"

#include <cuda_runtime.h>

namespace
{

__global__ void gather_kernel(uint4 *xp, const uint4 *xc, const int32_t *slot_tok, int P, int row16)
{
    for (int s = blockIdx.x; s < P; s += gridDim.x) {
        const uint4 *src = xc + (int64_t)slot_tok[s] * row16;
        uint4 *dst = xp + (int64_t)s * row16;
        for (int c = threadIdx.x; c < row16; c += blockDim.x) dst[c] = src[c];
    }
}

} // namespace

extern "C" int moed_cuda_gather_rows(void *xp, const void *xc, const int32_t *slot_tok, int P,
                                     int d_pad, moed_cuda_stream s)
{
    if (P <= 0) return 0;
    const int row16 = (int)moed_cuda_cbytes(d_pad) / 16;
    const int grid = P < 65536 ? P : 65536; /* (clang-format misreads a `<` inside <<<...>>>) */
    gather_kernel<<<grid, 128, 0, (cudaStream_t)s>>>((uint4 *)xp, (const uint4 *)xc, slot_tok, P,
                                                     row16);
    return cudaGetLastError() == cudaSuccess ? 0 : MOED_EDEVICE;
}
