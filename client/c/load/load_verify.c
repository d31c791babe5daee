/*
 * load_verify — the reference check of moed-load's --verify (load_verify.h states the contract).
 *
 * The reference is the CPU backend (moed_cpu) and the gating code of common/ on weights rebuilt
 * from the synthetic spec, so it follows the protocol's definitions exactly; a CPU server must
 * agree with it to rounding, a CUDA server to its compute type. One thread with one backend slot
 * does the work: the point is to catch wrong, lost or swapped rows under load, not to keep up with
 * it.
 */
#include "load_verify.h"
#include "cpu_backend.h"
#include "moed_dtype.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define VERIFY_QUEUE 32

struct load_verify {
    moed_backend *cpu;
    moed_layer *layers; /* slot i of the backend is layers[i] */
    int n_layers;
    double bound;
    void *y;       /* [max_tokens, d] in the widest dtype: the reference output */
    float *logits; /* [max_tokens, E]: the server router's logits, recomputed */
    float *row_a, *row_b;
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t work, idle;
    load_verify_item queue[VERIFY_QUEUE];
    int head, count;
    bool busy, quit;
    uint64_t quota, taken, checked, mismatches;
    double worst;
    char first[300];
};

static double dtype_bound(int dtype)
{
    return dtype == MOED_BF16 ? 2e-2 : dtype == MOED_F16 ? 5e-3 : 1e-4;
}

/* The per-token bound proto/moed/v1/moed.proto states for FP8 weights on the FP8 Tensor Cores. */
#define FP8_TOKEN_BOUND 1e-1

double load_verify_bound(int dtype, const char *backend, int wdtype)
{
    double b = dtype_bound(dtype);
    if (backend && !strcmp(backend, "cuda")) {
        double c = wdtype == MOED_FP8 ? FP8_TOKEN_BOUND
                                      : dtype_bound(wdtype == MOED_F16 ? MOED_F16 : MOED_BF16);
        if (c > b) b = c;
    }
    return b;
}

/* ---- one check ---- */

/* Route of a batch-gated reply: every token on the set S the server named, weights
 * softmax(l_t restricted to S) in float64 as moed_gate_batch computes them. */
static int route_from_set(const moedc_result *res, const float *logits, int64_t T, int E,
                          int k_batch, moed_route *out, char *why, size_t n)
{
    if ((int)res->n_expert_set != k_batch) {
        snprintf(why, n, "batch gating named %zu experts, asked for %d", res->n_expert_set,
                 k_batch);
        return -1;
    }
    for (int j = 0; j < k_batch; j++) {
        int e = res->expert_set[j];
        bool repeat = false;
        for (int i = 0; i < j; i++) repeat = repeat || res->expert_set[i] == e;
        if (e < 0 || e >= E || repeat) {
            snprintf(why, n, "batch gating set holds expert %d (out of range or repeated)", e);
            return -1;
        }
    }
    if (moed_route_init(out, T, T * k_batch)) {
        snprintf(why, n, "out of memory building the reference route");
        return -1;
    }
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        double m = -INFINITY, sum = 0;
        for (int j = 0; j < k_batch; j++)
            if ((double)l[res->expert_set[j]] > m) m = l[res->expert_set[j]];
        for (int j = 0; j < k_batch; j++) sum += exp((double)l[res->expert_set[j]] - m);
        int64_t o = t * k_batch;
        for (int j = 0; j < k_batch; j++) {
            out->expert[o + j] = res->expert_set[j];
            out->weight[o + j] = (float)(exp((double)l[res->expert_set[j]] - m) / sum);
        }
        out->off[t + 1] = o + k_batch;
    }
    out->T = T;
    return 0;
}

