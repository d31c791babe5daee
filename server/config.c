/*
 * moed_config — the daemon's option table, and what only the daemon checks: listen addresses,
 * lists of layers, experts and devices, options that go together (config.h states the contract;
 * moed_opt.c reads the command line and the file).
 */
#include "config.h"

#include "moed_opt.h"
#include "moed_place.h"
#include "moed_synth.h"

#include "file.h"
#include "log.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* One item of a list of numbers and ranges ("7" or "0-3") at *p, each from 0 to max: its bounds
 * in *a and *b, *p moved past it and its comma; -1 for anything else (a trailing comma too). */
static int next_range(const char **p, int64_t max, int64_t *a, int64_t *b)
{
    char *end;
    if (moed_opt_integer(*p, a, &end) || *a < 0 || *a > max) return -1;
    *b = *a;
    if (*end == '-' && (moed_opt_integer(end + 1, b, &end) || *b < *a || *b > max)) return -1;
    if ((*end != ',' && *end != 0) || (*end == ',' && !end[1])) return -1;
    *p = *end ? end + 1 : end;
    return 0;
}

int moed_config_parse_layers(const char *list, int **out, int *n, moed_error *err)
{
    *out = NULL;
    *n = 0;
    size_t len = strlen(list);
    if (len > MOED_CONFIG_MAX_LIST)
        return moed_fail(err, MOED_EINVAL,
                         "a list of %zu characters; at most %d are accepted (use ranges, like "
                         "0-59)",
                         len, MOED_CONFIG_MAX_LIST);
    /* Marks in a table indexed by number, then collects them in order: linear in the list and the
     * largest number, however the ranges overlap or are ordered (no sort). */
    unsigned char *mark = calloc(MOED_CONFIG_MAX_LAYER + 1, 1);
    if (!mark) return moed_fail(err, MOED_ENOMEM, "out of memory expanding '%s'", list);
    const char *p = list;
    int64_t top = -1;
    do {
        int64_t a, b;
        if (next_range(&p, MOED_CONFIG_MAX_LAYER, &a, &b)) goto bad;
        memset(mark + a, 1, (size_t)(b - a + 1));
        if (b > top) top = b;
        continue;
    bad:
        free(mark);
        return moed_fail(err, MOED_EINVAL,
                         "bad list '%s' at '%s': expected comma-separated numbers from 0 to %d, or "
                         "ranges like 0-3,7",
                         list, p, MOED_CONFIG_MAX_LAYER);
    } while (*p);
    int count = 0;
    for (int64_t i = 0; i <= top; i++) count += mark[i];
    int *v = malloc((size_t)count * sizeof *v);
    if (!v) {
        free(mark);
        return moed_fail(err, MOED_ENOMEM, "out of memory expanding '%s'", list);
    }
    for (int64_t i = 0, k = 0; i <= top; i++)
        if (mark[i]) v[k++] = (int)i;
    free(mark);
    *out = v;
    *n = count;
    return 0;
}

/* The host of host:port, n bytes at h: an IPv6 address in brackets, a dotted IPv4 address, or a
 * name (letters, digits, '.', '-', '_'); empty only where the caller allows it (every interface).
 * The socket layer's own parsers decide the literals, so what passes here binds as written. */
static bool host_ok(const char *h, size_t n, bool empty_ok)
{
    char buf[64];
    unsigned char addr[16];
    if (!n) return empty_ok;
    if (h[0] == '[') {
        if (n < 3 || h[n - 1] != ']' || n - 2 >= sizeof buf) return false;
        memcpy(buf, h + 1, n - 2);
        buf[n - 2] = 0;
        return inet_pton(AF_INET6, buf, addr) == 1;
    }
    if (strspn(h, "0123456789.") >= n) {
        if (n >= sizeof buf) return false;
        memcpy(buf, h, n);
        buf[n] = 0;
        return inet_pton(AF_INET, buf, addr) == 1;
    }
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)h[i]) && !strchr(".-_", h[i])) return false;
    return true;
}

