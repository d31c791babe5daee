/*
 * test_cuda_parts — the CUDA backend's parts (moed_backend.h): a job whose tokens lie in several
 * places gives, bit for bit, what the same job gives from one host buffer (inline). Parts in
 * pageable, pinned (host_alloc) and registered (host_register) host memory; in device memory of
 * the layer's GPU, mixed with host parts (device-to-device copies); a lone device part read and
 * written in place (no copy: batches too large for a replayed graph) and through the slot's
 * buffers (a replayed graph); a batch in chunks (more pairs than the workspace holds), whose next
 * chunk comes in while one computes; each part's output written over its own input, in each of
 * those paths; router logits from parts. Parts on a GPU the backend does not compute on (GPU 1, the
 * backend being on GPU 0: a client's CUDA region on another GPU of the host), where there is one:
 * the same paths and expert choices kept there (copied into the route's slots, a refused one
 * failing its own part alone), with the copies staged through host memory and then again with
 * peer access enabled (as map_device enables it). And the region hooks' refusals: an IPC handle
 * this process made does not open here, on the backend's GPU or on the other one (so map_device
 * takes a GPU it does not compute on), and a GPU this process does not see is refused by name.
 * Exits 77 (skipped) without a GPU.
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

/* Where a part lives. FAR is GPU 1, which the backend (on GPU 0) does not compute on; it needs a
 * second GPU, so test_placements does not cycle through it. */
enum { PAGEABLE, PINNED, REGISTERED, DEVICE, N_PLACES, FAR = N_PLACES };

/* The GPU of a place, or MOED_HOST_MEM. */
static int gpu_of(int kind)
{
    return kind == FAR ? 1 : kind == DEVICE ? 0 : MOED_HOST_MEM;
}

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
    if (gpu_of(kind) != MOED_HOST_MEM) {
        cudaSetDevice(gpu_of(kind));
        CHECK(cudaMalloc(&p->x, n) == cudaSuccess && cudaMalloc(&p->y, n) == cudaSuccess);
        cudaMemcpy(p->x, x, n, cudaMemcpyHostToDevice);
        cudaMemset(p->y, 0xff, n);
        cudaDeviceSynchronize();
        cudaSetDevice(0);
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
    if (gpu_of(p->kind) != MOED_HOST_MEM)
        cudaMemcpy(dst, y, n, cudaMemcpyDeviceToHost);
    else
        memcpy(dst, y, n);
}

