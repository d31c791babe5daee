/*
 * moedc_ring — the doorbell's caller side (moedclient.h states the contract; common/moed_ring.h
 * is the layout both sides share).
 *
 * Memory: one host region per ring, made here: the ring (header, slots) at offset 0, then one word
 * per slot that only this process and its streams write, `passed`: a stream stores its call's
 * ticket there after it waited for the completion and reset `done` to 0. The region is
 * page-rounded, so all of it can be page-locked for the streams (cuMemHostRegister).
 *
 * Slots: their bookkeeping is this process's, under the ring's mutex. A slot is FREE, HOST (a host
 * call with ticket t: over once `done` == t and its waiter took the completion), STREAM (a stream
 * call with ticket K: over once `passed` == K, which the stream stores only after it reset `done`,
 * so no later call of the slot can have its completion overwritten by that reset), or CAPTURED
 * (K, until released). A slot's tickets follow moed_ring_next_ticket, so no call's ticket equals
 * what `done` still holds from the call before. They start FIRST_TICKET, four calls before they
 * wrap (as Linux starts jiffies minutes before theirs wrap): every ring crosses the wrap in its
 * first calls, so both sides meet it in ordinary use, not after 2^32 calls of a slot.
 *
 * The watchdog, a thread per ring, looks every WATCH_NS whether the ring is still served: `state`
 * not CLOSED and the session's stream not ended. Once not, the ring is dead, and from then on
 * (every DEAD_WATCH_NS, for graphs replayed later) the watchdog completes the caller's calls
 * itself: status UNAVAILABLE, its message, `failures` counted, then `done` = the ticket. A call
 * still rung is claimed first (compare-and-swap of its ticket to 0): a closed ring's server takes
 * no call, so it is never computed too. A call the server took is completed here only once the
 * session ended (its daemon may be gone; a closed ring's live server finishes its calls itself),
 * and once: a stream that had not rung it yet then finds its completion waiting and moves on.
 */
#include "moed_backoff.h"
#include "moed_dtype.h"
#include "moed_ring.h"
#include "moed_time.h"
#include "moedc_common.h"
#include "moedc_cuda.h"
#include "moedc_session.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define WATCH_NS      2000000LL /* how often the watchdog looks at a live ring */
#define DEAD_WATCH_NS 1000000LL /* and answers a dead ring's calls */
#define UNAVAILABLE   14        /* google.rpc.Code */
#define FIRST_TICKET  (UINT32_MAX - 3)

enum { SLOT_FREE, SLOT_HOST, SLOT_STREAM, SLOT_CAPTURED };
enum { ALIVE = 0, CLOSED_BY_SERVER = 1, SESSION_ENDED = 2 }; /* why a ring is dead, worse later */

typedef struct slot_book {
    int state;
    uint32_t ticket; /* of the slot's current or last call */
    bool answered;   /* a dead ring's taken call, completed here already */
    uint64_t t0;     /* a host call: when it was rung (moed_now_ns) */
} slot_book;

struct moedc_ring {
    moedc_session *s;
    moedc_region *region;
    moed_ring_header *h;
    uint32_t *passed; /* [n] */
    uint32_t n;
    uint64_t id;
    pthread_mutex_t mu; /* book, cursor, why */
    slot_book *book;
    uint32_t cursor;
    int dead; /* ALIVE or why not (atomic) */
    char why[200];
    pthread_t watchdog;
    pthread_mutex_t watch_mu;
    pthread_cond_t watch_cv;
    bool stop, watching;
    pthread_mutex_t cuda_mu; /* the region's page-locking and device address */
    void *pinned_ctx;        /* the context that page-locked it; NULL: not yet */
    void *dev_ctx;           /* the context dev_base is valid in */
    moedc_cu_ptr dev_base;
};

static moed_ring_slot *slot_of(const moedc_ring *r, uint32_t i)
{
    return moed_ring_slot_at(r->h, i);
}

