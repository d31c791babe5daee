/*
 * launch — how every kernel is started, through cudaLaunchKernelEx: in clusters where the shape
 * asks, and for the kernels that take part in programmatic dependent launch, with its attribute
 * when the caller allows it and the device is sm_90 or newer, plainly otherwise; and how many
 * clusters of a persistent kernel fit the device at once.
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

#include <atomic>

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

/* Clusters of sh.cluster CTAs of KERN, each alone on its SM, that fit on the current device at
 * once (sh.grid is not read): a cluster of more than one needs that many SMs of one GPC, so there
 * can be fewer than SMs / sh.cluster. The occupancy query depends only on the kernel and the
 * device, so each kernel (KERN is a template argument) keeps its answer, an entry per device. */
template <auto KERN> int moed_cuda_resident_clusters(const moed_cuda_shape &sh)
{
    constexpr int CACHED_DEVICES = 16;
    static std::atomic<int> cached[CACHED_DEVICES];
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int mc = sh.cluster;
    if (mc == 1) return sms;
    const bool cacheable = dev >= 0 && dev < CACHED_DEVICES;
    if (cacheable && cached[dev].load(std::memory_order_relaxed) > 0)
        return cached[dev].load(std::memory_order_relaxed);
    cudaLaunchAttribute attrs[2];
    const cudaLaunchConfig_t cfg =
        moed_cuda_config(attrs, { dim3(sms / mc * mc), sh.block, sh.smem, mc }, nullptr, false);
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, KERN, &cfg) != cudaSuccess || n < 1) n = sms / mc;
    if (cacheable) cached[dev].store(n, std::memory_order_relaxed);
    return n;
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
