/*
 * moed_rpc — the gRPC front end: moed.v1.Moed (Forward, ForwardStream, GetModel) and
 * grpc.health.v1.Health (Check, Watch) on gRPC C core.
 *
 * Threads: --cq-threads completion queues for calls, each drained by its own thread, and as many
 * threads that only read the connections (gRPC's polling: sockets, HTTP/2 parsing) on queues no
 * call is bound to; a call's events run in order on its queue's thread, which never reads a socket
 * (rpc.c says why). Several calls per method and queue are requested in advance (re-armed as each
 * arrives) so concurrent calls are taken at once. Forward payloads are decoded on the queue thread
 * and queued in the scheduler; replies are sent from the scheduler's worker threads.
 *
 * Admission: a call is let in on its headers (its connection within its limits, the bearer token,
 * not draining) and only then is its request read; one turned away gets its status with a stream
 * reset, unread. A connection past its limits (calls open, calls ended unread, calls waiting for
 * their request, replies its client does not take: moed_peers) is closed, and the calls gRPC had
 * read from it before are dropped. The transport's limits (stream count, header size, pings,
 * compression, gRPC's resource quota) are set where the server is created (rpc.c).
 *
 * Life cycle: moed_rpc_start (bound while the weights still load: health NOT_SERVING, GetModel
 * answers with the load's progress, every other method UNAVAILABLE saying how far it has come) →
 * moed_rpc_loaded (the scheduler: every method served) → moed_rpc_set_serving(true) →
 * moed_rpc_drain (SIGTERM: merge windows flushed, NOT_SERVING, new Forward calls answered
 * UNAVAILABLE, open streams and watches ended once their requests are answered; once no call is
 * open and none has arrived for a moment, gRPC stops listening and every connection is closed, and
 * on_drained fires when every call is finished) → the scheduler drains → moed_rpc_destroy (which,
 * after a start that failed, shuts the server down itself).
 *
 * Listening: host:port through gRPC; a unix socket through moed's own listener (moed_unix), or
 * gRPC's with TLS. Who a call's principal is (its token, or the local user who connected) is
 * found by caller.c.
 */
#ifndef MOED_RPC_H
#define MOED_RPC_H

#include "doorbell.h"
#include "link.h"
#include "metrics.h"
#include "moed_backend.h"
#include "moed_err.h"
#include "request.h"
#include "scheduler.h"
#include "security.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct moed_rpc moed_rpc;

typedef struct moed_rpc_config {
    const char *listen; /* host:port; port 0 picks a free one (see moed_rpc_address) */
    int cq_threads;
    int64_t max_message_bytes; /* our limit; gRPC's own is set above it so ours answers */
    int max_streams;         /* MAX_CONCURRENT_STREAMS advertised; twice it enforced (moed_peers) */
    int64_t max_grpc_memory; /* gRPC core's resource quota, bytes */
    bool accept_compression; /* compressed requests accepted (else refused at their headers) */
    moed_sched *sched;       /* NULL until moed_rpc_loaded */
    const moed_served *served; /* read only once loaded */
    moed_backend *backend;     /* GetModel: name and devices */
    const char *model; /* GetModel once loaded: the checkpoint folder or the synthetic spec */
    const moed_security *security; /* TLS and the bearer token; NULL: plaintext, no token */
    moed_metrics *metrics;         /* requests, durations and bytes are recorded here; or NULL */
    moed_doorbell *doorbell;       /* the Regions stream's rings (NULL until moed_rpc_loaded, and
                                      NULL after it when the doorbell is off) */
    moed_links *links;             /* the Regions stream's NCCL links (likewise; NULL: links off) */
} moed_rpc_config;

typedef struct moed_rpc_stats {
    uint64_t calls[MOED_METHOD_COUNT]; /* by method (moed_method) */
    uint64_t forwards; /* Forward requests answered (unary, and each stream message) */
    /* Forward answers by gRPC status code (CANCELLED: the caller left) */
    uint64_t by_status[MOED_GRPC_STATUS_COUNT];
    uint64_t active_calls;
    uint64_t connections_closed; /* for going past their limits (moed_peers) */
} moed_rpc_stats;

/* Creates the server, binds cfg->listen (MOED_EIO naming the address when it cannot, or when
 * something answers on its unix socket already) and starts the completion-queue threads. The
 * configuration's pointers must outlive the server. */
int moed_rpc_start(const moed_rpc_config *cfg, moed_rpc **out, moed_error *err);

/* The address actually bound ("127.0.0.1:50051"; with port 0, the port chosen). */
const char *moed_rpc_address(const moed_rpc *r);

/* The weights are resident and *served is whole: Forward, ForwardStream, Regions and ListRegions
 * are served from now on, through sched, rings through doorbell and links through links (NULL:
 * none); before,
 * they are answered UNAVAILABLE. */
void moed_rpc_loaded(moed_rpc *r, moed_sched *sched, moed_doorbell *doorbell, moed_links *links);

/* Health status of "" and "moed.v1.Moed": SERVING or NOT_SERVING; Watch streams are told. */
void moed_rpc_set_serving(moed_rpc *r, bool serving);

/* Begins the drain; on_drained(arg) runs (on a queue thread) once every call has finished and
 * callers have gone quiet (no new call for 250 ms: a call on its way when gRPC core shuts down
 * would be cancelled by it). */
void moed_rpc_drain(moed_rpc *r, void (*on_drained)(void *arg), void *arg);

/* Cuts short a drain: cancels the calls still open and closes every connection. */
void moed_rpc_cancel_all(moed_rpc *r);

/* After on_drained and after the scheduler has drained: stops the threads, frees everything. */
void moed_rpc_destroy(moed_rpc *r);

void moed_rpc_get_stats(moed_rpc *r, moed_rpc_stats *out);

#endif
