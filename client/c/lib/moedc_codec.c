/*
 * moedc_codec — encoding the client's requests and decoding the server's replies.
 *
 * protobuf-c packs everything except the hidden tensor's bytes: packing them would copy the
 * largest buffer of the request once more on its way to the socket. Their field header is written
 * by hand instead (a Tensor's dtype, packed shape and the data's length prefix: a few varints), so
 * the caller's buffer itself becomes the message body. Replies are decoded with protobuf-c and
 * checked against what was asked, so a caller never reads past a buffer a confused server sized.
 */
#include "moedc_codec.h"
#include "moedc_common.h"
#include "moed_dtype.h"
#include "moed_link.h"

#include <grpc/health/v1/health.pb-c.h>
#include <moed/v1/moed.pb-c.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libmoedclient sends tensors as they lie in memory, which the wire defines as little-endian"
#endif

/* The largest tensor this client will describe: far above any server limit, far below overflow. */
#define MOEDC_MAX_TENSOR_BYTES ((uint64_t)1 << 46)

static size_t varint_len(uint64_t v)
{
    size_t n = 1;
    for (; v >= 0x80; v >>= 7) n++;
    return n;
}

static uint8_t *put_varint(uint8_t *p, uint64_t v)
{
    for (; v >= 0x80; v >>= 7) *p++ = (uint8_t)(v | 0x80);
    *p++ = (uint8_t)v;
    return p;
}

static int pack(const ProtobufCMessage *m, uint8_t **buf, size_t *n, moedc_error *err)
{
    size_t len = protobuf_c_message_get_packed_size(m);
    uint8_t *b = malloc(len ? len : 1);
    if (!b) return moedc_fail(err, MOEDC_ENOMEM, "out of memory packing a %zu-byte message", len);
    protobuf_c_message_pack(m, b);
    *buf = b;
    *n = len;
    return 0;
}

/* Checks that a [rows, cols] matrix of elem-byte elements can be described and is there. */
static int check_matrix(const char *name, const void *p, int64_t rows, int64_t cols, size_t elem,
                        moedc_error *err)
{
    if (rows < 0 || cols < 0)
        return moedc_fail(err, MOEDC_EINVAL, "%s has shape [%lld, %lld]: sizes cannot be negative",
                          name, (long long)rows, (long long)cols);
    if (cols && (uint64_t)rows > MOEDC_MAX_TENSOR_BYTES / elem / (uint64_t)cols)
        return moedc_fail(err, MOEDC_ETOOBIG, "%s of shape [%lld, %lld] is too large to send", name,
                          (long long)rows, (long long)cols);
    if (!p && rows && cols)
        return moedc_fail(err, MOEDC_EINVAL, "%s is NULL but its shape is [%lld, %lld]", name,
                          (long long)rows, (long long)cols);
    return 0;
}

/* Where a tensor's bytes are, for the check that they are anywhere: inline, or in a region. */
static const void *where(const void *inline_data, const moedc_ref *at)
{
    return at->region ? (const void *)at->region : inline_data;
}

static int check_request(const moedc_request *req, moedc_error *err)
{
    if (!moed_dtype_is_float(req->dtype))
        return moedc_fail(
            err, MOEDC_EINVAL,
            "request dtype %d (%s) is not one moed computes in: use MOEDC_F32, MOEDC_F16 "
            "or MOEDC_BF16",
            req->dtype, moed_dtype_name(req->dtype));
    int rc = check_matrix("hidden", where(req->hidden, &req->hidden_at), req->tokens, req->d_model,
                          moed_dtype_size(req->dtype), err);
    if (rc) return rc;
    switch (req->routing) {
    case MOEDC_ROUTE_EXPERTS:
        rc = check_matrix("expert_ids", where(req->expert_ids, &req->expert_ids_at), req->tokens,
                          req->k, 4, err);
        return rc ? rc
                  : check_matrix("expert_weights",
                                 where(req->expert_weights, &req->expert_weights_at), req->tokens,
                                 req->k, 4, err);
    case MOEDC_ROUTE_LOGITS:
        return check_matrix("logits", where(req->logits, &req->logits_at), req->tokens,
                            req->n_experts, 4, err);
    case MOEDC_ROUTE_SERVER:
        return 0;
    }
    return moedc_fail(err, MOEDC_EINVAL,
                      "request routing %d is not MOEDC_ROUTE_EXPERTS, MOEDC_ROUTE_LOGITS or "
                      "MOEDC_ROUTE_SERVER",
                      req->routing);
}

