/*
 * moed_synth — seeded synthetic weights, for demos, tests and benchmarks.
 *
 * The generator is documented so that any client can rebuild the same weights (the Python client's
 * moed.reference does, vectorised in numpy). It is counter-based: every element is a pure function
 * of (seed, layer, tensor, expert, flat index), so any slice can be generated alone and in
 * parallel.
 *
 *   splitmix64(x): z = x + 0x9E3779B97F4A7C15;
 *                  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
 *                  z = (z ^ (z >> 27)) * 0x94D049BB133111EB;
 *                  return z ^ (z >> 31)                         (all arithmetic mod 2^64)
 *   key    = splitmix64(splitmix64(seed) ^ (layer << 40 | tensor << 32 | expert))
 *   u      = (splitmix64(key + i) >> 40) / 2^24                 (in [0, 1), exact in float64)
 *   value  = (2u - 1) * sqrt(3 / fan_in)                         (uniform, variance 1 / fan_in)
 *   stored = value rounded (to nearest even) to the layer's weight dtype
 *
 * tensor is MOED_SYNTH_W1 .. MOED_SYNTH_BIAS below, i the row-major flat index in the [out, in]
 * matrix, fan_in its number of columns (d_model for W1, W3 and the router; d_ff for W2); for the
 * shared experts, expert is 0 and the matrix has shared_d_ff rows (or columns, for W2). The router
 * is stored in the weight dtype like the experts. The router bias (rule=deepseek only) is float32,
 * value (2u - 1) * 0.1 with expert 0 and i the expert number. Layers are numbered 0 .. n-1.
 * value is computed in float64, rounded to float32, then (for f16/bf16 weights) rounded again to
 * the weight dtype: the double rounding through float32 is part of the definition.
 *
 * dtype=fp8: every expert matrix (the shared experts' too) is the float32 values above quantized by
 * moed_fp8.h's rule in 128 x 128 blocks of the [out, in] matrix (e4m3 codes and a float32 scale per
 * block), and the router, which a checkpoint never quantizes, is stored in bf16.
 */
#ifndef MOED_SYNTH_H
#define MOED_SYNTH_H

#include "moed_err.h"
#include "moed_model.h"

#include <stdint.h>

enum {
    MOED_SYNTH_W1 = 0,
    MOED_SYNTH_W3 = 1,
    MOED_SYNTH_W2 = 2,
    MOED_SYNTH_ROUTER = 3,
    MOED_SYNTH_SHARED_W1 = 4,
    MOED_SYNTH_SHARED_W3 = 5,
    MOED_SYNTH_SHARED_W2 = 6,
    MOED_SYNTH_BIAS = 7,
};

/* A synthetic model: what `--synthetic SPEC` says. */
typedef struct moed_synth_spec {
    int layers;
    moed_layer_info layer; /* every layer alike; index is overwritten with 0 .. layers-1 */
    uint64_t seed;
} moed_synth_spec;

/* Parses "layers=2,d=256,ff=512,experts=8,topk=2,act=swiglu,dtype=bf16,seed=1" (any order, any
 * subset; the others keep the defaults shown, plus router=1 norm=1 shared=0 shared_ff=0
 * rule=softmax groups=1 topk_groups=1 scale=1). Unknown keys and bad values fail with a message
 * naming them. */
int moed_synth_parse(const char *spec, moed_synth_spec *out, moed_error *err);

/* Formats a spec back into the canonical string (all keys), for logs and GetModel. */
void moed_synth_format(const moed_synth_spec *s, char *buf, size_t n);

uint64_t moed_splitmix64(uint64_t x);

/* The hash of a list of expert ranges so far, h, with [first, last] appended (from h = 0): how a
 * caller's expectation of the experts a daemon holds (ForwardRequest.expect, a link call's
 * header) is compared in fixed space, however many ranges there are. */
uint64_t moed_ranges_fold(uint64_t h, uint32_t first, uint32_t last);

/* Fills n elements (flat indices first .. first+n-1) of one tensor, in dtype (F32, F16, BF16: the
 * unscaled types). */
void moed_synth_fill(uint64_t seed, int layer, int tensor, int expert, int fan_in, int dtype,
                     uint64_t first, uint64_t n, void *dst);

/* Allocates and fills every weight of layer `index` (0-based) of the spec into *out; the memory is
 * owned by out and released by moed_synth_free_layer. */
int moed_synth_layer(const moed_synth_spec *s, int index, moed_layer *out, moed_error *err);
void moed_synth_free_layer(moed_layer *l);

/* The same for an expert shard: only the experts `held` holds (NULL: all) are generated, each
 * exactly as in the whole layer; the others' matrices stay NULL. */
int moed_synth_layer_held(const moed_synth_spec *s, int index, const moed_expert_subset *held,
                          moed_layer *out, moed_error *err);

#endif
