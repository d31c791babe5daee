/*
 * launch — how the kernels that take part in programmatic dependent launch are started: with the
 * launch attribute when the caller allows it and the device is sm_90 or newer, plainly otherwise.
 * A kernel started early must call moed::ptx::griddep_wait before it reads what the kernel before
 * it writes, and before it writes anything at all (ptx/griddep.cuh); what it may do before that is
 * each launcher's contract (moed_cuda.h, MOED_CUDA_OVERLAP_*). MOED_CUDA_NO_PDL=1 in the
 * environment starts every kernel plainly: the same kernels, for measuring what the overlap buys,
 * or for a driver that mishandles it.
 */
#ifndef MOED_CUDA_LAUNCH_CUH
#define MOED_CUDA_LAUNCH_CUH

#include "moed_err.h"

#include <cuda_runtime.h>
#include <stdlib.h>

inline bool moed_cuda_pdl_off()
{
    static const bool off = [] {
        const char *v = getenv("MOED_CUDA_NO_PDL");
        return v && *v == '1';
    }();
    return off;
}

template <typename... P, typename... A>
int moed_cuda_launch(void (*kern)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                     bool early, A &&...args)
{
    int dev = 0, major = 0;
    early = early && !moed_cuda_pdl_off();
    if (early && cudaGetDevice(&dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
        major = 0;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = &attr;
    cfg.numAttrs = early && major >= 9 ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kern, static_cast<A &&>(args)...) == cudaSuccess ? 0
                                                                                     : MOED_EDEVICE;
}

#endif
