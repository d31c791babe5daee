/*
 * moed_http — a small read-only HTTP/1.1 server on a libuv loop, for /metrics and /healthz.
 *
 * It answers GET and HEAD, one request per connection (Connection: close), from a handler the
 * caller gives; http_parse.h says what it accepts and what it refuses (400, 405, 431). What one
 * peer can cost it is bounded, and a connection it cannot serve is answered, never reset:
 *
 *   - at most 256 connections waiting for their request, at most 32 of them from one address
 *     (an IPv6 peer counts by its /64); a new connection over a limit takes the place of the
 *     oldest waiting one (from that address, or from any) that has waited 250 ms or more, which
 *     is answered 503; with none that old, the new connection is answered 503 itself;
 *   - the whole request head within 5 s (a slow client gets 408), and at most 8 KiB of it;
 *   - after the answer the server keeps reading, so a client's close is seen at once, and waits at
 *     most 2 s for it; at most 64 answered connections wait so (the oldest is closed first).
 *
 * So an unauthenticated peer holds at most 32 connections (about 9 KiB each while waiting: the
 * 8 KiB head buffer and libuv's handles), a flood from many peers at most 256 waiting and 64
 * answered ones (under 3 MiB with their answers in flight), and every connection is
 * accepted and answered. With a token (cfg.token_file), the handler is told whether the request
 * carried `Authorization: Bearer <token>` (compared in constant time); a 401 answer gets
 * `WWW-Authenticate: Bearer`. Everything runs on the loop's thread.
 */
#ifndef MOED_HTTP_H
#define MOED_HTTP_H

#include "moed_err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

typedef struct moed_http moed_http;

typedef struct moed_http_config {
    const char *listen;     /* host:port (IPv4, [IPv6] or localhost; port 0 picks a free one) */
    const char *token_file; /* NULL, or a file whose first line is the bearer token */
} moed_http_config;

/* What the handler answers: a status, a content type and a malloc'd body the server frees. */
typedef struct moed_http_reply {
    int status;
    const char *content_type;
    char *body;
    size_t len;
} moed_http_reply;

/* Called on the loop's thread for each well-formed GET or HEAD; path has no query string.
 * authorized: no token is configured, or the request carried it. */
typedef void (*moed_http_handler)(void *arg, const char *path, bool authorized,
                                  moed_http_reply *out);

/* Reads the token, parses the address, binds and listens. MOED_EINVAL for an address it cannot
 * parse or a token file without a token, MOED_EIO naming the address when it cannot bind (or the
 * token file when it cannot read it). */
int moed_http_start(uv_loop_t *loop, const moed_http_config *cfg, moed_http_handler fn, void *arg,
                    moed_http **out, moed_error *err);

/* The address bound, with the port chosen ("127.0.0.1:8464"). */
const char *moed_http_address(const moed_http *h);

typedef struct moed_http_stats {
    uint64_t open;    /* connections open now: waiting for their request, or answered */
    uint64_t refused; /* connections answered 503 (over a limit) or 408 (too slow), in all */
} moed_http_stats;

void moed_http_get_stats(const moed_http *h, moed_http_stats *out);

/* Closes the listener and every connection; the memory goes once libuv has closed them. */
void moed_http_close(moed_http *h);

#endif
