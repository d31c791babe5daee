/*
 * test_cpu_backend — the CPU backend against a naive float64 reference written here, on a table of
 * layers, routes and dtypes; then its determinism contract (a row alone equals the same row inside
 * any batch, bit for bit; 1 and 4 threads agree bit for bit), the router logits, and its errors.
 *
 * The process runs every check once with the micro-kernel the CPU offers, then re-runs itself with
 * MOED_CPU_ISA=generic so the portable kernel is checked too.
 */
#include "check.h"
#include "cpu_backend.h"
#include "moed_dtype.h"
#include "moed_fp8.h"
#include "moed_synth.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static double urand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

static double wval(const void *p, int dtype, size_t i)
{
    float f;
    moed_to_f32(dtype, (const char *)p + i * moed_dtype_size(dtype), &f, 1);
    return f;
}

/* Element i of a [*, cols] weight matrix m of the layer (FP8: q * scale of its block). */
static double mval(const moed_layer *l, const void *m, const float *sc, int cols, size_t i)
{
    if (l->info.wdtype == MOED_FP8)
        return moed_fp8_weight(m, sc, cols, (int64_t)(i / (size_t)cols),
                               (int64_t)(i % (size_t)cols));
    return wval(m, l->info.wdtype, i);
}

/* ---- the reference ------------------------------------------------------------------------ */

/* y += scale * expert(x), in float64 from the stored weights. */
static void ref_expert(const moed_layer *l, const moed_expert_w *w, int ff, const double *x,
                       double scale, double *y)
{
    int d = l->info.d_model;
    double *h = malloc((size_t)ff * sizeof *h);
    for (int i = 0; i < ff; i++) {
        double a = 0, b = 0;
        for (int k = 0; k < d; k++) a += mval(l, w->w1, w->s1, d, (size_t)i * d + k) * x[k];
        if (l->info.act == MOED_ACT_SWIGLU) {
            for (int k = 0; k < d; k++) b += mval(l, w->w3, w->s3, d, (size_t)i * d + k) * x[k];
            h[i] = a / (1 + exp(-a)) * b;
        } else if (l->info.act == MOED_ACT_GELU) {
            h[i] = 0.5 * a * (1 + erf(a / sqrt(2.0)));
        } else {
            h[i] = a > 0 ? a : 0;
        }
    }
    for (int j = 0; j < d; j++) {
        double s = 0;
        for (int i = 0; i < ff; i++) s += mval(l, w->w2, w->s2, ff, (size_t)j * ff + i) * h[i];
        y[j] += scale * s;
    }
    free(h);
}

/* out [T, d] in float64 for input x (dtype) and route r. */
static void ref_forward(const moed_layer *l, int dtype, const void *x, int64_t T,
                        const moed_route *r, double *out)
{
    int d = l->info.d_model;
    double *xr = malloc((size_t)d * sizeof *xr);
    for (int64_t t = 0; t < T; t++) {
        double *y = out + t * d;
        for (int k = 0; k < d; k++) {
            xr[k] = wval(x, dtype, (size_t)(t * d + k));
            y[k] = 0;
        }
        for (int64_t p = r->off[t]; p < r->off[t + 1]; p++)
            ref_expert(l, &l->experts[r->expert[p]], l->info.d_ff, xr, r->weight[p], y);
        if (l->info.n_shared) ref_expert(l, &l->shared, l->info.shared_d_ff, xr, 1, y);
    }
    free(xr);
}

/* Compares y (dtype) with the reference: per element, the output dtype's rounding plus a small
 * share of the row's largest value for the float32 sums. Returns the failures. */
