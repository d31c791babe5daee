/*
 * moed_backend_impl — the implementations' side of moed_backend: the table of calls each backend
 * fills, and the handle's layout. Private: included by moed_backend.c and the backends (cpu/,
 * cuda/, and a test's fake backend) only; every caller goes through moed_backend.h.
 *
 * Required slots: name, load_layer, start, forward, router_logits, device_info, layer_place,
 * destroy. Optional
 * (NULL), with the default moed_backend.c supplies: host_alloc/host_free (64-byte aligned host
 * memory), exec_accepts (every slot runs every layer).
 */
#ifndef MOED_BACKEND_IMPL_H
#define MOED_BACKEND_IMPL_H

#include "moed_backend.h"

typedef struct moed_backend_ops {
    const char *name;
    /* The backend computes from the host memory load_layer was given for as long as it runs (the
     * CPU backend), rather than copying it to a device during load_layer (CUDA). */
    bool computes_from_host;
    int (*load_layer)(moed_backend *b, int slot, const moed_layer *l, moed_error *err);
    int (*start)(moed_backend *b, moed_error *err);
    int (*forward)(moed_backend *b, int exec, const moed_job *job, moed_error *err);
    int (*router_logits)(moed_backend *b, int exec, int slot, int dtype, int64_t T, const void *x,
                         float *logits, moed_error *err);
    void *(*host_alloc)(moed_backend *b, size_t bytes);
    void (*host_free)(moed_backend *b, void *p);
    int (*device_info)(moed_backend *b, int i, moed_device_info *out);
    int (*exec_accepts)(moed_backend *b, int exec, int slot);
    int (*layer_place)(moed_backend *b, int slot, moed_layer_place *out);
    /* Frees the implementation's state and b itself. */
    void (*destroy)(moed_backend *b);
} moed_backend_ops;

struct moed_backend {
    const moed_backend_ops *ops;
    void *ctx;     /* the implementation's own state */
    int n_exec;    /* execution slots (set by start) */
    int n_devices; /* entries device_info answers for */
};

/* Each implementation's constructor (called by moed_backend_open). */
int moed_backend_cpu_open(const moed_backend_config *cfg, moed_backend **out, moed_error *err);
int moed_backend_cuda_open(const moed_backend_config *cfg, moed_backend **out, moed_error *err);

#endif
