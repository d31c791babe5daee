/*
 * test_place — the placement planner (moed_place.h): whole layers by bytes, not round-robin; a
 * split layer's ranges contiguous, covering, and even in bytes; a layer larger than any one device
 * split by itself; one that fits nowhere refused with its size; two entries of one GPU sharing its
 * free memory; with the home's work given (home_work), a split even in expected work instead,
 * within what each GPU has room for, and exactly the byte split without it; a re-placement's cut
 * around a kept home, and its copies of hot experts (by hand, and against brute force: only where
 * they lower the peak, within budget and room), the cost of a copy, the predicted peak, and the
 * parts' local numbering. The CUDA backend places with these same functions.
 */
#include "check.h"

#include "moed_place.h"

#include <math.h>
#include <string.h>

#define GB (1ull << 30)
#define MB (1ull << 20)

static void devs_init(moed_place_dev *d, int n, const int *gpu, uint64_t free_each)
{
    for (int i = 0; i < n; i++) d[i] = (moed_place_dev){ gpu ? gpu[i] : i, free_each, 0 };
}

/* Ranges contiguous from 0, in increasing entry order, covering n_experts. */
static void check_cover(const moed_layer_place *p, int n_experts)
{
    int next = 0, last_dev = -1;
    for (int i = 0; i < p->n_parts; i++) {
        CHECK_EQ_INT(p->part[i].first, next);
        CHECK(p->part[i].count > 0);
        CHECK(p->part[i].dev > last_dev);
        last_dev = p->part[i].dev;
        next += p->part[i].count;
    }
    CHECK_EQ_INT(next, n_experts);
}

/* Layers of unequal size even out: a big layer, then small ones go to the other devices until
 * they weigh as much (round-robin would have put the third on device 0 again). */
static void test_whole_by_bytes(void)
{
    moed_place_dev d[2];
    moed_error err;
    moed_layer_place p;
    devs_init(d, 2, NULL, 100 * GB);
    const moed_place_need big = { 0, 1 * GB, 8, false, 0, NULL },
                          small = { 0, 1 * GB, 2, false, 0, NULL };
    CHECK(moed_place_layer(d, 2, &big, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 0);
    CHECK_EQ_INT(p.n_parts, 1);
    CHECK(!moed_place_is_split(&p));
    for (int i = 0; i < 4; i++) {
        CHECK(moed_place_layer(d, 2, &small, &p, &err) == 0);
        CHECK_EQ_INT(p.home, 1);
        CHECK_EQ_INT(p.part[0].dev, 1);
    }
    CHECK_EQ_INT(d[0].placed, 8 * GB);
    CHECK_EQ_INT(d[1].placed, 8 * GB);
    CHECK_EQ_INT(d[0].free, 92 * GB);
    /* equal layers then alternate, the first listed winning ties */
    CHECK(moed_place_layer(d, 2, &small, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 0);
    CHECK(moed_place_layer(d, 2, &small, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 1);
}

/* A device without room is passed over even when it is the lightest. */
static void test_whole_skips_full(void)
{
    moed_place_dev d[2] = { { 0, 3 * GB, 0 }, { 1, 50 * GB, 10 * GB } };
    moed_error err;
    moed_layer_place p;
    const moed_place_need l = { 0, 1 * GB, 4, false, 0, NULL };
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 1);
    CHECK(!moed_place_is_split(&p));
}

/* Asked split: the home carries the base, so it gets fewer experts; bytes even within one
 * expert; ranges in entry order. */
static void test_split_asked(void)
{
    moed_place_dev d[2];
    moed_error err;
    moed_layer_place p;
    devs_init(d, 2, NULL, 100 * GB);
    const moed_place_need l = { 4 * 88 * MB, 88 * MB, 256, true, 0, NULL };
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK(moed_place_is_split(&p));
    CHECK_EQ_INT(p.home, 0);
    CHECK_EQ_INT(p.n_parts, 2);
    check_cover(&p, 256);
    CHECK_EQ_INT(p.part[0].count, 126); /* 4 experts' worth of base: 126 + 4 = 130 = 256 - 126 */
    CHECK_EQ_INT(p.part[1].count, 130);
    CHECK_EQ_INT(d[0].placed, d[1].placed);
    /* a second split layer: its home is the lightest (now a tie: the first) */
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 0);
    uint64_t a = d[0].placed, b = d[1].placed;
    CHECK((a > b ? a - b : b - a) <= 88 * MB);
}

/* A layer larger than any one GPU is split without being asked; on the devices' remaining room. */
static void test_split_when_too_big(void)
{
    moed_place_dev d[3];
    moed_error err;
    moed_layer_place p;
    devs_init(d, 3, NULL, 10 * GB);
    const moed_place_need l = { 1 * GB, 1 * GB, 24, false, 0, NULL }; /* 25 GB over 3 x 10 GB */
    CHECK(moed_place_layer(d, 3, &l, &p, &err) == 0);
    CHECK(moed_place_is_split(&p));
    CHECK_EQ_INT(p.n_parts, 3);
    check_cover(&p, 24);
    for (int i = 0; i < 3; i++) CHECK(d[i].placed <= 10 * GB);
    CHECK_EQ_INT(d[0].placed + d[1].placed + d[2].placed, 25 * GB);
    CHECK_EQ_INT(p.home, 0); /* the base and 8 experts; 8 on each of the others */
    CHECK_EQ_INT(p.part[0].count, 8);
    CHECK_EQ_INT(d[0].placed, 9 * GB);
    CHECK_EQ_INT(d[1].placed, 8 * GB);
    /* what is left (5 GB) cannot take another 9 GB layer, split or not: refused, nothing counted */
    const moed_place_dev before[3] = { d[0], d[1], d[2] };
    const moed_place_need l2 = { 1 * GB, 1 * GB, 8, false, 0, NULL };
    CHECK(moed_place_layer(d, 3, &l2, &p, &err) == MOED_ENOMEM);
    CHECK(strstr(err.msg, "9.00 GiB") != NULL);
    CHECK(strstr(err.msg, "5.00 GiB free") != NULL);
    CHECK(!memcmp(before, d, sizeof before));
}

/* One device: a layer that does not fit is refused (nothing to split over); a split asked on one
 * device places it whole. */
static void test_one_device(void)
{
    moed_place_dev d[1] = { { 0, 4 * GB, 0 } };
    moed_error err;
    moed_layer_place p;
    const moed_place_need big = { 0, 1 * GB, 5, false, 0, NULL },
                          fits = { 0, 1 * GB, 3, true, 0, NULL };
    CHECK(moed_place_layer(d, 1, &big, &p, &err) == MOED_ENOMEM);
    CHECK(strstr(err.msg, "the device holds") != NULL);
    CHECK(moed_place_layer(d, 1, &fits, &p, &err) == 0);
    CHECK(!moed_place_is_split(&p));
    CHECK_EQ_INT(d[0].free, 1 * GB);
}

/* --devices 0,0: two entries of one GPU share its memory; the split gives both entries experts
 * and the GPU's free memory drops by the whole layer, once. */
static void test_same_gpu_twice(void)
{
    const int gpu[2] = { 0, 0 };
    moed_place_dev d[2];
    moed_error err;
    moed_layer_place p;
    devs_init(d, 2, gpu, 10 * GB);
    const moed_place_need l = { 0, 1 * GB, 6, true, 0, NULL };
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.n_parts, 2);
    CHECK_EQ_INT(p.part[0].count, 3);
    CHECK_EQ_INT(p.part[1].count, 3);
    CHECK_EQ_INT(d[0].free, 4 * GB);
    CHECK_EQ_INT(d[1].free, 4 * GB);
    /* 4 GB left on the GPU, whichever entry: a 5-expert layer fits nowhere */
    const moed_place_need l2 = { 0, 1 * GB, 5, true, 0, NULL };
    CHECK(moed_place_layer(d, 2, &l2, &p, &err) == MOED_ENOMEM);
    CHECK(strstr(err.msg, "4.00 GiB free") != NULL);
}

