/*
 * moedc_link — links: Forwards over NCCL (moedclient.h states the contract; common/moed_link.h is
 * the call layout both sides share, moed.proto's OpenLink the protocol).
 *
 * A link is one daemon's: a region session of its own (the link closes with it, so dropping a link
 * is aborting its communicator and closing its session), the communicator joined as rank 1, and
 * its buffers on the caller's device: the call header, the payload, the reply (moed_link_capacity
 * for the widest layer in float32, the widest dtype), and page-locked host copies of the key (the
 * link's first message) and of the reply's header with the link's call counter. Links are kept by
 * daemon (its moedc), so a daemon serving several layers has one; each layer remembers which link
 * serves each of its shards.
 *
 * A call, ordered on the caller's stream: for a fleet that sends each shard only its tokens
 * (moedc_links_opts.send), the expert choices copied to the host (the plan needs them:
 * moedc_plan_rows, the gRPC fleet's own rule); each shard's rows gathered into its payload (one
 * gather kernel for its three tensors), its header stamped with the link's next seq by a counter
 * on the device (moedc_link_stamp, which zeroes its reply's header too), its header and payload
 * sent, the slowest shard's first (send_in_turn); then every reply's receive; the combine kernel
 * (moedc_link_sum.h, the parts by value), which writes the output only when every reply arrived and
 * is OK and counts the call in the failures otherwise; each reply's header and its link's counter
 * copied back. A fleet's parts run on their links' own streams, forked from the caller's stream by
 * an event and joined back before the combine: NCCL's kernels of different communicators on one
 * stream run one after another, so one stream would send to the shards in turn and wait for each
 * reply in turn (on four H200s, three shards' T = 4096 calls spent 1.4 ms so, docs/fleets.md
 * "Measured"); one daemon's call stays on the caller's stream. Then the call's watch polls the
 * stream and each communicator until the stream is done, an NCCL error shows, or the time is up; a
 * link that did not answer is aborted (its kernels then end, freeing the stream) and dropped, to be
 * linked again by a later call.
 *
 * A call made while its stream is being captured is the same work, recorded: every shard gets
 * every token (no host read), nothing is waited for, and the replays carry no host state (seq on
 * the device, the parts in the combine's parameters). Its links are marked captured: the
 * links' watchdog thread aborts one whose daemon's session ended (its kernels end, so a replay
 * finishes, counted in the failures), an abort that NCCL completes only once the graphs holding it
 * are destroyed, so it runs on a thread of its own (joined by close), and a dropped captured link's
 * buffers are kept until close, for graphs may still use them.
 *
 * The kernels are link_kernels.cu compiled to PTX at build time (MOEDC_HAVE_LINK_PTX; a build
 * without nvcc has none and refuses links), loaded on the first join.
 */
#include "moedc_common.h"
#include "moedc_cuda.h"
#include "moedc_impl.h"
#include "moedc_link_sum.h"
#include "moedc_session.h"

#include "moed_backoff.h"
#include "moed_dtype.h"
#include "moed_link.h"
#include "moed_nccl.h"
#include "moed_time.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef MOEDC_HAVE_LINK_PTX
extern const unsigned char moedc_link_ptx[]; /* NUL-terminated, as cuModuleLoadData reads it */
#endif

#define DEFAULT_TIMEOUT_S 30.0
#define DRAIN_S           10.0      /* after aborting, how long the caller's stream gets to drain */
#define WATCH_NS          2000000LL /* how often the watchdog looks at captured links' sessions */
#define SEQ_AT            MOED_LINK_HEADER_BYTES /* the call counter, after the header */
#define THREADS           256
#define GRID_ROWS         1024 /* a gather's or combine's rows of blocks: rows beyond stride */

typedef struct link {
    moedc *daemon;
    const char *name;
    moedc_session *s;
    moed_nccl_comm comm;   /* the calls': joined, then split (NULL once aborted) */
    moed_nccl_comm joined; /* the non-blocking one, joined with a timeout */
    moed_nccl_comm split;  /* the blocking one split from it once connected (moed_nccl.h) */
    uint64_t max_payload, payload_cap, reply_cap;
    moedc_cu_ptr d_head; /* a call's header, then (SEQ_AT) the link's call counter */
    moedc_cu_ptr d_payload, d_reply;
    moed_link_call *h_head;   /* the key on its way to d_head (the link's first message) */
    moed_link_reply *h_reply; /* a reply's header, then (SEQ_AT) a copy of the counter */
    void *stream, *done;      /* its part of a fleet's call, and the event that joins it back */
    uint32_t compute_us;      /* its daemon's compute in its last reply: the slowest sends first */
    bool captured;            /* a call over it was captured: graphs may hold its buffers */
} link;

typedef struct layer_links {
    int layer;
    moedc_layout lay;
    link **by_shard; /* NULL: not linked (yet, or any more) */
} layer_links;

struct moedc_links {
    moedc *c;
    moedc_links_opts o;
    const moed_nccl *nccl;
    const moedc_cuda_table *cu; /* once a link joined */
    void *module, *k_gather, *k_stamp, *k_combine;
    moedc_cu_ptr d_failures; /* calls whose output the combine did not write */
    void *forked;            /* where a fleet's call leaves the caller's stream */
    void *watch; /* a stream of ours: the key's send, and replies read while the caller's waits */
    pthread_mutex_t mu;
    link **links;
    int n_links;
    layer_links *layers;
    int n_layers;
    uint32_t d_model; /* the widest layer's */
    int32_t *h_ids;   /* page-locked [max_tokens * max_top_k] */
    float *h_w;
    unsigned char *h_index; /* a call's parts, row lists and row maps, and their device copy */
    moedc_cu_ptr d_index;
    size_t index_cap;
    bool watching, stopping; /* the watchdog (started by the first captured call) */
    pthread_t watchdog;
    pthread_cond_t wake;
    pthread_t *aborters; /* aborting captured links' communicators; joined by close */
    int n_aborters;
    link **retired; /* dropped captured links: their buffers, freed by close */
    int n_retired;
    char line[512];
};

static size_t round_up(size_t x)
{
    return (x + MOED_LINK_ALIGN - 1) / MOED_LINK_ALIGN * MOED_LINK_ALIGN;
}

static int from_moed(const moed_error *e, moedc_error *err)
{
    return moedc_fail(err, e->code, "%s", e->msg);
}

static int nccl_fail(const moedc_links *L, const link *k, int result, const char *call,
                     moedc_error *err)
{
    moed_error e;
    moed_nccl_fail(L->nccl, result, call, &e);
    return moedc_fail(err, e.code, "daemon %s: %s", k->name, e.msg);
}

/* ---- links ---- */

typedef struct aborting {
    const moed_nccl *nccl;
    moed_nccl_comm split, joined;
} aborting;

static void *abort_main(void *arg)
{
    aborting *a = arg;
    moed_nccl_abort_pair(a->nccl, &a->split, &a->joined);
    free(a);
    return NULL;
}

/* Aborts k's communicators (moed_nccl_abort_pair: whatever the peer does, its kernels end): at
 * once, or for a captured link on a thread of its own, NCCL waiting there for the graphs that hold
 * the communicator (their kernels end at once all the same). */
static void link_abort(moedc_links *L, link *k)
{
    aborting *a = k->captured && (k->split || k->joined) ? malloc(sizeof *a) : NULL;
    pthread_t *grown = a ? realloc(L->aborters, sizeof *grown * (size_t)(L->n_aborters + 1)) : NULL;
    if (grown) L->aborters = grown;
    if (a && grown) {
        *a = (aborting){ L->nccl, k->split, k->joined };
        if (!pthread_create(&L->aborters[L->n_aborters], NULL, abort_main, a)) {
            L->n_aborters++;
            k->split = k->joined = k->comm = NULL;
            return;
        }
    }
    free(a);
    moed_nccl_abort_pair(L->nccl, &k->split, &k->joined);
    k->comm = NULL;
}

