/*
 * convert — the request's hidden rows, in whatever float type they came (f32, f16, bf16), into the
 * compute type of the GEMMs, each row padded with zeros to d_pad columns (the padded weight columns
 * are zero too, so the padding adds exact zeros). Skipped by the backend when the input already is
 * the compute type and needs no padding.
 */
#include "dtype.cuh"
#include "moed_cuda.h"

#include <cuda_runtime.h>

namespace
{

template <typename Tin, typename Tout>
__global__ void convert_kernel(const Tin *x, int64_t T, int d, Tout *xc, int d_pad)
{
    const int64_t n = T * d_pad;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = i / d_pad;
        const int c = (int)(i - t * d_pad);
        xc[i] = moed_cuda_from_f32<Tout>(c < d ? moed_cuda_to_f32<Tin>(x[t * d + c]) : 0.0f);
    }
}

template <typename Tout>
int launch(const void *x, int dtype, int64_t T, int d, Tout *xc, int d_pad, cudaStream_t s)
{
    const int64_t n = T * d_pad;
    const int blocks = (int)((n + 255) / 256 < 65536 ? (n + 255) / 256 : 65536);
    return moed_cuda_float_dispatch(dtype, [&]<typename Tin>() {
        convert_kernel<<<blocks, 256, 0, s>>>((const Tin *)x, T, d, xc, d_pad);
        return cudaGetLastError() == cudaSuccess ? 0 : MOED_EDEVICE;
    });
}

} // namespace

extern "C" int moed_cuda_convert_in(const void *x, int dtype, int64_t T, int d, void *xc,
                                    int cdtype, int d_pad, moed_cuda_stream s)
{
    if (T <= 0) return 0;
    if (cdtype == MOED_BF16)
        return launch(x, dtype, T, d, (__nv_bfloat16 *)xc, d_pad, (cudaStream_t)s);
    if (cdtype == MOED_F16) return launch(x, dtype, T, d, (__half *)xc, d_pad, (cudaStream_t)s);
    return MOED_EINVAL;
}