/* The route the server should have used for req, on layer l (backend slot). */
static int reference_route(load_verify *v, int slot, const load_verify_item *it, moed_route *route,
                           char *why, size_t n)
{
    const moedc_request *req = &it->req;
    const moed_layer *l = &v->layers[slot];
    const moed_layer_info *li = &l->info;
    moed_error err;
    if (req->routing == MOEDC_ROUTE_EXPERTS) {
        if (!moed_route_from_choice(route, req->expert_ids, req->expert_weights, req->tokens,
                                    req->k, li->n_experts, &err))
            return 0;
        snprintf(why, n, "the request's route is invalid here: %.240s", err.msg);
        return -1;
    }
    const float *logits = req->logits;
    if (req->routing == MOEDC_ROUTE_SERVER) {
        const moed_job lj = {
            .slot = slot, .dtype = req->dtype, .T = req->tokens, .x = req->hidden
        };
        if (moed_backend_router_logits(v->cpu, 0, &lj, v->logits, &err)) {
            snprintf(why, n, "the reference router failed: %.240s", err.msg);
            return -1;
        }
        logits = v->logits;
    }
    if (req->batch_gating)
        return route_from_set(&it->res, logits, req->tokens, li->n_experts,
                              req->k_batch ? (int)req->k_batch : li->top_k, route, why, n);
    moed_gate_params p = { req->gating.strategy, req->gating.top_k, req->gating.renormalize,
                           req->gating.threshold };
    if (!moed_gate_resolve(&p, li, &err) &&
        !moed_gate(&p, li, l->router_bias, logits, req->tokens, route, &err))
        return 0;
    snprintf(why, n, "the reference gating failed: %.240s", err.msg);
    return -1;
}

/* Row-by-row comparison of the reply with the reference; the worst relative error, or -1 when the
 * reply holds NaN or Inf. */
static double compare(load_verify *v, int dtype, int64_t T, int d, const void *got, const void *ref,
                      int64_t *worst_row)
{
    const size_t row = (size_t)d * moed_dtype_size(dtype);
    double mean_norm = 0, worst = 0;
    for (int64_t t = 0; t < T; t++) {
        moed_to_f32(dtype, (const char *)ref + t * row, v->row_a, (size_t)d);
        double s = 0;
        for (int c = 0; c < d; c++) s += (double)v->row_a[c] * v->row_a[c];
        mean_norm += sqrt(s) / (double)T;
    }
    *worst_row = 0;
    for (int64_t t = 0; t < T; t++) {
        moed_to_f32(dtype, (const char *)ref + t * row, v->row_a, (size_t)d);
        moed_to_f32(dtype, (const char *)got + t * row, v->row_b, (size_t)d);
        double num = 0, den = 0;
        for (int c = 0; c < d; c++) {
            if (!isfinite(v->row_b[c])) {
                *worst_row = t;
                return -1;
            }
            double e = (double)v->row_b[c] - v->row_a[c];
            num += e * e;
            den += (double)v->row_a[c] * v->row_a[c];
        }
        double norm = fmax(sqrt(den), mean_norm);
        double rel = norm > 0 ? sqrt(num) / norm : sqrt(num);
        if (rel > worst) {
            worst = rel;
            *worst_row = t;
        }
    }
    return worst;
}

/* Checks one reply; 0 when it matches, else -1 with why filled. */
static int check(load_verify *v, const load_verify_item *it, double *err_out, char *why, size_t n)
{
    const moedc_request *req = &it->req;
    int slot = -1;
    for (int i = 0; i < v->n_layers; i++)
        if (v->layers[i].info.index == it->layer) slot = i;
    if (slot < 0) {
        snprintf(why, n, "layer %d is not one the verifier built", it->layer);
        return -1;
    }
    moed_route route = { 0 };
    moed_error err;
    int rc = reference_route(v, slot, it, &route, why, n);
    if (!rc) {
        moed_job job = { .slot = slot,
                         .dtype = req->dtype,
                         .T = req->tokens,
                         .x = req->hidden,
                         .y = v->y,
                         .route = &route };
        if (moed_backend_forward(v->cpu, 0, &job, &err)) {
            snprintf(why, n, "the reference forward failed: %.240s", err.msg);
            rc = -1;
        }
    }
    moed_route_free(&route);
    if (rc) return rc;
    int64_t row;
    double e = compare(v, req->dtype, req->tokens, (int)req->d_model, it->res.output, v->y, &row);
    *err_out = e < 0 ? INFINITY : e;
    if (e >= 0 && e <= v->bound) return 0;
    if (e < 0)
        snprintf(why, n, "layer %d, %lld tokens: row %lld of the reply holds NaN or Inf", it->layer,
                 (long long)req->tokens, (long long)row);
    else
        snprintf(why, n,
                 "layer %d, %lld tokens: row %lld differs from the reference by %.3g (relative; "
                 "bound %.0e)",
                 it->layer, (long long)req->tokens, (long long)row, e, v->bound);
    return -1;
}

