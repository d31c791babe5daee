/*
 * test_metrics — the Prometheus metrics and their HTTP endpoint.
 *
 * Metrics: events recorded from many threads at once sum exactly; histogram buckets are
 * inclusive at their bound, cumulative in the text, and agree with _count and _sum; label values
 * are escaped; every recording function takes NULL. The endpoint: a real server on a libuv loop,
 * called over TCP by a client thread with good requests (GET, HEAD, query strings, bare LF, a
 * request sent byte by byte) and bad ones (garbage, NUL bytes, a bad request line, a header
 * without a colon, a body, an HTTP/2 preface, an over-long head, other methods), each answered
 * with its status; then a burst over the connection limit, after which it still answers.
 */
#include "check.h"
#include "http.h"
#include "metrics.h"
#include "moed_time.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdbool.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

/* ---- metrics --------------------------------------------------------------------------------- */

/* The value of the sample line that starts with `series ` in text, or -1. */
static double sample(const char *text, const char *series)
{
    size_t n = strlen(series);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncmp(p, series, n) && p[n] == ' ') return strtod(p + n + 1, NULL);
    return -1;
}

#define THREADS 8
#define EVENTS  5000

static void *record(void *arg)
{
    moed_metrics *m = arg;
    for (int i = 0; i < EVENTS; i++) {
        moed_metrics_request(m, MOED_METHOD_FORWARD, i % 2 ? 0 : 3);
        moed_metrics_forward(m, 1000000, 100, 10);
        moed_metrics_launch(m, 4, 2, 2000000);
        moed_metrics_queue_wait(m, 50000);
    }
    return NULL;
}

static char *render(moed_metrics *m)
{
    static const moed_device_info dev[2] = {
        { .name = "gpu \"zero\"\\\n", .memory_used = 30, .memory_total = 100 },
        { .name = "one", .memory_used = 5, .memory_total = 50 }
    };
    moed_metrics_gauges g = { .serving = true,
                              .queue_requests = 7,
                              .calls_active = 3,
                              .connections_closed = 2,
                              .exec_busy = 1,
                              .exec_size = 4,
                              .devices = dev,
                              .n_devices = 2,
                              .version = "9.9",
                              .backend = "cpu",
                              .http_connections = 5,
                              .http_refused = 11,
                              .regions = { 2, 1 },
                              .region_bytes = { 4096, 1 << 20 },
                              .staging_pool_used = 512,
                              .rings = 3,
                              .staging_pool_bytes = 8192 };
    size_t len = 0;
    char *t = moed_metrics_render(m, &g, &len);
    CHECK(t && strlen(t) == len);
    return t;
}

