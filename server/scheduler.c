/*
 * moed_sched — merge queues, worker threads and the launch pipeline of one merged batch.
 *
 * Why this shape: merging only pays when requests share weights (one layer), a dtype (one kernel
 * instantiation) and, for batch-level gating, one k (the expert set is chosen over the merged
 * batch). So a queue per merge key; one mutex over all queues (operations under it are a few
 * pointer moves; the work — copies, gating, compute — happens outside it); one condition variable
 * that idle workers wait on, with a timeout when a merge window is open. Wake-ups are broadcasts:
 * with several GPUs a worker runs only the layers resident on its own (backend exec_accepts), so
 * waking one arbitrary worker could leave the right one asleep. A condition's wake-up costs a
 * request tens of microseconds (a link call's queue time on H200s: docs/fleets.md, "Measured"),
 * so one idle worker at a time that ran a launch within the wait policy's spin (moed_backoff.h)
 * spins instead, watching a count of the wake-ups (every broadcast adds one), and takes the next
 * request as it comes: a caller calling once per layer per step finds a worker awake.
 *
 * A launch never splits a request and never lets one request's bad data spoil the others: a
 * request whose copy-in fails, or whose server-side gating fails (NaN logits from its own hidden
 * rows), is answered with its error and its rows leave the launch before the backend runs; one
 * whose device routing the backend refuses (moed_part_route.err) is answered with that error after
 * the launch, and the others' outputs are as without it.
 *
 * Each request is one part of the backend's job: its rows stay where the request keeps them when
 * the backend may read them there (item.mem), else they are copied into the worker's staging at a
 * row of their own. A request that leaves the launch just leaves the list of parts: nothing is
 * moved.
 */
#include "scheduler.h"

#include "moed_backoff.h"
#include "moed_dtype.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { ST_NEW = 0, ST_QUEUED, ST_RUNNING, ST_DONE };

typedef struct queue {
    int slot, dtype, k_batch; /* the merge key */
    moed_list items;          /* of moed_sched_item.node, in arrival order */
    moed_list turns; /* of moed_sched_item.turn_node: each owner's oldest, the next to go first */
    int64_t tokens;  /* queued in this queue */
    int64_t n;       /* requests queued in this queue */
    int in_flight;   /* launches of this queue running now */
    moed_list active_node; /* on s->active while items is not empty */
} queue;

typedef struct worker {
    moed_sched *s;
    int exec;
    pthread_t thread;
    bool started;
    void *x, *y;      /* staging, host_alloc'd: [max_batch_tokens, max d_model] x 4 bytes */
    float *logits;    /* [max_batch_tokens, max n_experts] */
    int32_t *set;     /* batch gating's expert set */
    moed_route route; /* the merged per-token route, grown on demand */
    int64_t route_T;  /* tokens route.off has room for */
    moed_sched_item **items;
    const moed_route **parts;
    int64_t *rows, *tokens;  /* per item of the launch: first row and T */
    int64_t *stage;          /* per item: its first row in the staging (x and y) */
    moed_part *mem;          /* per item: the backend job's parts */
    uint64_t *expert_tokens; /* a launch's pairs per expert the backend holds, for the metrics */
} worker;

/* One launch on a worker: what its requests share, and how many of them are still in it (a
 * request that fails alone leaves; the others' rows close up behind it). */
typedef struct launch {
    const moed_layer *layer;
    int slot, dtype, k_batch, E;
    size_t row_bytes;
    int n;                   /* requests: the worker's items[0 .. n) */
    int64_t T;               /* their tokens */
    moed_route batch;        /* batch gating's route */
    const moed_route *route; /* what the backend runs */
} launch;

struct moed_sched {
    moed_sched_config cfg;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    queue **queues;
    int n_queues, cap_queues;
    moed_list active; /* of queue.active_node: the non-empty queues */
    int64_t queued;
    uint64_t seq;           /* arrivals so far: moed_sched_item.seq */
    bool spinner;           /* an idle worker spins (worker_main) */
    _Atomic uint64_t wakes; /* broadcasts of wake so far: what a spinning worker watches */
    bool draining;
    bool flushing; /* merge windows are closed: see moed_sched_flush */
    worker *workers;
    int n_workers;
    int max_items; /* per launch: every request has T >= 1 and sits in the bounded queue */
    int max_experts;
    size_t staging_bytes, logits_bytes;
    _Atomic uint64_t submitted, rejected, cancelled, expired, failed, completed, batches,
        batch_tokens, compute_us, running;
};