static void drop(place *p)
{
    if (gpu_of(p->kind) != MOED_HOST_MEM) {
        cudaSetDevice(gpu_of(p->kind));
        cudaFree(p->x);
        cudaFree(p->y);
        cudaSetDevice(0);
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
    for (int i = 0, t = 0; i < n; t += (int)rows[i++]) {
        put(&pl[i], kinds[i], (const char *)x + (size_t)t * ROW_BYTES, rows[i]);
        pl[i].over = over;
        const int where = gpu_of(kinds[i]);
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

/* Router logits from parts, the second on device `kind`: the same bits as from one buffer. */
static void test_router_parts(int kind)
{
    const int64_t T = 40;
    void *x = make_x(T);
    float *a = malloc(sizeof(float) * T * 8), *b = malloc(sizeof(float) * T * 8);
    moed_error err;
    const moed_job one = { .dtype = MOED_BF16, .T = T, .x = x };
    CHECK(moed_backend_router_logits(gpu, 0, &one, a, &err) == 0);
    place d;
    put(&d, kind, (char *)x + 10 * ROW_BYTES, T - 10);
    moed_part parts[2] = { { 10, x, MOED_HOST_MEM, NULL, MOED_HOST_MEM, NULL },
                           { T - 10, d.x, gpu_of(kind), NULL, MOED_HOST_MEM, NULL } };
    const moed_job two = { .dtype = MOED_BF16, .T = T, .parts = parts, .n_parts = 2 };
    CHECK_MSG(moed_backend_router_logits(gpu, 0, &two, b, &err) == 0, "router logits: %s", err.msg);
    CHECK_MSG(!memcmp(a, b, sizeof(float) * T * 8), "router logits from parts (on %d) differ",
              gpu_of(kind));
    drop(&d);
    free(x);
    free(a);
    free(b);
}

/* GPU i's UUID as map_device takes it ("GPU-..."). */
static void uuid_of(int i, char out[48])
{
    struct cudaDeviceProp pr;
    out[0] = 0;
    if (cudaGetDeviceProperties(&pr, i) != cudaSuccess) return;
    const unsigned char *b = (const unsigned char *)pr.uuid.bytes;
    snprintf(out, 48, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

/* map_device on GPU `g` (by UUID, else by ordinal) of a handle this process exported there: it
 * cannot be opened by the process that made it, so map_device gets as far as opening it and says
 * so, naming the GPU. */
static void own_handle_refused(int g, bool by_uuid)
{
    void *p, *ptr, *base;
    int dev;
    moed_error err;
    cudaIpcMemHandle_t h;
    char uuid[48] = "";
    if (by_uuid) uuid_of(g, uuid);
    cudaSetDevice(g);
    CHECK(cudaMalloc(&p, 1 << 20) == cudaSuccess && cudaIpcGetMemHandle(&h, p) == cudaSuccess);
    cudaSetDevice(0);
    const int rc = moed_backend_map_device(gpu, &h, sizeof h, by_uuid ? uuid : NULL, g, 1 << 20, 0,
                                           &ptr, &dev, &base, &err);
    char want[32];
    snprintf(want, sizeof want, "does not open on GPU %d", g);
    CHECK_MSG(rc == MOED_EINVAL && strstr(err.msg, want),
              "GPU %d's own handle (by %s): %d %s; want MOED_EINVAL, '%s'", g,
              by_uuid ? "UUID" : "ordinal", rc, err.msg, want);
    cudaSetDevice(g);
    cudaFree(p);
    cudaSetDevice(0);
}

/* The region hooks' refusals, and the backend still computes after them. A GPU the backend does
 * not compute on (GPU 1) is one map_device opens memory on; a GPU the process does not see is
 * refused, by UUID or by ordinal, with the GPUs it does see. Bounds past the allocation are the
 * other process's test (test_ipc). */
static void test_map_refusals(int n_gpus)
{
    void *ptr, *base;
    int dev;
    moed_error err;
    cudaIpcMemHandle_t h;
    memset(&h, 0, sizeof h);
    own_handle_refused(0, false);
    own_handle_refused(0, true);
    if (n_gpus > 1) {
        own_handle_refused(1, true);
        own_handle_refused(1, false);
    }
    CHECK(moed_backend_map_device(gpu, &h, 10, NULL, 0, 64, 0, &ptr, &dev, &base, &err) ==
          MOED_EINVAL);
    int rc = moed_backend_map_device(gpu, &h, sizeof h, "GPU-00000000-0000-0000-0000-000000000000",
                                     0, 64, 0, &ptr, &dev, &base, &err);
    char gpu0[48], seen[64];
    uuid_of(0, gpu0);
    snprintf(seen, sizeof seen, "0 %s", gpu0);
    CHECK_MSG(rc == MOED_EPRECOND && strstr(err.msg, "not visible to this server") &&
                  strstr(err.msg, seen),
              "an unseen GPU's UUID: %d %s", rc, err.msg);
    rc = moed_backend_map_device(gpu, &h, sizeof h, NULL, n_gpus, 64, 0, &ptr, &dev, &base, &err);
    CHECK_MSG(rc == MOED_EPRECOND && strstr(err.msg, "sees no GPU") && strstr(err.msg, seen),
              "an unseen GPU's ordinal %d: %d %s", n_gpus, rc, err.msg);
    const int64_t rows[1] = { 8 };
    const int kinds[1] = { PAGEABLE };
    run_parts("after the refusals", 8, 2, rows, kinds, 1, false);
}

/* Expert choices kept on GPU 1 (device routing, as a doorbell call's choices in a CUDA region
 * there) for two parts, one with its rows on GPU 1 too and one in host memory: the first gives the
 * bits of the same choice routed on the host, the second's refused pair fails it alone, with the
 * message the host check words. */
static void test_far_choices(const char *how)
{
    enum { T = 24, K = 2 };
    int32_t ids[T * K];
    float w[T * K];
    for (int i = 0; i < T * K; i++) {
        seed = moed_splitmix64(seed);
        ids[i] = i % 7 == 3 ? -1 : (int32_t)(seed % 8);
        w[i] = ids[i] < 0 ? 0.0f : 0.1f + (float)(seed >> 60) / 16.0f;
    }
    ids[40] = 8; /* row 20: the second part (rows 12 ..) is refused at its row 8 */
    void *x = make_x(T), *host_y = malloc((size_t)T * ROW_BYTES);
    place far;
    put(&far, FAR, x, 12);
    int32_t *d_ids;
    float *d_w;
    cudaSetDevice(1);
    CHECK(cudaMalloc((void **)&d_ids, sizeof ids) == cudaSuccess &&
          cudaMalloc((void **)&d_w, sizeof w) == cudaSuccess);
    cudaMemcpy(d_ids, ids, sizeof ids, cudaMemcpyHostToDevice);
    cudaMemcpy(d_w, w, sizeof w, cudaMemcpyHostToDevice);
    cudaSetDevice(0);
    moed_part_route pr[2] = {
        { .ids = d_ids, .weights = d_w, .k = K, .dev = 1 },
        { .ids = d_ids + 12 * K, .weights = d_w + 12 * K, .k = K, .dev = 1 }
    };
    moed_part parts[2] = { { 12, far.x, 1, far.y, 1, &pr[0] },
                           { 12, (char *)x + 12 * ROW_BYTES, MOED_HOST_MEM, host_y, MOED_HOST_MEM,
                             &pr[1] } };
    moed_route none, host;
    moed_error err;
    moed_route_init(&none, T, 0);
    moed_job job = { .dtype = MOED_BF16, .T = T, .parts = parts, .n_parts = 2, .route = &none };
    int rc = moed_backend_forward(gpu, 0, &job, &err);
    CHECK_MSG(rc == 0, "choices on GPU 1 (%s): %s", how, err.msg);
    CHECK_MSG(!rc && pr[0].err.code == 0, "part 0 (%s): %s", how, pr[0].err.msg);
    moed_error want_err = { 0 };
    moed_choice_fail(&want_err, moed_choice_check(ids + 12 * K, w + 12 * K, 12, K, 8), K, 8);
    CHECK_MSG(!rc && pr[1].err.code == MOED_EINVAL && !strcmp(pr[1].err.msg, want_err.msg),
              "part 1 (%s): '%s', want '%s'", how, pr[1].err.msg, want_err.msg);
    CHECK(moed_route_from_choice(&host, ids, w, 12, K, 8, &err) == 0);
    void *want = inline_y(x, 12, &host), *got = malloc(12 * ROW_BYTES);
    take(&far, got, 12);
    const bool same = !rc && !memcmp(got, want, 12 * ROW_BYTES);
    CHECK_MSG(same, "choices on GPU 1 (%s) differ from the host route", how);
    fprintf(stderr, "  %-58s T=%-4d %s\n", "expert choices on GPU 1", T, same ? "same" : "DIFFERS");
    drop(&far);
    cudaSetDevice(1);
    cudaFree(d_ids);
    cudaFree(d_w);
    cudaSetDevice(0);
    moed_route_free(&none);
    moed_route_free(&host);
    free(x);
    free(host_y);
    free(want);
    free(got);
}

/* Parts on GPU 1, which the backend (on GPU 0) does not compute on, in every path a part on the
 * layer's GPU takes; `how` says how the copies between the GPUs go. */
static void test_far_parts(const char *how)
{
    fprintf(stderr, " parts on GPU 1, the backend computing on GPU 0 (%s):\n", how);
    const int64_t small[1] = { 8 }, large[1] = { 400 }, chunks[1] = { 300 },
                  three[3] = { 100, 250, 50 };
    const int far1[1] = { FAR }, mixed[3] = { PINNED, FAR, DEVICE };
    run_parts("a part on GPU 1, graph-replayed (via the slot)", 8, 2, small, far1, 1, false);
    run_parts("a part on GPU 1, no graph", 400, 2, large, far1, 1, false);
    run_parts("chunks: a part on GPU 1", 300, 8, chunks, far1, 1, false);
    run_parts("pinned, GPU 1 and GPU 0 parts", 400, 2, three, mixed, 3, false);
    run_parts("output over input: a part on GPU 1, graph-replayed", 8, 2, small, far1, 1, true);
    run_parts("output over input: a part on GPU 1, no graph", 400, 2, large, far1, 1, true);
    run_parts("output over input: chunks, a part on GPU 1", 300, 8, chunks, far1, 1, true);
    test_router_parts(FAR);
    test_far_choices(how);
}

/* Peer access between GPUs 0 and 1, both ways, as map_device enables it for a region on GPU 1;
 * false where the GPUs cannot have it. */
static bool enable_peer_access(void)
{
    int to = 0, from = 0;
    if (cudaDeviceCanAccessPeer(&to, 0, 1) != cudaSuccess || !to ||
        cudaDeviceCanAccessPeer(&from, 1, 0) != cudaSuccess || !from)
        return false;
    cudaSetDevice(0);
    const cudaError_t a = cudaDeviceEnablePeerAccess(1, 0);
    cudaSetDevice(1);
    const cudaError_t b = cudaDeviceEnablePeerAccess(0, 0);
    cudaSetDevice(0);
    cudaGetLastError();
    CHECK_MSG((a == cudaSuccess || a == cudaErrorPeerAccessAlreadyEnabled) &&
                  (b == cudaSuccess || b == cudaErrorPeerAccessAlreadyEnabled),
              "enabling peer access between GPUs 0 and 1: %s, %s", cudaGetErrorName(a),
              cudaGetErrorName(b));
    return true;
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
    test_router_parts(DEVICE);
    int n_gpus = 0;
    cudaGetDeviceCount(&n_gpus);
    if (n_gpus > 1) {
        /* Nothing has enabled peer access yet: the driver stages the copies through the host. */
        test_far_parts("staged through host memory");
        if (enable_peer_access())
            test_far_parts("peer access");
        else
            fprintf(stderr, "  GPUs 0 and 1 have no peer access: its round not run\n");
    } else {
        fprintf(stderr,
                "  parts on a GPU the backend does not compute on: one GPU only, not run\n");
    }
    test_map_refusals(n_gpus);
    moed_backend_destroy(gpu);
    moed_synth_free_layer(&layer);
    return check_status("test_cuda_parts");
}
