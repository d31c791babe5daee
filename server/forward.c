/*
 * forward — the Forward (unary) and ForwardStream (bidirectional) methods.
 *
 * Both do the same per request: open the payload's slices, decode (wire.c), validate (request.c),
 * queue (scheduler.c); the scheduler's worker calls back once the output is complete where it
 * goes, and the reply is built around it (wire.c's three-slice reply): its data slice is the
 * staging-pool buffer the backend wrote into, or a fresh copy when the pool had no room, or none
 * when the output went to a region.
 *
 * The stream keeps reading while earlier requests compute (they may even run in different
 * launches and finish out of order) and replies strictly in request order: replies wait in a
 * FIFO, and the head goes out as soon as it is ready and no send is in flight (gRPC allows one
 * at a time). A bounded number of requests per stream may be open, so a fast sender is slowed by
 * HTTP/2 flow control instead of filling memory. The first error ends the stream with its status,
 * after the replies to every earlier request.
 */
#include "rpc_call.h"

#include "log.h"
#include "moed_dtype.h"
#include "moed_list.h"
#include "request.h"
#include "scheduler.h"
#include "wire.h"

#include <stdlib.h>
#include <string.h>

/* Requests one stream may have decoded but not yet answered. */
#define STREAM_WINDOW 16

static int call_principal(void *c, moed_principal *out, moed_error *err)
{
    return rpc_principal(c, out, err);
}

/* Decodes and validates a payload of call c into w; errors name what is wrong. */
static int prepare(rpc_call *c, grpc_byte_buffer *payload, moed_wire_msg *msg, moed_work *w,
                   moed_error *err)
{
    moed_wire_request q;
    const moed_caller who = { .local = c->local, .principal = call_principal, .ctx = c };
    int rc = moed_wire_msg_open(msg, payload, err);
    if (!rc) rc = moed_wire_decode_request(msg->slices, msg->n_slices, &q, err);
    if (!rc) rc = moed_request_validate(c->rpc->cfg.served, &who, &q, w, err);
    return rc;
}

/* The reply message for a finished request, its output where the request asked for it; NULL and
 * err when that failed (a region that shrank) or memory ran out. */
static grpc_byte_buffer *encode_reply(moed_work *w, const moed_sched_result *res, moed_error *err)
{
    const moed_sched_item *it = &w->item;
    grpc_slice out;
    const moed_wire_ref *ref;
    if (moed_work_output(w, res->y, res->y_bytes, &out, &ref, err)) return NULL;
    moed_wire_response resp = { .request_id = w->request_id,
                                .request_id_len = w->request_id_len,
                                .dtype = it->dtype,
                                .rows = it->T,
                                .cols = it->layer->info.d_model,
                                .expert_set = res->expert_set,
                                .n_expert_set = res->n_expert_set,
                                .timings = res->timings,
                                .out_region = ref };
    grpc_byte_buffer *bb = moed_wire_encode_response(&resp, out);
    if (!bb) moed_fail(err, MOED_ENOMEM, "out of memory for the reply");
    return bb;
}

static void log_failure(const moed_work *w, const moed_error *err)
{
    if (moed_log_enabled(MOED_LOG_DEBUG))
        moed_log_debug("forward failed", "request_id=\"%.*s\" code=%d status=%d reason=\"%s\"",
                       (int)w->request_id_len, w->request_id, err->code,
                       moed_err_grpc_status(err->code), err->msg);
}

/* ---- Forward --------------------------------------------------------------------------------- */

typedef struct fwd_call {
    rpc_call base;
    moed_wire_msg msg;
    moed_work work;
} fwd_call;

static void fwd_release_request(fwd_call *f)
{
    moed_work_free(&f->work);
    moed_wire_msg_close(&f->msg);
    if (f->base.payload) grpc_byte_buffer_destroy(f->base.payload);
    f->base.payload = NULL;
}

/* On a worker thread (or, for a cancelled request, the thread that cancelled it). */
static void fwd_done(moed_sched_item *it, const moed_sched_result *res)
{
    fwd_call *f = it->user;
    moed_error err = { 0 };
    grpc_byte_buffer *bb = NULL;
    if (!res->status && (bb = encode_reply(&f->work, res, &err))) {
        rpc_reply(&f->base, bb, GRPC_STATUS_OK, NULL);
    } else if (!res->status) {
        log_failure(&f->work, &err);
        rpc_reply_error(&f->base, &err);
    } else if (res->status != MOED_ECANCELLED) {
        log_failure(&f->work, res->err);
        rpc_reply_error(&f->base, res->err);
    } else { /* a cancelled call has no one to answer, but it counts */
        rpc_count(&f->base, GRPC_STATUS_CANCELLED, f->base.t_received_ns, f->base.payload, NULL);
    }
    fwd_release_request(f);
    rpc_call_unref(&f->base); /* the scheduler's reference */
}

