/*
 * bench — helpers shared by the kernel benchmarks (device fill, timing statistics).
 */
#ifndef MOED_CUDA_BENCH_H
#define MOED_CUDA_BENCH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* n elements of dtype (MOED_BF16/F16/F32) at device pointer p, uniform in [-scale, scale), never 0.
 */
int bench_fill(void *p, int dtype, size_t n, uint64_t seed, float scale);

#ifdef __cplusplus
}
#endif
#endif
