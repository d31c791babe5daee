/*
 * cuda_backend — the CUDA implementation of moed_backend (host code, C): devices, resident weights,
 * the stream pool, and the per-batch pipeline of moed_cuda.h.
 *
 * Weights are converted once at load into the layout the kernels want: the compute type (bf16, or
 * f16 for f16 checkpoints), d and d_ff padded to MOED_CUDA_PAD with zeros, and for SwiGLU W1|W3
 * fused into one interleaved matrix (moed_cuda.h says why). The router stays as the checkpoint
 * stores it: router.cu computes logits from it and the request's hidden as they are, and the
 * logits then follow the layer's rounding rule (moed_router_round_logits), as on the CPU.
 *
 * Placement (moed_place.h): whole layers by bytes over the devices; a layer split over them when
 * asked (expert_parallel) or when it fits no device whole. A split layer's home device holds its
 * router and shared experts and runs its jobs: each job's x is copied to every part's device (a
 * peer copy), each part computes its own pairs' rows in a workspace of its own, gathers them in
 * its pair order straight into the home slot's Y (peer access, or the same GPU) or through a
 * landing buffer and a copy (no peer access; MOED_CUDA_NO_PEER=1 forces that path), and the home
 * combines every pair in route order (moed_cuda.h says why that is bit-identical to unsplit).
 *
 * The pool: `streams` execution slots per device, each with its own stream, pinned staging for the
 * route, and a device workspace sized at start for max_tokens tokens and max_pairs pairs; forward
 * never allocates. A batch with more pairs than the workspace holds (sigmoid gating can give a
 * token every expert) runs in token chunks, which changes nothing in the result since tokens are
 * independent. Everything a batch does is queued on its slot's stream with no device-to-host
 * synchronisation until the output copy; slots run concurrently, so one batch's copies overlap
 * another's kernels.
 *
 * A job's tokens come in parts (moed_backend.h), each copied in and out where it lies: host memory
 * by DMA (straight from pinned or registered pages), device memory device to device, another
 * GPU's memory by a peer copy. A lone part already on the layer's GPU is not copied at all: the
 * convert stage reads it and the combine writes the part's output in place (except for batches a
 * graph replays, whose buffers are captured: there the part costs one small device copy). When a
 * batch runs in chunks, the next chunk's rows come in on the slot's copy stream while the current
 * chunk computes, and the route staging alternates between two halves, so chunks never wait for
 * the host.
 */
#include "moed_backend_impl.h"

#include "moed_cuda.h"
#include "moed_dtype.h"
#include "moed_place.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_DEVICES MOED_PLACE_MAX

/* One set of experts as resident: the routed ones (E of them), or the shared experts (one). */
typedef struct dev_set {
    void *w13, *w2;
    float *w13_scale, *w2_scale;
    int E, ff, ff_pad, n_up;
} dev_set;

/* A split layer's range of experts on one device: their weights, and the kernels' view of them
 * (the layer's shapes, these experts numbered from 0, no shared experts). */
typedef struct cuda_part {
    int entry, device; /* the device entry (index of c->dev) and its GPU */
    dev_set set;
    moed_cuda_layer_dev k;
} cuda_part;

typedef struct cuda_layer {
    moed_layer_info info;
    int device; /* the home GPU: its slots run the layer */
    moed_layer_place place;
    moed_cuda_layer_dev k; /* what the kernels see (a split layer: its shared experts alone) */
    void *w13, *w2;        /* the allocations behind k (k's pointers are const) */
    void *s13, *s2;
    float *w13_scale, *w2_scale, *s13_scale, *s2_scale; /* FP8 layers */
    void *router; /* [E][d] in router_dtype, as the checkpoint stores it; NULL if none */
    int router_dtype;
    /* split: the parts (place.n_parts of them), each expert's part, and each part's first expert */
    cuda_part *parts;
    uint8_t *part_of;
    int part_first[MAX_DEVICES];
} cuda_layer;

/* Small batches replay a captured graph of the pipeline instead of launching its kernels one by
 * one: at a few tokens the launch gaps are a large share of the time. A graph's launches depend
 * only on this key (the buffers are the slot's own and the route lives in device memory). */
#define GRAPH_MAX_PAIRS 512
#define GRAPH_CACHE     16

typedef struct graph_key {
    int slot, dtype, n_active;
    int64_t T, P;
    const void *x; /* the slot's buffers the graph reads and writes (a chunk's rows) */
    void *out;
} graph_key;

typedef struct graph_entry {
    graph_key key;
    cudaGraphExec_t exec;
    uint64_t used; /* for least-recently-used eviction */
} graph_entry;

typedef struct cuda_exec {
    int device;
    cudaStream_t stream;
    cudaStream_t copy;     /* the next chunk's rows come in on it while a chunk computes */
    cudaEvent_t copied;    /* recorded on copy after a chunk's rows are in */
    cudaEvent_t routed[2]; /* recorded after each half of h_route was uploaded */
    /* pinned: the packed input route, in two halves used in turn (a split layer's: followed by
     * where each pair's row is) */
    int32_t *h_route[2];
    void *x_in, *out;
    moed_cuda_work_dev w;
    float *logits;
    int32_t *route; /* device: the packed input route, then route prep's arrays */
    moed_cuda_route_dev r;
    graph_entry graphs[GRAPH_CACHE];
    uint64_t graph_clock;
    /* Split layers. A slot on a home device: a part workspace per device entry (parts[entry]) and
     * the event its inputs are ready at. A part workspace: its pairs' route on the host, the
     * landing buffer of its rows where the home GPU is not reachable by peer access, and the
     * event its rows are home at. */
    struct cuda_exec *parts;
    int32_t *pos; /* [max_pairs] host: where each pair's row is among the parts' blocks */
    cudaEvent_t ready, done;
    moed_route sub;
    void *landing;
} cuda_exec;

typedef struct cuda_ctx {
    moed_backend_config cfg;
    int n_dev, dev[MAX_DEVICES], sm[MAX_DEVICES];
    struct cudaDeviceProp prop[MAX_DEVICES];
    cuda_layer *layers;
    int n_layers;
    cuda_exec *execs;
    int n_exec;
    int64_t max_tokens, max_pairs;
    int max_e, max_d_pad, max_ff_pad, max_sff_pad, max_router_e, max_d;
    int fp8_native; /* an FP8 layer runs on the FP8 Tensor Cores: slots need its buffers */
    int force_kernel;
    moed_place_dev place[MAX_DEVICES]; /* the planner's counts per entry */
    /* entry i's GPU writes entry j's memory directly (the same GPU, or peer access enabled) */
    bool direct[MAX_DEVICES][MAX_DEVICES];
    bool landing; /* some part of a split layer cannot reach its home directly */
} cuda_ctx;

static int cuda_fail(moed_error *err, cudaError_t e, const char *what)
{
    return moed_fail(err, MOED_EDEVICE, "CUDA error during %s: %s (%s)", what, cudaGetErrorName(e),
                     cudaGetErrorString(e));
}

#define CU(call, what)                                                                             \
    do {                                                                                           \
        cudaError_t cu_e_ = (call);                                                                \
        if (cu_e_ != cudaSuccess) {                                                                \
            rc = cuda_fail(err, cu_e_, what);                                                      \
            goto err;                                                                              \
        }                                                                                          \
    } while (0)

static int pad_to(int v)
{
    return (v + MOED_CUDA_PAD - 1) / MOED_CUDA_PAD * MOED_CUDA_PAD;
}

static int dev_index(const cuda_ctx *c, int device)
{
    for (int i = 0; i < c->n_dev; i++)
        if (c->dev[i] == device) return i;
    return 0;
}

