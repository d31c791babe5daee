/*
 * moectl — moed from the shell: health, info, and forward over .npy files (npy.h says which types).
 *
 * A thin layer over libmoedclient, so what moectl does any C program can do the same way. Exit
 * codes are for scripts: 0 success, 1 the call failed (or health is not SERVING, or the output
 * could not be written), 2 the command line or an input file is wrong, with the reason on stderr.
 */
#include "moedclient.h"
#include "moed_route.h"
#include "cli_num.h"
#include "npy.h"

#include <getopt.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { EXIT_RPC = 1, EXIT_USAGE = 2 };

static const char usage_main[] =
    "usage: moectl [--target ADDR] [--timeout S] [--token T] COMMAND [options]\n"
    "\n"
    "Calls a moed daemon (default 127.0.0.1:50051).\n"
    "\n"
    "commands:\n"
    "  health    print the server's health status (exit 0 only when SERVING)\n"
    "  info      print the resident layers, backend, devices and limits\n"
    "  forward   compute one MoE layer over a .npy batch (moectl forward --help)\n"
    "\n"
    "options:\n"
    "  --target ADDR   server address (host:port, unix:/path)\n"
    "  --timeout S     deadline of the call in seconds (default: none)\n"
    "  --token T       bearer token sent as 'authorization: Bearer T'\n"
    "  --help          this text; COMMAND --help for a command's\n"
    "\n"
    "exit codes: 0 ok, 1 the call failed (code and message printed), 2 bad usage or input\n";

static const char usage_health[] =
    "usage: moectl [global options] health [--service NAME]\n"
    "\n"
    "grpc.health.v1 Check. Prints SERVING, NOT_SERVING, UNKNOWN or SERVICE_UNKNOWN;\n"
    "exits 0 only when SERVING, so `until moectl health; do sleep 1; done` waits for the server.\n"
    "  --service NAME  the service to ask about (default \"\": the server as a whole)\n";

static const char usage_info[] =
    "usage: moectl [global options] info\n"
    "\n"
    "GetModel: the model, backend, version, limits, devices, and a table of the resident layers.\n";

static const char usage_forward[] =
    "usage: moectl [global options] forward --layer N --hidden x.npy ROUTING [options] --out "
    "y.npy\n"
    "\n"
    "Sends hidden [T, d_model] (float32, float16 or bfloat16) and writes the layer's output, in "
    "the\n"
    "same dtype, to --out. bfloat16 is read from ml_dtypes' np.save ('<V2') or from uint16 bits "
    "with\n"
    "--dtype bf16, and written as uint16 bits ('<u2': np.load(f).view(ml_dtypes.bfloat16)).\n"
    "\n"
    "ROUTING, one of:\n"
    "  --ids i.npy --weights w.npy   your routing: ids [T, k] int32/int64, weights [T, k] float\n"
    "                                (id -1 with weight 0 pads a row)\n"
    "  --logits l.npy                router logits [T, experts] float, gated by the server\n"
    "  --server-router               the layer's own router on the server\n"
    "gating (with --logits or --server-router):\n"
    "  --strategy S          model (default: the layer's rule), topk, sigmoid, sparsemax,\n"
    "                        quadratic, pioneer\n"
    "  --top-k K             experts per token for topk/quadratic/pioneer (0: the layer's)\n"
    "  --renormalize on|off  renormalise the top-k weights (default: the layer's)\n"
    "  --threshold P         sigmoid threshold in (0, 1) (default 0.5)\n"
    "  --batch-gating K      batch-level dynamic gating with a set of K experts (0: the layer's\n"
    "                        top_k); prints the set S\n"
    "options:\n"
    "  --dtype bf16          take a uint16 --hidden as bf16 bit patterns\n"
    "  --request-id ID       echoed by the server\n";

