/*
 * moed_rebalance — the pass thread and the baselines (rebalance.h states the contract).
 *
 * Why deltas of the metrics' counters rather than counters of its own: the scheduler already adds
 * each launch's pairs per expert once (moed_metrics_expert_tokens), and an operator reading
 * moed_expert_tokens_total sees exactly what the re-placement weighed. Why the baseline moves only
 * on a change: an unchanged placement was cut for the load measured since it was made, so the next
 * pass should weigh that whole period, longer and steadier, not just the last few seconds.
 */
#include "rebalance.h"

#include "log.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct baseline {
    uint64_t *pairs; /* [n_held]: the counters at the layer's last placement */
    uint64_t launches;
} baseline;

struct moed_rebalance {
    moed_rebalance_config cfg;
    baseline *base;               /* [n_slots] */
    _Atomic uint32_t *generation; /* [n_slots] */
    uint64_t *now;                /* [the most held experts]: counters read in a pass */
    double *pairs;                /* the same: the request's */
    pthread_mutex_t lock;         /* stop and the thread's wait */
    pthread_cond_t wake;
    _Atomic bool stopping;
    bool started;
    pthread_t thread;
};

int moed_rebalance_create(const moed_rebalance_config *cfg, moed_rebalance **out, moed_error *err)
{
    *out = NULL;
    moed_rebalance *r = calloc(1, sizeof *r);
    if (!r) return moed_fail(err, MOED_ENOMEM, "no memory for the re-placement's counters");
    r->cfg = *cfg;
    pthread_mutex_init(&r->lock, NULL);
    /* A monotonic clock for the thread's wait, so a wall clock stepped by NTP neither delays nor
     * hurries a pass. */
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->wake, &ca);
    pthread_condattr_destroy(&ca);
    int most = 1;
    for (int i = 0; i < cfg->n_slots; i++)
        if (cfg->shards[i].view.info.n_experts > most) most = cfg->shards[i].view.info.n_experts;
    bool ok = (r->base = calloc((size_t)cfg->n_slots + 1, sizeof *r->base)) &&
              (r->generation = calloc((size_t)cfg->n_slots + 1, sizeof *r->generation)) &&
              (r->now = calloc((size_t)most, sizeof *r->now)) &&
              (r->pairs = calloc((size_t)most, sizeof *r->pairs));
    for (int i = 0; ok && i < cfg->n_slots; i++) {
        const int n = cfg->shards[i].view.info.n_experts;
        if ((ok = (r->base[i].pairs = calloc((size_t)n, sizeof *r->base[i].pairs)) != NULL))
            moed_metrics_layer_load(cfg->metrics, i, r->base[i].pairs, n, &r->base[i].launches);
    }
    if (!ok) {
        moed_rebalance_destroy(r);
        return moed_fail(err, MOED_ENOMEM, "no memory for the re-placement's counters");
    }
    *out = r;
    return 0;
}

bool moed_rebalance_delta(const uint64_t *now, const uint64_t *base, int n, uint64_t launches_now,
                          uint64_t launches_base, int64_t min_pairs, double *pairs,
                          double *launches)
{
    double total = 0;
    for (int e = 0; e < n; e++) {
        pairs[e] = now[e] >= base[e] ? (double)(now[e] - base[e]) : 0;
        total += pairs[e];
    }
    *launches = launches_now >= launches_base ? (double)(launches_now - launches_base) : 0;
    return total > 0 && total >= (double)min_pairs;
}

static bool is_split(moed_rebalance *r, int slot)
{
    moed_layer_place p;
    return !moed_backend_layer_place(r->cfg.backend, slot, &p) && moed_place_is_split(&p);
}

/* The copies of hot experts as "17@1,42@0" (the whole layer's ids, device entries) into buf. */
static void replica_text(const moed_shard *sh, const moed_layer_place *p, char *buf, size_t n)
{
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < p->n_replicas && at + 1 < n; i++) {
        const int w = snprintf(buf + at, n - at, "%s%d@%d", i ? "," : "",
                               moed_shard_global(sh, p->replica[i].expert), p->replica[i].dev);
        if (w < 0) break;
        at += (size_t)w;
    }
}

/* Layer slot `slot` re-placed by pairs and launches: the backend's call, then the log line and
 * the counting of its result. `why` says where the load came from ("measured", "--expert-load"). */
static int replace(moed_rebalance *r, int slot, const double *pairs, double launches,
                   const char *why, bool *changed, moed_error *err)
{
    const moed_shard *sh = &r->cfg.shards[slot];
    const int index = sh->full->info.index, n = sh->view.info.n_experts;
    moed_replace_req req = { .pairs = pairs,
                             .launches = launches,
                             .max_replicas = r->cfg.max_replicas,
                             .min_gain = r->cfg.min_gain };
    moed_replace_result res;
    double total = 0;
    for (int e = 0; e < n; e++) total += pairs[e];
    *changed = false;
    int rc = moed_backend_replace_layer(r->cfg.backend, slot, &req, &res, err);
    if (rc) {
        moed_metrics_rebalance(r->cfg.metrics, slot, MOED_REBALANCE_FAILED);
        moed_log_warn("re-placement failed: the layer keeps its placement",
                      "layer=%d load=%s code=%d reason=\"%s\"", index, why, rc, err->msg);
        return rc;
    }
    if (!res.changed) {
        moed_metrics_rebalance(r->cfg.metrics, slot, MOED_REBALANCE_UNCHANGED);
        moed_log_debug("re-placement not worth it: the layer keeps its placement",
                       "layer=%d load=%s pairs=%.0f launches=%.0f before=%.4g after=%.4g "
                       "min_gain=%g",
                       index, why, total, launches, res.before, res.after, r->cfg.min_gain);
        return 0;
    }
    *changed = true;
    const uint32_t gen = atomic_fetch_add(&r->generation[slot], 1) + 1;
    moed_metrics_rebalance(r->cfg.metrics, slot, MOED_REBALANCE_CHANGED);
    moed_layer_place p;
    char where[512] = "", copies[512] = "";
    if (!moed_backend_layer_place(r->cfg.backend, slot, &p)) {
        moed_shard_place_text(sh, &p, where, sizeof where);
        replica_text(sh, &p, copies, sizeof copies);
    }
    moed_log_info("layer re-placed",
                  "layer=%d load=%s pairs=%.0f launches=%.0f before=%.4g after=%.4g gain=%.4f "
                  "home_device=%d experts=\"%s\" replicas=\"%s\" generation=%u",
                  index, why, total, launches, res.before, res.after,
                  res.before > 0 ? 1 - res.after / res.before : 0, p.home, where, copies, gen);
    return 0;
}

