/*
 * moed_guard — SIGBUS recovery for copies from and to shared memory.
 *
 * Why a signal handler and not a check before each copy: the object can shrink between any check
 * and the copy, so only recovering from the fault itself is safe. The handler longjmps only when
 * the faulting thread is inside moed_guard_copy (its thread-local recovery point is set); every
 * other SIGBUS gets the default action back and is raised again, so a real bug still dumps core
 * where it happened.
 */
#include "guard.h"

#include "moed_err.h"

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

/* volatile, and fenced where it is set: the handler must see it set before the copy's first load */
static _Thread_local sigjmp_buf *volatile recovery;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void on_sigbus(int sig, siginfo_t *info, void *ctx)
{
    (void)info;
    (void)ctx;
    if (recovery) siglongjmp(*recovery, 1);
    signal(sig, SIG_DFL); /* not ours: fault again with the default action */
}

static void install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, NULL);
}

void moed_guard_init(void)
{
    pthread_once(&once, install);
}

int moed_guard_run(void (*fn)(void *arg), void *arg)
{
    sigjmp_buf jb;
    moed_guard_init();
    /* volatile: the value must survive the longjmp back into this frame */
    volatile int faulted = 0;
    if (sigsetjmp(jb, 1))
        faulted = 1;
    else {
        recovery = &jb;
        atomic_signal_fence(memory_order_seq_cst);
        fn(arg);
        atomic_signal_fence(memory_order_seq_cst);
    }
    recovery = NULL;
    return faulted ? MOED_EPRECOND : 0;
}

typedef struct copy_args {
    void *dst;
    const void *src;
    size_t n;
} copy_args;

static void copy(void *arg)
{
    const copy_args *a = arg;
    memcpy(a->dst, a->src, a->n);
}

int moed_guard_copy(void *dst, const void *src, size_t n)
{
    copy_args a = { dst, src, n };
    return moed_guard_run(copy, &a);
}
