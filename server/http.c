/*
 * moed_http — the metrics endpoint's HTTP server, on the daemon's libuv loop (http.h).
 *
 * Why on the loop and not a thread of its own: scrapes come every few seconds and rendering is a
 * few microseconds of summing atomics, so the loop (otherwise idle but for signals and timers) has
 * time to spare; libuv gives non-blocking sockets and one read buffer serves every connection,
 * since a read is handled before the next one is taken. Why not libmicrohttpd: its connection
 * limits close the sockets over them (the resets this server must not give), and it would bring
 * a thread model and a dependency for two read-only paths.
 *
 * A connection is in one of two queues, each oldest first. `waiting`: accepted, its request head
 * not complete; bounded in number (in all, and per peer), in time and in bytes. `answered`: its
 * answer written with one write, then the write side shut down; the server still reads (and
 * discards) so that it sees the client's close at once — unread bytes would also turn a close
 * into a reset that could eat the answer — and closes after at most LINGER_MS.
 *
 * Why a limit takes the oldest waiting connection's place instead of refusing the newest: an
 * idle or trickling connection is what an attacker holds, and a scrape completes its head within
 * a round trip, so the oldest is the likeliest to be held for nothing; EVICT_AGE_MS spares one
 * whose request is merely on its way. The one displaced is answered 503, like a refused one.
 */
#include "http.h"

#include "file.h"
#include "http_parse.h"
#include "log.h"
#include "moed_list.h"

#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_WAITING     256 /* connections whose request has not come yet */
#define MAX_PER_PEER    32  /* of them from one address (IPv6: one /64) */
#define MAX_ANSWERED    64  /* connections answered and waiting for the client's close */
#define HEAD_TIMEOUT_MS 5000
#define LINGER_MS       2000
#define EVICT_AGE_MS    250
#define MAX_DISCARD     65536 /* bytes read after the head before the connection is closed */
#define MAX_TOKEN       4096

typedef struct conn conn;

typedef struct queue {
    moed_list conns; /* oldest first */
    int n;
} queue;

struct moed_http {
    uv_loop_t *loop;
    uv_tcp_t server;
    moed_http_handler fn;
    void *arg;
    char *token; /* NULL: no token */
    size_t token_len;
    char address[80];
    queue waiting, answered;
    uint64_t refused;
    int refs; /* the listener and each connection: freed when all are closed */
    bool closing;
    char rbuf[16384]; /* every read lands here and is handled before the next */
};

struct conn {
    moed_http *h;
    moed_list node;
    queue *in; /* waiting or answered; NULL once closing */
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_write_t wr;
    uv_shutdown_t sd;
    int handles; /* open libuv handles (tcp, timer) */
    bool writing, peer_closed;
    uint64_t since; /* uv_now when accepted */
    unsigned char peer[8];
    size_t peer_len, discarded;
    moed_http_parser *parser; /* while waiting */
    char *out;                /* the answer being written */
};

/* ---- queues ---------------------------------------------------------------------------------- */

static void queue_remove(conn *c)
{
    queue *q = c->in;
    if (!q) return;
    moed_list_remove(&c->node);
    c->in = NULL;
    q->n--;
}

static void queue_push(queue *q, conn *c)
{
    queue_remove(c);
    moed_list_insert_tail(&q->conns, &c->node);
    c->in = q;
    q->n++;
}

/* The oldest connection of q; NULL when q is empty. */
static conn *queue_oldest(const queue *q)
{
    return moed_list_empty(&q->conns) ? NULL
                                      : moed_list_data(moed_list_head(&q->conns), conn, node);
}

/* ---- closing --------------------------------------------------------------------------------- */

static void http_unref(moed_http *h)
{
    if (--h->refs) return;
    free(h->token);
    free(h);
}

static void on_conn_closed(uv_handle_t *hd)
{
    conn *c = hd->data;
    if (--c->handles) return;
    moed_http *h = c->h;
    free(c->parser);
    free(c->out);
    free(c);
    http_unref(h);
}

static void conn_close(conn *c)
{
    if (uv_is_closing((uv_handle_t *)&c->tcp)) return;
    queue_remove(c);
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
    uv_close((uv_handle_t *)&c->timer, on_conn_closed);
}

/* ---- answering ------------------------------------------------------------------------------- */

static const char *reason(int status)
{
    switch (status) {
    case 200:
        return "OK";
    case 400:
        return "Bad Request";
    case 401:
        return "Unauthorized";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 431:
        return "Request Header Fields Too Large";
    case 500:
        return "Internal Server Error";
    case 503:
        return "Service Unavailable";
    }
    return "Unknown";
}