int moed_rebalance_apply(moed_rebalance *r, int slot, const double *pairs, double launches,
                         bool *changed, moed_error *err)
{
    int rc = replace(r, slot, pairs, launches, "--expert-load", changed, err);
    if (!rc && *changed) /* what the layer serves from now on is measured from here */
        moed_metrics_layer_load(r->cfg.metrics, slot, r->base[slot].pairs,
                                r->cfg.shards[slot].view.info.n_experts, &r->base[slot].launches);
    return rc;
}

int moed_rebalance_pass(moed_rebalance *r)
{
    int changed_n = 0;
    for (int slot = 0; slot < r->cfg.n_slots && !atomic_load(&r->stopping); slot++) {
        if (!is_split(r, slot)) continue;
        const moed_shard *sh = &r->cfg.shards[slot];
        const int n = sh->view.info.n_experts;
        const int64_t min_pairs = r->cfg.min_pairs
                                      ? r->cfg.min_pairs
                                      : (int64_t)MOED_REBALANCE_PAIRS_PER_EXPERT * sh->n_held;
        uint64_t launches_now;
        double launches;
        moed_metrics_layer_load(r->cfg.metrics, slot, r->now, n, &launches_now);
        if (!moed_rebalance_delta(r->now, r->base[slot].pairs, n, launches_now,
                                  r->base[slot].launches, min_pairs, r->pairs, &launches)) {
            moed_log_debug("re-placement: too few pairs measured yet", "layer=%d min_pairs=%lld",
                           sh->full->info.index, (long long)min_pairs);
            continue;
        }
        bool changed;
        moed_error err = { 0 };
        if (replace(r, slot, r->pairs, launches, "measured", &changed, &err) || !changed) continue;
        memcpy(r->base[slot].pairs, r->now, (size_t)n * sizeof *r->now);
        r->base[slot].launches = launches_now;
        changed_n++;
    }
    return changed_n;
}

static void *run(void *arg)
{
    moed_rebalance *r = arg;
    pthread_mutex_lock(&r->lock);
    while (!atomic_load(&r->stopping)) {
        struct timespec at;
        clock_gettime(CLOCK_MONOTONIC, &at);
        at.tv_sec += r->cfg.period_s;
        while (!atomic_load(&r->stopping) &&
               pthread_cond_timedwait(&r->wake, &r->lock, &at) != ETIMEDOUT) {
        }
        if (atomic_load(&r->stopping)) break;
        pthread_mutex_unlock(&r->lock);
        moed_rebalance_pass(r);
        pthread_mutex_lock(&r->lock);
    }
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

int moed_rebalance_start(moed_rebalance *r, moed_error *err)
{
    if (!r->cfg.period_s) return 0;
    int split = 0;
    for (int slot = 0; slot < r->cfg.n_slots; slot++) split += is_split(r, slot);
    if (!split) {
        moed_log_info("--rebalance has nothing to do: the backend holds every layer whole on one "
                      "device (split layers need --expert-parallel or a layer larger than one GPU "
                      "on the cuda backend)",
                      "backend=%s layers=%d", moed_backend_name(r->cfg.backend), r->cfg.n_slots);
        return 0;
    }
    int rc = pthread_create(&r->thread, NULL, run, r);
    if (rc)
        return moed_fail(err, rc == EAGAIN ? MOED_ENOMEM : MOED_EINTERNAL,
                         "cannot start the re-placement thread: %s", strerror(rc));
    r->started = true;
    moed_log_info("re-placing split layers by measured load",
                  "every_s=%d split_layers=%d max_replicas=%d min_gain=%g min_pairs=%lld",
                  r->cfg.period_s, split, r->cfg.max_replicas, r->cfg.min_gain,
                  (long long)r->cfg.min_pairs);
    return 0;
}

uint32_t moed_rebalance_generation(const moed_rebalance *r, int slot)
{
    if (!r || slot < 0 || slot >= r->cfg.n_slots) return 0;
    return atomic_load(&r->generation[slot]);
}

void moed_rebalance_stop(moed_rebalance *r)
{
    if (!r) return;
    pthread_mutex_lock(&r->lock);
    atomic_store(&r->stopping, true);
    pthread_cond_broadcast(&r->wake);
    pthread_mutex_unlock(&r->lock);
}

void moed_rebalance_destroy(moed_rebalance *r)
{
    if (!r) return;
    if (r->started) {
        moed_rebalance_stop(r);
        pthread_join(r->thread, NULL);
    }
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->wake);
    for (int i = 0; r->base && i < r->cfg.n_slots; i++) free(r->base[i].pairs);
    free(r->base);
    free((void *)r->generation);
    free(r->now);
    free(r->pairs);
    free(r);
}
