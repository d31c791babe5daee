/*
 * test_cuda_backend — the CUDA backend against the CPU backend (the reference) over a table of
 * cases: the standard shapes scaled down, T = 1, 7, 128, 1000, 4096, k = 1, 2, 8, every token on
 * one expert, empty experts, variable k from sigmoid and sparsemax gating, padding, both
 * activations, every activation dtype, bf16 and f16 weights, shared experts, and each kernel family
 * forced in turn (sm80 mma.sync, sm90 with gathered rows, sm90p with pre-permuted rows; sm90 runs
 * in two-CTA clusters at bn 256 and alone at bn 128, and a cluster may have a CTA with no rows);
 * then the full-size standard shapes, checked on a random sample of rows; then the determinism
 * contract (a row computed alone is bit-identical to the same row inside a batch).
 *
 * The server router: for every rule (softmax top-k renormalised or not, DeepSeek-V3 with groups),
 * f32, f16 and bf16 hidden and f32 and bf16 router weights, over thousands of tokens whose router
 * rows come in near-identical twins (so most tokens have a near-tie at the top-k boundary), the
 * CUDA logits must be bit-identical to the CPU's, and every strategy (the layer's rule, top-k,
 * sigmoid, sparsemax, quadratic, pioneer, batch gating) must choose the same experts on both (ids
 * exactly, weights within 1e-6). The CPU side is its AVX2 kernel (MOED_CPU_ISA=generic would give
 * it unfused sums, which the CUDA router does not claim to match).
 *
 * A case passes when ||gpu - cpu|| / ||cpu|| is within the bound for its compute type, and every
 * token's output is within the per-token bound of that token's own magnitude (tok_ref.h: largest
 * error <= rtol x largest |reference| + atol), against the CPU backend on every compared row and
 * against a float64 reference on up to TOK_REF_ROWS of them (a bound on the whole batch alone
 * would let a token be dropped); when no element is NaN or Inf; and when every output element was
 * written (outputs are poisoned with NaN first). The distribution of the per-token errors is
 * printed per case and over the run. Exits 77 (skipped) where no CUDA device answers: CI has no
 * GPU, and a skip is not a pass.
 * MOED_GPU_TEST_QUICK=1 runs a few representative cases (for compute-sanitizer);
 * MOED_GPU_TEST_ROUTER_ONLY=1 the server-router cases alone; MOED_GPU_TEST_SPARSE_ONLY=1 the 2:4
 * sparse ones (below).
 *
 * FP8 (block-scaled e4m3 weights, dtype=fp8): every shape class above again, on the FP8 Tensor
 * Cores (Hopper: activations quantized per token per 128 channels) and on the portable path
 * (sm80: weights dequantized to bf16 in the load), against the CPU's exact dequantization, with a
 * bound on the whole batch and on every token's own relative error; and the FP8 path against the
 * bf16 path on the same bf16 model quantized at load (--weights fp8), which adds the weights' own
 * rounding to e4m3. The bounds are the ones proto/moed/v1/moed.proto states.
 *
 * 2:4 sparse (sparse_cases: every routed expert matrix pruned by moed_sp24_prune and the layer
 * marked sparse24, so the CUDA backend holds them compressed and runs them on mma.sp; the CPU
 * computes the same pruned model): the shape classes again — padded d and ff, bf16 and f16 weights
 * (and f32, computed in bf16), SwiGLU, GELU and ReLU, dense shared experts beside sparse routed
 * ones, T from 1 to 4096 so every bm of the sparse table runs, one expert over many m-tiles, empty
 * experts, padded routes, a full-size shape — with the compute type's bounds and the same
 * determinism check; and a layer claimed sparse24 with one group of three non-zeros must fail to
 * load, naming the layer, the expert and the matrix. MOED_GPU_TEST_SPARSE_ONLY=1 runs these alone
 * (with QUICK, a few).
 */
#include "check.h"
#include "tok_gpu.h"
#include "tok_ref.h"

#include "moed_registry.h"
#include "moed_dtype.h"
#include "moed_fp8.h"
#include "moed_route.h"
#include "moed_sp24.h"
#include "moed_synth.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum routing { R_TOPK, R_ONE_EXPERT, R_HALF_EXPERTS, R_SIGMOID, R_SPARSEMAX, R_PADDED };

typedef struct tcase {
    const char *name;
    const char *spec; /* moed_synth spec (one layer) */
    int64_t T;
    int routing;
    int xdtype;
    const char *kernel; /* MOED_CUDA_KERNEL: "sm80", "sm90" or NULL (the table chooses) */
    int sample;         /* check only this many random rows against the CPU (full-size shapes) */
} tcase;

static uint64_t rng_state = 0x1234567;

