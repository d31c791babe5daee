/*
 * test_moedc_codec — libmoedclient's messages without a server: every request it encodes is
 * decoded back by protobuf-c (an independent parser of the same proto) and compared field by field,
 * replies that do not match the request are refused, and gRPC statuses map to moed codes and back
 * (the public header's codes and texts being the daemon's).
 */
#include "check.h"
#include "moed_dtype.h"
#include "moed_err.h"
#include "moed_link.h"
#include "moedc_codec.h"

#include <grpc/health/v1/health.pb-c.h>
#include <moed/v1/moed.pb-c.h>

#include <stdlib.h>
#include <string.h>

/* Where an output goes when it travels in the reply. */
static const moedc_ref inline_out;

/* head + body + tail as one buffer, as gRPC puts them on the wire. */
static uint8_t *join(const moedc_wire *w, size_t *n)
{
    *n = w->head_len + w->body_len + w->tail_len;
    uint8_t *b = malloc(*n);
    memcpy(b, w->head, w->head_len);
    if (w->body_len) memcpy(b + w->head_len, w->body, w->body_len); /* no body: body may be NULL */
    memcpy(b + w->head_len + w->body_len, w->tail, w->tail_len);
    return b;
}

static Moed__V1__ForwardRequest *encode_expecting(const moedc_request *req,
                                                  const moedc_expect *expect)
{
    moedc_wire w;
    moedc_error err;
    int rc = moedc_encode_forward(req, expect, &w, &err);
    CHECK_MSG(rc == 0, "encode: %s", err.msg);
    if (rc) return NULL;
    /* hidden is sent from where it is, or named in its region */
    CHECK(w.body == (req->hidden_at.region ? NULL : req->hidden));
    size_t n;
    uint8_t *b = join(&w, &n);
    Moed__V1__ForwardRequest *m = moed__v1__forward_request__unpack(NULL, n, b);
    CHECK(m != NULL);
    free(b);
    moedc_wire_free(&w);
    return m;
}

static Moed__V1__ForwardRequest *encode_decode(const moedc_request *req)
{
    return encode_expecting(req, NULL);
}

static void check_tensor(const Moed__V1__Tensor *t, int dtype, int64_t r, int64_t c,
                         const void *data, size_t bytes)
{
    CHECK(t != NULL);
    if (!t) return;
    CHECK_EQ_INT(t->dtype, dtype);
    CHECK_EQ_INT(t->n_shape, 2);
    if (t->n_shape == 2) {
        CHECK_EQ_INT(t->shape[0], r);
        CHECK_EQ_INT(t->shape[1], c);
    }
    CHECK_EQ_INT(t->data.len, bytes);
    CHECK(t->data.len == bytes && !memcmp(t->data.data, data, bytes));
}

