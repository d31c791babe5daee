/*
 * moed_links — the registry of links and each link's thread (link.h states the contract).
 *
 * A link is on lk->links from its opening to its close; whoever takes it off the list (close_link,
 * the session's end, destroy) closes it: sets stop, aborts the communicator (every wait of the
 * thread returns), joins the thread, and disowns the region, whose release destroys the backend's
 * link once no request holds it. The thread never frees the link: it only ends. A command or a
 * session's end (on a completion-queue thread) hands the close to a thread of its own: NCCL's
 * abort of a communicator with a receive pending on a peer that died takes about a second
 * (docs/fleets.md, "Communicators"), which would hold that thread, and with it other clients'
 * calls, as long; destroy waits for every close still running.
 *
 * A call is the doorbell's (doorbell.c, submit): the ring descriptor moed_link_to_ring gives,
 * turned into a request by moed_request_from_ring and validated by moed_request_validate with the
 * link's principal, then submitted; the thread waits for its completion on the link's condition.
 */
#include "link.h"

#include "log.h"
#include "moed_backoff.h"
#include "moed_dtype.h"
#include "moed_list.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#define DEFAULT_WAIT_MS 30000 /* the join and key, a payload after its header, a reply */
#define ELEM_BYTES      4     /* links are sized for float32, the widest dtype a call may send */

typedef struct link link;

struct link {
    moed_list node; /* on lk->links while open */
    moed_links *lk;
    moed_link_info info;
    uint32_t max_tokens, max_top_k;
    moed_principal principal;
    moed_region_session *session; /* NULL once the session ended (draining) */
    moed_backend_link *bl;
    moed_region *region; /* the buffer, adopted */
    pthread_t thread;
    const char *why; /* a close handed to its own thread: the reason it logs */
    _Atomic bool stop;
    /* the call being computed */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    _Atomic bool done; /* set under lock, read without it while the thread spins */
    int status;
    moed_error err;
    moed_timings timings;
    moed_work work;
};

struct moed_links {
    moed_links_config cfg;
    pthread_mutex_t lock; /* the list, drain and the closes running */
    moed_list links;
    uint64_t n_links;
    _Atomic bool draining;
    int closing;         /* closes running on threads of their own */
    pthread_cond_t idle; /* closing came to 0 */
};

/* ---- a call -------------------------------------------------------------------------------------
 */

static int link_principal(void *ctx, moed_principal *out, moed_error *err)
{
    (void)err;
    *out = ((const link *)ctx)->principal;
    return 0;
}

/* The scheduler's answer (on a worker). */
static void call_done(moed_sched_item *it, const moed_sched_result *res)
{
    link *k = it->user;
    pthread_mutex_lock(&k->lock);
    k->status = res->status;
    if (res->status)
        k->err = *res->err;
    else
        k->timings = res->timings;
    atomic_store(&k->done, true);
    pthread_cond_signal(&k->cond);
    pthread_mutex_unlock(&k->lock);
}

/* The header's expectation as a ForwardRequest's (wire.h): the ranges by count and hash, the
 * first few for the message. */
static void expect_of(const moed_link_call *c, moed_wire_expect *x)
{
    x->present = true;
    x->model = c->expect_model;
    x->n_ranges = c->expect_n_ranges;
    x->ranges_hash = c->expect_ranges_hash;
    x->adds_shared = c->expect_adds_shared;
    for (uint32_t i = 0;
         i < c->expect_n_ranges && i < MOED_LINK_SHOWN_RANGES && i < MOED_WIRE_SHOWN_RANGES; i++) {
        x->first[i] = c->expect_first[i];
        x->last[i] = c->expect_last[i];
    }
}

