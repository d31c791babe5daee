/*
 * test_route — routes from client choices, every gating strategy, batch gating, concat, and the
 * split of a route over a layer's parts (with copies of hot experts).
 *
 * Each strategy is checked on small cases worked out by hand, then against a second, deliberately
 * plain implementation in this file (full stable sorts, float64) on random logits, including
 * logits drawn from a few values so that ties are common.
 */
#include "check.h"
#include "moed_dtype.h"
#include "moed_place.h"
#include "moed_route.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static moed_layer_info layer(int E, int k, int norm)
{
    return (moed_layer_info){ .index = 3,
                              .d_model = 16,
                              .d_ff = 32,
                              .n_experts = E,
                              .top_k = k,
                              .act = MOED_ACT_SWIGLU,
                              .wdtype = 3,
                              .norm_topk = norm,
                              .rule = MOED_RULE_SOFTMAX_TOPK,
                              .n_group = 1,
                              .topk_group = 1,
                              .routed_scale = 1.0f };
}

/* Gates one token's logits; returns the pair count (-code on error) with experts and weights. */
static int gate1(moed_gate_params p, const moed_layer_info *li, const float *bias, const float *l,
                 int32_t *e, float *w)
{
    moed_route r;
    moed_error err = { 0 };
    int rc = moed_gate(&p, li, bias, l, 1, &r, &err);
    if (rc) return rc;
    int n = (int)r.off[1];
    memcpy(e, r.expert, (size_t)n * sizeof *e);
    memcpy(w, r.weight, (size_t)n * sizeof *w);
    moed_route_free(&r);
    return n;
}

/* ---- the plain reference ------------------------------------------------------------------ */

/* idx = 0..n-1 ordered by decreasing key, ties to the lower index (stable insertion sort). */
static void ref_order(const double *key, int n, int *idx)
{
    for (int i = 0; i < n; i++) {
        int j = i;
        while (j > 0 && key[i] > key[idx[j - 1]]) {
            idx[j] = idx[j - 1];
            j--;
        }
        idx[j] = i;
    }
}

/* The strategy of p on one token; returns the count, experts in e, weights in w. */
static int ref_gate(const moed_gate_params *p, const moed_layer_info *li, const float *bias,
                    const float *l, int *e, double *w)
{
    int E = li->n_experts, k = p->top_k, renorm = p->renormalize == MOED_RENORM_ON;
    double key[512], prob[512];
    int idx[512];
    int strategy = p->strategy;
    if (strategy == MOED_GATE_MODEL && li->rule == MOED_RULE_SOFTMAX_TOPK)
        strategy = MOED_GATE_TOPK;
    if (strategy == MOED_GATE_TOPK || strategy == MOED_GATE_QUADRATIC ||
        strategy == MOED_GATE_PIONEER) {
        double s[512], m = -INFINITY, sum = 0;
        for (int i = 0; i < E; i++) {
            double x = l[i];
            s[i] = strategy == MOED_GATE_TOPK        ? x
                   : strategy == MOED_GATE_QUADRATIC ? x * x
                                                     : pow(cos(x), 2);
            m = fmax(m, s[i]);
        }
        for (int i = 0; i < E; i++) sum += exp(s[i] - m);
        for (int i = 0; i < E; i++) prob[i] = exp(s[i] - m) / sum;
        ref_order(prob, E, idx);
        double norm = 0;
        for (int j = 0; j < k; j++) norm += prob[idx[j]];
        for (int j = 0; j < k; j++) {
            e[j] = idx[j];
            w[j] = renorm ? prob[idx[j]] / norm : prob[idx[j]];
        }
        return k;
    }
    if (strategy == MOED_GATE_SIGMOID || strategy == MOED_GATE_SPARSEMAX) {
        if (strategy == MOED_GATE_SIGMOID) {
            for (int i = 0; i < E; i++) prob[i] = 1 / (1 + exp(-(double)l[i]));
        } else {
            for (int i = 0; i < E; i++) key[i] = l[i];
            ref_order(key, E, idx);
            double cum = 0, cstar = 0;
            int kstar = 0;
            for (int j = 1; j <= E; j++) {
                cum += key[idx[j - 1]];
                if (1 + j * key[idx[j - 1]] > cum) kstar = j, cstar = cum;
            }
            double tau = (cstar - 1) / kstar;
            for (int i = 0; i < E; i++) prob[i] = fmax(key[i] - tau, 0.0);
        }
        double thr = strategy == MOED_GATE_SIGMOID ? p->threshold : 0.0;
        ref_order(prob, E, idx);
        int n = 0;
        while (n < E && prob[idx[n]] > thr) {
            e[n] = idx[n];
            w[n] = prob[idx[n]];
            n++;
        }
        return n;
    }
    /* DeepSeek-V3 */
    int G = li->n_group, gs = E / G;
    double s[512], gscore[512];
    for (int i = 0; i < E; i++) {
        s[i] = 1 / (1 + exp(-(double)l[i]));
        key[i] = s[i] + (bias ? bias[i] : 0);
    }
    if (G > 1) {
        for (int g = 0; g < G; g++) {
            int gi[512] = { 0 }; /* filled by ref_order; zeroed for a group of no experts */
            ref_order(key + g * gs, gs, gi);
            gscore[g] = key[g * gs + gi[0]] + (gs > 1 ? key[g * gs + gi[1]] : 0);
        }
        int gorder[512];
        ref_order(gscore, G, gorder);
        for (int g = 0; g < G; g++) {
            int kept = 0;
            for (int j = 0; j < li->topk_group; j++) kept |= gorder[j] == g;
            if (!kept)
                for (int i = g * gs; i < (g + 1) * gs; i++) key[i] = -INFINITY;
        }
    }
    ref_order(key, E, idx);
    double sum = 0;
    for (int j = 0; j < k; j++) sum += s[idx[j]];
    for (int j = 0; j < k; j++) {
        e[j] = idx[j];
        w[j] = (renorm ? s[idx[j]] / (sum + 1e-20) : s[idx[j]]) * li->routed_scale;
    }
    return k;
}

