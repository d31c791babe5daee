/*
 * ptx/wgmma — warpgroup MMA (sm_90a): the shared-memory matrix descriptor, the fences that order
 * accumulator registers and shared memory around asynchronous MMAs, commit/wait of MMA groups, and
 * the wrappers that name the generated instructions (wgmma_ops.cuh) for a type and width: m64nNk16
 * for bf16/f16, m64nNk32 for e4m3, and the sparse m64nNk32 for bf16/f16 (2:4 A). Either way a K
 * step of A is 32 bytes of a 128-byte swizzled row (for sparse A: of its kept values).
 */
#ifndef MOED_PTX_WGMMA_CUH
#define MOED_PTX_WGMMA_CUH

#include "wgmma_ops.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

namespace moed::ptx
{

/* Rows of a 128-byte-swizzled K-major operand are 128 bytes; an 8-row swizzle atom is 1024. */
constexpr uint32_t sw128_row_bytes = 128, sw128_atom_bytes = 1024;

/* Descriptor of a K-major operand with the 128-byte swizzle: rows of 128 bytes, 8-row groups
 * sw128_atom_bytes apart. Stepping K by 16 elements inside the swizzle atom adds 32 bytes to the
 * start address. */
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t addr)
{
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) |
           ((uint64_t)(sw128_atom_bytes >> 4) << 32) | ((uint64_t)1 << 62);
}

/* The same with 8-row groups `sbo` bytes apart (a multiple of sw128_atom_bytes): an operand whose
 * groups are not adjacent, such as every fourth group of a larger tile. */
__device__ __forceinline__ uint64_t wgmma_desc_sw128_sbo(uint32_t addr, uint32_t sbo)
{
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(sbo >> 4) << 32) |
           ((uint64_t)1 << 62);
}

/* Before the first MMA that reads registers or shared memory written since the last one. */
__device__ __forceinline__ void wgmma_fence()
{
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit()
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/* Waits until at most N committed MMA groups of this warpgroup are still running. */
template <int N> __device__ __forceinline__ void wgmma_wait()
{
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes 0 to 7");
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Keeps the compiler from moving accesses of the accumulators across the point (an asynchronous
 * MMA reads and writes them behind its back). */
template <int N> __device__ __forceinline__ void wgmma_fence_operands(float (&acc)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(acc[i])::"memory");
}

/* acc (64 x N per warpgroup, N/2 registers per thread) += A · B^T, both operands in shared memory,
 * T = __nv_bfloat16 or __half. */
template <typename T, int N>
__device__ __forceinline__ void wgmma_m64k16(float *acc, uint64_t desc_a, uint64_t desc_b)
{
    static_assert(N == 128 || N == 256, "wgmma_ops.cuh has N = 128 and 256");
    constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
    static_assert(bf16 || std::is_same<T, __half>::value, "bf16 or f16 operands");
    if constexpr (N == 256) {
        if constexpr (bf16)
            wgmma_m64n256k16_bf16(acc, desc_a, desc_b);
        else
            wgmma_m64n256k16_f16(acc, desc_a, desc_b);
    } else {
        if constexpr (bf16)
            wgmma_m64n128k16_bf16(acc, desc_a, desc_b);
        else
            wgmma_m64n128k16_f16(acc, desc_a, desc_b);
    }
}

/* acc (64 x N per warpgroup) = A · B^T + (scale_d ? acc : 0), e4m3 operands in shared memory: the
 * K-step of 32 elements that block-scaled FP8 GEMMs chain within one scale block. */
template <int N>
__device__ __forceinline__ void wgmma_m64k32_e4m3(float *acc, uint64_t desc_a, uint64_t desc_b,
                                                  int scale_d)
{
    static_assert(N == 128, "wgmma_ops.cuh has the e4m3 instruction for N = 128");
    wgmma_m64n128k32_e4m3(acc, desc_a, desc_b, scale_d);
}

/* acc (64 x N per warpgroup) += A · B^T with A 2:4 sparse along K (64 x 32, its 64 x 16 kept values
 * in shared memory) and B dense (N x 32), T = __nv_bfloat16 or __half. e: this thread's metadata
 * word, read from the threads that selector SEL (0 or 1) names, as mma.sp m16n8k32 reads it per
 * warp of 16 rows (docs/kernels-notes.md, "2:4 sparse experts on
 * wgmma.sp"). */
template <typename T, int N, int SEL>
__device__ __forceinline__ void wgmma_sp_m64k32(float *acc, uint64_t desc_a, uint64_t desc_b,
                                                uint32_t e)
{
    static_assert(N == 128, "wgmma_ops.cuh has the sparse instruction for N = 128");
    static_assert(SEL == 0 || SEL == 1, "16-bit types take selectors 0 and 1");
    if constexpr (std::is_same<T, __nv_bfloat16>::value)
        wgmma_sp_m64n128k32_bf16<SEL>(acc, desc_a, desc_b, e);
    else
        wgmma_sp_m64n128k32_f16<SEL>(acc, desc_a, desc_b, e);
}

} // namespace moed::ptx

#endif
