/*
 * moed_request — ForwardRequest validation: sizes, expectation, layer, tensors, routing, gating.
 *
 * Order matters for the person reading the status: the whole-message limit first (nothing else is
 * worth reading past it), then identity (request_id, what the caller expects of this daemon,
 * layer), then hidden (which fixes T), then the routing tensors, whose shapes are stated relative
 * to T and the layer, then the output's region.
 * Small tensors (ids, weights, logits) are copied out of the slices or their region into aligned
 * memory here; hidden is copied into a staging-pool buffer (or, when the pool is full, stays a span
 * until the worker copies it into staging memory), or read where its region has it.
 */
#include "request.h"

#include "moed_dtype.h"
#include "moed_synth.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void moed_served_layer_list(const moed_served *s, char *buf, size_t n)
{
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < s->n_layers && at + 1 < n; i++) {
        int a = s->layers[i]->info.index, b = a;
        /* Layers are held in increasing index order, so a run of consecutive ones is a range. */
        while (i + 1 < s->n_layers && s->layers[i + 1]->info.index == b + 1)
            b = s->layers[++i]->info.index;
        int w = a == b ? snprintf(buf + at, n - at, "%s%d", at ? "," : "", a)
                       : snprintf(buf + at, n - at, "%s%d-%d", at ? "," : "", a, b);
        if (w < 0) break;
        at += (size_t)w;
    }
}

int moed_served_held(const moed_served *s, int i, uint32_t *lo, uint32_t *hi, int cap)
{
    if (s->shards) return moed_shard_range_list(&s->shards[i], lo, hi, cap);
    if (cap > 0) {
        lo[0] = 0;
        hi[0] = (uint32_t)s->layers[i]->info.n_experts - 1;
    }
    return 1;
}

bool moed_served_adds_shared(const moed_served *s, int i)
{
    return !s->shards || s->shards[i].adds_shared;
}

/* proto3 strings must be UTF-8; a client library would refuse to build such a response. */
static int utf8_valid(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint8_t c = p[i];
        size_t len = c < 0x80             ? 1
                     : (c & 0xe0) == 0xc0 ? 2
                     : (c & 0xf0) == 0xe0 ? 3
                     : (c & 0xf8) == 0xf0 ? 4
                                          : 0;
        if (!len || i + len > n || (len == 2 && c < 0xc2) || (len == 4 && c > 0xf4)) return 0;
        for (size_t j = 1; j < len; j++)
            if ((p[i + j] & 0xc0) != 0x80) return 0;
        if (len == 3) {
            uint32_t cp = (uint32_t)(c & 0x0f) << 12 | (uint32_t)(p[i + 1] & 0x3f) << 6;
            if (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff)) return 0; /* overlong, surrogate */
        }
        if (len == 4) {
            uint32_t cp = (uint32_t)(c & 0x07) << 18 | (uint32_t)(p[i + 1] & 0x3f) << 12;
            if (cp < 0x10000 || cp > 0x10ffff) return 0;
        }
        i += len;
    }
    return 1;
}

static int check_request_id(const moed_wire_request *q, moed_work *w, moed_error *err)
{
    if (q->request_id.len > MOED_REQUEST_ID_MAX)
        return moed_fail(err, MOED_EINVAL, "request_id is %zu bytes; at most %d are allowed",
                         q->request_id.len, MOED_REQUEST_ID_MAX);
    moed_span_copy(&q->request_id, w->request_id);
    w->request_id_len = q->request_id.len;
    w->request_id[w->request_id_len] = 0;
    if (!utf8_valid((const uint8_t *)w->request_id, w->request_id_len))
        return moed_fail(err, MOED_EINVAL,
                         "request_id is not valid UTF-8 (proto3 strings must be)");
    return 0;
}

/* ---- what the caller expects ------------------------------------------------------------- */

/* The first `shown` of n ranges as "0-3,6", and how many more there are. */
static void ranges_text(const uint32_t *lo, const uint32_t *hi, uint32_t n, uint32_t shown,
                        char *buf, size_t size)
{
    size_t at = 0;
    buf[0] = 0;
    for (uint32_t i = 0; i < n && i < shown && at < size; i++)
        at += (size_t)(lo[i] == hi[i]
                           ? snprintf(buf + at, size - at, "%s%u", i ? "," : "", lo[i])
                           : snprintf(buf + at, size - at, "%s%u-%u", i ? "," : "", lo[i], hi[i]));
    if (n > shown && at < size) snprintf(buf + at, size - at, " and %u more ranges", n - shown);
}

