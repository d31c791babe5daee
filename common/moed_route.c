/*
 * moed_route — routes (CSR lists of (expert, weight) pairs per token), client choices turned into
 * routes, and the gating strategies. Exactly (the numpy reference in client/python agrees):
 *
 *   TOPK      p = softmax(l) (max subtracted); the top_k largest p; w = p, or p / sum(chosen p)
 *   QUADRATIC the same with softmax(l^2);  PIONEER the same with softmax(cos(l)^2)
 *   SIGMOID   p = 1 / (1 + exp(-l)); every p > threshold, w = p
 *   SPARSEMAX Martins & Astudillo 2016: tau from the sorted logits, p = max(l - tau, 0); p > 0
 *   MODEL     the layer's rule: SOFTMAX_TOPK is TOPK; DEEPSEEK_V3 chooses top_k by
 *             sigmoid(l) + bias among the topk_group groups whose two best sum highest, and
 *             weighs by sigmoid(l), / (sum + 1e-20) when renormalising, times routed_scale
 *   batch     S = the k_batch largest column sums (float64, token order); w = softmax(l over S)
 *
 * Lists go by decreasing score, ties to the lower expert index. Every score and weight is
 * computed in float64 and each weight rounded once to float32, so the route is the float64
 * definition rounded, and which experts are chosen never hinges on float32 rounding.
 *
 * Speed (T up to 16384, E up to 256): top-k keeps a sorted list of k candidates while scanning the
 * experts in index order (ties fall to the lower index for free); only a large k, or the
 * variable-length strategies, sort, with an inline merge sort. Scratch is allocated per call, not
 * per token, and large calls split their tokens over threads.
 */
#include "moed_route.h"

#include "moed_dtype.h"
#include "moed_pool.h"
#include "moed_synth.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Above this k a full sort of the E candidates beats insertion into a sorted top-k list. */
#define ROUTE_INSERT_MAX_K 24
/* Logits (T x E) from which gating is worth spreading over threads. */
#define ROUTE_PARALLEL_MIN (1 << 17)

static const char *const strategy_names[] = { "model",     "topk",      "sigmoid",
                                              "sparsemax", "quadratic", "pioneer" };

int moed_gate_strategy_parse(const char *name)
{
    for (int i = 0; i < (int)(sizeof strategy_names / sizeof strategy_names[0]); i++)
        if (!strcmp(name, strategy_names[i])) return i;
    return -1;
}

const char *moed_gate_strategy_name(int strategy)
{
    if (strategy < 0 || strategy >= (int)(sizeof strategy_names / sizeof strategy_names[0]))
        return "unknown";
    return strategy_names[strategy];
}

int moed_route_init(moed_route *r, int64_t T, int64_t cap)
{
    memset(r, 0, sizeof *r);
    if (T < 0 || cap < 0 || (uint64_t)T >= SIZE_MAX / sizeof(int64_t) ||
        (uint64_t)cap >= SIZE_MAX / sizeof(int32_t))
        return MOED_EINVAL;
    r->off = calloc((size_t)T + 1, sizeof *r->off);
    r->expert = malloc((size_t)(cap ? cap : 1) * sizeof *r->expert);
    r->weight = malloc((size_t)(cap ? cap : 1) * sizeof *r->weight);
    if (!r->off || !r->expert || !r->weight) {
        moed_route_free(r);
        return MOED_ENOMEM;
    }
    r->T = T;
    r->cap = cap;
    return 0;
}

void moed_route_free(moed_route *r)
{
    if (!r) return;
    free(r->off);
    free(r->expert);
    free(r->weight);
    memset(r, 0, sizeof *r);
}

/* Makes room for `need` pairs, growing geometrically (sigmoid and sparsemax routes do not know
 * their size in advance). */
static int route_reserve(moed_route *r, int64_t need)
{
    if (need <= r->cap) return 0;
    int64_t cap = r->cap * 2 > need ? r->cap * 2 : need;
    if ((uint64_t)cap >= SIZE_MAX / sizeof(int32_t)) return MOED_ENOMEM;
    int32_t *e = realloc(r->expert, (size_t)cap * sizeof *e);
    if (!e) return MOED_ENOMEM;
    r->expert = e;
    float *w = realloc(r->weight, (size_t)cap * sizeof *w);
    if (!w) return MOED_ENOMEM;
    r->weight = w;
    r->cap = cap;
    return 0;
}