/* Fewer experts than devices: the devices without one get no part. */
static void test_few_experts(void)
{
    moed_place_dev d[4];
    moed_error err;
    moed_layer_place p;
    devs_init(d, 4, NULL, 10 * GB);
    const moed_place_need l = { 0, 1 * GB, 2, true, 0, NULL };
    CHECK(moed_place_layer(d, 4, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.n_parts, 2);
    check_cover(&p, 2);
}

/* DeepSeek-V3 (256 experts, top 8, one shared expert as wide as a routed one: 32 experts' work)
 * asked split over two equal GPUs: the first 32 experts go to the other entry, then they alternate,
 * the home first (fewer bytes): 112 + 32 = 144 on each. Bytes still counted as ever. */
static void test_work_two(void)
{
    moed_place_dev d[2];
    moed_error err;
    moed_layer_place p;
    devs_init(d, 2, NULL, 100 * GB);
    const moed_place_need l = { 1 * 88 * MB, 88 * MB, 256, true, 32.0, NULL };
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK(moed_place_is_split(&p));
    CHECK_EQ_INT(p.home, 0);
    CHECK_EQ_INT(p.n_parts, 2);
    check_cover(&p, 256);
    CHECK_EQ_INT(p.part[0].dev, 0);
    CHECK_EQ_INT(p.part[0].count, 112);
    CHECK_EQ_INT(p.part[1].dev, 1);
    CHECK_EQ_INT(p.part[1].count, 144);
    CHECK_EQ_INT(d[0].placed, 113 * 88 * MB);
    CHECK_EQ_INT(d[1].placed, 144 * 88 * MB);
    CHECK_EQ_INT(d[0].free, 100 * GB - 113 * 88 * MB);
    CHECK_EQ_INT(d[1].free, 100 * GB - 144 * 88 * MB);
    /* the next layer's home is the lightest in bytes, as ever: entry 0, the same split */
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 0);
    CHECK_EQ_INT(p.part[0].count, 112);
    /* with the second GPU lighter in bytes it is the home, and now it gets 112 */
    devs_init(d, 2, NULL, 100 * GB);
    d[0].placed = 1;
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 1);
    check_cover(&p, 256);
    CHECK_EQ_INT(p.part[0].count, 144);
    CHECK_EQ_INT(p.part[1].count, 112);
    /* where two cuts have the same heaviest entry, the entries listed first take the more: home 1
     * at 2 of 7, the least bound 4 is 4 + (2 + 1) or 3 + (2 + 2), and entry 0 takes 4 */
    devs_init(d, 2, NULL, 100 * GB);
    d[0].placed = 1;
    const moed_place_need t = { 0, 1 * GB, 5, true, 2.0, NULL };
    CHECK(moed_place_layer(d, 2, &t, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 1);
    check_cover(&p, 5);
    CHECK_EQ_INT(p.part[0].count, 4);
    CHECK_EQ_INT(p.part[1].count, 1);
}