static double urand(void)
{
    rng_state = moed_splitmix64(rng_state);
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

static double elapsed_s(struct timespec a)
{
    struct timespec b;
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
}

/* A route of the wanted kind for T tokens over the layer's experts. */
static int make_route(const moed_layer_info *li, const float *router_bias, int kind, int64_t T,
                      moed_route *r)
{
    const int E = li->n_experts, k = li->top_k;
    moed_error err;
    if (kind == R_SIGMOID || kind == R_SPARSEMAX || kind == R_TOPK) {
        float *logits = malloc(sizeof(float) * (size_t)T * E);
        for (int64_t i = 0; i < T * E; i++) logits[i] = (float)(4.0 * urand() - 2.0);
        moed_gate_params p = { kind == R_SIGMOID     ? MOED_GATE_SIGMOID
                               : kind == R_SPARSEMAX ? MOED_GATE_SPARSEMAX
                                                     : MOED_GATE_TOPK,
                               0, MOED_RENORM_DEFAULT, kind == R_SIGMOID ? 0.7f : 0.0f };
        int rc = moed_gate_resolve(&p, li, &err);
        if (!rc) rc = moed_gate(&p, li, router_bias, logits, T, r, &err);
        if (rc) fprintf(stderr, "gating failed: %s\n", err.msg);
        free(logits);
        return rc;
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * k);
    float *w = malloc(sizeof(float) * (size_t)T * k);
    for (int64_t t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int32_t e;
            if (kind == R_ONE_EXPERT)
                e = 3 % E;
            else if (kind == R_HALF_EXPERTS)
                e = (int32_t)(urand() * (E / 2)) * 2; /* odd experts stay empty */
            else
                e = (int32_t)(urand() * E);
            ids[t * k + j] = e;
            w[t * k + j] = (float)(0.05 + urand());
            if (kind == R_PADDED && j > 0 && urand() < 0.4) {
                ids[t * k + j] = -1;
                w[t * k + j] = 0.0f;
            }
        }
    int rc = moed_route_from_choice(r, ids, w, T, k, E, &err);
    if (rc) fprintf(stderr, "route failed: %s\n", err.msg);
    free(ids);
    free(w);
    return rc;
}

/* Backend with the one layer loaded and started. */
static moed_backend *open_backend(const char *name, const char *kernel, const moed_layer *l,
                                  int64_t max_tokens)
{
    moed_backend_config cfg = { 0 };
    cfg.max_tokens = max_tokens;
    cfg.streams = 1;
    moed_backend *b = NULL;
    moed_error err;
    if (kernel)
        setenv("MOED_CUDA_KERNEL", kernel, 1);
    else
        unsetenv("MOED_CUDA_KERNEL");
    int rc = moed_backend_open(name, &cfg, &b, &err);
    if (!rc) rc = moed_backend_load_layer(b, 0, l, &err);
    if (!rc) rc = moed_backend_start(b, &err);
    if (rc) {
        fprintf(stderr, "%s backend: %s\n", name, err.msg);
        moed_backend_destroy(b);
        return NULL;
    }
    return b;
}

/* The bounds (relative Frobenius error against the CPU backend; FP8: also per token) that
 * proto/moed/v1/moed.proto states, from this suite's errors on an H100 (FP8 Tensor Cores: 3.6e-2
 * to 4.8e-2 a batch, 7.3e-2 the worst token; portable: at most 5.7e-3; FP8 against bf16 on one
 * model: 6.2e-2). */
#define BOUND_BF16        2e-2
#define BOUND_F16         5e-3
#define BOUND_FP8_NATIVE  6e-2 /* e4m3 activations and H, promoted per 128 of K */
#define BOUND_FP8_TOKEN   1e-1 /* any one token of it */
#define BOUND_FP8_PORT    1e-2 /* portable: bf16 operands, dequantized weights */
#define BOUND_FP8_VS_BF16 8e-2 /* FP8 path on a bf16 model quantized at load vs its bf16 path */

/* The per-token bounds, by compute type, are tok_ref.h's (tok_rtol, TOK_ATOL; test_split holds
 * a split layer to them too). Tokens of a case checked against the float64 reference, which costs 3
 * d_model d_ff per pair: of the full-size shapes (sampled rows), fewer. */
#define TOK_REF_ROWS      64
#define TOK_REF_ROWS_FULL 8

/* The largest per-token error/magnitude ratio seen over the run, by compute type and reference (0
 * the CPU backend, 1 float64); -1 where no case ran. */
static double run_rel_max[TOK_C_COUNT][2] = { { -1, -1 }, { -1, -1 }, { -1, -1 }, { -1, -1 } };

/* Compares the GPU's rows with a reference token by token; returns the report. */
static tok_report check_tokens(const tcase *tc, int cls, int against_f64, const double *got,
                               const double *ref, int64_t n, int d)
{
    tok_report rep;
    tok_compare(got, ref, n, d, tok_rtol[cls], TOK_ATOL, &rep);
    CHECK_MSG(rep.bad == 0,
              "%s: %lld of %lld tokens over the bound against the %s; the worst, row %lld, at "
              "%.3g of its bound (%g x its magnitude + %g; inf: NaN, Inf or unwritten)",
              tc->name, (long long)rep.bad, (long long)n, against_f64 ? "float64 reference" : "cpu",
              (long long)rep.worst, rep.worst_use, tok_rtol[cls], TOK_ATOL);
    double *m = &run_rel_max[cls][against_f64];
    if (rep.rel_max > *m) *m = rep.rel_max;
    return rep;
}

/* The largest relative error of one token's row (n tokens of d); -1 if any is NaN/Inf. */
static double token_err(int dtype, const void *got, const void *ref, int64_t n, int d)
{
    double worst = 0;
    const size_t es = moed_dtype_size(dtype);
    float *g = malloc(sizeof(float) * (size_t)d), *r = malloc(sizeof(float) * (size_t)d);
    for (int64_t t = 0; t < n && worst >= 0; t++) {
        moed_to_f32(dtype, (const char *)got + (size_t)t * d * es, g, (size_t)d);
        moed_to_f32(dtype, (const char *)ref + (size_t)t * d * es, r, (size_t)d);
        double num = 0, den = 0;
        for (int c = 0; c < d; c++) {
            if (!isfinite(g[c])) worst = -1;
            num += ((double)g[c] - r[c]) * ((double)g[c] - r[c]);
            den += (double)r[c] * r[c];
        }
        const double e = sqrt(num / (den > 0 ? den : 1e-30));
        if (worst >= 0 && e > worst) worst = e;
    }
    free(g);
    free(r);
    return worst;
}

/* Relative Frobenius error of got against ref over n elements; -1 if got has NaN/Inf. */
static double rel_err(int dtype, const void *got, const void *ref, size_t n)
{
    float *g = malloc(sizeof(float) * n), *r = malloc(sizeof(float) * n);
    moed_to_f32(dtype, got, g, n);
    moed_to_f32(dtype, ref, r, n);
    double num = 0, den = 0;
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(g[i])) bad = 1;
        num += ((double)g[i] - r[i]) * ((double)g[i] - r[i]);
        den += (double)r[i] * r[i];
    }
    free(g);
    free(r);
    return bad ? -1.0 : sqrt(num / (den > 0 ? den : 1e-30));
}

static void poison(int dtype, void *y, size_t n)
{
    if (dtype == MOED_F32) {
        for (size_t i = 0; i < n; i++) ((float *)y)[i] = NAN;
    } else {
        for (size_t i = 0; i < n; i++) ((uint16_t *)y)[i] = 0x7fff; /* NaN in f16 and bf16 */
    }
}

/* Floats that differ in their bits. */
static int64_t count_diff(const float *a, const float *b, size_t n)
{
    int64_t k = 0;
    for (size_t i = 0; i < n; i++) k += memcmp(&a[i], &b[i], sizeof *a) != 0;
    return k;
}

