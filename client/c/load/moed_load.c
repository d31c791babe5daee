/*
 * moed-load — the load generator for moed: many Forward calls in flight from one process, closed
 * loop at a concurrency or open loop at a rate (constant or Poisson arrivals), with a report of
 * rates, errors by status, latency percentiles and a histogram, the server's own timings, and
 * optionally a check of replies against a local reference. ghz and Triton's perf_analyzer are the
 * models; moed-load knows moed's protocol, so it builds valid (and deliberately invalid) requests
 * from what GetModel says, and can verify the numbers as well as count the calls.
 *
 * This file is the command line and the set-up (connections, what the server serves, the request
 * pools); load_run.c runs the load, load_report.c writes the report, load_verify.c checks replies,
 * load_gen.c holds the random choices. Exit codes: 0 every call ended as expected and every
 * verified reply matched; 1 otherwise (or the server could not be reached); 2 bad usage.
 */
#include "cli_common.h"
#include "moed_opt.h"
#include "load_gen.h"
#include "load_metrics.h"
#include "load_regions.h"
#include "load_report.h"
#include "load_run.h"
#include "load_verify.h"
#include "moed_dtype.h"
#include "moed_synth.h"
#include "moedclient.h"
#include "moed_route.h"

#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { EXIT_FAILED = 1 }; /* and MOED_OPT_EXIT_USAGE for the command line */

typedef struct args {
    cli_conn conn;
    const char *layer, *layers, *dtype, *concurrency, *rate, *arrival;
    const char *tokens, *tokens_file, *routing, *synthetic, *json, *csv, *transport;
    const char *metrics, *metrics_token_file;
    char *metrics_token;
    double duration_s, warmup_s, deadline_ms, bad_fraction;
    int64_t requests, verify, seed, connections, threads, max_inflight, top_k, k_batch, device;
    int strategy;
    int progress; /* -1: when stderr is a terminal */
    bool batch_gating;
    moedc_gating gating; /* from strategy and top_k */
} args;

#define F(member) offsetof(args, member)

