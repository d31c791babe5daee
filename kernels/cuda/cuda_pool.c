/*
 * cuda_pool — the execution slots, made by start once every layer is loaded: `streams` slots per
 * device, each with its own stream, pinned staging for the route, and a device workspace sized for
 * max_tokens tokens and max_pairs pairs (and, past Y's rows, zero rows for the null pairs of
 * device-routed tokens to read: cuda_ctx.h), so forward never allocates (but for a split layer's
 * job whose parts bring device routing: cuda_forward.c). A batch with more pairs than the
 * workspace holds (sigmoid gating can give a token every expert) runs in token chunks
 * (cuda_forward.c). A slot on a device that is home to a split layer also gets a part workspace on
 * every device entry, and peer access is enabled between the entries (unless
 * MOED_CUDA_NO_PEER=1) so each part can read its tokens' rows from the home slot's memory and
 * write its partial rows straight into it.
 * Every allocation is admitted first against the device's free memory, with a message that says
 * what to lower.
 */
#include "cuda_ctx.h"

#include "moed_dtype.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The FP8 buffers of a slot (moed_cuda_work_dev): their sizes, for allocation and admission. */
typedef struct fp8_sizes {
    int64_t xs_ld, hs_ld;
    size_t xq, xs, hq, hs;
} fp8_sizes;

static fp8_sizes fp8_buffer_sizes(const cuda_ctx *c)
{
    fp8_sizes z = { 0 };
    if (!c->fp8_native) return z;
    const int64_t T = c->max_tokens, R = c->max_pairs > T ? c->max_pairs : T;
    const int ffw = c->max_ff_pad > c->max_sff_pad ? c->max_ff_pad : c->max_sff_pad;
    z.xs_ld = T;
    z.hs_ld = R;
    z.xq = (size_t)T * c->max_d_pad;
    z.xs = sizeof(float) * (size_t)(c->max_d_pad / MOED_CUDA_FP8_K) * (size_t)z.xs_ld;
    z.hq = (size_t)R * ffw;
    z.hs = sizeof(float) * (size_t)(ffw / MOED_CUDA_FP8_K) * (size_t)z.hs_ld;
    return z;
}

/* A slot's FP8 buffers, where an FP8 layer runs natively. */
static int exec_init_fp8(const cuda_ctx *c, cuda_exec *x, moed_error *err)
{
    const fp8_sizes z = fp8_buffer_sizes(c);
    int rc = 0;
    if (!z.xq) return 0;
    x->w.xs_ld = z.xs_ld;
    x->w.hs_ld = z.hs_ld;
    CU(cudaMalloc(&x->w.xq, z.xq), "workspace");
    CU(cudaMalloc((void **)&x->w.xs, z.xs), "workspace");
    CU(cudaMalloc(&x->w.hq, z.hq), "workspace");
    CU(cudaMalloc((void **)&x->w.hs_scale, z.hs), "workspace");
err:
    return rc;
}

/* Whether slots on GPU `device` run a split layer (and so need part workspaces). */
static bool homes_split(const cuda_ctx *c, int device)
{
    for (int l = 0; l < c->n_layers; l++)
        if (c->layers[l].sp.parts && c->layers[l].device == device) return true;
    return false;
}

/* Rows of fp32 partial sums a home slot holds: one per (token, part) a chunk can have. */
static int64_t psum_rows(const cuda_ctx *c)
{
    const int64_t all = c->max_tokens * c->n_dev;
    return all < c->max_pairs ? all : c->max_pairs;
}

/* Words of a slot's pinned route staging (each half): the packed route and a pair's worth more (a
 * part's token numbers), or on a split layer's home the parts' rows of every token. */
static size_t staging_words(const cuda_ctx *c, bool home)
{
    const size_t route = moed_cuda_route_in_words(c->max_tokens, c->max_pairs) + c->max_pairs,
                 rows = (size_t)c->n_dev * (size_t)c->max_tokens;
    return home && rows > route ? rows : route;
}