/* Runs the checked call c (its payload in the buffer) as a Forward: 0, or its error in err. */
static int forward(link *k, const moed_link_call *c, uint64_t t0, moed_error *err)
{
    moed_links *lk = k->lk;
    const moed_served *s = lk->cfg.served;
    const moed_caller who = { .local = true, .principal = link_principal, .ctx = k };
    moed_ring_request d;
    moed_wire_request q;
    moed_link_to_ring(c, moed_region_id(k->region), 0, moed_backend_link_reply_at(k->bl), &d);
    memset(&k->work, 0, sizeof k->work);
    memset(&k->timings, 0, sizeof k->timings);
    atomic_store(&k->done, false);
    int rc = moed_request_from_ring(s, &d, &q, err);
    if (!rc && (c->flags & MOED_LINK_EXPECT)) expect_of(c, &q.expect);
    if (!rc) rc = moed_request_validate(s, &who, &q, &k->work, err);
    if (!rc) {
        moed_sched_item *it = &k->work.item;
        it->done = call_done;
        it->user = k;
        it->owner = k; /* a link's calls take turns with other links', rings' and connections' */
        it->t_received_ns = t0;
        it->deadline_ns = c->deadline_us ? t0 + c->deadline_us * 1000ull : 0;
        rc = moed_sched_submit(lk->cfg.sched, it, err);
    }
    if (!rc) {
        /* the caller waits on this answer: spin (moed_backoff.h: a compute thread on this core
         * goes first) while a layer's kernels could run, then sleep on the condition, rather than
         * put a wake-up through it on every call's path */
        moed_backoff b;
        for (moed_backoff_start(&b); !atomic_load(&k->done) && moed_backoff_spinning(&b);)
            moed_backoff_pause(&b, 0);
        pthread_mutex_lock(&k->lock);
        while (!atomic_load(&k->done)) pthread_cond_wait(&k->cond, &k->lock);
        rc = k->status;
        if (rc) *err = k->err;
        pthread_mutex_unlock(&k->lock);
    }
    moed_work_free(&k->work);
    return rc;
}

static int64_t wait_ms(int64_t ms)
{
    return ms ? ms : DEFAULT_WAIT_MS;
}

/* Call `seq`: 0 when it was answered (whatever its status), else why the link ends. */
static int serve_call(link *k, uint64_t seq, moed_error *err)
{
    moed_links *lk = k->lk;
    const int64_t ms = wait_ms(lk->cfg.payload_ms);
    const uint64_t reply_at = moed_backend_link_reply_at(k->bl);
    moed_link_call c;
    int rc = moed_backend_link_recv_header(k->bl, &c, sizeof c, -1, &k->stop, err);
    const uint64_t t_in = moed_now_ns();
    if (!rc)
        rc = moed_link_check_call(&c, seq, k->max_tokens, k->max_top_k, k->info.max_payload_bytes,
                                  err);
    const uint64_t t_head = moed_now_ns();
    if (!rc) rc = moed_backend_link_recv(k->bl, 0, c.payload_bytes, ms, &k->stop, err);
    if (rc) return rc;
    const uint64_t t0 = moed_now_ns();
    moed_error cerr = { 0 };
    int code = atomic_load(&lk->draining)
                   ? moed_fail(&cerr, MOED_EDRAINING,
                               "draining: the server is shutting down and takes no new call; "
                               "open a link to another server")
                   : forward(k, &c, t0, &cerr);
    const int status = moed_err_grpc_status(code);
    moed_link_reply r;
    moed_link_reply_init(&r, seq, status, code ? cerr.msg : "", (uint32_t)k->timings.queue_us,
                         (uint32_t)k->timings.compute_us, k->timings.batch_tokens,
                         k->timings.batch_requests);
    if (code && code != MOED_EDRAINING && moed_log_enabled(MOED_LOG_DEBUG))
        moed_log_debug("link call failed", "link=%016llx seq=%llu tag=%llu status=%d reason=\"%s\"",
                       (unsigned long long)k->info.id, (unsigned long long)seq,
                       (unsigned long long)c.tag, status, cerr.msg);
    const uint64_t n = moed_link_reply_bytes(c.tokens, c.d_model, moed_dtype_size((int)c.dtype));
    const uint64_t t_done = moed_now_ns();
    rc = moed_backend_link_write(k->bl, reply_at, &r, sizeof r, err);
    if (!rc) rc = moed_backend_link_send(k->bl, reply_at, n, ms, &k->stop, err);
    const uint64_t t_sent = moed_now_ns();
    moed_metrics_link(lk->cfg.metrics, status, t_sent - t0);
    /* where a call's time goes on this side (docs/fleets.md, "Metrics and logs") */
    moed_log_debug(
        "link call",
        "link=%016llx seq=%llu tokens=%u status=%d header_us=%llu payload_us=%llu "
        "forward_us=%llu queue_us=%llu compute_us=%llu reply_us=%llu reply_bytes=%llu",
        (unsigned long long)k->info.id, (unsigned long long)seq, c.tokens, status,
        (unsigned long long)((t_head - t_in) / 1000), (unsigned long long)((t0 - t_head) / 1000),
        (unsigned long long)((t_done - t0) / 1000), (unsigned long long)k->timings.queue_us,
        (unsigned long long)k->timings.compute_us, (unsigned long long)((t_sent - t_done) / 1000),
        (unsigned long long)n);
    return rc;
}

