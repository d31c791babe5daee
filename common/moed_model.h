/*
 * moed_model — what one resident MoE layer is: its sizes and rules (moed_layer_info) and where its
 * weights are in host memory (moed_layer).
 *
 * Weights keep the Hugging Face nn.Linear layout, [out, in] row-major: W1 (gate_proj) and W3
 * (up_proj) are [d_ff, d_model], W2 (down_proj) is [d_model, d_ff], the router is
 * [n_experts, d_model]. The pointers may point into a memory-mapped checkpoint or into buffers the
 * synthetic generator filled; whoever built the moed_layer owns that memory and keeps it alive as
 * long as a backend that loaded the layer exists. FP8 expert weights (wdtype MOED_FP8) come with
 * their block scales (moed_fp8.h); the router is never FP8.
 */
#ifndef MOED_MODEL_H
#define MOED_MODEL_H

#include "moed_err.h"

#include <stdbool.h>
#include <stdint.h>

/* Values match moed.v1.Activation. */
typedef enum moed_act {
    MOED_ACT_NONE = 0,
    MOED_ACT_SWIGLU = 1, /* W2 (silu(W1 x) * W3 x) */
    MOED_ACT_GELU = 2,   /* W2 gelu(W1 x), exact erf form */
    MOED_ACT_RELU = 3,   /* W2 max(W1 x, 0) */
} moed_act;

/* Values match moed.v1.RouterRule. */
typedef enum moed_router_rule {
    MOED_RULE_NONE = 0,
    MOED_RULE_SOFTMAX_TOPK = 1, /* Mixtral, Qwen-MoE, OLMoE */
    MOED_RULE_DEEPSEEK_V3 = 2,  /* sigmoid + bias, group-limited top-k, scaled */
} moed_router_rule;

typedef struct moed_layer_info {
    int index; /* the layer's number in the checkpoint; what clients name */
    int d_model;
    int d_ff;      /* per routed expert */
    int n_experts; /* experts held: experts[], and the ids a backend job's route uses */
    int top_k;     /* num_experts_per_tok */
    moed_act act;
    int wdtype;      /* moed_dtype of every expert matrix (moed_dtype_is_weight) */
    bool has_router; /* router weights present: the server can compute logits */
    bool norm_topk;  /* renormalise top-k weights (norm_topk_prob) */
    moed_router_rule rule;
    int n_group; /* DeepSeek-V3 group-limited routing; 1 when not grouped */
    int topk_group;
    float routed_scale; /* routed_scaling_factor; 1 when absent */
    int n_shared;       /* shared experts, applied to every token with weight 1 */
    int shared_d_ff;    /* their total width: n_shared * moe_intermediate_size */
    /* The router's rows, and the width of its logits: the whole layer's experts. 0 means
     * n_experts; more than n_experts in the layer a backend gets from a daemon holding an expert
     * shard (moed --experts), whose router stays whole while it holds fewer experts. */
    int router_experts;
    /* Every routed expert's matrices are 2:4 sparse along K, zeros in place (moed_sp24.h): a
     * pruned layer (moed --weights sparse24) or a compressed-tensors 2:4 checkpoint. The shared
     * experts and the router stay dense. Backends with sparse Tensor Cores compute such a layer
     * from its compressed form; the others as any layer, with the same results on the zeros. */
    bool sparse24;
} moed_layer_info;

/* One expert's three matrices (w3 is NULL unless the activation is SwiGLU), and for FP8 weights
 * their float32 block scales, [ceil(rows/128), ceil(cols/128)] each (NULL for other dtypes). */
typedef struct moed_expert_w {
    const void *w1; /* [d_ff, d_model] */
    const void *w3; /* [d_ff, d_model] or NULL */
    const void *w2; /* [d_model, d_ff] */
    const float *s1, *s3, *s2;
} moed_expert_w;

typedef struct moed_layer {
    moed_layer_info info;
    moed_expert_w *experts;   /* n_experts of them (an expert shard's model leaves the matrices
                                 of the experts it does not hold NULL) */
    const void *router;       /* [n_experts, d_model] in moed_layer_router_dtype, or NULL */
    int router_dtype;         /* the router's moed_dtype as stored (never FP8); 0: wdtype */
    const float *router_bias; /* [n_experts] float32 (DeepSeek e_score_correction_bias), or NULL */
    moed_expert_w shared;     /* the shared experts fused along d_ff: [shared_d_ff, d_model] etc. */
    /* A placement hint, not part of the model: the measured load of each of the n_experts (its
     * (token, expert) pairs over some past run: moed --expert-load) and the layer's launches over
     * that run (0: unknown), which a backend splitting the layer over devices evens out instead
     * of the expected uniform load; NULL for none. */
    const double *expert_load;
    double expert_launches;
    /* An expert shard's view (moed --experts): for each of the whole layer's router_experts, its
     * id among the n_experts held, or -1; NULL for a whole layer. A job's host route comes in the
     * held numbering; a part's device routing (moed_backend.h) in the whole one, which the backend
     * renumbers by this map where the choice lies. */
    const int32_t *local_of;
} moed_layer;

/* The experts of a layer a daemon holding an expert shard loads (moed --experts): ids in
 * increasing order (NULL: every expert), and whether it loads the shared experts too. A NULL
 * subset stands for every expert and the shared ones. */
typedef struct moed_expert_subset {
    const int *ids;
    int n;
    bool shared;
} moed_expert_subset;

/* Checks a subset against a layer: it names at least one expert and every id one of the layer's
 * (MOED_EINVAL naming the first that does not). A NULL subset, or NULL ids, always fit. */
int moed_expert_subset_check(const moed_expert_subset *s, const moed_layer_info *li,
                             moed_error *err);

/* Whether subset s (NULL: every expert) holds expert e, and the shared experts. */
bool moed_expert_subset_has(const moed_expert_subset *s, int e);
bool moed_expert_subset_shared(const moed_expert_subset *s);

/* The dtype the router weights are held in: router_dtype, or the experts' wdtype when it is 0. */
int moed_layer_router_dtype(const moed_layer *l);

/* The router's rows and its logits' width: router_experts, or n_experts when it is 0. */
int moed_layer_router_experts(const moed_layer_info *li);

/* Bytes of one routed expert's weights (FP8: with their scales), and of the layer's resident
 * weights in all (an FP8 layer's router counted as bf16). */
uint64_t moed_layer_expert_bytes(const moed_layer_info *li);
uint64_t moed_layer_bytes(const moed_layer_info *li);

/* Name of an activation ("swiglu", "gelu", "relu") and the reverse (MOED_ACT_NONE if unknown). */
const char *moed_act_name(moed_act act);
moed_act moed_act_parse(const char *name);

#endif
