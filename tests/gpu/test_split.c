/*
 * test_split — expert parallelism (moed --expert-parallel): a layer split over two placements,
 * against the same layer whole, the CPU backend and a float64 reference, and against itself. Each
 * case opens the CUDA backend twice on one layer: whole on the first device, and split over two
 * device entries (MOED_SPLIT_DEVICES, default "0,0": two placements on GPU 0, so the dispatch and
 * the combine run through same-device copies; "0,1" on a machine with two GPUs, through peer
 * copies, or with MOED_CUDA_NO_PEER=1 through the landing buffers); and the CPU backend. The cases:
 * the standard shape classes scaled down, bf16, f16 and FP8 weights, shared experts, every input
 * dtype, each kernel family forced, 2:4 sparse routed experts (sparse_cases: the parts hold them
 * compressed; a re-placement copies their metadata with them), T = 1 to 4096, routes that leave
 * experts empty, that leave one
 * part without a pair, that give tokens no pair at all, variable k from sigmoid gating, and more
 * pairs than the workspace holds (token chunks).
 *
 * The rule (docs/cuda.md, "Several GPUs of a host"): each part adds its own pairs of a token in
 * float32, in route order, and sends home one partial row per token it touched; home adds the
 * parts' partial rows in part order (part 0 first), then the shared experts' row, in float32, and
 * rounds once to the output dtype. The whole layer adds the same terms in route order: only the
 * order of the float32 sums differs before the one rounding, so the split is no longer
 * bit-identical to the whole layer, but it is deterministic. Asserted, per case:
 *  - the placement: two parts, one per entry, contiguous, covering every expert (their sizes may
 *    differ: the placement evens out the work, not the count of experts);
 *  - split against whole, token by token (tok_ref.h: a token's largest error <= rtol x its own
 *    largest magnitude + atol), within what the reorder and one rounding allow (SPLIT_RTOL_*);
 *    printed: the worst token's error/magnitude and how many tokens are bit-identical;
 *  - split against the CPU backend on every token, and against the float64 reference (tok_ref.h)
 *    on up to SPLIT_REF_ROWS tokens spread over the batch (every token of a small one), with the
 *    per-token bounds test_cuda_backend holds the whole layer to for its compute type (tok_ref.h's
 *    tok_rtol and TOK_ATOL);
 *  - determinism, bit for bit: the split run twice on one job gives the same bits; the job's data
 *    where the data plane puts it (x and y on the home GPU, read and written in place; half in
 *    host memory and half on the other GPU) gives the same bits as the job inline; and the merging
 *    contract: a token alone, and the batch cut in two requests run alone, equal the same rows
 *    inside the split layer's batch (a token's bits never depend on the tokens beside it).
 * Re-placement (replace_cases, moed_backend_replace_layer): the split layer is re-placed by a load
 * with one hot expert, which gets a copy on the other entry (its pairs then split between the two
 * by the token hash, moed_route.h), and checked as above (accuracy, determinism, merged == alone);
 * re-placed again, with another hot expert, while a second thread keeps calling forward on it:
 * every call succeeds and gives the old placement's bits or the new one's; then by an even load
 * with no copies. A whole layer's re-placement fails with FAILED_PRECONDITION, and one whose
 * predicted gain is below min_gain changes nothing.
 * Outputs are poisoned (NaN) first, so an unwritten row fails. Exits 77 where the CUDA devices it
 * needs do not answer (CI has no GPU). MOED_GPU_TEST_QUICK=1 runs the cases of at most 128 tokens
 * (for compute-sanitizer).
 */
#include "check.h"
#include "tok_gpu.h"
#include "tok_ref.h"

#include "cpu_backend.h"
#include "cuda_backend.h"
#include "moed_dtype.h"
#include "moed_route.h"
#include "moed_synth.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum routing {
    R_TOPK,      /* k distinct experts per token, anywhere */
    R_ODD_EMPTY, /* only even experts: the odd ones get no pair */
    R_ONE_PART,  /* only the first part's experts: the last part gets no pair */
    R_HOLES,     /* some tokens without any pair, the others a varying count */
    R_SIGMOID,   /* sigmoid gating over random logits: k varies per token */
    R_MANY,      /* 3k pairs a token: more than the workspace, so the job runs in chunks */
};

typedef struct scase {
    const char *name;
    const char *spec; /* moed_synth spec (one layer) */
    int64_t T;
    int routing;
    int xdtype;
    const char *kernel; /* MOED_CUDA_KERNEL, or NULL: the table chooses */
} scase;

#define MIX_S  "layers=1,d=512,ff=1792,experts=8,topk=2,act=swiglu,dtype=bf16,seed=3"
#define QWEN_S "layers=1,d=256,ff=96,experts=128,topk=8,act=swiglu,dtype=bf16,seed=4"
#define DSV3_S                                                                                     \
    "layers=1,d=448,ff=256,experts=64,topk=8,act=swiglu,dtype=bf16,seed=5,shared=1,shared_ff=256," \
    "rule=deepseek,groups=8,topk_groups=4,scale=2.5"
#define DSV3_FP8                                                                                   \
    "layers=1,d=448,ff=256,experts=64,topk=8,act=swiglu,dtype=fp8,seed=5,shared=1,shared_ff=256,"  \
    "rule=deepseek,groups=8,topk_groups=4,scale=2.5"

