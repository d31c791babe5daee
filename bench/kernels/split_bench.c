/*
 * split_bench — expert parallelism measured (moe-split-bench): one layer whole on the first listed
 * device against the same layer split over the listed devices (moed --expert-parallel), both
 * through the CUDA backend as the daemon drives it, and the peer bandwidth between the first two
 * GPUs beside it, in the same run. x and y lie where `--io` says: on the first GPU (`device`, the
 * default: a caller's CUDA region or doorbell tensors, read and written in place, so the wire and
 * the host copies are not what is measured) or in pinned host memory (`host`, an inline call's
 * staging).
 *
 * The command line is one moed_opt table (`moe-split-bench --help` prints it).
 *
 * The layer is the synthetic SPEC (default: DeepSeek-V3's shape, d 7168, ff 2048, 256 experts,
 * top-8, one shared expert of 2048), routed by each of --routing's rules (moe-bench's: uniform, 8
 * distinct experts a token, by default; zipf, hot, empty), and for each rule also split as placed
 * by the measured load of another draw of T tokens by that rule, as one launch (moed
 * --expert-load: the placement a skewed routing gets from its own /metrics), then re-placed by
 * that load with up to --replicas copies of hot experts (moed_backend_replace_layer, what moed
 * --rebalance does while serving). For each rule and T:
 * the median milliseconds of a forward whole and split, tokens/s, the speedup, the time of x's
 * and y's host copies alone on the first GPU (what `--io host` adds to both layouts: the split's
 * own traffic is device to device), the splits' largest per-token difference from the whole layer
 * (a token's largest error over its own largest magnitude: docs/cuda.md says why a split sums in
 * another order) and whether two split runs gave the same bits. Peer bandwidth: cudaMemcpyPeerAsync
 * of 256 MiB each way and both ways at once (peer access enabled where the GPUs allow it; "staged"
 * where not, the driver copying through the host), beside a copy within the first GPU. Prints a
 * markdown table; --json writes the figures.
 */
#include "bench.h"
#include "moed_opt.h"
#include "cuda_backend.h"
#include "moed_dtype.h"
#include "moed_route.h"
#include "moed_synth.h"
#include "moed_time.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DSV3                                                                                       \
    "layers=1,d=7168,ff=2048,experts=256,topk=8,act=swiglu,dtype=bf16,seed=1,shared=1,"            \
    "shared_ff=2048"
#define MAX_T        16
#define MAX_ROUTINGS 4
#define PEER_MIB     256

typedef struct args {
    const char *spec, *tokens, *devices, *io, *routing, *json;
    double min_ms;
    int64_t replicas;
} args;

#define F(x) offsetof(args, x)
static const moed_opt options[] = {
    MOED_OPT_STR_ROW(
        "spec", F(spec), "SPEC", DSV3, NULL,
        "the synthetic layer (moed --synthetic's syntax); the default is DeepSeek-V3's\n"
        "shape with one shared expert"),
    MOED_OPT_STR_ROW("tokens", F(tokens), "LIST", "8,4096", NULL, "batch sizes T, at most 16"),
    MOED_OPT_STR_ROW("devices", F(devices), "LIST", "0,1", NULL,
                     "GPUs: the layer whole on the first, split over all (two or more)"),
    MOED_OPT_STR_ROW("routing", F(routing), "LIST", "uniform", NULL,
                     "routings, each timed at every T: uniform, zipf, hot, empty (moe-bench's);\n"
                     "for each the split is also timed placed by that routing's measured load\n"
                     "(moed --expert-load)"),
    MOED_OPT_I64_ROW("replicas", F(replicas), "N", 0, MOED_PLACE_MAX_REPLICAS, "8", NULL, NULL,
                     "for each routing, the load-placed split re-placed with up to N\n"
                     "copies of hot experts (0: not timed)"),
    MOED_OPT_CHOICE_ROW("io", F(io), "device|host", "device", NULL,
                        "where x and y lie: device (the first GPU, read and written in place) or\n"
                        "host (pinned memory, copied in and out)"),
    MOED_OPT_NUM_ROW("min-ms", F(min_ms), "MS", 1e-3, 1e7, "300", "give milliseconds > 0", NULL,
                     "time each figure for at least MS milliseconds"),
    MOED_OPT_STR_ROW("json", F(json), "FILE", NULL, NULL, "write the figures here"),
    MOED_OPT_HELP_ROW("this text"),
};
#undef F

