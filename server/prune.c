/*
 * moed_prune — the relative error of a 2:4-pruned layer against its dense weights (see prune.h).
 *
 * Matrices are read a row at a time (converted to float32 by moed_to_f32, which is exact for every
 * weight dtype taken) and every product and sum is in double, so the only rounding between the
 * stored weights and the stated error is double's. The rows are spread over a pool of one thread
 * per CPU: a layer of a large model (DeepSeek-V3: 256 expert evaluations of 44 M weights each,
 * twice) would otherwise add several times its own read time to the load.
 */
#include "prune.h"

#include "moed_dtype.h"
#include "moed_sp24.h"

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

/* Four running sums, then added: the order is fixed, so the result is too. */
static double dot_d(const double *row, const double *v, int n)
{
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += row[i] * v[i];
        s1 += row[i + 1] * v[i + 1];
        s2 += row[i + 2] * v[i + 2];
        s3 += row[i + 3] * v[i + 3];
    }
    for (; i < n; i++) s0 += row[i] * v[i];
    return (s0 + s1) + (s2 + s3);
}

static double dot_row(const float *row, const double *v, int n)
{
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double)row[i] * v[i];
        s1 += (double)row[i + 1] * v[i + 1];
        s2 += (double)row[i + 2] * v[i + 2];
        s3 += (double)row[i + 3] * v[i + 3];
    }
    for (; i < n; i++) s0 += (double)row[i] * v[i];
    return (s0 + s1) + (s2 + s3);
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
    if (moed_pool_create(0, &p->pool)) p->pool = NULL; /* then inline */
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
    if (p->pool) moed_pool_destroy(p->pool);
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

/* One expert's term over its tokens, both sides at once: each matrix row is converted once, pruned
 * by moed_sp24_prune on its float32 copy (the same kept positions as in the stored dtype: the
 * conversion is exact and keeps every order), and dotted with every token on both sides. Rows are
 * the pool's tasks; each writes only its own outputs, so the result does not depend on the
 * threads. */
typedef struct term_job {
    const moed_prune_probe *p;
    const moed_expert_w *w;
    int ff;         /* the matrices' width */
    bool prune;     /* false (shared experts): the pruned side is the dense one */
    const int *tok; /* n tokens, each with its route weight wt */
    const double *wt;
    int n;
    double *hd, *hp; /* [n, ff] activations, dense and pruned */
    double *yd, *yp; /* [T, d_model] the sides' outputs */
    bool down;       /* the W2 pass (after the W1/W3 one) */
    double *scratch; /* per thread: 4 rows of max(d_model, ff) */
    float *tmp;      /* per thread: one row */
    int row_max;
} term_job;

enum { ROWS_PER_TASK = 16 };

/* Row r of m in double in f and, if pruning, pruned in fp (else fp is f); tmp: float32 scratch
 * for the conversion and the pruning, which runs on the float32 values. */
static const double *load_row(const term_job *j, const void *m, int r, int cols, float *tmp,
                              double *f, double *fp)
{
    const int dt = j->p->info.wdtype;
    moed_to_f32(dt, (const char *)m + (size_t)r * (size_t)cols * moed_dtype_size(dt), tmp,
                (size_t)cols);
    for (int i = 0; i < cols; i++) f[i] = tmp[i];
    if (!j->prune) return f;
    moed_sp24_prune(tmp, MOED_F32, 1, cols);
    for (int i = 0; i < cols; i++) fp[i] = tmp[i];
    return fp;
}

static void term_task(void *arg, int64_t task, int thread)
{
    const term_job *j = arg;
    const moed_layer_info *li = &j->p->info;
    const int d = li->d_model, ff = j->ff;
    double *f1 = j->scratch + (size_t)thread * 4 * (size_t)j->row_max, *p1 = f1 + j->row_max,
           *f3 = p1 + j->row_max, *p3 = f3 + j->row_max;
    float *tmp = j->tmp + (size_t)thread * (size_t)j->row_max;
    const int rows = j->down ? d : ff, r0 = (int)task * ROWS_PER_TASK;
    for (int r = r0; r < r0 + ROWS_PER_TASK && r < rows; r++) {
        if (j->down) {
            const double *q = load_row(j, j->w->w2, r, ff, tmp, f1, p1);
            for (int t = 0; t < j->n; t++) {
                const size_t at = (size_t)j->tok[t] * (size_t)d + (size_t)r;
                j->yd[at] += j->wt[t] * dot_d(f1, &j->hd[(size_t)t * ff], ff);
                j->yp[at] += j->wt[t] * dot_d(q, &j->hp[(size_t)t * ff], ff);
            }
            continue;
        }
        const double *q1 = load_row(j, j->w->w1, r, d, tmp, f1, p1);
        const double *q3 = j->w->w3 ? load_row(j, j->w->w3, r, d, tmp, f3, p3) : NULL;
        for (int t = 0; t < j->n; t++) {
            const double *x = &j->p->x[(size_t)j->tok[t] * (size_t)d];
            double hd = act(li->act, dot_d(f1, x, d)), hp = act(li->act, dot_d(q1, x, d));
            if (q3) {
                hd *= dot_d(f3, x, d);
                hp *= dot_d(q3, x, d);
            }
            j->hd[(size_t)t * ff + r] = hd;
            j->hp[(size_t)t * ff + r] = hp;
        }
    }
}