static void test_requests(void)
{
    enum { T = 3, D = 200 }; /* 1200-byte f16 hidden: multi-byte varint lengths */
    static uint16_t hidden[T * D];
    for (int i = 0; i < T * D; i++) hidden[i] = (uint16_t)(i * 7919);
    int32_t ids[T * 2] = { 0, 1, 2, -1, 7, 7 };
    float w[T * 2] = { 0.5f, 0.5f, 1, 0, 0.25f, 0.75f };
    float logits[T * 4] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 };

    moedc_request req = { .request_id = "req-1",
                          .layer = 300,
                          .dtype = MOEDC_F16,
                          .tokens = T,
                          .d_model = D,
                          .hidden = hidden,
                          .routing = MOEDC_ROUTE_EXPERTS,
                          .k = 2,
                          .expert_ids = ids,
                          .expert_weights = w };
    Moed__V1__ForwardRequest *m = encode_decode(&req);
    if (m) {
        CHECK(!strcmp(m->request_id, "req-1"));
        CHECK_EQ_INT(m->layer, 300);
        check_tensor(m->hidden, MOEDC_F16, T, D, hidden, sizeof hidden);
        CHECK_EQ_INT(m->routing_case, MOED__V1__FORWARD_REQUEST__ROUTING_EXPERTS);
        check_tensor(m->experts->expert_ids, MOED_I32, T, 2, ids, sizeof ids);
        check_tensor(m->experts->expert_weights, MOEDC_F32, T, 2, w, sizeof w);
        CHECK(m->batch_gating == NULL && m->expect == NULL);
        moed__v1__forward_request__free_unpacked(m, NULL);
    }
    /* a fleet's sub-call states what it expects of its daemon */
    const moedc_expert_range held[2] = { { 0, 3 }, { 6, 6 } };
    const moedc_expect x = {
        .fingerprint = 0x8000000000000001ull, .held = held, .n_held = 2, .adds_shared = true
    };
    m = encode_expecting(&req, &x);
    if (m) {
        check_tensor(m->hidden, MOEDC_F16, T, D, hidden, sizeof hidden);
        CHECK(m->expect != NULL);
        if (m->expect) {
            CHECK(m->expect->model_fingerprint == x.fingerprint);
            CHECK(m->expect->adds_shared_experts);
            CHECK_EQ_INT(m->expect->n_experts_held, 2);
            if (m->expect->n_experts_held == 2)
                CHECK(m->expect->experts_held[0]->first == 0 &&
                      m->expect->experts_held[0]->last == 3 &&
                      m->expect->experts_held[1]->first == 6 &&
                      m->expect->experts_held[1]->last == 6);
        }
        moed__v1__forward_request__free_unpacked(m, NULL);
    }

    req = (moedc_request){ .layer = 0,
                           .dtype = MOEDC_BF16,
                           .tokens = T,
                           .d_model = D,
                           .hidden = hidden,
                           .routing = MOEDC_ROUTE_LOGITS,
                           .n_experts = 4,
                           .logits = logits,
                           .gating = { MOEDC_GATE_SIGMOID, 3, MOEDC_RENORM_OFF, 0.25f },
                           .batch_gating = true,
                           .k_batch = 2 };
    m = encode_decode(&req);
    if (m) {
        CHECK(!strcmp(m->request_id, ""));
        check_tensor(m->hidden, MOEDC_BF16, T, D, hidden, sizeof hidden);
        CHECK_EQ_INT(m->routing_case, MOED__V1__FORWARD_REQUEST__ROUTING_LOGITS);
        check_tensor(m->logits->logits, MOEDC_F32, T, 4, logits, sizeof logits);
        CHECK(m->logits->gating != NULL);
        if (m->logits->gating) {
            CHECK_EQ_INT(m->logits->gating->strategy, MOED__V1__STRATEGY__SIGMOID);
            CHECK_EQ_INT(m->logits->gating->top_k, 3);
            CHECK_EQ_INT(m->logits->gating->renormalize, MOED__V1__RENORMALIZE__RENORMALIZE_OFF);
            CHECK(m->logits->gating->threshold == 0.25f);
        }
        CHECK(m->batch_gating && m->batch_gating->k_batch == 2);
        moed__v1__forward_request__free_unpacked(m, NULL);
    }

    req = (moedc_request){ .layer = 1,
                           .dtype = MOEDC_F32,
                           .tokens = 1,
                           .d_model = 2,
                           .hidden = logits,
                           .routing = MOEDC_ROUTE_SERVER,
                           .batch_gating = true };
    m = encode_decode(&req);
    if (m) {
        CHECK_EQ_INT(m->routing_case, MOED__V1__FORWARD_REQUEST__ROUTING_SERVER_ROUTER);
        CHECK(m->server_router->gating && m->server_router->gating->strategy == 0);
        CHECK(m->batch_gating && m->batch_gating->k_batch == 0); /* present, default size */
        moed__v1__forward_request__free_unpacked(m, NULL);
    }
}

static void test_bad_requests(void)
{
    moedc_wire w;
    moedc_error err;
    float x[4] = { 0 };
    moedc_request req = {
        .dtype = MOED_I32, .tokens = 1, .d_model = 4, .hidden = x, .routing = MOEDC_ROUTE_SERVER
    };
    CHECK_EQ_INT(moedc_encode_forward(&req, NULL, &w, &err), MOEDC_EINVAL);
    CHECK(strstr(err.msg, "i32") != NULL);
    req.dtype = MOEDC_F32;
    req.hidden = NULL;
    CHECK_EQ_INT(moedc_encode_forward(&req, NULL, &w, &err), MOEDC_EINVAL);
    CHECK(strstr(err.msg, "hidden is NULL") != NULL);
    req.hidden = x;
    req.routing = 9;
    CHECK_EQ_INT(moedc_encode_forward(&req, NULL, &w, &err), MOEDC_EINVAL);
    CHECK(strstr(err.msg, "routing 9") != NULL);
    req.routing = MOEDC_ROUTE_EXPERTS;
    req.k = 2;
    CHECK_EQ_INT(moedc_encode_forward(&req, NULL, &w, &err), MOEDC_EINVAL);
    CHECK(strstr(err.msg, "expert_ids is NULL") != NULL);
    req.routing = MOEDC_ROUTE_SERVER;
    req.d_model = -4;
    CHECK_EQ_INT(moedc_encode_forward(&req, NULL, &w, &err), MOEDC_EINVAL);
    req.d_model = (int64_t)1 << 40;
    req.tokens = (int64_t)1 << 40;
    CHECK_EQ_INT(moedc_encode_forward(&req, NULL, &w, &err), MOEDC_ETOOBIG);
}