int64_t moed_choice_check(const int32_t *ids, const float *w, int64_t rows, int k, int n_experts)
{
    for (int64_t i = 0; i < rows * k; i++) {
        const int rule = moed_choice_rule(ids[i], w[i], n_experts);
        if (rule > MOED_CHOICE_PADDING) return i << MOED_CHOICE_RULE_BITS | rule;
    }
    return -1;
}

int moed_choice_fail(moed_error *err, int64_t code, int k, int n_experts)
{
    const int64_t at = code >> MOED_CHOICE_RULE_BITS, row = at / k;
    const int col = (int)(at % k);
    switch (code & ((1 << MOED_CHOICE_RULE_BITS) - 1)) {
    case MOED_CHOICE_PAD_WEIGHT:
        return moed_fail(err, MOED_EINVAL,
                         "expert_ids[%lld][%d] marks padding (-1), but expert_weights[%lld][%d] is "
                         "not 0: padding must have weight 0",
                         (long long)row, col, (long long)row, col);
    case MOED_CHOICE_RANGE:
        return moed_fail(err, MOED_EINVAL,
                         "expert_ids[%lld][%d] is out of range: the layer has %d experts, so ids "
                         "must be in [0, %d) (or -1 with weight 0 for padding)",
                         (long long)row, col, n_experts, n_experts);
    default:
        return moed_fail(err, MOED_EINVAL,
                         "expert_weights[%lld][%d] is %s: routing weights must be finite and >= 0",
                         (long long)row, col,
                         (code & ((1 << MOED_CHOICE_RULE_BITS) - 1)) == MOED_CHOICE_NEGATIVE
                             ? "negative"
                             : "not finite");
    }
}

int moed_route_from_choice(moed_route *r, const int32_t *ids, const float *w, int64_t T, int k,
                           int n_experts, moed_error *err)
{
    memset(r, 0, sizeof *r);
    if (T < 0 || k < 0)
        return moed_fail(err, MOED_EINVAL, "expert choice has shape [%lld, %d]: both must be >= 0",
                         (long long)T, k);
    int64_t pairs = 0;
    for (int64_t t = 0; t < T; t++) {
        for (int j = 0; j < k; j++) {
            const int rule = moed_choice_rule(ids[t * k + j], w[t * k + j], n_experts);
            if (rule > MOED_CHOICE_PADDING)
                return moed_choice_fail(err, (t * k + j) << MOED_CHOICE_RULE_BITS | rule, k,
                                        n_experts);
            pairs += rule == MOED_CHOICE_VALID;
        }
    }
    int rc = moed_route_init(r, T, pairs);
    if (rc) return moed_fail(err, rc, "no memory for a route of %lld pairs", (long long)pairs);
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++) {
        for (int j = 0; j < k; j++) {
            if (ids[t * k + j] == -1) continue;
            r->expert[n] = ids[t * k + j];
            r->weight[n] = w[t * k + j];
            n++;
        }
        r->off[t + 1] = n;
    }
    return 0;
}

/* DeepSeek-V3's group-limited routing must be able to pick top_k experts from topk_group groups. */
static int check_groups(const moed_layer_info *li, int top_k, moed_error *err)
{
    int E = li->n_experts, G = li->n_group, KG = li->topk_group;
    if (G <= 1) return 0; /* not grouped */
    if (E % G != 0)
        return moed_fail(err, MOED_EINVAL,
                         "layer %d: n_group = %d does not divide its %d experts into equal groups",
                         li->index, G, E);
    if (KG < 1 || KG > G)
        return moed_fail(err, MOED_EINVAL, "layer %d: topk_group = %d must be in [1, n_group = %d]",
                         li->index, KG, G);
    if (top_k > KG * (E / G))
        return moed_fail(err, MOED_EINVAL,
                         "top_k = %d is more than the %d experts of the %d groups the layer %d "
                         "keeps (topk_group %d x %d experts per group)",
                         top_k, KG * (E / G), KG, li->index, KG, E / G);
    return 0;
}