int moed_backend_cuda_available(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    for (int i = 0; i < n; i++) {
        int major = 0;
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, i) == cudaSuccess &&
            major >= 8)
            return 1;
    }
    return 0;
}

/* ---- weights ------------------------------------------------------------------------------- */

/* Copies rows [r0, r0+n) of a [rows, cols] matrix of dtype src into dst (ld dst_ld, compute type),
 * converting; the caller zeroed the padding. */
static void put_rows(void *dst, int dst_ld, int cdtype, const void *src, int sdtype, int cols,
                     int64_t r0, int64_t n, float *tmp)
{
    const size_t ss = moed_dtype_size(sdtype);
    for (int64_t i = 0; i < n; i++) {
        const char *s = (const char *)src + (size_t)(r0 + i) * cols * ss;
        char *d = (char *)dst + moed_cuda_cbytes((int64_t)i * dst_ld);
        if (sdtype == cdtype) {
            memcpy(d, s, (size_t)cols * ss);
        } else {
            moed_to_f32(sdtype, s, tmp, (size_t)cols);
            moed_from_f32(cdtype, tmp, d, (size_t)cols);
        }
    }
}

/* One expert's up matrix as the kernels read it: W13 interleaved in MOED_CUDA_GLU_BLOCK row blocks
 * (gate block j, then up block j) for SwiGLU, else W1; [n_up, d_pad] in the compute type. */
static void pack_up(void *dst, const cuda_layer *L, const void *w1, const void *w3, int ff,
                    int n_up, float *tmp)
{
    const int d = L->info.d_model, wd = L->info.wdtype;
    memset(dst, 0, moed_cuda_cbytes((int64_t)n_up * L->k.d_pad));
    if (!w3) {
        put_rows(dst, L->k.d_pad, L->k.cdtype, w1, wd, d, 0, ff, tmp);
        return;
    }
    for (int r0 = 0; r0 < ff; r0 += MOED_CUDA_GLU_BLOCK) {
        const int n = ff - r0 < MOED_CUDA_GLU_BLOCK ? ff - r0 : MOED_CUDA_GLU_BLOCK;
        char *blk = (char *)dst + moed_cuda_cbytes((int64_t)(2 * r0) * L->k.d_pad);
        put_rows(blk, L->k.d_pad, L->k.cdtype, w1, wd, d, r0, n, tmp);
        put_rows(blk + moed_cuda_cbytes((int64_t)MOED_CUDA_GLU_BLOCK * L->k.d_pad), L->k.d_pad,
                 L->k.cdtype, w3, wd, d, r0, n, tmp);
    }
}

/* W2 [d, ff] → [d_pad, ff_pad] in the compute type. */
static void pack_down(void *dst, const cuda_layer *L, const void *w2, int ff, int ff_pad,
                      float *tmp)
{
    memset(dst, 0, moed_cuda_cbytes((int64_t)L->k.d_pad * ff_pad));
    put_rows(dst, ff_pad, L->k.cdtype, w2, L->info.wdtype, ff, 0, L->info.d_model, tmp);
}

static int upload(void *dev, const void *host, size_t bytes, moed_error *err)
{
    cudaError_t e = cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice);
    return e == cudaSuccess ? 0 : cuda_fail(err, e, "weight upload");
}

/* Bytes of n resident weights: e4m3 for FP8 layers, else the compute type. */
static size_t wbytes(const cuda_layer *L, int64_t n)
{
    return L->k.wdtype == MOED_FP8 ? (size_t)n : moed_cuda_cbytes(n);
}

/* Floats of an FP8 [rows, k] matrix's scales in the kernels' tables (0 for other layers). */
static size_t wscales(const cuda_layer *L, int64_t rows, int64_t k)
{
    if (L->k.wdtype != MOED_FP8) return 0;
    return (size_t)(k / MOED_CUDA_FP8_K) * (size_t)(rows / MOED_CUDA_FP8_SROWS);
}

/* Expert e's up and down matrices into set ds: converted to the compute type, or (FP8) the e4m3
 * codes as they are with their scales, whose per-expert tables [K/128][N/32] become columns of
 * the set's [K/128][E·N/32] table. stage is pinned staging for the largest matrix and its
 * scales; tmp a row of floats. */
static int upload_expert(const cuda_layer *L, const dev_set *ds, int e, const moed_expert_w *x,
                         void *stage, float *tmp, moed_error *err)
{
    const int glu = L->k.act == MOED_ACT_SWIGLU, dp = L->k.d_pad;
    const size_t up_b = wbytes(L, (int64_t)ds->n_up * dp),
                 dn_b = wbytes(L, (int64_t)dp * ds->ff_pad);
    if (L->k.wdtype != MOED_FP8) {
        pack_up(stage, L, x->w1, glu ? x->w3 : NULL, ds->ff, ds->n_up, tmp);
        int rc = upload((char *)ds->w13 + up_b * e, stage, up_b, err);
        if (rc) return rc;
        pack_down(stage, L, x->w2, ds->ff, ds->ff_pad, tmp);
        return upload((char *)ds->w2 + dn_b * e, stage, dn_b, err);
    }
    float *sc = (float *)((char *)stage + (up_b > dn_b ? up_b : dn_b));
    const int g_up = ds->n_up / MOED_CUDA_FP8_SROWS, g_dn = dp / MOED_CUDA_FP8_SROWS;
    cudaError_t ce;
    moed_cuda_fp8_pack_up(stage, sc, x, glu, L->k.d, ds->ff, dp, ds->n_up);
    int rc = upload((char *)ds->w13 + up_b * e, stage, up_b, err);
    if (rc) return rc;
    ce = cudaMemcpy2D(ds->w13_scale + (size_t)g_up * e, sizeof(float) * g_up * ds->E, sc,
                      sizeof(float) * g_up, sizeof(float) * g_up, dp / MOED_CUDA_FP8_K,
                      cudaMemcpyHostToDevice);
    if (ce != cudaSuccess) return cuda_fail(err, ce, "weight scale upload");
    moed_cuda_fp8_pack_down(stage, sc, x, L->k.d, ds->ff, dp, ds->ff_pad);
    if ((rc = upload((char *)ds->w2 + dn_b * e, stage, dn_b, err))) return rc;
    ce = cudaMemcpy2D(ds->w2_scale + (size_t)g_dn * e, sizeof(float) * g_dn * ds->E, sc,
                      sizeof(float) * g_dn, sizeof(float) * g_dn, ds->ff_pad / MOED_CUDA_FP8_K,
                      cudaMemcpyHostToDevice);
    return ce == cudaSuccess ? 0 : cuda_fail(err, ce, "weight scale upload");
}

/* Allocates set ds on the device and uploads its experts x[0 .. E-1]. */
static int upload_set(const cuda_layer *L, dev_set *ds, const moed_expert_w *x, void *stage,
                      float *tmp, moed_error *err)
{
    const int dp = L->k.d_pad;
    cudaError_t ce = cudaMalloc(&ds->w13, wbytes(L, (int64_t)ds->n_up * dp) * ds->E);
    if (ce == cudaSuccess) ce = cudaMalloc(&ds->w2, wbytes(L, (int64_t)dp * ds->ff_pad) * ds->E);
    if (ce == cudaSuccess && L->k.wdtype == MOED_FP8) {
        ce = cudaMalloc((void **)&ds->w13_scale,
                        sizeof(float) * wscales(L, (int64_t)ds->n_up * ds->E, dp));
        if (ce == cudaSuccess)
            ce = cudaMalloc((void **)&ds->w2_scale,
                            sizeof(float) * wscales(L, (int64_t)dp * ds->E, ds->ff_pad));
    }
    if (ce != cudaSuccess) return cuda_fail(err, ce, "weight allocation");
    for (int e = 0; e < ds->E; e++) {
        int rc = upload_expert(L, ds, e, &x[e], stage, tmp, err);
        if (rc) return rc;
    }
    return 0;
}

