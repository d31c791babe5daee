/*
 * moed_rpc — the gRPC server's life cycle, its completion-queue threads, the calls' shared
 * plumbing (requesting, reference counting, replying, refusing), the answer to unknown methods,
 * and the drain. Each method of the protocol is answered in a file of its own (forward.c,
 * getmodel.c, health.c, region_rpc.c).
 *
 * Why C core and not the C++ API: the daemon is C, and core's byte buffers let the Forward path
 * read tensors straight from the received slices and reply from a slice the output was written
 * into. Why several completion queues: one queue thread tops out near one core of HTTP/2 work;
 * the bare gRPC floor the benchmarks compare against (an echo server with no compute, 8.2 GB/s)
 * was measured with eight. Why the threads that run calls never read a connection (their queues
 * are gRPC's non-polling kind, and other threads poll): gRPC 1.51 reads a connection on, in the
 * thread that polled it, for as long as its socket has data, so a peer sending streams faster than
 * they are parsed keeps that thread; a thread that also ran calls then ran none, and 32 such
 * connections stopped every call, and every decision to close one of them, for seconds.
 */
#include "rpc_call.h"

#include "loading.h"
#include "log.h"

#include <grpc/compression.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/log.h>
#include <grpc/support/time.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

/* The drain's wait for callers to go quiet (maybe_shutdown), and how often it looks. */
#define DRAIN_QUIET_NS ((uint64_t)250 * 1000000)
#define DRAIN_POLL_MS  50
/* moed's pings: every KEEPALIVE_MS, answered within KEEPALIVE_TIMEOUT_MS. */
#define KEEPALIVE_MS         60000
#define KEEPALIVE_TIMEOUT_MS 20000
/* How often queue 0's thread looks for connections that take no reply (moed_peers_stalled). */
#define STALL_POLL_NS ((uint64_t)1000000000)
/* How long moed_rpc_destroy waits for the transports of connections a drain reset to be gone, and
 * how often it looks. */
#define GRPC_GONE_WAIT_NS ((uint64_t)10 * 1000000000)
#define GRPC_GONE_POLL_S  1e-3

/* Calls requested in advance per method and queue: enough for a burst of callers to be taken
 * without waiting for a re-arm. */
static const int prepost[M_COUNT] = {
    [M_FORWARD] = 32, [M_STREAM] = 8,  [M_GETMODEL] = 2,     [M_CHECK] = 4,
    [M_WATCH] = 2,    [M_REGIONS] = 2, [M_LIST_REGIONS] = 2, [M_UNKNOWN] = 2
};

static const rpc_method unknown_method;

static const rpc_method *const methods[M_COUNT] = {
    [M_FORWARD] = &moed_forward_method,
    [M_STREAM] = &moed_stream_method,
    [M_GETMODEL] = &moed_getmodel_method,
    [M_CHECK] = &moed_check_method,
    [M_WATCH] = &moed_watch_method,
    [M_REGIONS] = &moed_regions_method,
    [M_LIST_REGIONS] = &moed_list_regions_method,
    [M_UNKNOWN] = &unknown_method,
};

/* ---- calls ----------------------------------------------------------------------------------- */

void rpc_call_ref(rpc_call *c)
{
    atomic_fetch_add(&c->refs, 1);
}

static void maybe_shutdown(moed_rpc *r);
static void shutdown_now(moed_rpc *r);
static void on_shutdown(rpc_tag *t, bool ok);

void rpc_call_unref(rpc_call *c)
{
    if (atomic_fetch_sub(&c->refs, 1) != 1) return;
    moed_rpc *r = c->rpc;
    if (c->live) {
        pthread_mutex_lock(&r->live_lock);
        moed_list_remove(&c->live_node);
        pthread_mutex_unlock(&r->live_lock);
    }
    if (c->started && c->method->destroy) c->method->destroy(c);
    moed_peers_leave(r->peers, &c->peer, moed_now_ns());
    const bool was_active = c->active;
    if (c->call) grpc_call_unref(c->call);
    grpc_metadata_array_destroy(&c->md);
    grpc_call_details_destroy(&c->call_details);
    if (c->payload) grpc_byte_buffer_destroy(c->payload);
    if (c->reply) grpc_byte_buffer_destroy(c->reply);
    grpc_slice_unref(c->details);
    free(c);
    if (was_active && atomic_fetch_sub(&r->active, 1) == 1 && atomic_load(&r->draining))
        maybe_shutdown(r);
}

void rpc_call_read(rpc_call *c)
{
    moed_peers_read(c->rpc->peers, &c->peer);
}

static void close_connection(moed_rpc *r, const char *peer, const char *why);

void rpc_hold(rpc_call *c, int64_t bytes)
{
    char victim[128];
    if (moed_peers_hold(c->rpc->peers, &c->peer, bytes, moed_now_ns(), victim, sizeof victim))
        close_connection(c->rpc, victim,
                         "replies waiting for their clients passed --max-grpc-memory, and this "
                         "connection's were the most: its client takes them too slowly, or "
                         "grants no HTTP/2 window");
}

const void *rpc_call_owner(const rpc_call *c)
{
    return c->peer.peer ? (const void *)c->peer.peer : (const void *)c;
}

/* Takes a reference unless the call is already on its way out (refs at 0). */
static bool ref_if_alive(rpc_call *c)
{
    int n = atomic_load(&c->refs);
    while (n > 0)
        if (atomic_compare_exchange_weak(&c->refs, &n, n + 1)) return true;
    return false;
}

