/*
 * moed_model — sizes and names of layers.
 */
#include "moed_model.h"

#include "moed_dtype.h"

#include <string.h>

int moed_layer_router_dtype(const moed_layer *l)
{
    return l->router_dtype ? l->router_dtype : l->info.wdtype;
}

uint64_t moed_layer_expert_bytes(const moed_layer_info *li)
{
    uint64_t mats = li->act == MOED_ACT_SWIGLU ? 3 : 2;
    return mats * (uint64_t)li->d_ff * (uint64_t)li->d_model * moed_dtype_size(li->wdtype);
}

uint64_t moed_layer_bytes(const moed_layer_info *li)
{
    uint64_t es = moed_dtype_size(li->wdtype);
    uint64_t mats = li->act == MOED_ACT_SWIGLU ? 3 : 2;
    uint64_t b = (uint64_t)li->n_experts * moed_layer_expert_bytes(li);
    b += mats * (uint64_t)li->shared_d_ff * (uint64_t)li->d_model * es;
    if (li->has_router) b += (uint64_t)li->n_experts * (uint64_t)li->d_model * es;
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