/* Bytes of a layer's router as held on the device (as stored), 0 without one. */
static size_t router_bytes(const cuda_layer *L, const moed_layer *l)
{
    if (!L->info.has_router || !l->router) return 0;
    return (size_t)moed_layer_router_experts(&L->info) * L->info.d_model *
           moed_dtype_size(L->router_dtype);
}

/* What the planner weighs (moed_place.h): device bytes of one routed expert with its scales, and
 * of the rest (shared experts, router). */
static moed_place_need layer_need(const cuda_layer *L, const moed_layer *l, bool split)
{
    const int64_t dp = L->k.d_pad;
    const int64_t up = (int64_t)L->k.n_up * dp, dn = dp * L->k.ff_pad;
    const int64_t sup = (int64_t)L->k.sn_up * dp, sdn = dp * L->k.sff_pad;
    moed_place_need n = { .n_experts = L->info.n_experts, .split = split };
    n.expert = wbytes(L, up + dn) +
               sizeof(float) * (wscales(L, L->k.n_up, dp) + wscales(L, dp, L->k.ff_pad));
    n.base = wbytes(L, sup + sdn) +
             sizeof(float) * (wscales(L, L->k.sn_up, dp) + wscales(L, dp, L->k.sff_pad)) +
             router_bytes(L, l);
    return n;
}

static int check_free(int device, uint64_t need, const char *what, moed_error *err)
{
    size_t free_b = 0, total_b = 0;
    cudaSetDevice(device);
    cudaError_t e = cudaMemGetInfo(&free_b, &total_b);
    if (e != cudaSuccess) return cuda_fail(err, e, "cudaMemGetInfo");
    if (need > free_b)
        return moed_fail(
            err, MOED_ENOMEM,
            "%s needs %.2f GiB on GPU %d, but only %.2f GiB of %.2f GiB are free; serve fewer "
            "layers (--layers), lower --max-batch-tokens or --streams, or add GPUs",
            what, need / 1073741824.0, device, free_b / 1073741824.0, total_b / 1073741824.0);
    return 0;
}

static void set_free(dev_set *ds)
{
    void *p[] = { ds->w13, ds->w2, ds->w13_scale, ds->w2_scale };
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) cudaFree(p[i]);
}

/* Frees a layer's device memory (what of it was allocated). */
static void layer_free(cuda_layer *L)
{
    for (int i = 0; L->parts && i < L->place.n_parts; i++) {
        cudaSetDevice(L->parts[i].device);
        set_free(&L->parts[i].set);
    }
    cudaSetDevice(L->device);
    void *p[] = { L->w13,      L->w2,        L->s13,      L->s2,    L->w13_scale,
                  L->w2_scale, L->s13_scale, L->s2_scale, L->router };
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) cudaFree(p[i]);
    free(L->parts);
    free(L->part_of);
}

/* The layer's shapes as the kernels see them (no weights yet). */
static void layer_shapes(cuda_layer *L, const moed_layer *l)
{
    const moed_layer_info *li = &l->info;
    const int glu = li->act == MOED_ACT_SWIGLU;
    L->info = *li;
    L->k.cdtype = li->wdtype == MOED_F16 ? MOED_F16 : MOED_BF16;
    L->k.wdtype = li->wdtype == MOED_FP8 ? MOED_FP8 : L->k.cdtype;
    L->k.act = li->act;
    L->k.d = li->d_model;
    L->k.E = li->n_experts;
    L->k.d_pad = pad_to(li->d_model);
    L->k.ff_pad = pad_to(li->d_ff);
    L->k.n_up = glu ? 2 * L->k.ff_pad : L->k.ff_pad;
    L->k.sff_pad = li->shared_d_ff ? pad_to(li->shared_d_ff) : 0;
    L->k.sn_up = glu ? 2 * L->k.sff_pad : L->k.sff_pad;
    L->router_dtype = moed_layer_router_dtype(l);
}

/* Pinned staging for the largest matrix and (FP8) its scales, and a row of floats for converting:
 * uploads go through them. */
static int staging(const cuda_layer *L, void **stage, float **tmp, moed_error *err)
{
    const moed_layer_info *li = &L->info;
    const int dp = L->k.d_pad;
    const int64_t rows[4] = { L->k.n_up, dp, L->k.sn_up, dp },
                  ks[4] = { dp, L->k.ff_pad, dp, L->k.sff_pad };
    size_t stage_b = 0;
    for (int i = 0; i < 4; i++) {
        const size_t need = wbytes(L, rows[i] * ks[i]) + sizeof(float) * wscales(L, rows[i], ks[i]);
        if (need > stage_b) stage_b = need;
    }
    int widest = li->d_model > li->d_ff ? li->d_model : li->d_ff; /* put_rows: rows of d or ff */
    if (li->shared_d_ff > widest) widest = li->shared_d_ff;
    *tmp = malloc(sizeof(float) * (size_t)widest);
    if (!*tmp) return moed_fail(err, MOED_ENOMEM, "out of host memory");
    const cudaError_t e = cudaHostAlloc(stage, stage_b, cudaHostAllocPortable);
    return e == cudaSuccess ? 0 : cuda_fail(err, e, "pinned staging for weights");
}

/* The routed experts, whole on the home GPU: into L->k. */
static int upload_whole(cuda_layer *L, const moed_layer *l, void *stage, float *tmp,
                        moed_error *err)
{
    dev_set routed = {
        .E = L->info.n_experts, .ff = L->info.d_ff, .ff_pad = L->k.ff_pad, .n_up = L->k.n_up
    };
    cudaSetDevice(L->device);
    const int rc = upload_set(L, &routed, l->experts, stage, tmp, err);
    L->k.w13 = L->w13 = routed.w13;
    L->k.w2 = L->w2 = routed.w2;
    L->k.w13_scale = L->w13_scale = routed.w13_scale;
    L->k.w2_scale = L->w2_scale = routed.w2_scale;
    return rc;
}

/* The routed experts split: each part's range onto its device, with its view of them. */
static int upload_parts(cuda_ctx *c, cuda_layer *L, const moed_layer *l, void *stage, float *tmp,
                        moed_error *err)
{
    const moed_layer_place *pl = &L->place;
    L->parts = calloc((size_t)pl->n_parts, sizeof *L->parts);
    L->part_of = malloc((size_t)L->info.n_experts);
    if (!L->parts || !L->part_of) return moed_fail(err, MOED_ENOMEM, "out of host memory");
    for (int i = 0; i < pl->n_parts; i++) {
        const moed_place_part *pp = &pl->part[i];
        cuda_part *P = &L->parts[i];
        memset(L->part_of + pp->first, i, (size_t)pp->count);
        L->part_first[i] = pp->first;
        P->entry = pp->dev;
        P->device = c->dev[pp->dev];
        P->set = (dev_set){
            .E = pp->count, .ff = L->info.d_ff, .ff_pad = L->k.ff_pad, .n_up = L->k.n_up
        };
        cudaSetDevice(P->device);
        const int rc = upload_set(L, &P->set, l->experts + pp->first, stage, tmp, err);
        if (rc) return rc;
        P->k = L->k;
        P->k.E = pp->count;
        P->k.w13 = P->set.w13;
        P->k.w2 = P->set.w2;
        P->k.w13_scale = P->set.w13_scale;
        P->k.w2_scale = P->set.w2_scale;
        P->k.sff_pad = P->k.sn_up = 0;
        P->k.s13 = P->k.s2 = NULL;
        P->k.s13_scale = P->k.s2_scale = NULL;
    }
    return 0;
}