static void link_buffers_free(moedc_links *L, link *k)
{
    const moedc_cuda_table *cu = L->cu;
    if (cu) {
        if (k->d_head) cu->cuMemFree(k->d_head);
        if (k->d_payload) cu->cuMemFree(k->d_payload);
        if (k->d_reply) cu->cuMemFree(k->d_reply);
        if (k->h_head) cu->cuMemFreeHost(k->h_head);
        if (k->h_reply) cu->cuMemFreeHost(k->h_reply);
        if (k->stream) cu->cuStreamDestroy(k->stream);
        if (k->done) cu->cuEventDestroy(k->done);
    }
    free(k);
}

/* Aborts k, closes its session (the server closes the link with it) and frees it, or retires it
 * until close when graphs may still use its buffers. */
static void link_free(moedc_links *L, link *k)
{
    if (!k) return;
    link_abort(L, k);
    moedc_session_close(k->s);
    k->s = NULL;
    if (!k->captured) {
        link_buffers_free(L, k);
        return;
    }
    link **grown = realloc(L->retired, sizeof *grown * (size_t)(L->n_retired + 1));
    if (!grown) return; /* kept all the same (lost to close): a graph may still use it */
    L->retired = grown;
    L->retired[L->n_retired++] = k;
}

/* Polls k's communicator until its operation in progress is done (0), fails, or `until` passes. */
static int settle(moedc_links *L, link *k, double until, const char *what, moedc_error *err)
{
    moed_backoff b;
    moed_backoff_start(&b);
    for (;;) {
        int async = 0, r = L->nccl->comm_get_async_error(k->comm, &async);
        if (r) return nccl_fail(L, k, r, "ncclCommGetAsyncError", err);
        if (async == MOED_NCCL_SUCCESS) return 0;
        if (async != MOED_NCCL_IN_PROGRESS) return nccl_fail(L, k, async, what, err);
        if (moed_now_s() > until)
            return moedc_fail(err, MOEDC_EUNAVAIL, "daemon %s: %s not done within %.0f s", k->name,
                              what, L->o.timeout_s);
        moed_backoff_pause(&b, 0);
    }
}

/* Waits for work NCCL queued on our stream `watch` for k: first for NCCL to have queued it (with
 * the non-blocking config an NCCL call may return before its kernels are on the stream, which
 * until then looks idle), then for the stream. */
static int drain_watch(moedc_links *L, link *k, double until, const char *what, moedc_error *err)
{
    int rc = settle(L, k, until, what, err);
    moed_backoff b;
    for (moed_backoff_start(&b); !rc;) {
        int q = L->cu->cuStreamQuery(L->watch);
        if (q == 0) return 0;
        if (q != MOEDC_CU_ERROR_NOT_READY) return moedc_cuda_fail(L->cu, q, what, err);
        if ((rc = settle(L, k, until, what, err))) break;
        if (moed_now_s() > until)
            return moedc_fail(err, MOEDC_EUNAVAIL, "daemon %s: %s not done within %.0f s", k->name,
                              what, L->o.timeout_s);
        moed_backoff_pause(&b, 0);
    }
    return rc;
}

/* The caller's device current on this thread (the driver loaded the first time), until leave. */
static int enter(moedc_links *L, moedc_error *err)
{
    if (!L->cu && !(L->cu = moedc_cuda_api(err))) return err->code;
    return moedc_cuda_enter(L->cu, L->o.device, err);
}

static void leave(moedc_links *L)
{
    moedc_cuda_leave(L->cu, L->o.device);
}

/* The kernels, on the first join (the caller's device current). */
static int load_kernels(moedc_links *L, moedc_error *err)
{
#ifdef MOEDC_HAVE_LINK_PTX
    if (L->k_combine) return 0;
    const moedc_cuda_table *cu = L->cu;
    int rc = cu->cuModuleLoadData(&L->module, moedc_link_ptx);
    if (rc) return moedc_cuda_fail(cu, rc, "cuModuleLoadData (the link kernels' PTX)", err);
    if ((rc = cu->cuModuleGetFunction(&L->k_gather, L->module, "moedc_link_gather")) ||
        (rc = cu->cuModuleGetFunction(&L->k_stamp, L->module, "moedc_link_stamp")) ||
        (rc = cu->cuModuleGetFunction(&L->k_combine, L->module, "moedc_link_combine")))
        return moedc_cuda_fail(cu, rc, "cuModuleGetFunction", err);
    const uint64_t zero = 0;
    if ((rc = cu->cuMemAlloc(&L->d_failures, sizeof zero)) ||
        (rc = cu->cuMemcpyHtoD(L->d_failures, &zero, sizeof zero)))
        return moedc_cuda_fail(cu, rc, "allocating the links' failure count", err);
    if ((rc = cu->cuStreamCreate(&L->watch, MOEDC_CU_STREAM_NON_BLOCKING)))
        return moedc_cuda_fail(cu, rc, "cuStreamCreate", err);
    if ((rc = cu->cuEventCreate(&L->forked, MOEDC_CU_EVENT_DISABLE_TIMING)))
        return moedc_cuda_fail(cu, rc, "cuEventCreate", err);
    return 0;
#else
    (void)L;
    return moedc_fail(err, MOEDC_EUNSUPPORTED,
                      "libmoedclient was built without nvcc, so it has no link kernels: rebuild it "
                      "where the CUDA toolkit is installed to use links");
#endif
}

static int alloc_buffers(moedc_links *L, link *k, moedc_error *err)
{
    const moedc_cuda_table *cu = L->cu;
    int rc = moed_link_capacity(L->o.max_tokens, L->o.max_top_k, L->d_model, 4, &k->payload_cap,
                                &k->reply_cap, &(moed_error){ 0 });
    if (rc)
        return moedc_fail(err, MOEDC_EINVAL,
                          "links of %u tokens, top_k %u and d_model %u are too large to lay out",
                          L->o.max_tokens, L->o.max_top_k, L->d_model);
    const char *what = "cuMemAlloc (a link's header)";
    const uint64_t zero = 0; /* the hello was seq 0: the first call is 1 */
    if (!(rc = cu->cuMemAlloc(&k->d_head, SEQ_AT + sizeof zero)) &&
        (what = "cuMemcpyHtoD (a link's call counter)") &&
        !(rc = cu->cuMemcpyHtoD(k->d_head + SEQ_AT, &zero, sizeof zero)) &&
        (what = "cuMemAlloc (a link's payload)") &&
        !(rc = cu->cuMemAlloc(&k->d_payload, k->payload_cap)) &&
        (what = "cuMemAlloc (a link's reply)") &&
        !(rc = cu->cuMemAlloc(&k->d_reply, k->reply_cap)) && (what = "cuMemHostAlloc") &&
        !(rc = cu->cuMemHostAlloc((void **)&k->h_head, MOED_LINK_HEADER_BYTES, 0)) &&
        !(rc = cu->cuMemHostAlloc((void **)&k->h_reply, SEQ_AT + sizeof(uint64_t), 0)) &&
        (what = "cuStreamCreate (a link's stream)") &&
        !(rc = cu->cuStreamCreate(&k->stream, MOEDC_CU_STREAM_NON_BLOCKING)) &&
        (what = "cuEventCreate (a link's join)"))
        rc = cu->cuEventCreate(&k->done, MOEDC_CU_EVENT_DISABLE_TIMING);
    return rc ? moedc_cuda_fail(cu, rc, what, err) : 0;
}

