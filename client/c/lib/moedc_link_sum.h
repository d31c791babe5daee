/*
 * moedc_link_sum — a link call's output, one element at a time: the combine kernel
 * (link_kernels.cu, compiled to PTX) and the host run this same code, so the kernel keeps the
 * gRPC fleet's sum rule (moedc_plan_sum; docs/fleets.md, "Numerics"): the partials of the shards
 * that got tokens added in float32 in the order of each shard's lowest expert, starting at -0.0
 * for a token every such shard got and +0.0 otherwise, rounded once to the dtype. A layer of one
 * shard answers that shard's reply verbatim, as the gRPC fleet does. tests/unit/test_moedc_link.c
 * proves the result equal to moedc_plan_sum's over tests/data/fleet_scenarios.json's sums; the
 * roundings are common/moed_dtype.h's own (host and device functions under nvcc).
 *
 * A part is one shard's reply as the link received it (moed_link.h: a 256-byte header, then
 * [rows, d_model] of dtype), row_of, the reply's row of each token of the call or -1 (NULL: the
 * shard got every token, in order), and the link's call counter, the seq the reply must carry.
 * A call's parts travel by value, as the combine kernel's parameter (moedc_link_parts): a captured
 * call's replays then read no memory that a later call rewrites.
 */
#ifndef MOEDC_LINK_SUM_H
#define MOEDC_LINK_SUM_H

#include "moed_dtype.h"
#include "moed_link.h"

#include <stdint.h>

#if defined(__CUDACC__)
#define MOEDC_LINK_FN static inline __host__ __device__
#else
#define MOEDC_LINK_FN static inline
#endif

#define MOEDC_LINK_MAX_PARTS 128 /* shards of a layer a link call reaches: 3 KiB of parameters */

typedef struct moedc_link_part {
    const unsigned char *reply; /* the header, then the rows */
    const int32_t *row_of;      /* [tokens], or NULL: row t is token t */
    const uint64_t *seq;        /* the link's call counter (moedc_link_stamp's) */
} moedc_link_part;

typedef struct moedc_link_parts {
    moedc_link_part p[MOEDC_LINK_MAX_PARTS];
} moedc_link_parts;

/* A shard's payload gathered in one launch (moedc_link_gather, its parameter): each tensor a
 * [*, bytes] matrix whose dst row j is src row rows[j] (row j itself where the launch has no rows),
 * bytes a whole number of 16-bit units (dtype rows, int32 ids, float32 weights). */
#define MOEDC_LINK_TENSORS 3 /* the hidden rows, the expert ids, the expert weights */

typedef struct moedc_link_copy {
    const unsigned char *src;
    unsigned char *dst;
    long long bytes;
} moedc_link_copy;

typedef struct moedc_link_copies {
    moedc_link_copy t[MOEDC_LINK_TENSORS];
} moedc_link_copies;

MOEDC_LINK_FN int32_t moedc_link_row(const moedc_link_part *part, int64_t t)
{
    return part->row_of ? part->row_of[t] : (int32_t)t;
}

MOEDC_LINK_FN float moedc_link_load(int dtype, const void *p, int64_t i)
{
    if (dtype == MOED_F32) return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    return dtype == MOED_F16 ? moed_f16_to_f32(h) : moed_bf16_to_f32(h);
}

MOEDC_LINK_FN void moedc_link_store(int dtype, void *p, int64_t i, float v)
{
    if (dtype == MOED_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = dtype == MOED_F16 ? moed_f32_to_f16(v) : moed_f32_to_bf16(v);
}

/* Whether every part's reply is the answer to its call, and OK: moed_link_reply_matches, which the
 * device cannot call, and status 0. The combine writes nothing otherwise, so no output is ever
 * built from a reply that did not arrive (and hidden, which output may be, stays intact). */
MOEDC_LINK_FN int moedc_link_replies_ok(const moedc_link_part *parts, int n)
{
    for (int s = 0; s < n; s++) {
        const moed_link_reply *r = (const moed_link_reply *)parts[s].reply;
        if (r->magic != MOED_LINK_REPLY_MAGIC || r->version != MOED_LINK_VERSION ||
            r->header_bytes != MOED_LINK_HEADER_BYTES || r->seq != *parts[s].seq || r->status)
            return 0;
    }
    return 1;
}

/* Element (t, c) of the output of n parts, [tokens, d] of dtype; verbatim: the layer is one shard
 * (its reply's bits are the output). */
MOEDC_LINK_FN void moedc_link_sum_element(int dtype, const moedc_link_part *parts, int n,
                                          int verbatim, int64_t t, int64_t d, int64_t c, void *out)
{
    if (verbatim) {
        const unsigned char *rows = parts[0].reply + MOED_LINK_HEADER_BYTES;
        const int64_t at = (int64_t)moedc_link_row(&parts[0], t) * d + c;
        if (dtype == MOED_F32)
            ((uint32_t *)out)[t * d + c] = ((const uint32_t *)rows)[at];
        else
            ((uint16_t *)out)[t * d + c] = ((const uint16_t *)rows)[at];
        return;
    }
    int held = 0;
    for (int s = 0; s < n; s++) held += moedc_link_row(&parts[s], t) >= 0;
    float acc = held == n ? -0.0f : 0.0f; /* a part without t would have answered +0.0 */
    for (int s = 0; s < n; s++) {
        const int32_t r = moedc_link_row(&parts[s], t);
        if (r >= 0)
            acc +=
                moedc_link_load(dtype, parts[s].reply + MOED_LINK_HEADER_BYTES, (int64_t)r * d + c);
    }
    moedc_link_store(dtype, out, t * d + c, acc);
}

#endif
