/*
 * moed_place — the placement plan (moed_place.h says the rules).
 */
#include "moed_place.h"

#include <math.h>
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

/* The split around `home` (whose GPU must have room for the base): the experts by work
 * (split_by_work) or, without loads or home_work, each in turn to the entry that is lightest in
 * bytes once it holds it; counts become contiguous ranges in entry order. */
static int split_at(moed_place_dev *devs, int n, const moed_place_need *need, int home,
                    moed_layer_place *out)
{
    moed_place_dev d[MOED_PLACE_MAX];
    int count[MOED_PLACE_MAX] = { 0 };
    memcpy(d, devs, sizeof d[0] * (size_t)n);
    if (d[home].free < need->base) return -1;
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

/* The split: home is the lightest entry with room for the base (split_at does the rest). */
static int split(moed_place_dev *devs, int n, const moed_place_need *need, moed_layer_place *out)
{
    const int home = lightest(devs, n, need->base);
    return home < 0 ? -1 : split_at(devs, n, need, home, out);
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

double moed_place_shared_work_measured(double width, const double *pairs, int n, int E, int k,
                                       double launches, double stream_rows)
{
    double total = 0, cost = 0;
    for (int e = 0; e < n; e++) {
        double c;
        moed_place_costs(&pairs[e], 1, launches, stream_rows, &c);
        total += pairs[e];
        cost += c;
    }
    if (!(launches > 0) || !(total > 0) || n <= 0 || k <= 0) return -1;
    const double tokens = total * E / ((double)n * k);
    return width * (tokens + stream_rows * launches) / (cost / n);
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

int moed_place_recut(moed_place_dev *devs, int n, const moed_place_need *need, int home,
                     moed_layer_place *out, moed_error *err)
{
    memset(out, 0, sizeof *out);
    if (n < 1 || n > MOED_PLACE_MAX || home < 0 || home >= n || need->n_experts < 1)
        return moed_fail(err, MOED_EINVAL, "cutting %d experts over %d devices from home %d",
                         need->n_experts, n, home);
    if (!split_at(devs, n, need, home, out)) return 0;
    return moed_fail(err, MOED_ENOMEM,
                     "its %d experts of %.3f GiB%s do not fit the %.2f GiB free on its devices; "
                     "free memory on them (fewer --streams or --max-batch-tokens) or leave the "
                     "placement as it is",
                     need->n_experts, gib(need->expert),
                     need->base ? ", with router and shared experts," : "",
                     gib(free_total(devs, n)));
}

double moed_place_copy_cost(const moed_place_load *ld, int e, int copies)
{
    const double share = ld->pairs[e] / (copies > 0 ? copies : 1);
    double cost;
    moed_place_costs(&share, 1, ld->launches, ld->stream_rows, &cost);
    return cost;
}

/* The home's own work in rows' time: home_work routed experts of the mean cost (one copy each). */
static double home_cost(const moed_place_load *ld)
{
    double sum = 0;
    for (int e = 0; e < ld->n_experts; e++) sum += moed_place_copy_cost(ld, e, 1);
    return ld->n_experts > 0 ? ld->home_work * sum / ld->n_experts : 0;
}

/* The entry whose range holds expert e; -1 if none. */
static int range_entry(const moed_layer_place *p, int e)
{
    for (int i = 0; i < p->n_parts; i++)
        if (e >= p->part[i].first && e < p->part[i].first + p->part[i].count) return p->part[i].dev;
    return -1;
}

/* Each expert's copies under p (its range's and its extra ones) into copies[n_experts], and a
 * mask of the entries holding it into holds (NULL: not wanted). */
static void count_copies(const moed_layer_place *p, int n_experts, int *copies, uint32_t *holds)
{
    for (int e = 0; e < n_experts; e++) {
        const int i = range_entry(p, e);
        copies[e] = i >= 0;
        if (holds) holds[e] = i >= 0 ? 1u << i : 0;
    }
    for (int r = 0; r < p->n_replicas; r++) {
        const moed_place_replica *c = &p->replica[r];
        copies[c->expert]++;
        if (holds) holds[c->expert] |= 1u << c->dev;
    }
}

/* The heaviest of work[0 .. n-1], ties to the first. */
static int heaviest(const double *work, int n)
{
    int h = 0;
    for (int i = 1; i < n; i++)
        if (work[i] > work[h]) h = i;
    return h;
}

/* Each entry's work under p, given each expert's copies (count_copies). */
static void entry_work(const moed_layer_place *p, int n, const moed_place_load *ld,
                       const int *copies, double *work)
{
    for (int i = 0; i < n; i++) work[i] = 0;
    work[p->home] += home_cost(ld);
    for (int i = 0; i < p->n_parts; i++)
        for (int e = p->part[i].first; e < p->part[i].first + p->part[i].count; e++)
            work[p->part[i].dev] += moed_place_copy_cost(ld, e, copies[e]);
    for (int r = 0; r < p->n_replicas; r++)
        work[p->replica[r].dev] +=
            moed_place_copy_cost(ld, p->replica[r].expert, copies[p->replica[r].expert]);
}

double moed_place_peak(const moed_layer_place *p, int n, const moed_place_load *ld, double *work)
{
    double w[MOED_PLACE_MAX];
    int *copies = malloc(sizeof *copies * (size_t)(ld->n_experts > 0 ? ld->n_experts : 1));
    if (!copies) return HUGE_VAL;
    count_copies(p, ld->n_experts, copies, NULL);
    entry_work(p, n, ld, copies, w);
    free(copies);
    if (work) memcpy(work, w, sizeof w[0] * (size_t)n);
    return w[heaviest(w, n)];
}

/* Gives back bytes that take() counted into entry i. */
static void untake(moed_place_dev *devs, int n, int i, uint64_t bytes)
{
    devs[i].placed -= bytes;
    for (int j = 0; j < n; j++)
        if (devs[j].gpu == devs[i].gpu) devs[j].free += bytes;
}

/* One greedy step (moed_place.h): the copy of the heaviest entry's costliest expert to the
 * lightest entry without it that has room, into *c; false when there is none or it would not
 * lower the heaviest entry's work or would raise the peak. */
static bool next_copy(const moed_place_dev *devs, int n, uint64_t bytes, const moed_place_load *ld,
                      const int *copies, const uint32_t *holds, const double *work,
                      moed_place_replica *c)
{
    const int h = heaviest(work, n);
    int best = -1;
    double best_cost = 0;
    for (int e = 0; e < ld->n_experts; e++) {
        if (!(holds[e] >> h & 1)) continue;
        const double cost = moed_place_copy_cost(ld, e, copies[e]);
        if (best < 0 || cost > best_cost) {
            best = e;
            best_cost = cost;
        }
    }
    if (best < 0) return false;
    int to = -1;
    for (int i = 0; i < n; i++)
        if (!(holds[best] >> i & 1) && devs[i].free >= bytes && (to < 0 || work[i] < work[to]))
            to = i;
    if (to < 0) return false;
    const double after = moed_place_copy_cost(ld, best, copies[best] + 1);
    if (!(after < best_cost) || work[to] + after > work[h]) return false;
    *c = (moed_place_replica){ best, to };
    return true;
}

/* Orders copies by expert, then entry (moed_layer_place's order). */
static void sort_replicas(moed_layer_place *p)
{
    for (int i = 1; i < p->n_replicas; i++) {
        const moed_place_replica v = p->replica[i];
        int j = i;
        for (; j > 0 && (p->replica[j - 1].expert > v.expert ||
                         (p->replica[j - 1].expert == v.expert && p->replica[j - 1].dev > v.dev));
             j--)
            p->replica[j] = p->replica[j - 1];
        p->replica[j] = v;
    }
}

int moed_place_replicate(moed_layer_place *p, moed_place_dev *devs, int n, uint64_t expert_bytes,
                         const moed_place_load *ld, int max_replicas)
{
    const int E = ld->n_experts, start = p->n_replicas;
    int *copies = malloc(sizeof *copies * (size_t)(E > 0 ? E : 1));
    uint32_t *holds = malloc(sizeof *holds * (size_t)(E > 0 ? E : 1));
    if (!copies || !holds) {
        free(copies);
        free(holds);
        return -1;
    }
    count_copies(p, E, copies, holds);
    double work[MOED_PLACE_MAX];
    entry_work(p, n, ld, copies, work);
    double best = work[heaviest(work, n)];
    int keep = start; /* the copies of the shortest prefix that reached the lowest peak */
    moed_place_replica c;
    while (p->n_replicas - start < max_replicas && p->n_replicas < MOED_PLACE_MAX_REPLICAS &&
           next_copy(devs, n, expert_bytes, ld, copies, holds, work, &c)) {
        p->replica[p->n_replicas++] = c;
        take(devs, n, c.dev, expert_bytes);
        copies[c.expert]++;
        holds[c.expert] |= 1u << c.dev;
        entry_work(p, n, ld, copies, work);
        const double peak = work[heaviest(work, n)];
        if (peak < best) {
            best = peak;
            keep = p->n_replicas;
        }
    }
    for (int r = keep; r < p->n_replicas; r++) untake(devs, n, p->replica[r].dev, expert_bytes);
    p->n_replicas = keep;
    sort_replicas(p);
    free(copies);
    free(holds);
    return keep - start;
}

int moed_place_parts(const moed_layer_place *p, int *dev)
{
    uint32_t held = 0;
    for (int i = 0; i < p->n_parts; i++)
        if (p->part[i].count) held |= 1u << p->part[i].dev;
    for (int r = 0; r < p->n_replicas; r++) held |= 1u << p->replica[r].dev;
    int n = 0;
    for (int i = 0; i < MOED_PLACE_MAX; i++)
        if (held >> i & 1) dev[n++] = i;
    return n;
}

/* The count of entry dev's range (0 without one), and its first expert into *first. */
static int range_of(const moed_layer_place *p, int dev, int *first)
{
    for (int i = 0; i < p->n_parts; i++)
        if (p->part[i].dev == dev) {
            *first = p->part[i].first;
            return p->part[i].count;
        }
    *first = 0;
    return 0;
}

int moed_place_entry_experts(const moed_layer_place *p, int dev, int *ids)
{
    int first;
    int n = range_of(p, dev, &first);
    for (int i = 0; i < n; i++) ids[i] = first + i;
    for (int r = 0; r < p->n_replicas; r++)
        if (p->replica[r].dev == dev) ids[n++] = p->replica[r].expert;
    return n;
}

void moed_place_copies(const moed_layer_place *p, int n_experts, int32_t *off, uint8_t *part,
                       int32_t *local)
{
    int dev[MOED_PLACE_MAX], part_of[MOED_PLACE_MAX], next[MOED_PLACE_MAX], first;
    const int n = moed_place_parts(p, dev);
    for (int q = 0; q < n; q++) {
        part_of[dev[q]] = q;
        next[dev[q]] = range_of(p, dev[q], &first); /* its copies are numbered after its range */
    }
    off[0] = 0;
    for (int e = 0; e < n_experts; e++) off[e + 1] = 1;
    for (int r = 0; r < p->n_replicas; r++) off[p->replica[r].expert + 1]++;
    for (int e = 0; e < n_experts; e++) off[e + 1] += off[e];
    for (int i = 0; i < p->n_parts; i++)
        for (int e = p->part[i].first; e < p->part[i].first + p->part[i].count; e++) {
            part[off[e]] = (uint8_t)part_of[p->part[i].dev];
            local[off[e]] = e - p->part[i].first;
        }
    for (int r = 0, k = 1; r < p->n_replicas; r++) { /* by expert then entry: k-th extra copy */
        const moed_place_replica *c = &p->replica[r];
        k = r > 0 && p->replica[r - 1].expert == c->expert ? k + 1 : 1;
        part[off[c->expert] + k] = (uint8_t)part_of[c->dev];
        local[off[c->expert] + k] = next[c->dev]++;
    }
}