/* home_work 0 is the byte split exactly: test_split_asked's inputs give its 126 + 130 and bytes,
 * whereas home_work 32 on them gives 112 + 144. */
static void test_work_zero_is_bytes(void)
{
    moed_place_dev d[2], w[2];
    moed_error err;
    moed_layer_place p, q;
    devs_init(d, 2, NULL, 100 * GB);
    devs_init(w, 2, NULL, 100 * GB);
    const moed_place_need bytes = {
        .base = 4 * 88 * MB, .expert = 88 * MB, .n_experts = 256, .split = true, .home_work = 0
    };
    moed_place_need work = bytes;
    work.home_work = 32;
    for (int rep = 0; rep < 3; rep++) {
        CHECK(moed_place_layer(d, 2, &bytes, &p, &err) == 0);
        CHECK_EQ_INT(p.home, 0);
        CHECK_EQ_INT(p.n_parts, 2);
        check_cover(&p, 256);
        CHECK_EQ_INT(p.part[0].count, 126);
        CHECK_EQ_INT(p.part[1].count, 130);
        CHECK_EQ_INT(d[0].placed, d[1].placed);
        CHECK(moed_place_layer(w, 2, &work, &q, &err) == 0);
        check_cover(&q, 256);
    }
    CHECK_EQ_INT(q.home, 0);
    CHECK_EQ_INT(q.part[0].count, 112);
    CHECK_EQ_INT(q.part[1].count, 144);
    CHECK_EQ_INT(w[0].placed, 3 * 116 * 88 * MB);
    CHECK_EQ_INT(w[1].placed, 3 * 144 * 88 * MB);
    /* the same bytes placed either way in all */
    CHECK_EQ_INT(d[0].placed + d[1].placed, w[0].placed + w[1].placed);
}

/* Four GPUs: the three others take 32 each first, then all four 40 more: home 40 (+32 = 72), the
 * others 72 each. */