/* Joins the communicator the daemon made, and sends it the key (the caller's device current: NCCL
 * takes the current device for its rank). */
static int join(moedc_links *L, link *k, const moedc_link_grant *g, moedc_error *err)
{
    const double until = moed_now_s() + L->o.timeout_s;
    moed_nccl_unique_id id;
    memcpy(id.internal, g->unique_id, sizeof id.internal);
    moed_nccl_config cfg = moed_nccl_config_make(0, MOED_NCCL_UNDEF_INT);
    int r = L->nccl->comm_init_rank_config(&k->joined, 2, id, 1, &cfg);
    k->comm = k->joined;
    if (r && r != MOED_NCCL_IN_PROGRESS) {
        k->comm = k->joined = NULL;
        return nccl_fail(L, k, r, "ncclCommInitRankConfig", err);
    }
    int rc = settle(L, k, until, "joining the link (ncclCommInitRankConfig)", err);
    if (rc) return rc;
    memcpy(k->h_head, g->key, MOED_LINK_KEY_BYTES); /* NCCL sends device memory */
    if ((rc = L->cu->cuMemcpyHtoDAsync(k->d_head, k->h_head, MOED_LINK_KEY_BYTES, L->watch)))
        return moedc_cuda_fail(L->cu, rc, "cuMemcpyHtoDAsync (the link's key)", err);
    r = L->nccl->send((const void *)(uintptr_t)k->d_head, MOED_LINK_KEY_BYTES, MOED_NCCL_UINT8, 0,
                      k->comm, L->watch);
    if (r && r != MOED_NCCL_IN_PROGRESS) return nccl_fail(L, k, r, "ncclSend (the key)", err);
    if ((rc = drain_watch(L, k, until, "sending the link's key", err))) return rc;
    /* the daemon's reply of seq 0 connects its direction now, not inside the first call's group
     * (moed_link.h) */
    r = L->nccl->recv((void *)(uintptr_t)k->d_reply, MOED_LINK_HEADER_BYTES, MOED_NCCL_UINT8, 0,
                      k->comm, L->watch);
    if (r && r != MOED_NCCL_IN_PROGRESS) return nccl_fail(L, k, r, "ncclRecv (the hello)", err);
    if ((rc = drain_watch(L, k, until, "receiving the link's hello", err))) return rc;
    if ((rc = L->cu->cuMemcpyDtoH(k->h_reply, k->d_reply, MOED_LINK_HEADER_BYTES)))
        return moedc_cuda_fail(L->cu, rc, "cuMemcpyDtoH (the link's hello)", err);
    if (!moed_link_reply_matches(k->h_reply, 0) || k->h_reply->status)
        return moedc_fail(err, MOEDC_EFORMAT,
                          "daemon %s: its first message on the link is not the "
                          "reply of seq 0 the link's layout begins with",
                          k->name);
    /* the daemon splits now too, and connects the split communicator both ways with its first
     * two messages: the hello again, and our answer (moed_link.h, "Communicators") */
    cfg = moed_nccl_config_make(1, 0);
    r = L->nccl->comm_split(k->comm, 0, 1, &k->split, &cfg);
    if (r && r != MOED_NCCL_IN_PROGRESS) return nccl_fail(L, k, r, "ncclCommSplit", err);
    if ((rc = settle(L, k, until, "splitting the link's communicator (ncclCommSplit)", err)))
        return rc;
    if (!k->split)
        return moedc_fail(err, MOEDC_EINTERNAL, "daemon %s: ncclCommSplit gave no communicator",
                          k->name);
    k->comm = k->split;
    r = L->nccl->recv((void *)(uintptr_t)k->d_reply, MOED_LINK_HEADER_BYTES, MOED_NCCL_UINT8, 0,
                      k->comm, L->watch);
    if (r) return nccl_fail(L, k, r, "ncclRecv (the hello, split)", err);
    if ((rc = drain_watch(L, k, until, "receiving the split link's hello", err))) return rc;
    r = L->nccl->send((const void *)(uintptr_t)k->d_head, MOED_LINK_HEADER_BYTES, MOED_NCCL_UINT8,
                      0, k->comm, L->watch);
    if (r) return nccl_fail(L, k, r, "ncclSend (the answer to the hello, split)", err);
    return drain_watch(L, k, until, "answering the split link's hello", err);
}

/* A link to daemon `name` (session, open_link, join), or the daemon's refusal naming it. The CUDA
 * driver is needed only after the daemon granted the link, so a daemon that cannot serve links
 * says so itself, on any machine. */
static int link_open(moedc_links *L, moedc *daemon, const char *name, link **out, moedc_error *err)
{
    link *k = calloc(1, sizeof *k);
    if (!k) return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a link");
    k->daemon = daemon;
    k->name = name;
    Moed__V1__OpenLink ol = MOED__V1__OPEN_LINK__INIT;
    Moed__V1__RegionCommand cmd = MOED__V1__REGION_COMMAND__INIT;
    Moed__V1__RegionEvent *ev = NULL;
    ol.max_tokens = L->o.max_tokens;
    ol.max_top_k = L->o.max_top_k;
    cmd.command_case = MOED__V1__REGION_COMMAND__COMMAND_OPEN_LINK;
    cmd.open_link = &ol;
    moedc_link_grant g;
    moedc_error e;
    int rc = moedc_session_open(daemon, &k->s, &e);
    if (!rc) rc = moedc_session_command(k->s, &cmd, &ev, &e);
    if (!rc) rc = moedc_decode_link(ev->link, &g, &e);
    if (ev) moed__v1__region_event__free_unpacked(ev, NULL);
    if (!rc && !moed_nccl_versions_match(g.nccl_version, L->nccl->version)) {
        char theirs[32], ours[32];
        moed_nccl_version_string((int)g.nccl_version, theirs, sizeof theirs);
        moed_nccl_version_string(L->nccl->version, ours, sizeof ours);
        rc =
            moedc_fail(&e, MOEDC_EUNSUPPORTED,
                       "its NCCL is %s and this process's %s (%s): one communicator needs the same "
                       "major.minor on both sides; install a matching NCCL or set MOED_NCCL_LIB",
                       theirs, ours, L->nccl->path);
    }
    const bool entered = !rc && !(rc = enter(L, &e));
    if (!rc) rc = load_kernels(L, &e);
    if (!rc) rc = alloc_buffers(L, k, &e);
    if (!rc) rc = join(L, k, &g, &e);
    k->max_payload = g.max_payload_bytes;
    if (entered) leave(L);
    if (rc) {
        link_free(L, k);
        return moedc_fail(err, rc, "daemon %s: %s", name, e.msg);
    }
    *out = k;
    return 0;
}

/* Drops link k (aborted, its session closed) from L and from every layer it served. */
static void link_drop(moedc_links *L, link *k)
{
    for (int i = 0; i < L->n_layers; i++)
        for (int s = 0; s < L->layers[i].lay.plan.n_shards; s++)
            if (L->layers[i].by_shard[s] == k) L->layers[i].by_shard[s] = NULL;
    for (int i = 0; i < L->n_links; i++)
        if (L->links[i] == k) L->links[i] = L->links[--L->n_links];
    link_free(L, k);
}

/* The experts of a shard, "0-3,6" (and " + shared"), for messages: the planner's own text. */
static void experts_text(const moedc_layer_info *li, char *buf, size_t n)
{
    moedc_plan_ranges_text(li->held, li->n_held, buf, n);
    const size_t used = strlen(buf);
    if (li->adds_shared && li->n_shared > 0 && used < n)
        snprintf(buf + used, n - used, " + shared");
}

/* Shard s of ll linked: its link still open, else a replica's (one linked already first, then
 * each in turn); MOEDC_EUNAVAIL (a single daemon: its own failure) naming each and why. */
