/*
 * test_shard — expert shards (moed --experts): which experts and shared ones a shard holds, its
 * maps and ranges, routes renumbered for the backend, synthetic weights generated for the held
 * experts only and equal to the whole layer's, where the held experts live in the whole numbering,
 * the CPU backend on two shards' views adding up to
 * the whole layer (with the same server-router logits), and the tokens-per-expert metric.
 */
#include "check.h"
#include "config.h"
#include "cpu_backend.h"
#include "metrics.h"
#include "moed_dtype.h"
#include "moed_synth.h"
#include "shard.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const SPEC =
    "layers=1,d=32,ff=48,experts=8,topk=2,act=swiglu,dtype=bf16,seed=7,shared=1,shared_ff=16";

/* --experts and --shared-experts on the command line. */
static void test_flags(void)
{
    moed_config c;
    moed_error err = { 0 };
    char *argv[] = { "moed", "--experts", "4-5,0,9", "--shared-experts", "off", NULL };
    CHECK_EQ_INT(moed_config_load(&c, 5, argv, stdout, &err), MOED_CONFIG_RUN);
    CHECK(c.experts.n == 4 && c.experts.v[0] == 0 && c.experts.v[1] == 4 && c.experts.v[3] == 9 &&
          !strcmp(c.experts.text, "4-5,0,9"));
    CHECK(!strcmp(c.shared_experts, "off") && !c.layers.text);
    moed_config_free(&c);
    char *plain[] = { "moed", NULL };
    CHECK_EQ_INT(moed_config_load(&c, 1, plain, stdout, &err), MOED_CONFIG_RUN);
    CHECK(!c.experts.text && !c.experts.v && !strcmp(c.shared_experts, "auto"));
    moed_config_free(&c);
    char *bad[] = { "moed", "--experts", "3-1", NULL };
    CHECK_EQ_INT(moed_config_load(&c, 3, bad, stdout, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "--experts") && strstr(err.msg, "'3-1'"), "%s", err.msg);
    moed_config_free(&c);
    char *word[] = { "moed", "--shared-experts", "maybe", NULL };
    CHECK_EQ_INT(moed_config_load(&c, 3, word, stdout, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "auto|on|off"), "%s", err.msg);
    moed_config_free(&c);
}

static void test_subset(void)
{
    static const int zero_on[] = { 0, 3 }, later[] = { 2, 5 };
    moed_expert_subset s = moed_shard_subset(NULL, 0, "auto");
    CHECK(!s.ids && s.shared && moed_expert_subset_has(&s, 7));
    s = moed_shard_subset(zero_on, 2, "auto");
    CHECK(s.shared && moed_expert_subset_has(&s, 3) && !moed_expert_subset_has(&s, 1));
    CHECK(!moed_shard_subset(later, 2, "auto").shared);
    CHECK(moed_shard_subset(later, 2, "on").shared);
    CHECK(!moed_shard_subset(zero_on, 2, "off").shared);
    CHECK(!moed_shard_subset(NULL, 0, "off").shared);

    moed_layer_info li = { .index = 4, .n_experts = 4 };
    moed_error err = { 0 };
    s = moed_shard_subset(later, 2, "auto");
    CHECK_EQ_INT(moed_expert_subset_check(&s, &li, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "expert 5") && strstr(err.msg, "4 experts (0-3)"), "%s", err.msg);
    li.n_experts = 6;
    CHECK_EQ_INT(moed_expert_subset_check(&s, &li, &err), 0);
    CHECK_EQ_INT(moed_expert_subset_check(NULL, &li, &err), 0);
}

