/*
 * test_fleet_plan — libmoedclient's fleet planner (moedc_plan) against the table of scenarios the
 * Python client's planner is tested against too ($MOED_TEST_DATA/fleet_scenarios.json, read by
 * client/python/tests/test_fleet_plan.py): the same constants, shards and replicas, the same error
 * codes and texts, replica choice, GetModel schedules, the tokens each shard gets, sums bit for
 * bit, and health.
 */
#include "check.h"
#include "moedc_plan.h"

#include <cjson/cJSON.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TARGETS 8

static const cJSON *table;

static const cJSON *get(const cJSON *o, const char *key)
{
    return cJSON_GetObjectItemCaseSensitive(o, key);
}

/* A scenario's value for key, else the defaults' (NULL: none). */
static const cJSON *field(const cJSON *sc, const cJSON *defaults, const char *key)
{
    const cJSON *v = get(sc, key);
    return v ? v : defaults ? get(defaults, key) : NULL;
}

static const char *name_of(const cJSON *sc)
{
    return get(sc, "name")->valuestring;
}

/* ---- building what the daemons answered ---- */

static void set_field(moedc_layer_info *li, const char *key, int v, const char *scenario)
{
    if (!strcmp(key, "index"))
        li->index = v;
    else if (!strcmp(key, "d_model"))
        li->d_model = v;
    else if (!strcmp(key, "d_ff"))
        li->d_ff = v;
    else if (!strcmp(key, "num_experts"))
        li->n_experts = v;
    else if (!strcmp(key, "top_k"))
        li->top_k = v;
    else if (!strcmp(key, "num_shared_experts"))
        li->n_shared = v;
    else if (!strcmp(key, "shared_d_ff"))
        li->shared_d_ff = v;
    else
        CHECK_MSG(0, "%s: the table sets layer field %s, which this test does not know", scenario,
                  key);
}

static void ranges(const cJSON *list, moedc_expert_range **out, int *n)
{
    *n = cJSON_GetArraySize(list);
    *out = calloc((size_t)*n, sizeof **out);
    for (int i = 0; i < *n; i++) {
        const cJSON *r = cJSON_GetArrayItem(list, i);
        (*out)[i] = (moedc_expert_range){ cJSON_GetArrayItem(r, 0)->valueint,
                                          cJSON_GetArrayItem(r, 1)->valueint };
    }
}

static void layer_info(const cJSON *spec, moedc_layer_info *li, const char *scenario)
{
    memset(li, 0, sizeof *li);
    const cJSON *v;
    cJSON_ArrayForEach(v, get(table, "layer")) set_field(li, v->string, v->valueint, scenario);
    cJSON_ArrayForEach(v, spec)
    {
        if (strcmp(v->string, "held") && strcmp(v->string, "adds_shared"))
            set_field(li, v->string, v->valueint, scenario);
    }
    if (get(spec, "held")) {
        ranges(get(spec, "held"), &li->held, &li->n_held);
    } else {
        li->held = malloc(sizeof *li->held);
        li->held[0] = (moedc_expert_range){ 0, li->n_experts - 1 };
        li->n_held = 1;
    }
    li->adds_shared = !get(spec, "adds_shared") || cJSON_IsTrue(get(spec, "adds_shared"));
}

static void model_info(const cJSON *answer, moedc_model_info *info, const char *scenario)
{
    memset(info, 0, sizeof *info);
    info->model = strdup("m");
    info->backend = strdup("cpu");
    info->version = strdup("v");
    info->max_message_bytes = 1 << 20;
    info->max_batch_tokens = 64;
    const cJSON *fp = get(answer, "fingerprint");
    info->model_fingerprint = fp ? (uint64_t)fp->valuedouble : 0;
    const cJSON *layers = get(answer, "layers");
    info->n_layers = layers ? cJSON_GetArraySize(layers) : 0;
    info->layers = calloc((size_t)info->n_layers + 1, sizeof *info->layers);
    for (int i = 0; i < info->n_layers; i++)
        layer_info(cJSON_GetArrayItem(layers, i), &info->layers[i], scenario);
}

