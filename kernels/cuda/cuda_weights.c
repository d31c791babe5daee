/*
 * cuda_weights — a layer's weights onto the devices (the backend's load_layer), and their release.
 *
 * Weights are converted once at load into the layout the kernels want: the compute type (bf16, or
 * f16 for f16 checkpoints), d and d_ff padded to MOED_CUDA_PAD with zeros, and for SwiGLU W1|W3
 * fused into one interleaved matrix (moed_cuda.h says why). FP8 layers keep the checkpoint's e4m3
 * codes and their scales in the kernels' tables. A 2:4 sparse layer (moed_layer_info.sparse24, not
 * FP8) has its routed experts' matrices built the same way and then compressed (sp24_pack.c): the
 * kept values and their metadata are all it holds on the device; its shared experts stay dense.
 * (FP8 layers that are also 2:4 sparse run as any FP8 layer: there is no sparse FP8 kernel.) The
 * router stays as the checkpoint stores it: router.cu computes logits from it and the request's
 * hidden as they are, and the logits then follow the layer's rounding rule
 * (moed_router_round_logits), as on the CPU.
 *
 * Placement (moed_place.h): whole layers by bytes over the devices; a layer split over them when
 * asked (expert_parallel) or when it fits no device whole. A split layer's home device holds its
 * router and shared experts, each part's device its range of the routed experts (and, once a
 * re-placement made them, copies of hot ones: cuda_replace.c), seen by the kernels as a layer of
 * its own (cuda_part.k). A layer that fails to load leaves nothing placed.
 */
#include "cuda_ctx.h"

#include "moed_dtype.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int pad_to(int v)
{
    return (v + MOED_CUDA_PAD - 1) / MOED_CUDA_PAD * MOED_CUDA_PAD;
}

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

/* Bytes of one [rows, k] matrix's weights in set ds as resident; for a 2:4 sparse set its kept
 * values, half the elements (its metadata, k/8 bytes a row, is allocated apart: 0.5625 of the
 * dense bytes together). */
static size_t mbytes(const cuda_layer *L, const dev_set *ds, int64_t rows, int64_t k)
{
    return ds->sparse ? moed_cuda_cbytes(rows * k / 2) : wbytes(L, rows * k);
}

/* Floats of an FP8 [rows, k] matrix's scales in the kernels' tables (0 for other layers). */
static size_t wscales(const cuda_layer *L, int64_t rows, int64_t k)
{
    if (L->k.wdtype != MOED_FP8) return 0;
    return (size_t)(k / MOED_CUDA_FP8_K) * (size_t)(rows / MOED_CUDA_FP8_SROWS);
}

/* The matrix a row of expert e's up matrix (dn: down) came from, and its row there: W13
 * interleaves W1 and W3 in blocks of MOED_CUDA_GLU_BLOCK rows. */
static const char *source_row(const cuda_layer *L, bool dn, int64_t *row)
{
    if (dn) return "w2";
    if (L->k.act != MOED_ACT_SWIGLU) return "w1";
    const int64_t blk = *row / (2 * MOED_CUDA_GLU_BLOCK), in = *row % (2 * MOED_CUDA_GLU_BLOCK);
    *row = blk * MOED_CUDA_GLU_BLOCK + in % MOED_CUDA_GLU_BLOCK;
    return in < MOED_CUDA_GLU_BLOCK ? "w1" : "w3";
}

/* The dense [rows, k] matrix in stage compressed (into the staging after it) and uploaded as
 * expert e's kept values and metadata in ds. A group of more than two non-zeros fails the load:
 * the loaders check the layer (moed_sp24_check), so only a broken one gets here. */
