/*
 * moed_http — the metrics endpoint's HTTP server, on the daemon's libuv loop.
 *
 * Why on the loop and not a thread of its own: scrapes come every few seconds and rendering is a
 * few microseconds of summing atomics, so the loop (otherwise idle but for signals and timers)
 * has time to spare; libuv gives non-blocking sockets, and every connection is bounded in bytes
 * (8 KiB of request head), time (10 s to send it) and number (64), so no client can hold the loop
 * or grow memory. Why so little HTTP: the endpoint is read-only and scraped by tools that send a
 * plain GET, so one request per connection, no bodies, no keep-alive, and a strict parser that
 * refuses (400) anything it does not fully understand.
 *
 * A connection's life: read until the blank line that ends the request head, parse, answer with
 * one write, shut the write side down, then read and discard until the client closes (so unread
 * bytes never turn the close into a reset that could eat the answer), bounded by a short linger.
 */
#include "http.h"

#include "log.h"

#include <ctype.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_HEAD           8192
#define MAX_CONNS          64
#define REQUEST_TIMEOUT_MS 10000
#define LINGER_MS          2000

typedef struct conn conn;

struct moed_http {
    uv_loop_t *loop;
    uv_tcp_t server;
    moed_http_handler fn;
    void *arg;
    char address[80];
    conn *conns;
    int n_conns;
    int refs; /* the listener and each connection: freed when all are closed */
    bool closing;
};

struct conn {
    moed_http *h;
    conn *prev, *next;
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_write_t wr;
    uv_shutdown_t sd;
    int handles; /* open libuv handles (tcp, timer) */
    bool answered, closing;
    char *out; /* the answer being written */
    size_t len;
    char head[MAX_HEAD + 1];
    char discard[512];
};

/* ---- connections ----------------------------------------------------------------------------- */

static void http_unref(moed_http *h)
{
    if (--h->refs == 0) free(h);
}

static void on_conn_closed(uv_handle_t *hd)
{
    conn *c = hd->data;
    if (--c->handles) return;
    moed_http *h = c->h;
    if (c->prev)
        c->prev->next = c->next;
    else
        h->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    h->n_conns--;
    free(c->out);
    free(c);
    http_unref(h);
}

static void conn_close(conn *c)
{
    if (c->closing) return;
    c->closing = true;
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
    uv_close((uv_handle_t *)&c->timer, on_conn_closed);
}

