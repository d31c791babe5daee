/*
 * getmodel — moed.v1.Moed/GetModel: the ModelInfo of what this daemon serves. Per layer its sizes,
 * routing and weight dtype, the experts it holds (experts_held, adds_shared_experts: a shard of a
 * fleet holds some) and where they live (home_device, expert_placement, expert_replicas, in the
 * whole layer's numbering, and placement_generation: the re-placements by measured load applied);
 * the backend, its devices and their memory now; the version, the limits, the tensor regions'
 * mode and caps, and the model's fingerprint. While the weights still load: the model as given,
 * the backend, its devices, the version and the message limit, and how far the load has come
 * (ModelInfo.loading), nothing of what is not loaded yet. Answered to every caller let in,
 * loading, draining or not; out of memory while building it is RESOURCE_EXHAUSTED.
 */
#include "rpc_call.h"

#include "loading.h"
#include "rebalance.h"

#include "wire.h"

#include "moed/v1/moed.pb-c.h"

#include <stdlib.h>

/* The experts each layer holds (LayerInfo.experts_held, adds_shared_experts), in one allocation:
 * *out, which the caller frees once the message is packed. */
static int held_experts(const moed_served *s, Moed__V1__LayerInfo *li, void **out)
{
    int n = 0;
    for (int i = 0; i < s->n_layers; i++) n += moed_served_held(s, i, NULL, NULL, 0);
    const size_t each = sizeof(Moed__V1__ExpertRange) + sizeof(void *) + 2 * sizeof(uint32_t);
    char *block = calloc((size_t)n + 1, each);
    *out = block;
    if (!block) return MOED_ENOMEM;
    Moed__V1__ExpertRange *r = (Moed__V1__ExpertRange *)block;
    Moed__V1__ExpertRange **rp = (Moed__V1__ExpertRange **)(r + n + 1);
    uint32_t *lo = (uint32_t *)(rp + n + 1), *hi = lo + n + 1;
    for (int i = 0, at = 0; i < s->n_layers; i++) {
        const int k = moed_served_held(s, i, lo + at, hi + at, n - at);
        li[i].adds_shared_experts = moed_served_adds_shared(s, i);
        li[i].n_experts_held = (size_t)k;
        li[i].experts_held = rp + at;
        for (int j = at; j < at + k; j++) {
            moed__v1__expert_range__init(&r[j]);
            r[j].first = lo[j];
            r[j].last = hi[j];
            rp[j] = &r[j];
        }
        at += k;
    }
    return 0;
}

/* Layer slot i's placement p in the whole layer's numbering (moed_shard_place_list; a layer held
 * whole without shards is one shard of itself). */
static int placed_ranges(const moed_served *s, const moed_layer_place *p, int i, uint32_t *lo,
                         uint32_t *hi, uint32_t *dev, int cap)
{
    if (s->shards) return moed_shard_place_list(&s->shards[i], p, lo, hi, dev, cap);
    int n = 0;
    for (; n < p->n_parts && n < cap; n++) {
        lo[n] = (uint32_t)p->part[n].first;
        hi[n] = (uint32_t)(p->part[n].first + p->part[n].count - 1);
        dev[n] = (uint32_t)p->part[n].dev;
    }
    return p->n_parts;
}

/* Where each layer lives (LayerInfo.home_device, expert_placement, expert_replicas,
 * placement_generation), in one allocation: *out, which the caller frees once the message is
 * packed. Each layer's placement is asked for once, here: a re-placement (--rebalance) may swap
 * it between two calls, and the counts must be those of the placement the ranges come from. */