static int link_shard(moedc_links *L, layer_links *ll, int s, moedc_error *err)
{
    if (ll->by_shard[s]) return 0;
    const moedc_shard *sh = &ll->lay.plan.shards[s];
    for (int r = 0; r < sh->n_replicas; r++)
        for (int i = 0; i < L->n_links; i++)
            if (L->links[i]->daemon == ll->lay.daemons[sh->replicas[r]]) {
                ll->by_shard[s] = L->links[i];
                return 0;
            }
    char why[sizeof err->msg] = "";
    size_t used = 0;
    int rc = MOEDC_EUNAVAIL;
    for (int r = 0; r < sh->n_replicas; r++) {
        const int d = sh->replicas[r];
        link *k = NULL;
        moedc_error e;
        link **grown = realloc(L->links, sizeof *grown * (size_t)(L->n_links + 1));
        if (!grown) return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a link");
        L->links = grown;
        rc = link_open(L, ll->lay.daemons[d], ll->lay.names[d], &k, &e);
        if (!rc) {
            L->links[L->n_links++] = k;
            ll->by_shard[s] = k;
            return 0;
        }
        if (used < sizeof why)
            used +=
                (size_t)snprintf(why + used, sizeof why - used, "%s%s", used ? "; " : "", e.msg);
    }
    if (sh->n_replicas == 1) return moedc_fail(err, rc, "%s", why);
    char experts[96];
    experts_text(sh->li, experts, sizeof experts);
    return moedc_fail(err, MOEDC_EUNAVAIL, "layer %d, experts %s: no daemon could be linked: %s",
                      ll->layer, experts, why);
}

/* One daemon's layout: a single shard, c itself (what the fleet's planner gives a layer of one). */
static int single_layout(moedc *c, int layer, moedc_layout *out, moedc_error *err)
{
    memset(out, 0, sizeof *out);
    moedc_model_info info;
    int rc = moedc_info(c, &info, err);
    if (rc) return rc;
    const moedc_layer_info *li = NULL;
    for (int i = 0; i < info.n_layers; i++)
        if (info.layers[i].index == layer) li = &info.layers[i];
    int replica = 0;
    moedc_shard one = { .li = li, .replicas = &replica, .n_replicas = 1 };
    moedc_layer_plan pl = { .layer = layer, .shards = &one, .n_shards = 1 };
    out->daemons = malloc(sizeof *out->daemons);
    out->names = malloc(sizeof *out->names);
    if (!li)
        rc = moedc_fail(err, MOEDC_ENOTFOUND, "daemon %s serves no layer %d", c->name, layer);
    else if (!out->daemons || !out->names)
        rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory planning a link call");
    else
        rc = moedc_plan_copy(&pl, &out->plan, err);
    out->fingerprint = info.model_fingerprint;
    moedc_model_info_free(&info);
    if (rc) {
        moedc_layout_free(out);
        return rc;
    }
    out->daemons[0] = c;
    out->names[0] = c->name;
    out->n_daemons = 1;
    return 0;
}

/* Layer `layer` as L knows it: planned (the first time) and every shard linked. */
static int layer_of(moedc_links *L, int layer, layer_links **out, moedc_error *err)
{
    layer_links *ll = NULL;
    for (int i = 0; i < L->n_layers && !ll; i++)
        if (L->layers[i].layer == layer) ll = &L->layers[i];
    if (!ll) {
        layer_links *grown = realloc(L->layers, sizeof *grown * (size_t)(L->n_layers + 1));
        if (!grown) return moedc_fail(err, MOEDC_ENOMEM, "out of memory planning a link call");
        L->layers = grown;
        layer_links fresh = { .layer = layer };
        int rc = L->c->ops->layout ? L->c->ops->layout(L->c, layer, &fresh.lay, err)
                                   : single_layout(L->c, layer, &fresh.lay, err);
        if (rc) return rc;
        fresh.by_shard = calloc((size_t)fresh.lay.plan.n_shards, sizeof *fresh.by_shard);
        if (!fresh.by_shard) {
            moedc_layout_free(&fresh.lay);
            return moedc_fail(err, MOEDC_ENOMEM, "out of memory planning a link call");
        }
        ll = &L->layers[L->n_layers++];
        *ll = fresh;
    }
    *out = ll;
    return 0;
}

static void describe(moedc_links *L)
{
    char v[32];
    moed_nccl_version_string(L->nccl->version, v, sizeof v);
    size_t used =
        (size_t)snprintf(L->line, sizeof L->line, "nccl %s: %d link%s (daemon%s ", v, L->n_links,
                         L->n_links == 1 ? "" : "s", L->n_links == 1 ? "" : "s");
    for (int i = 0; i < L->n_links && used < sizeof L->line; i++)
        used += (size_t)snprintf(L->line + used, sizeof L->line - used, "%s%s", i ? ", " : "",
                                 L->links[i]->name);
    if (used < sizeof L->line) snprintf(L->line + used, sizeof L->line - used, ")");
}

/* ---- open and close ---- */

void moedc_links_close(moedc_links *L)
{
    if (!L) return;
    if (L->watching) moedc_watch_stop(&L->mu, &L->wake, &L->stopping, L->watchdog);
    moedc_error ignored;
    const bool entered = L->cu && !enter(L, &ignored);
    while (L->n_links) link_drop(L, L->links[0]);
    /* NCCL frees a captured link's communicators once the graphs holding them are destroyed, and
     * only then may their buffers go (moedclient.h: destroy them before closing) */
    for (int i = 0; i < L->n_aborters; i++) pthread_join(L->aborters[i], NULL);
    for (int i = 0; i < L->n_retired; i++) link_buffers_free(L, L->retired[i]);
    for (int i = 0; i < L->n_layers; i++) {
        moedc_layout_free(&L->layers[i].lay);
        free(L->layers[i].by_shard);
    }
    if (L->cu) {
        if (L->h_ids) L->cu->cuMemFreeHost(L->h_ids);
        if (L->h_w) L->cu->cuMemFreeHost(L->h_w);
        if (L->h_index) L->cu->cuMemFreeHost(L->h_index);
        if (L->d_index) L->cu->cuMemFree(L->d_index);
        if (L->d_failures) L->cu->cuMemFree(L->d_failures);
        if (L->watch) L->cu->cuStreamDestroy(L->watch);
        if (L->forked) L->cu->cuEventDestroy(L->forked);
        if (L->module) L->cu->cuModuleUnload(L->module);
    }
    if (entered) leave(L);
    free(L->links);
    free(L->layers);
    free(L->aborters);
    free(L->retired);
    pthread_cond_destroy(&L->wake);
    pthread_mutex_destroy(&L->mu);
    free(L);
}

/* Every layer of c's model planned and linked, and the staging of a call's choices. */
static int open_all(moedc_links *L, moedc_error *err)
{
    moedc_model_info info;
    moedc_error e;
    int rc = moedc_info(L->c, &info, &e);
    if (rc) /* a fleet's message names its daemons; one daemon's does not */
        return moedc_fail(err, rc, "%s%s%s%s", L->c->name ? "daemon " : "",
                          L->c->name ? L->c->name : "", L->c->name ? ": " : "", e.msg);
    for (int i = 0; i < info.n_layers; i++)
        if ((uint32_t)info.layers[i].d_model > L->d_model)
            L->d_model = (uint32_t)info.layers[i].d_model;
    for (int i = 0; !rc && i < info.n_layers; i++) {
        layer_links *ll;
        rc = layer_of(L, info.layers[i].index, &ll, err);
        for (int s = 0; !rc && s < ll->lay.plan.n_shards; s++) rc = link_shard(L, ll, s, err);
    }
    if (!rc && !info.n_layers)
        rc = moedc_fail(err, MOEDC_EPRECOND, "the daemons serve no layer yet: nothing to link");
    moedc_model_info_free(&info);
    return rc;
}

