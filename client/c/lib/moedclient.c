/*
 * moedclient — libmoedclient's calls over gRPC C core (moedclient.h states the contract).
 *
 * Every RPC moed has is unary, so a call is one batch of all six ops (send metadata, message and
 * close; receive metadata, message and status) and finishes with exactly one completion on its
 * queue: the asynchronous API is that completion, and the blocking one waits for it on a queue of
 * its own. Nothing is shared between calls but the channel, which gRPC makes thread-safe, so no
 * lock is needed anywhere but in lending the hidden buffer.
 *
 * The hidden bytes go into the message as a slice over the caller's memory. gRPC may hold that
 * slice a little after the call completes (a reply that came before the whole request was written),
 * so the slice's release callback tells the call, and finishing a call waits for it: that is what
 * lets the contract say "valid until finish returns" rather than "until some later time".
 */
#include "moedc_codec.h"
#include "moedc_common.h"
#include "moedc_fleet.h"
#include "moedc_tls.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct moedc_queue {
    grpc_completion_queue *cq;
};

struct moedc_call {
    grpc_call *call;
    void *user;
    grpc_metadata auth_md;
    grpc_metadata_array initial_md, trailing_md;
    grpc_byte_buffer *send, *recv;
    grpc_status_code status;
    grpc_slice details;
    int batch_ok;
    /* what the reply must hold: the request's dtype and shape, and where its output went */
    int dtype;
    int64_t tokens, d_model;
    moedc_ref output_at;
    /* the hidden buffer lent to gRPC, until its slice is released */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int lent;
    /* fleets (moedc_fleet.h): a handle's fleet call, or a sub-call's part */
    moedc_fleet_call *fleet;
    moedc_part *part;
};

const char *moedc_health_name(int status)
{
    switch (status) {
    case MOEDC_HEALTH_SERVING:
        return "SERVING";
    case MOEDC_HEALTH_NOT_SERVING:
        return "NOT_SERVING";
    case MOEDC_HEALTH_SERVICE_UNKNOWN:
        return "SERVICE_UNKNOWN";
    }
    return "UNKNOWN";
}

/* ---- channel ---- */

/* "Bearer TOKEN" for the authorization header, or NULL for no token. */
static int auth_header(const char *token, char **out, moedc_error *err)
{
    *out = NULL;
    if (!token) return 0;
    for (const char *p = token; *p; p++)
        if (*p < 0x21 || *p > 0x7e)
            return moedc_fail(err, MOEDC_EINVAL,
                              "bearer_token holds a space or a control character at byte %zu: a "
                              "token is printable ASCII",
                              (size_t)(p - token));
    size_t n = strlen(token) + sizeof "Bearer ";
    *out = malloc(n);
    if (!*out) return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a connection");
    snprintf(*out, n, "Bearer %s", token);
    return 0;
}

/* The channel over creds: arguments sized for tensors, TLS's server name if one was given. */
static grpc_channel *open_channel(const char *target, grpc_channel_credentials *creds,
                                  const char *server_name)
{
    /* Unlimited message sizes: the server enforces its own limit, with a status that says so.
     * A local subchannel pool: this channel's connection is its own, not shared with others.
     * HTTP/2 sized for tensors, as the server's: the frame size we accept is what the server sends
     * us (the 16 KiB default cuts a 16 MiB reply into a thousand frames, each costing CPU on both
     * ends), and a large stream window keeps the server from stalling on our acknowledgements. */
    grpc_arg args[7] = {
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, { .integer = -1 } },
        { GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, { .integer = -1 } },
        { GRPC_ARG_INTEGER, GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, { .integer = 1 } },
        { GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_MAX_FRAME_SIZE, { .integer = 1 << 20 } },
        { GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, { .integer = 8 << 20 } },
        { GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_BDP_PROBE, { .integer = 1 } },
        { GRPC_ARG_STRING, GRPC_SSL_TARGET_NAME_OVERRIDE_ARG, { .string = (char *)server_name } },
    };
    grpc_channel_args chargs = { server_name ? 7 : 6, args };
    return grpc_channel_create(target, creds, &chargs);
}