/* A slot's buffers on `device`. A part workspace (part set) has no output, router or shared-expert
 * buffers, but a host route of its own, its tokens' numbers and, where needed, a landing buffer; a
 * slot on a split layer's home GPU has the parts' partial rows and where each token's are. */
static int exec_init(cuda_ctx *c, cuda_exec *x, int device, bool part, moed_error *err)
{
    int rc = 0;
    const int64_t T = c->max_tokens, P = c->max_pairs;
    const int32_t max_tiles = moed_cuda_route_max_tiles((int32_t)P, c->max_e, 16);
    memset(x, 0, sizeof *x);
    x->device = device;
    CU(cudaSetDevice(device), "cudaSetDevice");
    CU(cudaStreamCreateWithFlags(&x->stream, cudaStreamNonBlocking), "stream creation");
    CU(cudaStreamCreateWithFlags(&x->copy, cudaStreamNonBlocking), "stream creation");
    CU(cudaEventCreateWithFlags(&x->copied, cudaEventDisableTiming), "event creation");
    CU(cudaEventCreateWithFlags(part ? &x->done : &x->ready, cudaEventDisableTiming),
       "event creation");
    const size_t in_b = (size_t)T * c->max_d * 4;
    const bool home = !part && homes_split(c, device);
    for (int i = 0; i < 2; i++) {
        CU(cudaEventCreateWithFlags(&x->routed[i], cudaEventDisableTiming), "event creation");
        CU(cudaMallocHost((void **)&x->h_route[i], staging_words(c, home) * 4),
           "pinned route staging");
    }
    CU(cudaMalloc(&x->x_in, in_b), "workspace");
    CU(cudaMalloc(&x->w.xc, moed_cuda_cbytes(T * c->max_d_pad)), "workspace");
    CU(cudaMalloc(&x->w.h, moed_cuda_cbytes(P * c->max_ff_pad)), "workspace");
    CU(cudaMalloc(&x->w.y, moed_cuda_cbytes((P + NULL_ROWS) * c->max_d_pad)), "workspace");
    /* on the slot's stream, so every kernel of the slot runs after it */
    CU(cudaMemsetAsync((char *)x->w.y + moed_cuda_cbytes(P * c->max_d_pad), 0,
                       moed_cuda_cbytes(NULL_ROWS * c->max_d_pad), x->stream),
       "workspace");
    CU(cudaMalloc((void **)&x->route, moed_cuda_route_words(T, P, c->max_e, max_tiles) * 4),
       "workspace");
    if (part) {
        if (moed_route_init(&x->sub, T, P))
            return moed_fail(err, MOED_ENOMEM, "out of host memory for a part's route");
        CU(cudaMalloc((void **)&x->tok, sizeof *x->tok * (size_t)T), "workspace");
        if (c->landing) CU(cudaMalloc(&x->landing, in_b), "workspace");
        return exec_init_fp8(c, x, err);
    }
    CU(cudaMalloc(&x->out, in_b), "workspace");
    if (home) {
        const size_t rows = sizeof *x->prow * (size_t)c->n_dev * (size_t)T;
        x->ptok = malloc(rows);
        if (!x->ptok) return moed_fail(err, MOED_ENOMEM, "out of host memory");
        CU(cudaMalloc((void **)&x->prow, rows), "workspace");
        CU(cudaMalloc((void **)&x->psum, sizeof(float) * (size_t)psum_rows(c) * c->max_d),
           "workspace");
    }
    x->lay = malloc(sizeof *x->lay * (size_t)(T + 1));
    x->runs = malloc(sizeof *x->runs * (size_t)T);
    if (!x->lay || !x->runs) return moed_fail(err, MOED_ENOMEM, "out of host memory");
    CU(cudaMalloc((void **)&x->bad, sizeof *x->bad * (size_t)T), "workspace");
    CU(cudaMallocHost((void **)&x->h_bad, sizeof *x->h_bad * (size_t)T), "pinned status words");
    if (c->max_sff_pad) {
        CU(cudaMalloc(&x->w.hs, moed_cuda_cbytes(T * c->max_sff_pad)), "workspace");
        CU(cudaMalloc(&x->w.ys, moed_cuda_cbytes(T * c->max_d_pad)), "workspace");
    }
    if (c->max_router_e)
        CU(cudaMalloc((void **)&x->logits, (size_t)T * c->max_router_e * sizeof(float)),
           "workspace");
    return exec_init_fp8(c, x, err);
err:
    return rc;
}