/* ---- hand-worked cases -------------------------------------------------------------------- */

static void test_topk_by_hand(void)
{
    moed_layer_info li = layer(4, 2, 1);
    float l[4] = { 1, 3, 2, 0 };
    int32_t e[8];
    float w[8];
    moed_gate_params p = { .strategy = MOED_GATE_TOPK };
    CHECK_EQ_INT(gate1(p, &li, NULL, l, e, w), 2);
    CHECK_EQ_INT(e[0], 1);
    CHECK_EQ_INT(e[1], 2);
    double a = exp(3.0), b = exp(2.0), all = exp(1.0) + a + b + 1;
    CHECK_NEAR(w[0], a / (a + b), 1e-7);
    CHECK_NEAR(w[1], b / (a + b), 1e-7);
    p.renormalize = MOED_RENORM_OFF;
    CHECK_EQ_INT(gate1(p, &li, NULL, l, e, w), 2);
    CHECK_NEAR(w[0], a / all, 1e-7);
    CHECK_NEAR(w[1], b / all, 1e-7);
    /* MODEL with the softmax rule is the same as TOPK with the layer's defaults */
    p = (moed_gate_params){ .strategy = MOED_GATE_MODEL };
    CHECK_EQ_INT(gate1(p, &li, NULL, l, e, w), 2);
    CHECK(e[0] == 1 && e[1] == 2);
    CHECK_NEAR(w[0], a / (a + b), 1e-7);

    /* ties go to the lower index, in order */
    float tie[4] = { 2, 2, 1, 2 };
    p = (moed_gate_params){ .strategy = MOED_GATE_TOPK, .top_k = 3 };
    CHECK_EQ_INT(gate1(p, &li, NULL, tie, e, w), 3);
    CHECK(e[0] == 0 && e[1] == 1 && e[2] == 3);
    CHECK(w[0] == w[1] && w[1] == w[2]);
}

static void test_quadratic_pioneer_by_hand(void)
{
    moed_layer_info li = layer(4, 2, 0);
    int32_t e[8];
    float w[8];
    float q[4] = { -3, 1, 2, 0 }; /* squares 9 1 4 0 */
    moed_gate_params p = { .strategy = MOED_GATE_QUADRATIC };
    CHECK_EQ_INT(gate1(p, &li, NULL, q, e, w), 2);
    CHECK(e[0] == 0 && e[1] == 2);
    double s = exp(9.0) + exp(1.0) + exp(4.0) + 1;
    CHECK_NEAR(w[0], exp(9.0) / s, 1e-7);
    CHECK_NEAR(w[1], exp(4.0) / s, 1e-7);
    float c[4] = { 0, 1, 0.5f, 2 }; /* cos^2: 1, .292, .770, .173 */
    p.strategy = MOED_GATE_PIONEER;
    CHECK_EQ_INT(gate1(p, &li, NULL, c, e, w), 2);
    CHECK(e[0] == 0 && e[1] == 2);
    double c2[4];
    for (int i = 0; i < 4; i++) c2[i] = exp(cos(c[i]) * cos(c[i]));
    CHECK_NEAR(w[0], c2[0] / (c2[0] + c2[1] + c2[2] + c2[3]), 1e-7);
}

static void test_sigmoid_by_hand(void)
{
    moed_layer_info li = layer(4, 2, 1);
    int32_t e[8];
    float w[8];
    float l[4] = { 0.5f, -1, 2, 0 }; /* sigmoid .622 .269 .881 .5 */
    moed_gate_params p = { .strategy = MOED_GATE_SIGMOID };
    CHECK_EQ_INT(gate1(p, &li, NULL, l, e, w), 2); /* exactly 0.5 is not > 0.5 */
    CHECK(e[0] == 2 && e[1] == 0);
    CHECK_NEAR(w[0], 1 / (1 + exp(-2.0)), 1e-7);
    CHECK_NEAR(w[1], 1 / (1 + exp(-0.5)), 1e-7);
    p.threshold = 0.7f;
    CHECK_EQ_INT(gate1(p, &li, NULL, l, e, w), 1);
    CHECK_EQ_INT(e[0], 2);
    float neg[4] = { -1, -2, -3, -4 };
    CHECK_EQ_INT(gate1(p, &li, NULL, neg, e, w), 0); /* a token may get no expert */
    float hi[4] = { 50, 40, 60, 0 };                 /* all saturate to 1: ties by index */
    p.threshold = 0.5f;
    CHECK_EQ_INT(gate1(p, &li, NULL, hi, e, w), 3);
    CHECK(e[0] == 0 && e[1] == 1 && e[2] == 2);
}

static void test_sparsemax_by_hand(void)
{
    moed_layer_info li = layer(4, 2, 1);
    int32_t e[8];
    float w[8];
    /* sorted 1, .9, .5, -1: k* = 3, tau = (2.4 - 1) / 3 */
    float l[4] = { 1, 0.5f, -1, 0.9f };
    moed_gate_params p = { .strategy = MOED_GATE_SPARSEMAX };
    CHECK_EQ_INT(gate1(p, &li, NULL, l, e, w), 3);
    CHECK(e[0] == 0 && e[1] == 3 && e[2] == 1);
    double tau = ((double)1 + (double)0.9f + (double)0.5f - 1) / 3;
    CHECK_NEAR(w[0], 1 - tau, 1e-7);
    CHECK_NEAR(w[1], (double)0.9f - tau, 1e-7);
    CHECK_NEAR(w[2], (double)0.5f - tau, 1e-7);
    CHECK_NEAR(w[0] + w[1] + w[2], 1, 1e-6);
    float one[4] = { 5, 0, 1, 3 }; /* far ahead: all mass on one expert */
    CHECK_EQ_INT(gate1(p, &li, NULL, one, e, w), 1);
    CHECK(e[0] == 0 && w[0] == 1.0f);
    /* Logits beyond 2^53 (the request fuzzer's find): max - 2 rounds to max unless the logits are
     * shifted first; the answer must still be one expert with weight 1, never Inf or NaN. */
    float huge[4] = { 5.4e37f, 1, -3, 0.5f };
    CHECK_EQ_INT(gate1(p, &li, NULL, huge, e, w), 1);
    CHECK(e[0] == 0 && w[0] == 1.0f);
    float ties[4] = { 3.0e38f, -3.0e38f, 3.0e38f, 0 }; /* two at the largest float: half each */
    CHECK_EQ_INT(gate1(p, &li, NULL, ties, e, w), 2);
    CHECK(e[0] == 0 && e[1] == 2 && w[0] == 0.5f && w[1] == 0.5f);
}

