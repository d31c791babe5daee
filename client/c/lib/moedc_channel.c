/*
 * moedc_channel — the one-daemon moedc: calls over one gRPC C core channel, and the completion
 * queues every call finishes on (moedclient.h states the contract; moedc_impl.h the table this
 * fills).
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
#include "moedc_channel.h"

#include "moedc_codec.h"
#include "moedc_common.h"
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

typedef struct channel_call {
    moedc_call base;
    grpc_call *call;
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
} channel_call;

static const moedc_ops channel_ops;

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

static void channel_close(moedc *c)
{
    moedc_channel *ch = (moedc_channel *)c;
    if (ch->channel) grpc_channel_destroy(ch->channel);
    free(ch->auth);
    free((char *)ch->base.name);
    free(ch);
    grpc_shutdown();
}

int moedc_connect(const char *target, const moedc_opts *opts, moedc **out, moedc_error *err)
{
    static const moedc_opts none;
    *out = NULL;
    if (!opts) opts = &none;
    if (!target || !*target)
        return moedc_fail(err, MOEDC_EINVAL, "no server address given (e.g. 127.0.0.1:50051)");
    moedc_channel *ch = calloc(1, sizeof *ch);
    if (!ch) return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a connection");
    grpc_init();
    ch->base = (moedc){ .ops = &channel_ops, .timeout_s = opts->timeout_s, .name = strdup(target) };
    grpc_channel_credentials *creds = NULL;
    int rc = ch->base.name ? auth_header(opts->bearer_token, &ch->auth, err)
                           : moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a connection");
    if (!rc) rc = moedc_tls_credentials(opts, &creds, err);
    if (!rc) {
        ch->channel = open_channel(target, creds, opts->tls_server_name);
        grpc_channel_credentials_release(creds);
        if (!ch->channel)
            rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a connection to %s", target);
    }
    if (rc) {
        channel_close(&ch->base);
        return rc;
    }
    ch->m_forward = grpc_channel_register_call(ch->channel, "/moed.v1.Moed/Forward", NULL, NULL);
    ch->m_get_model = grpc_channel_register_call(ch->channel, "/moed.v1.Moed/GetModel", NULL, NULL);
    ch->m_health =
        grpc_channel_register_call(ch->channel, "/grpc.health.v1.Health/Check", NULL, NULL);
    ch->m_regions = grpc_channel_register_call(ch->channel, "/moed.v1.Moed/Regions", NULL, NULL);
    ch->m_list_regions =
        grpc_channel_register_call(ch->channel, "/moed.v1.Moed/ListRegions", NULL, NULL);
    *out = &ch->base;
    return 0;
}

static gpr_timespec after(double seconds)
{
    if (seconds < 0) return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_micros((int64_t)(seconds * 1e6), GPR_TIMESPAN));
}

static void channel_reconnect(moedc *c, double timeout_s)
{
    grpc_channel *channel = ((moedc_channel *)c)->channel;
    /* The reset reconnects asynchronously, and a channel that failed stays in TRANSIENT_FAILURE
     * (calls made meanwhile fail at once) until a connection is READY: so wait for that, or for
     * the time given, whichever comes first. */
    grpc_connectivity_state s = grpc_channel_check_connectivity_state(channel, 0);
    if (s == GRPC_CHANNEL_READY) return;
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    const gpr_timespec until = after(timeout_s);
    grpc_channel_watch_connectivity_state(channel, s, until, cq, NULL);
    grpc_channel_reset_connect_backoff(channel);
    grpc_channel_check_connectivity_state(channel, 1); /* an idle channel connects now */
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).success) {
        s = grpc_channel_check_connectivity_state(channel, 1);
        if (s == GRPC_CHANNEL_READY || s == GRPC_CHANNEL_SHUTDOWN) break;
        grpc_channel_watch_connectivity_state(channel, s, until, cq, NULL);
    }
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
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

int moedc_queue_next(moedc_queue *q, double timeout_s, moedc_call **out)
{
    *out = NULL;
    const gpr_timespec until = after(timeout_s);
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(q->cq, until, NULL);
        if (ev.type != GRPC_OP_COMPLETE) return 0; /* timeout (shutdown only comes in destroy) */
        channel_call *cc = ev.tag;
        cc->batch_ok = ev.success;
        moedc_call *call = &cc->base;
        while (call && call->done) call = call->done(call, call->done_arg);
        if (call) {
            *out = call;
            return 1;
        }
    }
}

/* ---- calls ---- */

static void body_released(void *arg)
{
    channel_call *call = arg;
    pthread_mutex_lock(&call->mu);
    call->lent = 0;
    pthread_cond_signal(&call->cv);
    pthread_mutex_unlock(&call->mu);
}

static channel_call *call_new(const moedc_start *how)
{
    channel_call *call = calloc(1, sizeof *call);
    if (!call) return NULL;
    call->base = (moedc_call){ .ops = &channel_ops };
    if (how) {
        call->base.user = how->user;
        call->base.done = how->done;
        call->base.done_arg = how->done_arg;
    }
    pthread_mutex_init(&call->mu, NULL);
    pthread_cond_init(&call->cv, NULL);
    grpc_metadata_array_init(&call->initial_md);
    grpc_metadata_array_init(&call->trailing_md);
    call->details = grpc_empty_slice();
    return call;
}

