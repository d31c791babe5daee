/*
 * moed_doorbell — rings, their registry, and the poller (doorbell.h states the contract).
 *
 * A ring is reference counted: one reference while it is registered (on db->rings), one while the
 * poller looks at it, one per call taken and not yet completed. Closing takes it off the list (no
 * further call is taken) and drops the registry's; whoever drops the last writes CLOSED and lets
 * the region go, so a ring's memory is never written after it is unmapped and a call never
 * outlives its ring. The poller keeps no lock while it touches a ring: it holds a reference.
 *
 * Every access to a ring's memory runs under moed_guard_run, which cannot take a lock or allocate
 * (a fault skips the rest): the poller's pass over one ring takes its calls into per-slot storage
 * allocated at registration, and the calls are validated and submitted after the guarded part.
 * Clearing the bell is an exchange (a full barrier): a ticket the caller stores after the poller
 * looked at its slot comes with a bell the poller sees on its next pass, never one it erased.
 */
#include "doorbell.h"

#include "guard.h"
#include "log.h"
#include "moed_list.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#define SPIN_NS      2000000u /* the poller spins while calls run, and this long after the last */
#define SLEEP_MIN_NS 50000u   /* then sleeps this long, doubling each time up to SLEEP_MAX_NS */
#define SLEEP_MAX_NS 1000000u

typedef struct ring ring;

/* A slot's call: the copy taken, and what it became. */
typedef struct call {
    ring *ring;
    uint32_t slot;
    uint32_t ticket;      /* the one taken: `done` is set to it */
    uint32_t completions; /* calls of this slot completed */
    _Atomic bool busy;    /* taken and not completed: the slot is not looked at */
    uint64_t t_taken_ns;
    moed_ring_request req;
    moed_work work;
} call;

struct ring {
    moed_list node; /* on db->rings while registered */
    moed_doorbell *db;
    uint64_t id, region_id, offset;
    uint32_t n_slots;
    moed_principal principal;
    moed_region_session *session; /* its session's, under db->lock; NULL once the session ended */
    moed_region *region;
    bool unringed;        /* the region no longer counts it (under db->lock) */
    moed_ring_header *h;  /* in the region's memory */
    call *calls;          /* [n_slots] */
    uint32_t *taken;      /* [n_slots]: the slots one pass took */
    uint32_t n_taken;     /* the poller's */
    _Atomic int refs;     /* see the file comment */
    _Atomic bool closed;  /* off the list: no call is taken */
    _Atomic bool rescan;  /* a call completed: its slot may have been rung again meanwhile */
    _Atomic bool faulted; /* its memory faulted: nothing more is written there */
};

struct moed_doorbell {
    moed_doorbell_config cfg;
    pthread_mutex_t lock; /* the list, sessions, drain and stop */
    pthread_cond_t wake;  /* the poller's sleep; and the drain's wait for it */
    moed_list rings;      /* of ring.node */
    uint64_t n_rings;
    int drain; /* 0; 1 asked; 2 the calls rung before it are taken and the rings say DRAINING */
    _Atomic int64_t running;       /* calls taken and not completed */
    _Atomic uint64_t last_done_ns; /* when the latest call completed */
    bool stop;
    bool started;
    pthread_t thread;
};

/* ---- ring memory, guarded ------------------------------------------------------------------ */

static moed_ring_slot *slot_of(const ring *r, uint32_t i)
{
    return moed_ring_slot_at(r->h, i);
}

typedef struct store_args {
    uint32_t *word, value;
} store_args;

static void store_word(void *arg)
{
    store_args *a = arg;
    moed_ring_store(a->word, a->value);
}

/* Lets the ring go after its memory faulted: marks the region broken, takes no more calls. */
static void ring_fault(ring *r);

static void ring_set_state(ring *r, uint32_t state)
{
    store_args a = { &r->h->state, state };
    if (!atomic_load(&r->faulted) && moed_guard_run(store_word, &a)) ring_fault(r);
}

/* ---- life cycle ------------------------------------------------------------------------------ */

