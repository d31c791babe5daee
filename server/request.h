/*
 * moed_request — checks a decoded ForwardRequest against what this server holds and turns it into
 * a work item the scheduler can run without further questions.
 *
 * Everything a caller can get wrong is found here, on the completion-queue thread, before the
 * request takes a place in a queue: a bad request is answered at once and never reaches a batch it
 * could spoil. Client routing (expert ids and weights, or logits with a per-token strategy) is
 * turned into a route here too; only what needs the merged batch or the backend (server-router
 * logits, batch-level gating) is left to the scheduler's worker.
 *
 * Where the tensors are is settled here too. Inline hidden rows are copied once, now, into a
 * buffer of the staging pool (the backend reads them from there and writes the output into the
 * same buffer, which becomes the reply); without room in the pool they stay in the message and the
 * worker copies them. Tensors in regions are bounds-checked and their regions held; hidden and the
 * output are handed to the backend where they lie when it may touch that memory
 * (moed_region_direct), else copied under moed_guard. Routing tensors are copied out at once
 * (guarded, or read from the GPU) and checked here, except expert choices whose ids and weights
 * both lie in CUDA regions of one GPU: those stay there, their regions held, and go to the backend
 * as the item's device routing (moed_part_route), which the backend checks where they lie; the
 * item's host route then has T tokens and no pair.
 *
 * A doorbell call (doorbell.h) is the same Forward in another encoding: moed_request_from_ring
 * turns a ring descriptor into the request it stands for, and moed_request_validate checks it by
 * the same rules, with the ring's principal.
 */
#ifndef MOED_REQUEST_H
#define MOED_REQUEST_H

#include "bufpool.h"
#include "moed_err.h"
#include "moed_model.h"
#include "moed_ring.h"
#include "region.h"
#include "scheduler.h"
#include "shard.h"
#include "wire.h"

#include <stdint.h>

#define MOED_REQUEST_ID_MAX 128

typedef struct moed_rebalance moed_rebalance; /* rebalance.h */

/* What this server serves: the resident layers by backend slot, and the request limits. */
typedef struct moed_served {
    const moed_layer *const *layers; /* [n_layers], the backend slot is the position */
    const moed_shard *shards;        /* [n_layers]: the experts held of each; NULL: all of them */
    int n_layers;
    int64_t max_batch_tokens;  /* --max-batch-tokens */
    int64_t max_message_bytes; /* --max-message-bytes */
    int64_t max_batch_pairs; /* --max-batch-pairs: (token, expert) pairs in one request; 0: none */
    moed_regions *regions;   /* the region registry; NULL: regions are off */
    moed_bufpool *pool;      /* inline hidden rows and replies; NULL: none */
    uint64_t fingerprint;    /* the model's (ModelInfo.model_fingerprint) */
    /* the re-placements by measured load (LayerInfo.placement_generation); NULL: none */
    const moed_rebalance *rebalance;
} moed_served;

/* Who sent a request: whether it came from this host (loopback or a unix socket), and the
 * principal whose regions it may name, asked for (principal(ctx, ...)) only when a tensor names a
 * region: finding it may take a system call, and fails (FAILED_PRECONDITION, saying what to do)
 * for a caller whose regions would be anyone's. */
typedef struct moed_caller {
    bool local;
    int (*principal)(void *ctx, moed_principal *out, moed_error *err);
    void *ctx;
} moed_caller;

/* A validated request: who asked, where its hidden rows lie, and the scheduler item that says
 * what to compute and how it is routed. */
typedef struct moed_work {
    char request_id[MOED_REQUEST_ID_MAX + 1];
    size_t request_id_len;
    moed_span hidden;           /* [T, d_model] bytes in the request's slices (inline) */
    moed_regions *regions;      /* where the references below go back to */
    moed_region *hidden_region; /* held until moed_work_free; or NULL */
    const void *hidden_at;      /* hidden's bytes in it (copied by copy_in unless direct) */
    moed_region *out_region;    /* the output's region, held; or NULL */
    void *out_at;               /* where in it the output goes */
    moed_wire_ref out_ref;      /* as the request named it (the reply names it back) */
    moed_region *ids_region, *weights_region; /* device routing's regions, held; or NULL */
    moed_part_route route; /* device routing (item.mem.route points here when it is used) */
    void *buf;             /* staging-pool buffer: hidden rows, then the output; or NULL */
    /* Ready to submit once the caller sets done, user and the times. */
    moed_sched_item item;
} moed_work;

/* Validates q from caller c against s and fills w (which moed_work_free releases, also after a
 * failure). w->hidden points into the message's slices, as q's spans do: they stay open until
 * done. Errors carry the status code (moed_err.h) and a message naming the field, the values and
 * the fix. */
int moed_request_validate(const moed_served *s, const moed_caller *c, const moed_wire_request *q,
                          moed_work *w, moed_error *err);

/* The ForwardRequest a ring descriptor stands for (a copy the caller can no longer change): layer,
 * hidden [tokens, d_model] of dtype, expert_ids [tokens, top_k] I32 and expert_weights [tokens,
 * top_k] F32, the output, each in the region it names; the request's spans are empty. Only what
 * has no ForwardRequest field is checked here (flags and reserved must be 0, MOED_EINVAL); the rest
 * is moed_request_validate's. */
int moed_request_from_ring(const moed_served *s, const moed_ring_request *d, moed_wire_request *q,
                           moed_error *err);

/* Puts a computed output where the request asked (res->y is the scheduler's result): nothing to
 * do when the backend wrote it there; for a host region it could not write, a guarded copy. Then
 * *data is the reply's data slice (empty for a region; the pool buffer itself when the output is
 * in it, which the slice then owns) and *ref the region to name, or NULL. */
int moed_work_output(moed_work *w, const void *y, size_t y_bytes, grpc_slice *data,
                     const moed_wire_ref **ref, moed_error *err);

void moed_work_free(moed_work *w);

/* "0-3,7" for the layers served, for messages and logs. */
void moed_served_layer_list(const moed_served *s, char *buf, size_t n);

/* Layer slot i's held experts as ranges (LayerInfo.experts_held): up to cap into lo[]/hi[];
 * returns how many there are (cap 0 counts). */
int moed_served_held(const moed_served *s, int i, uint32_t *lo, uint32_t *hi, int cap);
/* Whether layer slot i's replies include the shared experts' term (adds_shared_experts). */
bool moed_served_adds_shared(const moed_served *s, int i);

#endif
