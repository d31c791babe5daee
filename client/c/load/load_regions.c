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
    moedc_session *session;
    moedc_region *hidden, *routing, *out;
    void *dev_hidden, *dev_out; /* cuda: this process's allocations behind hidden and out */
    size_t ids_at[MAX_LAYERS], weights_at[MAX_LAYERS], logits_at;
    size_t stride; /* bytes of one output slot */
};

int load_transport_parse(const char *s, int *transport, moed_error *err)
{
    if (!strcmp(s, "inline"))
        *transport = LOAD_TRANSPORT_INLINE;
    else if (!strcmp(s, "shm"))
        *transport = LOAD_TRANSPORT_SHM;
    else if (!strcmp(s, "cuda"))
        *transport = LOAD_TRANSPORT_CUDA;
    else
        return moed_fail(err, MOED_EINVAL, "--transport %s: use inline, shm or cuda", s);
    return 0;
}

static size_t up64(size_t n)
{
    return (n + 63) / 64 * 64;
}

static int client_error(const char *what, const moedc_error *e, moed_error *err)
{
    return moed_fail(err, e->code, "%s: %s", what, e->msg);
}

/* `bytes` of GPU 0's memory in *dev holding `n` bytes of src at its start, through the driver
 * (moedc_cuda): moed-load links no CUDA library either. */
static int device_alloc(const void *src, size_t n, size_t bytes, void **dev, moed_error *err)
{
    moedc_error e;
    const moedc_cuda_table *cu = moedc_cuda_api(&e);
    if (!cu || moedc_cuda_enter(cu, 0, &e)) return client_error("--transport cuda", &e, err);
    moedc_cu_ptr p = 0;
    int rc = cu->cuMemAlloc(&p, bytes);
    const char *call = "cuMemAlloc";
    if (!rc && n && (rc = cu->cuMemcpyHtoD(p, src, n))) call = "cuMemcpyHtoD";
    if (rc && p) cu->cuMemFree(p);
    moedc_cuda_leave(cu, 0);
    if (rc) {
        moedc_cuda_fail(cu, rc, call, &e);
        return moed_fail(err, MOED_ENOMEM, "could not allocate and fill %zu bytes on GPU 0: %s",
                         bytes, e.msg);
    }
    *dev = (void *)(uintptr_t)p;
    return 0;
}

static void device_free(void *dev)
{
    moedc_error e;
    const moedc_cuda_table *cu = dev ? moedc_cuda_api(&e) : NULL;
    if (!cu || moedc_cuda_enter(cu, 0, &e)) return;
    cu->cuMemFree((moedc_cu_ptr)(uintptr_t)dev);
    moedc_cuda_leave(cu, 0);
}

/* A region of `bytes` holding `n` bytes of src at its start: host memory, or (cuda) device
 * memory allocated here into *dev. */
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
    int rc = device_alloc(src, n, bytes, dev, err);
    if (!rc && moedc_region_register_cuda(r->session, *dev, bytes, out, &e))
        rc = client_error("registering a CUDA region", &e, err);
    return rc;
}

/* The routing pools, one after the other, in one host region. */
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
    int rc = place(r, false, NULL, 0, at ? at : 64, &r->routing, NULL, err);
    if (rc) return rc;
    char *base = r->routing->ptr;
    for (int i = 0; i < p->n_layers; i++)
        if (p->layers[i].ids) {
            const size_t n = (size_t)p->pool_rows * (size_t)p->layers[i].cols * 4;
            memcpy(base + r->ids_at[i], p->layers[i].ids, n);
            memcpy(base + r->weights_at[i], p->layers[i].weights, n);
        }
    if (p->logits) memcpy(base + r->logits_at, p->logits, (size_t)p->pool_rows * max_e * 4);
    return 0;
}

int load_regions_open(int transport, moedc *c, load_plan *plan, int slots, int64_t max_tokens,
                      int max_d, load_regions **out, moed_error *err)
{
    *out = NULL;
    if (transport == LOAD_TRANSPORT_INLINE) return 0;
    if (plan->n_layers > MAX_LAYERS)
        return moed_fail(err, MOED_EINVAL, "--transport %s takes at most %d layers",
                         transport == LOAD_TRANSPORT_SHM ? "shm" : "cuda", MAX_LAYERS);
    load_regions *r = calloc(1, sizeof *r);
    if (!r) return moed_fail(err, MOED_ENOMEM, "out of memory");
    r->transport = transport;
    const size_t es = moed_dtype_size(plan->dtype);
    const size_t pool = (size_t)plan->pool_rows * (size_t)max_d * es;
    r->stride = up64((size_t)max_tokens * (size_t)max_d * es);
    const bool dev = transport == LOAD_TRANSPORT_CUDA;
    moedc_error e;
    int rc = moedc_session_open(c, &r->session, &e) ? client_error("a region session", &e, err) : 0;
    if (!rc) rc = place(r, dev, plan->hidden, pool, pool, &r->hidden, &r->dev_hidden, err);
    if (!rc) rc = place_routing(r, plan, err);
    if (!rc) rc = place(r, dev, NULL, 0, r->stride * (size_t)slots, &r->out, &r->dev_out, err);
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
    moedc_session_close(r->session); /* frees the regions here and releases them there */
    device_free(r->dev_hidden);
    device_free(r->dev_out);
    free(r);
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
    if (r->transport == LOAD_TRANSPORT_SHM) {
        memcpy(copy, res->output, res->output_bytes);
        return copy;
    }
    moedc_error e;
    const moedc_cuda_table *cu = moedc_cuda_api(&e);
    if (cu && !moedc_cuda_enter(cu, 0, &e)) {
        int rc = cu->cuMemcpyDtoH(copy, (moedc_cu_ptr)(uintptr_t)res->output, res->output_bytes);
        moedc_cuda_leave(cu, 0);
        if (!rc) return copy;
    }
    free(copy);
    return NULL;
}
