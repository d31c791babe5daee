/*
 * ptx/warpgroup — setmaxnreg (sm_90a): a warpgroup gives registers back to the pool or takes them
 * from it, so a producer that needs few can leave them to the consumers that hold accumulators.
 * Every warp of the warpgroup executes it; counts are per thread. And the named barrier that
 * synchronises the warps of one warpgroup without the rest of the CTA.
 */
#ifndef MOED_PTX_WARPGROUP_CUH
#define MOED_PTX_WARPGROUP_CUH

namespace moed::ptx
{

/* The bounds and granularity PTX sets for setmaxnreg's count. */
template <int N> constexpr bool valid_maxnreg = N >= 24 && N <= 256 && N % 8 == 0;

template <int N> __device__ __forceinline__ void setmaxnreg_dec()
{
    static_assert(valid_maxnreg<N>, "setmaxnreg takes a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

template <int N> __device__ __forceinline__ void setmaxnreg_inc()
{
    static_assert(valid_maxnreg<N>, "setmaxnreg takes a multiple of 8 in [24, 256]");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

/* Waits until `threads` threads (whole warps) have reached named barrier `id` (1..15; 0 is
 * __syncthreads'), and orders their shared-memory accesses around it. */
__device__ __forceinline__ void bar_sync(int id, int threads)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

} // namespace moed::ptx

#endif