static const char *reason(int status)
{
    switch (status) {
    case 200:
        return "OK";
    case 400:
        return "Bad Request";
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

static void on_shutdown(uv_shutdown_t *sd, int status)
{
    if (status < 0) conn_close(sd->data);
}

static void on_written(uv_write_t *wr, int status)
{
    conn *c = wr->data;
    free(c->out);
    c->out = NULL;
    if (status < 0 || c->closing) {
        conn_close(c);
        return;
    }
    c->sd.data = c;
    if (uv_shutdown(&c->sd, (uv_stream_t *)&c->tcp, on_shutdown)) conn_close(c);
}

static void on_timeout(uv_timer_t *t);

/* Sends the answer: the head, then the body unless the request was HEAD. Takes body. */
static void answer(conn *c, int status, const char *type, char *body, size_t len, bool head_only)
{
    char hdr[320];
    int n =
        snprintf(hdr, sizeof hdr,
                 "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                 "Cache-Control: no-store\r\nConnection: close\r\n%s\r\n",
                 status, reason(status), type, len, status == 405 ? "Allow: GET, HEAD\r\n" : "");
    size_t body_len = head_only ? 0 : len;
    c->answered = true;
    uv_read_stop((uv_stream_t *)&c->tcp);
    c->out = malloc((size_t)n + body_len);
    if (!c->out) {
        free(body);
        conn_close(c);
        return;
    }
    memcpy(c->out, hdr, (size_t)n);
    if (body_len) memcpy(c->out + n, body, body_len);
    free(body);
    c->len = (size_t)n + body_len;
    uv_buf_t buf = uv_buf_init(c->out, (unsigned)c->len);
    c->wr.data = c;
    if (uv_write(&c->wr, (uv_stream_t *)&c->tcp, &buf, 1, on_written)) {
        conn_close(c);
        return;
    }
    uv_timer_start(&c->timer, on_timeout, LINGER_MS, 0);
}

/* An error answer with a one-line plain-text body. */
static void refuse(conn *c, int status, const char *why)
{
    char *body = NULL;
    int n = why ? (int)strlen(why) : 0;
    if (why && (body = malloc((size_t)n + 1))) {
        memcpy(body, why, (size_t)n);
        body[n] = '\n';
    }
    answer(c, status, "text/plain; charset=utf-8", body, body ? (size_t)n + 1 : 0, false);
}

static void on_timeout(uv_timer_t *t)
{
    conn *c = t->data;
    if (c->answered)
        conn_close(c); /* the linger is over */
    else
        refuse(c, 408, "the request did not arrive in time");
}

/* ---- parsing --------------------------------------------------------------------------------- */

static bool is_tchar(int ch)
{
    return isalnum(ch) || (ch && strchr("!#$%&'*+-.^_`|~", ch));
}

/* One header line: a token, a colon, a value without control characters (HTAB allowed). The
 * only headers that change anything are those announcing a body, which this server refuses. */
static int parse_header(char *line, const char **why)
{
    char *colon = line;
    while (is_tchar((unsigned char)*colon)) colon++;
    if (colon == line || *colon != ':') {
        *why = "malformed header line (expected `Name: value`)";
        return 400;
    }
    *colon = 0;
    char *v = colon + 1;
    for (char *p = v; *p; p++)
        if (((unsigned char)*p < 0x20 && *p != '\t') || *p == 0x7f) {
            *why = "control character in a header value";
            return 400;
        }
    while (*v == ' ' || *v == '\t') v++;
    if (!strcasecmp(line, "transfer-encoding") ||
        (!strcasecmp(line, "content-length") && strspn(v, "0") != strcspn(v, " \t"))) {
        *why = "this endpoint is read-only: requests with a body are not accepted";
        return 400;
    }
    return 0;
}

/* Parses the request head (NUL-terminated, lines ended by LF or CRLF): 0 with *method and *path
 * set (path cut at its query), or an HTTP status with *why. */
static int parse_request(char *head, bool *is_head, char **path, const char **why)
{
    char *line = head, *eol = strchr(line, '\n');
    if (!eol) {
        *why = "no request line";
        return 400;
    }
    *eol = 0;
    if (eol > line && eol[-1] == '\r') eol[-1] = 0;
    char *sp1 = strchr(line, ' '), *sp2 = sp1 ? strchr(sp1 + 1, ' ') : NULL;
    if (!sp1 || !sp2 || strchr(sp2 + 1, ' ')) {
        *why = "malformed request line (expected `METHOD /path HTTP/1.1`)";
        return 400;
    }
    *sp1 = *sp2 = 0;
    char *target = sp1 + 1, *version = sp2 + 1;
    size_t mlen = strlen(line);
    if (!mlen || mlen > 16 || strspn(line, "ABCDEFGHIJKLMNOPQRSTUVWXYZ") != mlen) {
        *why = "malformed request method";
        return 400;
    }
    if (strcmp(version, "HTTP/1.1") && strcmp(version, "HTTP/1.0")) {
        *why = "unsupported HTTP version (HTTP/1.0 and HTTP/1.1 are served)";
        return 400;
    }
    if (target[0] != '/') {
        *why = "the request target must be a path starting with /";
        return 400;
    }
    for (char *p = target; *p; p++)
        if ((unsigned char)*p <= 0x20 || (unsigned char)*p >= 0x7f) {
            *why = "invalid character in the request target";
            return 400;
        }
    for (line = eol + 1; *line; line = eol + 1) {
        if (!(eol = strchr(line, '\n'))) break; /* cannot happen: the head ends with a blank line */
        *eol = 0;
        if (eol > line && eol[-1] == '\r') eol[-1] = 0;
        if (!*line) break;
        if (*line == ' ' || *line == '\t') {
            *why = "folded header lines are not accepted";
            return 400;
        }
        int st = parse_header(line, why);
        if (st) return st;
    }
    *is_head = !strcmp(head, "HEAD");
    if (strcmp(head, "GET") && !*is_head) {
        *why = "this endpoint is read-only: use GET or HEAD";
        return 405;
    }
    target[strcspn(target, "?#")] = 0;
    *path = target;
    return 0;
}

/* The end of the request head (just past its blank line), or NULL if it has not all arrived. */
static char *head_end(char *p, size_t n)
{
    for (size_t i = 0; i + 1 < n; i++)
        if (p[i] == '\n' &&
            (p[i + 1] == '\n' || (p[i + 1] == '\r' && i + 2 < n && p[i + 2] == '\n')))
            return p + i + (p[i + 1] == '\n' ? 2 : 3);
    return NULL;
}

static void handle(conn *c, char *end)
{
    if (memchr(c->head, 0, (size_t)(end - c->head))) {
        refuse(c, 400, "NUL byte in the request");
        return;
    }
    *end = 0;
    bool is_head = false;
    char *path = NULL;
    const char *why = NULL;
    int st = parse_request(c->head, &is_head, &path, &why);
    if (st) {
        refuse(c, st, why);
        return;
    }
    moed_http_reply r = { .status = 404, .content_type = "text/plain; charset=utf-8" };
    c->h->fn(c->h->arg, path, &r);
    if (r.status == 404 && !r.body) {
        refuse(c, 404, "not found: this endpoint serves /metrics and /healthz");
        return;
    }
    answer(c, r.status, r.content_type, r.body, r.len, is_head);
}

static void on_alloc(uv_handle_t *hd, size_t suggested, uv_buf_t *buf)
{
    conn *c = hd->data;
    if (c->answered)
        *buf = uv_buf_init(c->discard, sizeof c->discard);
    else
        *buf = uv_buf_init(c->head + c->len, (unsigned)(MAX_HEAD - c->len));
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    conn *c = s->data;
    if (nread < 0) {
        conn_close(c); /* EOF or error: before an answer there is nothing to answer */
        return;
    }
    if (c->answered || !nread) return;
    size_t from = c->len > 3 ? c->len - 3 : 0; /* a blank line may straddle two reads */
    c->len += (size_t)nread;
    char *end = head_end(c->head + from, c->len - from);
    if (end)
        handle(c, end);
    else if (c->len == MAX_HEAD)
        refuse(c, 431, "the request head is over 8 KiB");
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
    c->next = h->conns;
    if (h->conns) h->conns->prev = c;
    h->conns = c;
    h->n_conns++;
    h->refs++;
    uv_tcp_init(h->loop, &c->tcp);
    uv_timer_init(h->loop, &c->timer);
    c->handles = 2;
    c->tcp.data = c->timer.data = c;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) || h->n_conns > MAX_CONNS) {
        conn_close(c);
        return;
    }
    uv_timer_start(&c->timer, on_timeout, REQUEST_TIMEOUT_MS, 0);
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read)) conn_close(c);
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
                     "127.0.0.1:9400",
                     listen);
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