/* sparse: prune the routed experts 2:4 and mark the layer sparse24 first. */
static void run_case(const tcase *tc, int sparse)
{
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    moed_synth_spec spec;
    moed_error err;
    moed_layer layer;
    moed_route route = { 0 };
    if (moed_synth_parse(tc->spec, &spec, &err) || moed_synth_layer(&spec, 0, &layer, &err)) {
        CHECK_MSG(0, "%s: %s", tc->name, err.msg);
        return;
    }
    if (sparse) CHECK_MSG(tok_make_sparse(&layer) == 0, "%s: pruning failed", tc->name);
    const moed_layer_info *li = &layer.info;
    const int d = li->d_model;
    const size_t es = moed_dtype_size(tc->xdtype), row = (size_t)d * es;
    const int64_t T = tc->T, n_ref = tc->sample ? tc->sample : T;
    void *x = malloc(row * (size_t)T), *y = malloc(row * (size_t)T);
    void *xs = malloc(row * (size_t)n_ref), *ys = malloc(row * (size_t)n_ref),
         *yr = malloc(row * (size_t)n_ref);
    int64_t *tok = malloc(sizeof(int64_t) * (size_t)n_ref);
    float *xf = malloc(sizeof(float) * (size_t)d);
    for (int64_t t = 0; t < T; t++) {
        for (int c = 0; c < d; c++) xf[c] = (float)(2.0 * urand() - 1.0);
        moed_from_f32(tc->xdtype, xf, (char *)x + (size_t)t * row, (size_t)d);
    }
    for (int64_t i = 0; i < n_ref; i++) tok[i] = tc->sample ? (int64_t)(urand() * T) : i;
    if (make_route(li, layer.router_bias, tc->routing, T, &route)) {
        CHECK_MSG(0, "%s: no route", tc->name);
        goto out;
    }

    moed_backend *gpu = open_backend("cuda", tc->kernel, &layer, T);
    moed_backend *cpu = open_backend("cpu", NULL, &layer, n_ref);
    CHECK_MSG(gpu && cpu, "%s: backends did not open", tc->name);
    if (gpu && cpu) {
        poison(tc->xdtype, y, (size_t)T * d);
        moed_job job = { .dtype = tc->xdtype, .T = T, .x = x, .y = y, .route = &route };
        int rc = moed_backend_forward(gpu, 0, &job, &err);
        CHECK_MSG(rc == 0, "%s: cuda forward: %s", tc->name, err.msg);

        moed_route sr = { 0 };
        tok_sub_route(&route, tok, n_ref, &sr);
        tok_gather_rows(x, row, tok, n_ref, xs);
        tok_gather_rows(y, row, tok, n_ref, ys);
        moed_job rjob = { .dtype = tc->xdtype, .T = n_ref, .x = xs, .y = yr, .route = &sr };
        rc = moed_backend_forward(cpu, 0, &rjob, &err);
        CHECK_MSG(rc == 0, "%s: cpu forward: %s", tc->name, err.msg);

        const int fp8 = li->wdtype == MOED_FP8, native = fp8 && tok_fp8_native(tc->kernel, 0);
        const double bound = native                   ? BOUND_FP8_NATIVE
                             : fp8                    ? BOUND_FP8_PORT
                             : li->wdtype == MOED_F16 ? BOUND_F16
                                                      : BOUND_BF16;
        const double e = rel_err(tc->xdtype, ys, yr, (size_t)n_ref * d);
        CHECK_MSG(e >= 0 && e <= bound,
                  "%s: relative error %.3g (bound %.0e; -1 means NaN/Inf or unwritten)", tc->name,
                  e, bound);
        const double te = token_err(tc->xdtype, ys, yr, n_ref, d);
        if (native)
            CHECK_MSG(te >= 0 && te <= BOUND_FP8_TOKEN,
                      "%s: a token's relative error is %.3g (bound %.0e)", tc->name, te,
                      BOUND_FP8_TOKEN);

        /* Token by token: against the CPU on every compared row, against float64 on the first
         * TOK_REF_ROWS of them. */
        const int cls = tok_compute_class(li->wdtype, native);
        const int64_t most = tc->sample ? TOK_REF_ROWS_FULL : TOK_REF_ROWS,
                      n64 = n_ref < most ? n_ref : most;
        double *g = malloc(sizeof(double) * (size_t)(n_ref * d)),
               *c = malloc(sizeof(double) * (size_t)(n_ref * d)),
               *f = malloc(sizeof(double) * (size_t)(n64 * d));
        tok_to_f64(tc->xdtype, ys, g, (size_t)(n_ref * d));
        tok_to_f64(tc->xdtype, yr, c, (size_t)(n_ref * d));
        moed_route r64 = { 0 };
        tok_sub_route(&route, tok, n64, &r64);
        tok_ref_forward(&layer, tc->xdtype, xs, &r64, n64, f);
        const tok_report vc = check_tokens(tc, cls, 0, g, c, n_ref, d),
                         vf = check_tokens(tc, cls, 1, g, f, n64, d);
        fprintf(stderr,
                "  %-44s T=%-6lld pairs=%-7lld rel_err=%.2e token_max=%.2e%s; per-token "
                "error/magnitude: vs cpu p50 %.1e p99 %.1e max %.1e, vs f64 max %.1e  %.1fs\n",
                tc->name, (long long)T, (long long)route.off[T], e, te,
                native   ? " (fp8 native)"
                : sparse ? " (2:4 sparse)"
                         : "",
                vc.rel_p50, vc.rel_p99, vc.rel_max, vf.rel_max, elapsed_s(t0));
        moed_route_free(&r64);
        free(g);
        free(c);
        free(f);

        /* The server router on the sampled rows: the same logits to the bit. */
        if (li->has_router) {
            const size_t nl = (size_t)n_ref * li->n_experts;
            float *lg = malloc(sizeof(float) * nl), *lc = malloc(sizeof(float) * nl);
            const moed_job lj = { .dtype = tc->xdtype, .T = n_ref, .x = xs };
            rc = moed_backend_router_logits(gpu, 0, &lj, lg, &err);
            CHECK_MSG(rc == 0, "%s: cuda router logits: %s", tc->name, err.msg);
            rc = moed_backend_router_logits(cpu, 0, &lj, lc, &err);
            CHECK_MSG(rc == 0, "%s: cpu router logits: %s", tc->name, err.msg);
            CHECK_MSG(!memcmp(lg, lc, sizeof(float) * nl),
                      "%s: router logits differ from the CPU's (%lld of %zu)", tc->name,
                      (long long)count_diff(lg, lc, nl), nl);
            free(lg);
            free(lc);
        }

        /* Determinism: the first sampled token alone must reproduce its row of the batch bit for
         * bit. */
        moed_route one = { 0 };
        tok_sub_route(&route, tok, 1, &one);
        moed_job ojob = { .dtype = tc->xdtype, .T = 1, .x = xs, .y = yr, .route = &one };
        poison(tc->xdtype, yr, (size_t)d);
        rc = moed_backend_forward(gpu, 0, &ojob, &err);
        CHECK_MSG(rc == 0 && !memcmp(yr, ys, row),
                  "%s: token %lld alone differs from the same token in the batch", tc->name,
                  (long long)tok[0]);
        moed_route_free(&one);
        moed_route_free(&sr);
    }
    moed_backend_destroy(gpu);
    moed_backend_destroy(cpu);
out:
    moed_route_free(&route);
    moed_synth_free_layer(&layer);
    free(x);
    free(y);
    free(xs);
    free(ys);
    free(yr);
    free(tok);
    free(xf);
}

/* ---- the server router --------------------------------------------------------------- */

typedef struct rcase {
    const char *name;
    const char *spec; /* moed_synth spec (one layer); its router is replaced by twins */
    int64_t T;
} rcase;

static const rcase router_cases[] = {
    { "softmax top-k, renormalised", "layers=1,d=320,ff=32,experts=16,topk=2,dtype=bf16,seed=31",
      3000 },
    { "softmax top-k, not renormalised",
      "layers=1,d=320,ff=32,experts=16,topk=2,dtype=bf16,seed=32,norm=0", 3000 },
    { "qwen3 width", "layers=1,d=2048,ff=32,experts=128,topk=8,dtype=bf16,seed=33", 2048 },
    { "deepseek-v3 groups",
      "layers=1,d=448,ff=32,experts=64,topk=8,dtype=bf16,seed=34,rule=deepseek,groups=8,"
      "topk_groups=4,scale=2.5",
      3000 },
    { "deepseek-v3 full width (tall tiles)",
      "layers=1,d=7168,ff=32,experts=256,topk=8,dtype=bf16,seed=35,rule=deepseek,groups=8,"
      "topk_groups=4,scale=2.5",
      8192 },
};

/* Twins: expert e+1 is expert e's twin for e = 0, 3, 6, ...; the singles in between let the top-k
 * boundary fall inside a pair of twins for about a third of the tokens, whatever k is. */
static int is_twin(int e)
{
    return e % 3 == 1;
}

/* A router [E, d] in rdtype made from the layer's f32 router values `base`, with each twin's row
 * its elder's with a few elements moved by relative amounts from 1e-3 down to 1e-7 (where rounding
 * to rdtype undoes that, its smallest element by one unit in the last place), so that twins' logits
 * nearly tie for every token. */
