/*
 * test_request — ForwardRequest validation: requests built with protobuf-c (as clients build
 * them), decoded by wire.c, validated against two resident layers. Each mistake gets its status
 * code and a message naming the field and values; good requests give the work the scheduler
 * needs (route, server-logits flag, resolved gating, batch k, copied logits). A request's expect
 * is held against what the daemon serves.
 */
#include "check.h"
#include "moed_dtype.h"
#include "request.h"
#include "wire.h"

#include "moed/v1/moed.pb-c.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static moed_layer layers[2];
static const moed_layer *ptrs[2] = { &layers[0], &layers[1] };
static const moed_served served = { .layers = ptrs,
                                    .n_layers = 2,
                                    .max_batch_tokens = 64,
                                    .max_batch_pairs = 100,
                                    .max_message_bytes = 1 << 20,
                                    .fingerprint = 0xabc };
static float router[1];
/* No request here names a region: asking for the principal is a failure of the test. */
static int no_principal(void *ctx, moed_principal *out, moed_error *err)
{
    return moed_fail(err, MOED_EINTERNAL,
                     "the principal was asked for by a request without regions");
}

static const moed_caller anyone = { .local = true, .principal = no_principal };

/* A request under construction: hidden [T, d] F32 for layer, then the routing the test sets. */
typedef struct build {
    Moed__V1__ForwardRequest req;
    Moed__V1__Tensor hidden, ids, w, logits;
    Moed__V1__ExpertChoice ec;
    Moed__V1__RouterLogits rl;
    Moed__V1__ServerRouter sr;
    Moed__V1__Gating g;
    Moed__V1__BatchGating bg;
    int64_t hshape[2], kshape[2], lshape[2];
    float x[70 * 8], wt[70 * 2], lg[70 * 8];
    int32_t id[70 * 2];
} build;

static void init_build(build *b, uint32_t layer, int64_t T, int64_t d)
{
    memset(b, 0, sizeof *b);
    moed__v1__forward_request__init(&b->req);
    moed__v1__tensor__init(&b->hidden);
    moed__v1__tensor__init(&b->ids);
    moed__v1__tensor__init(&b->w);
    moed__v1__tensor__init(&b->logits);
    moed__v1__expert_choice__init(&b->ec);
    moed__v1__router_logits__init(&b->rl);
    moed__v1__server_router__init(&b->sr);
    moed__v1__gating__init(&b->g);
    moed__v1__batch_gating__init(&b->bg);
    b->req.layer = layer;
    b->req.request_id = "id-1";
    for (int i = 0; i < 70 * 8; i++) b->x[i] = (float)(i % 13) * 0.125f - 0.5f;
    for (int i = 0; i < 70 * 8; i++) b->lg[i] = (float)((i * 7) % 11) * 0.3f;
    b->hshape[0] = T;
    b->hshape[1] = d;
    b->hidden.dtype = MOED__V1__DTYPE__F32;
    b->hidden.n_shape = 2;
    b->hidden.shape = b->hshape;
    b->hidden.data = (ProtobufCBinaryData){ (size_t)(T * d) * 4, (uint8_t *)b->x };
    b->hidden.contents_case = MOED__V1__TENSOR__CONTENTS_DATA;
    b->req.hidden = &b->hidden;
}

static void set_choice(build *b, int64_t T, int64_t k)
{
    for (int i = 0; i < T * k; i++) b->id[i] = i % 8, b->wt[i] = 0.5f;
    b->kshape[0] = T;
    b->kshape[1] = k;
    b->ids.dtype = MOED__V1__DTYPE__I32;
    b->ids.n_shape = b->w.n_shape = 2;
    b->ids.shape = b->w.shape = b->kshape;
    b->ids.data = (ProtobufCBinaryData){ (size_t)(T * k) * 4, (uint8_t *)b->id };
    b->ids.contents_case = MOED__V1__TENSOR__CONTENTS_DATA;
    b->w.dtype = MOED__V1__DTYPE__F32;
    b->w.data = (ProtobufCBinaryData){ (size_t)(T * k) * 4, (uint8_t *)b->wt };
    b->w.contents_case = MOED__V1__TENSOR__CONTENTS_DATA;
    b->ec.expert_ids = &b->ids;
    b->ec.expert_weights = &b->w;
    b->req.routing_case = MOED__V1__FORWARD_REQUEST__ROUTING_EXPERTS;
    b->req.experts = &b->ec;
}