static void fwd_closed(rpc_call *c)
{
    fwd_call *f = (fwd_call *)c;
    if (c->cancelled) moed_sched_cancel(c->rpc->cfg.sched, &f->work.item);
}

static void fwd_start(rpc_call *c)
{
    fwd_call *f = (fwd_call *)c;
    moed_rpc *r = c->rpc;
    moed_error err = { 0 };
    rpc_post_close(c, fwd_closed);
    int rc = prepare(c, c->payload, &f->msg, &f->work, &err);
    if (!rc) {
        moed_sched_item *it = &f->work.item;
        it->done = fwd_done;
        it->user = f;
        it->t_received_ns = c->t_received_ns;
        it->deadline_ns = rpc_deadline_ns(c);
        it->owner = rpc_call_owner(c);
        rpc_call_ref(c); /* held by the scheduler until fwd_done */
        if ((rc = moed_sched_submit(r->cfg.sched, it, &err))) rpc_call_unref(c);
    }
    if (rc) {
        log_failure(&f->work, &err);
        rpc_reply_error(c, &err);
        fwd_release_request(f);
    }
}

static void fwd_destroy(rpc_call *c)
{
    fwd_release_request((fwd_call *)c);
}

const rpc_method moed_forward_method = { .path = "/moed.v1.Moed/Forward",
                                         .size = sizeof(fwd_call),
                                         .read_payload = true,
                                         .start = fwd_start,
                                         .destroy = fwd_destroy };

/* ---- ForwardStream --------------------------------------------------------------------------- */

/* A request of the stream: computing, answered (its reply waits for its turn), or failed. */
enum { E_WAITING, E_READY, E_FAILED };

/* The read side: whether the stream asks gRPC for the client's next request. */
typedef enum stream_read {
    READ_POSTED,  /* a RECV_MESSAGE is posted */
    READ_PAUSED,  /* STREAM_WINDOW requests are open: the next read is posted as replies go */
    READ_STOPPED, /* nothing more is read: an error is queued, or the stream is ending */
    READ_EOF      /* the client sent its last request (or the call ended) */
} stream_read;

/* The send side: gRPC allows one send at a time. */
typedef enum stream_send {
    SEND_FIRST, /* nothing sent yet: the initial metadata goes with the first send */
    SEND_IDLE,
    SEND_BUSY, /* a reply is in flight */
    SEND_ENDED /* the status is sent, or the call broke or was cancelled: nothing more goes */
} stream_send;

typedef struct stream_call stream_call;

typedef struct entry {
    moed_list node; /* on the stream's entries */
    stream_call *s;
    int state;
    grpc_byte_buffer *payload;
    moed_wire_msg msg;
    moed_work work;
    grpc_byte_buffer *reply; /* E_READY */
    moed_error err;          /* E_FAILED */
} entry;

struct stream_call {
    rpc_call base;
    pthread_mutex_t lock; /* everything below, and the entries */
    rpc_tag on_recv, on_send;
    grpc_byte_buffer *recv_bb;
    moed_list entries; /* of entry.node, in request order */
    int open;          /* entries not yet sent */
    stream_read read;
    stream_send send;
    bool draining;               /* the server drains: no new request, end once idle */
    grpc_byte_buffer *in_flight; /* the reply being sent */
    grpc_slice details;
};

static void entry_free(entry *e)
{
    moed_work_free(&e->work);
    moed_wire_msg_close(&e->msg);
    if (e->payload) grpc_byte_buffer_destroy(e->payload);
    if (e->reply) grpc_byte_buffer_destroy(e->reply);
    free(e);
}

static void stream_post_recv(stream_call *s)
{
    grpc_op op = { .op = GRPC_OP_RECV_MESSAGE };
    op.data.recv_message.recv_message = &s->recv_bb;
    s->read = READ_POSTED;
    rpc_start_batch(&s->base, &op, 1, &s->on_recv);
}

/* Starts one send (under s->lock), with the initial metadata if none went yet. */
static void stream_send_op(stream_call *s, const grpc_op *op)
{
    grpc_op ops[2];
    size_t n = 0;
    memset(ops, 0, sizeof ops);
    if (s->send == SEND_FIRST) ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[n++] = *op;
    s->send = op->op == GRPC_OP_SEND_STATUS_FROM_SERVER ? SEND_ENDED : SEND_BUSY;
    rpc_start_batch(&s->base, ops, n, &s->on_send);
}

