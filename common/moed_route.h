/*
 * moed_route — which experts compute each token, with what weight, and the gating strategies that
 * turn router logits into such a route.
 *
 * A route is CSR over tokens: the pairs of token t are off[t] .. off[t+1]-1, each an (expert,
 * weight). The number of pairs per token varies (sigmoid and sparsemax gating; padding in client
 * routes), and the order of a token's pairs is the order in which its terms are summed: backends
 * must keep it, so a token's result depends on its own row and route alone.
 *
 * Every strategy here is deterministic and defined to the bit on the host: ties go to the lower
 * expert index, top-k lists experts by decreasing score. The numpy reference in the Python client
 * implements the same definitions; see proto/moed/v1/moed.proto for the user-facing statement.
 *
 * Messages about a tensor's contents name the element by its position and the rule it breaks, never
 * its value: the tensor may lie in a caller's region, and a message must not read it back to
 * anyone (the caller holds the tensor and can look).
 *
 * Ownership: moed_route_from_choice, moed_gate and moed_gate_batch initialise their output route
 * themselves (whatever it held is overwritten, not freed); the caller releases it with
 * moed_route_free, which is also safe after a failure (the route is then left empty).
 */
#ifndef MOED_ROUTE_H
#define MOED_ROUTE_H

#include "moed_err.h"
#include "moed_model.h"

#include <stddef.h>
#include <stdint.h>

typedef struct moed_route {
    int64_t T;       /* tokens */
    int64_t *off;    /* T + 1 offsets into expert/weight; off[0] = 0 */
    int32_t *expert; /* off[T] expert ids, each in [0, n_experts) */
    float *weight;   /* off[T] weights, finite and >= 0 */
    int64_t cap;     /* pairs allocated */
} moed_route;

/* Values match moed.v1.Strategy; MOED_GATE_MODEL is the layer's own rule (moed_layer_info.rule). */
typedef enum moed_gate_strategy {
    MOED_GATE_MODEL = 0,
    MOED_GATE_TOPK = 1,
    MOED_GATE_SIGMOID = 2,
    MOED_GATE_SPARSEMAX = 3,
    MOED_GATE_QUADRATIC = 4,
    MOED_GATE_PIONEER = 5,
} moed_gate_strategy;

/* "model", "topk", "sigmoid", "sparsemax", "quadratic", "pioneer" -> the strategy; -1 if unknown.
 */
int moed_gate_strategy_parse(const char *name);
const char *moed_gate_strategy_name(int strategy);

/* Values match moed.v1.Renormalize. */
enum { MOED_RENORM_DEFAULT = 0, MOED_RENORM_ON = 1, MOED_RENORM_OFF = 2 };

typedef struct moed_gate_params {
    int strategy;    /* moed_gate_strategy */
    int64_t top_k;   /* 0: the layer's top_k; wide enough for any value a request carries */
    int renormalize; /* MOED_RENORM_* */
    float threshold; /* SIGMOID, in (0, 1); 0: 0.5 */
} moed_gate_params;

/* Allocates a route for T tokens and up to cap pairs (off zeroed). */
int moed_route_init(moed_route *r, int64_t T, int64_t cap);
void moed_route_free(moed_route *r);

/* Builds a route from client choices: ids [T, k] int32 and weights [T, k] float32. A pair with id
 * -1 and weight 0 is padding and is left out; the others are kept in their order (an id repeated
 * in a row is two pairs: the terms add). Ids outside [0, n_experts), other negative ids, NaN, Inf
 * or negative weights fail with MOED_EINVAL and a message naming the first bad row and column.
 */
int moed_route_from_choice(moed_route *r, const int32_t *ids, const float *w, int64_t T, int k,
                           int n_experts, moed_error *err);

/* The rules moed_route_from_choice applies to one pair (id, w), in the order it applies them, as
 * the pair's verdict: VALID and PADDING are accepted, the others refuse the choice. A backend that
 * checks choices where they lie (device memory, moed_backend.h) applies the same rules in the same
 * order, so both agree on every pair. */
enum {
    MOED_CHOICE_VALID = 0,
    MOED_CHOICE_PADDING = 1,    /* id -1, weight 0 (either zero): left out */
    MOED_CHOICE_PAD_WEIGHT = 2, /* id -1 with any other weight */
    MOED_CHOICE_RANGE = 3,      /* id outside [0, n_experts), and not -1 */
    MOED_CHOICE_NOT_FINITE = 4, /* weight NaN or infinite */
    MOED_CHOICE_NEGATIVE = 5,   /* weight < 0 */
    MOED_CHOICE_RULE_BITS = 3   /* a refusal's code: position << RULE_BITS | rule */
};

/* One definition for the host and the CUDA kernels (route_choice.cu), so the two cannot drift;
 * finiteness from the exponent bits, whatever the math flags. */
#if defined(__CUDACC__)
#define MOED_HOST_DEVICE __host__ __device__
#else
#define MOED_HOST_DEVICE
#endif
static inline MOED_HOST_DEVICE int moed_choice_rule(int32_t id, float w, int n_experts)
{
    union {
        float f;
        uint32_t u;
    } bits = { w };
    if (id == -1) return w == 0.0f ? MOED_CHOICE_PADDING : MOED_CHOICE_PAD_WEIGHT;
    if (id < 0 || id >= n_experts) return MOED_CHOICE_RANGE;
    if ((bits.u & 0x7f800000u) == 0x7f800000u) return MOED_CHOICE_NOT_FINITE;
    if (w < 0.0f) return MOED_CHOICE_NEGATIVE;
    return MOED_CHOICE_VALID;
}