int moedc_connect(const char *target, const moedc_opts *opts, moedc **out, moedc_error *err)
{
    static const moedc_opts none;
    *out = NULL;
    if (!opts) opts = &none;
    if (!target || !*target)
        return moedc_fail(err, MOEDC_EINVAL, "no server address given (e.g. 127.0.0.1:50051)");
    moedc *c = calloc(1, sizeof *c);
    if (!c) return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a connection");
    grpc_init();
    c->timeout_s = opts->timeout_s;
    grpc_channel_credentials *creds = NULL;
    int rc = auth_header(opts->bearer_token, &c->auth, err);
    if (!rc) rc = moedc_tls_credentials(opts, &creds, err);
    if (!rc) {
        c->channel = open_channel(target, creds, opts->tls_server_name);
        grpc_channel_credentials_release(creds);
        if (!c->channel)
            rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a connection to %s", target);
    }
    if (rc) {
        moedc_close(c);
        return rc;
    }
    c->m_forward = grpc_channel_register_call(c->channel, "/moed.v1.Moed/Forward", NULL, NULL);
    c->m_get_model = grpc_channel_register_call(c->channel, "/moed.v1.Moed/GetModel", NULL, NULL);
    c->m_health =
        grpc_channel_register_call(c->channel, "/grpc.health.v1.Health/Check", NULL, NULL);
    c->m_regions = grpc_channel_register_call(c->channel, "/moed.v1.Moed/Regions", NULL, NULL);
    c->m_list_regions =
        grpc_channel_register_call(c->channel, "/moed.v1.Moed/ListRegions", NULL, NULL);
    *out = c;
    return 0;
}

int moedc_connect_many(const char *const *targets, int n, const moedc_opts *opts, moedc **out,
                       moedc_error *err)
{
    *out = NULL;
    if (!targets || n < 1)
        return moedc_fail(err, MOEDC_EINVAL, "no server address given (e.g. 127.0.0.1:50051)");
    if (!moedc_fleet_wanted(targets, n)) return moedc_connect(targets[0], opts, out, err);
    moedc *c = calloc(1, sizeof *c);
    if (!c) return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a fleet");
    int rc = moedc_fleet_open(targets, n, opts, &c->fleet, err);
    if (rc) {
        free(c);
        return rc;
    }
    *out = c;
    return 0;
}

void moedc_close(moedc *c)
{
    if (!c) return;
    if (c->fleet) { /* its members' moedcs hold the channels */
        moedc_fleet_close(c->fleet);
        free(c);
        return;
    }
    if (c->channel) grpc_channel_destroy(c->channel);
    free(c->auth);
    free(c);
    grpc_shutdown();
}

/* ---- queues ---- */

int moedc_queue_create(moedc_queue **out, moedc_error *err)
{
    *out = NULL;
    moedc_queue *q = calloc(1, sizeof *q);
    if (!q) return moedc_fail(err, MOEDC_ENOMEM, "out of memory creating a completion queue");
    grpc_init();
    q->cq = grpc_completion_queue_create_for_next(NULL);
    *out = q;
    return 0;
}

void moedc_queue_destroy(moedc_queue *q)
{
    if (!q) return;
    grpc_completion_queue_shutdown(q->cq);
    while (grpc_completion_queue_next(q->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(q->cq);
    free(q);
    grpc_shutdown();
}

static gpr_timespec after(double seconds)
{
    if (seconds < 0) return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_micros((int64_t)(seconds * 1e6), GPR_TIMESPAN));
}

int moedc_queue_next(moedc_queue *q, double timeout_s, moedc_call **out)
{
    *out = NULL;
    const gpr_timespec until = after(timeout_s);
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(q->cq, until, NULL);
        if (ev.type != GRPC_OP_COMPLETE) return 0; /* timeout (shutdown only comes in destroy) */
        moedc_call *call = ev.tag;
        call->batch_ok = ev.success;
        if (call->part) call = moedc_fleet_part_done(call, call->part); /* a fleet's sub-call */
        if (call) {
            *out = call;
            return 1;
        }
    }
}

/* ---- calls ---- */

static void body_released(void *arg)
{
    moedc_call *call = arg;
    pthread_mutex_lock(&call->mu);
    call->lent = 0;
    pthread_cond_signal(&call->cv);
    pthread_mutex_unlock(&call->mu);
}

