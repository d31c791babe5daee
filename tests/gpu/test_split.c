/*
 * test_split — expert parallelism (moed --expert-parallel) against the unsplit layer, bit for bit.
 * Each case opens the CUDA backend twice on one layer: whole on the first device, and split over
 * two device entries (MOED_SPLIT_DEVICES, default "0,0": two placements on GPU 0, so the dispatch
 * and the combine run through same-device copies; "0,1" on a machine with two GPUs, through peer
 * copies, or with MOED_CUDA_NO_PEER=1 through the landing buffers). It checks that the split
 * layer's placement covers every expert with one contiguous range per entry, and that its output
 * equals the unsplit output to the bit (outputs poisoned first, so an unwritten row fails): for
 * the standard shape classes scaled down, bf16, f16 and FP8 weights, shared experts, every input
 * dtype, each kernel family forced, T = 1 to 4096, routes that leave experts empty, that leave one
 * part without a pair, that give tokens no pair at all, variable k from sigmoid gating, and more
 * pairs than the workspace holds (token chunks). Then the job's data where the data plane puts it
 * (x and y on the home GPU, read and written in place; half in host memory and half on the other
 * GPU) gives the same bits, and so does the merging contract on the split layer: a token alone,
 * and the batch cut in two requests run alone, equal the same rows inside the batch. Exits 77
 * where the CUDA devices it needs do not answer (CI has no GPU). MOED_GPU_TEST_QUICK=1 runs the
 * cases of at most 128 tokens (for compute-sanitizer).
 */
#include "check.h"

#include "cuda_backend.h"
#include "moed_dtype.h"
#include "moed_route.h"
#include "moed_synth.h"

#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum routing {
    R_TOPK,      /* k distinct experts per token, anywhere */
    R_ODD_EMPTY, /* only even experts: the odd ones get no pair */
    R_ONE_PART,  /* only the first half of the experts: the last part gets no pair */
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

static uint64_t rng_state = 0x5eed;

