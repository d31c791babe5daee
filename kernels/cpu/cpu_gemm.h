/*
 * cpu_gemm — the CPU backend's one matrix product, C = act(A B^T), with A float32 rows (gathered
 * through an index, so token rows are never copied) and B a weight matrix [n, k] in f32, f16 or
 * bf16, or block-scaled FP8 (each weight dequantized exactly as moed_fp8.h defines it, q * scale in
 * float32), used in place.
 *
 * Determinism: every element of C is one sequential float32 sum over k = 0 .. k-1, computed by the
 * same instructions whichever tile, block or thread it falls in, so a row's result never depends on
 * how many rows share the call (the contract of moed_backend.h).
 */
#ifndef MOED_CPU_GEMM_H
#define MOED_CPU_GEMM_H

#include "moed_model.h"

#include <stddef.h>
#include <stdint.h>

/* Columns of B converted together into a panel; the unit of the micro-kernel's width. */
#define MOED_CPU_NR 16

typedef struct moed_cpu_mm {
    const float *a; /* row r of A is a + rows[r] * lda (a + r * lda when rows is NULL) */
    const int32_t *rows;
    size_t lda;
    int k;
    const void *b;         /* [n, k] row-major, in bdtype */
    const void *b3;        /* SwiGLU: the up matrix W3, same shape; else NULL */
    const float *bs, *b3s; /* FP8: the block scales of b and b3 (moed_fp8.h); else NULL */
    int bdtype;
    int n;
    moed_act act; /* MOED_ACT_NONE: C = A B^T; SwiGLU: silu(A B^T) * (A b3^T) */
    float *c;     /* row r of C is c + r * ldc */
    size_t ldc;
} moed_cpu_mm;

/* Floats of per-thread scratch that moed_cpu_mm_block needs for a depth of k. */
size_t moed_cpu_mm_pack_floats(int k);

/* Computes rows [m0, m0 + m) and columns [n0, n0 + nc) of C; pack is the calling thread's
 * scratch (moed_cpu_mm_pack_floats(g->k) floats, 64-byte aligned). */
void moed_cpu_mm_block(const moed_cpu_mm *g, int64_t m0, int m, int n0, int nc, float *pack);

/* Which micro-kernel runs: "avx2" (AVX2 + FMA + F16C, where the CPU has them) or "generic";
 * the environment variable MOED_CPU_ISA=generic forces the portable one (the tests use it). */
const char *moed_cpu_mm_isa(void);

#endif
