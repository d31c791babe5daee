/*
 * load_regions — the region transports of moed-load (load_regions.h states what goes where).
 *
 * Offsets: the hidden pool's row r of a layer of d_model d is at r x d x es (as in the host pool);
 * the routing region holds, one after the other, each layer's ids then weights pools and the
 * logits pool, each 64-byte aligned; output slot s starts at s x stride.
 */
#include "load_regions.h"

#include "moed_dtype.h"
#include "moedc_cuda.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LAYERS 64

struct load_regions {
    int transport;
    int device; /* the GPU of the device memory */
    moedc_session *session;
    moedc_region *hidden, *routing, *out;
    void *dev_hidden, *dev_routing, *dev_out; /* this process's allocations behind them */
    size_t ids_at[MAX_LAYERS], weights_at[MAX_LAYERS], logits_at;
    size_t stride; /* bytes of one output slot */
    moedc_ring **rings;
    void **streams;
    int n_rings;
};

static const char *const names[] = { "inline",   "shm",           "cuda",
                                     "doorbell", "doorbell-cuda", "doorbell-stream" };

int load_transport_parse(const char *s, int *transport, moed_error *err)
{
    for (int i = 0; i < (int)(sizeof names / sizeof names[0]); i++)
        if (!strcmp(s, names[i])) {
            *transport = i;
            return 0;
        }
    return moed_fail(err, MOED_EINVAL,
                     "--transport %s: use inline, shm, cuda, doorbell, doorbell-cuda or "
                     "doorbell-stream",
                     s);
}

const char *load_transport_name(int transport)
{
    return names[transport];
}

bool load_transport_rings(int transport)
{
    return transport >= LOAD_TRANSPORT_DOORBELL;
}

static bool on_device(int transport)
{
    return transport == LOAD_TRANSPORT_CUDA || transport > LOAD_TRANSPORT_DOORBELL;
}

static size_t up64(size_t n)
{
    return (n + 63) / 64 * 64;
}

static int client_error(const char *what, const moedc_error *e, moed_error *err)
{
    return moed_fail(err, e->code, "%s: %s", what, e->msg);
}

/* `bytes` of the GPU's memory in *dev holding `n` bytes of src at its start, through the driver
 * (moedc_cuda): moed-load links no CUDA library either. */
static int device_alloc(const load_regions *r, const void *src, size_t n, size_t bytes, void **dev,
                        moed_error *err)
{
    moedc_error e;
    const moedc_cuda_table *cu = moedc_cuda_api(&e);
    if (!cu || moedc_cuda_enter(cu, r->device, &e))
        return client_error(load_transport_name(r->transport), &e, err);
    moedc_cu_ptr p = 0;
    int rc = cu->cuMemAlloc(&p, bytes);
    const char *call = "cuMemAlloc";
    if (!rc && n && (rc = cu->cuMemcpyHtoD(p, src, n))) call = "cuMemcpyHtoD";
    if (rc && p) cu->cuMemFree(p);
    moedc_cuda_leave(cu, r->device);
    if (rc) {
        moedc_cuda_fail(cu, rc, call, &e);
        return moed_fail(err, MOED_ENOMEM, "could not allocate and fill %zu bytes on GPU %d: %s",
                         bytes, r->device, e.msg);
    }
    *dev = (void *)(uintptr_t)p;
    return 0;
}

static void device_free(const load_regions *r, void *dev)
{
    moedc_error e;
    const moedc_cuda_table *cu = dev ? moedc_cuda_api(&e) : NULL;
    if (!cu || moedc_cuda_enter(cu, r->device, &e)) return;
    cu->cuMemFree((moedc_cu_ptr)(uintptr_t)dev);
    moedc_cuda_leave(cu, r->device);
}

/* A region of `bytes` holding `n` bytes of src at its start: host memory, or device memory
 * allocated here into *dev. */
