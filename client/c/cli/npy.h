/*
 * moed_npy — reading and writing NumPy .npy files, the format moectl takes and gives tensors in.
 *
 * Formats 1.0, 2.0 and 3.0 are read; 1.0 is written (2.0 when the header would not fit). Only
 * little-endian, C-order arrays: anything else fails with a message saying how to save it.
 *
 * Element types ("descr" -> dtype):
 *   '<f4' MOED_F32, '<f2' MOED_F16, '<i4' MOED_I32, '<f8' MOED_NPY_F64, '<i8' MOED_NPY_I64;
 *   '<V2' / '|V2' / 'bfloat16' MOED_BF16 (what np.save writes for an ml_dtypes.bfloat16 array);
 *   '<u2' MOED_NPY_U16 (uint16: bf16 bit patterns only if the caller says so).
 * bf16 is WRITTEN as '<u2': every numpy loads it, and `np.load(f).view(ml_dtypes.bfloat16)` gives
 * the values. (Files written with descr '<V2' load as an opaque void type, hence the choice.)
 */
#ifndef MOED_NPY_H
#define MOED_NPY_H

#include "moed_dtype.h"
#include "moed_err.h"

#include <stddef.h>
#include <stdint.h>

#define MOED_NPY_MAX_DIMS 8

/* Element types that .npy files commonly hold beyond moed_dtype's (values clear of moed_dtype). */
enum { MOED_NPY_U16 = 100, MOED_NPY_I64 = 101, MOED_NPY_F64 = 102 };

typedef struct moed_npy {
    int dtype; /* moed_dtype or MOED_NPY_* */
    int ndim;
    int64_t shape[MOED_NPY_MAX_DIMS];
    int64_t count; /* elements: product of shape (1 for a 0-d array) */
    void *data;    /* count elements, owned (moed_npy_free) */
    size_t nbytes;
} moed_npy;

/* Parses a whole .npy file held in memory; the data is copied into out. */
int moed_npy_parse(const void *buf, size_t n, moed_npy *out, moed_error *err);
/* Reads a .npy file; errors name the path. */
int moed_npy_read(const char *path, moed_npy *out, moed_error *err);
/* Writes ndim/shape/data of dtype (moed_dtype or MOED_NPY_*) as a .npy file. */
int moed_npy_write(const char *path, int dtype, int ndim, const int64_t *shape, const void *data,
                   moed_error *err);
void moed_npy_free(moed_npy *a);

/* Converts a in place to dtype, for the conversions numpy users take for granted: MOED_NPY_F64 ->
 * MOED_F32 (rounded to nearest), MOED_NPY_I64 -> MOED_I32 (every value must fit), MOED_NPY_U16 ->
 * MOED_BF16 (the bits are taken as bf16); nothing if a already has dtype. Anything else fails with
 * MOED_EINVAL and a message naming `what` ("--ids", ...) and both types. */
int moed_npy_convert(moed_npy *a, int dtype, const char *what, moed_error *err);

/* Bytes per element (0 if unknown), and a name such as "float32" or "uint16". */
size_t moed_npy_itemsize(int dtype);
const char *moed_npy_type_name(int dtype);

#endif
