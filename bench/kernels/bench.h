/*
 * bench — helpers shared by the kernel benchmarks (device fill, timing statistics, routings).
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

/* One token's k distinct experts of E by the routing rule, drawing from the splitmix64 state rng:
 * uniform; zipf (P(e) ~ 1/(e+1)^1.2, drawn again while a choice repeats); hot (every token's first
 * choice expert 0, the rest uniform); empty (from the first quarter of the experts, at least k
 * of them: three quarters idle). Unknown words are uniform. */
void bench_choose(const char *routing, int E, int k, uint64_t *rng, int32_t *out);

#ifdef __cplusplus
}
#endif
#endif