/* Wakes the idle workers, waiting or spinning (under s->lock). */
static void wake_all(moed_sched *s)
{
    atomic_fetch_add(&s->wakes, 1);
    pthread_cond_broadcast(&s->wake);
}

/* ---- queues (all under s->lock) -------------------------------------------------------------- */

static queue *find_queue(moed_sched *s, const moed_sched_item *it)
{
    for (int i = 0; i < s->n_queues; i++) {
        queue *q = s->queues[i];
        if (q->slot == it->slot && q->dtype == it->dtype && q->k_batch == it->k_batch) return q;
    }
    if (s->n_queues == s->cap_queues) {
        int cap = s->cap_queues ? 2 * s->cap_queues : 16;
        queue **nq = realloc(s->queues, (size_t)cap * sizeof *nq);
        if (!nq) return NULL;
        s->queues = nq;
        s->cap_queues = cap;
    }
    queue *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    q->slot = it->slot;
    q->dtype = it->dtype;
    q->k_batch = it->k_batch;
    moed_list_init(&q->items);
    moed_list_init(&q->turns);
    s->queues[s->n_queues++] = q;
    return q;
}

static moed_sched_item *oldest(const queue *q)
{
    return moed_list_data(moed_list_head(&q->items), moed_sched_item, node);
}

/* Each owner's requests in a queue take turns with other owners' (see take_batch): the owner's
 * oldest stands in q->turns, and its others follow it on a ring of their own (owner_node, no
 * list head: the one in q->turns is the first). An owner with no request queued has no place, so
 * nothing is allocated. NULL owners each stand alone. */
static moed_sched_item *turn_of(const queue *q, const void *owner)
{
    moed_list *n;
    if (owner)
        moed_list_foreach (n, &q->turns) {
            moed_sched_item *it = moed_list_data(n, moed_sched_item, turn_node);
            if (it->owner == owner) return it;
        }
    return NULL;
}

/* it leaves its owner's requests; the next of them takes its place in q->turns, or the last place
 * when `rotate` (it had its turn). */
static void leave_turn(queue *q, moed_sched_item *it, bool rotate)
{
    moed_list *next = it->owner_node.next;
    moed_list_remove(&it->owner_node);
    if (moed_list_empty(&it->turn_node)) return; /* not its owner's oldest */
    moed_list *at = rotate ? &q->turns : it->turn_node.next;
    moed_list_remove(&it->turn_node);
    moed_list_init(&it->turn_node);
    if (next == &it->owner_node) return; /* its owner had no other */
    moed_sched_item *n = moed_list_data(next, moed_sched_item, owner_node);
    moed_list_insert_tail(at, &n->turn_node); /* before `at`: in its place, or last */
}

static void push(moed_sched *s, queue *q, moed_sched_item *it)
{
    if (moed_list_empty(&q->items)) moed_list_insert_head(&s->active, &q->active_node);
    it->queue = q;
    it->seq = s->seq++;
    moed_list_insert_tail(&q->items, &it->node);
    moed_sched_item *first = turn_of(q, it->owner);
    moed_list_init(&it->turn_node);
    if (first) {
        moed_list_insert_tail(&first->owner_node, &it->owner_node); /* last of its owner's */
    } else {
        moed_list_init(&it->owner_node);
        moed_list_insert_tail(&q->turns, &it->turn_node); /* a new owner goes last */
    }
    q->tokens += it->T;
    q->n++;
    s->queued++;
}

/* Out of its queue; `took`: taken into a launch (its owner had its turn). */
static void unlink_item(moed_sched *s, moed_sched_item *it, bool took)
{
    queue *q = it->queue;
    moed_list_remove(&it->node);
    leave_turn(q, it, took);
    q->tokens -= it->T;
    q->n--;
    s->queued--;
    if (moed_list_empty(&q->items)) moed_list_remove(&q->active_node);
}

/* The ready queue whose oldest request has waited longest, or NULL and the time the next merge
 * window closes (*wake_at, 0 if no window is open).
 *
 * A queue is ready when its oldest request has waited the merge window, or earlier once it holds
 * min_batch_requests requests or a full batch of tokens. A queue with a launch running is ready
 * only when a full batch waits: while small batches are weight-bound, two concurrent launches of
 * one layer each read every expert's weights and each runs at half speed, while waiting for the
 * running one and merging everything that arrived meanwhile reads them once. The worker that
 * finishes the running launch looks again at once. */
