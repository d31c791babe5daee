/*
 * cuda_link — the ops table's link calls (moed_backend.h, "links"): a buffer of device memory, a
 * non-blocking stream and a two-rank NCCL communicator, this process rank 0, created with NCCL's
 * non-blocking config so that nothing here blocks in NCCL: every wait polls the stream and the
 * communicator's asynchronous error, and returns on its timeout, its stop flag or an abort.
 *
 * The link's calls come from its one thread; abort from any. The lock orders them around the
 * communicator: abort stops it under the lock (stop: revoked, or aborted) and clears comm, and
 * every other use of comm takes the lock and finds it either whole or gone, never being freed.
 * A closed link frees nothing while another may have an NCCL operation in flight (cuda_ctx.h,
 * "Links"): a revoked link's resources wait in a grave until no link is live.
 *
 * Once the hello (the link's first send) is done, the communicator is split into a blocking one,
 * which every call uses: on a non-blocking communicator NCCL launches each operation from a thread
 * it starts for it (moed_link.h, "Communicators"). A blocking call only enqueues once both
 * directions are connected (split's first two messages connect them); it would wait on the host
 * only for NCCL's own queue to the GPU, which one call at a time never fills. While those two
 * connect, the blocking calls hold the lock: a caller that stalls inside them (authenticated by
 * then) holds its own link's close until it goes on or its process ends.
 */
#include "cuda_ctx.h"

#include "moed_backoff.h"
#include "moed_link.h"
#include "moed_list.h"
#include "moed_nccl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* A link's two page-locked headers, mapped (NCCL writes the inbox through the mapping), each
 * MOED_LINK_HEADER_BYTES at a multiple of it; node links a closed link's pair into the backend's
 * list for the next link (cuda_ctx.h says why they are not freed). */
typedef struct link_headers {
    union {
        moed_list node;
        uint8_t first[MOED_LINK_HEADER_BYTES];
    } u;
    uint8_t staging[MOED_LINK_HEADER_BYTES];
    uint8_t inbox[MOED_LINK_HEADER_BYTES];
} link_headers;

/* Something put off until no link is live (cuda_ctx.h): a call moed_backend_when_quiet was
 * handed, or a stopped link's grave. */
typedef struct quiet_call {
    moed_list node;
    void (*fn)(void *arg);
    void *arg;
} quiet_call;

/* A stopped link's resources, freed by its call (bury). */
typedef struct link_grave {
    quiet_call call; /* first: freeing the call frees the grave */
    const moed_nccl *nccl;
    moed_nccl_comm split, joined;
    cudaStream_t stream;
    void *mem;
    int device;
} link_grave;

/* The most graves, and calls put off, that wait: past it the oldest runs at once, waiting as a
 * free does (cuda_ctx.h). A grave holds two communicators' connections and a link's buffer; a
 * call, a region's mapping. */
#define MAX_GRAVES      16
#define MAX_QUIET_CALLS 64

typedef struct cuda_link {
    cuda_ctx *c;
    link_headers *headers; /* staging and inbox point into it */
    bool live;             /* counted in c->links_live (until stopped) */
    bool revoked;          /* stopped by revoke: its resources go to a grave */
    const moed_nccl *nccl;
    pthread_mutex_t lock;  /* the communicators, against abort */
    moed_nccl_comm comm;   /* the calls': joined, then split; NULL once aborted */
    moed_nccl_comm joined; /* the non-blocking one the caller joined */
    moed_nccl_comm split;  /* the blocking one split from it (NCCL writes it when done) */
    bool split_tried;      /* the link's thread's: whether the hello went and split ran */
    cudaStream_t stream;
    void *staging; /* page-locked, MOED_LINK_HEADER_BYTES: a header on its way to the device */
    void *inbox;   /* page-locked and mapped, MOED_LINK_HEADER_BYTES: a call's header, from NCCL */
    _Atomic bool aborted;
} cuda_link;

static int aborted(moed_error *err)
{
    return moed_fail(err, MOED_ECANCELLED, "the link was closed (its communicator aborted)");
}

