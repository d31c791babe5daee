/*
 * tok_ref.h — what the accuracy tests share (test_tok_ref on the CPU, test_cuda_backend and
 * test_split on a GPU): a float64 reference of one MoE layer, and a comparison that bounds every
 * token's error by that token's own magnitude.
 *
 * The reference follows the definitions of moed_model.h and nothing else: for each (expert,
 * weight) pair of a token's route, weight * W2 act(W1 x) (SwiGLU: W2 (silu(W1 x) * W3 x)), plus
 * the shared experts with weight 1; every product and sum in double, from the stored weight values
 * (FP8: q times its block's scale, moed_fp8.h) and the exact input values (moed_to_f32 decodes the
 * dtypes). It costs d_model x d_ff x 3
 * multiply-adds per (token, expert) pair, so the tests run it on a sample of tokens.
 *
 * A token passes when its largest error is at most rtol times its own largest reference magnitude
 * plus atol, and its output is finite. Per token, because a bound over the whole batch lets a token
 * go missing: at T = 4096 a zeroed row moves the batch's relative Frobenius error by
 * 1/sqrt(4096) = 1.6e-2, under the 2e-2 such a bound needs for bf16 compute.
 *
 * The per-token bounds against the CPU backend and this reference, by the compute type a layer runs
 * in on a GPU (tok_rtol, TOK_ATOL), are here too: test_cuda_backend holds the CUDA backend to them,
 * and test_split a layer split over GPUs.
 */
#ifndef MOED_TOK_REF_H
#define MOED_TOK_REF_H

#include "moed_dtype.h"
#include "moed_fp8.h"
#include "moed_model.h"
#include "moed_route.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* n values of dtype as doubles. */
static inline void tok_to_f64(int dtype, const void *src, double *dst, size_t n)
{
    float *f = malloc(sizeof(float) * (n ? n : 1));
    moed_to_f32(dtype, src, f, n);
    for (size_t i = 0; i < n; i++) dst[i] = f[i];
    free(f);
}

/* Row j of a [rows, cols] weight matrix of dtype (FP8: with its block scales), as floats in buf. */
static inline const float *tok_row(int dtype, const void *w, const float *scale, int j, int cols,
                                   float *buf)
{
    if (dtype == MOED_FP8)
        for (int c = 0; c < cols; c++) buf[c] = moed_fp8_weight(w, scale, cols, j, c);
    else
        moed_to_f32(dtype, (const char *)w + (size_t)j * (size_t)cols * moed_dtype_size(dtype), buf,
                    (size_t)cols);
    return buf;
}

static inline double tok_dot(const float *w, const double *x, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++) s += (double)w[i] * x[i];
    return s;
}

/* y += g * W2 act(W1 x) for one expert of width ff (buf: max(d, ff) floats, h: ff doubles). */
static inline void tok_expert(const moed_layer_info *li, const moed_expert_w *w, int ff,
                              const double *x, double g, double *y, float *buf, double *h)
{
    const int d = li->d_model, dt = li->wdtype;
    for (int j = 0; j < ff; j++) {
        const double a = tok_dot(tok_row(dt, w->w1, w->s1, j, d, buf), x, d);
        if (li->act == MOED_ACT_SWIGLU)
            h[j] = a / (1.0 + exp(-a)) * tok_dot(tok_row(dt, w->w3, w->s3, j, d, buf), x, d);
        else if (li->act == MOED_ACT_GELU)
            h[j] = 0.5 * a * (1.0 + erf(a / sqrt(2.0)));
        else
            h[j] = a > 0 ? a : 0;
    }
    for (int i = 0; i < d; i++) y[i] += g * tok_dot(tok_row(dt, w->w2, w->s2, i, ff, buf), h, ff);
}

/* y [n, d_model] = the layer on x [n, d_model] (xdtype) routed by r (n tokens), in float64. */
static inline void tok_ref_forward(const moed_layer *l, int xdtype, const void *x,
                                   const moed_route *r, int64_t n, double *y)
{
    const moed_layer_info *li = &l->info;
    const int d = li->d_model;
    const int ff = li->shared_d_ff > li->d_ff ? li->shared_d_ff : li->d_ff;
    float *buf = malloc(sizeof(float) * (size_t)(d > ff ? d : ff));
    double *h = malloc(sizeof(double) * (size_t)ff), *xt = malloc(sizeof(double) * (size_t)d);
    for (int64_t t = 0; t < n; t++) {
        double *yt = y + (size_t)t * d;
        tok_to_f64(xdtype, (const char *)x + (size_t)t * d * moed_dtype_size(xdtype), xt,
                   (size_t)d);
        memset(yt, 0, sizeof(double) * (size_t)d);
        for (int64_t p = r->off[t]; p < r->off[t + 1]; p++)
            tok_expert(li, &l->experts[r->expert[p]], li->d_ff, xt, r->weight[p], yt, buf, h);
        if (li->n_shared && li->shared_d_ff && l->shared.w1)
            tok_expert(li, &l->shared, li->shared_d_ff, xt, 1.0, yt, buf, h);
    }
    free(buf);
    free(h);
    free(xt);
}