/* A reference to a tensor of `bytes` at `at` (whose region is set). */
static void ref_to(Moed__V1__RegionRef *r, const moedc_ref *at, uint64_t bytes)
{
    moed__v1__region_ref__init(r);
    r->region = at->region->id;
    r->offset = at->offset;
    r->length = bytes;
}

/* A protobuf-c Tensor over caller memory (packing only reads it), or naming its region: then r
 * holds the reference. */
static void tensor_over(Moed__V1__Tensor *t, int64_t shape[2], int dtype, int64_t rows,
                        int64_t cols, const void *data, size_t elem, const moedc_ref *at,
                        Moed__V1__RegionRef *r)
{
    moed__v1__tensor__init(t);
    shape[0] = rows;
    shape[1] = cols;
    t->dtype = (Moed__V1__DType)dtype;
    t->n_shape = 2;
    t->shape = shape;
    if (at->region) {
        ref_to(r, at, (uint64_t)(rows * cols) * elem);
        t->region = r;
        t->contents_case = MOED__V1__TENSOR__CONTENTS_REGION;
        return;
    }
    t->data.len = (size_t)(rows * cols) * elem;
    t->data.data = (uint8_t *)data;
    t->contents_case = MOED__V1__TENSOR__CONTENTS_DATA;
}

/* request_id, layer, then the hidden Tensor up to its data bytes (all of it, when it names a
 * region: then there is no body). */
static int encode_head(const moedc_request *req, uint64_t body_len, moedc_wire *w, moedc_error *err)
{
    Moed__V1__ForwardRequest m = MOED__V1__FORWARD_REQUEST__INIT;
    m.request_id = (char *)(req->request_id ? req->request_id : "");
    m.layer = req->layer;
    if (req->hidden_at.region) {
        Moed__V1__Tensor t;
        Moed__V1__RegionRef r;
        int64_t shape[2];
        tensor_over(&t, shape, req->dtype, req->tokens, req->d_model, NULL,
                    moed_dtype_size(req->dtype), &req->hidden_at, &r);
        m.hidden = &t;
        return pack(&m.base, &w->head, &w->head_len, err);
    }
    size_t fields_len = protobuf_c_message_get_packed_size(&m.base);
    uint64_t T = (uint64_t)req->tokens, d = (uint64_t)req->d_model;
    size_t shape_len = varint_len(T) + varint_len(d);
    size_t inner_len = 1 + varint_len((uint64_t)req->dtype) + 1 + varint_len(shape_len) +
                       shape_len + 1 + varint_len(body_len);
    uint64_t tensor_len = inner_len + body_len;
    w->head_len = fields_len + 1 + varint_len(tensor_len) + inner_len;
    w->head = malloc(w->head_len);
    if (!w->head) return moedc_fail(err, MOEDC_ENOMEM, "out of memory encoding a request");
    uint8_t *p = w->head + protobuf_c_message_pack(&m.base, w->head);
    *p++ = 3 << 3 | 2; /* ForwardRequest.hidden, length-delimited */
    p = put_varint(p, tensor_len);
    *p++ = 1 << 3 | 0; /* Tensor.dtype, varint */
    p = put_varint(p, (uint64_t)req->dtype);
    *p++ = 2 << 3 | 2; /* Tensor.shape, packed */
    p = put_varint(p, shape_len);
    p = put_varint(p, T);
    p = put_varint(p, d);
    *p++ = 3 << 3 | 2; /* Tensor.data */
    put_varint(p, body_len);
    return 0;
}