/* The caller's join and its key; then a reply of seq 0 (status OK), so that the communicator is
 * connected both ways before the first call: NCCL connects a direction at its first message, with
 * both ranks taking part, and a caller's first call (header, payload and the reply's receive in one
 * group) would otherwise wait on our reply's connection while we wait on its header. */
static int admit(link *k, moed_error *err)
{
    const int64_t ms = wait_ms(k->lk->cfg.join_ms);
    uint8_t key[MOED_LINK_KEY_BYTES];
    int rc = moed_backend_link_ready(k->bl, ms, &k->stop, err);
    if (!rc) rc = moed_backend_link_recv(k->bl, 0, sizeof key, ms, &k->stop, err);
    if (!rc) rc = moed_backend_link_read(k->bl, key, 0, sizeof key, err);
    if (rc) return rc;
    uint8_t diff = 0; /* constant time: how much of a key matched says nothing */
    for (size_t i = 0; i < sizeof key; i++) diff |= key[i] ^ k->info.key[i];
    if (diff)
        return moed_fail(err, MOED_EUNAUTH,
                         "the first message was not the link's key: nothing more is read");
    const uint64_t reply_at = moed_backend_link_reply_at(k->bl);
    moed_link_reply hello;
    moed_link_reply_init(&hello, 0, 0, "", 0, 0, 0, 0);
    rc = moed_backend_link_write(k->bl, reply_at, &hello, sizeof hello, err);
    return rc ? rc : moed_backend_link_send(k->bl, reply_at, sizeof hello, ms, &k->stop, err);
}

static void *link_main(void *arg)
{
    link *k = arg;
    moed_error err = { 0 };
    int rc = admit(k, &err);
    for (uint64_t seq = 1; !rc; seq++) rc = serve_call(k, seq, &err);
    if (!atomic_load(&k->stop)) { /* it ended on its own: the caller's waits fail now */
        moed_log_info("link ended", "link=%016llx reason=\"%s\"", (unsigned long long)k->info.id,
                      err.msg);
        moed_backend_link_abort(k->bl);
    }
    return NULL;
}

/* ---- life cycle ---------------------------------------------------------------------------------
 */

static void release_buffer(void *arg)
{
    moed_backend_link_destroy(arg);
}

/* Closes a link taken off the list (outside lk->lock): see the file comment. */
static void close_link(link *k, const char *why)
{
    atomic_store(&k->stop, true);
    moed_backend_link_abort(k->bl);
    pthread_join(k->thread, NULL);
    moed_log_info("link closed", "link=%016llx reason=\"%s\"", (unsigned long long)k->info.id, why);
    moed_region_disown(k->lk->cfg.served->regions, k->region);
    pthread_cond_destroy(&k->cond);
    pthread_mutex_destroy(&k->lock);
    free(k);
}