/* The request's expect against what this daemon serves. Checked before the layer, so a daemon
 * that no longer serves the layer it was expected to hold says so in the same terms. */
static int check_expect(const moed_served *s, const moed_wire_request *q, moed_error *err)
{
    const moed_wire_expect *x = &q->expect;
    if (!x->present) return 0;
    int slot = -1;
    for (int i = 0; i < s->n_layers && slot < 0; i++)
        if ((uint32_t)s->layers[i]->info.index == q->layer) slot = i;
    const int n = slot < 0 ? 0 : moed_served_held(s, slot, NULL, NULL, 0);
    uint32_t *lo = malloc(sizeof *lo * (size_t)(2 * n + 1));
    if (!lo) return moed_fail(err, MOED_ENOMEM, "no memory to check the request's expect");
    uint32_t *hi = lo + n;
    if (slot >= 0) moed_served_held(s, slot, lo, hi, n);
    uint64_t hash = 0;
    for (int i = 0; i < n; i++) hash = moed_ranges_fold(hash, lo[i], hi[i]);
    /* the shared-experts role changes a reply only where the layer has shared experts */
    const bool shared = slot < 0 || s->layers[slot]->info.n_shared > 0;
    const bool adds = slot >= 0 && moed_served_adds_shared(s, slot);
    const bool model_ok = !x->model || x->model == s->fingerprint;
    const bool held_ok =
        !x->n_ranges || (slot >= 0 && (uint32_t)n == x->n_ranges && hash == x->ranges_hash &&
                         (adds == x->adds_shared || !shared));
    if (model_ok && held_ok) {
        free(lo);
        return 0;
    }
    char have[512], want[512], list[256], layers[256];
    ranges_text(lo, hi, (uint32_t)n, 16, list, sizeof list);
    free(lo);
    moed_served_layer_list(s, layers, sizeof layers);
    if (slot < 0)
        snprintf(have, sizeof have, "not layer %u (its layers are %s)", q->layer, layers);
    else
        snprintf(have, sizeof have, "experts %s of layer %u%s", list, q->layer,
                 !shared ? ""
                 : adds  ? ", adding the shared experts"
                         : ", not adding the shared experts");
    ranges_text(x->first, x->last, x->n_ranges, MOED_WIRE_SHOWN_RANGES, list, sizeof list);
    if (x->n_ranges)
        snprintf(want, sizeof want, "experts %s%s", list,
                 !shared          ? ""
                 : x->adds_shared ? ", adding the shared experts"
                                  : ", not adding the shared experts");
    else
        snprintf(want, sizeof want, "any experts");
    char want_model[40] = "any model";
    if (x->model)
        snprintf(want_model, sizeof want_model, "model %016llx", (unsigned long long)x->model);
    return moed_fail(err, MOED_EPRECOND,
                     "this daemon is not what the request expects: it serves model %016llx, %s; "
                     "the request expects %s, %s. It was restarted with other weights, --layers, "
                     "--experts or --shared-experts since the caller asked its GetModel: ask again",
                     (unsigned long long)s->fingerprint, have, want_model, want);
}

static int find_layer(const moed_served *s, uint32_t index, moed_sched_item *it, moed_error *err)
{
    for (int i = 0; i < s->n_layers; i++)
        if ((uint32_t)s->layers[i]->info.index == index) {
            it->slot = i;
            it->layer = s->layers[i];
            return 0;
        }
    char list[256];
    moed_served_layer_list(s, list, sizeof list);
    return moed_fail(
        err, MOED_ENOTFOUND,
        "layer %u is not served here; the resident layers are %s (GetModel lists them)", index,
        list);
}

/* "[5, 12]" for messages; "[]" with no dims, "..." past the dims the decoder kept. */
static void shape_str(const moed_wire_tensor *t, char *buf, size_t n)
{
    size_t at = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < t->n_shape && i < MOED_WIRE_MAX_DIMS && at < n; i++)
        at += (size_t)snprintf(buf + at, n - at, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (at < n) snprintf(buf + at, n - at, "%s]", t->n_shape > MOED_WIRE_MAX_DIMS ? ", ..." : "");
}

/* ---- regions ------------------------------------------------------------------------------- */

