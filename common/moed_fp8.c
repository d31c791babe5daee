/*
 * moed_fp8 — the block quantizer and the scale check (moed_fp8.h defines both to the bit).
 */
#include "moed_fp8.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

int64_t moed_fp8_quantize_band(const float *v, int rows, int64_t cols, uint8_t *q, float *scale)
{
    for (int64_t c0 = 0; c0 < cols; c0 += MOED_FP8_BLOCK) {
        const int64_t c1 = c0 + MOED_FP8_BLOCK < cols ? c0 + MOED_FP8_BLOCK : cols;
        float amax = 0.0f;
        for (int r = 0; r < rows; r++)
            for (int64_t c = c0; c < c1; c++) {
                const float x = v[r * cols + c];
                if (!isfinite(x)) return r * cols + c;
                if (fabsf(x) > amax) amax = fabsf(x);
            }
        float s = amax / MOED_FP8_MAX;
        if (s == 0.0f) s = 1.0f;
        scale[c0 / MOED_FP8_BLOCK] = s;
        for (int r = 0; r < rows; r++)
            for (int64_t c = c0; c < c1; c++)
                q[r * cols + c] = moed_f32_to_e4m3(v[r * cols + c] / s);
    }
    return -1;
}

int moed_fp8_quantize(const void *src, int dtype, int64_t rows, int64_t cols, uint8_t *q,
                      float *scale, int64_t *bad_out)
{
    const size_t es = moed_dtype_size(dtype);
    float *band = dtype == MOED_F32 ? NULL : malloc(sizeof(float) * MOED_FP8_BLOCK * (size_t)cols);
    if (dtype != MOED_F32 && !band) return MOED_ENOMEM;
    int64_t bad = -1;
    for (int64_t r0 = 0; r0 < rows && bad < 0; r0 += MOED_FP8_BLOCK) {
        const int n = (int)(rows - r0 < MOED_FP8_BLOCK ? rows - r0 : MOED_FP8_BLOCK);
        const char *s = (const char *)src + (size_t)(r0 * cols) * es;
        const float *v = (const float *)s;
        if (band) {
            moed_to_f32(dtype, s, band, (size_t)n * (size_t)cols);
            v = band;
        }
        bad = moed_fp8_quantize_band(v, n, cols, q + r0 * cols,
                                     scale + (r0 / MOED_FP8_BLOCK) * moed_fp8_blocks(cols));
        if (bad >= 0) bad += r0 * cols;
    }
    free(band);
    *bad_out = bad;
    return bad < 0 ? 0 : MOED_EINVAL;
}

float moed_fp8_scale_max(int64_t cols)
{
    const double exact = (double)FLT_MAX / ((double)MOED_FP8_MAX * (double)(cols > 0 ? cols : 1));
    const float max = (float)exact;
    return (double)max > exact ? nextafterf(max, 0.0f) : max;
}

int64_t moed_fp8_check_scales(const float *scale, int64_t n, int64_t cols)
{
    const float max = moed_fp8_scale_max(cols);
    for (int64_t i = 0; i < n; i++)
        if (!(scale[i] > 0.0f && scale[i] <= max)) return i; /* NaN fails both */
    return -1;
}
