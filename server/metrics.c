/*
 * moed_metrics — sharded counters and fixed-bucket histograms, and their exposition text.
 *
 * Why shards: every answered request touches a handful of counters from whichever completion-
 * queue thread or scheduler worker finished it. One shared set of atomics would bounce its cache
 * lines between those cores on every call; a shard per thread (threads are dealt shards round-
 * robin on first use) keeps each add on a line the core already owns. Adds stay atomic because
 * two threads may share a shard once there are more threads than shards. A scrape (every few
 * seconds) sums the shards: a reader may see one request's counters half-updated, which the
 * Prometheus model tolerates (every series is monotonic on its own).
 *
 * Histograms store each observation in its own bucket (not cumulative) so recording is one add
 * per bucket hit plus one to the sum; rendering accumulates them into Prometheus' `le` form.
 */
#include "metrics.h"

#include "moed_err.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SHARDS      16
#define MAX_BUCKETS 20

enum {
    H_REQUEST,
    H_DOORBELL,
    H_LINK,
    H_QUEUE,
    H_COMPUTE,
    H_BATCH_TOKENS,
    H_BATCH_REQUESTS,
    H_COUNT
};

typedef struct hist_def {
    const char *name, *help;
    uint64_t bounds[MAX_BUCKETS]; /* in recorded units (ns or counts), increasing */
    int n;
    double scale; /* recorded unit in the exposed unit: 1e-9 for ns -> seconds, 0 for counts */
} hist_def;

/* A hist_def's bounds and their count, counted by the compiler. */
#define BOUNDS(...) { __VA_ARGS__ }, (int)(sizeof((uint64_t[]){ __VA_ARGS__ }) / sizeof(uint64_t))

#define DURATION_BOUNDS                                                                            \
    BOUNDS(100000, 250000, 500000, 1000000, 2500000, 5000000, 10000000, 25000000, 50000000,        \
           100000000, 250000000, 500000000, 1000000000, 2500000000, 5000000000, 10000000000),      \
        1e-9

static const hist_def hists[H_COUNT] = {
    [H_REQUEST] = { "moed_request_duration_seconds",
                    "Forward requests: time from arrival to the reply, in seconds.",
                    DURATION_BOUNDS },
    [H_DOORBELL] = { "moed_doorbell_request_duration_seconds",
                     "Doorbell calls: time from the server taking the call to its completion, in "
                     "seconds.",
                     BOUNDS(10000, 25000, 50000, 100000, 250000, 500000, 1000000, 2500000, 5000000,
                            10000000, 25000000, 50000000, 100000000, 250000000, 1000000000,
                            10000000000),
                     1e-9 },
    [H_LINK] = { "moed_link_request_duration_seconds",
                 "NCCL link calls: time from the server having a call's payload to its reply "
                 "sent, in seconds.",
                 DURATION_BOUNDS },
    [H_QUEUE] = { "moed_queue_duration_seconds",
                  "Forward requests: time waiting in the scheduler's queue before a launch, in "
                  "seconds.",
                  DURATION_BOUNDS },
    [H_COMPUTE] = { "moed_compute_duration_seconds",
                    "Launches: time to compute one merged batch, in seconds.", DURATION_BOUNDS },
    [H_BATCH_TOKENS] = { "moed_batch_tokens", "Launches: tokens in one merged batch.",
                         BOUNDS(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                16384, 32768, 65536),
                         0 },
    [H_BATCH_REQUESTS] = { "moed_batch_requests", "Launches: requests merged into one batch.",
                           BOUNDS(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), 0 },
};

typedef struct hist {
    _Atomic uint64_t bucket[MAX_BUCKETS + 1]; /* the last: above every bound (+Inf) */
    _Atomic uint64_t sum;
} hist;

typedef struct shard {
    _Alignas(64) _Atomic uint64_t requests[MOED_METHOD_COUNT][MOED_GRPC_STATUS_COUNT];
    _Atomic uint64_t doorbell[MOED_GRPC_STATUS_COUNT];
    _Atomic uint64_t link[MOED_GRPC_STATUS_COUNT];
    _Atomic uint64_t forwards, tokens, request_bytes, response_bytes;
    hist h[H_COUNT];
} shard;