/* The region a reference names, held, if the caller may use regions at all. */
static moed_region *region_for(const moed_served *s, const moed_caller *c, uint64_t id,
                               const char *what, moed_error *err)
{
    int mode = moed_regions_mode(s->regions);
    if (mode == MOED_REGIONS_OFF) {
        moed_fail(err, MOED_EPRECOND,
                  "%s names region %llu, but this server has regions off (--regions off): send "
                  "the tensor inline",
                  what, (unsigned long long)id);
        return NULL;
    }
    if (mode == MOED_REGIONS_LOCAL && !c->local) {
        moed_fail(err, MOED_EPRECOND,
                  "%s names a region, but regions are for callers on the server's own host "
                  "(loopback or a unix socket; --regions local): send the tensor inline",
                  what);
        return NULL;
    }
    moed_principal who;
    moed_region *g =
        c->principal(c->ctx, &who, err) ? NULL : moed_regions_acquire(s->regions, who, id, err);
    if (!g) moed_error_prefix(err, "%s", what);
    return g;
}

/* The tensor's `need` bytes, in a region or inline (checked against need), copied into fresh
 * memory aligned for any element type. */
static void *tensor_copy(const moed_served *s, const moed_caller *c, const moed_wire_tensor *t,
                         const char *name, int dtype, uint64_t need, moed_error *err)
{
    /* A region's reference is checked first: need, which the shape says, is then bytes the
     * caller holds, not a size it only named. */
    moed_region *g = t->in_region ? region_for(s, c, t->region.region, name, err) : NULL;
    void *at = NULL, *p = NULL;
    int dev;
    int rc = t->in_region && !g ? err->code
             : g                ? moed_region_resolve(g, t->region.offset, t->region.length, need,
                                                      moed_dtype_size(dtype), name, &at, &dev, err)
                                : 0;
    if (!rc && !(p = malloc(need ? need : 1)))
        rc = moed_fail(err, MOED_ENOMEM, "no memory to copy %llu bytes of the request",
                       (unsigned long long)need);
    if (!rc && !g)
        moed_span_copy(&t->data, p);
    else if (!rc && (rc = moed_region_copy_in(s->regions, g, p, at, (size_t)need, err)))
        moed_error_prefix(err, "%s", name); /* as region_for names it when the region is broken */
    moed_region_release(s->regions, g);
    if (!rc) return p;
    free(p);
    return NULL;
}

/* A 2-d tensor of the given dtype whose data (inline) is exactly rows x cols elements; *need the
 * bytes it holds (a region reference is checked against it when resolved). want_rows and want_cols
 * of -1 accept any (>= 1) value; `hint` says what the tensor should be. */
static int check_matrix(const moed_wire_tensor *t, const char *name, int dtype, int64_t want_rows,
                        int64_t want_cols, const char *hint, uint64_t *need_out, moed_error *err)
{
    char shape[160];
    if (!t->present) return moed_fail(err, MOED_EINVAL, "%s is missing: send %s", name, hint);
    shape_str(t, shape, sizeof shape);
    if (t->dtype != dtype)
        return moed_fail(err, MOED_EINVAL, "%s has dtype %s (%d); it must be %s: send %s", name,
                         moed_dtype_name(t->dtype), (int)t->dtype, moed_dtype_name(dtype), hint);
    if (t->n_shape != 2 || t->shape[0] < 0 || t->shape[1] < 0)
        return moed_fail(err, MOED_EINVAL, "%s has shape %s; it must be %s", name, shape, hint);
    if (t->shape[1] == 0 || (want_rows >= 0 && t->shape[0] != want_rows) ||
        (want_cols >= 0 && t->shape[1] != want_cols))
        return moed_fail(err, MOED_EINVAL, "%s has shape %s; it must be %s", name, shape, hint);
    uint64_t need;
    if (__builtin_mul_overflow((uint64_t)t->shape[0], (uint64_t)t->shape[1], &need) ||
        __builtin_mul_overflow(need, (uint64_t)moed_dtype_size(dtype), &need))
        need = UINT64_MAX;
    *need_out = need;
    if (t->in_region) return 0;
    if (need != t->data.len)
        return moed_fail(err, MOED_EINVAL,
                         "%s has %zu data bytes, but shape %s of %s needs exactly %llu", name,
                         t->data.len, shape, moed_dtype_name(dtype), (unsigned long long)need);
    return 0;
}