static void test_work_four(void)
{
    moed_place_dev d[4];
    moed_error err;
    moed_layer_place p;
    devs_init(d, 4, NULL, 100 * GB);
    const moed_place_need l = { 88 * MB, 88 * MB, 256, true, 32.0, NULL };
    CHECK(moed_place_layer(d, 4, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 0);
    CHECK_EQ_INT(p.n_parts, 4);
    check_cover(&p, 256);
    CHECK_EQ_INT(p.part[0].count, 40);
    for (int i = 1; i < 4; i++) {
        CHECK_EQ_INT(p.part[i].dev, i);
        CHECK_EQ_INT(p.part[i].count, 72);
    }
    /* a fractional home_work, 2.5, and 10 experts: the others take 1, 2, then 3 each (2 < 2.5 <
     * 3), then the home its one (3.5); with 8 experts the home would get none */
    devs_init(d, 4, NULL, 100 * GB);
    const moed_place_need f = { 0, 1 * GB, 10, true, 2.5, NULL };
    CHECK(moed_place_layer(d, 4, &f, &p, &err) == 0);
    check_cover(&p, 10);
    CHECK_EQ_INT(p.home, 0);
    CHECK_EQ_INT(p.n_parts, 4);
    CHECK_EQ_INT(p.part[0].count, 1);
    for (int i = 1; i < 4; i++) CHECK_EQ_INT(p.part[i].count, 3);
}

/* Room binds: a GPU too small for its share of the work takes what fits, the rest go elsewhere;
 * and a small home takes only what fits. */
static void test_work_room(void)
{
    moed_place_dev d[2] = { { 0, 300 * GB, 0 }, { 1, 100 * GB, 0 } };
    moed_error err;
    moed_layer_place p;
    const moed_place_need l = { 4 * GB, 1 * GB, 256, true, 32.0, NULL };
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 0);
    check_cover(&p, 256);
    CHECK_EQ_INT(p.part[0].count, 156); /* 144 would be even; entry 1 holds only 100 */
    CHECK_EQ_INT(p.part[1].count, 100);
    CHECK_EQ_INT(d[1].free, 0);
    CHECK_EQ_INT(d[0].free, 300 * GB - 160 * GB);
    /* the home has room for 46 experts past its base, not 112 */
    moed_place_dev s[2] = { { 0, 50 * GB, 0 }, { 1, 500 * GB, 0 } };
    CHECK(moed_place_layer(s, 2, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 0);
    check_cover(&p, 256);
    CHECK_EQ_INT(p.part[0].count, 46);
    CHECK_EQ_INT(p.part[1].count, 210);
    CHECK_EQ_INT(s[0].free, 0);
    /* too big for any one GPU, not asked: split by work all the same */
    moed_place_dev t[2] = { { 0, 200 * GB, 0 }, { 1, 200 * GB, 0 } };
    const moed_place_need big = { 4 * GB, 1 * GB, 256, false, 32.0, NULL };
    CHECK(moed_place_layer(t, 2, &big, &p, &err) == 0);
    CHECK(moed_place_is_split(&p));
    check_cover(&p, 256);
    CHECK_EQ_INT(p.part[0].count, 112);
    CHECK_EQ_INT(p.part[1].count, 144);
    /* and what fits nowhere is still refused, nothing counted */
    moed_place_dev u[2] = { { 0, 100 * GB, 0 }, { 1, 100 * GB, 0 } };
    const moed_place_dev before[2] = { u[0], u[1] };
    CHECK(moed_place_layer(u, 2, &big, &p, &err) == MOED_ENOMEM);
    CHECK(!memcmp(before, u, sizeof before));
}

/* A home busy enough gets no routed expert: its one part is elsewhere, still a split. */
static void test_work_home_empty(void)
{
    moed_place_dev d[2];
    moed_error err;
    moed_layer_place p;
    devs_init(d, 2, NULL, 10 * GB);
    const moed_place_need l = { 1 * GB, 1 * GB, 6, true, 8.0, NULL };
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 0);
    CHECK_EQ_INT(p.n_parts, 1);
    CHECK_EQ_INT(p.part[0].dev, 1);
    check_cover(&p, 6);
    CHECK(moed_place_is_split(&p));
    CHECK_EQ_INT(d[0].placed, 1 * GB);
    CHECK_EQ_INT(d[1].placed, 6 * GB);
    /* a whole layer ignores home_work: still placed by bytes */
    const moed_place_need whole = { 1 * GB, 1 * GB, 2, false, 8.0, NULL };
    CHECK(moed_place_layer(d, 2, &whole, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 0);
    CHECK(!moed_place_is_split(&p));
}

/* Measured loads: the cut's heaviest entry is the least any contiguous cut over the entries in
 * order can have (brute force over every cut of 3 entries, home 1 at home_work), on skewed loads
 * (zipf-like, a hot expert, zeros); the counts do not depend on the loads' scale; equal loads
 * cut as no loads do. */
static void test_load(void)
{
    enum { E = 40, N = 3 };
    uint64_t s = 99;
    for (int rep = 0; rep < 60; rep++) {
        double load[E], scaled[E], total = 0;
        for (int e = 0; e < E; e++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            const double u = (double)(s >> 11) / 9007199254740992.0;
            load[e] = rep % 3 == 0   ? 1000.0 / ((e + 1) * (e + 1))   /* zipf-like */
                      : rep % 3 == 1 ? (e == rep % E ? 5000 : 10 * u) /* one hot expert */
                                     : (u < 0.3 ? 0 : 100 * u);       /* some never routed */
            scaled[e] = load[e] * 1e6;
            total += load[e];
        }
        const double unit = total / E, home_work = (double)(rep % 4) * 2;
        moed_place_dev d[N], d2[N];
        devs_init(d, N, NULL, 100 * GB);
        devs_init(d2, N, NULL, 100 * GB);
        d[0].placed = d[2].placed = d2[0].placed = d2[2].placed = 1; /* home: entry 1 */
        moed_layer_place p, q;
        moed_error err;
        moed_place_need l = { 0, 1 * GB, E, true, home_work, load };
        CHECK(moed_place_layer(d, N, &l, &p, &err) == 0);
        CHECK_EQ_INT(p.home, 1);
        check_cover(&p, E);
        l.load = scaled;
        CHECK(moed_place_layer(d2, N, &l, &q, &err) == 0);
        CHECK(p.n_parts == q.n_parts);
        for (int i = 0; i < p.n_parts && i < q.n_parts; i++)
            CHECK(p.part[i].dev == q.part[i].dev && p.part[i].count == q.part[i].count);
        /* the heaviest entry of this cut, in units of the mean load */
        double work[N] = { 0, home_work, 0 }, got = 0;
        for (int i = 0; i < p.n_parts; i++)
            for (int e = p.part[i].first; e < p.part[i].first + p.part[i].count; e++)
                work[p.part[i].dev] += load[e] / unit;
        for (int i = 0; i < N; i++) got = work[i] > got ? work[i] : got;
        double best = 1e300;
        for (int a = 0; a <= E; a++)
            for (int b = a; b <= E; b++) {
                double w3[N] = { 0, home_work, 0 };
                for (int e = 0; e < E; e++) w3[e < a ? 0 : e < b ? 1 : 2] += load[e] / unit;
                const double m = w3[0] > w3[1] ? (w3[0] > w3[2] ? w3[0] : w3[2])
                                               : (w3[1] > w3[2] ? w3[1] : w3[2]);
                best = m < best ? m : best;
            }
        CHECK_MSG(got <= best * (1 + 1e-6), "rep %d: heaviest entry %.6f, the best cut %.6f", rep,
                  got, best);
    }
    /* equal loads cut as none: DeepSeek-V3's 112 + 144 */
    double same[256];
    for (int e = 0; e < 256; e++) same[e] = 7;
    moed_place_dev d[2];
    moed_layer_place p;
    moed_error err;
    devs_init(d, 2, NULL, 100 * GB);
    const moed_place_need l = { 88 * MB, 88 * MB, 256, true, 32.0, same };
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 0);
    CHECK_EQ_INT(p.part[0].count, 112);
    CHECK_EQ_INT(p.part[1].count, 144);
    /* a hot first expert alone on its entry, the rest evened out; room still binds */
    double hot[8] = { 70, 10, 10, 10, 10, 10, 10, 10 };
    devs_init(d, 2, NULL, 100 * GB);
    const moed_place_need h = { 0, 1 * GB, 8, true, 0, hot };
    CHECK(moed_place_layer(d, 2, &h, &p, &err) == 0);
    CHECK_EQ_INT(p.part[0].count, 1);
    CHECK_EQ_INT(p.part[1].count, 7);
    devs_init(d, 2, NULL, 100 * GB);
    d[1].free = 5 * GB; /* entry 1 holds 5 at most: entry 0 takes three */
    CHECK(moed_place_layer(d, 2, &h, &p, &err) == 0);
    CHECK_EQ_INT(p.part[0].count, 3);
    CHECK_EQ_INT(p.part[1].count, 5);
}