int moed_http_start(uv_loop_t *loop, const char *listen, moed_http_handler fn, void *arg,
                    moed_http **out, moed_error *err)
{
    *out = NULL;
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    int rc = parse_listen(listen, &ss, err);
    if (rc) return rc;
    moed_http *h = calloc(1, sizeof *h);
    if (!h) return moed_fail(err, MOED_ENOMEM, "no memory for the metrics endpoint");
    h->loop = loop;
    h->fn = fn;
    h->arg = arg;
    h->refs = 1;
    uv_tcp_init(loop, &h->server);
    h->server.data = h;
    int e = uv_tcp_bind(&h->server, (const struct sockaddr *)&ss, 0);
    if (!e) e = uv_listen((uv_stream_t *)&h->server, 128, on_connection);
    if (e) {
        moed_http_close(h);
        return moed_fail(err, MOED_EIO,
                         "cannot listen on --metrics-listen %s: %s; choose another address", listen,
                         uv_strerror(e));
    }
    set_address(h);
    *out = h;
    return 0;
}

const char *moed_http_address(const moed_http *h)
{
    return h->address;
}

void moed_http_close(moed_http *h)
{
    if (!h || h->closing) return;
    h->closing = true;
    for (conn *c = h->conns; c; c = c->next) conn_close(c);
    uv_close((uv_handle_t *)&h->server, on_server_closed);
}
