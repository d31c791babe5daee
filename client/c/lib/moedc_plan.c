/*
 * moedc_plan — a fleet's policy, with no I/O (moedc_plan.h states the contract).
 *
 * Messages are built in fixed buffers: what does not fit is cut, never overrun.
 */
#include "moedc_plan.h"

#include "moedc_common.h"

#include "moed_dtype.h"
#include "moed_route.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SUM_CHUNK 16384 /* elements added at a time (at least one row) */

/* printf at the end of a buffer (for messages built in pieces). */
static void append(char *buf, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void append(char *buf, size_t n, const char *fmt, ...)
{
    size_t at = strlen(buf);
    if (at + 1 >= n) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + at, n - at, fmt, ap);
    va_end(ap);
}

void moedc_plan_ranges_text(const moedc_expert_range *r, int n, char *buf, size_t size)
{
    buf[0] = 0;
    for (int i = 0; i < n; i++)
        if (r[i].first == r[i].last)
            append(buf, size, "%s%d", i ? "," : "", r[i].first);
        else
            append(buf, size, "%s%d-%d", i ? "," : "", r[i].first, r[i].last);
}

/* ---- members ---- */

int moedc_plan_add(moedc_planner *p, moedc_member *m)
{
    moedc_member **grown = realloc(p->m, sizeof *grown * (size_t)(p->n + 1));
    if (!grown) return MOEDC_ENOMEM;
    p->m = grown;
    snprintf(m->error, sizeof m->error, "not asked yet");
    p->m[p->n++] = m;
    return 0;
}

void moedc_member_release(moedc_member *m)
{
    if (m->have_info) moedc_model_info_free(&m->info);
    m->have_info = false;
    free(m->target);
    free(m->name);
    m->target = m->name = NULL;
}

static const moedc_layer_info *layer_of(const moedc_member *m, int index)
{
    for (int i = 0; m->have_info && !m->retired && !m->foreign && i < m->info.n_layers; i++)
        if (m->info.layers[i].index == index) return &m->info.layers[i];
    return NULL;
}

static bool same_ranges(const moedc_expert_range *a, int na, const moedc_expert_range *b, int nb)
{
    if (na != nb) return false;
    for (int i = 0; i < na; i++)
        if (a[i].first != b[i].first || a[i].last != b[i].last) return false;
    return true;
}

static bool same_share(const moedc_layer_info *a, const moedc_layer_info *b)
{
    return a->adds_shared == b->adds_shared && same_ranges(a->held, a->n_held, b->held, b->n_held);
}

static bool same_holdings(const moedc_model_info *a, const moedc_model_info *b)
{
    if (a->n_layers != b->n_layers || a->model_fingerprint != b->model_fingerprint) return false;
    for (int i = 0; i < a->n_layers; i++)
        if (a->layers[i].index != b->layers[i].index || !same_share(&a->layers[i], &b->layers[i]))
            return false;
    return true;
}

/* The first field (as moed.proto's LayerInfo names it) two replicas of one layer disagree on. */
static const char *differs(const moedc_layer_info *a, const moedc_layer_info *b)
{
#define SAME(f, name)                                                                              \
    if (a->f != b->f) return name
    SAME(d_model, "d_model");
    SAME(d_ff, "d_ff");
    SAME(n_experts, "num_experts");
    SAME(top_k, "top_k");
    SAME(act, "activation");
    SAME(wdtype, "weight_dtype");
    SAME(has_router, "has_router");
    SAME(norm_topk, "norm_topk_prob");
    SAME(rule, "router_rule");
    SAME(n_shared, "num_shared_experts");
    SAME(shared_d_ff, "shared_d_ff");
    SAME(n_group, "n_group");
    SAME(topk_group, "topk_group");
    SAME(routed_scale, "routed_scaling_factor");
    SAME(sparse24, "sparse24");
#undef SAME
    return NULL;
}

/* "A (layer:experts 0:0-3 1:0-3); B (UNAVAILABLE: ...)" for messages: every member in the fleet. */
static void members_text(const moedc_planner *p, char *buf, size_t size)
{
    buf[0] = 0;
    for (int i = 0, shown = 0; i < p->n; i++) {
        const moedc_member *m = p->m[i];
        if (m->retired) continue;
        append(buf, size, "%s%s (", shown++ ? "; " : "", m->target);
        if (!m->have_info || m->foreign) append(buf, size, "%s", m->error);
        for (int j = 0; m->have_info && !m->foreign && j < m->info.n_layers; j++) {
            char r[96];
            moedc_plan_ranges_text(m->info.layers[j].held, m->info.layers[j].n_held, r, sizeof r);
            append(buf, size, "%s%d:%s", j ? " " : "layer:experts ", m->info.layers[j].index, r);
        }
        append(buf, size, ")");
    }
}

