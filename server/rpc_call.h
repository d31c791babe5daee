/*
 * rpc_call — what the front end's files (rpc.c and the methods' forward.c, getmodel.c, health.c,
 * region_rpc.c) share: the server object, the per-call state every method starts from, and the
 * helpers that post and finish calls.
 *
 * Every completion-queue tag is an rpc_tag inside a call's state; the queue thread calls its fn.
 * A call's state is reference counted: one reference per operation batch in flight, one per
 * request in the scheduler, one for the handler running now. It is freed (and the grpc_call
 * released) only when the last one goes, so no tag ever points into freed memory.
 */
#ifndef MOED_RPC_CALL_H
#define MOED_RPC_CALL_H

#include "moed_list.h"
#include "peer_uid.h"
#include "peers.h"
#include "rpc.h"
#include "unix_listener.h"

#include <grpc/grpc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

typedef struct rpc_tag {
    void (*fn)(struct rpc_tag *t, bool ok);
} rpc_tag;

/* The methods, in the order the metrics' `method` label names them. */
enum {
    M_FORWARD = MOED_METHOD_FORWARD,
    M_STREAM = MOED_METHOD_FORWARD_STREAM,
    M_GETMODEL = MOED_METHOD_GET_MODEL,
    M_CHECK = MOED_METHOD_HEALTH_CHECK,
    M_WATCH = MOED_METHOD_HEALTH_WATCH,
    M_REGIONS = MOED_METHOD_REGIONS,
    M_LIST_REGIONS = MOED_METHOD_LIST_REGIONS,
    M_UNKNOWN = MOED_METHOD_UNKNOWN,
    M_COUNT = MOED_METHOD_COUNT
};

/* Health statuses, as grpc.health.v1.HealthCheckResponse.ServingStatus numbers them. */
enum { HEALTH_SERVING = 1, HEALTH_NOT_SERVING = 2, HEALTH_SERVICE_UNKNOWN = 3 };

typedef struct rpc_cq {
    moed_rpc *rpc;
    grpc_completion_queue *cq;
    pthread_t thread;
    bool started;
} rpc_cq;

typedef struct rpc_call rpc_call;

struct moed_rpc {
    moed_rpc_config cfg;
    grpc_server *server;
    void *methods[M_COUNT];
    rpc_cq *cqs; /* --cq-threads call queues, then as many reading threads' queues */
    int n_cqs;
    char address[256];
    bool started;                  /* grpc_server_start ran: destroy only after the shutdown tag */
    _Atomic bool draining;         /* new Forward calls are answered UNAVAILABLE */
    _Atomic bool shutting;         /* grpc_server_shutdown_and_notify called: no new calls at all */
    _Atomic uint64_t last_call_ns; /* when the latest call arrived (moed_now_ns) */
    rpc_tag shutdown_tag;
    void (*on_drained)(void *arg);
    void *drained_arg;
    pthread_mutex_t live_lock; /* the streaming calls (streams, watches), for drain and health */
    moed_list live;            /* of rpc_call.live_node */
    int serving;               /* HEALTH_SERVING or HEALTH_NOT_SERVING, under live_lock */
    moed_peers *peers;         /* calls open per connection, held to 2 x --max-streams */
    moed_unix *unix_listener;  /* moed's own on a unix socket without TLS, or NULL (gRPC's) */
    moed_tcp_self tcp_self;    /* the one loopback address gRPC's TCP listener serves, if it is */
    int port;                  /* the port listened on (0: a unix socket) */
    uint64_t stall_polled_ns;  /* queue 0's thread: when it last looked for stalled connections */
    _Atomic uint64_t closed;   /* connections closed for going past their limits */
    _Atomic uint64_t calls[M_COUNT], forwards, by_status[MOED_GRPC_STATUS_COUNT], active;
};

/* What a method does with its call: start when it arrives; for streaming methods, end when the
 * server drains and hear of health changes. */
typedef struct rpc_method {
    const char *path;
    size_t size;       /* of the method's call state, which begins with rpc_call */
    bool read_payload; /* unary: the request is read (once the call is let in) before start */
    bool generic;      /* not registered: takes the calls to every other method */
    void (*start)(rpc_call *c);
    void (*drain)(rpc_call *c);
    void (*health)(rpc_call *c, int status);
    void (*destroy)(rpc_call *c);
} rpc_method;