void rpc_start_batch(rpc_call *c, const grpc_op *ops, size_t n, rpc_tag *tag)
{
    rpc_call_ref(c);
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, tag, NULL);
    if (e == GRPC_CALL_OK) return;
    /* Only a bug in this file's op sequencing gets here; never leave the caller hanging. */
    moed_log_error("grpc batch refused", "method=%s error=\"%s\"", c->method->path,
                   grpc_call_error_to_string(e));
    grpc_call_cancel_with_status(c->call, GRPC_STATUS_INTERNAL, "moed: internal error", NULL);
    rpc_call_unref(c);
}

static void on_close(rpc_tag *t, bool ok)
{
    rpc_call *c = moed_container_of(t, rpc_call, on_close);
    if (c->close_fn) c->close_fn(c);
    rpc_call_unref(c);
}

void rpc_post_close(rpc_call *c, void (*close_fn)(rpc_call *c))
{
    grpc_op op = { .op = GRPC_OP_RECV_CLOSE_ON_SERVER };
    op.data.recv_close_on_server.cancelled = &c->cancelled;
    c->close_fn = close_fn;
    c->close_posted = true;
    c->on_close.fn = on_close;
    rpc_start_batch(c, &op, 1, &c->on_close);
}

static void on_reply(rpc_tag *t, bool ok)
{
    rpc_call *c = moed_container_of(t, rpc_call, on_reply);
    if (c->peer.held) rpc_hold(c, -c->peer.held); /* taken, or the call is over */
    rpc_call_unref(c);
}

void rpc_reply(rpc_call *c, grpc_byte_buffer *msg, int grpc_status, const char *details)
{
    grpc_op ops[4];
    size_t n = 0;
    memset(ops, 0, sizeof ops);
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (msg) {
        c->reply = msg;
        rpc_hold(c, (int64_t)grpc_byte_buffer_length(msg));
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = msg;
    }
    c->details = details && *details ? grpc_slice_from_copied_string(details) : grpc_empty_slice();
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)grpc_status;
    ops[n++].data.send_status_from_server.status_details = &c->details;
    if (!c->close_posted) {
        c->close_posted = true;
        ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
        ops[n++].data.recv_close_on_server.cancelled = &c->cancelled;
    }
    c->on_reply.fn = on_reply;
    rpc_count(c, grpc_status, c->t_received_ns, c->payload, msg);
    rpc_start_batch(c, ops, n, &c->on_reply);
}

void rpc_reply_error(rpc_call *c, const moed_error *err)
{
    rpc_reply(c, NULL, moed_err_grpc_status(err->code), err->msg);
}

void rpc_live_add(rpc_call *c)
{
    moed_rpc *r = c->rpc;
    pthread_mutex_lock(&r->live_lock);
    c->live = true;
    moed_list_insert_head(&r->live, &c->live_node);
    pthread_mutex_unlock(&r->live_lock);
}

void rpc_count(rpc_call *c, int grpc_status, uint64_t t_received_ns, grpc_byte_buffer *request,
               grpc_byte_buffer *reply)
{
    moed_rpc *r = c->rpc;
    moed_metrics_request(r->cfg.metrics, (moed_method)c->method_id, grpc_status);
    if (c->method_id != M_FORWARD && c->method_id != M_STREAM) return;
    atomic_fetch_add(&r->forwards, 1);
    if (grpc_status >= 0 && grpc_status < MOED_GRPC_STATUS_COUNT)
        atomic_fetch_add(&r->by_status[grpc_status], 1);
    if (r->cfg.metrics) /* skips the clock and the slice walks when nothing is recorded */
        moed_metrics_forward(r->cfg.metrics, moed_now_ns() - t_received_ns,
                             request ? grpc_byte_buffer_length(request) : 0,
                             reply ? grpc_byte_buffer_length(reply) : 0);
}

uint64_t rpc_deadline_ns(const rpc_call *c)
{
    gpr_timespec d = gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC);
    if (gpr_time_cmp(d, gpr_inf_future(GPR_CLOCK_MONOTONIC)) == 0) return 0;
    gpr_timespec left = gpr_time_sub(d, gpr_now(GPR_CLOCK_MONOTONIC));
    int64_t ns = left.tv_sec * 1000000000 + left.tv_nsec;
    uint64_t now = moed_now_ns();
    return ns <= 0 ? now : now + (uint64_t)ns; /* already past: expires at the first check */
}

int rpc_health_status(moed_rpc *r)
{
    pthread_mutex_lock(&r->live_lock);
    int s = r->serving;
    pthread_mutex_unlock(&r->live_lock);
    return s;
}

/* ---- compressed requests --------------------------------------------------------------------- */

#define INFLATE_CHUNK ((size_t)1 << 20)

/* Appends the filled part of *cur to out and starts a fresh chunk (or none, with room 0). */
static void next_chunk(grpc_slice_buffer *out, grpc_slice *cur, size_t used, size_t room)
{
    if (used)
        grpc_slice_buffer_add(out, grpc_slice_sub_no_ref(*cur, 0, used));
    else if (GRPC_SLICE_LENGTH(*cur))
        grpc_slice_unref(*cur);
    *cur = room ? grpc_slice_malloc(room) : grpc_empty_slice();
}

