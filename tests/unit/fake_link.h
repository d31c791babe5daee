/*
 * fake_link.h — a backend with links and no GPU, for server/link.c's tests (test_link_srv) and
 * fuzzer (fuzz_link): the CPU backend's compute behind a table of its own, whose "device memory" is
 * host memory of this process, as tests/fuzz/fuzz_ring.c fakes regions over host buffers.
 *
 * - Device memory: a link's buffer is malloc'd; read_device is memcpy; forward hands the CPU
 *   backend every part as host memory, the parts' device routing read to the host first
 *   (moed_backend_host_route, as the backend's contract says a split layer does).
 * - The communicator: two queues of whole messages. The test plays the caller: fake_join, then
 *   fake_put (caller -> server) and fake_get (server -> caller). A receive takes the next message
 *   and fails (MOED_EUNAVAIL) when its size is not the one posted, as two NCCL ranks out of step
 *   would; abort fails every wait at once, and fake_aborted tells the test it happened.
 *   fake_abort_ms makes each abort take that long first, as NCCL's does with a receive pending
 *   on a peer that died (about a second on H200s).
 * fake_link_backend takes over an opened CPU backend's handle. One translation unit includes this
 * header.
 */
#ifndef MOED_FAKE_LINK_H
#define MOED_FAKE_LINK_H

#include "moed_backend_impl.h"
#include "moed_list.h"
#include "moed_time.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct fake_msg {
    moed_list node;
    size_t n;
    unsigned char data[];
} fake_msg;

typedef struct fake_link {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    moed_list to_server, to_caller; /* of fake_msg.node */
    bool joined, aborted;
    int device;
} fake_link;

#define FAKE_MAX_LINKS 64
/* by creation, NULL once destroyed (a close's own thread destroys: fake_links_lock) */
static fake_link *fake_links[FAKE_MAX_LINKS];
static pthread_mutex_t fake_links_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int fake_abort_ms;
static int fake_n_links;
static const moed_layer *const *fake_layers; /* by slot: the experts a device route is read for */
static moed_backend_ops fake_link_ops_all;
static const moed_backend_ops *fake_cpu_ops;

static uint64_t fake_now_ms(void)
{
    return moed_now_ns() / 1000000u;
}

/* Waits (under f->lock) one step of at most 1 ms. */
static void fake_step(fake_link *f)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&f->cond, &f->lock, &ts);
}

static void fake_push(fake_link *f, moed_list *q, const void *p, size_t n)
{
    fake_msg *m = malloc(sizeof *m + n + 1);
    m->n = n;
    memcpy(m->data, p, n);
    pthread_mutex_lock(&f->lock);
    moed_list_insert_tail(q, &m->node);
    pthread_cond_broadcast(&f->cond);
    pthread_mutex_unlock(&f->lock);
}

static int fake_create(moed_backend *b, moed_backend_link *l,
                       uint8_t unique_id[MOED_NCCL_UNIQUE_ID_BYTES], moed_error *err)
{
    (void)b;
    if (fake_n_links == FAKE_MAX_LINKS) return moed_fail(err, MOED_ENOMEM, "fake: too many links");
    fake_link *f = calloc(1, sizeof *f);
    l->mem = calloc(1, (size_t)l->bytes);
    if (!f || !l->mem) {
        free(f);
        free(l->mem);
        return moed_fail(err, MOED_ENOMEM, "a link's buffer of %llu bytes does not fit",
                         (unsigned long long)l->bytes);
    }
    pthread_mutex_init(&f->lock, NULL);
    pthread_cond_init(&f->cond, NULL);
    moed_list_init(&f->to_server);
    moed_list_init(&f->to_caller);
    f->device = l->device;
    memset(unique_id, 0x5a, MOED_NCCL_UNIQUE_ID_BYTES);
    l->ctx = f;
    pthread_mutex_lock(&fake_links_lock);
    fake_links[fake_n_links++] = f;
    pthread_mutex_unlock(&fake_links_lock);
    return 0;
}

static int fake_wait(moed_backend_link *l, int what, uint64_t offset, uint64_t bytes,
                     int64_t timeout_ms, const _Atomic bool *stop, moed_error *err)
{
    fake_link *f = l->ctx;
    const uint64_t t0 = fake_now_ms();
    int rc = 0;
    if (what == MOED_LINK_WAIT_SEND) {
        fake_push(f, &f->to_caller, (char *)l->mem + offset, (size_t)bytes);
        return f->aborted ? moed_fail(err, MOED_ECANCELLED, "fake: aborted") : 0;
    }
    pthread_mutex_lock(&f->lock);
    for (;;) {
        if (f->aborted) {
            rc = moed_fail(err, MOED_ECANCELLED, "fake: the link was aborted");
            break;
        }
        if (what == MOED_LINK_WAIT_READY && f->joined) break;
        if (what == MOED_LINK_WAIT_RECV && !moed_list_empty(&f->to_server)) {
            fake_msg *m = moed_list_data(moed_list_head(&f->to_server), fake_msg, node);
            moed_list_remove(&m->node);
            if (m->n != bytes)
                rc = moed_fail(err, MOED_EUNAVAIL, "fake: %zu bytes came for a receive of %llu",
                               m->n, (unsigned long long)bytes);
            else
                memcpy((char *)l->mem + offset, m->data, m->n);
            free(m);
            break;
        }
        if (stop && atomic_load(stop)) {
            rc = moed_fail(err, MOED_ECANCELLED, "fake: stopped");
            break;
        }
        if (timeout_ms >= 0 && fake_now_ms() - t0 >= (uint64_t)timeout_ms) {
            rc = moed_fail(err, MOED_EDEADLINE, "fake: nothing came in %lld ms",
                           (long long)timeout_ms);
            break;
        }
        fake_step(f);
    }
    pthread_mutex_unlock(&f->lock);
    return rc;
}

