/*
 * moedc_fleet — a moedc over several daemons (moedc_connect_many in moedclient.h says what a fleet
 * does): its I/O. The targets and the addresses of their dns: names, one moedc per daemon, GetModel
 * asked when the planner (moedc_plan.h) says, and Forward calls fanned out over the shards as it
 * plans them. A fleet is a moedc_impl.h implementation, and drives its daemons' moedcs through
 * that table and the public calls only.
 *
 * A Forward over a fleet is a fleet call (the caller's handle) and one sub-call per shard that gets
 * tokens (where the client chose the experts, only those with a term on the shard:
 * moedc_plan_rows), started with a done function: the thread that collects a sub-call from the
 * queue runs part_done, which starts another replica or records the part, and hands over the fleet
 * call once every part is in; the caller never sees a sub-call. Every sub-call states what its part
 * expects of the daemon (the fleet's model, the shard's experts), so a part's reply is only ever
 * one the plan it was made from accounts for: the sum is right whatever changed since, and a daemon
 * that changed refuses instead.
 *
 * Locking: one mutex over the planner (the members' state, the plans) and the fleet calls'
 * bookkeeping. It is never held across a wait: GetModel is asked with it released, and a sub-call
 * is started under it (starting only queues a batch), so its completion, which takes the mutex
 * too, always finds the part knowing its sub-call. A fleet call copies what it needs of its shards
 * when it starts.
 */
#include "moedc_common.h"
#include "moedc_impl.h"
#include "moedc_plan.h"

#include "moed_dtype.h"
#include "moed_time.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef struct member {
    moedc_member pl; /* first: the planner's array points here */
    moedc *c;
} member;

typedef struct fleet {
    moedc base;
    pthread_mutex_t mu;
    moedc_planner p;
    char **names; /* the "dns:" targets, resolved again when a shard has no daemon answering */
    int n_names;
    double resolved_at;
    moedc_opts opts; /* for members that join later; its strings are owned copies */
    char *owned[5];
} fleet;

typedef struct fleet_call fleet_call;

/* One shard's part of a call. */
typedef struct part {
    fleet_call *fc;
    int layer;
    int *replicas;
    int n_replicas;
    unsigned turn; /* where the replicas' rotation starts for this call */
    unsigned char *tried;
    int member;               /* of the attempt in flight */
    moedc_call *sub;          /* the attempt in flight, or NULL */
    moedc_expect expect;      /* what each attempt states it expects of its daemon */
    moedc_expert_range *held; /* expect's ranges (the shard's, copied) */
    /* What it sends: the call's request, or, where the client chose the experts, only the tokens
     * the shard has terms for (moedc_plan_rows): rows lists them (NULL: every token), and the
     * request carries copies of those rows of hidden, ids and weights. */
    moedc_request req;
    int64_t *rows, n_rows;
    void *hidden, *ids, *weights;
    bool idle;    /* it gets no token: no call */
    bool refused; /* a replica refused it: it is not what the fleet took it for */
    moedc_result res;
    bool done;
} part;

struct fleet_call {
    moedc_call base;
    fleet *f;
    moedc_queue *q;
    moedc_request req;        /* the caller's, its routing tensors copied (the start copies) */
    void *ids, *weights, *lg; /* those copies */
    char *request_id;
    double deadline; /* monotonic seconds; 0: none */
    part *parts;
    int n_parts, pending;
    int rc; /* the first failure */
    moedc_error err;
};

static const moedc_ops fleet_ops;

