/*
 * test_load_stats — moed-load's pure logic: the histogram's counts and percentiles against exact
 * sorted samples, merging, the 1-2-5 display buckets, arrival gaps, token counts, sweeps, routing
 * draws (distinct, in range, weights summing to 1, Zipf skew), the exact share of bad requests,
 * and the progress line (the level of the run, where it is, the time left, one terminal row).
 */
#include "check.h"
#include "load_gen.h"
#include "load_hist.h"
#include "load_progress.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Percentiles of a spread of latencies (1 us .. 10 s, log-uniform) within 0.4% of the exact
 * nearest-rank sample, monotone in q; count, min, max and mean exact. */
static void test_hist_percentiles(void)
{
    enum { N = 100000 };
    static load_hist h;
    uint64_t *v = malloc(N * sizeof *v);
    load_rng r;
    load_rng_seed(&r, 7, 0);
    load_hist_init(&h);
    CHECK_EQ_INT(load_hist_quantile(&h, 0.5), 0);
    double sum = 0;
    for (int i = 0; i < N; i++) {
        v[i] = (uint64_t)pow(10, 3 + 7 * load_rng_uniform(&r));
        sum += (double)v[i];
        load_hist_add(&h, v[i]);
    }
    qsort(v, N, sizeof *v, cmp_u64);
    CHECK_EQ_INT(h.n, N);
    CHECK_EQ_INT(h.min, v[0]);
    CHECK_EQ_INT(h.max, v[N - 1]);
    CHECK_NEAR(load_hist_mean(&h), sum / N, 1e-6 * sum / N);
    const double qs[] = { 0.001, 0.1, 0.5, 0.9, 0.95, 0.99, 0.999, 0.9999 };
    uint64_t prev = 0;
    for (size_t i = 0; i < sizeof qs / sizeof *qs; i++) {
        uint64_t exact = v[(size_t)ceil(qs[i] * N) - 1], got = load_hist_quantile(&h, qs[i]);
        CHECK_MSG(fabs((double)got - (double)exact) <= 0.004 * (double)exact,
                  "q=%g: %llu vs exact %llu", qs[i], (unsigned long long)got,
                  (unsigned long long)exact);
        CHECK(got >= prev);
        prev = got;
    }
    CHECK_EQ_INT(load_hist_quantile(&h, 0), v[0]);
    CHECK_EQ_INT(load_hist_quantile(&h, 1), v[N - 1]);
    free(v);
}

/* Small values are exact; the display buckets count [edge i-1, edge i) exactly. */
static void test_hist_small_and_display(void)
{
    static load_hist h;
    load_hist_init(&h);
    for (uint64_t i = 1; i <= 100; i++) load_hist_add(&h, i);
    CHECK_EQ_INT(load_hist_quantile(&h, 0.5), 50);
    CHECK_EQ_INT(load_hist_quantile(&h, 0.99), 99);
    CHECK_EQ_INT(h.display[0], 100); /* all below 10 us */

    load_hist_init(&h);
    load_hist_add(&h, 9999);         /* < 10 us */
    load_hist_add(&h, 10000);        /* [10 us, 20 us) */
    load_hist_add(&h, 19999);        /* [10 us, 20 us) */
    load_hist_add(&h, 20000);        /* [20 us, 50 us) */
    load_hist_add(&h, 1000000);      /* [1 ms, 2 ms) */
    load_hist_add(&h, 100000000000); /* >= 100 s */
    CHECK_EQ_INT(load_hist_edge(0), 10000);
    CHECK_EQ_INT(load_hist_edge(6), 1000000);
    CHECK_EQ_INT(load_hist_edge(LOAD_HIST_EDGES - 1), 100000000000ULL);
    CHECK_EQ_INT(h.display[0], 1);
    CHECK_EQ_INT(h.display[1], 2);
    CHECK_EQ_INT(h.display[2], 1);
    CHECK_EQ_INT(h.display[7], 1);
    CHECK_EQ_INT(h.display[LOAD_HIST_EDGES], 1);
    uint64_t total = 0;
    for (int i = 0; i < LOAD_HIST_DISPLAY; i++) total += h.display[i];
    CHECK_EQ_INT(total, h.n);
}

