/*
 * link-bench — a caller of links on a GPU machine: the same inputs over links and over gRPC for
 * the same daemons, and against a reference daemon, with the figures as JSON. The GPU tests
 * (tests/e2e/test_links_gpu.py) and the links benchmark (bench/daemon/bench_links.py) run it
 * against daemons they start; `link-bench --help` lists its options.
 *
 * It makes random hidden [T, d_model] and k distinct experts per token (every third token's last
 * pair padding) from --seed, puts them on --device, and makes --calls calls over links
 * (moedc_links_forward on a stream of its own, after --warmup untimed ones). It reports:
 * - links: calls answered OK and failed (by status, with the first message of each), p50 / p90 /
 *   p99 latency per call, tokens per second over the timed calls, the slowest daemon's compute
 *   time per call (p50, as the daemons report it: the kernel a call waited for), and `wrong`: OK
 *   calls whose output differs in any bit from the first OK call's (the inputs never change, and a
 *   fleet's sum is deterministic, so any is a wrong answer);
 * - with --grpc, the same calls over gRPC (moedc_forward, the tensors inline from the host), their
 *   latency, and whether the two transports gave the same bits;
 * - with --ref TARGET (one daemon holding the layer's every expert), the largest per-token error of
 *   the links' output against that daemon's, over the token's largest magnitude.
 * - with --graph, one call captured in a CUDA graph on the links' stream and replayed --calls
 *   times (after --warmup): the replays' p50 / p90 latency (launch to the stream done), `wrong`
 *   (a replay's output differing in any bit from the first blocking call's: a captured call sends
 *   every shard every token, and the sum rule gives the same bits) and the links' failure count.
 * --keep-going carries on after a failed call (the tests kill a daemon under it); without it the
 * first failure ends the run. --duration bounds the links' calls in time (`calls` then counts
 * the calls made). --hold keeps the links open and idle a while after the calls (a test closes
 * another link meanwhile). --start-at lets callers started together time one window (each reports
 * its window_s, CLOCK_MONOTONIC, which every process of the machine shares); their timed calls
 * follow one another with no copy between them, only the last one's bits compared. Exit status: 0,
 * or 1 for a failure, a wrong answer, or different bits between the transports.
 */
#include "moed_dtype.h"
#include "moed_opt.h"
#include "moed_time.h"
#include "moedclient.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TARGETS    64
#define GRPC_TIMEOUT_S 120.0 /* a gRPC call of the benchmark (T = 4096 over a fleet: 0.5 s) */

typedef struct opts {
    const char *target, *ref, *dtype, *send, *json;
    int64_t device, layer, tokens, top_k, seed, calls, warmup;
    int grpc, keep_going, graph;
    double timeout, duration, hold, start_at;
} opts;

#define F(member) offsetof(opts, member)

