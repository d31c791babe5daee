/*
 * moed_backend — the calls every caller makes: each forwards to the implementation's table and
 * supplies the default where the implementation leaves a slot empty, so no caller tests a slot.
 * Each implementation lives in its own folder (cpu/, cuda/) and the registry (moed_registry.c)
 * opens one by name; this file only dispatches, so it names no implementation.
 */
#include "moed_backend_impl.h"

#include "moed_link.h"

#include <stdlib.h>
#include <string.h>

/* Alignment of the default host memory: a cache line, and enough for any vector load. */
#define HOST_ALIGN 64

const char *moed_backend_name(const moed_backend *b)
{
    return b->ops->name;
}

bool moed_backend_computes_from_host(const moed_backend *b)
{
    return b->ops->computes_from_host;
}

int moed_backend_load_layer(moed_backend *b, int slot, const moed_layer *l, moed_error *err)
{
    return b->ops->load_layer(b, slot, l, err);
}

int moed_backend_start(moed_backend *b, moed_error *err)
{
    return b->ops->start(b, err);
}

int moed_backend_n_exec(const moed_backend *b)
{
    return b->n_exec;
}

int moed_backend_n_devices(const moed_backend *b)
{
    return b->n_devices;
}

/* The job as implementations see it: with its parts (one part of host memory when it named none),
 * and every part's rows adding up to T. */
static int with_parts(const moed_job *job, moed_job *out, moed_part *one, moed_error *err)
{
    *out = *job;
    if (!job->n_parts) {
        *one = (moed_part){
            .rows = job->T, .x = job->x, .x_dev = MOED_HOST_MEM, .y = job->y, .y_dev = MOED_HOST_MEM
        };
        out->parts = one;
        out->n_parts = 1;
        return 0;
    }
    int64_t rows = 0;
    for (int i = 0; i < job->n_parts; i++) {
        if (job->parts[i].rows < 1)
            return moed_fail(err, MOED_EINVAL, "part %d of the job has %lld rows", i,
                             (long long)job->parts[i].rows);
        rows += job->parts[i].rows;
    }
    if (rows != job->T)
        return moed_fail(err, MOED_EINVAL, "the job's parts hold %lld rows, its T is %lld",
                         (long long)rows, (long long)job->T);
    return 0;
}

static int no_devices(const moed_backend *b, moed_error *err)
{
    return moed_fail(
        err, MOED_EPRECOND,
        "this server runs the %s backend; CUDA regions need the cuda backend (register "
        "a host region, or send the tensor inline)",
        b->ops->name);
}

static int check_route_tokens(const moed_job *job, moed_error *err)
{
    const moed_route *rt = job->route;
    if (rt && rt->T == job->T) return 0;
    return moed_fail(err, MOED_EINVAL, "the job's route has %lld tokens, its T is %lld",
                     rt ? (long long)rt->T : -1LL, (long long)job->T);
}

/* The job's parts that bring device routing: on a backend with devices, well formed, and with no
 * pair of theirs in the job's route (which must then cover the job's tokens). */
static int check_part_routes(const moed_backend *b, const moed_job *job, moed_error *err)
{
    const moed_route *rt = job->route;
    bool any = false;
    for (int i = 0; i < job->n_parts; i++) any |= job->parts[i].route != NULL;
    int rc = any ? check_route_tokens(job, err) : 0;
    if (!any || rc) return rc;
    int64_t t = 0;
    for (int i = 0; i < job->n_parts; t += job->parts[i++].rows) {
        const moed_part_route *pr = job->parts[i].route;
        if (!pr) continue;
        if (!b->ops->read_device) return no_devices(b, err);
        if (pr->k < 1 || !pr->ids || !pr->weights)
            return moed_fail(err, MOED_EINVAL,
                             "part %d's device routing has k = %d%s: it needs k >= 1 and both "
                             "tensors",
                             i, pr->k, pr->ids && pr->weights ? "" : " and a NULL tensor");
        const int64_t pairs = rt->off[t + job->parts[i].rows] - rt->off[t];
        if (pairs)
            return moed_fail(err, MOED_EINVAL,
                             "part %d brings its routing in device memory, but the job's route "
                             "holds %lld pairs for its tokens (it must hold none)",
                             i, (long long)pairs);
    }
    return 0;
}

