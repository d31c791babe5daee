/*
 * cuda_forward — one batch on an execution slot (the backend's forward and router_logits): the
 * job's tokens in, the pipeline of moed_cuda.h, the outputs out.
 *
 * A job's tokens come in parts (moed_backend.h), each copied in and out where it lies: host memory
 * by DMA (straight from pinned or registered pages), device memory device to device, another
 * GPU's memory (another of the backend's, or one it does not compute on, where a client's region
 * lies) by a peer copy, which goes over NVLink or PCIe where peer access is enabled
 * (cuda_regions.c) and is staged through host memory by the driver where not. A lone part already
 * on the layer's GPU is not copied at all: the convert stage reads it and the combine writes the
 * part's output in place (except for batches a graph replays, whose buffers are captured: there the
 * part costs one small device copy). When a batch runs in chunks (more pairs than the workspace
 * holds), the next chunk's rows come in on the slot's copy stream while the current chunk
 * computes, and the route staging alternates between two halves, so chunks never wait for the
 * host; tokens are independent, so chunks change nothing in the result. Everything a batch does is
 * queued on its slot's stream with no device-to-host synchronisation until the output copy; slots
 * run concurrently, so one batch's copies overlap another's kernels.
 *
 * A split layer's home slot runs its jobs (moed_cuda.h: the pipeline in two pieces): each part
 * takes only the rows of x of its own tokens, gathered over peer access from the home slot's x
 * (or, without peer access, x's rows copied over into a landing buffer and gathered there), runs
 * its pairs in a workspace of its own and sums one fp32 partial row per token, into the home
 * slot's partial rows on the home GPU or, on another, into its landing buffer and then by a copy
 * (run_part says why); meanwhile the home runs the shared experts, then adds each token's partial
 * rows in part order. x always comes into the home slot's own buffer first (a device copy where
 * it lies on the home GPU), because the parts' kernels read it over peer access, which covers
 * memory moed allocated but not a client's mapped region.
 *
 * Parts that bring their routing in device memory (moed_part_route): the host packs the job's host
 * pairs and the offsets of every token, k slots for each device-routed one, and after the upload a
 * route_choice kernel per such part and chunk checks and packs its choice into its slots where it
 * lies (a choice on another GPU, the backend's or not, is first copied into those slots). Each
 * part's status word comes back with the outputs, before the one synchronisation at the end. A
 * split layer splits its pairs on the host, so there the choices are read to the host first
 * (moed_backend_host_route: the one place this file allocates during a job).
 */
#include "cuda_ctx.h"

#include "moed_dtype.h"

#include <string.h>

/* ---- parts ------------------------------------------------------------------------------- */

/* Queues the copy of n bytes from src (on device sdev, or host memory) to dst (on device ddev, or
 * host memory) on s: DMA for host memory, device to device, or a peer copy between GPUs. */
static void copy_async(void *dst, int ddev, const void *src, int sdev, size_t n, cudaStream_t s)
{
    if (sdev != MOED_HOST_MEM && ddev != MOED_HOST_MEM && sdev != ddev)
        cudaMemcpyPeerAsync(dst, ddev, src, sdev, n, s);
    else
        cudaMemcpyAsync(dst, src, n,
                        sdev == MOED_HOST_MEM   ? cudaMemcpyHostToDevice
                        : ddev == MOED_HOST_MEM ? cudaMemcpyDeviceToHost
                                                : cudaMemcpyDeviceToDevice,
                        s);
}

/* Queues the copies between tokens [t0, t1) of the job's parts and rows `dev` of the slot's device
 * (dev holds token t0 first, rb bytes a row): into dev (in) or out of it. */
static void parts_copy(const cuda_exec *x, const moed_job *job, int64_t t0, int64_t t1, char *dev,
                       size_t rb, bool in, cudaStream_t s)
{
    int64_t first = 0;
    for (int i = 0; i < job->n_parts && first < t1; first += job->parts[i++].rows) {
        const moed_part *p = &job->parts[i];
        const int64_t lo = first > t0 ? first : t0,
                      hi = first + p->rows < t1 ? first + p->rows : t1;
        if (lo >= hi) continue;
        char *d = dev + (size_t)(lo - t0) * rb;
        const size_t n = (size_t)(hi - lo) * rb, at = (size_t)(lo - first) * rb;
        if (in)
            copy_async(d, x->device, (const char *)p->x + at, p->x_dev, n, s);
        else
            copy_async((char *)p->y + at, p->y_dev, d, x->device, n, s);
    }
}