static const moed_opt_cmd tool = {
    .head = "usage: moe-split-bench [options]\n"
            "\n"
            "A layer whole on one GPU against the same layer split over several, through the\n"
            "CUDA backend, and the peer bandwidth between the first two GPUs.\n",
    .tail = "exit codes: 0 done; 1 a run failed; 2 bad usage; 77 too few GPUs here\n",
};

static const moed_opt_spec command_line = MOED_OPT_TOOL_SPEC("moe-split-bench", options, tool);

static double now_ms(void)
{
    return (double)moed_now_ns() * 1e-6;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of fn(ctx) in ms over at least min_ms and 5 runs (after 2 not counted); -1 on failure. */
static double time_ms(int (*fn)(void *), void *ctx, double min_ms)
{
    double t[512];
    int n = 0;
    if (fn(ctx) || fn(ctx)) return -1;
    for (double spent = 0; n < 512 && (n < 5 || spent < min_ms); n++) {
        const double t0 = now_ms();
        if (fn(ctx)) return -1;
        t[n] = now_ms() - t0;
        spent += t[n];
    }
    qsort(t, (size_t)n, sizeof t[0], cmp_double);
    return t[n / 2];
}

/* ---- peer bandwidth -------------------------------------------------------------------------- */

typedef struct peer_run {
    int a, b, both; /* a→b, and b→a at once when both */
    void *pa, *pb, *qa, *qb;
    cudaStream_t sa, sb;
} peer_run;

static int peer_once(void *ctx)
{
    peer_run *p = ctx;
    const size_t bytes = (size_t)PEER_MIB << 20;
    if (p->a == p->b) {
        cudaSetDevice(p->a);
        cudaMemcpyAsync(p->qa, p->pa, bytes, cudaMemcpyDeviceToDevice, p->sa);
    } else {
        cudaMemcpyPeerAsync(p->pb, p->b, p->pa, p->a, bytes, p->sa);
        if (p->both) cudaMemcpyPeerAsync(p->qa, p->a, p->qb, p->b, bytes, p->sb);
    }
    return cudaStreamSynchronize(p->sa) != cudaSuccess ||
           cudaStreamSynchronize(p->sb) != cudaSuccess;
}

/* GB/s of a → b, b → a, both at once (the sum), and of a copy within a (read + written). */
static void peer_bandwidth(int a, int b, double gbs[4], const char **mode)
{
    int can = 0;
    peer_run p = { .a = a, .b = b };
    *mode = "same GPU";
    if (a != b && cudaDeviceCanAccessPeer(&can, a, b) == cudaSuccess && can) {
        cudaSetDevice(a);
        cudaDeviceEnablePeerAccess(b, 0);
        cudaSetDevice(b);
        cudaDeviceEnablePeerAccess(a, 0);
        cudaGetLastError();
        *mode = "peer access";
    } else if (a != b) {
        *mode = "staged (no peer access)";
    }
    const size_t bytes = (size_t)PEER_MIB << 20;
    cudaSetDevice(a);
    cudaMalloc(&p.pa, bytes);
    cudaMalloc(&p.qa, bytes);
    cudaStreamCreate(&p.sa);
    cudaSetDevice(b);
    cudaMalloc(&p.pb, bytes);
    cudaMalloc(&p.qb, bytes);
    cudaStreamCreate(&p.sb);
    const double gb = (double)bytes / 1e9;
    for (int k = 0; k < 4; k++) gbs[k] = 0;
    if (a != b) {
        double ms = time_ms(peer_once, &p, 100);
        gbs[0] = ms > 0 ? gb / (ms / 1e3) : 0;
        p.a = b, p.b = a;
        void *t = p.pa;
        p.pa = p.pb, p.pb = t;
        ms = time_ms(peer_once, &p, 100);
        gbs[1] = ms > 0 ? gb / (ms / 1e3) : 0;
        p.pb = p.pa, p.pa = t, p.a = a, p.b = b, p.both = 1;
        ms = time_ms(peer_once, &p, 100);
        gbs[2] = ms > 0 ? 2 * gb / (ms / 1e3) : 0;
    }
    peer_run local = { .a = a, .b = a, .pa = p.pa, .qa = p.qa, .sa = p.sa, .sb = p.sa };
    const double ms = time_ms(peer_once, &local, 100);
    gbs[3] = ms > 0 ? 2 * gb / (ms / 1e3) : 0;
    void *bufs[] = { p.pa, p.qa, p.pb, p.qb };
    for (int k = 0; k < 4; k++) cudaFree(bufs[k]);
    cudaStreamDestroy(p.sa);
    cudaStreamDestroy(p.sb);
}

/* ---- the layer, whole and split ------------------------------------------------------------ */

typedef struct fwd {
    moed_backend *b;
    moed_job job;
} fwd;

static int fwd_once(void *ctx)
{
    fwd *f = ctx;
    moed_error err;
    const int rc = moed_backend_forward(f->b, 0, &f->job, &err);
    if (rc) fprintf(stderr, "moe-split-bench: forward: %s\n", err.msg);
    return rc;
}

typedef struct copies {
    void *dev, *host;
    size_t bytes;
} copies;

static int copies_once(void *ctx)
{
    copies *c = ctx;
    return cudaMemcpy(c->dev, c->host, c->bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
           cudaMemcpy(c->host, c->dev, c->bytes, cudaMemcpyDeviceToHost) != cudaSuccess;
}

static moed_backend *open_on(const moed_layer *l, const int *dev, int n, int64_t T)
{
    moed_backend_config cfg = {
        .streams = 1, .devices = dev, .n_devices = n, .max_tokens = T, .expert_parallel = n > 1
    };
    moed_backend *b = NULL;
    moed_error err;
    int rc = moed_backend_cuda_open(&cfg, &b, &err);
    if (!rc) rc = moed_backend_load_layer(b, 0, l, &err);
    if (!rc) rc = moed_backend_start(b, &err);
    if (rc) {
        fprintf(stderr, "moe-split-bench: %s\n", err.msg);
        moed_backend_destroy(b);
        return NULL;
    }
    return b;
}

/* T tokens of k distinct experts each by the routing (bench.h), random weights; seed picks the
 * draw (a placement measures one draw and is timed on another). */
static int make_route(const moed_layer_info *li, const char *routing, uint64_t seed, int64_t T,
                      moed_route *r)
{
    const int k = li->top_k, E = li->n_experts;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(T * k));
    float *w = malloc(sizeof(float) * (size_t)(T * k));
    uint64_t s = seed;
    for (int64_t t = 0; t < T; t++) {
        bench_choose(routing, E, k, &s, ids + t * k);
        for (int j = 0; j < k; j++) {
            s = moed_splitmix64(s);
            w[t * k + j] = (float)((s >> 40) % 1000 + 1) / 1000.0f;
        }
    }
    moed_error err;
    const int rc = moed_route_from_choice(r, ids, w, T, k, E, &err);
    free(ids);
    free(w);
    return rc;
}

typedef struct row {
    const char *routing;
    int64_t T;
    double whole_ms, split_ms, copy_ms;
    double load_ms;    /* the split placed by the routing's measured load; -1 where not timed */
    double copies_ms;  /* that split re-placed with copies of hot experts; -1 where not timed */
    int n_copies;      /* the copies it made */
    double worst;      /* the split's largest per-token error/magnitude against the whole layer */
    int deterministic; /* two split runs gave the same bits */
} row;

/* The layer whole (bw) and split (bs); host buffers for the largest T, and (--io device) x and
 * both outputs on the first GPU. */
typedef struct bench {
    moed_backend *bw, *bs, *bl; /* bl: the split placed by a routing's measured load, or NULL */
    uint16_t *x, *yw, *ys, *ys2;
    void *dx, *dyw, *dys;
    int d, dev0, on_device;
} bench;

/* The job of T tokens whose output goes to y (host) or dy (the first GPU). */
static moed_job job_of(const bench *B, int64_t T, const moed_route *route, void *y, void *dy,
                       moed_part *lone)
{
    if (!B->on_device)
        return (moed_job){ .dtype = MOED_BF16, .T = T, .x = B->x, .y = y, .route = route };
    *lone = (moed_part){ T, B->dx, B->dev0, dy, B->dev0, NULL };
    return (moed_job){ .dtype = MOED_BF16, .T = T, .parts = lone, .n_parts = 1, .route = route };
}

/* A token's largest |a - b| over its own largest |b|, the worst over T tokens of d (bf16). */
static double worst_token(const uint16_t *a, const uint16_t *b, int64_t T, int d)
{
    double worst = 0;
    float *fa = malloc(sizeof(float) * (size_t)d), *fb = malloc(sizeof(float) * (size_t)d);
    for (int64_t t = 0; t < T; t++) {
        moed_to_f32(MOED_BF16, a + t * d, fa, (size_t)d);
        moed_to_f32(MOED_BF16, b + t * d, fb, (size_t)d);
        double err = 0, mag = 0;
        for (int c = 0; c < d; c++) {
            const double e = fabs((double)fa[c] - fb[c]), m = fabs((double)fb[c]);
            err = e > err || e != e ? e : err;
            mag = m > mag ? m : mag;
        }
        const double r = err != err ? INFINITY : mag > 0 ? err / mag : err;
        worst = r > worst ? r : worst;
    }
    free(fa);
    free(fb);
    return worst;
}

/* The outputs of the last runs into host memory, where --io device left them on the GPU. */
static void outputs_home(const bench *B, size_t bytes)
{
    if (!B->on_device) return;
    cudaSetDevice(B->dev0);
    cudaMemcpy(B->yw, B->dyw, bytes, cudaMemcpyDeviceToHost);
    cudaMemcpy(B->ys, B->dys, bytes, cudaMemcpyDeviceToHost);
}

/* sp timed, its outputs brought home and its worst token against the whole layer's kept in *worst
 * where worse: the milliseconds, or < 0 when a run failed. */
static double time_worst(bench *B, fwd *sp, int64_t T, double min_ms, double *worst)
{
    const double ms = time_ms(fwd_once, sp, min_ms);
    outputs_home(B, (size_t)T * B->d * 2);
    const double w = worst_token(B->ys, B->yw, T, B->d);
    *worst = w > *worst || w != w ? w : *worst;
    return ms;
}

/* The load-placed split sp re-placed by `load` with up to `replicas` copies of hot experts, timed
 * into out (copies_ms -1 where the re-placement did not change it). Non-zero on a failed run. */
static int time_copies(bench *B, fwd *sp, const double *load, int replicas, double min_ms,
                       int64_t T, row *out)
{
    const moed_replace_req req = { load, 1, replicas, 0 };
    moed_replace_result res;
    moed_layer_place p;
    moed_error err;
    out->n_copies = 0;
    if (moed_backend_replace_layer(B->bl, 0, &req, &res, &err)) {
        fprintf(stderr, "moe-split-bench: re-placing with copies: %s\n", err.msg);
        return 0; /* the column says not timed; the rest stands */
    }
    if (!res.changed || moed_backend_layer_place(B->bl, 0, &p)) return 0;
    out->n_copies = p.n_replicas;
    out->copies_ms = time_worst(B, sp, T, min_ms, &out->worst);
    return out->copies_ms < 0;
}

/* One T: both backends on the same x and route. */
static int run_T(bench *B, const moed_layer_info *li, const char *routing, int64_t T, double min_ms,
                 const double *load, int replicas, row *out)
{
    const size_t bytes = (size_t)T * B->d * 2;
    moed_route route = { 0 };
    if (make_route(li, routing, 7, T, &route)) return 1;
    moed_part pw, ps;
    fwd w = { B->bw, job_of(B, T, &route, B->yw, B->dyw, &pw) },
        sp = { B->bs, job_of(B, T, &route, B->ys, B->dys, &ps) };
    copies c = { B->dx, B->x, bytes };
    out->routing = routing;
    out->T = T;
    out->whole_ms = time_ms(fwd_once, &w, min_ms);
    out->split_ms = time_ms(fwd_once, &sp, min_ms);
    outputs_home(B, bytes);
    memcpy(B->ys2, B->ys, bytes);
    int again = fwd_once(&sp);
    outputs_home(B, bytes);
    out->deterministic = !again && !memcmp(B->ys2, B->ys, bytes);
    out->worst = worst_token(B->ys, B->yw, T, B->d);
    out->load_ms = -1;
    if (B->bl && !again) { /* the same routing's split placed by its measured load */
        sp.b = B->bl;
        out->load_ms = time_worst(B, &sp, T, min_ms, &out->worst);
        again = out->load_ms < 0;
    }
    out->copies_ms = -1;
    if (B->bl && !again && replicas) again = time_copies(B, &sp, load, replicas, min_ms, T, out);
    out->copy_ms = time_ms(copies_once, &c, min_ms / 4);
    moed_route_free(&route);
    return out->whole_ms < 0 || out->split_ms < 0 || out->copy_ms < 0 || again;
}

static int bench_open(bench *B, const moed_layer *l, const int *dev, int n, int64_t max_T,
                      bool on_device)
{
    const size_t bytes = (size_t)max_T * l->info.d_model * 2;
    memset(B, 0, sizeof *B);
    B->d = l->info.d_model;
    B->dev0 = dev[0];
    B->on_device = on_device;
    if (!(B->bw = open_on(l, dev, 1, max_T)) || !(B->bs = open_on(l, dev, n, max_T))) return 1;
    B->x = moed_backend_host_alloc(B->bw, bytes);
    B->yw = moed_backend_host_alloc(B->bw, bytes);
    B->ys = moed_backend_host_alloc(B->bw, bytes);
    B->ys2 = malloc(bytes);
    cudaSetDevice(dev[0]);
    if (!B->x || !B->yw || !B->ys || !B->ys2 || cudaMalloc(&B->dx, bytes) != cudaSuccess ||
        cudaMalloc(&B->dyw, bytes) != cudaSuccess || cudaMalloc(&B->dys, bytes) != cudaSuccess)
        return 1;
    uint64_t s = 3;
    for (size_t i = 0; i < bytes / 2; i++) {
        s = moed_splitmix64(s);
        const float v = (float)((double)(s >> 11) / 9007199254740992.0 * 2 - 1);
        moed_from_f32(MOED_BF16, &v, &B->x[i], 1);
    }
    return cudaMemcpy(B->dx, B->x, bytes, cudaMemcpyHostToDevice) != cudaSuccess;
}

static void bench_close(bench *B)
{
    cudaFree(B->dx);
    cudaFree(B->dyw);
    cudaFree(B->dys);
    free(B->ys2);
    if (B->bw) {
        moed_backend_host_free(B->bw, B->x);
        moed_backend_host_free(B->bw, B->yw);
        moed_backend_host_free(B->bw, B->ys);
    }
    moed_backend_destroy(B->bw);
    moed_backend_destroy(B->bs);
}

static void report(const args *a, const int *dev, int n, const row *rows, int nr,
                   const double gbs[4], const char *mode)
{
    printf("x and y in %s\n\n",
           a->io[0] == 'd' ? "device memory of the first GPU" : "pinned host memory");
    printf("| routing | T | whole on GPU %d (ms) | split over %d devices (ms) | speedup | split "
           "placed by measured load (ms) | speedup | re-placed with copies of hot experts (ms) | "
           "copies | speedup | tokens/s whole | tokens/s split | x and y host "
           "copies (ms) | splits vs whole, worst token | split deterministic |\n",
           dev[0], n);
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nr; i++) {
        char lms[32] = "-", lx[32] = "-", cms[32] = "-", cn[16] = "-", cx[32] = "-";
        if (rows[i].load_ms > 0) {
            snprintf(lms, sizeof lms, "%.3f", rows[i].load_ms);
            snprintf(lx, sizeof lx, "%.2fx", rows[i].whole_ms / rows[i].load_ms);
        }
        if (rows[i].copies_ms > 0) {
            snprintf(cms, sizeof cms, "%.3f", rows[i].copies_ms);
            snprintf(cn, sizeof cn, "%d", rows[i].n_copies);
            snprintf(cx, sizeof cx, "%.2fx", rows[i].whole_ms / rows[i].copies_ms);
        }
        printf("| %s | %lld | %.3f | %.3f | %.2fx | %s | %s | %s | %s | %s | %.0f | %.0f | %.3f | "
               "%.1e | %s |\n",
               rows[i].routing, (long long)rows[i].T, rows[i].whole_ms, rows[i].split_ms,
               rows[i].whole_ms / rows[i].split_ms, lms, lx, cms, cn, cx,
               rows[i].T / (rows[i].whole_ms / 1e3), rows[i].T / (rows[i].split_ms / 1e3),
               rows[i].copy_ms, rows[i].worst, rows[i].deterministic ? "yes" : "NO");
    }
    printf("\nPeer bandwidth GPU %d <-> GPU %d (%s, %d MiB copies): %.1f GB/s %d->%d, %.1f GB/s "
           "%d->%d, %.1f GB/s both ways at once; within GPU %d: %.1f GB/s (read + written)\n",
           dev[0], dev[1], mode, PEER_MIB, gbs[0], dev[0], dev[1], gbs[1], dev[1], dev[0], gbs[2],
           dev[0], gbs[3]);
    if (!a->json) return;
    FILE *f = fopen(a->json, "w");
    if (!f) return;
    fprintf(f,
            "{\"spec\": \"%s\", \"devices\": \"%s\", \"io\": \"%s\", \"peer\": {\"mode\": \"%s\", "
            "\"ab_gbs\": %.2f, "
            "\"ba_gbs\": %.2f, \"both_gbs\": %.2f, \"local_gbs\": %.2f}, \"rows\": [",
            a->spec, a->devices, a->io, mode, gbs[0], gbs[1], gbs[2], gbs[3]);
    for (int i = 0; i < nr; i++)
        fprintf(f,
                "%s{\"routing\": \"%s\", \"T\": %lld, \"whole_ms\": %.4f, \"split_ms\": %.4f, "
                "\"load_split_ms\": %.4f, \"copies_split_ms\": %.4f, \"copies\": %d, "
                "\"copy_ms\": %.4f, \"worst_token\": %.3e, \"deterministic\": %s}",
                i ? ", " : "", rows[i].routing, (long long)rows[i].T, rows[i].whole_ms,
                rows[i].split_ms, rows[i].load_ms, rows[i].copies_ms, rows[i].n_copies,
                rows[i].copy_ms, rows[i].worst, rows[i].deterministic ? "true" : "false");
    fprintf(f, "]}\n");
    fclose(f);
}