static double urand(void)
{
    rng_state = moed_splitmix64(rng_state);
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

static int devices[2], n_devices;

/* MOED_SPLIT_DEVICES as two ordinals; false when malformed. */
static bool parse_devices(void)
{
    const char *s = getenv("MOED_SPLIT_DEVICES");
    n_devices = sscanf(s ? s : "0,0", "%d,%d", &devices[0], &devices[1]);
    return n_devices == 2 && devices[0] >= 0 && devices[1] >= 0;
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

/* A route of the wanted kind for T tokens (client choices: ids and weights, -1 for padding). */
static int make_route(const moed_layer *l, int kind, int64_t T, moed_route *r)
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
            if (kind == R_ONE_PART) e = (int32_t)(urand() * (E / 2 > 0 ? E / 2 : 1));
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
    int rc = moed_backend_cuda_open(&cfg, &b, &err);
    if (!rc) rc = moed_backend_load_layer(b, 0, l, &err);
    if (!rc) rc = moed_backend_start(b, &err);
    if (rc) {
        fprintf(stderr, "%s: cuda backend (%s): %s\n", sc->name, ep ? "split" : "whole", err.msg);
        moed_backend_destroy(b);
        return NULL;
    }
    return b;
}

/* The split layer's placement: two parts, one per entry, contiguous, covering every expert. */
static void check_place(const scase *sc, moed_backend *b, int E)
{
    moed_layer_place p;
    CHECK(moed_backend_layer_place(b, 0, &p) == 0);
    CHECK_MSG(p.n_parts == 2 && p.part[0].dev == 0 && p.part[1].dev == 1 && p.part[0].first == 0 &&
                  p.part[1].first == p.part[0].count && p.part[0].count + p.part[1].count == E,
              "%s: placement of %d parts (%d+%d experts) is not the two entries' ranges", sc->name,
              p.n_parts, p.part[0].count, p.part[1].count);
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

static void run_case(const scase *sc)
{
    moed_synth_spec spec;
    moed_layer layer;
    moed_route route = { 0 };
    moed_error err;
    if (moed_synth_parse(sc->spec, &spec, &err) || moed_synth_layer(&spec, 0, &layer, &err)) {
        CHECK_MSG(0, "%s: %s", sc->name, err.msg);
        return;
    }
    const int d = layer.info.d_model;
    const size_t row = (size_t)d * moed_dtype_size(sc->xdtype);
    const int64_t T = sc->T;
    void *x = malloc(row * (size_t)T), *yw = malloc(row * (size_t)T), *ys = malloc(row * (size_t)T);
    float *xf = malloc(sizeof(float) * (size_t)d);
    for (int64_t t = 0; t < T; t++) {
        for (int c = 0; c < d; c++) xf[c] = (float)(2.0 * urand() - 1.0);
        moed_from_f32(sc->xdtype, xf, (char *)x + (size_t)t * row, (size_t)d);
    }
    moed_backend *bw = NULL, *bs = NULL;
    if (make_route(&layer, sc->routing, T, &route)) {
        CHECK_MSG(0, "%s: no route", sc->name);
    } else {
        bw = open_cuda(sc, &layer, devices, 1, false);
        bs = open_cuda(sc, &layer, devices, 2, true);
    }
    CHECK_MSG(bw && bs, "%s: backends did not open", sc->name);
    if (bw && bs) {
        check_place(sc, bs, layer.info.n_experts);
        poison(yw, row * (size_t)T);
        poison(ys, row * (size_t)T);
        moed_job jw = { .dtype = sc->xdtype, .T = T, .x = x, .y = yw, .route = &route },
                 js = { .dtype = sc->xdtype, .T = T, .x = x, .y = ys, .route = &route };
        int rc = moed_backend_forward(bw, 0, &jw, &err);
        CHECK_MSG(rc == 0, "%s: whole forward: %s", sc->name, err.msg);
        rc = rc ? rc : moed_backend_forward(bs, 0, &js, &err);
        CHECK_MSG(rc == 0, "%s: split forward: %s", sc->name, err.msg);
        const int64_t bad = rc ? T : rows_differ(ys, yw, T, row);
        CHECK_MSG(bad == 0, "%s: %lld of %lld rows of the split layer differ from the whole one's",
                  sc->name, (long long)bad, (long long)T);
        fprintf(stderr, "  %-42s T=%-5lld pairs=%-7lld %s\n", sc->name, (long long)T,
                (long long)route.off[T], bad ? "DIFFERS" : "bit-identical");
        if (!rc) {
            check_parts(sc, bs, &route, x, ys, row);
            check_alone(sc, bs, &route, x, ys, 0, 1, row);
            check_alone(sc, bs, &route, x, ys, T - 1, T, row);
            if (T > 1) {
                check_alone(sc, bs, &route, x, ys, 0, T / 2, row);
                check_alone(sc, bs, &route, x, ys, T / 2, T, row);
            }
        }
    }
    moed_backend_destroy(bw);
    moed_backend_destroy(bs);
    moed_route_free(&route);
    moed_synth_free_layer(&layer);
    free(x);
    free(yw);
    free(ys);
    free(xf);
}

int main(void)
{
    if (!parse_devices()) {
        fprintf(stderr, "test_split: MOED_SPLIT_DEVICES must be two ordinals, like 0,0 or 0,1\n");
        return 1;
    }
    int n = 0;
    if (!moed_backend_cuda_available() || cudaGetDeviceCount(&n) != cudaSuccess ||
        devices[0] >= n || devices[1] >= n) {
        fprintf(stderr, "test_split: devices %d,%d: no such CUDA devices here (%d): skipped\n",
                devices[0], devices[1], n);
        return CHECK_SKIP;
    }
    fprintf(stderr, "test_split: whole on GPU %d against split over GPUs %d,%d%s\n", devices[0],
            devices[0], devices[1],
            getenv("MOED_CUDA_NO_PEER") && *getenv("MOED_CUDA_NO_PEER") == '1'
                ? " (no peer access: landing buffers)"
                : "");
    const char *quick = getenv("MOED_GPU_TEST_QUICK");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (!(quick && *quick == '1') || cases[i].T <= 128) run_case(&cases[i]);
    return check_status("test_split");
}
