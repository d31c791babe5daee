/*
 * moedc_fleet — a moedc over several daemons: what each holds (its GetModel), the shards of each
 * layer, the choice of replicas, and Forward calls fanned out over the shards and added up.
 * moedclient.h (moedc_connect_many) says what a fleet does; moedc_fleet.h how it plugs into the
 * calls.
 *
 * Every sub-call states what its part expects of the daemon (the fleet's model, the shard's
 * experts), so a part's reply is only ever one the plan it was made from accounts for: the sum is
 * right whatever changed since, and a daemon that changed refuses instead.
 *
 * Locking: one mutex over the members' state (what they hold, calls outstanding, when they were
 * turned away) and the fleet calls' bookkeeping. It is never held across a wait: GetModel is
 * asked with it released, and a sub-call is started under it (starting only queues a batch), so
 * its completion, which takes the mutex too, always finds the part knowing its sub-call.
 * Plans (each layer's shards) are rebuilt whenever a daemon is learnt to hold something new; a
 * fleet call copies what it needs of its shards when it starts.
 */
#include "moedc_fleet.h"

#include "moedc_common.h"

#include "moed_dtype.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define PROBE_TIMEOUT_S 5.0 /* GetModel of one daemon, at most */
#define CONNECT_S       1.0 /* how long asking again waits for the connection it makes */
#define REPROBE_S       1.0 /* a daemon that never answered is asked again at most this often */
#define DOWN_MIN_S      0.5 /* a replica turned away is passed over this long, doubling ... */
#define DOWN_MAX_S      5.0 /* ... up to this */
#define MAX_MEMBERS     1024
#define SUM_CHUNK       16384 /* elements added at a time */
#define RESOLVE_EVERY_S 5.0   /* dns: names resolved again at most this often */

typedef struct member {
    char *target;
    char *name;   /* the dns: target this is one address of, or NULL */
    bool retired; /* its name no longer resolves to it: out of the fleet */
    bool foreign; /* it serves another model than the fleet's: left out */
    bool heard;   /* its GetModel answered, or failed, at least once */
    moedc *c;
    moedc_model_info info;
    bool have_info;
    bool check;      /* turned a call away since GetModel answered: ask again before using it */
    char error[360]; /* what went wrong last */
    int outstanding; /* calls in flight from this fleet */
    double down_until, down_for, asked_at;
} member;

/* The replicas holding the same experts of one layer. */
typedef struct shard {
    const moedc_layer_info *li; /* of its first replica: the ranges and the shared role */
    int *replicas;
    int n_replicas;
    unsigned turn; /* rotates ties between replicas */
} shard;

/* One layer's shards, lowest expert first; or why a call cannot be made to it. */
typedef struct plan {
    int layer;
    shard *shards;
    int n_shards;
    int rc; /* 0, MOEDC_EPRECOND (misconfigured), MOEDC_EUNAVAIL, MOEDC_ENOTFOUND */
    char msg[480];
} plan;

struct moedc_fleet {
    pthread_mutex_t mu;
    member **m; /* each allocated once: a member never moves while the array grows */
    int n;
    char **names; /* the "dns:" targets, resolved again when a shard has no daemon answering */
    int n_names;
    double resolved_at;
    moedc_opts opts; /* for members that join later; its strings are owned copies */
    char *owned[5];
    plan *plans;
    int n_plans;
    double timeout_s;     /* the moedc's default deadline */
    uint64_t fingerprint; /* the fleet's model, once its daemons agreed on one (0: not yet) */
    uint64_t agreed;      /* the model those that answered serve, pinned or not (0: none said) */
    double recheck_at, recheck_for; /* while a plan fails: when every member is asked again */
};

struct moedc_part {
    moedc_fleet_call *fc;
    int layer;
    char what[160]; /* "layer 1: experts 4-7" */
    int *replicas;
    int n_replicas;
    unsigned turn; /* where the replicas' rotation starts for this call */
    unsigned char *tried;
    int member;               /* of the attempt in flight */
    moedc_call *sub;          /* the attempt in flight, or NULL */
    moedc_expect expect;      /* what each attempt states it expects of its daemon */
    moedc_expert_range *held; /* expect's ranges (the shard's, copied) */
    bool refused;             /* a replica refused it: it is not what the fleet took it for */
    moedc_result res;
    bool done;
};