/* Merging two halves gives the histogram of the whole. */
static void test_hist_merge(void)
{
    static load_hist a, b, all;
    load_hist_init(&a);
    load_hist_init(&b);
    load_hist_init(&all);
    for (uint64_t i = 0; i < 5000; i++) {
        uint64_t x = 1000 + i * 7919 % 3000000;
        load_hist_add(i % 2 ? &a : &b, x);
        load_hist_add(&all, x);
    }
    load_hist_merge(&a, &b);
    CHECK_EQ_INT(a.n, all.n);
    CHECK_EQ_INT(a.min, all.min);
    CHECK_EQ_INT(a.max, all.max);
    CHECK(!memcmp(a.counts, all.counts, sizeof a.counts));
    CHECK(!memcmp(a.display, all.display, sizeof a.display));
    CHECK_EQ_INT(load_hist_quantile(&a, 0.9), load_hist_quantile(&all, 0.9));
}

/* Constant gaps are exact; Poisson gaps have mean 1/rate and a coefficient of variation of 1. */
static void test_arrivals(void)
{
    load_rng r;
    load_rng_seed(&r, 3, 1);
    CHECK_NEAR(load_arrival_gap(LOAD_ARRIVAL_CONSTANT, 250, &r), 0.004, 1e-15);
    enum { N = 200000 };
    double s = 0, s2 = 0;
    for (int i = 0; i < N; i++) {
        double g = load_arrival_gap(LOAD_ARRIVAL_POISSON, 1000, &r);
        CHECK(g > 0 || g == 0);
        s += g;
        s2 += g * g;
    }
    double mean = s / N, sd = sqrt(s2 / N - mean * mean);
    CHECK_NEAR(mean, 1e-3, 0.01e-3);
    CHECK_NEAR(sd / mean, 1.0, 0.02);
    load_arrival a;
    moed_error err;
    CHECK(!load_arrival_parse("poisson", &a, &err) && a == LOAD_ARRIVAL_POISSON);
    CHECK(load_arrival_parse("bursty", &a, &err) == MOED_EINVAL && strstr(err.msg, "bursty"));
}

static void test_tokens(void)
{
    load_tokens t;
    moed_error err;
    load_rng r;
    load_rng_seed(&r, 1, 2);
    CHECK(!load_tokens_parse("8", &t, &err) && t.lo == 8 && t.hi == 8);
    CHECK_EQ_INT(load_tokens_sample(&t, &r), 8);
    CHECK(!load_tokens_parse("4:6", &t, &err) && t.lo == 4 && t.hi == 6);
    int seen[7] = { 0 };
    for (int i = 0; i < 3000; i++) {
        int v = load_tokens_sample(&t, &r);
        CHECK(v >= 4 && v <= 6);
        if (v >= 4 && v <= 6) seen[v]++;
    }
    CHECK(seen[4] > 900 && seen[5] > 900 && seen[6] > 900);
    const char *bad[] = { "0", "-3", "8:4", "4:", ":8", "x", "4:8:2", "", "99999999999" };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        CHECK_MSG(load_tokens_parse(bad[i], &t, &err) == MOED_EINVAL, "'%s' accepted", bad[i]);

    char path[] = "/tmp/test_load_tokensXXXXXX";
    int fd = mkstemp(path);
    FILE *f = fdopen(fd, "w");
    fputs("# sizes\n16\n\n  32  \n1024 # big\n", f);
    fclose(f);
    CHECK(!load_tokens_read(path, &t, &err));
    CHECK_EQ_INT(t.n_values, 3);
    CHECK(t.lo == 16 && t.hi == 1024);
    for (int i = 0; i < 100; i++) {
        int v = load_tokens_sample(&t, &r);
        CHECK(v == 16 || v == 32 || v == 1024);
    }
    load_tokens_free(&t);
    f = fopen(path, "w");
    fputs("16\nabc\n", f);
    fclose(f);
    CHECK(load_tokens_read(path, &t, &err) == MOED_EINVAL && strstr(err.msg, "line 2"));
    f = fopen(path, "w");
    fclose(f);
    CHECK(load_tokens_read(path, &t, &err) == MOED_EINVAL && strstr(err.msg, "no token counts"));
    unlink(path);
    CHECK(load_tokens_read("/nonexistent/tokens", &t, &err) == MOED_EIO);
}