static const scase cases[] = {
    { "mixtral-s T=1", MIX_S, 1, R_TOPK, MOED_BF16, NULL },
    { "mixtral-s T=2", MIX_S, 2, R_TOPK, MOED_BF16, NULL },
    { "mixtral-s T=7", MIX_S, 7, R_TOPK, MOED_BF16, NULL },
    { "mixtral-s T=128", MIX_S, 128, R_TOPK, MOED_BF16, NULL },
    { "mixtral-s T=1000", MIX_S, 1000, R_TOPK, MOED_BF16, NULL },
    { "mixtral-s T=4096", MIX_S, 4096, R_TOPK, MOED_BF16, NULL },
    { "mixtral-s T=1000 sm80", MIX_S, 1000, R_TOPK, MOED_BF16, "sm80" },
    { "mixtral-s T=1000 sm90", MIX_S, 1000, R_TOPK, MOED_BF16, "sm90" },
    { "mixtral-s T=4096 sm90p", MIX_S, 4096, R_TOPK, MOED_BF16, "sm90p" },
    { "mixtral-s T=1000 f32 in/out", MIX_S, 1000, R_TOPK, MOED_F32, NULL },
    { "mixtral-s T=1000 f16 in/out", MIX_S, 1000, R_TOPK, MOED_F16, NULL },
    { "mixtral-s odd experts empty T=128", MIX_S, 128, R_ODD_EMPTY, MOED_BF16, NULL },
    { "mixtral-s one part empty T=1000", MIX_S, 1000, R_ONE_PART, MOED_BF16, NULL },
    { "mixtral-s tokens without pairs T=1000", MIX_S, 1000, R_HOLES, MOED_BF16, NULL },
    { "mixtral-s chunks T=1000", MIX_S, 1000, R_MANY, MOED_BF16, NULL },
    { "qwen3-s T=1", QWEN_S, 1, R_TOPK, MOED_BF16, NULL },
    { "qwen3-s T=1000", QWEN_S, 1000, R_TOPK, MOED_BF16, NULL },
    { "qwen3-s T=4096", QWEN_S, 4096, R_TOPK, MOED_BF16, NULL },
    { "qwen3-s sigmoid T=1000", QWEN_S, 1000, R_SIGMOID, MOED_BF16, NULL },
    { "qwen3-s odd experts empty T=1000", QWEN_S, 1000, R_ODD_EMPTY, MOED_BF16, NULL },
    { "deepseek-s shared T=1", DSV3_S, 1, R_TOPK, MOED_BF16, NULL },
    { "deepseek-s shared T=1000", DSV3_S, 1000, R_TOPK, MOED_BF16, NULL },
    { "deepseek-s shared T=4096", DSV3_S, 4096, R_TOPK, MOED_BF16, NULL },
    { "deepseek-s shared one part empty T=128", DSV3_S, 128, R_ONE_PART, MOED_BF16, NULL },
    { "deepseek-s shared T=1000 sm90p", DSV3_S, 1000, R_TOPK, MOED_BF16, "sm90p" },
    { "fp8 mixtral-s T=1000", "layers=1,d=512,ff=1792,experts=8,topk=2,act=swiglu,dtype=fp8,seed=3",
      1000, R_TOPK, MOED_BF16, NULL },
    { "fp8 deepseek-s shared T=7", DSV3_FP8, 7, R_TOPK, MOED_BF16, NULL },
    { "fp8 deepseek-s shared T=4096", DSV3_FP8, 4096, R_TOPK, MOED_BF16, NULL },
    { "fp8 deepseek-s shared T=1000 sm80", DSV3_FP8, 1000, R_TOPK, MOED_BF16, "sm80" },
    { "gelu f16 weights T=1000", "layers=1,d=320,ff=200,experts=8,topk=2,act=gelu,dtype=f16,seed=7",
      1000, R_TOPK, MOED_F16, NULL },
    { "relu f32 weights T=128", "layers=1,d=200,ff=130,experts=6,topk=2,act=relu,dtype=f32,seed=8",
      128, R_TOPK, MOED_F32, NULL },
    { "odd sizes T=37", "layers=1,d=100,ff=70,experts=5,topk=3,act=swiglu,dtype=bf16,seed=9", 37,
      R_TOPK, MOED_BF16, NULL },
};

/* 2:4 sparse routed experts (tok_make_sparse): the whole layer and the parts on the Sparse Tensor
 * Cores, the CPU on the same pruned weights. */
static const scase sparse_cases[] = {
    { "sparse mixtral-s T=7", MIX_S, 7, R_TOPK, MOED_BF16, NULL },
    { "sparse mixtral-s T=1000", MIX_S, 1000, R_TOPK, MOED_BF16, NULL },
    { "sparse deepseek-s shared T=128", DSV3_S, 128, R_TOPK, MOED_BF16, NULL },
    { "sparse qwen3-s odd experts empty T=1000", QWEN_S, 1000, R_ODD_EMPTY, MOED_BF16, NULL },
};

/* Split against whole, per token: the same terms, added in float32 in another order, then rounded
 * once to the output dtype. Each side's float32 sum is within a few float32 roundoffs of the terms
 * (2^-24 = 6e-8 each) of the other's, far less than a unit in the last place (ulp) of a bf16 or
 * f16 output at the token's scale, so the two rounded outputs are equal or one ulp apart; one ulp
 * of an element is at most 2u of its magnitude (u the unit roundoff: 2^-8 for bf16, 2^-11 for
 * f16), hence at most 2u of the token's largest magnitude. An f32 output is the float32 sum itself,
 * rounded no further: the reorder shows directly, a few float32 roundoffs of the terms, which may
 * cancel to less than the token's largest output; 1e-5 leaves room for that. atol covers rows
 * that are (nearly) zero. */
#define SPLIT_RTOL_BF16 0x1p-7  /* 2u of bf16 */
#define SPLIT_RTOL_F16  0x1p-10 /* 2u of f16 */
#define SPLIT_RTOL_F32  1e-5
#define SPLIT_ATOL      1e-6

/* Tokens of a case checked against the float64 reference, which costs 3 d_model d_ff per pair. */
#define SPLIT_REF_ROWS 64