/* "experts 0-3,6 on A, B" */
static void share_text(const moedc_planner *p, const moedc_expert_range *held, int n_held,
                       const int *replicas, int n, char *buf, size_t size)
{
    char r[160];
    moedc_plan_ranges_text(held, n_held, r, sizeof r);
    snprintf(buf, size, "experts %s on ", r);
    for (int i = 0; i < n; i++) append(buf, size, "%s%s", i ? ", " : "", p->m[replicas[i]]->target);
}

static void shard_text(const moedc_planner *p, const moedc_shard *s, char *buf, size_t size)
{
    share_text(p, s->li->held, s->li->n_held, s->replicas, s->n_replicas, buf, size);
}

/* ---- plans ---- */

static int plan_fail(moedc_layer_plan *pl, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int plan_fail(moedc_layer_plan *pl, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pl->msg, sizeof pl->msg, fmt, ap);
    va_end(ap);
    return pl->rc = rc;
}

/* Groups the members holding layer pl->layer into shards, lowest expert first. */
static int group(const moedc_planner *p, moedc_layer_plan *pl)
{
    const moedc_layer_info *first = NULL;
    int first_m = -1;
    pl->shards = calloc((size_t)p->n, sizeof *pl->shards);
    if (!pl->shards) return plan_fail(pl, MOEDC_ENOMEM, "out of memory planning a fleet");
    for (int i = 0; i < p->n; i++) {
        const moedc_layer_info *li = layer_of(p->m[i], pl->layer);
        if (!li) continue;
        const char *field = first ? differs(first, li) : NULL;
        if (field)
            return plan_fail(pl, MOEDC_EPRECOND,
                             "layer %d differs between %s and %s in %s: a fleet serves one model",
                             pl->layer, p->m[first_m]->target, p->m[i]->target, field);
        if (!first) first = li, first_m = i;
        int s = 0;
        while (s < pl->n_shards && !same_share(pl->shards[s].li, li)) s++;
        if (s == pl->n_shards) {
            int at = s; /* keep the shards ordered by their lowest expert */
            while (at > 0 && pl->shards[at - 1].li->held[0].first > li->held[0].first) at--;
            memmove(&pl->shards[at + 1], &pl->shards[at], sizeof *pl->shards * (size_t)(s - at));
            pl->shards[at] =
                (moedc_shard){ .li = li, .replicas = calloc((size_t)p->n, sizeof(int)) };
            if (!pl->shards[at].replicas)
                return plan_fail(pl, MOEDC_ENOMEM, "out of memory planning a fleet");
            pl->n_shards++;
            s = at;
        }
        pl->shards[s].replicas[pl->shards[s].n_replicas++] = i;
    }
    return 0;
}

static bool any_foreign(const moedc_planner *p)
{
    for (int i = 0; i < p->n; i++)
        if (p->m[i]->foreign && !p->m[i]->retired) return true;
    return false;
}

