/*
 * test_ring_stream — the doorbell's stream-ordered calls on a GPU. This program starts moed (the
 * path in argv[1]) on the CUDA backend (GPU 0) and, with every tensor of its calls in a CUDA region
 * of its own on the caller's GPU (GPU 0, and GPU 1 where there is one: the layer's GPU and
 * another), checks bit for bit against the same calls made from the host (moedc_ring_start and
 * moedc_ring_wait):
 *   - calls enqueued on a stream one by one, each call's hidden rows copied into place on the
 *     stream before it and its output copied out after it, so a call that rang before its input
 *     was there, or that let the stream go on before its output was written, shows;
 *   - the same N calls captured in one CUDA graph (global capture mode) with those copies, the
 *     graph replayed three times; one call of it names an out-of-range expert id, and fails
 *     INVALID_ARGUMENT on each replay (moedc_ring_failures counts one a replay) while the others
 *     are untouched;
 *   - the captured slots, released, serve host calls again; the daemon exits 0 on SIGTERM.
 * Exits 77 (skipped) without a GPU.
 */
#include "check.h"

#include "moedclient.h"

#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define D     512
#define E     8
#define K     2
#define N     12 /* calls */
#define MAX_T 40
#define BAD   5 /* the call with an out-of-range expert id */

static pid_t start_moed(const char *bin, char *target, size_t n)
{
    snprintf(target, n, "127.0.0.1:%d", 20000 + (int)(getpid() % 20000));
    pid_t pid = fork();
    if (pid == 0) {
        execl(bin, bin, "--listen", target, "--backend", "cuda", "--devices", "0", "--synthetic",
              "layers=1,d=512,ff=1024,experts=8,topk=2,act=swiglu,dtype=bf16,seed=3", "--log-level",
              "warn", (char *)NULL);
        _exit(127);
    }
    return pid;
}

static int wait_serving(moedc *c)
{
    for (int i = 0; i < 600; i++) {
        int status;
        moedc_error err;
        if (!moedc_health(c, "", &status, &err) && status == MOEDC_HEALTH_SERVING) return 0;
        struct timespec ts = { 0, 100000000 };
        nanosleep(&ts, NULL);
    }
    return -1;
}

static int64_t tokens(int i)
{
    return 1 + (i * 7) % MAX_T;
}

/* One allocation on the caller's GPU, registered as one CUDA region: per call a source of its
 * hidden rows, the rows the call reads, its routing, its output and where the output is copied. */
typedef struct arena {
    char *dev;
    moedc_region *region;
    size_t rows, route; /* bytes of one call's rows and of one call's ids (or weights) */
} arena;

static size_t at_src(const arena *a, int i)
{
    return (size_t)i * a->rows;
}
static size_t at_hidden(const arena *a, int i)
{
    return (N + (size_t)i) * a->rows;
}
static size_t at_out(const arena *a, int i)
{
    return (2 * N + (size_t)i) * a->rows;
}
static size_t at_copy(const arena *a, int i)
{
    return (3 * N + (size_t)i) * a->rows;
}
static size_t at_ids(const arena *a, int i)
{
    return 4 * N * a->rows + (size_t)i * a->route;
}
static size_t at_weights(const arena *a, int i)
{
    return 4 * N * a->rows + (N + (size_t)i) * a->route;
}

static int arena_open(moedc_session *s, arena *a)
{
    a->rows = (size_t)MAX_T * D * 2;
    a->route = (size_t)MAX_T * K * 4;
    const size_t bytes = 4 * N * a->rows + 2 * N * a->route;
    moedc_error err;
    if (cudaMalloc((void **)&a->dev, bytes) != cudaSuccess) return -1;
    uint16_t *x = malloc(a->rows);
    int32_t ids[MAX_T * K];
    float w[MAX_T * K];
    for (int i = 0; i < N; i++) {
        for (size_t j = 0; j < (size_t)MAX_T * D; j++)
            x[j] =
                (uint16_t)(0x3c00 + (((j + 977 * (size_t)i) * 2654435761u) >> 22) % 0x200 - 0x100);
        for (int t = 0; t < MAX_T; t++) {
            ids[t * K] = (t + i) % E;
            ids[t * K + 1] = (t + i + 3) % E;
            w[t * K] = 0.625f;
            w[t * K + 1] = 0.375f;
        }
        if (i == BAD) ids[K * (tokens(i) - 1)] = E;
        cudaMemcpy(a->dev + at_src(a, i), x, a->rows, cudaMemcpyHostToDevice);
        cudaMemcpy(a->dev + at_ids(a, i), ids, a->route, cudaMemcpyHostToDevice);
        cudaMemcpy(a->dev + at_weights(a, i), w, a->route, cudaMemcpyHostToDevice);
    }
    free(x);
    int rc = moedc_region_register_cuda(s, a->dev, bytes, &a->region, &err);
    CHECK_MSG(rc == 0, "registering the arena: %s", err.msg);
    return rc;
}

