/*
 * cuda_replace — re-placing a split layer while it serves (the backend's replace_layer,
 * moed_backend.h): a new cut of its routed experts by their measured cost over the same device
 * entries, its home kept, with copies of hot experts (moed_place.h), built beside the old parts
 * and swapped in between jobs.
 *
 * The plan: each expert's cost from the request's pairs and launches (moed_place_costs, in rows'
 * time), the home's shared experts costed from the same load (cuda_layer_need); room on each
 * GPU its free memory less REPLACE_RESERVE, plus what the layer's parts hold there now (the room
 * the new placement has once the old is freed); then the copies, up to req->max_replicas. The
 * heaviest entry's predicted work before and after (moed_place_peak, the same costs) decides: a
 * gain under req->min_gain changes nothing.
 *
 * The build: a new part the same as an old one (the same entry and experts in the same order)
 * keeps the old one's weights; every other new part is allocated and filled by device-to-device
 * copies from the old parts (from one on its own GPU where there is, else by a peer copy, which
 * the driver stages through host memory where peer access is off), so the host copy of the
 * weights is never needed again after load. All of the new parts' bytes must fit beside the old
 * ones (MOED_ENOMEM naming the bytes per GPU, nothing changed). Jobs run on the old parts
 * meanwhile; then the swap takes the layer's lock exclusively (cuda_ctx.h), which waits for the
 * jobs in flight to finish, switches the placement and its tables, and lets the next jobs run on
 * the new parts; the old parts' memory is freed after. Nothing is cached per placement elsewhere:
 * split layers replay no graphs, and a home slot's part workspaces fit any placement over its
 * entries (cuda_pool.c sizes them by max_tokens, max_pairs and the widest layer's experts, and a
 * part holds at most every expert once, its pairs and tokens at most a chunk's). Slots got landing
 * buffers at start only if some split layer had a part off its home GPU; without them, a new
 * placement keeps every part on the home GPU.
 */
#include "cuda_ctx.h"

