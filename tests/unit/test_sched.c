/*
 * test_sched — the scheduler against a fake backend whose forward can be held, so the test decides
 * what is queued when a worker becomes free: merging, the token bound, the merge window, the queue
 * bound, cancellation, deadlines, ordering across queues, merge keys, server-side routing with a
 * request that fails alone, a request whose copy-in fails, batch-level gating, drain, one launch
 * per queue at a time, owners (connections) taking turns, and a worker's spin after a launch
 * losing no request on its way to sleep.
 *
 * The fake computes y[t][j] = sum over the token's pairs of w * ((e + 1) * x[t][j] + e), so every
 * output names the experts and weights its token was routed to; the test computes the same from
 * the request alone and compares bit for bit.
 */
#include "check.h"
#include "moed_backend_impl.h" /* the fake is a backend: it fills the table the wrappers call */
#include "moed_backoff.h"
#include "moed_dtype.h"
#include "scheduler.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the fake backend ------------------------------------------------------------------------ */

#define MAX_JOBS 64

static struct {
    pthread_mutex_t m;
    pthread_cond_t c;
    int hold;       /* forward blocks while set */
    int in_forward; /* forwards running now */
    int n_jobs;
    int64_t job_T[MAX_JOBS];
    int job_parts[MAX_JOBS];
    int job_slot[MAX_JOBS];
    int job_exec[MAX_JOBS];
    int pin;          /* exec_accepts: slot s runs only on exec s (two GPUs, one layer each) */
    int fail_forward; /* the next forward fails */
    const int32_t *local_of[2]; /* by slot: an expert shard's map (moed_layer.local_of), or NULL */
} fk = { .m = PTHREAD_MUTEX_INITIALIZER, .c = PTHREAD_COND_INITIALIZER };

/* The part of the job holding token t, and t's row in it. */
static const moed_part *part_of(const moed_job *job, int64_t t, int64_t *row)
{
    int i = 0;
    while (t >= job->parts[i].rows) t -= job->parts[i++].rows;
    *row = t;
    return &job->parts[i];
}

static int fake_forward(moed_backend *b, int exec, const moed_job *job, moed_error *err)
{
    pthread_mutex_lock(&fk.m);
    if (fk.n_jobs < MAX_JOBS) {
        fk.job_T[fk.n_jobs] = job->T;
        fk.job_parts[fk.n_jobs] = job->n_parts;
        fk.job_slot[fk.n_jobs] = job->slot;
        fk.job_exec[fk.n_jobs] = exec;
    }
    fk.n_jobs++;
    fk.in_forward++;
    pthread_cond_broadcast(&fk.c);
    while (fk.hold) pthread_cond_wait(&fk.c, &fk.m);
    fk.in_forward--;
    int fail = fk.fail_forward;
    fk.fail_forward = 0;
    pthread_mutex_unlock(&fk.m);
    if (fail) return moed_fail(err, MOED_EDEVICE, "fake device fell over");
    int d = 4; /* every test layer has d_model 4 */
    const moed_route *r = job->route;
    CHECK_EQ_INT(r->T, job->T);
    /* Device routing as the CUDA backend takes it: checked part by part, a refused part counting
     * no pair; its pairs those of moed_route_from_choice over its own ids and weights, renumbered
     * on an expert shard (the ids are the whole layer's). */
    moed_route own[8] = { 0 };
    for (int i = 0; i < job->n_parts && i < 8; i++) {
        moed_part_route *pr = job->parts[i].route;
        if (!pr) continue;
        const int64_t bad = moed_choice_check(pr->ids, pr->weights, job->parts[i].rows, pr->k, 8);
        memset(&pr->err, 0, sizeof pr->err);
        if (bad >= 0) moed_choice_fail(&pr->err, bad, pr->k, 8);
        moed_error e;
        CHECK_EQ_INT(bad >= 0 ? moed_route_init(&own[i], job->parts[i].rows, 0)
                              : moed_route_from_choice(&own[i], pr->ids, pr->weights,
                                                       job->parts[i].rows, pr->k, 8, &e),
                     0);
        if (job->slot < 2 && fk.local_of[job->slot])
            moed_route_localize(&own[i], fk.local_of[job->slot]);
    }
    for (int64_t t = 0; t < job->T; t++) {
        int64_t row;
        const moed_part *pt = part_of(job, t, &row);
        const moed_route *rt = pt->route ? &own[pt - job->parts] : r;
        const int64_t u = pt->route ? row : t;
        const float *x = (const float *)pt->x + row * d;
        float *y = (float *)pt->y + row * d;
        CHECK(!pt->route || r->off[t + 1] == r->off[t]);
        for (int j = 0; j < d; j++) {
            float acc = 0;
            for (int64_t p = rt->off[u]; p < rt->off[u + 1]; p++)
                acc += rt->weight[p] * ((float)(rt->expert[p] + 1) * x[j] + (float)rt->expert[p]);
            y[j] = acc;
        }
    }
    for (int i = 0; i < 8; i++) moed_route_free(&own[i]);
    return 0;
}

/* "Device memory" is the test's own host memory. */
static int fake_read_device(moed_backend *b, void *dst, const void *src, int dev, size_t bytes,
                            moed_error *err)
{
    memcpy(dst, src, bytes);
    return 0;
}

/* logits[t][e] = x[t][0] * (e + 1) - x[t][1] * e: finite for finite rows, NaN for NaN rows. */
static int fake_router(moed_backend *b, int exec, const moed_job *job, float *logits,
                       moed_error *err)
{
    int E = 8;
    for (int64_t t = 0; t < job->T; t++) {
        int64_t row;
        const float *x = (const float *)part_of(job, t, &row)->x + row * 4;
        for (int e = 0; e < E; e++) logits[t * E + e] = x[0] * (float)(e + 1) - x[1] * (float)e;
    }
    return 0;
}

static int fake_exec_accepts(moed_backend *b, int exec, int slot)
{
    return !fk.pin || exec == slot;
}

static const moed_backend_ops fake_ops = { .name = "fake",
                                           .forward = fake_forward,
                                           .router_logits = fake_router,
                                           .exec_accepts = fake_exec_accepts,
                                           .read_device = fake_read_device };

static void hold(int on)
{
    pthread_mutex_lock(&fk.m);
    fk.hold = on;
    pthread_cond_broadcast(&fk.c);
    pthread_mutex_unlock(&fk.m);
}

/* Waits until `n` forwards are blocked in the fake (the workers are busy). */
static void wait_in_forward(int n)
{
    pthread_mutex_lock(&fk.m);
    while (fk.in_forward < n) pthread_cond_wait(&fk.c, &fk.m);
    pthread_mutex_unlock(&fk.m);
}

/* ---- requests -------------------------------------------------------------------------------- */