/* ---- a call's descriptor ----------------------------------------------------------------------
 */

static int refer(moed_ring_ref *out, const moedc_ref *in, uint64_t len, const char *what,
                 moedc_error *err)
{
    const moedc_region *g = in->region;
    if (!g)
        return moedc_fail(err, MOEDC_EINVAL,
                          "the call's %s names no region: every tensor of a ring call is in a "
                          "registered region",
                          what);
    if (in->offset > g->bytes || len > g->bytes - in->offset)
        return moedc_fail(err, MOEDC_EINVAL,
                          "the call's %s, %llu bytes from offset %llu, runs past its region of %zu "
                          "bytes",
                          what, (unsigned long long)len, (unsigned long long)in->offset, g->bytes);
    *out = (moed_ring_ref){ g->id, in->offset, len };
    return 0;
}

static uint32_t deadline_us(const moedc_ring *r, double timeout_s)
{
    if (timeout_s == 0) timeout_s = moedc_session_timeout(r->s);
    if (!(timeout_s > 0)) return 0;
    double us = timeout_s * 1e6;
    return us >= (double)UINT32_MAX ? UINT32_MAX : us < 1 ? 1 : (uint32_t)us;
}

/* The request half for call (its ticket left 0), or MOEDC_EINVAL saying what is wrong. */
static int describe(const moedc_ring *r, const moedc_ring_call *c, moed_ring_request *q,
                    moedc_error *err)
{
    memset(q, 0, sizeof *q);
    if (!c) return moedc_fail(err, MOEDC_EINVAL, "no call given");
    if (c->dtype != MOEDC_F32 && c->dtype != MOEDC_F16 && c->dtype != MOEDC_BF16)
        return moedc_fail(err, MOEDC_EINVAL, "dtype %d: use MOEDC_F32, MOEDC_F16 or MOEDC_BF16",
                          c->dtype);
    if (c->tokens < 1 || c->tokens > UINT32_MAX || c->d_model < 1 || c->k < 1)
        return moedc_fail(err, MOEDC_EINVAL,
                          "tokens %lld, d_model %lld and k %d must each be at least 1 (tokens at "
                          "most 2^32 - 1)",
                          (long long)c->tokens, (long long)c->d_model, c->k);
    const uint64_t es = moed_dtype_size(c->dtype);
    uint64_t rows, hidden, route;
    if (__builtin_mul_overflow((uint64_t)c->tokens, (uint64_t)c->d_model, &rows) ||
        __builtin_mul_overflow(rows, es, &hidden) ||
        __builtin_mul_overflow((uint64_t)c->tokens, (uint64_t)c->k * 4, &route))
        return moedc_fail(err, MOEDC_EINVAL, "tokens %lld x d_model %lld overflow 64 bits",
                          (long long)c->tokens, (long long)c->d_model);
    int rc = refer(&q->hidden, &c->hidden, hidden, "hidden", err);
    if (!rc) rc = refer(&q->expert_ids, &c->expert_ids, route, "expert_ids", err);
    if (!rc) rc = refer(&q->expert_weights, &c->expert_weights, route, "expert_weights", err);
    if (!rc) rc = refer(&q->output, &c->output, hidden, "output", err);
    q->layer = c->layer;
    q->dtype = (uint32_t)c->dtype;
    q->tokens = (uint32_t)c->tokens;
    q->top_k = (uint32_t)c->k;
    q->deadline_us = deadline_us(r, c->timeout_s);
    q->tag = c->tag;
    return rc;
}

/* Writes the request half of slot i but its ticket, which must be stored after it. */
static void write_request(moedc_ring *r, uint32_t i, const moed_ring_request *q)
{
    const size_t skip = sizeof q->ticket;
    memcpy((char *)&slot_of(r, i)->req + skip, (const char *)q + skip, sizeof *q - skip);
}

/* ---- slots ------------------------------------------------------------------------------------
 */