/* The first refused pair of a choice [rows, k] in row-major order, as the code
 * (row * k + col) << MOED_CHOICE_RULE_BITS | rule; -1 when every pair is accepted. */
int64_t moed_choice_check(const int32_t *ids, const float *w, int64_t rows, int k, int n_experts);

/* Fails with MOED_EINVAL and a message for a refusal's code (moed_choice_check's), naming the
 * position and the rule broken, never the value found there (the value lies in the caller's memory
 * and is the caller's to look at). */
int moed_choice_fail(moed_error *err, int64_t code, int k, int n_experts);

/* Checks a gating request against a layer and fills in its defaults (top_k, renormalize,
 * threshold) so that the result names exactly what will run; MOED_EINVAL with a message if
 * the strategy is unknown, top_k is out of [1, n_experts] or the threshold out of (0, 1). */
int moed_gate_resolve(moed_gate_params *p, const moed_layer_info *li, moed_error *err);

/* The server router's logits as the layer's model computes them. A backend's router_logits sums
 * x · router^T in float32 from x in the request's dtype and the router in the checkpoint's (neither
 * rounded first), then calls this on its float32 result [n]: where the model runs its gate Linear
 * in the activation dtype (the softmax top-k rule: Mixtral, Qwen-MoE and OLMoE in transformers) the
 * logits are rounded to `dtype`, the request's hidden dtype (nearest, ties to even), as that
 * Linear's output is; DeepSeek-V3 computes its gate in float32 and keeps them. Gating then runs in
 * float32 on these values. */
void moed_router_round_logits(const moed_layer_info *li, int dtype, float *logits, size_t n);

/* Applies a resolved strategy to logits [T, E] (float32, E = li->n_experts). MOED_GATE_MODEL
 * follows li->rule, using router_bias (DeepSeek e_score_correction_bias, may be NULL). Logits that
 * are NaN or Inf fail with MOED_EINVAL. */
int moed_gate(const moed_gate_params *p, const moed_layer_info *li, const float *router_bias,
              const float *logits, int64_t T, moed_route *out, moed_error *err);

/* Batch-level dynamic gating over a merged batch of T tokens: s_e = sum_t l[t, e]; S = the k_batch
 * experts of highest s_e (ties to the lower index) in decreasing order, written to set; every
 * token's route is S in that order with weights softmax(l_t restricted to S). */
int moed_gate_batch(const float *logits, int64_t T, int E, int k_batch, int32_t *set,
                    moed_route *out, moed_error *err);

/* Appends route b's pairs after route a's tokens into out (which must have room); used to merge
 * requests into one launch. out comes from moed_route_init with T >= the parts' tokens and
 * cap >= their pairs (MOED_EINVAL otherwise); out->T is set to the parts' tokens. */
int moed_route_concat(moed_route *out, const moed_route *const *parts, int nparts);

/* Keeps only the pairs whose expert is held, in place and in their order, with their ids
 * renumbered: local_of[e] is expert e's id among the held experts, or -1 when it is not held
 * (an expert shard: the route speaks the whole layer's numbering, the backend the shard's). A token
 * may be left with no pair. */
void moed_route_localize(moed_route *r, const int32_t *local_of);

#define MOED_ROUTE_MAX_PARTS 64

/* Splits tokens [t0, t1) of r by ranges of experts (a layer's experts over devices): expert e
 * belongs to part part_of[e] (< n_parts <= MOED_ROUTE_MAX_PARTS), whose experts start at
 * first[part]. Part p gets, as its own route (parts[p], with room for T = t1 - t0 tokens and their
 * pairs), only the tokens with a pair of its experts, in their order, each with those pairs in
 * their order, numbered e - first[p]: parts[p].T tokens, whose numbers in the range are
 * tok[p * T + i] (i < parts[p].T). row[p * T + t] is where token t's partial row lies when the
 * parts' rows are laid one after another, part 0's first, each part's in its token order; -1
 * where token t has no pair in part p. tok and row hold n_parts * T entries. */
void moed_route_split(const moed_route *r, int64_t t0, int64_t t1, const uint8_t *part_of,
                      const int *first, int n_parts, moed_route *parts, int32_t *tok, int32_t *row);

/* A split layer's experts over its parts when hot ones have extra copies (moed_place.h): expert
 * e's copies are off[e] .. off[e+1]-1, the first its range's, then its extra ones in increasing
 * device entry order, each on part part[c] as its expert local[c] there. */
typedef struct moed_route_copies {
    const int32_t *off;
    const uint8_t *part;
    const int32_t *local;
} moed_route_copies;

/* Which copy computes a pair (the rule): a token's pairs are hashed by that token's own expert
 * ids alone, in route order: h = 0, then h = (h xor id) x 0x9E3779B97F4A7C15 (mod 2^64) for each
 * id, then h = splitmix64(h) (moed_splitmix64); its pair of an expert with r copies goes to copy
 * floor((h >> 32) x r / 2^32) (h's top half scaled to [0, r): a division per pair would cost the
 * split a third of its time). A pair's copy therefore depends only on its token's routing, never
 * on the other tokens of a batch, so merged requests still equal the same requests alone and every
 * run gives the same bits; over many tokens a hot expert's pairs spread evenly over its copies.
 * All of one token's pairs of experts with r copies go to the same copy index. */
uint64_t moed_route_token_hash(const int32_t *expert, int64_t n);

/* moed_route_split for a layer whose experts may have several copies: the same outputs, with each
 * pair sent to the part of the copy the rule above picks, numbered as that copy's local id. */
void moed_route_split_copies(const moed_route *r, int64_t t0, int64_t t1,
                             const moed_route_copies *cp, int n_parts, moed_route *parts,
                             int32_t *tok, int32_t *row);

#endif