/* A listen address. For gRPC (grpc): unix:PATH or unix-abstract:NAME of at most
 * MOED_CONFIG_MAX_UNIX_PATH bytes (what a socket address holds), or host:port with a host (never
 * empty: gRPC's server takes no ":port") and without a scheme (gRPC's server takes no ipv4:,
 * ipv6: or dns:). For the metrics endpoint, host:port with an empty host for every interface. The
 * port is decimal, 0 to 65535 (0: the system picks one). Whether a name resolves is found where
 * it is bound. */
static int check_addr(const char *value, bool grpc, moed_error *err)
{
    const char *given = value;
    if (grpc && (!strncmp(value, "unix:", 5) || !strncmp(value, "unix-abstract:", 14))) {
        const char *path = value + strcspn(value, ":") + 1;
        if (!*path) return moed_fail(err, MOED_EINVAL, "'%s' names no socket path", value);
        if (strlen(path) > MOED_CONFIG_MAX_UNIX_PATH)
            return moed_fail(err, MOED_EINVAL,
                             "the socket path of '%s' is %zu bytes; a unix socket's is at most %d: "
                             "choose a shorter one",
                             value, strlen(path), MOED_CONFIG_MAX_UNIX_PATH);
        return 0;
    }
    static const char *const schemes[] = { "dns:", "ipv4:", "ipv6:" };
    for (size_t i = 0; grpc && i < sizeof schemes / sizeof schemes[0]; i++)
        if (!strncmp(value, schemes[i], strlen(schemes[i])))
            return moed_fail(err, MOED_EINVAL,
                             "'%s': gRPC's server takes host:port without a scheme (%s is for "
                             "clients' targets); give e.g. 127.0.0.1:50051, [::1]:50051 or "
                             "localhost:50051",
                             given, schemes[i]);
    const char *colon = strrchr(value, ':'), *port = colon ? colon + 1 : "";
    size_t digits = strspn(port, "0123456789");
    long v = digits && digits <= 5 && !port[digits] ? strtol(port, NULL, 10) : -1;
    bool bracketed = value[0] == '[' && colon && colon > value && colon[-1] == ']';
    bool v6_bare = colon && memchr(value, ':', (size_t)(colon - value)) && !bracketed;
    if (digits && !port[digits] && !v6_bare && (v < 0 || v > 65535))
        return moed_fail(err, MOED_EINVAL,
                         "port %s of '%s' is out of range; give a port from 1 to 65535 (or 0 "
                         "for any free one)",
                         port, given);
    if (v < 0 || v6_bare)
        return moed_fail(err, MOED_EINVAL,
                         "'%s' is not host:port; give e.g. 127.0.0.1:50051, [::1]:50051 or "
                         "0.0.0.0:50051 (a port from 1 to 65535)%s",
                         given, grpc ? ", or unix:PATH" : "");
    if (!host_ok(value, (size_t)(colon - value), !grpc))
        return moed_fail(err, MOED_EINVAL,
                         "'%s' has no host moed can listen on: give a name, a dotted IPv4 "
                         "address (each part 0 to 255) or an IPv6 address in brackets, e.g. "
                         "127.0.0.1, [::1] or localhost",
                         given);
    return 0;
}

/* ---- the values only the daemon takes (the table's customs) ---- */

static int parse_addr(const char *value, void *field, bool grpc, moed_error *err)
{
    int rc = *value ? check_addr(value, grpc, err)
                    : moed_fail(err, MOED_EINVAL, "empty value; give a ADDR");
    if (!rc) *(const char **)field = value;
    return rc;
}

static int parse_listen(const char *value, void *field, moed_error *err)
{
    return parse_addr(value, field, true, err);
}

static int parse_metrics_listen(const char *value, void *field, moed_error *err)
{
    return parse_addr(value, field, false, err);
}

static int parse_level(const char *value, void *field, moed_error *err)
{
    int level = moed_log_parse_level(value);
    if (level < 0)
        return moed_fail(err, MOED_EINVAL, "'%s' is not a log level; use one of %s", value,
                         "debug|info|warn|error");
    *(int *)field = level;
    return 0;
}

static int parse_list(const char *value, void *field, moed_error *err)
{
    moed_config_list *l = field;
    int *v, n, rc = moed_config_parse_layers(value, &v, &n, err);
    if (rc) return rc;
    free(l->v);
    *l = (moed_config_list){ .text = value, .v = v, .n = n };
    return 0;
}