/* ---- the verifier thread ---- */

static void *verifier_main(void *arg)
{
    load_verify *v = arg;
    pthread_mutex_lock(&v->mu);
    for (;;) {
        while (!v->count && !v->quit) pthread_cond_wait(&v->work, &v->mu);
        if (!v->count) break;
        load_verify_item it = v->queue[v->head];
        v->head = (v->head + 1) % VERIFY_QUEUE;
        v->count--;
        v->busy = true;
        pthread_mutex_unlock(&v->mu);

        char why[300];
        double e = 0;
        int rc = check(v, &it, &e, why, sizeof why);
        moedc_result_free(&it.res);
        free(it.output_copy);

        pthread_mutex_lock(&v->mu);
        v->busy = false;
        v->checked++;
        if (e > v->worst) v->worst = e;
        if (rc && !v->mismatches++) snprintf(v->first, sizeof v->first, "%s", why);
        if (!v->count) pthread_cond_broadcast(&v->idle);
    }
    pthread_mutex_unlock(&v->mu);
    return NULL;
}

void load_verify_begin(load_verify *v, uint64_t quota)
{
    pthread_mutex_lock(&v->mu);
    v->quota = quota;
    v->taken = v->checked = v->mismatches = 0;
    v->worst = 0;
    v->first[0] = 0;
    pthread_mutex_unlock(&v->mu);
}

bool load_verify_offer(load_verify *v, const load_verify_item *item)
{
    bool take = false;
    pthread_mutex_lock(&v->mu);
    if (v->taken < v->quota && v->count < VERIFY_QUEUE) {
        v->queue[(v->head + v->count) % VERIFY_QUEUE] = *item;
        v->count++;
        v->taken++;
        take = true;
        pthread_cond_signal(&v->work);
    }
    pthread_mutex_unlock(&v->mu);
    return take;
}

void load_verify_end(load_verify *v, uint64_t *checked, uint64_t *mismatches, double *worst,
                     char *first, size_t first_len)
{
    pthread_mutex_lock(&v->mu);
    while (v->count || v->busy) pthread_cond_wait(&v->idle, &v->mu);
    *checked = v->checked;
    *mismatches = v->mismatches;
    *worst = v->worst;
    snprintf(first, first_len, "%s", v->first);
    pthread_mutex_unlock(&v->mu);
}

/* ---- set-up ---- */

/* The served layer must be the spec's: same sizes and rules, or the weights are not the same. */
static int same_layer(const moed_layer_info *a, const moed_layer_info *b, moed_error *err)
{
    if (a->d_model == b->d_model && a->d_ff == b->d_ff && a->n_experts == b->n_experts &&
        a->top_k == b->top_k && a->act == b->act && a->wdtype == b->wdtype &&
        a->n_shared == b->n_shared && a->shared_d_ff == b->shared_d_ff && a->rule == b->rule)
        return 0;
    return moed_fail(err, MOED_EINVAL,
                     "layer %d: the server holds d=%d ff=%d experts=%d topk=%d %s %s, the spec "
                     "gives d=%d ff=%d experts=%d topk=%d %s %s: --synthetic must be the server's",
                     a->index, a->d_model, a->d_ff, a->n_experts, a->top_k, moed_act_name(a->act),
                     moed_dtype_name(a->wdtype), b->d_model, b->d_ff, b->n_experts, b->top_k,
                     moed_act_name(b->act), moed_dtype_name(b->wdtype));
}