static void *twin_router(const float *base, int E, int d, int rdtype)
{
    const size_t es = moed_dtype_size(rdtype);
    float *f = malloc(sizeof(float) * (size_t)E * d);
    void *r = malloc(es * (size_t)E * d);
    memcpy(f, base, sizeof(float) * (size_t)E * d);
    for (int e = 1; e < E; e++) {
        if (!is_twin(e)) continue;
        float *row = f + (size_t)e * d;
        memcpy(row, row - d, sizeof(float) * (size_t)d);
        const double scale = pow(10.0, -3.0 - 4.0 * urand());
        for (int j = 0; j < 3; j++) {
            const int k = (int)(urand() * d);
            row[k] += (float)((urand() - 0.5) * scale * fabs(row[k]));
        }
    }
    moed_from_f32(rdtype, f, r, (size_t)E * d);
    for (int e = 1; e < E; e++) { /* where rounding undid the move: one unit in the last place */
        char *row = (char *)r + es * (size_t)e * d;
        if (!is_twin(e) || memcmp(row, row - es * d, es * d)) continue;
        int k = 0; /* the row's smallest element, whose last place is worth least */
        for (int j = 1; j < d; j++)
            if (fabsf(f[(size_t)e * d + j]) < fabsf(f[(size_t)e * d + k])) k = j;
        if (es == 2)
            ((uint16_t *)row)[k] ^= 1;
        else
            ((uint32_t *)row)[k] ^= 1;
    }
    free(f);
    return r;
}

/* Tokens whose k-th and (k+1)-th largest choice scores (the logits; DeepSeek-V3: sigmoid plus the
 * bias) are within 1e-5 of each other relative to the largest: the near-ties the comparison is
 * about. */
static int64_t near_ties(const float *lg, const float *bias, int64_t T, int E, int k)
{
    int64_t n = 0;
    float *v = malloc(sizeof(float) * (size_t)E);
    for (int64_t t = 0; t < T; t++) {
        for (int e = 0; e < E; e++)
            v[e] = bias ? 1.0f / (1.0f + expf(-lg[t * E + e])) + bias[e] : lg[t * E + e];
        float top = -INFINITY;
        for (int e = 0; e < E; e++) top = fmaxf(top, fabsf(v[e]));
        for (int i = 0; i <= k && i < E; i++) /* partial selection sort, descending */
            for (int j = i + 1; j < E; j++)
                if (v[j] > v[i]) {
                    float s = v[i];
                    v[i] = v[j];
                    v[j] = s;
                }
        n += k < E && v[k - 1] - v[k] <= 1e-5f * top;
    }
    free(v);
    return n;
}

/* Tokens whose routes differ (count or ids), and the largest weight difference where they agree. */
static int64_t route_diff(const moed_route *a, const moed_route *b, double *wmax)
{
    int64_t bad = 0;
    *wmax = 0;
    for (int64_t t = 0; t < a->T; t++) {
        const int64_t n = a->off[t + 1] - a->off[t];
        int same = n == b->off[t + 1] - b->off[t];
        for (int64_t j = 0; same && j < n; j++) {
            same = a->expert[a->off[t] + j] == b->expert[b->off[t] + j];
            const double dw = fabs((double)a->weight[a->off[t] + j] - b->weight[b->off[t] + j]);
            if (dw > *wmax) *wmax = dw;
        }
        bad += !same;
    }
    return bad;
}

/* Every strategy over both backends' logits: the same experts, weights within 1e-6. */
static void compare_choices(const char *what, const moed_layer *l, const float *lg, const float *lc,
                            int64_t T)
{
    static const int strategies[] = { MOED_GATE_MODEL,     MOED_GATE_TOPK,      MOED_GATE_SIGMOID,
                                      MOED_GATE_SPARSEMAX, MOED_GATE_QUADRATIC, MOED_GATE_PIONEER };
    const moed_layer_info *li = &l->info;
    moed_error err;
    for (size_t i = 0; i <= sizeof strategies / sizeof strategies[0]; i++) {
        const int batch = i == sizeof strategies / sizeof strategies[0];
        moed_route rg = { 0 }, rc = { 0 };
        int32_t sg[64], sc[64];
        int ok;
        if (batch) {
            ok = !moed_gate_batch(lg, T, li->n_experts, li->top_k, sg, &rg, &err) &&
                 !moed_gate_batch(lc, T, li->n_experts, li->top_k, sc, &rc, &err);
            ok = ok && !memcmp(sg, sc, sizeof(int32_t) * (size_t)li->top_k);
        } else {
            moed_gate_params p = { strategies[i], 0, MOED_RENORM_DEFAULT, 0.0f };
            ok = !moed_gate_resolve(&p, li, &err) &&
                 !moed_gate(&p, li, l->router_bias, lg, T, &rg, &err) &&
                 !moed_gate(&p, li, l->router_bias, lc, T, &rc, &err);
        }
        const char *sname = batch ? "batch" : moed_gate_strategy_name(strategies[i]);
        CHECK_MSG(ok, "%s %s: gating failed: %s", what, sname, err.msg);
        double wmax = 0;
        const int64_t bad = ok ? route_diff(&rg, &rc, &wmax) : 0;
        CHECK_MSG(ok && bad == 0 && wmax <= 1e-6,
                  "%s %s: %lld of %lld tokens chose other experts, weights apart by up to %.3g",
                  what, sname, (long long)bad, (long long)T, wmax);
        moed_route_free(&rg);
        moed_route_free(&rc);
    }
}

static void run_router_case(const rcase *rc)
{
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    moed_synth_spec spec;
    moed_layer layer;
    moed_error err;
    if (moed_synth_parse(rc->spec, &spec, &err) || moed_synth_layer(&spec, 0, &layer, &err)) {
        CHECK_MSG(0, "%s: %s", rc->name, err.msg);
        return;
    }
    const moed_layer_info *li = &layer.info;
    const int d = li->d_model, E = li->n_experts;
    const int64_t T = rc->T;
    const void *synth_router = layer.router;
    const float *synth_bias = layer.router_bias;
    float *base = malloc(sizeof(float) * (size_t)E * d), *bias = NULL;
    moed_to_f32(moed_layer_router_dtype(&layer), layer.router, base, (size_t)E * d);
    if (synth_bias) { /* twins choose alike only with the same correction bias */
        bias = malloc(sizeof(float) * (size_t)E);
        for (int e = 0; e < E; e++) bias[e] = synth_bias[is_twin(e) ? e - 1 : e];
        layer.router_bias = bias;
    }
    static const int rdtypes[] = { MOED_F32, MOED_BF16 },
                     xdtypes[] = { MOED_F32, MOED_F16, MOED_BF16 };
    float *xf = malloc(sizeof(float) * (size_t)T * d);
    void *x = malloc(sizeof(float) * (size_t)T * d);
    float *lg = malloc(sizeof(float) * (size_t)T * E), *lc = malloc(sizeof(float) * (size_t)T * E);
    for (int64_t i = 0; i < T * d; i++) xf[i] = (float)(2.0 * urand() - 1.0);
    for (size_t r = 0; r < 2; r++) {
        void *router = twin_router(base, E, d, rdtypes[r]);
        layer.router = router;
        layer.router_dtype = rdtypes[r];
        moed_backend *gpu = open_backend("cuda", NULL, &layer, T);
        moed_backend *cpu = open_backend("cpu", NULL, &layer, T);
        CHECK_MSG(gpu && cpu, "%s: backends did not open", rc->name);
        for (size_t xi = 0; gpu && cpu && xi < 3; xi++) {
            char what[160];
            snprintf(what, sizeof what, "router %s, hidden %s, router weights %s", rc->name,
                     moed_dtype_name(xdtypes[xi]), moed_dtype_name(rdtypes[r]));
            moed_from_f32(xdtypes[xi], xf, x, (size_t)T * d);
            const moed_job lj = { .dtype = xdtypes[xi], .T = T, .x = x };
            int rcg = moed_backend_router_logits(gpu, 0, &lj, lg, &err);
            CHECK_MSG(rcg == 0, "%s: cuda: %s", what, err.msg);
            int rcc = moed_backend_router_logits(cpu, 0, &lj, lc, &err);
            CHECK_MSG(rcc == 0, "%s: cpu: %s", what, err.msg);
            if (rcg || rcc) continue;
            const int64_t diff = count_diff(lg, lc, (size_t)T * E),
                          ties = near_ties(lc, bias, T, E, li->top_k);
            CHECK_MSG(diff == 0, "%s: %lld of %lld logits differ from the CPU's", what,
                      (long long)diff, (long long)(T * E));
            CHECK_MSG(ties * 20 >= T,
                      "%s: only %lld of %lld tokens have a near-tie at the top-k "
                      "boundary: the inputs do not test what they should",
                      what, (long long)ties, (long long)T);
            compare_choices(what, &layer, lg, lc, T);
            fprintf(stderr, "  %-72s T=%-5lld near-ties %-5lld %.1fs\n", what, (long long)T,
                    (long long)ties, elapsed_s(t0));
        }
        moed_backend_destroy(gpu);
        moed_backend_destroy(cpu);
        free(router);
    }
    layer.router = synth_router;
    layer.router_dtype = 0;
    layer.router_bias = synth_bias;
    moed_synth_free_layer(&layer);
    free(base);
    free(bias);
    free(xf);
    free(x);
    free(lg);
    free(lc);
}

