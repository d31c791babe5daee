/* PLACEHOLDER (being written by the kernels helper): the CPU backend. */
#include "moed_backend.h"
int moed_backend_cpu_open(const moed_backend_config *cfg, moed_backend **out, moed_error *err)
{
    (void)cfg;
    *out = 0;
    return moed_fail(err, MOED_EUNSUPPORTED, "cpu backend not written yet");
}