int moedc_links_open(moedc *c, const moedc_links_opts *o, moedc_links **out, moedc_error *err)
{
    *out = NULL;
    if (!c || !o) return moedc_fail(err, MOEDC_EINVAL, "no client or no options given");
    if (o->max_tokens < 1 || o->max_top_k < 1 || o->max_top_k > MOED_LINK_MAX_TOP_K ||
        o->timeout_s < 0)
        return moedc_fail(err, MOEDC_EINVAL,
                          "links need max_tokens >= 1, max_top_k 1 .. %d and timeout_s >= 0 (got "
                          "%u, %u, %g)",
                          MOED_LINK_MAX_TOP_K, o->max_tokens, o->max_top_k, o->timeout_s);
    if (o->send < MOEDC_LINKS_SEND_AUTO || o->send > MOEDC_LINKS_SEND_ALL)
        return moedc_fail(err, MOEDC_EINVAL,
                          "send %d: use MOEDC_LINKS_SEND_AUTO, MOEDC_LINKS_SEND_CHOSEN or "
                          "MOEDC_LINKS_SEND_ALL",
                          o->send);
    moed_error e;
    const moed_nccl *nccl = moed_nccl_api(&e); /* before any daemon is asked anything */
    if (!nccl) return from_moed(&e, err);
    moedc_links *L = calloc(1, sizeof *L);
    if (!L) return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening links");
    L->c = c;
    L->o = *o;
    if (!(L->o.timeout_s > 0)) L->o.timeout_s = DEFAULT_TIMEOUT_S;
    L->nccl = nccl;
    pthread_mutex_init(&L->mu, NULL);
    moedc_watch_cond_init(&L->wake);
    int rc = open_all(L, err);
    if (rc) {
        moedc_links_close(L);
        return rc;
    }
    describe(L);
    *out = L;
    return 0;
}

const char *moedc_links_describe(const moedc_links *L)
{
    return L ? L->line : "links are not open";
}

/* ---- calls ---- */

/* A shard of the call: its link, its tokens (rows, NULL: every one) and its payload's layout. */
typedef struct part {
    link *k;
    void *stream; /* its link's for a fleet's call, else the caller's */
    int shard;
    int64_t *rows, n_rows;
    moed_link_payload pay;
    moed_link_call head; /* its header, stamped with its link's next seq on the device */
    bool late;           /* its reply did not arrive */
} part;

static int check_call(const moedc_links *L, const moedc_link_call *c, moedc_error *err)
{
    if (!c) return moedc_fail(err, MOEDC_EINVAL, "no call given");
    if (c->dtype != MOEDC_F32 && c->dtype != MOEDC_F16 && c->dtype != MOEDC_BF16)
        return moedc_fail(err, MOEDC_EINVAL, "dtype %d: use MOEDC_F32, MOEDC_F16 or MOEDC_BF16",
                          c->dtype);
    if (c->tokens < 1 || c->tokens > L->o.max_tokens || c->k < 1 || c->k > (int)L->o.max_top_k)
        return moedc_fail(err, MOEDC_EINVAL,
                          "tokens %lld and k %d: these links were opened for 1 .. %u tokens and 1 "
                          ".. %u choices",
                          (long long)c->tokens, c->k, L->o.max_tokens, L->o.max_top_k);
    if (c->d_model < 1 || c->d_model > L->d_model)
        return moedc_fail(err, MOEDC_EINVAL,
                          "d_model %lld: the widest layer these links were opened for has %u",
                          (long long)c->d_model, L->d_model);
    if (!c->hidden || !c->expert_ids || !c->expert_weights || !c->output)
        return moedc_fail(err, MOEDC_EINVAL,
                          "hidden, expert_ids, expert_weights and output are each needed");
    return 0;
}

/* The index area of a planned call of S parts and T tokens: S row lists of T, then S row maps of
 * T; grown (page-locked and on the device) when a call needs more. */
static int index_area(moedc_links *L, int S, int64_t T, size_t *map_at, moedc_error *err)
{
    *map_at = round_up((size_t)S * (size_t)T * 4);
    const size_t need = *map_at + (size_t)S * (size_t)T * 4;
    if (need <= L->index_cap) return 0;
    const moedc_cuda_table *cu = L->cu;
    if (L->h_index) cu->cuMemFreeHost(L->h_index);
    if (L->d_index) cu->cuMemFree(L->d_index);
    L->h_index = NULL;
    L->d_index = 0;
    L->index_cap = 0;
    int rc = cu->cuMemHostAlloc((void **)&L->h_index, need, 0);
    if (!rc) rc = cu->cuMemAlloc(&L->d_index, need);
    if (rc) return moedc_cuda_fail(cu, rc, "allocating a link call's index", err);
    L->index_cap = need;
    return 0;
}

/* A launch of a kernel over rows (y, GRID_ROWS of blocks at most, the kernel striding past them)
 * of `columns` threads (x, at least one block). */
static int grid(const moedc_links *L, void *fn, int64_t columns, int64_t rows, void *stream,
                void **params, const char *what, moedc_error *err)
{
    const unsigned gx = columns > THREADS ? (unsigned)((columns + THREADS - 1) / THREADS) : 1,
                   gy = (unsigned)(rows < GRID_ROWS ? (rows > 0 ? rows : 1) : GRID_ROWS);
    int rc = L->cu->cuLaunchKernel(fn, gx, gy, 1, THREADS, 1, 1, 0, stream, params, NULL);
    return rc ? moedc_cuda_fail(L->cu, rc, what, err) : 0;
}

/* Part p's header and payload layout, or the call's refusal: before any of the call's work is
 * queued, so that a refused call leaves its links in step. */
static int prepare(moedc_links *L, const layer_links *ll, const moedc_link_call *c, part *p,
                   moedc_error *err)
{
    link *k = p->k;
    const size_t elem = moed_dtype_size(c->dtype);
    moed_error e;
    /* the daemon's deadline is the call's: it drops what no one waits for any more */
    const double us = L->o.timeout_s * 1e6;
    const uint32_t deadline_us = us >= (double)UINT32_MAX ? UINT32_MAX : (uint32_t)us;
    moed_link_payload *pay = &p->pay;
    moed_link_call *head = &p->head;
    if (moed_link_call_init(head, 0, c->layer, (uint32_t)c->dtype, (uint32_t)p->n_rows,
                            (uint32_t)c->k, (uint32_t)c->d_model, deadline_us, 0, &e) ||
        moed_link_layout((uint64_t)p->n_rows, (uint64_t)c->k, (uint64_t)c->d_model, elem, pay, &e))
        return moedc_fail(err, e.code, "daemon %s: %s", k->name, e.msg);
    if (pay->total > k->max_payload || pay->total > k->payload_cap)
        return moedc_fail(err, MOEDC_EINVAL,
                          "daemon %s: a call's payload of %llu bytes is over its link's %llu",
                          k->name, (unsigned long long)pay->total,
                          (unsigned long long)(k->max_payload < k->payload_cap ? k->max_payload
                                                                               : k->payload_cap));
    /* what this daemon must be for its partial to fit the sum: a daemon restarted as another
     * shard or model since the plan refuses the call (moed_link.h) */
    const moedc_layer_info *li = ll->lay.plan.shards[p->shard].li;
    const uint32_t n_held = li->n_held > 0 ? (uint32_t)li->n_held : 0;
    uint32_t *first = malloc(sizeof *first * (2 * (size_t)n_held + 1)), *last = first + n_held;
    if (!first) return moedc_fail(err, MOEDC_ENOMEM, "out of memory staging a link call");
    for (uint32_t i = 0; i < n_held; i++) {
        first[i] = (uint32_t)li->held[i].first;
        last[i] = (uint32_t)li->held[i].last;
    }
    moed_link_call_expect(head, ll->lay.fingerprint, first, last, n_held, li->adds_shared);
    free(first);
    return 0;
}