/* Everything the command line says. */
typedef struct args {
    const char *target, *token, *command, *service;
    double timeout_s;
    const char *hidden, *ids, *weights, *logits, *out, *dtype, *request_id;
    long layer;
    int server_router, batch_gating, forward_opts;
    long k_batch;
    moedc_gating gating;
    int help;
} args;

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "moectl: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n(moectl --help, or moectl COMMAND --help)\n");
    va_end(ap);
    return EXIT_USAGE;
}

/* Parses argv into a; returns 0, or an exit code after printing why. */
static int parse_args(int argc, char **argv, args *a)
{
    enum {
        O_TARGET = 256,
        O_TIMEOUT,
        O_TOKEN,
        O_SERVICE,
        O_LAYER,
        O_HIDDEN,
        O_IDS,
        O_WEIGHTS,
        O_LOGITS,
        O_SERVER,
        O_STRATEGY,
        O_TOPK,
        O_RENORM,
        O_THRESHOLD,
        O_BATCH,
        O_DTYPE,
        O_REQID,
        O_OUT,
        O_HELP
    };
    static const struct option opts[] = {
        { "target", required_argument, 0, O_TARGET },
        { "timeout", required_argument, 0, O_TIMEOUT },
        { "token", required_argument, 0, O_TOKEN },
        { "service", required_argument, 0, O_SERVICE },
        { "layer", required_argument, 0, O_LAYER },
        { "hidden", required_argument, 0, O_HIDDEN },
        { "ids", required_argument, 0, O_IDS },
        { "weights", required_argument, 0, O_WEIGHTS },
        { "logits", required_argument, 0, O_LOGITS },
        { "server-router", no_argument, 0, O_SERVER },
        { "strategy", required_argument, 0, O_STRATEGY },
        { "top-k", required_argument, 0, O_TOPK },
        { "renormalize", required_argument, 0, O_RENORM },
        { "threshold", required_argument, 0, O_THRESHOLD },
        { "batch-gating", required_argument, 0, O_BATCH },
        { "dtype", required_argument, 0, O_DTYPE },
        { "request-id", required_argument, 0, O_REQID },
        { "out", required_argument, 0, O_OUT },
        { "help", no_argument, 0, O_HELP },
        { 0, 0, 0, 0 },
    };
    memset(a, 0, sizeof *a);
    a->target = "127.0.0.1:50051";
    a->layer = -1;
    long long v;
    int o;
    opterr = 0;
    while ((o = getopt_long(argc, argv, ":", opts, NULL)) != -1) {
        if (o >= O_LAYER && o <= O_OUT) a->forward_opts = 1;
        switch (o) {
        case O_TARGET:
            a->target = optarg;
            break;
        case O_TOKEN:
            a->token = optarg;
            break;
        case O_SERVICE:
            a->service = optarg;
            break;
        case O_HIDDEN:
            a->hidden = optarg;
            break;
        case O_IDS:
            a->ids = optarg;
            break;
        case O_WEIGHTS:
            a->weights = optarg;
            break;
        case O_LOGITS:
            a->logits = optarg;
            break;
        case O_SERVER:
            a->server_router = 1;
            break;
        case O_DTYPE:
            a->dtype = optarg;
            break;
        case O_REQID:
            a->request_id = optarg;
            break;
        case O_OUT:
            a->out = optarg;
            break;
        case O_HELP:
            a->help = 1;
            break;
        case O_TIMEOUT:
            if (cli_double(optarg, 0, 1e9, &a->timeout_s) || a->timeout_s <= 0)
                return usage_error("--timeout %s: give seconds > 0", optarg);
            break;
        case O_LAYER:
            if (cli_int(optarg, 0, 1 << 30, &v))
                return usage_error("--layer %s: give a layer index >= 0", optarg);
            a->layer = (long)v;
            break;
        case O_STRATEGY:
            if ((a->gating.strategy = moed_gate_strategy_parse(optarg)) < 0)
                return usage_error(
                    "--strategy %s: use model, topk, sigmoid, sparsemax, quadratic or pioneer",
                    optarg);
            break;
        case O_TOPK:
            if (cli_int(optarg, 0, 65535, &v))
                return usage_error("--top-k %s: give a count >= 0", optarg);
            a->gating.top_k = (int)v;
            break;
        case O_RENORM:
            if (strcmp(optarg, "on") && strcmp(optarg, "off"))
                return usage_error("--renormalize %s: use on or off", optarg);
            a->gating.renormalize = !strcmp(optarg, "on") ? MOEDC_RENORM_ON : MOEDC_RENORM_OFF;
            break;
        case O_THRESHOLD: {
            double t;
            if (cli_double(optarg, -INFINITY, INFINITY, &t))
                return usage_error("--threshold %s: give a number in (0, 1)", optarg);
            a->gating.threshold = (float)t;
            break;
        }
        case O_BATCH:
            if (cli_int(optarg, 0, 65535, &v))
                return usage_error("--batch-gating %s: give a set size >= 0", optarg);
            a->k_batch = (long)v;
            a->batch_gating = 1;
            break;
        case ':':
            return usage_error("%s needs a value", argv[optind - 1]);
        default:
            return usage_error("unknown option %s", argv[optind - 1]);
        }
    }
    if (optind < argc) a->command = argv[optind++];
    if (optind < argc) return usage_error("unexpected argument '%s'", argv[optind]);
    return 0;
}