void moed_router_round_logits(const moed_layer_info *li, int dtype, float *logits, size_t n)
{
    if (li->rule != MOED_RULE_SOFTMAX_TOPK || dtype == MOED_F32) return;
    for (size_t i = 0; i < n; i++)
        logits[i] = dtype == MOED_BF16 ? moed_bf16_to_f32(moed_f32_to_bf16(logits[i]))
                                       : moed_f16_to_f32(moed_f32_to_f16(logits[i]));
}

int moed_gate_resolve(moed_gate_params *p, const moed_layer_info *li, moed_error *err)
{
    if (p->strategy < MOED_GATE_MODEL || p->strategy > MOED_GATE_PIONEER)
        return moed_fail(err, MOED_EINVAL,
                         "unknown gating strategy %d: use 0 (the layer's own rule), 1 topk, "
                         "2 sigmoid, 3 sparsemax, 4 quadratic or 5 pioneer",
                         p->strategy);
    if (p->strategy == MOED_GATE_MODEL && li->rule != MOED_RULE_SOFTMAX_TOPK &&
        li->rule != MOED_RULE_DEEPSEEK_V3)
        return moed_fail(err, MOED_EINVAL,
                         "layer %d has no router rule of its own (rule %d): name a gating "
                         "strategy (topk, sigmoid, sparsemax, quadratic or pioneer)",
                         li->index, (int)li->rule);
    if (p->top_k == 0) p->top_k = li->top_k;
    if (p->top_k < 1 || p->top_k > li->n_experts)
        return moed_fail(
            err, MOED_EINVAL,
            "top_k = %lld is out of range: layer %d has %d experts, so top_k must be in "
            "[1, %d] (0 means the layer's own %d)",
            (long long)p->top_k, li->index, li->n_experts, li->n_experts, li->top_k);
    if (p->renormalize == MOED_RENORM_DEFAULT)
        p->renormalize = li->norm_topk ? MOED_RENORM_ON : MOED_RENORM_OFF;
    if (p->renormalize != MOED_RENORM_ON && p->renormalize != MOED_RENORM_OFF)
        return moed_fail(err, MOED_EINVAL,
                         "renormalize = %d is unknown: use 0 (the layer's default), 1 (on) or 2 "
                         "(off)",
                         p->renormalize);
    if (p->threshold == 0.0f) p->threshold = 0.5f;
    if (!(p->threshold > 0.0f && p->threshold < 1.0f))
        return moed_fail(err, MOED_EINVAL,
                         "sigmoid threshold = %g is out of range: it must be in (0, 1) (0 means "
                         "0.5)",
                         (double)p->threshold);
    if (p->strategy == MOED_GATE_MODEL && li->rule == MOED_RULE_DEEPSEEK_V3)
        return check_groups(li, (int)p->top_k, err);
    return 0;
}

/* ---- selection ---------------------------------------------------------------------------- */

typedef struct keyed {
    double key;
    int idx;
} keyed;

/* Decreasing key, ties to the lower index: a total order, so any correct sort gives one result. */
static inline int keyed_before(const keyed *x, const keyed *y)
{
    return x->key > y->key || (x->key == y->key && x->idx < y->idx);
}

/* Sorts a[0..n) by keyed_before: insertion sort of runs of 16, then bottom-up merges through tmp
 * (n entries). Inline comparisons: qsort's calls cost more than the sort at these sizes. */
static void keyed_sort(keyed *a, int n, keyed *tmp)
{
    for (int lo = 0; lo < n; lo += 16) {
        int hi = lo + 16 < n ? lo + 16 : n;
        for (int i = lo + 1; i < hi; i++) {
            keyed v = a[i];
            int j = i;
            while (j > lo && keyed_before(&v, &a[j - 1])) {
                a[j] = a[j - 1];
                j--;
            }
            a[j] = v;
        }
    }
    keyed *src = a, *dst = tmp;
    for (int width = 16; width < n; width *= 2) {
        for (int lo = 0; lo < n; lo += 2 * width) {
            int mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            int i = lo, j = mid, o = lo;
            while (i < mid && j < hi)
                dst[o++] = keyed_before(&src[j], &src[i]) ? src[j++] : src[i++];
            while (i < mid) dst[o++] = src[i++];
            while (j < hi) dst[o++] = src[j++];
        }
        keyed *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof *a);
}

