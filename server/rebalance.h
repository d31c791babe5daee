/*
 * moed_rebalance — re-placing the layers a backend splits over devices by the load they measured
 * (moed --rebalance SECONDS; docs/operations.md, "Re-placing split layers by measured load").
 *
 * Every period, on a thread of its own, one pass over the served layer slots: each one the backend
 * holds split (moed_place_is_split of its placement) is weighed on the pairs each of its held
 * experts had since the layer's last placement and its launches over the same period: deltas of
 * the counters moed_expert_tokens_total and moed_layer_launches_total read
 * (moed_metrics_layer_load), in the shard's numbering, which is the backend's. A layer with fewer
 * than min_pairs pairs since then is left for a later pass; the others go to
 * moed_backend_replace_layer, one at a time: changed:   the layer's baseline moves to the counters
 * read, its generation goes up by one (GetModel's LayerInfo.placement_generation), the log says
 * before and after and the new ranges and copies, in the whole layer's numbering; unchanged: a
 * debug line; the baseline stays, so the next pass weighs a longer period; failed:    a warning
 * with the backend's message; the old placement serves on. Each result is counted in the metrics
 * (moed_metrics_rebalance).
 *
 * Threads: no re-placement runs on the event loop or on an execution slot's thread, and never two
 * at a time: the pass thread makes them, and moed_rebalance_apply (the --expert-load file's loads,
 * once at start) is called before that thread starts. moed_rebalance_stop (SIGTERM) lets no
 * re-placement start after it and returns at once; the one in progress runs to its end, which the
 * backend bounds (moed_backend_replace_layer), and moed_rebalance_destroy waits for it.
 * moed_rebalance_generation may be called from any thread.
 */
#ifndef MOED_REBALANCE_H
#define MOED_REBALANCE_H

#include "metrics.h"
#include "moed_backend.h"
#include "moed_err.h"
#include "shard.h"

#include <stdbool.h>
#include <stdint.h>

/* Pairs per held expert a layer needs since its last placement by default (min_pairs 0): enough
 * for each expert's share to be measured within about a fifth of a uniform share (the count of
 * an expert expecting 32 pairs varies by sqrt(32), ~18 %). */
#define MOED_REBALANCE_PAIRS_PER_EXPERT 32

typedef struct moed_rebalance_config {
    moed_backend *backend;
    const moed_shard *shards; /* [n_slots]: the layers by backend slot; must outlive it */
    int n_slots;
    moed_metrics *metrics; /* the counters weighed (must not be NULL when period_s > 0) */
    int period_s;          /* a pass every period_s seconds; 0: no thread */
    int max_replicas;      /* moed_replace_req.max_replicas */
    double min_gain;       /* moed_replace_req.min_gain */
    int64_t min_pairs;     /* pairs a layer needs since its last placement; 0: 32 per held expert */
} moed_rebalance_config;

typedef struct moed_rebalance moed_rebalance;

/* The baselines are the counters now. MOED_ENOMEM. */
int moed_rebalance_create(const moed_rebalance_config *cfg, moed_rebalance **out, moed_error *err);

/* Starts the pass thread when period_s > 0 and the backend holds some layer split; otherwise logs
 * once why there is nothing to do (not an error). MOED_ENOMEM or MOED_EINTERNAL when the thread
 * cannot start. */
int moed_rebalance_start(moed_rebalance *r, moed_error *err);

/* One pass over the layers, as the thread makes every period: returns how many were re-placed. */
int moed_rebalance_pass(moed_rebalance *r);

/* The request for one layer from its counters now and at its last placement: pairs[e] =
 * now[e] - base[e] for its n held experts and *launches the launches between, into the caller's
 * arrays; false (nothing to weigh yet) when those pairs add up to fewer than min_pairs, or to 0. */
bool moed_rebalance_delta(const uint64_t *now, const uint64_t *base, int n, uint64_t launches_now,
                          uint64_t launches_base, int64_t min_pairs, double *pairs,
                          double *launches);

/* Re-places layer slot `slot` once by the given load (pairs per held expert in the shard's
 * numbering, launches; --expert-load's), through the same call and with the same logging and
 * counting as a pass. 0 with *changed set, or the backend's error (already logged). Not while the
 * pass thread runs. */
int moed_rebalance_apply(moed_rebalance *r, int slot, const double *pairs, double launches,
                         bool *changed, moed_error *err);

/* Re-placements applied to layer slot `slot` so far (0 for NULL r). */
uint32_t moed_rebalance_generation(const moed_rebalance *r, int slot);

/* No re-placement starts after this; returns without waiting (the loop's thread calls it). */
void moed_rebalance_stop(moed_rebalance *r);

/* Stops, waits for the thread (and the re-placement in progress) and frees; NULL is ignored. */
void moed_rebalance_destroy(moed_rebalance *r);

#endif