#define MIX_S  "layers=1,d=512,ff=1792,experts=8,topk=2,act=swiglu,dtype=bf16,seed=3"
#define QWEN_S "layers=1,d=256,ff=96,experts=128,topk=8,act=swiglu,dtype=bf16,seed=4"
#define DSV3_S                                                                                     \
    "layers=1,d=448,ff=256,experts=64,topk=8,act=swiglu,dtype=bf16,seed=5,shared=1,shared_ff=256," \
    "rule=deepseek,groups=8,topk_groups=4,scale=2.5"

static const tcase cases[] = {
    { "mixtral-s T=1", MIX_S, 1, R_TOPK, MOED_BF16, NULL, 0 },
    { "mixtral-s T=7", MIX_S, 7, R_TOPK, MOED_BF16, NULL, 0 },
    { "mixtral-s T=128", MIX_S, 128, R_TOPK, MOED_BF16, NULL, 0 },
    { "mixtral-s T=1000 sm80", MIX_S, 1000, R_TOPK, MOED_BF16, "sm80", 0 },
    { "mixtral-s T=1000 sm90", MIX_S, 1000, R_TOPK, MOED_BF16, "sm90", 0 },
    { "mixtral-s T=1000 sm90p", MIX_S, 1000, R_TOPK, MOED_BF16, "sm90p", 0 },
    { "mixtral-s T=64 (bm 32)", MIX_S, 64, R_TOPK, MOED_BF16, NULL, 0 },
    { "mixtral-s T=96 (bm 32)", MIX_S, 96, R_TOPK, MOED_BF16, NULL, 0 },
    { "mixtral-s T=4096", MIX_S, 4096, R_TOPK, MOED_BF16, NULL, 0 },
    { "mixtral-s T=4096 f32 in/out", MIX_S, 4096, R_TOPK, MOED_F32, NULL, 0 },
    { "mixtral-s T=1000 f16 in/out", MIX_S, 1000, R_TOPK, MOED_F16, NULL, 0 },
    { "mixtral-s one expert T=1000 sm90", MIX_S, 1000, R_ONE_EXPERT, MOED_BF16, "sm90", 0 },
    { "mixtral-s one expert T=1000 sm80", MIX_S, 1000, R_ONE_EXPERT, MOED_BF16, "sm80", 0 },
    /* 15 m-tiles: the last cluster's second CTA has none, and loads its half of the weights */
    { "mixtral-s one expert T=900 sm90", MIX_S, 900, R_ONE_EXPERT, MOED_BF16, "sm90", 0 },
    { "mixtral-s empty experts T=128", MIX_S, 128, R_HALF_EXPERTS, MOED_BF16, NULL, 0 },
    { "k=1 T=1000", "layers=1,d=384,ff=640,experts=16,topk=1,act=swiglu,dtype=bf16,seed=6", 1000,
      R_TOPK, MOED_BF16, NULL, 0 },
    { "qwen3-s T=1", QWEN_S, 1, R_TOPK, MOED_BF16, NULL, 0 },
    { "qwen3-s T=7", QWEN_S, 7, R_TOPK, MOED_BF16, NULL, 0 },
    { "qwen3-s T=1000", QWEN_S, 1000, R_TOPK, MOED_BF16, NULL, 0 },
    { "qwen3-s T=4096 sm90", QWEN_S, 4096, R_TOPK, MOED_BF16, "sm90", 0 },
    { "qwen3-s T=4096 sm90p", QWEN_S, 4096, R_TOPK, MOED_BF16, "sm90p", 0 },
    { "qwen3-s sigmoid T=1000", QWEN_S, 1000, R_SIGMOID, MOED_BF16, NULL, 0 },
    { "qwen3-s sparsemax T=1000", QWEN_S, 1000, R_SPARSEMAX, MOED_BF16, NULL, 0 },
    { "qwen3-s padded T=128", QWEN_S, 128, R_PADDED, MOED_BF16, NULL, 0 },
    { "deepseek-s shared T=1", DSV3_S, 1, R_TOPK, MOED_BF16, NULL, 0 },
    { "deepseek-s shared T=1000", DSV3_S, 1000, R_TOPK, MOED_BF16, NULL, 0 },
    { "deepseek-s shared T=4096 sm90", DSV3_S, 4096, R_TOPK, MOED_BF16, "sm90", 0 },
    { "deepseek-s shared T=4096 sm90p", DSV3_S, 4096, R_TOPK, MOED_BF16, "sm90p", 0 },
    /* the shared experts' 3 m-tiles: one cluster of two, one with a CTA that has no rows */
    { "deepseek-s shared T=300 sm90", DSV3_S, 300, R_TOPK, MOED_BF16, "sm90", 0 },
    /* d_pad 384: the down GEMM at bn 128, one CTA a cluster; the up GEMM at bn 256, two */
    { "bn 128 sm90 T=1000", "layers=1,d=384,ff=320,experts=16,topk=4,act=swiglu,dtype=bf16,seed=14",
      1000, R_TOPK, MOED_BF16, "sm90", 0 },
    { "bn 128 sm90p T=1000",
      "layers=1,d=384,ff=320,experts=16,topk=4,act=swiglu,dtype=bf16,seed=14", 1000, R_TOPK,
      MOED_BF16, "sm90p", 0 },
    /* ReLU on the Hopper kernel: the up GEMM at bn 128 (N = 384), the down GEMM's 256 columns
     * stored in two rounds of the staging buffer */
    { "relu sm90 T=1000", "layers=1,d=256,ff=384,experts=8,topk=2,act=relu,dtype=bf16,seed=15",
      1000, R_TOPK, MOED_BF16, "sm90", 0 },
    { "gelu f16 weights T=1000", "layers=1,d=320,ff=200,experts=8,topk=2,act=gelu,dtype=f16,seed=7",
      1000, R_TOPK, MOED_F16, NULL, 0 },
    { "relu f32 weights T=128", "layers=1,d=200,ff=130,experts=6,topk=2,act=relu,dtype=f32,seed=8",
      128, R_TOPK, MOED_F32, NULL, 0 },
    { "odd sizes T=37", "layers=1,d=100,ff=70,experts=5,topk=3,act=swiglu,dtype=bf16,seed=9", 37,
      R_TOPK, MOED_BF16, NULL, 0 },
    { "f16 weights sm90 T=1000",
      "layers=1,d=512,ff=384,experts=8,topk=2,act=swiglu,dtype=f16,seed=10", 1000, R_TOPK, MOED_F16,
      "sm90", 0 },
    /* full-size standard shapes, sampled rows */
    { "mixtral full T=4096",
      "layers=1,d=4096,ff=14336,experts=8,topk=2,act=swiglu,dtype=bf16,seed=11", 4096, R_TOPK,
      MOED_BF16, NULL, 24 },
    { "qwen3-30b-a3b full T=4096",
      "layers=1,d=2048,ff=768,experts=128,topk=8,act=swiglu,dtype=bf16,seed=12", 4096, R_TOPK,
      MOED_BF16, NULL, 24 },
    { "deepseek-v3 full T=1000",
      "layers=1,d=7168,ff=2048,experts=256,topk=8,act=swiglu,dtype=bf16,seed=13,shared=1,shared_ff="
      "2048,"
      "rule=deepseek,groups=8,topk_groups=4,scale=2.5",
      1000, R_TOPK, MOED_BF16, NULL, 16 },
};