/* Every expert held once, the shared experts added once. */
static int check_cover(const moedc_planner *p, moedc_layer_plan *pl)
{
    const moedc_layer_info *li = pl->shards[0].li;
    int *owner = malloc(sizeof *owner * (size_t)li->n_experts), adders = 0, rc = 0;
    char a[240], b[240], text[400];
    if (!owner) return plan_fail(pl, MOEDC_ENOMEM, "out of memory planning a fleet");
    for (int e = 0; e < li->n_experts; e++) owner[e] = -1;
    for (int s = 0; s < pl->n_shards && !rc; s++) {
        const moedc_shard *sh = &pl->shards[s];
        adders += sh->li->adds_shared;
        for (int r = 0; r < sh->li->n_held && !rc; r++)
            for (int e = sh->li->held[r].first; e <= sh->li->held[r].last && !rc; e++) {
                if (e < 0 || e >= li->n_experts || owner[e] < 0) {
                    if (e >= 0 && e < li->n_experts) owner[e] = s;
                    continue;
                }
                shard_text(p, &pl->shards[owner[e]], a, sizeof a);
                shard_text(p, sh, b, sizeof b);
                rc = plan_fail(pl, MOEDC_EPRECOND,
                               "layer %d: expert %d is held both by %s and by %s: a fleet's expert "
                               "shards must be disjoint (replicas hold the same experts and the "
                               "same shared-experts role)",
                               pl->layer, e, a, b);
            }
    }
    text[0] = 0;
    for (int e = 0; e < li->n_experts && !rc; e++) {
        if (owner[e] >= 0) continue;
        int last = e;
        while (last + 1 < li->n_experts && owner[last + 1] < 0) last++;
        append(text, sizeof text, last > e ? "%s%d-%d" : "%s%d", text[0] ? "," : "", e, last);
        e = last;
    }
    free(owner);
    if (rc) return rc;
    if (text[0]) {
        members_text(p, a, sizeof a);
        if (any_foreign(p))
            return plan_fail(pl, MOEDC_EPRECOND,
                             "layer %d: experts %s are held by no daemon serving the fleet's model "
                             "(fingerprint %016llx); targets: %s",
                             pl->layer, text, (unsigned long long)p->fingerprint, a);
        return plan_fail(pl, MOEDC_EUNAVAIL,
                         "layer %d: experts %s are held by no reachable daemon of the fleet; "
                         "targets tried: %s",
                         pl->layer, text, a);
    }
    if (li->n_shared && adders != 1) {
        text[0] = 0;
        for (int s = 0; s < pl->n_shards; s++) {
            if (!pl->shards[s].li->adds_shared) continue;
            shard_text(p, &pl->shards[s], a, sizeof a);
            append(text, sizeof text, "%s%s", text[0] ? "; " : "", a);
        }
        return plan_fail(pl, MOEDC_EPRECOND,
                         "layer %d has %d shared expert(s), and exactly one expert shard must add "
                         "them; %s%s",
                         pl->layer, li->n_shared,
                         adders ? "several shards add them: "
                                : "no shard adds them: start the one holding expert 0 with "
                                  "--shared-experts auto or on",
                         text);
    }
    return 0;
}

static void plan_free(moedc_layer_plan *pl)
{
    for (int s = 0; pl->shards && s < pl->n_shards; s++) free(pl->shards[s].replicas);
    free(pl->shards);
    memset(pl, 0, sizeof *pl);
}

void moedc_plan_close(moedc_planner *p)
{
    for (int i = 0; i < p->n_plans; i++) plan_free(&p->plans[i]);
    free(p->plans);
    free(p->m);
    memset(p, 0, sizeof *p);
}

/* The fleet's model: until it is known, the members that answered must agree on one (else
 * `differ` names them); once every member was asked, it is pinned for the fleet's life, and a
 * member found serving another is left out (moedc_plan_learnt). */
static void pin_model(moedc_planner *p, char *differ, size_t size)
{
    uint64_t fp = 0;
    bool two = false, all_heard = true;
    differ[0] = 0;
    for (int i = 0; i < p->n; i++) {
        const moedc_member *m = p->m[i];
        all_heard = all_heard && (m->heard || m->retired);
        if (!m->have_info || m->retired || !m->info.model_fingerprint) continue;
        two = two || (fp && m->info.model_fingerprint != fp);
        if (!fp) fp = m->info.model_fingerprint;
        append(differ, size, "%s%s (fingerprint %016llx)", differ[0] ? "; " : "", m->target,
               (unsigned long long)m->info.model_fingerprint);
    }
    if (!two) differ[0] = 0;
    p->agreed = two ? 0 : fp;
    if (!two && all_heard) p->fingerprint = fp;
}

/* Whether some member left out as foreign holds layer `index`. */
static bool foreign_holds(const moedc_planner *p, int index)
{
    for (int i = 0; i < p->n; i++) {
        const moedc_member *m = p->m[i];
        for (int j = 0; m->foreign && !m->retired && m->have_info && j < m->info.n_layers; j++)
            if (m->info.layers[j].index == index) return true;
    }
    return false;
}