static member *member_at(const fleet *f, int i)
{
    return (member *)f->p.m[i];
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
        for (struct addrinfo *a = ai; a && n + added < MOEDC_PLAN_MAX_MEMBERS; a = a->ai_next) {
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

/* Whether these targets are a fleet (several, or a name of several). */
static bool wanted(const char *const *targets, int n)
{
    if (n != 1) return n > 1;
    char **list;
    int k = expand_all(targets, n, &list);
    free_list(list, k);
    return k > 1;
}

/* ---- learning what the daemons hold ---- */

/* Asks GetModel of the members the planner says to ask (never answered, turned a call away since,
 * or any while a plan fails and its time came), and tells it what they answered. */
static void learn(fleet *f)
{
    pthread_mutex_lock(&f->mu);
    const bool again = moedc_plan_recheck_due(&f->p, moed_now_s());
    pthread_mutex_unlock(&f->mu);
    for (int i = 0;; i++) {
        pthread_mutex_lock(&f->mu); /* members may join meanwhile (regroup): the array moves */
        if (i >= f->p.n) {
            pthread_mutex_unlock(&f->mu);
            return;
        }
        member *m = member_at(f, i);
        const double now = moed_now_s();
        const bool ask = moedc_plan_to_ask(&m->pl, again, now);
        if (ask) m->pl.asked_at = now;
        pthread_mutex_unlock(&f->mu);
        if (!ask) continue;
        moedc_model_info info;
        moedc_error err;
        memset(&info, 0, sizeof info);
        /* a real attempt, not a failure the connection remembers */
        if (m->c->ops->reconnect) m->c->ops->reconnect(m->c, MOEDC_PLAN_CONNECT_S);
        int rc = m->c->ops->info(m->c, MOEDC_PLAN_PROBE_TIMEOUT_S, &info, &err);
        if (!rc && info.is_loading) { /* it serves nothing yet: as a daemon not up */
            rc = moedc_fail(&err, MOEDC_EUNAVAIL, "loading its weights (%s, %.0f%%)",
                            info.loading.phase, info.loading.percent);
            moedc_model_info_free(&info);
        }
        pthread_mutex_lock(&f->mu);
        if (rc) {
            char why[200];
            snprintf(why, sizeof why, "%s: %.160s", moedc_grpc_status_name(moedc_code_to_grpc(rc)),
                     err.msg);
            moedc_plan_unanswered(&f->p, &m->pl, why, moed_now_s());
        } else {
            moedc_plan_learnt(&f->p, &m->pl, &info, moed_now_s());
        }
        pthread_mutex_unlock(&f->mu);
    }
}

/* ---- opening, regrouping, closing ---- */

/* Opens a member for target, an address of dns: name `name` (or NULL), as the fleet's last
 * (under f->mu once the fleet is shared). */
static int add_member(fleet *f, const char *target, const char *name, moedc_error *err)
{
    member *m = calloc(1, sizeof *m);
    if (!m || !(m->pl.target = strdup(target)) || (name && !(m->pl.name = strdup(name)))) {
        if (m) moedc_member_release(&m->pl);
        free(m);
        return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a fleet");
    }
    moedc_opts o = f->opts;
    char host[256], port[16];
    if (name && !o.tls_server_name && dns_host_port(name, host, sizeof host, port, sizeof port))
        o.tls_server_name = host; /* TLS checks the name the address came from */
    int rc = moedc_connect(m->pl.target, &o, &m->c, err);
    if (!rc && moedc_plan_add(&f->p, &m->pl)) {
        moedc_close(m->c);
        rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a fleet");
    }
    if (rc) {
        moedc_member_release(&m->pl);
        free(m);
    }
    return rc;
}

/* The caller's options, their strings copied: members may join after the call returns. */
static int keep_opts(fleet *f, const moedc_opts *opts, moedc_error *err)
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
static int add_target(fleet *f, const char *target, moedc_error *err)
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

static void fleet_close(moedc *c)
{
    fleet *f = (fleet *)c;
    for (int i = 0; i < f->p.n; i++) {
        member *m = member_at(f, i);
        moedc_close(m->c);
        moedc_member_release(&m->pl);
        free(m);
    }
    moedc_plan_close(&f->p);
    free_list(f->names, f->n_names);
    for (int i = 0; i < 5; i++) free(f->owned[i]);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

int moedc_connect_many(const char *const *targets, int n, const moedc_opts *opts, moedc **out,
                       moedc_error *err)
{
    static const moedc_opts none;
    *out = NULL;
    if (!targets || n < 1)
        return moedc_fail(err, MOEDC_EINVAL, "no server address given (e.g. 127.0.0.1:50051)");
    if (!wanted(targets, n)) return moedc_connect(targets[0], opts, out, err);
    fleet *f = calloc(1, sizeof *f);
    if (!f) return moedc_fail(err, MOEDC_ENOMEM, "out of memory opening a fleet");
    if (!opts) opts = &none;
    f->base = (moedc){ .ops = &fleet_ops, .timeout_s = opts->timeout_s };
    pthread_mutex_init(&f->mu, NULL);
    f->resolved_at = moed_now_s();
    int rc = keep_opts(f, opts, err);
    for (int i = 0; i < n && !rc && f->p.n < MOEDC_PLAN_MAX_MEMBERS; i++)
        rc = add_target(f, targets[i], err);
    if (!rc) learn(f);
    for (int i = 0; !rc && i < f->p.n_plans; i++) /* learnt: the fleet is not shared yet */
        if (f->p.plans[i].rc == MOEDC_EPRECOND || f->p.plans[i].rc == MOEDC_ENOMEM)
            rc = moedc_fail(err, f->p.plans[i].rc, "%s", f->p.plans[i].msg);
    if (rc) {
        fleet_close(&f->base);
        return rc;
    }
    *out = &f->base;
    return 0;
}

/* What dns: name `name` resolves to now (a list of k targets): members for the new addresses, its
 * members not among them retired (under f->mu). True when anything changed. */
static bool regroup_name(fleet *f, const char *name, char **list, int k)
{
    bool changed = false;
    moedc_error err;
    for (int i = 0; i < k; i++) {
        bool have = false;
        for (int j = 0; j < f->p.n && !have; j++)
            have = !f->p.m[j]->retired && !strcmp(f->p.m[j]->target, list[i]);
        if (!have && f->p.n < MOEDC_PLAN_MAX_MEMBERS &&
            !add_member(f, list[i], strcmp(list[i], name) ? name : NULL, &err))
            changed = true;
    }
    for (int j = 0; j < f->p.n; j++) {
        moedc_member *m = f->p.m[j];
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
static bool regroup(fleet *f)
{
    pthread_mutex_lock(&f->mu);
    const double now = moed_now_s();
    const bool due = f->n_names && now >= f->resolved_at + MOEDC_PLAN_RESOLVE_EVERY_S;
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
        moedc_plan_rebuild(&f->p, moed_now_s());
        pthread_mutex_unlock(&f->mu);
    }
    return changed;
}

/* ---- calls ---- */

static int pick(const fleet *f, const part *p)
{
    return moedc_plan_pick(&f->p, p->layer, &p->expect, p->replicas, p->n_replicas, p->tried,
                           p->turn, moed_now_s());
}

static int exhausted(const fleet_call *fc, const part *p, moedc_error *err)
{
    return moedc_plan_exhausted(&fc->f->p, p->layer, &p->expect, p->replicas, p->n_replicas,
                                p->refused, err);
}

static moedc_call *part_done(moedc_call *sub, void *arg);

/* Starts part p's next attempt (under f->mu): 0, MOEDC_EUNAVAIL when no replica is left, or the
 * start's own failure (err filled). */
static int start_part(fleet_call *fc, part *p, moedc_error *err)
{
    fleet *f = fc->f;
    const int at = pick(f, p);
    if (at < 0) return MOEDC_EUNAVAIL;
    const int i = p->replicas[at];
    member *m = member_at(f, i);
    p->tried[at] = 1;
    moedc_request req = p->req;
    if (fc->deadline) {
        const double left = fc->deadline - moed_now_s();
        req.timeout_s = left > 1e-3 ? left : 1e-3;
    }
    const moedc_start how = { .expect = &p->expect, .done = part_done, .done_arg = p };
    p->sub = NULL;
    int rc = m->c->ops->forward_start(m->c, &req, &how, fc->q, &p->sub, err);
    if (rc) return rc;
    p->member = i;
    m->pl.outstanding++;
    return 0;
}

/* The call failed (under f->mu): its other parts' attempts are cancelled. */
static void fail_call(fleet_call *fc, int rc, const moedc_error *err)
{
    if (fc->rc) return;
    fc->rc = rc;
    fc->err = *err;
    for (int i = 0; i < fc->n_parts; i++)
        if (fc->parts[i].sub) moedc_call_cancel(fc->parts[i].sub);
}

/* A sub-call of part p finished (collected from the queue it was started on): returns the fleet
 * call when this was the last part outstanding, else NULL. */
static moedc_call *part_done(moedc_call *sub, void *arg)
{
    part *p = arg;
    fleet_call *fc = p->fc;
    fleet *f = fc->f;
    moedc_result res;
    moedc_error err;
    pthread_mutex_lock(&f->mu);
    p->sub = NULL; /* before it is freed: cancelling goes through p->sub under the mutex */
    pthread_mutex_unlock(&f->mu);
    int rc = moedc_call_finish(sub, &res, &err);
    pthread_mutex_lock(&f->mu);
    const bool next_replica =
        moedc_plan_done(&member_at(f, p->member)->pl, rc, err.msg, moed_now_s());
    if (!rc) {
        p->res = res;
        p->done = true;
    } else if (next_replica) {
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
    return last ? &fc->base : NULL;
}

/* Forgets the parts of a call (none of them in flight). */
static void free_parts(fleet_call *fc)
{
    for (int i = 0; fc->parts && i < fc->n_parts; i++) {
        moedc_result_free(&fc->parts[i].res);
        free(fc->parts[i].replicas);
        free(fc->parts[i].tried);
        free(fc->parts[i].held);
        free(fc->parts[i].rows);
        free(fc->parts[i].hidden);
        free(fc->parts[i].ids);
        free(fc->parts[i].weights);
    }
    free(fc->parts);
    fc->parts = NULL;
    fc->n_parts = 0;
    fc->rc = 0;
}

static void call_free(fleet_call *fc)
{
    free_parts(fc);
    free(fc->ids);
    free(fc->weights);
    free(fc->lg);
    free(fc->request_id);
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
static int keep_request(fleet_call *fc, const moedc_request *req, moedc_error *err)
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
    const double t = req->timeout_s == 0 ? fc->f->base.timeout_s : req->timeout_s;
    fc->deadline = t > 0 ? moed_now_s() + t : 0;
    return 0;
}

/* Whether the call's tokens may be sent to each shard apart: the client chose the experts, and
 * every tensor travels inline. */
static bool sliceable(const moedc_request *req)
{
    return req->routing == MOEDC_ROUTE_EXPERTS && req->tokens > 0 && req->k > 0 &&
           req->d_model > 0 && req->hidden && req->expert_ids && req->expert_weights &&
           (req->dtype == MOEDC_F32 || req->dtype == MOEDC_F16 || req->dtype == MOEDC_BF16) &&
           !req->hidden_at.region && !req->expert_ids_at.region && !req->expert_weights_at.region &&
           !req->output_at.region;
}

/* Copies rows[0..n-1] of the [*, cols] matrix at src (elements of size bytes) into a new array. */
static void *gather(const void *src, size_t cols, size_t size, const int64_t *rows, int64_t n)
{
    const size_t row = cols * size;
    char *out = malloc(row * (size_t)n);
    for (int64_t j = 0; out && j < n; j++)
        memcpy(out + row * (size_t)j, (const char *)src + row * (size_t)rows[j], row);
    return out;
}

/* Each part's tokens (moedc_plan_rows) and, for a part with some of them, its request for those
 * rows alone (under f->mu). */
static int slice_parts(fleet_call *fc, moedc_layer_plan *pl, moedc_error *err)
{
    const moedc_request *req = &fc->req;
    int64_t **rows = calloc((size_t)pl->n_shards, sizeof *rows),
            *n_rows = calloc((size_t)pl->n_shards, sizeof *n_rows);
    int rc = rows && n_rows ? moedc_plan_rows(pl, req->expert_ids, req->expert_weights, req->tokens,
                                              req->k, rows, n_rows, err)
                            : moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    for (int s = 0; !rc && s < fc->n_parts; s++) {
        part *p = &fc->parts[s];
        p->rows = rows[s];
        p->n_rows = n_rows[s];
        rows[s] = NULL;
        p->idle = !p->n_rows;
        if (p->n_rows == req->tokens) { /* every token: the call's own request */
            free(p->rows);
            p->rows = NULL;
        }
        if (!p->rows || p->idle) continue;
        const size_t size = moed_dtype_size(req->dtype), k = (size_t)req->k;
        p->hidden = gather(req->hidden, (size_t)req->d_model, size, p->rows, p->n_rows);
        p->ids = gather(req->expert_ids, k, sizeof(int32_t), p->rows, p->n_rows);
        p->weights = gather(req->expert_weights, k, sizeof(float), p->rows, p->n_rows);
        if (!p->hidden || !p->ids || !p->weights)
            rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
        p->req.tokens = p->n_rows;
        p->req.hidden = p->hidden;
        p->req.expert_ids = p->ids;
        p->req.expert_weights = p->weights;
    }
    for (int s = 0; rows && s < pl->n_shards; s++) free(rows[s]);
    free(rows);
    free(n_rows);
    return rc;
}

/* One part per shard of the plan (under f->mu). */
static int make_parts(fleet_call *fc, moedc_layer_plan *pl, moedc_error *err)
{
    fc->parts = calloc((size_t)pl->n_shards, sizeof *fc->parts);
    if (!fc->parts) return moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    for (int s = 0; s < pl->n_shards; s++) {
        moedc_shard *sh = &pl->shards[s];
        part *p = &fc->parts[fc->n_parts++];
        p->fc = fc;
        p->layer = pl->layer;
        p->replicas = malloc(sizeof *p->replicas * (size_t)sh->n_replicas);
        p->tried = calloc((size_t)sh->n_replicas, 1);
        p->held = malloc(sizeof *p->held * (size_t)sh->li->n_held);
        if (!p->replicas || !p->tried || !p->held)
            return moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
        memcpy(p->replicas, sh->replicas, sizeof *p->replicas * (size_t)sh->n_replicas);
        memcpy(p->held, sh->li->held, sizeof *p->held * (size_t)sh->li->n_held);
        p->expect = (moedc_expect){ .fingerprint = fc->f->p.agreed,
                                    .held = p->held,
                                    .n_held = sh->li->n_held,
                                    .adds_shared = sh->li->adds_shared };
        p->n_replicas = sh->n_replicas;
        p->turn = sh->turn++;
        p->req = fc->req;
    }
    return sliceable(&fc->req) ? slice_parts(fc, pl, err) : 0;
}

/* Plans the call and starts its parts (under f->mu). */
static int start_call(fleet_call *fc, moedc_error *err)
{
    fleet *f = fc->f;
    moedc_layer_plan none;
    moedc_layer_plan *pl = moedc_plan_for(&f->p, (int)fc->req.layer, &none);
    if (pl->rc) return moedc_fail(err, pl->rc, "%s", pl->msg);
    int rc = fc->req.batch_gating ? moedc_plan_batch_gating(&f->p, pl, err) : 0;
    if (!rc) rc = make_parts(fc, pl, err);
    /* every shard the call needs has a replica, or none starts */
    for (int i = 0; !rc && i < fc->n_parts; i++)
        if (!fc->parts[i].idle && pick(f, &fc->parts[i]) < 0)
            rc = exhausted(fc, &fc->parts[i], err);
    for (int i = 0; !rc && i < fc->n_parts; i++) {
        if (fc->parts[i].idle) continue;
        rc = start_part(fc, &fc->parts[i], err);
        if (rc == MOEDC_EUNAVAIL) exhausted(fc, &fc->parts[i], err);
        if (!rc) fc->pending++;
    }
    if (rc) /* the parts started are cancelled, and collected before the call comes back */
        fail_call(fc, rc, err);
    return rc;
}

/* A call that found no daemon to try waits for the next one due to be asked again (within its
 * deadline): it fails after a real attempt, not as fast as its caller can call. False when there
 * is none to wait for, or the deadline comes first (then it has waited for the deadline). */
static bool wait_for_chance(fleet *f, double deadline)
{
    pthread_mutex_lock(&f->mu);
    const double at = moedc_plan_next_chance(&f->p);
    pthread_mutex_unlock(&f->mu);
    if (!at) return false;
    const double until = deadline && deadline < at ? deadline : at, left = until - moed_now_s();
    moed_sleep_s(left);
    return until == at;
}

static int fleet_forward_start(moedc *c, const moedc_request *req, const moedc_start *how,
                               moedc_queue *q, moedc_call **out, moedc_error *err)
{
    fleet *f = (fleet *)c;
    if (how->expect)
        return moedc_fail(err, MOEDC_EINVAL,
                          "a fleet states what it expects of each of its daemons itself");
    fleet_call *fc = calloc(1, sizeof *fc);
    if (!fc) return moedc_fail(err, MOEDC_ENOMEM, "out of memory starting a call");
    fc->base = (moedc_call){
        .ops = &fleet_ops, .user = how->user, .done = how->done, .done_arg = how->done_arg
    };
    fc->f = f;
    fc->q = q;
    int rc = keep_request(fc, req, err);
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
        free_parts(fc);
        rc = start_call(fc, err);
        started = fc->pending > 0;
        pthread_mutex_unlock(&f->mu);
    }
    if (rc && !started) {
        call_free(fc);
        return rc;
    }
    /* with some parts started the call is the caller's: it finishes with the error */
    *out = &fc->base;
    return 0;
}

static void fleet_forward_cancel(moedc_call *call)
{
    fleet_call *fc = (fleet_call *)call;
    pthread_mutex_lock(&fc->f->mu);
    for (int i = 0; i < fc->n_parts; i++)
        if (fc->parts[i].sub) moedc_call_cancel(fc->parts[i].sub);
    pthread_mutex_unlock(&fc->f->mu);
}

/* The outputs of the parts that made a call added up (moedc_plan_sum), each over its tokens, into
 * the result of the part with the slowest reply, which becomes the call's: into its output when
 * that part got every token, else into an output of every token given to it. */
static int add_parts(fleet_call *fc, moedc_result *res, moedc_error *err)
{
    int carrier = -1, n = 0;
    for (int i = 0; i < fc->n_parts; i++)
        if (!fc->parts[i].idle && (carrier < 0 || fc->parts[i].res.timings.total_us >
                                                      fc->parts[carrier].res.timings.total_us))
            carrier = i;
    const void **outs = malloc(sizeof *outs * (size_t)fc->n_parts);
    const int64_t **rows = malloc(sizeof *rows * (size_t)fc->n_parts);
    int64_t *n_rows = malloc(sizeof *n_rows * (size_t)fc->n_parts);
    const size_t bytes =
        (size_t)fc->req.tokens * (size_t)fc->req.d_model * moed_dtype_size(fc->req.dtype);
    part *c = &fc->parts[carrier];
    /* the decoded reply's output, which the result owns */
    void *sum = c->rows ? malloc(bytes ? bytes : 1) : (void *)c->res.output;
    int rc = outs && rows && n_rows && sum
                 ? 0
                 : moedc_fail(err, MOEDC_ENOMEM, "out of memory adding the shards' outputs");
    for (int i = 0; !rc && i < fc->n_parts; i++) {
        if (fc->parts[i].idle) continue;
        outs[n] = fc->parts[i].res.output;
        rows[n] = fc->parts[i].rows;
        n_rows[n++] = fc->parts[i].n_rows;
    }
    if (!rc)
        rc = moedc_plan_sum(fc->req.dtype, outs, rows, n_rows, n, fc->req.tokens, fc->req.d_model,
                            sum, err);
    free(outs);
    free(rows);
    free(n_rows);
    if (c->rows) {
        if (rc)
            free(sum);
        else
            moedc_result_set_output(&c->res, sum, fc->req.tokens);
    }
    if (rc) return rc;
    *res = c->res;
    memset(&c->res, 0, sizeof *res);
    return 0;
}

static int fleet_forward_finish(moedc_call *call, moedc_result *res, moedc_error *err)
{
    fleet_call *fc = (fleet_call *)call;
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

/* ---- the fleet's model, health, and what it cannot do ---- */

static int fleet_info(moedc *c, double timeout_s, moedc_model_info *out, moedc_error *err)
{
    fleet *f = (fleet *)c;
    (void)timeout_s; /* each daemon's GetModel has its own bound, PROBE_TIMEOUT_S */
    learn(f);
    pthread_mutex_lock(&f->mu);
    int rc = moedc_plan_info(&f->p, out, err);
    pthread_mutex_unlock(&f->mu);
    return rc;
}

static int fleet_health(moedc *c, const char *service, double timeout_s, int *status,
                        moedc_error *err)
{
    fleet *f = (fleet *)c;
    (void)timeout_s; /* each daemon's answer has its own bound, PROBE_TIMEOUT_S */
    learn(f);
    pthread_mutex_lock(&f->mu);
    const int n = f->p.n;
    bool *serving = calloc((size_t)n, sizeof *serving);
    moedc **members = calloc((size_t)n, sizeof *members);
    for (int i = 0; serving && members && i < n; i++) members[i] = member_at(f, i)->c;
    pthread_mutex_unlock(&f->mu);
    if (!serving || !members) {
        free(serving);
        free(members);
        return moedc_fail(err, MOEDC_ENOMEM, "out of memory");
    }
    for (int i = 0; i < n; i++) {
        int st = MOEDC_HEALTH_UNKNOWN;
        moedc_error e;
        serving[i] =
            !members[i]->ops->health(members[i], service, MOEDC_PLAN_PROBE_TIMEOUT_S, &st, &e) &&
            st == MOEDC_HEALTH_SERVING;
    }
    free(members);
    pthread_mutex_lock(&f->mu);
    const bool ok = moedc_plan_serving(&f->p, serving, n); /* those that joined since: no */
    pthread_mutex_unlock(&f->mu);
    free(serving);
    *status = ok ? MOEDC_HEALTH_SERVING : MOEDC_HEALTH_NOT_SERVING;
    return 0;
}

static int fleet_list_regions(moedc *c, moedc_region_info **out, int *n, moedc_error *err)
{
    (void)c, (void)out, (void)n;
    return moedc_fail(err, MOEDC_EPRECOND,
                      "ListRegions asks one daemon; this moedc is a fleet of several: ask a member "
                      "by its own target");
}

static int fleet_session_open(moedc *c, moedc_session **out, moedc_error *err)
{
    (void)c, (void)out;
    return moedc_fail(err, MOEDC_EPRECOND,
                      "a region session needs one daemon on this host; this moedc is a fleet of "
                      "several (its calls carry their tensors inline)");
}

static int fleet_layout(moedc *c, int layer, moedc_layout *out, moedc_error *err)
{
    fleet *f = (fleet *)c;
    memset(out, 0, sizeof *out);
    learn(f); /* as a call's start: daemons to ask are asked first */
    pthread_mutex_lock(&f->mu);
    moedc_layer_plan none;
    const moedc_layer_plan *pl = moedc_plan_for(&f->p, layer, &none);
    int rc = pl->rc ? moedc_fail(err, pl->rc, "%s", pl->msg) : 0;
    if (!rc) rc = moedc_plan_copy(pl, &out->plan, err);
    out->fingerprint = f->p.fingerprint ? f->p.fingerprint : f->p.agreed;
    out->n_daemons = rc ? 0 : f->p.n;
    out->daemons = rc ? NULL : calloc((size_t)f->p.n, sizeof *out->daemons);
    out->names = rc ? NULL : calloc((size_t)f->p.n, sizeof *out->names);
    if (!rc && (!out->daemons || !out->names))
        rc = moedc_fail(err, MOEDC_ENOMEM, "out of memory copying a layer's plan");
    for (int i = 0; !rc && i < f->p.n; i++) {
        out->daemons[i] = member_at(f, i)->c;
        out->names[i] = member_at(f, i)->pl.target;
    }
    pthread_mutex_unlock(&f->mu);
    if (rc) moedc_layout_free(out);
    return rc;
}

static const moedc_ops fleet_ops = {
    .forward_start = fleet_forward_start,
    .forward_finish = fleet_forward_finish,
    .forward_cancel = fleet_forward_cancel,
    .info = fleet_info,
    .health = fleet_health,
    .list_regions = fleet_list_regions,
    .session_open = fleet_session_open,
    .layout = fleet_layout,
    .close = fleet_close,
};