/* Writes part p's payload, header (stamped with the link's next seq on the device) and zeroed
 * reply header on its stream (its rows at d_rows). */
static int stage(moedc_links *L, const moedc_link_call *c, part *p, moedc_cu_ptr d_rows,
                 moedc_error *err)
{
    link *k = p->k;
    const size_t elem = moed_dtype_size(c->dtype);
    const moed_link_payload *pay = &p->pay;
    moedc_cu_ptr rows = p->rows ? d_rows : 0;
    const size_t row_bytes[MOEDC_LINK_TENSORS] = { (size_t)c->d_model * elem, (size_t)c->k * 4,
                                                   (size_t)c->k * 4 };
    const void *src[MOEDC_LINK_TENSORS] = { c->hidden, c->expert_ids, c->expert_weights };
    const uint64_t at[MOEDC_LINK_TENSORS] = { pay->hidden, pay->ids, pay->weights };
    moedc_link_copies copies;
    for (int i = 0; i < MOEDC_LINK_TENSORS; i++)
        copies.t[i] = (moedc_link_copy){ .src = src[i],
                                         .dst = (unsigned char *)(uintptr_t)(k->d_payload + at[i]),
                                         .bytes = (long long)row_bytes[i] };
    long long n = p->n_rows;
    void *gparams[] = { &copies, &rows, &n };
    int rc = grid(L, L->k_gather, (int64_t)(row_bytes[0] / 16), n, p->stream, gparams,
                  "cuLaunchKernel (gather)", err);
    moedc_cu_ptr dst = k->d_head, counter = k->d_head + SEQ_AT, reply = k->d_reply;
    void *params[] = { &p->head, &dst, &counter, &reply };
    return rc ? rc : grid(L, L->k_stamp, 1, 1, p->stream, params, "cuLaunchKernel (stamp)", err);
}

/* One NCCL operation on part k's communicator, settled (a non-blocking communicator takes its next
 * operation only once the last one is queued). */
static int op(moedc_links *L, link *k, int r, double until, const char *what, moedc_error *err)
{
    if (r && r != MOED_NCCL_IN_PROGRESS) return nccl_fail(L, k, r, what, err);
    return settle(L, k, until, what, err);
}

/* Part p's header and payload sent on its stream. One NCCL operation at a time, not a group: on
 * H200s a group of a link's header, payload and reply never completed (the daemon receives the
 * header alone first, to learn the payload's size), while the same operations one by one do. */
static int send_part(moedc_links *L, const part *p, double until, moedc_error *err)
{
    const moed_nccl *x = L->nccl;
    link *k = p->k;
    int rc = op(L, k,
                x->send((const void *)(uintptr_t)k->d_head, MOED_LINK_HEADER_BYTES, MOED_NCCL_UINT8,
                        0, k->comm, p->stream),
                until, "ncclSend (a call's header)", err);
    return rc ? rc
              : op(L, k,
                   x->send((const void *)(uintptr_t)k->d_payload, p->pay.total, MOED_NCCL_UINT8, 0,
                           k->comm, p->stream),
                   until, "ncclSend (a call's payload)", err);
}

/* The parts' calls, staged and sent, the slowest shard's (as its last reply said) first: its
 * gather and messages are queued first. (Its payload would also arrive first if each send waited
 * for the one before: measured on four H200s, a T = 4096 call 0.1 ms faster over NVLink but much
 * slower over NCCL's sockets, where connections side by side add up, and the client cannot tell
 * which transport NCCL chose: docs/fleets.md, "A call".) */
static int send_in_turn(moedc_links *L, const moedc_link_call *c, part *parts, int n, double until,
                        moedc_error *err)
{
    int order[MOEDC_LINK_MAX_PARTS];
    for (int i = 0; i < n; i++) {
        int j = i;
        for (; j > 0 && parts[order[j - 1]].k->compute_us < parts[i].k->compute_us; j--)
            order[j] = order[j - 1];
        order[j] = i;
    }
    int rc = 0;
    for (int i = 0; !rc && i < n; i++) {
        part *p = &parts[order[i]];
        rc = stage(L, c, p, L->d_index + (size_t)order[i] * (size_t)c->tokens * 4, err);
        if (!rc) rc = send_part(L, p, until, err);
    }
    return rc;
}

/* Part p's reply received on its stream: posted after every part's sends, so that no shard's call
 * waits behind another's answer. */
static int recv_part(moedc_links *L, const moedc_link_call *c, const part *p, double until,
                     moedc_error *err)
{
    link *k = p->k;
    const uint64_t reply =
        moed_link_reply_bytes((uint64_t)p->n_rows, (uint64_t)c->d_model, moed_dtype_size(c->dtype));
    return op(
        L, k,
        L->nccl->recv((void *)(uintptr_t)k->d_reply, reply, MOED_NCCL_UINT8, 0, k->comm, p->stream),
        until, "ncclRecv (a call's reply)", err);
}

/* The parts' streams leave the caller's (fork) or rejoin it (join; whatever each was given, so a
 * capture ends joined and a failed call's drain of the caller's stream covers them); nothing for a
 * part on the caller's stream. */
static int fork_join(moedc_links *L, const moedc_link_call *c, part *parts, int n, bool fork,
                     moedc_error *err)
{
    const moedc_cuda_table *cu = L->cu;
    int rc =
        fork && n > 0 && parts[0].stream != c->stream ? cu->cuEventRecord(L->forked, c->stream) : 0;
    for (int j = 0; !rc && j < n; j++) {
        if (parts[j].stream == c->stream) continue;
        link *k = parts[j].k;
        rc = fork ? cu->cuStreamWaitEvent(k->stream, L->forked, 0)
                  : cu->cuEventRecord(k->done, k->stream);
        if (!rc && !fork) rc = cu->cuStreamWaitEvent(c->stream, k->done, 0);
    }
    return rc ? moedc_cuda_fail(cu, rc, fork ? "forking a fleet's call" : "joining a fleet's call",
                                err)
              : 0;
}

/* The seq of k's last call, as read back with its reply (read_reply). */
static uint64_t seq_of(const link *k)
{
    uint64_t seq;
    memcpy(&seq, (const unsigned char *)k->h_reply + SEQ_AT, sizeof seq);
    return seq;
}

/* Queues the copy of k's reply header and call counter to the host on `stream`. */
static int read_reply(moedc_links *L, link *k, void *stream)
{
    int rc = L->cu->cuMemcpyDtoHAsync(k->h_reply, k->d_reply, MOED_LINK_HEADER_BYTES, stream);
    return rc ? rc
              : L->cu->cuMemcpyDtoHAsync((unsigned char *)k->h_reply + SEQ_AT, k->d_head + SEQ_AT,
                                         sizeof(uint64_t), stream);
}

/* Which replies arrived, read on our own stream (the caller's may be held by a link that will not
 * answer): parts whose reply header is not their call's are late. */
static int find_late(moedc_links *L, part *parts, int n, moedc_error *err)
{
    int late = 0;
    for (int j = 0; j < n; j++) {
        link *k = parts[j].k;
        int rc = read_reply(L, k, L->watch);
        if (!rc) rc = L->cu->cuStreamSynchronize(L->watch);
        if (rc) return moedc_cuda_fail(L->cu, rc, "reading a link's reply header", err);
        parts[j].late = !moed_link_reply_matches(k->h_reply, seq_of(k));
        late += parts[j].late;
    }
    return late;
}