static bool slot_free(const moedc_ring *r, uint32_t i)
{
    const slot_book *b = &r->book[i];
    return b->state == SLOT_FREE ||
           (b->state == SLOT_STREAM && moed_ring_load(&r->passed[i]) == b->ticket);
}

/* A free slot for a call of kind `state`, its new ticket in *ticket; MOEDC_EFULL or
 * MOEDC_EUNAVAIL otherwise. */
static int take_slot(moedc_ring *r, int state, uint32_t *slot, uint32_t *ticket, moedc_error *err)
{
    pthread_mutex_lock(&r->mu);
    int rc = 0;
    if (__atomic_load_n(&r->dead, __ATOMIC_ACQUIRE)) {
        rc = moedc_fail(err, MOEDC_EUNAVAIL, "%s", r->why);
        goto out;
    }
    for (uint32_t j = 0; j < r->n; j++) {
        uint32_t i = (r->cursor + j) % r->n;
        if (!slot_free(r, i)) continue;
        slot_book *b = &r->book[i];
        b->state = state;
        b->ticket = moed_ring_next_ticket(b->ticket);
        b->answered = false;
        b->t0 = moed_now_ns();
        r->cursor = i + 1;
        *slot = i;
        *ticket = b->ticket;
        goto out;
    }
    rc = moedc_fail(err, MOEDC_EFULL,
                    "all %u slots of the ring hold calls: wait for one (a captured call holds its "
                    "slot until moedc_ring_release), or open the ring with more slots",
                    r->n);
out:
    pthread_mutex_unlock(&r->mu);
    return rc;
}

static void give_back(moedc_ring *r, uint32_t i)
{
    pthread_mutex_lock(&r->mu);
    r->book[i].state = SLOT_FREE;
    pthread_mutex_unlock(&r->mu);
}

/* Whether t is a call of kind `state` in flight on r. */
static int check_ticket(moedc_ring *r, const moedc_ring_ticket *t, int state, const char *what,
                        moedc_error *err)
{
    pthread_mutex_lock(&r->mu);
    bool ok = t && t->slot < r->n && r->book[t->slot].state == state &&
              r->book[t->slot].ticket == t->ticket;
    pthread_mutex_unlock(&r->mu);
    if (ok) return 0;
    return moedc_fail(err, MOEDC_EINVAL,
                      "ticket %u of slot %u is not %s of this ring (already waited for, released, "
                      "or its slot holds another call)",
                      t ? t->ticket : 0, t ? t->slot : 0, what);
}

static void read_result(const moedc_ring *r, uint32_t i, moedc_ring_result *res)
{
    const moed_ring_completion *c = &slot_of(r, i)->done;
    memset(res, 0, sizeof *res);
    res->status = c->status ? moedc_code_from_grpc(c->status) : MOEDC_OK;
    if (c->status) {
        memcpy(res->message, c->message, sizeof res->message);
        res->message[sizeof res->message - 1] = 0;
    }
    res->timings = (moedc_timings){ .queue_us = c->queue_us,
                                    .compute_us = c->compute_us,
                                    .batch_tokens = c->batch_tokens,
                                    .batch_requests = c->batch_requests };
}

/* ---- the watchdog -----------------------------------------------------------------------------
 */

/* Completes call `ticket` of slot i here, as the server would have with UNAVAILABLE. */
static void complete_here(moedc_ring *r, uint32_t i, uint32_t ticket)
{
    moed_ring_completion *c = &slot_of(r, i)->done;
    c->status = UNAVAILABLE;
    c->queue_us = c->compute_us = c->batch_tokens = c->batch_requests = 0;
    snprintf(c->message, sizeof c->message, "%s", r->why);
    __atomic_add_fetch(&c->completions, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&r->h->failures, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&r->h->completed, 1, __ATOMIC_RELAXED);
    moed_ring_store(&c->done, ticket);
}

