/*
 * moed_place — the placement plan (moed_place.h says the rules).
 */
#include "moed_place.h"

#include <stdlib.h>
#include <string.h>

static double gib(uint64_t b)
{
    return (double)b / 1073741824.0;
}

/* Counts bytes into entry i: its own share, and its GPU's free memory (every entry of that GPU). */
static void take(moed_place_dev *devs, int n, int i, uint64_t bytes)
{
    devs[i].placed += bytes;
    for (int j = 0; j < n; j++)
        if (devs[j].gpu == devs[i].gpu) devs[j].free -= bytes;
}

/* The entry with the fewest bytes placed among those whose GPU has `bytes` free; -1 if none. */
static int lightest(const moed_place_dev *devs, int n, uint64_t bytes)
{
    int best = -1;
    for (int i = 0; i < n; i++)
        if (devs[i].free >= bytes && (best < 0 || devs[i].placed < devs[best].placed)) best = i;
    return best;
}

/* Free bytes over distinct GPUs, for the message. */
static uint64_t free_total(const moed_place_dev *devs, int n)
{
    uint64_t sum = 0;
    for (int i = 0; i < n; i++) {
        bool first = true;
        for (int j = 0; j < i; j++) first = first && devs[j].gpu != devs[i].gpu;
        if (first) sum += devs[i].free;
    }
    return sum;
}

/* The entry of least expected work among those whose GPU has `bytes` free, ties to the fewest
 * bytes placed, then to the first listed; -1 if none. */
/* Whether experts can be cut into contiguous ranges over the entries in order with no entry's
 * work over `bound` (the home's starting at home_work) and each within its GPU's room; count gets
 * each entry's experts, taking as many as the bound and the room allow. */
static bool cut(const moed_place_dev *devs, int n, const moed_place_need *need, int home,
                const double *w, double bound, int *count)
{
    uint64_t room[MOED_PLACE_MAX]; /* by entry, shared between the entries of one GPU below */
    for (int i = 0; i < n; i++) room[i] = devs[i].free;
    room[home] -= need->base;
    for (int i = 0; i < n; i++)
        if (devs[i].gpu == devs[home].gpu) room[i] = room[home];
    int e = 0;
    for (int i = 0; i < n; i++) {
        double work = i == home ? need->home_work : 0;
        count[i] = 0;
        while (e < need->n_experts && room[i] >= need->expert && work + w[e] <= bound) {
            work += w[e++];
            count[i]++;
            for (int j = 0; j < n; j++)
                if (devs[j].gpu == devs[i].gpu) room[j] -= need->expert;
        }
    }
    return e == need->n_experts;
}

/* The split by work (moed_place.h): the least bound that cut() meets, by bisection between the
 * mean share and everything on one entry, then the counts at that bound. */
static bool split_by_work(const moed_place_dev *devs, int n, const moed_place_need *need, int home,
                          int *count)
{
    double *w = malloc(sizeof *w * (size_t)need->n_experts), total = 0;
    if (!w) return false;
    for (int e = 0; e < need->n_experts; e++) total += need->load ? need->load[e] : 1;
    const double unit = need->load && total > 0 ? total / need->n_experts : 1;
    double lo = 0, hi = need->home_work;
    for (int e = 0; e < need->n_experts; e++) {
        w[e] = need->load && total > 0 ? need->load[e] / unit : 1;
        hi += w[e];
    }
    bool ok = cut(devs, n, need, home, w, hi, count); /* false: no room, whatever the bound */
    for (int it = 0; ok && it < 64 && hi - lo > 1e-9 * hi; it++) {
        const double mid = (lo + hi) / 2;
        if (cut(devs, n, need, home, w, mid, count))
            hi = mid;
        else
            lo = mid;
    }
    ok = ok && cut(devs, n, need, home, w, hi, count);
    free(w);
    return ok;
}

/* The split: home is the lightest entry with room for the base; then the experts by work
 * (split_by_work) or, without loads or home_work, each in turn to the entry that is lightest in
 * bytes once it holds it; counts become contiguous ranges in entry order. */
static int split(moed_place_dev *devs, int n, const moed_place_need *need, moed_layer_place *out)
{
    moed_place_dev d[MOED_PLACE_MAX];
    int count[MOED_PLACE_MAX] = { 0 };
    memcpy(d, devs, sizeof d[0] * (size_t)n);
    const int home = lightest(d, n, need->base);
    if (home < 0) return -1;
    if (need->home_work > 0 || need->load) {
        if (!split_by_work(d, n, need, home, count)) return -1;
        take(d, n, home, need->base);
        for (int i = 0; i < n; i++) take(d, n, i, need->expert * (uint64_t)count[i]);
    } else {
        take(d, n, home, need->base);
        for (int e = 0; e < need->n_experts; e++) {
            const int i = lightest(d, n, need->expert);
            if (i < 0) return -1;
            take(d, n, i, need->expert);
            count[i]++;
        }
    }
    memcpy(devs, d, sizeof d[0] * (size_t)n);
    out->home = home;
    out->n_parts = 0;
    for (int i = 0, first = 0; i < n; first += count[i++])
        if (count[i]) out->part[out->n_parts++] = (moed_place_part){ i, first, count[i] };
    return 0;
}

double moed_place_shared_work(double width, int E, int k)
{
    return k > 0 ? width * ((double)E / k + 1) / 2 : 0;
}

void moed_place_costs(const double *pairs, int n, double launches, double stream_rows, double *out)
{
    for (int e = 0; e < n; e++)
        out[e] = pairs[e] +
                 (launches > 0 ? stream_rows * (pairs[e] < launches ? pairs[e] : launches) : 0);
}

int moed_place_layer(moed_place_dev *devs, int n, const moed_place_need *need,
                     moed_layer_place *out, moed_error *err)
{
    const uint64_t whole = need->base + need->expert * (uint64_t)need->n_experts;
    memset(out, 0, sizeof *out);
    if (n < 1 || n > MOED_PLACE_MAX || need->n_experts < 1)
        return moed_fail(err, MOED_EINVAL, "placing a layer of %d experts over %d devices",
                         need->n_experts, n);
    const int i = need->split && n > 1 ? -1 : lightest(devs, n, whole);
    if (i >= 0) {
        take(devs, n, i, whole);
        out->home = i;
        out->n_parts = 1;
        out->part[0] = (moed_place_part){ i, 0, need->n_experts };
        return 0;
    }
    if (n > 1 && !split(devs, n, need, out)) return 0;
    return moed_fail(err, MOED_ENOMEM,
                     "its weights need %.2f GiB (%d experts of %.3f GiB%s): more than %s (%.2f "
                     "GiB free); serve fewer layers (--layers) or experts (--experts), or add "
                     "devices",
                     gib(whole), need->n_experts, gib(need->expert),
                     need->base ? ", plus router and shared experts" : "",
                     n > 1 ? "the devices hold with its experts split over them"
                           : "the device holds",
                     gib(free_total(devs, n)));
}

bool moed_place_is_split(const moed_layer_place *p)
{
    return p->n_parts > 1 || (p->n_parts == 1 && p->part[0].dev != p->home);
}
