/*
 * moed_synth — the synthetic-model spec (parse, format) and the counter-based weight generator that
 * moed_synth.h defines to the bit.
 *
 * Every element is a pure function of its coordinates, so a layer is filled in parallel chunks on a
 * temporary thread pool (a Mixtral-sized layer is 1.4 G elements) and any slice equals the same
 * slice of a full fill.
 */
#include "moed_synth.h"

#include "moed_dtype.h"
#include "moed_fp8.h"
#include "moed_pool.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Elements per generator task: large enough to hide the task overhead, small enough to balance. */
#define SYNTH_CHUNK ((uint64_t)1 << 18)
/* Dimensions beyond this are surely a typo, and keep every size product far from overflow. */
#define SYNTH_MAX_DIM (1 << 20)

/* ---- the spec ----------------------------------------------------------------------------- */

static void spec_defaults(moed_synth_spec *s)
{
    memset(s, 0, sizeof *s);
    s->layers = 2;
    s->seed = 1;
    s->layer = (moed_layer_info){
        .d_model = 256,
        .d_ff = 512,
        .n_experts = 8,
        .top_k = 2,
        .act = MOED_ACT_SWIGLU,
        .wdtype = MOED_BF16,
        .has_router = true,
        .norm_topk = true,
        .rule = MOED_RULE_SOFTMAX_TOPK,
        .n_group = 1,
        .topk_group = 1,
        .routed_scale = 1.0f,
    };
}

/* The integer keys, where each lands and its smallest and largest value. */
typedef struct spec_int_key {
    const char *name;
    size_t offset; /* of an int inside moed_synth_spec */
    long long min, max;
} spec_int_key;

#define SPEC_INT(name, field, lo, hi)                                                              \
    {                                                                                              \
        name, offsetof(moed_synth_spec, field), lo, hi                                             \
    }
static const spec_int_key spec_ints[] = {
    SPEC_INT("layers", layers, 1, 4096),
    SPEC_INT("d", layer.d_model, 1, SYNTH_MAX_DIM),
    SPEC_INT("ff", layer.d_ff, 1, SYNTH_MAX_DIM),
    SPEC_INT("experts", layer.n_experts, 1, 65536),
    SPEC_INT("topk", layer.top_k, 1, 65536),
    SPEC_INT("shared", layer.n_shared, 0, 1024),
    SPEC_INT("shared_ff", layer.shared_d_ff, 0, SYNTH_MAX_DIM),
    SPEC_INT("groups", layer.n_group, 1, 65536),
    SPEC_INT("topk_groups", layer.topk_group, 1, 65536),
};
#undef SPEC_INT

static int parse_ll(const char *v, long long *out)
{
    char *end;
    errno = 0;
    *out = strtoll(v, &end, 10);
    return *v && !*end && !errno ? 0 : -1;
}

static int parse_bool(const char *v, bool *out)
{
    if (!strcmp(v, "1") || !strcmp(v, "true"))
        *out = true;
    else if (!strcmp(v, "0") || !strcmp(v, "false"))
        *out = false;
    else
        return -1;
    return 0;
}