/* The communicator's asynchronous state under the lock: NCCL's result, or -1 once aborted. */
static int async_state(cuda_link *k)
{
    int state = -1;
    pthread_mutex_lock(&k->lock);
    if (k->comm && k->nccl->comm_get_async_error(k->comm, &state) != MOED_NCCL_SUCCESS)
        state = MOED_NCCL_INVALID_ARGUMENT;
    pthread_mutex_unlock(&k->lock);
    return state;
}

/* Polls until the communicator is ready and (with `stream`) the stream's work is done. */
static int wait_done(cuda_link *k, const moed_nccl *n, bool stream, int64_t timeout_ms,
                     const _Atomic bool *stop, const char *what, moed_error *err)
{
    /* a caller's next call comes within a step of its model (moed_backoff.h): an idle link's waits
     * sleep, a busy one's spin */
    moed_backoff b;
    moed_backoff_start(&b);
    const uint64_t until = timeout_ms >= 0 ? b.start_ns + (uint64_t)timeout_ms * 1000000u : 0;
    for (;;) {
        const int state = async_state(k);
        if (state < 0 || atomic_load(&k->aborted)) return aborted(err);
        if (state != MOED_NCCL_SUCCESS && state != MOED_NCCL_IN_PROGRESS)
            return moed_nccl_fail(n, state, what, err);
        if (state == MOED_NCCL_SUCCESS) {
            cudaError_t e = stream ? cudaStreamQuery(k->stream) : cudaSuccess;
            if (e == cudaSuccess) return 0;
            if (e != cudaErrorNotReady) return cuda_fail(err, e, what);
        }
        if (stop && atomic_load(stop))
            return moed_fail(err, MOED_ECANCELLED, "%s: the link is closing", what);
        if (until && moed_now_ns() >= until)
            return moed_fail(err, MOED_EDEADLINE, "%s: nothing came in %lld ms", what,
                             (long long)timeout_ms);
        moed_backoff_pause(&b, until);
    }
}

/* One message of `bytes` at p (the buffer, or the inbox), sent to or received from the caller,
 * waited for as wait_done waits. */
static int xfer(moed_backend_link *l, bool send, void *p, uint64_t bytes, int64_t timeout_ms,
                const _Atomic bool *stop, moed_error *err)
{
    cuda_link *k = l->ctx;
    const moed_nccl *n = k->nccl;
    const char *call = send ? "ncclSend" : "ncclRecv";
    int r = -1;
    cudaError_t e = cudaSetDevice(l->device);
    if (e != cudaSuccess) return cuda_fail(err, e, "cudaSetDevice");
    pthread_mutex_lock(&k->lock);
    if (k->comm)
        r = send ? n->send(p, (size_t)bytes, MOED_NCCL_UINT8, 1, k->comm, k->stream)
                 : n->recv(p, (size_t)bytes, MOED_NCCL_UINT8, 1, k->comm, k->stream);
    pthread_mutex_unlock(&k->lock);
    if (r < 0) return aborted(err);
    if (r != MOED_NCCL_SUCCESS && r != MOED_NCCL_IN_PROGRESS)
        return moed_nccl_fail(n, r, call, err);
    return wait_done(k, n, true, timeout_ms, stop, call, err);
}

/* The blocking communicator the calls use, split from the joined one once the hello went (the
 * caller splits once it received it), with connections of its own: over a split sharing the joined
 * one's, a message's round trip measured 141 us on H200s against 40 us (docs/fleets.md,
 * "Communicators"). Its first two messages connect it both ways while the caller takes part: the
 * hello again, then the caller's answer (header-sized, read into the payload area and ignored). */