static queue *pick_queue(moed_sched *s, int exec, uint64_t now, uint64_t *wake_at)
{
    uint64_t delay = (uint64_t)s->cfg.max_delay_us * 1000u;
    moed_backend *b = s->cfg.backend;
    queue *best = NULL;
    moed_list *n;
    *wake_at = 0;
    moed_list_foreach (n, &s->active) {
        queue *q = moed_list_data(n, queue, active_node);
        if (!moed_backend_exec_accepts(b, exec, q->slot)) continue;
        uint64_t t0 = oldest(q)->t_enqueued_ns;
        bool full = q->tokens >= s->cfg.max_batch_tokens;
        bool enough = s->cfg.min_batch_requests > 1 && q->n >= s->cfg.min_batch_requests;
        bool ready =
            s->draining || s->flushing || full || (!q->in_flight && (enough || now >= t0 + delay));
        if (ready && (!best || t0 < oldest(best)->t_enqueued_ns)) best = q;
        if (!ready && !q->in_flight && (!*wake_at || t0 + delay < *wake_at)) *wake_at = t0 + delay;
    }
    return best;
}

static int by_arrival(const void *a, const void *b)
{
    uint64_t x = (*(moed_sched_item *const *)a)->seq, y = (*(moed_sched_item *const *)b)->seq;
    return (x > y) - (x < y);
}

/* Takes the queue's requests while they fit in one launch (tokens and pairs; the first always
 * goes, a request never being larger than the limits allow), owners taking turns: each owner's
 * oldest request in the order of q->turns, an owner going last once its request is taken, until
 * the next in turn does not fit (it goes first next time: a large request is never passed over
 * for smaller ones). So one owner (a connection: see moed_sched_item.owner) with many requests
 * queued holds a launch no longer than any other. Those whose deadline has passed are moved to
 * `expired` instead. The launch has them in arrival order, as it would have without turns. Returns
 * the number taken into items. */
static int take_batch(moed_sched *s, queue *q, uint64_t now, moed_sched_item **items,
                      moed_list *expired)
{
    int n = 0;
    int64_t tokens = 0, pairs = 0;
    while (!moed_list_empty(&q->turns) && n < s->max_items) {
        moed_sched_item *it = moed_list_data(moed_list_head(&q->turns), moed_sched_item, turn_node);
        if (it->deadline_ns && now >= it->deadline_ns) {
            unlink_item(s, it, false);
            it->state = ST_DONE;
            moed_list_insert_tail(expired, &it->node);
        } else if (tokens + it->T <= s->cfg.max_batch_tokens &&
                   (!n || pairs + it->pairs <= s->cfg.max_batch_pairs)) {
            unlink_item(s, it, true);
            it->state = ST_RUNNING;
            atomic_store(&it->cancelled, false);
            tokens += it->T;
            pairs += it->pairs;
            items[n++] = it;
        } else {
            break;
        }
    }
    qsort(items, (size_t)n, sizeof *items, by_arrival);
    return n;
}

/* ---- results --------------------------------------------------------------------------------- */

static void finish_error(moed_sched *s, moed_sched_item *it, int code, const moed_error *err)
{
    moed_sched_result r = { .status = code, .err = err };
    atomic_fetch_add(code == MOED_EDEADLINE    ? &s->expired
                     : code == MOED_ECANCELLED ? &s->cancelled
                                               : &s->failed,
                     1);
    it->done(it, &r);
}

static void finish_expired(moed_sched *s, moed_list *expired)
{
    while (!moed_list_empty(expired)) {
        moed_sched_item *it = moed_list_data(moed_list_head(expired), moed_sched_item, node);
        moed_list_remove(&it->node); /* before done, after which the item may be gone */
        moed_error err;
        uint64_t waited = (moed_now_ns() - it->t_received_ns) / 1000u;
        moed_fail(&err, MOED_EDEADLINE,
                  "the deadline passed after %llu us while the request waited in the queue; "
                  "allow more time or send to a less loaded server",
                  (unsigned long long)waited);
        finish_error(s, it, MOED_EDEADLINE, &err);
    }
}

/* ---- one launch (a worker thread, without the lock) ------------------------------------------ */

static int ensure_route(worker *w, int64_t T, int64_t pairs)
{
    if (w->route.off && T <= w->route_T && pairs <= w->route.cap) return 0;
    int64_t nt = T > 2 * w->route_T ? T : 2 * w->route_T;
    int64_t np = pairs > 2 * w->route.cap ? pairs : 2 * w->route.cap;
    if (nt > w->s->cfg.max_batch_tokens) nt = w->s->cfg.max_batch_tokens;
    moed_route_free(&w->route);
    w->route_T = 0;
    if (moed_route_init(&w->route, nt, np)) return MOED_ENOMEM;
    w->route_T = nt;
    return 0;
}