static int compare(const char *what, int dtype, const void *y, const double *ref, int64_t T, int d)
{
    double rel = dtype == MOED_F32 ? 1e-6 : dtype == MOED_F16 ? 1.0 / 2048 : 1.0 / 256;
    int bad = 0;
    for (int64_t t = 0; t < T; t++) {
        double rowmax = 0;
        for (int j = 0; j < d; j++) rowmax = fmax(rowmax, fabs(ref[t * d + j]));
        for (int j = 0; j < d; j++) {
            double got = wval(y, dtype, (size_t)(t * d + j)), want = ref[t * d + j];
            double tol = rel * fabs(want) + 3e-5 * rowmax + 1e-30;
            if (!isfinite(got) || fabs(got - want) > tol) {
                if (bad++ < 3)
                    fprintf(stderr, "%s: y[%lld][%d] = %.9g, reference %.9g (tol %.3g)\n", what,
                            (long long)t, j, got, want, tol);
            }
        }
    }
    CHECK_MSG(bad == 0, "%s: %d elements off", what, bad);
    return bad;
}

/* ---- routes ------------------------------------------------------------------------------- */

enum { R_TOPK, R_ONE_EXPERT, R_EMPTY_EXPERTS, R_VARIABLE, R_PADDING, R_SIGMOID };

/* k distinct experts per token (or the pattern of kind), random weights; built through
 * moed_route_from_choice like a client's. */
static void make_route(int kind, int64_t T, int k, int E, moed_route *r)
{
    int kk = kind == R_VARIABLE ? k + 2 : k;
    int32_t *ids = malloc((size_t)(T * kk) * sizeof *ids);
    float *w = malloc((size_t)(T * kk) * sizeof *w);
    for (int64_t t = 0; t < T; t++) {
        for (int j = 0; j < kk; j++) {
            int32_t *id = &ids[t * kk + j];
            w[t * kk + j] = (float)(0.1 + urand());
            switch (kind) {
            case R_ONE_EXPERT:
                *id = E - 1;
                break;
            case R_EMPTY_EXPERTS: /* only the even experts of the first half */
                *id = (int32_t)(urand() * ((E + 3) / 4)) * 2 % E;
                break;
            case R_VARIABLE: /* 0 .. kk pairs, repeats allowed */
                *id = j < (int)(t % (kk + 1)) ? (int32_t)(urand() * E) : -1;
                if (*id < 0) w[t * kk + j] = 0;
                break;
            case R_PADDING: /* the last pair of every other token is padding */
                *id = (int32_t)((t + 3 * j) % E);
                if (j == kk - 1 && t % 2) *id = -1, w[t * kk + j] = 0;
                break;
            default:
                *id = (int32_t)((t * 7 + j * 5 + (int64_t)(urand() * 3)) % E);
            }
        }
    }
    moed_error err = { 0 };
    int rc = moed_route_from_choice(r, ids, w, T, kk, E, &err);
    CHECK_MSG(rc == 0, "route: %s", err.msg);
    free(ids);
    free(w);
}

/* Builds a route by sigmoid gating of random logits (varying count, some tokens with none). */
static void make_gated_route(const moed_layer_info *li, int64_t T, moed_route *r)
{
    float *l = malloc((size_t)(T * li->n_experts) * sizeof *l);
    for (int64_t i = 0; i < T * li->n_experts; i++) l[i] = (float)(urand() * 4 - 3);
    moed_gate_params p = { .strategy = MOED_GATE_SIGMOID, .threshold = 0.7f };
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_gate(&p, li, NULL, l, T, r, &err), 0);
    free(l);
}

/* ---- running ------------------------------------------------------------------------------ */

static moed_backend *open_cpu(int threads, int64_t max_tokens, const moed_layer *l)
{
    moed_backend *b;
    moed_error err = { 0 };
    moed_backend_config cfg = { .threads = threads, .max_tokens = max_tokens };
    if (moed_backend_cpu_open(&cfg, &b, &err)) {
        CHECK_MSG(0, "open: %s", err.msg);
        return NULL;
    }
    int rc = moed_backend_load_layer(b, 0, l, &err);
    if (!rc) rc = moed_backend_start(b, &err);
    CHECK_MSG(rc == 0, "load/start: %s", err.msg);
    CHECK_EQ_INT(moed_backend_n_exec(b), 1);
    return b;
}