/* Inflates src into out, failing once more than `limit` bytes come out. */
static int inflate_slices(z_stream *z, const grpc_slice_buffer *src, grpc_slice_buffer *out,
                          size_t limit, moed_error *err)
{
    grpc_slice cur = grpc_empty_slice();
    size_t used = 0, total = 0, i = 0;
    int zr = Z_OK;
    while (zr == Z_OK) {
        if (!z->avail_in && i < src->count) {
            grpc_slice in = src->slices[i++];
            z->next_in = GRPC_SLICE_START_PTR(in);
            z->avail_in = (uInt)GRPC_SLICE_LENGTH(in);
        }
        if (used == GRPC_SLICE_LENGTH(cur)) {
            size_t room = limit + 1 - total < INFLATE_CHUNK ? limit + 1 - total : INFLATE_CHUNK;
            next_chunk(out, &cur, used, room);
            used = 0;
        }
        z->next_out = GRPC_SLICE_START_PTR(cur) + used;
        z->avail_out = (uInt)(GRPC_SLICE_LENGTH(cur) - used);
        zr = inflate(z, Z_NO_FLUSH);
        size_t got = GRPC_SLICE_LENGTH(cur) - used - z->avail_out;
        used += got;
        total += got;
        if (total > limit) zr = Z_MEM_ERROR;
        if (zr == Z_BUF_ERROR && !z->avail_in && i == src->count) break; /* input ends early */
        if (zr == Z_BUF_ERROR) zr = Z_OK;
    }
    next_chunk(out, &cur, used, 0);
    if (zr == Z_STREAM_END) return 0;
    if (total > limit)
        return moed_fail(err, MOED_ETOOBIG,
                         "the compressed request inflates past this server's limit of %zu bytes "
                         "(--max-message-bytes): send fewer tokens per call or raise the flag",
                         limit);
    return moed_fail(err, MOED_EFORMAT,
                     "the compressed request does not inflate (%s): compress it whole with the "
                     "algorithm its grpc-encoding names, or send it uncompressed",
                     zr == Z_BUF_ERROR ? "it ends early"
                     : z->msg          ? z->msg
                                       : "corrupt data");
}

/* gRPC core keeps a message's compressed flag from the application when the call's grpc-encoding
 * is identity, absent, or a name core does not know (it reads "snappy" as identity): such a
 * message arrives as plain bytes. Only this accessor tells the flag; libgrpc 1.51, which moed is
 * built against, exports it with C++ linkage, hence the mangled name. Weak: a libgrpc without it
 * leaves the flag unchecked. */
extern uint32_t grpc_last_message_flags(grpc_call *call) __asm__(
    "_Z37grpc_call_test_only_get_message_flagsP9grpc_call") __attribute__((weak));
#define MESSAGE_COMPRESSED 0x80000000u /* core's GRPC_WRITE_INTERNAL_COMPRESS, not public */

int rpc_inflate(rpc_call *c, grpc_byte_buffer **bb, moed_error *err)
{
    const moed_rpc *r = c->rpc;
    grpc_byte_buffer *in = *bb;
    if (!in) return 0;
    if (in->data.raw.compression == GRPC_COMPRESS_NONE) {
        if (!grpc_last_message_flags || !c->call ||
            !(grpc_last_message_flags(c->call) & MESSAGE_COMPRESSED))
            return 0;
        return moed_fail(err, MOED_EINTERNAL,
                         "the message is flagged compressed, but the call's grpc-encoding names "
                         "no compression (identity, none, or one gRPC does not know, which it "
                         "reads as identity): send it uncompressed, or gzip or deflate where "
                         "--accept-compression is on");
    }
    z_stream z;
    memset(&z, 0, sizeof z);
    /* gRPC's gzip is RFC 1952 (window bits + 16), its deflate the zlib format (RFC 1950). */
    if (inflateInit2(&z, in->data.raw.compression == GRPC_COMPRESS_GZIP ? 15 + 16 : 15) != Z_OK)
        return moed_fail(err, MOED_ENOMEM, "no memory to inflate the request");
    grpc_slice_buffer out;
    grpc_slice_buffer_init(&out);
    int rc =
        inflate_slices(&z, &in->data.raw.slice_buffer, &out, (size_t)r->cfg.max_message_bytes, err);
    inflateEnd(&z);
    if (!rc) {
        *bb = grpc_raw_byte_buffer_create(out.slices, out.count);
        grpc_byte_buffer_destroy(in);
    }
    grpc_slice_buffer_destroy(&out);
    return rc;
}

/* ---- requesting calls ------------------------------------------------------------------------ */

static void request_call(rpc_cq *q, int m);

/* Turns a call away before anything of it is read: its status goes out with a reset of the
 * stream, and nothing of it is kept waiting for the peer to read that (a reply would hold the call
 * until then, and a peer that never reads would pin every call it opens). */
static void refuse(rpc_call *c, const moed_error *err)
{
    int status = moed_err_grpc_status(err->code);
    rpc_count(c, status, c->t_received_ns, NULL, NULL);
    grpc_call_cancel_with_status(c->call, (grpc_status_code)status, err->msg, NULL);
}

/* With a bearer token configured, a call without it is answered UNAUTHENTICATED before its
 * method sees it, and before its request is read. Health stays open: probes and load balancers
 * send no credentials. */
static bool refuse_unauthenticated(rpc_call *c)
{
    moed_error err;
    if (c->method_id == M_CHECK || c->method_id == M_WATCH ||
        !moed_security_check_call(c->rpc->cfg.security, &c->md, &c->token, &err))
        return false;
    moed_log_debug("call refused", "method=%s reason=\"%s\"", c->method->path, err.msg);
    refuse(c, &err);
    return true;
}

/* While the weights load, only GetModel and Health are answered: every other call gets UNAVAILABLE
 * saying how far the load has come, at its headers. */
static bool refuse_loading(rpc_call *c)
{
    moed_error err;
    moed_loading_state s;
    char how[300];
    if (atomic_load(&c->rpc->loaded) || c->method_id == M_GETMODEL || c->method_id == M_CHECK ||
        c->method_id == M_WATCH || c->method_id == M_UNKNOWN)
        return false;
    moed_loading_get(&s);
    moed_loading_describe(&s, how, sizeof how);
    moed_fail(&err, MOED_EUNAVAIL,
              "moed is loading its weights (%s): retry once its health says SERVING", how);
    refuse(c, &err);
    return true;
}