/* A dead ring: completes the calls in it that no one else will (see the top of the file). */
static void answer(moedc_ring *r, int dead)
{
    pthread_mutex_lock(&r->mu);
    for (uint32_t i = 0; i < r->n; i++) {
        slot_book *b = &r->book[i];
        moed_ring_slot *sl = slot_of(r, i);
        const uint32_t k = b->ticket;
        if (b->state == SLOT_FREE || moed_ring_load(&sl->done.done) == k ||
            (b->state == SLOT_STREAM && moed_ring_load(&r->passed[i]) == k))
            continue;
        uint32_t rung = k;
        if (__atomic_compare_exchange_n(&sl->req.ticket, &rung, 0, false, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            complete_here(r, i, k);
        } else if (dead == SESSION_ENDED && !b->answered) {
            b->answered = true;
            complete_here(r, i, k);
        }
    }
    pthread_mutex_unlock(&r->mu);
}

static void *watch(void *arg)
{
    moedc_ring *r = arg;
    pthread_mutex_lock(&r->watch_mu);
    while (!r->stop) {
        int dead = __atomic_load_n(&r->dead, __ATOMIC_ACQUIRE);
        moedc_watch_wait(&r->watch_cv, &r->watch_mu, dead ? DEAD_WATCH_NS : WATCH_NS);
        if (r->stop) break;
        pthread_mutex_unlock(&r->watch_mu);
        int now = moedc_session_ended(r->s)                          ? SESSION_ENDED
                  : moed_ring_load(&r->h->state) == MOED_RING_CLOSED ? CLOSED_BY_SERVER
                                                                     : ALIVE;
        if (now > dead) {
            pthread_mutex_lock(&r->mu);
            snprintf(r->why, sizeof r->why, "%s",
                     now == SESSION_ENDED
                         ? "the ring's region session ended (the daemon stopped or died, or the "
                           "connection dropped): open a session and a ring again"
                         : "the server closed the ring (its session ended, or the daemon is "
                           "stopping): the call was not made");
            __atomic_store_n(&r->dead, now, __ATOMIC_RELEASE);
            pthread_mutex_unlock(&r->mu);
            dead = now;
        }
        if (dead) answer(r, dead);
        pthread_mutex_lock(&r->watch_mu);
    }
    pthread_mutex_unlock(&r->watch_mu);
    return NULL;
}

/* ---- open and close ---------------------------------------------------------------------------
 */

static uint64_t command_ring(moedc_ring *r, uint64_t unregister, moedc_error *err)
{
    Moed__V1__RegionCommand cmd = MOED__V1__REGION_COMMAND__INIT;
    Moed__V1__RegisterRing reg = MOED__V1__REGISTER_RING__INIT;
    Moed__V1__UnregisterRing unreg = MOED__V1__UNREGISTER_RING__INIT;
    Moed__V1__RegionEvent *ev = NULL;
    if (unregister) {
        unreg.ring = unregister;
        cmd.command_case = MOED__V1__REGION_COMMAND__COMMAND_UNREGISTER_RING;
        cmd.unregister_ring = &unreg;
    } else {
        reg.region = r->region->id;
        reg.offset = 0;
        reg.slots = r->n;
        cmd.command_case = MOED__V1__REGION_COMMAND__COMMAND_REGISTER_RING;
        cmd.register_ring = &reg;
    }
    if (moedc_session_command(r->s, &cmd, &ev, err)) return 0;
    uint64_t id = ev->ring ? ev->ring->id : 0;
    if (!id && !unregister)
        moedc_fail(err, MOEDC_EFORMAT, "the server's answer to register_ring lacks the ring");
    moed__v1__region_event__free_unpacked(ev, NULL);
    return id;
}

/* The process's CUDA driver, when its runtime loaded one already (never loads it here). */
static const moedc_cuda_table *driver_in_use(void)
{
    moedc_error ignored;
    return moedc_cuda_loaded() ? moedc_cuda_streams(&ignored) : NULL;
}

/* Page-locks the region for the streams of ctx's device and every other (PORTABLE), once. */
static int pin(moedc_ring *r, const moedc_cuda_table *cu, void *ctx, moedc_error *err)
{
    if (r->pinned_ctx) return 0;
    int rc = cu->cuMemHostRegister(r->region->ptr, r->region->bytes,
                                   MOEDC_CU_MEMHOSTREGISTER_PORTABLE |
                                       MOEDC_CU_MEMHOSTREGISTER_DEVICEMAP);
    if (rc)
        return moedc_cuda_fail(cu, rc,
                               "cuMemHostRegister of the ring (open the ring with a CUDA context "
                               "current, so it is page-locked before a stream capture begins)",
                               err);
    r->pinned_ctx = ctx;
    return 0;
}

/* The region's address for streams of context ctx, page-locking it first if need be. */
static int device_base(moedc_ring *r, const moedc_cuda_table *cu, void *ctx, moedc_cu_ptr *base,
                       moedc_error *err)
{
    pthread_mutex_lock(&r->cuda_mu);
    int rc = 0;
    if (!r->dev_base || r->dev_ctx != ctx) {
        void *popped;
        if ((rc = cu->cuCtxPushCurrent(ctx))) {
            rc = moedc_cuda_fail(cu, rc, "cuCtxPushCurrent", err);
        } else {
            rc = pin(r, cu, ctx, err);
            moedc_cu_ptr p = 0;
            int drc = rc ? 0 : cu->cuMemHostGetDevicePointer(&p, r->region->ptr, 0);
            if (drc)
                rc = moedc_cuda_fail(cu, drc, "cuMemHostGetDevicePointer", err);
            else if (!rc) {
                r->dev_base = p;
                r->dev_ctx = ctx;
            }
            cu->cuCtxPopCurrent(&popped);
        }
    }
    *base = r->dev_base;
    pthread_mutex_unlock(&r->cuda_mu);
    return rc;
}

int moedc_ring_open(moedc_session *s, uint32_t slots, moedc_ring **out, moedc_error *err)
{
    *out = NULL;
    if (!s) return moedc_fail(err, MOEDC_EINVAL, "no session given");
    if (slots < 1 || slots > MOED_RING_MAX_SLOTS)
        return moedc_fail(err, MOEDC_EINVAL, "a ring has 1 to %d slots, not %u",
                          MOED_RING_MAX_SLOTS, slots);
    moedc_ring *r = calloc(1, sizeof *r);
    if (r) r->book = calloc(slots, sizeof *r->book);
    if (!r || !r->book) {
        if (r) free(r);
        return moedc_fail(err, MOEDC_ENOMEM, "out of memory for a ring of %u slots", slots);
    }
    r->s = s;
    r->n = slots;
    for (uint32_t i = 0; i < slots; i++) r->book[i].ticket = FIRST_TICKET;
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->watch_mu, NULL);
    pthread_mutex_init(&r->cuda_mu, NULL);
    moedc_watch_cond_init(&r->watch_cv);
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t bytes = (size_t)moed_ring_bytes(slots) + (size_t)slots * sizeof *r->passed;
    int rc = moedc_region_create_host(s, (bytes + page - 1) / page * page, 0, &r->region, err);
    if (!rc) {
        r->h = r->region->ptr;
        r->passed = (uint32_t *)((char *)r->region->ptr + moed_ring_bytes(slots));
        *r->h = (moed_ring_header){ .magic = MOED_RING_MAGIC,
                                    .version = MOED_RING_VERSION,
                                    .header_bytes = MOED_RING_HEADER_BYTES,
                                    .slot_bytes = MOED_RING_SLOT_BYTES,
                                    .n_slots = slots };
        r->id = command_ring(r, 0, err);
        if (!r->id) rc = err->code;
    }
    if (!rc && pthread_create(&r->watchdog, NULL, watch, r))
        rc = moedc_fail(err, MOEDC_ENOMEM, "could not start the ring's watchdog thread");
    r->watching = !rc;
    if (!rc) rc = moedc_session_add_ring(s, r, err);
    /* page-locked and addressed now where a context is current, so that a stream call captured
     * first (where registering memory is not allowed) only reads what is known */
    const moedc_cuda_table *cu = rc ? NULL : driver_in_use();
    void *ctx = NULL;
    moedc_cu_ptr base;
    moedc_error ignored; /* a stream call tries again, and says why it cannot */
    if (cu && !cu->cuCtxGetCurrent(&ctx) && ctx) device_base(r, cu, ctx, &base, &ignored);
    if (rc) {
        moedc_session_remove_ring(s, r);
        moedc_ring_close(r);
        return rc;
    }
    *out = r;
    return 0;
}