static int parse_devices(const char *value, void *field, moed_error *err)
{
    moed_config_devices *d = field;
    int n = 0;
    const char *p = value;
    do {
        int64_t a, b;
        if (next_range(&p, MOED_CONFIG_MAX_LAYER, &a, &b))
            return moed_fail(err, MOED_EINVAL,
                             "bad device list '%s' at '%s': expected CUDA device ordinals like 0,1 "
                             "or 0-3",
                             value, p);
        if (n + (b - a + 1) > MOED_CONFIG_MAX_DEVICES)
            return moed_fail(err, MOED_EINVAL, "--devices '%s' names more than %d devices", value,
                             MOED_CONFIG_MAX_DEVICES);
        for (int64_t x = a; x <= b; x++) d->v[n++] = (int)x;
    } while (*p);
    d->n = n;
    return 0;
}

/* The file --config names: read whole, and kept in cfg for the values that point into it. */
static int read_config(void *dst, const char *path, char **text, size_t *len, moed_error *err)
{
    moed_config *cfg = dst;
    int rc = moed_file_read(path, "--config", MOED_CONFIG_MAX_FILE, text, len, err);
    if (rc == MOED_ETOOBIG)
        return moed_fail(err, MOED_EINVAL,
                         "--config: %s is over %d KiB; a config file is a few lines of `key = "
                         "value`",
                         path, MOED_CONFIG_MAX_FILE >> 10);
    if (rc) {
        err->code = MOED_EINVAL; /* a config file that cannot be used is a usage error */
        return MOED_EINVAL;
    }
    free(cfg->config_text);
    cfg->config_text = *text;
    return 0;
}

/* ---- the table ---- */

#define F(f) offsetof(moed_config, f)

