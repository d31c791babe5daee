/*
 * moed_place — where a backend puts each layer's weights over its devices, from byte counts
 * alone, so the CUDA backend and the unit tests run the same plan.
 *
 * Whole layers go by bytes: each to the device with the fewest bytes placed so far, among those
 * with room for all of it (ties to the first listed), so layers of unequal size still even out,
 * and equal ones go round the devices. A layer is split instead (expert parallelism) when asked,
 * or when no device has room for all of it: its home device holds what is not per expert (the
 * router and the shared experts), receives the layer's calls and combines the parts; its routed
 * experts are cut into contiguous ranges, one per device in the order the devices are listed,
 * each expert given to the device that is then lightest (the home's share counted), so the bytes
 * even out as far as whole experts allow. A device may get no expert of a small layer.
 *
 * Bytes are not time, though: the shared experts run for every token, a routed expert only for
 * the top_k/E of them routed to it, so in a large batch DeepSeek-V3's one shared expert (256
 * experts, top 8) computes as much as 32 routed ones, while a small batch mostly streams weights,
 * where it costs about one (moed_place_shared_work weighs the two); and real routing is skewed,
 * some experts taking many times their share. So when the caller
 * gives the home's work (home_work > 0, in routed experts' mean work) or the experts' measured
 * loads (load), the split evens the layer's work instead: each routed expert weighs its load over
 * the mean load (1 each without loads), the home starts at home_work, and the experts, in order,
 * are cut into contiguous ranges over the entries in order so that the heaviest entry is as light
 * as can be, each entry taking as many experts as that bound and its GPU's room allow (entries
 * whose bound is met take none). DeepSeek-V3 on 2 GPUs, uniform: 120 experts on the home, 136 on
 * the other. The home is still the lightest in bytes with room for its part, and it may get no
 * routed expert at all. docs/cuda.md ("Several GPUs of a host") has the numbers.
 *
 * Devices are the backend's entries in the order given (moed --devices); two entries may be one
 * GPU (--devices 0,0 runs the split on one GPU) and then share its free memory: `gpu` says which.
 * Layers are placed one at a time, in load order; moed_place_layer updates the devices' counts.
 */
#ifndef MOED_PLACE_H
#define MOED_PLACE_H

#include "moed_err.h"

#include <stdbool.h>
#include <stdint.h>

#define MOED_PLACE_MAX 16 /* devices (entries) a backend places over */

typedef struct moed_place_dev {
    int gpu;         /* the physical device: entries with the same gpu share its free memory */
    uint64_t free;   /* bytes the GPU still has for weights; lowered as layers are placed */
    uint64_t placed; /* bytes this entry holds so far */
} moed_place_dev;

typedef struct moed_place_need {
    uint64_t base;   /* bytes of the layer that are not per expert: router, shared experts */
    uint64_t expert; /* bytes of one routed expert (each the same) */
    int n_experts;
    bool split; /* expert parallelism asked for (moed --expert-parallel) */
    /* Per-token work of what the home runs besides its routed experts (the shared experts), in
     * routed experts' mean work: a shared expert as wide as a routed one in a layer of E experts
     * and top k is E/k. */
    double home_work;
    /* The routed experts' measured loads (n_experts of them, >= 0, any scale), or NULL: each
     * weighs the mean. With neither loads nor home_work a split evens bytes only. */
    const double *load;
} moed_place_need;

/* A range of a layer's experts on one device entry: experts first .. first + count - 1. */
typedef struct moed_place_part {
    int dev, first, count;
} moed_place_part;

#define MOED_PLACE_MAX_REPLICAS 64 /* extra copies of a split layer's experts */

/* An extra copy of expert `expert` on device entry `dev`, beside the one its range puts elsewhere:
 * a hot expert's pairs are shared among its copies (moed_route_split says how). */
typedef struct moed_place_replica {
    int expert, dev;
} moed_place_replica;

/* Where one layer lives: its home entry and its experts' ranges, contiguous and increasing,
 * covering every expert (one part on the home entry for a whole layer), and the extra copies of
 * hot experts a re-placement by measured load made (none otherwise), by expert then entry. */
typedef struct moed_layer_place {
    int home;
    int n_parts;
    moed_place_part part[MOED_PLACE_MAX];
    int n_replicas;
    moed_place_replica replica[MOED_PLACE_MAX_REPLICAS];
} moed_layer_place;

/* The home's shared experts in routed experts' mean cost (moed_place_need.home_work), for shared
 * experts `width` times as wide as a routed one in a layer of E routed experts and top k, costed
 * as moed_place_costs does (rows, plus the weights streamed once a launch) at the batch where a
 * routed expert's expected rows take as long as its stream (T = stream_rows x E / k): between
 * the small batches' width (streaming) and the large ones' width x E / k (rows), at their mean,
 * width x (E / k + 1) / 2, whatever stream_rows is. DeepSeek-V3: 16.5, and 120 + 136 experts on
 * two GPUs, which measured as fast as or faster than 32 (112 + 144) and bytes (128 + 128) at
 * T = 8 to 16384 (docs/benchmarks.md). */
double moed_place_shared_work(double width, int E, int k);

/* The same from a measured run, as moed_place_costs costs the experts: the shared experts' rows
 * (every token: the n held experts' pairs x E / (n x k), E the router's experts) plus their
 * weights streamed once a launch, width times a routed expert's, over the mean of the n experts'
 * costs. What a run of small batches measures is mostly streams, where the shared experts cost
 * about one routed expert (DeepSeek-V3 at T = 64: about 1.7), and a run of large ones rows (at
 * T = 16384: about 26), where moed_place_shared_work's mean, not knowing the batch, says 16.5.
 * -1 where launches are unknown (0) or no pair was measured: then moed_place_shared_work. */