static void set_logits(build *b, int64_t T, int64_t E)
{
    b->lshape[0] = T;
    b->lshape[1] = E;
    b->logits.dtype = MOED__V1__DTYPE__F32;
    b->logits.n_shape = 2;
    b->logits.shape = b->lshape;
    b->logits.data = (ProtobufCBinaryData){ (size_t)(T * E) * 4, (uint8_t *)b->lg };
    b->logits.contents_case = MOED__V1__TENSOR__CONTENTS_DATA;
    b->rl.logits = &b->logits;
    b->rl.gating = &b->g;
    b->req.routing_case = MOED__V1__FORWARD_REQUEST__ROUTING_LOGITS;
    b->req.logits = &b->rl;
}

/* Packs, decodes (over 7-byte slices) and validates; returns the code, fills w and err. */
static int validate(build *b, moed_work *w, moed_error *err)
{
    static uint8_t buf[1 << 16];
    size_t n = moed__v1__forward_request__pack(&b->req, buf);
    grpc_slice sl[1 << 14];
    size_t k = 0;
    for (size_t off = 0; off < n; off += 7)
        sl[k++] = grpc_slice_from_copied_buffer((const char *)buf + off, n - off < 7 ? n - off : 7);
    moed_wire_request q;
    int rc = moed_wire_decode_request(sl, k, &q, err);
    CHECK_EQ_INT(rc, 0);
    memset(err, 0, sizeof *err);
    rc = moed_request_validate(&served, &anyone, &q, w, err);
    if (!rc) {
        /* The item's copy_in must still read hidden's bytes: copy while the slices live. */
        float x[70 * 8];
        CHECK_EQ_INT(w->item.copy_in(&w->item, x, err), 0);
        CHECK(!memcmp(x, b->x, w->hidden.len));
    }
    for (size_t i = 0; i < k; i++) grpc_slice_unref(sl[i]);
    CHECK_MSG(rc == err->code || (!rc && !err->code), "code %d but err.code %d", rc, err->code);
    return rc;
}

static void expect(build *b, int code, const char *n1, const char *n2, const char *what)
{
    moed_work w;
    moed_error err;
    int rc = validate(b, &w, &err);
    CHECK_MSG(rc == code, "%s: code %d, wanted %d (%s)", what, rc, code, err.msg);
    CHECK_MSG(strstr(err.msg, n1) && strstr(err.msg, n2), "%s: '%s' lacks '%s' or '%s'", what,
              err.msg, n1, n2);
    moed_work_free(&w);
}

static void test_good(void)
{
    build b;
    moed_work w;
    moed_error err;

    init_build(&b, 7, 5, 8);
    set_choice(&b, 5, 2);
    b.id[3] = -1;
    b.wt[3] = 0; /* padding */
    CHECK_EQ_INT(validate(&b, &w, &err), 0);
    CHECK(w.item.slot == 1 && w.item.layer == &layers[1] && w.item.T == 5 &&
          w.item.dtype == MOED_F32);
    CHECK(!strcmp(w.request_id, "id-1") && w.request_id_len == 4);
    CHECK(w.item.route.off && w.item.route.T == 5 && w.item.route.off[5] == 9 &&
          !w.item.server_logits && !w.item.k_batch && w.item.pairs == 9);
    moed_work_free(&w);

    /* Client logits, top-2 softmax: the route is what moed_gate gives for them. */
    init_build(&b, 3, 4, 8);
    set_logits(&b, 4, 8);
    b.g.strategy = MOED__V1__STRATEGY__TOPK;
    b.g.top_k = 2;
    CHECK_EQ_INT(validate(&b, &w, &err), 0);
    moed_gate_params p = { MOED_GATE_TOPK, 2, MOED_RENORM_DEFAULT, 0 };
    moed_route want;
    CHECK_EQ_INT(moed_gate(&p, &layers[0].info, NULL, b.lg, 4, &want, &err), 0);
    CHECK(w.item.route.off && w.item.route.off[4] == want.off[4]);
    CHECK(!memcmp(w.item.route.expert, want.expert, (size_t)want.off[4] * 4));
    CHECK(!memcmp(w.item.route.weight, want.weight, (size_t)want.off[4] * 4));
    moed_route_free(&want);
    moed_work_free(&w);

    /* Batch gating with client logits: k resolved (0 = top_k), logits copied for the worker. */
    init_build(&b, 3, 4, 8);
    set_logits(&b, 4, 8);
    b.req.batch_gating = &b.bg;
    CHECK_EQ_INT(validate(&b, &w, &err), 0);
    CHECK(w.item.k_batch == 2 && w.item.logits && !memcmp(w.item.logits, b.lg, 4 * 8 * 4) &&
          !w.item.route.off);
    moed_work_free(&w);

    /* The server router: gating resolved to the layer's defaults. */
    init_build(&b, 3, 2, 8);
    b.req.routing_case = MOED__V1__FORWARD_REQUEST__ROUTING_SERVER_ROUTER;
    b.req.server_router = &b.sr;
    CHECK_EQ_INT(validate(&b, &w, &err), 0);
    CHECK(w.item.server_logits && w.item.gate.top_k == 2 &&
          w.item.gate.renormalize == MOED_RENORM_ON && w.item.pairs == 4);
    moed_work_free(&w);
}