static double split_rtol(int dtype)
{
    return dtype == MOED_F32   ? SPLIT_RTOL_F32
           : dtype == MOED_F16 ? SPLIT_RTOL_F16
                               : SPLIT_RTOL_BF16;
}

static uint64_t rng_state = 0x5eed;

static double urand(void)
{
    rng_state = moed_splitmix64(rng_state);
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

#define MAX_ENTRIES 16
static int devices[MAX_ENTRIES], n_devices;

/* MOED_SPLIT_DEVICES as two to MAX_ENTRIES ordinals; false when malformed. */
static bool parse_devices(void)
{
    const char *s = getenv("MOED_SPLIT_DEVICES");
    s = s ? s : "0,0";
    n_devices = 0;
    for (;;) {
        char *end;
        const long v = strtol(s, &end, 10);
        if (end == s || v < 0 || v > 1023 || n_devices == MAX_ENTRIES) return false;
        devices[n_devices++] = (int)v;
        if (!*end) break;
        if (*end != ',') return false;
        s = end + 1;
    }
    return n_devices >= 2;
}

/* Sigmoid gating over random logits (k varies per token). */
static int gated_route(const moed_layer *l, int64_t T, moed_route *r)
{
    const int E = l->info.n_experts;
    float *logits = malloc(sizeof(float) * (size_t)(T * E));
    for (int64_t i = 0; i < T * E; i++) logits[i] = (float)(4.0 * urand() - 2.0);
    moed_gate_params p = { MOED_GATE_SIGMOID, 0, MOED_RENORM_DEFAULT, 0.7f };
    moed_error err;
    int rc = moed_gate_resolve(&p, &l->info, &err);
    if (!rc) rc = moed_gate(&p, &l->info, l->router_bias, logits, T, r, &err);
    free(logits);
    return rc;
}

/* A route of the wanted kind for T tokens (client choices: ids and weights, -1 for padding);
 * first_part: how many experts the split's first part holds (R_ONE_PART routes to those alone). */
static int make_route(const moed_layer *l, int kind, int64_t T, int first_part, moed_route *r)
{
    if (kind == R_SIGMOID) return gated_route(l, T, r);
    const int E = l->info.n_experts, k = kind == R_MANY ? 3 * l->info.top_k : l->info.top_k;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(T * k));
    float *w = malloc(sizeof(float) * (size_t)(T * k));
    for (int64_t t = 0; t < T; t++) {
        const bool hole = kind == R_HOLES && urand() < 0.3;
        for (int j = 0; j < k; j++) {
            int32_t e = (int32_t)(urand() * E);
            if (kind == R_ODD_EMPTY) e = (int32_t)(urand() * ((E + 1) / 2)) * 2;
            if (kind == R_ONE_PART) e = (int32_t)(urand() * first_part);
            const bool pad = hole || (kind == R_HOLES && j > 0 && urand() < 0.4);
            ids[t * k + j] = pad ? -1 : e;
            w[t * k + j] = pad ? 0.0f : (float)(0.05 + urand());
        }
    }
    moed_error err;
    const int rc = moed_route_from_choice(r, ids, w, T, k, E, &err);
    free(ids);
    free(w);
    return rc;
}

/* Backend b, opened with rc, with the layer loaded and started; NULL (b destroyed) on failure. */
static moed_backend *start(const scase *sc, const char *what, int rc, moed_backend *b,
                           const moed_layer *l, moed_error *err)
{
    if (!rc) rc = moed_backend_load_layer(b, 0, l, err);
    if (!rc) rc = moed_backend_start(b, err);
    if (rc) {
        fprintf(stderr, "%s: %s backend: %s\n", sc->name, what, err->msg);
        moed_backend_destroy(b);
        return NULL;
    }
    return b;
}

/* The CUDA backend with the layer, on the given device entries (split over them when ep). */
static moed_backend *open_cuda(const scase *sc, const moed_layer *l, const int *dev, int n, bool ep)
{
    moed_backend_config cfg = {
        .streams = 1, .devices = dev, .n_devices = n, .max_tokens = sc->T, .expert_parallel = ep
    };
    moed_backend *b = NULL;
    moed_error err;
    if (sc->kernel)
        setenv("MOED_CUDA_KERNEL", sc->kernel, 1);
    else
        unsetenv("MOED_CUDA_KERNEL");
    const int rc = moed_backend_cuda_open(&cfg, &b, &err);
    return start(sc, ep ? "cuda (split)" : "cuda (whole)", rc, b, l, &err);
}

/* The CPU backend (the reference) with the layer. */
static moed_backend *open_cpu(const scase *sc, const moed_layer *l)
{
    moed_backend_config cfg = { .streams = 1, .max_tokens = sc->T };
    moed_backend *b = NULL;
    moed_error err;
    const int rc = moed_backend_cpu_open(&cfg, &b, &err);
    return start(sc, "cpu", rc, b, l, &err);
}

/* The split layer's placement: contiguous ranges in entry order covering every expert, on
 * entries that exist, each on its own entry (an entry may hold none of a small layer); they need
 * not hold as many experts each (the placement evens out work). False when it is not. */
static bool check_place(const scase *sc, moed_backend *b, int E, moed_layer_place *p)
{
    memset(p, 0, sizeof *p);
    const int rc = moed_backend_layer_place(b, 0, p);
    CHECK_MSG(rc == 0, "%s: no placement (%d)", sc->name, rc);
    bool ok = rc == 0 && p->n_parts >= 2 && p->n_parts <= n_devices;
    int next = 0;
    for (int i = 0; ok && i < p->n_parts; i++) {
        ok = p->part[i].first == next && p->part[i].count >= 0 &&
             (i ? p->part[i].dev > p->part[i - 1].dev : p->part[i].dev >= 0) &&
             p->part[i].dev < n_devices;
        next += p->part[i].count;
    }
    ok = ok && next == E;
    CHECK_MSG(ok,
              "%s: placement of %d parts (the first %d experts from %d) is not contiguous ranges "
              "over the %d entries covering %d experts",
              sc->name, p->n_parts, p->part[0].count, p->part[0].first, n_devices, E);
    return ok;
}