/* The call failed with late parts: each late link aborted (its kernels end, freeing the caller's
 * stream) and dropped, the stream given DRAIN_S to pass the rest, and the error naming each. */
static int fail_late(moedc_links *L, const moedc_link_call *c, layer_links *ll, part *parts, int n,
                     const char *cause, moedc_error *err)
{
    char who[sizeof err->msg] = "";
    size_t used = 0;
    int n_late = 0;
    for (int j = 0; j < n; j++) {
        if (!parts[j].late) continue;
        n_late++;
        char experts[96];
        experts_text(ll->lay.plan.shards[parts[j].shard].li, experts, sizeof experts);
        if (used < sizeof who)
            used += (size_t)snprintf(who + used, sizeof who - used, "%s%s (experts %s)",
                                     used ? ", " : "", parts[j].k->name, experts);
        link_abort(L, parts[j].k);
    }
    const double until = moed_now_s() + DRAIN_S;
    moed_backoff b;
    moed_backoff_start(&b);
    while (L->cu->cuStreamQuery(c->stream) == MOEDC_CU_ERROR_NOT_READY) {
        if (moed_now_s() > until)
            break; /* say so below: the caller must not reuse the buffers yet */
        moed_backoff_pause(&b, 0);
    }
    const bool drained = L->cu->cuStreamQuery(c->stream) == 0;
    for (int j = 0; j < n; j++)
        if (parts[j].late) link_drop(L, parts[j].k);
    describe(L);
    return moedc_fail(err, MOEDC_EUNAVAIL,
                      "layer %u: %s from %s: the output was not written, and the link%s aborted "
                      "(opened again by the next call)%s",
                      c->layer, cause, who, n_late > 1 ? "s were" : " was",
                      drained ? "" : "; the caller's stream had not drained 10 s after the abort");
}

/* Waits for the call on the caller's stream: 0 once done; the failure once an NCCL error shows or
 * the time is up (then which parts are late). */
static int watch_call(moedc_links *L, const moedc_link_call *c, layer_links *ll, part *parts, int n,
                      double until, moedc_error *err)
{
    moed_backoff b;
    for (moed_backoff_start(&b);;) {
        int q = L->cu->cuStreamQuery(c->stream);
        if (q == 0) return 0;
        if (q != MOEDC_CU_ERROR_NOT_READY)
            return moedc_cuda_fail(L->cu, q, "the call's stream", err);
        const char *cause = moed_now_s() > until ? "no answer in time" : NULL;
        char why[200] = "";
        for (int j = 0; j < n && !cause; j++) {
            int async = 0;
            L->nccl->comm_get_async_error(parts[j].k->comm, &async);
            if (async && async != MOED_NCCL_IN_PROGRESS) {
                moed_error e;
                moed_nccl_fail(L->nccl, async, "NCCL", &e);
                snprintf(why, sizeof why, "%.190s", e.msg);
                cause = why;
            }
        }
        if (cause) {
            int late = find_late(L, parts, n, err);
            if (late < 0) return late;
            if (!late && moed_now_s() <= until)
                continue; /* every reply is in: the stream is ending */
            for (int j = 0; !late && j < n; j++) parts[j].late = true; /* which one holds it? */
            char what[240];
            snprintf(what, sizeof what, "%s within %.1f s", cause, L->o.timeout_s);
            return fail_late(L, c, ll, parts, n, what, err);
        }
        moed_backoff_pause(&b, 0);
    }
}

/* The daemons' answers once the stream is done: the first that is not OK fails the call. */
static int answers(moedc_links *L, part *parts, int n, moedc_timings *t, moedc_error *err)
{
    for (int j = 0; j < n; j++) {
        link *k = parts[j].k;
        const moed_link_reply *r = k->h_reply;
        if (!moed_link_reply_matches(r, seq_of(k)))
            return moedc_fail(err, MOEDC_EFORMAT,
                              "daemon %s: its reply to call %llu is not one (the link is out of "
                              "step)",
                              k->name, (unsigned long long)seq_of(k));
        if (r->status) {
            char msg[MOED_LINK_MESSAGE_BYTES + 1];
            snprintf(msg, sizeof msg, "%s", r->message);
            return moedc_fail(err, moedc_code_from_grpc(r->status), "daemon %s: %s", k->name, msg);
        }
        k->compute_us = r->compute_us;
        if (t && r->queue_us + r->compute_us >= t->queue_us + t->compute_us)
            *t = (moedc_timings){ .queue_us = r->queue_us,
                                  .compute_us = r->compute_us,
                                  .batch_tokens = r->batch_tokens,
                                  .batch_requests = r->batch_requests };
    }
    return 0;
}

/* The call's expert choices on the host, once the caller's work that made them is done: a fleet's
 * plan needs them (one daemon takes every token, and the call never waits on the host). */
static int read_choices(moedc_links *L, const moedc_link_call *c, moedc_error *err)
{
    const moedc_cuda_table *cu = L->cu;
    const size_t pairs = (size_t)c->tokens * (size_t)c->k * 4,
                 cap = (size_t)L->o.max_tokens * L->o.max_top_k * 4;
    int rc = 0;
    if (!L->h_ids && (rc = cu->cuMemHostAlloc((void **)&L->h_ids, cap, 0)))
        return moedc_cuda_fail(cu, rc, "cuMemHostAlloc (a call's expert choices)", err);
    if (!L->h_w && (rc = cu->cuMemHostAlloc((void **)&L->h_w, cap, 0)))
        return moedc_cuda_fail(cu, rc, "cuMemHostAlloc (a call's expert choices)", err);
    rc = cu->cuMemcpyDtoHAsync(L->h_ids, (moedc_cu_ptr)(uintptr_t)c->expert_ids, pairs, c->stream);
    if (!rc)
        rc = cu->cuMemcpyDtoHAsync(L->h_w, (moedc_cu_ptr)(uintptr_t)c->expert_weights, pairs,
                                   c->stream);
    if (!rc) rc = cu->cuStreamSynchronize(c->stream);
    return rc ? moedc_cuda_fail(cu, rc, "copying the call's expert choices", err) : 0;
}

/* Drops the links the watchdog aborted (their daemons' sessions ended): later calls link again. */
static void drop_dead(moedc_links *L)
{
    for (int i = 0; i < L->n_links;)
        if (!L->links[i]->comm)
            link_drop(L, L->links[i]); /* the last link moved to i */
        else
            i++;
}

/* ---- the watchdog of captured calls ---- */

static void *watch_main(void *arg)
{
    moedc_links *L = arg;
    pthread_mutex_lock(&L->mu);
    while (!L->stopping) {
        for (int i = 0; i < L->n_links; i++) {
            link *k = L->links[i];
            if (k->captured && k->comm && moedc_session_ended(k->s)) link_abort(L, k);
        }
        moedc_watch_wait(&L->wake, &L->mu, WATCH_NS);
    }
    pthread_mutex_unlock(&L->mu);
    return NULL;
}

static int start_watchdog(moedc_links *L, moedc_error *err)
{
    if (L->watching) return 0;
    if (pthread_create(&L->watchdog, NULL, watch_main, L))
        return moedc_fail(err, MOEDC_ENOMEM, "could not start the links' watchdog thread");
    L->watching = true;
    return 0;
}

/* ---- a call ---- */

