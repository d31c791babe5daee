/*
 * fill — random device data for the benchmarks: uniform in [-scale, scale), from a counter-based
 * hash so it is cheap to make many gigabytes of it on the device, and never zero (zeros hide
 * unwritten outputs and run faster than real data).
 */
#include "bench.h"

#include "moed_dtype.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

namespace
{

__device__ __forceinline__ float hash_uniform(uint64_t seed, uint64_t i)
{
    uint64_t z = seed + i * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

template <typename T> __device__ __forceinline__ T cvt(float v);
template <> __device__ __forceinline__ __nv_bfloat16 cvt<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half cvt<__half>(float v)
{
    return __float2half_rn(v);
}
template <> __device__ __forceinline__ float cvt<float>(float v)
{
    return v;
}

template <typename T> __global__ void fill_kernel(T *p, size_t n, uint64_t seed, float scale)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float v = hash_uniform(seed, i) * scale;
        if (v == 0.0f) v = scale * 1e-3f;
        p[i] = cvt<T>(v);
    }
}

/* e4m3 codes of values uniform over the whole range (the block scales shrink them), never 0. */
__global__ void fill_fp8_kernel(uint8_t *p, size_t n, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint8_t q =
            __nv_cvt_float_to_fp8(hash_uniform(seed, i) * 448.0f, __NV_SATFINITE, __NV_E4M3);
        p[i] = (q & 0x7f) ? q : 0x38; /* 1.0 where the value rounded to zero */
    }
}

__global__ void fill_value_kernel(float *p, size_t n, float v)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = v;
}

} // namespace

extern "C" int bench_fill_fp8(void *p, size_t n, uint64_t seed)
{
    fill_fp8_kernel<<<4096, 256>>>((uint8_t *)p, n, seed);
    return cudaDeviceSynchronize() == cudaSuccess ? 0 : -1;
}

extern "C" int bench_fill_value(float *p, size_t n, float v)
{
    fill_value_kernel<<<4096, 256>>>(p, n, v);
    return cudaDeviceSynchronize() == cudaSuccess ? 0 : -1;
}

extern "C" int bench_fill(void *p, int dtype, size_t n, uint64_t seed, float scale)
{
    const int blocks = 4096;
    if (dtype == MOED_BF16)
        fill_kernel<<<blocks, 256>>>((__nv_bfloat16 *)p, n, seed, scale);
    else if (dtype == MOED_F16)
        fill_kernel<<<blocks, 256>>>((__half *)p, n, seed, scale);
    else
        fill_kernel<<<blocks, 256>>>((float *)p, n, seed, scale);
    return cudaDeviceSynchronize() == cudaSuccess ? 0 : -1;
}