static void *random_x(int dtype, int64_t n)
{
    float *f = malloc((size_t)n * sizeof *f);
    void *x = malloc((size_t)n * moed_dtype_size(dtype));
    for (int64_t i = 0; i < n; i++) f[i] = (float)(urand() * 2 - 1);
    moed_from_f32(dtype, f, x, (size_t)n);
    free(f);
    return x;
}

static int forward(moed_backend *b, int dtype, const void *x, int64_t T, const moed_route *r,
                   void *y)
{
    moed_job job = { .slot = 0, .dtype = dtype, .T = T, .x = x, .y = y, .route = r };
    moed_error err = { 0 };
    int rc = moed_backend_forward(b, 0, &job, &err);
    CHECK_MSG(rc == 0, "forward: %s", err.msg);
    return rc;
}

/* The router logits of T rows of x as one part. */
static int logits_of(moed_backend *b, int dtype, int64_t T, const void *x, float *out,
                     moed_error *err)
{
    const moed_job job = { .slot = 0, .dtype = dtype, .T = T, .x = x };
    return moed_backend_router_logits(b, 0, &job, out, err);
}

/* The route of tokens [t0, t0 + n) of r, as a route of its own. */
static void sub_route(const moed_route *r, int64_t t0, int64_t n, moed_route *out)
{
    int64_t p0 = r->off[t0], np = r->off[t0 + n] - p0;
    moed_route_init(out, n, np);
    memcpy(out->expert, r->expert + p0, (size_t)np * sizeof *out->expert);
    memcpy(out->weight, r->weight + p0, (size_t)np * sizeof *out->weight);
    for (int64_t t = 0; t <= n; t++) out->off[t] = r->off[t0 + t] - p0;
}

/* For float32 layers without shared experts: each token's output is, bit for bit, the float32 sum
 * in route order of w * y_e, where y_e is the backend's own output for the route {(e, 1)}. */
static void check_combine_order(const char *what, moed_backend *b, const float *x, int64_t T, int d,
                                const moed_route *r, const float *y)
{
    float *acc = malloc((size_t)d * sizeof *acc), *ye = malloc((size_t)d * sizeof *ye);
    int32_t e;
    float one = 1.0f;
    int64_t off[2] = { 0, 1 };
    moed_route single = { .T = 1, .off = off, .expert = &e, .weight = &one, .cap = 1 };
    int bad = 0;
    for (int64_t t = 0; t < T; t++) {
        memset(acc, 0, (size_t)d * sizeof *acc);
        for (int64_t p = r->off[t]; p < r->off[t + 1]; p++) {
            e = r->expert[p];
            forward(b, MOED_F32, x + t * d, 1, &single, ye);
            for (int j = 0; j < d; j++) acc[j] += r->weight[p] * ye[j];
        }
        bad += memcmp(acc, y + t * d, (size_t)d * sizeof *acc) != 0;
    }
    CHECK_MSG(bad == 0, "%s: %d tokens are not the route-order sum of their experts", what, bad);
    free(acc);
    free(ye);
}

typedef struct tcase {
    const char *spec;
    int64_t T;
    int k;
    int route;
    int xdtype;
} tcase;