/* Why no member serving the fleet's model holds the layer. */
static void no_holder(const moedc_planner *p, moedc_layer_plan *pl)
{
    char text[400];
    members_text(p, text, sizeof text);
    if (foreign_holds(p, pl->layer)) {
        plan_fail(pl, MOEDC_EPRECOND,
                  "layer %d is held by no daemon serving the fleet's model (fingerprint %016llx); "
                  "targets: %s",
                  pl->layer, (unsigned long long)p->fingerprint, text);
        return;
    }
    bool unknown = false;
    for (int i = 0; i < p->n; i++) unknown = unknown || (!p->m[i]->have_info && !p->m[i]->retired);
    if (unknown)
        plan_fail(pl, MOEDC_EUNAVAIL,
                  "layer %d is held by no reachable daemon of the fleet; targets tried: %s",
                  pl->layer, text);
    else
        plan_fail(pl, MOEDC_ENOTFOUND, "layer %d is not served by the fleet: %s", pl->layer, text);
}

int moedc_plan_rebuild(moedc_planner *p, double now)
{
    char differ[400];
    bool bad = false;
    for (int i = 0; i < p->n_plans; i++) plan_free(&p->plans[i]);
    p->n_plans = 0;
    if (!p->fingerprint)
        pin_model(p, differ, sizeof differ);
    else
        differ[0] = 0;
    for (int i = 0; i < p->n; i++)
        for (int j = 0; p->m[i]->have_info && !p->m[i]->retired && j < p->m[i]->info.n_layers;
             j++) {
            const int index = p->m[i]->info.layers[j].index;
            bool seen = false;
            for (int k = 0; k < p->n_plans; k++) seen = seen || p->plans[k].layer == index;
            if (seen) continue;
            moedc_layer_plan *grown = realloc(p->plans, sizeof *grown * (size_t)(p->n_plans + 1));
            if (!grown) return MOEDC_ENOMEM;
            p->plans = grown;
            moedc_layer_plan *pl = &p->plans[p->n_plans++];
            *pl = (moedc_layer_plan){ .layer = index };
            if (differ[0])
                plan_fail(pl, MOEDC_EPRECOND,
                          "the fleet's daemons serve different models: %s; a fleet serves one "
                          "model (ModelInfo.model_fingerprint)",
                          differ);
            else if (!group(p, pl) && !pl->n_shards)
                no_holder(p, pl);
            else if (!pl->rc)
                check_cover(p, pl);
            bad = bad || pl->rc;
        }
    if (!bad) p->recheck_at = p->recheck_for = 0;
    if (bad && !p->recheck_at) {
        p->recheck_for = MOEDC_PLAN_DOWN_MIN_S;
        p->recheck_at = now + MOEDC_PLAN_DOWN_MIN_S;
    }
    return 0;
}

moedc_layer_plan *moedc_plan_for(moedc_planner *p, int layer, moedc_layer_plan *none)
{
    for (int i = 0; i < p->n_plans; i++)
        if (p->plans[i].layer == layer) return &p->plans[i];
    *none = (moedc_layer_plan){ .layer = layer };
    no_holder(p, none);
    return none;
}

int moedc_plan_batch_gating(const moedc_planner *p, const moedc_layer_plan *pl, moedc_error *err)
{
    if (pl->n_shards < 2) return 0;
    char text[360] = "", s[240];
    for (int i = 0; i < pl->n_shards; i++) {
        shard_text(p, &pl->shards[i], s, sizeof s);
        append(text, sizeof text, "%s%s", i ? "; " : "", s);
    }
    return moedc_fail(err, MOEDC_EPRECOND,
                      "batch_gating needs one daemon holding every expert of layer %d, but this "
                      "fleet splits them over %d shards (%s): the expert set would be chosen over "
                      "a different merged batch on each",
                      pl->layer, pl->n_shards, text);
}

/* ---- when daemons are asked again ---- */

void moedc_plan_down(moedc_member *m, double now)
{
    m->down_for = m->down_for * 2 < MOEDC_PLAN_DOWN_MIN_S ? MOEDC_PLAN_DOWN_MIN_S : m->down_for * 2;
    if (m->down_for > MOEDC_PLAN_DOWN_MAX_S) m->down_for = MOEDC_PLAN_DOWN_MAX_S;
    m->down_until = now + m->down_for;
}

bool moedc_plan_recheck_due(moedc_planner *p, double now)
{
    if (!p->recheck_at || now < p->recheck_at) return false;
    p->recheck_for =
        p->recheck_for * 2 < MOEDC_PLAN_DOWN_MAX_S ? p->recheck_for * 2 : MOEDC_PLAN_DOWN_MAX_S;
    p->recheck_at = now + p->recheck_for;
    return true;
}

