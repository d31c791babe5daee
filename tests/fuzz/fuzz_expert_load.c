/*
 * fuzz_expert_load — libFuzzer target over --expert-load's parser (server/expert_load.c:
 * moed_expert_load_parse), which reads a file an operator scraped from /metrics and may have
 * edited, concatenated or cut short.
 *
 * What an accepted file must promise: entries sorted by (layer, expert) with no two alike, ids
 * from 0 to MOED_EXPERT_LOAD_MAX_ID, values finite and >= 0, each from a line the file has; and
 * moed_expert_load_layer gives back exactly those values for a layer. A refusal is MOED_EINVAL
 * (or MOED_ENOMEM) with a message that names a line the file has and holds printable ASCII only
 * (what it quotes of the file is sanitized). Line ends must not matter: the same input with every
 * LF made CRLF (when it has no CR of its own) gives the same outcome, entries and message.
 */
#include "expert_load.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char *why)
{
    fprintf(stderr, "fuzz_expert_load: %s\n", why);
    abort();
}

static int lines_of(const uint8_t *d, size_t n)
{
    int lines = 1;
    for (size_t i = 0; i < n; i++) lines += d[i] == '\n';
    return lines;
}

static void check_accepted(const moed_expert_load *l, int lines)
{
    for (int i = 0; i < l->n; i++) {
        const moed_expert_load_entry *e = &l->v[i];
        if (e->layer < 0 || e->layer > MOED_EXPERT_LOAD_MAX_ID || e->expert < 0 ||
            e->expert > MOED_EXPERT_LOAD_MAX_ID)
            die("an id out of range");
        if (!isfinite(e->tokens) || e->tokens < 0 || signbit(e->tokens)) die("a bad value");
        if (e->line < 1 || e->line > lines) die("a line the file does not have");
        if (i && (l->v[i - 1].layer > e->layer ||
                  (l->v[i - 1].layer == e->layer && l->v[i - 1].expert >= e->expert)))
            die("entries unsorted or repeated");
    }
    if (!l->n) return;
    /* The first layer's values, as the daemon takes them. */
    int layer = l->v[0].layer, top = 0, count = 0;
    for (int i = 0; i < l->n && l->v[i].layer == layer; i++) top = l->v[i].expert, count++;
    double *v;
    int named;
    moed_error err;
    if (moed_expert_load_layer(l, layer, top + 1, NULL, 0, &v, &named, &err)) {
        if (err.code != MOED_ENOMEM) die("a layer of the file refused");
        return;
    }
    if (named != count) die("named is not the layer's count");
    double sum = 0;
    for (int i = 0; i < count; i++) sum += l->v[i].tokens;
    if (!v != !(sum > 0)) die("a load given for zeros, or none for counts");
    for (int i = 0; v && i < count; i++)
        if (v[l->v[i].expert] != l->v[i].tokens) die("moed_expert_load_layer changed a value");
    free(v);
    if (moed_expert_load_layer(l, layer, top, NULL, 0, &v, &named, &err) != MOED_EINVAL || v)
        die("an expert out of the layer's range accepted");
}

static void check_refused(int rc, const moed_error *err, int lines)
{
    if (rc != MOED_EINVAL && rc != MOED_ENOMEM) die("refused with an unexpected code");
    if (rc == MOED_ENOMEM) return;
    if (strncmp(err->msg, "fuzz line ", 10)) die("a refusal that names no line");
    int line = atoi(err->msg + 10);
    if (line < 1 || line > lines) die("a refusal naming a line the file does not have");
    for (const char *p = err->msg; *p; p++)
        if ((unsigned char)*p < 0x20 || (unsigned char)*p >= 0x7f)
            die("a message with a byte that is not printable ASCII");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    moed_expert_load l, c;
    moed_error err = { 0 }, cerr = { 0 };
    const int lines = lines_of(data, size);
    int rc = moed_expert_load_parse((const char *)data, size, "fuzz", &l, &err);
    if (rc)
        check_refused(rc, &err, lines);
    else
        check_accepted(&l, lines);
    /* The same with CRLF line ends. */
    if (!memchr(data, '\r', size)) {
        char *crlf = malloc(2 * size + 1);
        size_t n = 0;
        if (!crlf) goto out;
        for (size_t i = 0; i < size; i++) {
            if (data[i] == '\n') crlf[n++] = '\r';
            crlf[n++] = (char)data[i];
        }
        int rc2 = moed_expert_load_parse(crlf, n, "fuzz", &c, &cerr);
        if (rc != MOED_ENOMEM && rc2 != MOED_ENOMEM) {
            if (rc2 != rc) die("CRLF changes the outcome");
            if (rc && strcmp(err.msg, cerr.msg)) die("CRLF changes the message");
            if (!rc && c.n != l.n) die("CRLF changes the entries");
            for (int i = 0; !rc && i < l.n; i++)
                if (c.v[i].layer != l.v[i].layer || c.v[i].expert != l.v[i].expert ||
                    c.v[i].line != l.v[i].line || c.v[i].tokens != l.v[i].tokens)
                    die("CRLF changes the entries");
        }
        moed_expert_load_free(&c);
        free(crlf);
    }
out:
    moed_expert_load_free(&l);
    return 0;
}
