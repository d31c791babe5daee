/*
 * moed_backend_impl — the implementations' side of moed_backend: the table of calls each backend
 * fills, and the handle's layout. Private: included by moed_backend.c and the backends (cpu/,
 * cuda/, and a test's fake backend) only; every caller goes through moed_backend.h.
 *
 * Required slots: name, load_layer, start, forward, router_logits, device_info, layer_place,
 * destroy. Optional
 * (NULL), with the default moed_backend.c supplies: host_alloc/host_free (64-byte aligned host
 * memory), exec_accepts (every slot runs every layer), host_register/host_unregister (nothing to
 * do), map_device/unmap_device/read_device/device_uuid (no devices: FAILED_PRECONDITION),
 * replace_layer (every layer whole: FAILED_PRECONDITION), device_ordinal (no GPUs: MOED_HOST_MEM),
 * links (none: UNSUPPORTED; a table of links fills every slot), when_quiet (runs it now).
 *
 * forward and router_logits always see job->parts: moed_backend.c turns a job with n_parts == 0
 * into its one part before calling them. forward sees a part with device routing (moed_part.route)
 * only on a backend that has read_device, with k >= 1, both tensors set and no pair of the part's
 * tokens in job->route: moed_backend.c refuses any other before calling it.
 */
#ifndef MOED_BACKEND_IMPL_H
#define MOED_BACKEND_IMPL_H

#include "moed_backend.h"

enum { MOED_LINK_WAIT_READY, MOED_LINK_WAIT_RECV, MOED_LINK_WAIT_SEND }; /* link_wait's what */

/* Links (moed_backend.h). moed_backend.c allocates the handle and sets its common fields, checks
 * every range against the buffer, and frees the handle after destroy. create allocates l->bytes of
 * device memory on GPU l->device into l->mem and its own state into l->ctx (on failure it leaves
 * nothing behind); wait waits for the caller's join (MOED_LINK_WAIT_READY) or receives / sends the
 * buffer's [offset, offset + bytes); copy is a synchronous copy between the buffer's offset and
 * host memory; abort and destroy as moed_backend_link_abort / _destroy. */
typedef struct moed_backend_link_ops {
    int (*create)(moed_backend *b, moed_backend_link *l,
                  uint8_t unique_id[MOED_NCCL_UNIQUE_ID_BYTES], moed_error *err);
    int (*wait)(moed_backend_link *l, int what, uint64_t offset, uint64_t bytes, int64_t timeout_ms,
                const _Atomic bool *stop, moed_error *err);
    int (*copy)(moed_backend_link *l, bool to_host, void *host, uint64_t offset, size_t bytes,
                moed_error *err);
    /* optional (moed_backend_link_recv_header): a message received into host memory */
    int (*recv_host)(moed_backend_link *l, void *dst, size_t bytes, int64_t timeout_ms,
                     const _Atomic bool *stop, moed_error *err);
    void (*abort)(moed_backend_link *l);
    void (*destroy)(moed_backend_link *l);
} moed_backend_link_ops;

typedef struct moed_backend_ops {
    const char *name;
    /* The backend computes from the host memory load_layer was given for as long as it runs (the
     * CPU backend), rather than copying it to a device during load_layer (CUDA). */
    bool computes_from_host;
    /* Host memory is only ever moved by DMA (moed_backend_host_dma). */
    bool host_dma;
    int (*load_layer)(moed_backend *b, int slot, const moed_layer *l, moed_error *err);
    int (*start)(moed_backend *b, moed_error *err);
    int (*forward)(moed_backend *b, int exec, const moed_job *job, moed_error *err);
    int (*router_logits)(moed_backend *b, int exec, const moed_job *job, float *logits,
                         moed_error *err);
    void *(*host_alloc)(moed_backend *b, size_t bytes);
    void (*host_free)(moed_backend *b, void *p);
    int (*device_info)(moed_backend *b, int i, moed_device_info *out);
    int (*exec_accepts)(moed_backend *b, int exec, int slot);
    int (*layer_place)(moed_backend *b, int slot, moed_layer_place *out);
    int (*replace_layer)(moed_backend *b, int slot, const moed_replace_req *req,
                         moed_replace_result *res, moed_error *err);
    int (*host_register)(moed_backend *b, void *p, size_t bytes, moed_error *err);
    void (*host_unregister)(moed_backend *b, void *p);
    int (*map_device)(moed_backend *b, const void *handle, size_t handle_len,
                      const char *device_uuid, int device, uint64_t bytes, uint64_t offset,
                      void **ptr, int *dev, void **base, moed_error *err);
    void (*unmap_device)(moed_backend *b, void *base, int dev);
    void (*when_quiet)(moed_backend *b, void (*fn)(void *arg), void *arg);
    int (*read_device)(moed_backend *b, void *dst, const void *src, int dev, size_t bytes,
                       moed_error *err);
    void (*device_uuid)(moed_backend *b, int dev, char out[48]);
    int (*device_ordinal)(moed_backend *b, int i);
    const moed_backend_link_ops *links;
    /* Frees the implementation's state and b itself. */
    void (*destroy)(moed_backend *b);
} moed_backend_ops;

struct moed_backend_link {
    moed_backend *backend;
    int device;
    uint64_t bytes;    /* the buffer's: payload area, then the reply area */
    uint64_t reply_at; /* where the reply area starts */
    void *mem;         /* the buffer's device address (link_create's) */
    void *ctx;         /* the implementation's own state */
};

struct moed_backend {
    const moed_backend_ops *ops;
    void *ctx;     /* the implementation's own state */
    int n_exec;    /* execution slots (set by start) */
    int n_devices; /* entries device_info answers for */
};

#endif