/* The parts' expert counts as "a+b+...", for the log. */
static const char *place_counts(const moed_layer_place *p, char *buf, size_t n)
{
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < p->n_parts && at < n; i++)
        at += (size_t)snprintf(buf + at, n - at, "%s%d", i ? "+" : "", p->part[i].count);
    return buf;
}

/* Tokens of y [T, d] doubles with an element that is not finite (NaN: unwritten). */
static int64_t rows_not_finite(const double *y, int64_t T, int d)
{
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++) {
        bool bad = false;
        for (int i = 0; i < d; i++) bad |= !isfinite(y[(size_t)t * d + i]);
        n += bad;
    }
    return n;
}

/* The split's rows g against a reference ref (both [n, d] doubles), token by token: what rtol and
 * atol allow, or the test fails naming the worst token (tok: the batch's token of each row, NULL
 * where row i is token i). */
static tok_report check_tokens(const scase *sc, const char *against, const double *g,
                               const double *ref, int64_t n, int d, double rtol, double atol,
                               const int64_t *tok)
{
    tok_report rep;
    tok_compare(g, ref, n, d, rtol, atol, &rep);
    CHECK_MSG(rep.bad == 0,
              "%s: %lld of %lld tokens of the split layer over the bound against %s; the worst, "
              "token %lld, at %.3g of its bound (%g x its magnitude + %g; inf: NaN, Inf or "
              "unwritten)",
              sc->name, (long long)rep.bad, (long long)n, against,
              (long long)(tok && rep.worst >= 0 ? tok[rep.worst] : rep.worst), rep.worst_use, rtol,
              atol);
    return rep;
}

static void poison(void *y, size_t bytes)
{
    memset(y, 0xff, bytes); /* NaN in every float type */
}

/* Rows of y that differ from ref, over T rows of row_bytes. */
static int64_t rows_differ(const void *y, const void *ref, int64_t T, size_t row_bytes)
{
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++)
        n += memcmp((const char *)y + t * row_bytes, (const char *)ref + t * row_bytes,
                    row_bytes) != 0;
    return n;
}

/* Tokens [a, b) of the job run alone on b_split must give the batch's rows ys, bit for bit. */
static void check_alone(const scase *sc, moed_backend *bs, const moed_route *route, const void *x,
                        const void *ys, int64_t a, int64_t b, size_t row)
{
    moed_route part = { 0 };
    moed_route_init(&part, b - a, route->off[b] - route->off[a] + 1);
    for (int64_t t = a; t < b; t++) {
        const int64_t p0 = route->off[t] - route->off[a];
        for (int64_t j = route->off[t]; j < route->off[t + 1]; j++) {
            part.expert[p0 + j - route->off[t]] = route->expert[j];
            part.weight[p0 + j - route->off[t]] = route->weight[j];
        }
        part.off[t - a + 1] = route->off[t + 1] - route->off[a];
    }
    void *y = malloc(row * (size_t)(b - a));
    poison(y, row * (size_t)(b - a));
    moed_job job = { .dtype = sc->xdtype,
                     .T = b - a,
                     .x = (const char *)x + row * (size_t)a,
                     .y = y,
                     .route = &part };
    moed_error err;
    const int rc = moed_backend_forward(bs, 0, &job, &err);
    CHECK_MSG(rc == 0, "%s: split forward of tokens %lld..%lld: %s", sc->name, (long long)a,
              (long long)b - 1, err.msg);
    const int64_t bad = rc ? b - a : rows_differ(y, (const char *)ys + row * (size_t)a, b - a, row);
    CHECK_MSG(bad == 0, "%s: tokens %lld..%lld alone: %lld rows differ from the same in the batch",
              sc->name, (long long)a, (long long)b - 1, (long long)bad);
    moed_route_free(&part);
    free(y);
}

/* The split layer on the job's data where the data plane puts it (moed_part): all of x and y in
 * device memory of the home GPU (a lone part, read and written in place when the batch is big
 * enough), then the first half of the tokens in host memory and the second on the other entry's
 * GPU (a peer copy each way when it is another GPU): the same bits as the job inline. */
static void check_parts(const scase *sc, moed_backend *bs, const moed_route *route, const void *x,
                        const void *ys, size_t row)
{
    const int64_t T = route->T, h = T / 2;
    const size_t bytes = row * (size_t)T;
    void *dx = NULL, *dy = NULL, *ex = NULL, *ey = NULL, *y = malloc(bytes);
    cudaSetDevice(devices[0]);
    cudaMalloc(&dx, bytes);
    cudaMalloc(&dy, bytes);
    cudaMemcpy(dx, x, bytes, cudaMemcpyHostToDevice);
    cudaSetDevice(devices[1]);
    cudaMalloc(&ex, bytes);
    cudaMalloc(&ey, bytes);
    cudaMemcpy(ex, x, bytes, cudaMemcpyHostToDevice);
    moed_error err;
    const moed_part lone = { T, dx, devices[0], dy, devices[0], NULL };
    moed_job job = { .dtype = sc->xdtype, .T = T, .parts = &lone, .n_parts = 1, .route = route };
    int rc = moed_backend_forward(bs, 0, &job, &err);
    cudaSetDevice(devices[0]);
    poison(y, bytes);
    if (!rc) cudaMemcpy(y, dy, bytes, cudaMemcpyDeviceToHost);
    CHECK_MSG(rc == 0 && !rows_differ(y, ys, T, row), "%s: x and y on GPU %d (a lone part): %s",
              sc->name, devices[0], rc ? err.msg : "rows differ from the job inline");
    if (h > 0) {
        poison(y, bytes);
        const moed_part two[2] = { { h, x, MOED_HOST_MEM, y, MOED_HOST_MEM, NULL },
                                   { T - h, (const char *)ex + row * (size_t)h, devices[1],
                                     (char *)ey + row * (size_t)h, devices[1], NULL } };
        job.parts = two;
        job.n_parts = 2;
        rc = moed_backend_forward(bs, 0, &job, &err);
        cudaSetDevice(devices[1]);
        if (!rc)
            cudaMemcpy((char *)y + row * (size_t)h, (char *)ey + row * (size_t)h,
                       row * (size_t)(T - h), cudaMemcpyDeviceToHost);
        CHECK_MSG(rc == 0 && !rows_differ(y, ys, T, row),
                  "%s: half in host memory, half on GPU %d: %s", sc->name, devices[1],
                  rc ? err.msg : "rows differ from the job inline");
    }
    cudaSetDevice(devices[0]);
    cudaFree(dx);
    cudaFree(dy);
    cudaSetDevice(devices[1]);
    cudaFree(ex);
    cudaFree(ey);
    free(y);
}