typedef struct req {
    moed_sched_item it;
    float x[16 * 4];     /* hidden, which copy_in copies */
    int fail_copy;       /* copy_in fails */
    struct req *cancels; /* copy_in_slowly cancels this one */
    int32_t ids[16 * 2];
    float w[16 * 2];
    /* the result */
    int done, status;
    float y[16 * 4];
    float own_y[16 * 4]; /* where the backend writes when the request asks for it (it.mem.y) */
    const void *y_at;    /* where the result said the output was */
    moed_timings tm;
    int32_t set[8];
    int n_set;
    char msg[480];
} req;

static pthread_mutex_t done_m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_c = PTHREAD_COND_INITIALIZER;
static int n_done;

static void on_done(moed_sched_item *it, const moed_sched_result *r)
{
    req *q = it->user;
    pthread_mutex_lock(&done_m);
    CHECK_MSG(!q->done, "done called twice");
    q->status = r->status;
    if (!r->status) {
        CHECK_EQ_INT(r->y_bytes, q->it.T * 4 * sizeof(float));
        memcpy(q->y, r->y, r->y_bytes);
        q->y_at = r->y;
        q->tm = r->timings;
        q->n_set = r->n_expert_set;
        if (r->n_expert_set) memcpy(q->set, r->expert_set, (size_t)r->n_expert_set * 4);
    } else {
        snprintf(q->msg, sizeof q->msg, "%s", r->err ? r->err->msg : "");
    }
    q->done = 1;
    n_done++;
    pthread_cond_broadcast(&done_c);
    pthread_mutex_unlock(&done_m);
}

/* The payload's copy: the request's own rows, or a failure when the test asks for one. */
static int copy_in(moed_sched_item *it, void *dst, moed_error *err)
{
    req *q = it->user;
    if (q->fail_copy) return moed_fail(err, MOED_EIO, "the fake region went away");
    memcpy(dst, q->x, (size_t)it->T * 4 * sizeof(float));
    return 0;
}

static int wait_done(int n)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 10;
    pthread_mutex_lock(&done_m);
    while (n_done < n)
        if (pthread_cond_timedwait(&done_c, &done_m, &ts)) break;
    int got = n_done;
    pthread_mutex_unlock(&done_m);
    CHECK_MSG(got >= n, "waited for %d completions, saw %d", n, got);
    return got >= n;
}

static moed_layer layers[2];
static const moed_layer *layer_ptrs[2] = { &layers[0], &layers[1] };
static float router_w[1]; /* has_router needs a non-NULL router; the fake never reads it */

static void init_layers(void)
{
    for (int i = 0; i < 2; i++) {
        layers[i].info = (moed_layer_info){ .index = i,
                                            .d_model = 4,
                                            .d_ff = 8,
                                            .n_experts = 8,
                                            .top_k = 2,
                                            .act = MOED_ACT_SWIGLU,
                                            .wdtype = MOED_F32,
                                            .has_router = true,
                                            .norm_topk = true,
                                            .rule = MOED_RULE_SOFTMAX_TOPK,
                                            .n_group = 1,
                                            .topk_group = 1,
                                            .routed_scale = 1 };
        layers[i].router = router_w;
    }
}

/* A request for layer `slot` with T tokens, routed by client choice (two experts per token). */
static req *make_req(int slot, int64_t T, int seed)
{
    req *q = calloc(1, sizeof *q);
    for (int i = 0; i < T * 4; i++) q->x[i] = (float)((seed * 7 + i * 3) % 11) - 5.0f;
    for (int t = 0; t < T; t++) {
        q->ids[2 * t] = (seed + t) % 8;
        q->ids[2 * t + 1] = (seed + 3 * t + 1) % 8;
        q->w[2 * t] = 0.25f * (float)(1 + (seed + t) % 3);
        q->w[2 * t + 1] = 0.5f;
    }
    moed_sched_item *it = &q->it;
    it->slot = slot;
    it->layer = &layers[slot];
    it->dtype = MOED_F32;
    it->T = T;
    moed_error err;
    CHECK_EQ_INT(moed_route_from_choice(&it->route, q->ids, q->w, T, 2, 8, &err), 0);
    q->it.copy_in = copy_in;
    q->it.done = on_done;
    q->it.user = q;
    q->it.t_received_ns = moed_now_ns();
    return q;
}

/* The same request routed by the server's router (per-token top-2) or by batch gating. */
static req *make_server_req(int slot, int64_t T, int seed, int k_batch)
{
    req *q = make_req(slot, T, seed);
    moed_route_free(&q->it.route);
    q->it.server_logits = true;
    q->it.k_batch = k_batch;
    q->it.gate =
        (moed_gate_params){ .strategy = MOED_GATE_TOPK, .top_k = 2, .renormalize = MOED_RENORM_ON };
    return q;
}

static void free_req(req *q)
{
    moed_route_free(&q->it.route);
    free(q->it.logits);
    free(q);
}

/* What the fake computes for this request alone, from a route. */
static void expect_route(const req *q, const moed_route *r)
{
    for (int64_t t = 0; t < q->it.T; t++)
        for (int j = 0; j < 4; j++) {
            float acc = 0;
            for (int64_t p = r->off[t]; p < r->off[t + 1]; p++)
                acc += r->weight[p] *
                       ((float)(r->expert[p] + 1) * q->x[t * 4 + j] + (float)r->expert[p]);
            CHECK_MSG(acc == q->y[t * 4 + j], "token %lld col %d: %g != %g", (long long)t, j,
                      (double)q->y[t * 4 + j], (double)acc);
        }
}

static void expect_ok(const req *q)
{
    CHECK_MSG(q->done && q->status == 0, "status %d: %s", q->status, q->msg);
    if (q->done && !q->status) expect_route(q, &q->it.route);
}

/* A scheduler over the fake with n_exec slots: cfg's limits, the test layers. */
static moed_sched *start_cfg(int n_exec, moed_sched_config cfg)
{
    static moed_backend be;
    be = (moed_backend){ .ops = &fake_ops, .n_exec = n_exec };
    cfg.backend = &be;
    cfg.layers = layer_ptrs;
    cfg.n_layers = 2;
    moed_sched *s;
    moed_error err;
    CHECK_EQ_INT(moed_sched_create(&cfg, &s, &err), 0);
    pthread_mutex_lock(&fk.m);
    fk.n_jobs = 0;
    pthread_mutex_unlock(&fk.m);
    pthread_mutex_lock(&done_m);
    n_done = 0;
    pthread_mutex_unlock(&done_m);
    return s;
}

static moed_sched *start_min(int n_exec, int64_t max_tokens, int64_t delay_us, int64_t max_queue,
                             int64_t min_requests)
{
    return start_cfg(n_exec, (moed_sched_config){ .max_batch_tokens = max_tokens,
                                                  .max_delay_us = delay_us,
                                                  .max_queue_requests = max_queue,
                                                  .min_batch_requests = min_requests });
}

static moed_sched *start(int n_exec, int64_t max_tokens, int64_t delay_us, int64_t max_queue)
{
    return start_min(n_exec, max_tokens, delay_us, max_queue, 1);
}

