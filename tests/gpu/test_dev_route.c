/*
 * test_dev_route — routing a client keeps in GPU memory (moed_part_route), read and checked where
 * it lies. Over a table of cases, a launch whose parts bring their expert choice in device memory
 * (some), in the job's host route (others) or a choice that breaks a rule (some, each rule) gives,
 * for every part not refused, the same bits as the same launch without the refused parts and with
 * every choice routed on the host (moed_route_from_choice); each device-routed part's status is 0,
 * or MOED_EINVAL with exactly the message the host check words for the same choice
 * (moed_choice_check: the same first position and rule, found in whatever chunk it lies). Outputs
 * are poisoned first, so an unwritten row fails.
 *
 * Cases: bf16, f16 and FP8 weights (FP8 on the FP8 Tensor Cores where the GPU has them and on the
 * portable path), f32, f16 and bf16 hidden, shared experts, k = 1 to 300 (a token with more pairs
 * than the combine stages), padding, repeated ids, a part all padding (a launch with no row to
 * compute), small batches that replay a captured graph (each run twice, the second time with other
 * choices in the same buffers: the graph replayed over new routing), batches over the workspace's
 * pairs (chunks, a refusal only in a later chunk), route prep's three-launch path, 4096 experts
 * (the null id is then 4096, and id 4096 itself must be refused), a lone device part read and
 * written in place, a layer split over two placements on GPU 0 (its choices read to the host
 * first), an expert shard's view, whole and split (the choices in the whole layer's numbering,
 * renumbered by the backend: the same bits as the host route renumbered by moed_route_localize,
 * the refusals worded against the whole layer), and choices on a GPU the layer is not on (where
 * there is one). Exits 77 (skipped) without
 * a GPU. MOED_GPU_TEST_QUICK=1 runs the cases of at most 64 tokens (for compute-sanitizer).
 */
#include "check.h"

#include "cuda_backend.h"
#include "moed_dtype.h"
#include "moed_route.h"
#include "moed_synth.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The layers, each on a backend of its own. */
typedef struct lcase {
    const char *name;
    const char *spec;
    int64_t max_tokens;
    const char *kernel; /* MOED_CUDA_KERNEL while the backend opens, or NULL */
    bool split;         /* expert parallelism over two placements on GPU 0 */
    bool shard;         /* an expert shard's view: the odd experts held (shard_view) */
} lcase;

enum { L_BF16, L_F16, L_FP8, L_FP8_PORTABLE, L_WIDE, L_SPLIT, L_SHARD, L_SHARD_SPLIT, L_COUNT };

static const lcase layers[L_COUNT] = {
    [L_BF16] = { "bf16 e8", "layers=1,d=256,ff=384,experts=8,topk=2,act=swiglu,dtype=bf16,seed=5",
                 512, NULL, false },
    [L_F16] = { "f16 e64 shared",
                "layers=1,d=256,ff=256,experts=64,topk=8,act=gelu,dtype=f16,seed=6,shared=1,"
                "shared_ff=256",
                4096, NULL, false },
    [L_FP8] = { "fp8 e16", "layers=1,d=256,ff=256,experts=16,topk=4,act=swiglu,dtype=fp8,seed=7",
                512, NULL, false },
    [L_FP8_PORTABLE] = { "fp8 e16 portable",
                         "layers=1,d=256,ff=256,experts=16,topk=4,act=swiglu,dtype=fp8,seed=7", 512,
                         "sm80", false },
    [L_WIDE] = { "bf16 e4096",
                 "layers=1,d=128,ff=128,experts=4096,topk=2,act=relu,dtype=bf16,seed=8", 64, NULL,
                 false },
    [L_SPLIT] = { "bf16 e8 split",
                  "layers=1,d=256,ff=384,experts=8,topk=2,act=swiglu,dtype=bf16,seed=5", 512, NULL,
                  true },
    [L_SHARD] = { "bf16 shard 4/8",
                  "layers=1,d=256,ff=384,experts=8,topk=2,act=swiglu,dtype=bf16,seed=9", 512, NULL,
                  false, true },
    [L_SHARD_SPLIT] = { "bf16 shard split",
                        "layers=1,d=256,ff=384,experts=8,topk=2,act=swiglu,dtype=bf16,seed=9", 512,
                        NULL, true, true },
};

