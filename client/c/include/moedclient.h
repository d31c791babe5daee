/*
 * moedclient — the C client library of moed (libmoedclient): connect to a daemon, run Forward,
 * GetModel and grpc.health.v1 Check.
 *
 * Contract:
 * - A moedc is one gRPC channel, and one TCP connection of its own (channels never share one, so a
 *   load generator opens N connections by opening N moedc). Any number of threads may call any
 *   function on one moedc at once; each call has its own gRPC call and completion queue.
 * - Two ways to call Forward. moedc_forward blocks until the reply. The asynchronous API keeps many
 *   calls in flight from one thread: moedc_forward_start on a moedc_queue, then moedc_queue_next
 *   hands back whichever call finished, and moedc_call_finish turns it into a result or an error.
 * - hidden is sent without being copied: it must stay valid and unchanged until moedc_forward or
 *   moedc_call_finish returns. Everything else in a request is copied by the start.
 * - Every function returns 0 or a negative MOED_E* code (kernels/moed_err.h) and fills err. For a
 *   call the server refused, err->code is moedc_code_from_grpc(status) and err->msg the server's
 *   status message verbatim, so moed_err_grpc_status(err->code) gives the status back (for the few
 *   statuses moed never sends, the message starts with the status name, e.g. "ABORTED: ...").
 *   Failures on this side (bad arguments, a malformed reply) are MOED_EINVAL / MOED_EFORMAT.
 * - Tensors are row-major and little-endian, as on the wire; the library builds only for
 *   little-endian hosts.
 *
 * Example (link libmoedclient; moectl.c is a complete program):
 *
 *   moedc *c;
 *   moed_error err;
 *   if (moedc_connect("127.0.0.1:50051", NULL, &c, &err)) die(err.msg);
 *   moedc_request req = { .layer = 0, .dtype = MOED_F32, .tokens = T, .d_model = d, .hidden = x,
 *                         .routing = MOEDC_ROUTE_LOGITS, .n_experts = E, .logits = logits,
 *                         .gating = { .strategy = MOED_GATE_TOPK, .top_k = 2 } };
 *   moedc_result res;
 *   if (moedc_forward(c, &req, &res, &err)) {
 *       int status = moed_err_grpc_status(err.code);
 *       fprintf(stderr, "%s: %s\n", moedc_grpc_status_name(status), err.msg);
 *   } else {
 *       use(res.output, res.output_bytes);
 *       moedc_result_free(&res);
 *   }
 *   moedc_close(c);
 */
#ifndef MOEDCLIENT_H
#define MOEDCLIENT_H

#include "moed_dtype.h"
#include "moed_err.h"
#include "moed_model.h"
#include "moed_route.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct moedc moedc;

typedef struct moedc_opts {
    double timeout_s;         /* default deadline of every call, seconds; 0: none */
    const char *bearer_token; /* sent as "authorization: Bearer TOKEN"; NULL: none */
} moedc_opts;

/* Opens a channel to target ("host:port", "unix:/path", any gRPC target; plaintext). gRPC connects
 * lazily: an unreachable server shows up as UNAVAILABLE on the first call. opts may be NULL. */
int moedc_connect(const char *target, const moedc_opts *opts, moedc **out, moed_error *err);
/* Closes the channel. Every call started on it must have been finished. */
void moedc_close(moedc *c);

/* How a request routes its tokens (the oneof of moed.v1.ForwardRequest). */
typedef enum moedc_routing {
    MOEDC_ROUTE_EXPERTS = 1, /* expert_ids [T, k] int32 + expert_weights [T, k] float32 */
    MOEDC_ROUTE_LOGITS = 2,  /* logits [T, n_experts] float32, gated by the server with gating */
    MOEDC_ROUTE_SERVER = 3,  /* the layer's router on the server, then gating */
} moedc_routing;

typedef struct moedc_request {
    const char *request_id; /* echoed in the result; NULL or at most 128 bytes */
    uint32_t layer;         /* the layer's index, as moedc_info lists it */
    int dtype;              /* MOED_F32, MOED_F16 or MOED_BF16: the output's dtype too */
    int64_t tokens;         /* T */
    int64_t d_model;
    const void *hidden; /* T x d_model elements of dtype; sent zero-copy (see the contract) */
    int routing;        /* moedc_routing */
    int k;              /* EXPERTS: columns of ids and weights (-1 with weight 0 pads) */
    const int32_t *expert_ids;   /* EXPERTS */
    const float *expert_weights; /* EXPERTS */
    int n_experts;               /* LOGITS: columns of logits */
    const float *logits;         /* LOGITS */
    moed_gate_params gating;     /* LOGITS and SERVER; all zero: the layer's own rule */
    bool batch_gating;           /* batch-level dynamic gating (needs LOGITS or SERVER) */
    uint32_t k_batch;            /* its set size; 0: the layer's top_k */
    double timeout_s;            /* 0: the moedc's default; < 0: no deadline */
} moedc_request;