/* Scratch for one gating call, sized for E experts. */
typedef struct gate_scratch {
    double *score;   /* per expert */
    double *prob;    /* per expert */
    int *sel;        /* chosen experts, in route order */
    int *cand;       /* candidate experts, increasing */
    keyed *kv, *tmp; /* sort space */
    int E;
} gate_scratch;

static int scratch_init(gate_scratch *s, int E)
{
    s->E = E;
    s->score = malloc((size_t)E * sizeof *s->score);
    s->prob = malloc((size_t)E * sizeof *s->prob);
    s->sel = malloc((size_t)E * sizeof *s->sel);
    s->cand = malloc((size_t)E * sizeof *s->cand);
    s->kv = malloc((size_t)E * sizeof *s->kv);
    s->tmp = malloc((size_t)E * sizeof *s->tmp);
    return s->score && s->prob && s->sel && s->cand && s->kv && s->tmp ? 0 : MOED_ENOMEM;
}

static void scratch_free(gate_scratch *s)
{
    free(s->score);
    free(s->prob);
    free(s->sel);
    free(s->cand);
    free(s->kv);
    free(s->tmp);
}

/* Writes to sel the k entries of idx[0..n) with the largest key[idx] (ties to the lower index),
 * by decreasing key. idx must be increasing; NULL means 0 .. n-1. */
static void select_top(const double *key, const int *idx, int n, int k, int *sel, keyed *kv,
                       keyed *tmp)
{
    if (k > n) k = n;
    if (k <= ROUTE_INSERT_MAX_K) {
        int have = 0;
        for (int i = 0; i < n; i++) {
            int e = idx ? idx[i] : i;
            double v = key[e];
            /* e is larger than every index held, so it only displaces strictly smaller keys */
            if (have == k && !(v > key[sel[k - 1]])) continue;
            int j = have < k ? have++ : k - 1;
            while (j > 0 && v > key[sel[j - 1]]) {
                sel[j] = sel[j - 1];
                j--;
            }
            sel[j] = e;
        }
        return;
    }
    for (int i = 0; i < n; i++) {
        kv[i].idx = idx ? idx[i] : i;
        kv[i].key = key[kv[i].idx];
    }
    keyed_sort(kv, n, tmp);
    for (int i = 0; i < k; i++) sel[i] = kv[i].idx;
}

/* ---- strategies: each fills s->sel / weights for one token and returns the pair count ------- */

static double sigmoid(double x)
{
    return 1.0 / (1.0 + exp(-x));
}

/* TOPK, QUADRATIC, PIONEER: p = softmax(score), the top k by p, renormalised if asked. */
static int gate_softmax_topk(int strategy, const float *l, int k, int renorm, gate_scratch *s,
                             double *w)
{
    int E = s->E;
    double m = -INFINITY;
    for (int e = 0; e < E; e++) {
        double x = l[e];
        if (strategy == MOED_GATE_QUADRATIC)
            x = x * x;
        else if (strategy == MOED_GATE_PIONEER)
            x = cos(x) * cos(x);
        s->score[e] = x;
        if (x > m) m = x;
    }
    double sum = 0.0;
    for (int e = 0; e < E; e++) {
        s->prob[e] = exp(s->score[e] - m);
        sum += s->prob[e];
    }
    for (int e = 0; e < E; e++) s->prob[e] /= sum;
    select_top(s->prob, NULL, E, k, s->sel, s->kv, s->tmp);
    double norm = 0.0;
    for (int j = 0; j < k; j++) norm += s->prob[s->sel[j]];
    for (int j = 0; j < k; j++) w[j] = renorm ? s->prob[s->sel[j]] / norm : s->prob[s->sel[j]];
    return k;
}

/* Sorts sel[0..n) (increasing indices) by decreasing prob, ties to the lower index. */
static void order_by_prob(gate_scratch *s, int n)
{
    for (int i = 0; i < n; i++) s->kv[i] = (keyed){ s->prob[s->sel[i]], s->sel[i] };
    keyed_sort(s->kv, n, s->tmp);
    for (int i = 0; i < n; i++) s->sel[i] = s->kv[i].idx;
}

