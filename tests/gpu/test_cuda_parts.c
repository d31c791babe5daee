/*
 * test_cuda_parts — the CUDA backend's parts (moed_backend.h): a job whose tokens lie in several
 * places gives, bit for bit, what the same job gives from one host buffer (inline). Parts in
 * pageable, pinned (host_alloc) and registered (host_register) host memory; in device memory of
 * the layer's GPU, mixed with host parts (device-to-device copies); a lone device part read and
 * written in place (no copy: batches too large for a replayed graph) and through the slot's
 * buffers (a replayed graph); a part on another GPU (peer copies; where there is one); a batch in
 * chunks (more pairs than the workspace holds), whose next chunk comes in while one computes;
 * each part's output written over its own input, in each of those paths; router logits from
 * parts. And the region hooks' refusals: an IPC handle this process made does not open here, and
 * says so. Exits 77 (skipped) without a GPU.
 */
#include "check.h"

#include "cuda_backend.h"
#include "moed_dtype.h"
#include "moed_route.h"
#include "moed_synth.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SPEC      "layers=1,d=256,ff=384,experts=8,topk=2,act=swiglu,dtype=bf16,seed=5"
#define MAX_T     512
#define ROW_BYTES (256 * 2)

static moed_layer layer;
static moed_backend *gpu;
static uint64_t seed = 99;

static moed_backend *open_gpu(int device)
{
    moed_backend_config cfg = {
        .max_tokens = MAX_T, .streams = 1, .devices = &device, .n_devices = 1
    };
    moed_backend *b = NULL;
    moed_error err;
    int rc = moed_backend_cuda_open(&cfg, &b, &err);
    if (!rc) rc = moed_backend_load_layer(b, 0, &layer, &err);
    if (!rc) rc = moed_backend_start(b, &err);
    CHECK_MSG(!rc, "cuda backend on GPU %d: %s", device, err.msg);
    return rc ? NULL : b;
}

/* T tokens of random bf16 rows, and a route of k experts each (k > 2: more pairs than top_k
 * sizes the workspace for, so the batch runs in chunks). */
static void *make_x(int64_t T)
{
    uint16_t *x = malloc((size_t)T * ROW_BYTES);
    float f;
    for (int64_t i = 0; i < T * 256; i++) {
        seed = moed_splitmix64(seed);
        f = (float)((double)(seed >> 11) / 9007199254740992.0 * 2 - 1);
        moed_from_f32(MOED_BF16, &f, &x[i], 1);
    }
    return x;
}

static void make_route(int64_t T, int k, moed_route *r)
{
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(T * k));
    float *w = malloc(sizeof(float) * (size_t)(T * k));
    for (int64_t i = 0; i < T * k; i++) {
        seed = moed_splitmix64(seed);
        ids[i] = (int32_t)(seed % 8);
        w[i] = 0.1f + (float)(seed >> 60) / 16.0f;
    }
    moed_error err;
    CHECK(moed_route_from_choice(r, ids, w, T, k, 8, &err) == 0);
    free(ids);
    free(w);
}

/* The job from one pageable host buffer: what every other placement must reproduce. */
static void *inline_y(const void *x, int64_t T, const moed_route *r)
{
    void *y = malloc((size_t)T * ROW_BYTES);
    moed_job job = { .dtype = MOED_BF16, .T = T, .x = x, .y = y, .route = r };
    moed_error err;
    CHECK_MSG(moed_backend_forward(gpu, 0, &job, &err) == 0, "inline: %s", err.msg);
    return y;
}

/* Where a part lives. */
enum { PAGEABLE, PINNED, REGISTERED, DEVICE, N_PLACES };

typedef struct place {
    int kind;
    void *x, *y; /* the part's buffers in that place */
    bool over;   /* the output written over x (y unused) */
} place;

static void put(place *p, int kind, const void *x, int64_t rows)
{
    const size_t n = (size_t)rows * ROW_BYTES;
    moed_error err;
    p->kind = kind;
    if (kind == DEVICE) {
        CHECK(cudaMalloc(&p->x, n) == cudaSuccess && cudaMalloc(&p->y, n) == cudaSuccess);
        cudaMemcpy(p->x, x, n, cudaMemcpyHostToDevice);
        cudaMemset(p->y, 0xff, n);
        return;
    }
    if (kind == PINNED) {
        p->x = moed_backend_host_alloc(gpu, n);
        p->y = moed_backend_host_alloc(gpu, n);
    } else {
        p->x = malloc(n);
        p->y = malloc(n);
    }
    memcpy(p->x, x, n);
    memset(p->y, 0xff, n);
    if (kind == REGISTERED)
        CHECK(!moed_backend_host_register(gpu, p->x, n, &err) &&
              !moed_backend_host_register(gpu, p->y, n, &err));
}