int moed_backend_forward(moed_backend *b, int exec, const moed_job *job, moed_error *err)
{
    moed_job j;
    moed_part one;
    int rc = with_parts(job, &j, &one, err);
    if (!rc) rc = check_part_routes(b, &j, err);
    return rc ? rc : b->ops->forward(b, exec, &j, err);
}

/* Reads part p's device choice (rows x k) to the host and checks it: its own route in *r, with no
 * pair when it fails (its status in p->route->err either way). */
static int read_choice(moed_backend *b, const moed_part *p, int n_experts, const int32_t *local_of,
                       moed_route *r, moed_error *err)
{
    moed_part_route *pr = p->route;
    const size_t n = (size_t)p->rows * (size_t)pr->k;
    int32_t *ids = malloc(n * sizeof *ids);
    float *w = malloc(n * sizeof *w);
    int rc = ids && w ? 0 : moed_fail(err, MOED_ENOMEM, "no memory to read a part's routing");
    if (!rc) rc = b->ops->read_device(b, ids, pr->ids, pr->dev, n * sizeof *ids, err);
    if (!rc) rc = b->ops->read_device(b, w, pr->weights, pr->dev, n * sizeof *w, err);
    if (!rc) {
        const int64_t bad = moed_choice_check(ids, w, p->rows, pr->k, n_experts);
        memset(&pr->err, 0, sizeof pr->err);
        if (bad >= 0) moed_choice_fail(&pr->err, bad, pr->k, n_experts);
        if (bad >= 0 ? moed_route_init(r, p->rows, 0)
                     : moed_route_from_choice(r, ids, w, p->rows, pr->k, n_experts, err))
            rc = moed_fail(err, MOED_ENOMEM, "no memory for the route of a part of %lld tokens",
                           (long long)p->rows);
        else if (local_of)
            moed_route_localize(r, local_of);
    }
    free(ids);
    free(w);
    return rc;
}

/* Appends tokens [a, b) of src to out, whose tokens before *t are written; *t moves past them. */
static void route_append_tokens(moed_route *out, int64_t *t, const moed_route *src, int64_t a,
                                int64_t b)
{
    int64_t n = out->off[*t];
    for (int64_t u = a; u < b; u++) {
        for (int64_t q = src->off[u]; q < src->off[u + 1]; q++, n++) {
            out->expert[n] = src->expert[q];
            out->weight[n] = src->weight[q];
        }
        out->off[++*t] = n;
    }
}

int moed_backend_host_route(moed_backend *b, const moed_job *job, int n_experts,
                            const int32_t *local_of, moed_route *out, moed_error *err)
{
    moed_job j;
    moed_part one;
    memset(out, 0, sizeof *out);
    int rc = with_parts(job, &j, &one, err);
    if (!rc) rc = check_route_tokens(&j, err);
    if (!rc) rc = check_part_routes(b, &j, err);
    if (rc) return rc;
    moed_route *own = calloc((size_t)j.n_parts, sizeof *own); /* the device parts' routes */
    int64_t pairs = j.route->off[j.T];
    if (!own) rc = moed_fail(err, MOED_ENOMEM, "no memory for the job's route");
    for (int i = 0; i < j.n_parts && !rc; i++)
        if (j.parts[i].route &&
            !(rc = read_choice(b, &j.parts[i], n_experts, local_of, &own[i], err)))
            pairs += own[i].off[j.parts[i].rows];
    if (!rc && moed_route_init(out, j.T, pairs))
        rc = moed_fail(err, MOED_ENOMEM, "no memory for a route of %lld pairs", (long long)pairs);
    for (int64_t i = 0, t = 0; i < j.n_parts && !rc; i++) {
        const moed_part *p = &j.parts[i];
        if (p->route)
            route_append_tokens(out, &t, &own[i], 0, p->rows);
        else
            route_append_tokens(out, &t, j.route, t, t + p->rows);
    }
    for (int i = 0; own && i < j.n_parts; i++) moed_route_free(&own[i]);
    free(own);
    if (rc) moed_route_free(out);
    return rc;
}

int moed_backend_router_logits(moed_backend *b, int exec, const moed_job *job, float *logits,
                               moed_error *err)
{
    moed_job j;
    moed_part one;
    int rc = with_parts(job, &j, &one, err);
    return rc ? rc : b->ops->router_logits(b, exec, &j, logits, err);
}