static const moed_opt options[] = {
    MOED_OPT_WORD_ROW("target", F(target), "ADDRS", NULL, NULL,
                      "one daemon, or a fleet as a comma-separated list"),
    MOED_OPT_STR_ROW("ref", F(ref), "ADDR", NULL, NULL,
                     "a daemon holding every expert of the layer: the links' output against its"),
    MOED_OPT_I64_ROW("device", F(device), "N", 0, 1023, "0", NULL, NULL, "the caller's GPU"),
    MOED_OPT_I64_ROW("layer", F(layer), "L", 0, 1 << 20, "0", NULL, NULL, "the layer called"),
    MOED_OPT_I64_ROW("tokens", F(tokens), "T", 1, 1 << 20, "128", NULL, NULL, "tokens per call"),
    MOED_OPT_I64_ROW("top-k", F(top_k), "K", 1, 64, "8", NULL, NULL, "experts per token"),
    MOED_OPT_CHOICE_ROW("dtype", F(dtype), "f32|f16|bf16", "bf16", NULL, "hidden's dtype"),
    MOED_OPT_CHOICE_ROW("send", F(send), "auto|chosen|all", "auto", NULL,
                        "which tokens each shard gets (moedc_links_opts.send)"),
    MOED_OPT_I64_ROW("seed", F(seed), "S", 0, INT64_MAX, "1", NULL, NULL, "the inputs' seed"),
    MOED_OPT_I64_ROW("calls", F(calls), "N", 1, 1 << 24, "100", NULL, NULL, "timed calls"),
    MOED_OPT_I64_ROW("warmup", F(warmup), "N", 0, 1 << 20, "5", NULL, NULL, "untimed calls first"),
    MOED_OPT_FLAG_ROW("grpc", F(grpc), 1, NULL, "the same calls over gRPC, and their bits"),
    MOED_OPT_FLAG_ROW("keep-going", F(keep_going), 1, NULL, "go on after a failed call"),
    MOED_OPT_FLAG_ROW("graph", F(graph), 1, NULL, "one call captured in a CUDA graph, replayed"),
    MOED_OPT_NUM_ROW("duration", F(duration), "S", 0, 3600, "0", NULL, NULL,
                     "stop the links' calls after S seconds (0: after --calls)"),
    MOED_OPT_NUM_ROW("timeout", F(timeout), "S", 0, 3600, "0", NULL, NULL,
                     "the links' timeout (moedc_links_opts.timeout_s; 0: its default)"),
    MOED_OPT_NUM_ROW("hold", F(hold), "S", 0, 3600, "0", NULL, NULL,
                     "keep the links open and idle S seconds after the calls"),
    MOED_OPT_NUM_ROW("start-at", F(start_at), "S", 0, 1e9, "0", NULL, NULL,
                     "begin the timed calls at S s of CLOCK_MONOTONIC (0: at once)"),
    MOED_OPT_STR_ROW("json", F(json), "FILE", NULL, NULL, "the figures there, not on stdout"),
    MOED_OPT_HELP_ROW("this text"),
};

static const moed_opt_cmd tool = {
    .head = "usage: link-bench --target ADDRS [options]\n\nCalls a daemon or a fleet over NCCL "
            "links from a GPU, beside gRPC and a reference.\n",
};

static const moed_opt_spec command_line = MOED_OPT_TOOL_SPEC("link-bench", options, tool);

static opts o;

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* the p-th quantile of v[0..n) (sorts v); 0 for none */
static double pct(double *v, int n, double p)
{
    if (n < 1) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[(int)(p * (n - 1))];
}

static uint64_t rng_state;
static double uniform(void) /* splitmix64 */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) / 9007199254740992.0;
}

static int die(const char *what, const char *why)
{
    fprintf(stderr, "link-bench: %s: %s\n", what, why);
    printf("\n{\"error\": \"%s\"}\n", what); /* on a line of its own, after a report begun */
    return 1;
}

/* Failures by status: the count and the first message of each. */
typedef struct failures {
    int count[17];
    char first[17][480];
    int total;
} failures;

static void failed(failures *f, const moedc_error *err)
{
    int g = moedc_code_to_grpc(err->code);
    g = g < 0 || g > 16 ? 2 : g;
    if (!f->count[g]++) snprintf(f->first[g], sizeof f->first[g], "%s", err->msg);
    f->total++;
}

static void json_string(FILE *out, const char *s)
{
    fputc('"', out);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') fputc('\\', out);
        if ((unsigned char)*s < 0x20)
            fprintf(out, "\\u%04x", *s);
        else
            fputc(*s, out);
    }
    fputc('"', out);
}

static void json_failures(FILE *out, const failures *f)
{
    fprintf(out, "{");
    int first = 1;
    for (int g = 0; g < 17; g++)
        if (f->count[g]) {
            fprintf(out, "%s\"%s\": {\"count\": %d, \"first\": ", first ? "" : ", ",
                    moedc_grpc_status_name(g), f->count[g]);
            json_string(out, f->first[g]);
            fprintf(out, "}");
            first = 0;
        }
    fprintf(out, "}");
}