/* The part's output rows, copied to host memory. */
static void take(const place *p, void *dst, int64_t rows)
{
    const size_t n = (size_t)rows * ROW_BYTES;
    const void *y = p->over ? p->x : p->y;
    if (p->kind == DEVICE)
        cudaMemcpy(dst, y, n, cudaMemcpyDeviceToHost);
    else
        memcpy(dst, y, n);
}

static void drop(place *p)
{
    if (p->kind == DEVICE) {
        cudaFree(p->x);
        cudaFree(p->y);
    } else if (p->kind == PINNED) {
        moed_backend_host_free(gpu, p->x);
        moed_backend_host_free(gpu, p->y);
    } else {
        if (p->kind == REGISTERED) {
            moed_backend_host_unregister(gpu, p->x);
            moed_backend_host_unregister(gpu, p->y);
        }
        free(p->x);
        free(p->y);
    }
}

/* The job in parts of rows[i] tokens, part i in places[i] (over: each part's output written over
 * its own input, as a region request whose output names hidden's bytes): equal to inline, bit for
 * bit. */
static void run_parts(const char *what, int64_t T, int k, const int64_t *rows, const int *kinds,
                      int n, bool over)
{
    moed_route r;
    make_route(T, k, &r);
    void *x = make_x(T), *want = inline_y(x, T, &r), *got = malloc((size_t)T * ROW_BYTES);
    place *pl = calloc((size_t)n, sizeof *pl);
    moed_part *parts = calloc((size_t)n, sizeof *parts);
    int dev = 0;
    cudaGetDevice(&dev);
    for (int i = 0, t = 0; i < n; t += (int)rows[i++]) {
        put(&pl[i], kinds[i], (const char *)x + (size_t)t * ROW_BYTES, rows[i]);
        pl[i].over = over;
        int where = kinds[i] == DEVICE ? dev : MOED_HOST_MEM;
        parts[i] = (moed_part){ rows[i], pl[i].x, where, over ? pl[i].x : pl[i].y, where, NULL };
    }
    moed_job job = { .dtype = MOED_BF16, .T = T, .parts = parts, .n_parts = n, .route = &r };
    moed_error err;
    CHECK_MSG(moed_backend_forward(gpu, 0, &job, &err) == 0, "%s: %s", what, err.msg);
    for (int i = 0, t = 0; i < n; t += (int)rows[i++])
        take(&pl[i], (char *)got + (size_t)t * ROW_BYTES, rows[i]);
    CHECK_MSG(!memcmp(got, want, (size_t)T * ROW_BYTES), "%s: differs from inline", what);
    fprintf(stderr, "  %-58s T=%-4lld pairs=%-5lld %s\n", what, (long long)T, (long long)r.off[T],
            memcmp(got, want, (size_t)T * ROW_BYTES) ? "DIFFERS" : "same");
    for (int i = 0; i < n; i++) drop(&pl[i]);
    free(pl);
    free(parts);
    free(x);
    free(want);
    free(got);
    moed_route_free(&r);
}

static void test_placements(void)
{
    const int64_t three[3] = { 5, 17, 9 }, big[3] = { 100, 250, 50 }, chunks[2] = { 150, 150 };
    for (int a = 0; a < N_PLACES; a++) {
        const int kinds[3] = { a, (a + 1) % N_PLACES, (a + 2) % N_PLACES };
        char what[96];
        snprintf(what, sizeof what, "three parts (places %d, %d, %d)", kinds[0], kinds[1],
                 kinds[2]);
        run_parts(what, 31, 2, three, kinds, 3, false);
        snprintf(what, sizeof what, "three large parts (places %d, %d, %d)", kinds[0], kinds[1],
                 kinds[2]);
        run_parts(what, 400, 2, big, kinds, 3, false);
    }
    const int dev1[1] = { DEVICE }, host_dev[2] = { PINNED, DEVICE };
    const int64_t small[1] = { 8 }, large[1] = { 400 };
    run_parts("one device part, graph-replayed (via the slot)", 8, 2, small, dev1, 1, false);
    run_parts("one device part, read and written in place", 400, 2, large, dev1, 1, false);
    run_parts("chunks: 8 pairs a token (host and device parts)", 300, 8, chunks, host_dev, 2,
              false);
    const int64_t one300[1] = { 300 };
    run_parts("chunks: one device part", 300, 8, one300, dev1, 1, false);
    /* The output over the input: a row is written only after it was read, in every path. */
    run_parts("output over input: device part, graph-replayed", 8, 2, small, dev1, 1, true);
    run_parts("output over input: device part, in place", 400, 2, large, dev1, 1, true);
    run_parts("output over input: chunks, host and device parts", 300, 8, chunks, host_dev, 2,
              true);
    run_parts("output over input: chunks, one device part", 300, 8, one300, dev1, 1, true);
}