static void test_deepseek_by_hand(void)
{
    moed_layer_info li = layer(8, 2, 1);
    li.rule = MOED_RULE_DEEPSEEK_V3;
    li.n_group = 4;
    li.topk_group = 2;
    li.routed_scale = 2.5f;
    int32_t e[8];
    float w[8];
    /* groups {0,1} {2,3} {4,5} {6,7}; expert 3 has the largest single score but its group's pair
     * sum loses to groups {4,5} and {6,7} */
    float l[8] = { -2, -2, -3, 3, 1, 1, 1.5f, 0.5f };
    float bias[8] = { 0 };
    moed_gate_params p = { .strategy = MOED_GATE_MODEL };
    CHECK_EQ_INT(gate1(p, &li, bias, l, e, w), 2);
    CHECK(e[0] == 6 && e[1] == 4); /* 4 and 5 tie: the lower index */
    double s6 = 1 / (1 + exp(-1.5)), s4 = 1 / (1 + exp(-1.0));
    CHECK_NEAR(w[0], s6 / (s6 + s4 + 1e-20) * 2.5, 1e-6);
    CHECK_NEAR(w[1], s4 / (s6 + s4 + 1e-20) * 2.5, 1e-6);
    /* the bias chooses, the unbiased score weighs */
    bias[5] = 0.5f;
    CHECK_EQ_INT(gate1(p, &li, bias, l, e, w), 2);
    CHECK(e[0] == 5 && e[1] == 6);
    CHECK_NEAR(w[0], s4 / (s6 + s4 + 1e-20) * 2.5, 1e-6);
    p.renormalize = MOED_RENORM_OFF;
    CHECK_EQ_INT(gate1(p, &li, bias, l, e, w), 2);
    CHECK_NEAR(w[0], s4 * 2.5, 1e-6);
    /* without groups expert 3 wins */
    li.n_group = 1;
    li.topk_group = 1;
    bias[5] = 0;
    p.renormalize = 0;
    CHECK_EQ_INT(gate1(p, &li, NULL, l, e, w), 2);
    CHECK(e[0] == 3 && e[1] == 6);
}

/* ---- random logits against the reference -------------------------------------------------- */

static uint64_t rng = 88172645463325252ull;
static double urand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

static void compare_random(moed_gate_params p, moed_layer_info li, int64_t T, int ties,
                           const char *what)
{
    int E = li.n_experts;
    float *l = malloc((size_t)(T * E) * sizeof *l), bias[512];
    for (int64_t i = 0; i < T * E; i++)
        l[i] = ties ? (float)(int)(urand() * 4) - 1.5f : (float)(urand() * 8 - 4);
    for (int i = 0; i < E; i++) bias[i] = (float)(urand() * 0.2 - 0.1);
    moed_route r;
    moed_error err = { 0 };
    int rc = moed_gate(&p, &li, bias, l, T, &r, &err);
    CHECK_MSG(rc == 0, "%s: %s", what, err.msg);
    moed_gate_params q = p;
    CHECK_EQ_INT(moed_gate_resolve(&q, &li, &err), 0);
    int bad = 0;
    for (int64_t t = 0; t < T && !rc && !bad; t++) {
        int e[512];
        double w[512];
        int n = ref_gate(&q, &li, bias, l + t * E, e, w);
        int got = (int)(r.off[t + 1] - r.off[t]);
        if (got != n) {
            CHECK_MSG(0, "%s: token %lld has %d pairs, reference %d", what, (long long)t, got, n);
            bad = 1;
            break;
        }
        for (int j = 0; j < n; j++) {
            float wj = r.weight[r.off[t] + j];
            if (r.expert[r.off[t] + j] != e[j] || fabs(wj - w[j]) > 2e-7 * fmax(1, fabs(w[j]))) {
                CHECK_MSG(0, "%s: token %lld pair %d: expert %d weight %.9g, reference %d %.9g",
                          what, (long long)t, j, r.expert[r.off[t] + j], wj, e[j], w[j]);
                bad = 1;
                break;
            }
        }
    }
    moed_route_free(&r);
    free(l);
}

static void test_random(void)
{
    static const int Es[] = { 1, 3, 8, 64, 256 };
    for (size_t i = 0; i < sizeof Es / sizeof Es[0]; i++) {
        int E = Es[i];
        int ks[] = { 1, E < 2 ? 1 : 2, E < 8 ? E : 8, E < 40 ? E : 40, E };
        for (int ki = 0; ki < 5; ki++) {
            for (int ties = 0; ties < 2; ties++) {
                moed_layer_info li = layer(E, ks[ki], ki & 1);
                for (int s = MOED_GATE_MODEL; s <= MOED_GATE_PIONEER; s++) {
                    char what[96];
                    snprintf(what, sizeof what, "strategy %d E %d k %d ties %d", s, E, ks[ki],
                             ties);
                    moed_gate_params p = { .strategy = s, .top_k = ks[ki] };
                    p.threshold = s == MOED_GATE_SIGMOID && ki == 2 ? 0.3f : 0;
                    compare_random(p, li, 40, ties, what);
                }
                /* the DeepSeek rule, ungrouped and grouped */
                li.rule = MOED_RULE_DEEPSEEK_V3;
                li.routed_scale = 1.5f;
                moed_gate_params p = { .strategy = MOED_GATE_MODEL, .top_k = ks[ki] };
                compare_random(p, li, 40, ties, "deepseek ungrouped");
                if (E % 4 == 0 && ks[ki] <= E / 2) {
                    li.n_group = 4;
                    li.topk_group = 2;
                    compare_random(p, li, 40, ties, "deepseek grouped");
                }
            }
        }
    }
    /* large enough to be gated on several threads: the parts must join into the same route */
    for (int st = MOED_GATE_TOPK; st <= MOED_GATE_SPARSEMAX; st++)
        compare_random((moed_gate_params){ .strategy = st, .top_k = 8 }, layer(256, 8, 1), 1500, 0,
                       "many tokens");
}