static void submit_ok(moed_sched *s, req *q)
{
    moed_error err;
    int rc = moed_sched_submit(s, &q->it, &err);
    CHECK_MSG(rc == 0, "submit: %d %s", rc, err.msg);
}

/* ---- the tests ------------------------------------------------------------------------------- */

/* While one launch runs, what queues behind it goes as one launch; results as if alone. */
static void test_merge(void)
{
    moed_sched *s = start(1, 16, 0, 64);
    hold(1);
    req *a = make_req(0, 3, 1);
    submit_ok(s, a);
    wait_in_forward(1);
    req *q[4];
    for (int i = 0; i < 4; i++) submit_ok(s, q[i] = make_req(0, 2 + i % 2, 10 + i));
    hold(0);
    wait_done(5);
    CHECK_EQ_INT(fk.n_jobs, 2);
    CHECK_EQ_INT(fk.job_T[0], 3);
    CHECK_EQ_INT(fk.job_T[1], 2 + 3 + 2 + 3);
    expect_ok(a);
    CHECK_EQ_INT(a->tm.batch_requests, 1);
    for (int i = 0; i < 4; i++) {
        expect_ok(q[i]);
        CHECK_EQ_INT(q[i]->tm.batch_requests, 4);
        CHECK_EQ_INT(q[i]->tm.batch_tokens, 10);
        CHECK(q[i]->tm.total_us >= q[i]->tm.queue_us);
        free_req(q[i]);
    }
    free_req(a);
    moed_sched_destroy(s);
}

/* Requests whose rows the backend may read where they are (item.mem) are parts of the job as
 * they lie, beside requests copied into the staging; a request that fails its copy-in leaves the
 * list of parts and the others' rows stay where they are. Each gets its own rows, bit for bit. */
static void test_parts(void)
{
    moed_sched *s = start(1, 16, 0, 64);
    hold(1);
    req *a = make_req(0, 1, 1);
    submit_ok(s, a);
    wait_in_forward(1);
    req *q[5];
    for (int i = 0; i < 5; i++) {
        q[i] = i == 4 ? make_server_req(0, 2, 40 + i, 0) : make_req(0, 1 + i % 3, 40 + i);
        if (i % 2 == 0) { /* direct: read from x, written into own_y */
            q[i]->it.mem = (moed_part){
                .x = q[i]->x, .x_dev = MOED_HOST_MEM, .y = q[i]->own_y, .y_dev = MOED_HOST_MEM
            };
        }
        q[i]->fail_copy = i == 1;
        submit_ok(s, q[i]);
    }
    hold(0);
    wait_done(6);
    CHECK_EQ_INT(fk.n_jobs, 2);
    CHECK_EQ_INT(fk.job_parts[1], 4); /* q[1] failed its copy and left */
    CHECK_EQ_INT(fk.job_T[1], 1 + 3 + 1 + 2);
    for (int i = 0; i < 5; i++) {
        if (i == 1) {
            CHECK_EQ_INT(q[i]->status, MOED_EIO);
        } else {
            expect_ok(q[i]);
        }
        if (i % 2 == 0 && !q[i]->status) {
            CHECK(q[i]->y_at == q[i]->own_y);
            CHECK(!memcmp(q[i]->own_y, q[i]->y, (size_t)q[i]->it.T * 4 * sizeof(float)));
        }
        free_req(q[i]);
    }
    free_req(a);
    moed_sched_destroy(s);
}

/* Never more than max_batch_tokens in a launch; requests are never split; order kept. */
static void test_max_tokens(void)
{
    moed_sched *s = start(1, 10, 0, 64);
    hold(1);
    req *a = make_req(0, 1, 1), *q[5];
    submit_ok(s, a);
    wait_in_forward(1);
    int64_t T[5] = { 4, 4, 4, 10, 1 };
    for (int i = 0; i < 5; i++) submit_ok(s, q[i] = make_req(0, T[i], 20 + i));
    hold(0);
    wait_done(6);
    /* [1] [4 4] [4] [10] [1]: the third 4 does not fit beside 4 + 4, nor 10 beside 4. */
    CHECK_EQ_INT(fk.n_jobs, 5);
    int64_t want[5] = { 1, 8, 4, 10, 1 };
    for (int i = 0; i < 5 && i < fk.n_jobs; i++) CHECK_EQ_INT(fk.job_T[i], want[i]);
    for (int i = 0; i < 5; i++) {
        expect_ok(q[i]);
        free_req(q[i]);
    }
    free_req(a);
    moed_sched_destroy(s);
}

/* A merge window gathers requests that arrive within it; a full batch does not wait for it. */
static void test_window(void)
{
    /* b, 20 ms after a, joins a's launch if it is queued before a's 200 ms window closes: the
     * test measures that it was, and makes another try where it was itself too slow for that. */
    const uint64_t window_ns = 200ull * 1000 * 1000;
    for (int tries = 1;; tries++) {
        moed_sched *s = start(1, 8, 200 * 1000, 64);
        req *a = make_req(0, 1, 1), *b = make_req(0, 2, 2);
        uint64_t t0 = moed_now_ns();
        submit_ok(s, a);
        struct timespec ts = { 0, 20 * 1000 * 1000 };
        nanosleep(&ts, NULL);
        submit_ok(s, b);
        bool in_time = moed_now_ns() - t0 < window_ns;
        wait_done(2);
        uint64_t waited = moed_now_ns() - t0;
        if (in_time) {
            CHECK_EQ_INT(fk.n_jobs, 1);
            CHECK_EQ_INT(a->tm.batch_requests, 2);
            CHECK(a->tm.queue_us > b->tm.queue_us);
        }
        CHECK_MSG(waited >= window_ns, "the window closed after %llu ns",
                  (unsigned long long)waited);
        CHECK(a->tm.queue_us >= 190000);
        expect_ok(a);
        expect_ok(b);
        free_req(a);
        free_req(b);
        moed_sched_destroy(s);
        if (in_time) break;
        CHECK_MSG(tries < 10, "in %d tries b was never submitted within a's window", tries);
        if (tries >= 10) break;
    }

    /* With a 60 s window, 8 tokens (the bound) go at once (wait_done gives up after 10 s). */
    moed_sched *s = start(1, 8, 60 * 1000 * 1000, 64);
    req *c = make_req(0, 5, 3), *d = make_req(0, 3, 4);
    submit_ok(s, c);
    submit_ok(s, d);
    wait_done(2);
    CHECK_EQ_INT(c->tm.batch_tokens, 8);
    expect_ok(c);
    expect_ok(d);
    free_req(c);
    free_req(d);
    moed_sched_destroy(s);
}