static const moed_opt options[] = {
    MOED_OPT_SECTION_ROW("target:", NULL),
    CLI_CONN_OPTS(args),
    MOED_OPT_STR_ROW("layer", F(layer), "N", NULL, NULL,
                     "the layer to call (default: the first the server holds)"),
    MOED_OPT_STR_ROW("layers", F(layers), "LIST", NULL, NULL,
                     "layers to call round-robin, e.g. 0,1,3 (repeats weight a layer)"),
    MOED_OPT_STR_ROW("dtype", F(dtype), "T", NULL, NULL,
                     "f32, f16 or bf16 activations (default: the layer's weight dtype)"),
    MOED_OPT_NUM_ROW("deadline", F(deadline_ms), "MS", 1e-3, 1e9, NULL, "give milliseconds > 0",
                     NULL, "deadline of each call in milliseconds (default: none)"),
    MOED_OPT_SECTION_ROW(
        "load (one of; a sweep a:b:step runs one level per value, each with its own "
        "report):",
        NULL),
    MOED_OPT_STR_ROW("concurrency", F(concurrency), "N", "1", NULL,
                     "closed loop: N calls in flight, or a sweep 1:16:4"),
    MOED_OPT_STR_ROW("rate", F(rate), "R", NULL, NULL,
                     "open loop: R requests per second, or a sweep 100:1000:100"),
    MOED_OPT_STR_ROW("arrival", F(arrival), "A", "constant", NULL,
                     "open loop arrivals: constant or poisson"),
    MOED_OPT_I64_ROW("max-inflight", F(max_inflight), "N", 1, 1 << 20, "4096", "give 1 to 1048576",
                     NULL, "open loop: the most calls in flight"),
    MOED_OPT_SECTION_ROW("how long (per level):", NULL),
    MOED_OPT_NUM_ROW("duration", F(duration_s), "S", 1e-3, 1e7, "10", "give seconds > 0", NULL,
                     "measure for S seconds"),
    MOED_OPT_I64_ROW("requests", F(requests), "N", 1, 1LL << 50, NULL, "give a count >= 1", NULL,
                     "measure N requests instead"),
    MOED_OPT_NUM_ROW("warmup", F(warmup_s), "S", 0, 1e7, "1", "give seconds >= 0", NULL,
                     "seconds of load before measuring, not counted"),
    MOED_OPT_SECTION_ROW("requests:", NULL),
    MOED_OPT_STR_ROW("tokens", F(tokens), "SPEC", "8", NULL,
                     "tokens per request: 8, or a range 4:64 drawn uniformly"),
    MOED_OPT_STR_ROW("tokens-file", F(tokens_file), "F", NULL, NULL,
                     "token counts sampled from F, one integer per line"),
    MOED_OPT_STR_ROW("routing", F(routing), "R", "uniform", NULL,
                     "uniform | zipf:S | one: expert choice from the client, top_k of the\n"
                     "layer (zipf: P(e) ~ 1/(e+1)^S; one: every token on expert 0);\n"
                     "logits: random router logits, gated by the server;\n"
                     "server: the layer's router on the server"),
    MOED_OPT_CUSTOM_ROW("strategy", F(strategy), "S", cli_parse_strategy, NULL,
                        "use model, topk, sigmoid, sparsemax, quadratic or pioneer", NULL,
                        "gating for logits/server: model (default), topk, sigmoid, sparsemax,\n"
                        "quadratic, pioneer"),
    MOED_OPT_I64_ROW("top-k", F(top_k), "K", 0, 65535, NULL, "give a count >= 0", NULL,
                     "experts per token for topk/quadratic/pioneer (0: the layer's)"),
    MOED_OPT_I64_ROW("batch-gating", F(k_batch), "K", 0, 65535, NULL, "give a set size >= 0", NULL,
                     "batch-level dynamic gating with a set of K experts (logits/server;\n"
                     "0: the layer's top_k)"),
    MOED_OPT_NUM_ROW("bad-fraction", F(bad_fraction), "P", 0, 1, NULL, "give a share in [0, 1]",
                     NULL,
                     "send that share of requests with an out-of-range expert id; they\n"
                     "must fail INVALID_ARGUMENT and count as expected errors"),
    MOED_OPT_I64_ROW("seed", F(seed), "S", 0, 1LL << 62, "1", "give an integer >= 0", NULL,
                     "random seed"),
    MOED_OPT_SECTION_ROW("checking:", NULL),
    MOED_OPT_I64_ROW("verify", F(verify), "N", 1, 1LL << 50, NULL, "give a count of replies >= 1",
                     NULL,
                     "check N replies per level against moed's own CPU backend (linked\n"
                     "in) on the same synthetic weights (the server must serve\n"
                     "--synthetic); a mistake the server shares with that backend\n"
                     "passes unseen"),
    MOED_OPT_STR_ROW("synthetic", F(synthetic), "SPEC", NULL, NULL,
                     "the server's spec, checked against what it reports (default: taken\n"
                     "from the server)"),
    MOED_OPT_STR_ROW("metrics", F(metrics), "ADDRS", NULL, NULL,
                     "the daemons' metrics endpoints (--metrics-listen), comma-separated:\n"
                     "report tokens per expert as they counted them (any routing)"),
    MOED_OPT_STR_ROW("metrics-token-file", F(metrics_token_file), "FILE", NULL, NULL,
                     "the bearer token of their /metrics (--metrics-token-file)"),
    MOED_OPT_SECTION_ROW("transport:", NULL),
    MOED_OPT_I64_ROW("connections", F(connections), "C", 1, 1024, "1", "give 1 to 1024", NULL,
                     "TCP connections to spread the calls over"),
    MOED_OPT_I64_ROW("threads", F(threads), "W", 1, 256, "1", "give 1 to 256", NULL,
                     "worker threads, each with its own completion queue"),
    MOED_OPT_STR_ROW("transport", F(transport), "T", "inline", NULL,
                     "how tensors travel: inline (in the messages), shm (shared-memory\n"
                     "regions: the server's host only), cuda (GPU memory of this process,\n"
                     "by CUDA IPC; needs the CUDA driver); doorbell (shared memory, each\n"
                     "call rung in a doorbell ring, not sent: one ring and one thread per\n"
                     "unit of --concurrency), doorbell-cuda (as doorbell, tensors in GPU\n"
                     "memory), doorbell-stream (as doorbell-cuda, each call enqueued on a\n"
                     "CUDA stream of the thread's)"),
    MOED_OPT_I64_ROW("device", F(device), "N", 0, 1023, "0", "give a GPU ordinal >= 0", NULL,
                     "the GPU of the transports' GPU memory (as CUDA_VISIBLE_DEVICES\n"
                     "numbers them)"),
    MOED_OPT_SECTION_ROW("output:", NULL),
    MOED_OPT_STR_ROW("json", F(json), "FILE", NULL, NULL,
                     "the report as JSON (one object per level)"),
    MOED_OPT_STR_ROW("csv", F(csv), "FILE", NULL, NULL, "one row per level"),
    MOED_OPT_FLAG_ROW("progress", F(progress), 1, NULL,
                      "the live progress line even when stderr is not a terminal"),
    MOED_OPT_FLAG_ROW("no-progress", F(progress), 0, NULL, "never the progress line"),
    MOED_OPT_HELP_ROW("this text"),
};