static int gate_sigmoid(const float *l, float threshold, gate_scratch *s, double *w)
{
    int n = 0;
    for (int e = 0; e < s->E; e++) {
        s->prob[e] = sigmoid(l[e]);
        if (s->prob[e] > (double)threshold) s->sel[n++] = e;
    }
    order_by_prob(s, n);
    for (int j = 0; j < n; j++) w[j] = s->prob[s->sel[j]];
    return n;
}

/* Sparsemax. Only experts within 2 of the largest logit can be in the support (tau >= max - 1), so
 * only they are sorted; the margin keeps the result identical to sorting all E. */
/* On z = l - max(l): sparsemax is shift-invariant, and without the shift a logit beyond 2^53 makes
 * `max - 2` round to max, keeps no candidate and divides by zero (found by the request fuzzer).
 * The difference of two floats within 2 of each other is exact in double. */
static int gate_sparsemax(const float *l, gate_scratch *s, double *w)
{
    int E = s->E;
    double zmax = -INFINITY;
    for (int e = 0; e < E; e++)
        if ((double)l[e] > zmax) zmax = l[e];
    int n = 0;
    for (int e = 0; e < E; e++)
        if ((double)l[e] - zmax > -2.0) s->kv[n++] = (keyed){ (double)l[e] - zmax, e };
    keyed_sort(s->kv, n, s->tmp);
    double cum = 0.0, cum_star = 0.0;
    int kstar = 0;
    for (int k = 1; k <= n; k++) {
        cum += s->kv[k - 1].key;
        if (1.0 + k * s->kv[k - 1].key > cum) {
            kstar = k;
            cum_star = cum;
        }
    }
    double tau = (cum_star - 1.0) / kstar;
    int m = 0;
    for (int e = 0; e < E; e++) {
        const double z = (double)l[e] - zmax;
        s->prob[e] = z - tau > 0.0 ? z - tau : 0.0;
        if (s->prob[e] > 0.0) s->sel[m++] = e;
    }
    order_by_prob(s, m);
    for (int j = 0; j < m; j++) w[j] = s->prob[s->sel[j]];
    return m;
}

/* DeepSeek-V3: choose by sigmoid + bias within the best groups, weigh by the unbiased sigmoid. */
static int gate_deepseek(const float *l, const float *bias, const moed_layer_info *li, int k,
                         int renorm, gate_scratch *s, double *w)
{
    int E = s->E, G = li->n_group > 1 ? li->n_group : 1, gs = E / G;
    for (int e = 0; e < E; e++) {
        s->prob[e] = sigmoid(l[e]);
        s->score[e] = s->prob[e] + (bias ? (double)bias[e] : 0.0);
    }
    int n = 0;
    if (G == 1) {
        for (int e = 0; e < E; e++) s->cand[n++] = e;
    } else {
        for (int q = 0; q < G; q++) { /* group score: the sum of its two largest scores */
            double a = -INFINITY, b = -INFINITY;
            for (int e = q * gs; e < (q + 1) * gs; e++) {
                double c = s->score[e];
                if (c > a) {
                    b = a;
                    a = c;
                } else if (c > b) {
                    b = c;
                }
            }
            s->kv[q] = (keyed){ gs > 1 ? a + b : a, q };
        }
        keyed_sort(s->kv, G, s->tmp);
        for (int q = 0; q < G; q++) {
            int keep = 0;
            for (int j = 0; j < li->topk_group; j++) keep |= s->kv[j].idx == q;
            for (int e = q * gs; keep && e < (q + 1) * gs; e++) s->cand[n++] = e;
        }
    }
    select_top(s->score, s->cand, n, k, s->sel, s->kv, s->tmp);
    double sum = 0.0;
    for (int j = 0; j < k; j++) sum += s->prob[s->sel[j]];
    for (int j = 0; j < k; j++) {
        double v = s->prob[s->sel[j]];
        if (renorm) v /= sum + 1e-20;
        w[j] = v * (double)li->routed_scale;
    }
    return k;
}

/* Names the first NaN or Inf of an [T, E] float32 matrix (by position only, as every message
 * about a tensor's values: moed_route.h). */
static int check_finite(const float *v, int64_t T, int E, const char *what, moed_error *err)
{
    for (int64_t i = 0; i < T * (int64_t)E; i++)
        if (!isfinite(v[i]))
            return moed_fail(err, MOED_EINVAL,
                             "%s[%lld][%lld] is not finite: router logits must be finite", what,
                             (long long)(i / E), (long long)(i % E));
    return 0;
}