/* The call, the caller's device current and L locked; captured when its stream is capturing. */
static int forward(moedc_links *L, const moedc_link_call *c, moedc_timings *t, moedc_error *err)
{
    const double start = moed_now_s(), until = start + L->o.timeout_s;
    const moedc_cuda_table *cu = L->cu;
    if (t) memset(t, 0, sizeof *t);
    int capture = 0;
    int rc = cu->cuStreamIsCapturing(c->stream, &capture);
    if (rc) return moedc_cuda_fail(cu, rc, "cuStreamIsCapturing", err);
    const bool captured = capture == MOEDC_CU_STREAM_CAPTURE_ACTIVE;
    if (!captured) drop_dead(L); /* frees buffers: not while capturing */
    layer_links *ll;
    if ((rc = layer_of(L, (int)c->layer, &ll, err))) return rc;
    const int S = ll->lay.plan.n_shards;
    if (S > MOEDC_LINK_MAX_PARTS)
        return moedc_fail(err, MOEDC_EUNSUPPORTED,
                          "layer %u is served by %d shards; a link call reaches at most %d",
                          c->layer, S, MOEDC_LINK_MAX_PARTS);
    const int64_t T = c->tokens;
    /* a replay's choices are not known now, and AUTO's saving may not pay for the read */
    const bool every =
        captured || S < 2 || L->o.send == MOEDC_LINKS_SEND_ALL ||
        (L->o.send == MOEDC_LINKS_SEND_AUTO && moedc_plan_sends_all(&ll->lay.plan, c->k));
    if (!every && (rc = read_choices(L, c, err))) return rc;
    int64_t **rows = calloc((size_t)S, sizeof *rows), *n_rows = calloc((size_t)S, sizeof *n_rows);
    part *parts = calloc((size_t)S, sizeof *parts);
    if (!rows || !n_rows || !parts)
        rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory planning a call");
    else if (every)
        for (int s = 0; s < S; s++) n_rows[s] = T;
    else
        rc = moedc_plan_rows(&ll->lay.plan, L->h_ids, L->h_w, T, c->k, rows, n_rows, err);
    int n = 0;
    bool planned = false;
    for (int s = 0; !rc && s < S; s++) {
        if (!n_rows[s]) continue;
        if (captured && !(ll->by_shard[s] && ll->by_shard[s]->comm)) {
            char experts[96];
            experts_text(ll->lay.plan.shards[s].li, experts, sizeof experts);
            rc = moedc_fail(err, MOEDC_EPRECOND,
                            "layer %u, experts %s: no link is open to a daemon holding them (its "
                            "last failed), and a captured call cannot open one: make a call of the "
                            "layer outside the capture first",
                            c->layer, experts);
        } else {
            rc = link_shard(L, ll, s, err);
        }
        if (rc) break;
        parts[n++] =
            (part){ .k = ll->by_shard[s], .shard = s, .rows = rows[s], .n_rows = n_rows[s] };
        parts[n - 1].stream = S > 1 ? ll->by_shard[s]->stream : c->stream;
        planned |= rows[s] != NULL;
        ll->by_shard[s]->captured |= captured;
    }
    size_t map_at = 0;
    if (!rc && planned) rc = index_area(L, n, T, &map_at, err);
    moedc_link_parts P;
    for (int j = 0; !rc && j < n; j++) {
        moedc_cu_ptr row_of = 0;
        if (parts[j].rows) {
            int32_t *list = (int32_t *)L->h_index + (size_t)j * (size_t)T;
            int32_t *map = (int32_t *)(L->h_index + map_at) + (size_t)j * (size_t)T;
            for (int64_t i = 0; i < T; i++) map[i] = -1;
            for (int64_t i = 0; i < parts[j].n_rows; i++) {
                list[i] = (int32_t)parts[j].rows[i];
                map[parts[j].rows[i]] = (int32_t)i;
            }
            row_of = L->d_index + map_at + (size_t)j * (size_t)T * 4;
        }
        const link *k = parts[j].k;
        P.p[j] = (moedc_link_part){ .reply = (const unsigned char *)(uintptr_t)k->d_reply,
                                    .row_of = (const int32_t *)(uintptr_t)row_of,
                                    .seq = (const uint64_t *)(uintptr_t)(k->d_head + SEQ_AT) };
    }
    int drc;
    if (!rc && planned &&
        (drc =
             cu->cuMemcpyHtoDAsync(L->d_index, L->h_index, map_at + (size_t)n * T * 4, c->stream)))
        rc = moedc_cuda_fail(cu, drc, "cuMemcpyHtoDAsync (the call's index)", err);
    for (int j = 0; !rc && j < n; j++) rc = prepare(L, ll, c, &parts[j], err);
    /* from here a failure leaves the links out of step with their daemons: each part's call goes
     * out as soon as it is staged, the replies' receives after every send */
    bool begun = false;
    if (!rc) begun = !(rc = fork_join(L, c, parts, n, true, err));
    if (!rc) rc = send_in_turn(L, c, parts, n, until, err);
    for (int j = 0; !rc && j < n; j++) rc = recv_part(L, c, &parts[j], until, err);
    if (begun) {
        moedc_error jerr;
        int jrc = fork_join(L, c, parts, n, false, &jerr);
        if (!rc && jrc) {
            *err = jerr;
            rc = jrc;
        }
    }
    if (rc && begun) {
        for (int j = 0; j < n; j++) parts[j].late = true; /* out of step with their daemons */
        char cause[sizeof err->msg];
        snprintf(cause, sizeof cause, "%s", err->msg);
        if (captured) { /* nothing to wait for: the capture is the caller's to discard */
            for (int j = 0; j < n; j++) link_abort(L, parts[j].k);
        } else {
            rc = fail_late(L, c, ll, parts, n, cause, err);
        }
    } else if (!rc) {
        int verbatim = S == 1, dtype = c->dtype;
        long long tokens = T, d = c->d_model;
        moedc_cu_ptr out = (moedc_cu_ptr)(uintptr_t)c->output, failures = L->d_failures;
        void *params[] = { &P, &n, &verbatim, &dtype, &tokens, &d, &out, &failures };
        rc = grid(L, L->k_combine, d, tokens, c->stream, params, "cuLaunchKernel (combine)", err);
    }
    if (captured) {
        if (!rc) rc = start_watchdog(L, err);
    } else {
        for (int j = 0; !rc && j < n; j++)
            if ((drc = read_reply(L, parts[j].k, c->stream)))
                rc = moedc_cuda_fail(cu, drc, "cuMemcpyDtoHAsync (a reply's header)", err);
        if (!rc) rc = watch_call(L, c, ll, parts, n, until, err);
        if (!rc) rc = answers(L, parts, n, t, err);
        if (t) t->total_us = (uint64_t)((moed_now_s() - start) * 1e6);
    }
    for (int s = 0; rows && s < S; s++) free(rows[s]);
    free(rows);
    free(n_rows);
    free(parts);
    return rc;
}

int moedc_links_failures(moedc_links *L, uint64_t *count, moedc_error *err)
{
    if (!L || !count) return moedc_fail(err, MOEDC_EINVAL, "no links or no count given");
    *count = 0;
    pthread_mutex_lock(&L->mu);
    int rc = 0;
    if (L->d_failures && !(rc = enter(L, err))) {
        int drc = L->cu->cuMemcpyDtoH(count, L->d_failures, sizeof *count);
        if (drc) rc = moedc_cuda_fail(L->cu, drc, "reading the links' failure count", err);
        leave(L);
    }
    pthread_mutex_unlock(&L->mu);
    return rc;
}

int moedc_links_forward(moedc_links *L, const moedc_link_call *call, moedc_timings *t,
                        moedc_error *err)
{
    if (!L) return moedc_fail(err, MOEDC_EINVAL, "no links given");
    int rc = check_call(L, call, err);
    if (rc) return rc;
    pthread_mutex_lock(&L->mu);
    if (!(rc = enter(L, err))) {
        rc = forward(L, call, t, err);
        leave(L);
    }
    pthread_mutex_unlock(&L->mu);
    return rc;
}