/* The queue bound answers EFULL without calling done; cancellation; deadlines at dispatch. */
static void test_bound_cancel_deadline(void)
{
    moed_sched *s = start(1, 16, 0, 3);
    hold(1);
    req *a = make_req(0, 1, 1);
    submit_ok(s, a);
    wait_in_forward(1);
    req *b = make_req(0, 1, 2), *c = make_req(0, 1, 3), *d = make_req(0, 1, 4),
        *e = make_req(0, 1, 5);
    d->it.deadline_ns = moed_now_ns() + 1000; /* passes while a holds the worker */
    submit_ok(s, b);
    submit_ok(s, c);
    submit_ok(s, d);
    moed_error err;
    CHECK_EQ_INT(moed_sched_submit(s, &e->it, &err), MOED_EFULL);
    CHECK(strstr(err.msg, "--max-queue-requests") != NULL);
    moed_sched_cancel(s, &c->it); /* queued: answered here and now */
    CHECK(c->done && c->status == MOED_ECANCELLED);
    moed_sched_cancel(s, &a->it); /* the backend has it: it runs to its end */
    CHECK(!a->done);
    /* With c gone there is room again. */
    submit_ok(s, e);
    struct timespec ts = { 0, 2 * 1000 * 1000 };
    nanosleep(&ts, NULL);
    hold(0);
    wait_done(5);
    expect_ok(a);
    expect_ok(b);
    expect_ok(e);
    CHECK_EQ_INT(d->status, MOED_EDEADLINE);
    CHECK(strstr(d->msg, "deadline") != NULL);
    CHECK_EQ_INT(fk.n_jobs, 2); /* a, then b + e; c and d never launched */
    CHECK_EQ_INT(b->tm.batch_requests, 2);
    moed_sched_cancel(s, &b->it); /* done already: no effect, no second done */
    moed_sched_stats st;
    moed_sched_get_stats(s, &st);
    CHECK_EQ_INT(st.rejected, 1);
    CHECK_EQ_INT(st.cancelled, 1);
    CHECK_EQ_INT(st.expired, 1);
    CHECK_EQ_INT(st.completed, 3);
    CHECK_EQ_INT(st.batches, 2);
    req *all[5] = { a, b, c, d, e };
    for (int i = 0; i < 5; i++) free_req(all[i]);
    moed_sched_destroy(s);
}

/* gRPC cancels a call whose deadline passed: cancelling such a queued item answers it as expired
 * (DEADLINE_EXCEEDED in the metrics), one whose deadline is still ahead as cancelled. */
static void test_cancel_after_the_deadline(void)
{
    moed_sched *s = start(1, 16, 0, 8);
    hold(1);
    req *a = make_req(0, 1, 1), *b = make_req(0, 1, 2), *c = make_req(0, 1, 3);
    submit_ok(s, a);
    wait_in_forward(1);
    b->it.deadline_ns = moed_now_ns(); /* already passed */
    c->it.deadline_ns = moed_now_ns() + 60ull * 1000 * 1000 * 1000;
    submit_ok(s, b);
    submit_ok(s, c);
    moed_sched_cancel(s, &b->it);
    moed_sched_cancel(s, &c->it);
    CHECK(b->done && b->status == MOED_EDEADLINE && strstr(b->msg, "deadline"));
    CHECK(c->done && c->status == MOED_ECANCELLED);
    hold(0);
    wait_done(3);
    expect_ok(a);
    CHECK_EQ_INT(fk.n_jobs, 1); /* neither b nor c launched */
    moed_sched_stats st;
    moed_sched_get_stats(s, &st);
    CHECK(st.expired == 1 && st.cancelled == 1 && st.completed == 1 && st.queued == 0);
    free_req(a);
    free_req(b);
    free_req(c);
    moed_sched_destroy(s);
}

/* Across queues the oldest request goes first; layers and dtypes never share a launch; a backend
 * failure fails that launch alone. */
static void test_order_and_keys(void)
{
    moed_sched *s = start(1, 16, 0, 64);
    hold(1);
    req *a = make_req(0, 1, 1);
    submit_ok(s, a);
    wait_in_forward(1);
    req *l1a = make_req(1, 2, 2), *l0 = make_req(0, 3, 3), *l1b = make_req(1, 1, 4);
    req *k2 = make_server_req(1, 1, 5, 2), *k3 = make_server_req(1, 1, 6, 3);
    submit_ok(s, l1a);
    submit_ok(s, l0);
    submit_ok(s, l1b);
    submit_ok(s, k2);
    submit_ok(s, k3);
    pthread_mutex_lock(&fk.m);
    fk.fail_forward = 0;
    pthread_mutex_unlock(&fk.m);
    hold(0);
    wait_done(6);
    CHECK_EQ_INT(fk.n_jobs, 5);
    int want_slot[5] = { 0, 1, 0, 1, 1 };
    int64_t want_T[5] = { 1, 3, 3, 1, 1 };
    for (int i = 0; i < 5 && i < fk.n_jobs; i++) {
        CHECK_EQ_INT(fk.job_slot[i], want_slot[i]);
        CHECK_EQ_INT(fk.job_T[i], want_T[i]);
    }
    expect_ok(l1a);
    expect_ok(l1b);
    expect_ok(l0);
    CHECK(k2->status == 0 && k2->n_set == 2 && k3->status == 0 && k3->n_set == 3);
    req *all[6] = { a, l1a, l0, l1b, k2, k3 };
    for (int i = 0; i < 6; i++) free_req(all[i]);

    /* The device fails: the launch's requests get its error, the next launch runs. */
    hold(1);
    a = make_req(0, 1, 1);
    submit_ok(s, a);
    wait_in_forward(1);
    pthread_mutex_lock(&fk.m);
    fk.fail_forward = 1;
    pthread_mutex_unlock(&fk.m);
    req *b = make_req(0, 1, 2);
    hold(0);
    wait_done(7);
    submit_ok(s, b);
    wait_done(8);
    CHECK_EQ_INT(a->status, MOED_EDEVICE);
    CHECK(strstr(a->msg, "fake device") != NULL);
    expect_ok(b);
    free_req(a);
    free_req(b);
    moed_sched_destroy(s);
}

/* A server-routed request's result: the route the server must have used is top-2 of the fake
 * logits of its own rows, and it went in a launch of `requests` requests. */
static void expect_server_route(const req *q, int requests)
{
    CHECK_MSG(q->done && q->status == 0, "status %d: %s", q->status, q->msg);
    float l[16 * 8];
    moed_error err;
    fake_router(NULL, 0,
                &(moed_job){ .T = q->it.T, .parts = &(moed_part){ .rows = q->it.T, .x = q->x } }, l,
                &err);
    moed_route want;
    CHECK_EQ_INT(moed_gate(&q->it.gate, &layers[0].info, NULL, l, q->it.T, &want, &err), 0);
    expect_route(q, &want);
    CHECK_EQ_INT(q->tm.batch_requests, requests);
    moed_route_free(&want);
}

/* The server router: logits from the backend, gated per request; a request whose hidden holds a
 * NaN fails alone and its rows leave the launch. */
