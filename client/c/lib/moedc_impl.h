/*
 * moedc_impl — the implementations' side of a moedc: the table of calls each fills, and the
 * layout every handle starts with. Private: included by moedclient.c (which dispatches the public
 * calls through the table) and the implementations: moedc_channel.c (one daemon over gRPC, made by
 * moedc_connect) and moedc_fleet.c (several daemons, made by moedc_connect_many, which drives its
 * daemons' moedcs through this table and the public calls alone).
 *
 * A moedc and a moedc_call start with these structs, so an implementation's own handle is
 * (struct theirs *)c. Every slot is required but reconnect (NULL: nothing to do) and layout. The
 * dispatch fills the outputs' defaults first (*out NULL, status UNKNOWN, a zeroed model info), so a
 * slot that fails need not.
 *
 * A call started with a done function is never handed to moedc_queue_next's caller: the thread
 * that collects it from the queue calls done(call, done_arg) instead, which returns the call to
 * hand over (another one, such as a fleet's call whose last part this was) or NULL. That is how a
 * fleet learns that its sub-calls finished without the queue knowing fleets.
 */
#ifndef MOEDC_IMPL_H
#define MOEDC_IMPL_H

#include "moedc_codec.h"
#include "moedc_plan.h"
#include "moedclient.h"

typedef moedc_call *(*moedc_done_fn)(moedc_call *call, void *arg);

/* What a Forward carries besides its request. */
typedef struct moedc_start {
    void *user;                 /* moedc_call_user's answer */
    const moedc_expect *expect; /* what the daemon is expected to hold (NULL: nothing stated) */
    moedc_done_fn done;         /* NULL: the call is handed to moedc_queue_next's caller */
    void *done_arg;
} moedc_start;

/* A layer's shards as a link call plans them (moedc_link.c), for use without c's locks: plan is a
 * copy (moedc_plan_copy) whose replicas index daemons; the daemons and their names are c's own,
 * valid until moedc_close(c). Free with moedc_layout_free. */
typedef struct moedc_layout {
    moedc_layer_plan plan;
    uint64_t fingerprint; /* the model the daemons serve (what each call expects), 0: not known */
    moedc **daemons;
    const char **names;
    int n_daemons;
} moedc_layout;
void moedc_layout_free(moedc_layout *l);

typedef struct moedc_ops {
    /* moedc_forward_start: the call, its fields below filled, in *out; nothing started on failure.
     * A fleet refuses an expect (it states its own to each daemon). */
    int (*forward_start)(moedc *c, const moedc_request *req, const moedc_start *how, moedc_queue *q,
                         moedc_call **out, moedc_error *err);
    /* moedc_call_finish: the result or the error of a finished call, which is freed. */
    int (*forward_finish)(moedc_call *call, moedc_result *res, moedc_error *err);
    /* moedc_call_cancel. */
    void (*forward_cancel)(moedc_call *call);
    /* GetModel and health, within timeout_s (0: the moedc's deadline; a fleet bounds each of its
     * daemons' answers by its own). */
    int (*info)(moedc *c, double timeout_s, moedc_model_info *out, moedc_error *err);
    int (*health)(moedc *c, const char *service, double timeout_s, int *status, moedc_error *err);
    /* The region calls: ListRegions and a region session. */
    int (*list_regions)(moedc *c, moedc_region_info **out, int *n, moedc_error *err);
    int (*session_open)(moedc *c, moedc_session **out, moedc_error *err);
    /* Tries to connect now, whatever backoff the connection would keep, and waits until it is
     * connected, at most timeout_s: a fleet asks a daemon again on its own schedule. */
    void (*reconnect)(moedc *c, double timeout_s);
    /* The layout of `layer` (a fleet's plan for it, MOEDC_EUNAVAIL / MOEDC_EPRECOND with why there
     * is none); NULL: c is one daemon, the layout a single shard of c itself. */
    int (*layout)(moedc *c, int layer, moedc_layout *out, moedc_error *err);
    /* Frees everything c holds, and c. */
    void (*close)(moedc *c);
} moedc_ops;

struct moedc {
    const moedc_ops *ops;
    double timeout_s; /* the default deadline of its calls (moedc_opts.timeout_s) */
    const char *name; /* one daemon: its target, for messages; a fleet: NULL */
};

struct moedc_call {
    const moedc_ops *ops; /* of the moedc it was started on */
    void *user;
    moedc_done_fn done;
    void *done_arg;
};

#endif
