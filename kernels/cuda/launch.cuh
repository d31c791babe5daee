/*
 * launch — how the kernels are started through cudaLaunchKernelEx: in clusters where the shape
 * asks, and for the kernels that take part in programmatic dependent launch, with its attribute
 * when the caller allows it and the device is sm_90 or newer, plainly otherwise.
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

/* A launch's shape: grid, block, dynamic shared memory, and CTAs a cluster along x (1: none). */
struct moed_cuda_shape {
    dim3 grid, block;
    size_t smem;
    int cluster;
};

/* The config of a launch of shape sh on s, its attributes in attrs (which must outlive it): the
 * cluster dimension when sh.cluster > 1, and when early, on sm_90 and newer, programmatic
 * dependent launch. The one place a config is built: the occupancy query for clusters
 * (cudaOccupancyMaxActiveClusters) takes the same one the launch does. */
inline cudaLaunchConfig_t moed_cuda_config(cudaLaunchAttribute (&attrs)[2],
                                           const moed_cuda_shape &sh, cudaStream_t s, bool early)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = sh.grid;
    cfg.blockDim = sh.block;
    cfg.dynamicSmemBytes = sh.smem;
    cfg.stream = s;
    cfg.attrs = attrs;
    if (sh.cluster > 1) {
        cudaLaunchAttribute &a = attrs[cfg.numAttrs++];
        a.id = cudaLaunchAttributeClusterDimension;
        a.val.clusterDim.x = (unsigned)sh.cluster;
        a.val.clusterDim.y = a.val.clusterDim.z = 1;
    }
    int dev = 0, major = 0;
    if (early && !moed_cuda_pdl_off() && cudaGetDevice(&dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
        major >= 9) {
        cudaLaunchAttribute &a = attrs[cfg.numAttrs++];
        a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        a.val.programmaticStreamSerializationAllowed = 1;
    }
    return cfg;
}

template <typename... P, typename... A>
int moed_cuda_launch(void (*kern)(P...), const moed_cuda_shape &sh, cudaStream_t s, bool early,
                     A &&...args)
{
    cudaLaunchAttribute attrs[2];
    const cudaLaunchConfig_t cfg = moed_cuda_config(attrs, sh, s, early);
    return cudaLaunchKernelEx(&cfg, kern, static_cast<A &&>(args)...) == cudaSuccess ? 0
                                                                                     : MOED_EDEVICE;
}

#endif
