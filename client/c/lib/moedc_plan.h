/*
 * moedc_plan — a fleet's policy, with no I/O (moedclient.h's moedc_connect_many says what a fleet
 * does): what each daemon holds as the fleet learnt it, the fleet's model, the shards of each
 * layer and every reason one cannot be served, when a daemon is asked GetModel again, the choice
 * of replicas, what an attempt's failure does to its daemon, which tokens of a call each shard
 * gets, and the sum of the shards' partial outputs. moedc_fleet.c does the I/O (targets,
 * connections, calls, waiting, locking) and tells the planner what came of it. The Python client's
 * moed/fleet_plan.py is the same policy, and both are tested against one table of scenarios
 * (tests/data/fleet_scenarios.json): the texts of the errors are the same in both.
 *
 * Time is passed in (monotonic seconds) and nothing here locks: the fleet holds its mutex around
 * every call. A planner owns its array of members and its plans, not the members themselves (the
 * fleet allocates each, with this struct first); moedc_member_release frees what one holds.
 */
#ifndef MOEDC_PLAN_H
#define MOEDC_PLAN_H

#include "moedc_codec.h"
#include "moedclient.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MOEDC_PLAN_PROBE_TIMEOUT_S 5.0 /* GetModel of one daemon, at most */
#define MOEDC_PLAN_CONNECT_S       1.0 /* how long asking again waits for the connection it makes */
#define MOEDC_PLAN_REPROBE_S       1.0 /* a daemon that never answered: asked at most this often */
#define MOEDC_PLAN_DOWN_MIN_S      0.5 /* a daemon turned away is passed over this long, doubling */
#define MOEDC_PLAN_DOWN_MAX_S      5.0 /* ... up to this */
#define MOEDC_PLAN_RESOLVE_EVERY_S 5.0 /* dns: names resolved again at most this often */
#define MOEDC_PLAN_MAX_MEMBERS     1024

/* One daemon of the fleet, as the planner knows it. */
typedef struct moedc_member {
    char *target;
    char *name;   /* the dns: target this is one address of, or NULL */
    bool retired; /* its name no longer resolves to it: out of the fleet */
    bool foreign; /* it serves another model than the fleet's: left out */
    bool heard;   /* its GetModel answered, or failed, at least once */
    bool have_info;
    moedc_model_info info;
    bool check;      /* turned a call away since GetModel answered: ask again before using it */
    char error[360]; /* what went wrong last */
    int outstanding; /* calls in flight to it */
    double down_until, down_for, asked_at;
} moedc_member;

/* The replicas holding the same experts of one layer. */
typedef struct moedc_shard {
    const moedc_layer_info *li; /* of its first replica: the ranges and the shared role */
    int *replicas;              /* indices of members */
    int n_replicas;
    unsigned turn; /* rotates ties between replicas */
} moedc_shard;

/* One layer's shards, lowest expert first; or why a call cannot be made to it. */
typedef struct moedc_layer_plan {
    int layer;
    moedc_shard *shards;
    int n_shards;
    int rc; /* 0, MOEDC_EPRECOND (misconfigured), MOEDC_EUNAVAIL, MOEDC_ENOTFOUND, MOEDC_ENOMEM */
    char msg[480];
} moedc_layer_plan;

typedef struct moedc_planner {
    moedc_member **m;
    int n;
    moedc_layer_plan *plans; /* each layer a member holds; rebuilt when what they hold changes */
    int n_plans;
    uint64_t fingerprint; /* the fleet's model, once every daemon was asked and agreed (0: not) */
    uint64_t agreed;      /* the model those that answered serve, pinned or not (0: none said) */
    double recheck_at, recheck_for; /* while a plan fails: when every member is asked again */
} moedc_planner;

/* Adds m (its target set, "not asked yet") as the last member; MOEDC_ENOMEM. */
int moedc_plan_add(moedc_planner *p, moedc_member *m);
/* Frees the plans and the array (not the members). */
void moedc_plan_close(moedc_planner *p);
/* Frees a member's info and strings (not m). */
void moedc_member_release(moedc_member *m);

/* Rebuilds every layer's plan from what the members hold; while one fails, every member is to be
 * asked again (moedc_plan_recheck_due). MOEDC_ENOMEM. */
int moedc_plan_rebuild(moedc_planner *p, double now);
/* What a call to `layer` finds: its plan (the caller may turn its shards), or (filled in *none)
 * why there is none. */
moedc_layer_plan *moedc_plan_for(moedc_planner *p, int layer, moedc_layer_plan *none);
/* The call's own refusal of a plan (batch gating over several shards): 0 or MOEDC_EPRECOND. */
int moedc_plan_batch_gating(const moedc_planner *p, const moedc_layer_plan *pl, moedc_error *err);

/* Whether every member is to be asked GetModel again now (a plan fails, and its time came); the
 * next time is set. */
bool moedc_plan_recheck_due(moedc_planner *p, double now);
/* Whether m is to be asked GetModel now: never answered (at most every REPROBE_S), turned a call
 * away since, or `again`; never while it is passed over. */
