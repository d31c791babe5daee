/*
 * ptx/cluster — thread-block clusters (sm_90): the CTA's rank in its cluster, the cluster-wide
 * barrier, and arriving on an mbarrier in another CTA of the cluster (its address mapped into the
 * cluster's shared window).
 */
#ifndef MOED_PTX_CLUSTER_CUH
#define MOED_PTX_CLUSTER_CUH

#include <stdint.h>

namespace moed::ptx
{

__device__ __forceinline__ uint32_t cluster_rank()
{
    uint32_t r;
    asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

/* Every thread of every CTA of the cluster arrives, then waits for all the others: what one CTA
 * wrote to shared memory before (barrier initialisation included) is visible to the others after.
 */
__device__ __forceinline__ void cluster_sync()
{
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::
                     : "memory");
}

/* The address in the cluster's shared window of this CTA's shared address `addr` in CTA `cta` of
 * the cluster (which may be this one). A CTA's shared memory is contiguous in that window, so
 * offsets from a mapped address stay in the same CTA. */
__device__ __forceinline__ uint32_t cluster_map(uint32_t addr, uint32_t cta)
{
    uint32_t r;
    asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(cta));
    return r;
}

/* Arrives on the barrier at `bar`, an address in the cluster's shared window (cluster_map), with
 * the default CTA-scope release. A cluster-scope release makes ptxas fence all of the thread's
 * outstanding memory traffic (MEMBAR.ALL.GPU) before each arrival; a consumer that releases a stage
 * only says that its wgmma reads of it, already waited for, are done. */
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

} // namespace moed::ptx

#endif