static int place(load_regions *r, bool on_device, const void *src, size_t n, size_t bytes,
                 moedc_region **out, void **dev, moed_error *err)
{
    moedc_error e;
    if (!on_device) {
        if (moedc_region_create_host(r->session, bytes, 0, out, &e))
            return client_error("registering a shared-memory region", &e, err);
        if (n) memcpy((*out)->ptr, src, n);
        return 0;
    }
    int rc = device_alloc(r, src, n, bytes, dev, err);
    if (!rc && moedc_region_register_cuda(r->session, *dev, bytes, out, &e))
        rc = client_error("registering a CUDA region", &e, err);
    return rc;
}

/* The routing pools, one after the other, in one region: on the device for the doorbell's CUDA
 * transports (where the server reads them), in shared memory otherwise. */
static int place_routing(load_regions *r, const load_plan *p, moed_error *err)
{
    size_t at = 0;
    for (int i = 0; i < p->n_layers; i++) {
        const size_t n = (size_t)p->pool_rows * (size_t)p->layers[i].cols * 4;
        const size_t room = p->layers[i].ids ? up64(n) : 0;
        r->ids_at[i] = at;
        r->weights_at[i] = at + room;
        at += 2 * room;
    }
    r->logits_at = at;
    size_t max_e = 0;
    for (int i = 0; i < p->n_layers; i++)
        if ((size_t)p->layers[i].info.n_experts > max_e)
            max_e = (size_t)p->layers[i].info.n_experts;
    at += p->logits ? up64((size_t)p->pool_rows * max_e * 4) : 0;
    char *base = calloc(1, at ? at : 64);
    if (!base) return moed_fail(err, MOED_ENOMEM, "out of memory for the routing pools");
    for (int i = 0; i < p->n_layers; i++)
        if (p->layers[i].ids) {
            const size_t n = (size_t)p->pool_rows * (size_t)p->layers[i].cols * 4;
            memcpy(base + r->ids_at[i], p->layers[i].ids, n);
            memcpy(base + r->weights_at[i], p->layers[i].weights, n);
        }
    if (p->logits) memcpy(base + r->logits_at, p->logits, (size_t)p->pool_rows * max_e * 4);
    int rc = place(r, r->transport > LOAD_TRANSPORT_DOORBELL, base, at, at ? at : 64, &r->routing,
                   &r->dev_routing, err);
    free(base);
    return rc;
}

/* The rings, one per worker, and for doorbell-stream a stream each on the GPU. */
static int open_rings(load_regions *r, int n, moed_error *err)
{
    moedc_error e;
    r->rings = calloc((size_t)n, sizeof *r->rings);
    r->streams = calloc((size_t)n, sizeof *r->streams);
    if (!r->rings || !r->streams) return moed_fail(err, MOED_ENOMEM, "out of memory for rings");
    const moedc_cuda_table *cu = NULL;
    if (r->transport == LOAD_TRANSPORT_DOORBELL_STREAM &&
        (!(cu = moedc_cuda_api(&e)) || moedc_cuda_enter(cu, r->device, &e)))
        return client_error(load_transport_name(r->transport), &e, err);
    int rc = 0, drc;
    for (; r->n_rings < n && !rc; r->n_rings++) {
        /* the ring is opened with the GPU's context current: page-locked for its streams now */
        if (moedc_ring_open(r->session, 2, &r->rings[r->n_rings], &e)) {
            rc = client_error("opening a doorbell ring", &e, err);
        } else if (cu &&
                   (drc = cu->cuStreamCreate(&r->streams[r->n_rings], 1 /* non-blocking */))) {
            moedc_cuda_fail(cu, drc, "cuStreamCreate", &e);
            rc = client_error("a stream for a ring", &e, err);
        }
    }
    if (cu) moedc_cuda_leave(cu, r->device);
    return rc;
}