/* A launch: its parts as letters and rows ("H5 D17 O9": 5 tokens routed on the host, 17 by a
 * device choice, 9 by a device choice that breaks the rule O). Device choices: D valid, A all
 * padding; and one refused pair (at 2/3 of the part's rows, last column; a second, of rule W, on
 * the part's last row when that is later) of rule O (id = E), M (id -2), W (id -1 with weight
 * 0.5), N (weight NaN), I (weight Inf), G (weight -0.25). */
typedef struct dcase {
    const char *name;
    int layer;
    int xdtype;
    int k;
    int pad_pct; /* share of padding slots (id -1, weight 0) */
    const char *parts;
    bool on_device; /* a lone part whose x and y lie on the layer's GPU (read and written there) */
    bool twice;     /* run again with other device choices (a replayed graph's second use) */
} dcase;

static const dcase cases[] = {
    { "graph: device and host parts", L_BF16, MOED_BF16, 2, 0, "D4 H4 D4", false, true },
    { "graph: padding, refused ids", L_BF16, MOED_BF16, 3, 30, "H3 D5 O4 D2 M3", false, true },
    { "graph: each weight rule", L_BF16, MOED_F32, 2, 20, "D3 N3 I3 G3 W3 H2", false, true },
    { "one token, k = 1", L_BF16, MOED_F16, 1, 0, "D1", false, true },
    { "all padding alone (no row to compute)", L_BF16, MOED_BF16, 4, 100, "A6", false, false },
    { "all padding among others", L_BF16, MOED_BF16, 2, 10, "H4 A6 D4", false, false },
    { "k = 300 (past the combine's staging)", L_BF16, MOED_BF16, 300, 99, "D5 H2 D3", false,
      false },
    { "large: host first, device after", L_BF16, MOED_BF16, 2, 5, "H200 D200 D100", false, false },
    { "chunks: k = 8 over top_k 2", L_BF16, MOED_BF16, 8, 25, "D100 H50 D250", false, false },
    { "chunks: refusal in a later chunk", L_BF16, MOED_F32, 8, 25, "H60 N400 D40", false, false },
    { "lone device part in place", L_BF16, MOED_BF16, 2, 10, "D400", true, false },
    { "lone device part, graph", L_BF16, MOED_BF16, 2, 10, "D8", true, true },
    { "f16 shared: three-launch route prep", L_F16, MOED_BF16, 8, 10, "H1000 D2000 O96 D1000",
      false, false },
    { "f16 shared: chunks", L_F16, MOED_F16, 12, 20, "D3000 H500 G596", false, false },
    { "f16 shared: small", L_F16, MOED_F32, 8, 30, "H7 D9 W5", false, true },
    { "fp8: small", L_FP8, MOED_BF16, 4, 20, "D20 H20 O4 D20", false, true },
    { "fp8: large", L_FP8, MOED_BF16, 4, 10, "H300 D140 N60", false, false },
    { "fp8 portable: small", L_FP8_PORTABLE, MOED_BF16, 4, 20, "D20 H20 M4 D20", false, true },
    { "fp8 portable: large", L_FP8_PORTABLE, MOED_F16, 4, 10, "D300 I60 H140", false, false },
    { "4096 experts: id 4096 refused", L_WIDE, MOED_BF16, 2, 10, "D20 O10 H10", false, true },
    { "split: host path", L_SPLIT, MOED_BF16, 2, 20, "H7 D9 O5 D3", false, true },
    { "split: chunks", L_SPLIT, MOED_BF16, 8, 25, "D100 H50 N250", false, false },
    { "shard: the whole numbering, graph", L_SHARD, MOED_BF16, 2, 20, "D6 H3 O4 D5", false, true },
    { "shard: chunks", L_SHARD, MOED_F32, 8, 10, "D300 H100 M50", false, false },
    { "shard: lone device part in place", L_SHARD, MOED_BF16, 2, 0, "D400", true, false },
    { "shard split: host path", L_SHARD_SPLIT, MOED_BF16, 2, 20, "H7 D9 O5 D3", false, true },
};

