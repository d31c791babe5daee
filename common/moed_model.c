/*
 * moed_model — sizes and names of layers.
 */
#include "moed_model.h"

#include "moed_dtype.h"
#include "moed_fp8.h"

#include <string.h>

int moed_layer_router_dtype(const moed_layer *l)
{
    return l->router_dtype ? l->router_dtype : l->info.wdtype;
}

int moed_expert_subset_check(const moed_expert_subset *s, const moed_layer_info *li,
                             moed_error *err)
{
    if (!s || !s->ids) return 0;
    if (!s->n)
        return moed_fail(err, MOED_EINVAL, "the expert list is empty: name experts of 0-%d",
                         li->n_experts - 1);
    if (s->ids[s->n - 1] >= li->n_experts)
        return moed_fail(err, MOED_EINVAL,
                         "the expert list names expert %d, but the model's layers have %d "
                         "experts (0-%d)",
                         s->ids[s->n - 1], li->n_experts, li->n_experts - 1);
    return 0;
}

bool moed_expert_subset_has(const moed_expert_subset *s, int e)
{
    if (!s || !s->ids) return true;
    int lo = 0, hi = s->n - 1;
    while (lo <= hi) {
        const int mid = lo + (hi - lo) / 2;
        if (s->ids[mid] == e) return true;
        if (s->ids[mid] < e)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return false;
}

bool moed_expert_subset_shared(const moed_expert_subset *s)
{
    return !s || s->shared;
}

int moed_layer_router_experts(const moed_layer_info *li)
{
    return li->router_experts ? li->router_experts : li->n_experts;
}

/* Bytes of `mats` [ff, d]-sized matrices in the layer's weight dtype, FP8 scales included. */
static uint64_t matrices_bytes(const moed_layer_info *li, uint64_t mats, int64_t ff)
{
    uint64_t b = mats * (uint64_t)ff * (uint64_t)li->d_model * moed_dtype_size(li->wdtype);
    if (li->wdtype == MOED_FP8) b += mats * 4 * (uint64_t)moed_fp8_scale_count(ff, li->d_model);
    return b;
}

uint64_t moed_layer_expert_bytes(const moed_layer_info *li)
{
    return matrices_bytes(li, li->act == MOED_ACT_SWIGLU ? 3 : 2, li->d_ff);
}

uint64_t moed_layer_bytes(const moed_layer_info *li)
{
    uint64_t rs = li->wdtype == MOED_FP8 ? 2 : moed_dtype_size(li->wdtype);
    uint64_t b = (uint64_t)li->n_experts * moed_layer_expert_bytes(li);
    b += matrices_bytes(li, li->act == MOED_ACT_SWIGLU ? 3 : 2, li->shared_d_ff);
    if (li->has_router) b += (uint64_t)moed_layer_router_experts(li) * (uint64_t)li->d_model * rs;
    return b;
}

static const char *const act_names[] = {
    [MOED_ACT_SWIGLU] = "swiglu", [MOED_ACT_GELU] = "gelu", [MOED_ACT_RELU] = "relu"
};

const char *moed_act_name(moed_act act)
{
    if (act >= MOED_ACT_SWIGLU && act <= MOED_ACT_RELU) return act_names[act];
    return "none";
}

moed_act moed_act_parse(const char *name)
{
    for (int a = MOED_ACT_SWIGLU; a <= MOED_ACT_RELU; a++)
        if (!strcmp(name, act_names[a])) return (moed_act)a;
    if (!strcmp(name, "silu")) return MOED_ACT_SWIGLU;
    return MOED_ACT_NONE;
}
