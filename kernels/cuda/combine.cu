/*
 * combine — each token's output: the weighted sum of its experts' rows in the order its route lists
 * them, in fp32, plus the shared experts' row, converted once to the request's dtype. One block per
 * token and a fixed order per token make the result deterministic and independent of the batch
 * (never an atomic add across pairs). Eight columns per thread with 16-byte loads when the row
 * width allows, one otherwise; a block per token, or for small batches a warp per 256 columns of a
 * token, so they still spread their loads over many SMs (T = 8 at d 2048: 64 blocks, not 8).
 * Small batches also start while the GEMM before drains: the token's slots and weights are staged
 * first, and Y is read after the wait (ptx/griddep.cuh). Large batches gain nothing from either
 * (H200: DBRX T=16384 0.29 ms as one block per token, 0.36 ms in slices).
 */
#include "dtype.cuh"
#include "launch.cuh"
#include "moed_cuda.h"
#include "ptx/griddep.cuh"

#include <cuda_runtime.h>

namespace
{

/* Adds w times 8 consecutive elements at src to acc. */
template <typename Tc> __device__ __forceinline__ void fma8(float acc[8], const Tc *src, float w)
{
    const uint4 raw = *reinterpret_cast<const uint4 *>(src);
    const Tc *v = reinterpret_cast<const Tc *>(&raw);
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] += w * moed_cuda_to_f32<Tc>(v[i]);
}

/* The end both combines share: token t's shared experts' row (ys, when not NULL) added to acc at
 * column c, and the W sums rounded once into o. */
template <typename Tc, typename Tout, bool VEC8>
__device__ __forceinline__ void finish_columns(float *acc, const Tc *ys, int t, int d_pad, int c,
                                               Tout *o)
{
    constexpr int W = VEC8 ? 8 : 1;
    if (ys) {
        const Tc *row = ys + (int64_t)t * d_pad + c;
        if constexpr (VEC8)
            fma8<Tc>(acc, row, 1.0f);
        else
            acc[0] += moed_cuda_to_f32<Tc>(row[0]);
    }
#pragma unroll
    for (int i = 0; i < W; i++) o[c + i] = moed_cuda_from_f32<Tout>(acc[i]);
}

constexpr int MAX_STAGED = 256; /* pairs of a token staged in shared memory; more: the slow loop */
constexpr int SMALL_T = 256;    /* fewer tokens: slices of rows, started early */

template <typename Tc, typename Tout, bool VEC8>
__global__ void combine_kernel(moed_cuda_route_dev r, const Tc *y, const Tc *ys, int d, int d_pad,
                               Tout *out)
{
    __shared__ int32_t slot[MAX_STAGED];
    __shared__ float wt[MAX_STAGED];
    const int t = blockIdx.x;
    const int j0 = r.tok_off[t], n = r.tok_off[t + 1] - j0;
    /* The token's slots and weights first, all at once: the row loads below are then independent
     * of each other instead of each waiting on its own index load. */
    const bool staged = n <= MAX_STAGED;
    if (staged)
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            slot[j] = r.pair_slot[j0 + j];
            wt[j] = r.pair_w[j0 + j];
        }
    __syncthreads();
    moed::ptx::griddep_wait();
    Tout *o = out + (int64_t)t * d;
    constexpr int W = VEC8 ? 8 : 1;
    for (int c = (blockIdx.y * blockDim.x + threadIdx.x) * W; c < d;
         c += gridDim.y * blockDim.x * W) {
        float acc[W];
#pragma unroll
        for (int i = 0; i < W; i++) acc[i] = 0.0f;
#pragma unroll 4
        for (int j = 0; j < n; j++) {
            const int s = staged ? slot[j] : r.pair_slot[j0 + j];
            const float w = staged ? wt[j] : r.pair_w[j0 + j];
            const Tc *row = y + (int64_t)s * d_pad + c;
            if constexpr (VEC8)
                fma8<Tc>(acc, row, w);
            else
                acc[0] += w * moed_cuda_to_f32<Tc>(row[0]);
        }
        finish_columns<Tc, Tout, VEC8>(acc, ys, t, d_pad, c, o);
    }
}

/* out[t] = Σ_q rows[row[q·T + t]] (the parts in order, rows that are -1 left out), plus ys[t]
 * when ys is not NULL, in fp32, rounded once. */
