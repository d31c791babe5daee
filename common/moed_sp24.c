/* moed_sp24 — see moed_sp24.h. */
#include "moed_sp24.h"

#include "moed_dtype.h"

#include <math.h>
#include <string.h>

static float value(const void *w, int dtype, int64_t i)
{
    switch (dtype) {
    case MOED_F32:
        return ((const float *)w)[i];
    case MOED_F16:
        return moed_f16_to_f32(((const uint16_t *)w)[i]);
    default:
        return moed_bf16_to_f32(((const uint16_t *)w)[i]);
    }
}

/* Whether element a outranks element b: a larger magnitude, a NaN above every number (moed_sp24.h).
 * Strict, so of two equal ones the one scanned first stays. */
static bool outranks(const void *w, int dtype, int64_t a, int64_t b)
{
    const float va = value(w, dtype, a), vb = value(w, dtype, b);
    const bool na = isnan(va), nb = isnan(vb);
    if (na || nb) return na && !nb;
    return fabsf(va) > fabsf(vb);
}

static void set_zero(void *w, int dtype, int64_t i)
{
    if (dtype == MOED_F32)
        ((float *)w)[i] = 0.0f;
    else
        ((uint16_t *)w)[i] = 0;
}

static bool is_nonzero(const void *w, int dtype, int64_t i)
{
    if (dtype == MOED_F32) {
        uint32_t u;
        memcpy(&u, (const float *)w + i, 4);
        return (u & 0x7fffffffu) != 0;
    }
    return (((const uint16_t *)w)[i] & 0x7fffu) != 0;
}

static bool takes(int dtype)
{
    return dtype == MOED_F32 || dtype == MOED_F16 || dtype == MOED_BF16;
}

int moed_sp24_prune(void *w, int dtype, int64_t rows, int64_t cols)
{
    if (!takes(dtype)) return MOED_EINVAL;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c0 = 0; c0 < cols; c0 += 4) {
            const int64_t base = r * cols + c0;
            const int n = cols - c0 < 4 ? (int)(cols - c0) : 4;
            if (n <= 2) continue;
            /* The two kept: the first and second in rank, scanning in index order so that an
             * equal magnitude never displaces an earlier index. */
            int first = 0, second = -1;
            for (int i = 1; i < n; i++) {
                if (outranks(w, dtype, base + i, base + first)) {
                    second = first;
                    first = i;
                } else if (second < 0 || outranks(w, dtype, base + i, base + second)) {
                    second = i;
                }
            }
            for (int i = 0; i < n; i++)
                if (i != first && i != second) set_zero(w, dtype, base + i);
        }
    }
    return 0;
}

bool moed_sp24_check(const void *w, int dtype, int64_t rows, int64_t cols, int64_t *bad_row,
                     int64_t *bad_col)
{
    if (!takes(dtype)) return false;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c0 = 0; c0 < cols; c0 += 4) {
            const int n = cols - c0 < 4 ? (int)(cols - c0) : 4;
            int nz = 0;
            for (int i = 0; i < n; i++) nz += is_nonzero(w, dtype, r * cols + c0 + i);
            if (nz > 2) {
                if (bad_row) *bad_row = r;
                if (bad_col) *bad_col = c0;
                return false;
            }
        }
    }
    return true;
}