struct moedc_fleet_call {
    moedc_fleet *f;
    moedc_call *handle;
    moedc_queue *q;
    moedc_request req;        /* the caller's, its routing tensors copied (the start copies) */
    void *ids, *weights, *lg; /* those copies */
    char *request_id;
    double deadline; /* monotonic seconds; 0: none */
    moedc_part *parts;
    int n_parts, pending;
    int rc; /* the first failure */
    moedc_error err;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

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

static void ranges_text(const moedc_expert_range *r, int n, char *buf, size_t size)
{
    buf[0] = 0;
    for (int i = 0; i < n; i++)
        if (r[i].first == r[i].last)
            append(buf, size, "%s%d", i ? "," : "", r[i].first);
        else
            append(buf, size, "%s%d-%d", i ? "," : "", r[i].first, r[i].last);
}

/* ---- targets ---- */

/* host and port of a "dns:" target (gRPC's forms: dns:///host:port, dns://auth/host:port,
 * dns:host:port; port 443 when none is given). False when it names no host. */
static bool dns_host_port(const char *target, char *host, size_t hn, char *port, size_t pn)
{
    const char *rest = target + 4;
    if (!strncmp(rest, "//", 2)) {
        rest = strchr(rest + 2, '/');
        if (!rest) return false;
        rest++;
    }
    const char *colon = NULL, *h = rest, *end;
    if (*rest == '[') {
        h = rest + 1;
        end = strchr(h, ']');
        if (!end) return false;
        colon = end[1] == ':' ? end + 1 : NULL;
    } else {
        colon = strrchr(rest, ':');
        end = colon ? colon : rest + strlen(rest);
    }
    if (end == h || (size_t)(end - h) >= hn) return false;
    snprintf(host, hn, "%.*s", (int)(end - h), h);
    snprintf(port, pn, "%s", colon && colon[1] ? colon + 1 : "443");
    return true;
}

/* The daemons a target names: for a "dns:" name, one "ipv4:A:P" / "ipv6:[A]:P" per address it
 * resolves to (itself when it resolves to one or none: gRPC then resolves, or says why not);
 * else itself. Appends to out (grown), returns the new count or -1 out of memory. */
static int expand(const char *target, char ***out, int n)
{
    char host[256], port[16], addr[INET6_ADDRSTRLEN], **list = *out;
    struct addrinfo hints = { .ai_socktype = SOCK_STREAM }, *ai = NULL;
    int added = 0;
    if (!strncmp(target, "dns:", 4) &&
        dns_host_port(target, host, sizeof host, port, sizeof port) &&
        !getaddrinfo(host, port, &hints, &ai)) {
        for (struct addrinfo *a = ai; a && n + added < MAX_MEMBERS; a = a->ai_next) {
            const void *p = a->ai_family == AF_INET6
                                ? (const void *)&((struct sockaddr_in6 *)a->ai_addr)->sin6_addr
                                : (const void *)&((struct sockaddr_in *)a->ai_addr)->sin_addr;
            if (a->ai_family != AF_INET && a->ai_family != AF_INET6) continue;
            inet_ntop(a->ai_family, p, addr, sizeof addr);
            char name[INET6_ADDRSTRLEN + 32];
            snprintf(name, sizeof name, a->ai_family == AF_INET6 ? "ipv6:[%s]:%s" : "ipv4:%s:%s",
                     addr, port);
            bool seen = false;
            for (int i = n; i < n + added; i++) seen = seen || !strcmp(list[i], name);
            if (seen) continue;
            char **grown = realloc(list, sizeof *list * (size_t)(n + added + 1));
            if (!grown || !(grown[n + added] = strdup(name))) {
                if (grown) *out = grown;
                freeaddrinfo(ai);
                return -1;
            }
            *out = list = grown;
            added++;
        }
        freeaddrinfo(ai);
    }
    if (added > 1) return n + added;
    for (int i = n; i < n + added; i++) free(list[i]);
    char **grown = realloc(list, sizeof *list * (size_t)(n + 1));
    if (!grown) return -1;
    *out = grown;
    return (grown[n] = strdup(target)) ? n + 1 : -1;
}

static int expand_all(const char *const *targets, int n, char ***out)
{
    int count = 0;
    *out = NULL;
    for (int i = 0; i < n && count >= 0; i++) count = expand(targets[i], out, count);
    return count;
}

static void free_list(char **list, int n)
{
    for (int i = 0; list && i < n; i++) free(list[i]);
    free(list);
}

bool moedc_fleet_wanted(const char *const *targets, int n)
{
    if (n != 1) return n > 1;
    char **list;
    int k = expand_all(targets, n, &list);
    free_list(list, k);
    return k > 1;
}

/* ---- what the daemons hold ---- */

static const moedc_layer_info *layer_of(const member *m, int index)
{
    for (int i = 0; m->have_info && !m->retired && !m->foreign && i < m->info.n_layers; i++)
        if (m->info.layers[i].index == index) return &m->info.layers[i];
    return NULL;
}

static bool same_share(const moedc_layer_info *a, const moedc_layer_info *b)
{
    if (a->n_held != b->n_held || a->adds_shared != b->adds_shared) return false;
    for (int i = 0; i < a->n_held; i++)
        if (a->held[i].first != b->held[i].first || a->held[i].last != b->held[i].last)
            return false;
    return true;
}

static bool same_holdings(const moedc_model_info *a, const moedc_model_info *b)
{
    if (a->n_layers != b->n_layers || a->model_fingerprint != b->model_fingerprint) return false;
    for (int i = 0; i < a->n_layers; i++)
        if (a->layers[i].index != b->layers[i].index || !same_share(&a->layers[i], &b->layers[i]))
            return false;
    return true;
}

/* The first field two replicas of one layer disagree on, or NULL. */
static const char *differs(const moedc_layer_info *a, const moedc_layer_info *b)
{
#define SAME(f)                                                                                    \
    if (a->f != b->f) return #f
    SAME(d_model);
    SAME(d_ff);
    SAME(n_experts);
    SAME(top_k);
    SAME(act);
    SAME(wdtype);
    SAME(has_router);
    SAME(norm_topk);
    SAME(rule);
    SAME(n_group);
    SAME(topk_group);
    SAME(routed_scale);
    SAME(n_shared);
    SAME(shared_d_ff);
#undef SAME
    return NULL;
}

/* "A (layer:experts 0:0-3 1:0-3); B (UNAVAILABLE: ...)" for messages. */
static void members_text(const moedc_fleet *f, char *buf, size_t size)
{
    buf[0] = 0;
    for (int i = 0, shown = 0; i < f->n; i++) {
        const member *m = f->m[i];
        if (m->retired) continue;
        append(buf, size, "%s%s (", shown++ ? "; " : "", m->target);
        if (!m->have_info || m->foreign) append(buf, size, "%s", m->error);
        for (int j = 0; m->have_info && !m->foreign && j < m->info.n_layers; j++) {
            char r[96];
            ranges_text(m->info.layers[j].held, m->info.layers[j].n_held, r, sizeof r);
            append(buf, size, "%s%d:%s", j ? " " : "layer:experts ", m->info.layers[j].index, r);
        }
        append(buf, size, ")");
    }
}

static void shard_text(const moedc_fleet *f, const shard *s, char *buf, size_t size)
{
    ranges_text(s->li->held, s->li->n_held, buf, size);
    append(buf, size, " on ");
    for (int i = 0; i < s->n_replicas; i++)
        append(buf, size, "%s%s", i ? ", " : "", f->m[s->replicas[i]]->target);
}

static int plan_fail(plan *p, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int plan_fail(plan *p, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->msg, sizeof p->msg, fmt, ap);
    va_end(ap);
    return p->rc = rc;
}

/* Groups the members holding layer p->layer into shards, lowest expert first. */
static int group(moedc_fleet *f, plan *p)
{
    const moedc_layer_info *first = NULL;
    int first_m = -1;
    p->shards = calloc((size_t)f->n, sizeof *p->shards);
    if (!p->shards) return plan_fail(p, MOEDC_ENOMEM, "out of memory planning a fleet");
    for (int i = 0; i < f->n; i++) {
        const moedc_layer_info *li = layer_of(f->m[i], p->layer);
        if (!li) continue;
        const char *field = first ? differs(first, li) : NULL;
        if (field)
            return plan_fail(p, MOEDC_EPRECOND,
                             "layer %d differs between %s and %s (%s): a fleet serves one model",
                             p->layer, f->m[first_m]->target, f->m[i]->target, field);
        if (!first) first = li, first_m = i;
        int s = 0;
        while (s < p->n_shards && !same_share(p->shards[s].li, li)) s++;
        if (s == p->n_shards) {
            int at = s; /* keep the shards ordered by their lowest expert */
            while (at > 0 && p->shards[at - 1].li->held[0].first > li->held[0].first) at--;
            memmove(&p->shards[at + 1], &p->shards[at], sizeof *p->shards * (size_t)(s - at));
            p->shards[at] = (shard){ .li = li, .replicas = calloc((size_t)f->n, sizeof(int)) };
            if (!p->shards[at].replicas) return plan_fail(p, MOEDC_ENOMEM, "out of memory");
            p->n_shards++;
            s = at;
        }
        p->shards[s].replicas[p->shards[s].n_replicas++] = i;
    }
    return 0;
}

static bool any_foreign(const moedc_fleet *f)
{
    for (int i = 0; i < f->n; i++)
        if (f->m[i]->foreign && !f->m[i]->retired) return true;
    return false;
}

/* Every expert held once, the shared experts added once. */
static int check_cover(moedc_fleet *f, plan *p)
{
    const moedc_layer_info *li = p->shards[0].li;
    int *owner = malloc(sizeof *owner * (size_t)li->n_experts), adders = 0, rc = 0;
    char a[240], b[240], text[400];
    if (!owner) return plan_fail(p, MOEDC_ENOMEM, "out of memory");
    for (int e = 0; e < li->n_experts; e++) owner[e] = -1;
    for (int s = 0; s < p->n_shards && !rc; s++) {
        const shard *sh = &p->shards[s];
        adders += sh->li->adds_shared;
        for (int r = 0; r < sh->li->n_held && !rc; r++)
            for (int e = sh->li->held[r].first; e <= sh->li->held[r].last && !rc; e++) {
                if (e < 0 || e >= li->n_experts || owner[e] < 0) {
                    if (e >= 0 && e < li->n_experts) owner[e] = s;
                    continue;
                }
                shard_text(f, &p->shards[owner[e]], a, sizeof a);
                shard_text(f, sh, b, sizeof b);
                rc = plan_fail(p, MOEDC_EPRECOND,
                               "layer %d: expert %d is held both by experts %s and by experts %s: "
                               "a fleet's expert shards must be disjoint (replicas hold the same "
                               "experts and the same shared-experts role)",
                               p->layer, e, a, b);
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
    if (!rc && text[0]) {
        members_text(f, a, sizeof a);
        if (any_foreign(f))
            return plan_fail(p, MOEDC_EPRECOND,
                             "layer %d: experts %s are held by no daemon serving the fleet's model "
                             "(fingerprint %016llx); targets: %s",
                             p->layer, text, (unsigned long long)f->fingerprint, a);
        return plan_fail(p, MOEDC_EUNAVAIL,
                         "layer %d: experts %s are held by no reachable daemon of the fleet; "
                         "targets tried: %s",
                         p->layer, text, a);
    }
    if (!rc && li->n_shared && adders != 1)
        rc = plan_fail(p, MOEDC_EPRECOND,
                       "layer %d has %d shared expert(s), and exactly one expert shard must add "
                       "them; %s",
                       p->layer, li->n_shared,
                       adders ? "several do"
                              : "none does: start the one holding expert 0 with --shared-experts "
                                "auto or on");
    return rc;
}

static void plan_free(plan *p)
{
    for (int s = 0; p->shards && s < p->n_shards; s++) free(p->shards[s].replicas);
    free(p->shards);
    memset(p, 0, sizeof *p);
}

/* The fleet's model: until it is known, the daemons that answered must agree on one (else
 * `differ` names them); once every daemon was asked, it is pinned for the fleet's life, and a
 * daemon found serving another is left out (learnt). */
static void pin_model(moedc_fleet *f, char *differ, size_t size)
{
    uint64_t fp = 0;
    bool two = false, all_heard = true;
    differ[0] = 0;
    for (int i = 0; i < f->n; i++) {
        const member *m = f->m[i];
        all_heard = all_heard && (m->heard || m->retired);
        if (!m->have_info || m->retired || !m->info.model_fingerprint) continue;
        two = two || (fp && m->info.model_fingerprint != fp);
        if (!fp) fp = m->info.model_fingerprint;
        append(differ, size, "%s%s (fingerprint %016llx)", differ[0] ? "; " : "", m->target,
               (unsigned long long)m->info.model_fingerprint);
    }
    if (!two) differ[0] = 0;
    f->agreed = two ? 0 : fp;
    if (!two && all_heard) f->fingerprint = fp;
}

/* Rebuilds every layer's plan from what the members hold (under f->mu); while one fails, every
 * member is asked GetModel again (learn), after DOWN_MIN_S doubling to DOWN_MAX_S. */
static int replan(moedc_fleet *f)
{
    char differ[400];
    bool bad = false;
    for (int i = 0; i < f->n_plans; i++) plan_free(&f->plans[i]);
    f->n_plans = 0;
    if (!f->fingerprint)
        pin_model(f, differ, sizeof differ);
    else
        differ[0] = 0;
    for (int i = 0; i < f->n; i++)
        for (int j = 0; f->m[i]->have_info && !f->m[i]->retired && j < f->m[i]->info.n_layers;
             j++) {
            const int index = f->m[i]->info.layers[j].index;
            bool seen = false;
            for (int k = 0; k < f->n_plans; k++) seen = seen || f->plans[k].layer == index;
            if (seen) continue;
            plan *grown = realloc(f->plans, sizeof *grown * (size_t)(f->n_plans + 1));
            if (!grown) return MOEDC_ENOMEM;
            f->plans = grown;
            plan *p = &f->plans[f->n_plans++];
            *p = (plan){ .layer = index };
            if (differ[0])
                plan_fail(p, MOEDC_EPRECOND,
                          "the fleet's daemons serve different models: %s; a fleet serves one "
                          "model (ModelInfo.model_fingerprint)",
                          differ);
            else if (!group(f, p) && !p->n_shards) {
                members_text(f, differ, sizeof differ);
                plan_fail(p, MOEDC_EPRECOND,
                          "layer %d is held by no daemon serving the fleet's model (fingerprint "
                          "%016llx): %s",
                          index, (unsigned long long)f->fingerprint, differ);
            } else if (!p->rc)
                check_cover(f, p);
            bad = bad || p->rc;
        }
    if (!bad) f->recheck_at = f->recheck_for = 0;
    if (bad && !f->recheck_at) {
        f->recheck_for = DOWN_MIN_S;
        f->recheck_at = now_s() + DOWN_MIN_S;
    }
    return 0;
}

/* What a call to `layer` finds (under f->mu): its plan, or a stand-in saying why there is none. */
static plan *plan_for(moedc_fleet *f, int layer, plan *none)
{
    for (int i = 0; i < f->n_plans; i++)
        if (f->plans[i].layer == layer) return &f->plans[i];
    char text[400];
    bool unknown = false;
    for (int i = 0; i < f->n; i++) unknown = unknown || (!f->m[i]->have_info && !f->m[i]->retired);
    members_text(f, text, sizeof text);
    *none = (plan){ .layer = layer };
    plan_fail(none, unknown ? MOEDC_EUNAVAIL : MOEDC_ENOTFOUND, "layer %d is %s: %s", layer,
              unknown ? "held by no reachable daemon of the fleet; targets tried"
                      : "not served by the fleet",
              text);
    return none;
}

static void mark_down(member *m, double now)
{
    m->down_for = m->down_for * 2 < DOWN_MIN_S ? DOWN_MIN_S : m->down_for * 2;
    if (m->down_for > DOWN_MAX_S) m->down_for = DOWN_MAX_S;
    m->down_until = now + m->down_for;
}

/* Whether every member is to be asked GetModel again now (a plan fails, and its time came); the
 * next time is set (under f->mu). */
static bool recheck_due(moedc_fleet *f, double now)
{
    if (!f->recheck_at || now < f->recheck_at) return false;
    f->recheck_for = f->recheck_for * 2 < DOWN_MAX_S ? f->recheck_for * 2 : DOWN_MAX_S;
    f->recheck_at = now + f->recheck_for;
    return true;
}

/* What GetModel of m answered (under f->mu; info is taken over): a member serving another model
 * than the fleet's is left out; the plans are rebuilt when anything changed. Otherwise the info
 * kept is the one the plans point into. */
static void learnt(moedc_fleet *f, member *m, moedc_model_info *info)
{
    const uint64_t fp = info->model_fingerprint;
    const bool foreign = f->fingerprint && fp && fp != f->fingerprint;
    const bool changed = !m->have_info || !same_holdings(&m->info, info) || foreign != m->foreign;
    if (changed) {
        if (m->have_info) moedc_model_info_free(&m->info);
        m->info = *info;
    } else {
        moedc_model_info_free(info);
    }
    m->have_info = true;
    m->check = foreign; /* asked again, 0.5 s doubling to 5 s, until it serves the fleet's model */
    m->foreign = foreign;
    if (foreign) {
        mark_down(m, now_s());
        snprintf(m->error, sizeof m->error,
                 "serves another model: fingerprint %016llx, the fleet's is %016llx",
                 (unsigned long long)fp, (unsigned long long)f->fingerprint);
    } else {
        snprintf(m->error, sizeof m->error, "answering");
    }
    if (changed) replan(f);
}

/* Asks GetModel of the members that need it (never answered, turned a call away since, or any
 * while a plan fails and its time came), not more often than their wait allows; rebuilds the
 * plans when one holds something new. */
static void learn(moedc_fleet *f)
{
    pthread_mutex_lock(&f->mu);
    const bool again = recheck_due(f, now_s());
    pthread_mutex_unlock(&f->mu);
    for (int i = 0;; i++) {
        pthread_mutex_lock(&f->mu); /* members may join meanwhile (regroup): f->m moves */
        if (i >= f->n) {
            pthread_mutex_unlock(&f->mu);
            return;
        }
        member *m = f->m[i];
        double now = now_s();
        bool ask = (!m->have_info || m->check || again) && !m->retired && now >= m->down_until &&
                   now >= m->asked_at + (m->have_info ? 0 : REPROBE_S);
        if (ask) m->asked_at = now;
        pthread_mutex_unlock(&f->mu);
        if (!ask) continue;
        moedc_model_info info;
        moedc_error err;
        moedc_reconnect_now(m->c, CONNECT_S); /* a real attempt, not a failure gRPC remembers */
        int rc = moedc_info_within(m->c, PROBE_TIMEOUT_S, &info, &err);
        pthread_mutex_lock(&f->mu);
        const bool first = !m->heard;
        m->heard = true;
        if (rc) {
            snprintf(m->error, sizeof m->error, "%s: %.160s",
                     moedc_grpc_status_name(moedc_code_to_grpc(rc)), err.msg);
            mark_down(m, now_s());
            if (first && !f->fingerprint) replan(f); /* it may be the last one the model waits on */
        } else {
            learnt(f, m, &info);
        }
        pthread_mutex_unlock(&f->mu);
    }
}

/* ---- opening, regrouping, closing ---- */

/* Opens a member for target, an address of dns: name `name` (or NULL), as the fleet's last
 * (under f->mu once the fleet is shared). */
static int add_member(moedc_fleet *f, const char *target, const char *name, moedc_error *err)
{
    member **grown = realloc(f->m, sizeof *grown * (size_t)(f->n + 1));
    if (!grown) return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a fleet");
    f->m = grown;
    member *m = calloc(1, sizeof *m);
    if (!m || !(m->target = strdup(target)) || (name && !(m->name = strdup(name)))) {
        if (m) free(m->target);
        free(m);
        return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a fleet");
    }
    snprintf(m->error, sizeof m->error, "not asked yet");
    moedc_opts o = f->opts;
    char host[256], port[16];
    if (name && !o.tls_server_name && dns_host_port(name, host, sizeof host, port, sizeof port))
        o.tls_server_name = host; /* TLS checks the name the address came from */
    int rc = moedc_connect(m->target, &o, &m->c, err);
    if (rc) {
        free(m->target);
        free(m->name);
        free(m);
        return rc;
    }
    f->m[f->n++] = m;
    return 0;
}

/* The caller's options, their strings copied: members may join after the call returns. */
static int keep_opts(moedc_fleet *f, const moedc_opts *opts, moedc_error *err)
{
    f->opts = *opts;
    const char **s[5] = { &f->opts.bearer_token, &f->opts.tls_ca, &f->opts.tls_cert,
                          &f->opts.tls_key, &f->opts.tls_server_name };
    for (int i = 0; i < 5; i++) {
        if (!*s[i]) continue;
        if (!(f->owned[i] = strdup(*s[i])))
            return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a fleet");
        *s[i] = f->owned[i];
    }
    return 0;
}

/* One member per daemon target names (each address of a dns: name that has several). */
static int add_target(moedc_fleet *f, const char *target, moedc_error *err)
{
    char **list;
    int k = expand_all(&target, 1, &list), rc = 0;
    if (k < 0) return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a fleet");
    for (int i = 0; i < k && !rc; i++)
        rc = add_member(f, list[i], strcmp(list[i], target) ? target : NULL, err);
    free_list(list, k);
    if (rc || strncmp(target, "dns:", 4)) return rc;
    char **grown = realloc(f->names, sizeof *grown * (size_t)(f->n_names + 1));
    if (!grown || !(grown[f->n_names] = strdup(target))) {
        if (grown) f->names = grown;
        return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a fleet");
    }
    f->names = grown;
    f->n_names++;
    return 0;
}

int moedc_fleet_open(const char *const *targets, int n, const moedc_opts *opts, moedc_fleet **out,
                     moedc_error *err)
{
    static const moedc_opts none;
    *out = NULL;
    moedc_fleet *f = calloc(1, sizeof *f);
    if (!f) return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a fleet");
    pthread_mutex_init(&f->mu, NULL);
    f->timeout_s = opts ? opts->timeout_s : 0;
    f->resolved_at = now_s();
    int rc = keep_opts(f, opts ? opts : &none, err);
    for (int i = 0; i < n && !rc && f->n < MAX_MEMBERS; i++) rc = add_target(f, targets[i], err);
    if (!rc) learn(f);
    pthread_mutex_lock(&f->mu);
    for (int i = 0; !rc && i < f->n_plans; i++)
        if (f->plans[i].rc == MOEDC_EPRECOND || f->plans[i].rc == MOEDC_ENOMEM)
            rc = moedc_fail(err, f->plans[i].rc, "%s", f->plans[i].msg);
    pthread_mutex_unlock(&f->mu);
    if (rc) {
        moedc_fleet_close(f);
        return rc;
    }
    *out = f;
    return 0;
}

/* What dns: name `name` resolves to now (a list of k targets): members for the new addresses, its
 * members not among them retired (under f->mu). True when anything changed. */
static bool regroup_name(moedc_fleet *f, const char *name, char **list, int k)
{
    bool changed = false;
    moedc_error err;
    for (int i = 0; i < k; i++) {
        bool have = false;
        for (int j = 0; j < f->n && !have; j++)
            have = !f->m[j]->retired && !strcmp(f->m[j]->target, list[i]);
        if (!have && f->n < MAX_MEMBERS &&
            !add_member(f, list[i], strcmp(list[i], name) ? name : NULL, &err))
            changed = true;
    }
    for (int j = 0; j < f->n; j++) {
        member *m = f->m[j];
        bool listed = false;
        for (int i = 0; i < k && !listed; i++) listed = !strcmp(m->target, list[i]);
        if (m->name && !strcmp(m->name, name) && !m->retired && !listed) {
            m->retired = true;
            changed = true;
        }
    }
    return changed;
}

/* The dns: names resolved again, at most every RESOLVE_EVERY_S: daemons behind a name may come
 * back at new addresses. True when the fleet changed (its plans are rebuilt). */
static bool regroup(moedc_fleet *f)
{
    pthread_mutex_lock(&f->mu);
    const double now = now_s();
    const bool due = f->n_names && now >= f->resolved_at + RESOLVE_EVERY_S;
    if (due) f->resolved_at = now;
    pthread_mutex_unlock(&f->mu);
    bool changed = false;
    for (int i = 0; due && i < f->n_names; i++) {
        char **list;
        int k = expand_all((const char *const *)&f->names[i], 1, &list);
        if (k < 0) continue;
        pthread_mutex_lock(&f->mu);
        changed |= regroup_name(f, f->names[i], list, k);
        pthread_mutex_unlock(&f->mu);
        free_list(list, k);
    }
    if (changed) {
        pthread_mutex_lock(&f->mu);
        replan(f);
        pthread_mutex_unlock(&f->mu);
    }
    return changed;
}

void moedc_fleet_close(moedc_fleet *f)
{
    if (!f) return;
    for (int i = 0; i < f->n_plans; i++) plan_free(&f->plans[i]);
    free(f->plans);
    for (int i = 0; i < f->n; i++) {
        moedc_close(f->m[i]->c);
        if (f->m[i]->have_info) moedc_model_info_free(&f->m[i]->info);
        free(f->m[i]->target);
        free(f->m[i]->name);
        free(f->m[i]);
    }
    free(f->m);
    free_list(f->names, f->n_names);
    for (int i = 0; i < 5; i++) free(f->owned[i]);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

/* ---- calls ---- */

/* The replica for the next attempt of part p (under f->mu): not tried in this call, not to be
 * asked GetModel first, not passed over if another is not, fewest calls outstanding (ties in
 * turn); -1 when none is left. */
static int pick(const moedc_fleet *f, const moedc_part *p)
{
    const double now = now_s();
    int best = -1;
    for (int down_too = 0; down_too < 2 && best < 0; down_too++)
        for (int j = 0; j < p->n_replicas; j++) {
            const int at = (int)((p->turn + (unsigned)j) % (unsigned)p->n_replicas);
            const member *m = f->m[p->replicas[at]];
            if (p->tried[at] || m->check || !layer_of(m, p->layer) ||
                (!down_too && m->down_until > now))
                continue;
            if (best < 0 || m->outstanding < f->m[p->replicas[best]]->outstanding) best = at;
        }
    return best;
}

/* Starts part p's next attempt (under f->mu): 0, MOEDC_EUNAVAIL when no replica is left, or the
 * start's own failure (err filled). */
static int start_part(moedc_fleet_call *fc, moedc_part *p, moedc_error *err)
{
    moedc_fleet *f = fc->f;
    const int at = pick(f, p);
    if (at < 0) return MOEDC_EUNAVAIL;
    const int i = p->replicas[at];
    p->tried[at] = 1;
    moedc_request req = fc->req;
    if (fc->deadline) {
        const double left = fc->deadline - now_s();
        req.timeout_s = left > 1e-3 ? left : 1e-3;
    }
    int rc = moedc_forward_start_part(f->m[i]->c, &req, &p->expect, fc->q, p, &p->sub, err);
    if (rc) return rc;
    p->member = i;
    f->m[i]->outstanding++;
    return 0;
}

/* The part's shard ran out of replicas: an error naming them and what each said; when one refused
 * the call (it is not what the fleet took it for), FAILED_PRECONDITION. */
static int exhausted(const moedc_fleet_call *fc, const moedc_part *p, moedc_error *err)
{
    char said[480] = "";
    for (int j = 0; j < p->n_replicas; j++) {
        const member *m = fc->f->m[p->replicas[j]];
        append(said, sizeof said, "%s%s (%s)", j ? "; " : "", m->target, m->error);
    }
    if (p->refused)
        return moedc_fail(err, MOEDC_EPRECOND, "%s: no replica is what the fleet took it for: %s",
                          p->what, said);
    return moedc_fail(err, MOEDC_EUNAVAIL, "%s: no replica answered: %s", p->what, said);
}

/* The call failed (under f->mu): its other parts' attempts are cancelled. */
static void fail_call(moedc_fleet_call *fc, int rc, const moedc_error *err)
{
    if (fc->rc) return;
    fc->rc = rc;
    fc->err = *err;
    for (int i = 0; i < fc->n_parts; i++)
        if (fc->parts[i].sub) moedc_call_cancel(fc->parts[i].sub);
}

moedc_call *moedc_fleet_part_done(moedc_call *sub, moedc_part *p)
{
    moedc_fleet_call *fc = p->fc;
    moedc_fleet *f = fc->f;
    moedc_result res;
    moedc_error err;
    pthread_mutex_lock(&f->mu);
    p->sub = NULL; /* before it is freed: cancelling goes through p->sub under the mutex */
    pthread_mutex_unlock(&f->mu);
    int rc = moedc_call_finish(sub, &res, &err);
    pthread_mutex_lock(&f->mu);
    member *m = f->m[p->member];
    m->outstanding--;
    if (!rc) {
        m->down_for = 0;
        p->res = res;
        p->done = true;
    } else if (rc == MOEDC_EUNAVAIL || rc == MOEDC_EPRECOND) {
        /* unreachable or draining: passed over a while; refused (the daemon is not what the fleet
         * took it for): never added up. Either way its GetModel is asked before it is used again */
        snprintf(m->error, sizeof m->error, "%s: %.330s",
                 rc == MOEDC_EUNAVAIL ? "UNAVAILABLE" : "FAILED_PRECONDITION", err.msg);
        m->check = true;
        if (rc == MOEDC_EUNAVAIL) mark_down(m, now_s());
        p->refused |= rc == MOEDC_EPRECOND;
        int next = fc->rc ? MOEDC_ECANCELLED : start_part(fc, p, &err);
        if (!next) {
            pthread_mutex_unlock(&f->mu);
            return NULL; /* the part goes on on another replica */
        }
        if (next == MOEDC_EUNAVAIL) next = exhausted(fc, p, &err);
        if (next != MOEDC_ECANCELLED) fail_call(fc, next, &err);
    } else {
        fail_call(fc, rc, &err);
    }
    const bool last = --fc->pending == 0;
    pthread_mutex_unlock(&f->mu);
    return last ? fc->handle : NULL;
}

static void call_free(moedc_fleet_call *fc)
{
    for (int i = 0; fc->parts && i < fc->n_parts; i++) {
        moedc_result_free(&fc->parts[i].res);
        free(fc->parts[i].replicas);
        free(fc->parts[i].tried);
        free(fc->parts[i].held);
    }
    free(fc->parts);
    free(fc->ids);
    free(fc->weights);
    free(fc->lg);
    free(fc->request_id);
    if (fc->handle) moedc_call_free_handle(fc->handle);
    free(fc);
}

/* A copy of n bytes at p (NULL stays NULL); false when out of memory. */
static bool copy_of(const void *p, size_t n, void **out)
{
    *out = NULL;
    if (!p) return true;
    if (!(*out = malloc(n ? n : 1))) return false;
    memcpy(*out, p, n);
    return true;
}

/* The request kept for the attempts to come: its routing tensors copied, its deadline fixed. */
static int keep_request(moedc_fleet_call *fc, const moedc_request *req, moedc_error *err)
{
    fc->req = *req;
    const size_t T = req->tokens > 0 ? (size_t)req->tokens : 0;
    const size_t pairs = req->routing == MOEDC_ROUTE_EXPERTS && req->k > 0 ? T * (size_t)req->k : 0;
    const size_t lg =
        req->routing == MOEDC_ROUTE_LOGITS && req->n_experts > 0 ? T * (size_t)req->n_experts : 0;
    bool ok = copy_of(pairs ? req->expert_ids : NULL, pairs * 4, &fc->ids) &&
              copy_of(pairs ? req->expert_weights : NULL, pairs * 4, &fc->weights) &&
              copy_of(lg ? req->logits : NULL, lg * 4, &fc->lg) &&
              (!req->request_id || (fc->request_id = strdup(req->request_id)));
    if (!ok) return moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    fc->req.expert_ids = fc->ids;
    fc->req.expert_weights = fc->weights;
    fc->req.logits = fc->lg;
    fc->req.request_id = fc->request_id;
    const double t = req->timeout_s == 0 ? fc->f->timeout_s : req->timeout_s;
    fc->deadline = t > 0 ? now_s() + t : 0;
    return 0;
}

/* One part per shard of the plan (under f->mu). */
static int make_parts(moedc_fleet_call *fc, plan *pl, moedc_error *err)
{
    fc->parts = calloc((size_t)pl->n_shards, sizeof *fc->parts);
    if (!fc->parts) return moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    for (int s = 0; s < pl->n_shards; s++) {
        shard *sh = &pl->shards[s];
        moedc_part *p = &fc->parts[fc->n_parts++];
        char r[120];
        ranges_text(sh->li->held, sh->li->n_held, r, sizeof r);
        snprintf(p->what, sizeof p->what, "layer %d: experts %s", pl->layer, r);
        p->fc = fc;
        p->layer = pl->layer;
        p->replicas = malloc(sizeof *p->replicas * (size_t)sh->n_replicas);
        p->tried = calloc((size_t)sh->n_replicas, 1);
        p->held = malloc(sizeof *p->held * (size_t)sh->li->n_held);
        if (!p->replicas || !p->tried || !p->held)
            return moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
        memcpy(p->replicas, sh->replicas, sizeof *p->replicas * (size_t)sh->n_replicas);
        memcpy(p->held, sh->li->held, sizeof *p->held * (size_t)sh->li->n_held);
        p->expect = (moedc_expect){ .fingerprint = fc->f->agreed,
                                    .held = p->held,
                                    .n_held = sh->li->n_held,
                                    .adds_shared = sh->li->adds_shared };
        p->n_replicas = sh->n_replicas;
        p->turn = sh->turn++;
    }
    return 0;
}

/* Forgets the parts of a call none of whose parts started (under f->mu). */
static void reset_parts(moedc_fleet_call *fc)
{
    for (int i = 0; i < fc->n_parts; i++) {
        free(fc->parts[i].replicas);
        free(fc->parts[i].tried);
        free(fc->parts[i].held);
    }
    free(fc->parts);
    fc->parts = NULL;
    fc->n_parts = 0;
    fc->rc = 0;
}

/* Plans the call and starts its parts (under f->mu). */
static int start_call(moedc_fleet_call *fc, moedc_error *err)
{
    moedc_fleet *f = fc->f;
    plan none;
    plan *pl = plan_for(f, (int)fc->req.layer, &none);
    if (pl->rc) return moedc_fail(err, pl->rc, "%s", pl->msg);
    if (fc->req.batch_gating && pl->n_shards > 1)
        return moedc_fail(err, MOEDC_EPRECOND,
                          "batch_gating needs one daemon holding every expert of layer %d, but "
                          "this fleet splits them over %d shards: the expert set would be chosen "
                          "over a different merged batch on each",
                          pl->layer, pl->n_shards);
    int rc = make_parts(fc, pl, err);
    for (int i = 0; !rc && i < fc->n_parts; i++) /* every shard has a replica, or none starts */
        if (pick(f, &fc->parts[i]) < 0) rc = exhausted(fc, &fc->parts[i], err);
    for (int i = 0; !rc && i < fc->n_parts; i++) {
        rc = start_part(fc, &fc->parts[i], err);
        if (rc == MOEDC_EUNAVAIL) exhausted(fc, &fc->parts[i], err);
        if (!rc) fc->pending++;
    }
    if (rc) /* the parts started are cancelled, and collected before the handle comes back */
        fail_call(fc, rc, err);
    return rc;
}

/* When the next member that might answer where none does now is due to be asked GetModel again
 * (learn's schedule, or the recheck of a fleet whose plans fail); 0: none is. */
static double next_chance(moedc_fleet *f)
{
    pthread_mutex_lock(&f->mu);
    double at = f->recheck_at;
    for (int i = 0; i < f->n; i++) {
        const member *m = f->m[i];
        if (m->retired || m->foreign || (m->have_info && !m->check)) continue;
        double t = m->have_info ? m->down_until : m->asked_at + REPROBE_S;
        if (t < m->down_until) t = m->down_until;
        if (!at || t < at) at = t;
    }
    pthread_mutex_unlock(&f->mu);
    return at;
}

/* A call that found no daemon to try waits for the next one due to be asked again (within its
 * deadline): it fails after a real attempt, not as fast as its caller can call. False when there
 * is none to wait for, or the deadline comes first (then it has waited for the deadline). */
static bool wait_for_chance(moedc_fleet *f, double deadline)
{
    const double at = next_chance(f);
    if (!at) return false;
    const double until = deadline && deadline < at ? deadline : at, left = until - now_s();
    if (left > 0) {
        struct timespec ts = { .tv_sec = (time_t)left,
                               .tv_nsec = (long)((left - (double)(time_t)left) * 1e9) };
        while (nanosleep(&ts, &ts) && errno == EINTR) {
        }
    }
    return until == at;
}

int moedc_fleet_forward_start(moedc_fleet *f, const moedc_request *req, moedc_queue *q, void *user,
                              moedc_call **out, moedc_error *err)
{
    moedc_fleet_call *fc = calloc(1, sizeof *fc);
    if (!fc) return moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    fc->f = f;
    fc->q = q;
    int rc = keep_request(fc, req, err);
    if (!rc && !(fc->handle = moedc_call_new_handle(user, fc)))
        rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    if (rc) {
        call_free(fc);
        return rc;
    }
    learn(f);
    pthread_mutex_lock(&f->mu);
    rc = start_call(fc, err);
    bool started = fc->pending > 0;
    pthread_mutex_unlock(&f->mu);
    /* once more, over who is there now: after the names were resolved again, or once a daemon
     * that might answer was asked again */
    if (rc == MOEDC_EUNAVAIL && !started && (regroup(f) || wait_for_chance(f, fc->deadline))) {
        learn(f);
        pthread_mutex_lock(&f->mu);
        reset_parts(fc);
        rc = start_call(fc, err);
        started = fc->pending > 0;
        pthread_mutex_unlock(&f->mu);
    }
    if (rc && !started) {
        call_free(fc);
        return rc;
    }
    /* with some parts started the call is the caller's: it finishes with the error */
    *out = fc->handle;
    return 0;
}

void moedc_fleet_cancel(moedc_call *handle)
{
    moedc_fleet_call *fc = moedc_call_fleet(handle);
    pthread_mutex_lock(&fc->f->mu);
    for (int i = 0; i < fc->n_parts; i++)
        if (fc->parts[i].sub) moedc_call_cancel(fc->parts[i].sub);
    pthread_mutex_unlock(&fc->f->mu);
}

/* The parts' outputs added in float32 in shard order, rounded once into the output of the part
 * with the slowest reply, whose result becomes the call's. */
static int add_parts(moedc_fleet_call *fc, moedc_result *res, moedc_error *err)
{
    int carrier = 0;
    for (int i = 1; i < fc->n_parts; i++)
        if (fc->parts[i].res.timings.total_us > fc->parts[carrier].res.timings.total_us)
            carrier = i;
    const int dt = fc->req.dtype;
    const size_t n = fc->parts[0].res.output_bytes / moed_dtype_size(dt);
    float *acc = malloc(sizeof *acc * SUM_CHUNK), *part = malloc(sizeof *part * SUM_CHUNK);
    if (!acc || !part) {
        free(acc);
        free(part);
        return moedc_fail(err, MOEDC_ENOMEM, "out of memory adding the shards' outputs");
    }
    void *out = (void *)fc->parts[carrier].res.output; /* the decoded reply's, which it owns */
    for (size_t at = 0; at < n; at += SUM_CHUNK) {
        const size_t m = n - at < SUM_CHUNK ? n - at : SUM_CHUNK;
        for (int i = 0; i < fc->n_parts; i++) {
            const char *src = (const char *)fc->parts[i].res.output + at * moed_dtype_size(dt);
            moed_to_f32(dt, src, i ? part : acc, m);
            for (size_t j = 0; i && j < m; j++) acc[j] += part[j];
        }
        moed_from_f32(dt, acc, (char *)out + at * moed_dtype_size(dt), m);
    }
    free(acc);
    free(part);
    *res = fc->parts[carrier].res;
    memset(&fc->parts[carrier].res, 0, sizeof *res);
    return 0;
}

int moedc_fleet_finish(moedc_call *handle, moedc_result *res, moedc_error *err)
{
    moedc_fleet_call *fc = moedc_call_fleet(handle);
    memset(res, 0, sizeof *res);
    int rc = fc->rc;
    if (rc) {
        if (err) *err = fc->err;
    } else if (fc->n_parts == 1) { /* one shard: its reply is the output, as from one daemon */
        *res = fc->parts[0].res;
        memset(&fc->parts[0].res, 0, sizeof *res);
    } else {
        rc = add_parts(fc, res, err);
    }
    call_free(fc);
    return rc;
}

/* ---- the fleet's model and health ---- */

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

/* The fleet's layers: each once, holding what the daemons that answered hold between them. */
static int merge_layers(const moedc_fleet *f, moedc_model_info *out)
{
    for (int i = 0; i < f->n; i++)
        for (int j = 0; f->m[i]->have_info && j < f->m[i]->info.n_layers; j++) {
            const moedc_layer_info *li = &f->m[i]->info.layers[j];
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
                out->layers[k].home_device = 0;
                out->layers[k].adds_shared = true;
            }
            for (int r = 0; r < li->n_held; r++)
                if (!add_range(&out->layers[k], li->held[r].first, li->held[r].last))
                    return MOEDC_ENOMEM;
        }
    return 0;
}

static int merge_info(const moedc_fleet *f, const moedc_model_info *first, moedc_model_info *out)
{
    out->model = strdup(first->model);
    out->backend = strdup(first->backend);
    out->version = strdup(first->version);
    out->max_message_bytes = first->max_message_bytes;
    out->max_batch_tokens = first->max_batch_tokens;
    if (!out->model || !out->backend || !out->version) return MOEDC_ENOMEM;
    for (int i = 0; i < f->n; i++) {
        const moedc_model_info *m = &f->m[i]->info;
        if (!f->m[i]->have_info) continue;
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
    return merge_layers(f, out);
}

int moedc_fleet_info(moedc_fleet *f, moedc_model_info *out, moedc_error *err)
{
    learn(f);
    pthread_mutex_lock(&f->mu);
    const moedc_model_info *first = NULL;
    for (int i = 0; i < f->n && !first; i++)
        if (f->m[i]->have_info) first = &f->m[i]->info;
    int rc = 0;
    if (!first) {
        char text[400];
        members_text(f, text, sizeof text);
        rc = moedc_fail(err, MOEDC_EUNAVAIL, "no daemon of the fleet answered GetModel: %s", text);
    } else if (merge_info(f, first, out)) {
        rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory merging the fleet's ModelInfo");
    }
    pthread_mutex_unlock(&f->mu);
    if (rc) moedc_model_info_free(out);
    return rc;
}

int moedc_fleet_health(moedc_fleet *f, const char *service, int *status, moedc_error *err)
{
    learn(f);
    pthread_mutex_lock(&f->mu);
    const int n = f->n;
    int *serving = calloc((size_t)n, sizeof *serving);
    moedc **c = calloc((size_t)n, sizeof *c);
    for (int i = 0; serving && c && i < n; i++) c[i] = f->m[i]->c;
    pthread_mutex_unlock(&f->mu);
    if (!serving || !c) {
        free(serving);
        free(c);
        return moedc_fail(err, MOEDC_ENOMEM, "out of memory");
    }
    for (int i = 0; i < n; i++) {
        int st;
        moedc_error e;
        serving[i] = !moedc_health_within(c[i], service, PROBE_TIMEOUT_S, &st, &e) &&
                     st == MOEDC_HEALTH_SERVING;
    }
    free(c);
    pthread_mutex_lock(&f->mu);
    bool ok = f->n_plans > 0;
    for (int i = 0; i < f->n_plans && ok; i++) {
        const plan *p = &f->plans[i];
        ok = !p->rc;
        for (int s = 0; ok && s < p->n_shards; s++) {
            bool any = false;
            for (int r = 0; r < p->shards[s].n_replicas; r++) /* those that joined since: no */
                any = any || (p->shards[s].replicas[r] < n && serving[p->shards[s].replicas[r]]);
            ok = any;
        }
    }
    pthread_mutex_unlock(&f->mu);
    free(serving);
    *status = ok ? MOEDC_HEALTH_SERVING : MOEDC_HEALTH_NOT_SERVING;
    return 0;
}
