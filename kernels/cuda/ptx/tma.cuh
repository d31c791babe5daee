/*
 * ptx/tma — the tensor memory accelerator (sm_90): a 2-D box of a tensor map copied from global to
 * shared memory, completing on an mbarrier by bytes, into this CTA or multicast to several CTAs of
 * its cluster; the store the other way, tracked in bulk groups; and the fence between the generic
 * proxy (ordinary stores, cp.async) and the async proxy (TMA, wgmma) that reads shared memory after
 * it.
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

/* The box at shared src to column x, row y of the map; the part of the box past the map's bounds
 * is not written. It belongs to the issuing thread's open bulk group. */
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, uint32_t src, int x, int y)
{
    asm volatile(
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
            reinterpret_cast<uint64_t>(map)),
        "r"(src), "r"(x), "r"(y)
        : "memory");
}

/* Closes the bulk group of the stores this thread issued since the last commit. */
__device__ __forceinline__ void bulk_commit()
{
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

/* Waits until at most N of this thread's bulk groups still read shared memory (their sources may
 * then be overwritten). */
template <int N> __device__ __forceinline__ void bulk_wait_read()
{
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

/* Waits until at most N of this thread's bulk groups are still in flight, writes included. */
template <int N> __device__ __forceinline__ void bulk_wait()
{
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Orders this thread's generic-proxy writes to shared memory before later async-proxy reads. */
__device__ __forceinline__ void fence_proxy_async()
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

} // namespace moed::ptx

#endif