static void test_sweep_and_lists(void)
{
    double *lv;
    int n;
    moed_error err;
    CHECK(!load_sweep_parse("--concurrency", "8", true, &lv, &n, &err) && n == 1 && lv[0] == 8);
    free(lv);
    CHECK(!load_sweep_parse("--concurrency", "1:16:4", true, &lv, &n, &err) && n == 4);
    CHECK(n == 4 && lv[0] == 1 && lv[1] == 5 && lv[2] == 9 && lv[3] == 13);
    free(lv);
    CHECK(!load_sweep_parse("--rate", "0.1:0.3:0.1", false, &lv, &n, &err) && n == 3);
    free(lv);
    const char *bad[] = { "0", "1:8", "8:1:1", "1:8:0", "1.5", "1:2:3:4", "a", "" };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        CHECK_MSG(load_sweep_parse("--concurrency", bad[i], true, &lv, &n, &err) == MOED_EINVAL,
                  "'%s' accepted", bad[i]);
    CHECK(load_sweep_parse("--rate", "1:100000:1", false, &lv, &n, &err) == MOED_EINVAL);

    int *v;
    CHECK(!load_int_list_parse("--layers", "3,0,3", &v, &n, &err) && n == 3);
    CHECK(n == 3 && v[0] == 3 && v[1] == 0 && v[2] == 3);
    free(v);
    CHECK(load_int_list_parse("--layers", "1,,2", &v, &n, &err) == MOED_EINVAL);
    CHECK(load_int_list_parse("--layers", "0-3", &v, &n, &err) == MOED_EINVAL);
}

/* Routes: ids in range and distinct per row, weights positive summing to 1; Zipf puts more tokens
 * on expert 0 than uniform does, in the ratio its definition gives; ONE puts all on expert 0. */
static void test_routing(void)
{
    enum { ROWS = 20000, E = 16, K = 4 };
    static int32_t ids[ROWS * K];
    static float w[ROWS * K];
    load_routing r;
    moed_error err;
    load_rng rng;
    load_rng_seed(&rng, 5, 0);
    const char *specs[] = { "uniform", "zipf:1.2", "one" };
    double share0[3];
    for (int s = 0; s < 3; s++) {
        CHECK(!load_routing_parse(specs[s], &r, &err));
        int cols = load_routing_cols(&r, K);
        CHECK_EQ_INT(cols, s == 2 ? 1 : K);
        CHECK(!load_routing_fill(&r, E, cols, ROWS, &rng, ids, w, &err));
        int bad = 0;
        long hits0 = 0;
        for (int t = 0; t < ROWS; t++) {
            double sum = 0;
            for (int j = 0; j < cols; j++) {
                int e = ids[t * cols + j];
                bad += e < 0 || e >= E || !(w[t * cols + j] > 0);
                for (int i = 0; i < j; i++) bad += ids[t * cols + i] == e;
                hits0 += e == 0;
                sum += w[t * cols + j];
            }
            bad += fabs(sum - 1) > 1e-5;
        }
        CHECK_MSG(!bad, "%s: %d bad entries", specs[s], bad);
        share0[s] = (double)hits0 / ROWS;
    }
    CHECK_NEAR(share0[0], (double)K / E, 0.02); /* P(expert 0 among 4 of 16) */
    CHECK(share0[1] > 0.5); /* P(expert 0) = 1 / sum_e (e+1)^-1.2 = 0.36 on the first draw alone */
    CHECK_NEAR(share0[2], 1.0, 0);
    CHECK(load_routing_parse("zipf", &r, &err) == MOED_EINVAL);
    CHECK(load_routing_parse("zipf:-1", &r, &err) == MOED_EINVAL);
    CHECK(!load_routing_parse("logits", &r, &err) && r.kind == LOAD_ROUTE_LOGITS);
    CHECK(!load_routing_parse("server", &r, &err) && r.kind == LOAD_ROUTE_SERVER);
    /* k = E: every expert once per row, whatever the skew */
    CHECK(!load_routing_parse("zipf:3", &r, &err));
    CHECK(!load_routing_fill(&r, 4, 4, 100, &rng, ids, w, &err));
    int sum_ids = 0;
    for (int i = 0; i < 400; i++) sum_ids += ids[i];
    CHECK_EQ_INT(sum_ids, 100 * (0 + 1 + 2 + 3));
}

