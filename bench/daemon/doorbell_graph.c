/*
 * doorbell-graph — what moed-load cannot measure of the doorbell: stream-ordered calls captured in
 * a CUDA graph, and the floor of the ring path. Runs against a moed on this host (--target).
 *
 *   --mode graph   each of --callers threads captures --calls stream-ordered calls of --tokens T
 *                  (each call's hidden, routing and output in CUDA regions of its own on GPU
 *                  --device) in one CUDA graph, as an engine captures a decode step's layers, and
 *                  replays it --replays times: the time of a replay (launch to synchronised) p50 /
 *                  p99, tokens/s over all callers, and every output of the last replay checked bit
 *                  for bit against the same calls made one by one from the host first.
 *   --mode floor   one caller, --requests calls of T tokens each way: from the host (start, wait)
 *                  and on a stream (enqueue, synchronise), p50 / p99 of each; against a layer so
 *                  small its kernel is negligible this is the ring path's own cost.
 *   --mode idle    --callers rings opened and left without calls for --seconds: prints "idle"
 *                  once they are open, so the daemon's CPU time can be read meanwhile.
 * The layer is the daemon's first (GetModel); with --layers all, call i of a graph goes to its
 * layer i mod n instead (a graph of n calls is a decode step through every layer, as an engine
 * whose MoE layers are all on this daemon makes it), the layers being of one shape. Calls carry
 * bf16 activations and uniform distinct expert choices. Prints one line and, with --json, the
 * figures as one JSON object. Exits 0 when every call succeeded and every check held, 1 otherwise,
 * 2 for bad usage.
 */
#include "moed_dtype.h"
#include "moed_opt.h"
#include "moed_time.h"
#include "moedclient.h"

#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct opts {
    const char *target, *mode, *layers, *json;
    int64_t tokens, calls, callers, replays, requests, device;
    double seconds;
} opts;

#define F(member) offsetof(opts, member)

static const moed_opt options[] = {
    MOED_OPT_STR_ROW("target", F(target), "ADDR", "127.0.0.1:50051", NULL, "the daemon"),
    MOED_OPT_CHOICE_ROW("mode", F(mode), "graph|floor|idle", "graph", NULL,
                        "graph: calls captured in a CUDA graph and replayed; floor: one call at a\n"
                        "time from the host and on a stream; idle: rings open, no calls"),
    MOED_OPT_CHOICE_ROW("layers", F(layers), "first|all", "first", NULL,
                        "graph: every call to the daemon's first layer, or call i to its layer\n"
                        "i mod n (a decode step through every layer with --calls n)"),
    MOED_OPT_I64_ROW("tokens", F(tokens), "T", 1, 1 << 20, "8", NULL, NULL, "tokens per call"),
    MOED_OPT_I64_ROW("calls", F(calls), "N", 1, 4096, "60", NULL, NULL, "graph: calls in a graph"),
    MOED_OPT_I64_ROW("callers", F(callers), "C", 1, 64, "1", NULL, NULL,
                     "graph: callers, each a thread with its ring, stream and graph"),
    MOED_OPT_I64_ROW("replays", F(replays), "R", 1, 1 << 20, "100", NULL, NULL,
                     "graph: timed replays per caller (after 3 untimed)"),
    MOED_OPT_I64_ROW("requests", F(requests), "N", 1, 1 << 24, "2000", NULL, NULL,
                     "floor: timed calls each way (after 100 untimed)"),
    MOED_OPT_I64_ROW("device", F(device), "N", 0, 1023, "0", NULL, NULL, "the callers' GPU"),
    MOED_OPT_NUM_ROW("seconds", F(seconds), "S", 0, 1e6, "3", NULL, NULL,
                     "idle: how long the rings stay open"),
    MOED_OPT_STR_ROW("json", F(json), "FILE", NULL, NULL, "the figures as JSON"),
    MOED_OPT_HELP_ROW("this text"),
};