/* While draining, a new Forward gets a clear UNAVAILABLE (the gRPC server keeps accepting until
 * the calls in flight are done; see moed_rpc_drain). Health and GetModel still answer. */
static bool refuse_draining(rpc_call *c)
{
    moed_error err;
    if (!atomic_load(&c->rpc->draining) || (c->method_id != M_FORWARD && c->method_id != M_STREAM))
        return false;
    moed_fail(&err, MOED_EDRAINING,
              "moed is draining (shutting down) and takes no new calls; retry on another server");
    refuse(c, &err);
    return true;
}

/* Closes a connection found past its limits (moed_peers); counted first, so that whoever sees it
 * closed finds it counted. */
static void close_connection(moed_rpc *r, const char *peer, const char *why)
{
    atomic_fetch_add(&r->closed, 1);
    int n = moed_peers_disconnect(peer, r->port);
    moed_log_warn("connection closed", "peer=%s sockets=%d reason=\"%s\"", peer, n, why);
}

/* Closes a connection for the verdict on one of its calls (moed_peers_enter), saying why. */
static void close_crowded(moed_rpc *r, const char *peer, moed_peer_verdict v)
{
    char why[300];
    const int limit = 2 * r->cfg.max_streams;
    if (v == MOED_PEER_CLOSE_CALLS)
        snprintf(why, sizeof why,
                 "%d calls open on one connection; MAX_CONCURRENT_STREAMS is %d (--max-streams)",
                 limit, r->cfg.max_streams);
    else if (v == MOED_PEER_CLOSE_UNREAD)
        snprintf(why, sizeof why,
                 "%d more of its calls ended unread (turned away at their headers, or reset before "
                 "their request) than were read",
                 MOED_PEERS_UNREAD);
    else
        snprintf(why, sizeof why,
                 "%d calls wait for their request (twice --max-streams), and this connection "
                 "holds the most of them",
                 limit);
    close_connection(r, peer, why);
}

/* A connection may hold twice the MAX_CONCURRENT_STREAMS moed advertises (a client that honours
 * the setting never comes near: the slack covers calls whose end the client has seen before this
 * side has freed them), within moed_peers' bounds on calls ended unread and calls waiting for
 * their request. The call that finds it past them closes it: refusing calls one by one cannot
 * keep up with a peer that opens streams without reading (see peers.h), and the calls gRPC had
 * already taken from it are dropped as they come. TCP peers are counted by address, and the
 * connections of moed's own unix listener by their descriptor ("fd:N"); those of gRPC's unix
 * listener (TLS on a unix socket) all share one name and are not counted: the socket file's
 * permissions admit them. */
static bool refuse_crowded(rpc_call *c)
{
    moed_rpc *r = c->rpc;
    char *peer = grpc_call_get_peer(c->call), victim[128] = "", key[64];
    const char *addr = NULL; /* as moed_peers counts it; NULL: not counted */
    uint64_t seq;
    moed_peer_verdict v = MOED_PEER_ADMIT;
    c->local = peer && moed_peer_is_local(peer);
    if (peer && (!strncmp(peer, "ipv4:", 5) || !strncmp(peer, "ipv6:", 5)))
        addr = peer;
    else if (peer && moed_unix_uid(r->unix_listener, peer, NULL, &seq)) {
        /* a later connection may get the same descriptor: its number in accept order tells them
         * apart */
        snprintf(key, sizeof key, "%s/%llu", peer, (unsigned long long)seq);
        addr = key;
    }
    if (addr) {
        /* gRPC makes one auth context per TCP connection (plaintext too): the connection's
         * identity beside its address */
        grpc_auth_context *conn = grpc_call_auth_context(c->call);
        v = moed_peers_enter(r->peers, addr, conn, c->method->read_payload, c->t_received_ns,
                             &c->peer, victim, sizeof victim);
        grpc_auth_context_release(conn);
    }
    if (v >= MOED_PEER_CLOSE_CALLS) close_crowded(r, addr, v);
    if (v == MOED_PEER_ADMIT && victim[0]) close_crowded(r, victim, MOED_PEER_CLOSE_WAITING);
    gpr_free(peer);
    return v != MOED_PEER_ADMIT;
}

static void start_method(rpc_call *c)
{
    c->started = true;
    c->method->start(c);
}

/* A unary call's request has arrived, or the call ended first: a client that cancelled or reset
 * its stream before its message was whole is counted CANCELLED and needs no answer. */
static void on_payload(rpc_tag *t, bool ok)
{
    rpc_call *c = moed_container_of(t, rpc_call, on_payload);
    moed_error err;
    if (c->payload) rpc_call_read(c);
    if (!c->payload && (!ok || grpc_call_failed_before_recv_message(c->call)))
        rpc_count(c, GRPC_STATUS_CANCELLED, c->t_received_ns, NULL, NULL);
    else if (rpc_inflate(c, &c->payload, &err))
        rpc_reply_error(c, &err);
    else
        start_method(c);
    rpc_call_unref(c);
}

static void on_new(rpc_tag *t, bool ok)
{
    rpc_call *c = moed_container_of(t, rpc_call, on_new);
    moed_rpc *r = c->rpc;
    if (!ok) { /* the server is shutting down: requests still posted come back unfilled */
        rpc_call_unref(c);
        return;
    }
    if (!atomic_load(&r->shutting)) request_call(c->cq, c->method_id);
    c->t_received_ns = moed_now_ns();
    atomic_fetch_add(&r->calls[c->method_id], 1);
    if (refuse_crowded(c)) { /* dropped: its connection is closed, no caller waits on it */
        rpc_call_unref(c);
        return;
    }
    /* a caller is still sending (the drain waits for callers to go quiet): not a closed
     * connection's backlog, which gRPC may go on delivering for seconds */
    atomic_store(&r->last_call_ns, c->t_received_ns);
    if (refuse_unauthenticated(c) || refuse_loading(c) || refuse_draining(c)) {
        rpc_call_unref(c);
        return;
    }
    atomic_fetch_add(&r->active, 1);
    c->active = true;
    if (c->method->read_payload) { /* only now is the request read: nothing before the token */
        grpc_op op = { .op = GRPC_OP_RECV_MESSAGE };
        op.data.recv_message.recv_message = &c->payload;
        c->on_payload.fn = on_payload;
        rpc_start_batch(c, &op, 1, &c->on_payload);
    } else {
        start_method(c);
    }
    rpc_call_unref(c); /* the handler's reference; the ops it posted hold their own */
}

