/*
 * moed_stacks — every thread's stack in the log (stacks.h states the contract).
 *
 * The handler only records raw return addresses into one shared slot and posts a semaphore (both
 * safe in a signal handler); naming them and logging happen on the asking thread. The slot says
 * which thread is being asked: one that answers after its wait ended finds another asked and
 * writes nothing, so a late answer never lands in the next thread's line.
 */
#include "stacks.h"

#include "log.h"

#include <dirent.h>
#include <errno.h>
#include <execinfo.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_FRAMES 48
#define ANSWER_MS  200
#define SKIP_ASKED 2 /* the handler and the signal's trampoline */

static struct {
    _Atomic long asking; /* the thread asked now, 0 when none */
    void *frames[MAX_FRAMES];
    int n;
    sem_t answered;
} slot;

static long tid_now(void)
{
    return (long)syscall(SYS_gettid);
}

static void on_ask(int sig)
{
    (void)sig;
    const int saved = errno;
    if (atomic_load(&slot.asking) == tid_now()) {
        slot.n = backtrace(slot.frames, MAX_FRAMES);
        sem_post(&slot.answered);
    }
    errno = saved;
}

int moed_stacks_install(void)
{
    void *warm[2];
    backtrace(warm, 2); /* loads the unwinder now, not in a handler */
    if (sem_init(&slot.answered, 0, 0)) return -1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_ask;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    return sigaction(MOED_STACKS_SIGNAL, &sa, NULL);
}

/* frames as "object(symbol+offset) < ...", each object without its directory. */
static void frames_text(void *const *frames, int n, char *buf, size_t cap)
{
    char **names = n > 0 ? backtrace_symbols(frames, n) : NULL;
    size_t used = 0;
    buf[0] = 0;
    for (int i = 0; i < n && used + 1 < cap; i++) {
        char addr[32];
        const char *name = names ? names[i] : NULL;
        if (!name) {
            snprintf(addr, sizeof addr, "%p", frames[i]);
            name = addr;
        }
        const char *base = strrchr(name, '/');
        base = base ? base + 1 : name;
        const size_t len = strcspn(base, " "); /* drops " [0x...]" */
        used += (size_t)snprintf(buf + used, cap - used, "%s%.*s", i ? " < " : "", (int)len, base);
    }
    free(names);
}

static void thread_name(long tid, char *name, size_t cap)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%ld/comm", tid);
    FILE *f = fopen(path, "r");
    name[0] = 0;
    if (f && fgets(name, (int)cap, f)) name[strcspn(name, "\n")] = 0;
    if (f) fclose(f);
}

/* Asks thread tid for its stack: true with the slot filled once it answered in time. */
static bool ask(long tid)
{
    while (!sem_trywait(&slot.answered)) {
    } /* a post of a thread that answered too late */
    atomic_store(&slot.asking, tid);
    bool ok = !syscall(SYS_tgkill, (long)getpid(), tid, MOED_STACKS_SIGNAL);
    if (ok) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += ANSWER_MS * 1000000L;
        until.tv_sec += until.tv_nsec / 1000000000L;
        until.tv_nsec %= 1000000000L;
        int rc;
        while ((rc = sem_timedwait(&slot.answered, &until)) && errno == EINTR) {
        }
        ok = !rc;
    }
    atomic_store(&slot.asking, 0);
    return ok;
}

void moed_stacks_log(void)
{
    static pthread_mutex_t one = PTHREAD_MUTEX_INITIALIZER;
    static char text[MOED_LOG_LINE_MAX];
    pthread_mutex_lock(&one);
    DIR *dir = opendir("/proc/self/task");
    int threads = 0, answered = 0;
    const long self = tid_now();
    for (struct dirent *e; dir && (e = readdir(dir));) {
        const long tid = atol(e->d_name);
        if (tid <= 0) continue;
        char name[32];
        thread_name(tid, name, sizeof name);
        threads++;
        if (tid == self) {
            void *frames[MAX_FRAMES];
            const int n = backtrace(frames, MAX_FRAMES);
            frames_text(frames + 1, n - 1, text, sizeof text);
        } else if (ask(tid) && slot.n > SKIP_ASKED) {
            frames_text(slot.frames + SKIP_ASKED, slot.n - SKIP_ASKED, text, sizeof text);
        } else {
            moed_log_info("thread stack", "tid=%ld name=%s answered=false", tid, name);
            continue;
        }
        answered++;
        moed_log_info("thread stack", "tid=%ld name=%s frames=\"%s\"", tid, name, text);
    }
    if (dir) closedir(dir);
    moed_log_info("thread stacks", "threads=%d answered=%d", threads, answered);
    pthread_mutex_unlock(&one);
}