static int check_hidden(const moed_served *s, const moed_caller *c, const moed_wire_request *q,
                        moed_work *w, moed_error *err)
{
    const moed_wire_tensor *h = &q->hidden;
    moed_sched_item *it = &w->item;
    const moed_layer_info *li = &it->layer->info;
    char shape[160];
    if (!h->present)
        return moed_fail(err, MOED_EINVAL,
                         "hidden is missing: send [T, %d] F32, F16 or BF16 for layer %d",
                         li->d_model, li->index);
    shape_str(h, shape, sizeof shape);
    if (!moed_dtype_is_float(h->dtype))
        return moed_fail(err, MOED_EINVAL, "hidden has dtype %s (%d); it must be F32, F16 or BF16",
                         moed_dtype_name(h->dtype), (int)h->dtype);
    if (h->n_shape != 2 || h->shape[1] != li->d_model || h->shape[0] < 0)
        return moed_fail(err, MOED_EINVAL,
                         "hidden has shape %s; layer %d needs [T, %d] (T tokens of d_model %d)",
                         shape, li->index, li->d_model, li->d_model);
    if (h->shape[0] == 0)
        return moed_fail(err, MOED_EINVAL, "hidden has T = 0 tokens; send at least one");
    if (h->shape[0] > s->max_batch_tokens)
        return moed_fail(err, MOED_ETOOBIG,
                         "hidden has T = %lld tokens, over this server's --max-batch-tokens = "
                         "%lld: split the request or raise the flag",
                         (long long)h->shape[0], (long long)s->max_batch_tokens);
    it->dtype = h->dtype;
    it->T = h->shape[0];
    uint64_t need = (uint64_t)it->T * (uint64_t)li->d_model * moed_dtype_size(it->dtype);
    if (h->in_region) {
        int dev;
        void *at;
        if (!(w->hidden_region = region_for(s, c, h->region.region, "hidden", err)))
            return err->code;
        int rc = moed_region_resolve(w->hidden_region, h->region.offset, h->region.length, need,
                                     moed_dtype_size(it->dtype), "hidden", &at, &dev, err);
        if (rc) return rc;
        w->hidden_at = at;
        if (moed_region_direct(s->regions, w->hidden_region))
            it->mem = (moed_part){ .x = at, .x_dev = dev };
        return 0;
    }
    if (h->data.len != need)
        return moed_fail(err, MOED_EINVAL,
                         "hidden has %zu data bytes, but shape %s of %s needs exactly %llu",
                         h->data.len, shape, moed_dtype_name(it->dtype), (unsigned long long)need);
    w->hidden = h->data;
    return 0;
}

/* The output may be hidden's own bytes: every path writes a row only after reading it (the
 * CUDA backend's chunks copy a chunk's rows in before its outputs go out). A partial overlap would
 * let a chunk's outputs land on rows a later chunk has yet to read, so it is refused. Both
 * references are bounds-checked already (no overflow). */
static int check_overlap(const moed_work *w, const moed_wire_ref *in, const moed_wire_ref *out,
                         moed_error *err)
{
    if (w->hidden_region != w->out_region || in->offset >= out->offset + out->length ||
        out->offset >= in->offset + in->length || in->offset == out->offset)
        return 0;
    return moed_fail(err, MOED_EINVAL,
                     "output (offset %llu) overlaps hidden (offset %llu, %llu bytes) in region "
                     "%llu without being the same bytes: name hidden's own offset to compute in "
                     "place, or bytes apart from it",
                     (unsigned long long)out->offset, (unsigned long long)in->offset,
                     (unsigned long long)in->length, (unsigned long long)out->region);
}

/* Where the output goes: the region the request names, held and bounds-checked. */
static int check_output(const moed_served *s, const moed_caller *c, const moed_wire_request *q,
                        moed_work *w, moed_error *err)
{
    moed_sched_item *it = &w->item;
    if (!q->has_output) return 0;
    const uint64_t need =
        (uint64_t)it->T * (uint64_t)it->layer->info.d_model * moed_dtype_size(it->dtype);
    int dev;
    if (!(w->out_region = region_for(s, c, q->output.region, "output", err))) return err->code;
    int rc = moed_region_resolve(w->out_region, q->output.offset, q->output.length, need,
                                 moed_dtype_size(it->dtype), "output", &w->out_at, &dev, err);
    if (rc || (rc = check_overlap(w, &q->hidden.region, &q->output, err))) return rc;
    w->out_ref = q->output;
    if (moed_region_direct(s->regions, w->out_region)) {
        it->mem.y = w->out_at;
        it->mem.y_dev = dev;
    }
    return 0;
}