/* --max-batch-pairs (100 here): the (token, expert) pairs a request routes are counted where the
 * route is known, padding excluded, and refused over the bound with RESOURCE_EXHAUSTED naming the
 * flag; server-gated requests whose count only the worker knows carry their most (T x experts). */
static void test_pairs(void)
{
    build b;
    moed_work w;
    moed_error err;

    init_build(&b, 3, 60, 8);
    set_choice(&b, 60, 2);
    expect(&b, MOED_ETOOBIG, "120 (token, expert) pairs", "--max-batch-pairs = 100", "choice");

    moed_served unbounded = served; /* 0: no bound (what a caller that sets none gets) */
    unbounded.max_batch_pairs = 0;
    static uint8_t buf[1 << 16];
    grpc_slice sl = grpc_slice_from_copied_buffer((const char *)buf,
                                                  moed__v1__forward_request__pack(&b.req, buf));
    moed_wire_request q;
    CHECK_EQ_INT(moed_wire_decode_request(&sl, 1, &q, &err), 0);
    CHECK_EQ_INT(moed_request_validate(&unbounded, &anyone, &q, &w, &err), 0);
    CHECK(w.item.pairs == 120);
    moed_work_free(&w);
    grpc_slice_unref(sl);

    for (int t = 0; t < 30; t++) b.id[2 * t + 1] = -1, b.wt[2 * t + 1] = 0; /* padding: free */
    CHECK_EQ_INT(validate(&b, &w, &err), 0);
    CHECK(w.item.pairs == 90 && w.item.route.off[60] == 90);
    moed_work_free(&w);

    /* Sigmoid gating of client logits keeps every expert over the threshold: 20 x 8. */
    init_build(&b, 3, 20, 8);
    set_logits(&b, 20, 8);
    b.g.strategy = MOED__V1__STRATEGY__SIGMOID;
    b.g.threshold = 1e-6f;
    expect(&b, MOED_ETOOBIG, "160 (token, expert) pairs", "--max-batch-pairs", "sigmoid");

    /* Batch gating: T x k_batch, known before the worker. */
    init_build(&b, 3, 20, 8);
    set_logits(&b, 20, 8);
    b.req.batch_gating = &b.bg;
    b.bg.k_batch = 8;
    expect(&b, MOED_ETOOBIG, "160 (token, expert) pairs (T x k_batch)", "--max-batch-pairs",
           "batch gating");

    /* The server router with top-k gating keeps exactly k: refused here. */
    init_build(&b, 3, 20, 8);
    b.req.routing_case = MOED__V1__FORWARD_REQUEST__ROUTING_SERVER_ROUTER;
    b.req.server_router = &b.sr;
    b.sr.gating = &b.g;
    b.g.strategy = MOED__V1__STRATEGY__TOPK;
    b.g.top_k = 8;
    expect(&b, MOED_ETOOBIG, "(T x top_k)", "--max-batch-pairs", "server top-k");

    /* With sigmoid gating only the worker knows: accepted, planned at its most. */
    b.g.strategy = MOED__V1__STRATEGY__SIGMOID;
    b.g.top_k = 0;
    CHECK_EQ_INT(validate(&b, &w, &err), 0);
    CHECK(w.item.server_logits && w.item.pairs == 20 * 8);
    moed_work_free(&w);
}

