/*
 * moed_sched — the scheduler: merges queued requests into launches and runs them on the backend's
 * execution slots, one worker thread per slot.
 *
 * Requests queue by merge key (layer slot, dtype, batch-gating k): only requests with the same key
 * can share a launch. A free worker takes the ready queue whose oldest request has waited longest;
 * a queue is ready when its requests fill --max-batch-tokens or its oldest has waited
 * --max-delay-us (0: at once, merging only what is already queued). A launch takes requests while
 * they fit, never splitting one, owners (connections) taking turns, one request each, so that a
 * client with many requests queued holds a launch no longer than any other; within an owner, and
 * within the launch, requests keep their arrival order. The worker has each request copy its hidden
 * rows into its staging buffer, computes server-router logits and gates where asked, renumbers the
 * routes for an expert shard (shard.h), concatenates them, runs the backend, and hands each
 * request its rows.
 *
 * The queue never sees a request's payload (libuv's uv_queue_work shape): an item says what to
 * compute and where its rows are, and brings two callbacks for its data, copy_in to fill its rows
 * of the staging and done to take its output. An item whose rows lie in memory the backend may
 * use as it is (a buffer of the staging pool, a client's region) names it in `mem`, and the backend
 * copies from and to it directly; otherwise copy_in fills the worker's staging and done gets the
 * output from it. Each item is one part of the backend's job (moed_part). An item whose expert
 * choice stays in device memory names it in mem.route (its route then has T tokens and no pair):
 * the backend checks it where it lies and a refused one fails that item alone (INVALID_ARGUMENT
 * with the backend's message), also on an expert shard, whose backend renumbers it there (the
 * worker renumbers host routes, moed_shard_localize). Each such item counts T x k pairs toward the
 * launch. So where hidden lives (in a message's slices, a pinned buffer, shared or GPU
 * memory) and where the output goes is the submitter's business alone.
 *
 * Threads: submit and cancel come from the gRPC completion-queue threads and the doorbell's poller
 * (doorbell.h); copy_in runs on a worker; `done` is called on a worker thread (or on the thread
 * that cancelled) exactly once for every item that submit accepted. After done returns, the
 * scheduler no longer touches the item.
 */
#ifndef MOED_SCHEDULER_H
#define MOED_SCHEDULER_H

#include "metrics.h"
#include "moed_backend.h"
#include "moed_list.h"
#include "moed_model.h"
#include "moed_route.h"
#include "moed_time.h"
#include "shard.h"
#include "timings.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct moed_sched moed_sched;
typedef struct moed_sched_item moed_sched_item;

/* What a request came to: status 0 with its output rows, or an error. */
typedef struct moed_sched_result {
    int status;            /* 0 or a MOED_E* code */
    const moed_error *err; /* the reason, when status != 0 */
    const void *y; /* [T, d_model] output in the request's dtype, when status == 0: mem.y, or the
                      worker's staging, valid during the done call only */
    size_t y_bytes;
    const int32_t *expert_set; /* batch gating: S in decreasing score order */
    int n_expert_set;
    moed_timings timings;
} moed_sched_result;

/* Writes the item's hidden rows, T x d_model values of its dtype, to dst: host staging memory
 * (the backend's host_alloc). Called only when mem.x is NULL. 0, or a MOED_E* code with err
 * filled: then the item alone fails, and its launch runs without it. */
typedef int (*moed_sched_copy_fn)(moed_sched_item *it, void *dst, moed_error *err);

/* Delivers the item's outcome (see moed_sched_result). */
typedef void (*moed_sched_done_fn)(moed_sched_item *it, const moed_sched_result *res);

struct moed_sched_item {
    /* What to compute, set by the submitter (request.c validates a request into these). */
    int slot; /* backend slot of the layer */
    const moed_layer *layer;
    int dtype; /* of hidden and of the output */
    int64_t T;
    moed_route route;      /* per-token route, when decided before queueing (route.off != NULL) */
    bool server_logits;    /* the worker computes logits with the layer's router */
    moed_gate_params gate; /* resolved; applied by the worker to server logits */
    int k_batch;           /* > 0: batch-level gating over the merged batch with this k */
    float *logits;         /* batch gating with client logits: [T, n_experts] */
    int64_t pairs; /* (token, expert) pairs it adds to a launch: its route's, T x k_batch, or (the
                      worker gates server logits) the most its gate can keep */
    /* route and logits stay the submitter's to free, after done; the worker may replace route
     * (gating server logits) with one the submitter then frees the same way. */