/* ---- batch gating ------------------------------------------------------------------------- */

static void test_batch(void)
{
    /* column sums: 3, 5, 5, -1 -> S = {1, 2} (tie to the lower index), then 0 */
    float l[8] = { 1, 2, 3, 0, 2, 3, 2, -1 };
    int32_t set[4];
    moed_route r;
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_gate_batch(l, 2, 4, 3, set, &r, &err), 0);
    CHECK(set[0] == 1 && set[1] == 2 && set[2] == 0);
    CHECK_EQ_INT(r.off[1], 3);
    CHECK_EQ_INT(r.off[2], 6);
    for (int t = 0; t < 2; t++) {
        double s = exp(l[t * 4 + 1]) + exp(l[t * 4 + 2]) + exp(l[t * 4 + 0]);
        for (int j = 0; j < 3; j++) {
            CHECK_EQ_INT(r.expert[t * 3 + j], set[j]);
            CHECK_NEAR(r.weight[t * 3 + j], exp(l[t * 4 + set[j]]) / s, 1e-7);
        }
    }
    moed_route_free(&r);
    CHECK_EQ_INT(moed_gate_batch(l, 2, 4, 5, set, &r, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "k_batch = 5") != NULL);
    CHECK_EQ_INT(moed_gate_batch(l, 2, 4, 0, set, &r, &err), MOED_EINVAL);

    /* random, against the reference: sums in float64, token order */
    int T = 37, E = 64, K = 9;
    float *x = malloc((size_t)T * E * sizeof *x);
    for (int i = 0; i < T * E; i++) x[i] = (float)(urand() * 6 - 3);
    int32_t S[64];
    CHECK_EQ_INT(moed_gate_batch(x, T, E, K, S, &r, &err), 0);
    double sum[64] = { 0 };
    int order[64];
    for (int t = 0; t < T; t++)
        for (int e = 0; e < E; e++) sum[e] += x[t * E + e];
    ref_order(sum, E, order);
    for (int j = 0; j < K; j++) CHECK_EQ_INT(S[j], order[j]);
    for (int t = 0; t < T; t++) {
        double z = 0;
        for (int j = 0; j < K; j++) z += exp(x[t * E + order[j]]);
        for (int j = 0; j < K; j++)
            CHECK_NEAR(r.weight[t * K + j], exp(x[t * E + order[j]]) / z, 2e-7);
    }
    moed_route_free(&r);
    free(x);
}

/* ---- client choices and validation --------------------------------------------------------- */

static int choice(const int32_t *ids, const float *w, int64_t T, int k, moed_route *r,
                  moed_error *err)
{
    int rc = moed_route_from_choice(r, ids, w, T, k, 8, err);
    return rc;
}