/* Packs a ForwardResponse with an output of the given dtype and shape. */
static uint8_t *reply(int dtype, int64_t r, int64_t c, size_t bytes, size_t *n)
{
    static uint8_t data[64];
    int64_t shape[2] = { r, c };
    int32_t set[2] = { 5, 2 };
    Moed__V1__Tensor t;
    moed__v1__tensor__init(&t);
    t.dtype = dtype;
    t.n_shape = 2;
    t.shape = shape;
    t.data.len = bytes;
    t.data.data = data;
    t.contents_case = MOED__V1__TENSOR__CONTENTS_DATA;
    for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)i;
    Moed__V1__Timings tm = MOED__V1__TIMINGS__INIT;
    tm.queue_us = 11;
    tm.compute_us = 22;
    tm.total_us = 40;
    tm.batch_tokens = 9;
    tm.batch_requests = 3;
    Moed__V1__ForwardResponse m = MOED__V1__FORWARD_RESPONSE__INIT;
    m.request_id = "abc";
    m.output = &t;
    m.n_expert_set = 2;
    m.expert_set = set;
    m.timings = &tm;
    *n = moed__v1__forward_response__get_packed_size(&m);
    uint8_t *b = malloc(*n);
    moed__v1__forward_response__pack(&m, b);
    return b;
}

static void test_replies(void)
{
    moedc_result res;
    moedc_error err;
    size_t n;
    uint8_t *b = reply(MOEDC_BF16, 2, 8, 32, &n);
    CHECK_EQ_INT(moedc_decode_forward(b, n, MOEDC_BF16, 2, 8, &inline_out, &res, &err), 0);
    CHECK_EQ_INT(res.output_bytes, 32);
    CHECK(res.output && ((const uint8_t *)res.output)[31] == 31);
    CHECK(res.n_expert_set == 2 && res.expert_set[0] == 5 && res.expert_set[1] == 2);
    CHECK(res.timings.queue_us == 11 && res.timings.compute_us == 22 && res.timings.total_us == 40);
    CHECK(res.timings.batch_tokens == 9 && res.timings.batch_requests == 3);
    CHECK(!strcmp(res.request_id, "abc"));
    moedc_result_free(&res);
    moedc_result_free(&res); /* twice is safe */
    CHECK_EQ_INT(moedc_decode_forward(b, n, MOEDC_F16, 2, 8, &inline_out, &res, &err),
                 MOEDC_EFORMAT);
    CHECK(strstr(err.msg, "bf16") != NULL);
    CHECK_EQ_INT(moedc_decode_forward(b, n, MOEDC_BF16, 4, 4, &inline_out, &res, &err),
                 MOEDC_EFORMAT);
    CHECK(res.priv == NULL);
    CHECK_EQ_INT(moedc_decode_forward(b, n - 3, MOEDC_BF16, 2, 8, &inline_out, &res, &err),
                 MOEDC_EFORMAT);
    free(b);
    b = reply(MOEDC_BF16, 2, 8, 30, &n); /* shape and bytes disagree */
    CHECK_EQ_INT(moedc_decode_forward(b, n, MOEDC_BF16, 2, 8, &inline_out, &res, &err),
                 MOEDC_EFORMAT);
    CHECK(strstr(err.msg, "30 bytes") != NULL);
    free(b);
    uint8_t junk[5] = { 0xff, 0xff, 0xff, 0xff, 0xff };
    CHECK_EQ_INT(moedc_decode_forward(junk, 5, MOEDC_F32, 1, 1, &inline_out, &res, &err),
                 MOEDC_EFORMAT);
}

static void check_ref(const Moed__V1__RegionRef *r, uint64_t id, uint64_t off, uint64_t len)
{
    CHECK(r && r->region == id && r->offset == off && r->length == len);
}

