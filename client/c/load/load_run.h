/*
 * load_run — moed-load's engine: drive one load level (closed loop at a concurrency, or open loop
 * at a rate) against a server and count what happens (load_report.h says how).
 *
 * Threads: plan->threads workers, each with its own completion queue, keeping its share of the
 * calls in flight through libmoedclient's asynchronous API; calls go round-robin over the plan's
 * connections (each its own TCP connection, since one HTTP/2 connection is a bottleneck for large
 * messages). The calling thread prints the progress line (which level of the run, how far its
 * warm-up or window is, rates, errors, latency, the time the run has left; one terminal row) and
 * collects the workers.
 *
 * A level: warm-up (calls started in it are not counted, but for the tokens per expert of
 * lv->sent, which counts every ok client route as the daemons' counters do), then the measured
 * window, ended by duration or by the number of requests (open loop: an arrival counts in the part
 * its due time falls in, and every one due in the window is sent, late if the machine is busy, so
 * their number depends on the rate alone); then the calls in flight are waited for
 * (their replies count), for at most the deadline plus 5 s (30 s without one), after which they
 * are cancelled and counted as CANCELLED. load_run_interrupt (SIGINT) ends the window early the
 * same way.
 */
#ifndef LOAD_RUN_H
#define LOAD_RUN_H

#include "load_gen.h"
#include "load_report.h"
#include "load_verify.h"
#include "moedclient.h"

#include <stdbool.h>
#include <stdint.h>

/* A destination of the run: a layer it sends to, with its pool of client routes. */
typedef struct load_dest {
    moed_layer_info info;
    int cols;       /* columns of a client route (MOEDC_ROUTE_EXPERTS) */
    int32_t *ids;   /* [pool_rows, cols], or NULL when the server routes */
    float *weights; /* [pool_rows, cols] */
} load_dest;

/* The pools and outputs in tensor regions (load_regions.h); NULL: every tensor inline. */
typedef struct load_regions load_regions;

typedef struct load_plan {
    moedc *const *conns;
    int n_conns;
    int threads;
    const load_dest *layers; /* requests go to them round-robin */
    int n_layers;
    /* Pools the requests take windows of rows from (never written during the run): hidden is
     * [pool_rows, d] for a layer of d_model d, logits [pool_rows, E] for one of E experts. */
    int64_t pool_rows;
    const void *hidden;
    const float *logits;
    int dtype;
    const load_tokens *tokens;
    int routing; /* moedc_routing */
    moedc_gating gating;
    bool batch_gating;
    uint32_t k_batch;
    double bad_fraction;
    double deadline_s; /* 0: none */
    double warmup_s;
    double duration_s; /* used when requests is 0 */
    uint64_t requests;
    load_arrival arrival;
    int max_inflight; /* open loop: the most calls in flight, over all workers */
    uint64_t seed;
    load_verify *verify; /* NULL without --verify */
    uint64_t verify_n;
    bool progress;       /* the progress line on stderr */
    int level, n_levels; /* this level's place in the run (0-based), for the progress line */
    const load_regions *regions;
} load_plan;

/* Runs one level: lv->concurrency (closed loop) or lv->rate (open loop) must be set; fills the
 * rest of lv. Fails only when the level could not be set up (threads, memory). */
int load_run_level(const load_plan *p, load_level *lv, moed_error *err);

/* A tokens-per-expert table (load_report.h) for the plan's layers. */
int load_plan_experts(const load_plan *p, load_experts *x);

/* Ends the current level's measured window early; safe in a signal handler. */
void load_run_interrupt(void);
bool load_run_interrupted(void);

#endif