static const moed_opt options[] = {
    MOED_OPT_CUSTOM_ROW("listen", F(listen), "ADDR", parse_listen, "127.0.0.1:50051", NULL, NULL,
                        "address to serve gRPC on: host:port (port 0: any free one, logged) or "
                        "unix:PATH"),
    MOED_OPT_WORD_ROW("model", F(model), "DIR", NULL, NULL,
                      "Hugging Face safetensors checkpoint folder"),
    MOED_OPT_WORD_ROW("synthetic", F(synthetic), "SPEC", NULL, NULL,
                      "seeded synthetic model, e.g. layers=2,d=256,ff=512,experts=8,topk=2,"
                      "act=swiglu,dtype=bf16,seed=1 (the default when neither --model nor "
                      "--synthetic is given)"),
    MOED_OPT_CUSTOM_ROW("layers", F(layers), "LIST", parse_list, NULL, NULL, NULL,
                        "serve only these MoE layers, e.g. 0-3,7"),
    MOED_OPT_CUSTOM_ROW("experts", F(experts), "LIST", parse_list, NULL, NULL, NULL,
                        "hold only these experts of each layer, e.g. 0-31 (an expert shard: "
                        "replies are the partial sums of these experts' terms; clients of a fleet "
                        "add them)"),
    MOED_OPT_CHOICE_ROW("shared-experts", F(shared_experts), "auto|on|off", "auto", NULL,
                        "whether this daemon adds the shared experts' term; auto: when it holds "
                        "expert 0 (one shard of a fleet must)"),
    MOED_OPT_CHOICE_ROW("backend", F(backend), "cpu|cuda|auto", "auto", NULL, "compute backend"),
    MOED_OPT_CHOICE_ROW("weights", F(weights), "stored|fp8|sparse24", "stored", NULL,
                        "expert weights as stored, or fp8: quantized at load to e4m3 in 128 x 128 "
                        "blocks (an FP8 checkpoint is served as it ships either way; with "
                        "--synthetic, the spec's dtype=fp8), or sparse24: routed experts pruned "
                        "at load to 2:4 (two of every four weights along a row zeroed), which "
                        "changes the model: the log states each layer's error against dense"),
    MOED_OPT_INT_ROW("threads", F(threads), "N", 0, 4096, "0", NULL, NULL,
                     "CPU backend threads, 0 = one per core"),
    MOED_OPT_INT_ROW("streams", F(streams), "N", 0, 256, "0", NULL, NULL,
                     "CUDA streams per device, 0 = default"),
    MOED_OPT_CUSTOM_ROW("devices", F(devices), "LIST", parse_devices, NULL, NULL, NULL,
                        "CUDA device ordinals in order, e.g. 0,1 (a GPU listed twice is two "
                        "devices: 0,0 runs --expert-parallel on one GPU)"),
    MOED_OPT_SWITCH_ROW("expert-parallel", F(expert_parallel), "0", NULL,
                        "split every layer's experts over the devices (CUDA; a layer larger than "
                        "one GPU is split without it)"),
    MOED_OPT_WORD_ROW("expert-load", F(expert_load), "FILE", NULL, NULL,
                      "place a split layer's experts to even out their measured load: a scrape "
                      "of a running moed's /metrics (its moed_expert_tokens_total lines; curl -s "
                      "HOST:PORT/metrics > FILE) instead of uniform routing's"),
    MOED_OPT_INT_ROW("rebalance", F(rebalance_s), "SECONDS", 0, 86400, "0", NULL, NULL,
                     "every SECONDS, re-place each layer split over devices by the load measured "
                     "since its last placement (new expert ranges and copies of hot experts, "
                     "swapped in between launches; docs/operations.md); 0: off"),
    MOED_OPT_INT_ROW("rebalance-replicas", F(rebalance_replicas), "N", 0, MOED_PLACE_MAX_REPLICAS,
                     "0", NULL, NULL,
                     "extra copies of hot experts a re-placement may make per split layer, memory "
                     "allowing (also with --expert-load, applied once at start); 0: none (they "
                     "measured slower than a new cut alone up to four GPUs: docs/operations.md)"),
    MOED_OPT_NUM_ROW("rebalance-min-gain", F(rebalance_min_gain), "FRACTION", 0, 1, "0.05", NULL,
                     NULL,
                     "re-place a layer only if its busiest device's predicted work drops by at "
                     "least this fraction"),
    MOED_OPT_I64_ROW("rebalance-min-pairs", F(rebalance_min_pairs), "N", 0,
                     (double)((int64_t)1 << 40), "0", NULL, NULL,
                     "(token, expert) pairs a layer must have had since its last placement before "
                     "it is weighed; 0 = 32 per expert held"),
    MOED_OPT_INT_ROW("cq-threads", F(cq_threads), "N", 1, 256, "4", NULL, NULL,
                     "threads running gRPC calls (a completion queue each), and as many reading "
                     "connections"),
    MOED_OPT_BYTES_ROW("max-message-bytes", F(max_message_bytes), "BYTES", 4096, INT_MAX,
                       "268435456", NULL, NULL,
                       "largest request accepted (suffixes KiB, MiB, GiB)"),
    MOED_OPT_I64_ROW("max-batch-tokens", F(max_batch_tokens), "N", 1, 1 << 24, "8192", NULL, NULL,
                     "most tokens in one launch and in one request"),
    MOED_OPT_I64_ROW("max-delay-us", F(max_delay_us), "US", 0, 60 * 1000 * 1000, "0", NULL, NULL,
                     "merge window in microseconds; 0 = merge only what is already queued"),
    MOED_OPT_I64_ROW("min-batch-requests", F(min_batch_requests), "N", 1, 1 << 24, "1", NULL, NULL,
                     "a merge queue waits, up to --max-delay-us, until it holds N requests "
                     "(deterministic merges for tests and batching experiments)"),
    MOED_OPT_I64_ROW("max-queue-requests", F(max_queue_requests), "N", 1, 1 << 24, "1024", NULL,
                     NULL, "requests queued at most; past it calls get UNAVAILABLE"),
    MOED_OPT_I64_ROW("max-batch-pairs", F(max_batch_pairs), "N", 0, (double)((int64_t)1 << 32), "0",
                     NULL, NULL,
                     "most (token, expert) pairs in one request and in one launch; 0 = "
                     "--max-batch-tokens x the largest top_k served x 2"),
    MOED_OPT_INT_ROW("max-streams", F(max_streams), "N", 0, 1 << 20, "0", NULL, NULL,
                     "MAX_CONCURRENT_STREAMS advertised per connection (twice it enforced); 0 = "
                     "--max-queue-requests"),
    MOED_OPT_BYTES_ROW("max-grpc-memory", F(max_grpc_memory), "BYTES", 0,
                       (double)((int64_t)1 << 40), "0", NULL, NULL,
                       "memory gRPC's transport may hold (its resource quota: buffers, streams, "
                       "requests until answered); 0 = 4 x --max-message-bytes + 256MiB"),
    MOED_OPT_INT_ROW("accept-compression", F(accept_compression), "0|1", 0, 1, "0", NULL, NULL,
                     "1: accept gzip/deflate requests, inflated by moed up to "
                     "--max-message-bytes; 0: refuse them (UNIMPLEMENTED) before reading them"),
    MOED_OPT_CHOICE_ROW("regions", F(regions), "off|local|any", "local", NULL,
                        "tensor regions (shared and GPU memory named by requests): for callers on "
                        "this host only (loopback or a unix socket), for any caller, or off"),
    MOED_OPT_I64_ROW("max-regions", F(max_regions), "N", 1, 1 << 16, "64", NULL, NULL,
                     "tensor regions one principal (a token, or without tokens a local user) may "
                     "have registered"),
    MOED_OPT_BYTES_ROW("max-region-bytes", F(max_region_bytes), "BYTES", 16,
                       (double)((int64_t)1 << 50), "68719476736", NULL, NULL,
                       "bytes of tensor regions one principal may have registered"),
    MOED_OPT_BYTES_ROW("max-region-bytes-total", F(max_region_bytes_total), "BYTES", 16,
                       (double)((int64_t)1 << 50), "274877906944", NULL, NULL,
                       "bytes of tensor regions registered by everyone together"),
    MOED_OPT_I64_ROW("max-rings", F(max_rings), "N", 0, 1 << 16, "16", NULL, NULL,
                     "doorbell rings (same-host calls through shared memory: docs/doorbell.md) one "
                     "principal may have open; 0: no doorbell"),
    MOED_OPT_I64_ROW("max-links", F(max_links), "N", 0, 1 << 10, "8", NULL, NULL,
                     "NCCL links (Forwards whose tensors move over NCCL, cuda backend) one "
                     "principal may have open; 0: no links"),
    MOED_OPT_BYTES_ROW("staging-pool", F(staging_pool), "BYTES", 0, (double)((int64_t)1 << 40), "0",
                       NULL, NULL,
                       "host memory (pinned for cuda) taken at start for inline requests' rows and "
                       "replies; a request that finds it full is copied the slower way; 0 = 4 x "
                       "--max-batch-tokens x the largest d_model x 4"),
    MOED_OPT_CUSTOM_ROW("metrics-listen", F(metrics_listen), "ADDR", parse_metrics_listen, NULL,
                        NULL, NULL,
                        "serve Prometheus /metrics and /healthz over HTTP here (e.g. "
                        "127.0.0.1:8464); off unless given"),
    MOED_OPT_WORD_ROW("metrics-token-file", F(metrics_token_file), "FILE", NULL, NULL,
                      "require 'Authorization: Bearer <token>' on /metrics (token: the file's "
                      "first line); /healthz stays open"),
    MOED_OPT_INT_ROW("drain-timeout", F(drain_timeout_s), "S", 0, 86400, "30", NULL, NULL,
                     "after SIGTERM, cancel the calls still open after S seconds (0: at once)"),
    MOED_OPT_WORD_ROW("tls-cert", F(tls_cert), "FILE", NULL, NULL,
                      "serve gRPC over TLS with this PEM certificate chain (needs --tls-key)"),
    MOED_OPT_WORD_ROW("tls-key", F(tls_key), "FILE", NULL, NULL,
                      "the certificate's PEM private key"),
    MOED_OPT_WORD_ROW("tls-client-ca", F(tls_client_ca), "FILE", NULL, NULL,
                      "mutual TLS: require client certificates signed by these PEM CA "
                      "certificates"),
    MOED_OPT_WORD_ROW("auth-token-file", F(auth_token_file), "FILE", NULL, NULL,
                      "require 'authorization: Bearer <token>' on every call but health (token: "
                      "the file's first line; or set $MOED_AUTH_TOKEN)"),
    MOED_OPT_CUSTOM_ROW("log-level", F(log_level), "debug|info|warn|error", parse_level, "info",
                        NULL, NULL, "log threshold"),
    MOED_OPT_WORD_ROW("log-file", F(log_file), "PATH", NULL, NULL,
                      "log to this file (reopened on SIGHUP); default stderr"),
    { .name = "config",
      .kind = MOED_OPT_CONFIG,
      .field = F(config_file),
      .arg = "FILE",
      .help = "read `key = value` lines (long flag names); the command line wins" },
    { .name = "help", .kind = MOED_OPT_HELP, .letter = 'h', .help = "print this help and exit" },
    { .name = "version",
      .kind = MOED_OPT_VERSION,
      .letter = 'V',
      .help = "print the version and exit" },
};

