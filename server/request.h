/*
 * moed_request — checks a decoded ForwardRequest against what this server holds and turns it into
 * a work item the scheduler can run without further questions.
 *
 * Everything a caller can get wrong is found here, on the completion-queue thread, before the
 * request takes a place in a queue: a bad request is answered at once and never reaches a batch it
 * could spoil. Client routing (expert ids and weights, or logits with a per-token strategy) is
 * turned into a route here too; only what needs the merged batch or the backend (server-router
 * logits, batch-level gating) is left to the scheduler's worker.
 */
#ifndef MOED_REQUEST_H
#define MOED_REQUEST_H

#include "moed_err.h"
#include "moed_model.h"
#include "scheduler.h"
#include "shard.h"
#include "wire.h"

#include <stdint.h>

#define MOED_REQUEST_ID_MAX 128

/* What this server serves: the resident layers by backend slot, and the request limits. */
typedef struct moed_served {
    const moed_layer *const *layers; /* [n_layers], the backend slot is the position */
    const moed_shard *shards;        /* [n_layers]: the experts held of each; NULL: all of them */
    int n_layers;
    int64_t max_batch_tokens;  /* --max-batch-tokens */
    int64_t max_message_bytes; /* --max-message-bytes */
    int64_t max_batch_pairs; /* --max-batch-pairs: (token, expert) pairs in one request; 0: none */
} moed_served;

/* A validated request: who asked, where its hidden rows lie, and the scheduler item that says
 * what to compute and how it is routed. */
typedef struct moed_work {
    char request_id[MOED_REQUEST_ID_MAX + 1];
    size_t request_id_len;
    moed_span hidden; /* [T, d_model] bytes in the request's slices */
    /* Ready to submit once the caller sets done, user and the times; its copy_in copies hidden. */
    moed_sched_item item;
} moed_work;

/* Validates q against s and fills w (which moed_work_free releases, also after a failure).
 * w->hidden points into the message's slices, as q's spans do: they stay open until done. Errors
 * carry the status code (moed_err.h) and a message naming the field, the values and
 * the fix. */
int moed_request_validate(const moed_served *s, const moed_wire_request *q, moed_work *w,
                          moed_error *err);
void moed_work_free(moed_work *w);

/* "0-3,7" for the layers served, for messages and logs. */
void moed_served_layer_list(const moed_served *s, char *buf, size_t n);

#endif