void *moed_backend_host_alloc(moed_backend *b, size_t bytes)
{
    if (b->ops->host_alloc) return b->ops->host_alloc(b, bytes);
    void *p = NULL;
    return posix_memalign(&p, HOST_ALIGN, bytes ? bytes : 1) ? NULL : p;
}

void moed_backend_host_free(moed_backend *b, void *p)
{
    if (!p) return;
    if (b->ops->host_free)
        b->ops->host_free(b, p);
    else
        free(p);
}

int moed_backend_device_info(moed_backend *b, int i, moed_device_info *out)
{
    return b->ops->device_info(b, i, out);
}

int moed_backend_exec_accepts(moed_backend *b, int exec, int slot)
{
    return b->ops->exec_accepts ? b->ops->exec_accepts(b, exec, slot) : 1;
}

int moed_backend_layer_place(moed_backend *b, int slot, moed_layer_place *out)
{
    return b->ops->layer_place(b, slot, out);
}

int moed_backend_replace_layer(moed_backend *b, int slot, const moed_replace_req *req,
                               moed_replace_result *res, moed_error *err)
{
    *res = (moed_replace_result){ 0 };
    if (!b->ops->replace_layer)
        return moed_fail(err, MOED_EPRECOND,
                         "the %s backend keeps every layer whole on one device: there is no split "
                         "layer to re-place",
                         b->ops->name);
    return b->ops->replace_layer(b, slot, req, res, err);
}

bool moed_backend_host_dma(const moed_backend *b)
{
    return b->ops->host_dma;
}

int moed_backend_host_register(moed_backend *b, void *p, size_t bytes, moed_error *err)
{
    return b->ops->host_register ? b->ops->host_register(b, p, bytes, err) : 0;
}

void moed_backend_host_unregister(moed_backend *b, void *p)
{
    if (b->ops->host_unregister) b->ops->host_unregister(b, p);
}

int moed_backend_map_device(moed_backend *b, const void *handle, size_t handle_len,
                            const char *device_uuid, int device, uint64_t bytes, uint64_t offset,
                            void **ptr, int *dev, void **base, moed_error *err)
{
    *ptr = *base = NULL;
    *dev = MOED_HOST_MEM;
    if (!b->ops->map_device) return no_devices(b, err);
    return b->ops->map_device(b, handle, handle_len, device_uuid, device, bytes, offset, ptr, dev,
                              base, err);
}

void moed_backend_when_quiet(moed_backend *b, void (*fn)(void *arg), void *arg)
{
    if (b->ops->when_quiet)
        b->ops->when_quiet(b, fn, arg);
    else
        fn(arg);
}

void moed_backend_unmap_device(moed_backend *b, void *base, int dev)
{
    if (b->ops->unmap_device) b->ops->unmap_device(b, base, dev);
}

int moed_backend_read_device(moed_backend *b, void *dst, const void *src, int dev, size_t bytes,
                             moed_error *err)
{
    if (!b->ops->read_device) return no_devices(b, err);
    return b->ops->read_device(b, dst, src, dev, bytes, err);
}

void moed_backend_device_uuid(moed_backend *b, int dev, char out[48])
{
    out[0] = 0;
    if (b->ops->device_uuid) b->ops->device_uuid(b, dev, out);
}

int moed_backend_device_ordinal(moed_backend *b, int i)
{
    return b->ops->device_ordinal ? b->ops->device_ordinal(b, i) : MOED_HOST_MEM;
}

/* ---- links ------------------------------------------------------------------------------------
 */

int moed_backend_link_create(moed_backend *b, int device, uint64_t payload_bytes,
                             uint64_t reply_bytes, uint8_t unique_id[MOED_NCCL_UNIQUE_ID_BYTES],
                             moed_backend_link **out, moed_error *err)
{
    *out = NULL;
    if (!b->ops->links)
        return moed_fail(err, MOED_EUNSUPPORTED,
                         "links move tensors between GPUs: the %s backend has none; start moed "
                         "with the cuda backend",
                         b->ops->name);
    const uint64_t reply_at =
        (payload_bytes + MOED_LINK_ALIGN - 1) / MOED_LINK_ALIGN * MOED_LINK_ALIGN;
    if (payload_bytes > UINT64_MAX / 4 || reply_bytes > UINT64_MAX / 4)
        return moed_fail(err, MOED_EINVAL, "a link's buffer of %llu + %llu bytes is too large",
                         (unsigned long long)payload_bytes, (unsigned long long)reply_bytes);
    moed_backend_link *l = calloc(1, sizeof *l);
    if (!l) return moed_fail(err, MOED_ENOMEM, "no memory for a link");
    *l = (moed_backend_link){
        .backend = b, .device = device, .bytes = reply_at + reply_bytes, .reply_at = reply_at
    };
    int rc = b->ops->links->create(b, l, unique_id, err);
    if (rc) {
        free(l);
        return rc;
    }
    *out = l;
    return 0;
}