static void test_choice(void)
{
    moed_route r;
    moed_error err = { 0 };
    int32_t ids[6] = { 3, -1, 7, 7, -1, -1 }; /* row 1 repeats 7; row 2 is all padding */
    float w[6] = { 0.5f, 0, 0.25f, 0.75f, 0, 0 };
    CHECK_EQ_INT(choice(ids, w, 3, 2, &r, &err), 0);
    CHECK_EQ_INT(r.T, 3);
    CHECK(r.off[0] == 0 && r.off[1] == 1 && r.off[2] == 3 && r.off[3] == 3);
    CHECK(r.expert[0] == 3 && r.expert[1] == 7 && r.expert[2] == 7);
    CHECK(r.weight[0] == 0.5f && r.weight[1] == 0.25f && r.weight[2] == 0.75f);
    moed_route_free(&r);

    struct {
        int32_t id;
        float w;
        const char *msg, *value; /* the value, as a message would have printed it */
    } bad[] = {
        { 8, 1, "expert_ids[1][0] is out of range", "8 is" },
        { -2, 0, "expert_ids[1][0] is out of range", "-2" },
        { -1, 0.5f, "expert_ids[1][0] marks padding (-1), but expert_weights[1][0] is not 0",
          "0.5" },
        { 2, NAN, "expert_weights[1][0] is not finite", "nan" },
        { 2, INFINITY, "expert_weights[1][0] is not finite", "= inf" },
        { 2, -0.25f, "expert_weights[1][0] is negative", "-0.25" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int32_t bi[4] = { 1, 2, bad[i].id, 9 }; /* the 9 after it is never reached */
        float bw[4] = { 1, 1, bad[i].w, 1 };
        memset(&err, 0, sizeof err);
        CHECK_EQ_INT(choice(bi, bw, 2, 2, &r, &err), MOED_EINVAL);
        CHECK_EQ_INT(err.code, MOED_EINVAL);
        CHECK_MSG(strstr(err.msg, bad[i].msg) != NULL, "got '%s', want '%s'", err.msg, bad[i].msg);
        /* the position, never the value (the tensor may be a region's) */
        CHECK_MSG(!strstr(err.msg, bad[i].value), "%s", err.msg);
        CHECK(r.off == NULL);
        moed_route_free(&r); /* safe after a failure */
    }
}

/* The rules one pair at a time, as moed_route_from_choice and the device check apply them. */
static void test_choice_rules(void)
{
    const struct {
        int32_t id;
        float w;
        int rule;
    } pairs[] = {
        { 3, 1.0f, MOED_CHOICE_VALID },
        { 3, 0.0f, MOED_CHOICE_VALID },  /* a zero weight on a real expert is a real pair */
        { 3, -0.0f, MOED_CHOICE_VALID }, /* not < 0 */
        { 7, 1e-45f, MOED_CHOICE_VALID },
        { -1, 0.0f, MOED_CHOICE_PADDING },
        { -1, -0.0f, MOED_CHOICE_PADDING },
        { -1, 0.5f, MOED_CHOICE_PAD_WEIGHT },
        { -1, NAN, MOED_CHOICE_PAD_WEIGHT },
        { 8, 1.0f, MOED_CHOICE_RANGE },
        { -2, 0.0f, MOED_CHOICE_RANGE },
        { INT32_MIN, 1.0f, MOED_CHOICE_RANGE },
        { 8, NAN, MOED_CHOICE_RANGE }, /* the id is checked before the weight */
        { 3, NAN, MOED_CHOICE_NOT_FINITE },
        { 3, INFINITY, MOED_CHOICE_NOT_FINITE },
        { 3, -INFINITY, MOED_CHOICE_NOT_FINITE },
        { 3, -0.25f, MOED_CHOICE_NEGATIVE },
    };
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++)
        CHECK_MSG(moed_choice_rule(pairs[i].id, pairs[i].w, 8) == pairs[i].rule,
                  "pair %zu (%d, %g): rule %d, want %d", i, (int)pairs[i].id, (double)pairs[i].w,
                  moed_choice_rule(pairs[i].id, pairs[i].w, 8), pairs[i].rule);

    /* The first refusal in row-major order, whatever follows it. */
    int32_t ids[6] = { 1, -1, 2, 3, 4, 5 };
    float w[6] = { 1, 0, 1, 1, 1, 1 };
    CHECK_EQ_INT(moed_choice_check(ids, w, 3, 2, 8), -1);
    ids[5] = 1234567;
    w[3] = NAN;
    const int64_t code = moed_choice_check(ids, w, 3, 2, 8);
    CHECK_EQ_INT(code, 3 << MOED_CHOICE_RULE_BITS | MOED_CHOICE_NOT_FINITE);

    /* The messages name the position and the rule, never the value found there. */
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_choice_fail(&err, code, 2, 8), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "expert_weights[1][1] is not finite") && !strstr(err.msg, "nan"),
              "%s", err.msg);
    CHECK_EQ_INT(moed_choice_fail(&err, 5 << MOED_CHOICE_RULE_BITS | MOED_CHOICE_RANGE, 2, 8),
                 MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "expert_ids[2][1] is out of range: the layer has 8 experts") &&
                  !strstr(err.msg, "1234567"),
              "%s", err.msg);
    moed_choice_fail(&err, 4 << MOED_CHOICE_RULE_BITS | MOED_CHOICE_PAD_WEIGHT, 3, 8);
    CHECK_MSG(strstr(err.msg, "expert_ids[1][1] marks padding (-1), but expert_weights[1][1] is "
                              "not 0"),
              "%s", err.msg);

    /* moed_route_from_choice refuses exactly the choices the check refuses, at the same place. */
    for (int round = 0; round < 2000; round++) {
        int32_t ri[12];
        float rw[12];
        for (int i = 0; i < 12; i++) {
            const double u = urand();
            ri[i] = u < 0.01 ? 8 : u < 0.02 ? -3 : u < 0.2 ? -1 : (int32_t)(u * 8);
            rw[i] = u < 0.2 && u >= 0.02 ? (urand() < 0.05 ? 1.0f : 0.0f)
                    : urand() < 0.01     ? NAN
                    : urand() < 0.01     ? -1.0f
                                         : (float)urand();
        }
        moed_route r;
        memset(&err, 0, sizeof err);
        const int rc = moed_route_from_choice(&r, ri, rw, 4, 3, 8, &err);
        const int64_t c = moed_choice_check(ri, rw, 4, 3, 8);
        CHECK_MSG((rc == 0) == (c < 0), "round %d: from_choice %d, check %lld", round, rc,
                  (long long)c);
        if (c >= 0) {
            moed_error mine = { 0 };
            moed_choice_fail(&mine, c, 3, 8);
            /* both name the same tensor and position first: "expert_xxx[r][c]" */
            const char *end = strchr(strchr(mine.msg, ']') + 1, ']');
            CHECK_MSG(!strncmp(err.msg, mine.msg, (size_t)(end - mine.msg + 1)),
                      "from_choice '%s', check '%s'", err.msg, mine.msg);
        }
        moed_route_free(&r);
    }
}

static void test_resolve(void)
{
    moed_layer_info li = layer(8, 2, 0);
    moed_error err = { 0 };
    moed_gate_params p = { 0 };
    CHECK_EQ_INT(moed_gate_resolve(&p, &li, &err), 0);
    CHECK_EQ_INT(p.top_k, 2);
    CHECK_EQ_INT(p.renormalize, MOED_RENORM_OFF);
    CHECK(p.threshold == 0.5f);
    li.norm_topk = 1;
    p = (moed_gate_params){ .strategy = MOED_GATE_SIGMOID, .top_k = 5, .threshold = 0.25f };
    CHECK_EQ_INT(moed_gate_resolve(&p, &li, &err), 0);
    CHECK(p.top_k == 5 && p.renormalize == MOED_RENORM_ON && p.threshold == 0.25f);

    struct {
        moed_gate_params p;
        const char *msg;
    } bad[] = {
        { { .strategy = 9 }, "unknown gating strategy 9" },
        { { .strategy = -1 }, "unknown gating strategy -1" },
        { { .strategy = 1, .top_k = 9 }, "top_k = 9 is out of range" },
        { { .strategy = 1, .top_k = -1 }, "top_k = -1 is out of range" },
        { { .strategy = 2, .threshold = 1.5f }, "threshold = 1.5" },
        { { .strategy = 2, .threshold = -0.5f }, "threshold = -0.5" },
        { { .strategy = 2, .threshold = NAN }, "threshold = nan" },
        { { .strategy = 1, .renormalize = 7 }, "renormalize = 7" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&err, 0, sizeof err);
        CHECK_EQ_INT(moed_gate_resolve(&bad[i].p, &li, &err), MOED_EINVAL);
        CHECK_MSG(strstr(err.msg, bad[i].msg) != NULL, "got '%s', want '%s'", err.msg, bad[i].msg);
    }
    li.rule = MOED_RULE_NONE;
    p = (moed_gate_params){ 0 };
    CHECK_EQ_INT(moed_gate_resolve(&p, &li, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "no router rule") != NULL);
    li.rule = MOED_RULE_DEEPSEEK_V3;
    li.n_group = 3;
    li.topk_group = 1;
    p = (moed_gate_params){ 0 };
    CHECK_EQ_INT(moed_gate_resolve(&p, &li, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "n_group = 3") != NULL);
    li.n_group = 4;
    p = (moed_gate_params){ .top_k = 3 }; /* one group of 2 cannot give 3 */
    CHECK_EQ_INT(moed_gate_resolve(&p, &li, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "top_k = 3") != NULL);

    /* NaN and Inf logits name their place */
    li = layer(4, 2, 1);
    float l[8] = { 0, 1, 2, 3, 4, 5, INFINITY, 7 };
    moed_route r;
    p = (moed_gate_params){ .strategy = MOED_GATE_TOPK };
    CHECK_EQ_INT(moed_gate(&p, &li, NULL, l, 2, &r, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "logits[1][2] is not finite") && !strstr(err.msg, "inf:"), "%s",
              err.msg);
    l[6] = NAN;
    CHECK_EQ_INT(moed_gate_batch(l, 2, 4, 2, (int32_t[2]){ 0 }, &r, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "logits[1][2] is not finite") && !strstr(err.msg, "nan"), "%s",
              err.msg);
}