double moed_place_shared_work_measured(double width, const double *pairs, int n, int E, int k,
                                       double launches, double stream_rows);

/* The cost of each of n experts over a run that measured `pairs[e]` (token, expert) pairs in
 * `launches` launches of the layer (0: unknown), in rows' time, into out: its rows, plus its
 * weights streamed once in each launch it had a pair in (at most one a pair), each streaming as
 * long as stream_rows rows take to compute. A small batch spends most of its time streaming, a
 * large one computing, so rows alone would cut small batches as if they computed. Without
 * launches only the rows count. out may be the loads a split's moed_place_need takes. */
void moed_place_costs(const double *pairs, int n, double launches, double stream_rows, double *out);

/* Places one layer over devs[0 .. n-1] (1 <= n <= MOED_PLACE_MAX) and counts its bytes in them.
 * MOED_ENOMEM naming the bytes needed and free when it fits nowhere, not even split. */
int moed_place_layer(moed_place_dev *devs, int n, const moed_place_need *need,
                     moed_layer_place *out, moed_error *err);

/* Whether the layer is split over several devices (more than one part, or its experts elsewhere
 * than its home). */
bool moed_place_is_split(const moed_layer_place *p);

/* ---- re-placement by measured load, with copies of hot experts ------------------------------
 *
 * A split layer already serving is cut again by what its experts cost over a run (the daemon's
 * measured pairs and launches), its home kept (its slots run the layer's jobs), and then its hot
 * experts get extra copies, greedily as DeepSeek's EPLB does: take the heaviest entry and, of the
 * experts it holds, the one whose copy costs most; copy it to the lightest entry that does not
 * hold it and has room for one expert; keep going while that lowers the heaviest entry's work,
 * until the budget is spent. Then only the shortest prefix of those copies that reached the
 * lowest peak is kept, so every copy kept lowered the peak (two entries tied at the peak need a
 * copy each before the peak drops; a lone one of them would cost memory and help nothing).
 *
 * Cost model. An expert's pairs are shared evenly among its copies (moed_route_split_copies), so
 * each of r copies computes pairs/r rows; but every copy streams the expert's weights once in
 * each launch it has a pair in, so a copy costs what moed_place_costs gives for pairs/r pairs:
 * pairs/r + stream_rows x min(pairs/r, launches). A copy thus always saves rows, but at small
 * batches (pairs below launches) halving the pairs also halves the streams, while at large ones
 * (each copy still in every launch) only the rows shrink: the stream term stays whole per copy.
 * The home's own work (the shared experts) is home_work x the mean cost of an expert, as the cut
 * counts it (moed_place_need.home_work). */
typedef struct moed_place_load {
    const double *pairs; /* n_experts: the (token, expert) pairs each expert had over the run */
    int n_experts;
    double launches;    /* launches of the layer over the run (0: unknown, rows alone count) */
    double stream_rows; /* rows computed in the time one expert's weights stream */
    double home_work;   /* the home's shared experts, in routed experts' mean cost */
} moed_place_load;

/* The cost of one of `copies` copies of expert e, in rows' time (the cost model above). */
double moed_place_copy_cost(const moed_place_load *ld, int e, int copies);

/* Each entry's predicted work under placement p, in rows' time, into work[0 .. n-1] (NULL: not
 * wanted): the home's own work, plus each expert copy it holds; returns the heaviest. */
double moed_place_peak(const moed_layer_place *p, int n, const moed_place_load *ld, double *work);

/* Cuts a split layer again with its home kept: as moed_place_layer splits (need->load the costs,
 * need->home_work the home's work; need->base what still has to find room on the home, 0 for a
 * layer already resident), over devs[0 .. n-1], whose free bytes bound each GPU's experts, and
 * counts the bytes in them. MOED_ENOMEM naming the bytes when the experts do not fit. */
int moed_place_recut(moed_place_dev *devs, int n, const moed_place_need *need, int home,
                     moed_layer_place *out, moed_error *err);

/* Adds up to max_replicas (at most MOED_PLACE_MAX_REPLICAS in all) copies of hot experts to p by
 * the greedy rule above, each where its GPU's free bytes in devs hold expert_bytes more (counted
 * in devs), and sorts p's copies by expert then entry. Deterministic: ties go to the lower entry,
 * then the lower expert. Returns the copies added. */
int moed_place_replicate(moed_layer_place *p, moed_place_dev *devs, int n, uint64_t expert_bytes,
                         const moed_place_load *ld, int max_replicas);

/* The parts a split layer runs: the entries that hold any of its experts (a range, copies or
 * both), in entry order, into dev; returns how many. A part numbers its experts locally: its range
 * first (expert first + i is i), then its copies in p's order. */
int moed_place_parts(const moed_layer_place *p, int *dev);

/* Entry dev's experts in its local numbering (moed_place_parts) into ids (room for n_experts);
 * returns how many. */
int moed_place_entry_experts(const moed_layer_place *p, int dev, int *ids);

/* Each expert's copies as moed_route_split_copies takes them, over p's parts (moed_place_parts):
 * expert e's are off[e] .. off[e+1]-1 (off: n_experts + 1), its range's part first, then its
 * extra copies in increasing entry order, each with its part (part) and local number (local);
 * both hold n_experts + p->n_replicas. */
void moed_place_copies(const moed_layer_place *p, int n_experts, int32_t *off, uint8_t *part,
                       int32_t *local);

#endif
