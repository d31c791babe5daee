/*
 * moed_prune — how much pruning a layer to 2:4 (moed --weights sparse24, moed_sp24.h's rule)
 * changes what it computes: ||y_pruned - y_dense|| / ||y_dense|| over a fixed batch, computed here
 * in double precision from the host weights, independently of any backend, so the number the log
 * states does not depend on the code it judges.
 *
 * The batch: MOED_PRUNE_TOKENS tokens of values uniform in [-1, 1), a counter-based function of
 * (MOED_PRUNE_SEED, layer, token, channel) (moed_prune_token_value), routed by the layer's own rule
 * from its router when it has one (logits summed in double, gated by moed_gate), else by the top_k
 * of seeded logits. Only the experts this batch routes to are computed, twice each (dense, then
 * pruned), so the cost is at most tokens x top_k expert evaluations per layer however many experts
 * it has. The shared experts (never pruned) add the same term to both sides.
 *
 * The loader feeds the probe each expert the batch reaches while it holds the dense values
 * (moed_prune_expert computes both sides, pruning each row's float32 copy by moed_sp24_prune),
 * then prunes them in place: no second copy of the layer is kept. An expert shard (moed --experts)
 * feeds the experts it holds: its error is that of its partial sum.
 */
#ifndef MOED_PRUNE_H
#define MOED_PRUNE_H

#include "moed_err.h"
#include "moed_model.h"
#include "moed_pool.h"
#include "moed_route.h"

#include <stdbool.h>
#include <stdint.h>

enum { MOED_PRUNE_TOKENS = 32 };
#define MOED_PRUNE_SEED 0x5ba4542c0ffeeULL

typedef struct moed_prune_probe {
    moed_layer_info info; /* the layer's (wdtype: its matrices' dtype) */
    int T;
    double *x;        /* [T, d_model] */
    moed_route route; /* the batch's pairs, weights with routed_scale in them */
    double *y_dense;  /* [T, d_model] */
    double *y_pruned; /* [T, d_model] */
    bool failed;      /* memory ran out computing a term: the error is NaN */
    int pairs;        /* the (token, expert) pairs computed (moed_prune_expert) */
    moed_pool *pool;  /* the threads the terms are computed on; NULL: the caller's alone */
} moed_prune_probe;

/* Token t's channel i of layer `layer`'s batch: uniform in [-1, 1). */
double moed_prune_token_value(int layer, int t, int i);

/* The batch for layer l (its info, router, router_dtype and router_bias; experts not read). */
int moed_prune_probe_init(moed_prune_probe *p, const moed_layer *l, moed_error *err);
void moed_prune_probe_free(moed_prune_probe *p);

/* Whether the batch routes any token to expert e. */
bool moed_prune_touches(const moed_prune_probe *p, int e);

/* Adds expert e's weighted term to y_dense, and the same with its matrices pruned by
 * moed_sp24_prune to y_pruned; w: the dense matrices, in the layer's wdtype (F32, F16 or BF16). */
void moed_prune_expert(moed_prune_probe *p, int e, const moed_expert_w *w);

/* Matrix w (rows x cols of dtype, memory the caller may write) pruned in place by
 * moed_sp24_prune, its rows in bands over the probe's threads. */
void moed_prune_matrix(moed_prune_probe *p, void *w, int dtype, int64_t rows, int64_t cols);

/* Adds the shared experts' term (w [shared_d_ff, ...]) to both sides. */
void moed_prune_shared(moed_prune_probe *p, const moed_expert_w *w);

/* ||y_pruned - y_dense|| / ||y_dense|| (Frobenius over the batch); NaN when y_dense is 0 (the
 * batch reached none of the experts fed, and there are no shared experts) or a term could not be
 * computed (no memory). */
double moed_prune_error(const moed_prune_probe *p);

#endif