/* The shared experts and the router, on the home GPU. */
static int upload_home(cuda_layer *L, const moed_layer *l, void *stage, float *tmp, moed_error *err)
{
    int rc = 0;
    cudaSetDevice(L->device);
    if (L->k.sff_pad) {
        dev_set shared = {
            .E = 1, .ff = L->info.shared_d_ff, .ff_pad = L->k.sff_pad, .n_up = L->k.sn_up
        };
        rc = upload_set(L, &shared, &l->shared, stage, tmp, err);
        L->k.s13 = L->s13 = shared.w13;
        L->k.s2 = L->s2 = shared.w2;
        L->k.s13_scale = L->s13_scale = shared.w13_scale;
        L->k.s2_scale = L->s2_scale = shared.w2_scale;
        if (rc) return rc;
    }
    if (router_bytes(L, l)) {
        CU(cudaMalloc(&L->router, router_bytes(L, l)), "router allocation");
        rc = upload(L->router, l->router, router_bytes(L, l), err);
    }
err:
    return rc;
}

static int cuda_load_layer(moed_backend *b, int slot, const moed_layer *l, moed_error *err)
{
    cuda_ctx *c = b->ctx;
    const moed_layer_info *li = &l->info;
    float *tmp = NULL;
    void *stage = NULL;
    if (slot != c->n_layers)
        return moed_fail(err, MOED_EINVAL, "layers must be loaded in slot order");
    if (li->n_experts > 4096)
        return moed_fail(err, MOED_EUNSUPPORTED,
                         "layer %d has %d experts; the CUDA backend handles up to 4096", li->index,
                         li->n_experts);
    cuda_layer *grown = realloc(c->layers, sizeof *grown * (size_t)(slot + 1));
    if (!grown) return moed_fail(err, MOED_ENOMEM, "out of host memory");
    c->layers = grown;
    cuda_layer *L = &c->layers[slot];
    memset(L, 0, sizeof *L);
    layer_shapes(L, l);
    const moed_place_need need = layer_need(L, l, c->cfg.expert_parallel);
    moed_place_dev before[MAX_DEVICES];
    memcpy(before, c->place, sizeof before);
    int rc = moed_place_layer(c->place, c->n_dev, &need, &L->place, err);
    if (rc) return rc;
    L->device = c->dev[L->place.home];
    if (!moed_place_is_split(&L->place)) {
        char what[64];
        snprintf(what, sizeof what, "layer %d's weights", li->index);
        rc = check_free(L->device, need.base + need.expert * (uint64_t)li->n_experts, what, err);
    }
    if (!rc) rc = staging(L, &stage, &tmp, err);
    if (!rc)
        rc = moed_place_is_split(&L->place) ? upload_parts(c, L, l, stage, tmp, err)
                                            : upload_whole(L, l, stage, tmp, err);
    if (!rc) rc = upload_home(L, l, stage, tmp, err);
    if (stage) cudaFreeHost(stage);
    free(tmp);
    if (rc) {
        layer_free(L);
        memcpy(c->place, before, sizeof before); /* nothing of it stays placed */
        return rc;
    }
    c->n_layers++;
    return 0;
}

/* ---- the pool ------------------------------------------------------------------------------ */

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

/* A slot's buffers on `device`. A part workspace (part set) has no output, router or shared-expert
 * buffers, but a host route of its own and, where needed, a landing buffer; a home slot's pinned
 * route has room for where each pair's row is when it runs a split layer. */
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
    for (int i = 0; i < 2; i++) {
        CU(cudaEventCreateWithFlags(&x->routed[i], cudaEventDisableTiming), "event creation");
        CU(cudaMallocHost((void **)&x->h_route[i],
                          (moed_cuda_route_in_words(T, P) + (size_t)P) * 4),
           "pinned route staging");
    }
    CU(cudaMalloc(&x->x_in, in_b), "workspace");
    CU(cudaMalloc(&x->w.xc, moed_cuda_cbytes(T * c->max_d_pad)), "workspace");
    CU(cudaMalloc(&x->w.h, moed_cuda_cbytes(P * c->max_ff_pad)), "workspace");
    CU(cudaMalloc(&x->w.y, moed_cuda_cbytes(P * c->max_d_pad)), "workspace");
    CU(cudaMalloc((void **)&x->route, moed_cuda_route_words(T, P, c->max_e, max_tiles) * 4),
       "workspace");
    if (part) {
        if (moed_route_init(&x->sub, T, P))
            return moed_fail(err, MOED_ENOMEM, "out of host memory for a part's route");
        if (c->landing)
            CU(cudaMalloc(&x->landing, moed_cuda_cbytes(P * c->max_d_pad)), "workspace");
        return exec_init_fp8(c, x, err);
    }
    CU(cudaMalloc(&x->out, in_b), "workspace");
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

static void exec_free(cuda_ctx *c, cuda_exec *x)
{
    for (int i = 0; x->parts && i < c->n_dev; i++) exec_free(c, &x->parts[i]);
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
    if (x->copied) cudaEventDestroy(x->copied);
    if (x->copy) cudaStreamDestroy(x->copy);
    void *p[] = { x->x_in,   x->out,   x->w.xc, x->w.h,  x->w.y,  x->w.hs,       x->w.ys,
                  x->logits, x->route, x->w.xq, x->w.xs, x->w.hq, x->w.hs_scale, x->landing };
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) cudaFree(p[i]);
    moed_route_free(&x->sub);
    free(x->pos);
    if (x->ready) cudaEventDestroy(x->ready);
    if (x->done) cudaEventDestroy(x->done);
    cudaStreamDestroy(x->stream);
}

/* Workspace bytes of one slot (or part workspace), for the admission message. */
static uint64_t exec_bytes(const cuda_ctx *c, bool part)
{
    const int64_t T = c->max_tokens, P = c->max_pairs;
    uint64_t b = (uint64_t)T * c->max_d * 4 + moed_cuda_cbytes(T * c->max_d_pad);
    b += moed_cuda_cbytes(P * (c->max_ff_pad + c->max_d_pad));
    b +=
        moed_cuda_route_words(T, P, c->max_e, moed_cuda_route_max_tiles((int32_t)P, c->max_e, 16)) *
        4;
    const fp8_sizes z = fp8_buffer_sizes(c);
    b += z.xq + z.xs + z.hq + z.hs;
    if (part) return b + (c->landing ? moed_cuda_cbytes(P * c->max_d_pad) : 0);
    b += (uint64_t)T * c->max_d * 4;
    b += moed_cuda_cbytes(T * (c->max_sff_pad + c->max_d_pad * (c->max_sff_pad > 0)));
    return b + (uint64_t)T * c->max_router_e * sizeof(float);
}

static void enable_peers(const cuda_ctx *c, int dev);

/* Peer access between every two GPUs of the entries (unless MOED_CUDA_NO_PEER=1), and whether a
 * split layer has a part that cannot write its home's memory directly. */
