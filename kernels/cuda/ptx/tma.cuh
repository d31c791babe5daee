/*
 * ptx/tma — the tensor memory accelerator (sm_90): a 2-D box of a tensor map copied from global to
 * shared memory, completing on an mbarrier by bytes, into this CTA or multicast to several CTAs of
 * its cluster; and the fence between the generic proxy (ordinary stores, cp.async) and the async
 * proxy (TMA, wgmma) that reads shared memory after it.
 */
#ifndef MOED_PTX_TMA_CUH
#define MOED_PTX_TMA_CUH

#include <cuda.h>
#include <stdint.h>

namespace moed::ptx
{

/* The box at column x, row y of the map into shared memory at dst; bar counts the bytes down. */
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, uint32_t bar,
                                            int x, int y)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
                 : "memory");
}

/* The same box into shared memory at dst of every CTA of the cluster in cta_mask (bit i: rank i),
 * each copy counting down the barrier at the same offset bar in its CTA. */
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap *map,
                                                      uint32_t bar, int x, int y, uint16_t cta_mask)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "h"(cta_mask)
                 : "memory");
}

/* Orders this thread's generic-proxy writes to shared memory before later async-proxy reads. */
__device__ __forceinline__ void fence_proxy_async()
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

} // namespace moed::ptx

#endif
