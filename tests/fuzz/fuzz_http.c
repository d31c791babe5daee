/*
 * fuzz_http — libFuzzer target over the metrics endpoint's request parser (server/http_parse.c),
 * the code every byte a peer sends to --metrics-listen goes through before anything else.
 *
 * Why a differential oracle: the parser takes the bytes as the socket delivers them, and the one
 * hard part is a head split at arbitrary points (a blank line straddling two reads), so every
 * input is parsed twice — whole, and cut into pieces (1-byte pieces, random cuts, empty pieces)
 * — and both must agree on the outcome and on every field. What an accepted request promises is
 * checked too: a path starting with '/' of visible ASCII without query or fragment, an
 * Authorization value without control characters or surrounding blanks; a refusal is 400, 405 or
 * 431 with a reason; and a head without a blank line in its first 8 KiB is never accepted.
 */
#include "http_parse.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char *why)
{
    fprintf(stderr, "fuzz_http: %s\n", why);
    abort();
}

static uint64_t rng_next(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct outcome {
    int st;
    moed_http_request req;
    const char *why;
} outcome;

/* Feeds data in pieces whose sizes follow from the bytes (a crash reproduces from its input),
 * mode 0: all at once; 1: one byte at a time; 2: random cuts with empty pieces between. */
static void parse(moed_http_parser *p, const uint8_t *data, size_t n, int mode, outcome *o)
{
    uint64_t s = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) s = (s ^ data[i]) * 1099511628211ull;
    memset(p, 0, sizeof *p);
    memset(o, 0, sizeof *o);
    size_t at = 0;
    do {
        size_t len = mode == 0 ? n - at : mode == 1 ? 1 : (size_t)(rng_next(&s) % 64);
        if (len > n - at) len = n - at;
        o->st = moed_http_parse(p, (const char *)data + at, len, &o->req, &o->why);
        at += len;
    } while (o->st == MOED_HTTP_MORE && at < n);
}

static void same_string(const char *a, const char *b, const char *what)
{
    if (!a != !b || (a && strcmp(a, b))) die(what);
}

static bool has_blank_line(const uint8_t *d, size_t n)
{
    for (size_t i = 0; i + 1 < n; i++)
        if (d[i] == '\n' &&
            (d[i + 1] == '\n' || (d[i + 1] == '\r' && i + 2 < n && d[i + 2] == '\n')))
            return true;
    return false;
}

static void check(const outcome *o, const uint8_t *data, size_t n)
{
    size_t head = n < MOED_HTTP_MAX_HEAD ? n : MOED_HTTP_MAX_HEAD;
    if (o->st == MOED_HTTP_DONE) {
        const char *p = o->req.path;
        if (!has_blank_line(data, head)) die("accepted a head without its blank line");
        if (!p || p[0] != '/') die("accepted a path not starting with /");
        for (; *p; p++)
            if ((unsigned char)*p <= 0x20 || (unsigned char)*p >= 0x7f || *p == '?' || *p == '#')
                die("accepted a path with a blank, control, non-ASCII, ? or # byte");
        const char *a = o->req.authorization;
        if (a) {
            size_t len = strlen(a);
            if (len && (a[0] == ' ' || a[0] == '\t' || a[len - 1] == ' ' || a[len - 1] == '\t'))
                die("authorization keeps surrounding blanks");
            for (; *a; a++)
                if (((unsigned char)*a < 0x20 && *a != '\t') || *a == 0x7f)
                    die("authorization with a control character");
        }
    } else if (o->st == MOED_HTTP_MORE) {
        if (n >= MOED_HTTP_MAX_HEAD || has_blank_line(data, head)) die("still waiting for more");
    } else if ((o->st != 400 && o->st != 405 && o->st != 431) || !o->why || !*o->why) {
        die("refused with an unexpected status or no reason");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static moed_http_parser p[3];
    outcome o[3];
    for (int mode = 0; mode < 3; mode++) parse(&p[mode], data, size, mode, &o[mode]);
    check(&o[0], data, size);
    for (int mode = 1; mode < 3; mode++) {
        if (o[mode].st != o[0].st) die("pieces change the outcome");
        if (o[0].st == MOED_HTTP_DONE) {
            same_string(o[mode].req.path, o[0].req.path, "pieces change the path");
            same_string(o[mode].req.authorization, o[0].req.authorization,
                        "pieces change the authorization");
            if (o[mode].req.head_only != o[0].req.head_only) die("pieces change the method");
        } else if (o[0].st != MOED_HTTP_MORE) {
            same_string(o[mode].why, o[0].why, "pieces change the reason");
        }
    }
    return 0;
}