static int upload_sparse(const cuda_layer *L, const dev_set *ds, int e, int e_global, bool dn,
                         void *stage, int64_t rows, int64_t k, moed_error *err)
{
    uint16_t *vals = (uint16_t *)((char *)stage + moed_cuda_cbytes(rows * k));
    uint16_t *meta = vals + rows * k / 2;
    int64_t bad_r = 0, bad_c = 0;
    if (moed_cuda_sp24_pack(stage, rows, k, vals, meta, &bad_r, &bad_c)) {
        const char *m = source_row(L, dn, &bad_r);
        return moed_fail(err, MOED_EINVAL,
                         "layer %d, expert %d: %s is not 2:4 sparse (row %lld has more than two "
                         "non-zeros in columns %lld..%lld)",
                         L->info.index, e_global, m, (long long)bad_r, (long long)bad_c,
                         (long long)bad_c + 3);
    }
    const size_t vb = moed_cuda_cbytes(rows * k / 2), mw = MOED_CUDA_SP24_META_WORDS(rows, k);
    int rc = upload((char *)(dn ? ds->w2 : ds->w13) + vb * e, vals, vb, err);
    if (!rc) rc = upload((dn ? ds->w2_meta : ds->w13_meta) + mw * e, meta, mw * 4, err);
    return rc;
}

/* Expert e (e_global in the layer) up and down matrices into set ds: converted to the compute type
 * (and for a sparse set compressed), or (FP8) the e4m3 codes as they are with their scales, whose
 * per-expert tables [K/128][N/32] become columns of the set's [K/128][E·N/32] table. stage is
 * pinned staging for the largest matrix and its scales or compressed form; tmp a row of floats. */