/* Inline hidden rows go into a staging-pool buffer now (the one copy in), with room behind them
 * for the output unless it goes to a region; the backend then reads and writes the buffer itself.
 * Without room in the pool nothing changes: the worker copies the rows, and the reply the output.
 */
static void take_buffer(const moed_served *s, moed_work *w)
{
    moed_sched_item *it = &w->item;
    const size_t rows =
        (size_t)it->T * (size_t)it->layer->info.d_model * moed_dtype_size(it->dtype);
    const bool in = !w->hidden_region, out = !w->out_region;
    if (!s->pool || !(w->buf = moed_bufpool_get(s->pool, (in + out) * rows))) return;
    if (in) {
        moed_span_copy(&w->hidden, w->buf);
        it->mem.x = w->buf;
        it->mem.x_dev = MOED_HOST_MEM;
    }
    if (out) {
        it->mem.y = (char *)w->buf + (in ? rows : 0);
        it->mem.y_dev = MOED_HOST_MEM;
    }
}

static int too_many_pairs(int64_t pairs, int64_t limit, const char *how, moed_error *err)
{
    return moed_fail(err, MOED_ETOOBIG,
                     "the request routes %lld (token, expert) pairs%s, over this server's "
                     "--max-batch-pairs = %lld: split it (fewer tokens, or fewer experts per "
                     "token) or raise the flag",
                     (long long)pairs, how, (long long)limit);
}

/* --max-batch-pairs, INT64_MAX when there is none. */
static int64_t pair_limit(const moed_served *s)
{
    return s->max_batch_pairs > 0 ? s->max_batch_pairs : INT64_MAX;
}

/* Sigmoid and sparsemax keep a varying number of experts per token, up to every one. */
static bool gate_varies(const moed_gate_params *g)
{
    return g->strategy == MOED_GATE_SIGMOID || g->strategy == MOED_GATE_SPARSEMAX;
}

/* The pairs the item adds to a launch: exact when its route is known here; otherwise (server
 * routing) the most its gating can give, and the worker checks the route it makes. */
static int count_pairs(const moed_served *s, moed_sched_item *it, moed_error *err)
{
    const moed_layer_info *li = &it->layer->info;
    if (it->mem.route) {
        it->pairs = it->T * it->mem.route->k;
        return it->pairs > pair_limit(s)
                   ? too_many_pairs(it->pairs, pair_limit(s),
                                    " (T x k: on the GPU every column counts)", err)
                   : 0;
    }
    if (it->route.off) {
        it->pairs = it->route.off[it->T];
        return it->pairs > pair_limit(s) ? too_many_pairs(it->pairs, pair_limit(s), "", err) : 0;
    }
    bool exact = it->k_batch || !gate_varies(&it->gate);
    it->pairs = it->T * (it->k_batch ? it->k_batch : exact ? it->gate.top_k : li->n_experts);
    if (exact && it->pairs > pair_limit(s))
        return too_many_pairs(it->pairs, pair_limit(s),
                              it->k_batch ? " (T x k_batch)" : " (T x top_k)", err);
    return 0;
}

/* Expert choices whose ids and weights both lie in CUDA regions of one GPU stay there (request.h),
 * when each token's k columns fit the backend's workspace (k <= the layer's experts: a longer row
 * is padding or repeats, and is read to the host instead). *taken says whether they did; when not,
 * nothing is held and the caller copies them. Each token counts k pairs, padding included. */
