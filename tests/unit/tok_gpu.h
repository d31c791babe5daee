/*
 * tok_gpu.h — what the GPU accuracy tests (test_cuda_backend, test_split) share beyond tok_ref.h:
 * whether a layer's FP8 weights run on the FP8 Tensor Cores, which picks its compute type
 * (tok_compute_class) and so its per-token bounds (tok_rtol); and a layer made 2:4 sparse as moed
 * --weights sparse24 loads it (tok_make_sparse).
 */
#ifndef MOED_TOK_GPU_H
#define MOED_TOK_GPU_H

#include "moed_model.h"
#include "moed_sp24.h"

#include <cuda_runtime_api.h>
#include <string.h>

/* Whether FP8 layers run on the FP8 Tensor Cores on CUDA device `device` with this kernel choice
 * (MOED_CUDA_KERNEL; NULL: the table's): forced sm80 is the portable path, any other forced
 * family the Tensor Cores; the table's choice takes them on sm_90. */
static inline int tok_fp8_native(const char *kernel, int device)
{
    struct cudaDeviceProp p;
    if (kernel) return strcmp(kernel, "sm80") != 0;
    return cudaGetDeviceProperties(&p, device) == cudaSuccess && p.major == 9 && p.minor == 0;
}

/* Prunes every routed expert's matrices of l 2:4 along K (the synthetic layer owns them) and
 * marks it sparse24, as moed --weights sparse24 loads a layer: the CPU backend then computes the
 * pruned dense weights, the CUDA backend the same weights compressed on mma.sp / wgmma.sp. */
static inline int tok_make_sparse(moed_layer *l)
{
    const moed_layer_info *li = &l->info;
    const int64_t d = li->d_model, ff = li->d_ff;
    int rc = 0;
    for (int e = 0; e < li->n_experts && !rc; e++) {
        moed_expert_w *x = &l->experts[e];
        rc = moed_sp24_prune((void *)x->w1, li->wdtype, ff, d);
        if (!rc && x->w3) rc = moed_sp24_prune((void *)x->w3, li->wdtype, ff, d);
        if (!rc) rc = moed_sp24_prune((void *)x->w2, li->wdtype, d, ff);
    }
    l->info.sparse24 = true;
    return rc;
}

#endif
