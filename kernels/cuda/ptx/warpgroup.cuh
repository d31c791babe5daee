/*
 * ptx/warpgroup — setmaxnreg (sm_90a): a warpgroup gives registers back to the pool or takes them
 * from it, so a producer that needs few can leave them to the consumers that hold accumulators.
 * Every warp of the warpgroup executes it; counts are per thread.
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

} // namespace moed::ptx

#endif