/* The header lines a status calls for. */
static const char *extra_headers(int status)
{
    switch (status) {
    case 401:
        return "WWW-Authenticate: Bearer realm=\"moed metrics\"\r\n";
    case 405:
        return "Allow: GET, HEAD\r\n";
    case 503:
        return "Retry-After: 1\r\n";
    }
    return "";
}

static void on_shutdown(uv_shutdown_t *sd, int status)
{
    if (status < 0) conn_close(sd->data);
}

static void on_written(uv_write_t *wr, int status)
{
    conn *c = wr->data;
    c->writing = false;
    free(c->out);
    c->out = NULL;
    if (uv_is_closing((uv_handle_t *)&c->tcp)) return;
    if (status < 0 || c->peer_closed) { /* nothing more to say, nobody left to wait for */
        conn_close(c);
        return;
    }
    c->sd.data = c;
    if (uv_shutdown(&c->sd, (uv_stream_t *)&c->tcp, on_shutdown)) conn_close(c);
}

static void on_timeout(uv_timer_t *t);

/* Sends the answer (the body unless head_only; takes body) and moves c to the answered queue,
 * making room there by closing the oldest. */
static void answer(conn *c, int status, const char *type, char *body, size_t len, bool head_only)
{
    moed_http *h = c->h;
    char hdr[384];
    int n = snprintf(hdr, sizeof hdr,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                     "Cache-Control: no-store\r\nConnection: close\r\n%s\r\n",
                     status, reason(status), type, len, extra_headers(status));
    size_t body_len = head_only ? 0 : len;
    free(c->parser);
    c->parser = NULL;
    queue_push(&h->answered, c);
    if (h->answered.n > MAX_ANSWERED) conn_close(queue_oldest(&h->answered));
    c->out = malloc((size_t)n + body_len);
    if (!c->out) {
        free(body);
        conn_close(c);
        return;
    }
    memcpy(c->out, hdr, (size_t)n);
    if (body_len) memcpy(c->out + n, body, body_len);
    free(body);
    uv_buf_t buf = uv_buf_init(c->out, (unsigned)((size_t)n + body_len));
    c->wr.data = c;
    if (uv_write(&c->wr, (uv_stream_t *)&c->tcp, &buf, 1, on_written)) {
        conn_close(c);
        return;
    }
    c->writing = true;
    uv_timer_start(&c->timer, on_timeout, LINGER_MS, 0);
}

/* An error answer with a one-line plain-text body. */
static void refuse(conn *c, int status, const char *why)
{
    size_t n = strlen(why);
    char *body = malloc(n + 1);
    if (body) {
        memcpy(body, why, n);
        body[n] = '\n';
    }
    if (status == 503 || status == 408) c->h->refused++;
    answer(c, status, "text/plain; charset=utf-8", body, body ? n + 1 : 0, false);
}

static void on_timeout(uv_timer_t *t)
{
    conn *c = t->data;
    if (c->in == &c->h->waiting)
        refuse(c, 408, "the request did not arrive in time");
    else
        conn_close(c); /* the linger is over */
}

/* ---- requests -------------------------------------------------------------------------------- */

/* Constant time in the bytes compared: how much of a guess is right must not show. */
static bool authorized(const moed_http *h, const char *auth)
{
    if (!h->token) return true;
    if (!auth || strncasecmp(auth, "Bearer ", 7)) return false;
    auth += 7;
    while (*auth == ' ') auth++;
    size_t n = strlen(auth);
    unsigned char diff = n != h->token_len;
    for (size_t i = 0; i < h->token_len; i++)
        diff |= (unsigned char)(h->token[i] ^ (i < n ? auth[i] : 0));
    return !diff;
}

static void handle(conn *c, const moed_http_request *req)
{
    moed_http_reply r = { .status = 404, .content_type = "text/plain; charset=utf-8" };
    c->h->fn(c->h->arg, req->path, authorized(c->h, req->authorization), &r);
    if (r.status == 404 && !r.body) {
        refuse(c, 404, "not found: this endpoint serves /metrics and /healthz");
        return;
    }
    answer(c, r.status, r.content_type, r.body, r.len, req->head_only);
}

static void on_alloc(uv_handle_t *hd, size_t suggested, uv_buf_t *buf)
{
    conn *c = hd->data;
    *buf = uv_buf_init(c->h->rbuf, sizeof c->h->rbuf);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    conn *c = s->data;
    if (nread == UV_EOF && c->in == &c->h->answered && c->writing) {
        c->peer_closed = true; /* a half-close after the request: the answer still goes out */
        uv_read_stop(s);
        return;
    }
    if (nread < 0) { /* gone: before an answer there is nothing to answer */
        conn_close(c);
        return;
    }
    if (c->in != &c->h->waiting) {
        if ((c->discarded += (size_t)nread) > MAX_DISCARD) conn_close(c);
        return;
    }
    moed_http_request req;
    const char *why = NULL;
    int st = moed_http_parse(c->parser, buf->base, (size_t)nread, &req, &why);
    if (st == MOED_HTTP_DONE)
        handle(c, &req);
    else if (st != MOED_HTTP_MORE)
        refuse(c, st, why);
}