void cuda_exec_free(cuda_ctx *c, cuda_exec *x)
{
    for (int i = 0; x->parts && i < c->n_dev; i++) cuda_exec_free(c, &x->parts[i]);
    free(x->parts);
    if (!x->stream) return;
    cudaSetDevice(x->device);
    cudaStreamSynchronize(x->stream);
    for (int i = 0; i < GRAPH_CACHE; i++)
        if (x->graphs[i].exec) cudaGraphExecDestroy(x->graphs[i].exec);
    for (int i = 0; i < 2; i++) {
        cudaFreeHost(x->h_route[i]);
        if (x->routed[i]) cudaEventDestroy(x->routed[i]);
    }
    cudaFreeHost(x->h_bad);
    free(x->lay);
    free(x->runs);
    if (x->copied) cudaEventDestroy(x->copied);
    if (x->copy) cudaStreamDestroy(x->copy);
    void *p[] = { x->x_in,       x->out,     x->w.xc,  x->w.h,  x->w.y,  x->w.hs,
                  x->w.ys,       x->logits,  x->route, x->w.xq, x->w.xs, x->w.hq,
                  x->w.hs_scale, x->landing, x->bad,   x->tok,  x->prow, x->psum };
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) cudaFree(p[i]);
    moed_route_free(&x->sub);
    free(x->ptok);
    if (x->ready) cudaEventDestroy(x->ready);
    if (x->done) cudaEventDestroy(x->done);
    cudaStreamDestroy(x->stream);
}

/* Workspace bytes of one slot (or part workspace; home: a slot on a split layer's home GPU), for
 * the admission message. */
static uint64_t exec_bytes(const cuda_ctx *c, bool part, bool home)
{
    const int64_t T = c->max_tokens, P = c->max_pairs;
    uint64_t b = (uint64_t)T * c->max_d * 4 + moed_cuda_cbytes(T * c->max_d_pad);
    b += moed_cuda_cbytes(P * (c->max_ff_pad + c->max_d_pad) + NULL_ROWS * c->max_d_pad);
    b +=
        moed_cuda_route_words(T, P, c->max_e, moed_cuda_route_max_tiles((int32_t)P, c->max_e, 16)) *
        4;
    const fp8_sizes z = fp8_buffer_sizes(c);
    b += z.xq + z.xs + z.hq + z.hs;
    if (part) return b + 4 * (uint64_t)T + (c->landing ? (uint64_t)T * c->max_d * 4 : 0);
    if (home) b += 4 * (uint64_t)c->n_dev * T + sizeof(float) * (uint64_t)psum_rows(c) * c->max_d;
    b += (uint64_t)T * c->max_d * 4 + (uint64_t)T * sizeof(unsigned long long);
    b += moed_cuda_cbytes(T * (c->max_sff_pad + c->max_d_pad * (c->max_sff_pad > 0)));
    return b + (uint64_t)T * c->max_router_e * sizeof(float);
}

/* Peer access between every two GPUs of the entries (unless MOED_CUDA_NO_PEER=1), and whether a
 * split layer has a part on another GPU than its home (whose partial rows go home by a copy from a
 * landing buffer, cuda_forward.c). */
static void plan_peers(cuda_ctx *c)
{
    for (int j = 0; j < c->n_dev; j++) cuda_enable_peers(c, c->dev[j]);
    for (int i = 0; i < c->n_dev; i++)
        for (int j = 0; j < c->n_dev; j++) {
            int can = 0;
            c->direct[i][j] =
                c->dev[i] == c->dev[j] ||
                (!c->no_peer &&
                 cudaDeviceCanAccessPeer(&can, c->dev[i], c->dev[j]) == cudaSuccess && can);
        }
    for (int l = 0; l < c->n_layers; l++) {
        const cuda_layer *L = &c->layers[l];
        for (int i = 0; L->sp.parts && i < L->sp.n; i++)
            if (L->sp.parts[i].device != L->device) c->landing = true;
    }
}

