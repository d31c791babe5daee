/*
 * ptx/cp_async — sm_80's asynchronous copies: 16 bytes from global to shared memory per thread,
 * bypassing L1 (.cg), or 4 (one float: a row's scale; only .ca takes that size), collected into
 * groups that a thread commits and later waits for, or whose completion arrives on an mbarrier.
 */
#ifndef MOED_PTX_CP_ASYNC_CUH
#define MOED_PTX_CP_ASYNC_CUH

#include <stdint.h>

namespace moed::ptx
{

/* 16-byte global→shared copy; src_bytes 0 fills the 16 bytes with zeros (rows past the end). */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

/* 4-byte global→shared copy; src_bytes 0 fills them with zeros. */
__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

/* Closes the group of the copies this thread issued since the last commit. */
__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Waits until at most N of this thread's committed groups are still in flight. */
template <int N> __device__ __forceinline__ void cp_async_wait()
{
    static_assert(N >= 0 && N <= 7, "cp.async.wait_group takes 0 to 7");
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Once every cp.async this thread issued so far has landed, an arrival on the mbarrier at bar (as
 * one of its expected arrivals: .noinc), without the thread waiting. A reader in another proxy
 * (wgmma, TMA) fences after its wait for the barrier (fence_proxy_async). */
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

} // namespace moed::ptx

#endif
