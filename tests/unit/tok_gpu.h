/*
 * tok_gpu.h — what the GPU accuracy tests (test_cuda_backend, test_split) share beyond tok_ref.h:
 * whether a layer's FP8 weights run on the FP8 Tensor Cores, which picks its compute type
 * (tok_compute_class) and so its per-token bounds (tok_rtol).
 */
#ifndef MOED_TOK_GPU_H
#define MOED_TOK_GPU_H

#include <cuda_runtime_api.h>
#include <string.h>

/* Whether FP8 layers run on the FP8 Tensor Cores on CUDA device `device` with this kernel choice
 * (MOED_CUDA_KERNEL; NULL: the table's): forced sm80 is the portable path, any other forced
 * family the Tensor Cores; the table's choice takes them on sm_90. */
static inline int tok_fp8_native(const char *kernel, int device)
{
    struct cudaDeviceProp p;
    if (kernel) return strcmp(kernel, "sm80") != 0;
    return cudaGetDeviceProperties(&p, device) == cudaSuccess && p.major == 9 && p.minor == 0;
}

#endif