/* Appends one token's pairs (experts sel, weights w in float64) to the route. */
static int route_append(moed_route *r, int64_t t, const int *sel, const double *w, int n)
{
    int64_t at = r->off[t];
    if (route_reserve(r, at + n)) return MOED_ENOMEM;
    for (int j = 0; j < n; j++) {
        r->expert[at + j] = sel[j];
        r->weight[at + j] = (float)w[j];
    }
    r->off[t + 1] = at + n;
    return 0;
}

/* One gating job: a resolved strategy over a range of tokens. */
typedef struct gate_job {
    moed_gate_params q;
    int rule; /* the layer's rule when the strategy is MODEL, else 0 */
    const moed_layer_info *li;
    const float *bias;
    const float *logits;
    int64_t T;
    int64_t chunk;     /* tokens per part */
    moed_route *parts; /* one route per chunk */
    int *rc;           /* per chunk */
} gate_job;

/* Gates tokens [t0, t0 + T) into a new route r. */
static int gate_range(const gate_job *g, int64_t t0, int64_t T, moed_route *r)
{
    int E = g->li->n_experts,
        varying = g->q.strategy == MOED_GATE_SIGMOID || g->q.strategy == MOED_GATE_SPARSEMAX;
    int renorm = g->q.renormalize == MOED_RENORM_ON, k = (int)g->q.top_k;
    gate_scratch s = { 0 };
    double *w = malloc((size_t)E * sizeof *w);
    int rc = scratch_init(&s, E);
    if (!rc && w) rc = moed_route_init(r, T, T * (varying ? 1 : k));
    for (int64_t t = 0; t < T && !rc && w; t++) {
        const float *l = g->logits + (t0 + t) * E;
        int n;
        if (g->rule == MOED_RULE_DEEPSEEK_V3)
            n = gate_deepseek(l, g->bias, g->li, k, renorm, &s, w);
        else if (g->q.strategy == MOED_GATE_SIGMOID)
            n = gate_sigmoid(l, g->q.threshold, &s, w);
        else if (g->q.strategy == MOED_GATE_SPARSEMAX)
            n = gate_sparsemax(l, &s, w);
        else
            n = gate_softmax_topk(g->q.strategy, l, k, renorm, &s, w);
        rc = route_append(r, t, s.sel, w, n);
    }
    if (!w) rc = MOED_ENOMEM;
    scratch_free(&s);
    free(w);
    if (rc) moed_route_free(r);
    return rc;
}

static void gate_task(void *arg, int64_t task, int thread)
{
    (void)thread;
    const gate_job *g = arg;
    int64_t t0 = task * g->chunk, n = g->T - t0 < g->chunk ? g->T - t0 : g->chunk;
    g->rc[task] = gate_range(g, t0, n, &g->parts[task]);
}

/* Splits a large job over a temporary pool: tokens are independent, so the parts, concatenated,
 * are exactly the route one thread would build. */
static int gate_parallel(gate_job *g, moed_route *out)
{
    int threads = moed_pool_online_cpus();
    int64_t n = (int64_t)threads * 4;
    g->chunk = (g->T + n - 1) / n;
    n = (g->T + g->chunk - 1) / g->chunk;
    moed_pool *pool = NULL;
    g->parts = calloc((size_t)n, sizeof *g->parts);
    g->rc = calloc((size_t)n, sizeof *g->rc);
    const moed_route **pp = calloc((size_t)n, sizeof *pp);
    int rc = g->parts && g->rc && pp ? moed_pool_create(threads, &pool) : MOED_ENOMEM;
    if (!rc) moed_pool_run(pool, n, gate_task, g);
    int64_t pairs = 0;
    for (int64_t i = 0; i < n && !rc; i++) {
        rc = g->rc[i];
        pp[i] = &g->parts[i];
        if (!rc) pairs += g->parts[i].off[g->parts[i].T];
    }
    if (!rc) rc = moed_route_init(out, g->T, pairs);
    if (!rc) moed_route_concat(out, pp, (int)n);
    for (int64_t i = 0; g->parts && i < n; i++) moed_route_free(&g->parts[i]);
    moed_pool_destroy(pool);
    free(g->parts);
    free(g->rc);
    free(pp);
    return rc;
}