static void ring_ref(ring *r)
{
    atomic_fetch_add(&r->refs, 1);
}

static void ring_unref(ring *r)
{
    if (atomic_fetch_sub(&r->refs, 1) != 1) return;
    ring_set_state(r, MOED_RING_CLOSED);
    moed_region_release(r->db->cfg.served->regions, r->region);
    free(r->calls);
    free(r->taken);
    free(r);
}

/* The ring's session no longer has it (under db->lock): the region may be unregistered. */
static void detach(moed_doorbell *db, ring *r)
{
    r->session = NULL;
    if (!r->unringed) moed_region_unring(db->cfg.served->regions, r->region);
    r->unringed = true;
}

/* Takes the ring off the list (under db->lock); true when it was on it, and the caller drops the
 * registry's reference (outside the lock). */
static bool take_off(moed_doorbell *db, ring *r)
{
    detach(db, r);
    if (atomic_exchange(&r->closed, true)) return false;
    moed_list_remove(&r->node);
    db->n_rings--;
    return true;
}

static void ring_fault(ring *r)
{
    moed_doorbell *db = r->db;
    moed_error err;
    if (atomic_exchange(&r->faulted, true)) return;
    moed_region_broken(r->region, &err);
    moed_log_debug("ring closed", "ring=%016llx reason=\"%s\"", (unsigned long long)r->id, err.msg);
    pthread_mutex_lock(&db->lock);
    bool listed = take_off(db, r);
    pthread_mutex_unlock(&db->lock);
    if (listed) ring_unref(r);
}

/* ---- completions ----------------------------------------------------------------------------- */

typedef struct complete_args {
    ring *r;
    call *c;
    const moed_ring_completion *done;
    bool failed;
} complete_args;

/* Everything of the completion but `done`, the header's counts, then `done` (release). */
static void write_completion(void *arg)
{
    complete_args *a = arg;
    moed_ring_completion *out = &slot_of(a->r, a->c->slot)->done;
    const size_t skip = offsetof(moed_ring_completion, status);
    memcpy((char *)out + skip, (const char *)a->done + skip, sizeof *out - skip);
    __atomic_fetch_add(&a->r->h->completed, 1, __ATOMIC_RELAXED);
    if (a->failed) __atomic_fetch_add(&a->r->h->failures, 1, __ATOMIC_RELAXED);
    moed_ring_store(&out->done, a->done->done);
}

/* The call's outcome into its slot (status 0, or a MOED_E* code and err); the call is over. */
static void complete(call *c, int code, const moed_error *err, const moed_sched_result *res)
{
    ring *r = c->ring;
    moed_doorbell *db = r->db;
    const int status = moed_err_grpc_status(code);
    moed_ring_completion done = { .done = c->ticket,
                                  .status = status,
                                  .completions = ++c->completions };
    if (res) {
        done.queue_us = (uint32_t)res->timings.queue_us;
        done.compute_us = (uint32_t)res->timings.compute_us;
        done.batch_tokens = res->timings.batch_tokens;
        done.batch_requests = res->timings.batch_requests;
    }
    if (code) memcpy(done.message, err->msg, strnlen(err->msg, sizeof done.message - 1));
    complete_args a = { r, c, &done, code != 0 };
    if (!atomic_load(&r->faulted) && moed_guard_run(write_completion, &a)) ring_fault(r);
    moed_metrics_doorbell(db->cfg.metrics, status, moed_now_ns() - c->t_taken_ns);
    if (code && code != MOED_EDRAINING && moed_log_enabled(MOED_LOG_DEBUG))
        moed_log_debug("doorbell call failed",
                       "ring=%016llx slot=%u tag=%llu code=%d status=%d reason=\"%s\"",
                       (unsigned long long)r->id, c->slot, (unsigned long long)c->req.tag, code,
                       status, err->msg);
    moed_work_free(&c->work);
    atomic_store(&c->busy, false);
    atomic_store(&r->rescan, true);
    atomic_store(&db->last_done_ns, moed_now_ns());
    atomic_fetch_sub(&db->running, 1);
    ring_unref(r); /* the call's */
}