/* Tensors in regions travel as references (no data), and so does the output's place; a reply
 * naming the request's region gives the output there, one naming another is malformed. */
static void test_regions(void)
{
    static float mem[64];
    const moedc_region g = { .id = 77, .kind = MOEDC_REGION_HOST, .ptr = mem, .bytes = sizeof mem };
    float w[4] = { 1, 1, 1, 1 };
    moedc_request req = { .layer = 2,
                          .dtype = MOEDC_F32,
                          .tokens = 2,
                          .d_model = 4,
                          .routing = MOEDC_ROUTE_EXPERTS,
                          .k = 2,
                          .expert_weights = w,
                          .hidden_at = { &g, 0 },
                          .expert_ids_at = { &g, 32 },
                          .output_at = { &g, 64 } };
    Moed__V1__ForwardRequest *m = encode_decode(&req);
    if (m) {
        CHECK_EQ_INT(m->hidden->contents_case, MOED__V1__TENSOR__CONTENTS_REGION);
        check_ref(m->hidden->region, 77, 0, 32);
        CHECK(m->hidden->n_shape == 2 && m->hidden->shape[1] == 4);
        CHECK_EQ_INT(m->experts->expert_ids->contents_case, MOED__V1__TENSOR__CONTENTS_REGION);
        check_ref(m->experts->expert_ids->region, 77, 32, 16);
        check_tensor(m->experts->expert_weights, MOEDC_F32, 2, 2, w, sizeof w);
        check_ref(m->output, 77, 64, 32);
        moed__v1__forward_request__free_unpacked(m, NULL);
    }
    Moed__V1__RegionRef ref = MOED__V1__REGION_REF__INIT;
    ref.region = 77;
    ref.offset = 64;
    ref.length = 32;
    int64_t shape[2] = { 2, 4 };
    Moed__V1__Tensor t;
    moed__v1__tensor__init(&t);
    t.dtype = MOED__V1__DTYPE__F32;
    t.n_shape = 2;
    t.shape = shape;
    t.contents_case = MOED__V1__TENSOR__CONTENTS_REGION;
    t.region = &ref;
    Moed__V1__ForwardResponse resp = MOED__V1__FORWARD_RESPONSE__INIT;
    resp.output = &t;
    uint8_t b[128];
    size_t n = moed__v1__forward_response__pack(&resp, b);
    moedc_result res;
    moedc_error err;
    CHECK_EQ_INT(moedc_decode_forward(b, n, MOEDC_F32, 2, 4, &req.output_at, &res, &err), 0);
    CHECK(res.output == mem + 16 && res.output_bytes == 32);
    moedc_result_free(&res);
    /* an inline request answered with a region, or a region answered elsewhere: malformed */
    CHECK_EQ_INT(moedc_decode_forward(b, n, MOEDC_F32, 2, 4, &inline_out, &res, &err),
                 MOEDC_EFORMAT);
    req.output_at.offset = 0;
    CHECK_EQ_INT(moedc_decode_forward(b, n, MOEDC_F32, 2, 4, &req.output_at, &res, &err),
                 MOEDC_EFORMAT);
    CHECK(strstr(err.msg, "region") != NULL);
}

