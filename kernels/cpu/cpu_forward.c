/*
 * cpu_forward — one MoE layer on the CPU: forward (route → expert GEMMs → combine) and the router
 * logits.
 *
 * A forward walks the route's (token, expert) pairs in order, in windows that fit the workspace;
 * each token's shared experts ride along as one more pair of weight 1 after its routed ones. Per
 * window: the pairs are counting-sorted by expert (stable, so by token then pair), the up-
 * projection with its activation fills H by sorted position, the down-projection fills R, and the
 * combine adds w * R to each token's float32 accumulator in the window's order — which is route
 * order, window after window. So a token's sum has one fixed order, and since each GEMM row is
 * independent of its neighbours, a token's output depends on nothing but its own row and route.
 * Every phase is a parallel-for over the pool; tasks split rows and columns, never the sum over k.
 */
#include "cpu_ctx.h"

#include "moed_dtype.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

/* Tokens per task when converting rows in and out. */
#define FWD_ROWS 8
/* Tokens per combine task. */
#define FWD_SEGS 8

typedef struct fwd {
    cpu_ctx *c;
    const moed_layer *l;
    int dtype;
    const moed_part *parts; /* where the rows come from and go to */
    int n_parts;
    bool out; /* a forward (rows go out), not router logits */
    const float
        *xf; /* the input rows in float32: a lone F32 part itself, or the workspace's copy */
    int64_t T;
    int d;
    int64_t n_blocks; /* row blocks of the current window */
    int n_seg;        /* tokens of the current window */
} fwd;

static cpu_ctx *ctx_of(moed_backend *b)
{
    return b->ctx;
}

/* ---- the phases (pool tasks) -------------------------------------------------------------- */

/* The part holding token t, and t's row within it. */
static const moed_part *part_of(const fwd *f, int64_t t, int64_t *row)
{
    int i = 0;
    while (t >= f->parts[i].rows) t -= f->parts[i++].rows;
    *row = t;
    return &f->parts[i];
}

/* Converts tokens [t0, t0 + n) in or out, a run of rows of one part at a time. */
static void rows_move(fwd *f, int64_t t0, int64_t n, bool in)
{
    const size_t d = (size_t)f->d, rb = d * moed_dtype_size(f->dtype);
    while (n > 0) {
        int64_t row;
        const moed_part *p = part_of(f, t0, &row);
        int64_t k = p->rows - row < n ? p->rows - row : n;
        if (in)
            moed_to_f32(f->dtype, (const char *)p->x + (size_t)row * rb,
                        f->c->ws.x + (size_t)t0 * d, (size_t)k * d);
        else
            moed_from_f32(f->dtype, f->c->ws.acc + (size_t)t0 * d, (char *)p->y + (size_t)row * rb,
                          (size_t)k * d);
        t0 += k;
        n -= k;
    }
}

static void task_rows_in(void *arg, int64_t task, int thread)
{
    (void)thread;
    fwd *f = arg;
    int64_t t0 = task * FWD_ROWS, n = f->T - t0 < FWD_ROWS ? f->T - t0 : FWD_ROWS;
    size_t d = (size_t)f->d;
    if (f->xf == f->c->ws.x) rows_move(f, t0, n, true);
    if (f->out) memset(f->c->ws.acc + (size_t)t0 * d, 0, (size_t)n * d * sizeof(float));
}

static void task_rows_out(void *arg, int64_t task, int thread)
{
    (void)thread;
    fwd *f = arg;
    int64_t t0 = task * FWD_ROWS, n = f->T - t0 < FWD_ROWS ? f->T - t0 : FWD_ROWS;
    rows_move(f, t0, n, false);
}

/* One (row block, column block) of the current product of each expert. */
static void task_gemm(void *arg, int64_t task, int thread)
{
    fwd *f = arg;
    cpu_ws *w = &f->c->ws;
    int64_t lo = 0, hi = f->n_blocks - 1; /* the last block whose first task is <= task */
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (w->block_task[mid] <= task)
            lo = mid;
        else
            hi = mid - 1;
    }
    const cpu_rowblock *rb = &w->blocks[lo];
    const moed_cpu_mm *g = &w->mm[rb->expert];
    int n0 = (int)(task - w->block_task[lo]) * MOED_CPU_NC;
    int nc = g->n - n0 < MOED_CPU_NC ? g->n - n0 : MOED_CPU_NC;
    moed_cpu_mm_block(g, rb->m0, rb->m, n0, nc, w->pack + (size_t)thread * f->c->pack_floats);
}

