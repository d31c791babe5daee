/*
 * moed_shard — expert shards: the maps between the whole layer's expert ids and the held ones, the
 * backend's view of the layer, and the held experts as ranges (see shard.h).
 */
#include "shard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

moed_expert_subset moed_shard_subset(const int *experts, int n, const char *shared_mode)
{
    bool holds_first = !experts || (n > 0 && experts[0] == 0);
    bool shared = !strcmp(shared_mode, "on") || (!strcmp(shared_mode, "auto") && holds_first);
    return (moed_expert_subset){ .ids = experts, .n = experts ? n : 0, .shared = shared };
}

/* The held experts' maps and weights, when the shard holds fewer than all. */
static int make_maps(moed_shard *s, const moed_expert_subset *held, moed_error *err)
{
    const int E = s->full->info.n_experts;
    s->local_of = malloc((size_t)E * sizeof *s->local_of);
    s->global_of = malloc((size_t)s->n_held * sizeof *s->global_of);
    s->held_w = malloc((size_t)s->n_held * sizeof *s->held_w);
    if (!s->local_of || !s->global_of || !s->held_w)
        return moed_fail(err, MOED_ENOMEM, "no memory for layer %d's expert maps",
                         s->full->info.index);
    for (int e = 0, k = 0; e < E; e++) {
        s->local_of[e] = moed_expert_subset_has(held, e) ? k : -1;
        if (s->local_of[e] < 0) continue;
        s->global_of[k] = e;
        s->held_w[k++] = s->full->experts[e];
    }
    s->view.experts = s->held_w;
    s->view.local_of = s->local_of;
    s->view.info.n_experts = s->n_held;
    s->view.info.router_experts = E;
    return 0;
}

int moed_shard_make(const moed_layer *full, const moed_expert_subset *held, moed_shard *out,
                    moed_error *err)
{
    memset(out, 0, sizeof *out);
    out->full = full;
    out->view = *full;
    out->adds_shared = moed_expert_subset_shared(held);
    const int E = full->info.n_experts;
    for (int e = 0; e < E; e++) out->n_held += moed_expert_subset_has(held, e);
    if (!out->adds_shared) { /* the backend never sees them: another shard adds them */
        out->view.info.n_shared = 0;
        out->view.info.shared_d_ff = 0;
        memset(&out->view.shared, 0, sizeof out->view.shared);
    }
    if (out->n_held == E) return 0;
    int rc = make_maps(out, held, err);
    if (rc) moed_shard_free(out);
    return rc;
}

void moed_shard_free(moed_shard *s)
{
    free(s->local_of);
    free(s->global_of);
    free(s->held_w);
    memset(s, 0, sizeof *s);
}

bool moed_shard_all_experts(const moed_shard *s)
{
    return !s->local_of;
}

void moed_shard_localize(const moed_shard *s, moed_route *r)
{
    if (s->local_of) moed_route_localize(r, s->local_of);
}

int moed_shard_global(const moed_shard *s, int local)
{
    return s->global_of ? s->global_of[local] : local;
}

/* The run of consecutive held experts from local id *k on, up to local id end (excluded), as
 * [*a, *b]; *k moves past it. */
static void next_run(const moed_shard *s, int *k, int end, int *a, int *b)
{
    *a = moed_shard_global(s, *k);
    while (*k + 1 < end && moed_shard_global(s, *k + 1) == moed_shard_global(s, *k) + 1) (*k)++;
    *b = moed_shard_global(s, (*k)++);
}

int moed_shard_range_list(const moed_shard *s, uint32_t *first, uint32_t *last, int cap)
{
    int n = 0, a, b;
    for (int k = 0; k < s->n_held; n++) {
        next_run(s, &k, s->n_held, &a, &b);
        if (n < cap) {
            first[n] = (uint32_t)a;
            last[n] = (uint32_t)b;
        }
    }
    return n;
}

void moed_shard_ranges(const moed_shard *s, char *buf, size_t n)
{
    size_t at = 0;
    int a, b;
    buf[0] = 0;
    for (int k = 0; k < s->n_held && at + 1 < n;) {
        next_run(s, &k, s->n_held, &a, &b);
        const int w = a == b ? snprintf(buf + at, n - at, "%s%d", at ? "," : "", a)
                             : snprintf(buf + at, n - at, "%s%d-%d", at ? "," : "", a, b);
        if (w < 0) break;
        at += (size_t)w;
    }
}

int moed_shard_place_list(const moed_shard *s, const moed_layer_place *p, uint32_t *first,
                          uint32_t *last, uint32_t *dev, int cap)
{
    int n = 0, a, b;
    for (int i = 0; i < p->n_parts; i++) {
        const int end = p->part[i].first + p->part[i].count;
        for (int k = p->part[i].first; k < end; n++) {
            next_run(s, &k, end, &a, &b);
            if (n < cap) {
                first[n] = (uint32_t)a;
                last[n] = (uint32_t)b;
                dev[n] = (uint32_t)p->part[i].dev;
            }
        }
    }
    return n;
}

void moed_shard_place_text(const moed_shard *s, const moed_layer_place *p, char *buf, size_t n)
{
    uint32_t first[64], last[64], dev[64];
    const int k = moed_shard_place_list(s, p, first, last, dev, 64);
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < k && i < 64 && at + 1 < n; i++) {
        const int w =
            first[i] == last[i]
                ? snprintf(buf + at, n - at, "%s%u@%u", i ? "," : "", first[i], dev[i])
                : snprintf(buf + at, n - at, "%s%u-%u@%u", i ? "," : "", first[i], last[i], dev[i]);
        if (w < 0) break;
        at += (size_t)w;
    }
}
