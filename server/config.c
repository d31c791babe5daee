/*
 * moed_config — flags and the config file, driven by one option table.
 *
 * Why a table: every option is parsed the same way from the command line and from the file, and
 * --help is generated from it, so the three never drift apart. Precedence is defaults < file <
 * command line: the command line is scanned once for --config/--help/--version, the file applied,
 * then the command line applied over it.
 */
#include "config.h"

#include "moed_synth.h"

#include "file.h"
#include "log.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

typedef enum opt_kind {
    OPT_STRING,  /* char * */
    OPT_ADDR,    /* char *, a listen address whose port is checked; max 1: unix: paths too */
    OPT_CHOICE,  /* char *, one of the '|'-separated words of arg */
    OPT_INT,     /* int in [min, max] */
    OPT_I64,     /* int64_t in [min, max] */
    OPT_BYTES,   /* int64_t in [min, max], with an optional KiB/MiB/GiB suffix */
    OPT_LEVEL,   /* int, a log level name */
    OPT_LIST,    /* char *, and its expansion: an int * at offset min, its count (an int) at max */
    OPT_DEVICES, /* devices[] */
    OPT_FLAG,    /* int 0|1: the bare flag is 1 (`--name=0` or `name = 0` in a file for 0) */
    OPT_CONFIG,  /* --config: the file (command line only) */
    OPT_HELP,    /* --help (command line only) */
    OPT_VERSION, /* --version (command line only) */
} opt_kind;

typedef struct opt {
    const char *name;
    opt_kind kind;
    size_t off;
    int64_t min, max;
    const char *arg;  /* the value's placeholder in --help */
    const char *help; /* one line; the default is appended from cfg */
} opt;

#define OFF(f) offsetof(moed_config, f)
#define MIB    (1024 * 1024)