int main(int argc, char **argv)
{
    args a = { 0 };
    moed_opt_parsed parsed;
    int rc, dev[16], n = 0, count = 0;
    if (!moed_opt_parse(&command_line, argc, argv, &a, &parsed, &rc)) return rc;
    for (const char *p = a.devices; n < 16 && *p; p += strcspn(p, ","), p += *p == ',')
        dev[n++] = atoi(p);
    if (n < 2) return moed_opt_usage(&command_line, "--devices needs two or more entries");
    moed_synth_spec spec;
    moed_error err;
    if (moed_synth_parse(a.spec, &spec, &err))
        return moed_opt_usage(&command_line, "--spec: %s", err.msg);
    char routings[MAX_ROUTINGS][16];
    int nrt = 0;
    for (const char *p = a.routing; nrt < MAX_ROUTINGS && *p; p += strcspn(p, ","), p += *p == ',')
        snprintf(routings[nrt++], sizeof routings[0], "%.*s", (int)strcspn(p, ","), p);
    for (int r = 0; r < nrt; r++)
        if (strcmp(routings[r], "uniform") && strcmp(routings[r], "zipf") &&
            strcmp(routings[r], "hot") && strcmp(routings[r], "empty")) {
            return moed_opt_usage(&command_line, "--routing %s: use uniform, zipf, hot or empty",
                                  routings[r]);
        }
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) {
        fprintf(stderr, "moe-split-bench: no CUDA device: skipped\n");
        return 77;
    }
    for (int i = 0; i < n; i++)
        if (dev[i] >= count) {
            fprintf(stderr, "moe-split-bench: GPU %d does not exist here (%d): skipped\n", dev[i],
                    count);
            return 77;
        }
    double gbs[4];
    const char *mode;
    peer_bandwidth(dev[0], dev[1], gbs, &mode);
    moed_layer layer;
    if (moed_synth_layer(&spec, 0, &layer, &err)) {
        fprintf(stderr, "moe-split-bench: the layer of --spec: %s\n", err.msg);
        return 1;
    }
    int64_t Ts[MAX_T], max_T = 1;
    int nt = 0;
    for (const char *p = a.tokens; nt < MAX_T && *p; p += strcspn(p, ","), p += *p == ',')
        if ((Ts[nt++] = atoll(p)) > max_T) max_T = Ts[nt - 1];
    row rows[MAX_T * MAX_ROUTINGS];
    int nr = 0;
    bench B;
    double *load = calloc((size_t)layer.info.n_experts, sizeof *load);
    rc = !load || bench_open(&B, &layer, dev, n, max_T, a.io[0] == 'd');
    for (int r = 0; r < nrt && !rc; r++)
        for (int i = 0; i < nt && !rc; i++, nr++) {
            moed_route m = { 0 }; /* placed by the measured load of another draw of T tokens */
            memset(load, 0, sizeof *load * (size_t)layer.info.n_experts);
            rc = make_route(&layer.info, routings[r], 1234, Ts[i], &m);
            for (int64_t j = 0; !rc && j < m.off[Ts[i]]; j++) load[m.expert[j]]++;
            moed_route_free(&m);
            layer.expert_load = load;
            layer.expert_launches = 1;
            rc = rc || !(B.bl = open_on(&layer, dev, n, max_T));
            layer.expert_load = NULL;
            if (!rc)
                rc = run_T(&B, &layer.info, routings[r], Ts[i], a.min_ms, load, (int)a.replicas,
                           &rows[nr]);
            moed_backend_destroy(B.bl);
            B.bl = NULL;
        }
    free(load);
    bench_close(&B);
    if (!rc) report(&a, dev, n, rows, nr, gbs, mode);
    moed_synth_free_layer(&layer);
    /* a split sums a token's terms in another order than the whole layer, then rounds once to
     * bf16: within two of bf16's roundings of the token's largest magnitude (docs/cuda.md) */
    for (int i = 0; i < nr && !rc; i++) rc = !rows[i].deterministic || !(rows[i].worst <= 0x1p-7);
    return rc ? 1 : 0;
}