void moedc_ring_close(moedc_ring *r)
{
    if (!r) return;
    if (r->watching) moedc_watch_stop(&r->watch_mu, &r->watch_cv, &r->stop, r->watchdog);
    moedc_session_remove_ring(r->s, r);
    moedc_error ignored;
    if (r->id) command_ring(r, r->id, &ignored);
    if (r->pinned_ctx) {
        const moedc_cuda_table *cu = moedc_cuda_api(&ignored);
        void *popped;
        bool pushed = !cu->cuCtxPushCurrent(r->pinned_ctx);
        cu->cuMemHostUnregister(r->region->ptr);
        if (pushed) cu->cuCtxPopCurrent(&popped);
    }
    if (r->region) moedc_region_free(r->region, &ignored);
    pthread_cond_destroy(&r->watch_cv);
    pthread_mutex_destroy(&r->cuda_mu);
    pthread_mutex_destroy(&r->watch_mu);
    pthread_mutex_destroy(&r->mu);
    free(r->book);
    free(r);
}

/* ---- host calls -------------------------------------------------------------------------------
 */

int moedc_ring_start(moedc_ring *r, const moedc_ring_call *call, moedc_ring_ticket *t,
                     moedc_error *err)
{
    moed_ring_request q;
    uint32_t i, ticket;
    int rc = describe(r, call, &q, err);
    if (!rc) rc = take_slot(r, SLOT_HOST, &i, &ticket, err);
    if (rc) return rc;
    write_request(r, i, &q);
    moed_ring_store(&slot_of(r, i)->req.ticket, ticket);
    moed_ring_store(&r->h->bell, 1);
    *t = (moedc_ring_ticket){ i, ticket };
    return 0;
}

