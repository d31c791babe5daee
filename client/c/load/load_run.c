/*
 * load_run — the load loop (load_run.h states the contract).
 *
 * Each worker is one loop over its completion queue: start whatever may start now (closed loop:
 * until its share of the concurrency is in flight; open loop: every arrival that is due, up to its
 * share of --max-inflight), then wait for a completion, never longer than until the next arrival.
 * A request is a window of rows from pools made before the run, so starting one costs an offset,
 * the library's encoding of the small routing tensors, and the gRPC call; the hidden rows are sent
 * zero-copy from the pool, which stays valid for the whole run.
 *
 * A worker of a ring transport (load_regions.h) instead rings its own ring, one call at a time, and
 * waits for the completion in the ring (host calls) or synchronises its CUDA stream (stream calls).
 *
 * Counting is per worker, under a mutex only the progress line contends for, so the report is
 * exact without making the workers share a cache line per call. Requests of the measured window
 * take numbers from one atomic counter: it decides --requests, the round-robin over layers and
 * which requests are deliberately bad, identically whatever the number of threads.
 */
#include "load_run.h"
#include "load_progress.h"
#include "load_regions.h"
#include "moed_dtype.h"
#include "moed_time.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

static atomic_int interrupted;

void load_run_interrupt(void)
{
    atomic_store(&interrupted, 1);
}

bool load_run_interrupted(void)
{
    return atomic_load(&interrupted) != 0;
}