template <typename Tc, typename Tout, bool VEC8>
__global__ void combine_parts_kernel(const int32_t *row, int n_parts, int T, const float *rows,
                                     const Tc *ys, int d, int d_pad, Tout *out)
{
    __shared__ int32_t at[MOED_CUDA_MAX_PARTS];
    const int t = blockIdx.x;
    for (int q = threadIdx.x; q < n_parts; q += blockDim.x) at[q] = row[(int64_t)q * T + t];
    __syncthreads();
    Tout *o = out + (int64_t)t * d;
    constexpr int W = VEC8 ? 8 : 1;
    for (int c = (blockIdx.y * blockDim.x + threadIdx.x) * W; c < d;
         c += gridDim.y * blockDim.x * W) {
        float acc[W];
#pragma unroll
        for (int i = 0; i < W; i++) acc[i] = 0.0f;
        for (int q = 0; q < n_parts; q++) {
            if (at[q] < 0) continue;
            const float *p = rows + (int64_t)at[q] * d + c;
            if constexpr (VEC8) {
                const float4 u = *reinterpret_cast<const float4 *>(p),
                             v = *reinterpret_cast<const float4 *>(p + 4);
                acc[0] += u.x, acc[1] += u.y, acc[2] += u.z, acc[3] += u.w;
                acc[4] += v.x, acc[5] += v.y, acc[6] += v.z, acc[7] += v.w;
            } else {
                acc[0] += p[0];
            }
        }
        finish_columns<Tc, Tout, VEC8>(acc, ys, t, d_pad, c, o);
    }
}

/* The grid both combines take: a block per token, or below SMALL_T tokens also a block per slice
 * of columns, so a few tokens still spread over many SMs. */
struct combine_grid {
    dim3 grid, block;
    bool small, vec8;
};

static combine_grid grid_for(int64_t T, int d)
{
    const bool small = T < SMALL_T;
    const int threads = small ? 32 : d >= 1024 ? 128 : 64, w = d % 8 == 0 ? 8 : 1;
    return { dim3((unsigned)T, small ? (unsigned)((d + threads * w - 1) / (threads * w)) : 1),
             dim3(threads), small, w == 8 };
}

template <typename Tc, typename Tout>
int launch(const moed_cuda_route_dev *r, const void *y, const void *ys, int d, int d_pad, void *out,
           cudaStream_t s)
{
    const combine_grid g = grid_for(r->T, d);
    auto kern = g.vec8 ? combine_kernel<Tc, Tout, true> : combine_kernel<Tc, Tout, false>;
    return moed_cuda_launch(kern, { g.grid, g.block, 0, 1 }, s, g.small, *r, (const Tc *)y,
                            (const Tc *)ys, d, d_pad, (Tout *)out);
}

template <typename Tc>
int dispatch_out(const moed_cuda_route_dev *r, const void *y, const void *ys, int d, int d_pad,
                 void *out, int dtype, cudaStream_t s)
{
    return moed_cuda_float_dispatch(
        dtype, [&]<typename Tout>() { return launch<Tc, Tout>(r, y, ys, d, d_pad, out, s); });
}

template <typename Tc, typename Tout>
int launch_parts(const int32_t *row, int n_parts, int64_t T, const float *rows, const void *ys,
                 int d, int d_pad, void *out, cudaStream_t s)
{
    const combine_grid g = grid_for(T, d);
    auto kern =
        g.vec8 ? combine_parts_kernel<Tc, Tout, true> : combine_parts_kernel<Tc, Tout, false>;
    return moed_cuda_launch(kern, { g.grid, g.block, 0, 1 }, s, false, row, n_parts, (int)T, rows,
                            (const Tc *)ys, d, d_pad, (Tout *)out);
}

} // namespace

extern "C" int moed_cuda_combine_parts(const int32_t *row, int n_parts, int64_t T,
                                       const float *rows, const void *ys, int cdtype, int d,
                                       int d_pad, void *out, int dtype, moed_cuda_stream s)
{
    if (T <= 0) return 0;
    if (n_parts < 1 || n_parts > MOED_CUDA_MAX_PARTS || (cdtype != MOED_BF16 && cdtype != MOED_F16))
        return MOED_EINVAL;
    return moed_cuda_float_dispatch(dtype, [&]<typename Tout>() {
        return cdtype == MOED_BF16 ? launch_parts<__nv_bfloat16, Tout>(row, n_parts, T, rows, ys, d,
                                                                       d_pad, out, (cudaStream_t)s)
                                   : launch_parts<__half, Tout>(row, n_parts, T, rows, ys, d, d_pad,
                                                                out, (cudaStream_t)s);
    });
}

extern "C" int moed_cuda_combine(const moed_cuda_route_dev *r, const void *y, const void *ys,
                                 int cdtype, int d, int d_pad, void *out, int dtype,
                                 moed_cuda_stream s)
{
    if (r->T <= 0) return 0;
    if (cdtype == MOED_BF16)
        return dispatch_out<__nv_bfloat16>(r, y, ys, d, d_pad, out, dtype, (cudaStream_t)s);
    if (cdtype == MOED_F16)
        return dispatch_out<__half>(r, y, ys, d, d_pad, out, dtype, (cudaStream_t)s);
    return MOED_EINVAL;
}