static void test_concurrent_counts(void)
{
    moed_metrics *m = moed_metrics_create();
    pthread_t th[THREADS];
    for (int i = 0; i < THREADS; i++) pthread_create(&th[i], NULL, record, m);
    for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
    moed_metrics_totals t;
    moed_metrics_get_totals(m, &t);
    const uint64_t n = (uint64_t)THREADS * EVENTS;
    CHECK_EQ_INT(t.requests[MOED_METHOD_FORWARD][0], n / 2);
    CHECK_EQ_INT(t.requests[MOED_METHOD_FORWARD][3], n / 2);
    CHECK_EQ_INT(t.forwards, n);
    CHECK_EQ_INT(t.tokens, 4 * n);
    CHECK_EQ_INT(t.request_bytes, 100 * n);
    CHECK_EQ_INT(t.response_bytes, 10 * n);
    CHECK_EQ_INT(t.launches, n);
    CHECK_EQ_INT(t.queue_waits, n);

    char *text = render(m);
    CHECK_NEAR(sample(text, "moed_requests_total{method=\"Forward\",code=\"OK\"}"), n / 2, 0);
    CHECK_NEAR(sample(text, "moed_requests_total{method=\"Forward\",code=\"INVALID_ARGUMENT\"}"),
               n / 2, 0);
    CHECK_NEAR(sample(text, "moed_tokens_total"), 4.0 * n, 0);
    CHECK_NEAR(sample(text, "moed_request_bytes_total"), 100.0 * n, 0);
    CHECK_NEAR(sample(text, "moed_response_bytes_total"), 10.0 * n, 0);
    /* 1 ms requests: below 0.001 nothing, from 0.001 on everything (the bound is inclusive). */
    CHECK_NEAR(sample(text, "moed_request_duration_seconds_bucket{le=\"0.0005\"}"), 0, 0);
    CHECK_NEAR(sample(text, "moed_request_duration_seconds_bucket{le=\"0.001\"}"), n, 0);
    CHECK_NEAR(sample(text, "moed_request_duration_seconds_bucket{le=\"+Inf\"}"), n, 0);
    CHECK_NEAR(sample(text, "moed_request_duration_seconds_count"), n, 0);
    CHECK_NEAR(sample(text, "moed_request_duration_seconds_sum"), n * 0.001, 1e-6);
    CHECK_NEAR(sample(text, "moed_compute_duration_seconds_bucket{le=\"0.001\"}"), 0, 0);
    CHECK_NEAR(sample(text, "moed_compute_duration_seconds_bucket{le=\"0.0025\"}"), n, 0);
    CHECK_NEAR(sample(text, "moed_queue_duration_seconds_bucket{le=\"0.0001\"}"), n, 0);
    CHECK_NEAR(sample(text, "moed_batch_tokens_bucket{le=\"2\"}"), 0, 0);
    CHECK_NEAR(sample(text, "moed_batch_tokens_bucket{le=\"4\"}"), n, 0);
    CHECK_NEAR(sample(text, "moed_batch_tokens_sum"), 4.0 * n, 0);
    CHECK_NEAR(sample(text, "moed_batch_requests_bucket{le=\"1\"}"), 0, 0);
    CHECK_NEAR(sample(text, "moed_batch_requests_bucket{le=\"2\"}"), n, 0);
    /* Gauges as sampled. */
    CHECK_NEAR(sample(text, "moed_up"), 1, 0);
    CHECK_NEAR(sample(text, "moed_serving"), 1, 0);
    CHECK_NEAR(sample(text, "moed_queue_requests"), 7, 0);
    CHECK_NEAR(sample(text, "moed_calls_active"), 3, 0);
    CHECK_NEAR(sample(text, "moed_connections_closed_total"), 2, 0);
    CHECK_NEAR(sample(text, "moed_stream_pool_busy"), 1, 0);
    CHECK_NEAR(sample(text, "moed_stream_pool_size"), 4, 0);
    CHECK_NEAR(sample(text, "moed_http_connections"), 5, 0);
    CHECK_NEAR(sample(text, "moed_http_refused_total"), 11, 0);
    CHECK_NEAR(sample(text, "moed_build_info{version=\"9.9\",backend=\"cpu\"}"), 1, 0);
    CHECK_NEAR(sample(text, "moed_device_memory_used_bytes{device=\"1\",name=\"one\"}"), 5, 0);
    CHECK_NEAR(sample(text, "moed_device_memory_total_bytes{device=\"1\",name=\"one\"}"), 50, 0);
    /* A device name with a quote, a backslash and a newline stays one well-formed line. */
    CHECK_NEAR(sample(text, "moed_device_memory_used_bytes{device=\"0\",name=\"gpu "
                            "\\\"zero\\\"\\\\\\n\"}"),
               30, 0);
    free(text);
    moed_metrics_destroy(m);
}