/* The job's lone part's input (or output) when it already lies on the slot's device: the kernels
 * then read (write) it in place. NULL otherwise. */
static const void *lone_x(const cuda_exec *x, const moed_job *job)
{
    return job->n_parts == 1 && job->parts[0].x_dev == x->device ? job->parts[0].x : NULL;
}

static void *lone_y(const cuda_exec *x, const moed_job *job)
{
    return job->n_parts == 1 && job->parts[0].y_dev == x->device ? job->parts[0].y : NULL;
}

/* ---- one batch ----------------------------------------------------------------------------- */

/* A host route as the packer reads it: no device-routed tokens. */
static moed_cuda_route_src host_src(const moed_route *rt)
{
    return (moed_cuda_route_src){ rt->off, rt->expert, rt->weight, rt->off, NULL, 0 };
}

/* Packs tokens [t0, t1) of the route into half h of the slot's pinned staging (once that half's
 * last upload is done), uploads it, and lays route prep's arrays out behind it for m-tiles of bm
 * rows; with tok (a split layer's part), uploads its T token numbers into x->tok too. */
static void stage_route(cuda_exec *x, int h, const moed_cuda_route_src *src, int64_t t0, int64_t t1,
                        int E, int bm, const int32_t *tok)
{
    const int64_t T = t1 - t0, P = src->lay[t1] - src->lay[t0];
    const size_t in = moed_cuda_route_in_words(T, P);
    cudaEventSynchronize(x->routed[h]);
    moed_cuda_route_pack(x->h_route[h], src, t0, t1);
    moed_cuda_route_layout(&x->r, x->route, T, P, E, bm);
    cudaMemcpyAsync(x->route, x->h_route[h], in * 4, cudaMemcpyHostToDevice, x->stream);
    if (tok) {
        memcpy(x->h_route[h] + in, tok, sizeof *tok * (size_t)T);
        cudaMemcpyAsync(x->tok, x->h_route[h] + in, sizeof *tok * (size_t)T, cudaMemcpyHostToDevice,
                        x->stream);
    }
    cudaEventRecord(x->routed[h], x->stream);
}

/* The range a device choice's ids are checked against: the layer's experts, or on an expert
 * shard the whole layer's (moed_backend.h), which L->local_of renumbers. */
static int choice_ids(const cuda_layer *L)
{
    return L->local_of ? moed_layer_router_experts(&L->info) : L->info.n_experts;
}

/* Each device run's tokens of [t0, t1), checked and packed into the slots of the route just
 * uploaded (x->r): read where they lie on the slot's GPU, or first copied into those very slots
 * from another GPU. Run i's refusals go to status word i. */
static int stage_choices(cuda_exec *x, const cuda_layer *L, const moed_cuda_route_src *src,
                         int64_t t0, int64_t t1)
{
    int rc = 0;
    for (int i = 0; i < src->n_runs && !rc; i++) {
        const moed_cuda_drun *u = &src->runs[i];
        const int64_t lo = u->t0 > t0 ? u->t0 : t0,
                      hi = u->t0 + u->rows < t1 ? u->t0 + u->rows : t1;
        if (lo >= hi) continue;
        moed_cuda_choice ch = { .ids = u->ids + (lo - u->t0) * u->k,
                                .w = u->w + (lo - u->t0) * u->k,
                                .row0 = lo - u->t0,
                                .rows = hi - lo,
                                .k = u->k,
                                .E = L->info.n_experts,
                                .n_ids = choice_ids(L),
                                .local_of = L->local_of,
                                .tok0 = (int32_t)(lo - t0),
                                .pair0 = (int32_t)(src->lay[lo] - src->lay[t0]),
                                .bad = x->bad + i };
        if (u->dev != x->device) {
            const size_t n = (size_t)ch.rows * (size_t)u->k;
            int32_t *ids = (int32_t *)x->r.pair_exp + ch.pair0;
            float *w = (float *)x->r.pair_w + ch.pair0;
            copy_async(ids, x->device, ch.ids, u->dev, n * sizeof *ids, x->stream);
            copy_async(w, x->device, ch.w, u->dev, n * sizeof *w, x->stream);
            ch.ids = ids;
            ch.w = w;
        }
        rc = moed_cuda_route_choice(&ch, &x->r, x->stream);
    }
    return rc;
}