/* Exactly floor(N p) of the first N requests are bad, spread evenly, for any N. */
static void test_bad_share(void)
{
    const double ps[] = { 0, 0.1, 0.29, 1.0 / 3, 0.5, 1 };
    for (size_t i = 0; i < sizeof ps / sizeof *ps; i++) {
        uint64_t bad = 0, gap = 0, max_gap = 0;
        for (uint64_t n = 0; n < 10007; n++) {
            bool b = load_is_bad(n, ps[i]);
            bad += b;
            gap = b ? 0 : gap + 1;
            if (gap > max_gap) max_gap = gap;
            if (n == 99) CHECK_EQ_INT(bad, (uint64_t)floor(100 * ps[i]));
        }
        CHECK_EQ_INT(bad, (uint64_t)floor(10007 * ps[i]));
        if (ps[i] > 0)
            CHECK_MSG((double)max_gap <= 1 / ps[i], "p=%g: gap %llu", ps[i],
                      (unsigned long long)max_gap);
    }
}

#define CHECK_STR_HAS(s, part) CHECK_MSG(strstr(s, part), "'%s' lacks '%s'", s, part)

/* The second of three levels of a sweep at concurrency 8, 4 s into its 10 s window: 60% of it
 * and two levels of 1 + 10 s left; the line cut to the terminal's row. */
static void test_progress_line(void)
{
    char line[400];
    load_progress g = { .level = 1,
                        .n_levels = 3,
                        .concurrency = 8,
                        .phase = LOAD_MEASURE,
                        .elapsed_s = 4,
                        .warmup_s = 1,
                        .duration_s = 10,
                        .rps = 1234.4,
                        .ok = 4000,
                        .errors = 2,
                        .expected_errors = 5,
                        .p50_ms = 1.5,
                        .p99_ms = 4.25 };
    CHECK_NEAR(load_progress_left_s(&g), 6 + 11, 1e-9);
    load_progress_text(&g, 0, line, sizeof line);
    CHECK_STR_HAS(line, "[2/3 c=8] 4.0/10.0 s (40%)  1234 req/s  ok 4000  errors 2 (+5 expected)");
    CHECK_STR_HAS(line, "p50 1.500 ms  p99 4.250 ms  run ends in 17 s");
    load_progress_text(&g, 40, line, sizeof line);
    CHECK_EQ_INT(strlen(line), 39);
    CHECK_MSG(!strncmp(line, "[2/3 c=8] 4.0/10.0 s (40%)", 26), "%s", line);

    g.phase = LOAD_WARMUP; /* 0.5 s into its warm-up */
    g.elapsed_s = 0.5;
    g.p50_ms = -1;
    CHECK_NEAR(load_progress_left_s(&g), 0.5 + 10 + 11, 1e-9);
    load_progress_text(&g, 0, line, sizeof line);
    CHECK_STR_HAS(line, "[2/3 c=8] warm-up 0.5/1.0 s");
    CHECK_MSG(!strstr(line, "p50"), "%s", line);

    /* open loop, --requests 500: 200 started at 100 req/s, so 3 s and one more level of 6 s */
    g = (load_progress){ .level = 0,
                         .n_levels = 2,
                         .rate = 100,
                         .phase = LOAD_MEASURE,
                         .warmup_s = 1,
                         .requests = 500,
                         .started = 200,
                         .rps = 100,
                         .p50_ms = -1 };
    CHECK_NEAR(load_progress_left_s(&g), 3 + 1 + 5, 1e-9);
    load_progress_text(&g, 0, line, sizeof line);
    CHECK_STR_HAS(line, "[1/2 100/s] 200/500 requests (40%)");
    g.rps = 0; /* no rate yet: the time left is not known, and not said */
    CHECK(load_progress_left_s(&g) < 0);
    load_progress_text(&g, 0, line, sizeof line);
    CHECK_MSG(!strstr(line, "run ends"), "%s", line);

    g.phase = LOAD_FINISH;
    load_progress_text(&g, 0, line, sizeof line);
    CHECK_STR_HAS(line, "[1/2 100/s] finishing the calls in flight");
}

int main(void)
{
    test_progress_line();
    test_hist_percentiles();
    test_hist_small_and_display();
    test_hist_merge();
    test_arrivals();
    test_tokens();
    test_sweep_and_lists();
    test_routing();
    test_bad_share();
    return check_status("test_load_stats");
}
