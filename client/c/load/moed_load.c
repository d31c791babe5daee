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
#include "load_gen.h"
#include "load_report.h"
#include "load_run.h"
#include "load_verify.h"
#include "moed_dtype.h"
#include "moed_synth.h"
#include "moedclient.h"
#include "moed_route.h"
#include "cli_num.h"

#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { EXIT_FAILED = 1, EXIT_USAGE = 2 };

static const char usage[] =
    "usage: moed-load [options]\n"
    "\n"
    "Loads a moed daemon with Forward calls and reports rates, errors and latencies.\n"
    "\n"
    "target:\n"
    "  --target ADDR         server address (default 127.0.0.1:50051)\n"
    "  --token T             bearer token sent as 'authorization: Bearer T'\n"
    "  --layer N             the layer to call (default: the first the server holds)\n"
    "  --layers LIST         layers to call round-robin, e.g. 0,1,3 (repeats weight a layer)\n"
    "  --dtype T             f32, f16 or bf16 activations (default: the layer's weight dtype)\n"
    "  --deadline MS         deadline of each call in milliseconds (default: none)\n"
    "load (one of; a sweep a:b:step runs one level per value, each with its own report):\n"
    "  --concurrency N       closed loop: N calls in flight, or a sweep 1:16:4 (default 1)\n"
    "  --rate R              open loop: R requests per second, or a sweep 100:1000:100\n"
    "  --arrival A           open loop arrivals: constant or poisson (default constant)\n"
    "  --max-inflight N      open loop: the most calls in flight (default 4096)\n"
    "how long (per level):\n"
    "  --duration S          measure for S seconds (default 10)\n"
    "  --requests N          measure N requests instead\n"
    "  --warmup S            seconds of load before measuring, not counted (default 1)\n"
    "requests:\n"
    "  --tokens SPEC         tokens per request: 8, or a range 4:64 drawn uniformly (default 8)\n"
    "  --tokens-file F       token counts sampled from F, one integer per line\n"
    "  --routing R           uniform | zipf:S | one: expert choice from the client, top_k of the\n"
    "                        layer (zipf: P(e) ~ 1/(e+1)^S; one: every token on expert 0);\n"
    "                        logits: random router logits, gated by the server;\n"
    "                        server: the layer's router on the server (default uniform)\n"
    "  --strategy S          gating for logits/server: model (default), topk, sigmoid, sparsemax,\n"
    "                        quadratic, pioneer\n"
    "  --top-k K             experts per token for topk/quadratic/pioneer (0: the layer's)\n"
    "  --batch-gating K      batch-level dynamic gating with a set of K experts (logits/server;\n"
    "                        0: the layer's top_k)\n"
    "  --bad-fraction P      send that share of requests with an out-of-range expert id; they\n"
    "                        must fail INVALID_ARGUMENT and count as expected errors\n"
    "  --seed S              random seed (default 1)\n"
    "checking:\n"
    "  --verify N            check N replies per level against the CPU reference on the same\n"
    "                        synthetic weights (the server must serve --synthetic)\n"
    "  --synthetic SPEC      the server's spec, checked against what it reports (default: taken\n"
    "                        from the server)\n"
    "transport:\n"
    "  --connections C       TCP connections to spread the calls over (default 1)\n"
    "  --threads W           worker threads, each with its own completion queue (default 1)\n"
    "output:\n"
    "  --json FILE           the report as JSON (one object per level)\n"
    "  --csv FILE            one row per level\n"
    "  --progress            the live progress line even when stderr is not a terminal\n"
    "  --no-progress         never the progress line\n"
    "  --help                this text\n"
    "\n"
    "exit codes: 0 every call ended as expected (ok, or INVALID_ARGUMENT for --bad-fraction) and\n"
    "every verified reply matched; 1 otherwise, or the server could not be reached; 2 bad usage\n";

typedef struct args {
    const char *target, *token, *layer, *layers, *dtype, *concurrency, *rate, *arrival;
    const char *tokens, *tokens_file, *routing, *synthetic, *json, *csv;
    double duration_s, warmup_s, deadline_ms, bad_fraction;
    long long requests, verify, seed;
    long connections, threads, max_inflight, k_batch;
    bool duration_set, batch_gating;
    moedc_gating gating;
    int progress; /* -1: when stderr is a terminal */
    bool help;
} args;

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "moed-load: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n(moed-load --help lists the options)\n");
    va_end(ap);
    return EXIT_USAGE;
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

