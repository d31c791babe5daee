/*
 * moed_fp8 — block-scaled e4m3 weights, as DeepSeek-V3, R1, Kimi-K2 and the Qwen3 -FP8 releases
 * ship them: each [rows, cols] weight matrix in e4m3 (moed_dtype.h's MOED_FP8) with one float32
 * scale per 128 x 128 block (the checkpoints' weight_scale_inv), a table of [ceil(rows/128),
 * ceil(cols/128)] scales, row-major. The weight at (r, c) is, by definition, the float32 product
 *
 *   w = e4m3_to_f32(q[r, c]) * scale[r / 128, c / 128]          (rounded once, to nearest even)
 *
 * moed's own quantizer (`--weights fp8`, `dtype=fp8` in a synthetic spec) makes such a matrix from
 * float32 values v (f16 and bf16 weights are widened exactly first), block by block:
 *
 *   amax  = the largest |v| in the block (edge blocks hold fewer elements)
 *   scale = amax / 448 in float32 (IEEE division, nearest even), or 1 where that is 0
 *   q     = e4m3(v / scale), the float32 quotient rounded to nearest even, saturating at +-448
 *
 * which numpy reproduces bit for bit: s = np.float32(amax) / np.float32(448) (1 where 0), then
 * np.clip(v / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).
 */
#ifndef MOED_FP8_H
#define MOED_FP8_H

#include "moed_dtype.h"
#include "moed_err.h"

#include <stdint.h>

#define MOED_FP8_BLOCK 128    /* rows and columns of a scale block */
#define MOED_FP8_MAX   448.0f /* the largest e4m3 value */

/* Scale blocks along a dimension of n elements. */
static inline int64_t moed_fp8_blocks(int64_t n)
{
    return (n + MOED_FP8_BLOCK - 1) / MOED_FP8_BLOCK;
}

/* Scales of a [rows, cols] matrix. */
static inline int64_t moed_fp8_scale_count(int64_t rows, int64_t cols)
{
    return moed_fp8_blocks(rows) * moed_fp8_blocks(cols);
}

/* The weight at (r, c) of a block-scaled matrix with cols columns. */
static inline float moed_fp8_weight(const uint8_t *q, const float *scale, int64_t cols, int64_t r,
                                    int64_t c)
{
    return moed_e4m3_to_f32(q[r * cols + c]) *
           scale[(r / MOED_FP8_BLOCK) * moed_fp8_blocks(cols) + c / MOED_FP8_BLOCK];
}

/* Quantizes one band of at most MOED_FP8_BLOCK float32 rows (the band starts on a block boundary)
 * into q (the same shape) and its ceil(cols/128) scales. Returns -1, or the flat index within the
 * band of the first value that is NaN or infinite (nothing is then defined). */
int64_t moed_fp8_quantize_band(const float *v, int rows, int64_t cols, uint8_t *q, float *scale);

/* Quantizes a [rows, cols] matrix of dtype (F32, F16 or BF16) into q and its scale table. Returns
 * 0, MOED_EINVAL with *bad the flat index of the first value that is NaN or infinite, or
 * MOED_ENOMEM.
 */
int moed_fp8_quantize(const void *src, int dtype, int64_t rows, int64_t cols, uint8_t *q,
                      float *scale, int64_t *bad);

/* The largest block scale of a matrix with cols columns: FLT_MAX / (448 x cols), rounded down. A
 * finite scale can still overflow: a row's weights, 448 x the scale each, summed against cols
 * activations of 1 must stay finite (every backend accumulates in float32). */
float moed_fp8_scale_max(int64_t cols);

/* The index of the first of n scales of a matrix with cols columns that is not a number in
 * (0, moed_fp8_scale_max(cols)] (NaN, infinite, zero, negative or too large), or -1 if none. */
int64_t moed_fp8_check_scales(const float *scale, int64_t n, int64_t cols);

#endif