static moedc_ring_call call_of(const arena *a, int i)
{
    return (moedc_ring_call){ .layer = 0,
                              .dtype = MOEDC_BF16,
                              .tokens = tokens(i),
                              .d_model = D,
                              .k = K,
                              .hidden = { a->region, at_hidden(a, i) },
                              .expert_ids = { a->region, at_ids(a, i) },
                              .expert_weights = { a->region, at_weights(a, i) },
                              .output = { a->region, at_out(a, i) },
                              .timeout_s = 60,
                              .tag = (uint64_t)i };
}

/* Every call's inputs out of place and outputs cleared, so only stream order puts them right. */
static void scramble(const arena *a)
{
    cudaMemset(a->dev + at_hidden(a, 0), 0, N * a->rows);
    cudaMemset(a->dev + at_out(a, 0), 0xff, 2 * N * a->rows);
    cudaDeviceSynchronize();
}

static void copies_around(const arena *a, int i, cudaStream_t st, bool after)
{
    const size_t n = (size_t)tokens(i) * D * 2;
    if (!after)
        cudaMemcpyAsync(a->dev + at_hidden(a, i), a->dev + at_src(a, i), n,
                        cudaMemcpyDeviceToDevice, st);
    else
        cudaMemcpyAsync(a->dev + at_copy(a, i), a->dev + at_out(a, i), n, cudaMemcpyDeviceToDevice,
                        st);
}

static void check_copies(const arena *a, void *const want[N], const char *what, int replay)
{
    for (int i = 0; i < N; i++) {
        if (i == BAD) continue;
        const size_t n = (size_t)tokens(i) * D * 2;
        void *got = malloc(n);
        cudaMemcpy(got, a->dev + at_copy(a, i), n, cudaMemcpyDeviceToHost);
        CHECK_MSG(!memcmp(got, want[i], n), "%s (replay %d): call %d differs from the host call",
                  what, replay, i);
        free(got);
    }
}