/* Applies one key=value; the error names both. */
static int spec_set(moed_synth_spec *s, const char *key, const char *v, moed_error *err)
{
    for (size_t i = 0; i < sizeof spec_ints / sizeof spec_ints[0]; i++) {
        const spec_int_key *k = &spec_ints[i];
        if (strcmp(key, k->name)) continue;
        long long x;
        if (parse_ll(v, &x) || x < k->min || x > k->max)
            return moed_fail(err, MOED_EINVAL,
                             "synthetic spec: %s=%s is not valid: it takes an integer in [%lld, "
                             "%lld]",
                             key, v, k->min, k->max);
        *(int *)((char *)s + k->offset) = (int)x;
        return 0;
    }
    moed_layer_info *li = &s->layer;
    if (!strcmp(key, "act")) {
        li->act = moed_act_parse(v);
        if (li->act == MOED_ACT_NONE)
            return moed_fail(err, MOED_EINVAL,
                             "synthetic spec: act=%s is not valid: use swiglu, gelu or relu", v);
    } else if (!strcmp(key, "dtype")) {
        li->wdtype = moed_dtype_parse(v);
        if (!moed_dtype_is_weight(li->wdtype))
            return moed_fail(err, MOED_EINVAL,
                             "synthetic spec: dtype=%s is not valid: use bf16, f16, f32 or fp8", v);
    } else if (!strcmp(key, "seed")) {
        char *end;
        errno = 0;
        s->seed = strtoull(v, &end, 10);
        if (!*v || *end || errno || *v == '-')
            return moed_fail(err, MOED_EINVAL,
                             "synthetic spec: seed=%s is not valid: it takes an unsigned 64-bit "
                             "integer",
                             v);
    } else if (!strcmp(key, "router") || !strcmp(key, "norm")) {
        if (parse_bool(v, !strcmp(key, "router") ? &li->has_router : &li->norm_topk))
            return moed_fail(err, MOED_EINVAL, "synthetic spec: %s=%s is not valid: use 0 or 1",
                             key, v);
    } else if (!strcmp(key, "rule")) {
        if (!strcmp(v, "softmax"))
            li->rule = MOED_RULE_SOFTMAX_TOPK;
        else if (!strcmp(v, "deepseek"))
            li->rule = MOED_RULE_DEEPSEEK_V3;
        else
            return moed_fail(err, MOED_EINVAL,
                             "synthetic spec: rule=%s is not valid: use softmax or deepseek", v);
    } else if (!strcmp(key, "scale")) {
        char *end;
        double x = strtod(v, &end);
        if (!*v || *end || !(x > 0.0) || !isfinite((float)x))
            return moed_fail(err, MOED_EINVAL,
                             "synthetic spec: scale=%s is not valid: it takes a finite number > 0",
                             v);
        li->routed_scale = (float)x;
    } else {
        return moed_fail(err, MOED_EINVAL,
                         "synthetic spec: unknown key '%s': the keys are layers, d, ff, experts, "
                         "topk, act, dtype, seed, router, norm, shared, shared_ff, rule, groups, "
                         "topk_groups and scale",
                         key);
    }
    return 0;
}

/* The relations between keys that each value alone cannot check. */
static int spec_check(const moed_synth_spec *s, moed_error *err)
{
    const moed_layer_info *li = &s->layer;
    if (li->top_k > li->n_experts)
        return moed_fail(err, MOED_EINVAL,
                         "synthetic spec: topk=%d is more than experts=%d: a token cannot use "
                         "more experts than the layer has",
                         li->top_k, li->n_experts);
    if ((li->n_shared > 0) != (li->shared_d_ff > 0))
        return moed_fail(err, MOED_EINVAL,
                         "synthetic spec: shared=%d with shared_ff=%d: shared experts need their "
                         "total width shared_ff > 0, and shared_ff needs shared >= 1",
                         li->n_shared, li->shared_d_ff);
    if (li->n_group > 1 || li->topk_group > 1) {
        if (li->rule != MOED_RULE_DEEPSEEK_V3)
            return moed_fail(err, MOED_EINVAL,
                             "synthetic spec: groups=%d topk_groups=%d need rule=deepseek (group-"
                             "limited routing is DeepSeek-V3's)",
                             li->n_group, li->topk_group);
        if (li->n_experts % li->n_group)
            return moed_fail(err, MOED_EINVAL,
                             "synthetic spec: groups=%d does not divide experts=%d into equal "
                             "groups",
                             li->n_group, li->n_experts);
        if (li->topk_group > li->n_group)
            return moed_fail(err, MOED_EINVAL,
                             "synthetic spec: topk_groups=%d is more than groups=%d",
                             li->topk_group, li->n_group);
        if (li->top_k > li->topk_group * (li->n_experts / li->n_group))
            return moed_fail(
                err, MOED_EINVAL,
                "synthetic spec: topk=%d is more than the %d experts in topk_groups=%d "
                "groups of %d",
                li->top_k, li->topk_group * (li->n_experts / li->n_group), li->topk_group,
                li->n_experts / li->n_group);
    }
    return 0;
}