static void test_model_info_and_health(void)
{
    Moed__V1__LayerInfo l0 = MOED__V1__LAYER_INFO__INIT, l1 = MOED__V1__LAYER_INFO__INIT;
    l0.index = 3;
    l0.d_model = 256;
    l0.d_ff = 512;
    l0.num_experts = 8;
    l0.top_k = 2;
    l0.activation = MOED__V1__ACTIVATION__GELU;
    l0.weight_dtype = MOED__V1__DTYPE__BF16;
    l0.has_router = 1;
    l0.norm_topk_prob = 1;
    l0.router_rule = MOED__V1__ROUTER_RULE__DEEPSEEK_V3;
    l0.num_shared_experts = 2;
    l0.shared_d_ff = 64;
    l0.n_group = 4;
    l0.topk_group = 2;
    l0.routed_scaling_factor = 2.5f;
    l1.index = 4;
    Moed__V1__LayerInfo *layers[2] = { &l0, &l1 };
    Moed__V1__Device dev = MOED__V1__DEVICE__INIT;
    dev.name = "cpu";
    dev.memory_total = 1000;
    dev.memory_used = 10;
    Moed__V1__Device *devs[1] = { &dev };
    Moed__V1__ModelInfo m = MOED__V1__MODEL_INFO__INIT;
    m.model = "layers=2";
    m.backend = "cpu";
    m.version = "0.1.0";
    m.n_layers = 2;
    m.layers = layers;
    m.n_devices = 1;
    m.devices = devs;
    m.max_message_bytes = 1 << 20;
    m.max_batch_tokens = 4096;
    m.model_fingerprint = 0xfedcba9876543210ull;
    size_t n = moed__v1__model_info__get_packed_size(&m);
    uint8_t *b = malloc(n);
    moed__v1__model_info__pack(&m, b);
    moedc_model_info info;
    moedc_error err;
    CHECK_EQ_INT(moedc_decode_model_info(b, n, &info, &err), 0);
    CHECK(!strcmp(info.model, "layers=2") && !strcmp(info.backend, "cpu"));
    CHECK(!strcmp(info.version, "0.1.0"));
    CHECK(info.max_message_bytes == 1 << 20 && info.max_batch_tokens == 4096);
    CHECK(info.model_fingerprint == 0xfedcba9876543210ull);
    CHECK(info.n_devices == 1 && !strcmp(info.devices[0].name, "cpu"));
    CHECK(info.devices[0].memory_total == 1000 && info.devices[0].memory_used == 10);
    CHECK_EQ_INT(info.n_layers, 2);
    const moedc_layer_info *li = &info.layers[0];
    CHECK(li->index == 3 && li->d_model == 256 && li->d_ff == 512 && li->n_experts == 8);
    CHECK(li->top_k == 2 && li->act == MOEDC_ACT_GELU && li->wdtype == MOEDC_BF16);
    CHECK(li->has_router && li->norm_topk && li->rule == MOEDC_RULE_DEEPSEEK_V3);
    CHECK(li->n_shared == 2 && li->shared_d_ff == 64 && li->n_group == 4 && li->topk_group == 2);
    CHECK(li->routed_scale == 2.5f);
    CHECK(info.layers[1].index == 4 && !info.layers[1].has_router);
    moedc_model_info_free(&info);
    free(b);

    uint8_t *q;
    CHECK_EQ_INT(moedc_encode_health("moed.v1.Moed", &q, &n, &err), 0);
    Grpc__Health__V1__HealthCheckRequest *hr =
        grpc__health__v1__health_check_request__unpack(NULL, n, q);
    CHECK(hr && !strcmp(hr->service, "moed.v1.Moed"));
    if (hr) grpc__health__v1__health_check_request__free_unpacked(hr, NULL);
    free(q);
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
    uint8_t rb[16];
    n = grpc__health__v1__health_check_response__pack(&resp, rb);
    int status = -1;
    CHECK_EQ_INT(moedc_decode_health(rb, n, &status, &err), 0);
    CHECK_EQ_INT(status, MOEDC_HEALTH_NOT_SERVING);
    CHECK(!strcmp(moedc_health_name(status), "NOT_SERVING"));
}

static void test_status_codes(void)
{
    /* Every status moed sends (moed.proto) comes back as a code that maps to the same status. */
    static const int sent[] = { 1, 3, 4, 5, 8, 9, 12, 13, 14, 16 };
    for (size_t i = 0; i < sizeof sent / sizeof sent[0]; i++)
        CHECK_EQ_INT(moedc_code_to_grpc(moedc_code_from_grpc(sent[i])), sent[i]);
    CHECK_EQ_INT(moedc_code_from_grpc(0), MOEDC_OK);
    CHECK_EQ_INT(moedc_code_from_grpc(3), MOEDC_EINVAL);
    CHECK_EQ_INT(moedc_code_from_grpc(14), MOEDC_EUNAVAIL);
    CHECK_EQ_INT(moedc_code_from_grpc(99), MOEDC_EINTERNAL);
    CHECK(!strcmp(moedc_grpc_status_name(8), "RESOURCE_EXHAUSTED"));
    CHECK(!strcmp(moedc_grpc_status_name(16), "UNAUTHENTICATED"));
    /* The public header's copy of the error table says what the daemon's says (the values are
     * checked at compile time; the texts and statuses here). */
    for (int code = 1; code >= -20; code--) {
        CHECK(!strcmp(moedc_strerror(code), moed_strerror(code)));
        if (strcmp(moed_strerror(code), "unknown error"))
            CHECK_EQ_INT(moedc_code_to_grpc(code), moed_err_grpc_status(code));
    }
}

