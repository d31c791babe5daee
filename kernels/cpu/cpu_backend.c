/*
 * cpu_backend — the CPU backend's life cycle: open, load_layer, start (the workspace), the device
 * query, destroy. The compute is in cpu_forward.c; host memory is the interface's default (plain
 * aligned memory is what a CPU moves fastest).
 *
 * It computes from the layer's weights where they lie (a checkpoint mapping or the synthetic
 * generator's buffers) and sizes every buffer it needs once, in start(), so a forward allocates
 * nothing. One execution slot runs on the whole thread pool: on a CPU, concurrent jobs would only
 * fight over the same cores and caches. It has no device memory (no region hooks, no read_device),
 * so every job's routing is its host route: a part with routing in device memory never reaches it
 * (moed_backend_forward refuses it, MOED_EPRECOND).
 */
#include "cpu_backend.h"
#include "cpu_ctx.h"

#include "moed_dtype.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sysinfo.h>

/* A forward's pairs go through the expert GEMMs in windows whose buffers stay under this. */
#define CPU_WINDOW_BYTES ((uint64_t)256 << 20)
/* max_tokens when the configuration leaves it 0. */
#define CPU_DEFAULT_MAX_TOKENS 4096

static cpu_ctx *ctx_of(moed_backend *b)
{
    return b->ctx;
}

/* Total and available bytes of host memory (MemAvailable, which counts reclaimable cache). */
static void host_memory(uint64_t *total, uint64_t *avail)
{
    struct sysinfo si;
    *total = *avail = 0;
    if (!sysinfo(&si)) {
        *total = (uint64_t)si.totalram * si.mem_unit;
        *avail = (uint64_t)(si.freeram + si.bufferram) * si.mem_unit;
    }
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return;
    char line[256];
    unsigned long long kb;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemTotal: %llu kB", &kb) == 1)
            *total = kb * 1024;
        else if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1)
            *avail = kb * 1024;
    }
    fclose(f);
}

static int cpu_load_layer(moed_backend *b, int slot, const moed_layer *l, moed_error *err)
{
    cpu_ctx *c = ctx_of(b);
    const moed_layer_info *li = &l->info;
    if (c->started)
        return moed_fail(err, MOED_EINVAL,
                         "layer %d: every layer must be loaded before the backend starts",
                         li->index);
    if (slot != c->n_layers)
        return moed_fail(err, MOED_EINVAL, "layer %d: loaded as slot %d, but the next slot is %d",
                         li->index, slot, c->n_layers);
    if (li->d_model < 1 || li->d_ff < 1 || li->n_experts < 1 || li->n_shared < 0 ||
        li->shared_d_ff < 0 || (li->n_shared > 0) != (li->shared_d_ff > 0))
        return moed_fail(err, MOED_EINVAL,
                         "layer %d has impossible sizes: d_model %d, d_ff %d, %d experts, %d "
                         "shared experts of total width %d",
                         li->index, li->d_model, li->d_ff, li->n_experts, li->n_shared,
                         li->shared_d_ff);
    if (!moed_dtype_is_weight(li->wdtype))
        return moed_fail(err, MOED_EUNSUPPORTED,
                         "layer %d: weights of dtype %s are not supported: use f32, f16, bf16 or "
                         "fp8",
                         li->index, moed_dtype_name(li->wdtype));
    const int fp8 = li->wdtype == MOED_FP8;
    if (li->act != MOED_ACT_SWIGLU && li->act != MOED_ACT_GELU && li->act != MOED_ACT_RELU)
        return moed_fail(err, MOED_EUNSUPPORTED, "layer %d: activation %d is not supported",
                         li->index, (int)li->act);
    int swiglu = li->act == MOED_ACT_SWIGLU;
    if (!l->experts)
        return moed_fail(err, MOED_EINVAL, "layer %d has no expert weights", li->index);
    for (int e = 0; e <= li->n_experts; e++) {
        const moed_expert_w *w = e < li->n_experts ? &l->experts[e] : &l->shared;
        if (e == li->n_experts && li->n_shared == 0) break;
        if (!w->w1 || !w->w2 || (swiglu && !w->w3) ||
            (fp8 && (!w->s1 || !w->s2 || (swiglu && !w->s3))))
            return moed_fail(err, MOED_EINVAL, "layer %d: %s %d lacks a weight matrix%s", li->index,
                             e < li->n_experts ? "expert" : "shared expert",
                             e < li->n_experts ? e : 0, fp8 ? " or its FP8 scales" : "");
    }
    if (li->has_router && (!l->router || !moed_dtype_is_float(moed_layer_router_dtype(l))))
        return moed_fail(err, MOED_EINVAL,
                         "layer %d says it has a router but its weights are missing or not "
                         "f32, f16 or bf16",
                         li->index);
    if (c->n_layers == c->cap_layers) {
        int cap = c->cap_layers ? 2 * c->cap_layers : 8;
        moed_layer *n = realloc(c->layers, (size_t)cap * sizeof *n);
        if (!n) return moed_fail(err, MOED_ENOMEM, "no memory to hold layer %d", li->index);
        c->layers = n;
        c->cap_layers = cap;
    }
    c->layers[c->n_layers++] = *l;
    return 0;
}