/* Each slot that runs split layers gets a part workspace on every entry's GPU. */
static int init_parts(cuda_ctx *c, moed_error *err)
{
    int rc = 0, per_entry = 0;
    for (int s = 0; s < c->n_exec; s++) per_entry += homes_split(c, c->execs[s].device);
    for (int e = 0; e < c->n_dev && per_entry && !rc; e++) {
        char what[96];
        snprintf(what, sizeof what, "the split layers' part workspaces (%d on this entry)",
                 per_entry);
        rc =
            cuda_check_free(c->dev[e], exec_bytes(c, true, false) * (uint64_t)per_entry, what, err);
    }
    for (int s = 0; s < c->n_exec && !rc; s++) {
        cuda_exec *x = &c->execs[s];
        if (!homes_split(c, x->device)) continue;
        x->parts = calloc((size_t)c->n_dev, sizeof *x->parts);
        if (!x->parts) return moed_fail(err, MOED_ENOMEM, "out of host memory");
        for (int e = 0; e < c->n_dev && !rc; e++)
            rc = exec_init(c, &x->parts[e], c->dev[e], true, err);
    }
    return rc;
}

int cuda_start(moed_backend *b, moed_error *err)
{
    cuda_ctx *c = b->ctx;
    int max_k = 1;
    for (int i = 0; i < c->n_layers; i++) {
        const cuda_layer *L = &c->layers[i];
        if (L->info.n_experts > c->max_e) c->max_e = L->info.n_experts;
        if (L->info.top_k > max_k) max_k = L->info.top_k;
        if (L->info.d_model > c->max_d) c->max_d = L->info.d_model;
        if (L->k.d_pad > c->max_d_pad) c->max_d_pad = L->k.d_pad;
        if (L->k.ff_pad > c->max_ff_pad) c->max_ff_pad = L->k.ff_pad;
        if (L->k.sff_pad > c->max_sff_pad) c->max_sff_pad = L->k.sff_pad;
        if (L->router && moed_layer_router_experts(&L->info) > c->max_router_e)
            c->max_router_e = moed_layer_router_experts(&L->info);
        for (int d = 0; d < c->n_dev && L->k.wdtype == MOED_FP8; d++) /* any device may hold it */
            if (moed_cuda_fp8_native(c->sm[d], c->force_kernel)) c->fp8_native = 1;
    }
    if (!c->n_layers) return moed_fail(err, MOED_EINVAL, "no layers loaded");
    /* Room for every token's top-k, and at least one token routed to every expert; batches with
     * more pairs run in token chunks. The halving of the x and h buffers' share keeps one slot
     * within a few GB on the largest shapes. */
    c->max_pairs = c->max_tokens * max_k;
    if (c->max_pairs < c->max_e) c->max_pairs = c->max_e;
    plan_peers(c);
    const int per_dev = c->cfg.streams > 0 ? c->cfg.streams : 2;
    c->n_exec = per_dev * c->n_dev;
    c->execs = calloc((size_t)c->n_exec, sizeof *c->execs);
    if (!c->execs) return moed_fail(err, MOED_ENOMEM, "out of host memory");
    int rc = 0;
    for (int d = 0; d < c->n_dev; d++) {
        char what[96];
        snprintf(what, sizeof what, "the stream pool (%d slots for %lld tokens)", per_dev,
                 (long long)c->max_tokens);
        const uint64_t need = exec_bytes(c, false, homes_split(c, c->dev[d])) * per_dev;
        if ((rc = cuda_check_free(c->dev[d], need, what, err))) return rc;
        for (int s = 0; s < per_dev; s++)
            if ((rc = exec_init(c, &c->execs[d * per_dev + s], c->dev[d], false, err))) return rc;
    }
    if ((rc = init_parts(c, err))) return rc;
    b->n_exec = c->n_exec;
    return 0;
}
