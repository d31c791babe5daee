/*
 * load_verify — moed-load's --verify: recompute a sample of replies with the CPU backend
 * (moed_cpu) on the same synthetic weights, and count those that differ.
 *
 * The check runs on a thread of its own so it never holds up the calls being measured: workers
 * offer replies (load_verify_offer), and the verifier takes them while fewer than the level's
 * quota are taken and its queue has room; otherwise the offer is declined and the worker frees the
 * reply. So a fast verifier checks the first N replies of a level, a slow one a sample spread over
 * it. What a request sent must stay valid until load_verify_end: moed-load sends windows of
 * pools that live for the whole run.
 *
 * A reply matches when, row by row, |y_t - ref_t| <= bound * max(|ref_t|, mean row norm) (norms
 * Euclidean, float64) and it holds no NaN or Inf. The bound is the rounding of the least precise
 * type on the way: the activation dtype, and on a CUDA server its compute type (bf16, or f16 for
 * f16 weights): f32 1e-4, f16 5e-3, bf16 2e-2 (as the GPU suite's CUDA-against-CPU bound).
 * With batch gating the reference uses the set S the reply names (the server chose it over the
 * merged batch, which the client cannot see), and checks S has k_batch distinct valid experts.
 */
#ifndef LOAD_VERIFY_H
#define LOAD_VERIFY_H

#include "moed_err.h"
#include "moed_model.h"
#include "moed_route.h"
#include "moed_synth.h"
#include "moedclient.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct load_verify load_verify;

/* What one call sent (pointers into the run's pools) and what came back. */
typedef struct load_verify_item {
    int layer; /* the layer's index */
    moedc_request req;
    moedc_result res;  /* owned by the verifier once the offer is taken */
    void *output_copy; /* malloc'd output (res.output) when it came in a region; freed with res */
} load_verify_item;

/* The bound for requests in dtype on a server with this backend ("cpu", "cuda") and weights. */
double load_verify_bound(int dtype, const char *backend, int wdtype);

/* Builds the layers of spec named in layers[0..n) and a one-thread CPU backend for them, and
 * starts the verifier thread. Each layer's info is checked against the server's (served[i]):
 * a server whose sizes differ from the spec is not serving it. */
int load_verify_open(const moed_synth_spec *spec, const moed_layer_info *served, int n,
                     int64_t max_tokens, double bound, load_verify **out, moed_error *err);
/* Starts a level: its quota of replies to check, counters zeroed. */
void load_verify_begin(load_verify *v, uint64_t quota);
/* Offers a reply; returns true if the verifier took it (and with it item->res). */
bool load_verify_offer(load_verify *v, const load_verify_item *item);
/* Waits for the replies taken to be checked, and reports them for the level. */
void load_verify_end(load_verify *v, uint64_t *checked, uint64_t *mismatches, double *worst,
                     char *first, size_t first_len);
void load_verify_close(load_verify *v);

#endif
