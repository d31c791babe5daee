/*
 * test_wire — the zero-copy ForwardRequest decoder against protobuf-c (the reference decoder) on
 * the same bytes, split into slices at every size down to one byte; hand-encoded variants that
 * protobuf-c's encoder never writes (unpacked shape, unknown fields, repeated sub-messages, a
 * oneof switching member); malformed input (every truncation, random bytes, huge lengths, wrong
 * wire types); and the three-slice response encoder read back by protobuf-c. Unknown groups nest
 * 100 deep, not deeper, and protobuf-c messages are read with their groups dropped.
 */
#include "check.h"
#include "moed_dtype.h"
#include "wire.h"

#include "moed/v1/moed.pb-c.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <stdlib.h>
#include <string.h>

/* ---- a tiny protobuf writer for hand-made messages ------------------------------------------- */

typedef struct buf {
    uint8_t d[1 << 16];
    size_t n;
} buf;

static void put(buf *b, const void *p, size_t n)
{
    memcpy(b->d + b->n, p, n);
    b->n += n;
}

static void put_varint(buf *b, uint64_t v)
{
    while (v >= 0x80) {
        b->d[b->n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    b->d[b->n++] = (uint8_t)v;
}

static void put_tag(buf *b, uint32_t field, int wt)
{
    put_varint(b, (uint64_t)field << 3 | (uint64_t)wt);
}

static void put_len(buf *b, uint32_t field, const void *p, size_t n)
{
    put_tag(b, field, 2);
    put_varint(b, n);
    put(b, p, n);
}

static void put_uint(buf *b, uint32_t field, uint64_t v)
{
    put_tag(b, field, 0);
    put_varint(b, v);
}

/* ---- slicing and the oracle ------------------------------------------------------------------ */

static uint64_t rng = 88172645463325252ull;

static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Splits data into slices of `chunk` bytes (0: random sizes), with empty slices sprinkled in. */
static size_t split(const uint8_t *data, size_t n, size_t chunk, grpc_slice *out, size_t max)
{
    size_t k = 0, off = 0;
    while (off < n && k + 2 < max) {
        size_t c = chunk ? chunk : 1 + rnd() % 97;
        if (c > n - off) c = n - off;
        if (rnd() % 8 == 0) out[k++] = grpc_empty_slice();
        out[k++] = grpc_slice_from_copied_buffer((const char *)data + off, c);
        off += c;
    }
    if (off < n) out[k++] = grpc_slice_from_copied_buffer((const char *)data + off, n - off);
    return k;
}

static void free_slices(grpc_slice *s, size_t k)
{
    for (size_t i = 0; i < k; i++) grpc_slice_unref(s[i]);
}

static int span_equals(const moed_span *s, const void *p, size_t n)
{
    if (s->len != n) return 0;
    uint8_t *tmp = malloc(n + 1);
    moed_span_copy(s, tmp);
    int eq = !n || !memcmp(tmp, p, n); /* protobuf-c leaves empty bytes NULL */
    free(tmp);
    return eq;
}

static int tensor_equals(const moed_wire_tensor *t, const Moed__V1__Tensor *r)
{
    if (!r) return !t->present;
    if (!t->present || t->dtype != (int32_t)r->dtype || t->n_shape != (int)r->n_shape) return 0;
    for (size_t i = 0; i < r->n_shape && i < MOED_WIRE_MAX_DIMS; i++)
        if (t->shape[i] != r->shape[i]) return 0;
    return span_equals(&t->data, r->data.data, r->data.len);
}

static int gating_equals(const moed_wire_gating *g, const Moed__V1__Gating *r)
{
    if (!r) return g->strategy == 0 && g->top_k == 0 && g->renormalize == 0 && g->threshold == 0;
    return g->strategy == (int32_t)r->strategy && g->top_k == r->top_k &&
           g->renormalize == (int32_t)r->renormalize && !memcmp(&g->threshold, &r->threshold, 4);
}

/* Our decoding of q equals protobuf-c's r in every field the schema has. */
static int request_equals(const moed_wire_request *q, const Moed__V1__ForwardRequest *r)
{
    /* protobuf-c keeps all of a string's bytes (NULs included) with a NUL after them. */
    size_t id_len = q->request_id.len;
    if (strlen(r->request_id) > id_len || r->request_id[id_len] != 0 ||
        !span_equals(&q->request_id, r->request_id, id_len))
        return 0;
    if (q->layer != r->layer || !tensor_equals(&q->hidden, r->hidden)) return 0;
    if (q->batch_gating != (r->batch_gating != NULL)) return 0;
    if (r->batch_gating && q->k_batch != r->batch_gating->k_batch) return 0;
    if (q->routing != (int)r->routing_case) return 0;
    switch (r->routing_case) {
    case MOED__V1__FORWARD_REQUEST__ROUTING_EXPERTS:
        return tensor_equals(&q->expert_ids, r->experts->expert_ids) &&
               tensor_equals(&q->expert_weights, r->experts->expert_weights);
    case MOED__V1__FORWARD_REQUEST__ROUTING_LOGITS:
        return tensor_equals(&q->logits, r->logits->logits) &&
               gating_equals(&q->gating, r->logits->gating);
    case MOED__V1__FORWARD_REQUEST__ROUTING_SERVER_ROUTER:
        return gating_equals(&q->gating, r->server_router->gating);
    default:
        return 1;
    }
}

/* Decodes bytes split at `chunk` and, if protobuf-c parses them, checks we agree field by field.
 * Returns our code. */
static int decode_and_compare(const uint8_t *data, size_t n, size_t chunk, const char *what)
{
    grpc_slice sl[4096];
    size_t k = split(data, n, chunk, sl, 4096);
    moed_wire_request q;
    moed_error err = { 0 };
    int rc = moed_wire_decode_request(sl, k, &q, &err);
    Moed__V1__ForwardRequest *r = moed__v1__forward_request__unpack(NULL, n, data);
    CHECK_MSG(rc == 0 || rc == MOED_EFORMAT, "%s: code %d", what, rc);
    if (rc)
        CHECK_MSG(err.code == MOED_EFORMAT && strstr(err.msg, "malformed"), "%s: %s", what,
                  err.msg);
    if (r) {
        CHECK_MSG(rc == 0, "%s (chunk %zu): protobuf-c parses it but we fail: %s", what, chunk,
                  err.msg);
        if (!rc && !request_equals(&q, r)) {
            CHECK_MSG(0, "%s (chunk %zu): fields differ", what, chunk);
            for (size_t i = 0; i < n; i++) fprintf(stderr, "%02x", data[i]);
            fprintf(stderr, "\n");
        }
        CHECK_EQ_INT(q.bytes, n);
        moed__v1__forward_request__free_unpacked(r, NULL);
    }
    free_slices(sl, k);
    return rc;
}

/* ---- reference requests ---------------------------------------------------------------------- */

static size_t pack_request(int routing, int batch, uint8_t *out, size_t cap)
{
    static float hid[5 * 12], w[5 * 2], lg[5 * 8];
    static int32_t ids[5 * 2];
    static int64_t hshape[2] = { 5, 12 }, kshape[2] = { 5, 2 }, lshape[2] = { 5, 8 };
    for (int i = 0; i < 60; i++) hid[i] = (float)i * 0.25f - 3.f;
    for (int i = 0; i < 10; i++) ids[i] = i % 8, w[i] = 0.5f;
    for (int i = 0; i < 40; i++) lg[i] = (float)(i % 7) - 2.f;
    Moed__V1__ForwardRequest req = MOED__V1__FORWARD_REQUEST__INIT;
    Moed__V1__Tensor h, ti, tw, tl;
    moed__v1__tensor__init(&h);
    moed__v1__tensor__init(&ti);
    moed__v1__tensor__init(&tw);
    moed__v1__tensor__init(&tl);
    Moed__V1__ExpertChoice ec = MOED__V1__EXPERT_CHOICE__INIT;
    Moed__V1__RouterLogits rl = MOED__V1__ROUTER_LOGITS__INIT;
    Moed__V1__ServerRouter sr = MOED__V1__SERVER_ROUTER__INIT;
    Moed__V1__Gating g = MOED__V1__GATING__INIT;
    Moed__V1__BatchGating bg = MOED__V1__BATCH_GATING__INIT;
    req.request_id = "req-\xc3\xa9-42";
    req.layer = 300;
    h.dtype = MOED__V1__DTYPE__F32;
    h.n_shape = 2;
    h.shape = hshape;
    h.data = (ProtobufCBinaryData){ sizeof hid, (uint8_t *)hid };
    h.contents_case = MOED__V1__TENSOR__CONTENTS_DATA;
    req.hidden = &h;
    g.strategy = MOED__V1__STRATEGY__SIGMOID;
    g.top_k = 3;
    g.renormalize = MOED__V1__RENORMALIZE__RENORMALIZE_OFF;
    g.threshold = 0.25f;
    if (routing == MOED_ROUTING_EXPERTS) {
        ti.dtype = MOED__V1__DTYPE__I32;
        ti.n_shape = tw.n_shape = 2;
        ti.shape = tw.shape = kshape;
        ti.data = (ProtobufCBinaryData){ sizeof ids, (uint8_t *)ids };
        ti.contents_case = MOED__V1__TENSOR__CONTENTS_DATA;
        tw.dtype = MOED__V1__DTYPE__F32;
        tw.data = (ProtobufCBinaryData){ sizeof w, (uint8_t *)w };
        tw.contents_case = MOED__V1__TENSOR__CONTENTS_DATA;
        ec.expert_ids = &ti;
        ec.expert_weights = &tw;
        req.routing_case = MOED__V1__FORWARD_REQUEST__ROUTING_EXPERTS;
        req.experts = &ec;
    } else if (routing == MOED_ROUTING_LOGITS) {
        tl.dtype = MOED__V1__DTYPE__F32;
        tl.n_shape = 2;
        tl.shape = lshape;
        tl.data = (ProtobufCBinaryData){ sizeof lg, (uint8_t *)lg };
        tl.contents_case = MOED__V1__TENSOR__CONTENTS_DATA;
        rl.logits = &tl;
        rl.gating = &g;
        req.routing_case = MOED__V1__FORWARD_REQUEST__ROUTING_LOGITS;
        req.logits = &rl;
    } else if (routing == MOED_ROUTING_SERVER) {
        sr.gating = &g;
        req.routing_case = MOED__V1__FORWARD_REQUEST__ROUTING_SERVER_ROUTER;
        req.server_router = &sr;
    }
    if (batch) {
        bg.k_batch = 4;
        req.batch_gating = &bg;
    }
    size_t n = moed__v1__forward_request__get_packed_size(&req);
    CHECK(n <= cap);
    return moed__v1__forward_request__pack(&req, out);
}

static void test_round_trip(void)
{
    static const size_t chunks[] = { 1, 2, 3, 5, 7, 16, 64, 4096, 0 };
    static const int routings[] = { MOED_ROUTING_NONE, MOED_ROUTING_EXPERTS, MOED_ROUTING_LOGITS,
                                    MOED_ROUTING_SERVER };
    uint8_t msg[4096];
    for (int ri = 0; ri < 4; ri++)
        for (int batch = 0; batch < 2; batch++) {
            size_t n = pack_request(routings[ri], batch, msg, sizeof msg);
            for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
                grpc_slice sl[4096];
                size_t k = split(msg, n, chunks[c], sl, 4096);
                moed_wire_request q;
                moed_error err;
                CHECK_EQ_INT(moed_wire_decode_request(sl, k, &q, &err), 0);
                /* Values we put in, not only agreement with protobuf-c. */
                CHECK_EQ_INT(q.layer, 300);
                CHECK_EQ_INT(q.routing, routings[ri]);
                CHECK(q.hidden.present && q.hidden.dtype == MOED_F32 && q.hidden.n_shape == 2);
                CHECK(q.hidden.shape[0] == 5 && q.hidden.shape[1] == 12);
                float hid[60];
                CHECK_EQ_INT(q.hidden.data.len, sizeof hid);
                moed_span_copy(&q.hidden.data, hid);
                CHECK(hid[0] == -3.f && hid[59] == 59 * 0.25f - 3.f);
                CHECK(span_equals(&q.request_id, "req-\xc3\xa9-42", 9));
                CHECK_EQ_INT(q.batch_gating, batch);
                CHECK_EQ_INT(q.k_batch, batch ? 4 : 0);
                if (routings[ri] == MOED_ROUTING_LOGITS || routings[ri] == MOED_ROUTING_SERVER) {
                    CHECK_EQ_INT(q.gating.strategy, 2);
                    CHECK_EQ_INT(q.gating.top_k, 3);
                    CHECK_EQ_INT(q.gating.renormalize, 2);
                    CHECK(q.gating.threshold == 0.25f);
                }
                if (routings[ri] == MOED_ROUTING_EXPERTS) {
                    int32_t ids[10];
                    moed_span_copy(&q.expert_ids.data, ids);
                    CHECK(q.expert_ids.dtype == MOED_I32 && ids[9] == 1);
                    CHECK(q.expert_weights.data.len == 40 && q.expert_weights.shape[1] == 2);
                }
                free_slices(sl, k);
                decode_and_compare(msg, n, chunks[c], "reference request");
            }
        }
}

/* A Tensor written by hand: unpacked shape, an unknown field of each wire type in the middle. */
static void hand_tensor(buf *t, int dtype, const int64_t *shape, int nd, int packed,
                        const void *data, size_t n)
{
    t->n = 0;
    put_uint(t, 99, 12345);
    put_uint(t, 1, (uint64_t)dtype);
    if (packed) {
        buf s = { .n = 0 };
        for (int i = 0; i < nd; i++) put_varint(&s, (uint64_t)shape[i]);
        put_len(t, 2, s.d, s.n);
    } else {
        for (int i = 0; i < nd; i++) put_uint(t, 2, (uint64_t)shape[i]);
    }
    put_tag(t, 17, 5);
    put(t, "abcd", 4);
    put_tag(t, 18, 1);
    put(t, "abcdefgh", 8);
    put_tag(t, 19, 3); /* a group holding a varint, closed by its end tag */
    put_uint(t, 1, 7);
    put_tag(t, 19, 4);
    put_len(t, 3, data, n);
    put_len(t, 20, "unknown", 7);
}

static void test_hand_encoded(void)
{
    static buf m, t, sub, t2;
    float data[6] = { 1, 2, 3, 4, 5, 6 };
    int64_t shape[2] = { 2, 3 };
    moed_wire_request q;
    moed_error err;
    grpc_slice sl[4096];
    size_t k;

    /* Unpacked shape and unknown fields at every level; decoded alike at every slicing. */
    for (int packed = 0; packed < 2; packed++) {
        m.n = 0;
        hand_tensor(&t, MOED_BF16, shape, 2, packed, data, sizeof data);
        put_uint(&m, 2, 7);
        put_uint(&m, 1000, 1);
        put_len(&m, 3, t.d, t.n);
        sub.n = 0;
        put_uint(&sub, 9, 1); /* unknown inside ServerRouter */
        put_len(&m, 6, sub.d, sub.n);
        for (size_t c = 1; c <= 9; c += 4) {
            k = split(m.d, m.n, c, sl, 4096);
            CHECK_EQ_INT(moed_wire_decode_request(sl, k, &q, &err), 0);
            CHECK(q.hidden.dtype == MOED_BF16 && q.hidden.n_shape == 2 && q.hidden.shape[1] == 3);
            CHECK(span_equals(&q.hidden.data, data, sizeof data));
            CHECK(q.layer == 7 && q.routing == MOED_ROUTING_SERVER);
            free_slices(sl, k);
        }
    }

    /* A repeated sub-message merges: dtype and data last-wins, shape appends. */
    m.n = 0;
    hand_tensor(&t, MOED_F32, shape, 1, 1, "xxxx", 4);
    hand_tensor(&t2, MOED_F16, shape + 1, 1, 0, data, 8);
    put_len(&m, 3, t.d, t.n);
    put_uint(&m, 2, 1);
    put_len(&m, 3, t2.d, t2.n);
    put_uint(&m, 2, 4); /* layer last-wins */
    decode_and_compare(m.d, m.n, 1, "merged hidden");
    k = split(m.d, m.n, 3, sl, 4096);
    CHECK_EQ_INT(moed_wire_decode_request(sl, k, &q, &err), 0);
    CHECK(q.hidden.dtype == MOED_F16 && q.hidden.n_shape == 2);
    CHECK(q.hidden.shape[0] == 2 && q.hidden.shape[1] == 3 && q.layer == 4);
    CHECK(span_equals(&q.hidden.data, data, 8));
    free_slices(sl, k);

    /* The routing oneof: experts then logits leaves logits alone; logits twice merges. */
    m.n = 0;
    hand_tensor(&t, MOED_I32, shape, 2, 1, data, sizeof data);
    sub.n = 0;
    put_len(&sub, 1, t.d, t.n);
    put_len(&m, 4, sub.d, sub.n);
    sub.n = 0;
    put_len(&sub, 1, t.d, t.n);
    put_len(&m, 5, sub.d, sub.n);
    buf gating = { .n = 0 };
    put_uint(&gating, 2, 5);
    sub.n = 0;
    put_len(&sub, 2, gating.d, gating.n);
    put_len(&m, 5, sub.d, sub.n);
    decode_and_compare(m.d, m.n, 2, "oneof switch");
    k = split(m.d, m.n, 5, sl, 4096);
    CHECK_EQ_INT(moed_wire_decode_request(sl, k, &q, &err), 0);
    CHECK(q.routing == MOED_ROUTING_LOGITS && !q.expert_ids.present && q.logits.present);
    CHECK(q.gating.top_k == 5 && q.logits.dtype == MOED_I32);
    free_slices(sl, k);

    /* More dims than kept: counted, so validation can report the real rank. */
    m.n = 0;
    int64_t many[12] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 };
    hand_tensor(&t, MOED_F32, many, 12, 0, data, 4);
    put_len(&m, 3, t.d, t.n);
    k = split(m.d, m.n, 0, sl, 4096);
    CHECK_EQ_INT(moed_wire_decode_request(sl, k, &q, &err), 0);
    CHECK(q.hidden.n_shape == 12 && q.hidden.shape[7] == 8);
    free_slices(sl, k);

    /* The empty message and no slices at all: every field default. */
    CHECK_EQ_INT(moed_wire_decode_request(NULL, 0, &q, &err), 0);
    CHECK(!q.hidden.present && q.routing == MOED_ROUTING_NONE && q.bytes == 0);
}