#define MIX8_S  "layers=1,d=512,ff=1792,experts=8,topk=2,act=swiglu,dtype=fp8,seed=3"
#define QWEN8_S "layers=1,d=256,ff=96,experts=128,topk=8,act=swiglu,dtype=fp8,seed=4"
#define DSV38_S                                                                                    \
    "layers=1,d=448,ff=256,experts=64,topk=8,act=swiglu,dtype=fp8,seed=5,shared=1,shared_ff=256,"  \
    "rule=deepseek,groups=8,topk_groups=4,scale=2.5"

/* The shape classes above with FP8 weights: NULL kernel is the table's choice (the FP8 Tensor
 * Cores on Hopper), sm80 the portable path. */
static const tcase fp8_cases[] = {
    { "fp8 mixtral-s T=1", MIX8_S, 1, R_TOPK, MOED_BF16, NULL, 0 },
    { "fp8 mixtral-s T=7", MIX8_S, 7, R_TOPK, MOED_BF16, NULL, 0 },
    { "fp8 mixtral-s T=128", MIX8_S, 128, R_TOPK, MOED_BF16, NULL, 0 },
    { "fp8 mixtral-s T=1000 sm80", MIX8_S, 1000, R_TOPK, MOED_BF16, "sm80", 0 },
    { "fp8 mixtral-s T=1000 sm90", MIX8_S, 1000, R_TOPK, MOED_BF16, "sm90", 0 },
    { "fp8 mixtral-s T=4096", MIX8_S, 4096, R_TOPK, MOED_BF16, NULL, 0 },
    { "fp8 mixtral-s T=4096 f32 in/out", MIX8_S, 4096, R_TOPK, MOED_F32, NULL, 0 },
    { "fp8 mixtral-s T=1000 f16 in/out", MIX8_S, 1000, R_TOPK, MOED_F16, NULL, 0 },
    { "fp8 mixtral-s one expert T=1000", MIX8_S, 1000, R_ONE_EXPERT, MOED_BF16, NULL, 0 },
    { "fp8 mixtral-s one expert T=1000 sm80", MIX8_S, 1000, R_ONE_EXPERT, MOED_BF16, "sm80", 0 },
    { "fp8 mixtral-s empty experts T=128", MIX8_S, 128, R_HALF_EXPERTS, MOED_BF16, NULL, 0 },
    { "fp8 k=1 T=1000", "layers=1,d=384,ff=640,experts=16,topk=1,act=swiglu,dtype=fp8,seed=6", 1000,
      R_TOPK, MOED_BF16, NULL, 0 },
    { "fp8 qwen3-s T=1", QWEN8_S, 1, R_TOPK, MOED_BF16, NULL, 0 },
    { "fp8 qwen3-s T=1000", QWEN8_S, 1000, R_TOPK, MOED_BF16, NULL, 0 },
    { "fp8 qwen3-s T=4096", QWEN8_S, 4096, R_TOPK, MOED_BF16, NULL, 0 },
    { "fp8 qwen3-s T=1000 sm80", QWEN8_S, 1000, R_TOPK, MOED_BF16, "sm80", 0 },
    { "fp8 qwen3-s sigmoid T=1000", QWEN8_S, 1000, R_SIGMOID, MOED_BF16, NULL, 0 },
    { "fp8 qwen3-s sparsemax T=1000", QWEN8_S, 1000, R_SPARSEMAX, MOED_BF16, NULL, 0 },
    { "fp8 qwen3-s padded T=128", QWEN8_S, 128, R_PADDED, MOED_BF16, NULL, 0 },
    { "fp8 deepseek-s shared T=1", DSV38_S, 1, R_TOPK, MOED_BF16, NULL, 0 },
    { "fp8 deepseek-s shared T=1000", DSV38_S, 1000, R_TOPK, MOED_BF16, NULL, 0 },
    { "fp8 deepseek-s shared T=4096", DSV38_S, 4096, R_TOPK, MOED_BF16, NULL, 0 },
    { "fp8 deepseek-s shared T=1000 sm80", DSV38_S, 1000, R_TOPK, MOED_BF16, "sm80", 0 },
    { "fp8 gelu T=1000", "layers=1,d=320,ff=200,experts=8,topk=2,act=gelu,dtype=fp8,seed=7", 1000,
      R_TOPK, MOED_F16, NULL, 0 },
    { "fp8 relu T=128", "layers=1,d=200,ff=130,experts=6,topk=2,act=relu,dtype=fp8,seed=8", 128,
      R_TOPK, MOED_F32, NULL, 0 },
    { "fp8 odd sizes T=37", "layers=1,d=100,ff=70,experts=5,topk=3,act=swiglu,dtype=fp8,seed=9", 37,
      R_TOPK, MOED_BF16, NULL, 0 },
    { "fp8 odd sizes T=37 sm80",
      "layers=1,d=100,ff=70,experts=5,topk=3,act=swiglu,dtype=fp8,seed=9", 37, R_TOPK, MOED_BF16,
      "sm80", 0 },
    { "fp8 mixtral full T=4096",
      "layers=1,d=4096,ff=14336,experts=8,topk=2,act=swiglu,dtype=fp8,seed=11", 4096, R_TOPK,
      MOED_BF16, NULL, 24 },
    { "fp8 qwen3-30b-a3b full T=4096",
      "layers=1,d=2048,ff=768,experts=128,topk=8,act=swiglu,dtype=fp8,seed=12", 4096, R_TOPK,
      MOED_BF16, NULL, 24 },
    { "fp8 deepseek-v3 full T=1000",
      "layers=1,d=7168,ff=2048,experts=256,topk=8,act=swiglu,dtype=fp8,seed=13,shared=1,"
      "shared_ff=2048,rule=deepseek,groups=8,topk_groups=4,scale=2.5",
      1000, R_TOPK, MOED_BF16, NULL, 16 },
    /* both ways the up GEMM reads its rows at bm 128 whatever the table picks: gathered in the
     * load, pre-permuted with their scales (each in clusters of two) */
    { "fp8 deepseek-s shared T=4096 sm90", DSV38_S, 4096, R_TOPK, MOED_BF16, "sm90", 0 },
    { "fp8 mixtral-s T=1000 sm90p", MIX8_S, 1000, R_TOPK, MOED_BF16, "sm90p", 0 },
};