/* The scheduler's answer (on a worker). */
static void call_done(moed_sched_item *it, const moed_sched_result *res)
{
    call *c = it->user;
    moed_error err = { 0 };
    grpc_slice data;
    const moed_wire_ref *ref;
    int rc = res->status;
    if (!rc && !(rc = moed_work_output(&c->work, res->y, res->y_bytes, &data, &ref, &err)))
        grpc_slice_unref(data);
    complete(c, rc, res->status ? res->err : &err, rc ? NULL : res);
}

/* ---- taking calls ---------------------------------------------------------------------------- */

static int ring_principal(void *ctx, moed_principal *out, moed_error *err)
{
    (void)err;
    *out = ((const ring *)ctx)->principal;
    return 0;
}

/* Validates a taken call and queues it, or completes it with its error (or, draining, with
 * UNAVAILABLE). */
static void submit(moed_doorbell *db, ring *r, call *c, bool draining)
{
    const moed_served *s = db->cfg.served;
    const moed_caller who = { .local = true, .principal = ring_principal, .ctx = r };
    moed_error err = { 0 };
    moed_wire_request q;
    int rc;
    ring_ref(r); /* the call's */
    atomic_fetch_add(&db->running, 1);
    c->t_taken_ns = moed_now_ns();
    memset(&c->work, 0, sizeof c->work);
    if (draining)
        rc = moed_fail(&err, MOED_EDRAINING,
                       "the server is draining (shutting down): it takes no new call; ring another "
                       "server's doorbell");
    else if (!(rc = moed_request_from_ring(s, &c->req, &q, &err)) &&
             !(rc = moed_request_validate(s, &who, &q, &c->work, &err))) {
        moed_sched_item *it = &c->work.item;
        it->done = call_done;
        it->user = c;
        it->owner = r; /* a ring's calls take turns with other rings' and connections' */
        it->t_received_ns = c->t_taken_ns;
        it->deadline_ns = c->req.deadline_us ? c->t_taken_ns + c->req.deadline_us * 1000ull : 0;
        rc = moed_sched_submit(db->cfg.sched, it, &err);
    }
    if (rc) complete(c, rc, &err, NULL);
}

/* One pass over a ring, guarded: when its bell is set (or a call of it completed), the calls rung
 * in its slots are copied and their tickets cleared; r->taken lists them. */
static void take_calls(void *arg)
{
    ring *r = arg;
    const bool rescan = atomic_exchange(&r->rescan, false);
    if (!moed_ring_load(&r->h->bell) && !rescan) return;
    __atomic_exchange_n(&r->h->bell, 0, __ATOMIC_SEQ_CST);
    for (uint32_t i = 0; i < r->n_slots && !atomic_load(&r->closed); i++) {
        call *c = &r->calls[i];
        moed_ring_slot *sl = slot_of(r, i);
        uint32_t t;
        if (atomic_load(&c->busy) || !(t = moed_ring_load(&sl->req.ticket))) continue;
        memcpy(&c->req, &sl->req, sizeof c->req);
        moed_ring_store(&sl->req.ticket, 0);
        c->ticket = t;
        atomic_store(&c->busy, true);
        r->taken[r->n_taken++] = i;
    }
}

/* The poller's look at one ring; the number of calls taken. */
static int poll_ring(moed_doorbell *db, ring *r, bool draining)
{
    r->n_taken = 0;
    if (atomic_load(&r->faulted)) return 0;
    if (moed_guard_run(take_calls, r)) {
        for (uint32_t i = 0; i < r->n_taken; i++) atomic_store(&r->calls[r->taken[i]].busy, false);
        ring_fault(r);
        return 0;
    }
    for (uint32_t i = 0; i < r->n_taken; i++) submit(db, r, &r->calls[r->taken[i]], draining);
    return (int)r->n_taken;
}