int moedc_ring_wait(moedc_ring *r, const moedc_ring_ticket *t, double timeout_s,
                    moedc_ring_result *res, moedc_error *err)
{
    int rc = check_ticket(r, t, SLOT_HOST, "a host call in flight", err);
    if (rc) return rc;
    const uint32_t *done = &slot_of(r, t->slot)->done.done;
    moed_backoff b;
    moed_backoff_start(&b);
    const uint64_t until = timeout_s < 0 ? 0 : b.start_ns + (uint64_t)(timeout_s * 1e9);
    while (moed_ring_load(done) != t->ticket) {
        if (until && moed_now_ns() >= until) return 0;
        moed_backoff_pause(&b, until);
    }
    read_result(r, t->slot, res);
    res->timings.total_us = (moed_now_ns() - r->book[t->slot].t0) / 1000;
    give_back(r, t->slot);
    return 1;
}

/* ---- stream calls -----------------------------------------------------------------------------
 */

int moedc_ring_enqueue(moedc_ring *r, const moedc_ring_call *call, void *cuda_stream,
                       moedc_ring_ticket *t, moedc_error *err)
{
    moed_ring_request q;
    const moedc_cuda_table *cu = moedc_cuda_streams(err);
    if (!cu) return err->code;
    int rc = describe(r, call, &q, err);
    if (rc) return rc;
    void *ctx = NULL;
    int capturing = 0;
    moedc_cu_ptr base = 0;
    if ((rc = cu->cuStreamGetCtx(cuda_stream, &ctx)))
        return moedc_cuda_fail(cu, rc, "cuStreamGetCtx", err);
    if ((rc = cu->cuStreamIsCapturing(cuda_stream, &capturing)))
        return moedc_cuda_fail(cu, rc, "cuStreamIsCapturing", err);
    if ((rc = device_base(r, cu, ctx, &base, err))) return rc;
    const bool captured = capturing == MOEDC_CU_STREAM_CAPTURE_ACTIVE;
    uint32_t i, k;
    if ((rc = take_slot(r, captured ? SLOT_CAPTURED : SLOT_STREAM, &i, &k, err))) return rc;
    write_request(r, i, &q);
    const moedc_cu_ptr slot = base + (moedc_cu_ptr)((char *)slot_of(r, i) - (char *)r->h);
    const moedc_cu_ptr ticket = slot + offsetof(moed_ring_slot, req.ticket);
    const moedc_cu_ptr done = slot + offsetof(moed_ring_slot, done.done);
    const moedc_cu_ptr bell = base + offsetof(moed_ring_header, bell);
    const moedc_cu_ptr passed = base + (moedc_cu_ptr)((char *)&r->passed[i] - (char *)r->h);
    /* default flags: a memory barrier orders the stream's earlier work before each write */
    const char *what = "cuStreamWriteValue32 (the ticket)";
    int drc = cu->cuStreamWriteValue32(cuda_stream, ticket, k, 0);
    bool first_in = !drc;
    if (!drc && (what = "cuStreamWriteValue32 (the bell)"))
        drc = cu->cuStreamWriteValue32(cuda_stream, bell, 1, 0);
    if (!drc && (what = "cuStreamWaitValue32 (the completion)"))
        drc = cu->cuStreamWaitValue32(cuda_stream, done, k, MOEDC_CU_STREAM_WAIT_VALUE_EQ);
    if (!drc && (what = "cuStreamWriteValue32 (the completion's reset)"))
        drc = cu->cuStreamWriteValue32(cuda_stream, done, 0, 0);
    if (!drc && !captured && (what = "cuStreamWriteValue32 (the slot's release)"))
        drc = cu->cuStreamWriteValue32(cuda_stream, passed, k, 0);
    if (drc) {
        /* a slot whose ring the stream may still write stays taken */
        if (!first_in || captured) give_back(r, i);
        return moedc_cuda_fail(cu, drc, what, err);
    }
    *t = (moedc_ring_ticket){ i, k };
    return 0;
}