/* The split layer's output ys against the whole layer's yw, the CPU backend's yc (every token) and
 * the float64 reference (up to SPLIT_REF_ROWS tokens spread over the batch), token by token; prints
 * the case's line. */
static void check_accuracy(const scase *sc, const moed_layer *l, const moed_route *route,
                           const moed_layer_place *place, const void *x, const void *ys,
                           const void *yw, const void *yc)
{
    const int d = l->info.d_model, dt = sc->xdtype;
    const int64_t T = route->T;
    const size_t n = (size_t)T * d, row = (size_t)d * moed_dtype_size(dt);
    double *g = malloc(sizeof(double) * n), *w = malloc(sizeof(double) * n),
           *c = malloc(sizeof(double) * n);
    tok_to_f64(dt, ys, g, n);
    tok_to_f64(dt, yw, w, n);
    tok_to_f64(dt, yc, c, n);
    /* A reference with a NaN (an unwritten row) would let any row pass against it. */
    const int64_t nw = rows_not_finite(w, T, d), nc = rows_not_finite(c, T, d);
    CHECK_MSG(nw == 0, "%s: %lld of %lld rows of the whole layer are not finite", sc->name,
              (long long)nw, (long long)T);
    CHECK_MSG(nc == 0, "%s: %lld of %lld rows of the cpu backend are not finite", sc->name,
              (long long)nc, (long long)T);

    /* Against the whole layer: the reorder of the float32 sums, then one rounding. */
    const double rtol_w = split_rtol(dt);
    const tok_report vw = check_tokens(sc, "the whole layer", g, w, T, d, rtol_w, SPLIT_ATOL, NULL);
    const int64_t same = T - rows_differ(ys, yw, T, row);

    /* Against the CPU and float64: the bounds of the layer's compute type. FP8 on the Tensor Cores
     * where either GPU of the split takes them (the looser bound). */
    bool native = false;
    for (int i = 0; l->info.wdtype == MOED_FP8 && i < n_devices; i++)
        native |= tok_fp8_native(sc->kernel, devices[i]) != 0;
    const int cls = tok_compute_class(l->info.wdtype, native);
    const tok_report vc =
        check_tokens(sc, "the cpu backend", g, c, T, d, tok_rtol[cls], TOK_ATOL, NULL);

    const int64_t n64 = T < SPLIT_REF_ROWS ? T : SPLIT_REF_ROWS;
    int64_t *tok = malloc(sizeof(int64_t) * (size_t)n64);
    for (int64_t i = 0; i < n64; i++) tok[i] = i * T / n64; /* every token when n64 == T */
    void *xs = malloc(row * (size_t)n64);
    double *gs = malloc(sizeof(double) * (size_t)n64 * d),
           *f = malloc(sizeof(double) * (size_t)n64 * d);
    moed_route r64 = { 0 };
    tok_sub_route(route, tok, n64, &r64);
    tok_gather_rows(x, row, tok, n64, xs);
    tok_gather_rows(g, sizeof(double) * (size_t)d, tok, n64, gs);
    tok_ref_forward(l, dt, xs, &r64, n64, f);
    const tok_report vf =
        check_tokens(sc, "the float64 reference", gs, f, n64, d, tok_rtol[cls], TOK_ATOL, tok);

    char counts[128];
    fprintf(stderr,
            "  %-42s T=%-5lld pairs=%-7lld experts %s; vs whole: worst error/magnitude %.1e "
            "(rtol %.1e), %lld of %lld tokens bit-identical; vs cpu max %.1e, vs f64 max %.1e "
            "(%s, rtol %g)\n",
            sc->name, (long long)T, (long long)route->off[T],
            place_counts(place, counts, sizeof counts), vw.rel_max, rtol_w, (long long)same,
            (long long)T, vc.rel_max, vf.rel_max, tok_compute_name[cls], tok_rtol[cls]);
    moed_route_free(&r64);
    free(g);
    free(w);
    free(c);
    free(tok);
    free(xs);
    free(gs);
    free(f);
}

/* The split layer bs on the route against the whole layer bw and the CPU backend bc (accuracy,
 * token by token), and against itself: the same job again, the job's data where the data plane
 * puts it, a token alone and the batch in halves, the same bits. The split's output into ys. */