/* ---- health and info ---- */

static int rpc_error(const char *what, const moedc_error *err)
{
    fprintf(stderr, "moectl: %s failed: %s: %s\n", what,
            moedc_grpc_status_name(moedc_code_to_grpc(err->code)), err->msg);
    return EXIT_RPC;
}

static int cmd_health(moedc *c, const args *a)
{
    moedc_error err;
    int status;
    if (moedc_health(c, a->service, &status, &err)) return rpc_error("health check", &err);
    printf("%s\n", moedc_health_name(status));
    return status == MOEDC_HEALTH_SERVING ? 0 : EXIT_RPC;
}

static void print_layers(const moedc_model_info *m)
{
    static const char *const rules[] = { "-", "softmax_topk", "deepseek_v3" };
    printf("%5s %7s %6s %7s %5s %6s %5s %6s %4s %12s %9s %6s %5s\n", "layer", "d_model", "d_ff",
           "experts", "top_k", "act", "dtype", "router", "norm", "rule", "shared", "groups",
           "scale");
    for (int i = 0; i < m->n_layers; i++) {
        const moedc_layer_info *l = &m->layers[i];
        char shared[32], groups[32];
        snprintf(shared, sizeof shared, "%dx%d", l->n_shared, l->shared_d_ff);
        snprintf(groups, sizeof groups, "%d/%d", l->n_group, l->topk_group);
        printf("%5d %7d %6d %7d %5d %6s %5s %6s %4d %12s %9s %6s %5g\n", l->index, l->d_model,
               l->d_ff, l->n_experts, l->top_k, moed_act_name((moed_act)l->act),
               moed_dtype_name(l->wdtype), l->has_router ? "yes" : "no", l->norm_topk,
               l->rule >= 0 && l->rule <= 2 ? rules[l->rule] : "?", shared, groups,
               (double)l->routed_scale);
    }
}

static int cmd_info(moedc *c)
{
    moedc_error err;
    moedc_model_info m;
    if (moedc_info(c, &m, &err)) return rpc_error("GetModel", &err);
    printf("model     %s\nbackend   %s\nversion   %s\n", m.model, m.backend, m.version);
    printf("limits    %llu bytes per message, %u tokens per request\n",
           (unsigned long long)m.max_message_bytes, m.max_batch_tokens);
    for (int i = 0; i < m.n_devices; i++)
        printf("device    %s: %.0f of %.0f MiB used\n", m.devices[i].name,
               (double)m.devices[i].memory_used / (1 << 20),
               (double)m.devices[i].memory_total / (1 << 20));
    print_layers(&m);
    moedc_model_info_free(&m);
    return 0;
}