/* Sends the head's reply; the entry is done with. */
static void stream_send_reply(stream_call *s, entry *e)
{
    moed_list_remove(&e->node);
    s->open--;
    s->in_flight = e->reply;
    e->reply = NULL;
    entry_free(e);
    grpc_op op = { .op = GRPC_OP_SEND_MESSAGE };
    op.data.send_message.send_message = s->in_flight;
    stream_send_op(s, &op);
}

/* Ends the stream with a status. */
static void stream_send_status(stream_call *s, int status, const char *text)
{
    s->details = grpc_slice_from_copied_string(text);
    grpc_op op = { .op = GRPC_OP_SEND_STATUS_FROM_SERVER };
    op.data.send_status_from_server.status = (grpc_status_code)status;
    op.data.send_status_from_server.status_details = &s->details;
    stream_send_op(s, &op);
}

/* Starts the next send the stream's state allows (under s->lock): the head's reply when it is
 * ready, or the status that ends the stream — the head's error, OK once the client is done and
 * every reply went, UNAVAILABLE when the server drains and nothing is open. */
static void stream_pump(stream_call *s)
{
    if (s->send == SEND_BUSY || s->send == SEND_ENDED) return;
    entry *e = moed_list_empty(&s->entries)
                   ? NULL
                   : moed_list_data(moed_list_head(&s->entries), entry, node);
    if (e && e->state == E_READY)
        stream_send_reply(s, e);
    else if (e && e->state == E_FAILED)
        stream_send_status(s, moed_err_grpc_status(e->err.code), e->err.msg);
    else if (!e && s->read == READ_EOF)
        stream_send_status(s, GRPC_STATUS_OK, "");
    else if (!e && s->draining)
        stream_send_status(s, GRPC_STATUS_UNAVAILABLE,
                           "the server is draining (shutting down); open a new stream to another "
                           "server");
    /* else the head is still computing, or the client may send more */
}

static void stream_on_send(rpc_tag *t, bool ok)
{
    stream_call *s = moed_container_of(t, stream_call, on_send);
    pthread_mutex_lock(&s->lock);
    if (s->send == SEND_BUSY) s->send = ok ? SEND_IDLE : SEND_ENDED; /* !ok: the stream broke */
    if (s->in_flight) {
        rpc_hold(&s->base, -(int64_t)grpc_byte_buffer_length(s->in_flight));
        grpc_byte_buffer_destroy(s->in_flight);
    }
    s->in_flight = NULL;
    if (s->read == READ_PAUSED && s->open < STREAM_WINDOW && s->send != SEND_ENDED)
        stream_post_recv(s);
    stream_pump(s);
    pthread_mutex_unlock(&s->lock);
    rpc_call_unref(&s->base);
}

static void stream_done(moed_sched_item *it, const moed_sched_result *res)
{
    entry *e = it->user;
    stream_call *s = e->s;
    moed_error err = { 0 };
    grpc_byte_buffer *bb = res->status ? NULL : encode_reply(&e->work, res, &err);
    pthread_mutex_lock(&s->lock);
    if (bb) {
        e->state = E_READY;
        e->reply = bb;
        rpc_hold(&s->base, (int64_t)grpc_byte_buffer_length(bb));
    } else {
        e->state = E_FAILED;
        e->err = res->status ? *res->err : err;
    }
    if (!bb && res->status != MOED_ECANCELLED) log_failure(&e->work, &e->err);
    rpc_count(&s->base, bb ? GRPC_STATUS_OK : moed_err_grpc_status(e->err.code), it->t_received_ns,
              e->payload, bb);
    /* The request's memory is no longer needed; only its reply waits for its turn. */
    moed_work_free(&e->work);
    moed_wire_msg_close(&e->msg);
    grpc_byte_buffer_destroy(e->payload);
    e->payload = NULL;
    stream_pump(s);
    pthread_mutex_unlock(&s->lock);
    rpc_call_unref(&s->base); /* the scheduler's reference */
}

/* A request arrived on the stream (under s->lock): queue it, or queue its error. Returns whether
 * the stream may read on (false once an error is queued). */