enum {
    O_TARGET = 256,
    O_TOKEN,
    O_LAYER,
    O_LAYERS,
    O_DTYPE,
    O_DEADLINE,
    O_CONC,
    O_RATE,
    O_ARRIVAL,
    O_MAXIF,
    O_DURATION,
    O_REQUESTS,
    O_WARMUP,
    O_TOKENS,
    O_TOKENS_FILE,
    O_ROUTING,
    O_STRATEGY,
    O_TOPK,
    O_BATCH,
    O_BAD,
    O_SEED,
    O_VERIFY,
    O_SYNTH,
    O_CONNS,
    O_THREADS,
    O_JSON,
    O_CSV,
    O_PROGRESS,
    O_NO_PROGRESS,
    O_HELP
};

static const struct option options[] = {
    { "target", required_argument, 0, O_TARGET },
    { "token", required_argument, 0, O_TOKEN },
    { "layer", required_argument, 0, O_LAYER },
    { "layers", required_argument, 0, O_LAYERS },
    { "dtype", required_argument, 0, O_DTYPE },
    { "deadline", required_argument, 0, O_DEADLINE },
    { "concurrency", required_argument, 0, O_CONC },
    { "rate", required_argument, 0, O_RATE },
    { "arrival", required_argument, 0, O_ARRIVAL },
    { "max-inflight", required_argument, 0, O_MAXIF },
    { "duration", required_argument, 0, O_DURATION },
    { "requests", required_argument, 0, O_REQUESTS },
    { "warmup", required_argument, 0, O_WARMUP },
    { "tokens", required_argument, 0, O_TOKENS },
    { "tokens-file", required_argument, 0, O_TOKENS_FILE },
    { "routing", required_argument, 0, O_ROUTING },
    { "strategy", required_argument, 0, O_STRATEGY },
    { "top-k", required_argument, 0, O_TOPK },
    { "batch-gating", required_argument, 0, O_BATCH },
    { "bad-fraction", required_argument, 0, O_BAD },
    { "seed", required_argument, 0, O_SEED },
    { "verify", required_argument, 0, O_VERIFY },
    { "synthetic", required_argument, 0, O_SYNTH },
    { "connections", required_argument, 0, O_CONNS },
    { "threads", required_argument, 0, O_THREADS },
    { "json", required_argument, 0, O_JSON },
    { "csv", required_argument, 0, O_CSV },
    { "progress", no_argument, 0, O_PROGRESS },
    { "no-progress", no_argument, 0, O_NO_PROGRESS },
    { "help", no_argument, 0, O_HELP },
    { 0, 0, 0, 0 },
};

/* One numeric option into a; 0, or an exit code after saying what is accepted. */
static int parse_number(int o, const char *v, args *a)
{
    long long n;
    switch (o) {
    case O_DEADLINE:
        return cli_double(v, 1e-3, 1e9, &a->deadline_ms)
                   ? usage_error("--deadline %s: give milliseconds > 0", v)
                   : 0;
    case O_DURATION:
        a->duration_set = true;
        return cli_double(v, 1e-3, 1e7, &a->duration_s)
                   ? usage_error("--duration %s: give seconds > 0", v)
                   : 0;
    case O_WARMUP:
        return cli_double(v, 0, 1e7, &a->warmup_s)
                   ? usage_error("--warmup %s: give seconds >= 0", v)
                   : 0;
    case O_BAD:
        return cli_double(v, 0, 1, &a->bad_fraction)
                   ? usage_error("--bad-fraction %s: give a share in [0, 1]", v)
                   : 0;
    case O_REQUESTS:
        return cli_int(v, 1, 1LL << 50, &a->requests)
                   ? usage_error("--requests %s: give a count >= 1", v)
                   : 0;
    case O_VERIFY:
        return cli_int(v, 1, 1LL << 50, &a->verify)
                   ? usage_error("--verify %s: give a count of replies >= 1", v)
                   : 0;
    case O_SEED:
        return cli_int(v, 0, 1LL << 62, &a->seed)
                   ? usage_error("--seed %s: give an integer >= 0", v)
                   : 0;
    case O_CONNS:
        if (cli_int(v, 1, 1024, &n)) return usage_error("--connections %s: give 1 to 1024", v);
        a->connections = (long)n;
        return 0;
    case O_THREADS:
        if (cli_int(v, 1, 256, &n)) return usage_error("--threads %s: give 1 to 256", v);
        a->threads = (long)n;
        return 0;
    case O_MAXIF:
        if (cli_int(v, 1, 1 << 20, &n))
            return usage_error("--max-inflight %s: give 1 to %d", v, 1 << 20);
        a->max_inflight = (long)n;
        return 0;
    case O_TOPK:
        if (cli_int(v, 0, 65535, &n)) return usage_error("--top-k %s: give a count >= 0", v);
        a->gating.top_k = (int)n;
        return 0;
    case O_BATCH:
        if (cli_int(v, 0, 65535, &n))
            return usage_error("--batch-gating %s: give a set size >= 0", v);
        a->k_batch = (long)n;
        a->batch_gating = true;
        return 0;
    }
    return 0;
}

