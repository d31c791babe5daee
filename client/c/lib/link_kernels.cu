/*
 * link_kernels — the device side of a link call (moedc_link.c): gathering a shard's rows into its
 * payload, its header (and zeroing its reply's), and adding the shards' replies into the caller's
 * output. libmoedclient links no CUDA library, so this file is compiled to PTX at build time (nvcc
 * -ptx, embedded in the library) and loaded through the driver (cuModuleLoadData) at the first link
 * open; the entry points are extern "C" so cuModuleGetFunction finds them by these names.
 */
#include "moedc_link_sum.h"

/* One tensor's rows in units V (16, 4 or 2 bytes: the widest that src, dst and the row's bytes
 * allow): a unit a thread, along x over a row (strided where the launch is narrower than the row
 * in these units), rows along y (strided). */
template <typename V>
__device__ void gather_rows(const moedc_link_copy &c, const int32_t *rows, long long n)
{
    const long long units = c.bytes / (long long)sizeof(V);
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x,
                    stride = (long long)gridDim.x * blockDim.x;
    for (long long r = blockIdx.y; r < n && first < units; r += gridDim.y) {
        const V *__restrict__ src = (const V *)(c.src + (rows ? (long long)rows[r] : r) * c.bytes);
        V *__restrict__ dst = (V *)(c.dst + r * c.bytes);
        for (long long u = first; u < units; u += stride) dst[u] = src[u];
    }
}

/* A shard's payload: the call's tensors' rows `rows` (every row where NULL), n of them. The launch
 * is sized for the widest tensor's row in 16-byte units (x) and the rows (y). */
extern "C" __global__ void moedc_link_gather(moedc_link_copies copies, const int32_t *rows,
                                             long long n)
{
    for (int i = 0; i < MOEDC_LINK_TENSORS; i++) {
        const moedc_link_copy c = copies.t[i];
        const unsigned long long align =
            (unsigned long long)c.src | (unsigned long long)c.dst | (unsigned long long)c.bytes;
        if (align % 16 == 0)
            gather_rows<uint4>(c, rows, n);
        else if (align % 4 == 0)
            gather_rows<uint32_t>(c, rows, n);
        else
            gather_rows<uint16_t>(c, rows, n);
    }
}

/* A call's header: head with its seq the link's next, counted on the device, so that each replay
 * of a captured call is a call of its own on the link (the first thread; the launch has a block);
 * and the reply's header zeroed, so that a reply that never lands is not taken for the last one.
 */
extern "C" __global__ void moedc_link_stamp(moed_link_call head, moed_link_call *dst,
                                            unsigned long long *counter, uint32_t *reply)
{
    if (blockIdx.x) return;
    for (unsigned i = threadIdx.x; i < MOED_LINK_HEADER_BYTES / 4; i += blockDim.x) reply[i] = 0;
    if (threadIdx.x) return;
    head.seq = ++*counter;
    *dst = head;
}

/* out [tokens, d] from the n parts (moedc_link_sum.h), or nothing when a reply is missing or not
 * OK: then the call is counted in *failures (once, by block 0). Columns along x, tokens along y
 * (strided): an element's token and column without a 64-bit division, which bounded this kernel
 * when it indexed elements in one dimension. The launch covers d columns. */
extern "C" __global__ void moedc_link_combine(moedc_link_parts parts, int n, int verbatim,
                                              int dtype, long long tokens, long long d, void *out,
                                              unsigned long long *failures)
{
    __shared__ int ok;
    if (threadIdx.x == 0) ok = moedc_link_replies_ok(parts.p, n);
    __syncthreads();
    if (!ok) {
        if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) atomicAdd(failures, 1ull);
        return;
    }
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= d) return;
    for (long long t = blockIdx.y; t < tokens; t += gridDim.y)
        moedc_link_sum_element(dtype, parts.p, n, verbatim, t, d, c, out);
}
