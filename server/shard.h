/*
 * moed_shard — the share of a layer's experts this daemon holds (--experts, --shared-experts), and
 * the two views of the layer that follow from it.
 *
 * Routing speaks the whole layer's numbering: clients send expert ids and logits over every
 * expert, the server router keeps its every row, so each shard of a fleet computes the same route.
 * The backend speaks only the shard's: it is given `view`, a layer holding just the held experts
 * (local ids 0 .. n_held-1, in increasing global order), the whole router (router_experts) and the
 * shared experts when this daemon adds them. Between the two, moed_shard_localize turns a host
 * route into the backend's: the pairs of experts held, in their order, renumbered; the rest
 * contribute nothing, so the reply is the held experts' partial sum. Device routing (a doorbell's
 * or a link's call) is renumbered by the backend where it lies, by the same map (view.local_of):
 * such a call reads nothing to the host on a shard either.
 *
 * A daemon without --experts holds every expert of every layer (and adds the shared ones): its
 * shards are whole, view is the layer itself, and nothing is renumbered.
 */
#ifndef MOED_SHARD_H
#define MOED_SHARD_H

#include "moed_err.h"
#include "moed_model.h"
#include "moed_place.h"
#include "moed_route.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct moed_shard {
    const moed_layer *full; /* the model's layer, in the whole numbering */
    moed_layer view;        /* what the backend loads (see above) */
    moed_expert_w *held_w;  /* view.experts, when it is not full's own array */
    int32_t *local_of;  /* [full n_experts]: the id among the held experts, or -1; NULL: whole */
    int32_t *global_of; /* [n_held]: the whole layer's id of each held expert; NULL: whole */
    int n_held;
    bool adds_shared; /* this daemon's replies include the shared experts' term */
} moed_shard;

/* --shared-experts "auto", "on", "off" and the expert list (NULL: every expert) as what the weights
 * loader reads: the experts held, and the shared experts when this daemon adds them (auto: when it
 * holds expert 0). */
moed_expert_subset moed_shard_subset(const int *experts, int n, const char *shared_mode);

/* Builds the shard of layer `full` that subset `held` (NULL: whole) describes; full and its
 * weights must outlive it. MOED_ENOMEM for the maps. */
int moed_shard_make(const moed_layer *full, const moed_expert_subset *held, moed_shard *out,
                    moed_error *err);
void moed_shard_free(moed_shard *s);

/* Whether the shard holds every expert of its layer (batch gating needs that). */
bool moed_shard_all_experts(const moed_shard *s);

/* A route of the whole numbering made the backend's (moed_route_localize), when the shard does not
 * hold every expert. */
void moed_shard_localize(const moed_shard *s, moed_route *r);

/* The whole layer's id of the backend's expert `local`. */
int moed_shard_global(const moed_shard *s, int local);

/* The held experts as "0-31,96-127" into buf. */
void moed_shard_ranges(const moed_shard *s, char *buf, size_t n);

/* The held experts as inclusive ranges: up to cap of them into first[]/last[]; returns how many
 * there are (call with cap 0 to count). */
int moed_shard_range_list(const moed_shard *s, uint32_t *first, uint32_t *last, int cap);

/* Where the held experts live (the backend's placement p, in its local ids and device numbers), in
 * the whole layer's numbering: up to cap ranges into first[]/last[] with the device of each into
 * dev[]; returns how many there are (cap 0 counts). A part whose held experts are not consecutive
 * in the whole numbering gives several. */
int moed_shard_place_list(const moed_shard *s, const moed_layer_place *p, uint32_t *first,
                          uint32_t *last, uint32_t *dev, int cap);

/* The same as "0-125@0,126-255@1" (experts@device) into buf. */
void moed_shard_place_text(const moed_shard *s, const moed_layer_place *p, char *buf, size_t n);

#endif
