/*
 * moed_place — the placement plan (moed_place.h says the rules).
 */
#include "moed_place.h"

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
static int least_work(const moed_place_dev *devs, const double *load, int n, uint64_t bytes)
{
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (devs[i].free < bytes) continue;
        if (best < 0 || load[i] < load[best] ||
            (load[i] == load[best] && devs[i].placed < devs[best].placed))
            best = i;
    }
    return best;
}

/* The split: home is the lightest entry with room for the base, then each expert in turn to the
 * entry that is lightest once it holds it, or with home_work, to the entry of least expected work
 * (the home starting at home_work, each expert adding 1); counts become contiguous ranges in entry
 * order. */
static int split(moed_place_dev *devs, int n, const moed_place_need *need, moed_layer_place *out)
{
    moed_place_dev d[MOED_PLACE_MAX];
    int count[MOED_PLACE_MAX] = { 0 };
    double load[MOED_PLACE_MAX] = { 0 };
    const bool by_work = need->home_work > 0;
    memcpy(d, devs, sizeof d[0] * (size_t)n);
    const int home = lightest(d, n, need->base);
    if (home < 0) return -1;
    take(d, n, home, need->base);
    load[home] = need->home_work;
    for (int e = 0; e < need->n_experts; e++) {
        const int i = by_work ? least_work(d, load, n, need->expert) : lightest(d, n, need->expert);
        if (i < 0) return -1;
        load[i] += 1;
        take(d, n, i, need->expert);
        count[i]++;
    }
    memcpy(devs, d, sizeof d[0] * (size_t)n);
    out->home = home;
    out->n_parts = 0;
    for (int i = 0, first = 0; i < n; first += count[i++])
        if (count[i]) out->part[out->n_parts++] = (moed_place_part){ i, first, count[i] };
    return 0;
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