static void test_concat(void)
{
    moed_route a, b, out;
    moed_error err;
    int32_t ia[4] = { 1, 2, 3, -1 };
    float wa[4] = { 0.1f, 0.2f, 0.3f, 0 };
    int32_t ib[3] = { 5, 6, 7 };
    float wb[3] = { 0.5f, 0.6f, 0.7f };
    CHECK_EQ_INT(moed_route_from_choice(&a, ia, wa, 2, 2, 8, &err), 0);
    CHECK_EQ_INT(moed_route_from_choice(&b, ib, wb, 3, 1, 8, &err), 0);
    const moed_route *parts[2] = { &a, &b };
    CHECK_EQ_INT(moed_route_init(&out, 6, 8), 0);
    CHECK_EQ_INT(moed_route_concat(&out, parts, 2), 0);
    CHECK_EQ_INT(out.T, 5);
    int64_t off[6] = { 0, 2, 3, 4, 5, 6 };
    int32_t ex[6] = { 1, 2, 3, 5, 6, 7 };
    float we[6] = { 0.1f, 0.2f, 0.3f, 0.5f, 0.6f, 0.7f };
    for (int i = 0; i < 6; i++) CHECK_EQ_INT(out.off[i], off[i]);
    for (int i = 0; i < 6; i++) CHECK(out.expert[i] == ex[i] && out.weight[i] == we[i]);
    moed_route_free(&out);
    CHECK_EQ_INT(moed_route_init(&out, 5, 5), 0); /* one pair short */
    CHECK_EQ_INT(moed_route_concat(&out, parts, 2), MOED_EINVAL);
    moed_route_free(&out);
    moed_route_free(&a);
    moed_route_free(&b);
}

/* The server router's rounding rule: softmax-rule logits are rounded to the activation dtype
 * (nearest, ties to even), DeepSeek-V3's and float32 activations' are left alone; and what it does
 * to a choice: two experts 0.002 apart in float32 tie in bf16, and the tie goes to the lower index.
 */
static void test_router_rounding(void)
{
    moed_layer_info soft = layer(4, 1, 1), deep = soft;
    deep.rule = MOED_RULE_DEEPSEEK_V3;
    const float in[6] = {
        1.00390625f, 1.005859375f, -2.3f, 1.00048828125f, 1.000732421875f, 3e-3f
    };
    const float bf16[6] = { 1.0f, 1.0078125f, -2.296875f, 1.0f, 1.0f, 0.0030059814453125f };
    const float f16[6] = { 1.00390625f, 1.005859375f,  -2.30078125f,
                           1.0f,        1.0009765625f, 0.0030002593994140625f };
    float v[6];
    memcpy(v, in, sizeof v);
    moed_router_round_logits(&soft, MOED_BF16, v, 6);
    for (int i = 0; i < 6; i++) CHECK_MSG(v[i] == bf16[i], "bf16 %d: %.9g", i, (double)v[i]);
    memcpy(v, in, sizeof v);
    moed_router_round_logits(&soft, MOED_F16, v, 6);
    for (int i = 0; i < 6; i++) CHECK_MSG(v[i] == f16[i], "f16 %d: %.9g", i, (double)v[i]);
    memcpy(v, in, sizeof v);
    moed_router_round_logits(&soft, MOED_F32, v, 6);
    CHECK(!memcmp(v, in, sizeof v));
    moed_router_round_logits(&deep, MOED_BF16, v, 6);
    CHECK(!memcmp(v, in, sizeof v));

    float l[4] = { 0.5f, 1.001f, 1.003f, -1.0f };
    moed_gate_params p = { MOED_GATE_MODEL, 0, MOED_RENORM_DEFAULT, 0 };
    moed_route r = { 0 };
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_gate_resolve(&p, &soft, &err), 0);
    CHECK_EQ_INT(moed_gate(&p, &soft, NULL, l, 1, &r, &err), 0);
    CHECK_EQ_INT(r.expert[0], 2); /* float32: expert 2 is ahead */
    moed_route_free(&r);
    moed_router_round_logits(&soft, MOED_BF16, l, 4);
    CHECK(l[1] == l[2]);
    CHECK_EQ_INT(moed_gate(&p, &soft, NULL, l, 1, &r, &err), 0);
    CHECK_EQ_INT(r.expert[0], 1); /* bf16: tied, the lower index wins */
    moed_route_free(&r);
}