static void test_server_router(void)
{
    moed_sched *s = start(1, 16, 0, 64);
    hold(1);
    req *a = make_req(0, 1, 1);
    submit_ok(s, a);
    wait_in_forward(1);
    req *p = make_server_req(0, 2, 7, 0), *bad = make_server_req(0, 3, 8, 0),
        *c = make_req(0, 2, 9), *r = make_server_req(0, 1, 10, 0);
    bad->x[5] = NAN;
    submit_ok(s, p);
    submit_ok(s, bad);
    submit_ok(s, c);
    submit_ok(s, r);
    hold(0);
    wait_done(5);
    CHECK_EQ_INT(bad->status, MOED_EINVAL);
    CHECK(strstr(bad->msg, "finite") != NULL);
    CHECK_EQ_INT(fk.n_jobs, 2);
    CHECK_EQ_INT(fk.job_T[1], 2 + 2 + 1);
    expect_ok(c);
    expect_server_route(p, 3);
    expect_server_route(r, 3);
    req *all[5] = { a, p, bad, c, r };
    for (int i = 0; i < 5; i++) free_req(all[i]);
    moed_sched_destroy(s);
}

/* Submits `n` requests behind a held launch, so they go as one launch once it is let go. */
static void submit_behind(moed_sched *s, req *held, req **q, int n, int done_before)
{
    hold(1);
    submit_ok(s, held);
    wait_in_forward(1);
    for (int i = 0; i < n; i++) submit_ok(s, q[i]);
    hold(0);
    wait_done(done_before + 1 + n);
}

/* A request whose copy-in fails (its data went away) is answered with that error alone, and its
 * launch runs without it: the others' rows close up, so the backend (and the server router) see
 * each one's own rows. A launch whose every copy fails runs nothing. */
static void test_copy_in_fails(void)
{
    moed_sched *s = start(1, 16, 0, 64);
    req *a = make_req(0, 1, 1),
        *q[3] = { make_req(0, 2, 13), make_req(0, 3, 14), make_req(0, 2, 15) };
    q[1]->fail_copy = 1;
    submit_behind(s, a, q, 3, 0);
    CHECK_EQ_INT(q[1]->status, MOED_EIO);
    CHECK(strstr(q[1]->msg, "went away") != NULL);
    CHECK_EQ_INT(fk.n_jobs, 2);
    CHECK_EQ_INT(fk.job_T[1], 2 + 2);
    expect_ok(q[0]);
    expect_ok(q[2]);
    CHECK_EQ_INT(q[2]->tm.batch_requests, 2);

    /* The same with server routing, whose logits come from the staged rows. */
    req *b = make_req(0, 1, 2),
        *r[3] = { make_server_req(0, 2, 16, 0), make_req(0, 3, 17), make_server_req(0, 1, 18, 0) };
    r[1]->fail_copy = 1;
    submit_behind(s, b, r, 3, 4);
    CHECK_EQ_INT(r[1]->status, MOED_EIO);
    CHECK_EQ_INT(fk.n_jobs, 4);
    CHECK_EQ_INT(fk.job_T[3], 2 + 1);
    expect_server_route(r[0], 2);
    expect_server_route(r[2], 2);

    req *gone = make_req(0, 2, 19);
    gone->fail_copy = 1;
    submit_ok(s, gone);
    wait_done(9);
    CHECK_EQ_INT(gone->status, MOED_EIO);
    CHECK_EQ_INT(fk.n_jobs, 4);
    moed_sched_stats st;
    moed_sched_get_stats(s, &st);
    CHECK_EQ_INT(st.failed, 3);
    CHECK_EQ_INT(st.completed, 6);
    CHECK_EQ_INT(st.batches, 4);
    req *all[9] = { a, q[0], q[1], q[2], b, r[0], r[1], r[2], gone };
    for (int i = 0; i < 9; i++) free_req(all[i]);
    moed_sched_destroy(s);
}

/* Batch gating merges requests asking the same k (client logits and server logits alike) and
 * gates over the merged logits: every request gets the same set, and the route gate_batch gives
 * for the merged rows. */
static void test_batch_gating(void)
{
    moed_sched *s = start(1, 16, 0, 64);
    hold(1);
    req *a = make_req(0, 1, 1);
    submit_ok(s, a);
    wait_in_forward(1);
    req *p = make_server_req(0, 2, 11, 3), *q = make_server_req(0, 3, 12, 3);
    /* q brings its own logits (RouterLogits + BatchGating): not the fake router's. */
    q->it.server_logits = false;
    q->it.logits = malloc(3 * 8 * sizeof(float));
    for (int i = 0; i < 24; i++) q->it.logits[i] = (float)((i * 5) % 9) * 0.5f;
    submit_ok(s, p);
    submit_ok(s, q);
    hold(0);
    wait_done(3);
    CHECK_EQ_INT(fk.n_jobs, 2);
    float l[5 * 8];
    moed_error err;
    fake_router(NULL, 0, &(moed_job){ .T = 2, .parts = &(moed_part){ .rows = 2, .x = p->x } }, l,
                &err);
    memcpy(l + 16, q->it.logits, 24 * sizeof(float));
    int32_t set[3];
    moed_route merged;
    CHECK_EQ_INT(moed_gate_batch(l, 5, 8, 3, set, &merged, &err), 0);
    CHECK(p->status == 0 && q->status == 0);
    CHECK(p->n_set == 3 && q->n_set == 3);
    for (int j = 0; j < 3; j++) CHECK(p->set[j] == set[j] && q->set[j] == set[j]);
    /* Split the merged route back into the two requests' parts and compare. */
    moed_route rp = merged, rq = merged;
    rp.T = 2;
    expect_route(p, &rp);
    int64_t off_q[4];
    for (int t = 0; t <= 3; t++) off_q[t] = merged.off[2 + t] - merged.off[2];
    rq.T = 3;
    rq.off = off_q;
    rq.expert = merged.expert + merged.off[2];
    rq.weight = merged.weight + merged.off[2];
    expect_route(q, &rq);
    moed_route_free(&merged);
    free_req(a);
    free_req(p);
    free_req(q);
    moed_sched_destroy(s);
}

/* Drain runs everything queued (even inside a long merge window), then refuses new work. */
static void test_drain(void)
{
    moed_sched *s = start(2, 16, 60 * 1000 * 1000, 64);
    req *q[6];
    for (int i = 0; i < 6; i++) submit_ok(s, q[i] = make_req(i % 2, 1 + i % 3, 30 + i));
    moed_sched_drain(s);
    CHECK_EQ_INT(n_done, 6);
    for (int i = 0; i < 6; i++) expect_ok(q[i]);
    req *late = make_req(0, 1, 40);
    moed_error err;
    CHECK_EQ_INT(moed_sched_submit(s, &late->it, &err), MOED_EDRAINING);
    CHECK(!late->done);
    for (int i = 0; i < 6; i++) free_req(q[i]);
    free_req(late);
    moed_sched_destroy(s);
}