static int expert_places(const moed_served *s, moed_backend *b, Moed__V1__LayerInfo *li, void **out)
{
    moed_layer_place *pl = calloc((size_t)s->n_layers + 1, sizeof *pl);
    if (!pl) return MOED_ENOMEM;
    int n = 0;
    for (int i = 0; i < s->n_layers; i++) {
        li[i].placement_generation = moed_rebalance_generation(s->rebalance, i);
        if (moed_backend_layer_place(b, i, &pl[i])) pl[i] = (moed_layer_place){ .n_parts = 0 };
        n += placed_ranges(s, &pl[i], i, NULL, NULL, NULL, 0) + pl[i].n_replicas;
    }
    const size_t each = sizeof(Moed__V1__ExpertPlacement) + sizeof(void *) + 3 * sizeof(uint32_t);
    char *block = calloc((size_t)n + 1, each);
    *out = block;
    if (!block) {
        free(pl);
        return MOED_ENOMEM;
    }
    Moed__V1__ExpertPlacement *r = (Moed__V1__ExpertPlacement *)block;
    Moed__V1__ExpertPlacement **rp = (Moed__V1__ExpertPlacement **)(r + n + 1);
    uint32_t *lo = (uint32_t *)(rp + n + 1), *hi = lo + n + 1, *dev = hi + n + 1;
    for (int i = 0, at = 0; i < s->n_layers; i++) {
        const moed_layer_place *p = &pl[i];
        li[i].home_device = (uint32_t)p->home;
        const int k = placed_ranges(s, p, i, lo + at, hi + at, dev + at, n - at);
        for (int c = 0; c < p->n_replicas; c++) { /* one expert each, after the ranges */
            const int e = p->replica[c].expert;
            lo[at + k + c] = hi[at + k + c] =
                (uint32_t)(s->shards ? moed_shard_global(&s->shards[i], e) : e);
            dev[at + k + c] = (uint32_t)p->replica[c].dev;
        }
        for (int j = at; j < at + k + p->n_replicas; j++) {
            moed__v1__expert_placement__init(&r[j]);
            r[j].first = lo[j];
            r[j].last = hi[j];
            r[j].device = dev[j];
            rp[j] = &r[j];
        }
        li[i].n_expert_placement = (size_t)k;
        li[i].expert_placement = rp + at;
        li[i].n_expert_replicas = (size_t)p->n_replicas;
        li[i].expert_replicas = rp + at + k;
        at += k + p->n_replicas;
    }
    free(pl);
    return 0;
}

/* ModelInfo.loading from the load's state. */
static void load_progress(const moed_loading_state *s, Moed__V1__LoadProgress *p)
{
    p->phase = (char *)s->phase;
    p->phase_number = (uint32_t)s->phase_no;
    p->phases = (uint32_t)s->phases;
    p->layer = s->layer;
    p->layers_done = (uint32_t)s->layers_done;
    p->layers_total = (uint32_t)s->layers_total;
    p->bytes_done = s->bytes_done;
    p->bytes_total = s->bytes_total;
    p->percent = (float)s->percent;
    p->elapsed_seconds = (float)s->elapsed_s;
    p->bytes_per_second = (float)s->rate_bps;
    p->eta_seconds = (float)s->eta_s;
}