static void plan_peers(cuda_ctx *c)
{
    const char *no = getenv("MOED_CUDA_NO_PEER");
    const bool off = no && *no == '1';
    for (int j = 0; j < c->n_dev && !off; j++) enable_peers(c, c->dev[j]);
    for (int i = 0; i < c->n_dev; i++)
        for (int j = 0; j < c->n_dev; j++) {
            int can = 0;
            c->direct[i][j] =
                c->dev[i] == c->dev[j] ||
                (!off && cudaDeviceCanAccessPeer(&can, c->dev[i], c->dev[j]) == cudaSuccess && can);
        }
    for (int l = 0; l < c->n_layers; l++) {
        const cuda_layer *L = &c->layers[l];
        for (int i = 0; L->parts && i < L->place.n_parts; i++)
            if (!c->direct[L->parts[i].entry][L->place.home]) c->landing = true;
    }
}

/* Whether slots on GPU `device` run a split layer (and so need part workspaces). */
static bool homes_split(const cuda_ctx *c, int device)
{
    for (int l = 0; l < c->n_layers; l++)
        if (c->layers[l].parts && c->layers[l].device == device) return true;
    return false;
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
        rc = check_free(c->dev[e], exec_bytes(c, true) * (uint64_t)per_entry, what, err);
    }
    for (int s = 0; s < c->n_exec && !rc; s++) {
        cuda_exec *x = &c->execs[s];
        if (!homes_split(c, x->device)) continue;
        x->parts = calloc((size_t)c->n_dev, sizeof *x->parts);
        x->pos = malloc(sizeof *x->pos * (size_t)c->max_pairs);
        if (!x->parts || !x->pos) return moed_fail(err, MOED_ENOMEM, "out of host memory");
        for (int e = 0; e < c->n_dev && !rc; e++)
            rc = exec_init(c, &x->parts[e], c->dev[e], true, err);
    }
    return rc;
}

static int cuda_start(moed_backend *b, moed_error *err)
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
        if ((rc = check_free(c->dev[d], exec_bytes(c, false) * per_dev, what, err))) return rc;
        for (int s = 0; s < per_dev; s++)
            if ((rc = exec_init(c, &c->execs[d * per_dev + s], c->dev[d], false, err))) return rc;
    }
    if ((rc = init_parts(c, err))) return rc;
    b->n_exec = c->n_exec;
    return 0;
}

/* ---- parts ------------------------------------------------------------------------------- */

/* Queues the copy of n bytes from src (on device sdev, or host memory) to dst (on device ddev, or
 * host memory) on s: DMA for host memory, device to device, or a peer copy between GPUs. */
static void copy_async(void *dst, int ddev, const void *src, int sdev, size_t n, cudaStream_t s)
{
    if (sdev != MOED_HOST_MEM && ddev != MOED_HOST_MEM && sdev != ddev)
        cudaMemcpyPeerAsync(dst, ddev, src, sdev, n, s);
    else
        cudaMemcpyAsync(dst, src, n,
                        sdev == MOED_HOST_MEM   ? cudaMemcpyHostToDevice
                        : ddev == MOED_HOST_MEM ? cudaMemcpyDeviceToHost
                                                : cudaMemcpyDeviceToDevice,
                        s);
}

/* Queues the copies between tokens [t0, t1) of the job's parts and rows `dev` of the slot's device
 * (dev holds token t0 first, rb bytes a row): into dev (in) or out of it. */
static void parts_copy(const cuda_exec *x, const moed_job *job, int64_t t0, int64_t t1, char *dev,
                       size_t rb, bool in, cudaStream_t s)
{
    int64_t first = 0;
    for (int i = 0; i < job->n_parts && first < t1; first += job->parts[i++].rows) {
        const moed_part *p = &job->parts[i];
        const int64_t lo = first > t0 ? first : t0,
                      hi = first + p->rows < t1 ? first + p->rows : t1;
        if (lo >= hi) continue;
        char *d = dev + (size_t)(lo - t0) * rb;
        const size_t n = (size_t)(hi - lo) * rb, at = (size_t)(lo - first) * rb;
        if (in)
            copy_async(d, x->device, (const char *)p->x + at, p->x_dev, n, s);
        else
            copy_async((char *)p->y + at, p->y_dev, d, x->device, n, s);
    }
}

/* The job's lone part's input (or output) when it already lies on the slot's device: the kernels
 * then read (write) it in place. NULL otherwise. */
static const void *lone_x(const cuda_exec *x, const moed_job *job)
{
    return job->n_parts == 1 && job->parts[0].x_dev == x->device ? job->parts[0].x : NULL;
}

static void *lone_y(const cuda_exec *x, const moed_job *job)
{
    return job->n_parts == 1 && job->parts[0].y_dev == x->device ? job->parts[0].y : NULL;
}

/* ---- one batch ----------------------------------------------------------------------------- */

/* Packs tokens [t0, t1) of the route into half h of the slot's pinned staging (once that half's
 * last upload is done), uploads it, and lays route prep's arrays out behind it for m-tiles of bm
 * rows; with pos (a split layer's home), uploads pos as the pairs' rows too. */
static void stage_route(cuda_exec *x, int h, const moed_route *rt, int64_t t0, int64_t t1, int E,
                        int bm, const int32_t *pos)
{
    const int64_t T = t1 - t0, P = rt->off[t1] - rt->off[t0];
    const size_t in = moed_cuda_route_in_words(T, P);
    cudaEventSynchronize(x->routed[h]);
    moed_cuda_route_pack(x->h_route[h], rt->off, rt->expert, rt->weight, t0, t1);
    moed_cuda_route_layout(&x->r, x->route, T, P, E, bm);
    cudaMemcpyAsync(x->route, x->h_route[h], in * 4, cudaMemcpyHostToDevice, x->stream);
    if (pos) { /* a split layer's combine: each pair's row, which no route prep computes here */
        memcpy(x->h_route[h] + in, pos, sizeof *pos * (size_t)P);
        cudaMemcpyAsync(x->r.pair_slot, x->h_route[h] + in, sizeof *pos * (size_t)P,
                        cudaMemcpyHostToDevice, x->stream);
    }
    cudaEventRecord(x->routed[h], x->stream);
}

/* Count of experts with pairs in tokens [t0, t1), for choosing the tile before staging. */
static int active_experts(const moed_route *rt, int64_t t0, int64_t t1, int E)
{
    static _Thread_local uint8_t seen[4096];
    int n = 0;
    memset(seen, 0, (size_t)E);
    for (int64_t j = rt->off[t0]; j < rt->off[t1]; j++)
        if (!seen[rt->expert[j]]) {
            seen[rt->expert[j]] = 1;
            n++;
        }
    return n;
}

/* The slot's graph for this key, captured on first use (evicting the least recently used); NULL if
 * capture fails, and the caller launches directly. */