static int split(moed_backend_link *l, int64_t timeout_ms, const _Atomic bool *stop,
                 moed_error *err)
{
    cuda_link *k = l->ctx;
    const moed_nccl *n = k->nccl;
    moed_nccl_config cfg = moed_nccl_config_make(1, 0);
    int r = -1;
    k->split_tried = true;
    pthread_mutex_lock(&k->lock);
    if (k->comm) r = n->comm_split(k->comm, 0, 0, &k->split, &cfg);
    pthread_mutex_unlock(&k->lock);
    if (r < 0) return aborted(err);
    if (r != MOED_NCCL_SUCCESS && r != MOED_NCCL_IN_PROGRESS)
        return moed_nccl_fail(n, r, "ncclCommSplit", err);
    int rc = wait_done(k, n, false, timeout_ms, stop, "ncclCommSplit", err);
    if (rc) return rc;
    pthread_mutex_lock(&k->lock);
    if (k->comm && k->split) k->comm = k->split;
    const bool ok = k->comm && k->comm == k->split;
    pthread_mutex_unlock(&k->lock);
    if (!ok) return moed_fail(err, MOED_EDEVICE, "ncclCommSplit gave no communicator");
    char *mem = l->mem;
    rc = xfer(l, true, mem + l->reply_at, MOED_LINK_HEADER_BYTES, timeout_ms, stop, err);
    return rc ? rc : xfer(l, false, mem, MOED_LINK_HEADER_BYTES, timeout_ms, stop, err);
}

static int cuda_link_wait(moed_backend_link *l, int what, uint64_t offset, uint64_t bytes,
                          int64_t timeout_ms, const _Atomic bool *stop, moed_error *err)
{
    cuda_link *k = l->ctx;
    if (what == MOED_LINK_WAIT_READY)
        return wait_done(k, k->nccl, false, timeout_ms, stop, "ncclCommInitRankConfig", err);
    const bool send = what == MOED_LINK_WAIT_SEND;
    int rc = xfer(l, send, (char *)l->mem + offset, bytes, timeout_ms, stop, err);
    if (!rc && send && !k->split_tried) rc = split(l, timeout_ms, stop, err);
    return rc;
}

/* A call's header straight into page-locked host memory (NCCL's kernel writes it there through the
 * mapping; measured on H200s: right bytes, a round trip 37 us against 32 into device memory), so
 * it needs no copy back and no synchronisation on the call's path. */
static int cuda_link_recv_host(moed_backend_link *l, void *dst, size_t bytes, int64_t timeout_ms,
                               const _Atomic bool *stop, moed_error *err)
{
    cuda_link *k = l->ctx;
    int rc = xfer(l, false, k->inbox, bytes, timeout_ms, stop, err);
    if (!rc) memcpy(dst, k->inbox, bytes);
    return rc;
}

static int cuda_link_copy(moed_backend_link *l, bool to_host, void *host, uint64_t offset,
                          size_t bytes, moed_error *err)
{
    cuda_link *k = l->ctx;
    char *dev = (char *)l->mem + offset;
    int rc = 0;
    CU(cudaSetDevice(l->device), "cudaSetDevice");
    if (!to_host && bytes <= MOED_LINK_HEADER_BYTES) {
        /* a reply's header: queued ahead of the send that carries it, which is waited for before
         * the next write reuses the page-locked copy (no synchronisation of its own) */
        memcpy(k->staging, host, bytes);
        CU(cudaMemcpyAsync(dev, k->staging, bytes, cudaMemcpyHostToDevice, k->stream),
           "cudaMemcpyAsync (a link's header)");
        return 0;
    }
    CU(cudaMemcpyAsync(to_host ? host : dev, to_host ? dev : host, bytes,
                       to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, k->stream),
       "cudaMemcpyAsync (a link's header)");
    CU(cudaStreamSynchronize(k->stream), "cudaStreamSynchronize (a link's header)");
err:
    return rc;
}

static void bury(void *arg)
{
    link_grave *g = arg;
    cudaSetDevice(g->device);
    moed_nccl_abort_pair(g->nccl, &g->split, &g->joined);
    if (cudaStreamDestroy(g->stream) != cudaSuccess) cudaGetLastError();
    if (g->mem && cudaFree(g->mem) != cudaSuccess) cudaGetLastError();
}

/* Runs what waits in `list` (graves or calls put off, counted in *n), the oldest first, under
 * c->link_lock, which holds off new links meanwhile; with `oldest`, only the oldest one. */
static void run_waiting(moed_list *list, int *n, bool oldest)
{
    while (!moed_list_empty(list)) {
        moed_list *q = list->prev; /* they go in at the head */
        quiet_call *call = moed_list_data(q, quiet_call, node);
        moed_list_remove(q);
        (*n)--;
        call->fn(call->arg);
        free(call);
        if (oldest) return;
    }
}