/* ---- admission ------------------------------------------------------------------------------- */

/* The peer's address as the per-peer limit counts it: IPv4 whole, IPv6 by its /64 (one host or
 * one customer usually holds a whole /64). */
static void set_peer(conn *c)
{
    struct sockaddr_storage ss;
    int n = sizeof ss;
    c->peer_len = 0;
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &n)) return;
    if (ss.ss_family == AF_INET) {
        memcpy(c->peer, &((struct sockaddr_in *)&ss)->sin_addr, 4);
        c->peer_len = 4;
    } else if (ss.ss_family == AF_INET6) {
        const unsigned char *a = ((struct sockaddr_in6 *)&ss)->sin6_addr.s6_addr;
        bool v4 = IN6_IS_ADDR_V4MAPPED((const struct in6_addr *)a);
        memcpy(c->peer, v4 ? a + 12 : a, v4 ? 4 : 8);
        c->peer_len = v4 ? 4 : 8;
    }
}

static bool same_peer(const conn *a, const conn *b)
{
    return a->peer_len == b->peer_len && !memcmp(a->peer, b->peer, a->peer_len);
}

/* The oldest waiting connection (from c's peer, if peer) that has waited EVICT_AGE_MS, or NULL. */
static conn *oldest_evictable(moed_http *h, const conn *c, bool peer)
{
    uint64_t now = uv_now(h->loop);
    moed_list *q;
    moed_list_foreach (q, &h->waiting.conns) {
        conn *w = moed_list_data(q, conn, node);
        if (peer && !same_peer(w, c)) continue;
        return now - w->since >= EVICT_AGE_MS ? w : NULL; /* the queue is oldest first */
    }
    return NULL;
}

/* Whether c may wait for its request: room under both limits, made if need be by answering the
 * oldest waiting connection 503. */
static bool admit(moed_http *h, conn *c)
{
    int same = 0;
    moed_list *q;
    moed_list_foreach (q, &h->waiting.conns) same += same_peer(moed_list_data(q, conn, node), c);
    bool peer_full = same >= MAX_PER_PEER;
    if (!peer_full && h->waiting.n < MAX_WAITING) return true;
    conn *victim = oldest_evictable(h, c, peer_full);
    if (!victim) return false;
    refuse(victim, 503,
           "too many connections to the metrics endpoint: this one waited longest for its "
           "request; try again");
    return true;
}

static void on_connection(uv_stream_t *server, int status)
{
    moed_http *h = server->data;
    if (status < 0 || h->closing) return;
    conn *c = calloc(1, sizeof *c);
    if (!c) {
        moed_log_error("out of memory", "what=\"a metrics connection\"");
        return; /* the pending connection waits in the backlog until memory allows */
    }
    c->h = h;
    h->refs++;
    uv_tcp_init(h->loop, &c->tcp);
    uv_timer_init(h->loop, &c->timer);
    c->handles = 2;
    c->tcp.data = c->timer.data = c;
    c->since = uv_now(h->loop);
    if (uv_accept(server, (uv_stream_t *)&c->tcp) ||
        uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read)) {
        conn_close(c);
        return;
    }
    set_peer(c);
    if (!admit(h, c)) {
        refuse(c, 503, "too many connections to the metrics endpoint; try again");
        return;
    }
    if (!(c->parser = calloc(1, sizeof *c->parser))) {
        refuse(c, 503, "out of memory; try again");
        return;
    }
    queue_push(&h->waiting, c);
    uv_timer_start(&c->timer, on_timeout, HEAD_TIMEOUT_MS, 0);
}

/* ---- the listener ---------------------------------------------------------------------------- */

/* "host:port", "[v6]:port", "localhost:port" or ":port" (every interface) into a socket address. */
static int parse_listen(const char *listen, struct sockaddr_storage *ss, moed_error *err)
{
    const char *colon = strrchr(listen, ':');
    char host[64];
    char *end;
    long port = colon ? strtol(colon + 1, &end, 10) : -1;
    size_t hl = colon ? (size_t)(colon - listen) : 0;
    if (!colon || !colon[1] || *end || port < 0 || port > 65535 || hl >= sizeof host) goto bad;
    memcpy(host, listen, hl);
    host[hl] = 0;
    if (!hl || !strcmp(host, "*")) strcpy(host, "0.0.0.0");
    if (!strcmp(host, "localhost")) strcpy(host, "127.0.0.1");
    if (host[0] == '[') {
        if (hl < 3 || host[hl - 1] != ']') goto bad;
        host[hl - 1] = 0;
        if (uv_ip6_addr(host + 1, (int)port, (struct sockaddr_in6 *)ss)) goto bad;
        return 0;
    }
    if (!uv_ip4_addr(host, (int)port, (struct sockaddr_in *)ss)) return 0;
bad:
    return moed_fail(err, MOED_EINVAL,
                     "--metrics-listen '%s' is not an address to listen on: give host:port with a "
                     "numeric IPv4 host, [IPv6], localhost or nothing (every interface), e.g. "
                     "127.0.0.1:8464",
                     listen);
}