/* moed_place_costs: rows plus a stream per launch with a pair (at most one a pair); rows alone
 * without launches. A small batch's loads (a pair or two an expert, one launch) then cut as
 * evenly by count as no loads do, where rows alone would put the hot experts' side on few experts;
 * a large batch's (hundreds of rows an expert) cut by rows. */
static void test_costs(void)
{
    const double pairs[5] = { 0, 0.5, 3, 100, 1e6 };
    double c[5];
    moed_place_costs(pairs, 5, 10, 128, c);
    CHECK(c[0] == 0 && c[1] == 0.5 + 64 && c[2] == 3 + 384 && c[3] == 100 + 1280 &&
          c[4] == 1e6 + 1280);
    moed_place_costs(pairs, 5, 0, 128, c);
    for (int e = 0; e < 5; e++) CHECK(c[e] == pairs[e]);
    /* one launch of 64 tokens, top 8 of 64 experts, zipf-like: the 16 hottest experts hold half
     * the pairs, the other 48 one or two each */
    double small[64], cost[64];
    for (int e = 0; e < 64; e++) small[e] = e < 16 ? 16 : e % 3 ? 1 : 2;
    moed_place_costs(small, 64, 1, 128, cost);
    moed_place_dev d[2];
    moed_layer_place by_rows, by_cost;
    moed_error err;
    devs_init(d, 2, NULL, 100 * GB);
    moed_place_need l = { 0, 1 * GB, 64, true, 0, small };
    CHECK(moed_place_layer(d, 2, &l, &by_rows, &err) == 0);
    devs_init(d, 2, NULL, 100 * GB);
    l.load = cost;
    CHECK(moed_place_layer(d, 2, &l, &by_cost, &err) == 0);
    CHECK_MSG(by_rows.part[0].count < 24, "by rows the hot side holds %d experts",
              by_rows.part[0].count);
    CHECK_MSG(by_cost.part[0].count >= 30 && by_cost.part[0].count <= 34,
              "by cost the first device holds %d of 64 experts, not about half",
              by_cost.part[0].count);
}

/* moed_place_shared_work: width x (E / k + 1) / 2; DeepSeek-V3's cut on two GPUs with it. Checked
 * against moed_place_costs at the batch it names (T = stream_rows x E / k): a routed expert's
 * rows and stream there cost 2 x stream_rows, the shared experts' T x width rows and their stream
 * width x (T + stream_rows). */
static void test_shared_work(void)
{
    CHECK(moed_place_shared_work(1, 256, 8) == 16.5);
    CHECK(moed_place_shared_work(2, 64, 8) == 9);
    CHECK(moed_place_shared_work(1, 64, 0) == 0);
    const double stream = 128, E = 256, k = 8, T = stream * E / k, width = 1.5;
    double pairs = T * k / E, routed;
    moed_place_costs(&pairs, 1, 1, stream, &routed);
    CHECK(routed == 2 * stream);
    CHECK(moed_place_shared_work(width, 256, 8) == width * (T + stream) / routed);
    moed_place_dev d[2];
    moed_layer_place p;
    moed_error err;
    devs_init(d, 2, NULL, 100 * GB);
    const moed_place_need l = {
        88 * MB, 88 * MB, 256, true, moed_place_shared_work(1, 256, 8), NULL
    };
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 0);
    CHECK_EQ_INT(p.part[0].count, 120);
    CHECK_EQ_INT(p.part[1].count, 136);
}

/* moed_place_shared_work_measured against the arithmetic done by hand: DeepSeek-V3's one shared
 * expert (256 experts, top 8) over one launch of T = 64 (2 pairs an expert: each costs 2 + 128
 * rows, the shared one 64 + 128) and of T = 16384 (512 + 128 against 16384 + 128); an expert shard
 * holding a quarter of the experts counts the tokens of the whole layer; unknown launches or no
 * pair say -1; and the cut it gives small batches is near the bytes' one. */