int moed_synth_parse(const char *spec, moed_synth_spec *out, moed_error *err)
{
    spec_defaults(out);
    size_t n = strlen(spec);
    char *buf = malloc(n + 1);
    if (!buf) return moed_fail(err, MOED_ENOMEM, "no memory to parse the synthetic spec");
    memcpy(buf, spec, n + 1);
    int rc = 0;
    const char *seen[32];
    int n_seen = 0;
    char *save = NULL;
    for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (!eq) {
            rc = moed_fail(err, MOED_EINVAL,
                           "synthetic spec: '%s' is not key=value (the spec looks like "
                           "layers=2,d=256,ff=512,experts=8,topk=2)",
                           item);
            goto out;
        }
        *eq = 0;
        for (int i = 0; i < n_seen; i++) {
            if (!strcmp(seen[i], item)) {
                rc = moed_fail(err, MOED_EINVAL, "synthetic spec: key '%s' is given twice", item);
                goto out;
            }
        }
        if ((rc = spec_set(out, item, eq + 1, err))) goto out;
        if (n_seen < (int)(sizeof seen / sizeof seen[0])) seen[n_seen++] = item;
    }
    rc = spec_check(out, err);
out:
    free(buf);
    return rc;
}

void moed_synth_format(const moed_synth_spec *s, char *buf, size_t n)
{
    const moed_layer_info *li = &s->layer;
    snprintf(buf, n,
             "layers=%d,d=%d,ff=%d,experts=%d,topk=%d,act=%s,dtype=%s,seed=%" PRIu64
             ",router=%d,norm=%d,shared=%d,shared_ff=%d,rule=%s,groups=%d,topk_groups=%d,"
             "scale=%.9g",
             s->layers, li->d_model, li->d_ff, li->n_experts, li->top_k, moed_act_name(li->act),
             moed_dtype_name(li->wdtype), s->seed, li->has_router ? 1 : 0, li->norm_topk ? 1 : 0,
             li->n_shared, li->shared_d_ff,
             li->rule == MOED_RULE_DEEPSEEK_V3 ? "deepseek" : "softmax", li->n_group,
             li->topk_group, (double)li->routed_scale);
}

/* ---- the generator ------------------------------------------------------------------------ */