typedef struct fleet {
    moedc_planner p;
    moedc_member m[MAX_TARGETS];
} fleet;

static int member_index(const fleet *f, const char *target)
{
    for (int i = 0; i < f->p.n; i++)
        if (!strcmp(f->p.m[i]->target, target)) return i;
    CHECK_MSG(0, "no target %s", target);
    return 0;
}

static void tell(fleet *f, const cJSON *rounds, const char *scenario)
{
    const cJSON *round, *a;
    cJSON_ArrayForEach(round, rounds) cJSON_ArrayForEach(a, round)
    {
        moedc_member *m = &f->m[member_index(f, get(a, "target")->valuestring)];
        if (get(a, "error")) {
            moedc_plan_unanswered(&f->p, m, get(a, "error")->valuestring, 0);
        } else {
            moedc_model_info info;
            model_info(a, &info, scenario);
            moedc_plan_learnt(&f->p, m, &info, 0);
        }
    }
}

/* The fleet a scenario (with defaults) describes, told its answers. */
static void fleet_of(fleet *f, const cJSON *sc, const cJSON *defaults)
{
    memset(f, 0, sizeof *f);
    const cJSON *t;
    cJSON_ArrayForEach(t, field(sc, defaults, "targets"))
    {
        moedc_member *m = &f->m[f->p.n];
        m->target = strdup(t->valuestring);
        moedc_plan_add(&f->p, m);
    }
    tell(f, field(sc, defaults, "answers"), name_of(sc));
}

static void fleet_free(fleet *f)
{
    for (int i = 0; i < f->p.n; i++) moedc_member_release(&f->m[i]);
    moedc_plan_close(&f->p);
}

static const char *code_name(int rc)
{
    return moedc_grpc_status_name(moedc_code_to_grpc(rc));
}

static void check_error(const cJSON *sc, int rc, const char *msg)
{
    const cJSON *want = get(sc, "error");
    CHECK_MSG(rc && !strcmp(code_name(rc), get(want, "code")->valuestring), "%s: %s, not %s",
              name_of(sc), rc ? code_name(rc) : "planned", get(want, "code")->valuestring);
    CHECK_MSG(rc && !strcmp(msg, get(want, "message")->valuestring),
              "%s: the message\n  %s\nis not the table's\n  %s", name_of(sc), rc ? msg : "",
              get(want, "message")->valuestring);
}

static bool same_ranges(const cJSON *want, const moedc_expert_range *r, int n)
{
    bool same = cJSON_GetArraySize(want) == n;
    for (int i = 0; same && i < n; i++) {
        const cJSON *w = cJSON_GetArrayItem(want, i);
        same = cJSON_GetArrayItem(w, 0)->valueint == r[i].first &&
               cJSON_GetArrayItem(w, 1)->valueint == r[i].last;
    }
    return same;
}

/* ---- the sections of the table ---- */

static void test_constants(void)
{
    const cJSON *c = get(table, "constants");
    CHECK(get(c, "probe_timeout_s")->valuedouble == MOEDC_PLAN_PROBE_TIMEOUT_S);
    CHECK(get(c, "reprobe_s")->valuedouble == MOEDC_PLAN_REPROBE_S);
    CHECK(get(c, "down_min_s")->valuedouble == MOEDC_PLAN_DOWN_MIN_S);
    CHECK(get(c, "down_max_s")->valuedouble == MOEDC_PLAN_DOWN_MAX_S);
    CHECK(get(c, "resolve_every_s")->valuedouble == MOEDC_PLAN_RESOLVE_EVERY_S);
}