/* moed_route_split: a range of tokens cut by expert ranges (a layer split over devices). Each
 * part's route holds exactly the tokens with a pair of its experts, in order, each with its pairs
 * of those experts in their order and local ids; tok names each part token's place in the range,
 * and row puts each (token, part) where the parts' rows laid one after another hold it: every row
 * used once, -1 exactly where the token has no pair in the part. */
static void test_split(void)
{
    enum { T = 50, E = 10, NP = 3, T0 = 5, T1 = 45, N = T1 - T0 };
    const int first[NP] = { 0, 3, 7 };
    uint8_t part_of[E];
    for (int e = 0; e < E; e++) part_of[e] = e >= 7 ? 2 : e >= 3 ? 1 : 0;
    moed_route r, parts[NP];
    moed_route_init(&r, T, T * 6);
    for (int t = 0; t < T; t++) { /* 0 to 5 pairs a token, experts in any order, some repeated */
        const int n = (int)(urand() * 6);
        for (int j = 0; j < n; j++) {
            r.expert[r.off[t + 1]] = (int32_t)(urand() * E);
            r.weight[r.off[t + 1]++] = (float)urand();
        }
        if (t + 1 < T) r.off[t + 2] = r.off[t + 1];
    }
    for (int q = 0; q < NP; q++) moed_route_init(&parts[q], N, T * 6);
    int32_t tok[NP * N], row[NP * N];
    memset(tok, 0x7f, sizeof tok);
    moed_route_split(&r, T0, T1, part_of, first, NP, parts, tok, row);
    int64_t pairs = 0, rows = 0;
    for (int q = 0; q < NP; q++) {
        pairs += parts[q].off[parts[q].T];
        rows += parts[q].T;
    }
    CHECK_EQ_INT(pairs, r.off[T1] - r.off[T0]);
    uint8_t used[NP * N] = { 0 };
    int32_t next[NP] = { 0 }; /* each part's next token */
    for (int t = 0; t < N; t++) {
        for (int q = 0, base = 0; q < NP; base += (int)parts[q++].T) {
            /* the token's pairs of part q, in route order, against the part's next token */
            int64_t mine = 0;
            for (int64_t j = r.off[T0 + t]; j < r.off[T0 + t + 1]; j++)
                mine += part_of[r.expert[j]] == q;
            if (!mine) {
                CHECK_EQ_INT(row[q * N + t], -1);
                continue;
            }
            const int32_t i = next[q]++;
            CHECK(i < parts[q].T);
            if (i >= parts[q].T) continue;
            CHECK_EQ_INT(tok[q * N + i], t);
            CHECK_EQ_INT(row[q * N + t], base + i);
            CHECK(row[q * N + t] >= 0 && row[q * N + t] < rows && !used[row[q * N + t]]);
            if (row[q * N + t] >= 0 && row[q * N + t] < rows) used[row[q * N + t]] = 1;
            CHECK_EQ_INT(parts[q].off[i + 1] - parts[q].off[i], mine);
            int64_t k = parts[q].off[i];
            for (int64_t j = r.off[T0 + t]; j < r.off[T0 + t + 1]; j++) {
                if (part_of[r.expert[j]] != q) continue;
                CHECK_EQ_INT(parts[q].expert[k] + first[q], r.expert[j]);
                CHECK(parts[q].weight[k] == r.weight[j]);
                k++;
            }
        }
    }
    for (int q = 0; q < NP; q++) CHECK_EQ_INT(next[q], parts[q].T); /* no token made up */
    moed_route_free(&r);
    for (int q = 0; q < NP; q++) moed_route_free(&parts[q]);
}

/* The copy rule (moed_route.h) written out plainly: splitmix64 spelled here, the chain, then the
 * top half of h scaled to the copies. */
static int ref_copy(const int32_t *ids, int64_t n, int copies)
{
    uint64_t h = 0;
    for (int64_t j = 0; j < n; j++) h = (h ^ (uint32_t)ids[j]) * 0x9E3779B97F4A7C15ull;
    uint64_t z = h + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (int)((double)(z >> 32) * copies / 4294967296.0);
}

/* moed_route_split_copies against a plain reference over random placements with copies of
 * random experts (moed_place_copies builds the tables): each pair on the part of the copy the
 * rule picks, as that part's local number of the expert (its range first, then its copies in
 * placement order), tokens and rows as moed_route_split lays them; a token's pairs split the same
 * in a range of its own (merged == alone); and with no copies, exactly moed_route_split. */