/* Each observation lands in the first bucket whose bound is >= it; the text is cumulative. */
static void test_buckets(void)
{
    moed_metrics *m = moed_metrics_create();
    uint64_t tokens[] = { 1, 2, 3, 4, 5, 65536, 65537, 1000000 };
    for (size_t i = 0; i < sizeof tokens / sizeof tokens[0]; i++)
        moed_metrics_launch(m, tokens[i], 1, 0);
    char *text = render(m);
    CHECK_NEAR(sample(text, "moed_batch_tokens_bucket{le=\"1\"}"), 1, 0);
    CHECK_NEAR(sample(text, "moed_batch_tokens_bucket{le=\"2\"}"), 2, 0);
    CHECK_NEAR(sample(text, "moed_batch_tokens_bucket{le=\"4\"}"), 4, 0);
    CHECK_NEAR(sample(text, "moed_batch_tokens_bucket{le=\"8\"}"), 5, 0);
    CHECK_NEAR(sample(text, "moed_batch_tokens_bucket{le=\"65536\"}"), 6, 0);
    CHECK_NEAR(sample(text, "moed_batch_tokens_bucket{le=\"+Inf\"}"), 8, 0);
    CHECK_NEAR(sample(text, "moed_batch_tokens_count"), 8, 0);
    CHECK_NEAR(sample(text, "moed_batch_tokens_sum"), 1 + 2 + 3 + 4 + 5 + 65536 + 65537 + 1000000,
               0);
    /* A zero-duration launch counts in the smallest duration bucket. */
    CHECK_NEAR(sample(text, "moed_compute_duration_seconds_bucket{le=\"0.0001\"}"), 8, 0);
    /* Only Forward/OK is shown at zero; other codes appear once seen. */
    CHECK_NEAR(sample(text, "moed_requests_total{method=\"Forward\",code=\"OK\"}"), 0, 0);
    CHECK(!strstr(text, "code=\"CANCELLED\""));
    /* Every line is a comment or `name{...} value`; every family has HELP and TYPE. */
    int helps = 0, types = 0;
    for (char *line = text; *line; line = strchr(line, '\n') + 1) {
        if (!strncmp(line, "# HELP ", 7)) helps++;
        if (!strncmp(line, "# TYPE ", 7)) types++;
        CHECK(line[0] == '#' || (line[0] >= 'a' && line[0] <= 'z'));
    }
    CHECK_NEAR(sample(text, "moed_link_requests_total{code=\"OK\"}"), 0, 0); /* links' own */
    CHECK(strstr(text, "# TYPE moed_link_request_duration_seconds histogram") != NULL);
    CHECK(strstr(text, "# TYPE moed_links_open gauge") != NULL);
    CHECK_EQ_INT(helps, 36);
    CHECK_EQ_INT(types, 36);
    /* the data plane's gauges, by region kind */
    CHECK_NEAR(sample(text, "moed_regions{kind=\"host\"}"), 2, 0);
    CHECK_NEAR(sample(text, "moed_regions{kind=\"cuda\"}"), 1, 0);
    CHECK_NEAR(sample(text, "moed_region_bytes{kind=\"cuda\"}"), 1 << 20, 0);
    CHECK_NEAR(sample(text, "moed_staging_pool_used_bytes"), 512, 0);
    free(text);
    moed_metrics_destroy(m);
}

/* Doorbell calls by code and their durations, apart from gRPC's; the rings open. */
static void test_doorbell(void)
{
    moed_metrics *m = moed_metrics_create();
    moed_metrics_doorbell(m, 0, 20000);     /* 20 us */
    moed_metrics_doorbell(m, 0, 2000000);   /* 2 ms */
    moed_metrics_doorbell(m, 3, 5000);      /* INVALID_ARGUMENT, 5 us */
    moed_metrics_doorbell(m, 77, 10000000); /* not a code: UNKNOWN */
    char *text = render(m);
    CHECK_NEAR(sample(text, "moed_doorbell_requests_total{code=\"OK\"}"), 2, 0);
    CHECK_NEAR(sample(text, "moed_doorbell_requests_total{code=\"INVALID_ARGUMENT\"}"), 1, 0);
    CHECK_NEAR(sample(text, "moed_doorbell_requests_total{code=\"UNKNOWN\"}"), 1, 0);
    CHECK_NEAR(sample(text, "moed_doorbell_request_duration_seconds_bucket{le=\"1e-05\"}"), 1, 0);
    CHECK_NEAR(sample(text, "moed_doorbell_request_duration_seconds_bucket{le=\"2.5e-05\"}"), 2, 0);
    CHECK_NEAR(sample(text, "moed_doorbell_request_duration_seconds_count"), 4, 0);
    CHECK_NEAR(sample(text, "moed_doorbell_request_duration_seconds_sum"), 0.012025, 1e-9);
    CHECK_NEAR(sample(text, "moed_request_duration_seconds_count"), 0, 0);
    CHECK_NEAR(sample(text, "moed_rings_open"), 3, 0);
    moed_metrics_totals t;
    moed_metrics_get_totals(m, &t);
    CHECK_EQ_INT(t.doorbell[0], 2);
    CHECK_EQ_INT(t.forwards, 0);
    free(text);
    moed_metrics_destroy(m);
}

