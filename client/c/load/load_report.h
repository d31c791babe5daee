/*
 * load_report — what moed-load counts for one load level (load_stats), and the report of a run in
 * text (stdout), JSON and CSV.
 *
 * Counting rules, so a test can check exact numbers:
 * - requests (sent) counts the calls started in the measured window (after the warm-up);
 * - every such call ends as exactly one of: ok; an expected error (a deliberately bad request
 *   answered INVALID_ARGUMENT); an unexpected error, counted by kind: the gRPC status name the
 *   server or transport gave, MALFORMED_REPLY (a reply that does not match the request), CLIENT
 *   (the call could not be started), BAD_ACCEPTED (a bad request answered OK);
 *   so sent == ok + expected_errors + errors.
 * - latency, tokens, bytes received and the server's timings are over the ok replies; bytes sent
 *   over every measured request that was started (a CLIENT error sent nothing).
 * - verify mismatches are replies that came back OK but differ from the local reference; they are
 *   counted apart from (and in addition to) the above and fail the run as errors do.
 */
#ifndef LOAD_REPORT_H
#define LOAD_REPORT_H

#include "load_hist.h"
#include "moed_err.h"

#include <cjson/cJSON.h>

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

enum {
    LOAD_ERR_MALFORMED = 17, /* 0 .. 16: gRPC status codes */
    LOAD_ERR_CLIENT = 18,
    LOAD_ERR_BAD_ACCEPTED = 19,
    LOAD_ERR_KINDS = 20,
};

typedef struct load_stats {
    uint64_t sent, ok, bad_sent, expected_errors;
    uint64_t errors[LOAD_ERR_KINDS];
    char first_error[LOAD_ERR_KINDS][200]; /* the first message of each kind */
    uint64_t tokens;                       /* in ok replies */
    uint64_t bytes_sent, bytes_received;   /* tensor payloads: of requests, of ok replies */
    uint64_t batch_tokens, batch_requests; /* sums over ok replies of the launch they were in */
    uint64_t verified, mismatches;
    double worst_verify_err; /* the largest relative error seen by --verify */
    char first_mismatch[300];
    int64_t t_last_ns; /* the last measured completion, CLOCK_MONOTONIC */
    load_hist latency, queue, compute;
} load_stats;

void load_stats_init(load_stats *s);
void load_stats_merge(load_stats *dst, const load_stats *src);
/* Records one unexpected error of kind with its message (kept if it is the first). */
void load_stats_error(load_stats *s, int kind, const char *msg);
uint64_t load_stats_errors(const load_stats *s);
/* "INVALID_ARGUMENT", ..., "MALFORMED_REPLY", "CLIENT", "BAD_ACCEPTED". */
const char *load_err_kind_name(int kind);

/* Tokens per expert: (token, expert) pairs per layer called and expert (the whole layer's ids),
 * counted from the routes of the replies that came back OK (moed-load's own count) or from the
 * daemons' moed_expert_tokens_total (--metrics), over a level, warm-up included, so the two agree
 * when every call succeeded. */
typedef struct load_experts {
    int n_layers, n_experts; /* n_experts: the most of any layer */
    int *layer;              /* [n_layers]: the layers' indices, as called */
    uint64_t *tokens;        /* [n_layers * n_experts] */
} load_experts;

/* A table for these layers (repeats count once) of up to n_experts experts each. */
int load_experts_init(load_experts *x, const int *layers, int n, int n_experts);
/* Adds v to (layer, expert); a layer or expert outside the table is ignored. */
void load_experts_add(load_experts *x, int layer, int expert, uint64_t v);
void load_experts_merge(load_experts *dst, const load_experts *src);
bool load_experts_any(const load_experts *x);
void load_experts_free(load_experts *x);

/* One level of a run: what was asked and what happened. */
typedef struct load_level {
    int concurrency;  /* closed loop: calls in flight; 0 for open loop */
    double rate;      /* open loop: asked requests per second; 0 for closed loop */
    double elapsed_s; /* from the end of the warm-up to the last measured reply */
    load_stats st;
    /* moed-load's own cost: CPU seconds of the whole process (gRPC's threads and --verify's
     * included) over the level, warm-up included, and the calls it finished in that time */
    double cpu_s, wall_s;
    uint64_t calls;
    load_experts sent;    /* from the routes sent (client routing) */
    load_experts servers; /* from the daemons' metrics (--metrics) */
} load_level;

/* The run's fixed settings, as the report states them. */
typedef struct load_setup {
    const char *target, *model, *backend;
    const char *dtype, *tokens, *routing, *arrival, *layers, *transport;
    int connections, threads;
    double warmup_s, duration_s, deadline_ms, bad_fraction;
    uint64_t requests; /* --requests, or 0 with --duration */
    uint64_t verify;   /* --verify N, or 0 */
    double verify_bound;
} load_setup;

void load_report_text(FILE *f, const load_setup *s, const load_level *l);
/* The run as a JSON document: the setup and one object per level (what --json writes and the HTML
 * report draws); NULL when out of memory. n >= 1. */
cJSON *load_report_doc(const load_setup *s, const load_level *levels, int n);
/* load_report_doc written to path; 0 or a negative MOED_E* code. */
int load_report_json(const char *path, const load_setup *s, const load_level *levels, int n,
                     moed_error *err);
/* Writes n bytes of text to path, the file of option `what` (named in the message); 0 or
 * MOED_EIO. */
int load_write_file(const char *path, const char *text, size_t n, const char *what,
                    moed_error *err);
/* A header row naming the columns, then one row per level. */
int load_report_csv(const char *path, const load_level *levels, int n, moed_error *err);

#endif
