/*
 * moed_prune — the relative error of a 2:4-pruned layer against its dense weights (see prune.h).
 *
 * Matrices are read a row at a time (converted to float32 by moed_to_f32, which is exact for every
 * weight dtype taken) and every product and sum is in double, so the only rounding between the
 * stored weights and the stated error is double's.
 */
#include "prune.h"

#include "moed_dtype.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

double moed_prune_token_value(int layer, int t, int i)
{
    uint64_t h = mix(mix(mix(MOED_PRUNE_SEED ^ (uint64_t)(uint32_t)layer) ^ (uint64_t)(uint32_t)t) ^
                     (uint64_t)(uint32_t)i);
    return (double)(h >> 11) * 0x1.0p-52 - 1.0; /* 53 bits: [0, 2) - 1 */
}

static double dot_row(const float *row, const double *v, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++) s += (double)row[i] * v[i];
    return s;
}

int moed_prune_probe_init(moed_prune_probe *p, const moed_layer *l, moed_error *err)
{
    const moed_layer_info *li = &l->info;
    const int T = MOED_PRUNE_TOKENS, d = li->d_model, E = li->n_experts;
    memset(p, 0, sizeof *p);
    p->info = *li;
    p->T = T;
    p->x = malloc(sizeof(double) * (size_t)T * (size_t)d);
    p->y_dense = calloc((size_t)T * (size_t)d, sizeof(double));
    p->y_pruned = calloc((size_t)T * (size_t)d, sizeof(double));
    float *logits = malloc(sizeof(float) * (size_t)T * (size_t)E);
    float *row = malloc(sizeof(float) * (size_t)d);
    int rc = 0;
    if (!p->x || !p->y_dense || !p->y_pruned || !logits || !row) {
        rc = moed_fail(err, MOED_ENOMEM, "no memory to measure layer %d's pruning", li->index);
        goto out;
    }
    for (int t = 0; t < T; t++)
        for (int i = 0; i < d; i++)
            p->x[(size_t)t * d + i] = moed_prune_token_value(li->index, t, i);
    /* The layer's own router, as its model routes: the experts this batch measures are those real
     * tokens of such values would reach. Without a router, the top_k of seeded logits. */
    moed_gate_params gp = { .strategy = l->router ? MOED_GATE_MODEL : MOED_GATE_TOPK };
    const int rd = moed_layer_router_dtype(l);
    const size_t rsize = moed_dtype_size(rd);
    for (int e = 0; e < E; e++) {
        if (l->router) moed_to_f32(rd, (const char *)l->router + (size_t)e * d * rsize, row, d);
        for (int t = 0; t < T; t++)
            logits[(size_t)t * E + e] = l->router
                                            ? (float)dot_row(row, &p->x[(size_t)t * d], d)
                                            : (float)moed_prune_token_value(li->index, T + t, e);
    }
    if ((rc = moed_gate_resolve(&gp, li, err)) ||
        (rc = moed_gate(&gp, li, l->router_bias, logits, T, &p->route, err)))
        moed_error_prefix(err, "routing layer %d's pruning probe", li->index);
out:
    free(logits);
    free(row);
    if (rc) moed_prune_probe_free(p);
    return rc;
}

void moed_prune_probe_free(moed_prune_probe *p)
{
    free(p->x);
    free(p->y_dense);
    free(p->y_pruned);
    moed_route_free(&p->route);
    memset(p, 0, sizeof *p);
}

bool moed_prune_touches(const moed_prune_probe *p, int e)
{
    for (int64_t j = 0; p->route.off && j < p->route.off[p->T]; j++)
        if (p->route.expert[j] == e) return true;
    return false;
}

static double act(moed_act a, double h)
{
    switch (a) {
    case MOED_ACT_SWIGLU:
        return h / (1.0 + exp(-h));
    case MOED_ACT_GELU:
        return 0.5 * h * (1.0 + erf(h / sqrt(2.0)));
    case MOED_ACT_RELU:
        return h > 0 ? h : 0;
    default:
        return h;
    }
}