static const tcase cases[] = {
    { "d=64,ff=96,experts=8,topk=2,dtype=bf16", 1, 2, R_TOPK, MOED_BF16 },
    { "d=64,ff=96,experts=8,topk=2,dtype=bf16", 7, 2, R_TOPK, MOED_F32 },
    { "d=64,ff=96,experts=8,topk=2,dtype=f16", 37, 1, R_TOPK, MOED_F16 },
    { "d=48,ff=80,experts=8,topk=2,dtype=f32", 37, 8, R_TOPK, MOED_BF16 },
    { "d=64,ff=96,experts=6,topk=2,dtype=bf16", 37, 2, R_ONE_EXPERT, MOED_BF16 },
    { "d=64,ff=96,experts=16,topk=2,dtype=bf16", 37, 2, R_EMPTY_EXPERTS, MOED_F32 },
    { "d=64,ff=96,experts=8,topk=2,dtype=f16", 37, 3, R_VARIABLE, MOED_F16 },
    { "d=64,ff=96,experts=8,topk=2,dtype=f32", 37, 3, R_PADDING, MOED_F32 },
    { "d=40,ff=56,experts=8,topk=2,act=gelu,dtype=bf16", 37, 2, R_TOPK, MOED_BF16 },
    { "d=40,ff=56,experts=8,topk=2,act=relu,dtype=f16", 7, 2, R_TOPK, MOED_F32 },
    { "d=64,ff=96,experts=8,topk=2,dtype=bf16,shared=2,shared_ff=80", 37, 2, R_TOPK, MOED_BF16 },
    { "d=64,ff=96,experts=8,topk=2,act=gelu,shared=1,shared_ff=24,rule=deepseek", 13, 2, R_VARIABLE,
      MOED_F16 },
    { "d=33,ff=17,experts=5,topk=2,dtype=f32", 37, 2, R_SIGMOID, MOED_F32 },
    { "d=128,ff=320,experts=4,topk=2,dtype=bf16", 37, 2, R_TOPK, MOED_BF16 },
    /* several row blocks per expert, and several column blocks */
    { "d=40,ff=300,experts=3,topk=2,dtype=bf16", 150, 2, R_ONE_EXPERT, MOED_F32 },
    { "d=270,ff=24,experts=4,topk=2,shared=1,shared_ff=40", 130, 2, R_TOPK, MOED_BF16 },
    /* FP8 weights: whole and partial 128 x 128 scale blocks, shared experts, every activation */
    { "d=300,ff=200,experts=6,topk=2,dtype=fp8", 37, 2, R_TOPK, MOED_BF16 },
    { "d=64,ff=160,experts=8,topk=2,dtype=fp8,shared=1,shared_ff=136", 13, 3, R_VARIABLE,
      MOED_F32 },
    { "d=130,ff=40,experts=4,topk=2,act=gelu,dtype=fp8", 7, 2, R_TOPK, MOED_F16 },
};