/* Adds the window's expert outputs to their tokens, each token's pairs in window order. */
static void task_combine(void *arg, int64_t task, int thread)
{
    (void)thread;
    fwd *f = arg;
    cpu_ws *w = &f->c->ws;
    size_t d = (size_t)f->d;
    int s1 = (int)(task + 1) * FWD_SEGS < f->n_seg ? (int)(task + 1) * FWD_SEGS : f->n_seg;
    for (int s = (int)task * FWD_SEGS; s < s1; s++) {
        float *acc = w->acc + (size_t)w->wtok[w->seg[s]] * d;
        for (int32_t i = w->seg[s]; i < w->seg[s + 1]; i++) {
            const float *r = w->r + (size_t)w->wpos[i] * d;
            float wt = w->ww[i];
            for (size_t j = 0; j < d; j++) acc[j] += wt * r[j];
        }
    }
}

/* ---- planning ----------------------------------------------------------------------------- */

/* Cuts each expert's sorted rows into row blocks. */
static void plan_blocks(fwd *f, int n_experts)
{
    cpu_ws *w = &f->c->ws;
    f->n_blocks = 0;
    for (int e = 0; e <= n_experts; e++)
        for (int64_t m0 = w->bucket[e]; m0 < w->bucket[e + 1]; m0 += MOED_CPU_MC) {
            int64_t m = w->bucket[e + 1] - m0;
            w->blocks[f->n_blocks++] =
                (cpu_rowblock){ e, m < MOED_CPU_MC ? (int)m : MOED_CPU_MC, m0 };
        }
}

/* Runs the product w->mm[block.expert] over every row block, split into column blocks. */
static void run_gemm(fwd *f)
{
    cpu_ws *w = &f->c->ws;
    w->block_task[0] = 0;
    for (int64_t i = 0; i < f->n_blocks; i++)
        w->block_task[i + 1] =
            w->block_task[i] + (w->mm[w->blocks[i].expert].n + MOED_CPU_NC - 1) / MOED_CPU_NC;
    moed_pool_run(f->c->pool, w->block_task[f->n_blocks], task_gemm, f);
}

/* Fills the window with the route's pairs from (*t, *j) on (j counting the token's pairs, the
 * shared experts last); returns how many. */
static int64_t fill_window(fwd *f, const moed_route *rt, int64_t *t, int64_t *j)
{
    cpu_ws *w = &f->c->ws;
    const moed_layer_info *li = &f->l->info;
    int shared = li->n_shared > 0;
    int64_t n = 0;
    f->n_seg = 0;
    while (*t < f->T && n < f->c->pw) {
        int64_t routed = rt->off[*t + 1] - rt->off[*t], cnt = routed + shared;
        if (*j < cnt) w->seg[f->n_seg++] = (int32_t)n;
        for (; *j < cnt && n < f->c->pw; (*j)++, n++) {
            w->wtok[n] = (int32_t)*t;
            w->wexp[n] = *j < routed ? rt->expert[rt->off[*t] + *j] : li->n_experts;
            w->ww[n] = *j < routed ? rt->weight[rt->off[*t] + *j] : 1.0f;
        }
        if (*j == cnt) {
            (*t)++;
            *j = 0;
        }
    }
    w->seg[f->n_seg] = (int32_t)n;
    return n;
}

/* Counting sort of the window's pairs by expert, stable. */
static void sort_window(fwd *f, int64_t n)
{
    cpu_ws *w = &f->c->ws;
    int E = f->l->info.n_experts;
    memset(w->bucket, 0, ((size_t)E + 2) * sizeof *w->bucket);
    for (int64_t i = 0; i < n; i++) w->bucket[w->wexp[i] + 1]++;
    for (int e = 0; e <= E; e++) w->bucket[e + 1] += w->bucket[e];
    /* bucket[e] is now expert e's first position; advance a copy in place, then undo */
    for (int64_t i = 0; i < n; i++) {
        int64_t p = w->bucket[w->wexp[i]]++;
        w->wpos[i] = (int32_t)p;
        w->stok[p] = w->wtok[i];
    }
    for (int e = E; e > 0; e--) w->bucket[e] = w->bucket[e - 1];
    w->bucket[0] = 0;
}