static void request_call(rpc_cq *q, int m)
{
    moed_rpc *r = q->rpc;
    rpc_call *c = calloc(1, methods[m]->size);
    if (!c) {
        moed_log_error("out of memory", "what=\"a call slot for %s\"", methods[m]->path);
        return;
    }
    c->rpc = r;
    c->cq = q;
    c->method = methods[m];
    c->method_id = m;
    c->refs = 1;
    c->details = grpc_empty_slice();
    c->on_new.fn = on_new;
    grpc_metadata_array_init(&c->md);
    grpc_call_details_init(&c->call_details);
    grpc_call_error e =
        methods[m]->generic
            ? grpc_server_request_call(r->server, &c->call, &c->call_details, &c->md, q->cq, q->cq,
                                       &c->on_new)
            : grpc_server_request_registered_call(r->server, r->methods[m], &c->call, &c->deadline,
                                                  &c->md, NULL, q->cq, q->cq, &c->on_new);
    if (e != GRPC_CALL_OK) {
        moed_log_error("grpc request_call refused", "method=%s error=\"%s\"", methods[m]->path,
                       grpc_call_error_to_string(e));
        grpc_metadata_array_destroy(&c->md);
        grpc_call_details_destroy(&c->call_details);
        free(c);
    }
}

/* Closes the connections that hold replies and have taken none for MOED_PEERS_STALL_NS, looking
 * every STALL_POLL_NS. */
static void close_stalled(moed_rpc *r)
{
    char victim[128];
    uint64_t now = moed_now_ns();
    if (now - r->stall_polled_ns < STALL_POLL_NS) return;
    r->stall_polled_ns = now;
    while (moed_peers_stalled(r->peers, now, victim, sizeof victim))
        close_connection(r, victim,
                         "its client has taken none of its replies for 20 s: it reads its socket "
                         "but grants no HTTP/2 window, or takes them too slowly");
}

/* A queue's thread: a call queue's runs its calls' events; a reading queue's thread has none (no
 * call is bound to it) and does gRPC's reading in grpc_completion_queue_next. Queue 0's thread also
 * wakes every DRAIN_POLL_MS, so that a drain waiting for callers to go quiet finishes when they
 * have, whether or not any event comes. */
static void *cq_main(void *arg)
{
    rpc_cq *q = arg;
    moed_rpc *r = q->rpc;
    bool polls = q == &r->cqs[0];
    for (;;) {
        gpr_timespec until = polls ? gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                                  gpr_time_from_millis(DRAIN_POLL_MS, GPR_TIMESPAN))
                                   : gpr_inf_future(GPR_CLOCK_MONOTONIC);
        grpc_event ev = grpc_completion_queue_next(q->cq, until, NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type == GRPC_OP_COMPLETE) ((rpc_tag *)ev.tag)->fn(ev.tag, ev.success != 0);
        if (ev.type == GRPC_QUEUE_TIMEOUT && atomic_load(&r->draining)) maybe_shutdown(r);
        if (polls) close_stalled(r);
    }
    return NULL;
}

/* ---- any other method ---------------------------------------------------------------------- */

/* Without this, gRPC core holds calls to unknown methods until their deadline. */
static void unknown_start(rpc_call *c)
{
    char msg[400];
    grpc_slice m = c->call_details.method;
    rpc_call_read(c); /* answered, as a call whose request was read */
    snprintf(msg, sizeof msg,
             "unknown method %.*s: moed serves /moed.v1.Moed/Forward, ForwardStream, GetModel, "
             "Regions and ListRegions, and /grpc.health.v1.Health/Check and Watch",
             (int)(GRPC_SLICE_LENGTH(m) < 200 ? GRPC_SLICE_LENGTH(m) : 200),
             (const char *)GRPC_SLICE_START_PTR(m));
    rpc_reply(c, NULL, GRPC_STATUS_UNIMPLEMENTED, msg);
}

static const rpc_method unknown_method = {
    .path = "(unknown)", .size = sizeof(rpc_call), .generic = true, .start = unknown_start
};

/* ---- the server ------------------------------------------------------------------------------ */

/* gRPC core's own log lines, as structured lines in ours (a bind failure's reason comes this way).
 */
static void grpc_log_hook(gpr_log_func_args *a)
{
    char msg[768];
    size_t n = 0;
    for (const char *p = a->message; *p && n + 1 < sizeof msg; p++)
        msg[n++] = *p == '"' ? '\'' : (*p == '\n' ? ' ' : *p);
    msg[n] = 0;
    moed_log_level lv = a->severity == GPR_LOG_SEVERITY_ERROR  ? MOED_LOG_ERROR
                        : a->severity == GPR_LOG_SEVERITY_INFO ? MOED_LOG_INFO
                                                               : MOED_LOG_DEBUG;
    moed_log(lv, "grpc", "detail=\"%s\" at=%s:%d", msg, a->file, a->line);
}

/* The bound address: the configured one with the port the kernel gave (a unix socket has none:
 * gRPC answers 1 for it). */
