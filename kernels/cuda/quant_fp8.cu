/*
 * quant_fp8 — rows quantized to e4m3 per row and 128 columns, the A operand of the FP8 Hopper GEMM:
 * the request's hidden rows (f32, f16 or bf16) before the up projection, and H (bf16) before the
 * down projection. One warp per (row, 128-column group), four columns a lane: the group's largest
 * magnitude by a warp reduction, scale = amax / 448 (1 for a group of zeros), then each value
 * divided by it and rounded to nearest e4m3, saturating — moed_fp8.h's rule, one scale per
 * group. A row's codes and scales depend on that row alone, so merged batches quantize each token
 * as it would be alone.
 */
#include "dtype.cuh"
#include "moed_cuda.h"

#include <cuda_fp8.h>
#include <cuda_runtime.h>

namespace
{

constexpr int GROUP = MOED_CUDA_FP8_K, WARP = 32, PER_LANE = GROUP / WARP;
static_assert(PER_LANE == 4, "a lane packs its four codes into one 32-bit store");
constexpr int THREADS = 256;

template <typename T>
__global__ void quant_kernel(const T *x, int64_t R, int cols, int64_t ldx, uint8_t *q, int cols_pad,
                             float *scale, int64_t scale_ld)
{
    const int groups = cols_pad / GROUP, lane = threadIdx.x & (WARP - 1);
    const int64_t n = R * groups, stride = (int64_t)gridDim.x * (THREADS / WARP);
    for (int64_t w = (int64_t)blockIdx.x * (THREADS / WARP) + threadIdx.x / WARP; w < n;
         w += stride) {
        const int64_t r = w / groups;
        const int grp = (int)(w - r * groups), c0 = grp * GROUP + lane * PER_LANE;
        float v[PER_LANE], amax = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            v[i] = c0 + i < cols ? moed_cuda_to_f32<T>(x[r * ldx + c0 + i]) : 0.0f;
            amax = fmaxf(amax, fabsf(v[i]));
        }
#pragma unroll
        for (int off = WARP / 2; off > 0; off /= 2)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        float s = amax / 448.0f;
        if (s == 0.0f) s = 1.0f;
        uint32_t packed = 0;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++)
            packed |= (uint32_t)__nv_cvt_float_to_fp8(v[i] / s, __NV_SATFINITE, __NV_E4M3)
                      << (8 * i);
        *reinterpret_cast<uint32_t *>(q + r * cols_pad + c0) = packed;
        if (lane == 0) scale[grp * scale_ld + r] = s;
    }
}

} // namespace

extern "C" int moed_cuda_quant_fp8(const void *x, int dtype, int64_t R, int cols, int64_t ldx,
                                   void *q, int cols_pad, float *scale, int64_t scale_ld,
                                   moed_cuda_stream s)
{
    if (R <= 0) return 0;
    if (cols_pad % GROUP || cols > cols_pad) return MOED_EINVAL;
    const int64_t warps = R * (cols_pad / GROUP),
                  want = (warps + THREADS / WARP - 1) / (THREADS / WARP);
    const int blocks = (int)(want < 8192 ? want : 8192);
    return moed_cuda_float_dispatch(dtype, [&]<typename T>() {
        quant_kernel<T><<<blocks, THREADS, 0, (cudaStream_t)s>>>(
            (const T *)x, R, cols, ldx, (uint8_t *)q, cols_pad, scale, scale_ld);
        return cudaGetLastError() == cudaSuccess ? 0 : MOED_EDEVICE;
    });
}