static cudaGraphExec_t graph_for(cuda_ctx *c, cuda_exec *x, const cuda_layer *L, const graph_key *k)
{
    graph_entry *victim = &x->graphs[0];
    for (int i = 0; i < GRAPH_CACHE; i++) {
        graph_entry *g = &x->graphs[i];
        if (g->exec && !memcmp(&g->key, k, sizeof *k)) {
            g->used = ++x->graph_clock;
            return g->exec;
        }
        if (g->used < victim->used) victim = g;
    }
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    if (cudaStreamBeginCapture(x->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
        goto fail;
    const int rc = moed_cuda_pipeline(&L->k, &x->r, &x->w, k->x, k->dtype, k->out,
                                      c->sm[dev_index(c, x->device)], k->n_active, c->force_kernel,
                                      x->stream, NULL);
    if (cudaStreamEndCapture(x->stream, &graph) != cudaSuccess || rc) goto fail;
    if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) goto fail;
    cudaGraphDestroy(graph);
    if (victim->exec) cudaGraphExecDestroy(victim->exec);
    victim->key = *k;
    victim->exec = exec;
    victim->used = ++x->graph_clock;
    return exec;
fail:
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError(); /* capture errors are not sticky: clear them and launch directly */
    return NULL;
}

/* What a batch reads and writes on the device, decided once for all its chunks. */
typedef struct batch_io {
    size_t rb;            /* bytes of one row of x and y */
    const void *x_direct; /* the lone part's input on this device, read in place; or NULL */
    void *y_direct;       /* the lone part's output on this device, written in place; or NULL */
} batch_io;

/* Computes tokens [t0, t1) (chunk number `chunk`), whose rows are in (or, direct, need not be
 * copied to) x_in from row t0 on, and queues their outputs' copies. */
static int run_chunk(cuda_ctx *c, cuda_exec *x, const cuda_layer *L, const moed_job *job,
                     const batch_io *io, int chunk, int64_t t0, int64_t t1)
{
    const moed_route *rt = job->route;
    const int E = L->info.n_experts;
    const int64_t T = t1 - t0, P = rt->off[t1] - rt->off[t0];
    const int n_act = active_experts(rt, t0, t1, E);
    const int sm = c->sm[dev_index(c, x->device)];
    stage_route(x, chunk & 1, rt, t0, t1, E,
                moed_cuda_tile_bm(sm, P, n_act, L->k.wdtype, c->force_kernel), NULL);
    const void *xin = io->x_direct ? io->x_direct : (char *)x->x_in + (size_t)t0 * io->rb;
    void *out = io->y_direct ? io->y_direct : (char *)x->out + (size_t)t0 * io->rb;
    int rc = 0;
    cudaGraphExec_t graph = NULL;
    if (P <= GRAPH_MAX_PAIRS && !io->x_direct && !io->y_direct) {
        graph_key k;
        memset(&k, 0, sizeof k); /* compared with memcmp: no stray padding bytes */
        k.slot = job->slot;
        k.dtype = job->dtype;
        k.n_active = n_act;
        k.T = T;
        k.P = P;
        k.x = xin;
        k.out = out;
        graph = graph_for(c, x, L, &k);
    }
    if (graph)
        rc = cudaGraphLaunch(graph, x->stream) == cudaSuccess ? 0 : MOED_EDEVICE;
    else
        rc = moed_cuda_pipeline(&L->k, &x->r, &x->w, xin, job->dtype, out, sm, n_act,
                                c->force_kernel, x->stream, NULL);
    if (!io->y_direct) parts_copy(x, job, t0, t1, out, io->rb, false, x->stream);
    return rc;
}

/* Part i of split layer L for home slot x, chunk `chunk`: after x's inputs are ready, copies x's
 * rows xin (xb bytes) over, runs the part's pairs (its route in q->sub) and brings their rows, in
 * its pair order, into x's Y from row `base` on; records q->done. */
static int run_part(cuda_ctx *c, cuda_exec *x, const cuda_layer *L, int i, int chunk, int dtype,
                    const void *xin, size_t xb, int64_t base)
{
    const cuda_part *pt = &L->parts[i];
    cuda_exec *q = &x->parts[pt->entry];
    const int64_t T = q->sub.T, P = q->sub.off[T];
    const int sm = c->sm[pt->entry], n_act = active_experts(&q->sub, 0, T, pt->k.E);
    const bool direct = c->direct[pt->entry][dev_index(c, x->device)];
    cudaSetDevice(q->device);
    cudaStreamWaitEvent(q->stream, x->ready, 0);
    copy_async(q->x_in, q->device, xin, x->device, xb, q->stream);
    stage_route(q, chunk & 1, &q->sub, 0, T, pt->k.E,
                moed_cuda_tile_bm(sm, P, n_act, pt->k.wdtype, c->force_kernel), NULL);
    int rc = P ? moed_cuda_pipeline_routed(&pt->k, &q->r, &q->w, q->x_in, dtype, sm, n_act,
                                           c->force_kernel, q->stream)
               : 0;
    char *dst = (char *)x->w.y + moed_cuda_cbytes(base * L->k.d_pad);
    if (!rc)
        rc = moed_cuda_gather_rows(direct ? dst : q->landing, q->w.y, q->r.pair_slot, (int)P,
                                   L->k.d_pad, q->stream);
    if (!rc && !direct)
        copy_async(dst, x->device, q->landing, q->device, moed_cuda_cbytes(P * L->k.d_pad),
                   q->stream);
    cudaEventRecord(q->done, q->stream);
    return rc;
}

/* Tokens [t0, t1) of a job on split layer L (moed_cuda.h: the pipeline in two pieces), their rows
 * in as for run_chunk: the home slot x uploads the whole route with each pair's row among the
 * parts' blocks, the parts run their pairs, x runs the shared experts meanwhile, then waits for
 * the parts, combines, and queues the outputs' copies. */
static int run_split_chunk(cuda_ctx *c, cuda_exec *x, const cuda_layer *L, const moed_job *job,
                           const batch_io *io, int chunk, int64_t t0, int64_t t1)
{
    const moed_route *rt = job->route;
    const int n = L->place.n_parts, sm = c->sm[dev_index(c, x->device)];
    const int64_t T = t1 - t0;
    const void *xin = io->x_direct ? io->x_direct : (char *)x->x_in + (size_t)t0 * io->rb;
    void *out = io->y_direct ? io->y_direct : (char *)x->out + (size_t)t0 * io->rb;
    moed_route sub[MAX_DEVICES];
    for (int i = 0; i < n; i++) sub[i] = x->parts[L->parts[i].entry].sub;
    moed_route_split(rt, t0, t1, L->part_of, L->part_first, n, sub, x->pos);
    for (int i = 0; i < n; i++) x->parts[L->parts[i].entry].sub.T = sub[i].T;
    stage_route(x, chunk & 1, rt, t0, t1, L->info.n_experts, 16, x->pos);
    cudaEventRecord(x->ready, x->stream);
    int rc = 0;
    for (int i = 0, base = 0; i < n && !rc; base += (int)sub[i++].off[T])
        rc = run_part(c, x, L, i, chunk, job->dtype, xin, (size_t)T * io->rb, base);
    cudaSetDevice(x->device);
    if (!rc)
        rc = moed_cuda_pipeline_shared(&L->k, T, &x->w, xin, job->dtype, sm, c->force_kernel,
                                       x->stream);
    for (int i = 0; i < n; i++) cudaStreamWaitEvent(x->stream, x->parts[L->parts[i].entry].done, 0);
    if (!rc)
        rc = moed_cuda_combine(&x->r, x->w.y, L->k.s13 ? x->w.ys : NULL, L->k.cdtype,
                               L->info.d_model, L->k.d_pad, out, job->dtype, x->stream);
    if (!io->y_direct) parts_copy(x, job, t0, t1, out, io->rb, false, x->stream);
    return rc;
}

static int finish(cuda_exec *x, int rc, const char *what, moed_error *err)
{
    cudaError_t e = cudaStreamSynchronize(x->stream);
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_fail(err, e, what);
    if (rc)
        return moed_fail(err, rc, "%s: a kernel launch was refused (%s)", what, moed_strerror(rc));
    return 0;
}

/* The slot and layer of a call, checked. */
static int check_call(cuda_ctx *c, int exec, const moed_job *job, moed_error *err)
{
    if (exec < 0 || exec >= c->n_exec || job->slot < 0 || job->slot >= c->n_layers)
        return moed_fail(err, MOED_EINVAL, "no execution slot %d or layer slot %d", exec,
                         job->slot);
    const cuda_layer *L = &c->layers[job->slot];
    if (L->device != c->execs[exec].device)
        return moed_fail(err, MOED_EINVAL, "layer slot %d lives on GPU %d, not on slot %d's GPU %d",
                         job->slot, L->device, exec, c->execs[exec].device);
    if (job->T > c->max_tokens)
        return moed_fail(err, MOED_ETOOBIG,
                         "%lld tokens is over the %lld the workspace was sized for",
                         (long long)job->T, (long long)c->max_tokens);
    return 0;
}

/* The end of the chunk that starts at token t0: as many tokens as the workspace's pairs hold. */
static int chunk_end(const cuda_ctx *c, const moed_route *rt, int64_t T, int64_t t0, int64_t *t1,
                     moed_error *err)
{
    int64_t e = t0 + 1;
    while (e < T && rt->off[e + 1] - rt->off[t0] <= c->max_pairs) e++;
    *t1 = e;
    if (rt->off[e] - rt->off[t0] <= c->max_pairs) return 0;
    return moed_fail(err, MOED_ETOOBIG, "token %lld has %lld pairs, over the workspace's %lld",
                     (long long)t0, (long long)(rt->off[e] - rt->off[t0]), (long long)c->max_pairs);
}

static int cuda_forward(moed_backend *b, int exec, const moed_job *job, moed_error *err)
{
    cuda_ctx *c = b->ctx;
    int rc = check_call(c, exec, job, err);
    if (rc) return rc;
    cuda_exec *x = &c->execs[exec];
    const cuda_layer *L = &c->layers[job->slot];
    const moed_route *rt = job->route;
    cudaSetDevice(x->device);
    const bool one_chunk = rt->off[job->T] <= c->max_pairs;
    /* In place only where no graph is replayed: a graph's buffers are the slot's own. */
    const bool in_place = one_chunk && rt->off[job->T] > GRAPH_MAX_PAIRS;
    const batch_io io = { .rb = (size_t)L->info.d_model * moed_dtype_size(job->dtype),
                          .x_direct = in_place ? lone_x(x, job) : NULL,
                          .y_direct = in_place ? lone_y(x, job) : NULL };
    int64_t t1;
    if ((rc = chunk_end(c, rt, job->T, 0, &t1, err))) return rc;
    if (!io.x_direct) parts_copy(x, job, 0, t1, x->x_in, io.rb, true, x->stream);
    int too_big = 0;
    for (int64_t t0 = 0, chunk = 0; t0 < job->T && !rc; chunk++) {
        int64_t t2 = t1;
        if (t1 < job->T && (too_big = chunk_end(c, rt, job->T, t1, &t2, err))) break;
        if (t1 < job->T) { /* the next chunk's rows come in while this one computes */
            parts_copy(x, job, t1, t2, (char *)x->x_in + (size_t)t1 * io.rb, io.rb, true, x->copy);
            cudaEventRecord(x->copied, x->copy);
        }
        rc = L->parts ? run_split_chunk(c, x, L, job, &io, (int)chunk, t0, t1)
                      : run_chunk(c, x, L, job, &io, (int)chunk, t0, t1);
        if (t1 < job->T) cudaStreamWaitEvent(x->stream, x->copied, 0);
        t0 = t1;
        t1 = t2;
    }
    if (too_big) {
        cudaStreamSynchronize(x->copy);
        cudaStreamSynchronize(x->stream);
        return too_big;
    }
    return finish(x, rc, "forward", err);
}

static int cuda_router_logits(moed_backend *b, int exec, const moed_job *job, float *logits,
                              moed_error *err)
{
    cuda_ctx *c = b->ctx;
    int rc = check_call(c, exec, job, err);
    if (rc) return rc;
    cuda_exec *x = &c->execs[exec];
    const cuda_layer *L = &c->layers[job->slot];
    if (!L->router)
        return moed_fail(err, MOED_EINVAL, "layer %d has no router weights", L->info.index);
    const int d = L->info.d_model, E = moed_layer_router_experts(&L->info);
    const int64_t T = job->T;
    cudaSetDevice(x->device);
    const void *xin = lone_x(x, job);
    if (!xin) {
        parts_copy(x, job, 0, T, x->x_in, (size_t)d * moed_dtype_size(job->dtype), true, x->stream);
        xin = x->x_in;
    }
    rc = moed_cuda_router_logits(xin, job->dtype, T, d, L->router, L->router_dtype, E, x->logits,
                                 x->stream);
    if (!rc)
        cudaMemcpyAsync(logits, x->logits, (size_t)T * E * sizeof(float), cudaMemcpyDeviceToHost,
                        x->stream);
    const int done = finish(x, rc, "router logits", err);
    if (!done) moed_router_round_logits(&L->info, job->dtype, logits, (size_t)T * E);
    return done;
}

/* ---- regions -------------------------------------------------------------------------------- */

static int cuda_host_register(moed_backend *b, void *p, size_t bytes, moed_error *err)
{
    (void)b;
    cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (e == cudaSuccess) return 0;
    cudaGetLastError();
    return moed_fail(err, MOED_ENOMEM,
                     "could not page-lock the region's %zu bytes for the GPU's copies: %s (%s)",
                     bytes, cudaGetErrorName(e), cudaGetErrorString(e));
}

static void cuda_host_unregister(moed_backend *b, void *p)
{
    (void)b;
    if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}

static void uuid_str(const cudaUUID_t *u, char out[48])
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, 48, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

static void cuda_device_uuid(moed_backend *b, int dev, char out[48])
{
    const cuda_ctx *c = b->ctx;
    out[0] = 0;
    for (int i = 0; i < c->n_dev; i++)
        if (c->dev[i] == dev) uuid_str(&c->prop[i].uuid, out);
}

/* Which of the backend's devices a client means: by UUID, or else by the server's ordinal. */
static int find_device(const cuda_ctx *c, const char *uuid, int device, moed_error *err)
{
    char have[MAX_DEVICES * 50] = "", one[48];
    for (int i = 0; i < c->n_dev; i++) {
        uuid_str(&c->prop[i].uuid, one);
        if (uuid && *uuid ? !strcasecmp(one, uuid) : c->dev[i] == device) return i;
        snprintf(have + strlen(have), sizeof have - strlen(have), "%s%d %s", i ? ", " : "",
                 c->dev[i], one);
    }
    if (uuid && *uuid)
        return moed_fail(err, MOED_EPRECOND,
                         "GPU %.60s is not one this server computes on (its GPUs: %s); register "
                         "memory on one of them, or a host region",
                         uuid, have);
    return moed_fail(err, MOED_EPRECOND,
                     "this server has no GPU %d (its GPUs: %s); give the device's UUID", device,
                     have);
}

typedef CUresult (*get_range_fn)(CUdeviceptr *base, size_t *size, CUdeviceptr p);

/* cuMemGetAddressRange from the driver, without linking it: the daemon still starts where no
 * driver is installed. */
static get_range_fn get_range(void)
{
    static get_range_fn fn;
    static int looked;
    if (!looked) {
        void *p = NULL;
        enum cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault,
                                             &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (get_range_fn)p;
        looked = 1;
    }
    return fn;
}

/* Lets the backend's other GPUs copy from and to dev directly (peer copies work without it, more
 * slowly, through the host). */
static void enable_peers(const cuda_ctx *c, int dev)
{
    for (int i = 0; i < c->n_dev; i++) {
        int can = 0;
        if (c->dev[i] == dev || cudaDeviceCanAccessPeer(&can, c->dev[i], dev) != cudaSuccess ||
            !can)
            continue;
        cudaSetDevice(c->dev[i]);
        cudaDeviceEnablePeerAccess(dev, 0);
        cudaGetLastError(); /* already enabled is fine */
    }
}

static int cuda_map_device(moed_backend *b, const void *handle, size_t handle_len,
                           const char *device_uuid, int device, uint64_t bytes, uint64_t offset,
                           void **ptr, int *dev, void **base, moed_error *err)
{
    cuda_ctx *c = b->ctx;
    if (handle_len != sizeof(cudaIpcMemHandle_t))
        return moed_fail(err, MOED_EINVAL,
                         "ipc_handle is %zu bytes; a cudaIpcMemHandle_t is %zu (send the bytes "
                         "cudaIpcGetMemHandle wrote)",
                         handle_len, sizeof(cudaIpcMemHandle_t));
    const int di = find_device(c, device_uuid, device, err);
    if (di < 0) return di;
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof h);
    void *p = NULL;
    cudaSetDevice(c->dev[di]);
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return moed_fail(err, MOED_EINVAL,
                         "the IPC handle does not open on GPU %d: %s (%s); send a handle of a live "
                         "allocation on that GPU, made by another process",
                         c->dev[di], cudaGetErrorName(e), cudaGetErrorString(e));
    }
    CUdeviceptr abase = 0;
    size_t asize = 0;
    get_range_fn range = get_range();
    if (!range || range(&abase, &asize, (CUdeviceptr)(uintptr_t)p) != CUDA_SUCCESS ||
        offset > asize || bytes > asize - offset) {
        cudaIpcCloseMemHandle(p);
        if (!range)
            return moed_fail(
                err, MOED_EPRECOND,
                "the CUDA driver does not offer cuMemGetAddressRange, which moed needs "
                "to check a region's bounds");
        return moed_fail(err, MOED_EINVAL,
                         "offset %llu + bytes %llu run past the exported allocation (%zu bytes)",
                         (unsigned long long)offset, (unsigned long long)bytes, asize);
    }
    enable_peers(c, c->dev[di]);
    *ptr = (char *)p + offset;
    *dev = c->dev[di];
    *base = p;
    return 0;
}

