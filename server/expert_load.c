/*
 * moed_expert_load — the measured per-expert load of --expert-load FILE: a Prometheus text
 * parser that reads only moed_expert_tokens_total, and its checks against the model
 * (expert_load.h states the contract).
 */
#include "expert_load.h"

#include "file.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define METRIC   "moed_expert_tokens_total"
#define LAUNCHES "moed_batch_tokens_count"

/* A short excerpt of n bytes at p for a message: at most 24 bytes, printable ASCII as it is and
 * any other byte as '?', "..." when cut. */
static const char *excerpt(const char *p, size_t n, char buf[32])
{
    size_t k = n < 24 ? n : 24;
    for (size_t i = 0; i < k; i++) {
        unsigned char c = (unsigned char)p[i];
        buf[i] = c >= 0x20 && c < 0x7f ? (char)c : '?';
    }
    if (n > k)
        memcpy(buf + k, "...", 4);
    else
        buf[k] = 0;
    return buf;
}

static bool blank(char c)
{
    return c == ' ' || c == '\t';
}

static const char *skip_blanks(const char *p, const char *end)
{
    while (p < end && blank(*p)) p++;
    return p;
}

/* How many of the n bytes at p are among `set` (which holds no NUL), from the first. */
static size_t span(const char *p, size_t n, const char *set)
{
    size_t k = 0;
    while (k < n && p[k] && strchr(set, p[k])) k++;
    return k;
}

static size_t name_span(const char *p, const char *end, bool metric)
{
    size_t n = 0;
    for (; p + n < end; n++) {
        char c = p[n];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                  (metric && c == ':') || (n && c >= '0' && c <= '9');
        if (!ok) break;
    }
    return n;
}

/* A label value that must be a decimal number from 0 to MOED_EXPERT_LOAD_MAX_ID: the number, or
 * -1. */
static int decimal_id(const char *p, size_t n)
{
    if (!n || n > 5) return -1;
    int v = 0;
    for (size_t i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9') return -1;
        v = v * 10 + (p[i] - '0');
    }
    return v <= MOED_EXPERT_LOAD_MAX_ID ? v : -1;
}

/* Where a message about line `no` of the file starts. */
#define AT "%s line %d: "

/* The sample's value, n bytes at p: a finite number >= 0 in *v, or MOED_EINVAL saying why not. */
static int sample_value(const char *p, size_t n, const char *what, int no, double *v,
                        moed_error *err)
{
    char buf[64], ex[32];
    static const char *const not_finite[] = { "nan",      "inf",       "+inf",     "-inf",
                                              "infinity", "+infinity", "-infinity" };
    for (size_t i = 0; i < sizeof not_finite / sizeof not_finite[0]; i++)
        if (n == strlen(not_finite[i]) && !strncasecmp(p, not_finite[i], n))
            return moed_fail(err, MOED_EINVAL,
                             AT "the value '%s' is not a finite number; a count of (token, "
                                "expert) pairs is a number >= 0",
                             what, no, excerpt(p, n, ex));
    bool chars_ok = n && n < sizeof buf && span(p, n, "0123456789.eE+-") == n;
    char *stop = buf;
    if (chars_ok) {
        memcpy(buf, p, n);
        buf[n] = 0;
        errno = 0;
        *v = strtod(buf, &stop);
    }
    if (!chars_ok || stop != buf + n)
        return moed_fail(err, MOED_EINVAL,
                         AT "the value '%s' is not a number; expected a count such as 123456 "
                            "or 1.5e+06",
                         what, no, excerpt(p, n, ex));
    if (!isfinite(*v))
        return moed_fail(err, MOED_EINVAL,
                         AT "the value '%s' is out of range; a count is a finite number >= 0", what,
                         no, excerpt(p, n, ex));
    if (*v < 0)
        return moed_fail(err, MOED_EINVAL,
                         AT "the value '%s' is negative; a count of (token, expert) pairs is "
                            ">= 0",
                         what, no, excerpt(p, n, ex));
    if (*v == 0) *v = 0; /* -0 */
    return 0;
}

