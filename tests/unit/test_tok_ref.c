/*
 * test_tok_ref — the per-token accuracy check that the GPU suite uses (tok_ref.h), shown on the CPU
 * backend where CI can run it.
 *
 * A scaled-down Mixtral layer (the GPU suite's "mixtral-s") at T = 4096, bf16 in and out: the CPU
 * backend's output matches the float64 reference within the per-token bound on a sample of tokens.
 * Then one token's row is zeroed (a token the kernels dropped) and, separately, scaled by 1.03 (one
 * token 3% wrong): the bound over the whole batch that the GPU suite used to apply (relative
 * Frobenius error 2e-2) still passes both, and the per-token check fails each, naming that token
 * and no other, against the float64 reference as against the backend's own output.
 */
#include "check.h"
#include "tok_ref.h"

#include "cpu_backend.h"
#include "moed_synth.h"

#include <stdio.h>

#define SPEC   "layers=1,d=512,ff=1792,experts=8,topk=2,act=swiglu,dtype=bf16,seed=3"
#define TOKENS 4096
#define REFS   48 /* tokens checked against the float64 reference */

/* The bounds the GPU suite applies to bf16 outputs (test_cuda_backend.c), and the batch-wide
 * bound it used to. */
#define RTOL     2e-2
#define ATOL     1e-4
#define OLD_FROB 2e-2

static uint64_t rng = 0x5eed;

static double urand(void)
{
    rng = moed_splitmix64(rng);
    return (double)(rng >> 11) / 9007199254740992.0;
}

/* ||a - b|| / ||b|| over n values. */
static double frobenius(const double *a, const double *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return sqrt(num / den);
}

/* The rows of y at tok[0..n). */
static void rows_at(const double *y, int d, const int64_t *tok, int n, double *out)
{
    for (int i = 0; i < n; i++)
        memcpy(out + (size_t)i * d, y + (size_t)tok[i] * d, sizeof(double) * (size_t)d);
}

/* A wrong token: old is the batch-wide error, which must stay under the old bound (the hole), and
 * the per-token checks against the backend's output and the reference must name token `t` alone. */
static void expect_caught(const char *what, const double *bad, const double *y, const double *ref,
                          const int64_t *tok, int d, int64_t t)
{
    tok_report rep;
    double *s = malloc(sizeof(double) * REFS * (size_t)d);
    const double old = frobenius(bad, y, (size_t)TOKENS * d);
    fprintf(stderr, "  %s: batch Frobenius error %.3g (old bound %g)\n", what, old, OLD_FROB);
    CHECK_MSG(old <= OLD_FROB, "%s: %.3g: the batch-wide bound would have caught it", what, old);
    CHECK_EQ_INT(tok_compare(bad, y, TOKENS, d, RTOL, ATOL, &rep), 1);
    CHECK_EQ_INT(rep.worst, t);
    rows_at(bad, d, tok, REFS, s);
    CHECK_EQ_INT(tok_compare(s, ref, REFS, d, RTOL, ATOL, &rep), 1);
    CHECK_EQ_INT(tok[rep.worst], t);
    free(s);
}

int main(void)
{
    moed_synth_spec spec;
    moed_layer layer;
    moed_error err;
    moed_route route = { 0 }, sub = { 0 };
    CHECK(!moed_synth_parse(SPEC, &spec, &err) && !moed_synth_layer(&spec, 0, &layer, &err));
    const int d = layer.info.d_model, E = layer.info.n_experts;
    const size_t n = (size_t)TOKENS * d;
    float *xf = malloc(sizeof(float) * n), *logits = malloc(sizeof(float) * TOKENS * E);
    uint16_t *x = malloc(2 * n), *y = malloc(2 * n), *xs = malloc(2 * REFS * (size_t)d);
    double *yd = malloc(sizeof(double) * n), *bad = malloc(sizeof(double) * n);
    double *ref = malloc(sizeof(double) * REFS * (size_t)d),
           *ys = malloc(sizeof(double) * REFS * d);
    int64_t tok[REFS];
    for (size_t i = 0; i < n; i++) xf[i] = (float)(2.0 * urand() - 1.0);
    for (int64_t i = 0; i < (int64_t)TOKENS * E; i++) logits[i] = (float)(4.0 * urand() - 2.0);
    moed_from_f32(MOED_BF16, xf, x, n);
    moed_gate_params gp = { MOED_GATE_TOPK, 0, MOED_RENORM_DEFAULT, 0.0f };
    CHECK(!moed_gate_resolve(&gp, &layer.info, &err) &&
          !moed_gate(&gp, &layer.info, NULL, logits, TOKENS, &route, &err));

    moed_backend_config cfg = { .max_tokens = TOKENS };
    moed_backend *cpu = NULL;
    CHECK(!moed_backend_cpu_open(&cfg, &cpu, &err) &&
          !moed_backend_load_layer(cpu, 0, &layer, &err) && !moed_backend_start(cpu, &err));
    moed_job job = { .slot = 0, .dtype = MOED_BF16, .T = TOKENS, .x = x, .y = y, .route = &route };
    CHECK(!moed_backend_forward(cpu, 0, &job, &err));
    tok_to_f64(MOED_BF16, y, yd, n);

    /* The float64 reference on a sample of tokens, one from each stretch of TOKENS / REFS. */
    for (int i = 0; i < REFS; i++) {
        tok[i] = i * (TOKENS / REFS) + (int64_t)(urand() * (TOKENS / REFS));
        memcpy(xs + (size_t)i * d, x + (size_t)tok[i] * d, 2 * (size_t)d);
    }
    moed_route_init(&sub, REFS, (int64_t)REFS * layer.info.top_k);
    for (int i = 0; i < REFS; i++) {
        int64_t a = route.off[tok[i]], b = route.off[tok[i] + 1], p = sub.off[i];
        memcpy(sub.expert + p, route.expert + a, sizeof(int32_t) * (size_t)(b - a));
        memcpy(sub.weight + p, route.weight + a, sizeof(float) * (size_t)(b - a));
        sub.off[i + 1] = p + (b - a);
    }
    tok_ref_forward(&layer, MOED_BF16, xs, &sub, REFS, ref);
    rows_at(yd, d, tok, REFS, ys);
    tok_report rep;
    CHECK_EQ_INT(tok_compare(ys, ref, REFS, d, RTOL, ATOL, &rep), 0);
    fprintf(stderr,
            "  cpu against float64, %d tokens: error/magnitude p50 %.2e p99 %.2e max %.2e\n", REFS,
            rep.rel_p50, rep.rel_p99, rep.rel_max);
    /* Output rounding alone: half a bf16 ulp is at most 2^-8 of the value. */
    CHECK(rep.rel_max <= 1.1 / 256);

    const int64_t t = tok[REFS / 2];
    memcpy(bad, yd, sizeof(double) * n);
    memset(bad + (size_t)t * d, 0, sizeof(double) * (size_t)d);
    expect_caught("token dropped", bad, yd, ref, tok, d, t);
    memcpy(bad, yd, sizeof(double) * n);
    for (int i = 0; i < d; i++) bad[(size_t)t * d + i] *= 1.03;
    expect_caught("token 3% off", bad, yd, ref, tok, d, t);

    moed_backend_destroy(cpu);
    moed_route_free(&route);
    moed_route_free(&sub);
    moed_synth_free_layer(&layer);
    free(xf);
    free(logits);
    free(x);
    free(y);
    free(xs);
    free(yd);
    free(bad);
    free(ref);
    free(ys);
    return check_status("test_tok_ref");
}