static void cuda_unmap_device(moed_backend *b, void *base, int dev)
{
    (void)b;
    cudaSetDevice(dev);
    if (cudaIpcCloseMemHandle(base) != cudaSuccess) cudaGetLastError();
}

static int cuda_read_device(moed_backend *b, void *dst, const void *src, int dev, size_t bytes,
                            moed_error *err)
{
    (void)b;
    cudaSetDevice(dev);
    cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
    return e == cudaSuccess ? 0 : cuda_fail(err, e, "a copy from a CUDA region");
}

static int cuda_exec_accepts(moed_backend *b, int exec, int slot)
{
    const cuda_ctx *c = b->ctx;
    return exec >= 0 && exec < c->n_exec && slot >= 0 && slot < c->n_layers &&
           c->execs[exec].device == c->layers[slot].device;
}

static int cuda_layer_place(moed_backend *b, int slot, moed_layer_place *out)
{
    const cuda_ctx *c = b->ctx;
    if (slot < 0 || slot >= c->n_layers) return MOED_EINVAL;
    *out = c->layers[slot].place;
    return 0;
}

static void *cuda_host_alloc(moed_backend *b, size_t bytes)
{
    void *p = NULL;
    (void)b;
    return cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable) == cudaSuccess ? p : NULL;
}