static int upload_expert(const cuda_layer *L, const dev_set *ds, int e, int e_global,
                         const moed_expert_w *x, void *stage, float *tmp, moed_error *err)
{
    const int glu = L->k.act == MOED_ACT_SWIGLU, dp = L->k.d_pad;
    const size_t up_b = wbytes(L, (int64_t)ds->n_up * dp),
                 dn_b = wbytes(L, (int64_t)dp * ds->ff_pad);
    if (ds->sparse) {
        pack_up(stage, L, x->w1, glu ? x->w3 : NULL, ds->ff, ds->n_up, tmp);
        int rc = upload_sparse(L, ds, e, e_global, false, stage, ds->n_up, dp, err);
        if (rc) return rc;
        pack_down(stage, L, x->w2, ds->ff, ds->ff_pad, tmp);
        return upload_sparse(L, ds, e, e_global, true, stage, dp, ds->ff_pad, err);
    }
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

/* Allocates set ds's weights on the current device (what of them was allocated stays in ds). */
static int set_alloc(const cuda_layer *L, dev_set *ds, moed_error *err)
{
    const int dp = L->k.d_pad;
    const int64_t up = (int64_t)ds->n_up * dp, dn = (int64_t)dp * ds->ff_pad;
    cudaError_t ce = cudaMalloc(&ds->w13, mbytes(L, ds, ds->n_up, dp) * ds->E);
    if (ce == cudaSuccess) ce = cudaMalloc(&ds->w2, mbytes(L, ds, dp, ds->ff_pad) * ds->E);
    if (ce == cudaSuccess && ds->sparse) {
        ce = cudaMalloc((void **)&ds->w13_meta, 4 * MOED_CUDA_SP24_META_WORDS(up, 1) * ds->E);
        if (ce == cudaSuccess)
            ce = cudaMalloc((void **)&ds->w2_meta, 4 * MOED_CUDA_SP24_META_WORDS(dn, 1) * ds->E);
    }
    if (ce == cudaSuccess && L->k.wdtype == MOED_FP8) {
        ce = cudaMalloc((void **)&ds->w13_scale,
                        sizeof(float) * wscales(L, (int64_t)ds->n_up * ds->E, dp));
        if (ce == cudaSuccess)
            ce = cudaMalloc((void **)&ds->w2_scale,
                            sizeof(float) * wscales(L, (int64_t)dp * ds->E, ds->ff_pad));
    }
    return ce == cudaSuccess ? 0 : cuda_fail(err, ce, "weight allocation");
}

/* Allocates set ds on the device and uploads its experts: the layer's experts x[ids[i]] (ids NULL:
 * x[i]) as its i-th. */
static int upload_set(const cuda_layer *L, dev_set *ds, const moed_expert_w *x, const int *ids,
                      void *stage, float *tmp, moed_error *err)
{
    int rc = set_alloc(L, ds, err);
    for (int e = 0; e < ds->E && !rc; e++) {
        const int g = ids ? ids[e] : e;
        rc = upload_expert(L, ds, e, g, &x[g], stage, tmp, err);
    }
    return rc;
}

/* Bytes of a layer's router as held on the device (as stored), 0 without one. */
static size_t router_bytes(const cuda_layer *L, const moed_layer *l)
{
    if (!L->info.has_router || !l->router) return 0;
    return (size_t)moed_layer_router_experts(&L->info) * L->info.d_model *
           moed_dtype_size(L->router_dtype);
}

moed_place_need cuda_layer_need(const cuda_layer *L, uint64_t router_b, bool split,
                                const double *pairs, double launches)
{
    const int64_t dp = L->k.d_pad;
    const int64_t up = (int64_t)L->k.n_up * dp, dn = dp * L->k.ff_pad;
    const int64_t sup = (int64_t)L->k.sn_up * dp, sdn = dp * L->k.sff_pad;
    moed_place_need n = { .n_experts = L->info.n_experts, .split = split };
    const dev_set routed = { .sparse = L->k.sparse24 };
    n.expert = mbytes(L, &routed, L->k.n_up, dp) + mbytes(L, &routed, dp, L->k.ff_pad) +
               4 * (L->k.sparse24 ? MOED_CUDA_SP24_META_WORDS(up + dn, 1) : 0) +
               sizeof(float) * (wscales(L, L->k.n_up, dp) + wscales(L, dp, L->k.ff_pad));
    n.base = wbytes(L, sup + sdn) +
             sizeof(float) * (wscales(L, L->k.sn_up, dp) + wscales(L, dp, L->k.sff_pad)) + router_b;
    /* The shared experts run for every token, a routed expert for top_k of the router's experts
     * (the whole layer's, also on an expert shard) on average: the home's extra work, which a
     * split evens out (moed_place.h); measured, where the experts' load is. */
    if (L->k.sff_pad) {
        const double width = (double)(L->k.sn_up + L->k.sff_pad) / (L->k.n_up + L->k.ff_pad);
        const int E = moed_layer_router_experts(&L->info);
        n.home_work = pairs ? moed_place_shared_work_measured(width, pairs, L->info.n_experts, E,
                                                              L->info.top_k, launches, STREAM_ROWS)
                            : -1;
        if (n.home_work < 0) n.home_work = moed_place_shared_work(width, E, L->info.top_k);
    }
    return n;
}

/* Each expert's cost over the run its measured loads come from (moed_place_costs), or NULL
 * without loads. */
static double *expert_costs(const moed_layer *l)
{
    const int E = l->info.n_experts;
    double *w = l->expert_load ? malloc(sizeof *w * (size_t)E) : NULL;
    if (w) moed_place_costs(l->expert_load, E, l->expert_launches, STREAM_ROWS, w);
    return w;
}

int cuda_check_free(int device, uint64_t need, const char *what, moed_error *err)
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
    void *p[] = { ds->w13, ds->w2, ds->w13_scale, ds->w2_scale, ds->w13_meta, ds->w2_meta };
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) cudaFree(p[i]);
}

void cuda_split_free(cuda_split *sp)
{
    for (int i = 0; sp->parts && i < sp->n; i++) {
        cudaSetDevice(sp->parts[i].device);
        set_free(&sp->parts[i].set);
    }
    free(sp->parts);
    free(sp->part_of);
    free(sp->copy_off);
    free(sp->copy_part);
    free(sp->copy_local);
    sp->parts = NULL;
    sp->part_of = NULL;
    sp->copy_off = sp->copy_local = NULL;
    sp->copy_part = NULL;
}

/* Frees a layer's device memory (what of it was allocated). */
void cuda_layer_free(cuda_layer *L)
{
    cuda_split_free(&L->sp);
    cudaSetDevice(L->device);
    void *p[] = { L->w13,       L->w2,       L->s13,      L->s2,      L->w13_scale, L->w2_scale,
                  L->s13_scale, L->s2_scale, L->w13_meta, L->w2_meta, L->router,    L->local_of };
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) cudaFree(p[i]);
    if (L->lock) pthread_rwlock_destroy(L->lock);
    free(L->lock);
}

