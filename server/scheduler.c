/*
 * moed_sched — merge queues, worker threads and the launch pipeline of one merged batch.
 *
 * Why this shape: merging only pays when requests share weights (one layer), a dtype (one kernel
 * instantiation) and, for batch-level gating, one k (the expert set is chosen over the merged
 * batch). So a queue per merge key; one mutex over all queues (operations under it are a few
 * pointer moves; the work — copies, gating, compute — happens outside it); one condition variable
 * that idle workers wait on, with a timeout when a merge window is open. Wake-ups are broadcasts:
 * with several GPUs a worker runs only the layers resident on its own (backend exec_accepts), so
 * waking one arbitrary worker could leave the right one asleep.
 *
 * A launch never splits a request and never lets one request's bad data spoil the others: a
 * request whose server-side gating fails (NaN logits from its own hidden rows) is answered with
 * its error and its rows are squeezed out of the launch before the backend runs.
 */
#include "scheduler.h"

#include "moed_dtype.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

enum { ST_NEW = 0, ST_QUEUED, ST_RUNNING, ST_DONE };

typedef struct queue {
    int slot, dtype, k_batch; /* the merge key */
    moed_sched_item *head, *tail;
    int64_t tokens; /* queued in this queue */
    int64_t n;      /* requests queued in this queue */
    int in_flight;  /* launches of this queue running now */
    struct queue *next_active, *prev_active;
    bool active; /* non-empty, on the active list */
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
    int64_t *rows, *tokens; /* per item of the launch: first row and T */
} worker;

struct moed_sched {
    moed_sched_config cfg;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    queue **queues;
    int n_queues, cap_queues;
    queue *active; /* non-empty queues */
    int64_t queued;
    bool draining;
    worker *workers;
    int n_workers;
    int max_items; /* per launch: every request has T >= 1 and sits in the bounded queue */
    int max_experts;
    size_t staging_bytes, logits_bytes;
    _Atomic uint64_t submitted, rejected, cancelled, expired, failed, completed, batches,
        batch_tokens, compute_us, running;
};

/* ---- queues (all under s->lock) -------------------------------------------------------------- */

