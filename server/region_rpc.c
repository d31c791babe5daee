/*
 * region_rpc — the Regions stream (a region session) and ListRegions.
 *
 * A session is one bidirectional stream: each RegionCommand is carried out on arrival (on the
 * call's completion-queue thread; mapping a region is a few system calls, or a CUDA IPC open) and
 * answered by one RegionEvent, in order, one send at a time. The stream is the regions' lease:
 * whenever it ends — the client closes its side, cancels, dies, its connection drops, or the
 * server drains — the session is closed, which closes its doorbell rings (doorbell.h) and NCCL
 * links (link.h) and releases
 * every region registered on it (region.h: unknown at once, unmapped after the last request that
 * holds it).
 *
 * Refused at the start, with FAILED_PRECONDITION and the reason: regions off (--regions off), a
 * peer beyond this host under --regions local, or a caller without a principal (caller.c). While
 * draining, a new session ends at once with UNAVAILABLE, and open ones end so once their events
 * are sent: an idle session at once.
 */
#include "rpc_call.h"

#include "region.h"
#include "region_cmd.h"
#include "wire.h"

#include <grpc/byte_buffer_reader.h>

#include "moed/v1/moed.pb-c.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Events a session may have waiting to be sent before it stops reading commands. */
#define EVENT_WINDOW 16

typedef struct event {
    moed_list node;
    grpc_byte_buffer *bb;
} event;

typedef struct regions_call {
    rpc_call base;
    pthread_mutex_t lock; /* everything below */
    rpc_tag on_recv, on_send;
    grpc_byte_buffer *recv_bb;
    moed_list events; /* of event.node: answers waiting to be sent, in order */
    int n_events;
    bool reading;   /* a RECV_MESSAGE is posted */
    bool done;      /* no command is read any more: the client's end, an error or the drain */
    int end_status; /* the status sent once the events are: OK, or UNAVAILABLE (drain) */
    bool md_sent, sending, status_sent, broken;
    grpc_byte_buffer *in_flight;
    grpc_slice details;
    moed_region_session *session; /* NULL once closed */
} regions_call;

static moed_regions *registry(const rpc_call *c)
{
    return c->rpc->cfg.served->regions;
}

static moed_doorbell *doorbell(const rpc_call *c)
{
    return c->rpc->cfg.doorbell;
}

static moed_links *links(const rpc_call *c)
{
    return c->rpc->cfg.links;
}

/* Ends the lease (under the call's lock): every ring, link and region of the session is
 * released. */
static void end_session(regions_call *rc)
{
    moed_doorbell_close_session(doorbell(&rc->base), rc->session);
    moed_links_close_session(links(&rc->base), rc->session);
    moed_regions_close_session(registry(&rc->base), rc->session);
    rc->session = NULL;
}

/* Sends the next event, or the status once none is left and no more command comes (under lock). */
static void pump(regions_call *rc)
{
    if (rc->sending || rc->status_sent || rc->broken) return;
    grpc_op ops[2];
    size_t n = 0;
    memset(ops, 0, sizeof ops);
    if (rc->n_events) {
        event *e = moed_list_data(moed_list_head(&rc->events), event, node);
        moed_list_remove(&e->node);
        rc->n_events--;
        rc->in_flight = e->bb;
        free(e);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = rc->in_flight;
    } else if (rc->done) {
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = (grpc_status_code)rc->end_status;
        ops[n++].data.send_status_from_server.status_details = &rc->details;
        rc->status_sent = true;
    } else {
        return;
    }
    if (!rc->md_sent) {
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
        rc->md_sent = true;
    }
    rc->sending = true;
    rpc_start_batch(&rc->base, ops, n, &rc->on_send);
}

static void post_recv(regions_call *rc)
{
    grpc_op op = { .op = GRPC_OP_RECV_MESSAGE };
    op.data.recv_message.recv_message = &rc->recv_bb;
    rc->reading = true;
    rpc_start_batch(&rc->base, &op, 1, &rc->on_recv);
}

/* No more commands are read; the stream ends with status (and details) once its events are sent
 * (under lock). */
static void finish(regions_call *rc, int status, const char *details)
{
    if (rc->done) return;
    rc->done = true;
    rc->end_status = status;
    grpc_slice_unref(rc->details);
    rc->details = grpc_slice_from_copied_string(details);
    end_session(rc);
    pump(rc);
}