static const moed_opt_cmd tool = {
    .head = "usage: doorbell-graph [options]\n\nTimes doorbell calls captured in a CUDA graph, or "
            "the ring path's floor.\n",
};

static const moed_opt_spec command_line = MOED_OPT_TOOL_SPEC("doorbell-graph", options, tool);

static opts o;
static moedc *conn;
static moedc_layer_info layer;             /* the shape every call has */
static const moedc_layer_info *layer_list; /* the layers calls go to, in turn */
static int n_layer_list;
static int failed; /* any call or check that went wrong (atomic) */

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "doorbell-graph: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
}

static double now_us(void)
{
    return (double)moed_now_ns() * 1e-3;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The q-quantile of v[0 .. n) (sorted here). */
static double quantile(double *v, size_t n, double q)
{
    qsort(v, n, sizeof *v, by_value);
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

/* ---- one caller's calls: every tensor in one CUDA region on the device ---- */

typedef struct caller {
    int id;
    moedc_session *s;
    moedc_ring *ring;
    char *dev;
    moedc_region *region;
    size_t rows; /* bytes a call's hidden (or output) takes in the region: out_bytes, rounded */
    size_t out_bytes; /* bytes of a call's output: what a call writes and is compared by */
    size_t route;
    int n;       /* calls */
    void **want; /* the host calls' outputs */
    double *times;
    size_t n_times;
    pthread_barrier_t *start;
} caller;

static moedc_ring_call call_of(const caller *c, int i)
{
    const size_t per = 2 * c->rows + 2 * c->route;
    const size_t at = (size_t)i * per;
    return (moedc_ring_call){ .layer = (uint32_t)layer_list[i % n_layer_list].index,
                              .dtype = MOEDC_BF16,
                              .tokens = o.tokens,
                              .d_model = layer.d_model,
                              .k = layer.top_k,
                              .hidden = { c->region, at },
                              .expert_ids = { c->region, at + c->rows },
                              .expert_weights = { c->region, at + c->rows + c->route },
                              .output = { c->region, at + c->rows + 2 * c->route },
                              .timeout_s = 60 };
}

static int caller_open(caller *c, int n_calls)
{
    moedc_error err;
    c->n = n_calls;
    c->out_bytes = c->rows = (size_t)o.tokens * (size_t)layer.d_model * 2;
    c->route = ((size_t)o.tokens * (size_t)layer.top_k * 4 + 255) / 256 * 256;
    c->rows = (c->rows + 255) / 256 * 256;
    const size_t per = 2 * c->rows + 2 * c->route, bytes = per * (size_t)n_calls;
    cudaSetDevice((int)o.device);
    if (cudaMalloc((void **)&c->dev, bytes) != cudaSuccess) {
        fail("cudaMalloc of the calls' tensors failed");
        return -1;
    }
    float *x = malloc((size_t)o.tokens * (size_t)layer.d_model * sizeof *x);
    void *xb = malloc(c->rows);
    int32_t *ids = malloc(c->route);
    float *w = malloc(c->route);
    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(c->id + 1);
    for (int i = 0; i < n_calls; i++) {
        for (int64_t j = 0; j < o.tokens * layer.d_model; j++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            x[j] = (float)((double)(rng >> 11) / 9007199254740992.0 * 2 - 1);
        }
        moed_from_f32(MOEDC_BF16, x, xb, (size_t)(o.tokens * layer.d_model));
        for (int64_t t = 0; t < o.tokens; t++) /* distinct experts, spread over the layer */
            for (int j = 0; j < layer.top_k; j++) {
                ids[t * layer.top_k + j] =
                    (int32_t)((t * 7 + i * 3 + j * (layer.n_experts / layer.top_k + 1)) %
                              layer.n_experts);
                w[t * layer.top_k + j] = 1.0f / (float)layer.top_k;
            }
        char *at = c->dev + (size_t)i * per;
        cudaMemcpy(at, xb, c->rows, cudaMemcpyHostToDevice);
        cudaMemcpy(at + c->rows, ids, c->route, cudaMemcpyHostToDevice);
        cudaMemcpy(at + c->rows + c->route, w, c->route, cudaMemcpyHostToDevice);
    }
    free(x);
    free(xb);
    free(ids);
    free(w);
    if (moedc_session_open(conn, &c->s, &err) ||
        moedc_region_register_cuda(c->s, c->dev, bytes, &c->region, &err) ||
        moedc_ring_open(c->s, (uint32_t)n_calls, &c->ring, &err)) {
        fail("setting up a caller: %s", err.msg);
        return -1;
    }
    return 0;
}

static void caller_close(caller *c)
{
    moedc_session_close(c->s); /* the ring, the region */
    cudaFree(c->dev);
    for (int i = 0; c->want && i < c->n; i++) free(c->want[i]);
    free(c->want);
    free(c->times);
}

/* Call i from the host; its status (0 ok). */
static int host_call(caller *c, int i)
{
    moedc_ring_call call = call_of(c, i);
    moedc_ring_ticket t;
    moedc_ring_result res;
    moedc_error err;
    if (moedc_ring_start(c->ring, &call, &t, &err)) {
        fail("start: %s", err.msg);
        return -1;
    }
    if (moedc_ring_wait(c->ring, &t, 60, &res, &err) != 1 || res.status) {
        fail("a host call failed: %s", res.status ? res.message : "no completion in 60 s");
        return -1;
    }
    return 0;
}

/* ---- graph ---- */

static void *graph_caller(void *arg)
{
    caller *c = arg;
    moedc_error err;
    cudaSetDevice((int)o.device);
    c->want = calloc((size_t)c->n, sizeof *c->want);
    for (int i = 0; i < c->n; i++) { /* the reference: one by one from the host */
        if (host_call(c, i)) break;
        moedc_ring_call call = call_of(c, i);
        c->want[i] = malloc(c->out_bytes);
        cudaMemcpy(c->want[i], c->dev + call.output.offset, c->out_bytes, cudaMemcpyDeviceToHost);
    }
    cudaStream_t st;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    moedc_ring_ticket *tickets = calloc((size_t)c->n, sizeof *tickets);
    /* Thread-local: the other callers' threads make their reference calls and copies meanwhile,
     * which a global capture would refuse them (and end this one). */
    cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
    for (int i = 0; i < c->n; i++) {
        moedc_ring_call call = call_of(c, i);
        if (moedc_ring_enqueue(c->ring, &call, st, &tickets[i], &err)) fail("enqueue: %s", err.msg);
    }
    cudaError_t ce = cudaStreamEndCapture(st, &graph);
    if (ce == cudaSuccess) ce = cudaGraphInstantiate(&exec, graph, 0);
    if (ce != cudaSuccess) {
        fail("capturing the graph failed: %s", cudaGetErrorString(ce));
        pthread_barrier_wait(c->start);
        return NULL;
    }
    for (int i = 0; i < c->n; i++) /* the graph's outputs must be its own */
        cudaMemset(c->dev + call_of(c, i).output.offset, 0xff, c->rows);
    const uint32_t failures = moedc_ring_failures(c->ring);
    for (int i = 0; i < 3; i++) cudaGraphLaunch(exec, st);
    cudaStreamSynchronize(st);
    c->times = malloc((size_t)o.replays * sizeof *c->times);
    pthread_barrier_wait(c->start);
    for (int64_t r = 0; r < o.replays; r++) {
        double t0 = now_us();
        cudaGraphLaunch(exec, st);
        if (cudaStreamSynchronize(st) != cudaSuccess) fail("a replay failed");
        c->times[c->n_times++] = now_us() - t0;
    }
    if (moedc_ring_failures(c->ring) != failures) fail("calls of the graph failed");
    void *got = malloc(c->out_bytes);
    for (int i = 0; i < c->n; i++) {
        cudaMemcpy(got, c->dev + call_of(c, i).output.offset, c->out_bytes, cudaMemcpyDeviceToHost);
        if (!c->want[i] || memcmp(got, c->want[i], c->out_bytes))
            fail("call %d: the graph's output differs from the same call made from the host", i);
    }
    free(got);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(st);
    for (int i = 0; i < c->n; i++) moedc_ring_release(c->ring, &tickets[i], &err);
    free(tickets);
    return NULL;
}

static int run_graph(FILE *json)
{
    const int n = (int)o.callers;
    caller *cs = calloc((size_t)n, sizeof *cs);
    pthread_t *th = calloc((size_t)n, sizeof *th);
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)n + 1);
    for (int i = 0; i < n; i++) {
        cs[i].id = i;
        cs[i].start = &start;
        if (caller_open(&cs[i], (int)o.calls)) return 1;
    }
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, graph_caller, &cs[i]);
    pthread_barrier_wait(&start);
    double t0 = now_us();
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    double wall = now_us() - t0;
    size_t total = 0;
    for (int i = 0; i < n; i++) total += cs[i].n_times;
    double *all = malloc((total ? total : 1) * sizeof *all);
    size_t k = 0;
    for (int i = 0; i < n; i++)
        for (size_t j = 0; j < cs[i].n_times; j++) all[k++] = cs[i].times[j];
    double p50 = total ? quantile(all, total, 0.5) : 0,
           p99 = total ? quantile(all, total, 0.99) : 0;
    double tok_s = (double)total * (double)o.calls * (double)o.tokens / (wall / 1e6);
    printf("graph  T=%lld  %lld calls  %d layers  %lld callers  replay p50 %.3f ms  p99 %.3f ms  "
           "(%.1f us a "
           "call)  %.0f tokens/s  %s\n",
           (long long)o.tokens, (long long)o.calls, n_layer_list, (long long)o.callers, p50 / 1e3,
           p99 / 1e3, p50 / (double)o.calls, tok_s, failed ? "FAILED" : "outputs as from the host");
    if (json)
        fprintf(json,
                "{\"mode\": \"graph\", \"tokens\": %lld, \"calls\": %lld, \"layers\": %d, "
                "\"callers\": %lld, "
                "\"device\": %lld, \"replays\": %zu, \"p50_ms\": %.6f, \"p99_ms\": %.6f, "
                "\"tokens_per_s\": %.1f, \"verified\": %s}\n",
                (long long)o.tokens, (long long)o.calls, n_layer_list, (long long)o.callers,
                (long long)o.device, total, p50 / 1e3, p99 / 1e3, tok_s, failed ? "false" : "true");
    free(all);
    for (int i = 0; i < n; i++) caller_close(&cs[i]);
    pthread_barrier_destroy(&start);
    free(cs);
    free(th);
    return failed;
}

