/*
 * moed_pool — parallel-for on a fixed set of threads.
 *
 * Workers sleep on a condition variable between jobs and claim tasks with one atomic counter, so a
 * job costs one broadcast plus one atomic per task: cheap enough for the CPU backend's several
 * phases per forward. A job of one task runs inline and wakes nobody.
 */
#include "moed_pool.h"

#include "moed_err.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct pool_worker {
    moed_pool *pool;
    int id;
    pthread_t th;
} pool_worker;

struct moed_pool {
    int n; /* threads, the caller included */
    pool_worker *workers;
    int started; /* workers actually running */
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    uint64_t gen; /* bumped for every job */
    int pending;  /* workers still inside the current job */
    int stop;
    /* the current job */
    moed_pool_fn fn;
    void *arg;
    int64_t n_tasks;
    _Atomic int64_t next;
};

int moed_pool_online_cpus(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void pool_work(moed_pool *p, int thread)
{
    for (;;) {
        int64_t t = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (t >= p->n_tasks) return;
        p->fn(p->arg, t, thread);
    }
}

static void *pool_main(void *a)
{
    pool_worker *w = a;
    moed_pool *p = w->pool;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->gen == seen && !p->stop) pthread_cond_wait(&p->work_cv, &p->mu);
        if (p->stop) break;
        seen = p->gen;
        pthread_mutex_unlock(&p->mu);
        pool_work(p, w->id);
        pthread_mutex_lock(&p->mu);
        if (--p->pending == 0) pthread_cond_signal(&p->done_cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int moed_pool_create(int threads, moed_pool **out)
{
    *out = NULL;
    moed_pool *p = calloc(1, sizeof *p);
    if (!p) return MOED_ENOMEM;
    p->n = threads > 0 ? threads : moed_pool_online_cpus();
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    if (p->n > 1) {
        p->workers = calloc((size_t)p->n - 1, sizeof *p->workers);
        if (!p->workers) goto err;
    }
    for (int i = 1; i < p->n; i++) {
        pool_worker *w = &p->workers[i - 1];
        w->pool = p;
        w->id = i;
        if (pthread_create(&w->th, NULL, pool_main, w)) goto err;
        p->started++;
    }
    *out = p;
    return 0;
err:
    moed_pool_destroy(p);
    return MOED_EINTERNAL;
}

void moed_pool_destroy(moed_pool *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->started; i++) pthread_join(p->workers[i].th, NULL);
    pthread_cond_destroy(&p->work_cv);
    pthread_cond_destroy(&p->done_cv);
    pthread_mutex_destroy(&p->mu);
    free(p->workers);
    free(p);
}

int moed_pool_threads(const moed_pool *p)
{
    return p->n;
}

void moed_pool_run(moed_pool *p, int64_t n_tasks, moed_pool_fn fn, void *arg)
{
    if (n_tasks <= 0) return;
    if (n_tasks == 1 || p->n == 1) {
        for (int64_t t = 0; t < n_tasks; t++) fn(arg, t, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->n_tasks = n_tasks;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    p->pending = p->started;
    p->gen++;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    pool_work(p, 0);
    pthread_mutex_lock(&p->mu);
    while (p->pending > 0) pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
