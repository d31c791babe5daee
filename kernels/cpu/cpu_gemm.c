/*
 * cpu_gemm — blocked float32 GEMM against weights in place, with the activation in the epilogue.
 *
 * For each panel of MOED_CPU_NR columns, B's rows are converted to float32 and laid out k-major in
 * per-thread scratch (the only copy of weights the backend makes, a panel at a time); then tiles
 * of 6 rows (fewer at the end of a block) are multiplied against it with every accumulator in
 * registers. Every tile height performs, per element, the same sequence of multiply-adds in k
 * order, which is what makes a row's result independent of its neighbours.
 *
 * Two implementations are chosen once at run time: AVX2+FMA (with F16C for f16 weights) where the
 * CPU has them, and portable C elsewhere; MOED_CPU_ISA=generic forces the portable one. Results
 * differ between the two (fused vs separate multiply-add) but never within one process.
 */
#include "cpu_gemm.h"

#include "moed_dtype.h"
#include "moed_fp8.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define MM_HAVE_X86 1
#endif

#define NR MOED_CPU_NR
#define MR 6

typedef void (*mm_tile_fn)(int mr, const float *const *a, const float *bp, int k, float *c);
typedef void (*mm_pack_fn)(const void *b, const float *scale, int dtype, int k, int j0, int nr,
                           float *bp);

static struct {
    mm_tile_fn tile;
    mm_pack_fn pack;
    const char *isa;
} mm_impl;
static pthread_once_t mm_once = PTHREAD_ONCE_INIT;

size_t moed_cpu_mm_pack_floats(int k)
{
    return 2 * (size_t)NR * (size_t)k;
}

/* ---- portable ----------------------------------------------------------------------------- */

/* c[r][j] = sum over p of a[r][p] * bp[p][j], for mr (1 to 6) rows; separate multiply and add. */
static void tile_generic(int mr, const float *const *a, const float *bp, int k, float *c)
{
    float acc[MR][NR];
    memset(acc, 0, sizeof acc);
    for (int p = 0; p < k; p++) {
        const float *b = bp + (size_t)p * NR;
        for (int r = 0; r < mr; r++) {
            float x = a[r][p];
            for (int j = 0; j < NR; j++) acc[r][j] += x * b[j];
        }
    }
    for (int r = 0; r < mr; r++) memcpy(c + r * NR, acc[r], sizeof acc[r]);
}

/* bp[p][j] = B[j0 + j][p] as float32 (FP8: dequantized with its block's scale), zero for the
 * columns j >= nr past the matrix's end. */
static void pack_generic(const void *b, const float *scale, int dtype, int k, int j0, int nr,
                         float *bp)
{
    size_t es = moed_dtype_size(dtype);
    for (int j = 0; j < NR; j++) {
        if (j >= nr) {
            for (int p = 0; p < k; p++) bp[(size_t)p * NR + j] = 0.0f;
            continue;
        }
        const char *row = (const char *)b + (size_t)(j0 + j) * (size_t)k * es;
        if (dtype == MOED_FP8) {
            const float *srow = scale + ((j0 + j) / MOED_FP8_BLOCK) * moed_fp8_blocks(k);
            for (int p = 0; p < k; p++)
                bp[(size_t)p * NR + j] =
                    moed_e4m3_to_f32(((const uint8_t *)row)[p]) * srow[p / MOED_FP8_BLOCK];
        } else if (dtype == MOED_F32)
            for (int p = 0; p < k; p++) bp[(size_t)p * NR + j] = ((const float *)row)[p];
        else if (dtype == MOED_BF16)
            for (int p = 0; p < k; p++)
                bp[(size_t)p * NR + j] = moed_bf16_to_f32(((const uint16_t *)row)[p]);
        else
            for (int p = 0; p < k; p++)
                bp[(size_t)p * NR + j] = moed_f16_to_f32(((const uint16_t *)row)[p]);
    }
}

/* ---- AVX2 + FMA (+ F16C) ------------------------------------------------------------------ */

#ifdef MM_HAVE_X86
#define MM_AVX2 __attribute__((target("avx2,fma,f16c")))

/* mr rows (a compile-time constant once inlined) x 16 columns, every accumulator in a register.
 * Each element is the same chain of fused multiply-adds in k order whatever mr is, so a row's
 * bits do not depend on how many rows share its tile. */
MM_AVX2 static inline __attribute__((always_inline)) void
tile_rows_avx2(const int mr, const float *const *a, const float *bp, int k, float *c)
{
    __m256 acc[MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int p = 0; p < k; p++) {
        __m256 b0 = _mm256_loadu_ps(bp + (size_t)p * NR);
        __m256 b1 = _mm256_loadu_ps(bp + (size_t)p * NR + 8);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            __m256 x = _mm256_broadcast_ss(a[r] + p);
            acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(c + r * NR, acc[r][0]);
        _mm256_storeu_ps(c + r * NR + 8, acc[r][1]);
    }
}

