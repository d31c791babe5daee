/*
 * load_hist — moed-load's latency histogram: constant memory, mergeable across threads, exact
 * count, min, max and mean, percentiles within 1%.
 *
 * Values are nanoseconds. Percentiles come from log-linear buckets (HdrHistogram's layout): values
 * below 128 ns have a bucket each; above, every power of two is split into 128 equal buckets, so a
 * bucket is at most 1/128 of its value wide. A percentile is the midpoint of the bucket holding
 * the nearest-rank sample (rank ceil(q n)), clamped to [min, max]: it is within 0.4% of the exact
 * sample and never decreases with q. The report's histogram uses fixed 1-2-5 buckets per decade
 * from 10 us to 100 s, counted exactly at record time (a fine bucket may straddle a 1-2-5 edge).
 */
#ifndef LOAD_HIST_H
#define LOAD_HIST_H

#include <stdint.h>

#define LOAD_HIST_SUB     128                                  /* buckets per power of two */
#define LOAD_HIST_BUCKETS (LOAD_HIST_SUB + 57 * LOAD_HIST_SUB) /* exponents 7 .. 63 */
#define LOAD_HIST_EDGES   22 /* 10us 20us 50us 100us ... 50s 100s */
#define LOAD_HIST_DISPLAY (LOAD_HIST_EDGES + 1)

typedef struct load_hist {
    uint64_t n;
    uint64_t min, max; /* ns; min is UINT64_MAX while empty */
    double sum;        /* ns */
    uint64_t counts[LOAD_HIST_BUCKETS];
    /* display[0]: below 10 us; display[i]: [edge i-1, edge i); display[EDGES]: 100 s and more */
    uint64_t display[LOAD_HIST_DISPLAY];
} load_hist;

void load_hist_init(load_hist *h);
void load_hist_add(load_hist *h, uint64_t ns);
/* Adds src's samples to dst. */
void load_hist_merge(load_hist *dst, const load_hist *src);
/* The q-quantile (q in [0, 1]) as above; 0 when empty. */
uint64_t load_hist_quantile(const load_hist *h, double q);
/* Mean in ns; 0 when empty. */
double load_hist_mean(const load_hist *h);
/* The i-th edge of the 1-2-5 display buckets (0 .. LOAD_HIST_EDGES-1), ns. */
uint64_t load_hist_edge(int i);

#endif