static void test_errors(void)
{
    build b;
    init_build(&b, 5, 2, 8);
    set_choice(&b, 2, 2);
    expect(&b, MOED_ENOTFOUND, "layer 5", "3,7", "unknown layer");

    init_build(&b, 3, 0, 8);
    set_choice(&b, 0, 2);
    expect(&b, MOED_EINVAL, "T = 0", "at least one", "no tokens");

    init_build(&b, 3, 65, 8);
    set_choice(&b, 65, 2);
    expect(&b, MOED_ETOOBIG, "T = 65", "--max-batch-tokens = 64", "too many tokens");

    init_build(&b, 3, 2, 6);
    set_choice(&b, 2, 2);
    expect(&b, MOED_EINVAL, "[2, 6]", "[T, 8]", "wrong d_model");

    init_build(&b, 3, 2, 8);
    b.hidden.dtype = MOED__V1__DTYPE__I32;
    set_choice(&b, 2, 2);
    expect(&b, MOED_EINVAL, "dtype i32", "F32, F16 or BF16", "int hidden");

    init_build(&b, 3, 2, 8);
    b.hidden.data.len -= 2;
    set_choice(&b, 2, 2);
    expect(&b, MOED_EINVAL, "62 data bytes", "exactly 64", "short hidden");

    init_build(&b, 3, 2, 8);
    b.req.hidden = NULL;
    set_choice(&b, 2, 2);
    expect(&b, MOED_EINVAL, "hidden is missing", "[T, 8]", "no hidden");

    init_build(&b, 3, 2, 8);
    expect(&b, MOED_EINVAL, "no routing", "server_router", "no routing");

    init_build(&b, 3, 2, 8);
    set_choice(&b, 3, 2);
    expect(&b, MOED_EINVAL, "expert_ids has shape [3, 2]", "T = 2", "ids rows");

    init_build(&b, 3, 2, 8);
    set_choice(&b, 2, 2);
    b.ids.dtype = MOED__V1__DTYPE__F32;
    expect(&b, MOED_EINVAL, "expert_ids has dtype f32", "i32", "ids dtype");

    init_build(&b, 3, 2, 8);
    set_choice(&b, 2, 2);
    b.w.data.len = 12;
    expect(&b, MOED_EINVAL, "expert_weights has 12 data bytes", "16", "weights size");

    init_build(&b, 3, 2, 8);
    set_choice(&b, 2, 2);
    b.id[1] = 8;
    expect(&b, MOED_EINVAL, "expert_ids[0][1] is out of range", "[0, 8)", "id out of range");

    init_build(&b, 3, 2, 8);
    set_choice(&b, 2, 2);
    b.wt[2] = NAN;
    expect(&b, MOED_EINVAL, "expert_weights[1][0]", "finite", "NaN weight");

    init_build(&b, 3, 2, 8);
    set_choice(&b, 2, 2);
    b.req.batch_gating = &b.bg;
    expect(&b, MOED_EINVAL, "batch_gating", "experts", "batch gating with experts");

    init_build(&b, 3, 2, 8);
    set_logits(&b, 2, 7);
    expect(&b, MOED_EINVAL, "logits.logits has shape [2, 7]", "num_experts = 8", "logits shape");

    init_build(&b, 3, 2, 8);
    set_logits(&b, 2, 8);
    b.g.strategy = 9;
    expect(&b, MOED_EINVAL, "gating", "strategy 9", "unknown strategy");

    init_build(&b, 3, 2, 8);
    set_logits(&b, 2, 8);
    b.g.renormalize = 5;
    expect(&b, MOED_EINVAL, "renormalize = 5", "2 (off)", "unknown renormalize");

    init_build(&b, 3, 2, 8);
    set_logits(&b, 2, 8);
    b.g.top_k = 9;
    expect(&b, MOED_EINVAL, "top_k", "9", "top_k over E");

    init_build(&b, 3, 2, 8);
    set_logits(&b, 2, 8);
    b.lg[3] = INFINITY;
    b.req.batch_gating = &b.bg;
    expect(&b, MOED_EINVAL, "logits[0][3]", "finite", "Inf logits for batch gating");

    init_build(&b, 3, 2, 8);
    set_logits(&b, 2, 8);
    b.bg.k_batch = 9;
    b.req.batch_gating = &b.bg;
    expect(&b, MOED_EINVAL, "k_batch = 9", "1..8", "k_batch over E");

    init_build(&b, 7, 2, 8);
    b.req.routing_case = MOED__V1__FORWARD_REQUEST__ROUTING_SERVER_ROUTER;
    b.req.server_router = &b.sr;
    expect(&b, MOED_EINVAL, "layer 7 has no router", "has_router", "no router weights");

    char long_id[200];
    memset(long_id, 'a', sizeof long_id - 1);
    long_id[199] = 0;
    init_build(&b, 3, 2, 8);
    set_choice(&b, 2, 2);
    b.req.request_id = long_id;
    expect(&b, MOED_EINVAL, "199 bytes", "128", "long request id");

    init_build(&b, 3, 2, 8);
    set_choice(&b, 2, 2);
    b.req.request_id = "bad\xff\xfeutf8";
    expect(&b, MOED_EINVAL, "request_id", "UTF-8", "bad UTF-8");

    /* Over the message limit: checked before anything else. */
    moed_wire_request q = { .bytes = (1 << 20) + 1 };
    moed_work w;
    moed_error err;
    CHECK_EQ_INT(moed_request_validate(&served, &anyone, &q, &w, &err), MOED_ETOOBIG);
    CHECK(strstr(err.msg, "1048577") && strstr(err.msg, "--max-message-bytes"));
    moed_work_free(&w);
}