/* The largest per-token |a - b| over the token's largest |b|. */
static double worst_token(const float *a, const float *b, int64_t T, int64_t d)
{
    double worst = 0;
    for (int64_t t = 0; t < T; t++) {
        double diff = 0, mag = 0;
        for (int64_t j = 0; j < d; j++) {
            const double x = a[t * d + j], y = b[t * d + j];
            diff = fmax(diff, isnan(x - y) ? INFINITY : fabs(x - y));
            mag = fmax(mag, fabs(y));
        }
        worst = fmax(worst, mag > 0 ? diff / mag : diff);
    }
    return worst;
}

/* One forward over gRPC from the host: into out (hb bytes). */
static int grpc_call(moedc *c, const moedc_request *req, void *out, size_t hb, moedc_error *err)
{
    moedc_result res = { 0 };
    int rc = moedc_forward(c, req, &res, err);
    if (!rc && res.output_bytes == hb) memcpy(out, res.output, hb);
    moedc_result_free(&res);
    return rc;
}

int main(int argc, char **argv)
{
    int rc;
    moed_opt_parsed p;
    if (!moed_opt_parse(&command_line, argc, argv, &o, &p, &rc)) return rc;
    char *list = strdup(o.target);
    const char *targets[MAX_TARGETS];
    int n_targets = 0;
    for (char *t = strtok(list, ","); t && n_targets < MAX_TARGETS; t = strtok(NULL, ","))
        targets[n_targets++] = t;
    const int dtype = moed_dtype_parse(o.dtype), k = (int)o.top_k, N = (int)o.calls;
    const int64_t T = o.tokens;
    rng_state = (uint64_t)o.seed;
    moedc *c;
    moedc_error err;
    /* every gRPC call here ends within GRPC_TIMEOUT_S: a daemon that stops answering fails the run,
     * naming the call, instead of holding it (a test's driver) for ever */
    const moedc_opts co = { .timeout_s = GRPC_TIMEOUT_S };
    if (moedc_connect_many(targets, n_targets, &co, &c, &err)) return die("connect", err.msg);
    moedc_model_info info;
    if (moedc_info(c, &info, &err)) return die("GetModel", err.msg);
    int64_t d = 0;
    int E = 0;
    for (int i = 0; i < info.n_layers; i++)
        if ((int64_t)info.layers[i].index == o.layer)
            d = info.layers[i].d_model, E = info.layers[i].n_experts;
    moedc_model_info_free(&info);
    if (!d || E < k) return die("layer", "not served, or fewer experts than --top-k");

    const size_t es = moed_dtype_size(dtype), hb = (size_t)T * (size_t)d * es;
    const size_t pb = (size_t)T * (size_t)k * 4, n = (size_t)T * (size_t)d;
    float *x32 = malloc(n * 4), *w = malloc(pb), *a = malloc(n * 4), *b = malloc(n * 4);
    int32_t *ids = malloc(pb);
    void *x = malloc(hb), *y_link = malloc(hb), *y_first = malloc(hb), *y_other = malloc(hb);
    for (size_t i = 0; i < n; i++) x32[i] = (float)(uniform() * 2 - 1);
    moed_from_f32(dtype, x32, x, n);
    for (int64_t t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int e, again;
            do { /* k distinct experts */
                e = (int)(uniform() * E);
                again = 0;
                for (int q = 0; q < j; q++) again |= ids[t * k + q] == e;
            } while (again);
            ids[t * k + j] = e;
            w[t * k + j] = (float)(uniform() + 0.05);
        }
    for (int64_t t = 0; k > 1 && t < T; t += 3) ids[t * k + k - 1] = -1, w[t * k + k - 1] = 0;

    void *dx, *dy, *dids, *dw;
    cudaStream_t st;
    if (cudaSetDevice((int)o.device) || cudaMalloc(&dx, hb) || cudaMalloc(&dy, hb) ||
        cudaMalloc(&dids, pb) || cudaMalloc(&dw, pb) || cudaStreamCreate(&st) ||
        cudaMemcpy(dx, x, hb, cudaMemcpyHostToDevice) ||
        cudaMemcpy(dids, ids, pb, cudaMemcpyHostToDevice) ||
        cudaMemcpy(dw, w, pb, cudaMemcpyHostToDevice))
        return die("CUDA", cudaGetErrorString(cudaGetLastError()));

    moedc_links *l;
    moedc_links_opts lo = { .device = (int)o.device,
                            .max_tokens = (uint32_t)T,
                            .max_top_k = (uint32_t)k,
                            .timeout_s = o.timeout,
                            .send = !strcmp(o.send, "chosen") ? MOEDC_LINKS_SEND_CHOSEN
                                    : !strcmp(o.send, "all")  ? MOEDC_LINKS_SEND_ALL
                                                              : MOEDC_LINKS_SEND_AUTO };
    double t_open = moed_now_s();
    if (moedc_links_open(c, &lo, &l, &err)) return die("moedc_links_open", err.msg);
    t_open = moed_now_s() - t_open;
    moedc_link_call call = { .layer = (uint32_t)o.layer,
                             .dtype = dtype,
                             .tokens = T,
                             .d_model = d,
                             .k = k,
                             .hidden = dx,
                             .expert_ids = dids,
                             .expert_weights = dw,
                             .output = dy,
                             .stream = st };
    double *lat = malloc(sizeof(double) * (size_t)N), *comp = malloc(sizeof(double) * (size_t)N);
    failures lf = { 0 };
    int ok = 0, wrong = 0, have_first = 0;
    double busy = 0;
    double t_calls = moed_now_s(), t_end = t_calls;
    for (int i = -(int)o.warmup; i < N; i++) {
        if (i == 0 && o.start_at > 0) { /* callers started together time the same window */
            moed_sleep_s(o.start_at - moed_now_s());
            t_calls = moed_now_s();
        }
        if (o.duration > 0 && moed_now_s() - t_calls > o.duration) break;
        moedc_timings tm = { 0 };
        const double t0 = moed_now_s();
        rc = moedc_links_forward(l, &call, &tm, &err);
        const double dt = moed_now_s() - t0;
        t_end = t0 + dt;
        if (rc) {
            if (i < 0 && !o.keep_going) return die("moedc_links_forward (warm-up)", err.msg);
            if (i >= 0) failed(&lf, &err);
            if (!o.keep_going) break;
            continue;
        }
        /* timed calls of callers started together: only the last one's bits are compared, so that
         * no copy leaves the daemons idle between a caller's calls */
        if (!(o.start_at > 0 && i >= 0 && i < N - 1)) {
            if (cudaMemcpy(y_link, dy, hb, cudaMemcpyDeviceToHost))
                return die("CUDA", cudaGetErrorString(cudaGetLastError()));
            if (!have_first) {
                memcpy(y_first, y_link, hb);
                have_first = 1;
            } else if (memcmp(y_first, y_link, hb)) {
                wrong++;
            }
        }
        if (i < 0) continue;
        lat[ok] = dt;
        comp[ok] = (double)tm.compute_us * 1e-6;
        busy += dt;
        ok++;
    }
    moed_sleep_s(o.hold); /* the daemons wait for these links' next headers meanwhile */
    FILE *out = o.json ? fopen(o.json, "w") : stdout;
    if (!out) return die("--json", "cannot be written");
    fprintf(out, "{\"transport\": ");
    json_string(out, moedc_links_describe(l));
    fprintf(out,
            ", \"daemons\": %d, \"tokens\": %lld, \"d_model\": %lld, \"k\": %d, \"dtype\": \"%s\", "
            "\"send\": \"%s\", \"open_s\": %.3f, \"links\": {\"calls\": %d, \"ok\": %d, "
            "\"wrong\": %d, \"failed\": ",
            n_targets, (long long)T, (long long)d, k, o.dtype, o.send, t_open, ok + lf.total, ok,
            wrong);
    json_failures(out, &lf);
    fprintf(out,
            ", \"p50_us\": %.1f, \"p90_us\": %.1f, \"p99_us\": %.1f, \"compute_p50_us\": %.1f, "
            "\"tokens_per_s\": %.0f, \"window_s\": [%.6f, %.6f]}",
            pct(lat, ok, 0.5) * 1e6, pct(lat, ok, 0.9) * 1e6, pct(lat, ok, 0.99) * 1e6,
            pct(comp, ok, 0.5) * 1e6, busy > 0 ? (double)T * ok / busy : 0.0, t_calls, t_end);
    int same = 1;
    moedc_request req = { .layer = (uint32_t)o.layer,
                          .dtype = dtype,
                          .tokens = T,
                          .d_model = d,
                          .hidden = x,
                          .routing = MOEDC_ROUTE_EXPERTS,
                          .k = k,
                          .expert_ids = ids,
                          .expert_weights = w };
    if (o.grpc) {
        int g_ok = 0;
        double g_busy = 0;
        for (int i = -(int)o.warmup; i < N; i++) {
            const double t0 = moed_now_s();
            if (grpc_call(c, &req, y_other, hb, &err)) return die("moedc_forward", err.msg);
            if (i < 0) continue;
            lat[g_ok] = moed_now_s() - t0;
            g_busy += lat[g_ok++];
        }
        same = have_first && !memcmp(y_first, y_other, hb);
        fprintf(out,
                ", \"grpc\": {\"p50_us\": %.1f, \"p90_us\": %.1f, \"tokens_per_s\": %.0f}, "
                "\"same_bits\": %s",
                pct(lat, g_ok, 0.5) * 1e6, pct(lat, g_ok, 0.9) * 1e6,
                g_busy > 0 ? (double)T * g_ok / g_busy : 0.0, same ? "true" : "false");
    }
    int g_wrong = 0;
    uint64_t g_failed = 0;
    if (o.graph && have_first) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal))
            return die("CUDA", cudaGetErrorString(cudaGetLastError()));
        rc = moedc_links_forward(l, &call, NULL, &err);
        if (cudaStreamEndCapture(st, &graph) || rc || cudaGraphInstantiate(&exec, graph, 0))
            return die("capturing a link call",
                       rc ? err.msg : cudaGetErrorString(cudaGetLastError()));
        int g_n = 0;
        for (int i = -(int)o.warmup; i < N; i++) {
            const double t0 = moed_now_s();
            if (cudaGraphLaunch(exec, st) || cudaStreamSynchronize(st))
                return die("CUDA", cudaGetErrorString(cudaGetLastError()));
            const double dt = moed_now_s() - t0;
            if (cudaMemcpy(y_link, dy, hb, cudaMemcpyDeviceToHost))
                return die("CUDA", cudaGetErrorString(cudaGetLastError()));
            g_wrong += memcmp(y_first, y_link, hb) != 0;
            if (i >= 0) lat[g_n++] = dt;
        }
        if (moedc_links_failures(l, &g_failed, &err)) return die("moedc_links_failures", err.msg);
        fprintf(out,
                ", \"graph\": {\"replays\": %d, \"p50_us\": %.1f, \"p90_us\": %.1f, \"wrong\": %d, "
                "\"failures\": %llu}",
                g_n, pct(lat, g_n, 0.5) * 1e6, pct(lat, g_n, 0.9) * 1e6, g_wrong,
                (unsigned long long)g_failed);
        cudaGraphExecDestroy(exec); /* before the links close: NCCL waits for it */
        cudaGraphDestroy(graph);
    }
    if (o.ref && have_first) {
        moedc *r;
        if (moedc_connect(o.ref, &co, &r, &err) || grpc_call(r, &req, y_other, hb, &err))
            return die("--ref", err.msg);
        moedc_close(r);
        moed_to_f32(dtype, y_first, a, n);
        moed_to_f32(dtype, y_other, b, n);
        fprintf(out, ", \"ref_worst_token\": %.3g", worst_token(a, b, T, d));
    }
    fprintf(out, "}\n");
    if (o.json) fclose(out);
    moedc_links_close(l);
    moedc_close(c);
    return lf.total || wrong || !same || g_wrong || g_failed ? 1 : 0;
}