/* The token: the file's first line without its blanks; printable ASCII, no spaces. */
static int load_token(moed_http *h, const char *path, moed_error *err)
{
    char *text;
    size_t len;
    int rc = moed_file_read(path, "--metrics-token-file", MAX_TOKEN, &text, &len, err);
    if (rc) return rc == MOED_ENOMEM ? rc : MOED_EIO;
    char *p = text, *end = text + strcspn(text, "\r\n");
    while (p < end && (*p == ' ' || *p == '\t')) p++;
    while (end > p && (end[-1] == ' ' || end[-1] == '\t')) end--;
    *end = 0;
    for (char *q = p; q < end && !rc; q++)
        if (*q <= ' ' || *q >= 0x7f)
            rc = moed_fail(err, MOED_EINVAL,
                           "--metrics-token-file %s: the token has a space or a non-printable byte "
                           "at offset %td; put the bare token on the first line",
                           path, q - p);
    if (!rc && p == end)
        rc = moed_fail(err, MOED_EINVAL,
                       "--metrics-token-file %s has no token on its first line (e.g. from "
                       "`openssl rand -hex 32`)",
                       path);
    if (!rc && !(h->token = strdup(p))) rc = moed_fail(err, MOED_ENOMEM, "no memory for the token");
    h->token_len = h->token ? (size_t)(end - p) : 0;
    memset(text, 0, len);
    free(text);
    return rc;
}

static void set_address(moed_http *h)
{
    struct sockaddr_storage ss;
    int n = sizeof ss;
    char ip[64] = "?";
    uv_tcp_getsockname(&h->server, (struct sockaddr *)&ss, &n);
    if (ss.ss_family == AF_INET6) {
        uv_ip6_name((struct sockaddr_in6 *)&ss, ip, sizeof ip);
        snprintf(h->address, sizeof h->address, "[%s]:%d", ip,
                 ntohs(((struct sockaddr_in6 *)&ss)->sin6_port));
    } else {
        uv_ip4_name((struct sockaddr_in *)&ss, ip, sizeof ip);
        snprintf(h->address, sizeof h->address, "%s:%d", ip,
                 ntohs(((struct sockaddr_in *)&ss)->sin_port));
    }
}

static void on_server_closed(uv_handle_t *hd)
{
    http_unref(hd->data);
}

int moed_http_start(uv_loop_t *loop, const moed_http_config *cfg, moed_http_handler fn, void *arg,
                    moed_http **out, moed_error *err)
{
    *out = NULL;
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    int rc = parse_listen(cfg->listen, &ss, err);
    if (rc) return rc;
    moed_http *h = calloc(1, sizeof *h);
    if (!h) return moed_fail(err, MOED_ENOMEM, "no memory for the metrics endpoint");
    h->loop = loop;
    h->fn = fn;
    h->arg = arg;
    h->refs = 1;
    moed_list_init(&h->waiting.conns);
    moed_list_init(&h->answered.conns);
    if (cfg->token_file && (rc = load_token(h, cfg->token_file, err))) {
        free(h);
        return rc;
    }
    uv_tcp_init(loop, &h->server);
    h->server.data = h;
    int e = uv_tcp_bind(&h->server, (const struct sockaddr *)&ss, 0);
    if (!e) e = uv_listen((uv_stream_t *)&h->server, 128, on_connection);
    if (e) {
        moed_http_close(h);
        return moed_fail(err, MOED_EIO,
                         "cannot listen on --metrics-listen %s: %s; choose another address",
                         cfg->listen, uv_strerror(e));
    }
    set_address(h);
    *out = h;
    return 0;
}

const char *moed_http_address(const moed_http *h)
{
    return h->address;
}

void moed_http_get_stats(const moed_http *h, moed_http_stats *out)
{
    out->open = (uint64_t)(h->waiting.n + h->answered.n);
    out->refused = h->refused;
}

void moed_http_close(moed_http *h)
{
    if (!h || h->closing) return;
    h->closing = true;
    conn *c;
    while ((c = queue_oldest(&h->waiting))) conn_close(c);
    while ((c = queue_oldest(&h->answered))) conn_close(c);
    uv_close((uv_handle_t *)&h->server, on_server_closed);
}