struct moed_metrics {
    shard shards[SHARDS];
    /* moed_expert_tokens_total: one counter per layer slot and held expert, added to once per
     * launch (not sharded: a launch adds a few counters, and the table can be large) */
    const moed_shard *layers;
    int n_slots;
    int *first;                      /* [n_slots + 1]: each slot's first counter */
    _Atomic uint64_t *expert_tokens; /* [first[n_slots]] */
    _Atomic uint64_t *launches;      /* [n_slots]: moed_layer_launches_total */
    _Atomic uint64_t *rebalances;    /* [n_slots][MOED_REBALANCE_RESULTS] */
};

static const char *const method_names[MOED_METHOD_COUNT] = {
    [MOED_METHOD_FORWARD] = "Forward",          [MOED_METHOD_FORWARD_STREAM] = "ForwardStream",
    [MOED_METHOD_GET_MODEL] = "GetModel",       [MOED_METHOD_HEALTH_CHECK] = "Check",
    [MOED_METHOD_HEALTH_WATCH] = "Watch",       [MOED_METHOD_REGIONS] = "Regions",
    [MOED_METHOD_LIST_REGIONS] = "ListRegions", [MOED_METHOD_UNKNOWN] = "unknown",
};

moed_metrics *moed_metrics_create(void)
{
    /* aligned_alloc: every shard starts on its own cache line (sizeof is a multiple of 64). */
    moed_metrics *m = aligned_alloc(64, sizeof *m);
    if (m) memset(m, 0, sizeof *m);
    return m;
}

void moed_metrics_destroy(moed_metrics *m)
{
    if (!m) return;
    free(m->first);
    free(m->expert_tokens);
    free(m->launches);
    free(m->rebalances);
    free(m);
}

int moed_metrics_set_layers(moed_metrics *m, const moed_shard *shards, int n_slots)
{
    if (!(m->first = malloc(((size_t)n_slots + 1) * sizeof *m->first))) return MOED_ENOMEM;
    m->first[0] = 0;
    for (int i = 0; i < n_slots; i++) m->first[i + 1] = m->first[i] + shards[i].n_held;
    if (!(m->expert_tokens = calloc((size_t)m->first[n_slots] + 1, sizeof *m->expert_tokens)) ||
        !(m->launches = calloc((size_t)n_slots + 1, sizeof *m->launches)) ||
        !(m->rebalances =
              calloc(((size_t)n_slots + 1) * MOED_REBALANCE_RESULTS, sizeof *m->rebalances)))
        return MOED_ENOMEM;
    m->layers = shards;
    m->n_slots = n_slots;
    return 0;
}

/* ---- recording ------------------------------------------------------------------------------- */

static shard *my_shard(moed_metrics *m)
{
    static _Atomic unsigned next;
    static _Thread_local int mine = -1;
    if (mine < 0) mine = (int)(atomic_fetch_add_explicit(&next, 1, memory_order_relaxed) % SHARDS);
    return &m->shards[mine];
}

static void add(_Atomic uint64_t *c, uint64_t v)
{
    atomic_fetch_add_explicit(c, v, memory_order_relaxed);
}

static void observe(shard *s, int which, uint64_t v)
{
    const hist_def *d = &hists[which];
    int b = 0;
    while (b < d->n && v > d->bounds[b]) b++;
    add(&s->h[which].bucket[b], 1);
    add(&s->h[which].sum, v);
}

void moed_metrics_request(moed_metrics *m, moed_method method, int grpc_status)
{
    if (!m || (unsigned)method >= MOED_METHOD_COUNT) return;
    if (grpc_status < 0 || grpc_status >= MOED_GRPC_STATUS_COUNT) grpc_status = 2; /* UNKNOWN */
    add(&my_shard(m)->requests[method][grpc_status], 1);
}

void moed_metrics_forward(moed_metrics *m, uint64_t duration_ns, uint64_t request_bytes,
                          uint64_t response_bytes)
{
    if (!m) return;
    shard *s = my_shard(m);
    add(&s->forwards, 1);
    add(&s->request_bytes, request_bytes);
    add(&s->response_bytes, response_bytes);
    observe(s, H_REQUEST, duration_ns);
}

