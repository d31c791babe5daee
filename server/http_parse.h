/*
 * moed_http_parse — the metrics endpoint's HTTP/1.x request-head parser, apart from the sockets so
 * that the fuzzer drives it exactly as the server does (tests/fuzz/fuzz_http.c).
 *
 * It takes bytes as they arrive, in pieces of any size, and keeps at most MOED_HTTP_MAX_HEAD of
 * them. It accepts only what a read-only endpoint needs and refuses the rest with a status: a
 * request line `GET|HEAD /path HTTP/1.0|1.1` (another method: 405), header lines `Name: value`
 * with a token name and a value free of control characters but HTAB, lines ended by CRLF or LF,
 * no folded lines, no body (Transfer-Encoding, or a non-zero Content-Length: 400), at most one
 * Authorization header, and a head over MOED_HTTP_MAX_HEAD bytes (431). Bytes after the head are
 * ignored (one request per connection).
 */
#ifndef MOED_HTTP_PARSE_H
#define MOED_HTTP_PARSE_H

#include <stdbool.h>
#include <stddef.h>

#define MOED_HTTP_MAX_HEAD 8192

typedef struct moed_http_request {
    bool head_only;            /* HEAD: the answer has no body */
    const char *path;          /* the target without its query or fragment; starts with '/' */
    const char *authorization; /* the Authorization header's value (blanks trimmed), or NULL */
} moed_http_request;

typedef struct moed_http_parser {
    size_t len;                       /* bytes kept */
    size_t scanned;                   /* of them, searched for the blank line */
    char buf[MOED_HTTP_MAX_HEAD + 1]; /* the head, NUL-terminated once parsed */
} moed_http_parser;

enum { MOED_HTTP_MORE = 0, MOED_HTTP_DONE = 1 };

/* p must start zeroed. Takes the next n bytes of the connection: MOED_HTTP_MORE until the head's
 * blank line has come; then MOED_HTTP_DONE with *req filled (its strings point into p), or an HTTP
 * status (400, 405, 431) with *why, a sentence for the person who sent it. Nothing may be fed
 * after DONE or a status. */
int moed_http_parse(moed_http_parser *p, const char *data, size_t n, moed_http_request *req,
                    const char **why);

#endif