static void test_maps(void)
{
    moed_synth_spec spec;
    moed_error err = { 0 };
    moed_layer full;
    CHECK_EQ_INT(moed_synth_parse(SPEC, &spec, &err), 0);
    CHECK_EQ_INT(moed_synth_layer(&spec, 0, &full, &err), 0);
    static const int ids[] = { 1, 2, 3, 6 };
    moed_expert_subset held = moed_shard_subset(ids, 4, "auto");
    moed_shard sh;
    CHECK_EQ_INT(moed_shard_make(&full, &held, &sh, &err), 0);
    CHECK(!moed_shard_all_experts(&sh) && !sh.adds_shared && sh.n_held == 4);
    CHECK(sh.view.info.n_experts == 4 && sh.view.info.router_experts == 8);
    CHECK(moed_layer_router_experts(&sh.view.info) == 8 && sh.view.router == full.router);
    CHECK(sh.view.info.n_shared == 0 && sh.view.info.shared_d_ff == 0 && !sh.view.shared.w1);
    for (int k = 0; k < 4; k++) {
        CHECK_EQ_INT(moed_shard_global(&sh, k), ids[k]);
        CHECK(sh.view.experts[k].w1 == full.experts[ids[k]].w1);
        CHECK_EQ_INT(sh.local_of[ids[k]], k);
    }
    CHECK(sh.local_of[0] == -1 && sh.local_of[4] == -1 && sh.local_of[7] == -1);
    char buf[64];
    moed_shard_ranges(&sh, buf, sizeof buf);
    CHECK_MSG(!strcmp(buf, "1-3,6"), "%s", buf);
    uint32_t lo[4], hi[4];
    CHECK_EQ_INT(moed_shard_range_list(&sh, NULL, NULL, 0), 2);
    CHECK_EQ_INT(moed_shard_range_list(&sh, lo, hi, 4), 2);
    CHECK(lo[0] == 1 && hi[0] == 3 && lo[1] == 6 && hi[1] == 6);
    /* placed as the backend says in its numbering (local 0-1 on device 0, 2-3 on device 1): in
     * the whole numbering 1-2@0, 3@1, 6@1 */
    moed_layer_place pl = { .home = 0, .n_parts = 2 };
    pl.part[0] = (moed_place_part){ 0, 0, 2 };
    pl.part[1] = (moed_place_part){ 1, 2, 2 };
    uint32_t dev[4];
    CHECK_EQ_INT(moed_shard_place_list(&sh, &pl, NULL, NULL, NULL, 0), 3);
    CHECK_EQ_INT(moed_shard_place_list(&sh, &pl, lo, hi, dev, 4), 3);
    CHECK(lo[0] == 1 && hi[0] == 2 && dev[0] == 0 && lo[1] == 3 && hi[1] == 3 && dev[1] == 1 &&
          lo[2] == 6 && hi[2] == 6 && dev[2] == 1);
    moed_shard_place_text(&sh, &pl, buf, sizeof buf);
    CHECK_MSG(!strcmp(buf, "1-2@0,3@1,6@1"), "%s", buf);
    /* what the backend gets: the held experts' pairs, in order, renumbered; others dropped */
    moed_route r;
    CHECK_EQ_INT(moed_route_init(&r, 3, 8), 0);
    const int32_t e[] = { 6, 0, 2, 2, 7, 4, 1, 3 };
    const int64_t off[] = { 0, 3, 5, 8 };
    for (int i = 0; i < 8; i++) {
        r.expert[i] = e[i];
        r.weight[i] = (float)(i + 1);
    }
    memcpy(r.off, off, sizeof off);
    r.T = 3;
    moed_shard_localize(&sh, &r);
    const int32_t want_e[] = { 3, 1, 1, 0, 2 };
    const float want_w[] = { 1, 3, 4, 7, 8 };
    CHECK(r.off[0] == 0 && r.off[1] == 2 && r.off[2] == 3 && r.off[3] == 5);
    for (int i = 0; i < 5; i++) CHECK(r.expert[i] == want_e[i] && r.weight[i] == want_w[i]);
    moed_route_free(&r);
    moed_shard_free(&sh);

    /* every expert held: whole, the layer itself, nothing renumbered */
    CHECK_EQ_INT(moed_shard_make(&full, NULL, &sh, &err), 0);
    CHECK(moed_shard_all_experts(&sh) && sh.adds_shared && sh.n_held == 8);
    CHECK(sh.view.experts == full.experts && sh.view.info.n_shared == 1);
    moed_shard_ranges(&sh, buf, sizeof buf);
    CHECK_MSG(!strcmp(buf, "0-7"), "%s", buf);
    moed_shard_free(&sh);
    moed_synth_free_layer(&full);
}

