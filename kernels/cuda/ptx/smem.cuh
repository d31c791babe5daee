/*
 * ptx/smem — the 32-bit shared-window address that every shared-memory operand of an instruction
 * takes (cvta.to.shared).
 */
#ifndef MOED_PTX_SMEM_CUH
#define MOED_PTX_SMEM_CUH

#include <stdint.h>

namespace moed::ptx
{

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

} // namespace moed::ptx

#endif