/* ---- forward ---- */

/* Inputs of a forward, read from their files. */
typedef struct inputs {
    moed_npy hidden, ids, weights, logits;
} inputs;

static void inputs_free(inputs *in)
{
    moed_npy_free(&in->hidden);
    moed_npy_free(&in->ids);
    moed_npy_free(&in->weights);
    moed_npy_free(&in->logits);
}

/* Reads path into a as a [rows, *] matrix of dtype; rows < 0 accepts any. */
static int load_matrix(const char *flag, const char *path, int dtype, int64_t rows, moed_npy *a)
{
    moed_error err;
    if (moed_npy_read(path, a, &err)) {
        fprintf(stderr, "moectl: %s: %s\n", flag, err.msg);
        return EXIT_USAGE;
    }
    if (moed_npy_convert(a, dtype, flag, &err)) {
        fprintf(stderr, "moectl: %s\n", err.msg);
        return EXIT_USAGE;
    }
    if (a->ndim != 2 || (rows >= 0 && a->shape[0] != rows)) {
        fprintf(stderr, "moectl: %s %s has %d dims%s; it must be [%s, n]\n", flag, path, a->ndim,
                a->ndim == 2 ? " and a different token count" : "", rows >= 0 ? "T" : "tokens");
        return EXIT_USAGE;
    }
    return 0;
}

static int check_forward_args(const args *a)
{
    int routes = (a->ids || a->weights) + !!a->logits + a->server_router;
    if (a->layer < 0) return usage_error("forward needs --layer N");
    if (!a->hidden) return usage_error("forward needs --hidden x.npy");
    if (!a->out) return usage_error("forward needs --out y.npy");
    if (routes != 1)
        return usage_error("forward needs exactly one routing: --ids with --weights, --logits, or "
                           "--server-router");
    if ((a->ids != NULL) != (a->weights != NULL))
        return usage_error("--ids and --weights go together");
    if (a->dtype && moed_dtype_parse(a->dtype) != MOED_BF16)
        return usage_error("--dtype %s: only bf16 is needed (for uint16 input)", a->dtype);
    return 0;
}

static int load_inputs(const args *a, inputs *in)
{
    moed_error err;
    if (moed_npy_read(a->hidden, &in->hidden, &err)) {
        fprintf(stderr, "moectl: --hidden: %s\n", err.msg);
        return EXIT_USAGE;
    }
    int hd = in->hidden.dtype;
    if (hd == MOED_NPY_U16 && !a->dtype) {
        fprintf(stderr,
                "moectl: --hidden %s holds uint16: add --dtype bf16 if these are bf16 bits\n",
                a->hidden);
        return EXIT_USAGE;
    }
    if (hd == MOED_NPY_U16) hd = MOED_BF16;
    if (!moed_dtype_is_float(hd) || in->hidden.ndim != 2) {
        fprintf(stderr,
                "moectl: --hidden %s is %dd %s; it must be [T, d_model] of float32, "
                "float16 or bfloat16\n",
                a->hidden, in->hidden.ndim, moed_npy_type_name(in->hidden.dtype));
        return EXIT_USAGE;
    }
    moed_npy_convert(&in->hidden, hd, "--hidden", &err); /* u2 -> bf16, or nothing */
    int64_t T = in->hidden.shape[0];
    if (a->ids) {
        int rc = load_matrix("--ids", a->ids, MOED_I32, T, &in->ids);
        if (!rc) rc = load_matrix("--weights", a->weights, MOED_F32, T, &in->weights);
        if (!rc && in->ids.shape[1] != in->weights.shape[1]) {
            fprintf(stderr, "moectl: --ids has %lld columns, --weights %lld: they must match\n",
                    (long long)in->ids.shape[1], (long long)in->weights.shape[1]);
            rc = EXIT_USAGE;
        }
        return rc;
    }
    return a->logits ? load_matrix("--logits", a->logits, MOED_F32, T, &in->logits) : 0;
}