/* The label set {layer="L",expert="E"} from just after its '{': *p is moved past its '}'. */
static int sample_labels(const char **pp, const char *end, const char *what, int no,
                         moed_expert_load_entry *e, moed_error *err)
{
    const char *p = *pp;
    char ex[32];
    int seen[2] = { -1, -1 }; /* layer, expert */
    for (;;) {
        p = skip_blanks(p, end);
        if (p < end && *p == '}') break;
        size_t n = name_span(p, end, false);
        if (!n)
            return moed_fail(err, MOED_EINVAL, AT "expected a label name or '}' at '%s'", what, no,
                             excerpt(p, (size_t)(end - p), ex));
        const char *name = p;
        int which = n == 5 && !memcmp(name, "layer", 5)    ? 0
                    : n == 6 && !memcmp(name, "expert", 6) ? 1
                                                           : -1;
        if (which < 0)
            return moed_fail(err, MOED_EINVAL,
                             AT "unknown label '%s'; %s has only the labels layer and expert", what,
                             no, excerpt(name, n, ex), METRIC);
        if (seen[which] >= 0)
            return moed_fail(err, MOED_EINVAL, AT "the label %s is given twice", what, no,
                             which ? "expert" : "layer");
        p = skip_blanks(p + n, end);
        if (p == end || *p != '=')
            return moed_fail(err, MOED_EINVAL, AT "expected '=' after the label %s", what, no,
                             which ? "expert" : "layer");
        p = skip_blanks(p + 1, end);
        if (p == end || *p != '"')
            return moed_fail(err, MOED_EINVAL, AT "the label %s's value is not in double quotes",
                             what, no, which ? "expert" : "layer");
        const char *v = ++p;
        while (p < end && *p != '"') p += *p == '\\' && p + 1 < end ? 2 : 1;
        if (p >= end)
            return moed_fail(err, MOED_EINVAL, AT "the label %s's value has no closing quote", what,
                             no, which ? "expert" : "layer");
        int id = decimal_id(v, (size_t)(p - v));
        if (id < 0)
            return moed_fail(err, MOED_EINVAL, AT "%s=\"%s\" is not a decimal number from 0 to %d",
                             what, no, which ? "expert" : "layer", excerpt(v, (size_t)(p - v), ex),
                             MOED_EXPERT_LOAD_MAX_ID);
        seen[which] = id;
        p = skip_blanks(p + 1, end);
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        if (p < end && *p == '}') break;
        return moed_fail(err, MOED_EINVAL, AT "expected ',' or '}' after the label %s", what, no,
                         which ? "expert" : "layer");
    }
    for (int k = 0; k < 2; k++)
        if (seen[k] < 0)
            return moed_fail(err, MOED_EINVAL,
                             AT "the label %s is missing; each sample has "
                                "{layer=\"L\",expert=\"E\"}",
                             what, no, k ? "expert" : "layer");
    e->layer = seen[0];
    e->expert = seen[1];
    *pp = p + 1;
    return 0;
}

/* One line (without its line end): 1 with *e filled for a sample of the metric, 2 with e->tokens
 * and e->line for the launches' count, 0 for a line to skip, or an error. */
