/*
 * load_gen — moed-load's random choices and spec parsing (load_gen.h states the contract).
 *
 * Everything random comes from splitmix64 streams seeded from --seed and the worker's number, so
 * a run is reproducible and workers never share a generator (no lock, no false sharing). Expert
 * choices are drawn once, into pools the requests then take windows from: per request the
 * generator only picks an offset, which keeps it cheap next to the call it makes.
 */
#include "load_gen.h"
#include "moed_synth.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- random numbers ---- */

void load_rng_seed(load_rng *r, uint64_t seed, uint64_t stream)
{
    r->s = moed_splitmix64(seed ^ moed_splitmix64(stream + 1));
}

uint64_t load_rng_next(load_rng *r)
{
    r->s += 0x9E3779B97F4A7C15ULL;
    return moed_splitmix64(r->s);
}

double load_rng_uniform(load_rng *r)
{
    return (double)(load_rng_next(r) >> 11) * 0x1p-53;
}

uint64_t load_rng_below(load_rng *r, uint64_t n)
{
    return (uint64_t)(load_rng_uniform(r) * (double)n) % n;
}

/* ---- arrivals ---- */

int load_arrival_parse(const char *s, load_arrival *out, moed_error *err)
{
    if (!strcmp(s, "constant"))
        *out = LOAD_ARRIVAL_CONSTANT;
    else if (!strcmp(s, "poisson"))
        *out = LOAD_ARRIVAL_POISSON;
    else
        return moed_fail(err, MOED_EINVAL, "--arrival %s: use constant or poisson", s);
    return 0;
}

double load_arrival_gap(load_arrival kind, double rate, load_rng *r)
{
    if (kind == LOAD_ARRIVAL_CONSTANT) return 1.0 / rate;
    return -log1p(-load_rng_uniform(r)) / rate; /* 1 - u is in (0, 1]: never log(0) */
}

/* ---- numbers in specs ---- */

static int parse_int(const char *s, const char *end, long *out)
{
    char *stop;
    errno = 0;
    long v = strtol(s, &stop, 10);
    if (s == end || stop != end || errno || *s == '-' || *s == '+' || *s == ' ') return -1;
    *out = v;
    return 0;
}

static int parse_num(const char *s, const char *end, double *out)
{
    char *stop;
    errno = 0;
    double v = strtod(s, &stop);
    if (s == end || stop != end || errno || !isfinite(v) || *s == ' ') return -1;
    *out = v;
    return 0;
}

/* ---- tokens ---- */

#define LOAD_MAX_TOKENS (1L << 24)

int load_tokens_parse(const char *spec, load_tokens *out, moed_error *err)
{
    memset(out, 0, sizeof *out);
    const char *colon = strchr(spec, ':'), *end = spec + strlen(spec);
    long lo, hi;
    if (parse_int(spec, colon ? colon : end, &lo) ||
        (colon ? parse_int(colon + 1, end, &hi) : (hi = lo, 0)) || lo < 1 || hi < lo ||
        hi > LOAD_MAX_TOKENS)
        return moed_fail(err, MOED_EINVAL,
                         "--tokens %s: give a count (8) or an inclusive range (4:64) of tokens per "
                         "request, each in [1, %ld]",
                         spec, LOAD_MAX_TOKENS);
    out->lo = (int)lo;
    out->hi = (int)hi;
    return 0;
}

/* Appends v to t->values, growing it. */
static int tokens_push(load_tokens *t, size_t *cap, int v)
{
    if (t->n_values == *cap) {
        size_t n = *cap ? *cap * 2 : 256;
        int *p = realloc(t->values, n * sizeof *p);
        if (!p) return -1;
        t->values = p;
        *cap = n;
    }
    t->values[t->n_values++] = v;
    if (t->n_values == 1 || v < t->lo) t->lo = v;
    if (v > t->hi) t->hi = v;
    return 0;
}