int load_regions_open(int transport, moedc *c, load_plan *plan, int slots, int rings,
                      int64_t max_tokens, int max_d, int device, load_regions **out,
                      moed_error *err)
{
    *out = NULL;
    if (transport == LOAD_TRANSPORT_INLINE) return 0;
    if (plan->n_layers > MAX_LAYERS)
        return moed_fail(err, MOED_EINVAL, "--transport %s takes at most %d layers",
                         load_transport_name(transport), MAX_LAYERS);
    load_regions *r = calloc(1, sizeof *r);
    if (!r) return moed_fail(err, MOED_ENOMEM, "out of memory");
    r->transport = transport;
    r->device = device;
    const size_t es = moed_dtype_size(plan->dtype);
    const size_t pool = (size_t)plan->pool_rows * (size_t)max_d * es;
    r->stride = up64((size_t)max_tokens * (size_t)max_d * es);
    const bool dev = on_device(transport);
    moedc_error e;
    int rc = moedc_session_open(c, &r->session, &e) ? client_error("a region session", &e, err) : 0;
    if (!rc) rc = place(r, dev, plan->hidden, pool, pool, &r->hidden, &r->dev_hidden, err);
    if (!rc) rc = place_routing(r, plan, err);
    if (!rc) rc = place(r, dev, NULL, 0, r->stride * (size_t)slots, &r->out, &r->dev_out, err);
    if (!rc && load_transport_rings(transport)) rc = open_rings(r, rings, err);
    if (rc) {
        load_regions_close(r);
        return rc;
    }
    plan->regions = r;
    *out = r;
    return 0;
}

void load_regions_close(load_regions *r)
{
    if (!r) return;
    moedc_error e;
    const moedc_cuda_table *cu = r->streams ? moedc_cuda_api(&e) : NULL;
    for (int i = 0; cu && i < r->n_rings; i++)
        if (r->streams[i]) cu->cuStreamDestroy(r->streams[i]);
    /* closes the rings, frees the regions here and releases them there */
    moedc_session_close(r->session);
    device_free(r, r->dev_hidden);
    device_free(r, r->dev_routing);
    device_free(r, r->dev_out);
    free(r->rings);
    free(r->streams);
    free(r);
}

bool load_regions_rings(const load_regions *r)
{
    return r && load_transport_rings(r->transport);
}

moedc_ring *load_regions_ring(const load_regions *r, int i, void **stream)
{
    *stream = r->streams[i];
    return r->rings[i];
}

int load_regions_sync(const load_regions *r, void *stream, moed_error *err)
{
    moedc_error e;
    const moedc_cuda_table *cu = moedc_cuda_api(&e);
    int rc = cu ? cu->cuStreamSynchronize(stream) : 0;
    if (rc) moedc_cuda_fail(cu, rc, "cuStreamSynchronize", &e);
    return cu && !rc ? 0 : moed_fail(err, e.code, "%s", e.msg);
}

void load_regions_refer(const load_regions *r, const load_plan *p, int layer, int64_t row, int slot,
                        moedc_request *req)
{
    const load_dest *l = &p->layers[layer];
    req->hidden_at = (moedc_ref){ r->hidden, (uint64_t)((size_t)req->hidden - (size_t)p->hidden) };
    req->output_at = (moedc_ref){ r->out, (uint64_t)slot * r->stride };
    if (req->routing == MOEDC_ROUTE_EXPERTS && req->expert_ids == l->ids + row * l->cols) {
        req->expert_ids_at =
            (moedc_ref){ r->routing, r->ids_at[layer] + (size_t)(row * l->cols) * 4 };
        req->expert_weights_at =
            (moedc_ref){ r->routing, r->weights_at[layer] + (size_t)(row * l->cols) * 4 };
    } else if (req->routing == MOEDC_ROUTE_LOGITS) {
        req->logits_at =
            (moedc_ref){ r->routing, r->logits_at + (size_t)(req->logits - p->logits) * 4 };
    }
}

void *load_regions_copy_output(const load_regions *r, const moedc_result *res)
{
    void *copy = malloc(res->output_bytes ? res->output_bytes : 1);
    if (!copy) return NULL;
    if (!on_device(r->transport)) {
        memcpy(copy, res->output, res->output_bytes);
        return copy;
    }
    moedc_error e;
    const moedc_cuda_table *cu = moedc_cuda_api(&e);
    if (cu && !moedc_cuda_enter(cu, r->device, &e)) {
        int rc = cu->cuMemcpyDtoH(copy, (moedc_cu_ptr)(uintptr_t)res->output, res->output_bytes);
        moedc_cuda_leave(cu, r->device);
        if (!rc) return copy;
    }
    free(copy);
    return NULL;
}