/* Count of experts with pairs in tokens [t0, t1), for choosing the tile before staging. A device
 * run's experts are unknown here: each of its slots counts as one more, up to `most`, which only
 * steers the tile's shape: E, or on an expert shard the whole layer's experts, over which its
 * slots spread, held or not (so the rows an expert come out as the held ones get them). */
static int active_experts(const moed_cuda_route_src *src, int64_t t0, int64_t t1, int E, int most)
{
    static _Thread_local uint8_t seen[4096];
    int n = 0;
    memset(seen, 0, (size_t)E);
    for (int64_t j = src->off[t0]; j < src->off[t1]; j++)
        if (!seen[src->expert[j]]) {
            seen[src->expert[j]] = 1;
            n++;
        }
    const int64_t dev = (src->lay[t1] - src->lay[t0]) - (src->off[t1] - src->off[t0]);
    return n + dev < most ? (int)(n + dev) : most;
}

/* The slot's graph for this key, captured on first use (evicting the least recently used); NULL if
 * capture fails, and the caller launches directly. While a link is live a key without a graph
 * gets none: an instantiation can wait for every kernel on the GPU, and an idle link's receive
 * runs until its caller's next call, which may wait for this batch (seen on H200s: a worker's
 * cudaGraphInstantiate of a new shape returned only once the link's caller stopped waiting;
 * docs/fleets.md, "What waits for an idle link"). */
