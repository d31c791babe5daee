/*
 * moed_sp24 — 2:4 structured sparsity of expert weights: in every aligned group of four consecutive
 * values along K (a row of a matrix in the nn.Linear [out, in] layout), at most two are non-zero.
 *
 * A sparse layer (moed_layer_info.sparse24) keeps its expert matrices dense in host memory with the
 * pruned values stored as zeros, so the CPU backend computes exactly the pruned model with no code
 * of its own, and every other backend is checked against it. A backend with sparse Tensor Cores
 * (CUDA, sm_80 and newer) compresses the matrices while loading them: the two kept values of each
 * group and their 2-bit positions, 0.5625 of the dense bytes at 16 bits a value.
 *
 * Groups are counted from column 0 of each row; a row whose length is not a multiple of four ends
 * in a partial group, read as if padded with zeros (so the backends' zero padding of K changes
 * nothing).
 */
#ifndef MOED_SP24_H
#define MOED_SP24_H

#include "moed_err.h"

#include <stdbool.h>
#include <stdint.h>

/* Prunes rows x cols values of dtype (MOED_F32, MOED_F16 or MOED_BF16), row-major, in place: in
 * each group of four along a row, the two of largest magnitude stay (a NaN counting as larger than
 * any number, so a broken weight is never hidden by pruning), ties to the lower index, and the
 * other two become +0. Returns 0, or MOED_EINVAL for a dtype it does not take. */
int moed_sp24_prune(void *w, int dtype, int64_t rows, int64_t cols);

/* Whether rows x cols values of dtype are 2:4 sparse (a zero of either sign counting as zero). When
 * they are not, the first group (row-major) with three or more non-zeros is reported in *bad_row
 * and *bad_col (its first column), each pointer may be NULL. Unknown dtypes are never sparse. */
bool moed_sp24_check(const void *w, int dtype, int64_t rows, int64_t cols, int64_t *bad_row,
                     int64_t *bad_col);

#endif