static void check_device(moedc_session *s, int dev)
{
    cudaSetDevice(dev);
    cudaFree(0); /* the context current: the ring is page-locked for streams when it opens */
    arena a = { 0 };
    moedc_ring *ring = NULL;
    moedc_error err;
    if (arena_open(s, &a)) return;
    CHECK_MSG(moedc_ring_open(s, N + 2, &ring, &err) == 0, "ring: %s", err.msg);
    if (!ring) return;
    fprintf(stderr, "test_ring_stream: caller on GPU %d\n", dev);
    /* the host calls: the reference */
    void *want[N];
    for (int i = 0; i < N; i++) {
        const size_t n = (size_t)tokens(i) * D * 2;
        cudaMemcpy(a.dev + at_hidden(&a, i), a.dev + at_src(&a, i), n, cudaMemcpyDeviceToDevice);
        moedc_ring_call call = call_of(&a, i);
        moedc_ring_ticket t;
        moedc_ring_result res;
        CHECK_MSG(moedc_ring_start(ring, &call, &t, &err) == 0, "start %d: %s", i, err.msg);
        CHECK_EQ_INT(moedc_ring_wait(ring, &t, 60, &res, &err), 1);
        if (i == BAD)
            CHECK_MSG(res.status == MOEDC_EINVAL, "the bad host call: %d %s", res.status,
                      res.message);
        else
            CHECK_MSG(res.status == 0, "host call %d: %s", i, res.message);
        want[i] = malloc(n);
        cudaMemcpy(want[i], a.dev + at_out(&a, i), n, cudaMemcpyDeviceToHost);
    }
    const uint32_t failures0 = moedc_ring_failures(ring);
    /* one by one on a stream */
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    scramble(&a);
    for (int i = 0; i < N; i++) {
        if (i == BAD) continue;
        moedc_ring_call call = call_of(&a, i);
        moedc_ring_ticket t;
        moedc_ring_result res;
        copies_around(&a, i, st, false);
        CHECK_MSG(moedc_ring_enqueue(ring, &call, st, &t, &err) == 0, "enqueue %d: %s", i, err.msg);
        copies_around(&a, i, st, true);
        CHECK(cudaStreamSynchronize(st) == cudaSuccess);
        CHECK_EQ_INT(moedc_ring_stream_result(ring, &t, &res, &err), 1);
        CHECK_MSG(res.status == 0, "stream call %d: %s", i, res.message);
    }
    check_copies(&a, want, "one by one", 0);
    /* all N in one graph */
    moedc_ring_ticket captured[N];
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal) == cudaSuccess);
    for (int i = 0; i < N; i++) {
        moedc_ring_call call = call_of(&a, i);
        copies_around(&a, i, st, false);
        CHECK_MSG(moedc_ring_enqueue(ring, &call, st, &captured[i], &err) == 0, "capture %d: %s", i,
                  err.msg);
        copies_around(&a, i, st, true);
    }
    CHECK(cudaStreamEndCapture(st, &graph) == cudaSuccess);
    CHECK(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    for (int replay = 1; replay <= 3; replay++) {
        scramble(&a);
        CHECK(cudaGraphLaunch(exec, st) == cudaSuccess);
        CHECK(cudaStreamSynchronize(st) == cudaSuccess);
        check_copies(&a, want, "graph", replay);
        moedc_ring_result res;
        CHECK_EQ_INT(moedc_ring_stream_result(ring, &captured[BAD], &res, &err), 1);
        CHECK_MSG(res.status == MOEDC_EINVAL && res.message[0], "the bad call in the graph: %d %s",
                  res.status, res.message);
        CHECK_EQ_INT(moedc_ring_failures(ring) - failures0, (uint32_t)replay);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    for (int i = 0; i < N; i++) CHECK(moedc_ring_release(ring, &captured[i], &err) == 0);
    for (int i = 0; i < N; i++) { /* every slot serves host calls again */
        moedc_ring_call call = call_of(&a, (i + 1) % N == BAD ? 0 : (i + 1) % N);
        moedc_ring_ticket t;
        moedc_ring_result res;
        CHECK(moedc_ring_start(ring, &call, &t, &err) == 0);
        CHECK(moedc_ring_wait(ring, &t, 60, &res, &err) == 1 && res.status == 0);
    }
    cudaStreamDestroy(st);
    moedc_ring_close(ring);
    moedc_region_free(a.region, &err);
    cudaFree(a.dev);
    for (int i = 0; i < N; i++) free(want[i]);
}

int main(int argc, char **argv)
{
    int n_gpus = 0;
    if (cudaGetDeviceCount(&n_gpus) != cudaSuccess || n_gpus == 0) {
        fprintf(stderr, "test_ring_stream: no CUDA device: skipped\n");
        return CHECK_SKIP;
    }
    if (argc != 2) {
        fprintf(stderr, "usage: test_ring_stream PATH-TO-MOED\n");
        return 2;
    }
    char target[64];
    pid_t pid = start_moed(argv[1], target, sizeof target);
    moedc *c = NULL;
    moedc_session *s = NULL;
    moedc_error err;
    CHECK(moedc_connect(target, NULL, &c, &err) == 0);
    if (c && wait_serving(c) == 0 && moedc_session_open(c, &s, &err) == 0) {
        for (int dev = 0; dev < n_gpus && dev < 2; dev++) check_device(s, dev);
        moedc_session_close(s);
    } else {
        CHECK_MSG(0, "moed at %s did not serve", target);
    }
    moedc_close(c);
    kill(pid, SIGTERM);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "moed exited with status %d", status);
    return check_status("test_ring_stream");
}