static const opt opts[] = {
    { "listen", OPT_ADDR, OFF(listen), 0, 1, "ADDR",
      "address to serve gRPC on: host:port (port 0: any free one, logged) or unix:PATH" },
    { "model", OPT_STRING, OFF(model), 0, 0, "DIR", "Hugging Face safetensors checkpoint folder" },
    { "synthetic", OPT_STRING, OFF(synthetic), 0, 0, "SPEC",
      "seeded synthetic model, e.g. layers=2,d=256,ff=512,experts=8,topk=2,act=swiglu,"
      "dtype=bf16,seed=1 (the default when neither --model nor --synthetic is given)" },
    { "layers", OPT_LIST, OFF(layers), OFF(layer_list), OFF(n_layer_list), "LIST",
      "serve only these MoE layers, e.g. 0-3,7" },
    { "experts", OPT_LIST, OFF(experts), OFF(expert_list), OFF(n_expert_list), "LIST",
      "hold only these experts of each layer, e.g. 0-31 (an expert shard: replies are the partial "
      "sums of these experts' terms; clients of a fleet add them)" },
    { "shared-experts", OPT_CHOICE, OFF(shared_experts), 0, 0, "auto|on|off",
      "whether this daemon adds the shared experts' term; auto: when it holds expert 0 (one shard "
      "of a fleet must)" },
    { "backend", OPT_CHOICE, OFF(backend), 0, 0, "cpu|cuda|auto", "compute backend" },
    { "weights", OPT_CHOICE, OFF(weights), 0, 0, "stored|fp8",
      "expert weights as stored, or fp8: quantized at load to e4m3 in 128 x 128 blocks (an FP8 "
      "checkpoint is served as it ships either way; with --synthetic, the spec's dtype=fp8)" },
    { "threads", OPT_INT, OFF(threads), 0, 4096, "N", "CPU backend threads, 0 = one per core" },
    { "streams", OPT_INT, OFF(streams), 0, 256, "N", "CUDA streams per device, 0 = default" },
    { "devices", OPT_DEVICES, OFF(devices), 0, 0, "LIST",
      "CUDA device ordinals in order, e.g. 0,1 (a GPU listed twice is two devices: 0,0 runs "
      "--expert-parallel on one GPU)" },
    { "expert-parallel", OPT_FLAG, OFF(expert_parallel), 0, 1, NULL,
      "split every layer's experts over the devices (CUDA; a layer larger than one GPU is split "
      "without it)" },
    { "cq-threads", OPT_INT, OFF(cq_threads), 1, 256, "N",
      "threads running gRPC calls (a completion queue each), and as many reading connections" },
    { "max-message-bytes", OPT_BYTES, OFF(max_message_bytes), 4096, INT_MAX, "BYTES",
      "largest request accepted (suffixes KiB, MiB, GiB)" },
    { "max-batch-tokens", OPT_I64, OFF(max_batch_tokens), 1, 1 << 24, "N",
      "most tokens in one launch and in one request" },
    { "max-delay-us", OPT_I64, OFF(max_delay_us), 0, 60 * 1000 * 1000, "US",
      "merge window in microseconds; 0 = merge only what is already queued" },
    { "min-batch-requests", OPT_I64, OFF(min_batch_requests), 1, 1 << 24, "N",
      "a merge queue waits, up to --max-delay-us, until it holds N requests (deterministic "
      "merges for tests and batching experiments)" },
    { "max-queue-requests", OPT_I64, OFF(max_queue_requests), 1, 1 << 24, "N",
      "requests queued at most; past it calls get UNAVAILABLE" },
    { "max-batch-pairs", OPT_I64, OFF(max_batch_pairs), 0, (int64_t)1 << 32, "N",
      "most (token, expert) pairs in one request and in one launch; 0 = --max-batch-tokens x the "
      "largest top_k served x 2" },
    { "max-streams", OPT_INT, OFF(max_streams), 0, 1 << 20, "N",
      "MAX_CONCURRENT_STREAMS advertised per connection (twice it enforced); 0 = "
      "--max-queue-requests" },
    { "max-grpc-memory", OPT_BYTES, OFF(max_grpc_memory), 0, (int64_t)1 << 40, "BYTES",
      "memory gRPC's transport may hold (its resource quota: buffers, streams, requests until "
      "answered); 0 = 4 x --max-message-bytes + 256MiB" },
    { "accept-compression", OPT_INT, OFF(accept_compression), 0, 1, "0|1",
      "1: accept gzip/deflate requests, inflated by moed up to --max-message-bytes; 0: refuse "
      "them (UNIMPLEMENTED) before reading them" },
    { "regions", OPT_CHOICE, OFF(regions), 0, 0, "off|local|any",
      "tensor regions (shared and GPU memory named by requests): for callers on this host only "
      "(loopback or a unix socket), for any caller, or off" },
    { "max-regions", OPT_I64, OFF(max_regions), 1, 1 << 16, "N",
      "tensor regions one principal (a token, or without tokens a local user) may have "
      "registered" },
    { "max-region-bytes", OPT_BYTES, OFF(max_region_bytes), 16, (int64_t)1 << 50, "BYTES",
      "bytes of tensor regions one principal may have registered" },
    { "max-region-bytes-total", OPT_BYTES, OFF(max_region_bytes_total), 16, (int64_t)1 << 50,
      "BYTES", "bytes of tensor regions registered by everyone together" },
    { "staging-pool", OPT_BYTES, OFF(staging_pool), 0, (int64_t)1 << 40, "BYTES",
      "host memory (pinned for cuda) taken at start for inline requests' rows and replies; a "
      "request that finds it full is copied the slower way; 0 = 4 x --max-batch-tokens x the "
      "largest d_model x 4" },
    { "metrics-listen", OPT_ADDR, OFF(metrics_listen), 0, 0, "ADDR",
      "serve Prometheus /metrics and /healthz over HTTP here (e.g. 127.0.0.1:8464); off unless "
      "given" },
    { "metrics-token-file", OPT_STRING, OFF(metrics_token_file), 0, 0, "FILE",
      "require 'Authorization: Bearer <token>' on /metrics (token: the file's first line); "
      "/healthz stays open" },
    { "drain-timeout", OPT_INT, OFF(drain_timeout_s), 0, 86400, "S",
      "after SIGTERM, cancel the calls still open after S seconds (0: at once)" },
    { "tls-cert", OPT_STRING, OFF(tls_cert), 0, 0, "FILE",
      "serve gRPC over TLS with this PEM certificate chain (needs --tls-key)" },
    { "tls-key", OPT_STRING, OFF(tls_key), 0, 0, "FILE", "the certificate's PEM private key" },
    { "tls-client-ca", OPT_STRING, OFF(tls_client_ca), 0, 0, "FILE",
      "mutual TLS: require client certificates signed by these PEM CA certificates" },
    { "auth-token-file", OPT_STRING, OFF(auth_token_file), 0, 0, "FILE",
      "require 'authorization: Bearer <token>' on every call but health (token: the file's "
      "first line; or set $MOED_AUTH_TOKEN)" },
    { "log-level", OPT_LEVEL, OFF(log_level), 0, 0, "debug|info|warn|error", "log threshold" },
    { "log-file", OPT_STRING, OFF(log_file), 0, 0, "PATH",
      "log to this file (reopened on SIGHUP); default stderr" },
    { "config", OPT_CONFIG, OFF(config_file), 0, 0, "FILE",
      "read `key = value` lines (long flag names); the command line wins" },
    { "help", OPT_HELP, 0, 0, 0, NULL, "print this help and exit" },
    { "version", OPT_VERSION, 0, 0, 0, NULL, "print the version and exit" },
};

