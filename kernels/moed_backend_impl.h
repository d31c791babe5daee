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
 * replace_layer (every layer whole: FAILED_PRECONDITION).
 *
 * forward and router_logits always see job->parts: moed_backend.c turns a job with n_parts == 0
 * into its one part before calling them. forward sees a part with device routing (moed_part.route)
 * only on a backend that has read_device, with k >= 1, both tensors set and no pair of the part's
 * tokens in job->route: moed_backend.c refuses any other before calling it.
 */
#ifndef MOED_BACKEND_IMPL_H
#define MOED_BACKEND_IMPL_H

#include "moed_backend.h"

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
    int (*read_device)(moed_backend *b, void *dst, const void *src, int dev, size_t bytes,
                       moed_error *err);
    void (*device_uuid)(moed_backend *b, int dev, char out[48]);
    /* Frees the implementation's state and b itself. */
    void (*destroy)(moed_backend *b);
} moed_backend_ops;

struct moed_backend {
    const moed_backend_ops *ops;
    void *ctx;     /* the implementation's own state */
    int n_exec;    /* execution slots (set by start) */
    int n_devices; /* entries device_info answers for */
};

#endif
