/*
 * cpu_ctx — the CPU backend's state, shared by its life-cycle code (cpu_backend.c) and its compute
 * code (cpu_forward.c). Not a public header.
 */
#ifndef MOED_CPU_CTX_H
#define MOED_CPU_CTX_H

#include "cpu_gemm.h"
#include "moed_backend_impl.h"
#include "moed_pool.h"

#include <stdint.h>

/* A run of rows of one expert in a window: the unit the GEMM tasks split by columns. */
typedef struct cpu_rowblock {
    int expert; /* n_experts: the shared experts */
    int m;
    int64_t m0;
} cpu_rowblock;

/* The one execution slot's workspace, sized by start() for the largest layer and max_tokens. A
 * forward runs over the route in windows of at most `pw` (token, expert) pairs. */
typedef struct cpu_ws {
    float *x;   /* [max_tokens, d_max] the input rows in float32 (f16/bf16 input) */
    float *acc; /* [max_tokens, d_max] each token's output, summed in route order */
    float *h;   /* [pw, ff_max] the window's activations, by sorted position */
    float *r;   /* [pw, d_max] the window's expert outputs, by sorted position */
    int32_t *wtok, *wexp, *wpos; /* [pw] per window pair: token, expert, sorted position */
    float *ww;                   /* [pw] per window pair: weight */
    int32_t *stok;               /* [pw] per sorted position: token */
    int32_t *seg;                /* [pw + 1] where each token's pairs start in the window */
    int64_t *bucket;             /* [e_max + 2] first sorted position of each expert */
    moed_cpu_mm *mm;             /* [e_max + 1] the window's products, one per expert */
    cpu_rowblock *blocks;        /* [nb_max] */
    int64_t *block_task;         /* [nb_max + 1] first task of each row block */
    float *pack;                 /* [threads][pack_floats] */
} cpu_ws;

typedef struct cpu_ctx {
    int threads;
    moed_pool *pool;
    moed_layer *layers; /* copies of the descriptors; the weights stay where they are */
    int n_layers, cap_layers;
    int started;
    int64_t max_tokens;
    int64_t pw;     /* pairs per window */
    int64_t nb_max; /* row blocks per window */
    int d_max, ff_max, e_max;
    size_t pack_floats; /* per thread */
    uint64_t ws_bytes;
    void *ws_mem; /* one allocation carved into ws */
    cpu_ws ws;
} cpu_ctx;

/* Row block height and column block width of the GEMM tasks. */
#define MOED_CPU_MC 96
#define MOED_CPU_NC 256

int moed_cpu_forward(moed_backend *b, int exec, const moed_job *job, moed_error *err);
int moed_cpu_router_logits(moed_backend *b, int exec, const moed_job *job, float *logits,
                           moed_error *err);

#endif