/* Per-token bounds (a token's largest error over its own largest magnitude, plus TOK_ATOL), by
 * compute type. Measured on an H100 over every case of test_cuda_backend's tables (the run prints
 * them): bf16 compute at most 8.0e-3 (p99 of a case at most 7.6e-3), f16 9.7e-4, FP8 on the Tensor
 * Cores 9.3e-2 against the CPU and 7.2e-2 against float64 (p99 of a case at most 7.1e-2), the
 * portable FP8 path 1.4e-2 and 9.6e-3; each rtol leaves 2x to 3x of room, and a token dropped is
 * an error of 1. The outputs are about 0.1 to 1 in size, so atol matters only for rows that are
 * (nearly) zero. */
enum { TOK_C_BF16, TOK_C_F16, TOK_C_FP8, TOK_C_FP8_PORT, TOK_C_COUNT };
static const char *const tok_compute_name[TOK_C_COUNT] = { "bf16", "f16", "fp8 tensor cores",
                                                           "fp8 portable" };
static const double tok_rtol[TOK_C_COUNT] = { 2e-2, 3e-3, 2e-1, 3e-2 };
#define TOK_ATOL 1e-4

/* The compute type of a layer with weights of wdtype: FP8 on the FP8 Tensor Cores where fp8_native
 * (the GPU and the kernel choice allow them), else portable; f16 weights in f16; bf16 and f32
 * weights in bf16. */
static inline int tok_compute_class(int wdtype, int fp8_native)
{
    if (wdtype == MOED_FP8) return fp8_native ? TOK_C_FP8 : TOK_C_FP8_PORT;
    return wdtype == MOED_F16 ? TOK_C_F16 : TOK_C_BF16;
}

/* The sub-route of the given tokens (their pairs, in order), as its own route over len tokens. */
static inline void tok_sub_route(const moed_route *r, const int64_t *tok, int64_t len,
                                 moed_route *out)
{
    int64_t pairs = 0;
    for (int64_t i = 0; i < len; i++) pairs += r->off[tok[i] + 1] - r->off[tok[i]];
    moed_route_init(out, len, pairs > 0 ? pairs : 1);
    int64_t p = 0;
    for (int64_t i = 0; i < len; i++) {
        for (int64_t j = r->off[tok[i]]; j < r->off[tok[i] + 1]; j++, p++) {
            out->expert[p] = r->expert[j];
            out->weight[p] = r->weight[j];
        }
        out->off[i + 1] = p;
    }
}

/* Rows tok[0 .. len-1] of x (rows of row_bytes) into dst, in that order. */
static inline void tok_gather_rows(const void *x, size_t row_bytes, const int64_t *tok, int64_t len,
                                   void *dst)
{
    for (int64_t i = 0; i < len; i++)
        memcpy((char *)dst + (size_t)i * row_bytes, (const char *)x + (size_t)tok[i] * row_bytes,
               row_bytes);
}

/* What a per-token comparison found. rel is a token's largest error over its largest reference
 * magnitude (over the tokens whose reference is not zero); use is its error over its bound. */
typedef struct tok_report {
    int64_t n, bad;   /* tokens compared, tokens over the bound or not finite */
    int64_t worst;    /* the token with the largest use */
    double worst_use; /* > 1: over the bound */
    double rel_p50, rel_p99, rel_max;
} tok_report;

static inline int tok_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Compares got with ref, both [n, d] doubles, token by token: token t passes when
 * max_i |got - ref| <= rtol * max_i |ref| + atol and got's row is finite. Returns rep->bad. */
static inline int64_t tok_compare(const double *got, const double *ref, int64_t n, int d,
                                  double rtol, double atol, tok_report *rep)
{
    double *rel = malloc(sizeof(double) * (size_t)(n ? n : 1));
    int64_t n_rel = 0;
    *rep = (tok_report){ .n = n, .worst = -1 };
    for (int64_t t = 0; t < n; t++) {
        double err = 0, mag = 0;
        int finite = 1;
        for (int i = 0; i < d; i++) {
            const double g = got[(size_t)t * d + i], r = ref[(size_t)t * d + i];
            finite &= isfinite(g);
            err = fmax(err, fabs(g - r));
            mag = fmax(mag, fabs(r));
        }
        const double use = finite ? err / (rtol * mag + atol) : INFINITY;
        rep->bad += use > 1.0;
        if (rep->worst < 0 || use > rep->worst_use) {
            rep->worst = t;
            rep->worst_use = use;
        }
        if (mag > 0) rel[n_rel++] = finite ? err / mag : INFINITY;
    }
    if (n_rel) {
        qsort(rel, (size_t)n_rel, sizeof *rel, tok_cmp_double);
        rep->rel_p50 = rel[n_rel / 2];
        rep->rel_p99 = rel[(n_rel * 99) / 100];
        rep->rel_max = rel[n_rel - 1];
    }
    free(rel);
    return rep->bad;
}

/* The same with got and ref in their dtypes. */
static inline int64_t tok_compare_dtype(int dtype, const void *got, const void *ref, int64_t n,
                                        int d, double rtol, double atol, tok_report *rep)
{
    double *g = malloc(sizeof(double) * (size_t)(n * d)),
           *r = malloc(sizeof(double) * (size_t)(n * d));
    tok_to_f64(dtype, got, g, (size_t)(n * d));
    tok_to_f64(dtype, ref, r, (size_t)(n * d));
    int64_t bad = tok_compare(g, r, n, d, rtol, atol, rep);
    free(g);
    free(r);
    return bad;
}

#endif