static void *poller_main(void *arg)
{
    moed_doorbell *db = arg;
    ring **held = NULL;
    size_t cap = 0;
    uint64_t last_call = moed_now_ns(), sleep_ns = SLEEP_MIN_NS;
    pthread_mutex_lock(&db->lock);
    while (!db->stop) {
        const int drain = db->drain;
        if (db->n_rings > cap) {
            ring **h = realloc(held, db->n_rings * sizeof *h);
            if (h) {
                held = h;
                cap = db->n_rings;
            }
        }
        size_t n = 0;
        moed_list *q;
        moed_list_foreach (q, &db->rings) {
            if (n == cap) break; /* out of memory: the others wait for the next pass */
            held[n] = moed_list_data(q, ring, node);
            ring_ref(held[n++]);
        }
        pthread_mutex_unlock(&db->lock);
        int taken = 0;
        for (size_t i = 0; i < n; i++) taken += poll_ring(db, held[i], drain == 2);
        for (size_t i = 0; i < n; i++) {
            if (drain == 1) ring_set_state(held[i], MOED_RING_DRAINING);
            ring_unref(held[i]);
        }
        const uint64_t done = atomic_load(&db->last_done_ns), now = moed_now_ns();
        if (taken) last_call = now;
        if (done > last_call) last_call = done;
        /* A caller rings again as soon as its call completes: the poller is there while calls
         * run, not asleep in a step of its backoff. */
        const bool busy = atomic_load(&db->running) > 0 || now - last_call < SPIN_NS;
        if (busy) sleep_ns = SLEEP_MIN_NS;
        pthread_mutex_lock(&db->lock);
        if (drain == 1) {
            db->drain = 2;
            pthread_cond_broadcast(&db->wake);
        }
        if (db->stop || db->drain == 1) continue;
        if (busy) {
            /* Spinning, but a thread that wants this core (the CPU backend's compute, the
             * caller's) gets it first. */
            pthread_mutex_unlock(&db->lock);
            sched_yield();
            pthread_mutex_lock(&db->lock);
            continue;
        }
        const uint64_t at = now + sleep_ns;
        struct timespec ts = { (time_t)(at / 1000000000u), (long)(at % 1000000000u) };
        pthread_cond_timedwait(&db->wake, &db->lock, &ts);
        if (sleep_ns < SLEEP_MAX_NS) sleep_ns *= 2;
    }
    pthread_mutex_unlock(&db->lock);
    free(held);
    return NULL;
}

/* ---- the registry ---------------------------------------------------------------------------- */

int moed_doorbell_create(const moed_doorbell_config *cfg, moed_doorbell **out, moed_error *err)
{
    *out = NULL;
    moed_doorbell *db = calloc(1, sizeof *db);
    if (!db) return moed_fail(err, MOED_ENOMEM, "no memory for the doorbell");
    db->cfg = *cfg;
    moed_list_init(&db->rings);
    pthread_mutex_init(&db->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&db->wake, &ca);
    pthread_condattr_destroy(&ca);
    if (cfg->sched && pthread_create(&db->thread, NULL, poller_main, db)) {
        moed_doorbell_destroy(db);
        return moed_fail(err, MOED_EINTERNAL, "could not start the doorbell's poller thread");
    }
    db->started = cfg->sched != NULL;
    *out = db;
    return 0;
}

void moed_doorbell_destroy(moed_doorbell *db)
{
    if (!db) return;
    pthread_mutex_lock(&db->lock);
    db->stop = true;
    pthread_cond_broadcast(&db->wake);
    pthread_mutex_unlock(&db->lock);
    if (db->started) pthread_join(db->thread, NULL);
    while (!moed_list_empty(&db->rings)) {
        ring *r = moed_list_data(moed_list_head(&db->rings), ring, node);
        take_off(db, r);
        ring_unref(r);
    }
    pthread_cond_destroy(&db->wake);
    pthread_mutex_destroy(&db->lock);
    free(db);
}

static ring *find(moed_doorbell *db, uint64_t id)
{
    moed_list *q;
    moed_list_foreach (q, &db->rings) {
        ring *r = moed_list_data(q, ring, node);
        if (r->id == id) return r;
    }
    return NULL;
}

