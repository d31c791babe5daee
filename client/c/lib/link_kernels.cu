/*
 * link_kernels — the device side of a link call (moedc_link.c): gathering a shard's rows into its
 * payload, its header, and adding the shards' replies into the caller's output. libmoedclient links
 * no CUDA library, so this file is compiled to PTX at build time (nvcc -ptx, embedded in the
 * library) and loaded through the driver (cuModuleLoadData) at the first link open; the entry
 * points are extern "C" so cuModuleGetFunction finds them by these names.
 */
#include "moedc_link_sum.h"

/* dst[j] = src[rows[j]], rows of `units` 16-bit units (every tensor of a call is a whole number of
 * them: f16/bf16/f32 rows, int32 ids, float32 weights). */
extern "C" __global__ void moedc_link_gather(const uint16_t *src, uint16_t *dst,
                                             const int32_t *rows, long long n, long long units)
{
    const long long total = n * units;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[(long long)rows[i / units] * units + i % units];
}

/* A call's header: head with its seq the link's next, counted on the device, so that each replay
 * of a captured call is a call of its own on the link (the first thread; the launch has a block).
 */
extern "C" __global__ void moedc_link_stamp(moed_link_call head, moed_link_call *dst,
                                            unsigned long long *counter)
{
    if (blockIdx.x || threadIdx.x) return;
    head.seq = ++*counter;
    *dst = head;
}

/* out [tokens, d] from the n parts (moedc_link_sum.h), or nothing when a reply is missing or not
 * OK: then the call is counted in *failures (once, by block 0). */
extern "C" __global__ void moedc_link_combine(moedc_link_parts parts, int n, int verbatim,
                                              int dtype, long long tokens, long long d, void *out,
                                              unsigned long long *failures)
{
    __shared__ int ok;
    if (threadIdx.x == 0) ok = moedc_link_replies_ok(parts.p, n);
    __syncthreads();
    if (!ok) {
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(failures, 1ull);
        return;
    }
    const long long total = tokens * d;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        moedc_link_sum_element(dtype, parts.p, n, verbatim, i / d, d, i % d, out);
}