bool moedc_plan_to_ask(const moedc_member *m, bool again, double now);
/* When the next member that might answer where none does now is due to be asked (0: none is). */
double moedc_plan_next_chance(const moedc_planner *p);
/* m's GetModel answered info (taken over): a member serving another model than the fleet's is
 * left out; the plans are rebuilt when anything changed (else the info kept is the one the plans
 * point into). */
void moedc_plan_learnt(moedc_planner *p, moedc_member *m, moedc_model_info *info, double now);
/* m's GetModel failed (why: "STATUS: message"): passed over a while. */
void moedc_plan_unanswered(moedc_planner *p, moedc_member *m, const char *why, double now);
/* Passes m over for DOWN_MIN_S, doubling each time to DOWN_MAX_S. */
void moedc_plan_down(moedc_member *m, double now);

/* The replica for an attempt of the shard of `layer` that e describes, among replicas[0..n-1]
 * (members' indices): not tried, not to be asked GetModel first, still holding that shard, not
 * passed over, the fewest calls outstanding (ties: the first from `turn` on); -1 when none. */
int moedc_plan_pick(const moedc_planner *p, int layer, const moedc_expect *e, const int *replicas,
                    int n, const unsigned char *tried, unsigned turn, double now);
/* An attempt on m ended with rc (0, or its error and message): UNAVAILABLE passes m over, and it
 * and FAILED_PRECONDITION (m is not what the call expected) have it asked GetModel before its next
 * call. True when the part may go on to another replica (those two). */
bool moedc_plan_done(moedc_member *m, int rc, const char *msg, double now);
/* A part whose replicas all failed: its error, naming each and what it said; refused (a replica
 * was not what the fleet took it for): MOEDC_EPRECOND, else MOEDC_EUNAVAIL. */
int moedc_plan_exhausted(const moedc_planner *p, int layer, const moedc_expect *e,
                         const int *replicas, int n, bool refused, moedc_error *err);

/* Which tokens (rows of the call) each shard of pl gets when the client chose the experts, ids and
 * w [T, k] in the whole layer's numbering: rows[s] lists shard s's, increasing, n_rows[s] of them
 * (0: it gets no call), or is NULL when it gets every token (n_rows[s] = T); the caller frees each.
 * A shard's partial output for a token with no pair on an expert it holds is exactly +0.0 (its sum
 * starts at zero), which moedc_plan_sum counts in without it. The shard that adds the shared
 * experts gets every token (it has a term for each); another, those with at least one pair the
 * daemons accept, not padding, on an expert it holds. Every shard gets every token, as for logits
 * and the server router, when the layer is one shard; when a pair is one the daemons refuse
 * (moed_choice_rule), so their error names its row in the caller's numbering; and when no shard
 * would get a token (an empty batch; only padding and no shared experts), so the daemons answer it
 * as before. MOEDC_ENOMEM. */
int moedc_plan_rows(const moedc_layer_plan *pl, const int32_t *ids, const float *w, int64_t T,
                    int k, int64_t **rows, int64_t *n_rows, moedc_error *err);
/* Whether a call of k choices a token had better send every shard of pl every token than read the
 * choices to plan each shard's (moedc_links_opts.send, AUTO): when, with each token's k experts
 * distinct and uniform, the shards would skip fewer than MOEDC_PLAN_SKIP_MIN of the tokens on
 * average (a shard adding the shared experts skips none). A layer of one shard: true. */
#define MOEDC_PLAN_SKIP_MIN 0.25
bool moedc_plan_sends_all(const moedc_layer_plan *pl, int k);
/* The parts' outputs, lowest expert first, added in float32 in that order and rounded once to
 * dtype, into out (tokens x d elements; it may be a part holding every token). Part i holds the
 * tokens rows[i] lists (increasing, n_rows[i] of them: its rows, in that order), or every token
 * when rows or rows[i] is NULL. A token some part does not hold starts at +0.0 (what the shard
 * would have answered for it), one every part holds at -0.0 (which adding leaves alone): the sum
 * is bit for bit the one over every shard's answer for every token. MOEDC_ENOMEM. */
int moedc_plan_sum(int dtype, const void *const *parts, const int64_t *const *rows,
                   const int64_t *n_rows, int n, int64_t tokens, int64_t d, void *out,
                   moedc_error *err);
/* A copy of pl that outlives the planner's next rebuild (a link call's, moedc_link.c): its shards
 * and their replicas, each shard's layer info with its held ranges (its other arrays NULL); rc and
 * msg too. MOEDC_ENOMEM. Free with moedc_plan_copy_free. */
int moedc_plan_copy(const moedc_layer_plan *pl, moedc_layer_plan *out, moedc_error *err);
void moedc_plan_copy_free(moedc_layer_plan *pl);
/* n expert ranges as "0-3,6", for messages (clipped to size). */
void moedc_plan_ranges_text(const moedc_expert_range *r, int n, char *buf, size_t size);
/* The fleet's ModelInfo: each layer once, holding what the members that answered hold between
 * them; the smallest limits; every device. MOEDC_EUNAVAIL when none answered. */
int moedc_plan_info(const moedc_planner *p, moedc_model_info *out, moedc_error *err);
/* Whether the fleet serves: every layer planned, each shard with a replica serving[i] (members
 * beyond n count as not serving). */
bool moedc_plan_serving(const moedc_planner *p, const bool *serving, int n);

#endif