#define N_OPTS (sizeof opts / sizeof opts[0])

/* Whether value is one of the '|'-separated words of choices. */
static bool is_choice(const char *value, const char *choices)
{
    const size_t n = strlen(value);
    for (const char *p = choices; *p;) {
        const char *bar = strchr(p, '|');
        const size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (n && len == n && !strncmp(p, value, n)) return true;
        p += len + (bar != NULL);
    }
    return false;
}

static int set_defaults(moed_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->listen = strdup("127.0.0.1:50051");
    cfg->backend = strdup("auto");
    cfg->weights = strdup("stored");
    cfg->shared_experts = strdup("auto");
    cfg->cq_threads = 4;
    cfg->max_message_bytes = 256 * MIB;
    cfg->max_batch_tokens = 8192;
    cfg->min_batch_requests = 1;
    cfg->max_delay_us = 0;
    cfg->max_queue_requests = 1024;
    cfg->drain_timeout_s = 30;
    cfg->regions = strdup("local");
    cfg->max_regions = 64;
    cfg->max_region_bytes = (int64_t)64 << 30;
    cfg->max_region_bytes_total = (int64_t)256 << 30;
    cfg->log_level = MOED_LOG_INFO;
    return cfg->listen && cfg->backend && cfg->weights && cfg->shared_experts && cfg->regions
               ? 0
               : MOED_ENOMEM;
}

void moed_config_free(moed_config *cfg)
{
    for (size_t i = 0; i < N_OPTS; i++) {
        if (opts[i].kind == OPT_STRING || opts[i].kind == OPT_ADDR || opts[i].kind == OPT_CHOICE ||
            opts[i].kind == OPT_LIST || opts[i].kind == OPT_CONFIG) {
            char **p = (char **)((char *)cfg + opts[i].off);
            free(*p);
            *p = NULL;
        }
    }
    for (size_t i = 0; i < N_OPTS; i++)
        if (opts[i].kind == OPT_LIST) {
            int **list = (int **)((char *)cfg + opts[i].min);
            free(*list);
            *list = NULL;
            *(int *)((char *)cfg + opts[i].max) = 0;
        }
}

static const opt *find_opt(const char *name, size_t len)
{
    for (size_t i = 0; i < N_OPTS; i++)
        if (strlen(opts[i].name) == len && !strncmp(opts[i].name, name, len)) return &opts[i];
    return NULL;
}

/* A decimal integer, all of s, into *v; the suffix (for byte sizes) is left in *end. */
static int parse_i64(const char *s, int64_t *v, char **end)
{
    errno = 0;
    long long x = strtoll(s, end, 10);
    if (*end == s || errno == ERANGE || !isdigit((unsigned char)s[s[0] == '-' || s[0] == '+']))
        return -1;
    *v = x;
    return 0;
}

