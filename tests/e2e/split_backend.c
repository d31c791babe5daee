/*
 * split_backend — the backend registry of moed-split-test, the daemon the end-to-end tests of
 * --rebalance run where there is no GPU: server/main.c linked with this file in place of
 * moed_registry.c. Whatever --backend asks for, it opens the CPU backend, which computes every
 * layer whole (so replies are the CPU's, exactly), and dresses it as a backend that holds every
 * layer split over two device entries:
 *
 *   layer_place    at load, the layer's experts cut in two halves on entries 0 and 1, home 0;
 *                  afterwards whatever the last re-placement made;
 *   replace_layer  appends the request to $MOED_FAKE_SPLIT_LOG (one line: slot, launches,
 *                  max_replicas, min_gain and the pairs in the backend's numbering), sleeps
 *                  $MOED_FAKE_SPLIT_DELAY_MS (a slow copy of weights), fails the first
 *                  $MOED_FAKE_SPLIT_FAIL calls (MOED_ENOMEM, as a backend short of memory does),
 *                  and otherwise cuts the experts in the two contiguous ranges that even out the
 *                  pairs, with one copy of the hottest expert on the other entry when
 *                  max_replicas > 0; the work of an entry is the pairs of its experts, a copied
 *                  expert's shared evenly. Changed when the heaviest entry's work drops by at
 *                  least min_gain of it, as moed_backend_replace_layer's contract says;
 *   device_info    entries 0 and 1, both the host.
 *
 * Not a model of the CUDA backend's costs (moed_place_costs): only of the contract the daemon
 * relies on (kernels/moed_backend.h).
 */
#include "cpu_backend.h"
#include "moed_backend_impl.h"
#include "moed_registry.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ENTRIES 2

static moed_backend_ops ops;     /* the CPU's, with the calls below in place */
static moed_backend_ops cpu_ops; /* the CPU's own */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static moed_layer_place *places; /* by slot */
static int n_places, calls;

static int split_load_layer(moed_backend *b, int slot, const moed_layer *l, moed_error *err)
{
    int rc = cpu_ops.load_layer(b, slot, l, err);
    if (rc) return rc;
    pthread_mutex_lock(&lock);
    if (slot >= n_places) {
        moed_layer_place *p = realloc(places, (size_t)(slot + 1) * sizeof *p);
        if (!p) {
            pthread_mutex_unlock(&lock);
            return moed_fail(err, MOED_ENOMEM, "split_backend: no memory for the placements");
        }
        places = p;
        n_places = slot + 1;
    }
    const int n = l->info.n_experts, half = n / 2;
    places[slot] = (moed_layer_place){ .home = 0, .n_parts = half ? 2 : 1 };
    places[slot].part[0] = (moed_place_part){ 0, 0, half ? half : n };
    places[slot].part[1] = (moed_place_part){ 1, half, n - half };
    pthread_mutex_unlock(&lock);
    return 0;
}

static int split_layer_place(moed_backend *b, int slot, moed_layer_place *out)
{
    (void)b;
    pthread_mutex_lock(&lock);
    const int rc = slot >= 0 && slot < n_places ? 0 : MOED_ENOTFOUND;
    if (!rc) *out = places[slot];
    pthread_mutex_unlock(&lock);
    return rc;
}

static int split_device_info(moed_backend *b, int i, moed_device_info *out)
{
    if (i < 0 || i >= ENTRIES) return MOED_ENOTFOUND;
    int rc = cpu_ops.device_info(b, 0, out);
    snprintf(out->name, sizeof out->name, "split-test entry %d (the host)", i);
    return rc;
}