/* The routing oneof, batch_gating, output and expect: a ForwardRequest holding only those. */
static int encode_tail(const moedc_request *req, const moedc_expect *expect, moedc_wire *w,
                       moedc_error *err)
{
    Moed__V1__ForwardRequest m = MOED__V1__FORWARD_REQUEST__INIT;
    Moed__V1__ExpertChoice experts = MOED__V1__EXPERT_CHOICE__INIT;
    Moed__V1__RouterLogits logits = MOED__V1__ROUTER_LOGITS__INIT;
    Moed__V1__ServerRouter server = MOED__V1__SERVER_ROUTER__INIT;
    Moed__V1__Gating gating = MOED__V1__GATING__INIT;
    Moed__V1__BatchGating batch = MOED__V1__BATCH_GATING__INIT;
    Moed__V1__Tensor t1, t2;
    Moed__V1__RegionRef r1, r2, out;
    int64_t s1[2], s2[2];

    gating.strategy = (Moed__V1__Strategy)req->gating.strategy;
    gating.top_k = (uint32_t)req->gating.top_k;
    gating.renormalize = (Moed__V1__Renormalize)req->gating.renormalize;
    gating.threshold = req->gating.threshold;
    switch (req->routing) {
    case MOEDC_ROUTE_EXPERTS:
        tensor_over(&t1, s1, MOED_I32, req->tokens, req->k, req->expert_ids, 4, &req->expert_ids_at,
                    &r1);
        tensor_over(&t2, s2, MOED_F32, req->tokens, req->k, req->expert_weights, 4,
                    &req->expert_weights_at, &r2);
        experts.expert_ids = &t1;
        experts.expert_weights = &t2;
        m.routing_case = MOED__V1__FORWARD_REQUEST__ROUTING_EXPERTS;
        m.experts = &experts;
        break;
    case MOEDC_ROUTE_LOGITS:
        tensor_over(&t1, s1, MOED_F32, req->tokens, req->n_experts, req->logits, 4, &req->logits_at,
                    &r1);
        logits.logits = &t1;
        logits.gating = &gating;
        m.routing_case = MOED__V1__FORWARD_REQUEST__ROUTING_LOGITS;
        m.logits = &logits;
        break;
    default:
        server.gating = &gating;
        m.routing_case = MOED__V1__FORWARD_REQUEST__ROUTING_SERVER_ROUTER;
        m.server_router = &server;
    }
    if (req->batch_gating) {
        batch.k_batch = req->k_batch;
        m.batch_gating = &batch;
    }
    if (req->output_at.region) {
        ref_to(&out, &req->output_at,
               (uint64_t)(req->tokens * req->d_model) * moed_dtype_size(req->dtype));
        m.output = &out;
    }
    if (!expect) return pack(&m.base, &w->tail, &w->tail_len, err);
    Moed__V1__Expectation x = MOED__V1__EXPECTATION__INIT;
    Moed__V1__ExpertRange *r = calloc((size_t)expect->n_held + 1, sizeof *r);
    Moed__V1__ExpertRange **rp = calloc((size_t)expect->n_held + 1, sizeof *rp);
    int rc = r && rp ? 0 : moedc_fail(err, MOEDC_ENOMEM, "out of memory encoding a request");
    for (int i = 0; !rc && i < expect->n_held; i++) {
        moed__v1__expert_range__init(&r[i]);
        r[i].first = (uint32_t)expect->held[i].first;
        r[i].last = (uint32_t)expect->held[i].last;
        rp[i] = &r[i];
    }
    x.model_fingerprint = expect->fingerprint;
    x.n_experts_held = (size_t)expect->n_held;
    x.experts_held = rp;
    x.adds_shared_experts = expect->adds_shared;
    m.expect = &x;
    if (!rc) rc = pack(&m.base, &w->tail, &w->tail_len, err);
    free(r);
    free(rp);
    return rc;
}

int moedc_encode_forward(const moedc_request *req, const moedc_expect *expect, moedc_wire *out,
                         moedc_error *err)
{
    memset(out, 0, sizeof *out);
    if (!req) return moedc_fail(err, MOEDC_EINVAL, "no request given");
    int rc = check_request(req, err);
    if (rc) return rc;
    out->body = req->hidden_at.region ? NULL : req->hidden;
    out->body_len = req->hidden_at.region
                        ? 0
                        : (size_t)(req->tokens * req->d_model) * moed_dtype_size(req->dtype);
    rc = encode_head(req, out->body_len, out, err);
    if (!rc) rc = encode_tail(req, expect, out, err);
    if (rc) moedc_wire_free(out);
    return rc;
}