int moed_gate(const moed_gate_params *p, const moed_layer_info *li, const float *router_bias,
              const float *logits, int64_t T, moed_route *out, moed_error *err)
{
    memset(out, 0, sizeof *out);
    gate_job g = { .q = *p, .li = li, .bias = router_bias, .logits = logits, .T = T };
    int rc = moed_gate_resolve(&g.q, li, err);
    if (rc) return rc;
    int E = li->n_experts;
    if ((rc = check_finite(logits, T, E, "logits", err))) return rc;
    g.rule = g.q.strategy == MOED_GATE_MODEL ? li->rule : 0;
    if (g.rule == MOED_RULE_DEEPSEEK_V3 && router_bias)
        for (int e = 0; e < E; e++)
            if (!isfinite(router_bias[e]))
                return moed_fail(err, MOED_EINVAL,
                                 "layer %d's router bias of expert %d is %g: the checkpoint's "
                                 "e_score_correction_bias must be finite",
                                 li->index, e, (double)router_bias[e]);
    rc = T * E >= ROUTE_PARALLEL_MIN && moed_pool_online_cpus() > 1 ? gate_parallel(&g, out)
                                                                    : gate_range(&g, 0, T, out);
    if (rc)
        return moed_fail(err, rc, "no memory to gate %lld tokens over %d experts", (long long)T, E);
    return 0;
}

int moed_gate_batch(const float *logits, int64_t T, int E, int k_batch, int32_t *set,
                    moed_route *out, moed_error *err)
{
    memset(out, 0, sizeof *out);
    if (E < 1 || k_batch < 1 || k_batch > E)
        return moed_fail(err, MOED_EINVAL,
                         "batch gating k_batch = %d is out of range: it must be in [1, %d], the "
                         "layer's experts",
                         k_batch, E);
    int rc = check_finite(logits, T, E, "logits", err);
    if (rc) return rc;
    gate_scratch s = { 0 };
    rc = scratch_init(&s, E);
    if (!rc) rc = moed_route_init(out, T, T * k_batch);
    if (rc) {
        rc = moed_fail(err, MOED_ENOMEM, "no memory to gate %lld tokens over %d experts",
                       (long long)T, E);
        goto err;
    }
    for (int e = 0; e < E; e++) s.score[e] = 0.0;
    for (int64_t t = 0; t < T; t++)
        for (int e = 0; e < E; e++) s.score[e] += logits[t * E + e];
    select_top(s.score, NULL, E, k_batch, s.sel, s.kv, s.tmp);
    for (int j = 0; j < k_batch; j++) set[j] = s.sel[j];
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        double m = -INFINITY, sum = 0.0;
        for (int j = 0; j < k_batch; j++)
            if ((double)l[s.sel[j]] > m) m = l[s.sel[j]];
        for (int j = 0; j < k_batch; j++) {
            s.prob[j] = exp((double)l[s.sel[j]] - m);
            sum += s.prob[j];
        }
        for (int j = 0; j < k_batch; j++) s.prob[j] /= sum;
        route_append(out, t, s.sel, s.prob, k_batch); /* cannot grow: cap is T * k_batch */
    }
    scratch_free(&s);
    return 0;
err:
    scratch_free(&s);
    moed_route_free(out);
    return rc;
}

int moed_route_concat(moed_route *out, const moed_route *const *parts, int nparts)
{
    int64_t T = 0, pairs = 0;
    for (int i = 0; i < nparts; i++) {
        T += parts[i]->T;
        pairs += parts[i]->off[parts[i]->T];
    }
    if (T > out->T || pairs > out->cap) return MOED_EINVAL;
    int64_t t0 = 0, p0 = 0;
    out->off[0] = 0;
    for (int i = 0; i < nparts; i++) {
        const moed_route *r = parts[i];
        int64_t n = r->off[r->T];
        memcpy(out->expert + p0, r->expert, (size_t)n * sizeof *r->expert);
        memcpy(out->weight + p0, r->weight, (size_t)n * sizeof *r->weight);
        for (int64_t t = 0; t < r->T; t++) out->off[t0 + t + 1] = p0 + r->off[t + 1];
        t0 += r->T;
        p0 += n;
    }
    out->T = T;
    return 0;
}