static void test_shared_work_measured(void)
{
    double pairs[256];
    for (int e = 0; e < 256; e++) pairs[e] = 2;
    CHECK(fabs(moed_place_shared_work_measured(1, pairs, 256, 256, 8, 1, 128) - 192.0 / 130) <
          1e-12);
    CHECK(fabs(moed_place_shared_work_measured(1, pairs, 64, 256, 8, 1, 128) - 192.0 / 130) <
          1e-12);
    CHECK(moed_place_shared_work_measured(1, pairs, 256, 256, 8, 0, 128) == -1);
    for (int e = 0; e < 256; e++) pairs[e] = 512;
    CHECK(fabs(moed_place_shared_work_measured(1, pairs, 256, 256, 8, 1, 128) - 16512.0 / 640) <
          1e-12);
    for (int e = 0; e < 256; e++) pairs[e] = 0;
    CHECK(moed_place_shared_work_measured(1, pairs, 256, 256, 8, 1, 128) == -1);
    moed_place_dev d[2];
    moed_layer_place p;
    moed_error err;
    devs_init(d, 2, NULL, 100 * GB);
    const moed_place_need l = { 88 * MB, 88 * MB, 256, true, 192.0 / 130, NULL };
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.part[0].count, 127);
}

/* A cut of E experts given as counts per entry (0: no part there), with home h. */
static moed_layer_place cut_of(const int *count, int n, int home)
{
    moed_layer_place p = { .home = home };
    for (int i = 0, first = 0; i < n; first += count[i++])
        if (count[i]) p.part[p.n_parts++] = (moed_place_part){ i, first, count[i] };
    return p;
}

/* moed_place_copy_cost: moed_place_costs of the copy's share of the pairs; moed_place_peak: each
 * entry's copies and the home's work (home_work x the mean cost of one copy of each expert). */
static void test_copy_cost_and_peak(void)
{
    const double pairs[4] = { 300, 10, 0, 2 };
    const moed_place_load ld = { pairs, 4, 10, 128, 2.0 };
    CHECK(moed_place_copy_cost(&ld, 0, 1) == 300 + 1280);
    CHECK(moed_place_copy_cost(&ld, 0, 2) == 150 + 1280);
    CHECK(moed_place_copy_cost(&ld, 0, 100) == 3 + 384);
    CHECK(moed_place_copy_cost(&ld, 2, 3) == 0);
    const int count[3] = { 1, 0, 3 };
    moed_layer_place p = cut_of(count, 3, 1);
    p.replica[p.n_replicas++] = (moed_place_replica){ 0, 1 };
    double work[3];
    const double mean = (300 + 1280 + 10 + 1280 + 0 + 2 + 256) / 4.0;
    const double peak = moed_place_peak(&p, 3, &ld, work);
    CHECK_NEAR(work[0], 150 + 1280, 1e-9);
    CHECK_NEAR(work[1], 150 + 1280 + 2 * mean, 1e-9);
    CHECK_NEAR(work[2], 10 + 1280 + 2 + 256, 1e-9);
    CHECK_NEAR(peak, work[1], 1e-9);
}

/* Hand cases of the greedy copies: a hot expert copied to the light entry once (a second copy has
 * nowhere to go); none without budget or room; two entries tied at the peak get a copy each or,
 * with a budget of one, none (one copy alone would not lower the peak). */
static void test_replicate_by_hand(void)
{
    const double hot[4] = { 100, 10, 10, 10 };
    const moed_place_load ld = { hot, 4, 0, 128, 0 };
    const int count[2] = { 2, 2 };
    moed_place_dev d[4];
    devs_init(d, 2, NULL, 100 * GB);
    moed_layer_place p = cut_of(count, 2, 0);
    CHECK_NEAR(moed_place_peak(&p, 2, &ld, NULL), 110, 1e-9);
    CHECK_EQ_INT(moed_place_replicate(&p, d, 2, 1 * GB, &ld, 8), 1);
    CHECK_EQ_INT(p.n_replicas, 1);
    CHECK(p.replica[0].expert == 0 && p.replica[0].dev == 1);
    CHECK_NEAR(moed_place_peak(&p, 2, &ld, NULL), 70, 1e-9);
    CHECK_EQ_INT(d[1].placed, 1 * GB);
    CHECK_EQ_INT(d[1].free, 99 * GB);
    CHECK_EQ_INT(d[0].free, 100 * GB);
    /* no budget, no room (entry 1's GPU short by a byte), or the only other entry on one GPU with
     * no room */
    p = cut_of(count, 2, 0);
    devs_init(d, 2, NULL, 100 * GB);
    CHECK_EQ_INT(moed_place_replicate(&p, d, 2, 1 * GB, &ld, 0), 0);
    d[1].free = 1 * GB - 1;
    CHECK_EQ_INT(moed_place_replicate(&p, d, 2, 1 * GB, &ld, 8), 0);
    CHECK_EQ_INT(p.n_replicas, 0);
    CHECK_EQ_INT(d[1].free, 1 * GB - 1);
    const int same[2] = { 0, 0 };
    devs_init(d, 2, same, 100 * GB);
    d[0].free = d[1].free = 1 * GB;
    CHECK_EQ_INT(moed_place_replicate(&p, d, 2, 1 * GB, &ld, 8), 1);
    CHECK_EQ_INT(d[0].free, 0); /* one GPU: both entries' room spent */
    /* ties: e0 and e1 hot on entries 0 and 1, entries 2 and 3 idle */
    const double two[4] = { 100, 100, 0, 0 };
    const moed_place_load l2 = { two, 4, 0, 128, 0 };
    const int one_each[4] = { 1, 1, 1, 1 };
    devs_init(d, 4, NULL, 100 * GB);
    p = cut_of(one_each, 4, 0);
    CHECK_EQ_INT(moed_place_replicate(&p, d, 4, 1 * GB, &l2, 1), 0);
    CHECK_EQ_INT(d[2].placed + d[3].placed, 0); /* the copy tried is given back */
    CHECK_EQ_INT(moed_place_replicate(&p, d, 4, 1 * GB, &l2, 2), 2);
    CHECK(p.replica[0].expert == 0 && p.replica[0].dev == 2);
    CHECK(p.replica[1].expert == 1 && p.replica[1].dev == 3);
    CHECK_NEAR(moed_place_peak(&p, 4, &l2, NULL), 50, 1e-9);
    /* a copy only where it helps: even load gains nothing from any copy */
    const double even[4] = { 10, 10, 10, 10 };
    const moed_place_load le = { even, 4, 0, 128, 0 };
    devs_init(d, 2, NULL, 100 * GB);
    p = cut_of(count, 2, 0);
    CHECK_EQ_INT(moed_place_replicate(&p, d, 2, 1 * GB, &le, 8), 0);
}