/* The layer's shapes as the kernels see them (no weights yet). */
static void layer_shapes(cuda_layer *L, const moed_layer *l)
{
    const moed_layer_info *li = &l->info;
    const int glu = li->act == MOED_ACT_SWIGLU;
    L->info = *li;
    L->k.cdtype = li->wdtype == MOED_F16 ? MOED_F16 : MOED_BF16;
    L->k.wdtype = li->wdtype == MOED_FP8 ? MOED_FP8 : L->k.cdtype;
    L->k.sparse24 = li->sparse24 && L->k.wdtype != MOED_FP8;
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
        size_t need = wbytes(L, rows[i] * ks[i]) + sizeof(float) * wscales(L, rows[i], ks[i]);
        if (i < 2 && L->k.sparse24) /* the routed matrix, then its kept values and metadata */
            need += moed_cuda_cbytes(rows[i] * ks[i] / 2) +
                    4 * MOED_CUDA_SP24_META_WORDS(rows[i], ks[i]);
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
    dev_set routed = { .E = L->info.n_experts,
                       .ff = L->info.d_ff,
                       .ff_pad = L->k.ff_pad,
                       .n_up = L->k.n_up,
                       .sparse = L->k.sparse24 };
    cudaSetDevice(L->device);
    const int rc = upload_set(L, &routed, l->experts, NULL, stage, tmp, err);
    L->k.w13 = L->w13 = routed.w13;
    L->k.w2 = L->w2 = routed.w2;
    L->k.w13_scale = L->w13_scale = routed.w13_scale;
    L->k.w2_scale = L->w2_scale = routed.w2_scale;
    L->k.w13_meta = L->w13_meta = routed.w13_meta;
    L->k.w2_meta = L->w2_meta = routed.w2_meta;
    return rc;
}

int cuda_split_init(const cuda_ctx *c, const cuda_layer *L, cuda_split *sp, moed_error *err)
{
    const moed_layer_place *pl = &sp->place;
    const int E = L->info.n_experts, copies = E + pl->n_replicas;
    int dev[MAX_DEVICES], *ids = malloc(sizeof *ids * (size_t)E);
    sp->n = moed_place_parts(pl, dev);
    sp->parts = calloc((size_t)sp->n, sizeof *sp->parts);
    if (pl->n_replicas) {
        sp->copy_off = malloc(sizeof *sp->copy_off * (size_t)(E + 1));
        sp->copy_part = malloc((size_t)copies);
        sp->copy_local = malloc(sizeof *sp->copy_local * (size_t)copies);
    } else {
        sp->part_of = malloc((size_t)E);
    }
    if (!ids || !sp->parts ||
        (pl->n_replicas ? !sp->copy_off || !sp->copy_part || !sp->copy_local : !sp->part_of)) {
        free(ids);
        cuda_split_free(sp);
        return moed_fail(err, MOED_ENOMEM, "out of host memory");
    }
    if (pl->n_replicas) {
        moed_place_copies(pl, E, sp->copy_off, sp->copy_part, sp->copy_local);
    } else { /* the parts are the ranges, in order (moed_place_parts) */
        for (int i = 0; i < pl->n_parts; i++) {
            memset(sp->part_of + pl->part[i].first, i, (size_t)pl->part[i].count);
            sp->first[i] = pl->part[i].first;
        }
    }
    for (int i = 0; i < sp->n; i++) {
        cuda_part *P = &sp->parts[i];
        P->entry = dev[i];
        P->device = c->dev[dev[i]];
        P->set = (dev_set){ .E = moed_place_entry_experts(pl, dev[i], ids),
                            .ff = L->info.d_ff,
                            .ff_pad = L->k.ff_pad,
                            .n_up = L->k.n_up,
                            .sparse = L->k.sparse24 };
    }
    free(ids);
    return 0;
}

/* Points part P's kernel view at its weights: the layer's shapes, its experts numbered from 0, no
 * shared experts. */
