/*
 * moed_registry — choosing a backend by name (moed_registry.h states the contract). It links the
 * CPU backend and, where nvcc was found, the CUDA one; without CUDA, asking for it says so.
 */
#include "moed_registry.h"

#include "cpu_backend.h"

#include <string.h>

#ifdef MOED_HAVE_CUDA
#include "cuda_backend.h"
#else
static int moed_backend_cuda_open(const moed_backend_config *cfg, moed_backend **out,
                                  moed_error *err)
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