void moed_metrics_doorbell(moed_metrics *m, int grpc_status, uint64_t duration_ns)
{
    if (!m) return;
    if (grpc_status < 0 || grpc_status >= MOED_GRPC_STATUS_COUNT) grpc_status = 2; /* UNKNOWN */
    shard *s = my_shard(m);
    add(&s->doorbell[grpc_status], 1);
    observe(s, H_DOORBELL, duration_ns);
}

void moed_metrics_link(moed_metrics *m, int grpc_status, uint64_t duration_ns)
{
    if (!m) return;
    if (grpc_status < 0 || grpc_status >= MOED_GRPC_STATUS_COUNT) grpc_status = 2; /* UNKNOWN */
    shard *s = my_shard(m);
    add(&s->link[grpc_status], 1);
    observe(s, H_LINK, duration_ns);
}

void moed_metrics_queue_wait(moed_metrics *m, uint64_t queue_ns)
{
    if (m) observe(my_shard(m), H_QUEUE, queue_ns);
}

void moed_metrics_launch(moed_metrics *m, uint64_t tokens, uint64_t requests, uint64_t compute_ns)
{
    if (!m) return;
    shard *s = my_shard(m);
    add(&s->tokens, tokens);
    observe(s, H_COMPUTE, compute_ns);
    observe(s, H_BATCH_TOKENS, tokens);
    observe(s, H_BATCH_REQUESTS, requests);
}

void moed_metrics_expert_tokens(moed_metrics *m, int slot, const uint64_t *tokens, int n)
{
    if (!m || slot < 0 || slot >= m->n_slots) return;
    _Atomic uint64_t *c = m->expert_tokens + m->first[slot];
    for (int e = 0; e < n && e < m->first[slot + 1] - m->first[slot]; e++)
        if (tokens[e]) add(&c[e], tokens[e]);
    add(&m->launches[slot], 1);
}

void moed_metrics_rebalance(moed_metrics *m, int slot, moed_rebalance_result result)
{
    if (!m || slot < 0 || slot >= m->n_slots || (unsigned)result >= MOED_REBALANCE_RESULTS) return;
    add(&m->rebalances[slot * MOED_REBALANCE_RESULTS + result], 1);
}

/* ---- reading --------------------------------------------------------------------------------- */

static uint64_t load(const _Atomic uint64_t *c)
{
    return atomic_load_explicit((_Atomic uint64_t *)c, memory_order_relaxed);
}

void moed_metrics_layer_load(const moed_metrics *m, int slot, uint64_t *pairs, int n,
                             uint64_t *launches)
{
    const bool have = m && slot >= 0 && slot < m->n_slots;
    const int held = have ? m->first[slot + 1] - m->first[slot] : 0;
    for (int e = 0; e < n; e++)
        pairs[e] = e < held ? load(&m->expert_tokens[m->first[slot] + e]) : 0;
    if (launches) *launches = have ? load(&m->launches[slot]) : 0;
}

/* A field summed over the shards; `field` is the field in shard 0, its place in the others the
 * same distance on. */
static uint64_t sum_of(const moed_metrics *m, const _Atomic uint64_t *field)
{
    size_t offset = (size_t)((const char *)field - (const char *)&m->shards[0]);
    uint64_t v = 0;
    for (int i = 0; i < SHARDS; i++)
        v += atomic_load_explicit((_Atomic uint64_t *)((char *)&m->shards[i] + offset),
                                  memory_order_relaxed);
    return v;
}

#define SUM(m, field) sum_of(m, &(m)->shards[0].field)

/* A histogram summed over the shards: per-bucket counts (not cumulative), count and sum. */
typedef struct hist_total {
    uint64_t bucket[MAX_BUCKETS + 1], count, sum;
} hist_total;

static void hist_sum(const moed_metrics *m, int which, hist_total *t)
{
    memset(t, 0, sizeof *t);
    for (int b = 0; b <= hists[which].n; b++) {
        t->bucket[b] = SUM(m, h[which].bucket[b]);
        t->count += t->bucket[b];
    }
    t->sum = SUM(m, h[which].sum);
}