static void set_address(moed_rpc *r, int port)
{
    const char *a = r->cfg.listen, *colon = strrchr(a, ':');
    if (!strncmp(a, "unix:", 5) || !strncmp(a, "unix-abstract:", 14)) {
        snprintf(r->address, sizeof r->address, "%s", a);
        return;
    }
    int host = colon ? (int)(colon - a) : (int)strlen(a);
    r->port = port;
    snprintf(r->address, sizeof r->address, "%.*s:%d", host, a, port);
}

/* The transport's limits. Compression: gRPC core 1.51 inflates a compressed message whole, and
 * checks only its compressed size against the receive limit, so a 0.5 MB gzip body becomes 500
 * MiB; off unless --accept-compression, and then moed inflates it itself, never past
 * --max-message-bytes (rpc_inflate). The resource quota bounds what gRPC holds (read buffers,
 * streams, request bytes until their reply): past 80 % of it flow-control windows shrink, over it
 * gRPC resets streams. */
static grpc_server *create_server(const moed_rpc_config *cfg)
{
    int64_t recv_limit = 2 * cfg->max_message_bytes;
    grpc_resource_quota *quota = grpc_resource_quota_create("moed");
    grpc_resource_quota_resize(quota, (size_t)cfg->max_grpc_memory);
    grpc_arg args[] = {
        /* Above ours, so a request over --max-message-bytes gets our message naming the flag. */
        { GRPC_ARG_INTEGER,
          GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
          { .integer = recv_limit > INT_MAX ? INT_MAX : (int)recv_limit } },
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, { .integer = -1 } },
        /* Large tensors: let flow-control windows grow, and read ahead more per stream. */
        { GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_BDP_PROBE, { .integer = 1 } },
        { GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, { .integer = 8 << 20 } },
        { GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MAX_FRAME_SIZE, { .integer = 1 << 20 } },
        /* A second daemon on a busy port must fail to bind, not share it silently. */
        { GRPC_ARG_INTEGER, GRPC_ARG_ALLOW_REUSEPORT, { .integer = 0 } },
        /* Attention workers hold connections open between bursts and may keep them alive, at
         * most one ping per 10 s; the second ping too many closes the connection. */
        { GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, { .integer = 1 } },
        { GRPC_ARG_INTEGER,
          GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
          { .integer = 10000 } },
        { GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MAX_PING_STRIKES, { .integer = 2 } },
        /* Peers that vanished without closing are found by our pings within 80 s; a connection
         * that never finishes its handshake is dropped after as long. Not sooner: gRPC's
         * deadline runs from the accept until the client's SETTINGS have been read, which counts
         * the time the connection waits for a reading thread, and a flood of streams makes that
         * wait seconds long (at 10 s, new clients were cut off, each of their attempts in
         * turn). A client that sent its SETTINGS and then nothing is held that long anyway. */
        { GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIME_MS, { .integer = KEEPALIVE_MS } },
        { GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIMEOUT_MS, { .integer = KEEPALIVE_TIMEOUT_MS } },
        { GRPC_ARG_INTEGER,
          GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
          { .integer = KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS } },
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_CONCURRENT_STREAMS, { .integer = cfg->max_streams } },
        /* Headers: the token (at most 4 KiB) and gRPC's own fit with room to spare. */
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_METADATA_SIZE, { .integer = 16 << 10 } },
        { GRPC_ARG_INTEGER,
          GRPC_COMPRESSION_CHANNEL_ENABLED_ALGORITHMS_BITSET,
          { .integer = cfg->accept_compression ? (1 << GRPC_COMPRESS_ALGORITHMS_COUNT) - 1
                                               : 1 << GRPC_COMPRESS_NONE } },
        { GRPC_ARG_INTEGER, GRPC_ARG_ENABLE_PER_MESSAGE_DECOMPRESSION, { .integer = 0 } },
        { GRPC_ARG_POINTER,
          GRPC_ARG_RESOURCE_QUOTA,
          { .pointer = { quota, grpc_resource_quota_arg_vtable() } } },
    };
    grpc_channel_args ca = { sizeof args / sizeof args[0], args };
    grpc_server *server = grpc_server_create(&ca, NULL);
    grpc_resource_quota_unref(quota); /* the server holds its own reference */
    return server;
}

/* The listener: moed's own on a unix socket without TLS (moed_unix: it knows who connects), gRPC's
 * otherwise, on a unix path claimed first so that a live daemon's socket is never taken over. */
static int listen_on(moed_rpc *r, moed_error *err)
{
    const moed_rpc_config *cfg = &r->cfg;
    const bool tls = cfg->security && cfg->security->cert_pem;
    int rc = 0;
    if (moed_unix_is_address(cfg->listen) &&
        (rc = tls ? moed_unix_claim(cfg->listen, err)
                  : moed_unix_open(cfg->listen, &r->unix_listener, err)))
        return rc;
    if (r->unix_listener) {
        set_address(r, 0);
        return 0;
    }
    grpc_server_credentials *creds = moed_security_credentials(cfg->security);
    int port = creds ? grpc_server_add_http2_port(r->server, cfg->listen, creds) : 0;
    if (creds) grpc_server_credentials_release(creds);
    if (!port)
        return moed_fail(err, MOED_EIO,
                         "cannot listen on %s: gRPC could not %s (its reason is logged just "
                         "above); choose another --listen%s",
                         cfg->listen,
                         creds ? "bind it (in use, or not a local host:port)"
                               : "create its TLS credentials",
                         tls ? " or check the TLS files" : "");
    set_address(r, port);
    moed_tcp_self_of(cfg->listen, port, &r->tcp_self);
    return 0;
}