int load_tokens_read(const char *path, load_tokens *out, moed_error *err)
{
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "r");
    if (!f)
        return moed_fail(err, MOED_EIO, "--tokens-file %s: cannot open it: %s", path,
                         strerror(errno));
    char line[256];
    size_t cap = 0;
    int lineno = 0, rc = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        char *s = line + strspn(line, " \t");
        size_t len = strcspn(s, "#\r\n");
        while (len && (s[len - 1] == ' ' || s[len - 1] == '\t')) len--;
        if (!len) continue;
        long v;
        if (parse_int(s, s + len, &v) || v < 1 || v > LOAD_MAX_TOKENS) {
            rc = moed_fail(err, MOED_EINVAL,
                           "--tokens-file %s line %d: '%.*s' is not a token count in [1, %ld] "
                           "(one integer per line)",
                           path, lineno, (int)len, s, LOAD_MAX_TOKENS);
            goto err;
        }
        if (tokens_push(out, &cap, (int)v)) {
            rc = moed_fail(err, MOED_ENOMEM, "--tokens-file %s: out of memory at line %d", path,
                           lineno);
            goto err;
        }
    }
    if (ferror(f)) {
        rc = moed_fail(err, MOED_EIO, "--tokens-file %s: read error: %s", path, strerror(errno));
        goto err;
    }
    if (!out->n_values) {
        rc = moed_fail(err, MOED_EINVAL, "--tokens-file %s holds no token counts", path);
        goto err;
    }
    fclose(f);
    return 0;
err:
    fclose(f);
    load_tokens_free(out);
    return rc;
}

int load_tokens_sample(const load_tokens *t, load_rng *r)
{
    if (t->n_values) return t->values[load_rng_below(r, t->n_values)];
    if (t->lo == t->hi) return t->lo;
    return t->lo + (int)load_rng_below(r, (uint64_t)(t->hi - t->lo) + 1);
}

void load_tokens_free(load_tokens *t)
{
    free(t->values);
    memset(t, 0, sizeof *t);
}

/* ---- sweeps and lists ---- */

int load_sweep_parse(const char *flag, const char *spec, bool integral, double **levels, int *n,
                     moed_error *err)
{
    *levels = NULL;
    *n = 0;
    double v[3];
    int parts = 0;
    const char *s = spec;
    for (;;) {
        const char *colon = strchr(s, ':'), *end = colon ? colon : s + strlen(s);
        if (parts == 3 || parse_num(s, end, &v[parts]) || v[parts] <= 0 ||
            (integral && v[parts] != floor(v[parts])))
            goto bad;
        parts++;
        if (!colon) break;
        s = colon + 1;
    }
    if (parts == 2) goto bad;
    double lo = v[0], hi = parts == 3 ? v[1] : v[0], step = parts == 3 ? v[2] : 1;
    if (hi < lo) goto bad;
    /* a small tolerance so 0.1:0.3:0.1 reaches 0.3 despite rounding */
    double count = floor((hi - lo) / step + 1e-9) + 1;
    if (count > LOAD_MAX_LEVELS)
        return moed_fail(err, MOED_EINVAL, "%s %s makes %.0f levels; at most %d", flag, spec, count,
                         LOAD_MAX_LEVELS);
    *levels = malloc((size_t)count * sizeof **levels);
    if (!*levels) return moed_fail(err, MOED_ENOMEM, "out of memory parsing %s", flag);
    for (int i = 0; i < (int)count; i++) (*levels)[i] = lo + i * step;
    *n = (int)count;
    return 0;
bad:
    return moed_fail(err, MOED_EINVAL,
                     "%s %s: give a value (8) or a sweep a:b:step (1:16:4 runs 1, 5, 9, 13), "
                     "every number > 0%s",
                     flag, spec, integral ? " and whole" : "");
}