static double cpu_seconds(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           (double)(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

static int64_t now_ns(void) /* signed: the pacing subtracts times either way */
{
    return (int64_t)moed_now_ns();
}

/* The times of a level, shared by its workers. */
typedef struct level_clock {
    int64_t t0, t_measure, t_end; /* t_end: INT64_MAX when --requests ends the window */
    atomic_uint_fast64_t tickets; /* numbers of the measured requests */
} level_clock;

/* One call in flight: what it sent, so its reply can be counted and verified. */
typedef struct call_slot {
    moedc_call *call;
    moedc_ring_ticket ticket; /* a ring transport's call */
    moedc_request req;
    int64_t t0;
    int layer; /* index into plan->layers */
    uint64_t bytes;
    bool measured, bad, busy;
    int next_free;
} call_slot;

typedef struct worker {
    const load_plan *p;
    level_clock *clock;
    atomic_int *running; /* workers not yet done; the last one to finish ends the watch */
    moedc_queue *q;
    moedc_ring *ring; /* a ring transport: the worker's ring, and its stream for stream calls */
    void *stream;
    load_rng rng;
    int cap;       /* calls in flight at most */
    int slot_base; /* its slots' numbers among all workers' (their output rows in a region) */
    double rate;   /* open loop: this worker's share, req/s; 0: closed loop */
    int64_t next_due;
    call_slot *slots;
    int free_head, inflight;
    int32_t *bad_ids; /* scratch of a bad request's route (the start copies it) */
    float *bad_weights;
    uint64_t warm_n, rr;
    bool exhausted, cancelled;
    pthread_t thread;
    pthread_mutex_t mu; /* st and completed, for the progress line */
    load_stats st;
    uint64_t completed;   /* all calls, warm-up included */
    load_experts experts; /* tokens per expert of the ok client routes, warm-up included */
} worker;

/* ---- starting a call ---- */

/* The route of a deliberately bad request: valid ids but one, which is n_experts (out of range). */
static void bad_route(worker *w, const load_dest *l, int64_t T, moedc_request *req)
{
    const int E = l->info.n_experts, k = l->info.top_k;
    for (int64_t t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            w->bad_ids[t * k + j] = (int32_t)((t + j) % E);
            w->bad_weights[t * k + j] = 1.0f / (float)k;
        }
    w->bad_ids[load_rng_below(&w->rng, (uint64_t)T) * k] = E;
    req->routing = MOEDC_ROUTE_EXPERTS;
    req->k = k;
    req->expert_ids = w->bad_ids;
    req->expert_weights = w->bad_weights;
}

/* Fills s->req for a request to layer li of T tokens, from row `row` of the pools. */
static void build_request(worker *w, call_slot *s, int64_t T, int64_t row)
{
    const load_plan *p = w->p;
    const load_dest *l = &p->layers[s->layer];
    const int d = l->info.d_model, E = l->info.n_experts;
    const size_t es = moed_dtype_size(p->dtype);
    moedc_request *r = &s->req;
    memset(r, 0, sizeof *r);
    r->layer = (uint32_t)l->info.index;
    r->dtype = p->dtype;
    r->tokens = T;
    r->d_model = d;
    r->hidden = (const char *)p->hidden + (size_t)(row * d) * es;
    r->timeout_s = p->deadline_s > 0 ? p->deadline_s : -1;
    s->bytes = (uint64_t)(T * d) * es;
    if (s->bad) {
        bad_route(w, l, T, r);
        s->bytes += (uint64_t)(T * r->k) * 8;
        if (p->regions) { /* the bad route alone travels inline */
            load_regions_refer(p->regions, p, s->layer, row, w->slot_base + (int)(s - w->slots), r);
            s->bytes = (uint64_t)(T * r->k) * 8;
        }
        return;
    }
    r->routing = p->routing;
    r->gating = p->gating;
    r->batch_gating = p->batch_gating;
    r->k_batch = p->k_batch;
    if (p->routing == MOEDC_ROUTE_EXPERTS) {
        r->k = l->cols;
        r->expert_ids = l->ids + row * l->cols;
        r->expert_weights = l->weights + row * l->cols;
        s->bytes += (uint64_t)(T * l->cols) * 8;
    } else if (p->routing == MOEDC_ROUTE_LOGITS) {
        r->n_experts = E;
        r->logits = p->logits + row * E;
        s->bytes += (uint64_t)(T * E) * 4;
    }
    if (p->regions) { /* nothing travels inline */
        load_regions_refer(p->regions, p, s->layer, row, w->slot_base + (int)(s - w->slots), r);
        s->bytes = 0;
    }
}

/* When the next call arrives: open loop, its due time, also when the worker gets to it late (on a
 * busy machine), so which window an arrival counts in, and how many there are, does not depend
 * on the scheduler; closed loop, now. */
static int64_t arrival(const worker *w, int64_t now)
{
    return w->rate ? w->next_due : now;
}

/* The ring call of a request whose tensors are all in regions (build_request made it so). */
static moedc_ring_call ring_call(const moedc_request *r)
{
    return (moedc_ring_call){ .layer = r->layer,
                              .dtype = r->dtype,
                              .tokens = r->tokens,
                              .d_model = r->d_model,
                              .k = r->k,
                              .hidden = r->hidden_at,
                              .expert_ids = r->expert_ids_at,
                              .expert_weights = r->expert_weights_at,
                              .output = r->output_at,
                              .timeout_s = r->timeout_s };
}

/* Starts s's call on connection c, or on the worker's ring. */
static int start_call(worker *w, call_slot *s, moedc *c, moedc_error *err)
{
    if (!w->ring) return moedc_forward_start(c, &s->req, w->q, s, &s->call, err);
    moedc_ring_call call = ring_call(&s->req);
    return w->stream ? moedc_ring_enqueue(w->ring, &call, w->stream, &s->ticket, err)
                     : moedc_ring_start(w->ring, &call, &s->ticket, err);
}

/* Starts the next request; sets w->exhausted instead when --requests have all been started. */
static void start_one(worker *w, int64_t now)
{
    const load_plan *p = w->p;
    bool measured = arrival(w, now) >= w->clock->t_measure;
    uint64_t n;
    if (measured) {
        n = atomic_fetch_add(&w->clock->tickets, 1);
        if (p->requests && n >= p->requests) {
            w->exhausted = true;
            return;
        }
    } else {
        n = w->warm_n++;
    }
    call_slot *s = &w->slots[w->free_head];
    s->layer = (int)(n % (uint64_t)p->n_layers);
    s->measured = measured;
    s->bad = measured && load_is_bad(n, p->bad_fraction);
    int64_t T = load_tokens_sample(p->tokens, &w->rng);
    int64_t row = (int64_t)load_rng_below(&w->rng, (uint64_t)(p->pool_rows - T + 1));
    build_request(w, s, T, row);
    s->t0 = now_ns();
    moedc *c = p->conns[w->rr++ % (uint64_t)p->n_conns];
    moedc_error err;
    const bool started = !start_call(w, s, c, &err);
    if (measured) { /* a call that could not be started sent nothing */
        pthread_mutex_lock(&w->mu);
        w->st.sent++;
        w->st.bad_sent += s->bad;
        w->st.bytes_sent += started ? s->bytes : 0;
        if (!started) load_stats_error(&w->st, LOAD_ERR_CLIENT, err.msg);
        pthread_mutex_unlock(&w->mu);
    }
    if (!started) return;
    s->busy = true;
    w->free_head = s->next_free;
    w->inflight++;
}

/* ---- finishing a call ---- */

static int error_kind(int code)
{
    return code == MOEDC_EFORMAT ? LOAD_ERR_MALFORMED : moedc_code_to_grpc(code);
}

/* Counts a measured call's outcome (under w->mu). */
static void count_reply(worker *w, const call_slot *s, int rc, const moedc_result *res,
                        const moedc_error *err, int64_t now)
{
    load_stats *st = &w->st;
    st->t_last_ns = now;
    if (s->bad) {
        if (rc == MOEDC_EINVAL)
            st->expected_errors++;
        else if (!rc)
            load_stats_error(st, LOAD_ERR_BAD_ACCEPTED,
                             "a request with an out-of-range expert id was answered OK");
        else
            load_stats_error(st, error_kind(rc), err->msg);
        return;
    }
    if (rc) {
        load_stats_error(st, error_kind(rc), err->msg);
        return;
    }
    st->ok++;
    load_hist_add(&st->latency, (uint64_t)(now - s->t0));
    load_hist_add(&st->queue, res->timings.queue_us * 1000);
    load_hist_add(&st->compute, res->timings.compute_us * 1000);
    st->batch_tokens += res->timings.batch_tokens;
    st->batch_requests += res->timings.batch_requests;
    st->tokens += (uint64_t)s->req.tokens;
    st->bytes_received += s->req.output_at.region ? 0 : res->output_bytes;
}

/* An ok client route's (token, expert) pairs, into the worker's tokens per expert. */
static void count_experts(worker *w, const call_slot *s)
{
    const moedc_request *r = &s->req;
    if (r->routing != MOEDC_ROUTE_EXPERTS) return;
    for (int64_t i = 0; i < r->tokens * r->k; i++)
        load_experts_add(&w->experts, (int)r->layer, r->expert_ids[i], 1);
}

/* Counts and verifies call s, which ended with rc (res or err). */
static void finish(worker *w, call_slot *s, int rc, moedc_result *res, const moedc_error *err)
{
    if (!rc && !s->bad) count_experts(w, s);
    int64_t now = now_ns();
    pthread_mutex_lock(&w->mu);
    if (s->measured) count_reply(w, s, rc, res, err, now);
    w->completed++;
    pthread_mutex_unlock(&w->mu);
    if (!rc && s->measured && !s->bad && w->p->verify) {
        load_verify_item it = { .layer = w->p->layers[s->layer].info.index,
                                .req = s->req,
                                .res = *res };
        /* an output in a region: the slot's next call writes there, so the check gets a copy */
        if (w->p->regions && (it.output_copy = load_regions_copy_output(w->p->regions, res)))
            it.res.output = it.output_copy;
        if (load_verify_offer(w->p->verify, &it))
            memset(res, 0, sizeof *res);
        else
            free(it.output_copy);
    }
    moedc_result_free(res);
    s->busy = false;
    s->next_free = w->free_head;
    w->free_head = (int)(s - w->slots);
    w->inflight--;
}

static void complete(worker *w, moedc_call *call)
{
    call_slot *s = moedc_call_user(call);
    moedc_result res;
    moedc_error err;
    int rc = moedc_call_finish(call, &res, &err);
    finish(w, s, rc, &res, &err);
}

/* Waits up to wait_s for the worker's ring call (its one call in flight) and finishes it. */
static void complete_ring(worker *w, double wait_s)
{
    call_slot *s = &w->slots[0];
    moedc_ring_result rr;
    moedc_error err;
    moed_error serr;
    int rc;
    if (!w->stream) {
        rc = moedc_ring_wait(w->ring, &s->ticket, wait_s, &rr, &err);
    } else if (load_regions_sync(w->p->regions, w->stream, &serr)) {
        rc = err.code = serr.code; /* the stream is broken: its call will not be seen through */
        memcpy(err.msg, serr.msg, sizeof err.msg);
    } else {
        rc = moedc_ring_stream_result(w->ring, &s->ticket, &rr, &err);
    }
    if (rc == 0) return; /* still in flight */
    if (rc < 0) rr = (moedc_ring_result){ .status = rc };
    if (rc > 0 && rr.status) snprintf(err.msg, sizeof err.msg, "%s", rr.message);
    const moedc_request *q = &s->req;
    moedc_result res = { .dtype = q->dtype,
                         .tokens = q->tokens,
                         .d_model = q->d_model,
                         .output = (const char *)q->output_at.region->ptr + q->output_at.offset,
                         .output_bytes =
                             (size_t)(q->tokens * q->d_model) * moed_dtype_size(q->dtype),
                         .timings = rr.timings };
    finish(w, s, rr.status, &res, &err);
}

static void cancel_all(worker *w)
{
    if (w->ring && w->inflight) { /* a ring call cannot be taken back: it is given up on */
        moedc_result res = { 0 };
        moedc_error err = { MOEDC_ECANCELLED, "no completion in the ring in time: given up" };
        finish(w, &w->slots[0], MOEDC_ECANCELLED, &res, &err);
    }
    for (int i = 0; i < w->cap && !w->ring; i++)
        if (w->slots[i].busy) moedc_call_cancel(w->slots[i].call);
    w->cancelled = true;
}

/* ---- the worker loop ---- */

static int64_t drain_ns(const load_plan *p)
{
    return (int64_t)((p->deadline_s > 0 ? p->deadline_s + 5 : 30) * 1e9);
}

static bool issuing(const worker *w, int64_t now)
{
    return !w->exhausted && arrival(w, now) < w->clock->t_end && !load_run_interrupted();
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    int64_t give_up = INT64_MAX;
    for (;;) {
        int64_t now = now_ns();
        while (issuing(w, now) && w->inflight < w->cap && (!w->rate || now >= w->next_due)) {
            start_one(w, now);
            if (w->rate)
                w->next_due += (int64_t)(load_arrival_gap(w->p->arrival, w->rate, &w->rng) * 1e9);
            now = now_ns();
        }
        bool more = issuing(w, now);
        if (!more && !w->inflight) break;
        if (!more && give_up == INT64_MAX) give_up = now + drain_ns(w->p);
        if (!more && now >= give_up && !w->cancelled) cancel_all(w);
        /* wake for the next arrival, the end of the window, or to look at the interrupt flag */
        int64_t until = now + 50000000;
        if (more && w->rate && w->inflight < w->cap && w->next_due < until) until = w->next_due;
        if (more && w->clock->t_end > now && w->clock->t_end < until) until = w->clock->t_end;
        moedc_call *call;
        double wait = until > now ? (double)(until - now) / 1e9 : 0;
        if (w->ring)
            complete_ring(w, wait);
        else if (moedc_queue_next(w->q, wait, &call))
            complete(w, call);
    }
    atomic_fetch_sub(w->running, 1);
    return NULL;
}

/* ---- a level ---- */

int load_plan_experts(const load_plan *p, load_experts *x)
{
    int *index = malloc(sizeof *index * (size_t)p->n_layers), max_e = 1;
    if (!index) return MOED_ENOMEM;
    for (int i = 0; i < p->n_layers; i++) {
        index[i] = p->layers[i].info.index;
        if (p->layers[i].info.n_experts > max_e) max_e = p->layers[i].info.n_experts;
    }
    int rc = load_experts_init(x, index, p->n_layers, max_e);
    free(index);
    return rc;
}

static void worker_free(worker *w)
{
    moedc_queue_destroy(w->q);
    free(w->slots);
    free(w->bad_ids);
    free(w->bad_weights);
    load_experts_free(&w->experts);
    pthread_mutex_destroy(&w->mu);
}

static int worker_init(worker *w, const load_plan *p, level_clock *clock, atomic_int *running,
                       int id, int n_workers, const load_level *lv, moed_error *err)
{
    memset(w, 0, sizeof *w);
    pthread_mutex_init(&w->mu, NULL);
    load_stats_init(&w->st);
    w->p = p;
    w->clock = clock;
    w->running = running;
    w->rr = (uint64_t)id;
    load_rng_seed(&w->rng, p->seed, (uint64_t)id);
    const int total = lv->concurrency ? lv->concurrency : p->max_inflight;
    w->cap = total / n_workers + (id < total % n_workers);
    w->slot_base = id * (total / n_workers + 1); /* no worker has more than that many */
    if (!lv->concurrency) {
        w->rate = lv->rate / n_workers;
        /* constant arrivals interleave the workers evenly; Poisson ones start at a random gap */
        double first = p->arrival == LOAD_ARRIVAL_CONSTANT
                           ? (double)id / lv->rate
                           : load_arrival_gap(p->arrival, w->rate, &w->rng);
        w->next_due = clock->t0 + (int64_t)(first * 1e9);
    }
    if (w->cap < 1) w->cap = 1;
    if (load_regions_rings(p->regions)) { /* one ring per worker, one call each */
        w->ring = load_regions_ring(p->regions, id, &w->stream);
        w->cap = 1;
    }
    int max_k = 1;
    for (int i = 0; i < p->n_layers; i++)
        if (p->layers[i].info.top_k > max_k) max_k = p->layers[i].info.top_k;
    size_t route = (size_t)p->tokens->hi * (size_t)max_k;
    w->slots = calloc((size_t)w->cap, sizeof *w->slots);
    w->bad_ids = malloc(route * sizeof *w->bad_ids);
    w->bad_weights = malloc(route * sizeof *w->bad_weights);
    if (!w->slots || !w->bad_ids || !w->bad_weights || load_plan_experts(p, &w->experts))
        return moed_fail(err, MOED_ENOMEM, "out of memory for %d calls in flight", w->cap);
    for (int i = 0; i < w->cap; i++) w->slots[i].next_free = i + 1;
    moedc_error qerr;
    if (moedc_queue_create(&w->q, &qerr)) return moed_fail(err, qerr.code, "%s", qerr.msg);
    return 0;
}

/* The terminal's width, to keep the progress line on one row (a line that wraps cannot be
 * rewritten with \r); 0 when stderr is no terminal or does not say. */
static int terminal_width(void)
{
    struct winsize w;
    return !ioctl(STDERR_FILENO, TIOCGWINSZ, &w) ? w.ws_col : 0;
}

/* The progress line on stderr (load_progress.h), cut to the terminal's width. */
static void progress_line(const load_plan *p, const load_level *lv, worker *ws, int n,
                          const level_clock *clock, uint64_t *last_done, int64_t *last_t)
{
    load_stats st;
    load_stats_init(&st);
    uint64_t done = 0;
    for (int i = 0; i < n; i++) {
        pthread_mutex_lock(&ws[i].mu);
        load_stats_merge(&st, &ws[i].st);
        done += ws[i].completed;
        pthread_mutex_unlock(&ws[i].mu);
    }
    const int64_t now = now_ns();
    load_progress g = {
        .level = p->level,
        .n_levels = p->n_levels,
        .concurrency = lv->concurrency,
        .rate = lv->rate,
        .warmup_s = p->warmup_s,
        .duration_s = p->requests ? 0 : p->duration_s,
        .requests = p->requests,
        .started = atomic_load(&clock->tickets),
        .rps = now > *last_t ? (double)(done - *last_done) * 1e9 / (double)(now - *last_t) : 0,
        .ok = st.ok,
        .errors = load_stats_errors(&st),
        .expected_errors = st.expected_errors,
        .p50_ms = st.latency.n ? (double)load_hist_quantile(&st.latency, 0.5) / 1e6 : -1,
        .p99_ms = st.latency.n ? (double)load_hist_quantile(&st.latency, 0.99) / 1e6 : -1,
    };
    g.phase = now < clock->t_measure                                         ? LOAD_WARMUP
              : (p->requests ? g.started < p->requests : now < clock->t_end) ? LOAD_MEASURE
                                                                             : LOAD_FINISH;
    g.elapsed_s = (double)(now - (g.phase == LOAD_WARMUP ? clock->t0 : clock->t_measure)) / 1e9;
    *last_done = done;
    *last_t = now;
    char line[400];
    load_progress_text(&g, terminal_width(), line, sizeof line);
    fprintf(stderr, "\r%s\033[K", line);
    fflush(stderr);
}

/* Waits for the workers, printing the progress line every 0.5 s when asked to. */
static void watch(const load_plan *p, const load_level *lv, worker *ws, int n,
                  const level_clock *clock, atomic_int *running)
{
    uint64_t last_done = 0;
    int64_t last_t = clock->t0, next = clock->t0 + 500000000;
    while (atomic_load(running)) {
        struct timespec ts = { 0, 20000000 };
        nanosleep(&ts, NULL);
        if (p->progress && now_ns() >= next) {
            progress_line(p, lv, ws, n, clock, &last_done, &last_t);
            next += 500000000;
        }
    }
    if (p->progress) fprintf(stderr, "\r\033[K");
}

int load_run_level(const load_plan *p, load_level *lv, moed_error *err)
{
    int n = lv->concurrency && lv->concurrency < p->threads ? lv->concurrency : p->threads;
    if (load_regions_rings(p->regions)) n = lv->concurrency; /* a worker per ring */
    worker *ws = calloc((size_t)n, sizeof *ws);
    level_clock clock;
    atomic_int running;
    int rc = 0, inited = 0, started = 0;
    if (!ws) {
        rc = moed_fail(err, MOED_ENOMEM, "out of memory starting %d workers", n);
        goto out;
    }
    double cpu0 = cpu_seconds();
    clock.t0 = now_ns();
    clock.t_measure = clock.t0 + (int64_t)(p->warmup_s * 1e9);
    clock.t_end = p->requests ? INT64_MAX : clock.t_measure + (int64_t)(p->duration_s * 1e9);
    atomic_init(&clock.tickets, 0);
    atomic_init(&running, n);
    for (; inited < n; inited++) {
        rc = worker_init(&ws[inited], p, &clock, &running, inited, n, lv, err);
        if (rc) {
            inited++;
            goto out;
        }
    }
    if (p->verify) load_verify_begin(p->verify, p->verify_n);
    for (; started < n; started++) {
        if (pthread_create(&ws[started].thread, NULL, worker_main, &ws[started])) {
            /* the ones running stop at once; the level is abandoned */
            load_run_interrupt();
            atomic_fetch_sub(&running, n - started);
            rc = moed_fail(err, MOED_ENOMEM, "could not start worker thread %d of %d", started + 1,
                           n);
            break;
        }
    }
    watch(p, lv, ws, n, &clock, &running);
    for (int i = 0; i < started; i++) pthread_join(ws[i].thread, NULL);
    if (load_plan_experts(p, &lv->sent)) {
        rc = moed_fail(err, MOED_ENOMEM, "out of memory counting tokens per expert");
        goto out;
    }
    for (int i = 0; i < started; i++) load_experts_merge(&lv->sent, &ws[i].experts);
    lv->cpu_s = cpu_seconds() - cpu0;
    lv->wall_s = (double)(now_ns() - clock.t0) / 1e9;
    load_stats_init(&lv->st);
    for (int i = 0; i < started; i++) {
        load_stats_merge(&lv->st, &ws[i].st);
        lv->calls += ws[i].completed;
    }
    if (p->verify)
        load_verify_end(p->verify, &lv->st.verified, &lv->st.mismatches, &lv->st.worst_verify_err,
                        lv->st.first_mismatch, sizeof lv->st.first_mismatch);
    lv->elapsed_s =
        lv->st.t_last_ns > clock.t_measure ? (double)(lv->st.t_last_ns - clock.t_measure) / 1e9 : 0;
out:
    for (int i = 0; i < inited; i++) worker_free(&ws[i]);
    free(ws);
    return rc;
}