/* A request whose caller has gone while its launch was assembled (cancelled, or past its
 * deadline) is answered so, and computes nothing. */
static bool answer_if_gone(moed_sched *s, moed_sched_item *it)
{
    moed_error err;
    /* Past its deadline first: gRPC cancels expired calls, and that is an expiry. */
    int code = it->deadline_ns && moed_now_ns() >= it->deadline_ns ? MOED_EDEADLINE
               : atomic_load(&it->cancelled)                       ? MOED_ECANCELLED
                                                                   : 0;
    if (!code) return false;
    moed_fail(&err, code,
              code == MOED_ECANCELLED
                  ? "the call was cancelled while its launch was assembled"
                  : "the deadline passed while the request's launch was assembled; allow more "
                    "time or send to a less loaded server");
    finish_error(s, it, code, &err);
    return true;
}

/* Has each request whose rows the backend cannot read where they are copy them into the staging,
 * at rows of its own; a request whose copy fails, or whose caller has gone, is answered now and
 * leaves the launch. */
static void stage_in(worker *w, launch *l)
{
    int m = 0;
    int64_t T = 0;
    for (int i = 0; i < l->n; i++) {
        moed_sched_item *it = w->items[i];
        moed_error err = { 0 };
        if (answer_if_gone(w->s, it)) continue;
        int rc = it->mem.x ? 0 : it->copy_in(it, (char *)w->x + T * l->row_bytes, &err);
        if (rc) {
            finish_error(w->s, it, rc, &err);
            continue;
        }
        w->items[m] = it;
        w->rows[m] = T;
        w->stage[m] = T;
        w->tokens[m] = it->T;
        T += it->T;
        m++;
    }
    l->n = m;
    l->T = T;
}

/* The job's parts: each request's rows where it keeps them, or its rows of the staging. */
static void set_parts(worker *w, const launch *l)
{
    for (int i = 0; i < l->n; i++) {
        const moed_sched_item *it = w->items[i];
        moed_part *p = &w->mem[i];
        const size_t at = (size_t)w->stage[i] * l->row_bytes;
        *p = it->mem;
        p->rows = it->T;
        if (!it->mem.x) {
            p->x = (char *)w->x + at;
            p->x_dev = MOED_HOST_MEM;
        }
        if (!it->mem.y) {
            p->y = (char *)w->y + at;
            p->y_dev = MOED_HOST_MEM;
        }
    }
}

/* The requests whose caller went while the server router ran leave the launch (items[i] = NULL);
 * returns how many. */
static int drop_gone(worker *w, const launch *l)
{
    int n = 0;
    for (int i = 0; i < l->n; i++)
        if (answer_if_gone(w->s, w->items[i])) {
            w->items[i] = NULL;
            n++;
        }
    return n;
}

/* Routes every request that is routed on the worker: server-router logits gated per token, or the
 * logits rows of a batch-gated launch gathered. A request that fails (also one whose gating keeps
 * more pairs than --max-batch-pairs) is answered now and its slot in items set to NULL. */
static void route_requests(worker *w, const launch *l)
{
    int E = l->E;
    int64_t max_pairs = w->s->cfg.max_batch_pairs;
    for (int i = 0; i < l->n; i++) {
        moed_sched_item *it = w->items[i];
        if (!it) continue;
        float *lg = w->logits + w->rows[i] * E;
        moed_error err = { 0 };
        int rc = 0;
        if (l->k_batch && !it->server_logits) {
            memcpy(lg, it->logits, (size_t)(it->T * E) * sizeof *lg);
        } else if (l->k_batch) {
            for (int64_t j = 0; j < it->T * E && !rc; j++)
                if (!isfinite(lg[j]))
                    rc = moed_fail(&err, MOED_EINVAL,
                                   "the server router's logits for token %lld, expert %lld are %g: "
                                   "check hidden for NaN or Inf",
                                   (long long)(j / E), (long long)(j % E), (double)lg[j]);
        } else if (it->server_logits) {
            moed_route_free(&it->route);
            rc = moed_gate(&it->gate, &l->layer->info, l->layer->router_bias, lg, it->T, &it->route,
                           &err);
            if (rc)
                moed_error_prefix(&err, "gating the server router's logits");
            else if (it->route.off[it->T] > max_pairs)
                rc = moed_fail(&err, MOED_ETOOBIG,
                               "gating the server router's logits kept %lld (token, expert) "
                               "pairs, over this server's --max-batch-pairs = %lld: send fewer "
                               "tokens, a higher threshold, or a top-k strategy",
                               (long long)it->route.off[it->T], (long long)max_pairs);
        }
        if (rc) {
            finish_error(w->s, it, rc, &err);
            w->items[i] = NULL;
        }
    }
}