void moedc_wire_free(moedc_wire *w)
{
    free(w->head);
    free(w->tail);
    memset(w, 0, sizeof *w);
}

static int check_output(const Moed__V1__ForwardResponse *r, int dtype, int64_t tokens,
                        int64_t d_model, const moedc_ref *out, moedc_error *err)
{
    const Moed__V1__Tensor *t = r->output;
    if (!t) return moedc_fail(err, MOEDC_EFORMAT, "the server's reply has no output tensor");
    if ((int)t->dtype != dtype)
        return moedc_fail(err, MOEDC_EFORMAT, "the server replied in %s to a %s request",
                          moed_dtype_name(t->dtype), moed_dtype_name(dtype));
    if (t->n_shape != 2 || t->shape[0] != tokens || t->shape[1] != d_model)
        return moedc_fail(err, MOEDC_EFORMAT,
                          "the server's output has %zu dims (first [%lld, %lld]) for a request of "
                          "shape [%lld, %lld]",
                          t->n_shape, t->n_shape > 0 ? (long long)t->shape[0] : -1LL,
                          t->n_shape > 1 ? (long long)t->shape[1] : -1LL, (long long)tokens,
                          (long long)d_model);
    size_t want = (size_t)(tokens * d_model) * moed_dtype_size(dtype);
    if (out->region) {
        const Moed__V1__RegionRef *g =
            t->contents_case == MOED__V1__TENSOR__CONTENTS_REGION ? t->region : NULL;
        if (!g || g->region != out->region->id || g->offset != out->offset || g->length != want)
            return moedc_fail(err, MOEDC_EFORMAT,
                              "the server's output does not name the region, offset and length "
                              "the request gave it");
        return 0;
    }
    if (t->contents_case != MOED__V1__TENSOR__CONTENTS_DATA || t->data.len != want)
        return moedc_fail(
            err, MOEDC_EFORMAT,
            "the server's output holds %zu bytes, its shape [%lld, %lld] of %s needs %zu",
            t->data.len, (long long)tokens, (long long)d_model, moed_dtype_name(dtype), want);
    return 0;
}

int moedc_decode_forward(const uint8_t *buf, size_t n, int dtype, int64_t tokens, int64_t d_model,
                         const moedc_ref *out, moedc_result *res, moedc_error *err)
{
    memset(res, 0, sizeof *res);
    Moed__V1__ForwardResponse *r = moed__v1__forward_response__unpack(NULL, n, buf);
    if (!r)
        return moedc_fail(err, MOEDC_EFORMAT, "the server's reply (%zu bytes) does not parse", n);
    int rc = check_output(r, dtype, tokens, d_model, out, err);
    if (rc) {
        moed__v1__forward_response__free_unpacked(r, NULL);
        return rc;
    }
    res->dtype = dtype;
    res->tokens = tokens;
    res->d_model = d_model;
    res->output_bytes = (size_t)(tokens * d_model) * moed_dtype_size(dtype);
    res->output = out->region ? (const void *)((const char *)out->region->ptr + out->offset)
                              : (const void *)r->output->data.data;
    res->expert_set = r->expert_set;
    res->n_expert_set = r->n_expert_set;
    if (r->timings) {
        res->timings.queue_us = r->timings->queue_us;
        res->timings.compute_us = r->timings->compute_us;
        res->timings.total_us = r->timings->total_us;
        res->timings.batch_tokens = r->timings->batch_tokens;
        res->timings.batch_requests = r->timings->batch_requests;
    }
    res->request_id = r->request_id ? r->request_id : "";
    res->priv = r;
    return 0;
}

void moedc_result_free(moedc_result *res)
{
    if (!res) return;
    if (res->priv) moed__v1__forward_response__free_unpacked(res->priv, NULL);
    memset(res, 0, sizeof *res);
}

