/*
 * moectl — moed from the shell: health, info, regions, and forward over .npy files (npy.h says
 * which types), inline or through a shared-memory region (--shm).
 *
 * A thin layer over libmoedclient, so what moectl does any C program can do the same way. Exit
 * codes are for scripts: 0 success, 1 the call failed (or health is not SERVING, or the output
 * could not be written), 2 the command line or an input file is wrong, with the reason on stderr.
 */
#include "cli_common.h"
#include "moed_opt.h"
#include "moedclient.h"
#include "moed_dtype.h"
#include "moed_route.h"
#include "npy.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { EXIT_RPC = 1, EXIT_USAGE = MOED_OPT_EXIT_USAGE };

/* Everything the command line says. */
typedef struct args {
    cli_conn conn;
    double timeout_s;
    const char *service;
    int64_t layer, top_k, k_batch;
    const char *hidden, *ids, *weights, *logits, *out, *dtype, *request_id;
    int server_router, strategy, renormalize;
    double threshold;
    bool batch_gating; /* --batch-gating given */
    int shm;           /* --shm: hidden and the output through a host region */
} args;

#define F(member) offsetof(args, member)

static const moed_opt options[] = {
    MOED_OPT_SECTION_ROW("options:", NULL),
    CLI_CONN_OPTS(args),
    MOED_OPT_NUM_ROW("timeout", F(timeout_s), "S", 1e-6, 1e9, NULL, "give seconds > 0", NULL,
                     "deadline of the call in seconds (default: none)"),
    MOED_OPT_HELP_ROW("this text; COMMAND --help for a command's"),

    MOED_OPT_STR_ROW("service", F(service), "NAME", NULL, "health",
                     "the service to ask about (default \"\": the server as a whole)"),

    MOED_OPT_I64_ROW("layer", F(layer), "N", 0, 1 << 30, NULL, "give a layer index >= 0", "forward",
                     "the layer to compute (as moectl info lists them)"),
    MOED_OPT_STR_ROW("hidden", F(hidden), "x.npy", NULL, "forward",
                     "hidden states [T, d_model]: float32, float16 or bfloat16"),
    MOED_OPT_STR_ROW("out", F(out), "y.npy", NULL, "forward", "where the output goes"),
    MOED_OPT_SECTION_ROW("ROUTING, one of:", "forward"),
    MOED_OPT_STR_ROW("ids", F(ids), "i.npy", NULL, "forward",
                     "your routing: expert ids [T, k] int32/int64, with --weights\n"
                     "(id -1 with weight 0 pads a row)"),
    MOED_OPT_STR_ROW("weights", F(weights), "w.npy", NULL, "forward",
                     "your routing: their weights [T, k] float, with --ids"),
    MOED_OPT_STR_ROW("logits", F(logits), "l.npy", NULL, "forward",
                     "router logits [T, experts] float, gated by the server"),
    MOED_OPT_FLAG_ROW("server-router", F(server_router), 1, "forward",
                      "the layer's own router on the server"),
    MOED_OPT_SECTION_ROW("gating (with --logits or --server-router):", "forward"),
    MOED_OPT_CUSTOM_ROW("strategy", F(strategy), "S", cli_parse_strategy, NULL,
                        "use model, topk, sigmoid, sparsemax, quadratic or pioneer", "forward",
                        "model (default: the layer's rule), topk, sigmoid, sparsemax,\n"
                        "quadratic, pioneer"),
    MOED_OPT_I64_ROW("top-k", F(top_k), "K", 0, 65535, NULL, "give a count >= 0", "forward",
                     "experts per token for topk/quadratic/pioneer (0: the layer's)"),
    MOED_OPT_CUSTOM_ROW("renormalize", F(renormalize), "on|off", cli_parse_on_off, NULL,
                        "use on or off", "forward",
                        "renormalise the top-k weights (default: the layer's)"),
    MOED_OPT_NUM_ROW("threshold", F(threshold), "P", -INFINITY, INFINITY, NULL,
                     "give a number in (0, 1)", "forward",
                     "sigmoid threshold in (0, 1) (default 0.5)"),
    MOED_OPT_I64_ROW("batch-gating", F(k_batch), "K", 0, 65535, NULL, "give a set size >= 0",
                     "forward",
                     "batch-level dynamic gating with a set of K experts (0: the layer's\n"
                     "top_k); prints the set S"),
    MOED_OPT_SECTION_ROW("options:", "forward"),
    MOED_OPT_STR_ROW("dtype", F(dtype), "bf16", NULL, "forward",
                     "take a uint16 --hidden as bf16 bit patterns"),
    MOED_OPT_STR_ROW("request-id", F(request_id), "ID", NULL, "forward", "echoed by the server"),
    MOED_OPT_FLAG_ROW("shm", F(shm), 1, "forward",
                      "send hidden and take the output through a shared-memory region\n"
                      "(on the server's host): no tensor bytes on the wire"),
};