typedef struct moedc_timings {
    uint64_t queue_us, compute_us, total_us;
    uint32_t batch_tokens, batch_requests;
} moedc_timings;

typedef struct moedc_result {
    int dtype;               /* the request's dtype */
    int64_t tokens, d_model; /* the request's shape */
    const void *output;      /* tokens x d_model elements of dtype, owned by the result */
    size_t output_bytes;
    const int32_t *expert_set; /* batch gating: the set S, by decreasing batch score */
    size_t n_expert_set;
    moedc_timings timings;
    const char *request_id; /* echoed by the server ("" if none) */
    void *priv;             /* the decoded reply that owns the memory above */
} moedc_result;

/* One Forward, blocking. On success fills res (release it with moedc_result_free). */
int moedc_forward(moedc *c, const moedc_request *req, moedc_result *res, moed_error *err);
/* Releases what a result owns; safe on a zeroed or already released result. */
void moedc_result_free(moedc_result *res);

/* ---- asynchronous calls ---- */

typedef struct moedc_queue moedc_queue; /* where finished calls are collected */
typedef struct moedc_call moedc_call;   /* one Forward in flight */

int moedc_queue_create(moedc_queue **out, moed_error *err);
/* Every call started on q must have been collected by moedc_queue_next and finished first. */
void moedc_queue_destroy(moedc_queue *q);

/* Starts a Forward whose completion will be delivered on q; user is returned by moedc_call_user.
 * On failure nothing was started and *out is NULL. One queue may be used by several threads. */
int moedc_forward_start(moedc *c, const moedc_request *req, moedc_queue *q, void *user,
                        moedc_call **out, moed_error *err);
/* Waits up to timeout_s (< 0: for ever) for a call started on q to finish. Returns 1 and sets *out
 * when one did, 0 on timeout. */
int moedc_queue_next(moedc_queue *q, double timeout_s, moedc_call **out);
void *moedc_call_user(const moedc_call *call);
/* Asks the server to drop the call; it still finishes through its queue (as CANCELLED, unless the
 * reply was already on its way). May run while another thread waits in moedc_queue_next, but not
 * after the call was finished. */
void moedc_call_cancel(moedc_call *call);
/* Turns a finished call (from moedc_queue_next) into a result or an error, and frees the call. */
int moedc_call_finish(moedc_call *call, moedc_result *res, moed_error *err);

/* ---- model information and health ---- */

typedef struct moedc_device {
    char *name; /* "cpu" or the GPU's name */
    uint64_t memory_total, memory_used;
} moedc_device;

typedef struct moedc_model_info {
    char *model;   /* the checkpoint folder, or the synthetic spec */
    char *backend; /* "cpu" or "cuda" */
    char *version;
    int n_layers;
    moed_layer_info *layers; /* index, sizes, act, wdtype, router, rule, shared experts, groups */
    int n_devices;
    moedc_device *devices;
    uint64_t max_message_bytes;
    uint32_t max_batch_tokens; /* the most tokens one request may carry */
} moedc_model_info;

/* GetModel. Release with moedc_model_info_free. */
int moedc_info(moedc *c, moedc_model_info *out, moed_error *err);
void moedc_model_info_free(moedc_model_info *m);

/* Values of grpc.health.v1.HealthCheckResponse.ServingStatus. */
enum {
    MOEDC_HEALTH_UNKNOWN = 0,
    MOEDC_HEALTH_SERVING = 1,
    MOEDC_HEALTH_NOT_SERVING = 2,
    MOEDC_HEALTH_SERVICE_UNKNOWN = 3,
};

/* grpc.health.v1.Health/Check of service ("" or NULL: the server as a whole) into *status. */
int moedc_health(moedc *c, const char *service, int *status, moed_error *err);
/* "SERVING", "NOT_SERVING", "UNKNOWN", "SERVICE_UNKNOWN". */
const char *moedc_health_name(int status);

/* ---- status codes ---- */

/* The moed code a gRPC status code is reported as (MOED_OK for 0). */
int moedc_code_from_grpc(int grpc_status);
/* "OK", "CANCELLED", ..., "UNAUTHENTICATED" (the gRPC names); "UNKNOWN" outside 0..16. */
const char *moedc_grpc_status_name(int grpc_status);

#endif
