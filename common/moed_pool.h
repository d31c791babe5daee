/*
 * moed_pool — a fixed set of threads that runs parallel-for jobs: fn(arg, task, thread) for every
 * task in [0, n_tasks), each task exactly once, on whichever thread claims it first.
 *
 * The calling thread works too, so a pool of n threads starts n - 1 and a pool of 1 runs everything
 * inline. The CPU backend keeps one for its execution slot; the synthetic generator makes one for a
 * layer. `thread` (0 .. n-1, 0 being the caller) lets a task use per-thread scratch memory. Which
 * thread runs a task is not fixed, so a task's result must not depend on it.
 */
#ifndef MOED_POOL_H
#define MOED_POOL_H

#include <stdint.h>

typedef struct moed_pool moed_pool;

typedef void (*moed_pool_fn)(void *arg, int64_t task, int thread);

/* threads <= 0: one per online CPU. MOED_ENOMEM or MOED_EINTERNAL (threads could not start). */
int moed_pool_create(int threads, moed_pool **out);
void moed_pool_destroy(moed_pool *p);
int moed_pool_threads(const moed_pool *p);
/* Runs the job and returns when every task is done. One job at a time per pool. */
void moed_pool_run(moed_pool *p, int64_t n_tasks, moed_pool_fn fn, void *arg);
/* The number of online CPUs (at least 1). */
int moed_pool_online_cpus(void);

#endif