static const moed_opt_cmd commands[] = {
    { .name = NULL,
      .head = "usage: moectl [--target ADDR] [--timeout S] [--token T] COMMAND [options]\n"
              "\n"
              "Calls a moed daemon.\n"
              "\n"
              "commands:\n"
              "  health    print the server's health status (exit 0 only when SERVING)\n"
              "  info      print the resident layers, backend, devices and limits (while the\n"
              "            weights load: how far the load has come)\n"
              "  regions   list this token's tensor regions on the server\n"
              "  forward   compute one MoE layer over a .npy batch (moectl forward --help)\n",
      .tail = "exit codes: 0 ok, 1 the call failed (code and message printed), 2 bad usage or "
              "input\n" },
    { .name = "health",
      .head = "usage: moectl [global options] health [--service NAME]\n"
              "\n"
              "grpc.health.v1 Check. Prints SERVING, NOT_SERVING, UNKNOWN or SERVICE_UNKNOWN;\n"
              "exits 0 only when SERVING, so `until moectl health; do sleep 1; done` waits for "
              "the server.\n"
              "\n"
              "options:\n" },
    { .name = "info",
      .head = "usage: moectl [global options] info\n"
              "\n"
              "GetModel: the model, backend, version, limits, devices, and a table of the "
              "resident layers.\n" },
    { .name = "regions",
      .head = "usage: moectl [global options] regions\n"
              "\n"
              "ListRegions: the tensor regions registered with this token, from every session.\n" },
    { .name = "forward",
      .head = "usage: moectl [global options] forward --layer N --hidden x.npy ROUTING [options] "
              "--out y.npy\n"
              "\n"
              "Sends hidden [T, d_model] (float32, float16 or bfloat16) and writes the layer's "
              "output, in the\n"
              "same dtype, to --out. bfloat16 is read from ml_dtypes' np.save ('<V2') or from "
              "uint16 bits with\n"
              "--dtype bf16, and written as uint16 bits ('<u2': "
              "np.load(f).view(ml_dtypes.bfloat16)).\n"
              "\n" },
};

static const moed_opt_spec command_line = {
    .prog = "moectl",
    .hint = "moectl --help, or moectl COMMAND --help",
    .opts = options,
    .n_opts = sizeof options / sizeof options[0],
    .cmds = commands,
    .n_cmds = sizeof commands / sizeof commands[0],
};

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
    printf("%5s %7s %6s %7s %5s %6s %5s %6s %4s %12s %9s %6s %5s %s\n", "layer", "d_model", "d_ff",
           "experts", "top_k", "act", "dtype", "router", "norm", "rule", "shared", "groups",
           "scale", "held");
    for (int i = 0; i < m->n_layers; i++) {
        const moedc_layer_info *l = &m->layers[i];
        char shared[32], groups[32], dtype[32], held[512] = "";
        snprintf(shared, sizeof shared, "%dx%d", l->n_shared, l->shared_d_ff);
        snprintf(groups, sizeof groups, "%d/%d", l->n_group, l->topk_group);
        snprintf(dtype, sizeof dtype, "%s%s", moed_dtype_name(l->wdtype),
                 l->sparse24 ? "/2:4" : "");
        for (int r = 0; r < l->n_held; r++) /* the experts this daemon holds (--experts) */
            snprintf(held + strlen(held), sizeof held - strlen(held),
                     l->held[r].first == l->held[r].last ? "%s%d" : "%s%d-%d", r ? "," : "",
                     l->held[r].first, l->held[r].last);
        if (l->n_shared && l->adds_shared)
            snprintf(held + strlen(held), sizeof held - strlen(held), "+shared");
        bool split = false; /* over several devices (--expert-parallel): say where */
        for (int r = 0; r < l->n_placed; r++)
            split = split || l->placed[r].device != l->home_device;
        if (split)
            snprintf(held + strlen(held), sizeof held - strlen(held), " (home device %d;",
                     l->home_device);
        for (int r = 0; split && r < l->n_placed; r++)
            snprintf(held + strlen(held), sizeof held - strlen(held), "%s%d-%d@%d", r ? "," : " ",
                     l->placed[r].first, l->placed[r].last, l->placed[r].device);
        for (int r = 0; split && r < l->n_replicas; r++) /* copies of hot experts (--rebalance) */
            snprintf(held + strlen(held), sizeof held - strlen(held), "%s%d@%d",
                     r ? "," : "; copies ", l->replicas[r].expert, l->replicas[r].device);
        if (split && l->placement_generation)
            snprintf(held + strlen(held), sizeof held - strlen(held), "; re-placed %ux",
                     (unsigned)l->placement_generation);
        if (split) snprintf(held + strlen(held), sizeof held - strlen(held), ")");
        printf("%5d %7d %6d %7d %5d %6s %5s %6s %4d %12s %9s %6s %5g %s\n", l->index, l->d_model,
               l->d_ff, l->n_experts, l->top_k, moed_act_name((moed_act)l->act), dtype,
               l->has_router ? "yes" : "no", l->norm_topk,
               l->rule >= 0 && l->rule <= 2 ? rules[l->rule] : "?", shared, groups,
               (double)l->routed_scale, held);
    }
}