int load_verify_open(const moed_synth_spec *spec, const moed_layer_info *served, int n,
                     int64_t max_tokens, double bound, load_verify **out, moed_error *err)
{
    *out = NULL;
    load_verify *v = calloc(1, sizeof *v);
    if (!v) return moed_fail(err, MOED_ENOMEM, "out of memory setting up --verify");
    pthread_mutex_init(&v->mu, NULL);
    pthread_cond_init(&v->work, NULL);
    pthread_cond_init(&v->idle, NULL);
    v->bound = bound;
    int rc = 0, max_d = 1, max_e = 1;
    v->layers = calloc((size_t)n, sizeof *v->layers);
    if (!v->layers) goto nomem;
    moed_backend_config cfg = { .threads = 1, .max_tokens = max_tokens };
    rc = moed_backend_cpu_open(&cfg, &v->cpu, err);
    if (rc) goto err;
    for (int i = 0; i < n; i++) {
        if (served[i].index < 0 || served[i].index >= spec->layers) {
            rc = moed_fail(err, MOED_EINVAL,
                           "the server serves layer %d, but the synthetic spec has layers 0..%d",
                           served[i].index, spec->layers - 1);
            goto err;
        }
        rc = moed_synth_layer(spec, served[i].index, &v->layers[i], err);
        if (rc) goto err;
        v->n_layers = i + 1;
        rc = same_layer(&served[i], &v->layers[i].info, err);
        if (!rc) rc = moed_backend_load_layer(v->cpu, i, &v->layers[i], err);
        if (rc) goto err;
        if (served[i].d_model > max_d) max_d = served[i].d_model;
        if (served[i].n_experts > max_e) max_e = served[i].n_experts;
    }
    rc = moed_backend_start(v->cpu, err);
    if (rc) goto err;
    v->y = malloc((size_t)max_tokens * (size_t)max_d * sizeof(float));
    v->logits = malloc((size_t)max_tokens * (size_t)max_e * sizeof(float));
    v->row_a = malloc((size_t)max_d * sizeof(float));
    v->row_b = malloc((size_t)max_d * sizeof(float));
    if (!v->y || !v->logits || !v->row_a || !v->row_b) goto nomem;
    if (pthread_create(&v->thread, NULL, verifier_main, v)) {
        rc = moed_fail(err, MOED_ENOMEM, "could not start the --verify thread");
        goto err;
    }
    v->started = true;
    *out = v;
    return 0;
nomem:
    rc = moed_fail(err, MOED_ENOMEM, "out of memory setting up --verify");
err:
    moed_error_prefix(err, "--verify");
    load_verify_close(v);
    return rc;
}

void load_verify_close(load_verify *v)
{
    if (!v) return;
    if (v->started) {
        pthread_mutex_lock(&v->mu);
        v->quit = true;
        pthread_cond_signal(&v->work);
        pthread_mutex_unlock(&v->mu);
        pthread_join(v->thread, NULL);
    }
    for (int i = 0; i < v->count; i++) {
        moedc_result_free(&v->queue[(v->head + i) % VERIFY_QUEUE].res);
        free(v->queue[(v->head + i) % VERIFY_QUEUE].output_copy);
    }
    moed_backend_destroy(v->cpu);
    for (int i = 0; i < v->n_layers; i++) moed_synth_free_layer(&v->layers[i]);
    free(v->layers);
    free(v->y);
    free(v->logits);
    free(v->row_a);
    free(v->row_b);
    pthread_mutex_destroy(&v->mu);
    pthread_cond_destroy(&v->work);
    pthread_cond_destroy(&v->idle);
    free(v);
}