static void part_view(const cuda_layer *L, cuda_part *P)
{
    P->k = L->k;
    P->k.E = P->set.E;
    P->k.w13 = P->set.w13;
    P->k.w2 = P->set.w2;
    P->k.w13_scale = P->set.w13_scale;
    P->k.w2_scale = P->set.w2_scale;
    P->k.w13_meta = P->set.w13_meta;
    P->k.w2_meta = P->set.w2_meta;
    P->k.sff_pad = P->k.sn_up = 0;
    P->k.s13 = P->k.s2 = NULL;
    P->k.s13_scale = P->k.s2_scale = NULL;
}

int cuda_part_alloc(const cuda_layer *L, cuda_part *P, moed_error *err)
{
    const int rc = set_alloc(L, &P->set, err);
    part_view(L, P);
    return rc;
}

/* The routed experts split: each part's experts (its range, and copies where a placement has
 * them) onto its device, with its view of them. */
static int upload_parts(cuda_ctx *c, cuda_layer *L, const moed_layer *l, void *stage, float *tmp,
                        moed_error *err)
{
    int rc = cuda_split_init(c, L, &L->sp, err);
    int *ids = rc ? NULL : malloc(sizeof *ids * (size_t)L->info.n_experts);
    if (!rc && !ids) rc = moed_fail(err, MOED_ENOMEM, "out of host memory");
    for (int i = 0; i < L->sp.n && !rc; i++) {
        cuda_part *P = &L->sp.parts[i];
        moed_place_entry_experts(&L->sp.place, P->entry, ids);
        cudaSetDevice(P->device);
        rc = upload_set(L, &P->set, l->experts, ids, stage, tmp, err);
        part_view(L, P);
    }
    free(ids);
    return rc;
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
        rc = upload_set(L, &shared, &l->shared, NULL, stage, tmp, err);
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
    if (!rc && l->local_of) {
        const size_t bytes = sizeof *l->local_of * (size_t)moed_layer_router_experts(&l->info);
        CU(cudaMalloc((void **)&L->local_of, bytes), "expert map allocation");
        rc = upload(L->local_of, l->local_of, bytes, err);
        L->local_of_host = l->local_of;
    }
err:
    return rc;
}

int cuda_load_layer(moed_backend *b, int slot, const moed_layer *l, moed_error *err)
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
    L->lock = malloc(sizeof *L->lock);
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    if (!L->lock || pthread_rwlock_init(L->lock, &attr)) {
        free(L->lock);
        L->lock = NULL;
        return moed_fail(err, MOED_ENOMEM, "out of host memory");
    }
    double *cost = expert_costs(l);
    moed_place_need need = cuda_layer_need(L, router_bytes(L, l), c->cfg.expert_parallel,
                                           l->expert_load, l->expert_launches);
    need.load = cost;
    moed_place_dev before[MAX_DEVICES];
    memcpy(before, c->place, sizeof before);
    int rc = l->expert_load && !cost
                 ? moed_fail(err, MOED_ENOMEM, "out of host memory")
                 : moed_place_layer(c->place, c->n_dev, &need, &L->sp.place, err);
    free(cost);
    if (rc) {
        cuda_layer_free(L);
        return rc;
    }
    L->device = c->dev[L->sp.place.home];
    if (!moed_place_is_split(&L->sp.place)) {
        char what[64];
        snprintf(what, sizeof what, "layer %d's weights", li->index);
        rc = cuda_check_free(L->device, need.base + need.expert * (uint64_t)li->n_experts, what,
                             err);
    }
    if (!rc) rc = staging(L, &stage, &tmp, err);
    if (!rc)
        rc = moed_place_is_split(&L->sp.place) ? upload_parts(c, L, l, stage, tmp, err)
                                               : upload_whole(L, l, stage, tmp, err);
    if (!rc) rc = upload_home(L, l, stage, tmp, err);
    if (stage) cudaFreeHost(stage);
    free(tmp);
    if (rc) {
        cuda_layer_free(L);
        memcpy(c->place, before, sizeof before); /* nothing of it stays placed */
        return rc;
    }
    c->n_layers++;
    return 0;
}