/* The worker's merged route is reused: a launch smaller than an earlier one, then one in between,
 * must still fit in it. */
static void test_route_reuse(void)
{
    moed_sched *s = start(1, 16, 0, 64);
    int64_t T[4] = { 12, 2, 7, 16 };
    for (int i = 0; i < 4; i++) {
        req *q = make_req(i % 2, T[i], 50 + i);
        submit_ok(s, q);
        wait_done(i + 1);
        expect_ok(q);
        free_req(q);
    }
    moed_sched_destroy(s);
}

/* A worker that ran a launch spins for the next request (moed_backoff.h's spin), then sleeps on
 * the condition: a request right after a launch, one after the spin has ended, and one to a worker
 * woken by another's launch ending (two slots, one queue: the second launch waits for the first)
 * are each taken, none lost between the spin and the sleep. */
static void test_spin_then_sleep(void)
{
    moed_sched *s = start(2, 16, 0, 64);
    req *q[5];
    for (int i = 0; i < 5; i++) q[i] = make_req(0, 2, 60 + i);
    submit_ok(s, q[0]);
    wait_done(1);
    submit_ok(s, q[1]); /* a worker spins now */
    wait_done(2);
    usleep((useconds_t)(MOED_BACKOFF_SPIN_NS / 1000 + 10000)); /* its spin is over: both sleep */
    submit_ok(s, q[2]);
    wait_done(3);
    hold(1);
    submit_ok(s, q[3]);
    wait_in_forward(1);
    submit_ok(s, q[4]); /* one launch per queue: it waits for q[3]'s to end */
    usleep((useconds_t)(MOED_BACKOFF_SPIN_NS / 1000 + 10000));
    hold(0);
    wait_done(5);
    for (int i = 0; i < 5; i++) {
        expect_ok(q[i]);
        free_req(q[i]);
    }
    moed_sched_destroy(s);
}

/* Two execution slots run two launches at once. */
static void test_two_slots(void)
{
    moed_sched *s = start(2, 16, 0, 64);
    hold(1);
    req *a = make_req(0, 1, 1), *b = make_req(1, 1, 2);
    submit_ok(s, a);
    submit_ok(s, b);
    wait_in_forward(2);
    hold(0);
    wait_done(2);
    expect_ok(a);
    expect_ok(b);
    free_req(a);
    free_req(b);
    moed_sched_destroy(s);
}

/* Two slots, one queue: while a launch of the queue runs, the free slot does not start a second
 * small launch of it (two weight-bound launches would each read every expert's weights); what
 * arrives meanwhile waits to go as one launch. Once a full batch of tokens waits, the free slot
 * does start, beside the running launch. */
static void test_one_launch_per_queue(void)
{
    moed_sched *s = start(2, 16, 0, 64);
    hold(1);
    req *a = make_req(0, 2, 1), *b = make_req(0, 3, 2), *c = make_req(0, 3, 3);
    submit_ok(s, a);
    wait_in_forward(1);
    submit_ok(s, b);
    submit_ok(s, c);
    usleep(50 * 1000); /* the free slot had every chance to take them */
    pthread_mutex_lock(&fk.m);
    CHECK_EQ_INT(fk.n_jobs, 1);
    pthread_mutex_unlock(&fk.m);
    req *full = make_req(0, 16, 4); /* the queue now holds 22 tokens, more than a launch takes */
    submit_ok(s, full);
    wait_in_forward(2);
    hold(0);
    wait_done(4);
    CHECK_EQ_INT(fk.n_jobs, 3);
    int64_t want[3] = { 2, 6, 16 }; /* b and c went together, beside a; then the full one */
    for (int i = 0; i < 3 && i < fk.n_jobs; i++) CHECK_EQ_INT(fk.job_T[i], want[i]);
    req *all[4] = { a, b, c, full };
    for (int i = 0; i < 4; i++) {
        expect_ok(all[i]);
        free_req(all[i]);
    }
    moed_sched_destroy(s);
}

/* --min-batch-requests: within a long window, the launch goes as soon as N requests are queued —
 * the deterministic merge the end-to-end tests of batch gating rely on. */
static void test_min_requests(void)
{
    moed_sched *s = start_min(1, 16, 60 * 1000 * 1000, 64, 3);
    req *q[3];
    for (int i = 0; i < 2; i++) submit_ok(s, q[i] = make_req(0, 2, 40 + i));
    usleep(50 * 1000);
    pthread_mutex_lock(&fk.m);
    CHECK_EQ_INT(fk.n_jobs, 0); /* two of three: the window (60 s) holds them */
    pthread_mutex_unlock(&fk.m);
    submit_ok(s, q[2] = make_req(0, 3, 42));
    wait_done(3);
    CHECK_EQ_INT(fk.n_jobs, 1);
    CHECK_EQ_INT(fk.job_T[0], 7);
    for (int i = 0; i < 3; i++) {
        expect_ok(q[i]);
        CHECK_EQ_INT(q[i]->tm.batch_requests, 3);
        free_req(q[i]);
    }
    moed_sched_destroy(s);
}

/* Layers pinned to devices (exec_accepts): every launch runs on a slot that holds its layer, also
 * when the other slot is the free one. */
static void test_exec_placement(void)
{
    fk.pin = 1;
    moed_sched *s = start(2, 16, 0, 64);
    req *q[8];
    for (int i = 0; i < 8; i++) submit_ok(s, q[i] = make_req(i % 2, 2, 60 + i));
    wait_done(8);
    for (int j = 0; j < fk.n_jobs && j < MAX_JOBS; j++)
        CHECK_MSG(fk.job_exec[j] == fk.job_slot[j], "launch %d of layer slot %d ran on exec %d", j,
                  fk.job_slot[j], fk.job_exec[j]);
    for (int i = 0; i < 8; i++) {
        expect_ok(q[i]);
        free_req(q[i]);
    }
    moed_sched_destroy(s);
    fk.pin = 0;
}

/* A launch never holds more (token, expert) pairs than max_batch_pairs: requests queue in order
 * while their pairs fit, and one larger than the bound goes alone (request.c refuses those whose
 * route is known; a server-gated one is checked on the worker). */
static void test_max_pairs(void)
{
    moed_sched *s =
        start_cfg(1, (moed_sched_config){
                         .max_batch_tokens = 64, .max_batch_pairs = 10, .max_queue_requests = 64 });
    hold(1);
    req *a = make_req(0, 1, 1), *q[5];
    a->it.pairs = 2;
    submit_ok(s, a);
    wait_in_forward(1);
    int64_t T[5] = { 2, 2, 2, 3, 6 }; /* two experts per token: 4, 4, 4, 6 and 12 pairs */
    for (int i = 0; i < 5; i++) {
        q[i] = make_req(0, T[i], 30 + i);
        q[i]->it.pairs = q[i]->it.route.off[T[i]];
        submit_ok(s, q[i]);
    }
    hold(0);
    wait_done(6);
    /* [1] [2 2] [2 3] [6]: a third 4 would make 12 > 10; 4 + 6 is exactly 10; 12 goes alone. */
    CHECK_EQ_INT(fk.n_jobs, 4);
    int64_t want[4] = { 1, 4, 5, 6 };
    for (int i = 0; i < 4 && i < fk.n_jobs; i++) CHECK_EQ_INT(fk.job_T[i], want[i]);
    for (int i = 0; i < 5; i++) {
        expect_ok(q[i]);
        free_req(q[i]);
    }
    free_req(a);
    moed_sched_destroy(s);
}

