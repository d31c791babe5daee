/*
 * moed_metrics — the daemon's Prometheus metrics: counters and histograms recorded on the hot
 * path, rendered in the text exposition format (version 0.0.4) when /metrics is scraped.
 *
 * Recording is a few relaxed atomic adds into the calling thread's shard (one of a fixed set of
 * cache-line-aligned copies), so completion-queue threads and scheduler workers never contend on
 * one cache line; rendering sums the shards. Every recording function accepts m == NULL and then
 * does nothing, so a module (or a unit test) without metrics passes NULL.
 *
 * Gauges (queue depth, busy execution slots, device memory, serving state) are not recorded: the
 * caller samples them at scrape time and hands them to moed_metrics_render.
 *
 * Names and units follow the Prometheus conventions: counters end in _total, durations are
 * histograms in seconds, sizes are plain counts.
 */
#ifndef MOED_METRICS_H
#define MOED_METRICS_H

#include "moed_backend.h"
#include "moed_err.h"
#include "shard.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct moed_metrics moed_metrics;

/* The gRPC methods, as the `method` label names them. The front end's method table has this
 * order (rpc_call.h). */
typedef enum moed_method {
    MOED_METHOD_FORWARD,
    MOED_METHOD_FORWARD_STREAM,
    MOED_METHOD_GET_MODEL,
    MOED_METHOD_HEALTH_CHECK,
    MOED_METHOD_HEALTH_WATCH,
    MOED_METHOD_REGIONS,
    MOED_METHOD_LIST_REGIONS,
    MOED_METHOD_UNKNOWN,
    MOED_METHOD_COUNT
} moed_method;

/* NULL when out of memory. */
moed_metrics *moed_metrics_create(void);
void moed_metrics_destroy(moed_metrics *m);

/* One answered request (a unary call, or one message of a stream): moed_requests_total. */
void moed_metrics_request(moed_metrics *m, moed_method method, int grpc_status);

/* One answered Forward request: its duration from arrival to reply, and its message sizes. */
void moed_metrics_forward(moed_metrics *m, uint64_t duration_ns, uint64_t request_bytes,
                          uint64_t response_bytes);

/* One answered doorbell call (doorbell.h): its status and its duration from the poller taking it
 * to its completion: moed_doorbell_requests_total, moed_doorbell_request_duration_seconds. */
void moed_metrics_doorbell(moed_metrics *m, int grpc_status, uint64_t duration_ns);

/* One answered NCCL link call (link.h): its status and its duration from the server having its
 * payload to its reply sent: moed_link_requests_total, moed_link_request_duration_seconds. */
void moed_metrics_link(moed_metrics *m, int grpc_status, uint64_t duration_ns);

/* A request left its queue for a launch after waiting queue_ns. */
void moed_metrics_queue_wait(moed_metrics *m, uint64_t queue_ns);

/* A launch computed `tokens` tokens of `requests` merged requests in compute_ns. */
void moed_metrics_launch(moed_metrics *m, uint64_t tokens, uint64_t requests, uint64_t compute_ns);

/* The layers by backend slot and the experts held of each, which moed_expert_tokens_total counts
 * (labelled with the layer's index and the whole layer's expert ids). Called once, before anything
 * is recorded; shards must outlive m. MOED_ENOMEM. */
int moed_metrics_set_layers(moed_metrics *m, const moed_shard *shards, int n_slots);

/* A launch of layer slot `slot` routed tokens[e] (token, expert) pairs to the backend's expert e,
 * 0 <= e < n (the shard's numbering); it counts as one launch of the layer
 * (moed_layer_launches_total). */
void moed_metrics_expert_tokens(moed_metrics *m, int slot, const uint64_t *tokens, int n);

/* Layer slot `slot`'s counters so far: the pairs of each of its held experts (the shard's
 * numbering, the first n) into pairs, and its launches into *launches (may be NULL). What a
 * re-placement by measured load weighs (rebalance.h); 0s for a slot out of range. */
void moed_metrics_layer_load(const moed_metrics *m, int slot, uint64_t *pairs, int n,
                             uint64_t *launches);

/* How a re-placement of a layer by its measured load ended (moed_rebalances_total's `result`). */
typedef enum moed_rebalance_result {
    MOED_REBALANCE_CHANGED,   /* the layer runs on a new placement */
    MOED_REBALANCE_UNCHANGED, /* the gain was below --rebalance-min-gain */
    MOED_REBALANCE_FAILED,    /* the backend refused or failed it (the old placement serves on) */
    MOED_REBALANCE_RESULTS
} moed_rebalance_result;

/* A re-placement of layer slot `slot` weighed by the backend ended with `result`; CHANGED also
 * moves moed_layer_placement_generation on. */
void moed_metrics_rebalance(moed_metrics *m, int slot, moed_rebalance_result result);

/* What is sampled at scrape time. */
typedef struct moed_metrics_gauges {
    bool serving;            /* health SERVING */
    uint64_t queue_requests; /* requests waiting in the scheduler's queues */
    uint64_t calls_active;   /* gRPC calls open */
    uint64_t exec_busy;      /* execution slots (stream pool) running a launch */
    uint64_t exec_size;      /* execution slots in all */
    /* gRPC connections closed for going past their limits (moed_peers), in all */
    uint64_t connections_closed;
    const moed_device_info *devices;
    int n_devices;
    const char *version, *backend;
    double start_time_s;       /* Unix time the daemon started */
    uint64_t http_connections; /* connections open to the metrics endpoint itself */
    uint64_t http_refused;     /* of them answered 503 (over a limit) or 408 (too slow), in all */
    uint64_t regions[2], region_bytes[2]; /* registered now: host, cuda */
    uint64_t staging_pool_used, staging_pool_bytes;
    uint64_t rings; /* doorbell rings open */
    uint64_t links; /* NCCL links open */
} moed_metrics_gauges;

/* The exposition text (malloc'd, *len bytes, NUL-terminated), or NULL when out of memory. */
char *moed_metrics_render(const moed_metrics *m, const moed_metrics_gauges *g, size_t *len);

/* Sums of the counters, for tests and the stats log. */
typedef struct moed_metrics_totals {
    uint64_t requests[MOED_METHOD_COUNT][MOED_GRPC_STATUS_COUNT];
    uint64_t forwards, tokens, request_bytes, response_bytes, launches, queue_waits;
    uint64_t doorbell[MOED_GRPC_STATUS_COUNT]; /* doorbell calls by status */
    uint64_t link[MOED_GRPC_STATUS_COUNT];     /* NCCL link calls by status */
} moed_metrics_totals;

void moed_metrics_get_totals(const moed_metrics *m, moed_metrics_totals *out);

#endif
