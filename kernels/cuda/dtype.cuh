/*
 * dtype — the kernels' element types: float32 from and to float, __half and __nv_bfloat16 (the
 * widening is exact, the narrowing rounds to nearest, ties to even), and the one switch from a
 * moed_dtype to its device type.
 */
#ifndef MOED_CUDA_DTYPE_CUH
#define MOED_CUDA_DTYPE_CUH

#include "moed_dtype.h"
#include "moed_err.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

template <typename T> __device__ __forceinline__ float moed_cuda_to_f32(T v);
template <> __device__ __forceinline__ float moed_cuda_to_f32<float>(float v)
{
    return v;
}
template <> __device__ __forceinline__ float moed_cuda_to_f32<__half>(__half v)
{
    return __half2float(v);
}
template <> __device__ __forceinline__ float moed_cuda_to_f32<__nv_bfloat16>(__nv_bfloat16 v)
{
    return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T moed_cuda_from_f32(float v);
template <> __device__ __forceinline__ float moed_cuda_from_f32<float>(float v)
{
    return v;
}
template <> __device__ __forceinline__ __half moed_cuda_from_f32<__half>(float v)
{
    return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 moed_cuda_from_f32<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}

/* Calls f.template operator()<T>() with T the device type of a float moed_dtype (F32, F16, BF16);
 * MOED_EINVAL for any other. */
template <typename F> __host__ __forceinline__ int moed_cuda_float_dispatch(int dtype, F &&f)
{
    switch (dtype) {
    case MOED_F32:
        return f.template operator()<float>();
    case MOED_F16:
        return f.template operator()<__half>();
    case MOED_BF16:
        return f.template operator()<__nv_bfloat16>();
    }
    return MOED_EINVAL;
}

#endif