static const moed_opt_cmd the_daemon = {
    .head = "usage: moed [flags]\n\n"
            "Serves Mixture-of-Experts layers over gRPC (moed.v1.Moed, grpc.health.v1).\n\n",
    .tail = "Exit status: 0 after a clean drain (SIGTERM/SIGINT), 1 when start-up fails, 2 on bad "
            "usage.\n",
};

/* Flags in full only (a prefix would outlive the next flag that shares it), help in one line. */
static const moed_opt_spec command_line = {
    .prog = "moed",
    .hint = "moed --help lists the options",
    .version = "moed " MOED_VERSION,
    .opts = options,
    .n_opts = sizeof options / sizeof options[0],
    .cmds = &the_daemon,
    .n_cmds = 1,
    .exact = true,
    .help_column = 37,
    .help_width = INT_MAX,
    .read_config = read_config,
};

/* TLS flags come in pairs: a certificate needs its key, and client verification needs TLS. */
static int check_tls(const moed_config *cfg, moed_error *err)
{
    if (!cfg->tls_cert != !cfg->tls_key)
        return moed_fail(err, MOED_EINVAL, "--%s '%s' given without --%s: TLS needs both",
                         cfg->tls_cert ? "tls-cert" : "tls-key",
                         cfg->tls_cert ? cfg->tls_cert : cfg->tls_key,
                         cfg->tls_cert ? "tls-key" : "tls-cert");
    if (cfg->tls_client_ca && !cfg->tls_cert)
        return moed_fail(err, MOED_EINVAL,
                         "--tls-client-ca '%s' given without --tls-cert and --tls-key: client "
                         "certificates are checked only over TLS",
                         cfg->tls_client_ca);
    return MOED_CONFIG_RUN;
}