static void test_plan(const cJSON *sc)
{
    fleet f;
    fleet_of(&f, sc, NULL);
    moedc_layer_plan none;
    moedc_error err = { 0 };
    const moedc_layer_plan *pl = moedc_plan_for(&f.p, get(sc, "layer")->valueint, &none);
    int rc = pl->rc;
    const char *msg = pl->msg;
    if (!rc && cJSON_IsTrue(get(sc, "batch_gating"))) {
        rc = moedc_plan_batch_gating(&f.p, pl, &err);
        msg = err.msg;
    }
    if (get(sc, "error")) {
        check_error(sc, rc, msg);
    } else {
        const cJSON *want = get(sc, "shards"), *fp = get(sc, "expect_fingerprint");
        CHECK_MSG(!rc, "%s: %s", name_of(sc), msg);
        CHECK_MSG(rc || cJSON_GetArraySize(want) == pl->n_shards, "%s: %d shards", name_of(sc),
                  pl->n_shards);
        for (int s = 0; !rc && s < pl->n_shards && s < cJSON_GetArraySize(want); s++) {
            const cJSON *w = cJSON_GetArrayItem(want, s), *replicas = get(w, "replicas");
            const moedc_shard *sh = &pl->shards[s];
            CHECK_MSG(same_ranges(get(w, "held"), sh->li->held, sh->li->n_held), "%s: shard %d",
                      name_of(sc), s);
            CHECK_MSG(cJSON_IsTrue(get(w, "adds_shared")) == sh->li->adds_shared, "%s: shard %d",
                      name_of(sc), s);
            CHECK_MSG(cJSON_GetArraySize(replicas) == sh->n_replicas, "%s: shard %d", name_of(sc),
                      s);
            for (int r = 0; r < sh->n_replicas && r < cJSON_GetArraySize(replicas); r++)
                CHECK_MSG(!strcmp(f.p.m[sh->replicas[r]]->target,
                                  cJSON_GetArrayItem(replicas, r)->valuestring),
                          "%s: shard %d replica %d", name_of(sc), s, r);
        }
        if (fp) CHECK_MSG(f.p.agreed == (uint64_t)fp->valuedouble, "%s", name_of(sc));
    }
    fleet_free(&f);
}

/* A part of the scenario's shard, as the fleet copies it when a call starts. */
typedef struct part {
    int replicas[MAX_TARGETS], n;
    moedc_expect e;
    moedc_expert_range held[MAX_TARGETS];
} part;

static void part_of(const fleet *f, const cJSON *sc, const cJSON *defaults, part *p)
{
    moedc_layer_plan none;
    const moedc_layer_plan *pl =
        moedc_plan_for((moedc_planner *)&f->p, field(sc, defaults, "layer")->valueint, &none);
    const moedc_shard *sh = &pl->shards[field(sc, defaults, "shard")->valueint];
    p->n = sh->n_replicas;
    memcpy(p->replicas, sh->replicas, sizeof *p->replicas * (size_t)p->n);
    memcpy(p->held, sh->li->held, sizeof *p->held * (size_t)sh->li->n_held);
    p->e = (moedc_expect){ .fingerprint = f->p.agreed,
                           .held = p->held,
                           .n_held = sh->li->n_held,
                           .adds_shared = sh->li->adds_shared };
}

static void test_pick(const cJSON *sc)
{
    const cJSON *defaults = get(table, "picks_default"), *v, *state;
    fleet f;
    fleet_of(&f, sc, defaults);
    part p;
    part_of(&f, sc, defaults, &p);
    if (get(sc, "then")) tell(&f, get(sc, "then"), name_of(sc));
    cJSON_ArrayForEach(state, field(sc, defaults, "state"))
    {
        moedc_member *m = &f.m[member_index(&f, state->string)];
        cJSON_ArrayForEach(v, state)
        {
            if (!strcmp(v->string, "outstanding"))
                m->outstanding = v->valueint;
            else if (!strcmp(v->string, "down_until"))
                m->down_until = v->valuedouble;
            else if (!strcmp(v->string, "check"))
                m->check = cJSON_IsTrue(v);
            else
                CHECK_MSG(0, "%s: unknown state %s", name_of(sc), v->string);
        }
    }
    unsigned char tried[MAX_TARGETS] = { 0 };
    cJSON_ArrayForEach(v, field(sc, defaults, "tried"))
    {
        for (int r = 0; r < p.n; r++)
            tried[r] |= !strcmp(f.p.m[p.replicas[r]]->target, v->valuestring);
    }
    const int at = moedc_plan_pick(&f.p, field(sc, defaults, "layer")->valueint, &p.e, p.replicas,
                                   p.n, tried, (unsigned)get(sc, "turn")->valueint,
                                   field(sc, defaults, "now")->valuedouble);
    const cJSON *want = get(sc, "pick");
    const char *got = at < 0 ? "none" : f.p.m[p.replicas[at]]->target;
    CHECK_MSG(!strcmp(got, cJSON_IsNull(want) ? "none" : want->valuestring), "%s: picked %s",
              name_of(sc), got);
    fleet_free(&f);
}

