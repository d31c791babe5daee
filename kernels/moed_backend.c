/*
 * moed_backend — choosing a backend by name, and the calls every caller makes: each forwards to the
 * implementation's table and supplies the default where the implementation leaves a slot empty,
 * so no caller tests a slot. Each implementation lives in its own folder (cpu/, cuda/); this file
 * only dispatches, so the daemon never names an implementation.
 */
#include "moed_backend_impl.h"

#include <stdlib.h>
#include <string.h>

/* Alignment of the default host memory: a cache line, and enough for any vector load. */
#define HOST_ALIGN 64

#ifndef MOED_HAVE_CUDA
int moed_backend_cuda_open(const moed_backend_config *cfg, moed_backend **out, moed_error *err)
{
    (void)cfg;
    *out = NULL;
    return moed_fail(err, MOED_EUNSUPPORTED,
                     "this moed was built without CUDA (nvcc was not found at build time); "
                     "use --backend cpu, or rebuild on a machine with the CUDA toolkit");
}

int moed_backend_cuda_available(void)
{
    return 0;
}
#endif

int moed_backend_open(const char *name, const moed_backend_config *cfg, moed_backend **out,
                      moed_error *err)
{
    *out = NULL;
    if (!strcmp(name, "cpu")) return moed_backend_cpu_open(cfg, out, err);
    if (!strcmp(name, "cuda")) return moed_backend_cuda_open(cfg, out, err);
    if (!strcmp(name, "auto")) {
        if (moed_backend_cuda_available()) return moed_backend_cuda_open(cfg, out, err);
        return moed_backend_cpu_open(cfg, out, err);
    }
    return moed_fail(err, MOED_EINVAL, "unknown backend '%s': use cpu, cuda or auto", name);
}

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

int moed_backend_forward(moed_backend *b, int exec, const moed_job *job, moed_error *err)
{
    return b->ops->forward(b, exec, job, err);
}

int moed_backend_router_logits(moed_backend *b, int exec, int slot, int dtype, int64_t T,
                               const void *x, float *logits, moed_error *err)
{
    return b->ops->router_logits(b, exec, slot, dtype, T, x, logits, err);
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

void moed_backend_destroy(moed_backend *b)
{
    if (b) b->ops->destroy(b);
}