static void expect_format_error(const uint8_t *d, size_t n, const char *needle, const char *what)
{
    grpc_slice sl[64];
    size_t k = split(d, n, 1, sl, 64);
    moed_wire_request q;
    moed_error err = { 0 };
    int rc = moed_wire_decode_request(sl, k, &q, &err);
    CHECK_MSG(rc == MOED_EFORMAT, "%s: code %d", what, rc);
    CHECK_MSG(strstr(err.msg, needle), "%s: message '%s' lacks '%s'", what, err.msg, needle);
    free_slices(sl, k);
}

static void test_malformed(void)
{
    uint8_t msg[4096];
    buf m;

    /* Every truncation of every reference request: we fail exactly when protobuf-c does. */
    for (int routing = 0; routing <= 6; routing += routing ? 1 : 4)
        for (int batch = 0; batch < 2; batch++) {
            size_t n = pack_request(routing, batch, msg, sizeof msg);
            int fails = 0;
            for (size_t cut = 0; cut < n; cut++) {
                Moed__V1__ForwardRequest *r = moed__v1__forward_request__unpack(NULL, cut, msg);
                int rc = decode_and_compare(msg, cut, cut % 3 + 1, "truncation");
                CHECK_MSG((rc == 0) == (r != NULL), "truncation at %zu: ours %d, protobuf-c %s",
                          cut, rc, r ? "ok" : "fails");
                fails += rc != 0;
                if (r) moed__v1__forward_request__free_unpacked(r, NULL);
            }
            CHECK(fails > (int)n / 2); /* most cuts land inside a field */
        }

    /* Huge lengths, overlong varints, bad tags. */
    m.n = 0;
    put_tag(&m, 3, 2);
    put_varint(&m, UINT64_MAX);
    expect_format_error(m.d, m.n, "runs past", "huge nested length");
    m.n = 0;
    put_tag(&m, 1, 2);
    put_varint(&m, (uint64_t)1 << 62);
    expect_format_error(m.d, m.n, "runs past", "huge string length");
    m.n = 0;
    put_tag(&m, 2, 0);
    put(&m, "\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11);
    expect_format_error(m.d, m.n, "varint", "11-byte varint");
    m.n = 0;
    put_tag(&m, 2, 0);
    put(&m, "\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7f", 10);
    expect_format_error(m.d, m.n, "64 bits", "varint over 64 bits");
    expect_format_error((const uint8_t *)"\x00", 1, "field number 0", "field 0");
    expect_format_error((const uint8_t *)"\x0e", 1, "invalid (6)", "known field, wire type 6");
    expect_format_error((const uint8_t *)"\x7e", 1, "invalid wire type",
                        "unknown field, wire type 6");
    expect_format_error((const uint8_t *)"\x0c", 1, "end-group", "stray end group");
    m.n = 0; /* a packed shape whose last varint crosses its end */
    buf t = { .n = 0 };
    put_tag(&t, 2, 2);
    put_varint(&t, 1);
    put(&t, "\x80\x01", 2);
    put_len(&m, 3, t.d, t.n);
    expect_format_error(m.d, m.n, "crosses", "packed shape overrun");

    /* Known fields with the wrong wire type name the field. */
    m.n = 0;
    put_len(&m, 2, "x", 1);
    expect_format_error(m.d, m.n, "ForwardRequest.layer", "layer as bytes");
    m.n = 0;
    put_uint(&m, 3, 5);
    expect_format_error(m.d, m.n, "ForwardRequest.hidden", "hidden as varint");
    m.n = 0;
    t.n = 0;
    put_uint(&t, 3, 5);
    put_len(&m, 3, t.d, t.n);
    expect_format_error(m.d, m.n, "Tensor.data", "data as varint");
    m.n = 0;
    t.n = 0;
    put_uint(&t, 4, 5);
    buf sub = { .n = 0 };
    put_len(&sub, 1, t.d, t.n);
    put_len(&m, 6, sub.d, sub.n);
    expect_format_error(m.d, m.n, "Gating.threshold", "threshold as varint");

    /* Random bytes, random slicing: never a crash, only success or EFORMAT, and where
     * protobuf-c parses them we agree field by field. */
    for (int iter = 0; iter < 20000; iter++) {
        size_t n = rnd() % 200;
        for (size_t i = 0; i < n; i++) msg[i] = (uint8_t)rnd();
        decode_and_compare(msg, n, 0, "random bytes");
    }
    /* Random mutations of a valid request reach deeper into the schema. */
    for (int iter = 0; iter < 20000; iter++) {
        size_t n = pack_request((int)(rnd() % 3) + 4, (int)(rnd() % 2), msg, sizeof msg);
        for (int j = 0, flips = 1 + (int)(rnd() % 4); j < flips; j++)
            msg[rnd() % n] = (uint8_t)rnd();
        decode_and_compare(msg, n, 0, "mutated request");
    }
}

static void test_response(void)
{
    int16_t out[3 * 4];
    for (int i = 0; i < 12; i++) out[i] = (int16_t)(i * 1000 - 5000);
    int32_t set[3] = { 7, 0, 3 };
    moed_wire_response r = { .request_id = "abc",
                             .request_id_len = 3,
                             .dtype = MOED_BF16,
                             .rows = 3,
                             .cols = 4,
                             .expert_set = set,
                             .n_expert_set = 3,
                             .timings = { 11, 22, 333, 44, 5 } };
    grpc_slice data = grpc_slice_malloc(sizeof out);
    memcpy(GRPC_SLICE_START_PTR(data), out, sizeof out);
    grpc_byte_buffer *bb = moed_wire_encode_response(&r, data);
    CHECK(bb != NULL);
    CHECK_EQ_INT(bb->data.raw.slice_buffer.count, 3);
    ProtobufCMessage *m;
    moed_error err;
    CHECK_EQ_INT(moed_wire_unpack(&moed__v1__forward_response__descriptor, bb, &m, &err), 0);
    Moed__V1__ForwardResponse *resp = (Moed__V1__ForwardResponse *)m;
    CHECK(!strcmp(resp->request_id, "abc"));
    CHECK(resp->output && resp->output->dtype == MOED__V1__DTYPE__BF16);
    CHECK(resp->output->n_shape == 2 && resp->output->shape[0] == 3 && resp->output->shape[1] == 4);
    CHECK(resp->output->data.len == sizeof out &&
          !memcmp(resp->output->data.data, out, sizeof out));
    CHECK(resp->n_expert_set == 3 && resp->expert_set[0] == 7 && resp->expert_set[2] == 3);
    CHECK(resp->timings && resp->timings->queue_us == 11 && resp->timings->compute_us == 22);
    CHECK(resp->timings->total_us == 333 && resp->timings->batch_tokens == 44);
    CHECK(resp->timings->batch_requests == 5);
    protobuf_c_message_free_unpacked(m, NULL);
    grpc_byte_buffer_destroy(bb);

    /* No request id, no expert set, all-zero timings: still a valid message. */
    moed_wire_response r0 = { .dtype = MOED_F32, .rows = 1, .cols = 1 };
    data = grpc_slice_malloc(4);
    memset(GRPC_SLICE_START_PTR(data), 0, 4);
    bb = moed_wire_encode_response(&r0, data);
    CHECK_EQ_INT(moed_wire_unpack(&moed__v1__forward_response__descriptor, bb, &m, &err), 0);
    resp = (Moed__V1__ForwardResponse *)m;
    CHECK(resp->request_id[0] == 0 && resp->n_expert_set == 0 && resp->output->data.len == 4);
    protobuf_c_message_free_unpacked(m, NULL);
    grpc_byte_buffer_destroy(bb);
}

static void test_byte_buffers(void)
{
    /* A multi-slice byte buffer, opened as the server sees it, decodes with spans into it. */
    uint8_t msg[4096];
    size_t n = pack_request(MOED_ROUTING_EXPERTS, 0, msg, sizeof msg);
    grpc_slice sl[4096];
    size_t k = split(msg, n, 13, sl, 4096);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(sl, k);
    free_slices(sl, k);
    moed_wire_msg wm;
    moed_wire_request q;
    moed_error err;
    CHECK_EQ_INT(moed_wire_msg_open(&wm, bb, &err), 0);
    CHECK(wm.n_slices > 1);
    CHECK_EQ_INT(moed_wire_decode_request(wm.slices, wm.n_slices, &q, &err), 0);
    CHECK(q.routing == MOED_ROUTING_EXPERTS && q.hidden.data.len == 240);
    moed_wire_msg_close(&wm);
    grpc_byte_buffer_destroy(bb);

    /* protobuf-c pack and unpack through byte buffers; garbage fails with EFORMAT. */
    Moed__V1__ModelInfo mi = MOED__V1__MODEL_INFO__INIT;
    mi.model = "layers=2";
    mi.max_batch_tokens = 77;
    bb = moed_wire_pack(&mi.base);
    ProtobufCMessage *m;
    CHECK_EQ_INT(moed_wire_unpack(&moed__v1__model_info__descriptor, bb, &m, &err), 0);
    CHECK(((Moed__V1__ModelInfo *)m)->max_batch_tokens == 77);
    protobuf_c_message_free_unpacked(m, NULL);
    grpc_byte_buffer_destroy(bb);
    CHECK_EQ_INT(moed_wire_unpack(&moed__v1__model_info__descriptor, NULL, &m, &err), 0);
    protobuf_c_message_free_unpacked(m, NULL);
    grpc_slice bad = grpc_slice_from_static_string("\x0a\xff");
    bb = grpc_raw_byte_buffer_create(&bad, 1);
    CHECK_EQ_INT(moed_wire_unpack(&moed__v1__model_info__descriptor, bb, &m, &err), MOED_EFORMAT);
    grpc_byte_buffer_destroy(bb);
}

/* An unknown group `depth` deep (field f), a varint innermost. */
static void put_group(buf *b, uint32_t f, int depth)
{
    put_tag(b, f, 3);
    if (depth > 1)
        put_group(b, f, depth - 1);
    else
        put_uint(b, 1, 7);
    put_tag(b, f, 4);
}

static void test_groups(void)
{
    static buf m, sub;
    uint8_t msg[4096];
    moed_wire_request q;
    moed_error err;
    grpc_slice sl;

    /* Groups nest as deep as protobuf's own parsers read them (100), not one level more. */
    for (int depth = 99; depth <= 101; depth++) {
        m.n = 0;
        put_group(&m, 30, depth);
        size_t n = pack_request(MOED_ROUTING_EXPERTS, 0, msg, sizeof msg);
        put(&m, msg, n);
        sl = grpc_slice_from_copied_buffer((const char *)m.d, m.n);
        int rc = moed_wire_decode_request(&sl, 1, &q, &err);
        grpc_slice_unref(sl);
        CHECK_MSG(depth <= 100 ? rc == 0 : rc == MOED_EFORMAT, "depth %d: %d", depth, rc);
        if (depth > 100) CHECK(strstr(err.msg, "groups nested deeper than 100"));
    }

    /* protobuf-c messages: groups dropped at the top and inside a known sub-message, nothing else
     * changed (a string, a 64-bit and a 32-bit unknown field stay). */
    m.n = sub.n = 0;
    put_uint(&m, 1, 41); /* seq */
    put_group(&m, 9, 100);
    put_group(&sub, 7, 3);
    put_len(&sub, 1, "/moed-x", 7);
    put_tag(&sub, 12, 1);
    put(&sub, "abcdefgh", 8);
    put_uint(&sub, 2, 4096);
    put_group(&sub, 7, 1);
    put_len(&m, 2, sub.d, sub.n); /* register_host */
    put_tag(&m, 13, 5);
    put(&m, "wxyz", 4);
    ProtobufCMessage *pm;
    CHECK(!moed__v1__region_command__unpack(NULL, m.n, m.d)); /* protobuf-c alone refuses */
    CHECK_EQ_INT(moed_wire_unpack_bytes(&moed__v1__region_command__descriptor, m.d, m.n, &pm, &err),
                 0);
    const Moed__V1__RegionCommand *c = (const Moed__V1__RegionCommand *)pm;
    CHECK(c->seq == 41 && c->command_case == MOED__V1__REGION_COMMAND__COMMAND_REGISTER_HOST);
    CHECK(!strcmp(c->register_host->name, "/moed-x") && c->register_host->bytes == 4096);
    CHECK(c->base.n_unknown_fields == 1 && c->register_host->base.n_unknown_fields == 1);
    protobuf_c_message_free_unpacked(pm, NULL);
    CHECK_EQ_INT(moed_wire_find_uint(m.d, m.n, 1), 41);

    /* What does not parse says where and why, and still names its seq. */
    m.n = 0;
    put_uint(&m, 1, 5);
    put_group(&m, 9, 101);
    CHECK_EQ_INT(moed_wire_unpack_bytes(&moed__v1__region_command__descriptor, m.d, m.n, &pm, &err),
                 MOED_EFORMAT);
    CHECK(!pm && strstr(err.msg, "moed.v1.RegionCommand") && strstr(err.msg, "deeper than 100"));
    CHECK_EQ_INT(moed_wire_find_uint(m.d, m.n, 1), 5);
    m.n = 0;
    put_uint(&m, 1, 6);
    put_tag(&m, 9, 3); /* never closed */
    CHECK_EQ_INT(moed_wire_unpack_bytes(&moed__v1__region_command__descriptor, m.d, m.n, &pm, &err),
                 MOED_EFORMAT);
    CHECK_EQ_INT(moed_wire_find_uint(m.d, m.n, 1), 6);
    CHECK_EQ_INT(moed_wire_find_uint((const uint8_t *)"\xff", 1, 1), 0);
}

int main(void)
{
    grpc_init();
    test_round_trip();
    test_hand_encoded();
    test_malformed();
    test_response();
    test_byte_buffers();
    test_groups();
    grpc_shutdown();
    return check_status("test_wire");
}