    /* Where the backend reads the rows and writes the output as they are (host or device memory,
     * moed_part's x, x_dev, y, y_dev; rows is set by the worker); x or y NULL: the worker's
     * staging, through copy_in and done. */
    moed_part mem;

    /* The payload's two ends, and when the call arrived and must be answered by. */
    moed_sched_copy_fn copy_in;
    moed_sched_done_fn done;
    void *user;
    /* Whose request it is (a connection): an owner's requests take turns with other owners' in a
     * queue (see moed_sched); NULL: its own. Compared, never dereferenced. */
    const void *owner;
    uint64_t t_received_ns; /* moed_now_ns() when the call arrived: total_us counts from it */
    uint64_t deadline_ns;   /* moed_now_ns() clock; 0: none */

    /* The scheduler's own. */
    moed_list node;       /* on its queue while queued, in arrival order */
    moed_list turn_node;  /* on its queue's turns while its owner's oldest */
    moed_list owner_node; /* among its owner's requests queued */
    uint64_t seq;         /* its place in the arrival order */
    void *queue;
    int state;
    _Atomic bool cancelled; /* the caller went while its launch was being assembled */
    uint64_t t_enqueued_ns;
};

typedef struct moed_sched_config {
    moed_backend *backend;           /* started; its n_exec workers are created */
    const moed_layer *const *layers; /* the resident layers by backend slot: sizes the staging */
    const moed_shard *shards;        /* by slot: the experts the backend holds of each (routes are
                                        renumbered for it before a launch); NULL: every expert */
    int n_layers;
    int64_t max_batch_tokens;
    int64_t max_batch_pairs; /* a launch's (token, expert) pairs (moed_sched_item.pairs); 0: no
                                bound */
    int64_t max_delay_us;
    int64_t min_batch_requests; /* ready before the window closes once this many wait; <= 1: off */
    int64_t max_queue_requests;
    moed_metrics *metrics; /* launches, queue waits and tokens per expert are recorded here; or
                              NULL */
} moed_sched_config;

typedef struct moed_sched_stats {
    uint64_t submitted, rejected, cancelled, expired, failed, completed;
    uint64_t batches, batch_tokens;
    uint64_t queued;     /* now */
    uint64_t running;    /* now: workers (execution slots) running a launch */
    uint64_t compute_us; /* summed over launches */
} moed_sched_stats;

/* Allocates each worker's staging (backend host_alloc: max_batch_tokens x the largest d_model x 4
 * bytes, in and out) and starts the workers. MOED_ENOMEM names the bytes. */
int moed_sched_create(const moed_sched_config *cfg, moed_sched **out, moed_error *err);

/* Queues it; 0, or MOED_EFULL (queue bound) / MOED_EDRAINING with err filled, in which case done
 * is not called and the caller answers. */
int moed_sched_submit(moed_sched *s, moed_sched_item *it, moed_error *err);

/* The call went away: a queued item leaves its queue and done is called on this thread, with
 * MOED_EDEADLINE when its deadline has passed (gRPC cancels expired calls) and MOED_ECANCELLED
 * otherwise; an item whose launch is being assembled is dropped from it (done with the same
 * codes, on the worker) unless the backend has it already; then it runs to completion and its
 * result is discarded. */
void moed_sched_cancel(moed_sched *s, moed_sched_item *it);

/* Closes every merge window now and from now on (the drain's first step): what is queued, and
 * what comes later, is launched without waiting for more requests. */
void moed_sched_flush(moed_sched *s);

/* Stops accepting, runs everything queued (without waiting for merge windows), then stops and
 * joins the workers. */
void moed_sched_drain(moed_sched *s);

/* Drains if needed and frees staging and the scheduler. */
void moed_sched_destroy(moed_sched *s);

void moed_sched_get_stats(moed_sched *s, moed_sched_stats *out);

#endif