static void test_ask(const cJSON *sc)
{
    const cJSON *spec = get(sc, "member");
    moedc_member m = { 0 };
    m.have_info = cJSON_IsTrue(get(spec, "answered"));
    m.check = cJSON_IsTrue(get(spec, "check"));
    m.retired = cJSON_IsTrue(get(spec, "retired"));
    m.asked_at = get(spec, "asked_at") ? get(spec, "asked_at")->valuedouble : 0;
    m.down_until = get(spec, "down_until") ? get(spec, "down_until")->valuedouble : 0;
    CHECK_MSG(moedc_plan_to_ask(&m, cJSON_IsTrue(get(sc, "again")), get(sc, "now")->valuedouble) ==
                  cJSON_IsTrue(get(sc, "ask")),
              "%s", name_of(sc));
}

static void test_downs(void)
{
    const cJSON *downs = get(table, "downs"), *want;
    const double now = get(downs, "now")->valuedouble;
    moedc_member m = { 0 };
    cJSON_ArrayForEach(want, get(downs, "down_for"))
    {
        moedc_plan_down(&m, now);
        CHECK(m.down_for == want->valuedouble && m.down_until == now + want->valuedouble);
    }
}

static void test_rechecks(void)
{
    const cJSON *sc = get(table, "rechecks"), *due;
    fleet f;
    fleet_of(&f, sc, NULL);
    moedc_layer_plan none;
    CHECK(moedc_plan_for(&f.p, get(sc, "layer")->valueint, &none)->rc);
    cJSON_ArrayForEach(due, get(sc, "due"))
    {
        const double t = cJSON_GetArrayItem(due, 0)->valuedouble;
        CHECK_MSG(moedc_plan_recheck_due(&f.p, t) == cJSON_IsTrue(cJSON_GetArrayItem(due, 1)),
                  "at %g", t);
    }
    fleet_free(&f);
}

/* A table's list of bit patterns as dtype's elements (size bytes each) at out. */
static void bits_of(const cJSON *list, size_t size, unsigned char *out)
{
    for (int j = 0; j < cJSON_GetArraySize(list); j++) {
        const uint32_t bits = (uint32_t)cJSON_GetArrayItem(list, j)->valuedouble;
        if (size == 4)
            memcpy(out + (size_t)j * 4, &bits, 4);
        else
            memcpy(out + (size_t)j * 2, &(uint16_t){ (uint16_t)bits }, 2);
    }
}