/* A daemon still loading its weights: how far it has come, one line. */
static void print_loading(const moedc_load_progress *l)
{
    printf("loading   %s", l->phase[0] ? l->phase : "starting");
    if (l->layer >= 0) printf(" layer %d", l->layer);
    printf(" (%d of %d layers done): %.1f%%", l->layers_done, l->layers_total, l->percent);
    if (l->bytes_total)
        printf(" of %.2f GiB at %.0f MiB/s", (double)l->bytes_total / (1 << 30),
               l->bytes_per_s / (1 << 20));
    if (l->eta_s >= 0) printf(", about %.0f s left", l->eta_s);
    printf("; phase %d of %d, %.1f s since the load began\n", l->phase_number, l->phases,
           l->elapsed_s);
}

static int cmd_info(moedc *c)
{
    moedc_error err;
    moedc_model_info m;
    if (moedc_info(c, &m, &err)) return rpc_error("GetModel", &err);
    printf("model     %s\nbackend   %s\nversion   %s\n", m.model, m.backend, m.version);
    if (m.is_loading) { /* no layers, limits or regions yet */
        print_loading(&m.loading);
    } else {
        printf("limits    %llu bytes per message, %u tokens per request\n",
               (unsigned long long)m.max_message_bytes, m.max_batch_tokens);
        printf("regions   %s: %u per token, %llu bytes per token, %llu in all%s\n", m.regions_mode,
               m.max_regions, (unsigned long long)m.max_region_bytes,
               (unsigned long long)m.max_region_bytes_total, m.cuda_regions ? ", CUDA too" : "");
    }
    for (int i = 0; i < m.n_devices; i++)
        printf("device    %s: %.0f of %.0f MiB used\n", m.devices[i].name,
               (double)m.devices[i].memory_used / (1 << 20),
               (double)m.devices[i].memory_total / (1 << 20));
    if (!m.is_loading) print_layers(&m);
    moedc_model_info_free(&m);
    return 0;
}