void moed_metrics_get_totals(const moed_metrics *m, moed_metrics_totals *out)
{
    memset(out, 0, sizeof *out);
    for (int i = 0; i < MOED_METHOD_COUNT; i++)
        for (int c = 0; c < MOED_GRPC_STATUS_COUNT; c++)
            out->requests[i][c] = SUM(m, requests[i][c]);
    for (int c = 0; c < MOED_GRPC_STATUS_COUNT; c++) {
        out->doorbell[c] = SUM(m, doorbell[c]);
        out->link[c] = SUM(m, link[c]);
    }
    out->forwards = SUM(m, forwards);
    out->tokens = SUM(m, tokens);
    out->request_bytes = SUM(m, request_bytes);
    out->response_bytes = SUM(m, response_bytes);
    hist_total t;
    hist_sum(m, H_COMPUTE, &t);
    out->launches = t.count;
    hist_sum(m, H_QUEUE, &t);
    out->queue_waits = t.count;
}

/* ---- the exposition text --------------------------------------------------------------------- */

typedef struct text {
    char *p;
    size_t len, cap;
    bool oom;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(text *t, const char *fmt, ...)
{
    for (int tries = 0; tries < 2 && !t->oom; tries++) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(t->p + t->len, t->cap - t->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            t->oom = true;
            return;
        }
        if ((size_t)n < t->cap - t->len) {
            t->len += (size_t)n;
            return;
        }
        size_t cap = 2 * t->cap + (size_t)n + 1;
        char *p = realloc(t->p, cap);
        if (!p) {
            t->oom = true;
            return;
        }
        t->p = p;
        t->cap = cap;
    }
}

/* A label value with \, " and newline escaped, as the format requires. */
static void put_label(text *t, const char *name, const char *value, bool last)
{
    put(t, "%s=\"", name);
    for (const char *c = value ? value : ""; *c; c++) {
        if (*c == '\\' || *c == '"')
            put(t, "\\%c", *c);
        else if (*c == '\n')
            put(t, "\\n");
        else
            put(t, "%c", *c);
    }
    put(t, "\"%s", last ? "" : ",");
}

