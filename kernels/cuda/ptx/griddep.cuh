/*
 * ptx/griddep — programmatic dependent launch (sm_90): a kernel launched with it may start while
 * the kernel before it on the stream still runs. launch_dependents lets the next such kernel start
 * once every CTA of this one has issued it (or exited); wait blocks until the kernel before has
 * completed and its memory is visible. Before sm_90 both are nothing: there the launch attribute
 * is never set, so every kernel starts after the one before has finished.
 */
#ifndef MOED_PTX_GRIDDEP_CUH
#define MOED_PTX_GRIDDEP_CUH

namespace moed::ptx
{

__device__ __forceinline__ void griddep_launch_dependents()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

} // namespace moed::ptx

#endif