static void test_null(void)
{
    moed_metrics_doorbell(NULL, 0, 1);
    moed_metrics_request(NULL, MOED_METHOD_FORWARD, 0);
    moed_metrics_forward(NULL, 1, 2, 3);
    moed_metrics_queue_wait(NULL, 1);
    moed_metrics_launch(NULL, 1, 1, 1);
    moed_metrics *m = moed_metrics_create();
    moed_metrics_request(m, MOED_METHOD_COUNT, 0);      /* out of range: ignored */
    moed_metrics_request(m, MOED_METHOD_GET_MODEL, 99); /* not a code: counted as UNKNOWN */
    moed_metrics_totals t;
    moed_metrics_get_totals(m, &t);
    CHECK_EQ_INT(t.requests[MOED_METHOD_GET_MODEL][2], 1);
    moed_metrics_destroy(m);
}

/* ---- the endpoint ---------------------------------------------------------------------------- */

typedef struct server {
    uv_loop_t loop;
    uv_async_t stop;
    moed_http *http;
    int port;
} server;

/* /metrics (401 unless authorized), and /open: the connections open, from the loop's thread. */
static void handler(void *arg, const char *path, bool authorized, moed_http_reply *out)
{
    server *s = arg;
    char buf[64];
    if (!strcmp(path, "/open")) {
        moed_http_stats st;
        moed_http_get_stats(s->http, &st);
        snprintf(buf, sizeof buf, "%llu %llu\n", (unsigned long long)st.open,
                 (unsigned long long)st.refused);
        out->status = 200;
        out->body = strdup(buf);
        out->len = strlen(buf);
        return;
    }
    if (strcmp(path, "/metrics")) return; /* 404 */
    out->status = authorized ? 200 : 401;
    out->content_type = "text/plain; version=0.0.4";
    out->body = strdup(authorized ? "moed_up 1\n" : "no\n");
    out->len = strlen(out->body);
}

static void on_stop(uv_async_t *a)
{
    server *s = a->data;
    moed_http_close(s->http);
    uv_close((uv_handle_t *)a, NULL);
}

/* Sends req (in pieces of `chunk` bytes, 0: at once) and reads the answer until the server
 * closes; returns the status, -1 if none came. */
static int call(int port, const char *req, size_t len, size_t chunk, char *resp, size_t cap)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa)) {
        close(fd);
        return -1;
    }
    for (size_t at = 0; at < len;) {
        size_t n = chunk && chunk < len - at ? chunk : len - at;
        ssize_t w = send(fd, req + at, n, MSG_NOSIGNAL);
        if (w <= 0) break;
        at += (size_t)w;
        if (chunk) usleep(1000);
    }
    size_t got = 0;
    ssize_t r;
    while (got + 1 < cap && (r = recv(fd, resp + got, cap - 1 - got, 0)) > 0) got += (size_t)r;
    resp[got] = 0;
    close(fd);
    int status = -1;
    if (sscanf(resp, "HTTP/1.1 %d ", &status) != 1) status = -1;
    return status;
}

static int get(int port, const char *req, char *resp, size_t cap)
{
    return call(port, req, strlen(req), 0, resp, cap);
}

static void limits(int port);