static void test_sum(const cJSON *sc)
{
    const char *dtype = get(sc, "dtype")->valuestring;
    const int dt = !strcmp(dtype, "f32")   ? MOEDC_F32
                   : !strcmp(dtype, "f16") ? MOEDC_F16
                                           : MOEDC_BF16;
    const size_t size = dt == MOEDC_F32 ? 4 : 2;
    const cJSON *parts = get(sc, "parts"), *want = get(sc, "sum"), *rows = get(sc, "rows");
    const int n = cJSON_GetArraySize(parts);
    const size_t count = (size_t)cJSON_GetArraySize(want);
    /* without rows: every part holds every token, each one element */
    const int64_t tokens = rows ? get(sc, "tokens")->valueint : (int64_t)count;
    const int64_t d = (int64_t)count / tokens;
    unsigned char *bytes = calloc((size_t)(n + 1) * count, size),
                  *expect = bytes + n * count * size;
    const void *ptrs[MAX_TARGETS];
    int64_t row_lists[MAX_TARGETS][16], n_rows[MAX_TARGETS];
    const int64_t *row_ptrs[MAX_TARGETS];
    bool whole = true; /* every part holds every token: the sum may go into the first */
    for (int i = 0; i < n; i++) {
        ptrs[i] = bytes + (size_t)i * count * size;
        bits_of(cJSON_GetArrayItem(parts, i), size, (unsigned char *)ptrs[i]);
        const cJSON *list = rows ? cJSON_GetArrayItem(rows, i) : NULL;
        n_rows[i] = list ? cJSON_GetArraySize(list) : tokens;
        for (int64_t j = 0; list && j < n_rows[i]; j++)
            row_lists[i][j] = cJSON_GetArrayItem(list, (int)j)->valueint;
        row_ptrs[i] = list ? row_lists[i] : NULL;
        whole &= n_rows[i] == tokens;
    }
    bits_of(want, size, expect);
    unsigned char *out = malloc(count * size);
    moedc_error err;
    CHECK_EQ_INT(moedc_plan_sum(dt, ptrs, row_ptrs, n_rows, n, tokens, d, out, &err), 0);
    CHECK_MSG(!memcmp(out, expect, count * size), "%s", name_of(sc));
    if (whole) { /* into the first part itself, as the fleet does (the carrier's output) */
        CHECK_EQ_INT(moedc_plan_sum(dt, ptrs, NULL, NULL, n, tokens, d, bytes, &err), 0);
        CHECK_MSG(!memcmp(bytes, expect, count * size), "%s in place", name_of(sc));
    }
    free(out);
    free(bytes);
}

/* Layer 0's plan for the fleet a scenario describes (checked to be one). */
static const moedc_layer_plan *layer0_plan(fleet *f, const cJSON *sc, moedc_layer_plan *none)
{
    fleet_of(f, sc, NULL);
    const moedc_layer_plan *pl = moedc_plan_for(&f->p, 0, none);
    CHECK_MSG(!pl->rc, "%s: %s", name_of(sc), pl->msg);
    return pl;
}

static void test_slices(const cJSON *sc)
{
    fleet f;
    moedc_layer_plan none;
    const moedc_layer_plan *pl = layer0_plan(&f, sc, &none);
    const cJSON *ids = get(sc, "ids"), *w = get(sc, "weights"), *k_given = get(sc, "k");
    const int T = cJSON_GetArraySize(ids);
    const int k = T ? cJSON_GetArraySize(cJSON_GetArrayItem(ids, 0)) : k_given->valueint;
    int32_t id[64];
    float wt[64];
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            id[t * k + j] = cJSON_GetArrayItem(cJSON_GetArrayItem(ids, t), j)->valueint;
            wt[t * k + j] = w ? (float)cJSON_GetArrayItem(cJSON_GetArrayItem(w, t), j)->valuedouble
                              : id[t * k + j] != -1;
        }
    int64_t *rows[MAX_TARGETS], n_rows[MAX_TARGETS];
    moedc_error err;
    CHECK_EQ_INT(moedc_plan_rows(pl, id, wt, T, k, rows, n_rows, &err), 0);
    const cJSON *want = get(sc, "rows");
    CHECK_MSG(cJSON_GetArraySize(want) == pl->n_shards, "%s: %d shards", name_of(sc), pl->n_shards);
    for (int s = 0; s < pl->n_shards && s < cJSON_GetArraySize(want); s++) {
        const cJSON *list = cJSON_GetArrayItem(want, s);
        bool same = cJSON_GetArraySize(list) == n_rows[s];
        for (int64_t j = 0; same && j < n_rows[s]; j++)
            same = cJSON_GetArrayItem(list, (int)j)->valueint == (rows[s] ? rows[s][j] : j);
        CHECK_MSG(same, "%s: shard %d gets %lld rows, not the table's", name_of(sc), s,
                  (long long)n_rows[s]);
        free(rows[s]);
    }
    fleet_free(&f);
}

static void test_sends(const cJSON *sc)
{
    fleet f;
    moedc_layer_plan none;
    const moedc_layer_plan *pl = layer0_plan(&f, sc, &none);
    const bool want = cJSON_IsTrue(get(sc, "sends_all"));
    CHECK_MSG(moedc_plan_sends_all(pl, get(sc, "k")->valueint) == want, "%s: sends %s", name_of(sc),
              want ? "the chosen tokens, not all" : "all, not the chosen tokens");
    fleet_free(&f);
}