/* A layer on its backend: every layer of the table lives on GPU 0. */
typedef struct layer_run {
    moed_layer layer;
    moed_layer synth; /* a shard's: the synthetic layer whole, put back before it is freed */
    moed_backend *b;
    int exec; /* an execution slot that runs the layer */
} layer_run;

static layer_run runs[L_COUNT];
static uint64_t seed = 2024;

static uint64_t next(void)
{
    return seed = moed_splitmix64(seed);
}

static double urand(void)
{
    return (double)(next() >> 11) / 9007199254740992.0;
}

/* An expert shard's view of l, as moed --experts makes it (server/shard.c): the odd experts held,
 * renumbered 0, 1, ...; the router and the choices keep the whole layer's numbering. */
static void shard_view(layer_run *lr)
{
    moed_layer *l = &lr->layer;
    const int E = l->info.n_experts;
    int32_t *local_of = malloc(sizeof *local_of * (size_t)E);
    moed_expert_w *held = malloc(sizeof *held * (size_t)E);
    int n = 0;
    for (int e = 0; e < E; e++) {
        local_of[e] = e % 2 ? n : -1;
        if (e % 2) held[n++] = l->experts[e];
    }
    lr->synth = *l;
    l->experts = held;
    l->local_of = local_of;
    l->info.router_experts = E;
    l->info.n_experts = n;
}

static layer_run *open_layer(int l)
{
    layer_run *lr = &runs[l];
    if (lr->b) return lr;
    const lcase *lc = &layers[l];
    moed_synth_spec spec;
    moed_error err;
    static const int split_devices[2] = { 0, 0 }, one[1] = { 0 };
    moed_backend_config cfg = { .streams = 1,
                                .max_tokens = lc->max_tokens,
                                .devices = lc->split ? split_devices : one,
                                .n_devices = lc->split ? 2 : 1,
                                .expert_parallel = lc->split };
    if (lc->kernel) setenv("MOED_CUDA_KERNEL", lc->kernel, 1);
    int rc = moed_synth_parse(lc->spec, &spec, &err);
    if (!rc) rc = moed_synth_layer(&spec, 0, &lr->layer, &err);
    if (!rc && lc->shard) shard_view(lr);
    if (!rc) rc = moed_backend_cuda_open(&cfg, &lr->b, &err);
    if (!rc) rc = moed_backend_load_layer(lr->b, 0, &lr->layer, &err);
    if (!rc) rc = moed_backend_start(lr->b, &err);
    unsetenv("MOED_CUDA_KERNEL");
    CHECK_MSG(!rc, "%s: %s", lc->name, err.msg);
    if (rc) return NULL;
    while (!moed_backend_exec_accepts(lr->b, lr->exec, 0)) lr->exec++;
    return lr;
}

/* One part of a launch: its choice on the host, on the device where it is device-routed, and its
 * route where it is accepted. */
typedef struct part {
    char kind;
    int64_t t0, rows;
    int32_t *ids;
    float *w;
    void *d_ids, *d_w;
    moed_route r;
    moed_part_route pr;
} part;

static bool on_device(char kind)
{
    return kind != 'H';
}

static bool refused(char kind)
{
    return strchr("OMWNIG", kind) != NULL;
}

/* Puts the rule of `kind` at pair i of the choice (breaking that rule alone). */
static void break_rule(part *p, int64_t i, char kind, int E)
{
    static const char kinds[] = "OMWNIG";
    static const int32_t id[] = { 0, -2, -1, 1, 1, 1 };
    static const float w[] = { 0.5f, 0.5f, 0.5f, NAN, INFINITY, -0.25f };
    const int j = (int)(strchr(kinds, kind) - kinds);
    p->ids[i] = kind == 'O' ? E : id[j];
    p->w[i] = w[j];
}