/* ---- commands -------------------------------------------------------------------------------- */

/* The event answering one received command (region_cmd.c carries it out). */
static grpc_byte_buffer *answer(regions_call *rc, grpc_byte_buffer *bb, int *status)
{
    grpc_byte_buffer_reader rd;
    grpc_slice all = grpc_empty_slice();
    size_t n = grpc_byte_buffer_length(bb);
    if (n <= MOED_REGION_CMD_MAX && grpc_byte_buffer_reader_init(&rd, bb)) {
        all = grpc_byte_buffer_reader_readall(&rd);
        grpc_byte_buffer_reader_destroy(&rd);
    }
    size_t len;
    uint8_t *ev =
        moed_region_command(registry(&rc->base), doorbell(&rc->base), links(&rc->base), rc->session,
                            GRPC_SLICE_START_PTR(all),
                            n <= MOED_REGION_CMD_MAX ? GRPC_SLICE_LENGTH(all) : n, &len, status);
    grpc_slice_unref(all);
    if (!ev) return NULL;
    grpc_slice sl = grpc_slice_new(ev, len, free);
    grpc_byte_buffer *out = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    return out;
}

/* ---- the stream --------------------------------------------------------------------------------
 */

static void on_recv(rpc_tag *t, bool ok)
{
    regions_call *rc = moed_container_of(t, regions_call, on_recv);
    pthread_mutex_lock(&rc->lock); /* held while the command runs: the drain may end the session */
    grpc_byte_buffer *bb = rc->recv_bb;
    rc->recv_bb = NULL;
    rc->reading = false;
    if (ok && bb) rpc_call_read(&rc->base);
    int status = 0;
    moed_error err;
    const bool unread = ok && bb && !rc->done && rpc_inflate(&rc->base, &bb, &err);
    grpc_byte_buffer *out = ok && bb && !rc->done && !unread ? answer(rc, bb, &status) : NULL;
    if (!ok || !bb) {
        finish(rc, GRPC_STATUS_OK, ""); /* the client closed its side: the lease ends */
    } else if (unread) {
        rpc_count(&rc->base, moed_err_grpc_status(err.code), 0, NULL, NULL);
        finish(rc, moed_err_grpc_status(err.code), err.msg);
    } else if (!rc->done) {
        rpc_count(&rc->base, out ? status : GRPC_STATUS_RESOURCE_EXHAUSTED, 0, NULL, NULL);
        event *e = out ? calloc(1, sizeof *e) : NULL;
        if (!e) {
            if (out) grpc_byte_buffer_destroy(out);
            finish(rc, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory for a region event");
        } else {
            e->bb = out;
            moed_list_insert_tail(&rc->events, &e->node);
            rc->n_events++;
            if (rc->n_events < EVENT_WINDOW) post_recv(rc);
        }
    }
    if (bb) grpc_byte_buffer_destroy(bb);
    pump(rc);
    pthread_mutex_unlock(&rc->lock);
    rpc_call_unref(&rc->base);
}

static void on_send(rpc_tag *t, bool ok)
{
    regions_call *rc = moed_container_of(t, regions_call, on_send);
    pthread_mutex_lock(&rc->lock);
    rc->sending = false;
    if (rc->in_flight) grpc_byte_buffer_destroy(rc->in_flight);
    rc->in_flight = NULL;
    if (!ok) rc->broken = true; /* the stream broke: on_closed ends the lease */
    if (!rc->done && !rc->reading && !rc->broken && rc->n_events < EVENT_WINDOW) post_recv(rc);
    pump(rc);
    pthread_mutex_unlock(&rc->lock);
    rpc_call_unref(&rc->base);
}

/* The call is over, however it ended: the lease ends with it. */
static void on_closed(rpc_call *c)
{
    regions_call *rc = (regions_call *)c;
    pthread_mutex_lock(&rc->lock);
    rc->done = true;
    end_session(rc);
    pthread_mutex_unlock(&rc->lock);
}

static void regions_drain(rpc_call *c)
{
    regions_call *rc = (regions_call *)c;
    pthread_mutex_lock(&rc->lock);
    finish(rc, GRPC_STATUS_UNAVAILABLE,
           "the server is draining (shutting down); its regions are released: register them with "
           "another server");
    pthread_mutex_unlock(&rc->lock);
}

/* Whether this caller may use regions, and as whom: 0 and *who, or FAILED_PRECONDITION saying
 * why not. */
static int admit(rpc_call *c, moed_principal *who, moed_error *err)
{
    int mode = moed_regions_mode(registry(c));
    if (mode == MOED_REGIONS_OFF)
        return moed_fail(err, MOED_EPRECOND,
                         "this server has regions off (--regions off): send tensors inline");
    if (mode == MOED_REGIONS_LOCAL && !c->local)
        return moed_fail(err, MOED_EPRECOND,
                         "regions are for callers on the server's own host (loopback or a unix "
                         "socket; --regions local): send tensors inline");
    return rpc_principal(c, who, err);
}

static void regions_start(rpc_call *c)
{
    regions_call *rc = (regions_call *)c;
    pthread_mutex_init(&rc->lock, NULL);
    moed_list_init(&rc->events);
    rc->details = grpc_empty_slice();
    rc->on_recv.fn = on_recv;
    rc->on_send.fn = on_send;
    rc->end_status = GRPC_STATUS_OK;
    moed_principal who;
    moed_error err;
    if (admit(c, &who, &err)) {
        int status = moed_err_grpc_status(err.code);
        rpc_count(c, status, 0, NULL, NULL);
        grpc_call_cancel_with_status(c->call, (grpc_status_code)status, err.msg, NULL);
        return;
    }
    rpc_live_add(c);
    rpc_post_close(c, on_closed);
    pthread_mutex_lock(&rc->lock);
    rc->session = moed_regions_open_session(registry(c), who);
    if (!rc->session)
        finish(rc, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory for a region session");
    else if (atomic_load(&c->rpc->draining))
        finish(rc, GRPC_STATUS_UNAVAILABLE,
               "the server is draining (shutting down); open the session on another server");
    else
        post_recv(rc);
    pthread_mutex_unlock(&rc->lock);
}

static void regions_destroy(rpc_call *c)
{
    regions_call *rc = (regions_call *)c;
    end_session(rc);
    while (!moed_list_empty(&rc->events)) {
        event *e = moed_list_data(moed_list_head(&rc->events), event, node);
        moed_list_remove(&e->node);
        grpc_byte_buffer_destroy(e->bb);
        free(e);
    }
    if (rc->recv_bb) grpc_byte_buffer_destroy(rc->recv_bb);
    if (rc->in_flight) grpc_byte_buffer_destroy(rc->in_flight);
    grpc_slice_unref(rc->details);
    pthread_mutex_destroy(&rc->lock);
}

const rpc_method moed_regions_method = { .path = "/moed.v1.Moed/Regions",
                                         .size = sizeof(regions_call),
                                         .read_payload = false,
                                         .start = regions_start,
                                         .drain = regions_drain,
                                         .destroy = regions_destroy };

/* ---- ListRegions ------------------------------------------------------------------------------
 */

/* Regions off: an empty list, as ever; a caller without a principal: FAILED_PRECONDITION. */
static void list_start(rpc_call *c)
{
    moed_region_info *infos = NULL;
    int n = 0;
    moed_error err = { 0 };
    moed_regions *r = registry(c);
    moed_principal who;
    if (r && (admit(c, &who, &err) || moed_regions_list(r, who, &infos, &n, &err))) {
        rpc_reply_error(c, &err);
        return;
    }
    Moed__V1__RegionList list = MOED__V1__REGION_LIST__INIT;
    Moed__V1__Region *rs = calloc((size_t)n + 1, sizeof *rs);
    Moed__V1__Region **rp = calloc((size_t)n + 1, sizeof *rp);
    grpc_byte_buffer *bb = NULL;
    if (rs && rp) {
        for (int i = 0; i < n; i++) {
            moed_region_to_proto(&infos[i], &rs[i]);
            rp[i] = &rs[i];
        }
        list.n_regions = (size_t)n;
        list.regions = rp;
        bb = moed_wire_pack(&list.base);
    }
    if (bb)
        rpc_reply(c, bb, GRPC_STATUS_OK, NULL);
    else
        rpc_reply(c, NULL, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory listing regions");
    free(rs);
    free(rp);
    free(infos);
}

const rpc_method moed_list_regions_method = { .path = "/moed.v1.Moed/ListRegions",
                                              .size = sizeof(rpc_call),
                                              .read_payload = true,
                                              .start = list_start };