/* Hands out 64-byte aligned pieces of one allocation (or, with base NULL, just counts them). */
static void *carve(char *base, uint64_t *at, uint64_t bytes)
{
    void *p = base ? base + *at : NULL;
    *at += (bytes + 63) & ~(uint64_t)63;
    return p;
}

/* Lays the workspace out over base; returns its size. */
static uint64_t ws_layout(cpu_ctx *c, char *base)
{
    cpu_ws *w = &c->ws;
    uint64_t at = 0, T = (uint64_t)c->max_tokens, pw = (uint64_t)c->pw;
    w->x = carve(base, &at, T * c->d_max * 4);
    w->acc = carve(base, &at, T * c->d_max * 4);
    w->h = carve(base, &at, pw * c->ff_max * 4);
    w->r = carve(base, &at, pw * c->d_max * 4);
    w->wtok = carve(base, &at, pw * 4);
    w->wexp = carve(base, &at, pw * 4);
    w->wpos = carve(base, &at, pw * 4);
    w->ww = carve(base, &at, pw * 4);
    w->stok = carve(base, &at, pw * 4);
    w->seg = carve(base, &at, (pw + 1) * 4);
    w->bucket = carve(base, &at, ((uint64_t)c->e_max + 2) * 8);
    w->mm = carve(base, &at, ((uint64_t)c->e_max + 1) * sizeof *w->mm);
    w->blocks = carve(base, &at, (uint64_t)c->nb_max * sizeof *w->blocks);
    w->block_task = carve(base, &at, ((uint64_t)c->nb_max + 1) * 8);
    w->pack = carve(base, &at, (uint64_t)c->threads * c->pack_floats * 4);
    return at;
}

static int cpu_start(moed_backend *b, moed_error *err)
{
    cpu_ctx *c = ctx_of(b);
    if (c->started) return 0;
    if (c->n_layers == 0)
        return moed_fail(err, MOED_EINVAL, "the CPU backend was started with no layer loaded");
    int kpairs = 1, k_max = 1;
    for (int i = 0; i < c->n_layers; i++) {
        const moed_layer_info *li = &c->layers[i].info;
        int ff = li->d_ff > li->shared_d_ff ? li->d_ff : li->shared_d_ff;
        if (li->d_model > c->d_max) c->d_max = li->d_model;
        if (ff > c->ff_max) c->ff_max = ff;
        if (li->n_experts > c->e_max) c->e_max = li->n_experts;
        if (li->d_model > k_max) k_max = li->d_model;
        if (ff > k_max) k_max = ff;
        if (li->top_k + (li->n_shared > 0) > kpairs) kpairs = li->top_k + (li->n_shared > 0);
    }
    /* One window holds a whole typical job; bigger jobs, or routes with more pairs per token
     * than top_k, take several windows (the result is the same, the weights are read again). */
    uint64_t budget = CPU_WINDOW_BYTES / (4 * ((uint64_t)c->ff_max + c->d_max));
    uint64_t pw = (uint64_t)c->max_tokens * kpairs;
    if (pw > budget) pw = budget > 64 ? budget : 64;
    if (pw > INT32_MAX / 2) pw = INT32_MAX / 2;
    c->pw = (int64_t)pw;
    c->nb_max = (c->pw > c->max_tokens ? c->pw : c->max_tokens) / MOED_CPU_MC + c->e_max + 2;
    c->pack_floats = moed_cpu_mm_pack_floats(k_max);
    c->ws_bytes = ws_layout(c, NULL);
    if (c->ws_bytes > SIZE_MAX - 64 || posix_memalign(&c->ws_mem, 64, (size_t)c->ws_bytes)) {
        uint64_t total, avail;
        host_memory(&total, &avail);
        c->ws_mem = NULL;
        return moed_fail(err, MOED_ENOMEM,
                         "the CPU backend's workspace needs %.1f MiB (max_tokens %lld, d_model "
                         "%d, d_ff %d) but the host has %.1f MiB available: lower max_tokens",
                         (double)c->ws_bytes / (1 << 20), (long long)c->max_tokens, c->d_max,
                         c->ff_max, (double)avail / (1 << 20));
    }
    ws_layout(c, c->ws_mem);
    c->started = 1;
    b->n_exec = 1;
    return 0;
}