/* A fresh choice for p (k a token, ids of E experts; its host route renumbered by local_of where
 * that is not NULL), uploaded where the part is device-routed. */
static void make_choice(part *p, int k, int E, const int32_t *local_of, int pad_pct)
{
    const int64_t n = p->rows * k;
    for (int64_t i = 0; i < n; i++) {
        const bool pad = p->kind == 'A' || (int)(urand() * 100) < pad_pct;
        p->ids[i] = pad ? -1 : (int32_t)(next() % (uint64_t)E); /* repeats come naturally */
        p->w[i] = pad ? 0.0f : (float)(0.05 + 0.95 * urand());
    }
    if (refused(p->kind)) {
        const int64_t row = p->rows * 2 / 3;
        break_rule(p, row * k + k - 1, p->kind, E);
        if (p->rows - 1 > row) break_rule(p, (p->rows - 1) * k, 'W', E);
    }
    moed_route_free(&p->r);
    if (!refused(p->kind)) {
        moed_error err;
        CHECK(moed_route_from_choice(&p->r, p->ids, p->w, p->rows, k, E, &err) == 0);
        if (local_of) moed_route_localize(&p->r, local_of);
    }
    if (on_device(p->kind)) {
        cudaMemcpy(p->d_ids, p->ids, sizeof(int32_t) * (size_t)n, cudaMemcpyHostToDevice);
        cudaMemcpy(p->d_w, p->w, sizeof(float) * (size_t)n, cudaMemcpyHostToDevice);
        cudaDeviceSynchronize(); /* a copy from pageable memory may return before it lands */
    }
}

static int parse_parts(const char *s, part *parts, int max)
{
    int n = 0;
    int64_t t = 0;
    while (*s && n < max) {
        char *end;
        parts[n] = (part){ .kind = *s, .t0 = t, .rows = strtoll(s + 1, &end, 10) };
        t += parts[n++].rows;
        s = *end ? end + 1 : end;
    }
    return n;
}

/* The job's route: the host parts' pairs (those of device parts too when host_all), and no pair
 * for the tokens of the others; parts kept[i] false are left out. */
static void job_route(const part *p, int n, const bool *kept, bool host_all, moed_route *out)
{
    int64_t T = 0, pairs = 0;
    moed_route empty[32];
    const moed_route *pieces[32];
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (!kept[i]) continue;
        T += p[i].rows;
        if (p[i].kind == 'H' || (host_all && !refused(p[i].kind))) {
            pieces[m++] = &p[i].r;
            pairs += p[i].r.off[p[i].rows];
        } else {
            CHECK(moed_route_init(&empty[i], p[i].rows, 0) == 0);
            pieces[m++] = &empty[i];
        }
    }
    CHECK(moed_route_init(out, T, pairs) == 0);
    CHECK(moed_route_concat(out, pieces, m) == 0);
    for (int i = 0; i < n; i++)
        if (kept[i] && !(p[i].kind == 'H' || (host_all && !refused(p[i].kind))))
            moed_route_free(&empty[i]);
}

/* Runs the launch of parts p (kept ones only) with rows of x and into y, each part's rows at its
 * own place; device-routed parts bring their choice when device_routing. */