static bool stream_accept(stream_call *s, grpc_byte_buffer *payload)
{
    moed_rpc *r = s->base.rpc;
    uint64_t t_received = moed_now_ns();
    entry *e = calloc(1, sizeof *e);
    if (!e) {
        grpc_byte_buffer_destroy(payload);
        grpc_call_cancel_with_status(s->base.call, GRPC_STATUS_RESOURCE_EXHAUSTED,
                                     "out of memory for a stream request", NULL);
        return false;
    }
    e->s = s;
    e->payload = payload;
    e->state = E_WAITING;
    int rc;
    if (s->draining)
        rc = moed_fail(&e->err, MOED_EDRAINING,
                       "the server is draining (shutting down); open a new stream to another "
                       "server");
    else if (!(rc = rpc_inflate(&s->base, &e->payload, &e->err)))
        rc = prepare(&s->base, e->payload, &e->msg, &e->work, &e->err);
    moed_sched_item *it = &e->work.item;
    it->t_received_ns = t_received; /* after prepare, which clears the item */
    if (!rc) {
        it->done = stream_done;
        it->user = e;
        it->deadline_ns = rpc_deadline_ns(&s->base);
        it->owner = rpc_call_owner(&s->base);
        rpc_call_ref(&s->base);
        if ((rc = moed_sched_submit(r->cfg.sched, it, &e->err))) rpc_call_unref(&s->base);
    }
    if (rc) {
        log_failure(&e->work, &e->err);
        rpc_count(&s->base, moed_err_grpc_status(rc), t_received, e->payload, NULL);
        e->state = E_FAILED;
    }
    moed_list_insert_tail(&s->entries, &e->node);
    s->open++;
    return !rc;
}

static void stream_on_recv(rpc_tag *t, bool ok)
{
    stream_call *s = moed_container_of(t, stream_call, on_recv);
    pthread_mutex_lock(&s->lock);
    grpc_byte_buffer *bb = s->recv_bb;
    s->recv_bb = NULL;
    if (ok && bb) rpc_call_read(&s->base);
    if (!ok || !bb) {
        s->read = READ_EOF;
        if (bb) grpc_byte_buffer_destroy(bb);
    } else if (s->send == SEND_ENDED) {
        s->read = READ_STOPPED;
        grpc_byte_buffer_destroy(bb);
    } else if (!stream_accept(s, bb)) {
        s->read = READ_STOPPED; /* no request after an error is read */
    } else if (s->open < STREAM_WINDOW) {
        stream_post_recv(s);
    } else {
        s->read = READ_PAUSED;
    }
    stream_pump(s);
    pthread_mutex_unlock(&s->lock);
    rpc_call_unref(&s->base);
}

static void stream_closed(rpc_call *c)
{
    stream_call *s = (stream_call *)c;
    if (!c->cancelled) return;
    /* Take the queued requests out of the scheduler. Entries are not freed once the send side has
     * ended (see stream_pump), so the items stay valid after the lock is let go; cancel may call
     * stream_done, which takes the lock. */
    pthread_mutex_lock(&s->lock);
    s->send = SEND_ENDED;
    int n = 0;
    moed_list *q;
    moed_list_foreach (q, &s->entries) n += moed_list_data(q, entry, node)->state == E_WAITING;
    moed_sched_item **items = n ? malloc((size_t)n * sizeof *items) : NULL;
    int k = 0;
    if (items) {
        moed_list_foreach (q, &s->entries) {
            entry *e = moed_list_data(q, entry, node);
            if (e->state == E_WAITING) items[k++] = &e->work.item;
        }
    }
    pthread_mutex_unlock(&s->lock);
    for (int i = 0; i < k; i++) moed_sched_cancel(c->rpc->cfg.sched, items[i]);
    free(items);
}

static void stream_start(rpc_call *c)
{
    stream_call *s = (stream_call *)c;
    pthread_mutex_init(&s->lock, NULL);
    moed_list_init(&s->entries);
    s->details = grpc_empty_slice();
    s->on_recv.fn = stream_on_recv;
    s->on_send.fn = stream_on_send;
    rpc_live_add(c);
    rpc_post_close(c, stream_closed);
    pthread_mutex_lock(&s->lock);
    s->draining = atomic_load(&c->rpc->draining);
    if (s->draining)
        s->read = READ_STOPPED;
    else
        stream_post_recv(s);
    stream_pump(s);
    pthread_mutex_unlock(&s->lock);
}

static void stream_drain(rpc_call *c)
{
    stream_call *s = (stream_call *)c;
    pthread_mutex_lock(&s->lock);
    s->draining = true;
    stream_pump(s);
    pthread_mutex_unlock(&s->lock);
}

static void stream_destroy(rpc_call *c)
{
    stream_call *s = (stream_call *)c;
    while (!moed_list_empty(&s->entries)) {
        entry *e = moed_list_data(moed_list_head(&s->entries), entry, node);
        moed_list_remove(&e->node);
        entry_free(e);
    }
    if (s->recv_bb) grpc_byte_buffer_destroy(s->recv_bb);
    if (s->in_flight) grpc_byte_buffer_destroy(s->in_flight);
    grpc_slice_unref(s->details);
    pthread_mutex_destroy(&s->lock);
}

const rpc_method moed_stream_method = { .path = "/moed.v1.Moed/ForwardStream",
                                        .size = sizeof(stream_call),
                                        .read_payload = false,
                                        .start = stream_start,
                                        .drain = stream_drain,
                                        .destroy = stream_destroy };