/* Server gating that keeps more pairs than the bound (sigmoid keeps every expert over its
 * threshold) fails that request alone, on the worker, naming the flag; the next one runs. */
static void test_server_gate_over_pairs(void)
{
    moed_sched *s =
        start_cfg(1, (moed_sched_config){
                         .max_batch_tokens = 64, .max_batch_pairs = 16, .max_queue_requests = 64 });
    hold(1);
    req *a = make_req(0, 1, 1);
    submit_ok(s, a);
    wait_in_forward(1);
    req *big = make_server_req(0, 4, 40, 0), *ok = make_server_req(0, 2, 41, 0);
    big->it.gate = (moed_gate_params){ .strategy = MOED_GATE_SIGMOID,
                                       .top_k = 2,
                                       .renormalize = MOED_RENORM_OFF,
                                       .threshold = 1e-30f };
    big->it.pairs = 4 * 8; /* what request.c plans for it: T x n_experts */
    ok->it.pairs = 2 * 2;
    submit_ok(s, big);
    submit_ok(s, ok);
    hold(0);
    wait_done(3);
    CHECK_EQ_INT(big->status, MOED_ETOOBIG);
    CHECK_MSG(strstr(big->msg, "--max-batch-pairs") != NULL, "%s", big->msg);
    expect_server_route(ok, 1);
    CHECK_EQ_INT(fk.n_jobs, 2); /* a, then ok alone: big planned 32 pairs, so it went alone */
    req *all[3] = { a, big, ok };
    for (int i = 0; i < 3; i++) free_req(all[i]);
    moed_sched_destroy(s);
}

/* Callers that go while their launch is assembled compute nothing: one cancelled by another's
 * copy-in (as a client cancels mid-assembly), one whose deadline passes meanwhile. Both are
 * answered so and counted; the launch runs with the rest. */
static moed_sched *assembling;

static int copy_in_slowly(moed_sched_item *it, void *dst, moed_error *err)
{
    req *q = it->user;
    moed_sched_cancel(assembling, &q->cancels->it);
    struct timespec ts = { 0, 20 * 1000 * 1000 };
    nanosleep(&ts, NULL); /* the next one's deadline passes */
    return copy_in(it, dst, err);
}

static void test_gone_while_assembling(void)
{
    moed_sched *s = assembling = start(1, 64, 0, 64);
    hold(1);
    req *a = make_req(0, 1, 1);
    submit_ok(s, a);
    wait_in_forward(1);
    req *first = make_req(0, 2, 50), *victim = make_req(0, 3, 51), *late = make_req(0, 1, 52),
        *last = make_req(0, 2, 53);
    first->it.copy_in = copy_in_slowly;
    first->cancels = victim;
    late->it.deadline_ns = moed_now_ns() + 10 * 1000 * 1000; /* passes during first's copy-in */
    submit_ok(s, first);
    submit_ok(s, victim);
    submit_ok(s, late);
    submit_ok(s, last);
    hold(0);
    wait_done(5);
    CHECK_EQ_INT(victim->status, MOED_ECANCELLED);
    CHECK_EQ_INT(late->status, MOED_EDEADLINE);
    expect_ok(first);
    expect_ok(last);
    CHECK_EQ_INT(fk.n_jobs, 2);
    CHECK_EQ_INT(fk.job_T[1], 2 + 2); /* first and last only */
    CHECK_EQ_INT(first->tm.batch_requests, 2);
    moed_sched_stats st;
    moed_sched_get_stats(s, &st);
    CHECK_EQ_INT(st.cancelled, 1);
    CHECK_EQ_INT(st.expired, 1);
    req *all[5] = { a, first, victim, late, last };
    for (int i = 0; i < 5; i++) free_req(all[i]);
    moed_sched_destroy(s);
}

/* moed_sched_flush (the drain's first step) closes merge windows now: requests waiting for a
 * 60 s window and 100 companions are launched at once, together, and later ones do not wait. */
static void test_flush(void)
{
    moed_sched *s = start_min(1, 64, 60 * 1000 * 1000, 64, 100);
    req *q[4];
    for (int i = 0; i < 3; i++) submit_ok(s, q[i] = make_req(0, 2, 60 + i));
    struct timespec ts = { 0, 50 * 1000 * 1000 };
    nanosleep(&ts, NULL);
    CHECK_EQ_INT(n_done, 0); /* the window holds them */
    moed_sched_flush(s);
    wait_done(3); /* within its 10 s: the flush, not the 60 s window, launched them */
    submit_ok(s, q[3] = make_req(0, 1, 63));
    wait_done(4);
    CHECK_EQ_INT(fk.n_jobs, 2);
    CHECK_EQ_INT(q[0]->tm.batch_requests, 3);
    for (int i = 0; i < 4; i++) {
        expect_ok(q[i]);
        free_req(q[i]);
    }
    moed_sched_destroy(s);
}

/* Owners take turns: one connection's six requests queued before another's one do not keep it
 * waiting for all of them (the FIFO before turns ran [4 4] [4 4] [4 4] [4]); each owner's requests
 * keep their order; a large request next in turn is not passed over for a smaller one behind it;
 * a cancelled oldest request's place goes to its owner's next. */