static moedc_call *call_new(void *user)
{
    moedc_call *call = calloc(1, sizeof *call);
    if (!call) return NULL;
    call->user = user;
    pthread_mutex_init(&call->mu, NULL);
    pthread_cond_init(&call->cv, NULL);
    grpc_metadata_array_init(&call->initial_md);
    grpc_metadata_array_init(&call->trailing_md);
    call->details = grpc_empty_slice();
    return call;
}

/* Releases everything a call holds, once gRPC has given the hidden buffer back. */
static void call_free(moedc_call *call)
{
    if (!call) return;
    if (call->call) grpc_call_unref(call->call);
    if (call->send) grpc_byte_buffer_destroy(call->send);
    if (call->recv) grpc_byte_buffer_destroy(call->recv);
    grpc_metadata_array_destroy(&call->initial_md);
    grpc_metadata_array_destroy(&call->trailing_md);
    grpc_slice_unref(call->details);
    pthread_mutex_lock(&call->mu);
    while (call->lent) pthread_cond_wait(&call->cv, &call->mu);
    pthread_mutex_unlock(&call->mu);
    pthread_mutex_destroy(&call->mu);
    pthread_cond_destroy(&call->cv);
    free(call);
}

/* Starts the one batch of a unary call carrying the message in slices (gRPC takes its own refs). */
static int call_start(moedc *c, void *method, moedc_queue *q, double timeout_s, grpc_slice *slices,
                      size_t n, moedc_call *call, moedc_error *err)
{
    double t = timeout_s == 0 ? c->timeout_s : timeout_s;
    call->call = grpc_channel_create_registered_call(c->channel, NULL, GRPC_PROPAGATE_DEFAULTS,
                                                     q->cq, method, after(t > 0 ? t : -1), NULL);
    call->send = grpc_raw_byte_buffer_create(slices, n);
    if (!call->call || !call->send)
        return moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    if (c->auth) {
        call->auth_md.key = grpc_slice_from_static_string("authorization");
        call->auth_md.value = grpc_slice_from_static_string(c->auth);
    }
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = c->auth ? 1 : 0;
    ops[0].data.send_initial_metadata.metadata = &call->auth_md;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = call->send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &call->initial_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &call->recv;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &call->trailing_md;
    ops[5].data.recv_status_on_client.status = &call->status;
    ops[5].data.recv_status_on_client.status_details = &call->details;
    grpc_call_error e = grpc_call_start_batch(call->call, ops, 6, call, NULL);
    if (e != GRPC_CALL_OK)
        return moedc_fail(err, MOEDC_EINTERNAL, "gRPC refused to start the call: %s",
                          grpc_call_error_to_string(e));
    return 0;
}

/* The error of a refused call: the server's message, as the contract in moedclient.h says. */
static int status_error(const moedc_call *call, moedc_error *err)
{
    int code = moedc_code_from_grpc(call->status);
    const char *name = moedc_grpc_status_name(call->status);
    int len = (int)GRPC_SLICE_LENGTH(call->details);
    const char *msg = (const char *)GRPC_SLICE_START_PTR(call->details);
    if (!len) return moedc_fail(err, code, "%s (the server sent no message)", name);
    if (moedc_code_to_grpc(code) != (int)call->status)
        return moedc_fail(err, code, "%s: %.*s", name, len, msg);
    return moedc_fail(err, code, "%.*s", len, msg);
}

/* The reply of a finished call as one contiguous slice, or the call's error. */
static int call_reply(moedc_call *call, grpc_slice *out, moedc_error *err)
{
    if (call->status != GRPC_STATUS_OK) return status_error(call, err);
    if (!call->batch_ok)
        return moedc_fail(err, MOEDC_EINTERNAL, "the call failed in gRPC without a status");
    if (!call->recv)
        return moedc_fail(err, MOEDC_EFORMAT, "the server ended the call without a reply");
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, call->recv))
        return moedc_fail(err, MOEDC_EFORMAT,
                          "the server's reply could not be read (compression?)");
    *out = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    return 0;
}

/* moedc_forward_start on a channel; part: the fleet's part it is a sub-call of (stating expect),
 * or NULL. */