/* The two products of each expert: up (x -> H, with the activation) and down (H -> R). */
static void set_products(fwd *f, int up)
{
    cpu_ws *w = &f->c->ws;
    const moed_layer_info *li = &f->l->info;
    int ffw = li->d_ff > li->shared_d_ff ? li->d_ff : li->shared_d_ff;
    for (int e = 0; e <= li->n_experts; e++) {
        if (w->bucket[e + 1] == w->bucket[e]) continue;
        const moed_expert_w *ew = e < li->n_experts ? &f->l->experts[e] : &f->l->shared;
        int ff = e < li->n_experts ? li->d_ff : li->shared_d_ff;
        if (up)
            w->mm[e] = (moed_cpu_mm){ .a = f->xf,
                                      .rows = w->stok,
                                      .lda = (size_t)f->d,
                                      .k = f->d,
                                      .b = ew->w1,
                                      .b3 = li->act == MOED_ACT_SWIGLU ? ew->w3 : NULL,
                                      .bs = ew->s1,
                                      .b3s = ew->s3,
                                      .bdtype = li->wdtype,
                                      .n = ff,
                                      .act = li->act,
                                      .c = w->h,
                                      .ldc = (size_t)ffw };
        else
            w->mm[e] = (moed_cpu_mm){ .a = w->h,
                                      .lda = (size_t)ffw,
                                      .k = ff,
                                      .b = ew->w2,
                                      .bs = ew->s2,
                                      .bdtype = li->wdtype,
                                      .n = f->d,
                                      .act = MOED_ACT_NONE,
                                      .c = w->r,
                                      .ldc = (size_t)f->d };
    }
}

/* ---- checks ------------------------------------------------------------------------------- */

static int check_call(cpu_ctx *c, int exec, int slot, int dtype, int64_t T, moed_error *err)
{
    if (!c->started) return moed_fail(err, MOED_EINVAL, "the CPU backend is used before start()");
    if (exec != 0)
        return moed_fail(err, MOED_EINVAL,
                         "CPU backend: execution slot %d does not exist (it has "
                         "one, 0)",
                         exec);
    if (slot < 0 || slot >= c->n_layers)
        return moed_fail(err, MOED_ENOTFOUND, "CPU backend: layer slot %d is not loaded (%d are)",
                         slot, c->n_layers);
    if (dtype != MOED_F32 && dtype != MOED_F16 && dtype != MOED_BF16)
        return moed_fail(err, MOED_EINVAL,
                         "activations of dtype %s are not supported: use f32, f16 or bf16",
                         moed_dtype_name(dtype));
    if (T < 1 || T > c->max_tokens)
        return moed_fail(err, T < 1 ? MOED_EINVAL : MOED_ETOOBIG,
                         "%lld tokens: a job carries 1 to %lld (the backend's max_tokens)",
                         (long long)T, (long long)c->max_tokens);
    return 0;
}

/* The CPU reads and writes host memory only. */
static int check_parts(const moed_job *job, moed_error *err)
{
    for (int i = 0; i < job->n_parts; i++)
        if (job->parts[i].x_dev != MOED_HOST_MEM || job->parts[i].y_dev != MOED_HOST_MEM)
            return moed_fail(err, MOED_EPRECOND,
                             "part %d of the job lies in device memory; the cpu backend computes "
                             "from host memory only",
                             i);
    return 0;
}

/* The job's parts as the forward reads them: x converted into the workspace unless it is one F32
 * part, which the GEMMs read in place. */
static void set_parts(fwd *f, const moed_job *job)
{
    f->parts = job->parts;
    f->n_parts = job->n_parts;
    f->xf = job->dtype == MOED_F32 && job->n_parts == 1 ? job->parts[0].x : f->c->ws.x;
}