static int parse_args(int argc, char **argv, args *a)
{
    memset(a, 0, sizeof *a);
    a->target = "127.0.0.1:50051";
    a->duration_s = 10;
    a->warmup_s = 1;
    a->seed = 1;
    a->connections = 1;
    a->threads = 1;
    a->max_inflight = 4096;
    a->progress = -1;
    int o;
    opterr = 0;
    while ((o = getopt_long(argc, argv, ":", options, NULL)) != -1) {
        int rc = 0;
        switch (o) {
        case O_TARGET:
            a->target = optarg;
            break;
        case O_TOKEN:
            a->token = optarg;
            break;
        case O_LAYER:
            a->layer = optarg;
            break;
        case O_LAYERS:
            a->layers = optarg;
            break;
        case O_DTYPE:
            a->dtype = optarg;
            break;
        case O_CONC:
            a->concurrency = optarg;
            break;
        case O_RATE:
            a->rate = optarg;
            break;
        case O_ARRIVAL:
            a->arrival = optarg;
            break;
        case O_TOKENS:
            a->tokens = optarg;
            break;
        case O_TOKENS_FILE:
            a->tokens_file = optarg;
            break;
        case O_ROUTING:
            a->routing = optarg;
            break;
        case O_SYNTH:
            a->synthetic = optarg;
            break;
        case O_JSON:
            a->json = optarg;
            break;
        case O_CSV:
            a->csv = optarg;
            break;
        case O_PROGRESS:
            a->progress = 1;
            break;
        case O_NO_PROGRESS:
            a->progress = 0;
            break;
        case O_HELP:
            a->help = true;
            break;
        case O_STRATEGY:
            if ((a->gating.strategy = moed_gate_strategy_parse(optarg)) < 0)
                return usage_error("--strategy %s: use model, topk, sigmoid, sparsemax, quadratic "
                                   "or pioneer",
                                   optarg);
            break;
        case ':':
            return usage_error("%s needs a value", argv[optind - 1]);
        case '?':
            return usage_error("unknown option %s", argv[optind - 1]);
        default:
            rc = parse_number(o, optarg, a);
        }
        if (rc) return rc;
    }
    if (optind < argc) return usage_error("unexpected argument '%s'", argv[optind]);
    if (a->help) return 0;
    if (a->layer && a->layers) return usage_error("give --layer or --layers, not both");
    if (a->concurrency && a->rate)
        return usage_error("give --concurrency (closed loop) or --rate (open loop), not both");
    if (a->arrival && !a->rate)
        return usage_error("--arrival shapes an open loop: it needs --rate");
    if (a->duration_set && a->requests)
        return usage_error("give --duration or --requests, not both");
    if (a->tokens && a->tokens_file) return usage_error("give --tokens or --tokens-file, not both");
    if (a->synthetic && !a->verify)
        return usage_error("--synthetic is for --verify: it names the server's weights");
    return 0;
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
    load_layer *layers;
    void *hidden;
    float *logits;
    int64_t pool_rows;
    load_verify *verify;
    double verify_bound;
    load_level *results;
    int n_results;
} run;