static int forward_start(moedc *c, const moedc_request *req, moedc_queue *q, void *user,
                         moedc_part *part, const moedc_expect *expect, moedc_call **out,
                         moedc_error *err)
{
    *out = NULL;
    moedc_wire w;
    int rc = moedc_encode_forward(req, expect, &w, err);
    if (rc) return rc;
    moedc_call *call = call_new(user);
    if (!call) {
        moedc_wire_free(&w);
        return moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    }
    call->dtype = req->dtype;
    call->tokens = req->tokens;
    call->d_model = req->d_model;
    call->part = part;
    call->output_at = req->output_at;
    /* head and tail become slices that own them; the body a slice lent from the caller */
    grpc_slice s[3];
    size_t n = 0;
    s[n++] = grpc_slice_new(w.head, w.head_len, free);
    if (w.body_len) {
        call->lent = 1;
        s[n++] = grpc_slice_new_with_user_data((void *)w.body, w.body_len, body_released, call);
    }
    s[n++] = grpc_slice_new(w.tail, w.tail_len, free);
    rc = call_start(c, c->m_forward, q, req->timeout_s, s, n, call, err);
    for (size_t i = 0; i < n; i++) grpc_slice_unref(s[i]);
    if (rc) {
        call_free(call);
        return rc;
    }
    *out = call;
    return 0;
}

int moedc_forward_start(moedc *c, const moedc_request *req, moedc_queue *q, void *user,
                        moedc_call **out, moedc_error *err)
{
    if (c->fleet) {
        *out = NULL;
        return moedc_fleet_forward_start(c->fleet, req, q, user, out, err);
    }
    return forward_start(c, req, q, user, NULL, NULL, out, err);
}

void *moedc_call_user(const moedc_call *call)
{
    return call->user;
}

void moedc_call_cancel(moedc_call *call)
{
    if (call->fleet)
        moedc_fleet_cancel(call);
    else
        grpc_call_cancel(call->call, NULL);
}

int moedc_call_finish(moedc_call *call, moedc_result *res, moedc_error *err)
{
    if (call->fleet) return moedc_fleet_finish(call, res, err);
    memset(res, 0, sizeof *res);
    grpc_slice reply;
    int rc = call_reply(call, &reply, err);
    if (!rc) {
        rc =
            moedc_decode_forward(GRPC_SLICE_START_PTR(reply), GRPC_SLICE_LENGTH(reply), call->dtype,
                                 call->tokens, call->d_model, &call->output_at, res, err);
        grpc_slice_unref(reply);
    }
    call_free(call);
    return rc;
}

int moedc_forward(moedc *c, const moedc_request *req, moedc_result *res, moedc_error *err)
{
    memset(res, 0, sizeof *res);
    moedc_queue *q;
    moedc_call *call;
    int rc = moedc_queue_create(&q, err);
    if (rc) return rc;
    rc = moedc_forward_start(c, req, q, NULL, &call, err);
    if (!rc) {
        moedc_queue_next(q, -1, &call);
        rc = moedc_call_finish(call, res, err);
    }
    moedc_queue_destroy(q);
    return rc;
}

/* A small blocking call (GetModel, health) with a deadline of timeout_s (0: the moedc's): msg is
 * freed; *reply holds the answer on success. */
static int unary(moedc *c, void *method, uint8_t *msg, size_t n, double timeout_s,
                 grpc_slice *reply, moedc_error *err)
{
    moedc_queue *q;
    int rc = moedc_queue_create(&q, err);
    if (rc) {
        free(msg);
        return rc;
    }
    moedc_call *call = call_new(NULL);
    grpc_slice s = grpc_slice_new(msg, n, free);
    if (!call) {
        rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    } else {
        rc = call_start(c, method, q, timeout_s, &s, 1, call, err);
        if (!rc) {
            moedc_call *done;
            moedc_queue_next(q, -1, &done);
            rc = call_reply(done, reply, err);
        }
    }
    grpc_slice_unref(s);
    call_free(call);
    moedc_queue_destroy(q);
    return rc;
}

int moedc_info(moedc *c, moedc_model_info *out, moedc_error *err)
{
    if (c->fleet) {
        memset(out, 0, sizeof *out);
        return moedc_fleet_info(c->fleet, out, err);
    }
    return moedc_info_within(c, 0, out, err);
}