bool moedc_plan_to_ask(const moedc_member *m, bool again, double now)
{
    return (!m->have_info || m->check || again) && !m->retired && now >= m->down_until &&
           now >= m->asked_at + (m->have_info ? 0 : MOEDC_PLAN_REPROBE_S);
}

double moedc_plan_next_chance(const moedc_planner *p)
{
    double at = p->recheck_at;
    for (int i = 0; i < p->n; i++) {
        const moedc_member *m = p->m[i];
        if (m->retired || m->foreign || (m->have_info && !m->check)) continue;
        double t = m->have_info ? m->down_until : m->asked_at + MOEDC_PLAN_REPROBE_S;
        if (t < m->down_until) t = m->down_until;
        if (!at || t < at) at = t;
    }
    return at;
}

void moedc_plan_learnt(moedc_planner *p, moedc_member *m, moedc_model_info *info, double now)
{
    const uint64_t fp = info->model_fingerprint;
    const bool foreign = p->fingerprint && fp && fp != p->fingerprint;
    const bool changed = !m->have_info || !same_holdings(&m->info, info) || foreign != m->foreign;
    if (changed) {
        if (m->have_info) moedc_model_info_free(&m->info);
        m->info = *info;
    } else {
        moedc_model_info_free(info);
    }
    m->have_info = m->heard = true;
    m->check = foreign; /* asked again, 0.5 s doubling to 5 s, until it serves the fleet's model */
    m->foreign = foreign;
    if (foreign) {
        moedc_plan_down(m, now);
        snprintf(m->error, sizeof m->error,
                 "serves another model: fingerprint %016llx, the fleet's is %016llx",
                 (unsigned long long)fp, (unsigned long long)p->fingerprint);
    } else {
        snprintf(m->error, sizeof m->error, "answering");
    }
    if (changed) moedc_plan_rebuild(p, now);
}

void moedc_plan_unanswered(moedc_planner *p, moedc_member *m, const char *why, double now)
{
    const bool first = !m->heard;
    m->heard = true;
    snprintf(m->error, sizeof m->error, "%s", why);
    moedc_plan_down(m, now);
    if (first && !p->fingerprint) moedc_plan_rebuild(p, now); /* the model may wait on this one */
}

/* ---- attempts ---- */

int moedc_plan_pick(const moedc_planner *p, int layer, const moedc_expect *e, const int *replicas,
                    int n, const unsigned char *tried, unsigned turn, double now)
{
    int best = -1;
    for (int j = 0; j < n; j++) {
        const int at = (int)((turn + (unsigned)j) % (unsigned)n);
        const moedc_member *m = p->m[replicas[at]];
        const moedc_layer_info *li = layer_of(m, layer);
        if (tried[at] || m->check || m->down_until > now || !li ||
            li->adds_shared != e->adds_shared ||
            !same_ranges(li->held, li->n_held, e->held, e->n_held))
            continue;
        if (best < 0 || m->outstanding < p->m[replicas[best]]->outstanding) best = at;
    }
    return best;
}

bool moedc_plan_done(moedc_member *m, int rc, const char *msg, double now)
{
    m->outstanding--;
    if (!rc) {
        m->down_for = 0;
        return false;
    }
    if (rc != MOEDC_EUNAVAIL && rc != MOEDC_EPRECOND) return false;
    /* unreachable or draining: passed over a while; refused (the daemon is not what the fleet took
     * it for): never added up. Either way its GetModel is asked before it is used again */
    snprintf(m->error, sizeof m->error, "%s: %.330s",
             rc == MOEDC_EUNAVAIL ? "UNAVAILABLE" : "FAILED_PRECONDITION", msg);
    m->check = true;
    if (rc == MOEDC_EUNAVAIL) moedc_plan_down(m, now);
    return true;
}

int moedc_plan_exhausted(const moedc_planner *p, int layer, const moedc_expect *e,
                         const int *replicas, int n, bool refused, moedc_error *err)
{
    char share[200], said[400] = "";
    share_text(p, e->held, e->n_held, replicas, n, share, sizeof share);
    for (int j = 0; j < n; j++) {
        const moedc_member *m = p->m[replicas[j]];
        append(said, sizeof said, "%s%s (%s)", j ? "; " : "", m->target, m->error);
    }
    if (refused)
        return moedc_fail(err, MOEDC_EPRECOND,
                          "layer %d: no replica of %s is what the fleet took it for: %s", layer,
                          share, said);
    return moedc_fail(err, MOEDC_EUNAVAIL, "layer %d: no replica of %s answered: %s", layer, share,
                      said);
}