/* One case: reference, rows alone vs the batch, a middle slice of the batch, 1 vs 4 threads. */
static void run_case(const tcase *c, int max_tokens)
{
    char what[160];
    snprintf(what, sizeof what, "[%s] T=%lld k=%d route %d x %s max_tokens %d", c->spec,
             (long long)c->T, c->k, c->route, moed_dtype_name(c->xdtype), max_tokens);
    moed_synth_spec s;
    moed_layer l;
    moed_error err = { 0 };
    CHECK_MSG(moed_synth_parse(c->spec, &s, &err) == 0, "%s: %s", what, err.msg);
    CHECK_MSG(moed_synth_layer(&s, 0, &l, &err) == 0, "%s: %s", what, err.msg);
    int d = l.info.d_model, dt = c->xdtype;
    size_t es = moed_dtype_size(dt), row = (size_t)d * es;
    moed_route r;
    if (c->route == R_SIGMOID)
        make_gated_route(&l.info, c->T, &r);
    else
        make_route(c->route, c->T, c->k, l.info.n_experts, &r);
    void *x = random_x(dt, c->T * d);
    void *y = malloc((size_t)c->T * row), *y1 = malloc((size_t)c->T * row);
    double *ref = malloc((size_t)c->T * d * sizeof *ref);
    ref_forward(&l, dt, x, c->T, &r, ref);

    moed_backend *b4 = open_cpu(4, max_tokens, &l), *b1 = open_cpu(1, max_tokens, &l);
    if (b4 && b1 && !forward(b4, dt, x, c->T, &r, y)) {
        compare(what, dt, y, ref, c->T, d);
        /* 1 thread: the same bits */
        forward(b1, dt, x, c->T, &r, y1);
        CHECK_MSG(memcmp(y, y1, (size_t)c->T * row) == 0, "%s: 1 and 4 threads differ", what);
        /* every row alone: the same bits */
        int diff = 0;
        for (int64_t t = 0; t < c->T; t++) {
            moed_route one;
            sub_route(&r, t, 1, &one);
            forward(b4, dt, (const char *)x + t * row, 1, &one, y1);
            diff += memcmp(y1, (const char *)y + t * row, row) != 0;
            moed_route_free(&one);
        }
        CHECK_MSG(diff == 0, "%s: %d rows differ when computed alone", what, diff);
        if (dt == MOED_F32 && l.info.n_shared == 0)
            check_combine_order(what, b4, x, c->T, d, &r, y);
        /* the batch in three parts of their own, each in its own buffers: the same bits */
        if (c->T > 6) {
            const int64_t rows[3] = { 1, c->T - 4, 3 };
            void *xs[3], *ys[3];
            moed_part parts[3];
            for (int i = 0, t = 0; i < 3; t += (int)rows[i++]) {
                xs[i] = malloc((size_t)rows[i] * row);
                ys[i] = malloc((size_t)rows[i] * row);
                memcpy(xs[i], (const char *)x + (size_t)t * row, (size_t)rows[i] * row);
                parts[i] = (moed_part){ rows[i], xs[i], MOED_HOST_MEM, ys[i], MOED_HOST_MEM, NULL };
            }
            moed_job pj = {
                .slot = 0, .dtype = dt, .T = c->T, .parts = parts, .n_parts = 3, .route = &r
            };
            CHECK_EQ_INT(moed_backend_forward(b4, 0, &pj, &err), 0);
            for (int i = 0, t = 0; i < 3; t += (int)rows[i++]) {
                CHECK_MSG(!memcmp(ys[i], (const char *)y + (size_t)t * row, (size_t)rows[i] * row),
                          "%s: part %d differs from the same rows of one buffer", what, i);
                free(xs[i]);
                free(ys[i]);
            }
        }
        /* a slice from the middle, on one thread */
        if (c->T > 6) {
            moed_route part;
            sub_route(&r, 2, c->T - 5, &part);
            forward(b1, dt, (const char *)x + 2 * row, c->T - 5, &part, y1);
            CHECK_MSG(memcmp(y1, (const char *)y + 2 * row, (size_t)(c->T - 5) * row) == 0,
                      "%s: rows 2..%lld differ inside a smaller batch", what, (long long)c->T - 4);
            moed_route_free(&part);
        }
    }
    moed_backend_destroy(b4);
    moed_backend_destroy(b1);
    moed_route_free(&r);
    free(x);
    free(y);
    free(y1);
    free(ref);
    moed_synth_free_layer(&l);
}

static void test_cases(void)
{
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        run_case(&cases[i], 256);
        /* max_tokens = T: windows of only T * top_k pairs, so longer routes take several */
        if (cases[i].k > 2 || cases[i].route == R_SIGMOID) run_case(&cases[i], (int)cases[i].T);
    }
}

/* Router logits against a float64 reference from the stored values, for every dtype of x and a
 * router in float32 on a bf16 layer (held as stored, not rounded to the experts' dtype); a row
 * alone is bit-identical to the same row in the batch. DeepSeek-V3's logits stay float32; the
 * softmax rule's are the same float32 sums rounded to x's dtype. */
