/*
 * ptx/mma_sm80 — the warp-level Tensor Core path of sm_80 and newer: ldmatrix loads 8x8 b16
 * fragments from shared memory, mma.sync m16n8k16 multiplies them with fp32 accumulation. The
 * fragment layouts are PTX's (the kernel maps rows and columns to lanes).
 */
#ifndef MOED_PTX_MMA_SM80_CUH
#define MOED_PTX_MMA_SM80_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace moed::ptx
{

/* Four 8x8 b16 matrices; lanes 8i .. 8i+7 give the row addresses of matrix i. */
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* d += a · b for a 16x16 A fragment (row-major), a 16x8 B fragment (column-major), T = bf16 or
 * f16, fp32 accumulators. */
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2]);
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float d[4], const uint32_t a[4],
                                                            const uint32_t b[2])
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float d[4], const uint32_t a[4],
                                                     const uint32_t b[2])
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

} // namespace moed::ptx

#endif