/* ---- the fleet's answers ---- */

int moedc_plan_rows(const moedc_layer_plan *pl, const int32_t *ids, const float *w, int64_t T,
                    int k, int64_t **rows, int64_t *n_rows, moedc_error *err)
{
    const int S = pl->n_shards;
    for (int s = 0; s < S; s++) {
        rows[s] = NULL;
        n_rows[s] = T;
    }
    if (S < 2) return 0;
    const int E = pl->shards[0].li->n_experts;
    for (int64_t i = 0; i < T * k; i++) /* refused: the daemons name its place in the call */
        if (moed_choice_rule(ids[i], w[i], E) > MOED_CHOICE_PADDING) return 0;
    int *owner = malloc(sizeof *owner * (size_t)(E > 0 ? E : 1));
    bool ok = owner != NULL;
    for (int s = 0; ok && s < S; s++) {
        const moedc_layer_info *li = pl->shards[s].li;
        for (int r = 0; r < li->n_held; r++)
            for (int e = li->held[r].first; e <= li->held[r].last; e++) owner[e] = s;
        if (li->adds_shared && li->n_shared > 0) continue; /* a term for every token */
        n_rows[s] = 0;
        ok = (rows[s] = malloc(sizeof **rows * (size_t)(T > 0 ? T : 1))) != NULL;
    }
    for (int64_t t = 0; ok && t < T; t++)
        for (int j = 0; j < k; j++) {
            const int32_t e = ids[t * k + j];
            if (moed_choice_rule(e, w[t * k + j], E) != MOED_CHOICE_VALID) continue;
            const int s = owner[e];
            if (rows[s] && (!n_rows[s] || rows[s][n_rows[s] - 1] != t)) rows[s][n_rows[s]++] = t;
        }
    bool any = false;
    for (int s = 0; s < S; s++) any |= n_rows[s] > 0;
    free(owner);
    if (!ok || !any) { /* no shard would get a token: every shard gets them all, as before */
        for (int s = 0; s < S; s++) {
            free(rows[s]);
            rows[s] = NULL;
            n_rows[s] = T;
        }
    }
    return ok ? 0 : moedc_fail(err, MOEDC_ENOMEM, "out of memory planning a call's shards");
}

bool moedc_plan_sends_all(const moedc_layer_plan *pl, int k)
{
    const int S = pl->n_shards;
    if (S < 2) return true;
    const int E = pl->shards[0].li->n_experts;
    double skipped = 0;
    for (int s = 0; s < S; s++) {
        const moedc_layer_info *li = pl->shards[s].li;
        if (li->adds_shared && li->n_shared > 0) continue;
        int held = 0;
        for (int r = 0; r < li->n_held; r++) held += li->held[r].last - li->held[r].first + 1;
        /* a token skips the shard when each of its k distinct experts is one of the E - held
         * others: C(E - held, k) / C(E, k) */
        double q = 1;
        for (int i = 0; i < k && q > 0; i++)
            q *= E - held - i > 0 ? (double)(E - held - i) / (E - i) : 0;
        skipped += q;
    }
    return skipped < MOEDC_PLAN_SKIP_MIN * S;
}