static int cpu_device_info(moed_backend *b, int i, moed_device_info *out)
{
    (void)b;
    if (i != 0) return MOED_ENOTFOUND;
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "cpu");
    uint64_t total, avail;
    host_memory(&total, &avail);
    out->memory_total = total;
    out->memory_used = total > avail ? total - avail : 0;
    return 0;
}

/* One device: every layer whole on it. */
static int cpu_layer_place(moed_backend *b, int slot, moed_layer_place *out)
{
    const cpu_ctx *c = ctx_of(b);
    if (slot < 0 || slot >= c->n_layers) return MOED_EINVAL;
    *out = (moed_layer_place){ .home = 0, .n_parts = 1 };
    out->part[0] = (moed_place_part){ 0, 0, c->layers[slot].info.n_experts };
    return 0;
}

static void cpu_destroy(moed_backend *b)
{
    cpu_ctx *c = ctx_of(b);
    if (c) {
        moed_pool_destroy(c->pool);
        free(c->ws_mem);
        free(c->layers);
        free(c);
    }
    free(b);
}

static const moed_backend_ops cpu_ops = {
    .name = "cpu",
    .computes_from_host = true,
    .load_layer = cpu_load_layer,
    .start = cpu_start,
    .forward = moed_cpu_forward,
    .router_logits = moed_cpu_router_logits,
    .device_info = cpu_device_info,
    .layer_place = cpu_layer_place,
    .destroy = cpu_destroy,
};

int moed_backend_cpu_open(const moed_backend_config *cfg, moed_backend **out, moed_error *err)
{
    *out = NULL;
    if (cfg->threads < 0 || cfg->max_tokens < 0)
        return moed_fail(err, MOED_EINVAL,
                         "CPU backend: threads = %d and max_tokens = %lld must be >= 0 (0 picks "
                         "the default)",
                         cfg->threads, (long long)cfg->max_tokens);
    if (cfg->expert_parallel)
        return moed_fail(err, MOED_EINVAL,
                         "--expert-parallel splits a layer's experts over GPUs, but the cpu "
                         "backend computes every layer in host memory on one device: leave it "
                         "out, or use --backend cuda");
    moed_backend *b = calloc(1, sizeof *b);
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!b || !c) {
        free(b);
        free(c);
        return moed_fail(err, MOED_ENOMEM, "no memory for the CPU backend");
    }
    b->ops = &cpu_ops;
    b->ctx = c;
    b->n_devices = 1;
    c->max_tokens = cfg->max_tokens > 0 ? cfg->max_tokens : CPU_DEFAULT_MAX_TOKENS;
    c->threads = cfg->threads > 0 ? cfg->threads : moed_pool_online_cpus();
    int rc = moed_pool_create(c->threads, &c->pool);
    if (rc) {
        cpu_destroy(b);
        return moed_fail(err, rc, "CPU backend: could not start %d threads", c->threads);
    }
    *out = b;
    return 0;
}
