/*
 * test_sp24_pack — the CUDA backend's 2:4 packer (kernels/cuda/sp24_pack.c), on the CPU: pruned
 * bf16 and f16 matrices (moed_sp24_prune, with groups of no, one and two non-zeros at every
 * position mixed in) packed, then read back two ways: moed_cuda_sp24_unpack must give the pruned
 * matrix bit for bit, and an independent reading of the metadata in the order the kernel's lanes
 * hand it to mma.sp (moed_cuda.h: 16 rows and 128 of K a block, a uint2 a lane; lane 4g + t's word
 * j is K step 2j + (t >> 1), its 16-wide half t & 1, rows g and g + 8 in its low and high halves)
 * must find every non-zero at its place, with indices that increase within each group; a group of
 * three non-zeros must be refused where it is.
 */
#include "check.h"
#include "moed_cuda.h"
#include "moed_dtype.h"
#include "moed_err.h"
#include "moed_sp24.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { ROWS = 48, K = 384 };

static uint64_t rng = 11;

static uint32_t next(void)
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng >> 33);
}

/* A pruned [ROWS, K] matrix of dtype: random values, then every group pruned to two, and some
 * groups emptied to none or one non-zero (each position in turn), as padding and pruning leave
 * them. */
static void make_pruned(int dtype, uint16_t *w)
{
    static float f[ROWS * K];
    for (int i = 0; i < ROWS * K; i++) f[i] = (float)((int)(next() % 2001) - 1000) / 256.0f;
    for (int i = 0; i < ROWS * K; i++)
        if (f[i] == 0.0f) f[i] = 1.0f; /* the group kinds below are what zeros there are */
    moed_from_f32(dtype, f, w, ROWS * K);
    CHECK_EQ_INT(moed_sp24_prune(w, dtype, ROWS, K), 0);
    for (int g = 0; g < ROWS * K / 4; g++) {
        uint16_t *q = w + 4 * g;
        const int kind = (int)(next() % 8);
        if (kind == 0) memset(q, 0, 8); /* no non-zero */
        if (kind >= 1 && kind <= 4) {   /* one, at position kind - 1 */
            const uint16_t keep = q[0] ? q[0] : q[1] ? q[1] : q[2] ? q[2] : q[3];
            memset(q, 0, 8);
            q[kind - 1] = keep;
        }
    }
}

/* The metadata read as mma.sp takes it from the kernel's lanes, independently of
 * sp24_pack.c's own indexing: the values each 16-bit half places must be the row's non-zeros and
 * nothing else. */
static void check_lane_order(const uint16_t *w, const uint16_t *vals, const uint16_t *meta)
{
    int bad = 0;
    size_t at = 0; /* 32-bit words */
    for (int rb = 0; rb < ROWS / 16; rb++)
        for (int kb = 0; kb < K / 128; kb++)
            for (int lane = 0; lane < 32; lane++)
                for (int j = 0; j < 2; j++, at++)
                    for (int half = 0; half < 2; half++) {
                        const int g = lane / 4, t = lane % 4;
                        const int row = 16 * rb + g + 8 * half, step = 4 * kb + 2 * j + t / 2;
                        const unsigned bits = meta[2 * at + half];
                        for (int q = 0; q < 4; q++) {
                            const int c0 = 32 * step + 16 * (t & 1) + 4 * q;
                            const unsigned i0 = (bits >> (4 * q)) & 3u,
                                           i1 = (bits >> (4 * q + 2)) & 3u;
                            const uint16_t *grp = w + (size_t)row * K + c0;
                            const uint16_t *kept = vals + (size_t)row * (K / 2) + c0 / 2;
                            int ok = i0 < i1 && kept[0] == grp[i0] && kept[1] == grp[i1];
                            for (unsigned i = 0; i < 4; i++)
                                if (i != i0 && i != i1 && (grp[i] & 0x7fffu)) ok = 0;
                            if (!ok && bad++ < 5)
                                fprintf(stderr,
                                        "lane %d word %d half %d (row %d, K %d..%d) reads "
                                        "indices %u, %u\n",
                                        lane, j, half, row, c0, c0 + 3, i0, i1);
                        }
                    }
    CHECK_EQ_INT(at, MOED_CUDA_SP24_META_WORDS(ROWS, K));
    CHECK_EQ_INT(bad, 0);
}

static void test_round_trip(int dtype)
{
    static uint16_t w[ROWS * K], back[ROWS * K], vals[ROWS * K / 2], meta[ROWS * K / 16];
    make_pruned(dtype, w);
    CHECK(moed_sp24_check(w, dtype, ROWS, K, NULL, NULL));
    int64_t br = -1, bc = -1;
    CHECK_EQ_INT(moed_cuda_sp24_pack(w, ROWS, K, vals, meta, &br, &bc), 0);
    moed_cuda_sp24_unpack(vals, meta, ROWS, K, back);
    CHECK_MSG(!memcmp(w, back, sizeof w), "%s: unpacked matrix differs from the pruned one",
              moed_dtype_name(dtype));
    check_lane_order(w, vals, meta);
}

/* A group of three non-zeros fails, named by its row and first column; a negative zero counts as
 * zero. */
static void test_refused(void)
{
    static uint16_t w[ROWS * K], vals[ROWS * K / 2], meta[ROWS * K / 16];
    make_pruned(MOED_BF16, w);
    uint16_t *q = w + 17 * K + 64;
    q[0] = 0x3f80; /* 1.0 */
    q[1] = 0x8000; /* -0: still a zero */
    q[2] = 0x4000; /* 2.0 */
    q[3] = 0x0000;
    int64_t br = -1, bc = -1;
    CHECK_EQ_INT(moed_cuda_sp24_pack(w, ROWS, K, vals, meta, &br, &bc), 0);
    q[3] = 0xbf80; /* -1.0: the third non-zero */
    CHECK_EQ_INT(moed_cuda_sp24_pack(w, ROWS, K, vals, meta, &br, &bc), MOED_EINVAL);
    CHECK_EQ_INT(br, 17);
    CHECK_EQ_INT(bc, 64);
}

int main(void)
{
    test_round_trip(MOED_BF16);
    test_round_trip(MOED_F16);
    test_refused();
    return check_status("test_sp24_pack");
}
