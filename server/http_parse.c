/*
 * moed_http_parse — a strict request-head parser (http_parse.h).
 *
 * Why strict: the endpoint is scraped by tools that send a plain GET, so anything it does not
 * fully understand is refused rather than guessed at; a parser that guesses is where request
 * smuggling and header confusion live. Why bytes are copied in rather than parsed in place: the
 * head must be whole before it is parsed (a blank line may straddle two reads), and 8 KiB is a
 * bound the server can afford per connection.
 */
#include "http_parse.h"

#include <ctype.h>
#include <string.h>
#include <strings.h>

static bool is_tchar(int ch)
{
    return isalnum(ch) || (ch && strchr("!#$%&'*+-.^_`|~", ch));
}

/* One header line (NUL-terminated): a token, a colon, a value without control characters (HTAB
 * allowed). Only the headers that announce a body (refused) and Authorization matter. */
static int parse_header(char *line, moed_http_request *req, const char **why)
{
    char *colon = line;
    while (is_tchar((unsigned char)*colon)) colon++;
    if (colon == line || *colon != ':') {
        *why = "malformed header line (expected `Name: value`)";
        return 400;
    }
    *colon = 0;
    char *v = colon + 1, *end = v + strlen(v);
    for (char *p = v; p < end; p++)
        if (((unsigned char)*p < 0x20 && *p != '\t') || *p == 0x7f) {
            *why = "control character in a header value";
            return 400;
        }
    while (*v == ' ' || *v == '\t') v++;
    while (end > v && (end[-1] == ' ' || end[-1] == '\t')) *--end = 0;
    if (!strcasecmp(line, "transfer-encoding") ||
        (!strcasecmp(line, "content-length") && (!*v || strspn(v, "0") != strlen(v)))) {
        *why = "this endpoint is read-only: requests with a body are not accepted";
        return 400;
    }
    if (!strcasecmp(line, "authorization")) {
        if (req->authorization) {
            *why = "more than one Authorization header";
            return 400;
        }
        req->authorization = v;
    }
    return 0;
}

/* The request line (NUL-terminated): method, target and version. */
static int parse_request_line(char *line, moed_http_request *req, const char **why)
{
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
    req->head_only = !strcmp(line, "HEAD");
    if (strcmp(line, "GET") && !req->head_only) {
        *why = "this endpoint is read-only: use GET or HEAD";
        return 405;
    }
    target[strcspn(target, "?#")] = 0;
    req->path = target;
    return 0;
}

/* The whole head (NUL-terminated, ending in its blank line). The method is checked after the
 * headers, so a malformed head is a 400 whatever its method. */
static int parse_head(char *head, moed_http_request *req, const char **why)
{
    char *line = head, *eol = strchr(line, '\n');
    *eol = 0;
    if (eol > line && eol[-1] == '\r') eol[-1] = 0;
    char *request_line = line;
    for (line = eol + 1; (eol = strchr(line, '\n')); line = eol + 1) {
        *eol = 0;
        if (eol > line && eol[-1] == '\r') eol[-1] = 0;
        if (!*line) break;
        if (*line == ' ' || *line == '\t') {
            *why = "folded header lines are not accepted";
            return 400;
        }
        int st = parse_header(line, req, why);
        if (st) return st;
    }
    return parse_request_line(request_line, req, why);
}

/* Where the head ends (just past its blank line) in buf[0..len), searching from `from`; 0 if it
 * has not all arrived. */
static size_t head_end(const char *buf, size_t from, size_t len)
{
    for (size_t i = from; i + 1 < len; i++)
        if (buf[i] == '\n') {
            if (buf[i + 1] == '\n') return i + 2;
            if (buf[i + 1] == '\r' && i + 2 < len && buf[i + 2] == '\n') return i + 3;
        }
    return 0;
}

int moed_http_parse(moed_http_parser *p, const char *data, size_t n, moed_http_request *req,
                    const char **why)
{
    size_t take = n < MOED_HTTP_MAX_HEAD - p->len ? n : MOED_HTTP_MAX_HEAD - p->len;
    memcpy(p->buf + p->len, data, take);
    p->len += take;
    size_t end = head_end(p->buf, p->scanned, p->len);
    /* A blank line may straddle two pieces: the next search starts two bytes back. */
    p->scanned = p->len > 2 ? p->len - 2 : 0;
    if (!end) {
        if (p->len < MOED_HTTP_MAX_HEAD) return MOED_HTTP_MORE;
        *why = "the request head is over 8 KiB";
        return 431;
    }
    if (memchr(p->buf, 0, end)) {
        *why = "NUL byte in the request";
        return 400;
    }
    p->buf[end] = 0;
    memset(req, 0, sizeof *req);
    int st = parse_head(p->buf, req, why);
    return st ? st : MOED_HTTP_DONE;
}