/* Takes failed requests out of the launch (and their rows out of the logits, when the launch has
 * them): items, rows, staging rows and tokens compacted alike, l->n and l->T what is left. */
static void compact(worker *w, launch *l, bool logits)
{
    int m = 0;
    int64_t row = 0;
    for (int i = 0; i < l->n; i++) {
        if (!w->items[i]) continue;
        if (w->rows[i] != row && logits)
            memmove(w->logits + row * l->E, w->logits + w->rows[i] * l->E,
                    (size_t)(w->tokens[i] * l->E) * sizeof(float));
        w->items[m] = w->items[i];
        w->tokens[m] = w->tokens[i];
        w->stage[m] = w->stage[i];
        w->rows[m] = row;
        row += w->tokens[i];
        m++;
    }
    l->n = m;
    l->T = row;
}

/* An expert shard's backend holds some experts only: each host route in its numbering (a device
 * route the backend renumbers where it lies, moed_layer.local_of). */
static void localize(worker *w, const launch *l)
{
    const moed_shard *sh = w->s->cfg.shards ? &w->s->cfg.shards[l->slot] : NULL;
    if (!sh || moed_shard_all_experts(sh)) return;
    for (int i = 0; i < l->n; i++)
        if (!w->items[i]->mem.route) moed_shard_localize(sh, &w->items[i]->route);
}

/* The merged route: batch gating over the launch's logits, or the requests' routes end to end. */
static int merge_routes(worker *w, launch *l, moed_error *err)
{
    if (l->k_batch) {
        l->route = &l->batch;
        return moed_gate_batch(w->logits, l->T, l->E, l->k_batch, w->set, &l->batch, err);
    }
    int64_t pairs = 0;
    for (int i = 0; i < l->n; i++) {
        w->parts[i] = &w->items[i]->route;
        pairs += w->parts[i]->off[w->parts[i]->T];
    }
    if (ensure_route(w, l->T, pairs))
        return moed_fail(err, MOED_ENOMEM, "no memory for a route of %lld pairs", (long long)pairs);
    l->route = &w->route;
    w->route.T = w->route_T; /* concat checks room against T, and leaves T at the launch's */
    if (moed_route_concat(&w->route, w->parts, l->n))
        return moed_fail(err, MOED_EINTERNAL, "merging %d routes of %lld tokens failed", l->n,
                         (long long)l->T);
    return 0;
}

/* Everything the launch does on the device: staging, server-router logits, gating, the backend.
 * Requests that fail alone have been answered and left; a failure returned is the launch's. */
static int compute(worker *w, launch *l, moed_error *err)
{
    moed_backend *b = w->s->cfg.backend;
    bool server = false;
    stage_in(w, l);
    for (int i = 0; i < l->n; i++) server |= w->items[i]->server_logits;
    moed_job job = { .slot = l->slot, .dtype = l->dtype, .T = l->T, .parts = w->mem };
    int rc = 0;
    if (server && l->n) {
        set_parts(w, l);
        job.n_parts = l->n;
        rc = moed_backend_router_logits(b, w->exec, &job, w->logits, err);
    }
    if (rc) return rc;
    int dropped = drop_gone(w, l); /* the server router may have taken a while */
    if (server || l->k_batch) route_requests(w, l);
    if (dropped || server || l->k_batch) compact(w, l, server || l->k_batch);
    localize(w, l);
    if (!l->n || (rc = merge_routes(w, l, err))) return rc;
    set_parts(w, l);
    job.T = l->T;
    job.n_parts = l->n;
    job.route = l->route;
    return moed_backend_forward(b, w->exec, &job, err);
}

/* The launch's (token, expert) pairs per expert, into the metrics (a per-launch add). */
static void count_experts(worker *w, const launch *l)
{
    moed_sched *s = w->s;
    if (!s->cfg.metrics) return;
    const int n = s->cfg.shards ? s->cfg.shards[l->slot].view.info.n_experts : l->E;
    const moed_route *r = l->route;
    memset(w->expert_tokens, 0, (size_t)n * sizeof *w->expert_tokens);
    for (int64_t p = 0; p < r->off[r->T]; p++) w->expert_tokens[r->expert[p]]++;
    moed_metrics_expert_tokens(s->cfg.metrics, l->slot, w->expert_tokens, n);
}

