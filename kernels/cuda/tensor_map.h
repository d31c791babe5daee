/*
 * tensor_map — the TMA tensor maps the Hopper GEMMs read their tiles through: a row-major 2-D
 * matrix in global memory, copied into shared memory in boxes, 128-byte swizzled (the layout the
 * wgmma descriptors name) or plain (scale vectors).
 */
#ifndef MOED_CUDA_TENSOR_MAP_H
#define MOED_CUDA_TENSOR_MAP_H

#include <cuda.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The element types the kernels read through maps. */
enum { MOED_CUDA_TM_BF16, MOED_CUDA_TM_F16, MOED_CUDA_TM_E4M3, MOED_CUDA_TM_F32 };

/* Fills m for the [rows, cols] matrix at p of `type` elements, ld elements from row to row (ld
 * times the element size a multiple of 16 bytes), read in boxes of box_cols x box_rows elements;
 * swizzle128: the box's rows are 128 bytes, swizzled; else laid out plainly. Boxes past the matrix
 * are zero-filled. 0, or MOED_EDEVICE (no driver, or the driver refused the map). */
int moed_cuda_tensor_map(CUtensorMap *m, int type, const void *p, int64_t rows, int64_t cols,
                         int64_t ld, int box_cols, int box_rows, int swizzle128);

#ifdef __cplusplus
}
#endif
#endif