/* The held experts are generated exactly as in the whole layer; the others are not generated. */
static void test_synth_held(void)
{
    moed_synth_spec spec;
    moed_error err = { 0 };
    moed_layer full, part;
    CHECK_EQ_INT(moed_synth_parse(SPEC, &spec, &err), 0);
    CHECK_EQ_INT(moed_synth_layer(&spec, 0, &full, &err), 0);
    static const int ids[] = { 5, 7 };
    moed_expert_subset held = moed_shard_subset(ids, 2, "off");
    CHECK_EQ_INT(moed_synth_layer_held(&spec, 0, &held, &part, &err), 0);
    const size_t bytes = (size_t)32 * 48 * moed_dtype_size(MOED_BF16);
    for (int e = 0; e < 8; e++) {
        const bool h = e == 5 || e == 7;
        CHECK((part.experts[e].w1 != NULL) == h && (part.experts[e].w2 != NULL) == h);
        if (h)
            CHECK(!memcmp(part.experts[e].w1, full.experts[e].w1, bytes) &&
                  !memcmp(part.experts[e].w3, full.experts[e].w3, bytes) &&
                  !memcmp(part.experts[e].w2, full.experts[e].w2, bytes));
    }
    CHECK(!part.shared.w1 && part.router && !memcmp(part.router, full.router, (size_t)8 * 32 * 2));
    moed_synth_free_layer(&part);
    static const int bad[] = { 3, 9 };
    held = moed_shard_subset(bad, 2, "on");
    CHECK_EQ_INT(moed_synth_layer_held(&spec, 0, &held, &part, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "expert 9"), "%s", err.msg);
    moed_synth_free_layer(&full);
}

/* One CPU backend holding the layer's whole view and two shards' views, as slots 0, 1, 2. */
static moed_backend *open_backend(const moed_layer *const *views, moed_error *err)
{
    moed_backend_config bc = { .threads = 1, .max_tokens = 16 };
    moed_backend *b;
    if (moed_backend_cpu_open(&bc, &b, err)) return NULL;
    for (int i = 0; i < 3; i++) CHECK_EQ_INT(moed_backend_load_layer(b, i, views[i], err), 0);
    CHECK_EQ_INT(moed_backend_start(b, err), 0);
    return b;
}

/* The two shards' partial outputs add up to the whole layer's (float32 summation order aside),
 * for a route with repeated experts, a token on one shard only and a padded one; the shards'
 * server-router logits are the whole layer's, bit for bit. */