static void *closer_main(void *arg)
{
    link *k = arg;
    moed_links *lk = k->lk;
    close_link(k, k->why);
    pthread_mutex_lock(&lk->lock);
    if (--lk->closing == 0) pthread_cond_broadcast(&lk->idle);
    pthread_mutex_unlock(&lk->lock);
    return NULL;
}

/* Closes k (taken off the list) on a thread of its own, or here when none starts. */
static void close_later(link *k, const char *why)
{
    moed_links *lk = k->lk;
    pthread_attr_t attr;
    pthread_t t;
    k->why = why;
    pthread_mutex_lock(&lk->lock);
    lk->closing++;
    pthread_mutex_unlock(&lk->lock);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    const bool started = !pthread_create(&t, &attr, closer_main, k);
    pthread_attr_destroy(&attr);
    if (!started) closer_main(k);
}

int moed_links_create(const moed_links_config *cfg, moed_links **out, moed_error *err)
{
    *out = NULL;
    moed_links *lk = calloc(1, sizeof *lk);
    if (!lk) return moed_fail(err, MOED_ENOMEM, "no memory for the links");
    lk->cfg = *cfg;
    pthread_mutex_init(&lk->lock, NULL);
    pthread_cond_init(&lk->idle, NULL);
    moed_list_init(&lk->links);
    *out = lk;
    return 0;
}

void moed_links_destroy(moed_links *lk)
{
    if (!lk) return;
    while (!moed_list_empty(&lk->links)) {
        link *k = moed_list_data(moed_list_head(&lk->links), link, node);
        moed_list_remove(&k->node);
        close_link(k, "the server exits");
    }
    moed_links_wait_closes(lk);
    pthread_cond_destroy(&lk->idle);
    pthread_mutex_destroy(&lk->lock);
    free(lk);
}

static link *find(moed_links *lk, uint64_t id)
{
    moed_list *q;
    moed_list_foreach (q, &lk->links) {
        link *k = moed_list_data(q, link, node);
        if (k->info.id == id) return k;
    }
    return NULL;
}

/* Whether the principal may open one more link now (under lk->lock). */
static int may_open(moed_links *lk, moed_principal who, moed_error *err)
{
    if (atomic_load(&lk->draining))
        return moed_fail(err, MOED_EDRAINING,
                         "the server is draining (shutting down): it opens no link; open it with "
                         "another server");
    int64_t open = 0;
    moed_list *q;
    moed_list_foreach (q, &lk->links) {
        const link *k = moed_list_data(q, link, node);
        open += k->session && k->principal == who;
    }
    if (open >= lk->cfg.max_links)
        return moed_fail(err, MOED_ETOOBIG,
                         "this principal has %lld NCCL links open, the most --max-links allows: "
                         "close_link one first",
                         (long long)open);
    return 0;
}

/* The GPU (CUDA ordinal) open_link asks for: device_plus_one - 1, or the first served layer's
 * home. A backend without GPUs gets MOED_HOST_MEM: link_create says why it has no links. */
static int pick_device(moed_links *lk, uint32_t device_plus_one, int *out, moed_error *err)
{
    moed_backend *b = lk->cfg.backend;
    moed_layer_place place;
    *out = MOED_HOST_MEM;
    if (moed_backend_device_ordinal(b, 0) == MOED_HOST_MEM) return 0;
    if (!device_plus_one) {
        if (moed_backend_layer_place(b, 0, &place))
            return moed_fail(err, MOED_EINTERNAL, "the first served layer has no placement");
        *out = moed_backend_device_ordinal(b, place.home);
        return 0;
    }
    char gpus[160] = "";
    for (int i = 0; i < moed_backend_n_devices(b); i++) {
        const int g = moed_backend_device_ordinal(b, i);
        if ((uint64_t)g + 1 == device_plus_one) {
            *out = g;
            return 0;
        }
        snprintf(gpus + strlen(gpus), sizeof gpus - strlen(gpus), "%s%d", i ? ", " : "", g);
    }
    return moed_fail(err, MOED_EINVAL,
                     "open_link.device_plus_one = %u names GPU %u, not one this server computes on "
                     "(GPUs %s): give one of them plus one, or 0 for the first layer's",
                     device_plus_one, device_plus_one - 1, gpus);
}