int moedc_info_within(moedc *c, double timeout_s, moedc_model_info *out, moedc_error *err)
{
    memset(out, 0, sizeof *out);
    uint8_t *msg;
    size_t n;
    grpc_slice reply;
    int rc = moedc_encode_get_model(&msg, &n, err);
    if (!rc) rc = unary(c, c->m_get_model, msg, n, timeout_s, &reply, err);
    if (rc) return rc;
    rc = moedc_decode_model_info(GRPC_SLICE_START_PTR(reply), GRPC_SLICE_LENGTH(reply), out, err);
    grpc_slice_unref(reply);
    return rc;
}

int moedc_health(moedc *c, const char *service, int *status, moedc_error *err)
{
    if (c->fleet) {
        *status = MOEDC_HEALTH_UNKNOWN;
        return moedc_fleet_health(c->fleet, service, status, err);
    }
    return moedc_health_within(c, service, 0, status, err);
}

int moedc_health_within(moedc *c, const char *service, double timeout_s, int *status,
                        moedc_error *err)
{
    *status = MOEDC_HEALTH_UNKNOWN;
    uint8_t *msg;
    size_t n;
    grpc_slice reply;
    int rc = moedc_encode_health(service, &msg, &n, err);
    if (!rc) rc = unary(c, c->m_health, msg, n, timeout_s, &reply, err);
    if (rc) return rc;
    rc = moedc_decode_health(GRPC_SLICE_START_PTR(reply), GRPC_SLICE_LENGTH(reply), status, err);
    grpc_slice_unref(reply);
    return rc;
}

/* ---- what fleets need of calls (moedc_fleet.h) ---- */

moedc_call *moedc_call_new_handle(void *user, moedc_fleet_call *fc)
{
    moedc_call *call = call_new(user);
    if (call) call->fleet = fc;
    return call;
}

void moedc_call_free_handle(moedc_call *call)
{
    call_free(call);
}

moedc_fleet_call *moedc_call_fleet(const moedc_call *call)
{
    return call->fleet;
}

void moedc_reconnect_now(moedc *c, double timeout_s)
{
    /* The reset reconnects asynchronously, and a channel that failed stays in TRANSIENT_FAILURE
     * (calls made meanwhile fail at once) until a connection is READY: so wait for that, or for
     * the time given, whichever comes first. */
    grpc_connectivity_state s = grpc_channel_check_connectivity_state(c->channel, 0);
    if (s == GRPC_CHANNEL_READY) return;
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    const gpr_timespec until = after(timeout_s);
    grpc_channel_watch_connectivity_state(c->channel, s, until, cq, NULL);
    grpc_channel_reset_connect_backoff(c->channel);
    grpc_channel_check_connectivity_state(c->channel, 1); /* an idle channel connects now */
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).success) {
        s = grpc_channel_check_connectivity_state(c->channel, 1);
        if (s == GRPC_CHANNEL_READY || s == GRPC_CHANNEL_SHUTDOWN) break;
        grpc_channel_watch_connectivity_state(c->channel, s, until, cq, NULL);
    }
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
}

int moedc_forward_start_part(moedc *c, const moedc_request *req, const moedc_expect *expect,
                             moedc_queue *q, moedc_part *p, moedc_call **out, moedc_error *err)
{
    return forward_start(c, req, q, NULL, p, expect, out, err);
}

int moedc_list_regions(moedc *c, moedc_region_info **out, int *n, moedc_error *err)
{
    *out = NULL;
    *n = 0;
    if (c->fleet)
        return moedc_fail(err, MOEDC_EPRECOND,
                          "ListRegions asks one daemon; this moedc is a fleet of several: ask a "
                          "member by its own target");
    uint8_t *msg = malloc(1); /* ListRegionsRequest has no fields: an empty message */
    grpc_slice reply;
    if (!msg) return moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    int rc = unary(c, c->m_list_regions, msg, 0, 0, &reply, err);
    if (rc) return rc;
    rc = moedc_decode_region_list(GRPC_SLICE_START_PTR(reply), GRPC_SLICE_LENGTH(reply), out, n,
                                  err);
    grpc_slice_unref(reply);
    return rc;
}