static const moed_opt_cmd tool = {
    .head = "usage: moed-load [options]\n"
            "\n"
            "Loads a moed daemon with Forward calls and reports rates, errors and latencies.\n",
    .tail = "exit codes: 0 every call ended as expected (ok, or INVALID_ARGUMENT for "
            "--bad-fraction) and\n"
            "every verified reply matched; 1 otherwise, or the server could not be reached; 2 bad "
            "usage\n",
};

static const moed_opt_spec command_line = MOED_OPT_TOOL_SPEC("moed-load", options, tool);

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A combination of options that does not go together, or does not fit the server. */
static int usage_error(const char *fmt, ...)
{
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return moed_opt_usage(&command_line, "%s", msg);
}

static int failure(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Says why the run failed (not the user's command line) and returns the exit code for it. */
static int failure(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "moed-load: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return EXIT_FAILED;
}

/* Options that exclude or need each other. */
static int check_combinations(const args *a, const moed_opt_parsed *p)
{
#define GIVEN(name) moed_opt_given(&command_line, p, name)
    if (a->layer && a->layers) return usage_error("give --layer or --layers, not both");
    if (GIVEN("concurrency") && a->rate)
        return usage_error("give --concurrency (closed loop) or --rate (open loop), not both");
    if (GIVEN("arrival") && !a->rate)
        return usage_error("--arrival shapes an open loop: it needs --rate");
    if (GIVEN("duration") && a->requests)
        return usage_error("give --duration or --requests, not both");
    if (GIVEN("tokens") && a->tokens_file)
        return usage_error("give --tokens or --tokens-file, not both");
    if (a->synthetic && !a->verify)
        return usage_error("--synthetic is for --verify: it names the server's weights");
    if (a->metrics_token_file && !a->metrics)
        return usage_error("--metrics-token-file goes with --metrics");
    return 0;
#undef GIVEN
}

/* Parses the command line into a; false (with *rc the exit code) when moed-load should stop. */
static bool parse_args(int argc, char **argv, args *a, int *rc)
{
    memset(a, 0, sizeof *a);
    a->progress = -1;
    moed_opt_parsed p;
    if (!moed_opt_parse(&command_line, argc, argv, a, &p, rc)) return false;
    a->batch_gating = moed_opt_given(&command_line, &p, "batch-gating");
    a->gating = (moedc_gating){ .strategy = a->strategy, .top_k = (int)a->top_k };
    *rc = check_combinations(a, &p);
    return !*rc;
}

/* ---- what the command line asks for, parsed and checked against the server ---- */

typedef struct run {
    args a;
    double *levels;
    int n_levels;
    bool closed;
    load_tokens tokens;
    load_routing routing;
    load_arrival arrival;
    int *layer_list;
    int n_layer_list;
    int dtype;
    moedc **conns;
    int n_conns;
    moedc_model_info info;
    bool have_info;
    load_dest *layers;
    void *hidden;
    float *logits;
    int64_t pool_rows;
    load_verify *verify;
    double verify_bound;
    int transport;
    load_regions *regions;
    load_level *results;
    int n_results;
} run;

/* What a ring transport cannot do: a ring call carries expert choices, every tensor in a region,
 * and a worker per ring rings one call at a time. */
static int check_rings(const run *r, bool client_route)
{
    const args *a = &r->a;
    if (!load_transport_rings(r->transport)) return 0;
    if (!client_route)
        return usage_error("--transport %s takes the client's expert choices: use --routing "
                           "uniform, zipf:S or one",
                           a->transport);
    if (!r->closed)
        return usage_error("--transport %s runs a closed loop (a ring per unit of --concurrency): "
                           "give --concurrency, not --rate",
                           a->transport);
    if (a->bad_fraction > 0)
        return usage_error("--bad-fraction sends its bad routes inline; --transport %s takes "
                           "every tensor from a region",
                           a->transport);
    return 0;
}

static int parse_specs(run *r)
{
    const args *a = &r->a;
    moed_error err;
    int rc;
    r->closed = !a->rate;
    rc = load_sweep_parse(a->rate ? "--rate" : "--concurrency", a->rate ? a->rate : a->concurrency,
                          r->closed, &r->levels, &r->n_levels, &err);
    if (!rc && r->closed)
        for (int i = 0; i < r->n_levels && !rc; i++)
            if (r->levels[i] > 1 << 20)
                rc = moed_fail(&err, MOED_EINVAL, "--concurrency %.0f is over %d", r->levels[i],
                               1 << 20);
    if (!rc)
        rc = a->tokens_file ? load_tokens_read(a->tokens_file, &r->tokens, &err)
                            : load_tokens_parse(a->tokens, &r->tokens, &err);
    if (!rc) rc = load_routing_parse(a->routing, &r->routing, &err);
    if (!rc) rc = load_arrival_parse(a->arrival, &r->arrival, &err);
    if (!rc) rc = load_transport_parse(a->transport, &r->transport, &err);
    if (!rc && (a->layer || a->layers))
        rc = load_int_list_parse(a->layer ? "--layer" : "--layers", a->layer ? a->layer : a->layers,
                                 &r->layer_list, &r->n_layer_list, &err);
    if (!rc && a->dtype) {
        r->dtype = moed_dtype_parse(a->dtype);
        if (!moed_dtype_is_float(r->dtype))
            rc = moed_fail(&err, MOED_EINVAL, "--dtype %s: use f32, f16 or bf16", a->dtype);
    }
    if (rc) return usage_error("%s", err.msg);
    bool client_route = r->routing.kind <= LOAD_ROUTE_ONE;
    if (a->batch_gating && client_route)
        return usage_error("--batch-gating needs logits: use --routing logits or --routing server");
    if ((a->gating.strategy || a->gating.top_k) && client_route)
        return usage_error("--strategy and --top-k apply to --routing logits or server, not %s",
                           a->routing);
    if (a->layer && r->n_layer_list != 1)
        return usage_error("--layer takes one layer; use --layers for a list");
    return check_rings(r, client_route);
}

/* Opens the connections, makes sure each reaches a serving server, and asks what it serves. */
static int connect_all(run *r)
{
    moedc_error err;
    moedc_opts o;
    int rc = cli_conn_opts(&command_line, &r->a.conn, &o);
    if (!rc && r->a.metrics_token_file)
        rc = cli_read_token(&command_line, "--metrics-token-file", r->a.metrics_token_file,
                            &r->a.metrics_token);
    if (rc) return rc;
    r->conns = calloc((size_t)r->a.connections, sizeof *r->conns);
    if (!r->conns) return failure("out of memory");
    while (r->n_conns < r->a.connections) {
        moedc **c = &r->conns[r->n_conns];
        int status;
        if (cli_connect(&r->a.conn, &o, c, &err)) {
            /* a fleet that is misconfigured, as opposed to a bad address */
            return err.code == MOEDC_EPRECOND ? failure("%s", err.msg) : usage_error("%s", err.msg);
        }
        r->n_conns++; /* counted at once: the cleanup closes it even when the health check fails */
        /* a health check opens the connection now, so the first measured call does not pay it */
        if (moedc_health(*c, "", &status, &err)) {
            return failure("%s: health check failed: %s: %s", r->a.conn.target,
                           moedc_grpc_status_name(moedc_code_to_grpc(err.code)), err.msg);
        }
        if (status != MOEDC_HEALTH_SERVING) {
            return failure("%s is %s, not SERVING: wait for it, or check its log", r->a.conn.target,
                           moedc_health_name(status));
        }
    }
    if (moedc_info(r->conns[0], &r->info, &err)) {
        return failure("%s: GetModel failed: %s", r->a.conn.target, err.msg);
    }
    r->have_info = true;
    return 0;
}

static const moedc_layer_info *served_layer(const moedc_model_info *m, int index)
{
    for (int i = 0; i < m->n_layers; i++)
        if (m->layers[i].index == index) return &m->layers[i];
    return NULL;
}

/* A served layer as the daemon's core describes it, for the request pools and the reference. */
static moed_layer_info layer_info_of(const moedc_layer_info *l)
{
    return (moed_layer_info){
        .index = l->index,
        .d_model = l->d_model,
        .d_ff = l->d_ff,
        .n_experts = l->n_experts,
        .top_k = l->top_k,
        .act = (moed_act)l->act,
        .wdtype = l->wdtype,
        .has_router = l->has_router,
        .norm_topk = l->norm_topk,
        .rule = (moed_router_rule)l->rule,
        .n_group = l->n_group,
        .topk_group = l->topk_group,
        .routed_scale = l->routed_scale,
        .n_shared = l->n_shared,
        .shared_d_ff = l->shared_d_ff,
    };
}

/* The layers asked for, checked against the server: present, routable as asked, within limits. */
static int resolve_layers(run *r)
{
    const moedc_model_info *m = &r->info;
    if (!m->n_layers) return failure("the server holds no layers");
    if (!r->n_layer_list) {
        r->layer_list = malloc(sizeof *r->layer_list);
        if (!r->layer_list) return failure("out of memory");
        r->layer_list[0] = m->layers[0].index;
        r->n_layer_list = 1;
    }
    r->layers = calloc((size_t)r->n_layer_list, sizeof *r->layers);
    if (!r->layers) return failure("out of memory");
    if (!r->dtype) { /* the weights' dtype, or bf16 beside FP8 weights (never a request's) */
        const moedc_layer_info *first = served_layer(m, r->layer_list[0]);
        r->dtype = first && moed_dtype_is_float(first->wdtype) ? first->wdtype : MOED_BF16;
    }
    const size_t es = moed_dtype_size(r->dtype);
    for (int i = 0; i < r->n_layer_list; i++) {
        const moedc_layer_info *li = served_layer(m, r->layer_list[i]);
        if (!li) {
            char list[256] = "";
            for (int j = 0; j < m->n_layers && strlen(list) < 200; j++)
                snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", j ? "," : "",
                         m->layers[j].index);
            return usage_error("layer %d is not served by %s; it serves layers %s",
                               r->layer_list[i], r->a.conn.target, list);
        }
        if (r->routing.kind == LOAD_ROUTE_SERVER && !li->has_router)
            return usage_error("--routing server: layer %d has no router weights on the server; "
                               "use --routing logits",
                               li->index);
        if ((uint64_t)r->tokens.hi > m->max_batch_tokens)
            return usage_error(
                "requests of up to %d tokens are over the server's limit of %u tokens per request",
                r->tokens.hi, m->max_batch_tokens);
        uint64_t bytes =
            (uint64_t)r->tokens.hi *
            ((uint64_t)li->d_model * es + (uint64_t)li->n_experts * 4 + 8 * (uint64_t)li->top_k);
        if (m->max_message_bytes && bytes > m->max_message_bytes)
            return usage_error("a request of %d tokens to layer %d takes up to %llu bytes, over "
                               "the server's limit of %llu: send fewer tokens",
                               r->tokens.hi, li->index, (unsigned long long)bytes,
                               (unsigned long long)m->max_message_bytes);
        r->layers[i].info = layer_info_of(li);
        r->layers[i].cols = load_routing_cols(&r->routing, li->top_k);
    }
    return 0;
}

/* ---- request pools ---- */

static int fill_pools(run *r)
{
    moed_error err;
    load_rng rng;
    load_rng_seed(&rng, (uint64_t)r->a.seed, 1u << 20);
    int max_d = 1, max_e = 1;
    for (int i = 0; i < r->n_layer_list; i++) {
        if (r->layers[i].info.d_model > max_d) max_d = r->layers[i].info.d_model;
        if (r->layers[i].info.n_experts > max_e) max_e = r->layers[i].info.n_experts;
    }
    /* a window of T rows at a random offset: enough rows that requests differ */
    r->pool_rows = r->tokens.hi + 1024;
    const size_t n = (size_t)r->pool_rows * (size_t)max_d;
    r->hidden = malloc(n * moed_dtype_size(r->dtype));
    float *row = malloc((size_t)max_d * sizeof *row);
    if (!r->hidden || !row) goto nomem;
    for (size_t i = 0; i < n; i += (size_t)max_d) {
        for (int c = 0; c < max_d; c++) row[c] = (float)(2 * load_rng_uniform(&rng) - 1);
        moed_from_f32(r->dtype, row, (char *)r->hidden + i * moed_dtype_size(r->dtype),
                      (size_t)max_d);
    }
    free(row);
    if (r->routing.kind == LOAD_ROUTE_LOGITS) {
        size_t m = (size_t)r->pool_rows * (size_t)max_e;
        r->logits = malloc(m * sizeof *r->logits);
        if (!r->logits) goto nomem;
        for (size_t i = 0; i < m; i++) /* standard normal (Box-Muller) */
            r->logits[i] = (float)(sqrt(-2 * log1p(-load_rng_uniform(&rng))) *
                                   cos(2 * M_PI * load_rng_uniform(&rng)));
    }
    if (r->routing.kind > LOAD_ROUTE_ONE) return 0;
    for (int i = 0; i < r->n_layer_list; i++) {
        load_dest *l = &r->layers[i];
        size_t m = (size_t)r->pool_rows * (size_t)l->cols;
        l->ids = malloc(m * sizeof *l->ids);
        l->weights = malloc(m * sizeof *l->weights);
        if (!l->ids || !l->weights) goto nomem;
        if (load_routing_fill(&r->routing, l->info.n_experts, l->cols, r->pool_rows, &rng, l->ids,
                              l->weights, &err)) {
            return failure("%s", err.msg);
        }
    }
    return 0;
nomem:
    free(row);
    return failure("out of memory for the request pools (%lld rows of %d values)",
                   (long long)r->pool_rows, max_d);
}

/* ---- --verify ---- */

/* The synthetic spec the server serves: --synthetic if given (and it must be the server's), else
 * what GetModel reports when that is a synthetic spec. */
static int verify_spec(const run *r, moed_synth_spec *spec)
{
    moed_error err;
    moed_synth_spec served;
    bool synthetic = !moed_synth_parse(r->info.model, &served, &err);
    if (!r->a.synthetic) {
        if (!synthetic)
            return usage_error("--verify needs synthetic weights, but %s serves '%s': run moed "
                               "with --synthetic SPEC",
                               r->a.conn.target, r->info.model);
        *spec = served;
        return 0;
    }
    if (moed_synth_parse(r->a.synthetic, spec, &err))
        return usage_error("--synthetic: %s", err.msg);
    char mine[512], theirs[512];
    moed_synth_format(spec, mine, sizeof mine);
    if (synthetic) moed_synth_format(&served, theirs, sizeof theirs);
    if (!synthetic || strcmp(mine, theirs))
        return usage_error("--synthetic is '%s', but the server serves '%s': give the server's "
                           "spec (or leave --synthetic out)",
                           mine, synthetic ? theirs : r->info.model);
    return 0;
}

static int open_verify(run *r)
{
    moed_synth_spec spec;
    int rc = verify_spec(r, &spec);
    if (rc) return rc;
    /* the distinct layers called, each built once */
    moed_layer_info *distinct = calloc((size_t)r->n_layer_list, sizeof *distinct);
    if (!distinct) return failure("out of memory");
    int n = 0;
    for (int i = 0; i < r->n_layer_list; i++) {
        bool seen = false;
        for (int j = 0; j < n; j++) seen = seen || distinct[j].index == r->layers[i].info.index;
        if (!seen) distinct[n++] = r->layers[i].info;
    }
    r->verify_bound = load_verify_bound(r->dtype, r->info.backend, distinct[0].wdtype);
    moed_error err;
    rc = load_verify_open(&spec, distinct, n, r->tokens.hi, r->verify_bound, &r->verify, &err);
    free(distinct);
    if (rc) return usage_error("%s", err.msg);
    return 0;
}

/* ---- running and reporting ---- */

static void on_sigint(int sig)
{
    (void)sig;
    load_run_interrupt();
}

static void describe(const run *r, load_setup *s, char *layers, size_t n, char *tokens, size_t tn)
{
    layers[0] = 0;
    for (int i = 0; i < r->n_layer_list && strlen(layers) + 12 < n; i++)
        snprintf(layers + strlen(layers), n - strlen(layers), "%s%d", i ? "," : "",
                 r->layer_list[i]);
    if (r->a.tokens_file)
        snprintf(tokens, tn, "file %s", r->a.tokens_file);
    else if (r->tokens.lo == r->tokens.hi)
        snprintf(tokens, tn, "%d", r->tokens.lo);
    else
        snprintf(tokens, tn, "%d:%d", r->tokens.lo, r->tokens.hi);
    *s = (load_setup){
        .target = r->a.conn.target,
        .model = r->info.model,
        .backend = r->info.backend,
        .dtype = moed_dtype_name(r->dtype),
        .tokens = tokens,
        .routing = r->a.routing,
        .arrival = r->closed                            ? "none"
                   : r->arrival == LOAD_ARRIVAL_POISSON ? "poisson"
                                                        : "constant",
        .layers = layers,
        .connections = (int)r->a.connections,
        .threads = (int)r->a.threads,
        .warmup_s = r->a.warmup_s,
        .duration_s = r->a.requests ? 0 : r->a.duration_s,
        .deadline_ms = r->a.deadline_ms,
        .bad_fraction = r->a.bad_fraction,
        .requests = (uint64_t)r->a.requests,
        .verify = (uint64_t)r->a.verify,
        .verify_bound = r->verify_bound,
    };
}

/* One level; with --metrics, the tokens per expert the daemons counted during it (their counters
 * read before and after it). */
static int run_level(run *r, const load_plan *p, load_level *lv)
{
    moed_error err;
    load_experts before = { 0 };
    int rc = 0;
    if (r->a.metrics && (load_plan_experts(p, &before) || load_plan_experts(p, &lv->servers)))
        rc = failure("out of memory");
    if (!rc && r->a.metrics &&
        load_metrics_scrape_all(r->a.metrics, r->a.metrics_token, &before, &err))
        rc = failure("%s", err.msg);
    if (!rc && load_run_level(p, lv, &err)) rc = failure("%s", err.msg);
    if (!rc && r->a.metrics &&
        load_metrics_scrape_all(r->a.metrics, r->a.metrics_token, &lv->servers, &err))
        rc = failure("%s", err.msg);
    for (size_t i = 0; !rc && r->a.metrics && i < (size_t)before.n_layers * before.n_experts; i++)
        lv->servers.tokens[i] -=
            lv->servers.tokens[i] < before.tokens[i] ? lv->servers.tokens[i] : before.tokens[i];
    load_experts_free(&before);
    return rc;
}

/* --transport shm|cuda|doorbell|doorbell-stream: the pools and every call's output in regions
 * (and the rings). */
static int open_regions(run *r, load_plan *p)
{
    int max_d = 1, slots = 1;
    for (int i = 0; i < r->n_layer_list; i++)
        if (r->layers[i].info.d_model > max_d) max_d = r->layers[i].info.d_model;
    for (int i = 0; i < r->n_levels; i++)
        if (r->closed && r->levels[i] > slots) slots = (int)r->levels[i];
    if (!r->closed) slots = (int)r->a.max_inflight;
    /* a worker's output slots start at its number times (calls it keeps / workers + 1): a worker
     * per ring takes up to twice the concurrency */
    const int rings = load_transport_rings(r->transport) ? slots : 0;
    const int outputs = slots + (rings ? rings : (int)r->a.threads);
    moed_error err;
    if (load_regions_open(r->transport, r->conns[0], p, outputs, rings, r->tokens.hi, max_d,
                          (int)r->a.device, &r->regions, &err))
        return failure("--transport %s: %s", r->a.transport, err.msg);
    return 0;
}

static int run_levels(run *r, const load_setup *s)
{
    load_plan p = {
        .conns = r->conns,
        .n_conns = r->n_conns,
        .threads = (int)r->a.threads,
        .layers = r->layers,
        .n_layers = r->n_layer_list,
        .pool_rows = r->pool_rows,
        .hidden = r->hidden,
        .logits = r->logits,
        .dtype = r->dtype,
        .tokens = &r->tokens,
        .routing = r->routing.kind == LOAD_ROUTE_LOGITS   ? MOEDC_ROUTE_LOGITS
                   : r->routing.kind == LOAD_ROUTE_SERVER ? MOEDC_ROUTE_SERVER
                                                          : MOEDC_ROUTE_EXPERTS,
        .gating = r->a.gating,
        .batch_gating = r->a.batch_gating,
        .k_batch = (uint32_t)r->a.k_batch,
        .bad_fraction = r->a.bad_fraction,
        .deadline_s = r->a.deadline_ms / 1e3,
        .warmup_s = r->a.warmup_s,
        .duration_s = r->a.duration_s,
        .requests = (uint64_t)r->a.requests,
        .arrival = r->arrival,
        .max_inflight = (int)r->a.max_inflight,
        .seed = (uint64_t)r->a.seed,
        .verify = r->verify,
        .verify_n = (uint64_t)r->a.verify,
        .progress = r->a.progress < 0 ? isatty(STDERR_FILENO) : r->a.progress,
    };
    if (open_regions(r, &p)) return EXIT_FAILED;
    r->results = calloc((size_t)r->n_levels, sizeof *r->results);
    if (!r->results) return failure("out of memory");
    fprintf(stdout, "moed-load  %s  model %s (%s backend, moed %s)\n", s->target, s->model,
            s->backend, r->info.version);
    fprintf(stdout,
            "           layers %s  dtype %s  tokens %s  routing %s  connections %d  threads %d  "
            "transport %s\n",
            s->layers, s->dtype, s->tokens, s->routing, s->connections, s->threads, r->a.transport);
    for (int i = 0; i < r->n_levels && !load_run_interrupted(); i++) {
        load_level *lv = &r->results[i];
        if (r->closed)
            lv->concurrency = (int)r->levels[i];
        else
            lv->rate = r->levels[i];
        r->n_results++; /* counted at once: run_free frees what the level allocated */
        if (run_level(r, &p, lv)) return EXIT_FAILED;
        fprintf(stdout, "\n");
        load_report_text(stdout, s, lv);
        fflush(stdout);
    }
    if (load_run_interrupted())
        fprintf(stderr, "moed-load: interrupted: the report covers the calls made until then\n");
    return 0;
}

static void run_free(run *r)
{
    load_verify_close(r->verify);
    load_regions_close(r->regions);
    for (int i = 0; r->layers && i < r->n_layer_list; i++) {
        free(r->layers[i].ids);
        free(r->layers[i].weights);
    }
    free(r->layers);
    free(r->hidden);
    free(r->logits);
    for (int i = 0; i < r->n_conns; i++) moedc_close(r->conns[i]);
    free(r->conns);
    if (r->have_info) moedc_model_info_free(&r->info);
    load_tokens_free(&r->tokens);
    free(r->levels);
    free(r->layer_list);
    for (int i = 0; r->results && i < r->n_results; i++) {
        load_experts_free(&r->results[i].sent);
        load_experts_free(&r->results[i].servers);
    }
    free(r->results);
    free(r->a.metrics_token);
    cli_conn_free(&r->a.conn);
}

int main(int argc, char **argv)
{
    run r;
    memset(&r, 0, sizeof r);
    int rc;
    if (!parse_args(argc, argv, &r.a, &rc)) return rc;
    rc = parse_specs(&r);
    if (!rc) rc = connect_all(&r);
    if (!rc) rc = resolve_layers(&r);
    if (!rc) rc = fill_pools(&r);
    if (!rc && r.a.verify) rc = open_verify(&r);
    char layers[256], tokens[600];
    load_setup setup;
    if (!rc) {
        describe(&r, &setup, layers, sizeof layers, tokens, sizeof tokens);
        struct sigaction sa = { .sa_handler = on_sigint, .sa_flags = SA_RESETHAND };
        sigaction(SIGINT, &sa, NULL);
        rc = run_levels(&r, &setup);
    }
    moed_error err;
    if (!rc && r.a.json && load_report_json(r.a.json, &setup, r.results, r.n_results, &err))
        rc = failure("%s", err.msg);
    if (!rc && r.a.csv && load_report_csv(r.a.csv, r.results, r.n_results, &err))
        rc = failure("%s", err.msg);
    for (int i = 0; !rc && i < r.n_results; i++)
        if (load_stats_errors(&r.results[i].st) || r.results[i].st.mismatches) rc = EXIT_FAILED;
    run_free(&r);
    return rc;
}