/* The widest served layer's d_model: what a link's buffer is sized for. */
static int widest(const moed_served *s)
{
    int d = 1;
    for (int i = 0; i < s->n_layers; i++)
        if (s->layers[i]->info.d_model > d) d = s->layers[i]->info.d_model;
    return d;
}

static int check_open(moed_links *lk, uint32_t max_tokens, uint32_t max_top_k, moed_error *err)
{
    const int64_t most = lk->cfg.served->max_batch_tokens;
    if (max_tokens < 1 || max_tokens > most)
        return moed_fail(err, MOED_EINVAL,
                         "open_link.max_tokens = %u: give 1 .. %lld (--max-batch-tokens)",
                         max_tokens, (long long)most);
    if (max_top_k < 1 || max_top_k > MOED_LINK_MAX_TOP_K)
        return moed_fail(err, MOED_EINVAL, "open_link.max_top_k = %u: give 1 .. %d", max_top_k,
                         MOED_LINK_MAX_TOP_K);
    return 0;
}

/* A link of session s with its buffer made and adopted; its thread not started. */
static int make_link(moed_links *lk, moed_region_session *s, uint32_t max_tokens,
                     uint32_t max_top_k, int device, link **out, moed_error *err)
{
    uint64_t payload, reply;
    int rc = moed_link_capacity(max_tokens, max_top_k, (uint64_t)widest(lk->cfg.served), ELEM_BYTES,
                                &payload, &reply, err);
    link *k = rc ? NULL : calloc(1, sizeof *k);
    if (!rc && !k) rc = moed_fail(err, MOED_ENOMEM, "no memory for a link");
    if (rc) return rc;
    *k = (link){ .lk = lk,
                 .max_tokens = max_tokens,
                 .max_top_k = max_top_k,
                 .principal = moed_region_session_principal(s),
                 .session = s,
                 .info = { .device = (uint32_t)device, .max_payload_bytes = payload } };
    rc = moed_backend_link_create(lk->cfg.backend, device, payload, reply, k->info.unique_id,
                                  &k->bl, err);
    if (!rc && getrandom(k->info.key, sizeof k->info.key, 0) != sizeof k->info.key)
        rc = moed_fail(err, MOED_EIO, "getrandom failed: %s", strerror(errno));
    if (!rc) {
        k->region =
            moed_regions_adopt(lk->cfg.served->regions, s, moed_backend_link_mem(k->bl),
                               moed_backend_link_bytes(k->bl), device, release_buffer, k->bl, err);
        if (!k->region) rc = err->code;
    }
    if (rc) {
        moed_backend_link_destroy(k->bl);
        free(k);
        return rc;
    }
    moed_error ne;
    const moed_nccl *n = moed_nccl_api(&ne);
    k->info.nccl_version = n ? (uint32_t)n->version : 0;
    pthread_mutex_init(&k->lock, NULL);
    pthread_cond_init(&k->cond, NULL);
    *out = k;
    return 0;
}

