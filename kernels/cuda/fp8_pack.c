/*
 * fp8_pack — an FP8 layer's expert matrices in the kernels' layout (moed_cuda.h): the checkpoint's
 * e4m3 codes copied unchanged into the padded (and, for SwiGLU, W1|W3-interleaved) matrix, and its
 * 128 x 128 block scales spread over the kernels' table of one scale per 32 rows and 128-deep K
 * block. 32 divides 128, so the 32 rows of a table entry always lie in one checkpoint block and
 * take its scale exactly; padding rows take 0 (their codes are zero too).
 */
#include "moed_cuda.h"

#include "moed_fp8.h"
#include "moed_model.h"

#include <string.h>

/* Rows [r0, r0 + n) of the [rows, cols] FP8 matrix q (scales s) to rows at `at` of the padded
 * matrix dst [*, cols_pad] and its table sc [cols_pad/128][groups]: codes copied, and each group of
 * MOED_CUDA_FP8_SROWS rows the scales of its checkpoint block row. */
static void put_rows(uint8_t *dst, float *sc, int groups, int cols_pad, const uint8_t *q,
                     const float *s, int cols, int r0, int n, int at)
{
    const int64_t bc = moed_fp8_blocks(cols);
    for (int i = 0; i < n; i++)
        memcpy(dst + (int64_t)(at + i) * cols_pad, q + (int64_t)(r0 + i) * cols, (size_t)cols);
    for (int i = 0; i < n; i += MOED_CUDA_FP8_SROWS) {
        const float *srow = s + ((r0 + i) / MOED_FP8_BLOCK) * bc;
        for (int64_t kb = 0; kb < bc; kb++)
            sc[kb * groups + (at + i) / MOED_CUDA_FP8_SROWS] = srow[kb];
    }
}

void moed_cuda_fp8_pack_up(void *dst, float *scale, const moed_expert_w *w, int glu, int d, int ff,
                           int d_pad, int n_up)
{
    const int groups = n_up / MOED_CUDA_FP8_SROWS;
    memset(dst, 0, (size_t)n_up * (size_t)d_pad);
    memset(scale, 0, sizeof(float) * (size_t)(d_pad / MOED_CUDA_FP8_K) * (size_t)groups);
    if (!glu) {
        put_rows(dst, scale, groups, d_pad, w->w1, w->s1, d, 0, ff, 0);
        return;
    }
    for (int r0 = 0; r0 < ff; r0 += MOED_CUDA_GLU_BLOCK) {
        const int n = ff - r0 < MOED_CUDA_GLU_BLOCK ? ff - r0 : MOED_CUDA_GLU_BLOCK;
        put_rows(dst, scale, groups, d_pad, w->w1, w->s1, d, r0, n, 2 * r0);
        put_rows(dst, scale, groups, d_pad, w->w3, w->s3, d, r0, n, 2 * r0 + MOED_CUDA_GLU_BLOCK);
    }
}

void moed_cuda_fp8_pack_down(void *dst, float *scale, const moed_expert_w *w, int d, int ff,
                             int d_pad, int ff_pad)
{
    const int groups = d_pad / MOED_CUDA_FP8_SROWS;
    memset(dst, 0, (size_t)d_pad * (size_t)ff_pad);
    memset(scale, 0, sizeof(float) * (size_t)(ff_pad / MOED_CUDA_FP8_K) * (size_t)groups);
    put_rows(dst, scale, groups, ff_pad, w->w2, w->s2, ff, 0, d, 0);
}