uint64_t moed_splitmix64(uint64_t x)
{
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint64_t moed_ranges_fold(uint64_t h, uint32_t first, uint32_t last)
{
    return moed_splitmix64(h ^ ((uint64_t)first << 32 | last));
}

/* Element i of the tensor whose key is `key`, before rounding to the weight dtype. */
static inline float synth_value(uint64_t key, uint64_t i, double scale)
{
    /* 24 bits: through int32 the conversion to double is one instruction, not uint64's dance */
    double u = (double)(int32_t)(moed_splitmix64(key + i) >> 40) / 16777216.0;
    return (float)((2.0 * u - 1.0) * scale);
}

void moed_synth_fill(uint64_t seed, int layer, int tensor, int expert, int fan_in, int dtype,
                     uint64_t first, uint64_t n, void *dst)
{
    uint64_t key =
        moed_splitmix64(moed_splitmix64(seed) ^ ((uint64_t)layer << 40 | (uint64_t)tensor << 32 |
                                                 (uint64_t)(uint32_t)expert));
    double scale = tensor == MOED_SYNTH_BIAS ? 0.1 : sqrt(3.0 / fan_in);
    float *f = dst;
    uint16_t *h = dst;
    if (dtype == MOED_F32)
        for (uint64_t i = 0; i < n; i++) f[i] = synth_value(key, first + i, scale);
    else if (dtype == MOED_BF16)
        for (uint64_t i = 0; i < n; i++)
            h[i] = moed_f32_to_bf16(synth_value(key, first + i, scale));
    else if (dtype == MOED_F16)
        for (uint64_t i = 0; i < n; i++) h[i] = moed_f32_to_f16(synth_value(key, first + i, scale));
}

/* One tensor of a layer to generate: n elements in dtype, in tasks of `chunk` elements. An FP8
 * tensor's task is a band of MOED_FP8_BLOCK rows (fan_in columns), generated in float32 and then
 * quantized, with its row of block scales. */
typedef struct synth_tensor {
    int tensor, expert, fan_in, dtype;
    uint64_t n, chunk;
    void *dst;
    float *scale; /* FP8: [ceil(rows/128), ceil(fan_in/128)] */
} synth_tensor;

typedef struct synth_job {
    const moed_synth_spec *spec;
    int layer;
    const synth_tensor *t;
    int n_t;
    const uint64_t *first_task; /* per tensor, its first task; n_t + 1 entries */
    _Atomic int failed;         /* a task ran out of memory */
} synth_job;

/* One band of an FP8 tensor: its float32 values, quantized. The band buffer is the task's own
 * (a few MB at most for real widths); 0, or MOED_ENOMEM. */
static int synth_fp8_band(const synth_job *j, const synth_tensor *t, uint64_t first, uint64_t n)
{
    float *v = malloc(sizeof(float) * n);
    if (!v) return MOED_ENOMEM;
    moed_synth_fill(j->spec->seed, j->layer, t->tensor, t->expert, t->fan_in, MOED_F32, first, n,
                    v);
    const uint64_t band = first / t->chunk;
    /* the values are finite by construction: nothing to report */
    (void)moed_fp8_quantize_band(v, (int)(n / (uint64_t)t->fan_in), t->fan_in,
                                 (uint8_t *)t->dst + first,
                                 t->scale + band * (uint64_t)moed_fp8_blocks(t->fan_in));
    free(v);
    return 0;
}

static void synth_task(void *arg, int64_t task, int thread)
{
    (void)thread;
    synth_job *j = arg;
    int i = 0;
    while (j->first_task[i + 1] <= (uint64_t)task) i++;
    const synth_tensor *t = &j->t[i];
    uint64_t first = ((uint64_t)task - j->first_task[i]) * t->chunk;
    uint64_t n = t->n - first < t->chunk ? t->n - first : t->chunk;
    if (t->scale) {
        if (synth_fp8_band(j, t, first, n)) j->failed = 1;
        return;
    }
    moed_synth_fill(j->spec->seed, j->layer, t->tensor, t->expert, t->fan_in, t->dtype, first, n,
                    (char *)t->dst + first * moed_dtype_size(t->dtype));
}

/* Lists the layer's tensors (the held experts' only) and allocates their memory, wiring the
 * pointers into l. */
static int synth_alloc(const moed_layer_info *li, const moed_expert_subset *held, moed_layer *l,
                       synth_tensor *t, int *n_t, moed_error *err)
{
    uint64_t d = (uint64_t)li->d_model, ff = (uint64_t)li->d_ff, sff = (uint64_t)li->shared_d_ff;
    int wd = li->wdtype, swiglu = li->act == MOED_ACT_SWIGLU, n = 0;
    const int fp8 = wd == MOED_FP8, rd = fp8 ? MOED_BF16 : wd;
    l->experts = calloc((size_t)li->n_experts, sizeof *l->experts);
    if (!l->experts) goto nomem;
        /* A tensor of `count` elements; an FP8 one with its scales in *sp, generated in row bands.
         */
#define SYNTH_ADD(ptr, sp, tens, exp, fan, dt, count)                                              \
    do {                                                                                           \
        void *p_ = NULL, *s_ = NULL;                                                               \
        const uint64_t rows_ = (count) / (uint64_t)(fan);                                          \
        if (posix_memalign(&p_, 64, (size_t)(count)*moed_dtype_size(dt))) goto nomem;              \
        (ptr) = p_;                                                                                \
        if ((dt) == MOED_FP8) {                                                                    \
            s_ = malloc(sizeof(float) * (size_t)moed_fp8_scale_count((int64_t)rows_, fan));        \
            if (!s_) goto nomem;                                                                   \
            *(sp) = s_;                                                                            \
        }                                                                                          \
        t[n++] =                                                                                   \
            (synth_tensor){ tens,  exp,                                                            \
                            fan,   dt,                                                             \
                            count, s_ ? (uint64_t)MOED_FP8_BLOCK * (uint64_t)(fan) : SYNTH_CHUNK,  \
                            p_,    s_ };                                                           \
    } while (0)
    for (int e = 0; e < li->n_experts; e++) {
        moed_expert_w *x = &l->experts[e];
        if (!moed_expert_subset_has(held, e)) continue;
        SYNTH_ADD(x->w1, &x->s1, MOED_SYNTH_W1, e, li->d_model, wd, ff * d);
        if (swiglu) SYNTH_ADD(x->w3, &x->s3, MOED_SYNTH_W3, e, li->d_model, wd, ff * d);
        SYNTH_ADD(x->w2, &x->s2, MOED_SYNTH_W2, e, li->d_ff, wd, d * ff);
    }
    float *none = NULL;
    if (li->has_router) {
        SYNTH_ADD(l->router, &none, MOED_SYNTH_ROUTER, 0, li->d_model, rd,
                  (uint64_t)li->n_experts * d);
        l->router_dtype = rd;
    }
    if (li->rule == MOED_RULE_DEEPSEEK_V3)
        SYNTH_ADD(l->router_bias, &none, MOED_SYNTH_BIAS, 0, 1, MOED_F32, (uint64_t)li->n_experts);
    if (li->n_shared > 0 && moed_expert_subset_shared(held)) {
        moed_expert_w *x = &l->shared;
        SYNTH_ADD(x->w1, &x->s1, MOED_SYNTH_SHARED_W1, 0, li->d_model, wd, sff * d);
        if (swiglu) SYNTH_ADD(x->w3, &x->s3, MOED_SYNTH_SHARED_W3, 0, li->d_model, wd, sff * d);
        SYNTH_ADD(x->w2, &x->s2, MOED_SYNTH_SHARED_W2, 0, li->shared_d_ff, wd, d * sff);
    }
#undef SYNTH_ADD
    *n_t = n;
    return 0;
nomem:
    return moed_fail(err, MOED_ENOMEM,
                     "no memory for synthetic layer %d: it needs %.1f MiB of weights; use a "
                     "smaller spec (d, ff, experts) or fewer layers",
                     li->index, (double)moed_layer_bytes(li) / (1 << 20));
}

int moed_synth_layer(const moed_synth_spec *s, int index, moed_layer *out, moed_error *err)
{
    return moed_synth_layer_held(s, index, NULL, out, err);
}

int moed_synth_layer_held(const moed_synth_spec *s, int index, const moed_expert_subset *held,
                          moed_layer *out, moed_error *err)
{
    memset(out, 0, sizeof *out);
    if (index < 0 || index >= s->layers)
        return moed_fail(err, MOED_EINVAL, "synthetic layer %d does not exist: the spec has %d",
                         index, s->layers);
    out->info = s->layer;
    out->info.index = index;
    if (moed_expert_subset_check(held, &out->info, err)) return MOED_EINVAL;
    int cap = 3 * s->layer.n_experts + 6, n_t = 0, rc;
    synth_tensor *t = calloc((size_t)cap, sizeof *t);
    uint64_t *first_task = calloc((size_t)cap + 1, sizeof *first_task);
    moed_pool *pool = NULL;
    if (!t || !first_task) {
        rc = moed_fail(err, MOED_ENOMEM, "no memory to plan synthetic layer %d", index);
        goto err;
    }
    if ((rc = synth_alloc(&out->info, held, out, t, &n_t, err))) goto err;
    for (int i = 0; i < n_t; i++)
        first_task[i + 1] = first_task[i] + (t[i].n + t[i].chunk - 1) / t[i].chunk;
    uint64_t tasks = first_task[n_t];
    if (moed_pool_create(tasks > 1 ? 0 : 1, &pool)) {
        rc = moed_fail(err, MOED_EINTERNAL, "could not start threads to generate layer %d", index);
        goto err;
    }
    synth_job job = { s, index, t, n_t, first_task, 0 };
    moed_pool_run(pool, (int64_t)tasks, synth_task, &job);
    moed_pool_destroy(pool);
    if (job.failed) {
        rc = moed_fail(err, MOED_ENOMEM, "no memory to quantize synthetic layer %d", index);
        goto err;
    }
    free(t);
    free(first_task);
    return 0;
err:
    free(t);
    free(first_task);
    moed_synth_free_layer(out);
    return rc;
}

void moed_synth_free_layer(moed_layer *l)
{
    if (!l) return;
    for (int e = 0; l->experts && e <= l->info.n_experts; e++) {
        const moed_expert_w *x = e < l->info.n_experts ? &l->experts[e] : &l->shared;
        free((void *)x->w1);
        free((void *)x->w3);
        free((void *)x->w2);
        free((void *)x->s1);
        free((void *)x->s3);
        free((void *)x->s2);
    }
    free(l->experts);
    free((void *)l->router);
    free((void *)l->router_bias);
    memset(l, 0, sizeof *l);
}