static int parse_specs(run *r)
{
    const args *a = &r->a;
    moed_error err;
    int rc;
    r->closed = !a->rate;
    rc = load_sweep_parse(a->rate ? "--rate" : "--concurrency",
                          a->rate          ? a->rate
                          : a->concurrency ? a->concurrency
                                           : "1",
                          r->closed, &r->levels, &r->n_levels, &err);
    if (!rc && r->closed)
        for (int i = 0; i < r->n_levels && !rc; i++)
            if (r->levels[i] > 1 << 20)
                rc = moed_fail(&err, MOED_EINVAL, "--concurrency %.0f is over %d", r->levels[i],
                               1 << 20);
    if (!rc)
        rc = a->tokens_file ? load_tokens_read(a->tokens_file, &r->tokens, &err)
                            : load_tokens_parse(a->tokens ? a->tokens : "8", &r->tokens, &err);
    if (!rc) rc = load_routing_parse(a->routing ? a->routing : "uniform", &r->routing, &err);
    if (!rc && a->arrival) rc = load_arrival_parse(a->arrival, &r->arrival, &err);
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
                           a->routing ? a->routing : "uniform");
    if (a->layer && r->n_layer_list != 1)
        return usage_error("--layer takes one layer; use --layers for a list");
    return 0;
}

/* Opens the connections, makes sure each reaches a serving server, and asks what it serves. */
static int connect_all(run *r)
{
    moedc_error err;
    moedc_opts o = { .bearer_token = r->a.token };
    r->conns = calloc((size_t)r->a.connections, sizeof *r->conns);
    if (!r->conns) return failure("out of memory");
    while (r->n_conns < r->a.connections) {
        moedc **c = &r->conns[r->n_conns];
        int status;
        if (moedc_connect(r->a.target, &o, c, &err)) return usage_error("%s", err.msg);
        r->n_conns++; /* counted at once: the cleanup closes it even when the health check fails */
        /* a health check opens the connection now, so the first measured call does not pay it */
        if (moedc_health(*c, "", &status, &err)) {
            return failure("%s: health check failed: %s: %s", r->a.target,
                           moedc_grpc_status_name(moedc_code_to_grpc(err.code)), err.msg);
        }
        if (status != MOEDC_HEALTH_SERVING) {
            return failure("%s is %s, not SERVING: wait for it, or check its log", r->a.target,
                           moedc_health_name(status));
        }
    }
    if (moedc_info(r->conns[0], &r->info, &err)) {
        return failure("%s: GetModel failed: %s", r->a.target, err.msg);
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
    if (!r->dtype)
        r->dtype = served_layer(m, r->layer_list[0]) ? served_layer(m, r->layer_list[0])->wdtype
                                                     : MOED_BF16;
    const size_t es = moed_dtype_size(r->dtype);
    for (int i = 0; i < r->n_layer_list; i++) {
        const moedc_layer_info *li = served_layer(m, r->layer_list[i]);
        if (!li) {
            char list[256] = "";
            for (int j = 0; j < m->n_layers && strlen(list) < 200; j++)
                snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", j ? "," : "",
                         m->layers[j].index);
            return usage_error("layer %d is not served by %s; it serves layers %s",
                               r->layer_list[i], r->a.target, list);
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
        load_layer *l = &r->layers[i];
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
                               r->a.target, r->info.model);
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
        .target = r->a.target,
        .model = r->info.model,
        .backend = r->info.backend,
        .dtype = moed_dtype_name(r->dtype),
        .tokens = tokens,
        .routing = r->a.routing ? r->a.routing : "uniform",
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
    r->results = calloc((size_t)r->n_levels, sizeof *r->results);
    if (!r->results) return failure("out of memory");
    fprintf(stdout, "moed-load  %s  model %s (%s backend, moed %s)\n", s->target, s->model,
            s->backend, r->info.version);
    fprintf(stdout,
            "           layers %s  dtype %s  tokens %s  routing %s  connections %d  threads %d\n",
            s->layers, s->dtype, s->tokens, s->routing, s->connections, s->threads);
    for (int i = 0; i < r->n_levels && !load_run_interrupted(); i++) {
        load_level *lv = &r->results[i];
        if (r->closed)
            lv->concurrency = (int)r->levels[i];
        else
            lv->rate = r->levels[i];
        moed_error err;
        if (load_run_level(&p, lv, &err)) {
            return failure("%s", err.msg);
        }
        r->n_results++;
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
    free(r->results);
}

int main(int argc, char **argv)
{
    run r;
    memset(&r, 0, sizeof r);
    int rc = parse_args(argc, argv, &r.a);
    if (rc) return rc;
    if (r.a.help) {
        fputs(usage, stdout);
        return 0;
    }
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