static void test_cpu_partial_sums(void)
{
    moed_synth_spec spec;
    moed_error err = { 0 };
    moed_layer full;
    CHECK_EQ_INT(moed_synth_parse(SPEC, &spec, &err), 0);
    CHECK_EQ_INT(moed_synth_layer(&spec, 0, &full, &err), 0);
    static const int lo[] = { 0, 1, 2, 3 }, hi[] = { 4, 5, 6, 7 };
    moed_expert_subset a = moed_shard_subset(lo, 4, "auto"), b = moed_shard_subset(hi, 4, "auto");
    moed_shard whole, sa, sb;
    CHECK_EQ_INT(moed_shard_make(&full, NULL, &whole, &err), 0);
    CHECK_EQ_INT(moed_shard_make(&full, &a, &sa, &err), 0);
    CHECK_EQ_INT(moed_shard_make(&full, &b, &sb, &err), 0);
    CHECK(sa.adds_shared && !sb.adds_shared);
    const moed_layer *views[3] = { &whole.view, &sa.view, &sb.view };
    moed_backend *be = open_backend(views, &err);
    CHECK_MSG(be, "%s", err.msg);
    if (!be) return;
    enum { T = 4, D = 32 };
    float x[T * D], y[3][T * D], lg[3][T * 8];
    for (int i = 0; i < T * D; i++) x[i] = (float)sin(0.37 * i);
    const int32_t ids[T * 2] = { 1, 6, 2, 2, 5, 7, -1, 0 };
    const float w[T * 2] = { 0.25f, 0.75f, 0.5f, 0.5f, 1.0f, 0.125f, 0.0f, 1.0f };
    for (int s = 0; s < 3; s++) {
        moed_route r;
        CHECK_EQ_INT(moed_route_from_choice(&r, ids, w, T, 2, 8, &err), 0);
        moed_shard_localize(s == 0 ? &whole : s == 1 ? &sa : &sb, &r);
        moed_job job = { .slot = s, .dtype = MOED_F32, .T = T, .x = x, .y = y[s], .route = &r };
        CHECK_EQ_INT(moed_backend_forward(be, 0, &job, &err), 0);
        CHECK_EQ_INT(moed_backend_router_logits(be, 0, &job, lg[s], &err), 0);
        moed_route_free(&r);
    }
    double worst = 0, scale = 0;
    for (int i = 0; i < T * D; i++) {
        worst = fmax(worst, fabs((double)y[0][i] - ((double)y[1][i] + (double)y[2][i])));
        scale = fmax(scale, fabs((double)y[0][i]));
    }
    CHECK_MSG(scale > 0.01 && worst <= 1e-5 * scale, "worst %g of %g", worst, scale);
    /* token 2 routes to experts 5 and 7 only: shard a adds the shared experts alone there */
    CHECK(y[1][2 * D] != 0 && y[2][2 * D] != 0);
    CHECK(!memcmp(lg[0], lg[1], sizeof lg[0]) && !memcmp(lg[0], lg[2], sizeof lg[0]));
    moed_backend_destroy(be);
    moed_shard_free(&whole);
    moed_shard_free(&sa);
    moed_shard_free(&sb);
    moed_synth_free_layer(&full);
}

/* moed_expert_tokens_total: per layer and the whole layer's expert id of each held expert. */
static void test_metrics(void)
{
    moed_synth_spec spec;
    moed_error err = { 0 };
    moed_layer full;
    CHECK_EQ_INT(moed_synth_parse(SPEC, &spec, &err), 0);
    CHECK_EQ_INT(moed_synth_layer(&spec, 0, &full, &err), 0);
    full.info.index = 3;
    static const int ids[] = { 2, 6 };
    moed_expert_subset held = moed_shard_subset(ids, 2, "auto");
    moed_shard sh;
    CHECK_EQ_INT(moed_shard_make(&full, &held, &sh, &err), 0);
    moed_metrics *m = moed_metrics_create();
    CHECK_EQ_INT(moed_metrics_set_layers(m, &sh, 1), 0);
    const uint64_t a[2] = { 5, 0 }, b[2] = { 1, 7 };
    moed_metrics_expert_tokens(m, 0, a, 2);
    moed_metrics_expert_tokens(m, 0, b, 2);
    moed_metrics_expert_tokens(m, 1, b, 2); /* no such slot: ignored */
    moed_metrics_gauges g = { .version = "1", .backend = "cpu" };
    size_t len;
    char *text = moed_metrics_render(m, &g, &len);
    CHECK(text && strstr(text, "# TYPE moed_expert_tokens_total counter\n"));
    CHECK(text && strstr(text, "moed_expert_tokens_total{layer=\"3\",expert=\"2\"} 6\n"));
    CHECK(text && strstr(text, "moed_expert_tokens_total{layer=\"3\",expert=\"6\"} 7\n"));
    CHECK(text && !strstr(text, "expert=\"0\""));
    free(text);
    moed_metrics_destroy(m);
    moed_shard_free(&sh);
    moed_synth_free_layer(&full);
}

int main(void)
{
    test_flags();
    test_subset();
    test_maps();
    test_synth_held();
    test_cpu_partial_sums();
    test_metrics();
    return check_status("test_shard");
}