MM_AVX2 static void tile_avx2(int mr, const float *const *a, const float *bp, int k, float *c)
{
    switch (mr) {
    case 1:
        tile_rows_avx2(1, a, bp, k, c);
        break;
    case 2:
        tile_rows_avx2(2, a, bp, k, c);
        break;
    case 3:
        tile_rows_avx2(3, a, bp, k, c);
        break;
    case 4:
        tile_rows_avx2(4, a, bp, k, c);
        break;
    case 5:
        tile_rows_avx2(5, a, bp, k, c);
        break;
    default:
        tile_rows_avx2(6, a, bp, k, c);
    }
}

/* 8 consecutive elements of a weight row, as float32. */
MM_AVX2 static inline __m256 load8_avx2(const char *row, int dtype, int p)
{
    if (dtype == MOED_F32) return _mm256_loadu_ps((const float *)row + p);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + p));
    if (dtype == MOED_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Transposes the 8x8 block held in r[0..7]. */
MM_AVX2 static inline void transpose8_avx2(__m256 *r)
{
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* As pack_generic, 8 rows x 8 columns at a time through a register transpose (FP8 by the
 * portable code: its per-element scale lookup gains nothing from the transpose). */
MM_AVX2 static void pack_avx2(const void *b, const float *scale, int dtype, int k, int j0, int nr,
                              float *bp)
{
    if (nr < NR || dtype == MOED_FP8) {
        pack_generic(b, scale, dtype, k, j0, nr, bp);
        return;
    }
    size_t rs = (size_t)k * moed_dtype_size(dtype);
    int k8 = k & ~7;
    for (int half = 0; half < NR; half += 8) {
        const char *rows[8];
        for (int i = 0; i < 8; i++) rows[i] = (const char *)b + (size_t)(j0 + half + i) * rs;
        for (int p = 0; p < k8; p += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = load8_avx2(rows[i], dtype, p);
            transpose8_avx2(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(bp + (size_t)(p + i) * NR + half, r[i]);
        }
    }
    if (k8 < k) { /* the last k % 8 columns */
        size_t es = moed_dtype_size(dtype);
        for (int j = 0; j < NR; j++) {
            const char *row = (const char *)b + (size_t)(j0 + j) * rs;
            for (int p = k8; p < k; p++) {
                float v;
                moed_to_f32(dtype, row + (size_t)p * es, &v, 1);
                bp[(size_t)p * NR + j] = v;
            }
        }
    }
}
#endif

static void mm_choose(void)
{
    mm_impl.tile = tile_generic;
    mm_impl.pack = pack_generic;
    mm_impl.isa = "generic";
#ifdef MM_HAVE_X86
    const char *force = getenv("MOED_CPU_ISA");
    __builtin_cpu_init();
    if ((!force || strcmp(force, "generic")) && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        mm_impl.tile = tile_avx2;
        mm_impl.pack = pack_avx2;
        mm_impl.isa = "avx2";
    }
#endif
}

const char *moed_cpu_mm_isa(void)
{
    pthread_once(&mm_once, mm_choose);
    return mm_impl.isa;
}

/* ---- the block ---------------------------------------------------------------------------- */

static void mm_epilogue(moed_act act, const float *a, const float *b, float *c, int n)
{
    switch (act) {
    case MOED_ACT_SWIGLU:
        for (int j = 0; j < n; j++) c[j] = a[j] / (1.0f + expf(-a[j])) * b[j];
        break;
    case MOED_ACT_GELU:
        for (int j = 0; j < n; j++) c[j] = 0.5f * a[j] * (1.0f + erff(a[j] / (float)M_SQRT2));
        break;
    case MOED_ACT_RELU:
        for (int j = 0; j < n; j++) c[j] = a[j] > 0.0f ? a[j] : 0.0f;
        break;
    default:
        memcpy(c, a, (size_t)n * sizeof *c);
    }
}

void moed_cpu_mm_block(const moed_cpu_mm *g, int64_t m0, int m, int n0, int nc, float *pack)
{
    pthread_once(&mm_once, mm_choose);
    float *p1 = pack, *p3 = pack + (size_t)NR * (size_t)g->k;
    float ta[MR * NR], tb[MR * NR];
    for (int j0 = n0; j0 < n0 + nc; j0 += NR) {
        int nr = n0 + nc - j0 < NR ? n0 + nc - j0 : NR;
        mm_impl.pack(g->b, g->bs, g->bdtype, g->k, j0, nr, p1);
        if (g->b3) mm_impl.pack(g->b3, g->b3s, g->bdtype, g->k, j0, nr, p3);
        for (int r = 0; r < m;) {
            int mr = m - r >= MR ? MR : m - r;
            const float *ar[MR];
            for (int i = 0; i < mr; i++) {
                int64_t row = m0 + r + i;
                ar[i] = g->a + (size_t)(g->rows ? g->rows[row] : row) * g->lda;
            }
            mm_impl.tile(mr, ar, p1, g->k, ta);
            if (g->b3) mm_impl.tile(mr, ar, p3, g->k, tb);
            for (int i = 0; i < mr; i++)
                mm_epilogue(g->act, ta + i * NR, tb + i * NR,
                            g->c + (size_t)(m0 + r + i) * g->ldc + j0, nr);
            r += mr;
        }
    }
}