void cuda_when_quiet(moed_backend *b, void (*fn)(void *arg), void *arg)
{
    cuda_ctx *c = b->ctx;
    quiet_call *call = malloc(sizeof *call);
    pthread_mutex_lock(&c->link_lock);
    if (c->links_live && call) {
        *call = (quiet_call){ .fn = fn, .arg = arg };
        moed_list_insert_head(&c->quiet_calls, &call->node);
        if (++c->n_quiet_calls > MAX_QUIET_CALLS)
            run_waiting(&c->quiet_calls, &c->n_quiet_calls, true);
    } else {
        fn(arg); /* nothing in flight (or no memory to put it off) */
        free(call);
    }
    pthread_mutex_unlock(&c->link_lock);
}

/* Stops the link's operations in flight, under k->lock. A connected link (its calls on the split
 * communicator) is revoked where NCCL can: its kernels end and nothing is freed, so its
 * communicators can wait for a grave; otherwise, or when the revoke fails or the link's stream
 * has not drained 2 s after it, both communicators are aborted now (which frees). */
static void stop(cuda_link *k)
{
    const moed_nccl *n = k->nccl;
    if (n->comm_revoke && k->split && k->comm == k->split &&
        n->comm_revoke(k->split, 0) == MOED_NCCL_SUCCESS) {
        moed_backoff b;
        moed_backoff_start(&b);
        const uint64_t until = b.start_ns + 2000000000u;
        cudaError_t e;
        while ((e = cudaStreamQuery(k->stream)) == cudaErrorNotReady && moed_now_ns() < until)
            moed_backoff_pause(&b, until);
        k->revoked = e == cudaSuccess;
        if (e != cudaSuccess) cudaGetLastError();
    }
    if (!k->revoked) moed_nccl_abort_pair(n, &k->split, &k->joined);
}

static void cuda_link_abort(moed_backend_link *l)
{
    cuda_link *k = l->ctx;
    pthread_mutex_lock(&k->lock);
    atomic_store(&k->aborted, true);
    const bool was_live = k->live;
    if (k->comm) {
        cudaSetDevice(l->device);
        stop(k);
    }
    k->comm = NULL;
    k->live = false;
    pthread_mutex_unlock(&k->lock);
    if (!was_live) return;
    cuda_ctx *c = k->c;
    pthread_mutex_lock(&c->link_lock);
    if (--c->links_live == 0) {
        run_waiting(&c->link_graves, &c->n_graves, false);
        run_waiting(&c->quiet_calls, &c->n_quiet_calls, false);
    }
    pthread_mutex_unlock(&c->link_lock);
}

/* A pair of headers: a closed link's, or new ones. */
static link_headers *headers_take(cuda_ctx *c)
{
    link_headers *h = NULL;
    pthread_mutex_lock(&c->link_lock);
    if (!moed_list_empty(&c->link_headers)) {
        moed_list *q = moed_list_head(&c->link_headers);
        moed_list_remove(q);
        h = moed_list_data(q, link_headers, u.node);
    }
    pthread_mutex_unlock(&c->link_lock);
    if (!h && cudaHostAlloc((void **)&h, sizeof *h, cudaHostAllocMapped) != cudaSuccess) {
        cudaGetLastError();
        h = NULL;
    }
    return h;
}

static void headers_give(cuda_ctx *c, link_headers *h)
{
    pthread_mutex_lock(&c->link_lock);
    moed_list_insert_head(&c->link_headers, &h->u.node);
    pthread_mutex_unlock(&c->link_lock);
}

void cuda_links_free(cuda_ctx *c)
{
    run_waiting(&c->link_graves, &c->n_graves, false);
    run_waiting(&c->quiet_calls, &c->n_quiet_calls, false);
    while (!moed_list_empty(&c->link_headers)) {
        moed_list *q = moed_list_head(&c->link_headers);
        moed_list_remove(q);
        cudaFreeHost(moed_list_data(q, link_headers, u.node));
    }
}

/* A revoked link's communicators, buffer and stream go to a grave, freed at once when no link is
 * live; an aborted one's are freed here (its abort freed its communicators already). */