int moedc_plan_sum(int dtype, const void *const *parts, const int64_t *const *rows,
                   const int64_t *n_rows, int n, int64_t tokens, int64_t d, void *out,
                   moedc_error *err)
{
    const size_t size = moed_dtype_size(dtype), row = d > 0 ? (size_t)d : 0;
    const int64_t block = row && row < SUM_CHUNK ? (int64_t)(SUM_CHUNK / row) : 1;
    const size_t floats = (size_t)block * (row ? row : 1);
    float *acc = malloc(sizeof *acc * floats), *part = malloc(sizeof *part * floats);
    int *held = malloc(sizeof *held * (size_t)block);
    int64_t *next = calloc((size_t)(n > 0 ? n : 1), sizeof *next); /* each part's next row */
    int rc = acc && part && held && next
                 ? 0
                 : moedc_fail(err, MOEDC_ENOMEM, "out of memory adding the shards' outputs");
    int whole = 0; /* parts holding every token */
    for (int i = 0; i < n; i++) whole += !(rows && rows[i]);
    for (int64_t r0 = 0; !rc && r0 < tokens; r0 += block) {
        const int64_t m = tokens - r0 < block ? tokens - r0 : block;
        for (int64_t j = 0; j < m; j++) held[j] = whole;
        for (int i = 0; rows && i < n; i++)
            for (int64_t j = next[i]; rows[i] && j < n_rows[i] && rows[i][j] < r0 + m; j++)
                held[rows[i][j] - r0]++;
        for (int64_t j = 0; j < m; j++) {
            /* A part without the token would have answered +0.0 there; -0.0 is what adding to
             * leaves alone. Either way the sum is the one over every shard's answer. */
            const float start = held[j] == n ? -0.0f : 0.0f;
            for (size_t c = 0; c < row; c++) acc[(size_t)j * row + c] = start;
        }
        for (int i = 0; i < n; i++) {
            if (!(rows && rows[i])) {
                moed_to_f32(dtype, (const char *)parts[i] + (size_t)r0 * row * size, part,
                            (size_t)m * row);
                for (size_t c = 0; c < (size_t)m * row; c++) acc[c] += part[c];
                continue;
            }
            for (; next[i] < n_rows[i] && rows[i][next[i]] < r0 + m; next[i]++) {
                moed_to_f32(dtype, (const char *)parts[i] + (size_t)next[i] * row * size, part,
                            row);
                float *a = acc + (size_t)(rows[i][next[i]] - r0) * row;
                for (size_t c = 0; c < row; c++) a[c] += part[c];
            }
        }
        moed_from_f32(dtype, acc, (char *)out + (size_t)r0 * row * size, (size_t)m * row);
    }
    free(acc);
    free(part);
    free(held);
    free(next);
    return rc;
}

int moedc_plan_copy(const moedc_layer_plan *pl, moedc_layer_plan *out, moedc_error *err)
{
    *out = *pl;
    out->shards = calloc((size_t)(pl->n_shards > 0 ? pl->n_shards : 1), sizeof *out->shards);
    bool ok = out->shards != NULL;
    for (int s = 0; ok && s < pl->n_shards; s++) {
        const moedc_shard *from = &pl->shards[s];
        moedc_shard *to = &out->shards[s];
        moedc_layer_info *li = malloc(sizeof *li);
        to->li = li;
        to->turn = from->turn;
        ok = li && (to->replicas = malloc(sizeof *to->replicas * (size_t)from->n_replicas));
        if (!ok) break;
        to->n_replicas = from->n_replicas;
        memcpy(to->replicas, from->replicas, sizeof *to->replicas * (size_t)from->n_replicas);
        *li = *from->li;
        li->placed = NULL, li->n_placed = 0;
        li->replicas = NULL, li->n_replicas = 0;
        li->held = malloc(sizeof *li->held * (size_t)(li->n_held > 0 ? li->n_held : 1));
        if (!(ok = li->held != NULL)) break;
        memcpy(li->held, from->li->held, sizeof *li->held * (size_t)li->n_held);
    }
    if (ok) return 0;
    moedc_plan_copy_free(out);
    return moedc_fail(err, MOEDC_ENOMEM, "out of memory copying a layer's plan");
}

void moedc_plan_copy_free(moedc_layer_plan *pl)
{
    for (int s = 0; pl->shards && s < pl->n_shards; s++) {
        moedc_layer_info *li = (moedc_layer_info *)pl->shards[s].li; /* this copy's own */
        if (li) free(li->held);
        free(li);
        free(pl->shards[s].replicas);
    }
    free(pl->shards);
    pl->shards = NULL;
    pl->n_shards = 0;
}

/* Adds [first, last] to a layer's held ranges (kept increasing and merged). */
static bool add_range(moedc_layer_info *li, int first, int last)
{
    moedc_expert_range *r = realloc(li->held, sizeof *r * (size_t)(li->n_held + 1));
    if (!r) return false;
    li->held = r;
    int at = li->n_held++;
    while (at > 0 && r[at - 1].first > first) {
        r[at] = r[at - 1];
        at--;
    }
    r[at] = (moedc_expert_range){ first, last };
    int k = 0;
    for (int i = 1; i < li->n_held; i++)
        if (r[i].first <= r[k].last + 1) {
            if (r[i].last > r[k].last) r[k].last = r[i].last;
        } else {
            r[++k] = r[i];
        }
    li->n_held = k + 1;
    return true;
}

