/*
 * test_sp24 — the 2:4 pruning rule and check of moed_sp24.h: the kept pair of each group against
 * an independent choice (the pair of largest magnitude sum, the lower indices on ties, found by
 * trying all six pairs) over random groups in every dtype, ties, NaN, a partial last group, and the
 * check's report of the first group that is not 2:4.
 */
#include "check.h"
#include "moed_dtype.h"
#include "moed_sp24.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static uint64_t rng = 7;

static uint32_t next(void)
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng >> 33);
}

/* The independent rule for one group: rank the four by magnitude (descending), then index
 * (ascending), and keep the top two: an element is kept when fewer than two others beat it. */
static int kept_mask(const double m[4])
{
    int mask = 0;
    for (int i = 0; i < 4; i++) {
        int beaten = 0;
        for (int j = 0; j < 4; j++)
            if (j != i && (m[j] > m[i] || (m[j] == m[i] && j < i))) beaten++;
        if (beaten < 2) mask |= 1 << i;
    }
    return mask;
}

static double mag(double v)
{
    return fabs(v); /* the random groups hold no NaN */
}

static void test_random_groups(int dtype)
{
    enum { ROWS = 37, COLS = 64 };
    static float src[ROWS * COLS];
    static uint16_t h[ROWS * COLS];
    for (int i = 0; i < ROWS * COLS; i++) {
        /* Few distinct magnitudes, so ties and equal values of opposite sign are common. */
        src[i] = (float)((int)(next() % 9) - 4) * 0.25f;
    }
    void *w = src;
    if (dtype != MOED_F32) {
        moed_from_f32(dtype, src, h, ROWS * COLS);
        w = h;
    }
    float before[ROWS * COLS], after[ROWS * COLS];
    moed_to_f32(dtype, w, before, ROWS * COLS);
    CHECK_EQ_INT(moed_sp24_prune(w, dtype, ROWS, COLS), 0);
    moed_to_f32(dtype, w, after, ROWS * COLS);
    for (int g = 0; g < ROWS * COLS / 4; g++) {
        double m[4];
        for (int i = 0; i < 4; i++) m[i] = mag(before[4 * g + i]);
        const int mask = kept_mask(m);
        for (int i = 0; i < 4; i++) {
            const float want = (mask >> i) & 1 ? before[4 * g + i] : 0.0f;
            CHECK_MSG(after[4 * g + i] == want && !signbit(after[4 * g + i]) == !signbit(want),
                      "%s group %d element %d: %g, want %g", moed_dtype_name(dtype), g, i,
                      after[4 * g + i], want);
        }
    }
    CHECK(moed_sp24_check(w, dtype, ROWS, COLS, NULL, NULL));
}

static void test_nan_and_partial_group(void)
{
    /* A NaN outranks infinity; a row of 7: groups {0..3} and {4,5,6} (read as padded with a zero,
     * so its two largest stay). */
    float w[7] = { 1.0f, NAN, -INFINITY, 2.0f, 3.0f, -5.0f, 4.0f };
    CHECK_EQ_INT(moed_sp24_prune(w, MOED_F32, 1, 7), 0);
    CHECK(w[0] == 0.0f && isnan(w[1]) && isinf(w[2]) && w[3] == 0.0f);
    CHECK(w[4] == 0.0f && w[5] == -5.0f && w[6] == 4.0f);
    /* Rows of at most two values are already 2:4. */
    float two[2] = { 1.0f, 2.0f };
    CHECK_EQ_INT(moed_sp24_prune(two, MOED_F32, 1, 2), 0);
    CHECK(two[0] == 1.0f && two[1] == 2.0f);
}

static void test_check_reports_first_bad_group(void)
{
    float w[2 * 8] = { 0 };
    w[0] = 1, w[1] = 2;                /* row 0 group 0: two, fine */
    w[8 + 4] = -0.0f, w[8 + 5] = 1.0f; /* a negative zero counts as zero */
    w[8 + 6] = 2.0f;
    CHECK(moed_sp24_check(w, MOED_F32, 2, 8, NULL, NULL));
    w[8 + 7] = 3.0f; /* row 1 group 1 now holds three */
    int64_t r = -1, c = -1;
    CHECK(!moed_sp24_check(w, MOED_F32, 2, 8, &r, &c));
    CHECK_EQ_INT(r, 1);
    CHECK_EQ_INT(c, 4);
    CHECK_EQ_INT(moed_sp24_prune(w, MOED_FP8, 2, 8), MOED_EINVAL);
    CHECK(!moed_sp24_check(w, MOED_I32, 2, 8, NULL, NULL));
}

int main(void)
{
    test_random_groups(MOED_F32);
    test_random_groups(MOED_F16);
    test_random_groups(MOED_BF16);
    test_nan_and_partial_group();
    test_check_reports_first_bad_group();
    return check_status("test_sp24");
}