static int parse_bytes(const char *s, int64_t *v)
{
    static const struct {
        const char *suffix;
        int64_t mult;
    } units[] = { { "", 1 },
                  { "k", 1024 },
                  { "kib", 1024 },
                  { "m", 1 << 20 },
                  { "mib", 1 << 20 },
                  { "g", (int64_t)1 << 30 },
                  { "gib", (int64_t)1 << 30 } };
    char *end;
    if (parse_i64(s, v, &end)) return -1;
    while (*end == ' ') end++;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcasecmp(end, units[i].suffix)) continue;
        if (*v < 0 || *v > INT64_MAX / units[i].mult) return -1;
        *v *= units[i].mult;
        return 0;
    }
    return -1;
}

/* One item of a list of numbers and ranges ("7" or "0-3") at *p, each from 0 to max: its bounds
 * in *a and *b, *p moved past it and its comma; -1 for anything else (a trailing comma too). */
static int next_range(const char **p, int64_t max, int64_t *a, int64_t *b)
{
    char *end;
    if (parse_i64(*p, a, &end) || *a < 0 || *a > max) return -1;
    *b = *a;
    if (*end == '-' && (parse_i64(end + 1, b, &end) || *b < *a || *b > max)) return -1;
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
static int check_addr(const char *value, bool grpc, const char *where, moed_error *err)
{
    const char *given = value;
    if (grpc && (!strncmp(value, "unix:", 5) || !strncmp(value, "unix-abstract:", 14))) {
        const char *path = value + strcspn(value, ":") + 1;
        if (!*path)
            return moed_fail(err, MOED_EINVAL, "%s: '%s' names no socket path", where, value);
        if (strlen(path) > MOED_CONFIG_MAX_UNIX_PATH)
            return moed_fail(err, MOED_EINVAL,
                             "%s: the socket path of '%s' is %zu bytes; a unix socket's is at most "
                             "%d: choose a shorter one",
                             where, value, strlen(path), MOED_CONFIG_MAX_UNIX_PATH);
        return 0;
    }
    static const char *const schemes[] = { "dns:", "ipv4:", "ipv6:" };
    for (size_t i = 0; grpc && i < sizeof schemes / sizeof schemes[0]; i++)
        if (!strncmp(value, schemes[i], strlen(schemes[i])))
            return moed_fail(err, MOED_EINVAL,
                             "%s: '%s': gRPC's server takes host:port without a scheme (%s is for "
                             "clients' targets); give e.g. 127.0.0.1:50051, [::1]:50051 or "
                             "localhost:50051",
                             where, given, schemes[i]);
    const char *colon = strrchr(value, ':'), *port = colon ? colon + 1 : "";
    size_t digits = strspn(port, "0123456789");
    long v = digits && digits <= 5 && !port[digits] ? strtol(port, NULL, 10) : -1;
    bool bracketed = value[0] == '[' && colon && colon > value && colon[-1] == ']';
    bool v6_bare = colon && memchr(value, ':', (size_t)(colon - value)) && !bracketed;
    if (digits && !port[digits] && !v6_bare && (v < 0 || v > 65535))
        return moed_fail(err, MOED_EINVAL,
                         "%s: port %s of '%s' is out of range; give a port from 1 to 65535 (or 0 "
                         "for any free one)",
                         where, port, given);
    if (v < 0 || v6_bare)
        return moed_fail(err, MOED_EINVAL,
                         "%s: '%s' is not host:port; give e.g. 127.0.0.1:50051, [::1]:50051 or "
                         "0.0.0.0:50051 (a port from 1 to 65535)%s",
                         where, given, grpc ? ", or unix:PATH" : "");
    if (!host_ok(value, (size_t)(colon - value), !grpc))
        return moed_fail(err, MOED_EINVAL,
                         "%s: '%s' has no host moed can listen on: give a name, a dotted IPv4 "
                         "address (each part 0 to 255) or an IPv6 address in brackets, e.g. "
                         "127.0.0.1, [::1] or localhost",
                         where, given);
    return 0;
}

/* Device ordinals in the order given, repeats kept (a GPU listed twice is two placements). */
static int parse_devices(moed_config *cfg, const char *list, moed_error *err)
{
    int n = 0;
    const char *p = list;
    do {
        int64_t a, b;
        if (next_range(&p, MOED_CONFIG_MAX_LAYER, &a, &b)) goto bad;
        if (n + (b - a + 1) > MOED_CONFIG_MAX_DEVICES)
            return moed_fail(err, MOED_EINVAL, "--devices '%s' names more than %d devices", list,
                             MOED_CONFIG_MAX_DEVICES);
        for (int64_t v = a; v <= b; v++) cfg->devices[n++] = (int)v;
    } while (*p);
    cfg->n_devices = n;
    return 0;
bad:
    return moed_fail(err, MOED_EINVAL,
                     "bad device list '%s' at '%s': expected CUDA device ordinals like 0,1 or 0-3",
                     list, p);
}

static int replace_string(char **slot, const char *value)
{
    char *s = strdup(value);
    if (!s) return MOED_ENOMEM;
    free(*slot);
    *slot = s;
    return 0;
}

/* Applies one option's value; the message names where it came from (`--flag` or `file:line`). */
static int apply(moed_config *cfg, const opt *o, const char *value, const char *where,
                 moed_error *err)
{
    void *field = (char *)cfg + o->off;
    int64_t v;
    char *end;
    switch (o->kind) {
    case OPT_STRING:
    case OPT_ADDR:
    case OPT_CONFIG:
        if (!*value)
            return moed_fail(err, MOED_EINVAL, "%s: empty value; give a %s", where, o->arg);
        if (o->kind == OPT_ADDR) {
            int rc = check_addr(value, o->max == 1, where, err);
            if (rc) return rc;
        }
        return replace_string(field, value);
    case OPT_CHOICE:
        if (is_choice(value, o->arg)) return replace_string(field, value);
        return moed_fail(err, MOED_EINVAL, "%s: '%s' is not one of %s", where, value, o->arg);
    case OPT_LEVEL:
        if ((v = moed_log_parse_level(value)) < 0)
            return moed_fail(err, MOED_EINVAL, "%s: '%s' is not a log level; use one of %s", where,
                             value, o->arg);
        *(int *)field = (int)v;
        return 0;
    case OPT_INT:
    case OPT_FLAG:
    case OPT_I64:
    case OPT_BYTES:
        if (o->kind == OPT_BYTES ? parse_bytes(value, &v)
                                 : (parse_i64(value, &v, &end) || *end != 0))
            return moed_fail(err, MOED_EINVAL,
                             "%s: '%s' is not %s; give an integer in [%lld, %lld]", where, value,
                             o->kind == OPT_BYTES ? "a byte count (like 268435456 or 256MiB)"
                                                  : "an integer",
                             (long long)o->min, (long long)o->max);
        if (v < o->min || v > o->max)
            return moed_fail(err, MOED_EINVAL,
                             "%s: %lld is out of range; give a value in [%lld, %lld]", where,
                             (long long)v, (long long)o->min, (long long)o->max);
        if (o->kind == OPT_INT || o->kind == OPT_FLAG)
            *(int *)field = (int)v;
        else
            *(int64_t *)field = v;
        return 0;
    case OPT_LIST: {
        int *list, n, rc = moed_config_parse_layers(value, &list, &n, err);
        if (rc) {
            moed_error_prefix(err, "%s", where);
            return rc;
        }
        if ((rc = replace_string(field, value))) {
            free(list);
            return rc;
        }
        int **slot = (int **)((char *)cfg + o->min);
        free(*slot);
        *slot = list;
        *(int *)((char *)cfg + o->max) = n;
        return 0;
    }
    case OPT_DEVICES: {
        int rc = parse_devices(cfg, value, err);
        if (rc) moed_error_prefix(err, "%s", where);
        return rc;
    }
    case OPT_HELP:
    case OPT_VERSION:
        break;
    }
    return moed_fail(err, MOED_EINVAL, "%s: not allowed here", where);
}

static void trim(char **s, char **e)
{
    while (*s < *e && isspace((unsigned char)**s)) (*s)++;
    while (*e > *s && isspace((unsigned char)(*e)[-1])) (*e)--;
}

/* The value after `=`, in place: a double-quoted value keeps everything up to its closing quote
 * (a `#` too), with \" and \\ as the only escapes; an unquoted one ends at a `#` (a comment).
 * After a closing quote only blanks and a comment may follow. */
static int line_value(char *v, char *end, const char *where, char **out, moed_error *err)
{
    while (v < end && isspace((unsigned char)*v)) v++;
    if (v == end || *v != '"') {
        char *hash = memchr(v, '#', (size_t)(end - v));
        if (hash) end = hash;
        trim(&v, &end);
        *end = 0;
        *out = v;
        return 0;
    }
    char *w = v, *r = v + 1;
    for (; r < end && *r != '"'; r++) {
        if (*r == '\\') {
            if (r + 1 == end || (r[1] != '"' && r[1] != '\\'))
                return moed_fail(err, MOED_EINVAL,
                                 "%s: unknown escape in a quoted value; inside double quotes only "
                                 "\\\" (a quote) and \\\\ (a backslash) are escapes",
                                 where);
            r++;
        }
        *w++ = *r;
    }
    if (r == end)
        return moed_fail(err, MOED_EINVAL, "%s: the quoted value has no closing quote", where);
    for (char *t = r + 1; t < end && *t != '#'; t++)
        if (!isspace((unsigned char)*t))
            return moed_fail(err, MOED_EINVAL,
                             "%s: text after the closing quote; only a # comment may follow",
                             where);
    *w = 0;
    *out = v;
    return 0;
}

/* Applies one `key = value` line (end: its end, without the newline). */
static int apply_line(moed_config *cfg, char *line, char *end, const char *where, moed_error *err)
{
    trim(&line, &end);
    if (line == end || *line == '#') return 0;
    size_t key_len = strcspn(line, "=#");
    char *eq = line + key_len;
    if (eq >= end || *eq != '=')
        return moed_fail(err, MOED_EINVAL, "%s: expected `key = value`, got '%.*s'", where,
                         (int)(end - line), line);
    char *key = line, *key_end = eq, *val = NULL;
    trim(&key, &key_end);
    int rc = line_value(eq + 1, end, where, &val, err);
    if (rc) return rc;
    const opt *o = find_opt(key, (size_t)(key_end - key));
    if (!o || o->kind == OPT_CONFIG || o->kind == OPT_HELP || o->kind == OPT_VERSION)
        return moed_fail(err, MOED_EINVAL,
                         "%s: unknown key '%.*s'; keys are the long flags' names (see moed --help)",
                         where, (int)(key_end - key), key);
    return apply(cfg, o, val, where, err);
}

static int load_file(moed_config *cfg, const char *path, moed_error *err)
{
    char *text, where[600];
    size_t len;
    int rc = moed_file_read(path, "--config", MOED_CONFIG_MAX_FILE, &text, &len, err);
    if (rc) {
        err->code = MOED_EINVAL; /* a config file that cannot be used is a usage error */
        return rc == MOED_ETOOBIG ? moed_fail(err, MOED_EINVAL,
                                              "--config: %s is over %d KiB; a config file is a "
                                              "few lines of `key = value`",
                                              path, MOED_CONFIG_MAX_FILE >> 10)
                                  : MOED_EINVAL;
    }
    char *line = text, *nl;
    for (int no = 1; !rc && line < text + len; no++, line = nl + 1) {
        snprintf(where, sizeof where, "%s:%d", path, no);
        if (!(nl = memchr(line, '\n', (size_t)(text + len - line)))) nl = text + len;
        if (memchr(line, 0, (size_t)(nl - line)))
            rc = moed_fail(err, MOED_EINVAL, "%s: a NUL byte: not a text file", where);
        else
            rc = apply_line(cfg, line, nl, where, err);
    }
    free(text);
    return rc;
}

/* Splits argv[*i] into its option and value (from `--name=value` or the next argument). */
static int next_flag(int argc, char **argv, int *i, const opt **o, const char **value,
                     moed_error *err)
{
    const char *a = argv[*i];
    if (!strcmp(a, "-h")) a = "--help";
    if (!strcmp(a, "-V")) a = "--version";
    if (strncmp(a, "--", 2))
        return moed_fail(err, MOED_EINVAL,
                         "unexpected argument '%s'; flags start with -- "
                         "(see moed --help)",
                         a);
    const char *name = a + 2, *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    *o = find_opt(name, len);
    if (!*o)
        return moed_fail(err, MOED_EINVAL, "unknown flag '--%.*s' (see moed --help)", (int)len,
                         name);
    *value = NULL;
    if ((*o)->kind == OPT_FLAG) {
        *value = eq ? eq + 1 : "1";
        return 0;
    }
    if ((*o)->kind == OPT_HELP || (*o)->kind == OPT_VERSION) {
        if (eq) return moed_fail(err, MOED_EINVAL, "--%s takes no value", (*o)->name);
        return 0;
    }
    if (eq)
        *value = eq + 1;
    else if (*i + 1 < argc)
        *value = argv[++*i];
    else
        return moed_fail(err, MOED_EINVAL, "--%s needs a value: %s", (*o)->name, (*o)->arg);
    return 0;
}

static void print_help(FILE *out, const moed_config *d)
{
    fprintf(out, "usage: moed [flags]\n\n"
                 "Serves Mixture-of-Experts layers over gRPC (moed.v1.Moed, grpc.health.v1).\n\n");
    for (size_t i = 0; i < N_OPTS; i++) {
        const opt *o = &opts[i];
        char left[64], def[64] = "";
        snprintf(left, sizeof left, "--%s%s%s", o->name, o->arg ? " " : "", o->arg ? o->arg : "");
        const void *f = (const char *)d + o->off;
        if (o->kind == OPT_STRING || o->kind == OPT_ADDR || o->kind == OPT_CHOICE) {
            if (*(char *const *)f) snprintf(def, sizeof def, " (default %s)", *(char *const *)f);
        } else if (o->kind == OPT_INT) {
            snprintf(def, sizeof def, " (default %d)", *(const int *)f);
        } else if (o->kind == OPT_I64 || o->kind == OPT_BYTES) {
            snprintf(def, sizeof def, " (default %lld)", (long long)*(const int64_t *)f);
        } else if (o->kind == OPT_LEVEL) {
            snprintf(def, sizeof def, " (default info)");
        } else if (o->kind == OPT_FLAG) {
            snprintf(def, sizeof def, " (default %s)", *(const int *)f ? "on" : "off");
        }
        fprintf(out, "  %-34s %s%s\n", left, o->help, def);
    }
    fprintf(out, "\nExit status: 0 after a clean drain (SIGTERM/SIGINT), 1 when start-up fails, "
                 "2 on bad usage.\n");
}

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
    int rc = set_defaults(cfg);
    if (rc) return moed_fail(err, rc, "out of memory");
    const opt *o;
    const char *value;
    /* Pass 1: --help/--version answer at once; --config is read before the other flags. */
    for (int i = 1; i < argc; i++) {
        if ((rc = next_flag(argc, argv, &i, &o, &value, err))) return rc;
        if (o->kind == OPT_HELP) {
            print_help(out, cfg);
            return MOED_CONFIG_EXIT;
        }
        if (o->kind == OPT_VERSION) {
            fprintf(out, "moed %s\n", MOED_VERSION);
            return MOED_CONFIG_EXIT;
        }
        if (o->kind == OPT_CONFIG && (rc = apply(cfg, o, value, "--config", err))) return rc;
    }
    if (cfg->config_file && (rc = load_file(cfg, cfg->config_file, err))) return rc;
    for (int i = 1; i < argc; i++) {
        next_flag(argc, argv, &i, &o, &value, err);
        if (o->kind == OPT_CONFIG) continue;
        char where[80];
        snprintf(where, sizeof where, "--%s", o->name);
        if ((rc = apply(cfg, o, value, where, err))) return rc;
    }
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

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int moed_config_wants_layer(const moed_config *cfg, int index)
{
    if (!cfg->layers) return 1;
    return bsearch(&index, cfg->layer_list, (size_t)cfg->n_layer_list, sizeof index, cmp_int) !=
           NULL;
}