static cudaGraphExec_t graph_for(cuda_ctx *c, cuda_exec *x, const cuda_layer *L, const graph_key *k)
{
    graph_entry *victim = &x->graphs[0];
    for (int i = 0; i < GRAPH_CACHE; i++) {
        graph_entry *g = &x->graphs[i];
        if (g->exec && !memcmp(&g->key, k, sizeof *k)) {
            g->used = ++x->graph_clock;
            return g->exec;
        }
        if (g->used < victim->used) victim = g;
    }
    if (atomic_load_explicit(&c->links_live, memory_order_relaxed)) return NULL;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    if (cudaStreamBeginCapture(x->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
        goto fail;
    const int rc = moed_cuda_pipeline(&L->k, &x->r, &x->w, k->x, k->dtype, k->out,
                                      c->sm[cuda_dev_index(c, x->device)], k->n_active,
                                      c->force_kernel, x->stream, NULL);
    if (cudaStreamEndCapture(x->stream, &graph) != cudaSuccess || rc) goto fail;
    if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) goto fail;
    cudaGraphDestroy(graph);
    if (victim->exec) cudaGraphExecDestroy(victim->exec);
    victim->key = *k;
    victim->exec = exec;
    victim->used = ++x->graph_clock;
    return exec;
fail:
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError(); /* capture errors are not sticky: clear them and launch directly */
    return NULL;
}

/* What a batch reads and writes on the device, decided once for all its chunks. */
typedef struct batch_io {
    size_t rb;            /* bytes of one row of x and y */
    const void *x_direct; /* the lone part's input on this device, read in place; or NULL */
    void *y_direct;       /* the lone part's output on this device, written in place; or NULL */
} batch_io;

/* Computes tokens [t0, t1) (chunk number `chunk`), whose rows are in (or, direct, need not be
 * copied to) x_in from row t0 on, and queues their outputs' copies. */
static int run_chunk(cuda_ctx *c, cuda_exec *x, const cuda_layer *L, const moed_job *job,
                     const moed_cuda_route_src *src, const batch_io *io, int chunk, int64_t t0,
                     int64_t t1)
{
    const int E = L->info.n_experts;
    const int64_t T = t1 - t0, P = src->lay[t1] - src->lay[t0];
    const int n_act = active_experts(src, t0, t1, E, choice_ids(L));
    const int sm = c->sm[cuda_dev_index(c, x->device)];
    stage_route(x, chunk & 1, src, t0, t1, E,
                moed_cuda_tile_bm(sm, P, n_act, moed_cuda_routed_wfmt(&L->k), c->force_kernel),
                NULL);
    x->r.null_row = cuda_null_row(c, L->k.d_pad);
    const void *xin = io->x_direct ? io->x_direct : (char *)x->x_in + (size_t)t0 * io->rb;
    void *out = io->y_direct ? io->y_direct : (char *)x->out + (size_t)t0 * io->rb;
    int rc = stage_choices(x, L, src, t0, t1);
    cudaGraphExec_t graph = NULL;
    if (!rc && P <= GRAPH_MAX_PAIRS && !io->x_direct && !io->y_direct) {
        graph_key k;
        memset(&k, 0, sizeof k); /* compared with memcmp: no stray padding bytes */
        k.slot = job->slot;
        k.dtype = job->dtype;
        k.n_active = n_act;
        k.T = T;
        k.P = P;
        k.x = xin;
        k.out = out;
        graph = graph_for(c, x, L, &k);
    }
    if (graph)
        rc = cudaGraphLaunch(graph, x->stream) == cudaSuccess ? 0 : MOED_EDEVICE;
    else if (!rc)
        rc = moed_cuda_pipeline(&L->k, &x->r, &x->w, xin, job->dtype, out, sm, n_act,
                                c->force_kernel, x->stream, NULL);
    if (!io->y_direct) parts_copy(x, job, t0, t1, out, io->rb, false, x->stream);
    return rc;
}

/* Part i of split layer L for home slot x, chunk `chunk` of T tokens whose rows (rb bytes each)
 * are in x->x_in from row t0 on: after x's inputs are ready, takes the rows of the part's tokens
 * (q->sub, numbered in tok) and runs its pairs, into one fp32 partial row per token at `sums` in
 * x's partial rows; records q->done. On another GPU the partial rows are summed into the landing
 * buffer and copied home: a kernel's scattered 4-byte stores cost far more over the link than on
 * the GPU's own memory, where a copy engine's transfer runs at the link's rate. */
static int run_part(cuda_ctx *c, cuda_exec *x, const cuda_layer *L, int i, int chunk, int dtype,
                    int64_t t0, int64_t T, size_t rb, const int32_t *tok, float *sums)
{
    const cuda_part *pt = &L->sp.parts[i];
    cuda_exec *q = &x->parts[pt->entry];
    const int64_t Tp = q->sub.T;
    const int d = L->info.d_model;
    if (!Tp) return 0; /* no pair here: nothing to wait for either */
    const moed_cuda_route_src src = host_src(&q->sub);
    const int64_t P = src.lay[Tp];
    const int sm = c->sm[pt->entry], n_act = active_experts(&src, 0, Tp, pt->k.E, pt->k.E);
    const bool here = q->device == x->device,
               peer = c->direct[pt->entry][cuda_dev_index(c, x->device)];
    const char *xin = (const char *)x->x_in + (size_t)t0 * rb;
    cudaSetDevice(q->device);
    cudaStreamWaitEvent(q->stream, x->ready, 0);
    stage_route(q, chunk & 1, &src, 0, Tp, pt->k.E,
                moed_cuda_tile_bm(sm, P, n_act, moed_cuda_routed_wfmt(&pt->k), c->force_kernel),
                tok);
    if (!peer) { /* x's rows come over by a copy, and are gathered here */
        copy_async(q->landing, q->device, xin, x->device, (size_t)T * rb, q->stream);
        xin = q->landing;
    }
    int rc = moed_cuda_gather_rows(q->x_in, xin, q->tok, (int)Tp, rb, q->stream);
    if (!rc)
        rc = moed_cuda_pipeline_routed(&pt->k, &q->r, &q->w, q->x_in, dtype, sm, n_act,
                                       c->force_kernel, q->stream);
    if (!rc)
        rc = moed_cuda_combine(&q->r, q->w.y, NULL, L->k.cdtype, d, L->k.d_pad,
                               here ? (void *)sums : q->landing, MOED_F32, q->stream);
    if (!rc && !here)
        copy_async(sums, x->device, q->landing, q->device, sizeof(float) * (size_t)(Tp * d),
                   q->stream);
    cudaEventRecord(q->done, q->stream);
    return rc;
}

/* Tokens [t0, t1) of a job on split layer L (moed_cuda.h: the pipeline in two pieces), its route
 * rt all on the host, their rows in x->x_in: the home slot x uploads where each token's partial
 * rows will be, the parts run their pairs, x runs the shared experts meanwhile, then waits for the
 * parts, adds up each token and queues the outputs' copies. */
static int run_split_chunk(cuda_ctx *c, cuda_exec *x, const cuda_layer *L, const moed_job *job,
                           const moed_route *rt, const batch_io *io, int chunk, int64_t t0,
                           int64_t t1)
{
    const cuda_split *sp = &L->sp;
    const int n = sp->n, sm = c->sm[cuda_dev_index(c, x->device)], h = chunk & 1;
    const int64_t T = t1 - t0;
    const void *xin = (char *)x->x_in + (size_t)t0 * io->rb;
    void *out = io->y_direct ? io->y_direct : (char *)x->out + (size_t)t0 * io->rb;
    moed_route sub[MAX_DEVICES];
    for (int i = 0; i < n; i++) sub[i] = x->parts[sp->parts[i].entry].sub;
    cudaEventSynchronize(x->routed[h]); /* the staging half's last upload is done */
    int32_t *row = x->h_route[h];
    if (sp->copy_off) {
        const moed_route_copies cp = { sp->copy_off, sp->copy_part, sp->copy_local };
        moed_route_split_copies(rt, t0, t1, &cp, n, sub, x->ptok, row);
    } else {
        moed_route_split(rt, t0, t1, sp->part_of, sp->first, n, sub, x->ptok, row);
    }
    for (int i = 0; i < n; i++) x->parts[sp->parts[i].entry].sub.T = sub[i].T;
    cudaMemcpyAsync(x->prow, row, sizeof *row * (size_t)(n * T), cudaMemcpyHostToDevice, x->stream);
    cudaEventRecord(x->routed[h], x->stream);
    cudaEventRecord(x->ready, x->stream);
    float *sums[MAX_DEVICES];
    sums[0] = x->psum;
    for (int i = 1; i < n; i++) sums[i] = sums[i - 1] + (size_t)sub[i - 1].T * L->info.d_model;
    /* The host prepares each part's route before launching it (a few tenths of a millisecond at
     * large T), so the parts on other GPUs, whose rows then travel home, are launched first, then
     * the shared experts, then the parts on the home GPU. */
    int rc = 0;
    for (int i = 0; i < n && !rc; i++)
        if (sp->parts[i].device != x->device)
            rc = run_part(c, x, L, i, chunk, job->dtype, t0, T, io->rb, x->ptok + i * T, sums[i]);
    cudaSetDevice(x->device);
    if (!rc)
        rc = moed_cuda_pipeline_shared(&L->k, T, &x->w, xin, job->dtype, sm, c->force_kernel,
                                       x->stream);
    for (int i = 0; i < n && !rc; i++)
        if (sp->parts[i].device == x->device)
            rc = run_part(c, x, L, i, chunk, job->dtype, t0, T, io->rb, x->ptok + i * T, sums[i]);
    cudaSetDevice(x->device);
    for (int i = 0; i < n; i++)
        if (sub[i].T) cudaStreamWaitEvent(x->stream, x->parts[sp->parts[i].entry].done, 0);
    if (!rc)
        rc = moed_cuda_combine_parts(x->prow, n, T, x->psum, L->k.s13 ? x->w.ys : NULL, L->k.cdtype,
                                     L->info.d_model, L->k.d_pad, out, job->dtype, x->stream);
    if (!io->y_direct) parts_copy(x, job, t0, t1, out, io->rb, false, x->stream);
    return rc;
}

static int finish(cuda_exec *x, int rc, const char *what, moed_error *err)
{
    cudaError_t e = cudaStreamSynchronize(x->stream);
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_fail(err, e, what);
    if (rc)
        return moed_fail(err, rc, "%s: a kernel launch was refused (%s)", what, moed_strerror(rc));
    return 0;
}

/* The slot and layer of a call, checked. */
static int check_call(cuda_ctx *c, int exec, const moed_job *job, moed_error *err)
{
    if (exec < 0 || exec >= c->n_exec || job->slot < 0 || job->slot >= c->n_layers)
        return moed_fail(err, MOED_EINVAL, "no execution slot %d or layer slot %d", exec,
                         job->slot);
    const cuda_layer *L = &c->layers[job->slot];
    if (L->device != c->execs[exec].device)
        return moed_fail(err, MOED_EINVAL, "layer slot %d lives on GPU %d, not on slot %d's GPU %d",
                         job->slot, L->device, exec, c->execs[exec].device);
    if (job->T > c->max_tokens)
        return moed_fail(err, MOED_ETOOBIG,
                         "%lld tokens is over the %lld the workspace was sized for",
                         (long long)job->T, (long long)c->max_tokens);
    return 0;
}

/* The end of the chunk that starts at token t0: as many tokens as the workspace's pairs hold (lay:
 * the packed route's offsets). */
static int chunk_end(const cuda_ctx *c, const int64_t *lay, int64_t T, int64_t t0, int64_t *t1,
                     moed_error *err)
{
    int64_t e = t0 + 1;
    while (e < T && lay[e + 1] - lay[t0] <= c->max_pairs) e++;
    *t1 = e;
    if (lay[e] - lay[t0] <= c->max_pairs) return 0;
    return moed_fail(err, MOED_ETOOBIG, "token %lld has %lld pairs, over the workspace's %lld",
                     (long long)t0, (long long)(lay[e] - lay[t0]), (long long)c->max_pairs);
}

/* The job's route as slot x packs it, in *src: its host route, with its parts' device routing as
 * runs (in x->lay and x->runs); or, for split layer L, all on the host in *host
 * (moed_backend_host_route, which sets those parts' statuses). */
static int job_route(moed_backend *b, cuda_exec *x, const cuda_layer *L, const moed_job *job,
                     moed_cuda_route_src *src, moed_route *host, moed_error *err)
{
    cuda_ctx *c = b->ctx;
    const moed_route *rt = job->route;
    bool any = false;
    for (int i = 0; i < job->n_parts; i++) any |= job->parts[i].route != NULL;
    if (any && L->sp.parts) {
        int rc = moed_backend_host_route(b, job, choice_ids(L), L->local_of_host, host, err);
        if (rc) return rc;
        rt = host;
        any = false;
    }
    *src = host_src(rt);
    if (!any) return 0;
    src->runs = x->runs;
    for (int64_t i = 0, t = 0; i < job->n_parts; t += job->parts[i++].rows) {
        const moed_part_route *pr = job->parts[i].route;
        if (!pr) continue;
        if (pr->dev < 0 || pr->dev >= c->n_gpus)
            return moed_fail(err, MOED_EINVAL,
                             "part %lld's routing lies on GPU %d, which this process does not see",
                             (long long)i, pr->dev);
        x->runs[src->n_runs++] =
            (moed_cuda_drun){ t, job->parts[i].rows, pr->k, pr->ids, pr->weights, pr->dev };
    }
    moed_cuda_route_offsets(x->lay, rt->off, job->T, x->runs, src->n_runs);
    src->lay = x->lay;
    return 0;
}

/* Each device-routed part's status, from its word as it came back (x->h_bad, in part order). */
static void part_statuses(const cuda_exec *x, const moed_job *job, int E)
{
    for (int i = 0, r = 0; i < job->n_parts; i++) {
        moed_part_route *pr = job->parts[i].route;
        if (!pr) continue;
        const unsigned long long bad = x->h_bad[r++];
        memset(&pr->err, 0, sizeof pr->err);
        if (bad != ~0ULL) moed_choice_fail(&pr->err, (int64_t)bad, pr->k, E);
    }
}

int cuda_forward(moed_backend *b, int exec, const moed_job *job, moed_error *err)
{
    cuda_ctx *c = b->ctx;
    int rc = check_call(c, exec, job, err);
    if (rc) return rc;
    cuda_exec *x = &c->execs[exec];
    const cuda_layer *L = &c->layers[job->slot];
    moed_cuda_route_src src;
    moed_route host = { 0 };
    /* the layer's placement stays as it is until this job's last synchronisation (cuda_ctx.h) */
    pthread_rwlock_rdlock(L->lock);
    if ((rc = job_route(b, x, L, job, &src, &host, err))) goto out;
    const moed_route *rt = host.off ? &host : job->route;
    const int64_t *lay = src.lay;
    cudaSetDevice(x->device);
    const bool one_chunk = lay[job->T] <= c->max_pairs;
    /* In place only where no graph is replayed: a graph's buffers are the slot's own. A split
     * layer's parts read x from the slot's own buffer (see the top of this file). */
    const bool in_place = one_chunk && lay[job->T] > GRAPH_MAX_PAIRS;
    const batch_io io = { .rb = (size_t)L->info.d_model * moed_dtype_size(job->dtype),
                          .x_direct = in_place && !L->sp.parts ? lone_x(x, job) : NULL,
                          .y_direct = in_place ? lone_y(x, job) : NULL };
    int64_t t1;
    if ((rc = chunk_end(c, lay, job->T, 0, &t1, err))) goto out;
    if (src.n_runs) cudaMemsetAsync(x->bad, 0xff, sizeof *x->bad * (size_t)src.n_runs, x->stream);
    if (!io.x_direct) parts_copy(x, job, 0, t1, x->x_in, io.rb, true, x->stream);
    int too_big = 0;
    for (int64_t t0 = 0, chunk = 0; t0 < job->T && !rc; chunk++) {
        int64_t t2 = t1;
        if (t1 < job->T && (too_big = chunk_end(c, lay, job->T, t1, &t2, err))) break;
        if (t1 < job->T) { /* the next chunk's rows come in while this one computes */
            parts_copy(x, job, t1, t2, (char *)x->x_in + (size_t)t1 * io.rb, io.rb, true, x->copy);
            cudaEventRecord(x->copied, x->copy);
        }
        rc = L->sp.parts ? run_split_chunk(c, x, L, job, rt, &io, (int)chunk, t0, t1)
                         : run_chunk(c, x, L, job, &src, &io, (int)chunk, t0, t1);
        if (t1 < job->T) cudaStreamWaitEvent(x->stream, x->copied, 0);
        t0 = t1;
        t1 = t2;
    }
    if (too_big) {
        cudaStreamSynchronize(x->copy);
        cudaStreamSynchronize(x->stream);
        rc = too_big;
        goto out;
    }
    if (src.n_runs)
        cudaMemcpyAsync(x->h_bad, x->bad, sizeof *x->bad * (size_t)src.n_runs,
                        cudaMemcpyDeviceToHost, x->stream);
    if (!(rc = finish(x, rc, "forward", err)) && src.n_runs) part_statuses(x, job, choice_ids(L));
out:
    pthread_rwlock_unlock(L->lock);
    moed_route_free(&host);
    return rc;
}

int cuda_router_logits(moed_backend *b, int exec, const moed_job *job, float *logits,
                       moed_error *err)
{
    cuda_ctx *c = b->ctx;
    int rc = check_call(c, exec, job, err);
    if (rc) return rc;
    cuda_exec *x = &c->execs[exec];
    const cuda_layer *L = &c->layers[job->slot];
    if (!L->router)
        return moed_fail(err, MOED_EINVAL, "layer %d has no router weights", L->info.index);
    const int d = L->info.d_model, E = moed_layer_router_experts(&L->info);
    const int64_t T = job->T;
    cudaSetDevice(x->device);
    const void *xin = lone_x(x, job);
    if (!xin) {
        parts_copy(x, job, 0, T, x->x_in, (size_t)d * moed_dtype_size(job->dtype), true, x->stream);
        xin = x->x_in;
    }
    rc = moed_cuda_router_logits(xin, job->dtype, T, d, L->router, L->router_dtype, E, x->logits,
                                 x->stream);
    if (!rc)
        cudaMemcpyAsync(logits, x->logits, (size_t)T * E * sizeof(float), cudaMemcpyDeviceToHost,
                        x->stream);
    const int done = finish(x, rc, "router logits", err);
    if (!done) moed_router_round_logits(&L->info, job->dtype, logits, (size_t)T * E);
    return done;
}