static void family(text *t, const char *name, const char *type, const char *help)
{
    put(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void gauge(text *t, const char *name, const char *help, double v)
{
    family(t, name, "gauge", help);
    put(t, "%s %.17g\n", name, v);
}

static void counter(text *t, const char *name, const char *help, uint64_t v)
{
    family(t, name, "counter", help);
    put(t, "%s %llu\n", name, (unsigned long long)v);
}

static void histogram(text *t, const moed_metrics *m, int which)
{
    const hist_def *d = &hists[which];
    hist_total h;
    hist_sum(m, which, &h);
    family(t, d->name, "histogram", d->help);
    uint64_t cum = 0;
    for (int b = 0; b < d->n; b++) {
        cum += h.bucket[b];
        double le = d->scale ? (double)d->bounds[b] * d->scale : (double)d->bounds[b];
        put(t, "%s_bucket{le=\"%g\"} %llu\n", d->name, le, (unsigned long long)cum);
    }
    put(t, "%s_bucket{le=\"+Inf\"} %llu\n", d->name, (unsigned long long)h.count);
    if (d->scale)
        put(t, "%s_sum %.9f\n", d->name, (double)h.sum * d->scale);
    else
        put(t, "%s_sum %llu\n", d->name, (unsigned long long)h.sum);
    put(t, "%s_count %llu\n", d->name, (unsigned long long)h.count);
}

static void requests(text *t, const moed_metrics *m)
{
    family(t, "moed_requests_total", "counter",
           "Requests answered, by gRPC method and status code (each message of a stream counts "
           "as one request; health Watch streams are not counted).");
    for (int i = 0; i < MOED_METHOD_COUNT; i++)
        for (int c = 0; c < MOED_GRPC_STATUS_COUNT; c++) {
            uint64_t v = SUM(m, requests[i][c]);
            /* Forward/OK always appears, so rate() has a series from the first scrape. */
            if (!v && !(i == MOED_METHOD_FORWARD && c == 0)) continue;
            put(t, "moed_requests_total{method=\"%s\",code=\"%s\"} %llu\n", method_names[i],
                moed_grpc_status_name(c), (unsigned long long)v);
        }
}

/* A transport's calls by status (OK always listed, so rate() has a series from the first scrape);
 * counts[c] is shard 0's counter of code c. */
static void transport_calls(text *t, const moed_metrics *m, const char *name, const char *help,
                            const _Atomic uint64_t *counts)
{
    family(t, name, "counter", help);
    for (int c = 0; c < MOED_GRPC_STATUS_COUNT; c++) {
        uint64_t v = sum_of(m, &counts[c]);
        if (v || c == 0)
            put(t, "%s{code=\"%s\"} %llu\n", name, moed_grpc_status_name(c), (unsigned long long)v);
    }
}

static void expert_tokens(text *t, const moed_metrics *m)
{
    family(t, "moed_expert_tokens_total", "counter",
           "(token, expert) pairs computed, by layer and expert (the whole layer's numbering; a "
           "daemon holding an expert shard counts its own experts).");
    for (int i = 0; i < m->n_slots; i++) {
        const moed_shard *sh = &m->layers[i];
        for (int k = 0; k < sh->n_held; k++)
            put(t, "moed_expert_tokens_total{layer=\"%d\",expert=\"%d\"} %llu\n",
                sh->full->info.index, moed_shard_global(sh, k),
                (unsigned long long)load(&m->expert_tokens[m->first[i] + k]));
    }
}

/* Per layer: its launches, and its re-placements by measured load (rebalance.h) by result and as
 * the generation GetModel reports (LayerInfo.placement_generation). */
static void layers(text *t, const moed_metrics *m)
{
    static const char *const results[MOED_REBALANCE_RESULTS] = {
        [MOED_REBALANCE_CHANGED] = "changed",
        [MOED_REBALANCE_UNCHANGED] = "unchanged",
        [MOED_REBALANCE_FAILED] = "failed",
    };
    family(t, "moed_layer_launches_total", "counter",
           "Launches (merged batches computed), by layer.");
    for (int i = 0; i < m->n_slots; i++)
        put(t, "moed_layer_launches_total{layer=\"%d\"} %llu\n", m->layers[i].full->info.index,
            (unsigned long long)load(&m->launches[i]));
    family(t, "moed_rebalances_total", "counter",
           "Re-placements of a split layer by its measured load (--rebalance) the backend weighed, "
           "by layer and result: changed (a new placement serves), unchanged (gain below "
           "--rebalance-min-gain), failed (the old placement serves on; the log says why).");
    for (int i = 0; i < m->n_slots; i++)
        for (int r = 0; r < MOED_REBALANCE_RESULTS; r++)
            put(t, "moed_rebalances_total{layer=\"%d\",result=\"%s\"} %llu\n",
                m->layers[i].full->info.index, results[r],
                (unsigned long long)load(&m->rebalances[i * MOED_REBALANCE_RESULTS + r]));
    family(t, "moed_layer_placement_generation", "gauge",
           "Re-placements applied to each layer since the start (GetModel's "
           "LayerInfo.placement_generation; 0: the placement made at load).");
    for (int i = 0; i < m->n_slots; i++)
        put(t, "moed_layer_placement_generation{layer=\"%d\"} %llu\n",
            m->layers[i].full->info.index,
            (unsigned long long)load(
                &m->rebalances[i * MOED_REBALANCE_RESULTS + MOED_REBALANCE_CHANGED]));
}

static void devices(text *t, const moed_metrics_gauges *g)
{
    static const char *const names[2] = { "moed_device_memory_used_bytes",
                                          "moed_device_memory_total_bytes" };
    static const char *const helps[2] = {
        "Memory in use on each compute device, in bytes (host memory for the cpu backend).",
        "Memory on each compute device, in bytes (host memory for the cpu backend)."
    };
    for (int k = 0; k < 2; k++) {
        family(t, names[k], "gauge", helps[k]);
        for (int i = 0; i < g->n_devices; i++) {
            const moed_device_info *d = &g->devices[i];
            char ordinal[16];
            snprintf(ordinal, sizeof ordinal, "%d", i);
            put(t, "%s{", names[k]);
            put_label(t, "device", ordinal, false);
            put_label(t, "name", d->name, true);
            put(t, "} %llu\n", (unsigned long long)(k ? d->memory_total : d->memory_used));
        }
    }
}

static void regions(text *t, const moed_metrics_gauges *g)
{
    static const char *const kinds[2] = { "host", "cuda" };
    family(t, "moed_regions", "gauge",
           "Tensor regions registered now (usable or awaiting their confirmation), by kind.");
    for (int k = 0; k < 2; k++)
        put(t, "moed_regions{kind=\"%s\"} %llu\n", kinds[k], (unsigned long long)g->regions[k]);
    family(t, "moed_region_bytes", "gauge", "Bytes of the tensor regions registered now, by kind.");
    for (int k = 0; k < 2; k++)
        put(t, "moed_region_bytes{kind=\"%s\"} %llu\n", kinds[k],
            (unsigned long long)g->region_bytes[k]);
}

char *moed_metrics_render(const moed_metrics *m, const moed_metrics_gauges *g, size_t *len)
{
    text t = { .cap = 16384 };
    if (!(t.p = malloc(t.cap))) return NULL;
    t.p[0] = 0;
    gauge(&t, "moed_up", "1 while the daemon runs (the scrape itself reached it).", 1);
    family(&t, "moed_build_info", "gauge", "The daemon's version and backend; always 1.");
    put(&t, "moed_build_info{");
    put_label(&t, "version", g->version, false);
    put_label(&t, "backend", g->backend, true);
    put(&t, "} 1\n");
    gauge(&t, "moed_start_time_seconds", "Unix time the daemon started, in seconds.",
          g->start_time_s);
    gauge(&t, "moed_serving", "1 while the health status is SERVING, 0 before and while draining.",
          g->serving);
    requests(&t, m);
    transport_calls(&t, m, "moed_doorbell_requests_total",
                    "Doorbell calls (same-host calls through a ring in shared memory) answered, by "
                    "status code.",
                    m->shards[0].doorbell);
    transport_calls(&t, m, "moed_link_requests_total",
                    "NCCL link calls (Forwards whose tensors move over NCCL) answered, by status "
                    "code.",
                    m->shards[0].link);
    counter(&t, "moed_tokens_total", "Tokens computed (rows of hidden, over every launch).",
            SUM(m, tokens));
    expert_tokens(&t, m);
    layers(&t, m);
    counter(&t, "moed_request_bytes_total", "Bytes of Forward request messages received.",
            SUM(m, request_bytes));
    counter(&t, "moed_response_bytes_total", "Bytes of Forward response messages sent.",
            SUM(m, response_bytes));
    for (int h = 0; h < H_COUNT; h++) histogram(&t, m, h);
    gauge(&t, "moed_queue_requests", "Requests waiting in the scheduler's queues.",
          (double)g->queue_requests);
    counter(&t, "moed_connections_closed_total",
            "gRPC connections closed for going past their limits (--max-streams).",
            g->connections_closed);
    gauge(&t, "moed_calls_active", "gRPC calls open (unary calls in progress and open streams).",
          (double)g->calls_active);
    gauge(&t, "moed_stream_pool_busy",
          "Execution slots (CUDA streams; one for cpu) running a launch.", (double)g->exec_busy);
    gauge(&t, "moed_stream_pool_size", "Execution slots (CUDA streams; one for cpu).",
          (double)g->exec_size);
    devices(&t, g);
    regions(&t, g);
    gauge(&t, "moed_rings_open", "Doorbell rings open (registered and not closed).",
          (double)g->rings);
    gauge(&t, "moed_links_open", "NCCL links open (opened and not closed).", (double)g->links);
    gauge(&t, "moed_staging_pool_used_bytes",
          "Bytes of the staging pool (--staging-pool) holding requests' rows and replies now.",
          (double)g->staging_pool_used);
    gauge(&t, "moed_staging_pool_bytes", "Size of the staging pool (--staging-pool), in bytes.",
          (double)g->staging_pool_bytes);
    gauge(&t, "moed_http_connections",
          "Connections open to this metrics endpoint (waiting for their request, or answered).",
          (double)g->http_connections);
    counter(&t, "moed_http_refused_total",
            "Connections to this metrics endpoint answered 503 (over its connection limits) or 408 "
            "(request too slow).",
            g->http_refused);
    if (t.oom) {
        free(t.p);
        return NULL;
    }
    *len = t.len;
    return t.p;
}
