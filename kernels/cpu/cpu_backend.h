/*
 * cpu_backend — the CPU backend's constructor: how the registry (moed_registry.c) opens it, and how
 * a program that needs the CPU backend alone (moed-load's --verify) does, without the registry.
 * Every other call goes through moed_backend.h.
 */
#ifndef MOED_CPU_BACKEND_H
#define MOED_CPU_BACKEND_H

#include "moed_backend.h"

/* The reference backend: cfg->threads workers (0: one per core), jobs of up to cfg->max_tokens
 * (0: its default). MOED_EINVAL for negative sizes or expert_parallel. */
int moed_backend_cpu_open(const moed_backend_config *cfg, moed_backend **out, moed_error *err);

#endif