void moedc_result_set_output(moedc_result *res, void *buf, int64_t tokens)
{
    Moed__V1__ForwardResponse *r = res->priv;
    /* free_unpacked frees the reply's bytes with the default allocator, free(): buf's too */
    free(r->output->data.data);
    r->output->data.data = buf;
    res->tokens = tokens;
    res->output_bytes = (size_t)(tokens * res->d_model) * moed_dtype_size(res->dtype);
    r->output->data.len = res->output_bytes;
    res->output = buf;
}

int moedc_encode_get_model(uint8_t **buf, size_t *n, moedc_error *err)
{
    Moed__V1__GetModelRequest m = MOED__V1__GET_MODEL_REQUEST__INIT;
    return pack(&m.base, buf, n, err);
}

int moedc_encode_health(const char *service, uint8_t **buf, size_t *n, moedc_error *err)
{
    Grpc__Health__V1__HealthCheckRequest m = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    m.service = (char *)(service ? service : "");
    return pack(&m.base, buf, n, err);
}

/* Whether a layer's held ranges and placement are what moed sends: increasing, disjoint, within
 * its experts, on devices it lists (n_devices). */
static bool ranges_valid(const Moed__V1__LayerInfo *l, size_t n_devices)
{
    int64_t next = 0;
    for (size_t i = 0; i < l->n_experts_held; i++) {
        const Moed__V1__ExpertRange *r = l->experts_held[i];
        if (r->first < next || r->last < r->first || r->last >= l->num_experts) return false;
        next = (int64_t)r->last + 1;
    }
    next = 0;
    for (size_t i = 0; i < l->n_expert_placement; i++) {
        const Moed__V1__ExpertPlacement *r = l->expert_placement[i];
        if (r->first < next || r->last < r->first || r->last >= l->num_experts ||
            r->device >= n_devices)
            return false;
        next = (int64_t)r->last + 1;
    }
    for (size_t i = 0; i < l->n_expert_replicas; i++) {
        const Moed__V1__ExpertPlacement *r = l->expert_replicas[i];
        if (r->first != r->last || r->last >= l->num_experts || r->device >= n_devices)
            return false;
    }
    return l->num_experts <= INT32_MAX &&
           (l->home_device < n_devices || (!l->home_device && !n_devices));
}

/* l's fields into li (held is malloc'd: false when out of memory). */
static bool layer_info_from(const Moed__V1__LayerInfo *l, moedc_layer_info *li)
{
    memset(li, 0, sizeof *li);
    li->index = (int)l->index;
    li->d_model = (int)l->d_model;
    li->d_ff = (int)l->d_ff;
    li->n_experts = (int)l->num_experts;
    li->top_k = (int)l->top_k;
    li->act = (int)l->activation;
    li->wdtype = (int)l->weight_dtype;
    li->has_router = l->has_router;
    li->norm_topk = l->norm_topk_prob;
    li->rule = (int)l->router_rule;
    li->n_group = (int)l->n_group;
    li->topk_group = (int)l->topk_group;
    li->routed_scale = l->routed_scaling_factor;
    li->n_shared = (int)l->num_shared_experts;
    li->shared_d_ff = (int)l->shared_d_ff;
    li->sparse24 = l->sparse24;
    /* a moed older than these fields holds every expert and adds the shared ones */
    li->n_held = l->n_experts_held ? (int)l->n_experts_held : 1;
    li->adds_shared = l->adds_shared_experts || !l->n_experts_held;
    if (!(li->held = calloc((size_t)li->n_held, sizeof *li->held))) return false;
    li->held[0].last = li->n_experts - 1;
    for (size_t i = 0; i < l->n_experts_held; i++)
        li->held[i] =
            (moedc_expert_range){ (int)l->experts_held[i]->first, (int)l->experts_held[i]->last };
    li->home_device = (int)l->home_device;
    li->n_placed = (int)l->n_expert_placement;
    if (li->n_placed && !(li->placed = calloc((size_t)li->n_placed, sizeof *li->placed)))
        return false;
    for (int i = 0; i < li->n_placed; i++)
        li->placed[i] = (moedc_expert_place){ (int)l->expert_placement[i]->first,
                                              (int)l->expert_placement[i]->last,
                                              (int)l->expert_placement[i]->device };
    li->placement_generation = l->placement_generation;
    li->n_replicas = (int)l->n_expert_replicas;
    if (li->n_replicas && !(li->replicas = calloc((size_t)li->n_replicas, sizeof *li->replicas)))
        return false;
    for (int i = 0; i < li->n_replicas; i++)
        li->replicas[i] = (moedc_expert_copy){ (int)l->expert_replicas[i]->first,
                                               (int)l->expert_replicas[i]->device };
    return true;
}