static queue *find_queue(moed_sched *s, const moed_work *w)
{
    for (int i = 0; i < s->n_queues; i++) {
        queue *q = s->queues[i];
        if (q->slot == w->slot && q->dtype == w->dtype && q->k_batch == w->k_batch) return q;
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
    q->slot = w->slot;
    q->dtype = w->dtype;
    q->k_batch = w->k_batch;
    s->queues[s->n_queues++] = q;
    return q;
}

static void push(moed_sched *s, queue *q, moed_sched_item *it)
{
    it->queue = q;
    it->prev = q->tail;
    it->next = NULL;
    if (q->tail)
        q->tail->next = it;
    else
        q->head = it;
    q->tail = it;
    q->tokens += it->work.T;
    q->n++;
    s->queued++;
    if (!q->active) {
        q->active = true;
        q->prev_active = NULL;
        q->next_active = s->active;
        if (s->active) s->active->prev_active = q;
        s->active = q;
    }
}

static void unlink_item(moed_sched *s, moed_sched_item *it)
{
    queue *q = it->queue;
    if (it->prev)
        it->prev->next = it->next;
    else
        q->head = it->next;
    if (it->next)
        it->next->prev = it->prev;
    else
        q->tail = it->prev;
    q->tokens -= it->work.T;
    q->n--;
    s->queued--;
    if (!q->head && q->active) {
        q->active = false;
        if (q->prev_active)
            q->prev_active->next_active = q->next_active;
        else
            s->active = q->next_active;
        if (q->next_active) q->next_active->prev_active = q->prev_active;
    }
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
    *wake_at = 0;
    for (queue *q = s->active; q; q = q->next_active) {
        if (!moed_backend_exec_accepts(b, exec, q->slot)) continue;
        uint64_t t0 = q->head->t_enqueued_ns;
        bool full = q->tokens >= s->cfg.max_batch_tokens;
        bool enough = s->cfg.min_batch_requests > 1 && q->n >= s->cfg.min_batch_requests;
        bool ready = s->draining || full || (!q->in_flight && (enough || now >= t0 + delay));
        if (ready && (!best || t0 < best->head->t_enqueued_ns)) best = q;
        if (!ready && !q->in_flight && (!*wake_at || t0 + delay < *wake_at)) *wake_at = t0 + delay;
    }
    return best;
}

/* Takes the queue's requests in order while they fit in one launch; those whose deadline has
 * passed are moved to *expired instead. Returns the number taken into items. */
static int take_batch(moed_sched *s, queue *q, uint64_t now, moed_sched_item **items,
                      moed_sched_item **expired)
{
    int n = 0;
    int64_t tokens = 0;
    moed_sched_item *it = q->head;
    while (it && n < s->max_items) {
        moed_sched_item *next = it->next;
        if (it->deadline_ns && now >= it->deadline_ns) {
            unlink_item(s, it);
            it->state = ST_DONE;
            it->next = *expired;
            *expired = it;
        } else if (tokens + it->work.T <= s->cfg.max_batch_tokens) {
            unlink_item(s, it);
            it->state = ST_RUNNING;
            tokens += it->work.T;
            items[n++] = it;
        } else {
            break;
        }
        it = next;
    }
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

static void finish_expired(moed_sched *s, moed_sched_item *list)
{
    while (list) {
        moed_sched_item *next = list->next;
        moed_error err;
        uint64_t waited = (moed_now_ns() - list->t_received_ns) / 1000u;
        moed_fail(&err, MOED_EDEADLINE,
                  "the deadline passed after %llu us while the request waited in the queue; "
                  "allow more time or send to a less loaded server",
                  (unsigned long long)waited);
        finish_error(s, list, MOED_EDEADLINE, &err);
        list = next;
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

/* Routes every request that is routed on the worker: server-router logits gated per token, or the
 * logits rows of a batch-gated launch gathered. A request that fails is answered now and its
 * slot in items set to NULL. */
static void route_requests(worker *w, int n, const moed_layer *layer, int k_batch)
{
    moed_sched *s = w->s;
    int E = layer->info.n_experts;
    for (int i = 0; i < n; i++) {
        moed_sched_item *it = w->items[i];
        moed_work *wk = &it->work;
        float *l = w->logits + w->rows[i] * E;
        moed_error err = { 0 };
        int rc = 0;
        if (k_batch && !wk->server_logits) {
            memcpy(l, wk->logits, (size_t)(wk->T * E) * sizeof *l);
        } else if (k_batch) {
            for (int64_t j = 0; j < wk->T * E && !rc; j++)
                if (!isfinite(l[j]))
                    rc = moed_fail(&err, MOED_EINVAL,
                                   "the server router's logits for token %lld, expert %lld are %g: "
                                   "check hidden for NaN or Inf",
                                   (long long)(j / E), (long long)(j % E), (double)l[j]);
        } else if (wk->server_logits) {
            moed_route_free(&wk->route);
            rc = moed_gate(&wk->gate, &layer->info, layer->router_bias, l, wk->T, &wk->route, &err);
            if (rc) moed_error_prefix(&err, "gating the server router's logits");
        }
        if (rc) {
            finish_error(s, it, rc, &err);
            w->items[i] = NULL;
        }
    }
}

/* Squeezes the rows of failed requests out of x and logits; returns the requests left (items,
 * rows and tokens compacted alike) and their total tokens in *T. */
static int compact(worker *w, int n, size_t row_bytes, int E, int64_t *T)
{
    int m = 0;
    int64_t row = 0;
    for (int i = 0; i < n; i++) {
        if (!w->items[i]) continue;
        if (w->rows[i] != row) {
            memmove((char *)w->x + row * row_bytes, (char *)w->x + w->rows[i] * row_bytes,
                    (size_t)w->tokens[i] * row_bytes);
            memmove(w->logits + row * E, w->logits + w->rows[i] * E,
                    (size_t)(w->tokens[i] * E) * sizeof(float));
        }
        w->items[m] = w->items[i];
        w->tokens[m] = w->tokens[i];
        w->rows[m] = row;
        row += w->tokens[i];
        m++;
    }
    *T = row;
    return m;
}

/* The merged route: batch gating over the launch's logits, or the requests' routes end to end. */
static int merge_routes(worker *w, int n, int64_t T, int E, int k_batch, moed_route *batch,
                        const moed_route **route, moed_error *err)
{
    if (k_batch) {
        int rc = moed_gate_batch(w->logits, T, E, k_batch, w->set, batch, err);
        *route = batch;
        return rc;
    }
    int64_t pairs = 0;
    for (int i = 0; i < n; i++) {
        w->parts[i] = &w->items[i]->work.route;
        pairs += w->parts[i]->off[w->parts[i]->T];
    }
    if (ensure_route(w, T, pairs))
        return moed_fail(err, MOED_ENOMEM, "no memory for a route of %lld pairs", (long long)pairs);
    *route = &w->route;
    w->route.T = w->route_T; /* concat checks room against T, and leaves T at the launch's */
    if (moed_route_concat(&w->route, w->parts, n))
        return moed_fail(err, MOED_EINTERNAL, "merging %d routes of %lld tokens failed", n,
                         (long long)T);
    return 0;
}

/* The queue's launch has left the device: another worker may start the queue's next launch while
 * this one still copies out and sends the replies. */
static void launch_done(moed_sched *s, queue *q)
{
    pthread_mutex_lock(&s->lock);
    q->in_flight--;
    if (s->queued) pthread_cond_broadcast(&s->wake);
    pthread_mutex_unlock(&s->lock);
}

static void run_batch(worker *w, queue *q, int n, uint64_t t_launch)
{
    moed_sched *s = w->s;
    moed_backend *b = s->cfg.backend;
    const moed_work *first = &w->items[0]->work;
    const moed_layer *layer = first->layer;
    int E = layer->info.n_experts, k_batch = first->k_batch;
    size_t row_bytes = (size_t)layer->info.d_model * moed_dtype_size(first->dtype);
    int64_t T = 0;
    bool server = false;
    for (int i = 0; i < n; i++) {
        moed_work *wk = &w->items[i]->work;
        w->rows[i] = T;
        w->tokens[i] = wk->T;
        moed_span_copy(&wk->hidden, (char *)w->x + T * row_bytes);
        T += wk->T;
        server |= wk->server_logits;
    }
    moed_error err = { 0 };
    moed_route batch = { 0 };
    const moed_route *route = NULL;
    int rc = 0;
    if (server && (rc = moed_backend_router_logits(b, w->exec, first->slot, first->dtype, T, w->x,
                                                   w->logits, &err)))
        goto fail;
    if (server || k_batch) {
        route_requests(w, n, layer, k_batch);
        if (!(n = compact(w, n, row_bytes, E, &T))) {
            launch_done(s, q);
            return;
        }
    }
    if ((rc = merge_routes(w, n, T, E, k_batch, &batch, &route, &err))) goto fail;
    moed_job job = {
        .slot = first->slot, .dtype = first->dtype, .T = T, .x = w->x, .y = w->y, .route = route
    };
    rc = moed_backend_forward(b, w->exec, &job, &err);
    launch_done(s, q);
    if (rc) goto fail_released;
    moed_route_free(&batch);

    uint64_t t_done = moed_now_ns();
    atomic_fetch_add(&s->batches, 1);
    atomic_fetch_add(&s->batch_tokens, (uint64_t)T);
    atomic_fetch_add(&s->compute_us, (t_done - t_launch) / 1000u);
    moed_metrics_launch(s->cfg.metrics, (uint64_t)T, (uint64_t)n, t_done - t_launch);
    for (int i = 0; i < n; i++) {
        moed_sched_item *it = w->items[i];
        moed_metrics_queue_wait(s->cfg.metrics, t_launch - it->t_enqueued_ns);
        moed_sched_result r = {
            .y = (const char *)w->y + w->rows[i] * row_bytes,
            .y_bytes = (size_t)w->tokens[i] * row_bytes,
            .expert_set = k_batch ? w->set : NULL,
            .n_expert_set = k_batch,
            .timings = { .queue_us = (t_launch - it->t_enqueued_ns) / 1000u,
                         .compute_us = (t_done - t_launch) / 1000u,
                         .total_us = (moed_now_ns() - it->t_received_ns) / 1000u,
                         .batch_tokens = (uint32_t)T,
                         .batch_requests = (uint32_t)n },
        };
        atomic_fetch_add(&s->completed, 1);
        it->done(it, &r);
    }
    return;
fail:
    launch_done(s, q);
fail_released:
    moed_route_free(&batch);
    if (!err.code) moed_fail(&err, rc, "the %s backend failed this launch", moed_backend_name(b));
    for (int i = 0; i < n; i++)
        if (w->items[i]) finish_error(s, w->items[i], rc, &err);
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    moed_sched *s = w->s;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        uint64_t now = moed_now_ns(), wake_at;
        queue *q = pick_queue(s, w->exec, now, &wake_at);
        if (q) {
            moed_sched_item *expired = NULL;
            int n = take_batch(s, q, now, w->items, &expired);
            if (n) q->in_flight++;
            if (s->queued)
                pthread_cond_broadcast(&s->wake); /* more may be ready for another worker */
            pthread_mutex_unlock(&s->lock);
            finish_expired(s, expired);
            if (n) {
                atomic_fetch_add(&s->running, 1);
                run_batch(w, q, n, now); /* releases q's in-flight slot when the device is done */
                atomic_fetch_sub(&s->running, 1);
            }
            pthread_mutex_lock(&s->lock);
            continue;
        }
        if (s->draining && !s->queued) break;
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
    if (!w->x || !w->y || !w->logits || !w->set || !w->items || !w->parts || !w->rows || !w->tokens)
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
}

int moed_sched_create(const moed_sched_config *cfg, moed_sched **out, moed_error *err)
{
    *out = NULL;
    moed_sched *s = calloc(1, sizeof *s);
    if (!s) return moed_fail(err, MOED_ENOMEM, "no memory for the scheduler");
    s->cfg = *cfg;
    int64_t max_d = 1, max_e = 1;
    for (int i = 0; i < cfg->served->n_layers; i++) {
        const moed_layer_info *li = &cfg->served->layers[i]->info;
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
    int rc = 0, n = moed_backend_n_exec(cfg->backend) > 0 ? moed_backend_n_exec(cfg->backend) : 1;
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
    else if (!(q = find_queue(s, &it->work)))
        rc = moed_fail(err, MOED_ENOMEM, "no memory for a new queue");
    if (!rc) {
        it->t_enqueued_ns = moed_now_ns();
        it->state = ST_QUEUED;
        push(s, q, it);
        pthread_cond_broadcast(&s->wake);
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
        unlink_item(s, it);
        it->state = ST_DONE;
    }
    pthread_mutex_unlock(&s->lock);
    if (queued) {
        moed_error err;
        moed_fail(&err, MOED_ECANCELLED, "the call was cancelled while queued");
        finish_error(s, it, MOED_ECANCELLED, &err);
    }
}

void moed_sched_drain(moed_sched *s)
{
    pthread_mutex_lock(&s->lock);
    s->draining = true;
    pthread_cond_broadcast(&s->wake);
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