/* Hands each request of a computed launch its rows. */
static void deliver(worker *w, const launch *l, uint64_t t_launch)
{
    moed_sched *s = w->s;
    uint64_t t_done = moed_now_ns();
    atomic_fetch_add(&s->batches, 1);
    atomic_fetch_add(&s->batch_tokens, (uint64_t)l->T);
    atomic_fetch_add(&s->compute_us, (t_done - t_launch) / 1000u);
    moed_metrics_launch(s->cfg.metrics, (uint64_t)l->T, (uint64_t)l->n, t_done - t_launch);
    count_experts(w, l);
    for (int i = 0; i < l->n; i++) {
        moed_sched_item *it = w->items[i];
        const moed_part_route *pr = w->mem[i].route;
        moed_metrics_queue_wait(s->cfg.metrics, t_launch - it->t_enqueued_ns);
        if (pr && pr->err.code) { /* its device routing was refused: it alone fails */
            finish_error(s, it, pr->err.code, &pr->err);
            continue;
        }
        moed_sched_result r = {
            .y = w->mem[i].y,
            .y_bytes = (size_t)w->tokens[i] * l->row_bytes,
            .expert_set = l->k_batch ? w->set : NULL,
            .n_expert_set = l->k_batch,
            .timings = { .queue_us = (t_launch - it->t_enqueued_ns) / 1000u,
                         .compute_us = (t_done - t_launch) / 1000u,
                         .total_us = (moed_now_ns() - it->t_received_ns) / 1000u,
                         .batch_tokens = (uint32_t)l->T,
                         .batch_requests = (uint32_t)l->n },
        };
        atomic_fetch_add(&s->completed, 1);
        it->done(it, &r);
    }
}

/* The launch failed as a whole: every request still in it gets its error. */
static void fail_launch(worker *w, const launch *l, int rc, moed_error *err)
{
    if (!err->code)
        moed_fail(err, rc, "the %s backend failed this launch",
                  moed_backend_name(w->s->cfg.backend));
    for (int i = 0; i < l->n; i++) finish_error(w->s, w->items[i], rc, err);
}

/* Runs the n requests taken from q. The queue's in-flight slot is released as soon as the device
 * is done, before the replies go: another worker may start q's next launch meanwhile. */
