/*
 * load_gen — what moed-load sends and when, as pure functions of a seed: random numbers, arrival
 * gaps, tokens per request, expert choices, which requests are deliberately bad, and the parsing of
 * the command-line specs that describe them. No I/O but reading a tokens file, no gRPC, so all of
 * it is unit-tested (tests/unit/test_load_stats.c).
 */
#ifndef LOAD_GEN_H
#define LOAD_GEN_H

#include "moed_err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- random numbers: splitmix64, one stream per worker ---- */

typedef struct load_rng {
    uint64_t s;
} load_rng;

void load_rng_seed(load_rng *r, uint64_t seed, uint64_t stream);
uint64_t load_rng_next(load_rng *r);
/* Uniform in [0, 1), 53 bits. */
double load_rng_uniform(load_rng *r);
/* Uniform in [0, n), n >= 1. */
uint64_t load_rng_below(load_rng *r, uint64_t n);

/* ---- open-loop arrivals ---- */

typedef enum load_arrival {
    LOAD_ARRIVAL_CONSTANT = 0, /* every 1/rate seconds */
    LOAD_ARRIVAL_POISSON = 1,  /* exponential gaps of mean 1/rate */
} load_arrival;

int load_arrival_parse(const char *s, load_arrival *out, moed_error *err);
/* Seconds from one arrival to the next at rate (> 0) requests per second. */
double load_arrival_gap(load_arrival kind, double rate, load_rng *r);

/* ---- tokens per request ---- */

typedef struct load_tokens {
    int lo, hi;  /* uniform in [lo, hi] (fixed when lo == hi) */
    int *values; /* from a file: sampled uniformly (lo/hi are then their min and max) */
    size_t n_values;
} load_tokens;

/* "8" (fixed) or "4:64" (uniform, inclusive). */
int load_tokens_parse(const char *spec, load_tokens *out, moed_error *err);
/* One integer >= 1 per line (blank lines and '#' comments skipped). */
int load_tokens_read(const char *path, load_tokens *out, moed_error *err);
int load_tokens_sample(const load_tokens *t, load_rng *r);
void load_tokens_free(load_tokens *t);

/* ---- sweeps: "8" or "a:b:step" (a, a+step, ... up to b) ---- */

#define LOAD_MAX_LEVELS 1000

/* Parses flag's value into levels (malloc'd); every level must be > 0, and integral when
 * integral is set. */
int load_sweep_parse(const char *flag, const char *spec, bool integral, double **levels, int *n,
                     moed_error *err);

/* ---- a comma-separated list of non-negative integers, in order, repeats kept ---- */

int load_int_list_parse(const char *flag, const char *spec, int **out, int *n, moed_error *err);

/* ---- routing chosen by the client ---- */

typedef enum load_route_kind {
    LOAD_ROUTE_UNIFORM = 0, /* k distinct experts per token, uniformly */
    LOAD_ROUTE_ZIPF = 1,    /* k distinct experts, P(e) proportional to 1/(e+1)^s */
    LOAD_ROUTE_ONE = 2,     /* every token on expert 0 alone */
    LOAD_ROUTE_LOGITS = 3,  /* random router logits, gated by the server */
    LOAD_ROUTE_SERVER = 4,  /* the server's router */
} load_route_kind;

typedef struct load_routing {
    load_route_kind kind;
    double zipf_s;
} load_routing;

/* "uniform", "zipf:S" (S >= 0), "one", "logits", "server". */
int load_routing_parse(const char *s, load_routing *out, moed_error *err);
/* Columns of a client route for a layer with top_k experts per token (1 for ONE). */
int load_routing_cols(const load_routing *r, int top_k);
/* Fills rows x cols expert ids and weights (each row's weights > 0, summing to 1) for a layer
 * with n_experts; cols <= n_experts. UNIFORM and ZIPF draw without replacement. */
int load_routing_fill(const load_routing *r, int n_experts, int cols, int64_t rows, load_rng *rng,
                      int32_t *ids, float *weights, moed_error *err);

/* ---- deliberately bad requests ---- */

/* Whether request number n (0, 1, ...) is bad when a share p in [0, 1] is: of the first N
 * requests exactly floor(N * p) are (that product computed in double), spread evenly. */
bool load_is_bad(uint64_t n, double p);

#endif