static int parse_line(const char *line, const char *end, const char *what, int no,
                      moed_expert_load_entry *e, moed_error *err)
{
    char ex[32];
    const char *p = skip_blanks(line, end);
    if (p == end || *p == '#') return 0;
    size_t n = name_span(p, end, true);
    if (n == strlen(LAUNCHES) && !memcmp(p, LAUNCHES, n)) { /* the launches: one value, no labels */
        const char *v = skip_blanks(p + n, end), *w = v;
        while (w < end && !blank(*w)) w++;
        if (w == v || skip_blanks(w, end) != end)
            return moed_fail(err, MOED_EINVAL, AT "expected %s COUNT", what, no, LAUNCHES);
        e->line = no;
        int rc = sample_value(v, (size_t)(w - v), what, no, &e->tokens, err);
        return rc ? rc : 2;
    }
    if (n != strlen(METRIC) || memcmp(p, METRIC, n)) return 0; /* another metric */
    if (end - line > MOED_EXPERT_LOAD_MAX_LINE)
        return moed_fail(err, MOED_EINVAL, AT "%td bytes; a line of %s is at most %d", what, no,
                         end - line, METRIC, MOED_EXPERT_LOAD_MAX_LINE);
    p = skip_blanks(p + n, end);
    if (p == end || *p != '{')
        return moed_fail(err, MOED_EINVAL,
                         AT "%s without its labels; expected %s{layer=\"L\",expert=\"E\"} COUNT",
                         what, no, METRIC, METRIC);
    p++;
    int rc = sample_labels(&p, end, what, no, e, err);
    if (rc) return rc;
    p = skip_blanks(p, end);
    const char *v = p;
    while (p < end && !blank(*p)) p++;
    if (p == v) return moed_fail(err, MOED_EINVAL, AT "no value after the labels", what, no);
    if ((rc = sample_value(v, (size_t)(p - v), what, no, &e->tokens, err))) return rc;
    p = skip_blanks(p, end);
    if (p < end) { /* a timestamp: an integer of milliseconds, ignored */
        const char *t = p + (*p == '-');
        size_t digits = span(t, (size_t)(end - t), "0123456789");
        const char *rest = skip_blanks(t + digits, end);
        if (!digits || digits > 19 || rest != end)
            return moed_fail(err, MOED_EINVAL,
                             AT "unexpected '%s' after the value; only a timestamp (an integer) "
                                "may follow it",
                             what, no, excerpt(p, (size_t)(end - p), ex));
    }
    e->line = no;
    return 1;
}

static int by_layer_expert(const void *a, const void *b)
{
    const moed_expert_load_entry *x = a, *y = b;
    if (x->layer != y->layer) return x->layer < y->layer ? -1 : 1;
    if (x->expert != y->expert) return x->expert < y->expert ? -1 : 1;
    return (x->line > y->line) - (x->line < y->line);
}

int moed_expert_load_parse(const char *text, size_t len, const char *what, moed_expert_load *out,
                           moed_error *err)
{
    memset(out, 0, sizeof *out);
    if (!(out->what = strdup(what))) return moed_fail(err, MOED_ENOMEM, "no memory for %s", what);
    size_t cap = 0;
    const char *line = text, *stop = text + len;
    for (int no = 1; line < stop; no++) {
        const char *nl = memchr(line, '\n', (size_t)(stop - line)), *end = nl ? nl : stop;
        if (memchr(line, 0, (size_t)(end - line)))
            return moed_fail(err, MOED_EINVAL, AT "a NUL byte: not a text file", what, no);
        if (end > line && end[-1] == '\r') end--;
        moed_expert_load_entry e;
        int rc = parse_line(line, end, what, no, &e, err);
        if (rc < 0) return rc;
        if (rc == 2 && out->launches_line)
            return moed_fail(err, MOED_EINVAL, AT "%s again, first given on line %d", what, no,
                             LAUNCHES, out->launches_line);
        if (rc == 2) {
            out->launches = e.tokens;
            out->launches_line = no;
        } else if (rc) {
            if ((size_t)out->n == cap) {
                size_t want = cap ? 2 * cap : 256;
                moed_expert_load_entry *v = realloc(out->v, want * sizeof *v);
                if (!v) return moed_fail(err, MOED_ENOMEM, "no memory to read %s", what);
                out->v = v;
                cap = want;
            }
            out->v[out->n++] = e;
        }
        line = nl ? nl + 1 : stop;
    }
    if (out->n > 1) qsort(out->v, (size_t)out->n, sizeof *out->v, by_layer_expert);
    /* Of the (layer, expert)s given more than once, the one whose second line comes first. */
    const moed_expert_load_entry *again = NULL;
    for (int i = 1; i < out->n; i++)
        if (out->v[i].layer == out->v[i - 1].layer && out->v[i].expert == out->v[i - 1].expert &&
            (!again || out->v[i].line < again[1].line))
            again = &out->v[i - 1];
    if (again)
        return moed_fail(err, MOED_EINVAL,
                         AT "layer %d expert %d again, first given on line %d; each (layer, "
                            "expert) is counted once (to combine several daemons' scrapes, add "
                            "their counts)",
                         what, again[1].line, again->layer, again->expert, again->line);
    return 0;
}