/* The cases MOED_GPU_TEST_QUICK runs (by name: the table grows). */
static const char *const quick[] = { "mixtral-s T=7",
                                     "mixtral-s T=1000 sm90",
                                     "mixtral-s T=1000 sm90p",
                                     "mixtral-s T=64 (bm 32)",
                                     "mixtral-s one expert T=1000 sm90",
                                     "mixtral-s one expert T=900 sm90",
                                     "bn 128 sm90 T=1000",
                                     "relu sm90 T=1000",
                                     "qwen3-s T=4096 sm90p",
                                     "deepseek-s shared T=1000",
                                     "odd sizes T=37" };
static const int fp8_quick[] = { 1, 3, 4, 13, 20, 25 };

/* The shape classes run with 2:4 sparse routed experts (run_case's sparse; the table always picks
 * mma.sp for them). */
static const tcase sparse_cases[] = {
    { "sp mixtral-s T=1", MIX_S, 1, R_TOPK, MOED_BF16, NULL, 0 },
    { "sp mixtral-s T=7", MIX_S, 7, R_TOPK, MOED_BF16, NULL, 0 },
    { "sp mixtral-s T=64 (bm 32)", MIX_S, 64, R_TOPK, MOED_BF16, NULL, 0 },
    { "sp mixtral-s T=128 (bm 64)", MIX_S, 128, R_TOPK, MOED_BF16, NULL, 0 },
    { "sp mixtral-s T=1000 (bm 128)", MIX_S, 1000, R_TOPK, MOED_BF16, NULL, 0 },
    { "sp mixtral-s T=4096 f32 in/out", MIX_S, 4096, R_TOPK, MOED_F32, NULL, 0 },
    { "sp mixtral-s one expert T=1000", MIX_S, 1000, R_ONE_EXPERT, MOED_BF16, NULL, 0 },
    { "sp mixtral-s empty experts T=128", MIX_S, 128, R_HALF_EXPERTS, MOED_BF16, NULL, 0 },
    { "sp qwen3-s T=1", QWEN_S, 1, R_TOPK, MOED_BF16, NULL, 0 },
    { "sp qwen3-s T=1000", QWEN_S, 1000, R_TOPK, MOED_BF16, NULL, 0 },
    { "sp qwen3-s T=4096", QWEN_S, 4096, R_TOPK, MOED_BF16, NULL, 0 },
    { "sp qwen3-s padded T=128", QWEN_S, 128, R_PADDED, MOED_BF16, NULL, 0 },
    { "sp deepseek-s shared T=1", DSV3_S, 1, R_TOPK, MOED_BF16, NULL, 0 },
    { "sp deepseek-s shared T=1000", DSV3_S, 1000, R_TOPK, MOED_BF16, NULL, 0 },
    { "sp gelu f16 weights T=7", "layers=1,d=320,ff=200,experts=8,topk=2,act=gelu,dtype=f16,seed=7",
      7, R_TOPK, MOED_F16, NULL, 0 },
    { "sp gelu f16 weights T=1000",
      "layers=1,d=320,ff=200,experts=8,topk=2,act=gelu,dtype=f16,seed=7", 1000, R_TOPK, MOED_F16,
      NULL, 0 },
    { "sp swiglu f16 weights T=300",
      "layers=1,d=512,ff=384,experts=8,topk=2,act=swiglu,dtype=f16,seed=10", 300, R_TOPK, MOED_F16,
      NULL, 0 },
    { "sp relu f32 weights T=128",
      "layers=1,d=200,ff=130,experts=6,topk=2,act=relu,dtype=f32,seed=8", 128, R_TOPK, MOED_F32,
      NULL, 0 },
    { "sp odd sizes T=37", "layers=1,d=100,ff=70,experts=5,topk=3,act=swiglu,dtype=bf16,seed=9", 37,
      R_TOPK, MOED_BF16, NULL, 0 },
    { "sp qwen3-30b-a3b full T=512",
      "layers=1,d=2048,ff=768,experts=128,topk=8,act=swiglu,dtype=bf16,seed=12", 512, R_TOPK,
      MOED_BF16, NULL, 24 },
};
static const int sparse_quick[] = { 1, 4, 13, 15, 18 };

/* A layer marked sparse24 whose expert 2 has one group of three non-zeros in W3: the CUDA load
 * must refuse it (MOED_EINVAL), naming the layer, the expert and the matrix. */
static void run_sparse_refused(void)
{
    moed_synth_spec spec;
    moed_error err;
    moed_layer layer;
    if (moed_synth_parse(MIX_S, &spec, &err) || moed_synth_layer(&spec, 0, &layer, &err)) {
        CHECK_MSG(0, "sparse refusal: %s", err.msg);
        return;
    }
    CHECK(tok_make_sparse(&layer) == 0);
    uint16_t *grp = (uint16_t *)layer.experts[2].w3 + 5 * layer.info.d_model + 8;
    grp[0] = grp[1] = grp[2] = 0x3f80; /* 1.0 in bf16 */
    moed_backend_config cfg = { .max_tokens = 16, .streams = 1 };
    moed_backend *b = NULL;
    unsetenv("MOED_CUDA_KERNEL");
    int rc = moed_backend_open("cuda", &cfg, &b, &err);
    CHECK_MSG(rc == 0, "sparse refusal: cuda backend: %s", err.msg);
    if (!rc) {
        rc = moed_backend_load_layer(b, 0, &layer, &err);
        CHECK_MSG(rc == MOED_EINVAL && strstr(err.msg, "layer 0") && strstr(err.msg, "expert 2") &&
                      strstr(err.msg, "w3") && strstr(err.msg, "row 5"),
                  "sparse refusal: load returned %d (%s)", rc, rc ? err.msg : "accepted");
        fprintf(stderr, "  %-44s refused: %s\n", "sp not 2:4", rc ? err.msg : "(accepted)");
    }
    moed_backend_destroy(b);
    moed_synth_free_layer(&layer);
}

static void run_sparse(int quick_only)
{
    if (quick_only) {
        for (size_t i = 0; i < sizeof sparse_quick / sizeof sparse_quick[0]; i++)
            run_case(&sparse_cases[sparse_quick[i]], 1);
    } else {
        for (size_t i = 0; i < sizeof sparse_cases / sizeof sparse_cases[0]; i++)
            run_case(&sparse_cases[i], 1);
    }
    run_sparse_refused();
}

/* ---- FP8 against bf16 on the same model --------------------------------------------------- */