/* Releases everything a call holds, once gRPC has given the hidden buffer back. */
static void call_free(channel_call *call)
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
static int call_start(moedc_channel *ch, void *method, moedc_queue *q, double timeout_s,
                      grpc_slice *slices, size_t n, channel_call *call, moedc_error *err)
{
    double t = timeout_s == 0 ? ch->base.timeout_s : timeout_s;
    call->call = grpc_channel_create_registered_call(ch->channel, NULL, GRPC_PROPAGATE_DEFAULTS,
                                                     q->cq, method, after(t > 0 ? t : -1), NULL);
    call->send = grpc_raw_byte_buffer_create(slices, n);
    if (!call->call || !call->send)
        return moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    if (ch->auth) {
        call->auth_md.key = grpc_slice_from_static_string("authorization");
        call->auth_md.value = grpc_slice_from_static_string(ch->auth);
    }
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = ch->auth ? 1 : 0;
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
static int status_error(const channel_call *call, moedc_error *err)
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
static int call_reply(channel_call *call, grpc_slice *out, moedc_error *err)
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

static int channel_forward_start(moedc *c, const moedc_request *req, const moedc_start *how,
                                 moedc_queue *q, moedc_call **out, moedc_error *err)
{
    moedc_wire w;
    int rc = moedc_encode_forward(req, how->expect, &w, err);
    if (rc) return rc;
    channel_call *call = call_new(how);
    if (!call) {
        moedc_wire_free(&w);
        return moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    }
    call->dtype = req->dtype;
    call->tokens = req->tokens;
    call->d_model = req->d_model;
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
    rc = call_start((moedc_channel *)c, ((moedc_channel *)c)->m_forward, q, req->timeout_s, s, n,
                    call, err);
    for (size_t i = 0; i < n; i++) grpc_slice_unref(s[i]);
    if (rc) {
        call_free(call);
        return rc;
    }
    *out = &call->base;
    return 0;
}

static void channel_forward_cancel(moedc_call *call)
{
    grpc_call_cancel(((channel_call *)call)->call, NULL);
}

static int channel_forward_finish(moedc_call *base, moedc_result *res, moedc_error *err)
{
    channel_call *call = (channel_call *)base;
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

/* A small blocking call (GetModel, health, ListRegions) with a deadline of timeout_s (0: the
 * moedc's): msg is freed; *reply holds the answer on success. */
static int unary(moedc *c, void *method, uint8_t *msg, size_t n, double timeout_s,
                 grpc_slice *reply, moedc_error *err)
{
    moedc_queue *q;
    int rc = moedc_queue_create(&q, err);
    if (rc) {
        free(msg);
        return rc;
    }
    channel_call *call = call_new(NULL);
    grpc_slice s = grpc_slice_new(msg, n, free);
    if (!call) {
        rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    } else {
        rc = call_start((moedc_channel *)c, method, q, timeout_s, &s, 1, call, err);
        if (!rc) {
            moedc_call *done;
            moedc_queue_next(q, -1, &done);
            rc = call_reply(call, reply, err);
        }
    }
    grpc_slice_unref(s);
    call_free(call);
    moedc_queue_destroy(q);
    return rc;
}

static int channel_info(moedc *c, double timeout_s, moedc_model_info *out, moedc_error *err)
{
    uint8_t *msg;
    size_t n;
    grpc_slice reply;
    int rc = moedc_encode_get_model(&msg, &n, err);
    if (!rc) rc = unary(c, ((moedc_channel *)c)->m_get_model, msg, n, timeout_s, &reply, err);
    if (rc) return rc;
    rc = moedc_decode_model_info(GRPC_SLICE_START_PTR(reply), GRPC_SLICE_LENGTH(reply), out, err);
    grpc_slice_unref(reply);
    return rc;
}

static int channel_health(moedc *c, const char *service, double timeout_s, int *status,
                          moedc_error *err)
{
    uint8_t *msg;
    size_t n;
    grpc_slice reply;
    int rc = moedc_encode_health(service, &msg, &n, err);
    if (!rc) rc = unary(c, ((moedc_channel *)c)->m_health, msg, n, timeout_s, &reply, err);
    if (rc) return rc;
    rc = moedc_decode_health(GRPC_SLICE_START_PTR(reply), GRPC_SLICE_LENGTH(reply), status, err);
    grpc_slice_unref(reply);
    return rc;
}

static int channel_list_regions(moedc *c, moedc_region_info **out, int *n, moedc_error *err)
{
    uint8_t *msg = malloc(1); /* ListRegionsRequest has no fields: an empty message */
    grpc_slice reply;
    if (!msg) return moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    int rc = unary(c, ((moedc_channel *)c)->m_list_regions, msg, 0, 0, &reply, err);
    if (rc) return rc;
    rc = moedc_decode_region_list(GRPC_SLICE_START_PTR(reply), GRPC_SLICE_LENGTH(reply), out, n,
                                  err);
    grpc_slice_unref(reply);
    return rc;
}

static const moedc_ops channel_ops = {
    .forward_start = channel_forward_start,
    .forward_finish = channel_forward_finish,
    .forward_cancel = channel_forward_cancel,
    .info = channel_info,
    .health = channel_health,
    .list_regions = channel_list_regions,
    .session_open = moedc_channel_session_open,
    .reconnect = channel_reconnect,
    .close = channel_close,
};