static void verify(const scase *sc, const moed_layer *l, const moed_route *route,
                   const moed_layer_place *place, const void *x, moed_backend *bw, moed_backend *bs,
                   moed_backend *bc, void *ys)
{
    const int64_t T = route->T;
    const size_t row = (size_t)l->info.d_model * moed_dtype_size(sc->xdtype),
                 bytes = row * (size_t)T;
    void *yw = malloc(bytes), *ys2 = malloc(bytes), *yc = malloc(bytes);
    moed_error err;
    poison(yw, bytes);
    poison(ys, bytes);
    poison(ys2, bytes);
    poison(yc, bytes);
    moed_job jw = { .dtype = sc->xdtype, .T = T, .x = x, .y = yw, .route = route },
             js = { .dtype = sc->xdtype, .T = T, .x = x, .y = ys, .route = route },
             j2 = { .dtype = sc->xdtype, .T = T, .x = x, .y = ys2, .route = route },
             jc = { .dtype = sc->xdtype, .T = T, .x = x, .y = yc, .route = route };
    const int rw = moed_backend_forward(bw, 0, &jw, &err);
    CHECK_MSG(rw == 0, "%s: whole forward: %s", sc->name, err.msg);
    const int rs = moed_backend_forward(bs, 0, &js, &err);
    CHECK_MSG(rs == 0, "%s: split forward: %s", sc->name, err.msg);
    const int rc = moed_backend_forward(bc, 0, &jc, &err);
    CHECK_MSG(rc == 0, "%s: cpu forward: %s", sc->name, err.msg);
    if (!rw && !rs && !rc) check_accuracy(sc, l, route, place, x, ys, yw, yc);
    if (!rs) {
        /* Determinism: the same job again, then the same tokens elsewhere and alone. */
        const int r2 = moed_backend_forward(bs, 0, &j2, &err);
        const int64_t again = r2 ? T : rows_differ(ys2, ys, T, row);
        CHECK_MSG(again == 0, "%s: the split run again: %s (%lld of %lld rows differ)", sc->name,
                  r2 ? err.msg : "not the same bits", (long long)again, (long long)T);
        check_parts(sc, bs, route, x, ys, row);
        check_alone(sc, bs, route, x, ys, 0, 1, row);
        check_alone(sc, bs, route, x, ys, T - 1, T, row);
        if (T > 1) {
            check_alone(sc, bs, route, x, ys, 0, T / 2, row);
            check_alone(sc, bs, route, x, ys, T / 2, T, row);
        }
    }
    free(yw);
    free(ys2);
    free(yc);
}

/* The case's layer (its routed experts pruned 2:4 with `sparse`), its input x (T rows of random
 * values) and the three backends: whole, split and the CPU. False (and the test failed) where any
 * is missing. */
static bool setup(const scase *sc, bool sparse, moed_layer *layer, void **x, moed_backend **bw,
                  moed_backend **bs, moed_backend **bc)
{
    moed_synth_spec spec;
    moed_error err;
    *x = NULL;
    *bw = *bs = *bc = NULL;
    memset(layer, 0, sizeof *layer); /* teardown frees it whatever happens */
    if (moed_synth_parse(sc->spec, &spec, &err) || moed_synth_layer(&spec, 0, layer, &err)) {
        CHECK_MSG(0, "%s: %s", sc->name, err.msg);
        return false;
    }
    if (sparse && tok_make_sparse(layer)) {
        CHECK_MSG(0, "%s: pruning 2:4 failed", sc->name);
        return false;
    }
    const int d = layer->info.d_model;
    const size_t row = (size_t)d * moed_dtype_size(sc->xdtype);
    float *xf = malloc(sizeof(float) * (size_t)d);
    *x = malloc(row * (size_t)sc->T);
    for (int64_t t = 0; t < sc->T; t++) {
        for (int c = 0; c < d; c++) xf[c] = (float)(2.0 * urand() - 1.0);
        moed_from_f32(sc->xdtype, xf, (char *)*x + (size_t)t * row, (size_t)d);
    }
    free(xf);
    *bw = open_cuda(sc, layer, devices, 1, false);
    *bs = open_cuda(sc, layer, devices, n_devices, true);
    *bc = open_cpu(sc, layer);
    CHECK_MSG(*bw && *bs && *bc, "%s: backends did not open", sc->name);
    return *bw && *bs && *bc;
}

static void teardown(moed_layer *layer, void *x, moed_backend *bw, moed_backend *bs,
                     moed_backend *bc)
{
    moed_backend_destroy(bw);
    moed_backend_destroy(bs);
    moed_backend_destroy(bc);
    moed_synth_free_layer(layer);
    free(x);
}

static void run_case(const scase *sc, bool sparse)
{
    moed_layer layer;
    moed_route route = { 0 };
    moed_backend *bw, *bs, *bc;
    void *x;
    if (setup(sc, sparse, &layer, &x, &bw, &bs, &bc)) {
        const int E = layer.info.n_experts;
        moed_layer_place place;
        const bool placed = check_place(sc, bs, E, &place);
        /* R_ONE_PART routes to the first part's experts (to the first half where the placement
         * is wrong, which has failed already). */
        int first = E / 2 > 0 ? E / 2 : 1;
        if (placed && place.part[0].count > 0) first = place.part[0].count;
        const bool routed = !make_route(&layer, sc->routing, sc->T, first, &route);
        CHECK_MSG(routed, "%s: no route", sc->name);
        void *ys = malloc((size_t)layer.info.d_model * moed_dtype_size(sc->xdtype) * (size_t)sc->T);
        if (routed) verify(sc, &layer, &route, &place, x, bw, bs, bc, ys);
        free(ys);
    }
    moed_route_free(&route);
    teardown(&layer, x, bw, bs, bc);
}

/* ---- re-placement (moed_backend_replace_layer) --------------------------------------------- */

/* Cases re-placed: the split layer is re-placed by a skewed load (one expert with most pairs),
 * which copies that expert onto the other entry, and checked as any split; re-placed again while
 * another thread calls forward; then by an even load with no copies. */