/* y[tok[j]] += wt[j] * expert(x[tok[j]]) for the n tokens given; ff is the matrices' width. The
 * matrices are walked a row at a time with every token inside, so each row is converted once. */
static void add_term(moed_prune_probe *p, const moed_expert_w *w, int ff, const int *tok,
                     const double *wt, int n, double *y)
{
    const moed_layer_info *li = &p->info;
    const int d = li->d_model, dt = li->wdtype;
    const size_t es = moed_dtype_size(dt);
    const bool gated = li->act == MOED_ACT_SWIGLU;
    float *row = malloc(sizeof(float) * (size_t)(d > ff ? d : ff));
    double *h = malloc(sizeof(double) * (size_t)n * (size_t)ff);
    if (!row || !h) {
        free(row);
        free(h);
        p->failed = true;
        return;
    }
    for (int r = 0; r < ff; r++) {
        moed_to_f32(dt, (const char *)w->w1 + (size_t)r * d * es, row, d);
        for (int j = 0; j < n; j++)
            h[(size_t)j * ff + r] = act(li->act, dot_row(row, &p->x[(size_t)tok[j] * d], d));
        if (!gated) continue;
        moed_to_f32(dt, (const char *)w->w3 + (size_t)r * d * es, row, d);
        for (int j = 0; j < n; j++)
            h[(size_t)j * ff + r] *= dot_row(row, &p->x[(size_t)tok[j] * d], d);
    }
    for (int r = 0; r < d; r++) {
        moed_to_f32(dt, (const char *)w->w2 + (size_t)r * ff * es, row, ff);
        for (int j = 0; j < n; j++)
            y[(size_t)tok[j] * d + r] += wt[j] * dot_row(row, &h[(size_t)j * ff], ff);
    }
    free(row);
    free(h);
}

void moed_prune_expert(moed_prune_probe *p, int e, const moed_expert_w *w, bool pruned)
{
    const int64_t pairs = p->route.off ? p->route.off[p->T] : 0;
    int *tok = malloc(sizeof(int) * (size_t)(pairs ? pairs : 1));
    double *wt = malloc(sizeof(double) * (size_t)(pairs ? pairs : 1));
    int n = 0;
    if (!tok || !wt) {
        p->failed = true;
    } else {
        for (int t = 0; t < p->T; t++)
            for (int64_t j = p->route.off[t]; j < p->route.off[t + 1]; j++)
                if (p->route.expert[j] == e) {
                    tok[n] = t;
                    wt[n++] = p->route.weight[j];
                }
        if (n) add_term(p, w, p->info.d_ff, tok, wt, n, pruned ? p->y_pruned : p->y_dense);
    }
    free(tok);
    free(wt);
}

void moed_prune_shared(moed_prune_probe *p, const moed_expert_w *w)
{
    int tok[MOED_PRUNE_TOKENS];
    double wt[MOED_PRUNE_TOKENS];
    double *term = calloc((size_t)p->T * (size_t)p->info.d_model, sizeof *term);
    if (!term) {
        p->failed = true;
        return;
    }
    for (int t = 0; t < p->T; t++) {
        tok[t] = t;
        wt[t] = 1.0;
    }
    add_term(p, w, p->info.shared_d_ff, tok, wt, p->T, term);
    for (size_t i = 0; i < (size_t)p->T * (size_t)p->info.d_model; i++) {
        p->y_dense[i] += term[i];
        p->y_pruned[i] += term[i];
    }
    free(term);
}

double moed_prune_error(const moed_prune_probe *p)
{
    double diff = 0, ref = 0;
    for (size_t i = 0; i < (size_t)p->T * (size_t)p->info.d_model; i++) {
        const double a = p->y_pruned[i] - p->y_dense[i];
        diff += a * a;
        ref += p->y_dense[i] * p->y_dense[i];
    }
    if (p->failed) return NAN;
    return ref > 0 ? sqrt(diff / ref) : diff > 0 ? INFINITY : 0.0;
}
