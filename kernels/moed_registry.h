/*
 * moed_registry — the backends by name: what the daemon and the tests call to open one without
 * naming its implementation. The one place that knows whether moed was built with CUDA; a program
 * that needs one backend only links that backend and calls its constructor (cpu/cpu_backend.h,
 * cuda/cuda_backend.h) instead.
 */
#ifndef MOED_REGISTRY_H
#define MOED_REGISTRY_H

#include "moed_backend.h"

/* Opens a backend by name: "cpu", "cuda", or "auto" (cuda where it was built and a device is
 * present, else cpu). MOED_ENODEV if "cuda" is asked for and cannot run, MOED_EUNSUPPORTED if
 * moed was built without CUDA. */
int moed_backend_open(const char *name, const moed_backend_config *cfg, moed_backend **out,
                      moed_error *err);

/* True when the CUDA backend was compiled in and at least one device answers. */
int moed_backend_cuda_available(void);

#endif