static const scase replace_cases[] = {
    { "replace mixtral-s T=128", MIX_S, 128, R_TOPK, MOED_BF16, NULL },
    { "replace mixtral-s T=1000", MIX_S, 1000, R_TOPK, MOED_BF16, NULL },
    { "replace deepseek-s shared T=1000", DSV3_S, 1000, R_TOPK, MOED_BF16, NULL },
    { "replace fp8 deepseek-s shared T=128", DSV3_FP8, 128, R_TOPK, MOED_BF16, NULL },
    { "replace qwen3-s sigmoid T=1000", QWEN_S, 1000, R_SIGMOID, MOED_BF16, NULL },
};
/* A 2:4 sparse layer re-placed: its parts' compressed weights and metadata copied with them. */
static const scase replace_sparse = {
    "replace sparse deepseek-s shared T=128", DSV3_S, 128, R_TOPK, MOED_BF16, NULL
};

/* A placement after a re-placement: contiguous ranges covering every expert on the entries,
 * and copies each of an expert on the entry that does not hold its range, by expert then entry. */
static void check_replicas(const scase *sc, const moed_layer_place *p, int E)
{
    int next = 0;
    for (int i = 0; i < p->n_parts; i++) {
        CHECK_MSG(p->part[i].first == next && p->part[i].dev >= 0 && p->part[i].dev < n_devices,
                  "%s: part %d (entry %d, %d experts from %d) does not follow on", sc->name, i,
                  p->part[i].dev, p->part[i].count, p->part[i].first);
        next += p->part[i].count;
    }
    CHECK_MSG(next == E, "%s: the ranges cover %d of %d experts", sc->name, next, E);
    for (int r = 0; r < p->n_replicas; r++) {
        const moed_place_replica *c = &p->replica[r];
        bool own = false;
        for (int i = 0; i < p->n_parts; i++)
            own |= p->part[i].dev == c->dev && c->expert >= p->part[i].first &&
                   c->expert < p->part[i].first + p->part[i].count;
        CHECK_MSG(c->expert >= 0 && c->expert < E && c->dev >= 0 && c->dev < n_devices && !own,
                  "%s: copy %d of expert %d on entry %d", sc->name, r, c->expert, c->dev);
        CHECK(r == 0 || p->replica[r - 1].expert < c->expert ||
              (p->replica[r - 1].expert == c->expert && p->replica[r - 1].dev < c->dev));
    }
}

/* Re-places bs's layer by a load where expert `hot` has most pairs (hot < 0: all the same), with
 * up to max_rep copies and no least gain; it must change, lower the predicted peak and leave a
 * valid placement (into p), with copies where there is a hot expert and copies are allowed. */
static bool replace_to(const scase *sc, moed_backend *bs, int E, int hot, int max_rep,
                       moed_layer_place *p)
{
    double *pairs = malloc(sizeof(double) * (size_t)E);
    for (int e = 0; e < E; e++) pairs[e] = hot < 0 ? 1000 : e == hot ? 1e6 : 10;
    const moed_replace_req req = { pairs, 64, max_rep, 0 };
    moed_replace_result res;
    moed_error err;
    int rc = moed_backend_replace_layer(bs, 0, &req, &res, &err);
    free(pairs);
    CHECK_MSG(rc == 0, "%s: re-placing by hot expert %d: %s", sc->name, hot, err.msg);
    CHECK_MSG(rc || (res.changed && res.after < res.before),
              "%s: re-placing by hot expert %d: changed %d, predicted peak %g -> %g", sc->name, hot,
              res.changed, res.before, res.after);
    memset(p, 0, sizeof *p);
    if (!rc) rc = moed_backend_layer_place(bs, 0, p);
    if (!rc) check_replicas(sc, p, E);
    CHECK_MSG(rc || hot < 0 || !max_rep || p->n_replicas > 0,
              "%s: hot expert %d got no copy (%d parts)", sc->name, hot, p->n_parts);
    CHECK_MSG(rc || max_rep || p->n_replicas == 0, "%s: %d copies where none were allowed",
              sc->name, p->n_replicas);
    char counts[128];
    fprintf(stderr, "  %s: re-placed (hot expert %d): %s experts, %d copies, peak %.3g -> %.3g\n",
            sc->name, hot, place_counts(p, counts, sizeof counts), p->n_replicas, res.before,
            res.after);
    return rc == 0;
}

/* A thread calling forward on the split layer over and over while the main thread re-places it:
 * every call must succeed, and give either the old placement's bits or, once swapped, the new
 * one's (the first such output is kept to be checked against the new placement after; the two may
 * be the same bits where every token's terms group alike, e.g. two pairs and no shared expert). */
typedef struct hammer {
    moed_backend *b;
    moed_job job;
    size_t bytes;
    const void *y_old;
    void *y_new;
    atomic_int stop, calls;
    int failed, old, fresh, other;
    bool last_old; /* the last call gave the old placement's bits */
} hammer;

static void *hammer_run(void *arg)
{
    hammer *h = arg;
    void *y = malloc(h->bytes);
    moed_job job = h->job;
    job.y = y;
    while (!atomic_load(&h->stop)) {
        moed_error err;
        poison(y, h->bytes);
        if (moed_backend_forward(h->b, 0, &job, &err)) {
            h->failed++;
            fprintf(stderr, "  forward during a re-placement failed: %s\n", err.msg);
        } else if ((h->last_old = !memcmp(y, h->y_old, h->bytes))) {
            h->old++;
        } else if (!h->fresh) {
            memcpy(h->y_new, y, h->bytes);
            h->fresh++;
        } else {
            *(memcmp(y, h->y_new, h->bytes) ? &h->other : &h->fresh) += 1;
        }
        atomic_fetch_add(&h->calls, 1);
    }
    free(y);
    return NULL;
}

static void wait_calls(hammer *h, int n)
{
    while (atomic_load(&h->calls) < n) {
        struct timespec ms = { 0, 1000000 };
        nanosleep(&ms, NULL);
    }
}