/* Router logits from parts: the same bits as from one buffer. */
static void test_router_parts(void)
{
    const int64_t T = 40;
    void *x = make_x(T);
    float *a = malloc(sizeof(float) * T * 8), *b = malloc(sizeof(float) * T * 8);
    moed_error err;
    const moed_job one = { .dtype = MOED_BF16, .T = T, .x = x };
    CHECK(moed_backend_router_logits(gpu, 0, &one, a, &err) == 0);
    place d;
    put(&d, DEVICE, (char *)x + 10 * ROW_BYTES, T - 10);
    int dev = 0;
    cudaGetDevice(&dev);
    moed_part parts[2] = { { 10, x, MOED_HOST_MEM, NULL, MOED_HOST_MEM, NULL },
                           { T - 10, d.x, dev, NULL, MOED_HOST_MEM, NULL } };
    const moed_job two = { .dtype = MOED_BF16, .T = T, .parts = parts, .n_parts = 2 };
    CHECK(moed_backend_router_logits(gpu, 0, &two, b, &err) == 0);
    CHECK_MSG(!memcmp(a, b, sizeof(float) * T * 8), "router logits from parts differ");
    drop(&d);
    free(x);
    free(a);
    free(b);
}

/* A handle this process exported cannot be opened by it: map_device says so, and the backend
 * still computes. Bounds past the allocation are the other process's test (test_ipc). */
static void test_map_refusals(void)
{
    void *p, *ptr, *base;
    int dev;
    moed_error err;
    cudaIpcMemHandle_t h;
    CHECK(cudaMalloc(&p, 1 << 20) == cudaSuccess && cudaIpcGetMemHandle(&h, p) == cudaSuccess);
    int rc =
        moed_backend_map_device(gpu, &h, sizeof h, NULL, 0, 1 << 20, 0, &ptr, &dev, &base, &err);
    CHECK_MSG(rc == MOED_EINVAL && strstr(err.msg, "does not open"), "%d %s", rc, err.msg);
    CHECK(moed_backend_map_device(gpu, &h, 10, NULL, 0, 64, 0, &ptr, &dev, &base, &err) ==
          MOED_EINVAL);
    CHECK(moed_backend_map_device(gpu, &h, sizeof h, "GPU-00000000-0000-0000-0000-000000000000", 0,
                                  64, 0, &ptr, &dev, &base, &err) == MOED_EPRECOND);
    CHECK(strstr(err.msg, "not one this server computes on") != NULL);
    cudaFree(p);
    const int64_t rows[1] = { 8 };
    const int kinds[1] = { PAGEABLE };
    run_parts("after the refusals", 8, 2, rows, kinds, 1, false);
}

/* A part on another GPU: peer copies in and out. */
static void test_peer(void)
{
    int n = 0;
    cudaGetDeviceCount(&n);
    if (n < 2) {
        fprintf(stderr, "  peer parts: one GPU only, not run\n");
        return;
    }
    const int64_t T = 64;
    moed_route r;
    make_route(T, 2, &r);
    void *x = make_x(T), *want = inline_y(x, T, &r), *got = malloc((size_t)T * ROW_BYTES);
    void *dx, *dy;
    cudaSetDevice(1);
    CHECK(cudaMalloc(&dx, T * ROW_BYTES) == cudaSuccess && cudaMalloc(&dy, T * ROW_BYTES) == 0);
    cudaMemcpy(dx, x, T * ROW_BYTES, cudaMemcpyHostToDevice);
    cudaSetDevice(0);
    moed_part part = { T, dx, 1, dy, 1, NULL };
    moed_job job = { .dtype = MOED_BF16, .T = T, .parts = &part, .n_parts = 1, .route = &r };
    moed_error err;
    CHECK_MSG(moed_backend_forward(gpu, 0, &job, &err) == 0, "peer: %s", err.msg);
    cudaMemcpy(got, dy, T * ROW_BYTES, cudaMemcpyDeviceToHost);
    CHECK_MSG(!memcmp(got, want, (size_t)T * ROW_BYTES), "a part on GPU 1 differs from inline");
    fprintf(stderr, "  peer parts (GPU 1 to the layer's GPU 0)                    same\n");
    cudaFree(dx);
    cudaFree(dy);
    free(x);
    free(want);
    free(got);
    moed_route_free(&r);
}

int main(void)
{
    if (!moed_backend_cuda_available()) {
        fprintf(stderr, "test_cuda_parts: no CUDA device (or moed built without CUDA): skipped\n");
        return CHECK_SKIP;
    }
    moed_synth_spec spec;
    moed_error err;
    if (moed_synth_parse(SPEC, &spec, &err) || moed_synth_layer(&spec, 0, &layer, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    if (!(gpu = open_gpu(0))) return check_status("test_cuda_parts");
    cudaSetDevice(0);
    test_placements();
    test_router_parts();
    test_map_refusals();
    test_peer();
    moed_backend_destroy(gpu);
    moed_synth_free_layer(&layer);
    return check_status("test_cuda_parts");
}