/* Adds wt[t] * expert(x[tok[t]]) to y_dense, and the same with the matrices pruned (if prune) to
 * y_pruned. */
static void add_term(moed_prune_probe *p, const moed_expert_w *w, int ff, bool prune,
                     const int *tok, const double *wt, int n)
{
    const int d = p->info.d_model, row_max = d > ff ? d : ff;
    const int threads = p->pool ? moed_pool_threads(p->pool) : 1;
    term_job j = { .p = p,
                   .w = w,
                   .ff = ff,
                   .prune = prune,
                   .tok = tok,
                   .wt = wt,
                   .n = n,
                   .yd = p->y_dense,
                   .yp = p->y_pruned,
                   .row_max = row_max };
    j.hd = malloc(sizeof(double) * (size_t)n * (size_t)ff);
    j.hp = prune ? malloc(sizeof(double) * (size_t)n * (size_t)ff) : j.hd;
    j.scratch = malloc(sizeof(double) * 4 * (size_t)row_max * (size_t)threads);
    j.tmp = malloc(sizeof(float) * (size_t)row_max * (size_t)threads);
    if (!j.hd || !j.hp || !j.scratch || !j.tmp) {
        p->failed = true;
    } else {
        for (int pass = 0; pass < 2; pass++) {
            j.down = pass == 1;
            const int64_t tasks = ((j.down ? d : ff) + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
            if (p->pool)
                moed_pool_run(p->pool, tasks, term_task, &j);
            else
                for (int64_t k = 0; k < tasks; k++) term_task(&j, k, 0);
        }
    }
    if (j.hp != j.hd) free(j.hp);
    free(j.hd);
    free(j.scratch);
    free(j.tmp);
}

void moed_prune_expert(moed_prune_probe *p, int e, const moed_expert_w *w)
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
        if (n) add_term(p, w, p->info.d_ff, true, tok, wt, n);
        p->pairs += n;
    }
    free(tok);
    free(wt);
}

/* moed_sp24_prune over bands of rows: rows are pruned independently, so the bands may run on any
 * thread in any order with the same result. */
typedef struct band_job {
    void *w;
    int dtype;
    int64_t rows, cols;
} band_job;

enum { BAND_ROWS = 64 };

static void band_task(void *arg, int64_t task, int thread)
{
    const band_job *j = arg;
    const int64_t r0 = task * BAND_ROWS, n = j->rows - r0 < BAND_ROWS ? j->rows - r0 : BAND_ROWS;
    (void)thread;
    moed_sp24_prune((char *)j->w + (size_t)(r0 * j->cols) * moed_dtype_size(j->dtype), j->dtype, n,
                    j->cols);
}

void moed_prune_matrix(moed_prune_probe *p, void *w, int dtype, int64_t rows, int64_t cols)
{
    band_job j = { w, dtype, rows, cols };
    const int64_t tasks = (rows + BAND_ROWS - 1) / BAND_ROWS;
    if (p->pool)
        moed_pool_run(p->pool, tasks, band_task, &j);
    else
        for (int64_t k = 0; k < tasks; k++) band_task(&j, k, 0);
}

void moed_prune_shared(moed_prune_probe *p, const moed_expert_w *w)
{
    int tok[MOED_PRUNE_TOKENS];
    double wt[MOED_PRUNE_TOKENS];
    for (int t = 0; t < p->T; t++) {
        tok[t] = t;
        wt[t] = 1.0;
    }
    add_term(p, w, p->info.shared_d_ff, false, tok, wt, p->T);
}

double moed_prune_error(const moed_prune_probe *p)
{
    double diff = 0, ref = 0;
    for (size_t i = 0; i < (size_t)p->T * (size_t)p->info.d_model; i++) {
        const double a = p->y_pruned[i] - p->y_dense[i];
        diff += a * a;
        ref += p->y_dense[i] * p->y_dense[i];
    }
    return p->failed || !(ref > 0) ? NAN : sqrt(diff / ref);
}