/* Whether m's answer counts in the fleet's ModelInfo. */
static bool known(const moedc_member *m)
{
    return m->have_info && !m->retired && !m->foreign;
}

/* The fleet's layers: each once, holding what the members that answered hold between them. */
static int merge_layers(const moedc_planner *p, moedc_model_info *out)
{
    for (int i = 0; i < p->n; i++)
        for (int j = 0; known(p->m[i]) && j < p->m[i]->info.n_layers; j++) {
            const moedc_layer_info *li = &p->m[i]->info.layers[j];
            int k = 0;
            while (k < out->n_layers && out->layers[k].index != li->index) k++;
            if (k == out->n_layers) {
                moedc_layer_info *grown =
                    realloc(out->layers, sizeof *grown * (size_t)(out->n_layers + 1));
                if (!grown) return MOEDC_ENOMEM;
                out->layers = grown;
                out->layers[out->n_layers++] = *li;
                out->layers[k].held = NULL;
                out->layers[k].n_held = 0;
                out->layers[k].placed = NULL; /* each daemon's devices are its own */
                out->layers[k].n_placed = 0;
                out->layers[k].replicas = NULL;
                out->layers[k].n_replicas = 0;
                out->layers[k].placement_generation = 0;
                out->layers[k].home_device = 0;
                out->layers[k].adds_shared = true;
            }
            for (int r = 0; r < li->n_held; r++)
                if (!add_range(&out->layers[k], li->held[r].first, li->held[r].last))
                    return MOEDC_ENOMEM;
        }
    return 0;
}

static int merge_info(const moedc_planner *p, const moedc_model_info *first, moedc_model_info *out)
{
    out->model = strdup(first->model);
    out->backend = strdup(first->backend);
    out->version = strdup(first->version);
    out->max_message_bytes = first->max_message_bytes;
    out->max_batch_tokens = first->max_batch_tokens;
    out->model_fingerprint = first->model_fingerprint;
    if (!out->model || !out->backend || !out->version) return MOEDC_ENOMEM;
    for (int i = 0; i < p->n; i++) {
        const moedc_model_info *m = &p->m[i]->info;
        if (!known(p->m[i])) continue;
        if (m->max_message_bytes < out->max_message_bytes)
            out->max_message_bytes = m->max_message_bytes;
        if (m->max_batch_tokens < out->max_batch_tokens)
            out->max_batch_tokens = m->max_batch_tokens;
        moedc_device *d =
            realloc(out->devices, sizeof *d * (size_t)(out->n_devices + m->n_devices + 1));
        if (!d) return MOEDC_ENOMEM;
        out->devices = d;
        for (int j = 0; j < m->n_devices; j++) {
            d[out->n_devices] = m->devices[j];
            if (!(d[out->n_devices].name = strdup(m->devices[j].name))) return MOEDC_ENOMEM;
            out->n_devices++;
        }
    }
    return merge_layers(p, out);
}

int moedc_plan_info(const moedc_planner *p, moedc_model_info *out, moedc_error *err)
{
    const moedc_model_info *first = NULL;
    for (int i = 0; i < p->n && !first; i++)
        if (known(p->m[i])) first = &p->m[i]->info;
    if (!first) {
        char text[400];
        members_text(p, text, sizeof text);
        return moedc_fail(err, MOEDC_EUNAVAIL, "no daemon of the fleet answered GetModel: %s",
                          text);
    }
    if (merge_info(p, first, out)) {
        moedc_model_info_free(out);
        return moedc_fail(err, MOEDC_ENOMEM, "out of memory merging the fleet's ModelInfo");
    }
    return 0;
}

bool moedc_plan_serving(const moedc_planner *p, const bool *serving, int n)
{
    bool ok = p->n_plans > 0;
    for (int i = 0; i < p->n_plans && ok; i++) {
        const moedc_layer_plan *pl = &p->plans[i];
        ok = !pl->rc;
        for (int s = 0; ok && s < pl->n_shards; s++) {
            bool any = false;
            for (int r = 0; r < pl->shards[s].n_replicas; r++)
                any = any || (pl->shards[s].replicas[r] < n && serving[pl->shards[s].replicas[r]]);
            ok = any;
        }
    }
    return ok;
}