static void print_result(const args *a, const moedc_result *r)
{
    const moedc_timings *t = &r->timings;
    printf("wrote %s: [%lld, %lld] %s\n", a->out, (long long)r->tokens, (long long)r->d_model,
           moed_dtype_name(r->dtype));
    printf("timings: queue %llu us, compute %llu us, total %llu us; batch of %u tokens, %u "
           "requests\n",
           (unsigned long long)t->queue_us, (unsigned long long)t->compute_us,
           (unsigned long long)t->total_us, t->batch_tokens, t->batch_requests);
    if (r->n_expert_set) {
        printf("expert set:");
        for (size_t i = 0; i < r->n_expert_set; i++) printf(" %d", r->expert_set[i]);
        printf("\n");
    }
}

static int cmd_forward(moedc *c, const args *a)
{
    inputs in;
    memset(&in, 0, sizeof in);
    moedc_error err;
    moedc_result res;
    memset(&res, 0, sizeof res);
    int rc = check_forward_args(a);
    if (!rc) rc = load_inputs(a, &in);
    if (rc) goto out;
    moedc_request req = {
        .request_id = a->request_id,
        .layer = (uint32_t)a->layer,
        .dtype = in.hidden.dtype,
        .tokens = in.hidden.shape[0],
        .d_model = in.hidden.shape[1],
        .hidden = in.hidden.data,
        .routing = a->ids      ? MOEDC_ROUTE_EXPERTS
                   : a->logits ? MOEDC_ROUTE_LOGITS
                               : MOEDC_ROUTE_SERVER,
        .k = a->ids ? (int)in.ids.shape[1] : 0,
        .expert_ids = in.ids.data,
        .expert_weights = in.weights.data,
        .n_experts = a->logits ? (int)in.logits.shape[1] : 0,
        .logits = in.logits.data,
        .gating = a->gating,
        .batch_gating = a->batch_gating,
        .k_batch = (uint32_t)a->k_batch,
    };
    if (moedc_forward(c, &req, &res, &err)) {
        rc = rpc_error("Forward", &err);
        goto out;
    }
    int64_t shape[2] = { res.tokens, res.d_model };
    moed_error werr;
    if (moed_npy_write(a->out, res.dtype, 2, shape, res.output, &werr)) {
        fprintf(stderr, "moectl: --out: %s\n", werr.msg);
        rc = EXIT_RPC;
        goto out;
    }
    print_result(a, &res);
out:
    moedc_result_free(&res);
    inputs_free(&in);
    return rc;
}

int main(int argc, char **argv)
{
    args a;
    int rc = parse_args(argc, argv, &a);
    if (rc) return rc;
    const char *help = !a.command                      ? usage_main
                       : !strcmp(a.command, "health")  ? usage_health
                       : !strcmp(a.command, "info")    ? usage_info
                       : !strcmp(a.command, "forward") ? usage_forward
                                                       : NULL;
    if (!help) return usage_error("unknown command '%s'", a.command);
    if (a.help) {
        fputs(help, stdout);
        return 0;
    }
    if (!a.command) {
        fputs(usage_main, stderr);
        return EXIT_USAGE;
    }
    if (a.forward_opts && strcmp(a.command, "forward"))
        return usage_error("forward's options were given to '%s'", a.command);
    if (a.service && strcmp(a.command, "health"))
        return usage_error("--service belongs to health, not '%s'", a.command);
    moedc_error err;
    moedc *c;
    moedc_opts opts = { .timeout_s = a.timeout_s, .bearer_token = a.token };
    if (moedc_connect(a.target, &opts, &c, &err)) {
        fprintf(stderr, "moectl: %s\n", err.msg);
        return EXIT_USAGE;
    }
    rc = !strcmp(a.command, "health") ? cmd_health(c, &a)
         : !strcmp(a.command, "info") ? cmd_info(c)
                                      : cmd_forward(c, &a);
    moedc_close(c);
    return rc;
}