/* ---- floor ---- */

static int run_floor(FILE *json)
{
    caller c = { 0 };
    moedc_error err;
    if (caller_open(&c, 1)) return 1;
    const size_t n = (size_t)o.requests;
    double *host = malloc(n * sizeof *host), *stream = malloc(n * sizeof *stream);
    for (int i = 0; i < 100; i++) host_call(&c, 0);
    for (size_t i = 0; i < n && !failed; i++) {
        double t0 = now_us();
        host_call(&c, 0);
        host[i] = now_us() - t0;
    }
    cudaStream_t st;
    cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    moedc_ring_call call = call_of(&c, 0);
    for (size_t i = 0; i < n + 100 && !failed; i++) {
        moedc_ring_ticket t;
        moedc_ring_result res;
        double t0 = now_us();
        if (moedc_ring_enqueue(c.ring, &call, st, &t, &err)) fail("enqueue: %s", err.msg);
        cudaStreamSynchronize(st);
        if (i >= 100) stream[i - 100] = now_us() - t0;
        if (moedc_ring_stream_result(c.ring, &t, &res, &err) != 1 || res.status)
            fail("a stream call failed: %s", res.message);
    }
    cudaStreamDestroy(st);
    double h50 = quantile(host, n, 0.5), h99 = quantile(host, n, 0.99);
    double s50 = quantile(stream, n, 0.5), s99 = quantile(stream, n, 0.99);
    printf("floor  T=%lld  host start/wait p50 %.1f us  p99 %.1f us  stream enqueue+sync p50 %.1f "
           "us  p99 %.1f us\n",
           (long long)o.tokens, h50, h99, s50, s99);
    if (json)
        fprintf(json,
                "{\"mode\": \"floor\", \"tokens\": %lld, \"device\": %lld, \"requests\": %zu, "
                "\"host_p50_us\": %.2f, \"host_p99_us\": %.2f, \"stream_p50_us\": %.2f, "
                "\"stream_p99_us\": %.2f}\n",
                (long long)o.tokens, (long long)o.device, n, h50, h99, s50, s99);
    free(host);
    free(stream);
    caller_close(&c);
    return failed;
}