/* The code a call the daemon answered with status `name` fails with. */
static int code_of(const char *name)
{
    for (int status = 0; status <= 16; status++)
        if (!strcmp(moedc_grpc_status_name(status), name)) return moedc_code_from_grpc(status);
    CHECK_MSG(0, "%s is no gRPC status", name);
    return MOEDC_EINTERNAL;
}

static void test_exhausted(const cJSON *sc)
{
    const cJSON *defaults = get(table, "exhausted_default"), *fl, *state;
    const double now = get(sc, "now")->valuedouble;
    fleet f;
    fleet_of(&f, sc, defaults);
    part p;
    part_of(&f, sc, defaults, &p);
    bool refused = false;
    cJSON_ArrayForEach(fl, get(sc, "failures"))
    {
        moedc_member *m = &f.m[member_index(&f, get(fl, "target")->valuestring)];
        const int rc = code_of(get(fl, "code")->valuestring);
        m->outstanding++;
        const bool on = moedc_plan_done(m, rc, get(fl, "message")->valuestring, now);
        CHECK_MSG(on == cJSON_IsTrue(get(fl, "moves_on")), "%s", name_of(sc));
        refused |= on && rc == MOEDC_EPRECOND;
        CHECK(m->outstanding == 0);
    }
    cJSON_ArrayForEach(state, get(sc, "members"))
    {
        const moedc_member *m = &f.m[member_index(&f, state->string)];
        CHECK_MSG(m->check == cJSON_IsTrue(get(state, "check")) &&
                      m->down_until == get(state, "down_until")->valuedouble,
                  "%s: %s", name_of(sc), state->string);
    }
    if (get(sc, "error")) {
        moedc_error err = { 0 };
        int rc = moedc_plan_exhausted(&f.p, field(sc, defaults, "layer")->valueint, &p.e,
                                      p.replicas, p.n, refused, &err);
        check_error(sc, rc, err.msg);
    }
    fleet_free(&f);
}

static void test_health(const cJSON *sc)
{
    fleet f;
    fleet_of(&f, sc, NULL);
    bool serving[MAX_TARGETS] = { false };
    const cJSON *t;
    cJSON_ArrayForEach(t, get(sc, "serving")) serving[member_index(&f, t->valuestring)] = true;
    const bool ok = moedc_plan_serving(&f.p, serving, f.p.n);
    CHECK_MSG(!strcmp(ok ? "SERVING" : "NOT_SERVING", get(sc, "status")->valuestring), "%s",
              name_of(sc));
    fleet_free(&f);
}

static int run(const char *section, void (*one)(const cJSON *))
{
    const cJSON *sc;
    int n = 0;
    cJSON_ArrayForEach(sc, get(table, section))
    {
        one(sc);
        n++;
    }
    CHECK_MSG(n > 0, "the table has no %s", section);
    return n;
}

int main(void)
{
    const char *dir = getenv("MOED_TEST_DATA");
    char path[4096];
    snprintf(path, sizeof path, "%s/fleet_scenarios.json", dir ? dir : "tests/data");
    FILE *f = fopen(path, "rb");
    static char text[1 << 20];
    const size_t n_text = f ? fread(text, 1, sizeof text - 1, f) : 0;
    if (f) fclose(f);
    text[n_text] = 0;
    cJSON *root = cJSON_Parse(text);
    if (!(table = root)) {
        fprintf(stderr, "test_fleet_plan: cannot read the scenarios from %s\n", path);
        return 1;
    }
    test_constants();
    int n = run("plans", test_plan) + run("picks", test_pick) + run("asks", test_ask) +
            run("sums", test_sum) + run("slices", test_slices) + run("sends", test_sends) +
            run("exhausted", test_exhausted) + run("health", test_health);
    test_downs();
    test_rechecks();
    fprintf(stderr, "test_fleet_plan: %d scenarios\n", n);
    cJSON_Delete(root);
    return check_status("test_fleet_plan");
}