/* The Link of open_link's event, through the wire (packed, then parsed by protobuf-c): its facts,
 * and each way a server's Link can break moed.proto refused naming the field. */
static void test_link(void)
{
    uint8_t uid[128], key[32], buf[512];
    for (int i = 0; i < 128; i++) uid[i] = (uint8_t)(i * 7 + 1);
    for (int i = 0; i < 32; i++) key[i] = (uint8_t)(255 - i);
    Moed__V1__Link l = MOED__V1__LINK__INIT;
    Moed__V1__RegionEvent ev = MOED__V1__REGION_EVENT__INIT;
    l.id = 0x1234567890abcdefull;
    l.unique_id = (ProtobufCBinaryData){ sizeof uid, uid };
    l.key = (ProtobufCBinaryData){ sizeof key, key };
    l.device = 3;
    l.version = MOED_LINK_VERSION;
    l.nccl_version = 22703;
    l.max_payload_bytes = 1 << 20;
    ev.seq = 9;
    ev.link = &l;
    size_t n = moed__v1__region_event__pack(&ev, buf);
    Moed__V1__RegionEvent *got = moed__v1__region_event__unpack(NULL, n, buf);
    moedc_link_grant g;
    moedc_error err;
    CHECK_EQ_INT(moedc_decode_link(got->link, &g, &err), 0);
    CHECK(g.id == l.id && g.device == 3 && g.version == MOED_LINK_VERSION &&
          g.nccl_version == 22703);
    CHECK(g.max_payload_bytes == 1 << 20);
    CHECK(!memcmp(g.unique_id, uid, sizeof uid) && !memcmp(g.key, key, sizeof key));
    moed__v1__region_event__free_unpacked(got, NULL);

    CHECK_EQ_INT(moedc_decode_link(NULL, &g, &err), MOEDC_EFORMAT);
    CHECK(strstr(err.msg, "lacks the link") != NULL);
    Moed__V1__Link bad = l;
    bad.id = 0;
    CHECK_EQ_INT(moedc_decode_link(&bad, &g, &err), MOEDC_EFORMAT);
    CHECK(strstr(err.msg, "id 0") != NULL);
    bad = l;
    bad.unique_id.len = 127;
    CHECK_EQ_INT(moedc_decode_link(&bad, &g, &err), MOEDC_EFORMAT);
    CHECK(strstr(err.msg, "unique_id of 127 bytes") != NULL);
    bad = l;
    bad.key.len = 16;
    CHECK_EQ_INT(moedc_decode_link(&bad, &g, &err), MOEDC_EFORMAT);
    CHECK(strstr(err.msg, "key of 16") != NULL);
    bad = l;
    bad.version = 1; /* before the split after the hello (moed_link.h) */
    CHECK_EQ_INT(moedc_decode_link(&bad, &g, &err), MOEDC_EUNSUPPORTED);
    CHECK(strstr(err.msg, "version 1") != NULL);
    bad = l;
    bad.max_payload_bytes = 0;
    CHECK_EQ_INT(moedc_decode_link(&bad, &g, &err), MOEDC_EFORMAT);
    CHECK(strstr(err.msg, "max_payload_bytes") != NULL);

    /* the command: open_link's limits survive the wire under field 8 */
    Moed__V1__OpenLink ol = MOED__V1__OPEN_LINK__INIT;
    Moed__V1__RegionCommand cmd = MOED__V1__REGION_COMMAND__INIT;
    ol.max_tokens = 4096;
    ol.max_top_k = 8;
    cmd.command_case = MOED__V1__REGION_COMMAND__COMMAND_OPEN_LINK;
    cmd.open_link = &ol;
    n = moed__v1__region_command__pack(&cmd, buf);
    Moed__V1__RegionCommand *c = moed__v1__region_command__unpack(NULL, n, buf);
    CHECK(c && c->command_case == MOED__V1__REGION_COMMAND__COMMAND_OPEN_LINK);
    CHECK(c && c->open_link->max_tokens == 4096 && c->open_link->max_top_k == 8);
    if (c) moed__v1__region_command__free_unpacked(c, NULL);
}

int main(void)
{
    test_requests();
    test_bad_requests();
    test_replies();
    test_regions();
    test_model_info_and_health();
    test_status_codes();
    test_link();
    return check_status("test_moedc_codec");
}