static int fake_copy(moed_backend_link *l, bool to_host, void *host, uint64_t offset, size_t bytes,
                     moed_error *err)
{
    (void)err;
    char *dev = (char *)l->mem + offset;
    memcpy(to_host ? host : dev, to_host ? dev : host, bytes);
    return 0;
}

static void fake_abort(moed_backend_link *l)
{
    fake_link *f = l->ctx;
    const int ms = atomic_load(&fake_abort_ms);
    if (ms) {
        struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&f->lock);
    f->aborted = true;
    pthread_cond_broadcast(&f->cond);
    pthread_mutex_unlock(&f->lock);
}

static void fake_drop(moed_list *q)
{
    while (!moed_list_empty(q)) {
        fake_msg *m = moed_list_data(moed_list_head(q), fake_msg, node);
        moed_list_remove(&m->node);
        free(m);
    }
}

static void fake_destroy(moed_backend_link *l)
{
    fake_link *f = l->ctx;
    pthread_mutex_lock(&fake_links_lock);
    for (int i = 0; i < fake_n_links; i++)
        if (fake_links[i] == f) fake_links[i] = NULL;
    pthread_mutex_unlock(&fake_links_lock);
    fake_drop(&f->to_server);
    fake_drop(&f->to_caller);
    pthread_cond_destroy(&f->cond);
    pthread_mutex_destroy(&f->lock);
    free(f);
    free(l->mem);
}

static const moed_backend_link_ops fake_link_ops = { .create = fake_create,
                                                     .wait = fake_wait,
                                                     .copy = fake_copy,
                                                     .abort = fake_abort,
                                                     .destroy = fake_destroy };

static int fake_read_device(moed_backend *b, void *dst, const void *src, int dev, size_t bytes,
                            moed_error *err)
{
    (void)b, (void)dev, (void)err;
    memcpy(dst, src, bytes);
    return 0;
}

static int fake_device_ordinal(moed_backend *b, int i)
{
    return i >= 0 && i < b->n_devices ? i : MOED_HOST_MEM;
}

/* The CPU backend's forward with every part in host memory and a host route. */
static int fake_forward(moed_backend *b, int exec, const moed_job *job, moed_error *err)
{
    moed_part parts[64];
    moed_route rt;
    if (job->n_parts > 64) return moed_fail(err, MOED_EINVAL, "fake: too many parts");
    const moed_layer *L = fake_layers[job->slot];
    int rc =
        moed_backend_host_route(b, job, moed_layer_router_experts(&L->info), L->local_of, &rt, err);
    if (rc) return rc;
    for (int i = 0; i < job->n_parts; i++) {
        parts[i] = job->parts[i];
        parts[i].x_dev = parts[i].y_dev = MOED_HOST_MEM;
        parts[i].route = NULL;
    }
    moed_job j = *job;
    j.parts = parts;
    j.route = &rt;
    rc = fake_cpu_ops->forward(b, exec, &j, err);
    moed_route_free(&rt);
    return rc;
}

/* Takes over an opened backend's handle (the CPU backend's, or the fuzzer's): the same compute,
 * now with links and its device 0 a "GPU" (0). */
static void fake_link_backend(moed_backend *cpu, const moed_layer *const *layers)
{
    fake_cpu_ops = cpu->ops;
    fake_link_ops_all = *cpu->ops;
    fake_link_ops_all.name = "fake";
    fake_link_ops_all.forward = fake_forward;
    fake_link_ops_all.read_device = fake_read_device;
    fake_link_ops_all.device_ordinal = fake_device_ordinal;
    fake_link_ops_all.links = &fake_link_ops;
    fake_layers = layers;
    cpu->ops = &fake_link_ops_all;
}

/* ---- the caller's side ---- */

static void fake_join(fake_link *f)
{
    pthread_mutex_lock(&f->lock);
    f->joined = true;
    pthread_cond_broadcast(&f->cond);
    pthread_mutex_unlock(&f->lock);
}

static void fake_put(fake_link *f, const void *p, size_t n)
{
    fake_push(f, &f->to_server, p, n);
}

/* The next message to the caller (malloc'd, *n bytes), or NULL after timeout_ms. */
static void *fake_get(fake_link *f, size_t *n, int64_t timeout_ms)
{
    const uint64_t t0 = fake_now_ms();
    void *out = NULL;
    pthread_mutex_lock(&f->lock);
    while (moed_list_empty(&f->to_caller) && fake_now_ms() - t0 < (uint64_t)timeout_ms)
        fake_step(f);
    if (!moed_list_empty(&f->to_caller)) {
        fake_msg *m = moed_list_data(moed_list_head(&f->to_caller), fake_msg, node);
        moed_list_remove(&m->node);
        *n = m->n;
        out = malloc(m->n ? m->n : 1);
        memcpy(out, m->data, m->n);
        free(m);
    }
    pthread_mutex_unlock(&f->lock);
    return out;
}

/* Whether the link was aborted within timeout_ms. */
static inline bool fake_aborted(fake_link *f, int64_t timeout_ms)
{
    const uint64_t t0 = fake_now_ms();
    pthread_mutex_lock(&f->lock);
    while (!f->aborted && fake_now_ms() - t0 < (uint64_t)timeout_ms) fake_step(f);
    bool a = f->aborted;
    pthread_mutex_unlock(&f->lock);
    return a;
}

#endif