#include "moed_dtype.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Bytes of each GPU left free by a re-placement: what the driver may still take once serving
 * (graphs that later batches capture, peer mappings, the allocator's rounding), so a new placement
 * never leaves the running work short. */
#define REPLACE_RESERVE (512ull << 20)

static double gib(uint64_t b)
{
    return (double)b / 1073741824.0;
}

/* Free bytes of every entry's GPU now, by entry. */
static int gpu_free(const cuda_ctx *c, uint64_t *free_b, moed_error *err)
{
    for (int i = 0; i < c->n_dev; i++) {
        size_t f = 0, total = 0;
        cudaSetDevice(c->dev[i]);
        const cudaError_t e = cudaMemGetInfo(&f, &total);
        if (e != cudaSuccess) return cuda_fail(err, e, "cudaMemGetInfo");
        free_b[i] = f;
    }
    return 0;
}

/* Whether new part P holds the same experts in the same order on the same entry as old part O. */
static bool same_part(const cuda_split *neu, const cuda_part *P, const cuda_split *old,
                      const cuda_part *O, int *a, int *b)
{
    if (P->entry != O->entry || P->set.E != O->set.E) return false;
    moed_place_entry_experts(&neu->place, P->entry, a);
    moed_place_entry_experts(&old->place, O->entry, b);
    return !memcmp(a, b, sizeof *a * (size_t)P->set.E);
}

/* Where the old placement holds expert e for a copy to GPU `device`: its part (on that GPU if one
 * is) and its number there. */
static const cuda_part *source_of(const cuda_split *old, int e, int device, int *local, int *ids)
{
    const cuda_part *best = NULL;
    for (int i = 0; i < old->n; i++) {
        const cuda_part *O = &old->parts[i];
        const int n = moed_place_entry_experts(&old->place, O->entry, ids);
        for (int j = 0; j < n; j++)
            if (ids[j] == e && (!best || (best->device != device && O->device == device))) {
                best = O;
                *local = j;
            }
    }
    return best;
}

/* Queues on s the copy of `rows` rows of `width` bytes (strides dpitch and spitch; one row: 0)
 * from GPU sdev to GPU ddev: a device copy, or a peer copy between two GPUs. */
static cudaError_t copy_rows(void *dst, int ddev, size_t dpitch, const void *src, int sdev,
                             size_t spitch, size_t width, size_t rows, cudaStream_t s)
{
    if (ddev == sdev)
        return cudaMemcpy2DAsync(dst, dpitch ? dpitch : width, src, spitch ? spitch : width, width,
                                 rows, cudaMemcpyDeviceToDevice, s);
    if (rows == 1) return cudaMemcpyPeerAsync(dst, ddev, src, sdev, width, s);
    struct cudaMemcpy3DPeerParms p;
    memset(&p, 0, sizeof p);
    p.srcPtr = (struct cudaPitchedPtr){ (void *)src, spitch, width, rows };
    p.srcDevice = sdev;
    p.dstPtr = (struct cudaPitchedPtr){ dst, dpitch, width, rows };
    p.dstDevice = ddev;
    p.extent = (struct cudaExtent){ width, rows, 1 };
    return cudaMemcpy3DPeerAsync(&p, s);
}

/* Queues on s the copy of old part O's expert j into new part P's expert i: its matrices (a 2:4
 * set: kept values and metadata), and for FP8 its scales, columns of the sets' [K/128][E·N/32]
 * tables (cuda_weights.c). */
static cudaError_t copy_expert(const cuda_layer *L, const cuda_part *P, int i, const cuda_part *O,
                               int j, cudaStream_t s)
{
    const dev_set *d = &P->set, *o = &O->set;
    const int dp = L->k.d_pad;
    const int64_t up = (int64_t)d->n_up * dp, dn = (int64_t)dp * d->ff_pad;
    const bool fp8 = L->k.wdtype == MOED_FP8;
    const size_t up_b = d->sparse ? moed_cuda_cbytes(up / 2)
                        : fp8     ? (size_t)up
                                  : moed_cuda_cbytes(up),
                 dn_b = d->sparse ? moed_cuda_cbytes(dn / 2)
                        : fp8     ? (size_t)dn
                                  : moed_cuda_cbytes(dn);
    const int dd = P->device, sd = O->device;
    cudaError_t e = copy_rows((char *)d->w13 + up_b * i, dd, 0, (const char *)o->w13 + up_b * j, sd,
                              0, up_b, 1, s);
    if (e == cudaSuccess)
        e = copy_rows((char *)d->w2 + dn_b * i, dd, 0, (const char *)o->w2 + dn_b * j, sd, 0, dn_b,
                      1, s);
    if (e == cudaSuccess && d->sparse) {
        const size_t mu = 4 * MOED_CUDA_SP24_META_WORDS(up, 1),
                     md = 4 * MOED_CUDA_SP24_META_WORDS(dn, 1);
        e = copy_rows((char *)d->w13_meta + mu * i, dd, 0, (const char *)o->w13_meta + mu * j, sd,
                      0, mu, 1, s);
        if (e == cudaSuccess)
            e = copy_rows((char *)d->w2_meta + md * i, dd, 0, (const char *)o->w2_meta + md * j, sd,
                          0, md, 1, s);
    }
    if (e == cudaSuccess && fp8) {
        const size_t g_up = (size_t)d->n_up / MOED_CUDA_FP8_SROWS,
                     g_dn = (size_t)dp / MOED_CUDA_FP8_SROWS, f = sizeof(float);
        e = copy_rows(d->w13_scale + g_up * i, dd, f * g_up * d->E, o->w13_scale + g_up * j, sd,
                      f * g_up * o->E, f * g_up, (size_t)dp / MOED_CUDA_FP8_K, s);
        if (e == cudaSuccess)
            e = copy_rows(d->w2_scale + g_dn * i, dd, f * g_dn * d->E, o->w2_scale + g_dn * j, sd,
                          f * g_dn * o->E, f * g_dn, (size_t)d->ff_pad / MOED_CUDA_FP8_K, s);
    }
    return e;
}

/* Fills new part P (allocated) from the old parts, on a stream of its GPU, and waits for it. */
static int fill_part(const cuda_layer *L, const cuda_split *neu, cuda_part *P,
                     const cuda_split *old, int *ids, int *tmp, moed_error *err)
{
    cudaStream_t s = NULL;
    int rc = 0;
    cudaSetDevice(P->device);
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream creation");
    const int n = moed_place_entry_experts(&neu->place, P->entry, ids);
    for (int i = 0; i < n; i++) {
        int j = 0;
        const cuda_part *O = source_of(old, ids[i], P->device, &j, tmp);
        if (!O) {
            rc = moed_fail(err, MOED_EINTERNAL, "layer %d: expert %d is in no part to copy from",
                           L->info.index, ids[i]);
            goto err;
        }
        CU(copy_expert(L, P, i, O, j, s), "copying an expert's weights between parts");
    }
    CU(cudaStreamSynchronize(s), "copying an expert's weights between parts");
err:
    if (s) cudaStreamDestroy(s);
    return rc;
}

/* Whether the two placements are the same. */
static bool same_place(const moed_layer_place *a, const moed_layer_place *b)
{
    if (a->home != b->home || a->n_parts != b->n_parts || a->n_replicas != b->n_replicas)
        return false;
    for (int i = 0; i < a->n_parts; i++)
        if (a->part[i].dev != b->part[i].dev || a->part[i].first != b->part[i].first ||
            a->part[i].count != b->part[i].count)
            return false;
    for (int r = 0; r < a->n_replicas; r++)
        if (a->replica[r].expert != b->replica[r].expert || a->replica[r].dev != b->replica[r].dev)
            return false;
    return true;
}

/* The new placement for L by the request (cuda_replace's plan, at the top of this file). */
static int plan(const cuda_ctx *c, const cuda_layer *L, const moed_replace_req *req,
                const uint64_t *free_b, uint64_t expert_b, moed_layer_place *out,
                const moed_place_load *ld, moed_error *err)
{
    const int E = L->info.n_experts;
    moed_place_dev devs[MAX_DEVICES];
    for (int i = 0; i < c->n_dev; i++) {
        uint64_t held = 0;
        for (int q = 0; q < L->sp.n; q++)
            if (L->sp.parts[q].device == c->dev[i])
                held += expert_b * (uint64_t)L->sp.parts[q].set.E;
        const bool reach = c->landing || c->dev[i] == L->device;
        devs[i] = (moed_place_dev){
            .gpu = c->dev[i],
            .free =
                reach ? (free_b[i] > REPLACE_RESERVE ? free_b[i] - REPLACE_RESERVE : 0) + held : 0,
        };
    }
    double *cost = malloc(sizeof *cost * (size_t)E);
    if (!cost) return moed_fail(err, MOED_ENOMEM, "out of host memory");
    moed_place_costs(req->pairs, E, req->launches, STREAM_ROWS, cost);
    moed_place_need need = cuda_layer_need(L, 0, true, req->pairs, req->launches);
    need.base = 0; /* the router and shared experts stay where they are */
    need.load = cost;
    int rc = moed_place_recut(devs, c->n_dev, &need, L->sp.place.home, out, err);
    free(cost);
    if (rc) return rc;
    const int cap =
        req->max_replicas < MOED_PLACE_MAX_REPLICAS ? req->max_replicas : MOED_PLACE_MAX_REPLICAS;
    if (moed_place_replicate(out, devs, c->n_dev, expert_b, ld, cap) < 0)
        return moed_fail(err, MOED_ENOMEM, "out of host memory");
    return 0;
}

/* Builds the new parts' weights (those not kept from old parts, marked in kept), after checking
 * they fit beside the old on every GPU. */
static int build(const cuda_ctx *c, const cuda_layer *L, cuda_split *neu, const uint64_t *free_b,
                 uint64_t expert_b, bool *kept, bool *moved, moed_error *err)
{
    const int E = L->info.n_experts;
    int *a = malloc(sizeof *a * (size_t)E), *b = malloc(sizeof *b * (size_t)E), rc = 0;
    if (!a || !b) {
        free(a);
        free(b);
        return moed_fail(err, MOED_ENOMEM, "out of host memory");
    }
    uint64_t need[MAX_DEVICES] = { 0 }; /* by entry of each GPU's first entry */
    for (int q = 0; q < neu->n; q++) {
        cuda_part *P = &neu->parts[q];
        for (int o = 0; o < L->sp.n && !kept[q]; o++)
            if (!moved[o] && same_part(neu, P, &L->sp, &L->sp.parts[o], a, b)) {
                *P = L->sp.parts[o]; /* its weights and its kernels' view of them */
                kept[q] = moved[o] = true;
            }
        if (!kept[q]) need[cuda_dev_index(c, P->device)] += expert_b * (uint64_t)P->set.E;
    }
    char msg[320] = "";
    for (int i = 0; i < c->n_dev; i++) {
        const uint64_t room = free_b[i] > REPLACE_RESERVE ? free_b[i] - REPLACE_RESERVE : 0;
        if (need[i] > room && strlen(msg) < sizeof msg - 80)
            snprintf(msg + strlen(msg), sizeof msg - strlen(msg),
                     "%s%.2f GiB on GPU %d (%.2f GiB free)", *msg ? ", " : "", gib(need[i]),
                     c->dev[i], gib(free_b[i]));
    }
    if (*msg)
        rc = moed_fail(err, MOED_ENOMEM,
                       "layer %d: the new placement's parts need %s beside the old ones, keeping "
                       "%.2f GiB of each GPU in reserve; ask for fewer copies (max_replicas), or "
                       "free memory (fewer --streams, lower --max-batch-tokens)",
                       L->info.index, msg, gib(REPLACE_RESERVE));
    for (int q = 0; q < neu->n && !rc; q++) {
        if (kept[q]) continue;
        cudaSetDevice(neu->parts[q].device);
        rc = cuda_part_alloc(L, &neu->parts[q], err);
        if (!rc) rc = fill_part(L, neu, &neu->parts[q], &L->sp, a, b, err);
    }
    free(a);
    free(b);
    return rc;
}

int cuda_replace_layer(moed_backend *b, int slot, const moed_replace_req *req,
                       moed_replace_result *res, moed_error *err)
{
    cuda_ctx *c = b->ctx;
    if (slot < 0 || slot >= c->n_layers)
        return moed_fail(err, MOED_EINVAL, "no layer slot %d (%d loaded)", slot, c->n_layers);
    cuda_layer *L = &c->layers[slot];
    const int E = L->info.n_experts;
    if (!L->sp.parts)
        return moed_fail(err, MOED_EPRECOND,
                         "layer %d runs whole on GPU %d: only a split layer (--expert-parallel, or "
                         "one too large for a GPU) can be re-placed",
                         L->info.index, L->device);
    if (!req->pairs || req->max_replicas < 0 || !(req->min_gain >= 0) || !(req->launches >= 0))
        return moed_fail(err, MOED_EINVAL,
                         "re-placing layer %d needs each expert's pairs, launches >= 0, "
                         "max_replicas >= 0 and min_gain >= 0",
                         L->info.index);
    for (int e = 0; e < E; e++)
        if (!(req->pairs[e] >= 0) || !isfinite(req->pairs[e]))
            return moed_fail(err, MOED_EINVAL,
                             "re-placing layer %d: expert %d's pairs must be finite and >= 0",
                             L->info.index, e);
    const moed_place_need need = cuda_layer_need(L, 0, true, req->pairs, req->launches);
    const moed_place_load ld = { req->pairs, E, req->launches, STREAM_ROWS, need.home_work };
    uint64_t free_b[MAX_DEVICES];
    moed_layer_place np;
    int rc = gpu_free(c, free_b, err);
    if (!rc) rc = plan(c, L, req, free_b, need.expert, &np, &ld, err);
    if (rc) return rc;
    res->before = moed_place_peak(&L->sp.place, c->n_dev, &ld, NULL);
    res->after = moed_place_peak(&np, c->n_dev, &ld, NULL);
    if (same_place(&np, &L->sp.place) ||
        !(res->before - res->after >= req->min_gain * res->before) || res->after >= res->before)
        return 0;
    cuda_split neu = { .place = np };
    bool kept[MAX_DEVICES] = { false }, moved[MAX_DEVICES] = { false };
    rc = cuda_split_init(c, L, &neu, err);
    if (!rc) rc = build(c, L, &neu, free_b, need.expert, kept, moved, err);
    if (rc) {
        for (int q = 0; q < neu.n; q++)
            if (kept[q]) memset(&neu.parts[q].set, 0, sizeof neu.parts[q].set); /* the old's */
        cuda_split_free(&neu);
        return rc;
    }
    pthread_rwlock_wrlock(L->lock);
    cuda_split old = L->sp;
    L->sp = neu;
    pthread_rwlock_unlock(L->lock);
    for (int o = 0; o < old.n; o++)
        if (moved[o]) memset(&old.parts[o].set, 0, sizeof old.parts[o].set); /* now the new's */
    cuda_split_free(&old);
    res->changed = true;
    return 0;
}