static grpc_byte_buffer *model_info(moed_rpc *r)
{
    static const moed_served none; /* what is served while the weights load */
    const bool loaded = atomic_load(&r->loaded);
    const moed_served *s = loaded ? r->cfg.served : &none;
    moed_backend *b = r->cfg.backend;
    grpc_byte_buffer *bb = NULL;
    int nd = moed_backend_n_devices(b);
    Moed__V1__ModelInfo mi = MOED__V1__MODEL_INFO__INIT;
    Moed__V1__LayerInfo *li = calloc((size_t)s->n_layers + 1, sizeof *li);
    Moed__V1__LayerInfo **lp = calloc((size_t)s->n_layers + 1, sizeof *lp);
    Moed__V1__Device *dv = calloc((size_t)nd + 1, sizeof *dv);
    Moed__V1__Device **dp = calloc((size_t)nd + 1, sizeof *dp);
    moed_device_info *di = calloc((size_t)nd + 1, sizeof *di);
    void *ranges = NULL, *places = NULL;
    if (!li || !lp || !dv || !dp || !di) goto out;
    for (int i = 0; i < s->n_layers; i++) {
        const moed_layer_info *x = &s->layers[i]->info;
        moed__v1__layer_info__init(&li[i]);
        li[i].index = (uint32_t)x->index;
        li[i].d_model = (uint32_t)x->d_model;
        li[i].d_ff = (uint32_t)x->d_ff;
        li[i].num_experts = (uint32_t)x->n_experts;
        li[i].top_k = (uint32_t)x->top_k;
        li[i].activation = (Moed__V1__Activation)x->act;
        li[i].weight_dtype = (Moed__V1__DType)x->wdtype;
        li[i].has_router = x->has_router && s->layers[i]->router;
        li[i].sparse24 = x->sparse24;
        li[i].norm_topk_prob = x->norm_topk;
        li[i].router_rule = (Moed__V1__RouterRule)x->rule;
        li[i].num_shared_experts = (uint32_t)x->n_shared;
        li[i].shared_d_ff = (uint32_t)x->shared_d_ff;
        li[i].n_group = (uint32_t)x->n_group;
        li[i].topk_group = (uint32_t)x->topk_group;
        li[i].routed_scaling_factor = x->routed_scale;
        lp[i] = &li[i];
    }
    if (held_experts(s, li, &ranges) || expert_places(s, b, li, &places)) goto out;
    int n = 0;
    for (int i = 0; i < nd; i++) {
        if (moed_backend_device_info(b, i, &di[n])) continue;
        moed__v1__device__init(&dv[n]);
        di[n].name[sizeof di[n].name - 1] = 0;
        dv[n].name = di[n].name;
        dv[n].memory_total = di[n].memory_total;
        dv[n].memory_used = di[n].memory_used;
        dp[n] = &dv[n];
        n++;
    }
    moed_loading_state load = { .phase = "" };
    Moed__V1__LoadProgress lp_ = MOED__V1__LOAD_PROGRESS__INIT;
    if (!loaded) {
        moed_loading_get(&load);
        load_progress(&load, &lp_);
        mi.loading = &lp_;
    }
    mi.model = loaded ? (char *)r->cfg.model : load.what;
    mi.n_layers = (size_t)s->n_layers;
    mi.layers = lp;
    mi.backend = (char *)moed_backend_name(b);
    mi.n_devices = (size_t)n;
    mi.devices = dp;
    mi.version = MOED_VERSION;
    mi.max_message_bytes = (uint64_t)r->cfg.max_message_bytes;
    mi.max_batch_tokens = (uint32_t)s->max_batch_tokens;
    mi.model_fingerprint = s->fingerprint;
    Moed__V1__RegionLimits rl = MOED__V1__REGION_LIMITS__INIT;
    static const char *const modes[] = { "off", "local", "any" };
    rl.mode = (char *)modes[moed_regions_mode(s->regions)];
    if (s->regions) {
        const moed_regions_config *lim = moed_regions_limits(s->regions);
        rl.max_regions = (uint32_t)lim->max_regions;
        rl.max_region_bytes = (uint64_t)lim->max_bytes;
        rl.max_region_bytes_total = (uint64_t)lim->max_total_bytes;
        rl.cuda = moed_backend_host_dma(b);
        rl.max_rings = loaded ? (uint32_t)moed_doorbell_max_rings(r->cfg.doorbell) : 0;
    }
    mi.regions = loaded ? &rl : NULL;
    bb = moed_wire_pack(&mi.base);
out:
    free(ranges);
    free(places);
    free(li);
    free(lp);
    free(dv);
    free(dp);
    free(di);
    return bb;
}

static void getmodel_start(rpc_call *c)
{
    grpc_byte_buffer *bb = model_info(c->rpc);
    if (bb)
        rpc_reply(c, bb, GRPC_STATUS_OK, NULL);
    else
        rpc_reply(c, NULL, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory building ModelInfo");
}

const rpc_method moed_getmodel_method = { .path = "/moed.v1.Moed/GetModel",
                                          .size = sizeof(rpc_call),
                                          .read_payload = true,
                                          .start = getmodel_start };