/* The least peak any set of at most `budget` copies reaches within room (brute force over every
 * (expert, entry) a copy may go to, from the `from`-th on). */
static double best_copies(moed_layer_place *p, const moed_place_dev *d, int n, uint64_t bytes,
                          const moed_place_load *ld, int budget, int from)
{
    double best = moed_place_peak(p, n, ld, NULL);
    if (!budget) return best;
    for (int c = from; c < ld->n_experts * n; c++) {
        const int e = c / n, i = c % n;
        bool held = false;
        for (int q = 0; q < p->n_parts; q++)
            held |= p->part[q].dev == i && e >= p->part[q].first &&
                    e < p->part[q].first + p->part[q].count;
        for (int r = 0; r < p->n_replicas; r++)
            held |= p->replica[r].expert == e && p->replica[r].dev == i;
        uint64_t used = bytes; /* this copy and the others on i's GPU */
        for (int r = 0; r < p->n_replicas; r++)
            used += d[p->replica[r].dev].gpu == d[i].gpu ? bytes : 0;
        if (held || used > d[i].free) continue;
        p->replica[p->n_replicas++] = (moed_place_replica){ e, i };
        const double m = best_copies(p, d, n, bytes, ld, budget - 1, c + 1);
        p->n_replicas--;
        best = m < best ? m : best;
    }
    return best;
}

/* Random loads, cuts and room against brute force: never over the budget or the room (the devs'
 * counts are the copies' bytes), a copy on an entry that already holds its expert never, sorted,
 * deterministic; the peak never above the cut's, and copies made only where some set of copies
 * lowers the peak (strictly lower with them); the greedy's peak against the best set's, reported.
 */
static void test_replicate_brute(void)
{
    enum { E = 5, N = 3 };
    uint64_t s = 7;
    double worst = 1;
    for (int rep = 0; rep < 300; rep++) {
        double pairs[E], u[E + N + 2];
        for (int i = 0; i < E + N + 2; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            u[i] = (double)(s >> 11) / 9007199254740992.0;
        }
        for (int e = 0; e < E; e++)
            pairs[e] = rep % 2 ? 1000 * u[e] * u[e] * u[e] : (u[e] < 0.3 ? 500 * u[e] : u[e]);
        const moed_place_load ld = { pairs, E, rep % 3 ? 20 * u[E] : 0, 128, rep % 4 ? 0 : 1.5 };
        int count[N] = { 0 }, left = E;
        for (int i = 0; i < N - 1; i++) {
            count[i] = (int)(u[E + 1 + i] * (left + 1));
            left -= count[i];
        }
        count[N - 1] = left;
        moed_place_dev d[N], d0[N];
        const int gpus[N] = { 0, 1, rep % 5 == 0 ? 1 : 2 };
        devs_init(d, N, gpus, 3 * GB);
        d[0].free = (uint64_t)(rep % 3) * GB;
        if (gpus[2] == 1) d[2].free = d[1].free;
        memcpy(d0, d, sizeof d);
        const int budget = rep % 3;
        moed_layer_place p = cut_of(count, N, rep % N), q = p, b = p;
        const double before = moed_place_peak(&p, N, &ld, NULL);
        const int added = moed_place_replicate(&p, d, N, 1 * GB, &ld, budget);
        CHECK(added >= 0 && added <= budget && added == p.n_replicas);
        moed_place_dev d2[N];
        memcpy(d2, d0, sizeof d2);
        CHECK_EQ_INT(moed_place_replicate(&q, d2, N, 1 * GB, &ld, budget), added);
        CHECK(!memcmp(&p, &q, sizeof p) && !memcmp(d, d2, sizeof d));
        for (int i = 0; i < N; i++) {
            uint64_t mine = 0, gpu = 0;
            for (int r = 0; r < p.n_replicas; r++) {
                mine += p.replica[r].dev == i ? 1 * GB : 0;
                gpu += d[p.replica[r].dev].gpu == d[i].gpu ? 1 * GB : 0;
            }
            CHECK_EQ_INT(d[i].placed, mine);
            CHECK(gpu <= d0[i].free && d[i].free == d0[i].free - gpu);
        }
        for (int r = 0; r < p.n_replicas; r++) {
            const moed_place_replica *c = &p.replica[r];
            for (int k = 0; k < p.n_parts; k++)
                CHECK(!(p.part[k].dev == c->dev && c->expert >= p.part[k].first &&
                        c->expert < p.part[k].first + p.part[k].count));
            if (r)
                CHECK(p.replica[r - 1].expert < c->expert ||
                      (p.replica[r - 1].expert == c->expert && p.replica[r - 1].dev < c->dev));
        }
        const double after = moed_place_peak(&p, N, &ld, NULL),
                     best = best_copies(&b, d0, N, 1 * GB, &ld, budget, 0);
        CHECK(after <= before);
        CHECK(best <= after * (1 + 1e-12));
        CHECK_MSG(added == 0 || after < before, "rep %d: %d copies and the peak %g stays %g", rep,
                  added, after, before);
        CHECK_MSG(best < before || added == 0, "rep %d: %d copies where none helps", rep, added);
        if (after > 0 && before > 0) worst = fmax(worst, after / best);
    }
    fprintf(stderr, "  greedy copies: peak at most %.3f x the best set's\n", worst);
}