static int cmd_regions(moedc *c)
{
    static const char *const kinds[] = { "?", "host", "cuda" };
    moedc_error err;
    moedc_region_info *r;
    int n;
    if (moedc_list_regions(c, &r, &n, &err)) return rpc_error("ListRegions", &err);
    printf("%20s %5s %14s %6s %8s %s\n", "id", "kind", "bytes", "state", "requests", "name");
    for (int i = 0; i < n; i++)
        printf("%20llu %5s %14llu %6s %8u %s\n", (unsigned long long)r[i].id,
               kinds[r[i].kind >= 1 && r[i].kind <= 2 ? r[i].kind : 0],
               (unsigned long long)r[i].bytes,
               r[i].broken  ? "broken"
               : r[i].ready ? "ready"
                            : "new",
               r[i].requests, r[i].kind == MOEDC_REGION_CUDA ? "-" : r[i].name);
    free(r);
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
    if (a->layer < 0) return moed_opt_usage(&command_line, "forward needs --layer N");
    if (!a->hidden) return moed_opt_usage(&command_line, "forward needs --hidden x.npy");
    if (!a->out) return moed_opt_usage(&command_line, "forward needs --out y.npy");
    if (routes != 1)
        return moed_opt_usage(
            &command_line, "forward needs exactly one routing: --ids with --weights, --logits, or "
                           "--server-router");
    if ((a->ids != NULL) != (a->weights != NULL))
        return moed_opt_usage(&command_line, "--ids and --weights go together");
    if (a->dtype && moed_dtype_parse(a->dtype) != MOED_BF16)
        return moed_opt_usage(&command_line, "--dtype %s: only bf16 is needed (for uint16 input)",
                              a->dtype);
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

/* --shm: hidden copied into a host region of a fresh session, and the output placed behind it. */
static int through_region(moedc *c, moedc_request *req, moedc_session **session)
{
    moedc_error err;
    moedc_region *r;
    const size_t bytes = (size_t)(req->tokens * req->d_model) * moed_dtype_size(req->dtype);
    const size_t out_at = (bytes + 63) / 64 * 64;
    if (moedc_session_open(c, session, &err) ||
        moedc_region_create_host(*session, out_at + bytes, 0, &r, &err)) {
        moedc_session_close(*session);
        *session = NULL;
        return rpc_error("registering a shared-memory region", &err);
    }
    memcpy(r->ptr, req->hidden, bytes);
    req->hidden_at = (moedc_ref){ r, 0 };
    req->output_at = (moedc_ref){ r, out_at };
    return 0;
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
        .gating = { .strategy = a->strategy,
                    .top_k = (int)a->top_k,
                    .renormalize = a->renormalize,
                    .threshold = (float)a->threshold },
        .batch_gating = a->batch_gating,
        .k_batch = (uint32_t)a->k_batch,
    };
    moedc_session *session = NULL;
    if (a->shm && (rc = through_region(c, &req, &session))) goto out;
    int failed = moedc_forward(c, &req, &res, &err);
    if (failed) {
        rc = rpc_error("Forward", &err);
        moedc_session_close(session);
        goto out;
    }
    int64_t shape[2] = { res.tokens, res.d_model };
    moed_error werr;
    if (moed_npy_write(a->out, res.dtype, 2, shape, res.output, &werr)) {
        fprintf(stderr, "moectl: --out: %s\n", werr.msg);
        rc = EXIT_RPC;
        moedc_session_close(session);
        goto out;
    }
    print_result(a, &res);
    moedc_session_close(session); /* after the output was read from its region */
out:
    moedc_result_free(&res);
    inputs_free(&in);
    return rc;
}

/* Parses the command line into a; false (with *rc the exit code) when moectl should stop. */
static bool parse_args(int argc, char **argv, args *a, const char **command, int *rc)
{
    memset(a, 0, sizeof *a);
    moed_opt_parsed p;
    if (!moed_opt_parse(&command_line, argc, argv, a, &p, rc)) return false;
    *command = p.command;
    a->batch_gating = moed_opt_given(&command_line, &p, "batch-gating");
    if (!moed_opt_given(&command_line, &p, "layer")) a->layer = -1;
    return true;
}

static int connect_to(args *a, moedc **c)
{
    moedc_opts opts;
    moedc_error err;
    int rc = cli_conn_opts(&command_line, &a->conn, &opts);
    if (rc) return rc;
    opts.timeout_s = a->timeout_s;
    if (cli_connect(&a->conn, &opts, c, &err)) {
        fprintf(stderr, "moectl: %s\n", err.msg);
        return EXIT_USAGE;
    }
    return 0;
}

int main(int argc, char **argv)
{
    args a;
    const char *command;
    moedc *c;
    int rc;
    if (!parse_args(argc, argv, &a, &command, &rc)) return rc;
    rc = connect_to(&a, &c);
    if (!rc) {
        rc = !strcmp(command, "health")    ? cmd_health(c, &a)
             : !strcmp(command, "info")    ? cmd_info(c)
             : !strcmp(command, "regions") ? cmd_regions(c)
                                           : cmd_forward(c, &a);
        moedc_close(c);
    }
    cli_conn_free(&a.conn);
    return rc;
}