void moed_route_localize(moed_route *r, const int32_t *local_of)
{
    int64_t kept = 0, first = 0;
    for (int64_t t = 0; t < r->T; t++) {
        const int64_t end = r->off[t + 1];
        for (int64_t p = first; p < end; p++) {
            const int32_t e = local_of[r->expert[p]];
            if (e < 0) continue;
            r->expert[kept] = e;
            r->weight[kept++] = r->weight[p];
        }
        first = end; /* off[t + 1] is overwritten below: the next token starts where it ended */
        r->off[t + 1] = kept;
    }
}

/* moed_route_token_hash: one multiply a pair in the chain, the mixing once a token. */
static inline uint64_t token_hash(const int32_t *expert, int64_t n)
{
    uint64_t h = 0;
    for (int64_t j = 0; j < n; j++) h = (h ^ (uint32_t)expert[j]) * 0x9E3779B97F4A7C15ull;
    return moed_splitmix64(h);
}

uint64_t moed_route_token_hash(const int32_t *expert, int64_t n)
{
    return token_hash(expert, n);
}

/* The split of moed_route_split and moed_route_split_copies, inlined into each so that the first
 * keeps its one branchless pass (cp NULL folds away): one pass over the pairs with each part's
 * counts in locals, since the host does this before any part can start, for every batch of a
 * split layer. With copies each token's hash is taken first (a second read of its few ids). */
static inline __attribute__((always_inline)) void
split_route(const moed_route *r, int64_t t0, int64_t t1, const uint8_t *part_of, const int *first,
            const moed_route_copies *cp, int n_parts, moed_route *parts, int32_t *tok, int32_t *row)
{
    const int64_t T = t1 - t0;
    int64_t pairs[MOED_ROUTE_MAX_PARTS], toks[MOED_ROUTE_MAX_PARTS];
    for (int q = 0; q < n_parts; q++) {
        pairs[q] = toks[q] = 0;
        parts[q].off[0] = 0;
    }
    for (int64_t t = 0; t < T; t++) {
        uint64_t touched = 0;
        const int64_t j0 = r->off[t0 + t], j1 = r->off[t0 + t + 1];
        const uint64_t h = cp ? token_hash(r->expert + j0, j1 - j0) : 0;
        for (int64_t j = j0; j < j1; j++) {
            const int e = r->expert[j];
            int q, local;
            if (cp) { /* the rule of moed_route_token_hash */
                const uint64_t r_e = (uint64_t)(cp->off[e + 1] - cp->off[e]);
                const int32_t c = cp->off[e] + (int32_t)((h >> 32) * r_e >> 32);
                q = cp->part[c];
                local = cp->local[c];
            } else {
                q = part_of[e];
                local = e - first[q];
            }
            moed_route *p = &parts[q];
            /* the token's first pair in this part opens its row (no branch: parts come in any
             * order, so a branch here would be mispredicted half the time) */
            toks[q] += !(touched >> q & 1);
            touched |= 1ull << q;
            tok[q * T + toks[q] - 1] = (int32_t)t;
            p->expert[pairs[q]] = local;
            p->weight[pairs[q]++] = r->weight[j];
            p->off[toks[q]] = pairs[q];
        }
        for (int q = 0; q < n_parts; q++)
            row[q * T + t] = touched >> q & 1 ? (int32_t)toks[q] - 1 : -1;
    }
    int32_t base = 0; /* the parts' rows one after another */
    for (int q = 0; q < n_parts; base += (int32_t)toks[q++]) {
        parts[q].T = toks[q];
        if (base)
            for (int64_t i = 0; i < toks[q]; i++) row[q * T + tok[q * T + i]] += base;
    }
}

void moed_route_split(const moed_route *r, int64_t t0, int64_t t1, const uint8_t *part_of,
                      const int *first, int n_parts, moed_route *parts, int32_t *tok, int32_t *row)
{
    split_route(r, t0, t1, part_of, first, NULL, n_parts, parts, tok, row);
}

void moed_route_split_copies(const moed_route *r, int64_t t0, int64_t t1,
                             const moed_route_copies *cp, int n_parts, moed_route *parts,
                             int32_t *tok, int32_t *row)
{
    split_route(r, t0, t1, NULL, NULL, cp, n_parts, parts, tok, row);
}
