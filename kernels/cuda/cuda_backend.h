/*
 * cuda_backend — the CUDA backend's constructor and its device check, for the registry
 * (moed_registry.c) and the programs that link the CUDA backend alone (the kernel benchmarks, the
 * GPU tests). Every other call goes through moed_backend.h.
 */
#ifndef MOED_CUDA_BACKEND_H
#define MOED_CUDA_BACKEND_H

#include "moed_backend.h"

/* MOED_ENODEV when no CUDA device answers. */
int moed_backend_cuda_open(const moed_backend_config *cfg, moed_backend **out, moed_error *err);

/* True when at least one device of compute capability 8.0 or newer answers. */
int moed_backend_cuda_available(void);

#endif
