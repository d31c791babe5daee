/*
 * load_hist — log-linear buckets for percentiles, 1-2-5 buckets for the report (load_hist.h).
 *
 * Every operation is a few arithmetic steps and array updates with no allocation, so recording
 * costs the load generator nothing measurable next to a gRPC call; each worker thread keeps its
 * own histogram and the report merges them.
 */
#include "load_hist.h"

#include <math.h>
#include <string.h>

static const uint64_t edges[LOAD_HIST_EDGES] = {
    10000ULL,       20000ULL,       50000ULL,       100000ULL,       200000ULL,     500000ULL,
    1000000ULL,     2000000ULL,     5000000ULL,     10000000ULL,     20000000ULL,   50000000ULL,
    100000000ULL,   200000000ULL,   500000000ULL,   1000000000ULL,   2000000000ULL, 5000000000ULL,
    10000000000ULL, 20000000000ULL, 50000000000ULL, 100000000000ULL,
};

uint64_t load_hist_edge(int i)
{
    return edges[i];
}

void load_hist_init(load_hist *h)
{
    memset(h, 0, sizeof *h);
    h->min = UINT64_MAX;
}

static int bucket_of(uint64_t v)
{
    if (v < LOAD_HIST_SUB) return (int)v;
    int e = 63 - __builtin_clzll(v); /* 7 .. 63 */
    int m = (int)(v >> (e - 7));     /* 128 .. 255 */
    return LOAD_HIST_SUB + (e - 7) * LOAD_HIST_SUB + (m - LOAD_HIST_SUB);
}

/* The midpoint of bucket b (the bucket's only value below 128 ns). */
static double bucket_mid(int b)
{
    if (b < LOAD_HIST_SUB) return b;
    int e = (b - LOAD_HIST_SUB) / LOAD_HIST_SUB + 7;
    int m = (b - LOAD_HIST_SUB) % LOAD_HIST_SUB + LOAD_HIST_SUB;
    double width = ldexp(1.0, e - 7);
    return (double)m * width + width / 2;
}

static int display_of(uint64_t v)
{
    int i = 0;
    while (i < LOAD_HIST_EDGES && v >= edges[i]) i++;
    return i;
}

void load_hist_add(load_hist *h, uint64_t ns)
{
    h->n++;
    h->sum += (double)ns;
    if (ns < h->min) h->min = ns;
    if (ns > h->max) h->max = ns;
    h->counts[bucket_of(ns)]++;
    h->display[display_of(ns)]++;
}

void load_hist_merge(load_hist *dst, const load_hist *src)
{
    if (!src->n) return;
    dst->n += src->n;
    dst->sum += src->sum;
    if (src->min < dst->min) dst->min = src->min;
    if (src->max > dst->max) dst->max = src->max;
    for (int i = 0; i < LOAD_HIST_BUCKETS; i++) dst->counts[i] += src->counts[i];
    for (int i = 0; i < LOAD_HIST_DISPLAY; i++) dst->display[i] += src->display[i];
}

uint64_t load_hist_quantile(const load_hist *h, double q)
{
    if (!h->n) return 0;
    if (q <= 0) return h->min;
    if (q >= 1) return h->max;
    uint64_t rank = (uint64_t)ceil(q * (double)h->n), seen = 0;
    if (rank < 1) rank = 1;
    for (int b = 0; b < LOAD_HIST_BUCKETS; b++) {
        seen += h->counts[b];
        if (seen >= rank) {
            double v = bucket_mid(b);
            if (v < (double)h->min) return h->min;
            if (v > (double)h->max) return h->max;
            return (uint64_t)v;
        }
    }
    return h->max;
}

double load_hist_mean(const load_hist *h)
{
    return h->n ? h->sum / (double)h->n : 0.0;
}