/* The route must fit the job and the layer, or the GEMMs would read out of bounds. */
static int check_route(const moed_route *r, int64_t T, int E, moed_error *err)
{
    if (!r || r->T != T || !r->off || r->off[0] != 0)
        return moed_fail(err, MOED_EINVAL, "the route has %lld tokens, the job %lld",
                         r ? (long long)r->T : -1LL, (long long)T);
    for (int64_t t = 0; t < T; t++) {
        if (r->off[t + 1] < r->off[t] || r->off[t + 1] > r->cap)
            return moed_fail(err, MOED_EINVAL, "the route's offsets are broken at token %lld",
                             (long long)t);
        for (int64_t p = r->off[t]; p < r->off[t + 1]; p++)
            if (r->expert[p] < 0 || r->expert[p] >= E || !isfinite(r->weight[p]) ||
                r->weight[p] < 0.0f)
                return moed_fail(err, MOED_EINVAL,
                                 "token %lld's pair %lld breaks the route's rules: experts are "
                                 "0..%d and weights finite and >= 0",
                                 (long long)t, (long long)(p - r->off[t]), E - 1);
    }
    return 0;
}

/* ---- entry points ------------------------------------------------------------------------- */

int moed_cpu_forward(moed_backend *b, int exec, const moed_job *job, moed_error *err)
{
    cpu_ctx *c = ctx_of(b);
    int rc = check_call(c, exec, job->slot, job->dtype, job->T, err);
    if (!rc) rc = check_parts(job, err);
    if (rc) return rc;
    const moed_layer *l = &c->layers[job->slot];
    if ((rc = check_route(job->route, job->T, l->info.n_experts, err))) return rc;
    fwd f = { .c = c, .l = l, .dtype = job->dtype, .out = true, .T = job->T, .d = l->info.d_model };
    set_parts(&f, job);
    int64_t row_tasks = (job->T + FWD_ROWS - 1) / FWD_ROWS;
    moed_pool_run(c->pool, row_tasks, task_rows_in, &f);
    int64_t t = 0, j = 0, n;
    while ((n = fill_window(&f, job->route, &t, &j)) > 0) {
        sort_window(&f, n);
        plan_blocks(&f, l->info.n_experts);
        set_products(&f, 1);
        run_gemm(&f);
        set_products(&f, 0);
        run_gemm(&f);
        moed_pool_run(c->pool, (f.n_seg + FWD_SEGS - 1) / FWD_SEGS, task_combine, &f);
    }
    moed_pool_run(c->pool, row_tasks, task_rows_out, &f);
    return 0;
}

int moed_cpu_router_logits(moed_backend *b, int exec, const moed_job *job, float *logits,
                           moed_error *err)
{
    cpu_ctx *c = ctx_of(b);
    const int64_t T = job->T;
    const int dtype = job->dtype;
    int rc = check_call(c, exec, job->slot, dtype, T, err);
    if (!rc) rc = check_parts(job, err);
    if (rc) return rc;
    const moed_layer *l = &c->layers[job->slot];
    if (!l->router)
        return moed_fail(err, MOED_EINVAL,
                         "layer %d has no router weights: send expert choices or router logits",
                         l->info.index);
    const int E = moed_layer_router_experts(&l->info);
    fwd f = { .c = c, .l = l, .dtype = dtype, .T = T, .d = l->info.d_model };
    set_parts(&f, job);
    moed_pool_run(c->pool, (T + FWD_ROWS - 1) / FWD_ROWS, task_rows_in, &f);
    cpu_ws *w = &c->ws;
    w->mm[0] = (moed_cpu_mm){ .a = f.xf,
                              .lda = (size_t)f.d,
                              .k = f.d,
                              .b = l->router,
                              .bdtype = moed_layer_router_dtype(l),
                              .n = E,
                              .act = MOED_ACT_NONE,
                              .c = logits,
                              .ldc = (size_t)E };
    f.n_blocks = 0;
    for (int64_t m0 = 0; m0 < T; m0 += MOED_CPU_MC)
        w->blocks[f.n_blocks++] =
            (cpu_rowblock){ 0, T - m0 < MOED_CPU_MC ? (int)(T - m0) : MOED_CPU_MC, m0 };
    run_gemm(&f);
    moed_router_round_logits(&l->info, dtype, logits, (size_t)T * (size_t)E);
    return 0;
}