int moed_rpc_start(const moed_rpc_config *cfg, moed_rpc **out, moed_error *err)
{
    *out = NULL;
    gpr_set_log_function(grpc_log_hook);
    grpc_init();
    moed_rpc *r = calloc(1, sizeof *r);
    if (!r) {
        grpc_shutdown();
        return moed_fail(err, MOED_ENOMEM, "no memory for the gRPC front end");
    }
    int rc = 0;
    r->cfg = *cfg;
    r->serving = HEALTH_NOT_SERVING;
    r->shutdown_tag.fn = on_shutdown;
    pthread_mutex_init(&r->live_lock, NULL);
    pthread_cond_init(&r->shut_cond, NULL);
    moed_list_init(&r->live);
    if (!(r->server = create_server(cfg)) ||
        !(r->peers = moed_peers_create(2 * cfg->max_streams, cfg->max_grpc_memory)) ||
        !(r->cqs = calloc(2 * (size_t)cfg->cq_threads, sizeof *r->cqs))) {
        rc = moed_fail(err, MOED_ENOMEM, "no memory for the gRPC server");
        goto err;
    }
    for (int m = 0; m < M_COUNT; m++)
        if (!methods[m]->generic)
            r->methods[m] = grpc_server_register_method(r->server, methods[m]->path, NULL,
                                                        GRPC_SRM_PAYLOAD_NONE, 0);
    /* Threads before the port: until grpc_server_start a failure can simply destroy the server.
     * The call queues first (the calls are bound to them), then the reading threads' queues. */
    for (r->n_cqs = 0; r->n_cqs < 2 * cfg->cq_threads; r->n_cqs++) {
        rpc_cq *q = &r->cqs[r->n_cqs];
        grpc_completion_queue_attributes attr = {
            GRPC_CQ_CURRENT_VERSION, GRPC_CQ_NEXT,
            r->n_cqs < cfg->cq_threads ? GRPC_CQ_NON_POLLING : GRPC_CQ_DEFAULT_POLLING, NULL
        };
        q->rpc = r;
        q->cq =
            grpc_completion_queue_create(grpc_completion_queue_factory_lookup(&attr), &attr, NULL);
        grpc_server_register_completion_queue(r->server, q->cq, NULL);
        if (pthread_create(&q->thread, NULL, cq_main, q)) {
            r->n_cqs++;
            rc = moed_fail(err, MOED_EINTERNAL, "could not start completion-queue thread %d",
                           r->n_cqs - 1);
            goto err;
        }
        q->started = true;
    }
    if ((rc = listen_on(r, err))) goto err;
    grpc_server_start(r->server);
    r->started = true;
    if (r->unix_listener) moed_unix_serve(r->unix_listener, r->server);
    for (int i = 0; i < cfg->cq_threads; i++) /* the call queues */
        for (int m = 0; m < M_COUNT; m++)
            for (int k = 0; k < prepost[m]; k++) request_call(&r->cqs[i], m);
    *out = r;
    return 0;
err:
    moed_rpc_destroy(r);
    return rc;
}

const char *moed_rpc_address(const moed_rpc *r)
{
    return r->address;
}

/* Runs fn on every live streaming call, each held by a reference outside live_lock (fn takes the
 * call's own lock, and a last unref takes live_lock). */
static void for_each_live(moed_rpc *r, void (*fn)(rpc_call *c, int arg), int arg)
{
    pthread_mutex_lock(&r->live_lock);
    size_t n = 0;
    moed_list *q;
    moed_list_foreach (q, &r->live) n++;
    rpc_call **held = malloc((n ? n : 1) * sizeof *held);
    size_t k = 0;
    if (held) {
        moed_list_foreach (q, &r->live) {
            rpc_call *c = moed_list_data(q, rpc_call, live_node);
            if (ref_if_alive(c)) held[k++] = c;
        }
    }
    pthread_mutex_unlock(&r->live_lock);
    if (!held) {
        moed_log_error("out of memory", "what=\"telling %zu streams of a change\"", n);
        return;
    }
    for (size_t i = 0; i < k; i++) {
        fn(held[i], arg);
        rpc_call_unref(held[i]);
    }
    free(held);
}

static void tell_health(rpc_call *c, int status)
{
    if (c->method->health) c->method->health(c, status);
}

static void tell_drain(rpc_call *c, int unused)
{
    if (c->method->drain) c->method->drain(c);
}

void moed_rpc_loaded(moed_rpc *r, moed_sched *sched, moed_doorbell *doorbell, moed_links *links)
{
    r->cfg.sched = sched;
    r->cfg.doorbell = doorbell;
    r->cfg.links = links;
    atomic_store(&r->loaded, true); /* publishes cfg.sched, cfg.doorbell, cfg.links and *served to
                                       the queue threads */
}

void moed_rpc_set_serving(moed_rpc *r, bool serving)
{
    int s = serving ? HEALTH_SERVING : HEALTH_NOT_SERVING;
    pthread_mutex_lock(&r->live_lock);
    bool changed = r->serving != s;
    r->serving = s;
    pthread_mutex_unlock(&r->live_lock);
    if (changed) for_each_live(r, tell_health, s);
}

static void on_shutdown(rpc_tag *t, bool ok)
{
    moed_rpc *r = moed_container_of(t, moed_rpc, shutdown_tag);
    pthread_mutex_lock(&r->live_lock);
    r->shut_down = true;
    pthread_cond_broadcast(&r->shut_cond);
    pthread_mutex_unlock(&r->live_lock);
    if (r->on_drained) r->on_drained(r->drained_arg);
}

/* The second half of the drain, once (from the last call to finish, or from the drain itself when
 * nothing is in flight): gRPC stops accepting and reports when every call and connection is gone.
 * The connections are closed at once: no call is left on them to wait for, and gRPC would
 * otherwise wait for each client to close its own, or to answer the ping of its GOAWAY (up to the
 * keepalive timeout), which an idle client that reads nothing never does. */
