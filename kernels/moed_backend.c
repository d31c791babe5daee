/*
 * moed_backend — choosing a backend by name. Each implementation lives in its own folder (cpu/,
 * cuda/); this file only dispatches, so the daemon never names an implementation.
 */
#include "moed_backend.h"

#include <string.h>

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