static int choice_on_device(const moed_served *s, const moed_caller *c, const moed_wire_request *q,
                            moed_work *w, int64_t k, uint64_t n_ids, uint64_t n_wt, bool *taken,
                            moed_error *err)
{
    moed_sched_item *it = &w->item;
    const moed_wire_ref *ri = &q->expert_ids.region, *rw = &q->expert_weights.region;
    void *ids, *wt;
    int dev_i, dev_w;
    *taken = false;
    if (!q->expert_ids.in_region || !q->expert_weights.in_region || k > it->layer->info.n_experts)
        return 0;
    if (!(w->ids_region = region_for(s, c, ri->region, "experts.expert_ids", err)) ||
        !(w->weights_region = region_for(s, c, rw->region, "experts.expert_weights", err)))
        return err->code;
    int rc = moed_region_resolve(w->ids_region, ri->offset, ri->length, n_ids, 4,
                                 "experts.expert_ids", &ids, &dev_i, err);
    if (!rc)
        rc = moed_region_resolve(w->weights_region, rw->offset, rw->length, n_wt, 4,
                                 "experts.expert_weights", &wt, &dev_w, err);
    if (rc) return rc;
    if (dev_i == MOED_HOST_MEM || dev_i != dev_w) {
        moed_region_release(s->regions, w->ids_region);
        moed_region_release(s->regions, w->weights_region);
        w->ids_region = w->weights_region = NULL;
        return 0;
    }
    if (moed_route_init(&it->route, it->T, 0))
        return moed_fail(err, MOED_ENOMEM, "no memory for a route of %lld tokens",
                         (long long)it->T);
    w->route = (moed_part_route){ .ids = ids, .weights = wt, .k = (int)k, .dev = dev_i };
    it->mem.route = &w->route;
    *taken = true;
    return 0;
}

static int route_from_choice(const moed_served *s, const moed_caller *c, const moed_wire_request *q,
                             moed_work *w, moed_error *err)
{
    moed_sched_item *it = &w->item;
    const moed_layer_info *li = &it->layer->info;
    char hint[160];
    uint64_t n_ids = 0, n_wt = 0; /* set by check_matrix before use; gcc -O2 cannot see it */
    snprintf(hint, sizeof hint, "[T = %lld, k] I32 expert ids, k >= 1", (long long)it->T);
    int rc =
        check_matrix(&q->expert_ids, "experts.expert_ids", MOED_I32, it->T, -1, hint, &n_ids, err);
    if (rc) return rc;
    int64_t k = q->expert_ids.shape[1];
    snprintf(hint, sizeof hint, "[T = %lld, k = %lld] F32 weights, like expert_ids",
             (long long)it->T, (long long)k);
    bool on_device;
    if ((rc = check_matrix(&q->expert_weights, "experts.expert_weights", MOED_F32, it->T, k, hint,
                           &n_wt, err)) ||
        (rc = choice_on_device(s, c, q, w, k, n_ids, n_wt, &on_device, err)) || on_device)
        return rc;
    int32_t *ids = tensor_copy(s, c, &q->expert_ids, "experts.expert_ids", MOED_I32, n_ids, err);
    if (!ids) return err->code;
    int64_t pairs = 0; /* counted before the route is built: a huge k must not allocate first */
    for (int64_t i = 0; i < it->T * k; i++) pairs += ids[i] != -1;
    float *wt = NULL;
    if (pairs > pair_limit(s))
        rc = too_many_pairs(pairs, pair_limit(s), "", err);
    else if (!(wt = tensor_copy(s, c, &q->expert_weights, "experts.expert_weights", MOED_F32, n_wt,
                                err)))
        rc = err->code;
    else
        rc = moed_route_from_choice(&it->route, ids, wt, it->T, (int)k, li->n_experts, err);
    free(ids);
    free(wt);
    return rc;
}

static int resolve_gating(const moed_wire_gating *g, moed_sched_item *it, moed_error *err)
{
    it->gate = (moed_gate_params){
        .strategy = g->strategy,
        .top_k = g->top_k,
        .renormalize = g->renormalize,
        .threshold = g->threshold,
    };
    if (g->renormalize < MOED_RENORM_DEFAULT || g->renormalize > MOED_RENORM_OFF)
        return moed_fail(err, MOED_EINVAL,
                         "gating.renormalize = %d is unknown: use 0 (the layer's default), 1 (on) "
                         "or 2 (off)",
                         (int)g->renormalize);
    int rc = moed_gate_resolve(&it->gate, &it->layer->info, err);
    if (rc) moed_error_prefix(err, "gating");
    return rc;
}

static int resolve_k_batch(const moed_wire_request *q, moed_sched_item *it, moed_error *err)
{
    const moed_layer_info *li = &it->layer->info;
    int64_t k = q->k_batch ? (int64_t)q->k_batch : li->top_k;
    if (k < 1 || k > li->n_experts)
        return moed_fail(err, MOED_EINVAL,
                         "batch_gating.k_batch = %u is out of range: layer %d has %d experts, so "
                         "give 1..%d (0 means its top_k, %d)",
                         q->k_batch, li->index, li->n_experts, li->n_experts, li->top_k);
    it->k_batch = (int)k;
    return 0;
}