static void run_batch(worker *w, queue *q, int n, uint64_t t_launch)
{
    moed_sched *s = w->s;
    const moed_sched_item *first = w->items[0];
    launch l = { .layer = first->layer,
                 .slot = first->slot,
                 .dtype = first->dtype,
                 .k_batch = first->k_batch,
                 .E = first->layer->info.n_experts,
                 .row_bytes = (size_t)first->layer->info.d_model * moed_dtype_size(first->dtype),
                 .n = n };
    moed_error err = { 0 };
    int rc = compute(w, &l, &err);
    pthread_mutex_lock(&s->lock);
    q->in_flight--;
    if (s->queued) wake_all(s);
    pthread_mutex_unlock(&s->lock);
    if (rc)
        fail_launch(w, &l, rc, &err);
    else if (l.n)
        deliver(w, &l, t_launch);
    moed_route_free(&l.batch);
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    moed_sched *s = w->s;
    uint64_t last_launch = 0; /* when this worker's last launch ended; 0: none in its spin */
    pthread_mutex_lock(&s->lock);
    for (;;) {
        uint64_t now = moed_now_ns(), wake_at;
        queue *q = pick_queue(s, w->exec, now, &wake_at);
        if (q) {
            moed_list expired;
            moed_list_init(&expired);
            int n = take_batch(s, q, now, w->items, &expired);
            if (n) q->in_flight++;
            if (s->queued) wake_all(s); /* more may be ready for another worker */
            pthread_mutex_unlock(&s->lock);
            finish_expired(s, &expired);
            if (n) {
                atomic_fetch_add(&s->running, 1);
                run_batch(w, q, n, now); /* releases q's in-flight slot when the device is done */
                atomic_fetch_sub(&s->running, 1);
                last_launch = moed_now_ns();
            }
            pthread_mutex_lock(&s->lock);
            continue;
        }
        if (s->draining && !s->queued) break;
        if (!wake_at && last_launch && !s->spinner) {
            /* the spin counts from the last launch: an idle daemon's workers all sleep */
            moed_backoff b;
            moed_backoff_start(&b);
            b.start_ns = last_launch;
            const uint64_t seen = atomic_load(&s->wakes);
            s->spinner = true;
            pthread_mutex_unlock(&s->lock);
            while (atomic_load(&s->wakes) == seen && moed_backoff_spinning(&b))
                moed_backoff_pause(&b, 0);
            pthread_mutex_lock(&s->lock);
            s->spinner = false;
            if (!moed_backoff_spinning(&b)) last_launch = 0;
            continue;
        }
        if (!wake_at) {
            pthread_cond_wait(&s->wake, &s->lock);
        } else {
            struct timespec ts = { (time_t)(wake_at / 1000000000u), (long)(wake_at % 1000000000u) };
            pthread_cond_timedwait(&s->wake, &s->lock, &ts);
        }
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

/* ---- life cycle ------------------------------------------------------------------------------ */

static int worker_init(moed_sched *s, worker *w, int exec, moed_error *err)
{
    moed_backend *b = s->cfg.backend;
    w->s = s;
    w->exec = exec;
    w->x = moed_backend_host_alloc(b, s->staging_bytes);
    w->y = moed_backend_host_alloc(b, s->staging_bytes);
    w->logits = moed_backend_host_alloc(b, s->logits_bytes);
    w->set = malloc((size_t)s->max_experts * sizeof *w->set);
    w->items = calloc((size_t)s->max_items, sizeof *w->items);
    w->parts = calloc((size_t)s->max_items, sizeof *w->parts);
    w->rows = calloc((size_t)s->max_items, sizeof *w->rows);
    w->tokens = calloc((size_t)s->max_items, sizeof *w->tokens);
    w->stage = calloc((size_t)s->max_items, sizeof *w->stage);
    w->mem = calloc((size_t)s->max_items, sizeof *w->mem);
    w->expert_tokens = calloc((size_t)s->max_experts, sizeof *w->expert_tokens);
    if (!w->x || !w->y || !w->logits || !w->set || !w->items || !w->parts || !w->rows ||
        !w->tokens || !w->stage || !w->mem || !w->expert_tokens)
        return moed_fail(err, MOED_ENOMEM,
                         "no memory for execution slot %d's staging: 2 x %zu bytes (--max-batch-"
                         "tokens %lld x the largest d_model x 4) plus %zu for logits; lower "
                         "--max-batch-tokens",
                         exec, s->staging_bytes, (long long)s->cfg.max_batch_tokens,
                         s->logits_bytes);
    if (pthread_create(&w->thread, NULL, worker_main, w))
        return moed_fail(err, MOED_EINTERNAL, "could not start scheduler worker %d", exec);
    w->started = true;
    return 0;
}

static void worker_free(moed_sched *s, worker *w)
{
    moed_backend *b = s->cfg.backend;
    moed_backend_host_free(b, w->x);
    moed_backend_host_free(b, w->y);
    moed_backend_host_free(b, w->logits);
    moed_route_free(&w->route);
    free(w->set);
    free(w->items);
    free(w->parts);
    free(w->rows);
    free(w->tokens);
    free(w->stage);
    free(w->mem);
    free(w->expert_tokens);
}

int moed_sched_create(const moed_sched_config *cfg, moed_sched **out, moed_error *err)
{
    *out = NULL;
    moed_sched *s = calloc(1, sizeof *s);
    if (!s) return moed_fail(err, MOED_ENOMEM, "no memory for the scheduler");
    s->cfg = *cfg;
    if (s->cfg.max_batch_pairs <= 0) s->cfg.max_batch_pairs = INT64_MAX;
    int64_t max_d = 1, max_e = 1;
    for (int i = 0; i < cfg->n_layers; i++) {
        const moed_layer_info *li = &cfg->layers[i]->info;
        if (li->d_model > max_d) max_d = li->d_model;
        if (li->n_experts > max_e) max_e = li->n_experts;
    }
    s->staging_bytes = (size_t)(cfg->max_batch_tokens * max_d * 4);
    s->logits_bytes = (size_t)(cfg->max_batch_tokens * max_e) * sizeof(float);
    s->max_experts = (int)max_e;
    s->max_items = (int)(cfg->max_batch_tokens < cfg->max_queue_requests ? cfg->max_batch_tokens
                                                                         : cfg->max_queue_requests);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->wake, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&s->lock, NULL);
    moed_list_init(&s->active);
    int rc = 0, n = moed_backend_n_exec(cfg->backend);
    if (n < 1) n = 1;
    if (!(s->workers = calloc((size_t)n, sizeof *s->workers))) {
        rc = moed_fail(err, MOED_ENOMEM, "no memory for %d scheduler workers", n);
        goto err;
    }
    s->n_workers = n;
    for (int i = 0; i < n && !rc; i++) rc = worker_init(s, &s->workers[i], i, err);
    if (rc) goto err;
    *out = s;
    return 0;
err:
    moed_sched_destroy(s); /* joins the workers already started: nothing is queued */
    return rc;
}

int moed_sched_submit(moed_sched *s, moed_sched_item *it, moed_error *err)
{
    int rc = 0;
    pthread_mutex_lock(&s->lock);
    queue *q = NULL;
    if (s->draining)
        rc = moed_fail(err, MOED_EDRAINING,
                       "the server is draining (shutting down); retry on another server");
    else if (s->queued >= s->cfg.max_queue_requests)
        rc = moed_fail(err, MOED_EFULL,
                       "the queue is full: %lld requests wait (--max-queue-requests); retry "
                       "later or elsewhere",
                       (long long)s->queued);
    else if (!(q = find_queue(s, it)))
        rc = moed_fail(err, MOED_ENOMEM, "no memory for a new queue");
    if (!rc) {
        it->t_enqueued_ns = moed_now_ns();
        it->state = ST_QUEUED;
        push(s, q, it);
        wake_all(s);
    }
    pthread_mutex_unlock(&s->lock);
    atomic_fetch_add(rc ? &s->rejected : &s->submitted, 1);
    return rc;
}

void moed_sched_cancel(moed_sched *s, moed_sched_item *it)
{
    pthread_mutex_lock(&s->lock);
    bool queued = it->state == ST_QUEUED;
    if (queued) {
        unlink_item(s, it, false);
        it->state = ST_DONE;
    } else if (it->state == ST_RUNNING) {
        atomic_store(&it->cancelled, true); /* the worker drops it if the backend has not got it */
    }
    pthread_mutex_unlock(&s->lock);
    if (!queued) return;
    /* gRPC cancels a call whose deadline passes: that is an expiry, and counts as one. */
    moed_error err;
    if (it->deadline_ns && moed_now_ns() >= it->deadline_ns) {
        moed_fail(&err, MOED_EDEADLINE,
                  "the deadline passed while the request waited in the queue");
        finish_error(s, it, MOED_EDEADLINE, &err);
    } else {
        moed_fail(&err, MOED_ECANCELLED, "the call was cancelled while queued");
        finish_error(s, it, MOED_ECANCELLED, &err);
    }
}

void moed_sched_flush(moed_sched *s)
{
    pthread_mutex_lock(&s->lock);
    s->flushing = true;
    wake_all(s);
    pthread_mutex_unlock(&s->lock);
}

void moed_sched_drain(moed_sched *s)
{
    pthread_mutex_lock(&s->lock);
    s->draining = true;
    wake_all(s);
    pthread_mutex_unlock(&s->lock);
    for (int i = 0; i < s->n_workers; i++)
        if (s->workers[i].started) {
            pthread_join(s->workers[i].thread, NULL);
            s->workers[i].started = false;
        }
}

void moed_sched_destroy(moed_sched *s)
{
    if (!s) return;
    moed_sched_drain(s);
    for (int i = 0; i < s->n_workers; i++) worker_free(s, &s->workers[i]);
    for (int i = 0; i < s->n_queues; i++) free(s->queues[i]);
    free(s->queues);
    free(s->workers);
    pthread_cond_destroy(&s->wake);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

void moed_sched_get_stats(moed_sched *s, moed_sched_stats *out)
{
    pthread_mutex_lock(&s->lock);
    out->queued = (uint64_t)s->queued;
    pthread_mutex_unlock(&s->lock);
    out->submitted = atomic_load(&s->submitted);
    out->rejected = atomic_load(&s->rejected);
    out->cancelled = atomic_load(&s->cancelled);
    out->expired = atomic_load(&s->expired);
    out->failed = atomic_load(&s->failed);
    out->completed = atomic_load(&s->completed);
    out->batches = atomic_load(&s->batches);
    out->batch_tokens = atomic_load(&s->batch_tokens);
    out->compute_us = atomic_load(&s->compute_us);
    out->running = atomic_load(&s->running);
}