static void test_router_logits(void)
{
    moed_synth_spec s;
    moed_layer soft, deep;
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_synth_parse("d=72,ff=16,experts=12,topk=2,dtype=bf16", &s, &err), 0);
    CHECK_EQ_INT(moed_synth_layer(&s, 0, &soft, &err), 0);
    CHECK_EQ_INT(
        moed_synth_parse("d=72,ff=16,experts=12,topk=2,dtype=bf16,rule=deepseek", &s, &err), 0);
    CHECK_EQ_INT(moed_synth_layer(&s, 0, &deep, &err), 0);
    enum { T = 29, d = 72, E = 12 };
    float *router = malloc(sizeof(float) * E * d); /* bf16 values plus what bf16 cannot hold */
    for (int i = 0; i < E * d; i++) router[i] = (float)wval(soft.router, MOED_BF16, i) + 1e-4f;
    const void *synth_routers[2] = { soft.router, deep.router };
    soft.router = deep.router = router;
    soft.router_dtype = deep.router_dtype = MOED_F32;
    moed_backend *bs = open_cpu(3, 64, &soft), *bd = open_cpu(2, 64, &deep);
    for (int dt = MOED_F32; dt <= MOED_BF16 && bs && bd; dt++) {
        void *x = random_x(dt, T * d);
        float lg[T * E], ls[T * E], one[E];
        CHECK_EQ_INT(logits_of(bd, dt, T, x, lg, &err), 0);
        CHECK_EQ_INT(logits_of(bs, dt, T, x, ls, &err), 0);
        int bad = 0, diff = 0, round = 0;
        for (int t = 0; t < T; t++) {
            for (int e = 0; e < E; e++) {
                double want = 0, mag = 0;
                for (int k = 0; k < d; k++) {
                    double v = router[e * d + k] * wval(x, dt, (size_t)t * d + k);
                    want += v;
                    mag += fabs(v);
                }
                bad += !(fabs(lg[t * E + e] - want) <= 1e-6 * mag);
                float r = lg[t * E + e];
                moed_router_round_logits(&soft.info, dt, &r, 1);
                round += memcmp(&r, &ls[t * E + e], sizeof r) != 0;
            }
            logits_of(bd, dt, 1, (const char *)x + (size_t)t * d * moed_dtype_size(dt), one, &err);
            diff += memcmp(one, lg + t * E, sizeof one) != 0;
        }
        CHECK_MSG(bad == 0, "router logits (x %s): %d off", moed_dtype_name(dt), bad);
        CHECK_MSG(round == 0, "softmax-rule logits (x %s): %d not the float32 sums rounded",
                  moed_dtype_name(dt), round);
        CHECK_MSG(diff == 0, "router logits (x %s): %d rows differ alone", moed_dtype_name(dt),
                  diff);
        free(x);
    }
    moed_backend_destroy(bs);
    moed_backend_destroy(bd);
    soft.router = synth_routers[0];
    deep.router = synth_routers[1];
    free(router);
    moed_synth_free_layer(&soft);
    moed_synth_free_layer(&deep);
}