static void info_of(const ring *r, moed_ring_info *out)
{
    *out = (moed_ring_info){ r->id, r->region_id, r->offset, r->n_slots };
}

/* The server's fields of a new ring: its header's counts and every slot's completion at 0, SERVING
 * last. */
static void reset_ring(void *arg)
{
    ring *r = arg;
    r->h->failures = 0;
    r->h->completed = 0;
    for (uint32_t i = 0; i < r->n_slots; i++)
        memset(&slot_of(r, i)->done, 0, sizeof(moed_ring_completion));
    moed_ring_store(&r->h->state, MOED_RING_SERVING);
}

/* Checks where the ring is to lie and its header; *h its place in the region's memory. */
static int place_ring(moed_region *g, void *mem, uint64_t bytes, uint64_t offset, uint32_t slots,
                      moed_ring_header **h, moed_error *err)
{
    moed_ring_header copy;
    if (offset % MOED_RING_ALIGN)
        return moed_fail(err, MOED_EINVAL,
                         "register_ring.offset = %llu is not a multiple of %d: a ring's header "
                         "starts on a cache line",
                         (unsigned long long)offset, MOED_RING_ALIGN);
    if (offset > bytes || bytes - offset < MOED_RING_HEADER_BYTES)
        return moed_fail(err, MOED_EINVAL,
                         "register_ring.offset = %llu leaves no room for a ring's %d-byte header "
                         "in the region's %llu bytes",
                         (unsigned long long)offset, MOED_RING_HEADER_BYTES,
                         (unsigned long long)bytes);
    *h = (moed_ring_header *)((char *)mem + offset);
    if (moed_guard_copy(&copy, *h, sizeof copy)) return moed_region_broken(g, err);
    return moed_ring_check_header(&copy, slots, bytes - offset, err);
}

/* The principal's open rings (under db->lock). */
static int64_t rings_of(moed_doorbell *db, moed_principal who)
{
    int64_t n = 0;
    moed_list *q;
    moed_list_foreach (q, &db->rings) {
        const ring *r = moed_list_data(q, ring, node);
        n += r->session && r->principal == who;
    }
    return n;
}

/* Whether the principal may open one more ring now (under db->lock). */
static int may_open(moed_doorbell *db, moed_principal who, moed_error *err)
{
    if (db->drain)
        return moed_fail(err, MOED_EDRAINING,
                         "the server is draining (shutting down): it opens no ring; register it "
                         "with another server");
    const int64_t open = rings_of(db, who);
    if (open >= db->cfg.max_rings)
        return moed_fail(err, MOED_ETOOBIG,
                         "this principal has %lld doorbell rings open, the most --max-rings "
                         "allows: unregister_ring one first",
                         (long long)open);
    return 0;
}

/* A ring of `slots` slots in g at h, holding g, with nothing taken yet; NULL when out of memory. */
static ring *ring_new(moed_doorbell *db, moed_region_session *s, moed_region *g,
                      moed_ring_header *h, uint64_t region, uint64_t offset, uint32_t slots)
{
    ring *r = calloc(1, sizeof *r);
    call *calls = calloc(slots, sizeof *calls);
    uint32_t *taken = calloc(slots, sizeof *taken);
    if (!r || !calls || !taken) {
        free(r);
        free(calls);
        free(taken);
        return NULL;
    }
    *r = (ring){ .db = db,
                 .region_id = region,
                 .offset = offset,
                 .n_slots = slots,
                 .principal = moed_region_session_principal(s),
                 .session = s,
                 .region = g,
                 .h = h,
                 .calls = calls,
                 .taken = taken,
                 .refs = 1 };
    for (uint32_t i = 0; i < slots; i++) calls[i] = (call){ .ring = r, .slot = i };
    return r;
}