static void test_split_copies(void)
{
    enum { T = 60, E = 12, N = 4 };
    for (int rep = 0; rep < 200; rep++) {
        /* the cut: N entries, some empty; copies on entries other than the range's */
        moed_layer_place pl = { .home = rep % N };
        for (int i = 0, first = 0; i < N; i++) {
            const int count = i == N - 1 ? E - first : (int)(urand() * (E - first + 1) / 2);
            if (count) pl.part[pl.n_parts++] = (moed_place_part){ i, first, count };
            first += count;
        }
        const int want = rep % 5 == 0 ? 0 : (int)(urand() * 10);
        for (int e = 0; e < E && pl.n_replicas < want; e++)
            for (int i = 0; i < N; i++) {
                int owner = -1;
                for (int q = 0; q < pl.n_parts; q++)
                    if (e >= pl.part[q].first && e < pl.part[q].first + pl.part[q].count)
                        owner = pl.part[q].dev;
                if (i != owner && urand() < 0.3 && pl.n_replicas < want)
                    pl.replica[pl.n_replicas++] = (moed_place_replica){ e, i };
            }
        int dev[MOED_PLACE_MAX], ids[MOED_PLACE_MAX][E], nid[MOED_PLACE_MAX];
        const int np = moed_place_parts(&pl, dev);
        for (int q = 0; q < np; q++) nid[q] = moed_place_entry_experts(&pl, dev[q], ids[q]);
        int32_t off[E + 1], local[E + MOED_PLACE_MAX_REPLICAS];
        uint8_t part[E + MOED_PLACE_MAX_REPLICAS];
        moed_place_copies(&pl, E, off, part, local);
        const moed_route_copies cp = { off, part, local };
        /* the reference's copies of e: its range's entry, then its copies' entries, increasing */
        int cdev[E][MOED_PLACE_MAX], nc[E];
        for (int e = 0; e < E; e++) {
            nc[e] = 0;
            for (int q = 0; q < pl.n_parts; q++)
                if (e >= pl.part[q].first && e < pl.part[q].first + pl.part[q].count)
                    cdev[e][nc[e]++] = pl.part[q].dev;
            for (int i = 0; i < N; i++)
                for (int c = 0; c < pl.n_replicas; c++)
                    if (pl.replica[c].expert == e && pl.replica[c].dev == i) cdev[e][nc[e]++] = i;
            CHECK_EQ_INT(off[e + 1] - off[e], nc[e]);
        }
        moed_route r, parts[MOED_PLACE_MAX], alone[MOED_PLACE_MAX];
        moed_route_init(&r, T, T * 5);
        for (int t = 0; t < T; t++) {
            const int n = (int)(urand() * 5);
            for (int j = 0; j < n; j++) {
                r.expert[r.off[t + 1]] = (int32_t)(urand() * E);
                r.weight[r.off[t + 1]++] = (float)urand();
            }
            if (t + 1 < T) r.off[t + 2] = r.off[t + 1];
        }
        for (int q = 0; q < np; q++) {
            moed_route_init(&parts[q], T, T * 5);
            moed_route_init(&alone[q], T, T * 5);
        }
        int32_t tok[MOED_PLACE_MAX * T], row[MOED_PLACE_MAX * T];
        int32_t tok1[MOED_PLACE_MAX * T], row1[MOED_PLACE_MAX * T];
        moed_route_split_copies(&r, 0, T, &cp, np, parts, tok, row);
        int64_t next[MOED_PLACE_MAX] = { 0 }, pair[MOED_PLACE_MAX] = { 0 };
        for (int t = 0; t < T; t++) {
            const int64_t j0 = r.off[t], j1 = r.off[t + 1];
            /* the same token split alone: its own pairs go the same way */
            moed_route_split_copies(&r, t, t + 1, &cp, np, alone, tok1, row1);
            for (int q = 0, base = 0; q < np; base += (int)parts[q++].T) {
                int64_t mine = 0;
                for (int64_t j = j0; j < j1; j++) {
                    const int e = r.expert[j], d = cdev[e][ref_copy(r.expert + j0, j1 - j0, nc[e])];
                    if (d != dev[q]) continue;
                    int l = 0;
                    while (l < nid[q] && ids[q][l] != e) l++;
                    CHECK(l < nid[q]);
                    CHECK_EQ_INT(parts[q].expert[pair[q] + mine], l);
                    CHECK(parts[q].weight[pair[q] + mine] == r.weight[j]);
                    CHECK_EQ_INT(alone[q].expert[mine], l);
                    mine++;
                }
                CHECK_EQ_INT(alone[q].T, mine > 0);
                if (!mine) {
                    CHECK_EQ_INT(row[q * T + t], -1);
                    continue;
                }
                CHECK_EQ_INT(tok[q * T + next[q]], t);
                CHECK_EQ_INT(row[q * T + t], base + next[q]);
                CHECK_EQ_INT(parts[q].off[next[q] + 1] - parts[q].off[next[q]], mine);
                next[q]++;
                pair[q] += mine;
            }
        }
        for (int q = 0; q < np; q++) CHECK_EQ_INT(next[q], parts[q].T);
        if (!pl.n_replicas) { /* no copies: moed_route_split's outputs exactly */
            uint8_t part_of[E];
            int first[MOED_PLACE_MAX];
            for (int q = 0; q < pl.n_parts; q++) {
                first[q] = pl.part[q].first;
                memset(part_of + pl.part[q].first, q, (size_t)pl.part[q].count);
            }
            moed_route_split(&r, 0, T, part_of, first, np, alone, tok1, row1);
            CHECK(!memcmp(row, row1, sizeof(int32_t) * (size_t)(np * T)));
            for (int q = 0; q < np; q++) {
                CHECK_EQ_INT(alone[q].T, parts[q].T);
                CHECK(!memcmp(alone[q].off, parts[q].off, sizeof(int64_t) * (size_t)(T + 1)));
                CHECK(!memcmp(alone[q].expert, parts[q].expert,
                              sizeof(int32_t) * (size_t)parts[q].off[parts[q].T]));
                CHECK(!memcmp(tok + q * T, tok1 + q * T, sizeof(int32_t) * (size_t)parts[q].T));
            }
        }
        moed_route_free(&r);
        for (int q = 0; q < np; q++) {
            moed_route_free(&parts[q]);
            moed_route_free(&alone[q]);
        }
    }
}

/* The copy rule spreads a hot expert's pairs about evenly: 4 copies of expert 0 over 40000 tokens
 * of random routes each take a quarter within 3 % (3.5 standard deviations). */
static void test_copy_spread(void)
{
    int32_t ids[8];
    int n[4] = { 0 };
    for (int t = 0; t < 40000; t++) {
        ids[0] = 0;
        for (int j = 1; j < 8; j++) ids[j] = 1 + (int32_t)(urand() * 255);
        const uint64_t h = moed_route_token_hash(ids, 8);
        n[(h >> 32) * 4 >> 32]++;
        CHECK_EQ_INT((int)((h >> 32) * 4 >> 32), ref_copy(ids, 8, 4));
    }
    for (int c = 0; c < 4; c++)
        CHECK_MSG(n[c] > 9700 && n[c] < 10300, "copy %d: %d of 40000", c, n[c]);
}

int main(void)
{
    test_topk_by_hand();
    test_quadratic_pioneer_by_hand();
    test_sigmoid_by_hand();
    test_sparsemax_by_hand();
    test_deepseek_by_hand();
    test_random();
    test_batch();
    test_choice();
    test_choice_rules();
    test_resolve();
    test_concat();
    test_router_rounding();
    test_split();
    test_split_copies();
    test_copy_spread();
    return check_status("test_route");
}