static char *dup_or_empty(const char *s)
{
    return strdup(s ? s : "");
}

int moedc_decode_model_info(const uint8_t *buf, size_t n, moedc_model_info *out, moedc_error *err)
{
    memset(out, 0, sizeof *out);
    Moed__V1__ModelInfo *m = moed__v1__model_info__unpack(NULL, n, buf);
    if (!m)
        return moedc_fail(err, MOEDC_EFORMAT, "the server's ModelInfo (%zu bytes) does not parse",
                          n);
    out->model = dup_or_empty(m->model);
    out->backend = dup_or_empty(m->backend);
    out->version = dup_or_empty(m->version);
    out->layers = calloc(m->n_layers ? m->n_layers : 1, sizeof *out->layers);
    out->devices = calloc(m->n_devices ? m->n_devices : 1, sizeof *out->devices);
    if (!out->model || !out->backend || !out->version || !out->layers || !out->devices) goto err;
    for (size_t i = 0; i < m->n_layers; i++)
        if (!ranges_valid(m->layers[i], m->n_devices)) {
            int index = (int)m->layers[i]->index;
            moed__v1__model_info__free_unpacked(m, NULL);
            moedc_model_info_free(out);
            return moedc_fail(err, MOEDC_EFORMAT,
                              "the server's ModelInfo is malformed: layer %d's experts_held or "
                              "expert_placement are not increasing ranges of its experts on its "
                              "devices, or its expert_replicas not single experts on them",
                              index);
        }
    for (size_t i = 0; i < m->n_layers; i++) {
        if (!layer_info_from(m->layers[i], &out->layers[i])) goto err;
        out->n_layers = (int)i + 1;
    }
    for (size_t i = 0; i < m->n_devices; i++) {
        out->devices[i].name = dup_or_empty(m->devices[i]->name);
        if (!out->devices[i].name) goto err;
        out->devices[i].memory_total = m->devices[i]->memory_total;
        out->devices[i].memory_used = m->devices[i]->memory_used;
        out->n_devices = (int)i + 1;
    }
    out->max_message_bytes = m->max_message_bytes;
    out->max_batch_tokens = m->max_batch_tokens;
    out->model_fingerprint = m->model_fingerprint;
    if ((out->is_loading = m->loading != NULL)) {
        const Moed__V1__LoadProgress *p = m->loading;
        moedc_load_progress *l = &out->loading;
        snprintf(l->phase, sizeof l->phase, "%s", p->phase ? p->phase : "");
        l->phase_number = (int)p->phase_number;
        l->phases = (int)p->phases;
        l->layer = p->layer;
        l->layers_done = (int)p->layers_done;
        l->layers_total = (int)p->layers_total;
        l->bytes_done = p->bytes_done;
        l->bytes_total = p->bytes_total;
        l->percent = p->percent;
        l->elapsed_s = p->elapsed_seconds;
        l->bytes_per_s = p->bytes_per_second;
        l->eta_s = p->eta_seconds;
    }
    out->regions_mode = dup_or_empty(m->regions ? m->regions->mode : NULL);
    if (!out->regions_mode) goto err;
    if (m->regions) {
        out->max_regions = m->regions->max_regions;
        out->max_region_bytes = m->regions->max_region_bytes;
        out->max_region_bytes_total = m->regions->max_region_bytes_total;
        out->cuda_regions = m->regions->cuda;
    }
    moed__v1__model_info__free_unpacked(m, NULL);
    return 0;
err:
    moed__v1__model_info__free_unpacked(m, NULL);
    moedc_model_info_free(out);
    return moedc_fail(err, MOEDC_ENOMEM, "out of memory decoding the server's ModelInfo");
}

