/*
 * moed_backend — the one interface every compute backend implements (a vtable and an opaque
 * context, as ggml-backend does), so the daemon, the tests and the benchmarks drive the CPU and
 * CUDA backends through the same calls.
 *
 * Life cycle: moed_backend_open → load_layer for every layer → start → (forward | router_logits)*
 * → destroy. A backend offers n_exec execution slots (CUDA: one per stream of the pool, each with
 * its own pinned staging and device workspace; CPU: one, running on all its threads). Calls on
 * different slots may run concurrently from different threads; calls on one slot must not.
 * forward and router_logits return when the result is in host memory.
 *
 * Contract on results: a token's output depends only on its own row of x and its own pairs of the
 * route, in their order — never on T or on the other tokens of the job — so merged requests are
 * bit-identical to the same requests run alone.
 */
#ifndef MOED_BACKEND_H
#define MOED_BACKEND_H

#include "moed_err.h"
#include "moed_model.h"
#include "moed_route.h"

#include <stddef.h>
#include <stdint.h>

typedef struct moed_backend moed_backend;

typedef struct moed_backend_config {
    int threads;        /* CPU: worker threads, 0 = one per core */
    int streams;        /* CUDA: streams per device, 0 = default (4) */
    const int *devices; /* CUDA: device ordinals to use; NULL = all */
    int n_devices;
    int64_t max_tokens; /* the most tokens one job may carry: sizes staging and workspaces */
} moed_backend_config;

typedef struct moed_job {
    int slot;      /* which resident layer: the slot given to load_layer */
    int dtype;     /* of x and y: MOED_F32, MOED_F16 or MOED_BF16 */
    int64_t T;     /* tokens, 1 .. max_tokens */
    const void *x; /* [T, d_model] host memory (from host_alloc for the fast path) */
    void *y;       /* [T, d_model] host memory, fully written */
    const moed_route *route;
} moed_job;

typedef struct moed_device_info {
    char name[96];
    uint64_t memory_total; /* bytes */
    uint64_t memory_used;  /* bytes */
} moed_device_info;

typedef struct moed_backend_ops {
    const char *name; /* "cpu", "cuda" */
    /* Makes layer l resident as `slot` (0, 1, ... in load order). l and the memory it points to
     * stay valid until the backend is destroyed, so a backend may compute from it in place (the CPU
     * backend does) or copy it to its device (CUDA). */
    int (*load_layer)(moed_backend *b, int slot, const moed_layer *l, moed_error *err);
    /* Sizes and allocates per-slot staging and workspaces once every layer is loaded; fails with
     * MOED_ENOMEM naming bytes needed and free. */
    int (*start)(moed_backend *b, moed_error *err);
    int (*forward)(moed_backend *b, int exec, const moed_job *job, moed_error *err);
    /* logits [T, n_experts] float32 = x [T, d_model] @ router^T, accumulated in float32 from x
     * and the router as stored, then moed_router_round_logits: the model's own logits, the same
     * bits on every backend. */
    int (*router_logits)(moed_backend *b, int exec, int slot, int dtype, int64_t T, const void *x,
                         float *logits, moed_error *err);
    /* Host memory the backend moves fastest (pinned for CUDA); NULL when out of memory. */
    void *(*host_alloc)(moed_backend *b, size_t bytes);
    void (*host_free)(moed_backend *b, void *p);
    int (*device_info)(moed_backend *b, int i, moed_device_info *out);
    /* Whether execution slot `exec` can run layer `slot` (with several GPUs a layer is resident on
     * one of them, and only that GPU's slots can run it). NULL: every slot runs every layer. */
    int (*exec_accepts)(moed_backend *b, int exec, int slot);
    void (*destroy)(moed_backend *b);
} moed_backend_ops;

struct moed_backend {
    const moed_backend_ops *ops;
    void *ctx;     /* the implementation's own state */
    int n_exec;    /* execution slots (valid after start) */
    int n_devices; /* entries device_info answers for */
};

/* Opens a backend by name: "cpu", "cuda", or "auto" (cuda where it was built and a device is
 * present, else cpu). MOED_ENODEV if "cuda" is asked for and cannot run, MOED_EUNSUPPORTED if
 * moed was built without CUDA. */
int moed_backend_open(const char *name, const moed_backend_config *cfg, moed_backend **out,
                      moed_error *err);

/* Each implementation's constructor (called by moed_backend_open). */
int moed_backend_cpu_open(const moed_backend_config *cfg, moed_backend **out, moed_error *err);
int moed_backend_cuda_open(const moed_backend_config *cfg, moed_backend **out, moed_error *err);
/* True when the CUDA backend was compiled in and at least one device answers. */
int moed_backend_cuda_available(void);

static inline void moed_backend_destroy(moed_backend *b)
{
    if (b) b->ops->destroy(b);
}

#endif