/* One matrix of a bf16 layer quantized (moed_fp8.h), into new buffers. */
static void quantize_matrix(const void *w, int64_t rows, int64_t cols, const void **q,
                            const float **sc)
{
    uint8_t *qq = malloc((size_t)(rows * cols));
    float *ss = malloc(sizeof(float) * (size_t)moed_fp8_scale_count(rows, cols));
    int64_t bad;
    CHECK(moed_fp8_quantize(w, MOED_BF16, rows, cols, qq, ss, &bad) == 0);
    *q = qq;
    *sc = ss;
}

/* The bf16 layer l quantized as --weights fp8 does; free with free_quantized. */
static void quantize_layer(const moed_layer *l, moed_layer *out)
{
    const moed_layer_info *li = &l->info;
    *out = *l;
    out->info.wdtype = MOED_FP8;
    out->router_dtype = moed_layer_router_dtype(l);
    out->experts = calloc((size_t)li->n_experts, sizeof *out->experts);
    for (int e = 0; e <= li->n_experts; e++) {
        if (e == li->n_experts && !li->n_shared) break;
        const moed_expert_w *x = e < li->n_experts ? &l->experts[e] : &l->shared;
        moed_expert_w *y = e < li->n_experts ? &out->experts[e] : &out->shared;
        const int64_t ff = e < li->n_experts ? li->d_ff : li->shared_d_ff, d = li->d_model;
        quantize_matrix(x->w1, ff, d, &y->w1, &y->s1);
        if (x->w3) quantize_matrix(x->w3, ff, d, &y->w3, &y->s3);
        quantize_matrix(x->w2, d, ff, &y->w2, &y->s2);
    }
}

static void free_quantized(moed_layer *q)
{
    for (int e = 0; e <= q->info.n_experts; e++) {
        if (e == q->info.n_experts && !q->info.n_shared) break;
        moed_expert_w *y = e < q->info.n_experts ? &q->experts[e] : &q->shared;
        free((void *)y->w1);
        free((void *)y->w3);
        free((void *)y->w2);
        free((void *)y->s1);
        free((void *)y->s3);
        free((void *)y->s2);
    }
    free(q->experts);
}

/* The FP8 path on a bf16 model quantized at load, against the bf16 path on the model itself. */
static void run_vs_bf16(const char *name, const char *spec_text, int64_t T)
{
    moed_synth_spec spec;
    moed_error err;
    moed_layer layer, q;
    moed_route route = { 0 };
    if (moed_synth_parse(spec_text, &spec, &err) || moed_synth_layer(&spec, 0, &layer, &err)) {
        CHECK_MSG(0, "%s: %s", name, err.msg);
        return;
    }
    quantize_layer(&layer, &q);
    const int d = layer.info.d_model;
    const size_t n = (size_t)T * d;
    uint16_t *x = malloc(2 * n), *y8 = malloc(2 * n), *y16 = malloc(2 * n);
    float *xf = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) xf[i] = (float)(2.0 * urand() - 1.0);
    moed_from_f32(MOED_BF16, xf, x, n);
    moed_backend *b16 = NULL, *b8 = NULL;
    if (!make_route(&layer.info, layer.router_bias, R_TOPK, T, &route)) {
        b16 = open_backend("cuda", NULL, &layer, T);
        b8 = open_backend("cuda", NULL, &q, T);
    }
    CHECK_MSG(b16 && b8, "%s: backends did not open", name);
    if (b16 && b8) {
        moed_job j16 = { .dtype = MOED_BF16, .T = T, .x = x, .y = y16, .route = &route },
                 j8 = { .dtype = MOED_BF16, .T = T, .x = x, .y = y8, .route = &route };
        CHECK(moed_backend_forward(b16, 0, &j16, &err) == 0);
        CHECK(moed_backend_forward(b8, 0, &j8, &err) == 0);
        const double e = rel_err(MOED_BF16, y8, y16, n);
        CHECK_MSG(e >= 0 && e <= BOUND_FP8_VS_BF16,
                  "%s: fp8 vs bf16 relative error %.3g (bound "
                  "%.0e)",
                  name, e, BOUND_FP8_VS_BF16);
        fprintf(stderr, "  %-44s T=%-6lld fp8 vs bf16 rel_err=%.2e token_max=%.2e\n", name,
                (long long)T, e, token_err(MOED_BF16, y8, y16, T, d));
    }
    moed_backend_destroy(b16);
    moed_backend_destroy(b8);
    moed_route_free(&route);
    free_quantized(&q);
    moed_synth_free_layer(&layer);
    free(x);
    free(y8);
    free(y16);
    free(xf);
}

static void run_fp8(int quick_only)
{
    const int n = (int)(sizeof fp8_cases / sizeof fp8_cases[0]);
    if (quick_only) {
        for (size_t i = 0; i < sizeof fp8_quick / sizeof fp8_quick[0]; i++)
            run_case(&fp8_cases[fp8_quick[i]], 0);
        return;
    }
    for (int i = 0; i < n; i++) run_case(&fp8_cases[i], 0);
    run_vs_bf16("fp8 vs bf16 mixtral-s", MIX_S, 1000);
    run_vs_bf16("fp8 vs bf16 qwen3-s", QWEN_S, 1000);
    run_vs_bf16("fp8 vs bf16 deepseek-s shared", DSV3_S, 1000);
    run_vs_bf16("fp8 vs bf16 qwen3-30b-a3b full",
                "layers=1,d=2048,ff=768,experts=128,topk=8,act=swiglu,dtype=bf16,seed=12", 512);
}

int main(void)
{
    if (!moed_backend_cuda_available()) {
        fprintf(stderr,
                "test_cuda_backend: no CUDA device (or moed built without CUDA): skipped\n");
        return CHECK_SKIP;
    }
    const int n = (int)(sizeof cases / sizeof cases[0]);
    const char *q = getenv("MOED_GPU_TEST_QUICK"), *ro = getenv("MOED_GPU_TEST_ROUTER_ONLY"),
               *f8 = getenv("MOED_GPU_TEST_FP8_ONLY"), *sp = getenv("MOED_GPU_TEST_SPARSE_ONLY");
    if (sp && *sp == '1') {
        run_sparse(q && *q == '1');
    } else if (ro && *ro == '1') {
        for (size_t i = 0; i < sizeof router_cases / sizeof router_cases[0]; i++)
            run_router_case(&router_cases[i]);
    } else if (f8 && *f8 == '1') {
        run_fp8(q && *q == '1');
    } else if (q && *q == '1') {
        for (size_t i = 0; i < sizeof quick / sizeof quick[0]; i++)
            for (int j = 0; j < n; j++)
                if (!strcmp(cases[j].name, quick[i])) run_case(&cases[j], 0);
        run_fp8(1);
        run_sparse(1);
        run_router_case(&router_cases[0]);
    } else {
        for (int i = 0; i < n; i++) run_case(&cases[i], 0);
        run_fp8(0);
        run_sparse(0);
        for (size_t i = 0; i < sizeof router_cases / sizeof router_cases[0]; i++)
            run_router_case(&router_cases[i]);
    }
    for (int k = 0; k < TOK_C_COUNT; k++)
        if (run_rel_max[k][0] >= 0)
            fprintf(stderr,
                    "per-token error/magnitude, largest over the run, %s compute: vs cpu %.2e, "
                    "vs f64 %.2e (rtol %g)\n",
                    tok_compute_name[k], run_rel_max[k][0], run_rel_max[k][1], tok_rtol[k]);
    return check_status("test_cuda_backend");
}