int moedc_ring_stream_result(moedc_ring *r, const moedc_ring_ticket *t, moedc_ring_result *res,
                             moedc_error *err)
{
    pthread_mutex_lock(&r->mu);
    const slot_book *b = t && t->slot < r->n ? &r->book[t->slot] : NULL;
    int rc = b && b->ticket == t->ticket && (b->state == SLOT_STREAM || b->state == SLOT_CAPTURED)
                 ? (b->state == SLOT_CAPTURED || moed_ring_load(&r->passed[t->slot]) == t->ticket)
                 : -1;
    if (rc == 1) read_result(r, t->slot, res);
    pthread_mutex_unlock(&r->mu);
    if (rc >= 0) return rc;
    return moedc_fail(err, MOEDC_EINVAL,
                      "ticket %u of slot %u is not a stream call of this ring (its slot holds "
                      "another call)",
                      t ? t->ticket : 0, t ? t->slot : 0);
}

int moedc_ring_release(moedc_ring *r, const moedc_ring_ticket *t, moedc_error *err)
{
    int rc = check_ticket(r, t, SLOT_CAPTURED, "a captured call", err);
    if (!rc) give_back(r, t->slot);
    return rc;
}

uint32_t moedc_ring_failures(const moedc_ring *r)
{
    return moed_ring_load(&r->h->failures);
}