/* Whether [offset, offset + bytes) lies within the link's buffer. */
static int link_range(const moed_backend_link *l, uint64_t offset, uint64_t bytes, moed_error *err)
{
    if (offset <= l->bytes && bytes <= l->bytes - offset) return 0;
    return moed_fail(err, MOED_EINVAL,
                     "bytes %llu .. %llu are outside the link's buffer of %llu bytes",
                     (unsigned long long)offset, (unsigned long long)(offset + bytes),
                     (unsigned long long)l->bytes);
}

int moed_backend_link_ready(moed_backend_link *l, int64_t timeout_ms, const _Atomic bool *stop,
                            moed_error *err)
{
    return l->backend->ops->links->wait(l, MOED_LINK_WAIT_READY, 0, 0, timeout_ms, stop, err);
}

int moed_backend_link_recv(moed_backend_link *l, uint64_t offset, uint64_t bytes,
                           int64_t timeout_ms, const _Atomic bool *stop, moed_error *err)
{
    int rc = link_range(l, offset, bytes, err);
    return rc ? rc
              : l->backend->ops->links->wait(l, MOED_LINK_WAIT_RECV, offset, bytes, timeout_ms,
                                             stop, err);
}

int moed_backend_link_send(moed_backend_link *l, uint64_t offset, uint64_t bytes,
                           int64_t timeout_ms, const _Atomic bool *stop, moed_error *err)
{
    int rc = link_range(l, offset, bytes, err);
    return rc ? rc
              : l->backend->ops->links->wait(l, MOED_LINK_WAIT_SEND, offset, bytes, timeout_ms,
                                             stop, err);
}

int moed_backend_link_recv_header(moed_backend_link *l, void *dst, size_t bytes, int64_t timeout_ms,
                                  const _Atomic bool *stop, moed_error *err)
{
    if (bytes > MOED_LINK_HEADER_BYTES)
        return moed_fail(err, MOED_EINVAL, "a header of %zu bytes: at most %d", bytes,
                         MOED_LINK_HEADER_BYTES);
    const moed_backend_link_ops *o = l->backend->ops->links;
    if (o->recv_host) return o->recv_host(l, dst, bytes, timeout_ms, stop, err);
    int rc = moed_backend_link_recv(l, 0, bytes, timeout_ms, stop, err);
    return rc ? rc : moed_backend_link_read(l, dst, 0, bytes, err);
}

int moed_backend_link_read(moed_backend_link *l, void *dst, uint64_t offset, size_t bytes,
                           moed_error *err)
{
    int rc = link_range(l, offset, bytes, err);
    return rc ? rc : l->backend->ops->links->copy(l, true, dst, offset, bytes, err);
}

int moed_backend_link_write(moed_backend_link *l, uint64_t offset, const void *src, size_t bytes,
                            moed_error *err)
{
    int rc = link_range(l, offset, bytes, err);
    return rc ? rc : l->backend->ops->links->copy(l, false, (void *)src, offset, bytes, err);
}

void *moed_backend_link_mem(const moed_backend_link *l)
{
    return l->mem;
}

int moed_backend_link_device(const moed_backend_link *l)
{
    return l->device;
}

uint64_t moed_backend_link_bytes(const moed_backend_link *l)
{
    return l->bytes;
}

uint64_t moed_backend_link_reply_at(const moed_backend_link *l)
{
    return l->reply_at;
}

void moed_backend_link_abort(moed_backend_link *l)
{
    l->backend->ops->links->abort(l);
}

void moed_backend_link_destroy(moed_backend_link *l)
{
    if (!l) return;
    l->backend->ops->links->destroy(l);
    free(l);
}

void moed_backend_destroy(moed_backend *b)
{
    if (b) b->ops->destroy(b);
}