static void *client(void *arg)
{
    server *s = arg;
    char r[8192];
    int p = s->port;
    CHECK_EQ_INT(get(p, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", r, sizeof r), 200);
    CHECK(strstr(r, "\r\n\r\nmoed_up 1\n") && strstr(r, "Content-Length: 10\r\n"));
    CHECK(strstr(r, "Content-Type: text/plain; version=0.0.4\r\n"));
    CHECK_EQ_INT(get(p, "HEAD /metrics HTTP/1.0\r\n\r\n", r, sizeof r), 200);
    CHECK(strstr(r, "Content-Length: 10\r\n") && !strstr(r, "moed_up"));
    CHECK_EQ_INT(get(p, "GET /metrics?name[]=x HTTP/1.1\n\n", r, sizeof r), 200);
    const char slow[] = "GET /metrics HTTP/1.1\r\nUser-Agent: Prometheus/2.53\r\n\r\n";
    CHECK_EQ_INT(call(p, slow, sizeof slow - 1, 1, r, sizeof r), 200);
    CHECK_EQ_INT(get(p, "GET /other HTTP/1.1\r\n\r\n", r, sizeof r), 404);
    CHECK_EQ_INT(get(p, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", r, sizeof r), 405);
    CHECK(strstr(r, "Allow: GET, HEAD\r\n"));
    const char *bad[] = {
        "\x16\x03\x01\x02\xff\x01\x7f\x01\xfc\x03\x03\r\n\r\n", /* binary, ending in a blank line */
        "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        "GET /metrics\r\n\r\n",
        "GET  /metrics HTTP/1.1\r\n\r\n",
        "GET /metrics HTTP/1.1 extra\r\n\r\n",
        "get /metrics HTTP/1.1\r\n\r\n",
        "GET metrics HTTP/1.1\r\n\r\n",
        "GET /met\x7frics HTTP/1.1\r\n\r\n",
        "GET /metrics HTTP/3.0\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nNoColonHere\r\n\r\n",
        "GET /metrics HTTP/1.1\r\n: empty name\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nX: a\x01b\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
        "GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_MSG(get(p, bad[i], r, sizeof r) == 400, "request %zu answered %.40s", i, r);
    const char nul[] = "GET /metrics HTTP/1.1\r\nX: a\0b\r\n\r\n";
    CHECK_EQ_INT(call(p, nul, sizeof nul - 1, 0, r, sizeof r), 400);
    /* A head that never ends: refused once 8 KiB have arrived. */
    char *big = malloc(9000);
    memcpy(big, "GET /metrics HTTP/1.1\r\nX: ", 26);
    memset(big + 26, 'a', 9000 - 26);
    CHECK_EQ_INT(call(p, big, 9000, 0, r, sizeof r), 431);
    free(big);
    limits(p);
    uv_async_send(&s->stop);
    return NULL;
}

/* A connection from 127.0.0.src (the whole of 127/8 is this host) that sends nothing yet. */
static int idle(int port, int src)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in me = { .sin_family = AF_INET };
    me.sin_addr.s_addr = htonl(INADDR_LOOPBACK + (uint32_t)src - 1);
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&me, sizeof me) ||
        connect(fd, (struct sockaddr *)&sa, sizeof sa)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* server/http.c's limits: how old a waiting connection must be before a newcomer may take its
 * place, how long one may take to send its head, how long an answered one lingers. */
#define EVICT_AGE_NS    (250ll * 1000 * 1000)
#define HEAD_TIMEOUT_NS (5000ll * 1000 * 1000)
#define LINGER_NS       (2000ll * 1000 * 1000)

static long long now_ns(void)
{
    return (long long)moed_now_ns();
}

/* Waits (60 s at most) until `want` of the n connections have been told something: st[i] stays 0
 * while nothing came, becomes the status of the answer that came, or -1 for a reset or a close
 * without an answer. */
static void collect(const int *fds, int *st, int n, int want)
{
    int told = 0;
    for (int ms = 0; ms < 60000; ms += 5, usleep(5000)) {
        told = 0;
        for (int i = 0; i < n; i++) {
            if (!st[i]) {
                char buf[256];
                ssize_t k = recv(fds[i], buf, sizeof buf - 1, MSG_DONTWAIT);
                if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
                st[i] = -1;
                if (k > 0) {
                    buf[k] = 0;
                    if (sscanf(buf, "HTTP/1.1 %d ", &st[i]) != 1) st[i] = -1;
                }
            }
            told++;
        }
        if (told >= want) return;
    }
    CHECK_MSG(0, "%d of %d connections were answered, not %d", told, n, want);
}

static int count(const int *st, int n, int v)
{
    int k = 0;
    for (int i = 0; i < n; i++) k += st[i] == v;
    return k;
}

/* "/open": (connections open, refused in all), as the server counts them. */
static int open_now(int port, int *refused)
{
    char r[512];
    int open = -1, ref = -1;
    if (get(port, "GET /open HTTP/1.1\r\n\r\n", r, sizeof r) == 200)
        sscanf(strstr(r, "\r\n\r\n") + 4, "%d %d", &open, &ref);
    if (refused) *refused = ref;
    return open;
}

/* Whether a look that ended before `by` (now_ns) found only the asking connection open: false
 * also when the test looked too late to tell. */
static bool released_before(int port, long long by)
{
    for (;;) {
        bool one = open_now(port, NULL) == 1;
        if (now_ns() >= by) return false;
        if (one) return true;
        usleep(5000);
    }
}

/* Closes n connections and waits (60 s at most) until only the asking one is open. */
static void close_all(int port, const int *fds, int n)
{
    for (int i = 0; i < n; i++) close(fds[i]);
    for (int ms = 0; ms < 60000 && open_now(port, NULL) != 1; ms += 5) usleep(5000);
}

/* Scrapes that read their answer and close are released at once, not after the 2 s linger. */
static bool scrapes_released(int p)
{
    char r[8192];
    long long sent = now_ns();
    for (int i = 0; i < 40; i++)
        CHECK_EQ_INT(get(p, "GET /metrics HTTP/1.1\r\n\r\n", r, sizeof r), 200);
    return released_before(p, sent + LINGER_NS);
}

/* The limit per address. False: the test was too slow to see what it checks in time (a young
 * connection refusing a scrape, a release before the head timeout). */
static bool peer_limit(int p)
{
    char r[8192];
    /* 40 idle connections from one address: 32 wait, 8 are answered 503. */
    int fds[300], st[300] = { 0 }, refused0, refused1;
    open_now(p, &refused0);
    long long opened = now_ns();
    for (int i = 0; i < 40; i++) fds[i] = idle(p, 1);
    collect(fds, st, 40, 8);
    CHECK_EQ_INT(count(st, 40, 0), 32);
    CHECK_EQ_INT(count(st, 40, 503), 8);
    /* A scrape while they are all young is over the limit too: 503 and Retry-After, not a reset. */
    int status = get(p, "GET /metrics HTTP/1.1\r\n\r\n", r, sizeof r);
    if (now_ns() - opened >= EVICT_AGE_NS) { /* too late to tell: it may have taken a place */
        CHECK(status == 503 || status == 200);
        close_all(p, fds, 40);
        return false;
    }
    CHECK_EQ_INT(status, 503);
    CHECK(strstr(r, "Retry-After: 1\r\n") != NULL);
    /* Once they have waited 250 ms, a scrape takes the oldest one's place, which is told 503
     * before the scrape is answered. */
    usleep(300000);
    CHECK_EQ_INT(get(p, "GET /metrics HTTP/1.1\r\n\r\n", r, sizeof r), 200);
    collect(fds, st, 40, 9);
    CHECK_EQ_INT(st[0], 503);
    CHECK_EQ_INT(count(st, 40, 0), 31);
    /* 150 more (190 in all, over a hundred idle), then a scrape: answered; nothing reset. The
     * newcomers take the old ones' places, then are refused: 32 wait, all new. */
    opened = now_ns();
    for (int i = 40; i < 190; i++) fds[i] = idle(p, 1);
    collect(fds, st, 190, 190 - 32);
    usleep(300000);
    CHECK_EQ_INT(get(p, "GET /metrics HTTP/1.1\r\n\r\n", r, sizeof r), 200);
    collect(fds, st, 190, 190 - 31);
    CHECK_EQ_INT(count(st, 190, -1), 0);
    CHECK_EQ_INT(count(st, 190, 0), 31);
    CHECK_EQ_INT(count(st, 190, 503), 190 - 31);
    int open = open_now(p, &refused1);
    CHECK_MSG(open >= 32 && open <= 32 + 64, "%d open", open); /* 31 waiting, this, answered */
    CHECK_EQ_INT(refused1 - refused0, 1 + 190 - 31);
    for (int i = 0; i < 190; i++) close(fds[i]);
    if (released_before(p, opened + HEAD_TIMEOUT_NS)) return true;
    close_all(p, fds, 0);
    return false;
}

/* The total limit: 9 addresses with 32 each (288), over the 256 that may wait. */
static bool total_limit(int p)
{
    char r[8192];
    int fds[300], st[300] = { 0 };
    long long opened = now_ns();
    for (int i = 0; i < 288; i++) fds[i] = idle(p, 2 + i / 32);
    collect(fds, st, 288, 288 - 256);
    CHECK_EQ_INT(count(st, 288, -1), 0);
    CHECK_EQ_INT(count(st, 288, 0), 256);
    usleep(300000);
    CHECK_EQ_INT(get(p, "GET /metrics HTTP/1.1\r\n\r\n", r, sizeof r), 200);
    collect(fds, st, 288, 288 - 255);
    CHECK_EQ_INT(count(st, 288, -1), 0);
    CHECK_EQ_INT(count(st, 288, 0), 255);
    for (int i = 0; i < 288; i++) close(fds[i]);
    if (released_before(p, opened + HEAD_TIMEOUT_NS)) return true;
    close_all(p, fds, 0);
    return false;
}

/* Each check again where the test itself was too slow to see it (10 tries at most). */
static void limits(int p)
{
    static bool (*const checks[])(int) = { scrapes_released, peer_limit, total_limit };
    static const char *const names[] = { "scrapes_released", "peer_limit", "total_limit" };
    for (int c = 0; c < 3; c++) {
        bool seen = false;
        for (int tries = 0; tries < 10 && !seen; tries++) seen = checks[c](p);
        CHECK_MSG(seen, "%s: never seen in time in 10 tries", names[c]);
    }
}

/* The token: /metrics is authorized only with `Authorization: Bearer <token>`. */
static void *token_client(void *arg)
{
    server *s = arg;
    char r[2048];
    int p = s->port;
    CHECK_EQ_INT(get(p, "GET /metrics HTTP/1.1\r\n\r\n", r, sizeof r), 401);
    CHECK(strstr(r, "WWW-Authenticate: Bearer") != NULL);
    CHECK_EQ_INT(
        get(p, "GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cret-t0ken\r\n\r\n", r, sizeof r),
        200);
    CHECK_EQ_INT(get(p, "GET /metrics HTTP/1.1\r\nauthorization:   bearer s3cret-t0ken  \r\n\r\n",
                     r, sizeof r),
                 200);
    static const char *const wrong[] = { "Bearer s3cret-t0ke",
                                         "Bearer s3cret-t0kenX",
                                         "Basic s3cret-t0ken",
                                         "s3cret-t0ken",
                                         "Bearer",
                                         "Bearer S3CRET-T0KEN" };
    for (size_t i = 0; i < sizeof wrong / sizeof wrong[0]; i++) {
        char req[256];
        snprintf(req, sizeof req, "GET /metrics HTTP/1.1\r\nAuthorization: %s\r\n\r\n", wrong[i]);
        CHECK_MSG(get(p, req, r, sizeof r) == 401, "%s: %.20s", wrong[i], r);
    }
    CHECK_EQ_INT(get(p,
                     "GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cret-t0ken\r\n"
                     "Authorization: Bearer x\r\n\r\n",
                     r, sizeof r),
                 400);
    uv_async_send(&s->stop);
    return NULL;
}

static void run_server(server *s, void *(*fn)(void *))
{
    uv_async_init(&s->loop, &s->stop, on_stop);
    s->stop.data = s;
    pthread_t th;
    pthread_create(&th, NULL, fn, s);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    pthread_join(th, NULL);
    CHECK_EQ_INT(uv_loop_close(&s->loop), 0); /* every handle closed, every connection freed */
}

static void test_token(void)
{
    char path[] = "/tmp/moed-test-token-XXXXXX";
    int fd = mkstemp(path);
    CHECK(write(fd, "  s3cret-t0ken \n# not the token\n", 32) == 32);
    close(fd);
    server s = { 0 };
    moed_error err;
    uv_loop_init(&s.loop);
    moed_http_config cfg = { .listen = "127.0.0.1:0", .token_file = path };
    CHECK_EQ_INT(moed_http_start(&s.loop, &cfg, handler, &s, &s.http, &err), 0);
    s.port = atoi(strrchr(moed_http_address(s.http), ':') + 1);
    run_server(&s, token_client);
    /* Token files that cannot be used. */
    moed_http *h = NULL;
    uv_loop_init(&s.loop);
    static const struct {
        const char *text;
        int code;
        const char *says;
    } bad[] = { { "\n", MOED_EINVAL, "no token" }, { "a b\n", MOED_EINVAL, "space" } };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        FILE *f = fopen(path, "w");
        fputs(bad[i].text, f);
        fclose(f);
        CHECK_EQ_INT(moed_http_start(&s.loop, &cfg, handler, &s, &h, &err), bad[i].code);
        CHECK_MSG(strstr(err.msg, path) && strstr(err.msg, bad[i].says), "%s", err.msg);
    }
    unlink(path);
    cfg.token_file = "/tmp";
    CHECK_EQ_INT(moed_http_start(&s.loop, &cfg, handler, &s, &h, &err), MOED_EIO);
    CHECK(strstr(err.msg, "--metrics-token-file") && strstr(err.msg, "a directory"));
    CHECK_EQ_INT(uv_loop_close(&s.loop), 0);
}

static void test_endpoint(void)
{
    server s = { 0 };
    moed_error err;
    uv_loop_init(&s.loop);
    moed_http_config cfg = { .listen = "127.0.0.1:0" };
    CHECK_EQ_INT(moed_http_start(&s.loop, &cfg, handler, &s, &s.http, &err), 0);
    const char *addr = moed_http_address(s.http);
    s.port = atoi(strrchr(addr, ':') + 1);
    CHECK(!strncmp(addr, "127.0.0.1:", 10) && s.port > 0);

    /* The same port again cannot be bound; addresses that are not addresses are refused. */
    moed_http *h2 = NULL;
    char again[64];
    snprintf(again, sizeof again, "127.0.0.1:%d", s.port);
    moed_http_config c2 = { .listen = again };
    CHECK_EQ_INT(moed_http_start(&s.loop, &c2, handler, &s, &h2, &err), MOED_EIO);
    CHECK(strstr(err.msg, again) != NULL);
    const char *bad[] = { "9400",      "127.0.0.1", "127.0.0.1:",    "127.0.0.1:65536",
                          "host:9400", "[::1:9400", "127.0.0.1:94x", "1.2.3.4.5:80" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        c2.listen = bad[i];
        CHECK_EQ_INT(moed_http_start(&s.loop, &c2, handler, &s, &h2, &err), MOED_EINVAL);
        CHECK(strstr(err.msg, bad[i]) != NULL);
    }
    run_server(&s, client);
}

int main(void)
{
    test_concurrent_counts();
    test_doorbell();
    test_buckets();
    test_null();
    test_endpoint();
    test_token();
    return check_status("test_metrics");
}