static void cuda_host_free(moed_backend *b, void *p)
{
    (void)b;
    if (p) cudaFreeHost(p);
}

static int cuda_device_info(moed_backend *b, int i, moed_device_info *out)
{
    cuda_ctx *c = b->ctx;
    if (i < 0 || i >= c->n_dev) return MOED_EINVAL;
    size_t free_b = 0, total_b = 0;
    cudaSetDevice(c->dev[i]);
    cudaMemGetInfo(&free_b, &total_b);
    snprintf(out->name, sizeof out->name, "%.64s (GPU %d, sm_%d)", c->prop[i].name, c->dev[i],
             c->sm[i]);
    out->memory_total = total_b;
    out->memory_used = total_b - free_b;
    return 0;
}

static void cuda_destroy(moed_backend *b)
{
    cuda_ctx *c = b->ctx;
    for (int i = 0; i < c->n_exec; i++) exec_free(c, &c->execs[i]);
    for (int i = 0; i < c->n_layers; i++) layer_free(&c->layers[i]);
    free(c->execs);
    free(c->layers);
    free(c);
    free(b);
}

static const moed_backend_ops cuda_ops = {
    .name = "cuda",
    .host_dma = true,
    .load_layer = cuda_load_layer,
    .start = cuda_start,
    .forward = cuda_forward,
    .router_logits = cuda_router_logits,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .device_info = cuda_device_info,
    .exec_accepts = cuda_exec_accepts,
    .layer_place = cuda_layer_place,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .map_device = cuda_map_device,
    .unmap_device = cuda_unmap_device,
    .read_device = cuda_read_device,
    .device_uuid = cuda_device_uuid,
    .destroy = cuda_destroy,
};

int moed_backend_cuda_open(const moed_backend_config *cfg, moed_backend **out, moed_error *err)
{
    int n = 0, rc = 0;
    cuda_ctx *c = NULL;
    moed_backend *b = NULL;
    *out = NULL;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        cudaGetLastError();
        return moed_fail(err, MOED_ENODEV, "no CUDA device answers (%s); use --backend cpu",
                         e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    }
    c = calloc(1, sizeof *c);
    b = calloc(1, sizeof *b);
    if (!c || !b) {
        rc = moed_fail(err, MOED_ENOMEM, "out of host memory");
        goto err;
    }
    c->cfg = *cfg;
    c->max_tokens = cfg->max_tokens > 0 ? cfg->max_tokens : 8192;
    c->force_kernel = moed_cuda_kernel_parse(getenv("MOED_CUDA_KERNEL"));
    const int listed = cfg->devices && cfg->n_devices > 0;
    const int want = listed ? cfg->n_devices : n;
    for (int i = 0; i < want && c->n_dev < MAX_DEVICES; i++) {
        const int id = listed ? cfg->devices[i] : i;
        struct cudaDeviceProp *pr = &c->prop[c->n_dev];
        if (id < 0 || id >= n) {
            rc = moed_fail(err, MOED_EINVAL, "--devices names GPU %d, but only GPUs 0..%d exist",
                           id, n - 1);
            goto err;
        }
        CU(cudaGetDeviceProperties(pr, id), "cudaGetDeviceProperties");
        const int sm = pr->major * 10 + pr->minor;
        if (sm < 80) {
            rc = moed_fail(err, MOED_ENODEV,
                           "GPU %d (%.64s) is sm_%d; the CUDA backend needs sm_80 or newer", id,
                           pr->name, sm);
            goto err;
        }
        size_t free_b = 0, total_b = 0;
        CU(cudaSetDevice(id), "cudaSetDevice");
        CU(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
        c->place[c->n_dev] = (moed_place_dev){ .gpu = id, .free = free_b };
        c->sm[c->n_dev] = sm;
        c->dev[c->n_dev++] = id;
    }
    if (cfg->expert_parallel && c->n_dev < 2) {
        rc = moed_fail(err, MOED_EINVAL,
                       "--expert-parallel splits each layer's experts over the devices, but only "
                       "GPU %d is used: list two or more (--devices 0,1; or --devices 0,0 to run "
                       "the split on one GPU)",
                       c->dev[0]);
        goto err;
    }
    b->ops = &cuda_ops;
    b->ctx = c;
    b->n_devices = c->n_dev;
    *out = b;
    return 0;
err:
    free(c);
    free(b);
    return rc;
}