static void test_turns(void)
{
    moed_sched *s = start(1, 8, 0, 64);
    int x_owner, y_owner; /* owners are compared, never read */
    hold(1);
    req *a = make_req(0, 1, 1), *x[6], *y;
    submit_ok(s, a);
    wait_in_forward(1);
    for (int i = 0; i < 6; i++) {
        x[i] = make_req(0, 4, 60 + i);
        x[i]->it.owner = &x_owner;
        submit_ok(s, x[i]);
    }
    y = make_req(0, 4, 70);
    y->it.owner = &y_owner;
    submit_ok(s, y);
    hold(0);
    wait_done(8);
    /* [1] [x0 y] [x1 x2] [x3 x4] [x5] */
    CHECK_EQ_INT(fk.n_jobs, 5);
    int64_t want[5] = { 1, 8, 8, 8, 4 };
    for (int i = 0; i < 5 && i < fk.n_jobs; i++) CHECK_EQ_INT(fk.job_T[i], want[i]);
    expect_ok(y);
    CHECK_EQ_INT(y->tm.batch_requests, 2);
    for (int i = 0; i < 6; i++) {
        expect_ok(x[i]);
        CHECK_EQ_INT(x[i]->tm.batch_requests, i == 5 ? 1 : 2);
        free_req(x[i]);
    }
    free_req(y);
    free_req(a);
    moed_sched_destroy(s);

    /* x: 8 then 1, y: 1 then 1. Turns: x's 8 alone (y's 1 does not fit beside it, nor is it let
     * past), then y's 1, x's 1, y's 1. */
    s = start(1, 8, 0, 64);
    hold(1);
    a = make_req(0, 1, 1);
    submit_ok(s, a);
    wait_in_forward(1);
    int64_t T[4] = { 8, 1, 1, 1 };
    req *q[4];
    for (int i = 0; i < 4; i++) {
        q[i] = make_req(0, T[i], 80 + i);
        q[i]->it.owner = i == 0 || i == 2 ? (void *)&x_owner : (void *)&y_owner;
        submit_ok(s, q[i]);
    }
    hold(0);
    wait_done(5);
    CHECK_EQ_INT(fk.n_jobs, 3);
    CHECK_EQ_INT(fk.job_T[1], 8);
    CHECK_EQ_INT(fk.job_T[2], 3);
    for (int i = 0; i < 4; i++) {
        expect_ok(q[i]);
        free_req(q[i]);
    }
    free_req(a);
    moed_sched_destroy(s);

    /* x0 (4), x1 (3), y0 (4), at most 4 tokens a launch; x0 cancelled: x1 takes its turn, before
     * y0. */
    s = start(1, 4, 0, 64);
    hold(1);
    a = make_req(0, 1, 1);
    submit_ok(s, a);
    wait_in_forward(1);
    int64_t T2[3] = { 4, 3, 4 };
    for (int i = 0; i < 3; i++) {
        q[i] = make_req(0, T2[i], 90 + i);
        q[i]->it.owner = i < 2 ? (void *)&x_owner : (void *)&y_owner;
        submit_ok(s, q[i]);
    }
    moed_sched_cancel(s, &q[0]->it);
    CHECK_EQ_INT(q[0]->status, MOED_ECANCELLED);
    hold(0);
    wait_done(4);
    CHECK_EQ_INT(fk.n_jobs, 3);
    CHECK_EQ_INT(fk.job_T[1], 3);
    CHECK_EQ_INT(fk.job_T[2], 4);
    for (int i = 0; i < 3; i++) {
        if (i) expect_ok(q[i]);
        free_req(q[i]);
    }
    free_req(a);
    moed_sched_destroy(s);
}

/* Device routing: a request's expert choice in "device memory" (mem.route) goes to the backend
 * as its part's routing; in a launch that mixes host and device routes, a refused choice fails
 * its request alone (INVALID_ARGUMENT, the backend's message), and the others get what they get
 * alone. On an expert shard the same: the worker renumbers the host routes only, and the device
 * choices reach the backend as they are (it renumbers them where they lie), nothing read to the
 * host. */
static req *make_device_req(int slot, int64_t T, int seed, int32_t bad_id)
{
    req *q = make_req(slot, T, seed);
    moed_route_free(&q->it.route);
    moed_route_init(&q->it.route, T, 0);
    if (bad_id) q->ids[1] = bad_id;
    static moed_part_route routes[16];
    static int n;
    moed_part_route *pr = &routes[n++ % 16];
    *pr = (moed_part_route){ .ids = q->ids, .weights = q->w, .k = 2, .dev = 0 };
    q->it.mem.route = pr;
    q->it.pairs = T * 2;
    return q;
}

/* What the request gets alone: its choice as a host route (in the shard's numbering when given). */
static void expect_choice(req *q, const int32_t *local_of)
{
    moed_route r;
    moed_error err;
    CHECK_EQ_INT(moed_route_from_choice(&r, q->ids, q->w, q->it.T, 2, 8, &err), 0);
    if (local_of) moed_route_localize(&r, local_of);
    CHECK_MSG(q->done && q->status == 0, "status %d: %s", q->status, q->msg);
    if (q->done && !q->status) expect_route(q, &r);
    moed_route_free(&r);
}

static void test_device_routing(void)
{
    for (int sharded = 0; sharded < 2; sharded++) {
        static int32_t local_of[8] = { 0, 1, 2, 3, -1, -1, -1, -1 }, global_of[4] = { 0, 1, 2, 3 };
        moed_shard shards[2] = { { .full = &layers[0], .view = layers[0], .n_held = 8 },
                                 { .full = &layers[1], .view = layers[1], .n_held = 8 } };
        if (sharded) {
            shards[0].local_of = local_of;
            shards[0].global_of = global_of;
            shards[0].n_held = 4;
        }
        fk.local_of[0] = sharded ? local_of : NULL;
        moed_sched *s =
            start_cfg(1, (moed_sched_config){
                             .max_batch_tokens = 64, .max_queue_requests = 64, .shards = shards });
        hold(1);
        req *first = make_req(0, 1, 9);
        submit_ok(s, first);
        wait_in_forward(1);
        req *a = make_req(0, 3, 1), *b = make_device_req(0, 4, 2, 0),
            *c = make_device_req(0, 2, 3, 8), *e = make_device_req(0, 2, 4, 0);
        submit_ok(s, a);
        submit_ok(s, b);
        submit_ok(s, c);
        submit_ok(s, e);
        hold(0);
        wait_done(5);
        pthread_mutex_lock(&fk.m);
        CHECK_EQ_INT(fk.n_jobs, 2);
        CHECK_EQ_INT(fk.job_T[1], 3 + 4 + 2 + 2); /* c runs, and fails alone */
        CHECK_EQ_INT(fk.job_parts[1], 4);
        pthread_mutex_unlock(&fk.m);
        CHECK_EQ_INT(c->status, MOED_EINVAL);
        CHECK_MSG(strstr(c->msg, "expert_ids[0][1]") != NULL, "c: %s", c->msg);
        expect_ok(a);
        expect_choice(b, sharded ? local_of : NULL);
        expect_choice(e, sharded ? local_of : NULL);
        CHECK(b->it.mem.route != NULL); /* never read to the host */
        free_req(first);
        free_req(a);
        free_req(b);
        free_req(c);
        free_req(e);
        moed_sched_destroy(s);
    }
    fk.local_of[0] = NULL;
}

int main(void)
{
    init_layers();
    test_merge();
    test_parts();
    test_max_tokens();
    test_window();
    test_bound_cancel_deadline();
    test_cancel_after_the_deadline();
    test_order_and_keys();
    test_server_router();
    test_copy_in_fails();
    test_batch_gating();
    test_drain();
    test_route_reuse();
    test_spin_then_sleep();
    test_two_slots();
    test_one_launch_per_queue();
    test_min_requests();
    test_exec_placement();
    test_max_pairs();
    test_server_gate_over_pairs();
    test_gone_while_assembling();
    test_flush();
    test_turns();
    test_device_routing();
    return check_status("test_sched");
}