int moed_config_load(moed_config *cfg, int argc, char **argv, FILE *out, moed_error *err)
{
    memset(cfg, 0, sizeof *cfg);
    moed_opt_parsed given;
    int rc = moed_opt_read(&command_line, argc, argv, cfg, &given, out, err);
    if (rc) return rc == MOED_OPT_DONE ? MOED_CONFIG_EXIT : rc;
    if (cfg->model && cfg->synthetic)
        return moed_fail(err, MOED_EINVAL,
                         "--model '%s' and --synthetic '%s' both given; serve one or the other",
                         cfg->model, cfg->synthetic);
    if (cfg->synthetic) { /* a spec is usage like any flag value: check it now, not at load */
        moed_synth_spec spec;
        if ((rc = moed_synth_parse(cfg->synthetic, &spec, err))) {
            moed_error_prefix(err, "--synthetic '%s'", cfg->synthetic);
            return rc;
        }
    }
    return check_tls(cfg, err);
}

void moed_config_usage(const moed_error *err)
{
    moed_opt_usage(&command_line, "%s", err->msg);
}

void moed_config_free(moed_config *cfg)
{
    free(cfg->layers.v);
    free(cfg->experts.v);
    free(cfg->config_text);
    memset(cfg, 0, sizeof *cfg);
}

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int moed_config_wants_layer(const moed_config *cfg, int index)
{
    if (!cfg->layers.text) return 1;
    return bsearch(&index, cfg->layers.v, (size_t)cfg->layers.n, sizeof index, cmp_int) != NULL;
}