int moed_expert_load_read(const char *path, moed_expert_load *out, moed_error *err)
{
    char *text, what[64 + 4096];
    size_t len;
    memset(out, 0, sizeof *out);
    int rc = moed_file_read(path, "--expert-load", MOED_EXPERT_LOAD_MAX_FILE, &text, &len, err);
    if (rc) return rc;
    snprintf(what, sizeof what, "--expert-load %s", path);
    rc = moed_expert_load_parse(text, len, what, out, err);
    free(text);
    return rc;
}

double moed_expert_load_launches(const moed_expert_load *l)
{
    int layers = 0;
    for (int i = 0; i < l->n; i++) layers += !i || l->v[i - 1].layer != l->v[i].layer;
    return layers ? l->launches / layers : 0;
}

void moed_expert_load_free(moed_expert_load *l)
{
    free(l->what);
    free(l->v);
    memset(l, 0, sizeof *l);
}

static bool has_layer(const int *have, int n, int index)
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (have[mid] == index) return true;
        if (have[mid] < index)
            lo = mid + 1;
        else
            hi = mid;
    }
    return false;
}

int moed_expert_load_check(const moed_expert_load *l, const int *have, int n_have,
                           const char *model, bool ignore_others, int *ignored, moed_error *err)
{
    const moed_expert_load_entry *stray = NULL;
    int others = 0;
    for (int i = 0; i < l->n; i++) {
        const moed_expert_load_entry *e = &l->v[i];
        if (has_layer(have, n_have, e->layer)) continue;
        others += !i || l->v[i - 1].layer != e->layer;
        if (!stray || e->line < stray->line) stray = e;
    }
    if (ignored) *ignored = others;
    if (!stray || ignore_others) return 0;
    if (!n_have)
        return moed_fail(err, MOED_EINVAL, AT "layer %d: %s has no MoE layer", l->what, stray->line,
                         stray->layer, model);
    return moed_fail(err, MOED_EINVAL,
                     AT "layer %d is not a MoE layer of %s (it has %d MoE layers, from %d to %d)",
                     l->what, stray->line, stray->layer, model, n_have, have[0], have[n_have - 1]);
}

int moed_expert_load_layer(const moed_expert_load *l, int index, int n_experts, const int32_t *ids,
                           int n_ids, double **out, int *named, moed_error *err)
{
    *out = NULL;
    *named = 0;
    int lo = 0, hi = l->n; /* the layer's first entry */
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (l->v[mid].layer < index)
            lo = mid + 1;
        else
            hi = mid;
    }
    int first = lo, last = lo;
    while (last < l->n && l->v[last].layer == index) last++;
    if (first == last) return 0;
    *named = last - first;
    const moed_expert_load_entry *top = &l->v[last - 1]; /* the largest id: sorted by expert */
    if (top->expert >= n_experts) {
        const moed_expert_load_entry *e = top;
        for (int i = first; i < last; i++) /* the first out of range in the file */
            if (l->v[i].expert >= n_experts && l->v[i].line < e->line) e = &l->v[i];
        return moed_fail(err, MOED_EINVAL,
                         AT "expert %d of layer %d is out of range: the layer has %d experts (0 "
                            "to %d)",
                         l->what, e->line, e->expert, index, n_experts, n_experts - 1);
    }
    if (!ids) n_ids = n_experts;
    double *whole = calloc((size_t)n_experts, sizeof *whole);
    double *v = malloc(((size_t)n_ids + 1) * sizeof *v);
    if (!whole || !v) {
        free(whole);
        free(v);
        return moed_fail(err, MOED_ENOMEM, "no memory for layer %d's expert load", index);
    }
    for (int i = first; i < last; i++) whole[l->v[i].expert] = l->v[i].tokens;
    bool any = false;
    for (int k = 0; k < n_ids; k++) {
        v[k] = whole[ids ? ids[k] : k];
        any |= v[k] > 0;
    }
    free(whole);
    if (any)
        *out = v;
    else
        free(v);
    return 0;
}