/* ---- idle ---- */

static int run_idle(void)
{
    const int n = (int)o.callers;
    moedc_session **s = calloc((size_t)n, sizeof *s);
    moedc_error err;
    int rc = 0;
    for (int i = 0; i < n && !rc; i++) {
        moedc_ring *ring;
        rc = moedc_session_open(conn, &s[i], &err) || moedc_ring_open(s[i], 64, &ring, &err);
    }
    if (rc) {
        fail("opening the rings: %s", err.msg);
    } else {
        printf("idle: %d rings open\n", n);
        fflush(stdout);
        moed_sleep_s(o.seconds);
    }
    for (int i = 0; i < n; i++) moedc_session_close(s[i]); /* and their rings */
    free(s);
    return failed;
}

int main(int argc, char **argv)
{
    int rc;
    moed_opt_parsed p;
    if (!moed_opt_parse(&command_line, argc, argv, &o, &p, &rc)) return rc;
    moedc_error err;
    moedc_model_info info;
    if (moedc_connect(o.target, NULL, &conn, &err) || moedc_info(conn, &info, &err)) {
        fprintf(stderr, "doorbell-graph: %s: %s\n", o.target, err.msg);
        return 1;
    }
    if (!info.n_layers) {
        fprintf(stderr, "doorbell-graph: %s serves no layer\n", o.target);
        return 1;
    }
    layer = info.layers[0];
    layer_list = info.layers;
    n_layer_list = strcmp(o.layers, "all") ? 1 : info.n_layers;
    for (int i = 1; i < n_layer_list; i++)
        if (info.layers[i].d_model != layer.d_model || info.layers[i].top_k != layer.top_k ||
            info.layers[i].n_experts != layer.n_experts) {
            fprintf(stderr,
                    "doorbell-graph: --layers all needs layers of one shape: layer %u is d_model "
                    "%u, top_k %u, %u experts, layer %u d_model %u, top_k %u, %u experts\n",
                    info.layers[i].index, info.layers[i].d_model, info.layers[i].top_k,
                    info.layers[i].n_experts, layer.index, layer.d_model, layer.top_k,
                    layer.n_experts);
            return 2;
        }
    cudaSetDevice((int)o.device);
    cudaFree(0); /* the context current: rings are page-locked for streams when they open */
    FILE *json = o.json ? fopen(o.json, "w") : NULL;
    if (o.json && !json) {
        fprintf(stderr, "doorbell-graph: cannot write %s\n", o.json);
        return 1;
    }
    rc = !strcmp(o.mode, "graph")   ? run_graph(json)
         : !strcmp(o.mode, "floor") ? run_floor(json)
                                    : run_idle();
    if (json) fclose(json);
    moedc_model_info_free(&info);
    moedc_close(conn);
    return rc ? 1 : 0;
}
