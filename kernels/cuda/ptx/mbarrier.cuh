/*
 * ptx/mbarrier — sm_90's shared-memory barriers with transaction counts: a barrier completes a
 * phase once its expected arrivals have arrived and the bytes announced with expect_tx have landed
 * (TMA copies count them down); waiters name the phase by its parity.
 */
#ifndef MOED_PTX_MBARRIER_CUH
#define MOED_PTX_MBARRIER_CUH

#include <stdint.h>

namespace moed::ptx
{

/* Shared-memory bytes of one barrier (a 64-bit word, 8-byte aligned). */
constexpr uint32_t mbar_bytes = 8;

__device__ __forceinline__ void mbar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

/* Makes the initialised barriers visible to the other threads and to the async proxy (TMA). */
__device__ __forceinline__ void mbar_fence_init()
{
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

/* Arrives and announces `bytes` more bytes that asynchronous copies will deliver this phase. */
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, int bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

/* Spins until the phase of the given parity has completed. */
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity)
{
    asm volatile("{\n.reg .pred P1;\nLAB_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}

} // namespace moed::ptx

#endif
