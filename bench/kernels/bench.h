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
/* n e4m3 codes at p, spread over the whole e4m3 range, never 0. */
int bench_fill_fp8(void *p, size_t n, uint64_t seed);
/* n copies of v at p. */
int bench_fill_value(float *p, size_t n, float v);

#ifdef __cplusplus
}
#endif
#endif