void moedc_model_info_free(moedc_model_info *m)
{
    if (!m) return;
    free(m->model);
    free(m->backend);
    free(m->version);
    for (int i = 0; i < m->n_layers; i++) {
        free(m->layers[i].held);
        free(m->layers[i].placed);
        free(m->layers[i].replicas);
    }
    free(m->regions_mode);
    free(m->layers);
    for (int i = 0; i < m->n_devices; i++) free(m->devices[i].name);
    free(m->devices);
    memset(m, 0, sizeof *m);
}

int moedc_decode_region_list(const uint8_t *buf, size_t n, moedc_region_info **out, int *count,
                             moedc_error *err)
{
    *out = NULL;
    *count = 0;
    Moed__V1__RegionList *l = moed__v1__region_list__unpack(NULL, n, buf);
    if (!l)
        return moedc_fail(err, MOEDC_EFORMAT, "the server's RegionList (%zu bytes) does not parse",
                          n);
    moedc_region_info *a = calloc(l->n_regions ? l->n_regions : 1, sizeof *a);
    for (size_t i = 0; a && i < l->n_regions; i++) {
        const Moed__V1__Region *r = l->regions[i];
        a[i] = (moedc_region_info){ .id = r->id,
                                    .kind = (int)r->kind,
                                    .bytes = r->bytes,
                                    .device = (int)r->device,
                                    .ready = r->ready,
                                    .broken = r->broken,
                                    .requests = r->requests };
        snprintf(a[i].name, sizeof a[i].name, "%s", r->name ? r->name : "");
    }
    *count = a ? (int)l->n_regions : 0;
    moed__v1__region_list__free_unpacked(l, NULL);
    if (!a) return moedc_fail(err, MOEDC_ENOMEM, "out of memory decoding the server's RegionList");
    *out = a;
    return 0;
}

int moedc_decode_health(const uint8_t *buf, size_t n, int *status, moedc_error *err)
{
    Grpc__Health__V1__HealthCheckResponse *r =
        grpc__health__v1__health_check_response__unpack(NULL, n, buf);
    if (!r)
        return moedc_fail(err, MOEDC_EFORMAT,
                          "the server's HealthCheckResponse (%zu bytes) does not parse", n);
    *status = (int)r->status;
    grpc__health__v1__health_check_response__free_unpacked(r, NULL);
    return 0;
}

int moedc_decode_link(const Moed__V1__Link *l, moedc_link_grant *out, moedc_error *err)
{
    memset(out, 0, sizeof *out);
    if (!l)
        return moedc_fail(err, MOEDC_EFORMAT, "the server's answer to open_link lacks the link");
    if (!l->id) return moedc_fail(err, MOEDC_EFORMAT, "the server's link has id 0");
    if (l->unique_id.len != sizeof out->unique_id || l->key.len != sizeof out->key)
        return moedc_fail(
            err, MOEDC_EFORMAT,
            "the server's link has a unique_id of %zu bytes and a key of %zu (moed.proto: "
            "%zu and %zu)",
            l->unique_id.len, l->key.len, sizeof out->unique_id, sizeof out->key);
    if (l->version != MOED_LINK_VERSION)
        return moedc_fail(err, MOEDC_EUNSUPPORTED,
                          "the server's links speak call layout version %u, this client %d: use "
                          "gRPC, or a client and daemon of one release",
                          l->version, MOED_LINK_VERSION);
    if (!l->max_payload_bytes)
        return moedc_fail(err, MOEDC_EFORMAT,
                          "the server's link takes no payload (max_payload_bytes 0)");
    out->id = l->id;
    memcpy(out->unique_id, l->unique_id.data, sizeof out->unique_id);
    memcpy(out->key, l->key.data, sizeof out->key);
    out->device = l->device;
    out->version = l->version;
    out->nccl_version = l->nccl_version;
    out->max_payload_bytes = l->max_payload_bytes;
    return 0;
}