/* By position only: no message reads a tensor's values back (moed_route.h). */
static int check_finite_rows(const float *l, int64_t T, int E, moed_error *err)
{
    for (int64_t i = 0; i < T * E; i++)
        if (!isfinite(l[i]))
            return moed_fail(err, MOED_EINVAL,
                             "logits[%lld][%lld] is not finite: router logits must be finite",
                             (long long)(i / E), (long long)(i % E));
    return 0;
}

static int route_from_logits(const moed_served *s, const moed_caller *c, const moed_wire_request *q,
                             moed_sched_item *it, moed_error *err)
{
    const moed_layer_info *li = &it->layer->info;
    char hint[160];
    uint64_t need;
    snprintf(hint, sizeof hint, "[T = %lld, num_experts = %d] F32 router logits", (long long)it->T,
             li->n_experts);
    int rc =
        check_matrix(&q->logits, "logits.logits", MOED_F32, it->T, li->n_experts, hint, &need, err);
    if (rc) return rc;
    float *l = tensor_copy(s, c, &q->logits, "logits.logits", MOED_F32, need, err);
    if (!l) return err->code;
    if (q->batch_gating) {
        /* Checked now: one caller's NaN must not poison the scores of a merged batch. */
        if ((rc = check_finite_rows(l, it->T, li->n_experts, err))) goto out;
        it->logits = l;
        return 0;
    }
    if (!(rc = resolve_gating(&q->gating, it, err)))
        rc = moed_gate(&it->gate, li, it->layer->router_bias, l, it->T, &it->route, err);
out:
    free(l);
    return rc;
}

/* Batch gating picks one expert set over the merged batch, which differs between the shards of a
 * fleet, so only a daemon holding every expert of the layer may do it. */
static int check_batch_gating(const moed_served *s, const moed_sched_item *it, moed_error *err)
{
    const moed_shard *sh = s->shards ? &s->shards[it->slot] : NULL;
    if (!sh || moed_shard_all_experts(sh)) return 0;
    char held[256];
    moed_shard_ranges(sh, held, sizeof held);
    return moed_fail(err, MOED_EPRECOND,
                     "batch_gating: this daemon holds experts %s of layer %d's %d (--experts); "
                     "the batch's expert set is chosen over a merged batch, which differs from one "
                     "expert shard to another, so only a daemon holding every expert can gate "
                     "batches: send it to one, or gate per token",
                     held, it->layer->info.index, it->layer->info.n_experts);
}

static int check_routing(const moed_served *s, const moed_caller *c, const moed_wire_request *q,
                         moed_work *w, moed_error *err)
{
    moed_sched_item *it = &w->item;
    const moed_layer_info *li = &it->layer->info;
    if (q->batch_gating) {
        int rc = resolve_k_batch(q, it, err);
        if (!rc && q->routing != MOED_ROUTING_EXPERTS) rc = check_batch_gating(s, it, err);
        if (rc) return rc;
    }
    switch (q->routing) {
    case MOED_ROUTING_EXPERTS:
        if (q->batch_gating)
            return moed_fail(err, MOED_EINVAL,
                             "batch_gating needs router logits (logits or server_router); it "
                             "cannot be combined with experts, which already fix the route");
        return route_from_choice(s, c, q, w, err);
    case MOED_ROUTING_LOGITS:
        return route_from_logits(s, c, q, it, err);
    case MOED_ROUTING_SERVER:
        if (!li->has_router || !it->layer->router)
            return moed_fail(err, MOED_EINVAL,
                             "server_router: layer %d has no router weights loaded (has_router is "
                             "false in GetModel); send experts or logits instead",
                             li->index);
        it->server_logits = true;
        return q->batch_gating ? 0 : resolve_gating(&q->gating, it, err);
    }
    return moed_fail(err, MOED_EINVAL,
                     "no routing: set experts (expert_ids and expert_weights), logits (router "
                     "logits and a gating strategy) or server_router");
}

/* The item's copy_in, when the backend cannot read hidden where it is: the one copy, from the
 * message's slices or (guarded) from its region, into the staging. */
static int copy_hidden(moed_sched_item *it, void *dst, moed_error *err)
{
    moed_work *w = moed_container_of(it, moed_work, item);
    if (w->hidden_region)
        return moed_region_copy_in(
            w->regions, w->hidden_region, dst, w->hidden_at,
            (size_t)it->T * (size_t)it->layer->info.d_model * moed_dtype_size(it->dtype), err);
    moed_span_copy(&w->hidden, dst);
    return 0;
}