static int launch(layer_run *lr, const dcase *dc, part *p, int n, const bool *kept,
                  bool device_routing, const char *x, char *y, size_t rb, moed_error *err)
{
    moed_part mp[32];
    int m = 0;
    int64_t T = 0;
    for (int i = 0; i < n; i++) {
        if (!kept[i]) continue;
        mp[m] = (moed_part){ .rows = p[i].rows,
                             .x = x + (size_t)p[i].t0 * rb,
                             .x_dev = MOED_HOST_MEM,
                             .y = y + (size_t)p[i].t0 * rb,
                             .y_dev = MOED_HOST_MEM };
        if (device_routing && on_device(p[i].kind)) {
            p[i].pr = (moed_part_route){ .ids = p[i].d_ids, .weights = p[i].d_w, .k = dc->k };
            p[i].pr.dev = 0;
            memset(&p[i].pr.err, 0x5a, sizeof p[i].pr.err); /* forward must set it */
            mp[m].route = &p[i].pr;
        }
        T += p[i].rows;
        m++;
    }
    if (!m) return 0;
    moed_route r;
    job_route(p, n, kept, !device_routing, &r);
    void *dx = NULL, *dy = NULL;
    if (dc->on_device) { /* the lone part's x and y on the layer's GPU */
        CHECK(cudaMalloc(&dx, (size_t)T * rb) == cudaSuccess);
        CHECK(cudaMalloc(&dy, (size_t)T * rb) == cudaSuccess);
        cudaMemcpy(dx, x, (size_t)T * rb, cudaMemcpyHostToDevice);
        cudaMemset(dy, 0xff, (size_t)T * rb);
        cudaDeviceSynchronize(); /* the backend's streams do not wait for the default one */
        mp[0].x = dx;
        mp[0].y = dy;
        mp[0].x_dev = mp[0].y_dev = 0;
    }
    moed_job job = { .dtype = dc->xdtype, .T = T, .parts = mp, .n_parts = m, .route = &r };
    int rc = moed_backend_forward(lr->b, lr->exec, &job, err);
    if (dc->on_device) {
        cudaMemcpy(y, dy, (size_t)T * rb, cudaMemcpyDeviceToHost);
        cudaFree(dx);
        cudaFree(dy);
    }
    moed_route_free(&r);
    return rc;
}

static void run_case(const dcase *dc)
{
    layer_run *lr = open_layer(dc->layer);
    if (!lr) return;
    const moed_layer_info *li = &lr->layer.info;
    const int E = moed_layer_router_experts(li), d = li->d_model; /* the choices' numbering */
    const int32_t *local_of = lr->layer.local_of;
    part p[32];
    const int n = parse_parts(dc->parts, p, 32);
    const int64_t T = p[n - 1].t0 + p[n - 1].rows;
    const size_t rb = (size_t)d * moed_dtype_size(dc->xdtype);
    float *xf = malloc(sizeof(float) * (size_t)T * d);
    char *x = malloc((size_t)T * rb), *got = malloc((size_t)T * rb), *want = malloc((size_t)T * rb);
    for (int64_t i = 0; i < T * d; i++) xf[i] = (float)(2 * urand() - 1);
    moed_from_f32(dc->xdtype, xf, x, (size_t)T * d);
    bool all[32], accepted[32];
    for (int i = 0; i < n; i++) {
        const size_t nk = (size_t)p[i].rows * dc->k;
        p[i].ids = malloc(sizeof(int32_t) * nk);
        p[i].w = malloc(sizeof(float) * nk);
        p[i].r = (moed_route){ 0 };
        p[i].d_ids = p[i].d_w = NULL;
        if (on_device(p[i].kind)) {
            CHECK(cudaMalloc(&p[i].d_ids, sizeof(int32_t) * nk) == cudaSuccess);
            CHECK(cudaMalloc(&p[i].d_w, sizeof(float) * nk) == cudaSuccess);
        }
        make_choice(&p[i], dc->k, E, local_of, dc->pad_pct);
        all[i] = true;
        accepted[i] = !refused(p[i].kind);
    }
    for (int round = 0; round < (dc->twice ? 2 : 1); round++) {
        if (round) /* the same shapes, so the same graph; other choices in the same buffers */
            for (int i = 0; i < n; i++)
                if (on_device(p[i].kind)) make_choice(&p[i], dc->k, E, local_of, dc->pad_pct);
        moed_error err;
        memset(got, 0xff, (size_t)T * rb);
        memset(want, 0xff, (size_t)T * rb);
        int rc = launch(lr, dc, p, n, all, true, x, got, rb, &err);
        CHECK_MSG(rc == 0, "%s: forward: %s", dc->name, err.msg);
        rc = launch(lr, dc, p, n, accepted, false, x, want, rb, &err);
        CHECK_MSG(rc == 0, "%s: the host-routed launch: %s", dc->name, err.msg);
        int differ = 0, bad_status = 0;
        for (int i = 0; i < n; i++) {
            if (accepted[i] && memcmp(got + (size_t)p[i].t0 * rb, want + (size_t)p[i].t0 * rb,
                                      (size_t)p[i].rows * rb)) {
                differ++;
                CHECK_MSG(0, "%s (round %d): part %d (%c%lld) differs from the host route",
                          dc->name, round, i, p[i].kind, (long long)p[i].rows);
            }
            if (!on_device(p[i].kind)) continue;
            moed_error want_err = { 0 };
            const int64_t code = moed_choice_check(p[i].ids, p[i].w, p[i].rows, dc->k, E);
            if (code >= 0) moed_choice_fail(&want_err, code, dc->k, E);
            CHECK_MSG(refused(p[i].kind) == (code >= 0), "%s: part %d's choice as made", dc->name,
                      i);
            if (p[i].pr.err.code != want_err.code || strcmp(p[i].pr.err.msg, want_err.msg)) {
                bad_status++;
                CHECK_MSG(0, "%s (round %d): part %d's status %d '%.200s', want %d '%.200s'",
                          dc->name, round, i, p[i].pr.err.code, p[i].pr.err.msg, want_err.code,
                          want_err.msg);
            }
        }
        fprintf(stderr, "  %-16s %-42s T=%-5lld k=%-3d %s%s\n", layers[dc->layer].name, dc->name,
                (long long)T, dc->k, differ ? "DIFFERS" : "same bits",
                bad_status ? ", STATUS WRONG" : ", statuses right");
    }
    for (int i = 0; i < n; i++) {
        free(p[i].ids);
        free(p[i].w);
        cudaFree(p[i].d_ids);
        cudaFree(p[i].d_w);
        moed_route_free(&p[i].r);
    }
    free(xf);
    free(x);
    free(got);
    free(want);
}