/* The heaviest entry's work under placement p of n experts with loads pairs. */
static double heaviest(const moed_layer_place *p, const double *pairs, int n)
{
    double work[ENTRIES] = { 0 };
    for (int i = 0; i < p->n_parts; i++)
        for (int e = p->part[i].first; e < p->part[i].first + p->part[i].count && e < n; e++) {
            int copies = 1;
            for (int c = 0; c < p->n_replicas; c++) copies += p->replica[c].expert == e;
            work[p->part[i].dev] += pairs[e] / copies;
            for (int c = 0; c < p->n_replicas; c++)
                if (p->replica[c].expert == e) work[p->replica[c].dev] += pairs[e] / copies;
        }
    return work[0] > work[1] ? work[0] : work[1];
}

static int env_int(const char *name)
{
    const char *v = getenv(name);
    return v ? atoi(v) : 0;
}

static int split_replace_layer(moed_backend *b, int slot, const moed_replace_req *req,
                               moed_replace_result *res, moed_error *err)
{
    moed_layer_place old;
    if (split_layer_place(b, slot, &old))
        return moed_fail(err, MOED_ENOTFOUND, "split_backend: no layer in slot %d", slot);
    const int n = old.part[old.n_parts - 1].first + old.part[old.n_parts - 1].count;
    const char *path = getenv("MOED_FAKE_SPLIT_LOG");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (f) {
        fprintf(f, "slot=%d launches=%.0f max_replicas=%d min_gain=%g pairs=", slot, req->launches,
                req->max_replicas, req->min_gain);
        for (int e = 0; e < n; e++) fprintf(f, "%s%.0f", e ? "," : "", req->pairs[e]);
        fprintf(f, "\n");
        fclose(f);
    }
    const int delay_ms = env_int("MOED_FAKE_SPLIT_DELAY_MS");
    if (delay_ms > 0) {
        struct timespec ts = { delay_ms / 1000, (long)(delay_ms % 1000) * 1000000L };
        nanosleep(&ts, NULL);
    }
    if (__atomic_fetch_add(&calls, 1, __ATOMIC_RELAXED) < env_int("MOED_FAKE_SPLIT_FAIL"))
        return moed_fail(err, MOED_ENOMEM,
                         "split_backend: no room for the new parts beside the old (as told by "
                         "$MOED_FAKE_SPLIT_FAIL)");
    moed_layer_place best = old;
    if (n >= 2) {
        int hot = 0;
        for (int e = 1; e < n; e++)
            if (req->pairs[e] > req->pairs[hot]) hot = e;
        double best_work = -1;
        for (int cut = 1; cut < n; cut++) {
            moed_layer_place p = { .home = 0, .n_parts = 2 };
            p.part[0] = (moed_place_part){ 0, 0, cut };
            p.part[1] = (moed_place_part){ 1, cut, n - cut };
            if (req->max_replicas > 0)
                p.replica[p.n_replicas++] = (moed_place_replica){ hot, hot < cut ? 1 : 0 };
            const double w = heaviest(&p, req->pairs, n);
            if (best_work < 0 || w < best_work) {
                best_work = w;
                best = p;
            }
        }
    }
    res->before = heaviest(&old, req->pairs, n);
    res->after = heaviest(&best, req->pairs, n);
    res->changed = res->before > 0 && res->before - res->after >= req->min_gain * res->before &&
                   res->after < res->before;
    if (res->changed) {
        pthread_mutex_lock(&lock);
        places[slot] = best;
        pthread_mutex_unlock(&lock);
    }
    return 0;
}

int moed_backend_open(const char *name, const moed_backend_config *cfg, moed_backend **out,
                      moed_error *err)
{
    (void)name;
    int rc = moed_backend_cpu_open(cfg, out, err);
    if (rc) return rc;
    cpu_ops = *(*out)->ops;
    ops = cpu_ops;
    ops.load_layer = split_load_layer;
    ops.layer_place = split_layer_place;
    ops.replace_layer = split_replace_layer;
    ops.device_info = split_device_info;
    (*out)->ops = &ops;
    (*out)->n_devices = ENTRIES;
    return 0;
}

int moed_backend_cuda_available(void)
{
    return 0;
}
