/*
 * ptx/mma_sp_sm80 — the Sparse Tensor Cores' warp-level MMA of sm_80 and newer (Hopper runs it
 * too): mma.sp m16n8k32 with a 2:4 sparse A (16 x 32, stored as its 16 x 16 kept values, the same
 * fragment as mma.sync m16n8k16's A), a dense 32 x 8 B (column-major: two m16n8k16 B fragments,
 * K 0-15 then 16-31) and fp32 accumulators. The metadata word e says where each kept value sits;
 * the sparsity selector SEL names the threads of each group of four that hold it (0: threads 0
 * and 1, for K 0-15 and 16-31, each rows g and g + 8 in its low and high half; 1: threads 2 and
 * 3), so threads 2 and 3 can hold the next MMA's metadata meanwhile (moed_cuda.h's layout).
 * ::ordered_metadata: each group's two indices increase (the layout keeps them so); the plain
 * form is slower on newer GPUs by ptxas's own advice.
 */
#ifndef MOED_PTX_MMA_SP_SM80_CUH
#define MOED_PTX_MMA_SP_SM80_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

namespace moed::ptx
{

/* d += a · b with A 2:4 sparse, T = bf16 or f16. */
template <typename T, int SEL>
__device__ __forceinline__ void mma_sp_m16n8k32(float d[4], const uint32_t a[4],
                                                const uint32_t b[4], uint32_t e)
{
    static_assert(SEL == 0 || SEL == 1, "m16n8k32 on 16-bit types takes selectors 0 and 1");
    if constexpr (std::is_same<T, __nv_bfloat16>::value)
        asm volatile("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, %13;\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]),
                       "r"(b[3]), "r"(e), "n"(SEL));
    else
        asm volatile("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, %13;\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]),
                       "r"(b[3]), "r"(e), "n"(SEL));
}

} // namespace moed::ptx

#endif