static void run_replace_case(const scase *sc, bool sparse)
{
    moed_layer layer;
    moed_route route = { 0 };
    moed_backend *bw, *bs, *bc;
    void *x;
    if (!setup(sc, sparse, &layer, &x, &bw, &bs, &bc)) {
        teardown(&layer, x, bw, bs, bc);
        return;
    }
    const int E = layer.info.n_experts;
    const size_t bytes = (size_t)layer.info.d_model * moed_dtype_size(sc->xdtype) * (size_t)sc->T;
    moed_layer_place place;
    moed_error err;
    double *pairs = malloc(sizeof(double) * (size_t)E);
    for (int e = 0; e < E; e++) pairs[e] = e == 0 ? 1e6 : 10;
    /* a whole layer cannot be re-placed; a gain below min_gain changes nothing */
    moed_replace_req req = { pairs, 64, 4, 0.999 };
    moed_replace_result res;
    CHECK_MSG(moed_backend_replace_layer(bw, 0, &req, &res, &err) == MOED_EPRECOND,
              "%s: re-placing a whole layer did not fail with FAILED_PRECONDITION", sc->name);
    const int rc = moed_backend_replace_layer(bs, 0, &req, &res, &err);
    CHECK_MSG(rc == 0 && !res.changed && res.before > 0 && res.after > 0,
              "%s: re-placing for a gain of 99.9%%: rc %d (%s), changed %d, peak %g -> %g",
              sc->name, rc, rc ? err.msg : "", res.changed, res.before, res.after);
    free(pairs);
    void *ys = malloc(bytes);
    const bool routed = !make_route(&layer, sc->routing, sc->T, E / 2, &route);
    CHECK_MSG(routed, "%s: no route", sc->name);
    if (routed && replace_to(sc, bs, E, 0, 4, &place)) {
        verify(sc, &layer, &route, &place, x, bw, bs, bc, ys);
        void *y_old = malloc(bytes);
        memcpy(y_old, ys, bytes);
        hammer h = { .b = bs,
                     .job = { .dtype = sc->xdtype, .T = sc->T, .x = x, .route = &route },
                     .bytes = bytes,
                     .y_old = y_old,
                     .y_new = malloc(bytes) };
        pthread_t th;
        pthread_create(&th, NULL, hammer_run, &h);
        wait_calls(&h, 2);
        const bool moved = replace_to(sc, bs, E, E - 1, 4, &place);
        wait_calls(&h, atomic_load(&h.calls) + 3);
        atomic_store(&h.stop, 1);
        pthread_join(th, NULL);
        CHECK_MSG(h.failed == 0 && h.other == 0 && h.old > 0,
                  "%s: forward beside a re-placement: %d calls failed, %d gave bits of neither "
                  "placement, %d the old one's, %d the new one's",
                  sc->name, h.failed, h.other, h.old, h.fresh);
        if (moved) {
            verify(sc, &layer, &route, &place, x, bw, bs, bc, ys);
            const bool differ = memcmp(ys, y_old, bytes) != 0;
            CHECK_MSG(!h.fresh || !memcmp(ys, h.y_new, bytes),
                      "%s: calls after the swap differ from the new placement's bits", sc->name);
            CHECK_MSG(!differ || !h.last_old,
                      "%s: the last call beside the re-placement still ran on the old placement",
                      sc->name);
            fprintf(stderr,
                    "  %s: beside the re-placement %d calls on the old placement, %d on "
                    "the new%s\n",
                    sc->name, h.old, h.fresh, differ ? "" : " (the two give the same bits here)");
        }
        free(h.y_new);
        free(y_old);
        if (replace_to(sc, bs, E, -1, 0, &place))
            verify(sc, &layer, &route, &place, x, bw, bs, bc, ys);
    }
    free(ys);
    moed_route_free(&route);
    teardown(&layer, x, bw, bs, bc);
}

int main(void)
{
    if (!parse_devices()) {
        fprintf(stderr,
                "test_split: MOED_SPLIT_DEVICES must be 2 to %d ordinals, like 0,0 or "
                "0,1,2,3\n",
                MAX_ENTRIES);
        return 1;
    }
    char list[MAX_ENTRIES * 6] = "";
    int n = 0, missing = 0;
    for (int i = 0, at = 0; i < n_devices; i++)
        at += snprintf(list + at, sizeof list - (size_t)at, "%s%d", i ? "," : "", devices[i]);
    const bool cuda = moed_backend_cuda_available() && cudaGetDeviceCount(&n) == cudaSuccess;
    for (int i = 0; i < n_devices; i++) missing |= devices[i] >= n;
    if (!cuda || missing) {
        fprintf(stderr, "test_split: devices %s: no such CUDA devices here (%d): skipped\n", list,
                n);
        return CHECK_SKIP;
    }
    fprintf(stderr, "test_split: whole on GPU %d against split over GPUs %s%s\n", devices[0], list,
            getenv("MOED_CUDA_NO_PEER") && *getenv("MOED_CUDA_NO_PEER") == '1'
                ? " (no peer access: landing buffers)"
                : "");
    const bool quick = getenv("MOED_GPU_TEST_QUICK") && *getenv("MOED_GPU_TEST_QUICK") == '1';
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (!quick || cases[i].T <= 128) run_case(&cases[i], false);
    for (size_t i = 0; i < sizeof sparse_cases / sizeof sparse_cases[0]; i++)
        if (!quick || sparse_cases[i].T <= 128) run_case(&sparse_cases[i], true);
    for (size_t i = 0; i < sizeof replace_cases / sizeof replace_cases[0]; i++)
        if (!quick || replace_cases[i].T <= 128) run_replace_case(&replace_cases[i], false);
    run_replace_case(&replace_sparse, true);
    return check_status("test_split");
}