static void shutdown_now(moed_rpc *r)
{
    if (atomic_exchange(&r->shutting, true)) return;
    moed_unix_stop(r->unix_listener);
    grpc_server_shutdown_and_notify(r->server, r->cqs[0].cq, &r->shutdown_tag);
    grpc_server_cancel_all_calls(r->server);
}

/* The second half waits for no call in flight and none arriving for DRAIN_QUIET_NS: a call on its
 * way when gRPC core shuts down is cancelled by it, and its caller would see CANCELLED. Callers
 * told UNAVAILABLE (and watchers told NOT_SERVING) stop sending; those that never do are cut short
 * by --drain-timeout. With no connection open on a TCP listener no call can be on its way (one on a
 * connection not yet accepted fails UNAVAILABLE at its client), so the wait ends there too: a
 * supervisor stopping a daemon its clients have left waits for nothing. A unix listener's
 * connections are not counted, and always wait. */
static void maybe_shutdown(moed_rpc *r)
{
    if (atomic_load(&r->active) == 0 &&
        (moed_now_ns() - atomic_load(&r->last_call_ns) >= DRAIN_QUIET_NS ||
         (r->port > 0 && moed_peers_connections(r->port) == 0)))
        shutdown_now(r);
}

/* Draining has two halves. First the server keeps accepting calls, so that a new Forward on an
 * open connection is answered UNAVAILABLE with a message instead of being cancelled by gRPC core,
 * while every call in flight finishes; streams and watches are told to end. When the last one is
 * gone and callers have gone quiet, the gRPC server shuts down (maybe_shutdown). */
void moed_rpc_drain(moed_rpc *r, void (*on_drained)(void *arg), void *arg)
{
    if (atomic_exchange(&r->draining, true)) return;
    moed_rpc_set_serving(r, false);
    r->on_drained = on_drained;
    r->drained_arg = arg;
    /* Streams first: region sessions end (no more command is answered) before a request that
     * waited in a merge window is answered, so no caller sees its session outlive the drain. */
    for_each_live(r, tell_drain, 0);
    if (r->cfg.sched) moed_sched_flush(r->cfg.sched); /* calls in a merge window launch now */
    maybe_shutdown(r);
}

void moed_rpc_cancel_all(moed_rpc *r)
{
    if (!atomic_load(&r->draining)) return;
    shutdown_now(r); /* which cancels every call */
    /* gRPC's reading threads may still be parsing what flooding connections sent (they leave a
     * connection only once it is closed), and the server cannot finish shutting down meanwhile */
    int n = r->port > 0 ? moed_peers_disconnect(NULL, r->port) : 0;
    if (n) moed_log_info("connections reset", "reason=\"drain cut short\" connections=%d", n);
}

void moed_rpc_destroy(moed_rpc *r)
{
    if (!r) return;
    /* Started servers come here after the shutdown tag, or (a start that failed while the weights
     * loaded: nothing drained them) are shut down now; unstarted ones have no calls. Then each
     * queue hands back its last events (unfilled requests) before its thread ends. */
    if (r->started) {
        shutdown_now(r);
        pthread_mutex_lock(&r->live_lock);
        while (!r->shut_down) pthread_cond_wait(&r->shut_cond, &r->live_lock);
        pthread_mutex_unlock(&r->live_lock);
    }
    if (r->server) grpc_server_destroy(r->server);
    for (int i = 0; i < r->n_cqs; i++) grpc_completion_queue_shutdown(r->cqs[i].cq);
    for (int i = 0; i < r->n_cqs; i++) {
        if (r->cqs[i].started)
            pthread_join(r->cqs[i].thread, NULL);
        else
            cq_main(&r->cqs[i]);
        grpc_completion_queue_destroy(r->cqs[i].cq);
    }
    free(r->cqs);
    moed_unix_free(r->unix_listener);
    moed_peers_destroy(r->peers);
    pthread_mutex_destroy(&r->live_lock);
    pthread_cond_destroy(&r->shut_cond);
    free(r);
    /* Once this returns no gRPC code may run: its executor destroys a call's stream, and with it a
     * reply slice whose destroy callback hands a buffer back to the staging pool, which teardown
     * frees next (seen under ASan: moed_bufpool_put on the freed pool). grpc_shutdown_blocking
     * drops moed's reference to gRPC, but every connection's server-side channel holds one of its
     * own until its transport is gone, which after a drain cut short (connections reset) can
     * outlive the server: the last channel then shuts gRPC down on a thread of its own, later.
     * So wait for that too: grpc_is_initialized takes the lock the clean-up holds throughout. */
    grpc_shutdown_blocking();
    const uint64_t until = moed_now_ns() + GRPC_GONE_WAIT_NS;
    while (grpc_is_initialized()) {
        if (moed_now_ns() >= until) {
            moed_log_warn("grpc still running",
                          "why=\"a connection's transport outlived the server by %d s\"",
                          (int)(GRPC_GONE_WAIT_NS / 1000000000));
            break;
        }
        moed_sleep_s(GRPC_GONE_POLL_S);
    }
}

void moed_rpc_get_stats(moed_rpc *r, moed_rpc_stats *out)
{
    for (int m = 0; m < M_COUNT; m++) out->calls[m] = atomic_load(&r->calls[m]);
    out->forwards = atomic_load(&r->forwards);
    for (int i = 0; i < MOED_GRPC_STATUS_COUNT; i++)
        out->by_status[i] = atomic_load(&r->by_status[i]);
    out->active_calls = atomic_load(&r->active);
    out->connections_closed = atomic_load(&r->closed);
}