static void cuda_link_destroy(moed_backend_link *l)
{
    cuda_link *k = l->ctx;
    if (!k) return;
    cuda_link_abort(l); /* ends whatever the stream still waits for */
    cudaSetDevice(l->device);
    cuda_ctx *c = k->c;
    link_grave *g = k->revoked ? malloc(sizeof *g) : NULL;
    if (g) {
        *g = (link_grave){ .call = { .fn = bury, .arg = g },
                           .nccl = k->nccl,
                           .split = k->split,
                           .joined = k->joined,
                           .stream = k->stream,
                           .mem = l->mem,
                           .device = l->device };
        pthread_mutex_lock(&c->link_lock);
        moed_list_insert_head(&c->link_graves, &g->call.node);
        c->n_graves++;
        if (!c->links_live || c->n_graves > MAX_GRAVES)
            run_waiting(&c->link_graves, &c->n_graves, c->links_live > 0);
        pthread_mutex_unlock(&c->link_lock);
    } else {
        if (k->revoked) moed_nccl_abort_pair(k->nccl, &k->split, &k->joined); /* no memory */
        if (k->stream && cudaStreamSynchronize(k->stream) != cudaSuccess) cudaGetLastError();
        if (k->stream) cudaStreamDestroy(k->stream);
        if (l->mem && cudaFree(l->mem) != cudaSuccess) cudaGetLastError();
    }
    if (k->headers) headers_give(c, k->headers);
    pthread_mutex_destroy(&k->lock);
    free(k);
    l->ctx = NULL;
}

static int cuda_link_create(moed_backend *b, moed_backend_link *l,
                            uint8_t unique_id[MOED_NCCL_UNIQUE_ID_BYTES], moed_error *err)
{
    const moed_nccl *n = moed_nccl_api(err);
    if (!n) return err->code;
    cuda_link *k = calloc(1, sizeof *k);
    if (!k) return moed_fail(err, MOED_ENOMEM, "no memory for a link");
    cuda_ctx *c = k->c = b->ctx;
    k->nccl = n;
    pthread_mutex_lock(&c->link_lock);
    if (!c->links_live) /* nothing in flight now: free what waits */
        run_waiting(&c->link_graves, &c->n_graves, false);
    c->links_live++;
    k->live = true;
    pthread_mutex_unlock(&c->link_lock);
    pthread_mutex_init(&k->lock, NULL);
    l->ctx = k;
    int rc = 0;
    moed_nccl_unique_id id;
    CU(cudaSetDevice(l->device), "cudaSetDevice");
    cudaError_t e = cudaMalloc(&l->mem, (size_t)l->bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        l->mem = NULL;
        rc = moed_fail(err, MOED_ENOMEM,
                       "a link's buffer of %llu bytes does not fit on GPU %d (%s): open it with a "
                       "smaller max_tokens",
                       (unsigned long long)l->bytes, l->device, cudaGetErrorString(e));
        goto err;
    }
    CU(cudaStreamCreateWithFlags(&k->stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    if (!(k->headers = headers_take(k->c))) {
        rc = moed_fail(err, MOED_ENOMEM, "no page-locked memory for a link's headers");
        goto err;
    }
    k->staging = k->headers->staging;
    k->inbox = k->headers->inbox;
    int r = n->get_unique_id(&id);
    if (r != MOED_NCCL_SUCCESS) {
        rc = moed_nccl_fail(n, r, "ncclGetUniqueId", err);
        goto err;
    }
    moed_nccl_config cfg = moed_nccl_config_make(0, MOED_NCCL_UNDEF_INT);
    r = n->comm_init_rank_config(&k->joined, 2, id, 0, &cfg);
    k->comm = k->joined;
    if (r != MOED_NCCL_SUCCESS && r != MOED_NCCL_IN_PROGRESS) {
        k->comm = k->joined = NULL;
        rc = moed_nccl_fail(n, r, "ncclCommInitRankConfig", err);
        goto err;
    }
    memcpy(unique_id, id.internal, sizeof id.internal);
    return 0;
err:
    cuda_link_destroy(l);
    return rc;
}

const moed_backend_link_ops cuda_link_ops = { .create = cuda_link_create,
                                              .wait = cuda_link_wait,
                                              .copy = cuda_link_copy,
                                              .recv_host = cuda_link_recv_host,
                                              .abort = cuda_link_abort,
                                              .destroy = cuda_link_destroy };
