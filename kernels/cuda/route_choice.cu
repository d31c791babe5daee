/*
 * route_choice — a client's expert choice that lies in device memory (ids int32 and weights float32
 * [rows, k]) checked and packed into a batch's route where it lies, with no copy to the host: each
 * pair's slot gets its token, its id and its weight, or for padding and for a refused pair E and 0
 * (a null pair, moed_cuda.h). A refused pair lowers its part's status word to its code
 * (moed_choice_check's), so the word ends as the first refusal in row-major order whatever order
 * the threads ran in; the host reads the words back with the batch's outputs and words the messages
 * (moed_choice_fail). The rules are moed_choice_rule's, applied in its order, so host and device
 * agree on every pair. On an expert shard the ids are the whole layer's, checked against its
 * count and renumbered by the shard's map (a pair of an expert not held a null pair, as
 * moed_route_localize drops it).
 */
#include "moed_cuda.h"

#include "moed_err.h"
#include "moed_route.h"

#include <cuda_runtime.h>

namespace
{

/* One pair a thread. c.ids and c.w may be pair_exp and pair_w themselves (no restrict): a thread
 * reads its pair before it writes the same slot. */
__global__ void choice_kernel(moed_cuda_choice c, int32_t *pair_tok, int32_t *pair_exp,
                              float *pair_w)
{
    const int64_t n = c.rows * c.k;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int32_t id = c.ids[i];
        const float w = c.w[i];
        const int rule = moed_choice_rule(id, w, c.n_ids);
        const int64_t p = c.pair0 + i;
        const int32_t e = rule != MOED_CHOICE_VALID ? -1 : c.local_of ? c.local_of[id] : id;
        pair_tok[p] = c.tok0 + (int32_t)(i / c.k);
        pair_exp[p] = e >= 0 ? e : c.E;
        pair_w[p] = e >= 0 ? w : 0.0f;
        if (rule > MOED_CHOICE_PADDING)
            atomicMin(c.bad,
                      (unsigned long long)(c.row0 * c.k + i) << MOED_CHOICE_RULE_BITS | rule);
    }
}

} // namespace

extern "C" int moed_cuda_route_choice(const moed_cuda_choice *c, const moed_cuda_route_dev *r,
                                      moed_cuda_stream s)
{
    const int64_t n = c->rows * c->k;
    if (n <= 0) return 0;
    const int blocks = (int)((n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024);
    /* The route's inputs are const to the kernels that read them; this one writes them. */
    choice_kernel<<<blocks, 256, 0, (cudaStream_t)s>>>(*c, (int32_t *)r->pair_tok,
                                                       (int32_t *)r->pair_exp, (float *)r->pair_w);
    return cudaGetLastError() == cudaSuccess ? 0 : MOED_EDEVICE;
}