int moed_request_validate(const moed_served *s, const moed_caller *c, const moed_wire_request *q,
                          moed_work *w, moed_error *err)
{
    memset(w, 0, sizeof *w);
    w->regions = s->regions;
    if ((int64_t)q->bytes > s->max_message_bytes)
        return moed_fail(err, MOED_ETOOBIG,
                         "the request is %zu bytes, over this server's limit of %lld "
                         "(--max-message-bytes): send fewer tokens per call or raise the flag",
                         q->bytes, (long long)s->max_message_bytes);
    int rc;
    w->item.copy_in = copy_hidden;
    if ((rc = check_request_id(q, w, err)) || (rc = check_expect(s, q, err)) ||
        (rc = find_layer(s, q->layer, &w->item, err)) || (rc = check_hidden(s, c, q, w, err)) ||
        (rc = check_routing(s, c, q, w, err)) || (rc = count_pairs(s, &w->item, err)) ||
        (rc = check_output(s, c, q, w, err)))
        return rc;
    take_buffer(s, w);
    return 0;
}

/* A tensor of a ring descriptor: [rows, cols] of dtype in the region `r` names. */
static void ring_tensor(moed_wire_tensor *t, uint32_t dtype, int64_t rows, int64_t cols,
                        const moed_ring_ref *r)
{
    *t = (moed_wire_tensor){ .present = true,
                             .dtype = (int32_t)dtype,
                             .n_shape = 2,
                             .shape = { rows, cols },
                             .in_region = true,
                             .region = { r->region, r->offset, r->length } };
}

int moed_request_from_ring(const moed_served *s, const moed_ring_request *d, moed_wire_request *q,
                           moed_error *err)
{
    memset(q, 0, sizeof *q);
    if (d->flags)
        return moed_fail(err, MOED_EINVAL,
                         "flags = 0x%x: no flag is defined in ring layout version %d; write 0",
                         d->flags, MOED_RING_VERSION);
    if (d->reserved)
        return moed_fail(err, MOED_EINVAL, "the reserved word at +28 is %u; write 0", d->reserved);
    /* hidden's width is the layer's own: the descriptor names none (an unknown layer fails first)
     */
    int64_t d_model = 0;
    for (int i = 0; i < s->n_layers; i++)
        if ((uint32_t)s->layers[i]->info.index == d->layer) d_model = s->layers[i]->info.d_model;
    q->layer = d->layer;
    ring_tensor(&q->hidden, d->dtype, d->tokens, d_model, &d->hidden);
    q->routing = MOED_ROUTING_EXPERTS;
    ring_tensor(&q->expert_ids, MOED_I32, d->tokens, d->top_k, &d->expert_ids);
    ring_tensor(&q->expert_weights, MOED_F32, d->tokens, d->top_k, &d->expert_weights);
    q->has_output = true;
    q->output = (moed_wire_ref){ d->output.region, d->output.offset, d->output.length };
    return 0;
}

int moed_work_output(moed_work *w, const void *y, size_t y_bytes, grpc_slice *data,
                     const moed_wire_ref **ref, moed_error *err)
{
    *ref = NULL;
    *data = grpc_empty_slice();
    if (w->out_region) {
        *ref = &w->out_ref;
        return y == w->out_at
                   ? 0
                   : moed_region_copy_out(w->regions, w->out_region, w->out_at, y, y_bytes, err);
    }
    if (w->buf && y == w->item.mem.y) { /* the backend wrote the reply's bytes in place */
        *data = grpc_slice_new_with_user_data((void *)y, y_bytes, moed_bufpool_put, w->buf);
        w->buf = NULL;
        return 0;
    }
    *data = grpc_slice_malloc(y_bytes);
    memcpy(GRPC_SLICE_START_PTR(*data), y, y_bytes);
    return 0;
}

void moed_work_free(moed_work *w)
{
    moed_route_free(&w->item.route);
    free(w->item.logits);
    w->item.logits = NULL;
    moed_region_release(w->regions, w->hidden_region);
    moed_region_release(w->regions, w->out_region);
    moed_region_release(w->regions, w->ids_region);
    moed_region_release(w->regions, w->weights_region);
    w->hidden_region = w->out_region = w->ids_region = w->weights_region = NULL;
    w->item.mem.route = NULL;
    moed_bufpool_put(w->buf);
    w->buf = NULL;
}
