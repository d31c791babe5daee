/*
 * ptx — the PTX instructions the kernels issue through inline assembly, one small header per
 * family, all in namespace moed::ptx, each wrapper a single instruction (or a fixed instruction
 * sequence) with no policy of its own: which barrier, which stage and how many bytes stay the
 * kernel's business. This header includes them all.
 *
 *   smem.cuh        shared-memory addresses as the instructions take them
 *   cp_async.cuh    16-byte asynchronous global→shared copies, their groups, and an mbarrier
 *                   arrival once they land (sm_80)
 *   mma_sm80.cuh    ldmatrix and mma.sync m16n8k16 (sm_80)
 *   mma_sp_sm80.cuh mma.sp m16n8k32 on the Sparse Tensor Cores, 2:4 sparse A (sm_80)
 *   mbarrier.cuh    shared-memory transaction barriers (sm_90)
 *   tma.cuh         the tensor memory accelerator's 2-D load (to one CTA or multicast to its
 *                   cluster), its 2-D store and bulk groups, and the async-proxy fence (sm_90)
 *   cluster.cuh     thread-block clusters: rank, cluster barrier, arrivals on a peer's mbarrier
 *                   (sm_90)
 *   wgmma.cuh       warpgroup MMA: descriptors, fences, commit/wait, and the generated
 *                   instructions of wgmma_ops.cuh (gen_wgmma_ops.py writes it) (sm_90a)
 *   warpgroup.cuh   setmaxnreg: moving registers between warpgroups (sm_90a); named barriers
 *   griddep.cuh     programmatic dependent launch: start early, wait for the kernel before
 *                   (sm_90; nothing on older GPUs, so every pass may call them)
 *
 * The sm_90 wrappers assemble only in the sm_90a pass: kernels call them inside their
 * architecture guard, and an inline function nobody calls emits nothing.
 */
#ifndef MOED_PTX_CUH
#define MOED_PTX_CUH

#include "cluster.cuh"
#include "cp_async.cuh"
#include "griddep.cuh"
#include "mbarrier.cuh"
#include "mma_sm80.cuh"
#include "mma_sp_sm80.cuh"
#include "smem.cuh"
#include "tma.cuh"
#include "warpgroup.cuh"
#include "wgmma.cuh"

#endif