int load_int_list_parse(const char *flag, const char *spec, int **out, int *n, moed_error *err)
{
    *out = NULL;
    *n = 0;
    int count = 1;
    for (const char *p = spec; *p; p++) count += *p == ',';
    int *v = malloc((size_t)count * sizeof *v);
    if (!v) return moed_fail(err, MOED_ENOMEM, "out of memory parsing %s", flag);
    const char *s = spec;
    for (int i = 0; i < count; i++) {
        const char *comma = strchr(s, ','), *end = comma ? comma : s + strlen(s);
        long x;
        if (parse_int(s, end, &x) || x > 1000000) {
            free(v);
            return moed_fail(err, MOED_EINVAL,
                             "%s %s: element %d ('%.*s') is not a layer index: give a "
                             "comma-separated list such as 0,1,3",
                             flag, spec, i + 1, (int)(end - s), s);
        }
        v[i] = (int)x;
        s = end + 1;
    }
    *out = v;
    *n = count;
    return 0;
}

/* ---- routing ---- */

int load_routing_parse(const char *s, load_routing *out, moed_error *err)
{
    static const char *const names[] = { "uniform", "zipf", "one", "logits", "server" };
    memset(out, 0, sizeof *out);
    for (int i = 0; i < 5; i++)
        if (!strcmp(s, names[i]) && i != LOAD_ROUTE_ZIPF) {
            out->kind = (load_route_kind)i;
            return 0;
        }
    if (!strncmp(s, "zipf:", 5) && !parse_num(s + 5, s + strlen(s), &out->zipf_s) &&
        out->zipf_s >= 0 && out->zipf_s <= 100) {
        out->kind = LOAD_ROUTE_ZIPF;
        return 0;
    }
    return moed_fail(err, MOED_EINVAL,
                     "--routing %s: use uniform, zipf:S (S >= 0, e.g. zipf:1.2), one, logits or "
                     "server",
                     s);
}

int load_routing_cols(const load_routing *r, int top_k)
{
    return r->kind == LOAD_ROUTE_ONE ? 1 : top_k;
}

/* One row: cols distinct experts drawn in turn, each with probability proportional to its mass
 * among those not yet drawn. O(E) per draw, which is fine: rows are drawn once, into a pool. */
static void draw_row(const double *mass, double total, int E, int cols, load_rng *rng,
                     unsigned char *taken, int32_t *ids)
{
    memset(taken, 0, (size_t)E);
    for (int j = 0; j < cols; j++) {
        double u = load_rng_uniform(rng) * total, acc = 0;
        int pick = -1;
        for (int e = 0; e < E; e++) {
            if (taken[e]) continue;
            pick = e; /* the last candidate, should rounding leave u above the sum */
            acc += mass[e];
            if (u < acc) break;
        }
        taken[pick] = 1;
        total -= mass[pick];
        ids[j] = pick;
    }
}

int load_routing_fill(const load_routing *r, int n_experts, int cols, int64_t rows, load_rng *rng,
                      int32_t *ids, float *weights, moed_error *err)
{
    double *mass = malloc((size_t)n_experts * sizeof *mass);
    unsigned char *taken = malloc((size_t)n_experts);
    if (!mass || !taken) {
        free(mass);
        free(taken);
        return moed_fail(err, MOED_ENOMEM, "out of memory drawing routes over %d experts",
                         n_experts);
    }
    double total = 0;
    for (int e = 0; e < n_experts; e++) {
        mass[e] = r->kind == LOAD_ROUTE_ZIPF ? pow(e + 1.0, -r->zipf_s) : 1.0;
        total += mass[e];
    }
    for (int64_t t = 0; t < rows; t++) {
        int32_t *id = ids + t * cols;
        float *w = weights + t * cols;
        if (r->kind == LOAD_ROUTE_ONE) {
            for (int j = 0; j < cols; j++) id[j] = 0;
        } else {
            draw_row(mass, total, n_experts, cols, rng, taken, id);
        }
        double sum = 0;
        for (int j = 0; j < cols; j++) sum += w[j] = (float)(0.5 + load_rng_uniform(rng));
        for (int j = 0; j < cols; j++) w[j] = (float)(w[j] / sum);
    }
    free(mass);
    free(taken);
    return 0;
}

/* ---- bad requests ---- */

bool load_is_bad(uint64_t n, double p)
{
    return floor((double)(n + 1) * p) > floor((double)n * p);
}