static void test_errors(void)
{
    moed_synth_spec s;
    moed_layer l;
    moed_error err = { 0 };
    CHECK_EQ_INT(moed_synth_parse("d=16,ff=8,experts=4,topk=2,router=0", &s, &err), 0);
    CHECK_EQ_INT(moed_synth_layer(&s, 0, &l, &err), 0);
    moed_backend *b;
    moed_backend_config cfg = { .threads = 2, .max_tokens = 8 };
    CHECK_EQ_INT(moed_backend_cpu_open(&cfg, &b, &err), 0);
    CHECK_EQ_INT(moed_backend_start(b, &err), MOED_EINVAL); /* nothing loaded */
    CHECK_EQ_INT(moed_backend_load_layer(b, 1, &l, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "next slot is 0") != NULL);
    CHECK_EQ_INT(moed_backend_load_layer(b, 0, &l, &err), 0);
    CHECK_EQ_INT(moed_backend_start(b, &err), 0);
    CHECK_EQ_INT(moed_backend_load_layer(b, 1, &l, &err), MOED_EINVAL);

    float x[16 * 9] = { 0 }, y[16 * 9];
    moed_route r;
    make_route(R_TOPK, 9, 2, 4, &r);
    moed_job job = { .slot = 0, .dtype = MOED_F32, .T = 2, .x = x, .y = y, .route = &r };
    CHECK_EQ_INT(moed_backend_forward(b, 0, &job, &err), MOED_EINVAL); /* route has 9 tokens */
    job.T = 9;
    CHECK_EQ_INT(moed_backend_forward(b, 0, &job, &err), MOED_ETOOBIG); /* max_tokens 8 */
    CHECK(strstr(err.msg, "9 tokens") != NULL);
    moed_route_free(&r);
    make_route(R_TOPK, 2, 2, 4, &r);
    job.T = 2;
    CHECK_EQ_INT(moed_backend_forward(b, 1, &job, &err), MOED_EINVAL);
    job.slot = 1;
    CHECK_EQ_INT(moed_backend_forward(b, 0, &job, &err), MOED_ENOTFOUND);
    job.slot = 0;
    job.dtype = MOED_I32;
    CHECK_EQ_INT(moed_backend_forward(b, 0, &job, &err), MOED_EINVAL);
    job.dtype = MOED_F32;
    r.expert[1] = 4; /* out of range: must not be read */
    CHECK_EQ_INT(moed_backend_forward(b, 0, &job, &err), MOED_EINVAL);
    CHECK_MSG(strstr(err.msg, "token 0's pair 1") && !strstr(err.msg, "expert 4"), "%s", err.msg);
    r.expert[1] = 3;
    r.weight[2] = NAN;
    CHECK_EQ_INT(moed_backend_forward(b, 0, &job, &err), MOED_EINVAL);
    r.weight[2] = 1;
    CHECK_EQ_INT(moed_backend_forward(b, 0, &job, &err), 0);
    CHECK_EQ_INT(logits_of(b, MOED_F32, 2, x, y, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "no router weights") != NULL);
    /* parts: their rows must add up to T, and the CPU computes from host memory only */
    moed_part parts[2] = { { 1, x, MOED_HOST_MEM, y, MOED_HOST_MEM, NULL },
                           { 2, x + 16, MOED_HOST_MEM, y + 16, MOED_HOST_MEM, NULL } };
    moed_job pj = {
        .slot = 0, .dtype = MOED_F32, .T = 2, .parts = parts, .n_parts = 2, .route = &r
    };
    CHECK_EQ_INT(moed_backend_forward(b, 0, &pj, &err), MOED_EINVAL);
    CHECK(strstr(err.msg, "hold 3 rows") != NULL);
    parts[1].rows = 1;
    parts[1].x_dev = 0;
    CHECK_EQ_INT(moed_backend_forward(b, 0, &pj, &err), MOED_EPRECOND);
    CHECK(strstr(err.msg, "device memory") != NULL);
    /* and it has no devices to map */
    void *ptr, *base;
    int dev;
    CHECK_EQ_INT(moed_backend_map_device(b, "h", 1, NULL, 0, 64, 0, &ptr, &dev, &base, &err),
                 MOED_EPRECOND);
    CHECK(strstr(err.msg, "cpu backend") != NULL);
    CHECK(!moed_backend_host_dma(b));

    moed_device_info info;
    CHECK_EQ_INT(moed_backend_n_devices(b), 1);
    CHECK_EQ_INT(moed_backend_device_info(b, 0, &info), 0);
    CHECK(!strcmp(info.name, "cpu") && info.memory_total > 0);
    CHECK(info.memory_used <= info.memory_total);
    CHECK(moed_backend_device_info(b, 1, &info) != 0);
    void *p = moed_backend_host_alloc(b, 1000);
    CHECK(p && ((uintptr_t)p & 63) == 0);
    memset(p, 1, 1000);
    moed_backend_host_free(b, p);
    moed_backend_host_free(b, NULL);
    CHECK(moed_backend_exec_accepts(b, 0, 0)); /* the default: one slot runs every layer */
    CHECK(!strcmp(moed_backend_name(b), "cpu"));
    moed_route_free(&r);
    moed_backend_destroy(b);
    moed_synth_free_layer(&l);
}

/* Re-runs this program with the portable micro-kernel; returns its failures as one check. */
static void run_generic(char **argv)
{
    if (getenv("MOED_CPU_ISA")) return; /* already the child, or the caller chose */
    pid_t pid = fork();
    if (pid == 0) {
        setenv("MOED_CPU_ISA", "generic", 1);
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the generic kernel's run failed");
}

int main(int argc, char **argv)
{
    (void)argc;
    fprintf(stderr, "micro-kernel: %s\n", getenv("MOED_CPU_ISA") ? "generic" : "best");
    test_cases();
    test_router_logits();
    test_errors();
    run_generic(argv);
    return check_status("test_cpu_backend");
}