/* Choices on a GPU the layer is not on (a device the backend uses: both are its devices), copied
 * into the route's slots first: the same bits and statuses as on the layer's GPU. */
static void test_other_gpu(void)
{
    int n = 0;
    cudaGetDeviceCount(&n);
    if (n < 2) {
        fprintf(stderr, "  choices on another GPU: one GPU only, not run\n");
        return;
    }
    moed_synth_spec spec;
    moed_layer layer;
    moed_error err;
    static const int devs[2] = { 0, 1 };
    moed_backend_config cfg = { .streams = 1, .max_tokens = 64, .devices = devs, .n_devices = 2 };
    moed_backend *b = NULL;
    int rc = moed_synth_parse(layers[L_BF16].spec, &spec, &err);
    if (!rc) rc = moed_synth_layer(&spec, 0, &layer, &err);
    if (!rc) rc = moed_backend_cuda_open(&cfg, &b, &err);
    if (!rc) rc = moed_backend_load_layer(b, 0, &layer, &err);
    if (!rc) rc = moed_backend_start(b, &err);
    CHECK_MSG(!rc, "two GPUs: %s", err.msg);
    if (rc) return;
    moed_layer_place place;
    moed_backend_layer_place(b, 0, &place);
    int exec = 0;
    while (!moed_backend_exec_accepts(b, exec, 0)) exec++;
    const int other = place.home == 0 ? 1 : 0, T = 24, k = 2, d = layer.info.d_model;
    const size_t rb = (size_t)d * 2;
    int32_t ids[48];
    float w[48], xf[24 * 256];
    for (int i = 0; i < T * k; i++) {
        ids[i] = i % 7 == 3 ? -1 : (int32_t)(next() % 8);
        w[i] = ids[i] < 0 ? 0.0f : (float)urand();
    }
    ids[40] = 8; /* row 20 of the choice: the second part (rows 12 ..) is refused at its row 8 */
    for (int i = 0; i < T * d; i++) xf[i] = (float)(2 * urand() - 1);
    uint16_t x[24 * 256], got[24 * 256], want[24 * 256];
    moed_from_f32(MOED_BF16, xf, x, (size_t)T * d);
    void *d_ids, *d_w;
    cudaSetDevice(other);
    cudaMalloc(&d_ids, sizeof ids);
    cudaMalloc(&d_w, sizeof w);
    cudaMemcpy(d_ids, ids, sizeof ids, cudaMemcpyHostToDevice);
    cudaMemcpy(d_w, w, sizeof w, cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();
    moed_part_route pr[2] = {
        { .ids = d_ids, .weights = d_w, .k = k, .dev = other },
        { .ids = (int32_t *)d_ids + 24, .weights = (float *)d_w + 24, .k = k, .dev = other }
    };
    moed_part parts[2] = { { .rows = 12,
                             .x = x,
                             .x_dev = MOED_HOST_MEM,
                             .y = got,
                             .y_dev = MOED_HOST_MEM,
                             .route = &pr[0] },
                           { .rows = 12,
                             .x = x + 12 * 256,
                             .x_dev = MOED_HOST_MEM,
                             .y = got + 12 * 256,
                             .y_dev = MOED_HOST_MEM,
                             .route = &pr[1] } };
    moed_route none, host;
    moed_route_init(&none, T, 0);
    moed_job job = { .dtype = MOED_BF16, .T = T, .parts = parts, .n_parts = 2, .route = &none };
    memset(got, 0xff, sizeof got);
    rc = moed_backend_forward(b, exec, &job, &err);
    CHECK_MSG(rc == 0, "choices on GPU %d: %s", other, err.msg);
    CHECK_MSG(pr[0].err.code == 0, "part 0: %s", pr[0].err.msg);
    moed_error want_err = { 0 };
    moed_choice_fail(&want_err, moed_choice_check(ids + 24, w + 24, 12, k, 8), k, 8);
    CHECK_MSG(pr[1].err.code == MOED_EINVAL && !strcmp(pr[1].err.msg, want_err.msg),
              "part 1: '%s', want '%s'", pr[1].err.msg, want_err.msg);
    CHECK(moed_route_from_choice(&host, ids, w, 12, k, 8, &err) == 0);
    moed_job hjob = { .dtype = MOED_BF16, .T = 12, .x = x, .y = want, .route = &host };
    CHECK(moed_backend_forward(b, exec, &hjob, &err) == 0);
    CHECK_MSG(!memcmp(got, want, 12 * rb), "choices on GPU %d differ from the host route", other);
    fprintf(stderr, "  choices on GPU %d, layer on GPU %d%*s%s\n", other, place.home, 30, "",
            memcmp(got, want, 12 * rb) ? "DIFFERS" : "same bits");
    moed_route_free(&none);
    moed_route_free(&host);
    cudaFree(d_ids);
    cudaFree(d_w);
    moed_backend_destroy(b);
    moed_synth_free_layer(&layer);
}

int main(void)
{
    if (!moed_backend_cuda_available()) {
        fprintf(stderr, "test_dev_route: no CUDA device (or moed built without CUDA): skipped\n");
        return CHECK_SKIP;
    }
    const char *q = getenv("MOED_GPU_TEST_QUICK");
    const bool quick = q && *q == '1';
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        part p[32];
        const int n = parse_parts(cases[i].parts, p, 32);
        if (!quick || p[n - 1].t0 + p[n - 1].rows <= 64) run_case(&cases[i]);
    }
    test_other_gpu();
    for (int l = 0; l < L_COUNT; l++) {
        moed_backend_destroy(runs[l].b);
        if (runs[l].layer.local_of) { /* the shard's view put back to the synthetic layer */
            free(runs[l].layer.experts);
            free((int32_t *)runs[l].layer.local_of);
            runs[l].layer = runs[l].synth;
        }
        if (runs[l].b) moed_synth_free_layer(&runs[l].layer);
    }
    return check_status("test_dev_route");
}
