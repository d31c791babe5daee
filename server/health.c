/*
 * health — grpc.health.v1.Health, Check and Watch, as the standard health protocol states them,
 * so grpc_health_probe, Kubernetes' gRPC probes and grpc's client-side health checks work.
 *
 * Services known: "" (the whole server) and "moed.v1.Moed"; both share the server's status,
 * SERVING once every layer is resident and NOT_SERVING while draining. Check on another name
 * answers NOT_FOUND; Watch on another name streams SERVICE_UNKNOWN (and stays open, as the
 * protocol asks). A Watch sends the status at once and every change after; when the server drains
 * it sends NOT_SERVING and then ends, so the drain is not held up by watchers.
 */
#include "rpc_call.h"

#include "wire.h"

#include "grpc/health/v1/health.pb-c.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool known_service(const char *name)
{
    return !strcmp(name, "") || !strcmp(name, "moed.v1.Moed");
}

/* The request's service name (owned by *req), or NULL with err filled. */
static const char *read_service(rpc_call *c, ProtobufCMessage **req, moed_error *err)
{
    if (moed_wire_unpack(&grpc__health__v1__health_check_request__descriptor, c->payload, req, err))
        return NULL;
    return ((Grpc__Health__V1__HealthCheckRequest *)*req)->service;
}

static grpc_byte_buffer *status_message(int status)
{
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)status;
    return moed_wire_pack(&resp.base);
}

/* ---- Check ----------------------------------------------------------------------------------- */

static void check_start(rpc_call *c)
{
    ProtobufCMessage *req = NULL;
    moed_error err;
    const char *service = read_service(c, &req, &err);
    if (!service) {
        rpc_reply_error(c, &err);
    } else if (!known_service(service)) {
        char msg[320];
        snprintf(msg, sizeof msg,
                 "unknown service '%.200s': moed answers for \"\" and "
                 "\"moed.v1.Moed\"",
                 service);
        rpc_reply(c, NULL, GRPC_STATUS_NOT_FOUND, msg);
    } else {
        grpc_byte_buffer *bb = status_message(rpc_health_status(c->rpc));
        if (bb)
            rpc_reply(c, bb, GRPC_STATUS_OK, NULL);
        else
            rpc_reply(c, NULL, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    }
    if (req) protobuf_c_message_free_unpacked(req, NULL);
}

const rpc_method moed_check_method = { .path = "/grpc.health.v1.Health/Check",
                                       .size = sizeof(rpc_call),
                                       .read_payload = true,
                                       .start = check_start };

/* ---- Watch ----------------------------------------------------------------------------------- */

typedef struct watch_call {
    rpc_call base;
    pthread_mutex_t lock;
    rpc_tag on_send;
    int want, sent; /* the status to tell, and the last one told (0: none yet) */
    bool md_sent, sending, ending, status_sent, closed;
    grpc_byte_buffer *in_flight;
    grpc_slice details;
} watch_call;

/* Sends what the watcher has not been told yet, one message at a time (under w->lock). */
static void watch_pump(watch_call *w)
{
    if (w->sending || w->status_sent || w->closed) return;
    grpc_op ops[2];
    size_t n = 0;
    memset(ops, 0, sizeof ops);
    if (w->want != w->sent) {
        if (!(w->in_flight = status_message(w->want))) return;
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = w->in_flight;
        w->sent = w->want;
    } else if (w->ending) {
        w->details = grpc_slice_from_static_string("the server is draining (shutting down)");
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = GRPC_STATUS_UNAVAILABLE;
        ops[n++].data.send_status_from_server.status_details = &w->details;
        w->status_sent = true;
    } else {
        return;
    }
    if (!w->md_sent) {
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA; /* order within a batch does not matter */
        w->md_sent = true;
    }
    w->sending = true;
    rpc_start_batch(&w->base, ops, n, &w->on_send);
}

static void watch_on_send(rpc_tag *t, bool ok)
{
    watch_call *w = moed_container_of(t, watch_call, on_send);
    pthread_mutex_lock(&w->lock);
    w->sending = false;
    if (w->in_flight) grpc_byte_buffer_destroy(w->in_flight);
    w->in_flight = NULL;
    if (!ok) w->closed = true;
    watch_pump(w);
    pthread_mutex_unlock(&w->lock);
    rpc_call_unref(&w->base);
}

static void watch_closed(rpc_call *c)
{
    watch_call *w = (watch_call *)c;
    pthread_mutex_lock(&w->lock);
    w->closed = true; /* the client went away: nothing more to tell */
    pthread_mutex_unlock(&w->lock);
}

static void watch_health(rpc_call *c, int status)
{
    watch_call *w = (watch_call *)c;
    pthread_mutex_lock(&w->lock);
    if (w->want != HEALTH_SERVICE_UNKNOWN) w->want = status;
    watch_pump(w);
    pthread_mutex_unlock(&w->lock);
}

static void watch_drain(rpc_call *c)
{
    watch_call *w = (watch_call *)c;
    pthread_mutex_lock(&w->lock);
    if (w->want != HEALTH_SERVICE_UNKNOWN) w->want = HEALTH_NOT_SERVING;
    w->ending = true;
    watch_pump(w);
    pthread_mutex_unlock(&w->lock);
}

static void watch_start(rpc_call *c)
{
    watch_call *w = (watch_call *)c;
    pthread_mutex_init(&w->lock, NULL);
    w->details = grpc_empty_slice();
    w->on_send.fn = watch_on_send;
    ProtobufCMessage *req = NULL;
    moed_error err;
    const char *service = read_service(c, &req, &err);
    if (!service) {
        rpc_reply_error(c, &err);
        return;
    }
    bool known = known_service(service);
    protobuf_c_message_free_unpacked(req, NULL);
    rpc_live_add(c);
    rpc_post_close(c, watch_closed);
    pthread_mutex_lock(&w->lock);
    w->want = known ? rpc_health_status(c->rpc) : HEALTH_SERVICE_UNKNOWN;
    w->ending = atomic_load(&c->rpc->draining);
    watch_pump(w);
    pthread_mutex_unlock(&w->lock);
}

static void watch_destroy(rpc_call *c)
{
    watch_call *w = (watch_call *)c;
    if (w->in_flight) grpc_byte_buffer_destroy(w->in_flight);
    grpc_slice_unref(w->details);
    pthread_mutex_destroy(&w->lock);
}

const rpc_method moed_watch_method = { .path = "/grpc.health.v1.Health/Watch",
                                       .size = sizeof(watch_call),
                                       .read_payload = true,
                                       .start = watch_start,
                                       .drain = watch_drain,
                                       .health = watch_health,
                                       .destroy = watch_destroy };
