/*
 * moed_http — a small read-only HTTP/1.1 server on a libuv loop, for /metrics and /healthz.
 *
 * It answers GET and HEAD, one request per connection (Connection: close), from a handler that
 * the caller gives. Anything else is refused with a status and the connection closed: a
 * malformed request line or header gets 400, a request head over 8 KiB 431, a method other than
 * GET or HEAD 405, a request with a body 400, and a client that does not finish its request in
 * 10 s is cut off. At most 64 connections are open at once; more are closed on accept. All of it
 * runs on the loop's thread.
 */
#ifndef MOED_HTTP_H
#define MOED_HTTP_H

#include "moed_err.h"

#include <stddef.h>
#include <uv.h>

typedef struct moed_http moed_http;

/* What the handler answers: a status, a content type and a malloc'd body the server frees. */
typedef struct moed_http_reply {
    int status;
    const char *content_type;
    char *body;
    size_t len;
} moed_http_reply;

/* Called on the loop's thread for each well-formed GET or HEAD; path has no query string. */
typedef void (*moed_http_handler)(void *arg, const char *path, moed_http_reply *out);

/* Parses "host:port" (IPv4, [IPv6] or localhost; port 0 picks a free one), binds and listens.
 * MOED_EINVAL for an address it cannot parse, MOED_EIO naming the address when it cannot bind. */
int moed_http_start(uv_loop_t *loop, const char *listen, moed_http_handler fn, void *arg,
                    moed_http **out, moed_error *err);

/* The address bound, with the port chosen ("127.0.0.1:9400"). */
const char *moed_http_address(const moed_http *h);

/* Closes the listener and every connection; the memory goes once libuv has closed them. */
void moed_http_close(moed_http *h);

#endif