/* ForwardRequest.expect: checked part by part when given, before the layer; a daemon that differs
 * says what it serves and what was expected. */
static void test_expect(void)
{
    Moed__V1__Expectation x;
    Moed__V1__ExpertRange r[20], *rp[20];
    for (int i = 0; i < 20; i++) {
        moed__v1__expert_range__init(&r[i]);
        r[i].first = r[i].last = (uint32_t)(2 * i);
        rp[i] = &r[i];
    }
    build b;
    moed_work w;
    moed_error err;
    const struct {
        uint64_t fp;
        uint32_t first, last;
        int n_ranges;
        bool adds;
        uint32_t layer;
        int code;
        const char *n1, *n2;
    } cases[] = {
        { 0xabc, 0, 7, 1, true, 3, 0, "", "" },
        { 0, 0, 0, 0, false, 3, 0, "", "" },     /* present, nothing to check */
        { 0xabc, 0, 7, 1, false, 3, 0, "", "" }, /* no shared experts: the role is moot */
        { 0xabd, 0, 7, 1, true, 3, MOED_EPRECOND,
          "serves model 0000000000000abc, experts 0-7 of layer 3",
          "expects model 0000000000000abd" },
        { 0, 0, 3, 1, true, 3, MOED_EPRECOND, "experts 0-7 of layer 3",
          "expects any model, experts 0-3" },
        { 0xabc, 0, 7, 1, true, 5, MOED_EPRECOND, "not layer 5 (its layers are 3,7)",
          "experts 0-7" },
        { 0xabc, 0, 0, 20, true, 3, MOED_EPRECOND, "0,2,4,6,8,10,12,14 and 12 more ranges",
          "ask again" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        init_build(&b, cases[i].layer, 2, 8);
        set_choice(&b, 2, 2);
        moed__v1__expectation__init(&x);
        x.model_fingerprint = cases[i].fp;
        x.adds_shared_experts = cases[i].adds;
        r[0] = (Moed__V1__ExpertRange)MOED__V1__EXPERT_RANGE__INIT;
        r[0].first = cases[i].n_ranges == 1 ? cases[i].first : 0;
        r[0].last = cases[i].n_ranges == 1 ? cases[i].last : 0;
        x.n_experts_held = (size_t)cases[i].n_ranges;
        x.experts_held = rp;
        b.req.expect = &x;
        if (!cases[i].code) {
            CHECK_MSG(validate(&b, &w, &err) == 0, "case %zu: %s", i, err.msg);
            moed_work_free(&w);
        } else {
            expect(&b, cases[i].code, cases[i].n1, cases[i].n2, "expect");
        }
    }
}

int main(void)
{
    for (int i = 0; i < 2; i++)
        layers[i].info = (moed_layer_info){ .index = i ? 7 : 3,
                                            .d_model = 8,
                                            .d_ff = 16,
                                            .n_experts = 8,
                                            .top_k = 2,
                                            .act = MOED_ACT_SWIGLU,
                                            .wdtype = MOED_BF16,
                                            .has_router = i == 0,
                                            .norm_topk = true,
                                            .rule = MOED_RULE_SOFTMAX_TOPK,
                                            .n_group = 1,
                                            .topk_group = 1,
                                            .routed_scale = 1 };
    layers[0].router = router;
    test_good();
    test_errors();
    test_pairs();
    test_expect();
    return check_status("test_request");
}