int moed_links_open(moed_links *lk, moed_region_session *s, uint32_t max_tokens, uint32_t max_top_k,
                    uint32_t device_plus_one, moed_link_info *out, moed_error *err)
{
    const moed_principal who = moed_region_session_principal(s);
    link *k = NULL;
    int device;
    pthread_mutex_lock(&lk->lock);
    int rc = may_open(lk, who, err);
    pthread_mutex_unlock(&lk->lock);
    if (!rc) rc = check_open(lk, max_tokens, max_top_k, err);
    if (!rc) rc = pick_device(lk, device_plus_one, &device, err);
    if (!rc) rc = make_link(lk, s, max_tokens, max_top_k, device, &k, err);
    if (rc) return rc;
    pthread_mutex_lock(&lk->lock);
    rc = may_open(lk, who, err); /* again, where the link goes on the list */
    if (!rc) {
        do {
            if (getrandom(&k->info.id, sizeof k->info.id, 0) != sizeof k->info.id) k->info.id = 0;
        } while (!k->info.id || find(lk, k->info.id));
        if (pthread_create(&k->thread, NULL, link_main, k))
            rc = moed_fail(err, MOED_EINTERNAL, "could not start a link's thread");
    }
    if (!rc) {
        moed_list_insert_tail(&lk->links, &k->node);
        lk->n_links++;
        *out = k->info;
    }
    pthread_mutex_unlock(&lk->lock);
    if (rc) {
        moed_region_disown(lk->cfg.served->regions, k->region);
        pthread_cond_destroy(&k->cond);
        pthread_mutex_destroy(&k->lock);
        free(k);
        return rc;
    }
    char version[32];
    moed_nccl_version_string((int)out->nccl_version, version, sizeof version);
    moed_log_info("link opened", "link=%016llx device=%u nccl=%s max_tokens=%u max_top_k=%u",
                  (unsigned long long)out->id, out->device, version, max_tokens, max_top_k);
    return 0;
}

/* Takes the link off the list (under lk->lock). */
static void take_off(moed_links *lk, link *k)
{
    moed_list_remove(&k->node);
    lk->n_links--;
}

int moed_links_close(moed_links *lk, moed_region_session *s, uint64_t id, moed_link_info *out,
                     moed_error *err)
{
    pthread_mutex_lock(&lk->lock);
    link *k = find(lk, id);
    if (k && k->session != s) k = NULL;
    if (k) {
        take_off(lk, k);
        *out = k->info;
        memset(out->key, 0, sizeof out->key);
    }
    pthread_mutex_unlock(&lk->lock);
    if (!k)
        return moed_fail(err, MOED_ENOTFOUND,
                         "link %llu is not an open link of this session (a link belongs to the "
                         "Regions stream that opened it)",
                         (unsigned long long)id);
    close_later(k, "close_link");
    return 0;
}

void moed_links_close_session(moed_links *lk, moed_region_session *s)
{
    if (!lk || !s) return;
    moed_list gone, *q, *next;
    moed_list_init(&gone);
    pthread_mutex_lock(&lk->lock);
    for (q = lk->links.next; q != &lk->links; q = next) {
        next = q->next;
        link *k = moed_list_data(q, link, node);
        if (k->session != s) continue;
        k->session = NULL;
        if (atomic_load(&lk->draining)) continue; /* it stays, answering UNAVAILABLE */
        take_off(lk, k);
        moed_list_insert_tail(&gone, &k->node);
    }
    pthread_mutex_unlock(&lk->lock);
    while (!moed_list_empty(&gone)) {
        link *k = moed_list_data(moed_list_head(&gone), link, node);
        moed_list_remove(&k->node);
        close_later(k, "the session ended");
    }
}

void moed_links_wait_closes(moed_links *lk)
{
    if (!lk) return;
    pthread_mutex_lock(&lk->lock);
    while (lk->closing) pthread_cond_wait(&lk->idle, &lk->lock);
    pthread_mutex_unlock(&lk->lock);
}

void moed_links_drain(moed_links *lk)
{
    if (lk) atomic_store(&lk->draining, true);
}

uint64_t moed_links_count(moed_links *lk)
{
    if (!lk) return 0;
    pthread_mutex_lock(&lk->lock);
    uint64_t n = lk->n_links;
    pthread_mutex_unlock(&lk->lock);
    return n;
}