struct rpc_call {
    moed_rpc *rpc;
    rpc_cq *cq;
    const rpc_method *method;
    int method_id;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_call_details call_details; /* the generic method's: which method was called */
    grpc_byte_buffer *payload;      /* unary requests: read once the call is let in */
    _Atomic int refs;
    uint64_t t_received_ns;
    moed_peer_call peer;      /* as its connection's calls count it (moed_peers) */
    int token;                /* the token it carries, 1..n (moed_security_check_call); 0: none */
    bool has_principal;       /* principal found (rpc_principal asks once per call) */
    moed_principal principal; /* whose regions it may use */
    bool local;               /* its peer is on this host (loopback or a unix socket) */
    bool active;  /* let in (token, drain and stream count checked): the drain waits for it */
    bool started; /* the method's start ran: its destroy must run too */
    rpc_tag on_new, on_payload;
    /* RECV_CLOSE_ON_SERVER */
    rpc_tag on_close;
    void (*close_fn)(rpc_call *c);
    int cancelled;
    bool close_posted;
    /* a unary reply: metadata, optional message, status */
    rpc_tag on_reply;
    grpc_byte_buffer *reply;
    grpc_slice details;
    /* on rpc->live while it streams */
    moed_list live_node;
    bool live;
};

extern const rpc_method moed_forward_method, moed_stream_method, moed_getmodel_method,
    moed_check_method, moed_watch_method, moed_regions_method, moed_list_regions_method;

void rpc_call_ref(rpc_call *c);
void rpc_call_unref(rpc_call *c);

/* Posts RECV_CLOSE_ON_SERVER; close_fn (may be NULL) runs when it completes, cancelled or not. */
void rpc_post_close(rpc_call *c, void (*close_fn)(rpc_call *c));

/* Answers a unary call: initial metadata, msg (owned; NULL for none) and status. Adds
 * RECV_CLOSE_ON_SERVER if the call has not posted it. Counts the answer (rpc_count). */
void rpc_reply(rpc_call *c, grpc_byte_buffer *msg, int grpc_status, const char *details);

/* Answers with a moed error: its gRPC status and message. */
void rpc_reply_error(rpc_call *c, const moed_error *err);

/* Starts a batch of ops on the call with `tag`, taking a reference for it; a refusal (a bug) is
 * logged and answered by cancelling the call. */
void rpc_start_batch(rpc_call *c, const grpc_op *ops, size_t n, rpc_tag *tag);

/* A request of the call was read (moed_peers counts the calls that end with none). */
void rpc_call_read(rpc_call *c);

/* The call's connection holds `bytes` more of its replies (made; negative: taken by the client,
 * or given up): past --max-grpc-memory in all, or taken by none for 20 s, a connection is closed
 * (moed_peers_hold, moed_peers_stalled). A unary reply is counted by rpc_reply. */
void rpc_hold(rpc_call *c, int64_t bytes);

/* Whose requests the call's are, for the scheduler's turns (moed_sched_item.owner): its
 * connection's, or (a unix-socket peer, not counted per connection) the call's own. */
const void *rpc_call_owner(const rpc_call *c);

/* Streaming calls: registered on rpc->live while open, so drain and health reach them. */
void rpc_live_add(rpc_call *c);

/* Counts one answered request of c's method (a unary call, or one message of a stream) in the
 * stats and the metrics; a Forward request also with its duration since t_received_ns and the
 * sizes of its request and reply messages (either may be NULL). */
void rpc_count(rpc_call *c, int grpc_status, uint64_t t_received_ns, grpc_byte_buffer *request,
               grpc_byte_buffer *reply);

/* The message c just received: a compressed one (--accept-compression) inflated into a plain
 * buffer that replaces *bb; a plain one is left as it is. MOED_ETOOBIG past --max-message-bytes,
 * MOED_EFORMAT when corrupt, MOED_EINTERNAL when flagged compressed with no algorithm (gRPC's
 * compression spec). */
int rpc_inflate(rpc_call *c, grpc_byte_buffer **bb, moed_error *err);

/* The principal whose regions the call may use (caller.c): 0, or FAILED_PRECONDITION with a
 * message saying what to do when it has none. Asked only by calls that use regions; the answer is
 * kept for the call. */
int rpc_principal(rpc_call *c, moed_principal *out, moed_error *err);

/* The call's deadline on moed_now_ns()'s clock, 0 for none. */
uint64_t rpc_deadline_ns(const rpc_call *c);

int rpc_health_status(moed_rpc *r);

#endif