/* moed_place_recut: the home kept, the cut moed_place_layer makes around that home; room binds;
 * too little room is MOED_ENOMEM. */
static void test_recut(void)
{
    double load[8] = { 70, 10, 10, 10, 10, 10, 10, 10 };
    moed_place_dev d[2], d2[2];
    moed_layer_place p, q;
    moed_error err;
    devs_init(d, 2, NULL, 100 * GB);
    devs_init(d2, 2, NULL, 100 * GB);
    d[0].placed = 1; /* moed_place_layer's home: entry 1 */
    const moed_place_need l = { 0, 1 * GB, 8, true, 2.0, load };
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.home, 1);
    CHECK(moed_place_recut(d2, 2, &l, 1, &q, &err) == 0);
    CHECK_EQ_INT(q.home, 1);
    CHECK_EQ_INT(q.n_parts, p.n_parts);
    for (int i = 0; i < p.n_parts; i++)
        CHECK(p.part[i].dev == q.part[i].dev && p.part[i].count == q.part[i].count);
    CHECK_EQ_INT(d2[0].placed + d2[1].placed, 8 * GB);
    devs_init(d2, 2, NULL, 3 * GB);
    CHECK(moed_place_recut(d2, 2, &l, 0, &q, &err) == MOED_ENOMEM);
    CHECK(strstr(err.msg, "8 experts") != NULL);
    CHECK_EQ_INT(d2[0].placed, 0);
}

/* The parts a placement runs and their local numbering: entries with a range or copies, in order;
 * a part's range first, then its copies in placement order; each expert's copies, its range's
 * first. */
static void test_parts_and_copies(void)
{
    const int count[4] = { 3, 0, 2, 0 };
    moed_layer_place p = cut_of(count, 4, 0);
    p.replica[p.n_replicas++] = (moed_place_replica){ 0, 1 };
    p.replica[p.n_replicas++] = (moed_place_replica){ 0, 2 };
    p.replica[p.n_replicas++] = (moed_place_replica){ 4, 0 };
    p.replica[p.n_replicas++] = (moed_place_replica){ 4, 1 };
    int dev[MOED_PLACE_MAX], ids[8];
    CHECK_EQ_INT(moed_place_parts(&p, dev), 3);
    CHECK(dev[0] == 0 && dev[1] == 1 && dev[2] == 2);
    CHECK_EQ_INT(moed_place_entry_experts(&p, 0, ids), 4);
    CHECK(ids[0] == 0 && ids[1] == 1 && ids[2] == 2 && ids[3] == 4);
    CHECK_EQ_INT(moed_place_entry_experts(&p, 1, ids), 2);
    CHECK(ids[0] == 0 && ids[1] == 4);
    CHECK_EQ_INT(moed_place_entry_experts(&p, 2, ids), 3);
    CHECK(ids[0] == 3 && ids[1] == 4 && ids[2] == 0);
    CHECK_EQ_INT(moed_place_entry_experts(&p, 3, ids), 0);
    int32_t off[6], local[9];
    uint8_t part[9];
    moed_place_copies(&p, 5, off, part, local);
    const int32_t want_off[6] = { 0, 3, 4, 5, 6, 9 };
    CHECK(!memcmp(off, want_off, sizeof off));
    /* expert 0: part 0 (local 0), part 1 (0), part 2 (2); expert 4: part 2 (1), part 0 (3),
     * part 1 (1) */
    const uint8_t want_part[9] = { 0, 1, 2, 0, 0, 2, 2, 0, 1 };
    const int32_t want_local[9] = { 0, 0, 2, 1, 2, 0, 1, 3, 1 };
    CHECK(!memcmp(part, want_part, sizeof part));
    CHECK(!memcmp(local, want_local, sizeof local));
}

int main(void)
{
    test_whole_by_bytes();
    test_whole_skips_full();
    test_split_asked();
    test_split_when_too_big();
    test_one_device();
    test_same_gpu_twice();
    test_few_experts();
    test_work_two();
    test_work_zero_is_bytes();
    test_work_four();
    test_work_room();
    test_work_home_empty();
    test_load();
    test_costs();
    test_shared_work();
    test_shared_work_measured();
    test_copy_cost_and_peak();
    test_replicate_by_hand();
    test_replicate_brute();
    test_recut();
    test_parts_and_copies();
    return check_status("test_place");
}