int moed_doorbell_register(moed_doorbell *db, moed_region_session *s, uint64_t region,
                           uint64_t offset, uint32_t slots, moed_ring_info *out, moed_error *err)
{
    moed_regions *regions = db->cfg.served->regions;
    void *mem;
    uint64_t bytes;
    moed_ring_header *h;
    moed_region *g = moed_regions_hold_ring(regions, s, region, &mem, &bytes, err);
    if (!g) return err->code;
    int rc = place_ring(g, mem, bytes, offset, slots, &h, err);
    if (!rc) { /* checked again below, where the ring goes on the list */
        pthread_mutex_lock(&db->lock);
        rc = may_open(db, moed_region_session_principal(s), err);
        pthread_mutex_unlock(&db->lock);
    }
    ring *r = rc ? NULL : ring_new(db, s, g, h, region, offset, slots);
    if (!rc && !r) rc = moed_fail(err, MOED_ENOMEM, "no memory for a ring of %u slots", slots);
    if (!r) {
        moed_region_unring(regions, g);
        moed_region_release(regions, g);
        return rc;
    }
    if (moed_guard_run(reset_ring, r)) rc = moed_region_broken(g, err);
    pthread_mutex_lock(&db->lock);
    if (!rc) rc = may_open(db, r->principal, err);
    if (!rc) {
        do {
            if (getrandom(&r->id, sizeof r->id, 0) != sizeof r->id) r->id = 0;
        } while (!r->id || find(db, r->id));
        moed_list_insert_tail(&db->rings, &r->node);
        db->n_rings++;
        info_of(r, out);
        pthread_cond_broadcast(&db->wake); /* the poller looks at it at once */
    } else {
        detach(db, r);
        atomic_store(&r->closed, true);
    }
    pthread_mutex_unlock(&db->lock);
    if (rc) ring_unref(r); /* CLOSED over SERVING, and the region let go */
    return rc;
}

int moed_doorbell_unregister(moed_doorbell *db, moed_region_session *s, uint64_t id,
                             moed_ring_info *out, moed_error *err)
{
    pthread_mutex_lock(&db->lock);
    ring *r = find(db, id);
    if (r && r->session != s) r = NULL;
    bool listed = false;
    if (r) {
        info_of(r, out);
        listed = take_off(db, r);
    }
    pthread_mutex_unlock(&db->lock);
    if (!r)
        return moed_fail(err, MOED_ENOTFOUND,
                         "ring %llu is not an open ring of this session (a ring belongs to the "
                         "Regions stream that registered it)",
                         (unsigned long long)id);
    if (listed) ring_unref(r);
    return 0;
}

void moed_doorbell_close_session(moed_doorbell *db, moed_region_session *s)
{
    if (!db || !s) return;
    moed_list gone, *q, *next;
    moed_list_init(&gone);
    pthread_mutex_lock(&db->lock);
    for (q = db->rings.next; q != &db->rings; q = next) {
        next = q->next;
        ring *r = moed_list_data(q, ring, node);
        if (r->session != s) continue;
        if (db->drain) { /* it stays, answering UNAVAILABLE, until the exit */
            detach(db, r);
        } else if (take_off(db, r)) {
            moed_list_insert_tail(&gone, &r->node);
        }
    }
    pthread_mutex_unlock(&db->lock);
    while (!moed_list_empty(&gone)) {
        ring *r = moed_list_data(moed_list_head(&gone), ring, node);
        moed_list_remove(&r->node);
        ring_unref(r);
    }
}

void moed_doorbell_drain(moed_doorbell *db)
{
    if (!db) return;
    pthread_mutex_lock(&db->lock);
    if (!db->drain) db->drain = db->started ? 1 : 2;
    pthread_cond_broadcast(&db->wake);
    while (db->drain == 1) pthread_cond_wait(&db->wake, &db->lock);
    pthread_mutex_unlock(&db->lock);
}

uint64_t moed_doorbell_rings(moed_doorbell *db)
{
    if (!db) return 0;
    pthread_mutex_lock(&db->lock);
    uint64_t n = db->n_rings;
    pthread_mutex_unlock(&db->lock);
    return n;
}

int64_t moed_doorbell_max_rings(const moed_doorbell *db)
{
    return db ? db->cfg.max_rings : 0;
}
