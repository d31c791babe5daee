/*
 * test_place — the placement planner (moed_place.h): whole layers by bytes, not round-robin; a
 * split layer's ranges contiguous, covering, and even in bytes; a layer larger than any one device
 * split by itself; one that fits nowhere refused with its size; two entries of one GPU sharing its
 * free memory. The CUDA backend places with this same function.
 */
#include "check.h"

#include "moed_place.h"

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
    const moed_place_need big = { 0, 1 * GB, 8, false }, small = { 0, 1 * GB, 2, false };
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
    const moed_place_need l = { 0, 1 * GB, 4, false };
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
    const moed_place_need l = { 4 * 88 * MB, 88 * MB, 256, true };
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
    const moed_place_need l = { 1 * GB, 1 * GB, 24, false }; /* 25 GB over 3 x 10 GB */
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
    const moed_place_need l2 = { 1 * GB, 1 * GB, 8, false };
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
    const moed_place_need big = { 0, 1 * GB, 5, false }, fits = { 0, 1 * GB, 3, true };
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
    const moed_place_need l = { 0, 1 * GB, 6, true };
    CHECK(moed_place_layer(d, 2, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.n_parts, 2);
    CHECK_EQ_INT(p.part[0].count, 3);
    CHECK_EQ_INT(p.part[1].count, 3);
    CHECK_EQ_INT(d[0].free, 4 * GB);
    CHECK_EQ_INT(d[1].free, 4 * GB);
    /* 4 GB left on the GPU, whichever entry: a 5-expert layer fits nowhere */
    const moed_place_need l2 = { 0, 1 * GB, 5, true };
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
    const moed_place_need l = { 0, 1 * GB, 2, true };
    CHECK(moed_place_layer(d, 4, &l, &p, &err) == 0);
    CHECK_EQ_INT(p.n_parts, 2);
    check_cover(&p, 2);
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
    return check_status("test_place");
}
