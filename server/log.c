/*
 * moed_log — logfmt lines, formatted into one buffer and written with one write(2), so concurrent
 * threads never interleave and the log needs no lock on the hot path. The destination swap on
 * SIGHUP takes a lock; readers load the descriptor atomically.
 */
#include "log.h"

#include "moed_err.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static _Atomic int log_level = MOED_LOG_INFO;
static _Atomic int log_fd = STDERR_FILENO;
static char log_path[4096];
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *const level_names[] = { "debug", "info", "warn", "error" };

int moed_log_parse_level(const char *name)
{
    for (int i = 0; i < 4; i++)
        if (!strcmp(name, level_names[i])) return i;
    if (!strcmp(name, "warning")) return MOED_LOG_WARN;
    return -1;
}

static int open_log(const char *path)
{
    return open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

int moed_log_init(moed_log_level level, const char *path)
{
    atomic_store(&log_level, level);
    if (!path || !*path || !strcmp(path, "-")) {
        log_path[0] = 0;
        return 0;
    }
    int fd = open_log(path);
    if (fd < 0) return MOED_EIO;
    snprintf(log_path, sizeof log_path, "%s", path);
    atomic_store(&log_fd, fd);
    return 0;
}

int moed_log_reopen(void)
{
    if (!log_path[0]) return 0;
    int fd = open_log(log_path);
    if (fd < 0) return MOED_EIO;
    pthread_mutex_lock(&log_lock);
    int old = atomic_exchange(&log_fd, fd);
    pthread_mutex_unlock(&log_lock);
    if (old != STDERR_FILENO) close(old);
    return 0;
}

void moed_log_close(void)
{
    int old = atomic_exchange(&log_fd, STDERR_FILENO);
    if (old != STDERR_FILENO) close(old);
    log_path[0] = 0;
}

int moed_log_enabled(moed_log_level level)
{
    return (int)level >= atomic_load(&log_level);
}

void moed_log(moed_log_level level, const char *msg, const char *kv, ...)
{
    if (!moed_log_enabled(level)) return;
    char line[2048];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n =
        snprintf(line, sizeof line, "ts=%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ level=%s msg=\"%s\"",
                 tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                 ts.tv_nsec / 1000000, level_names[level], msg);
    if (kv && n < (int)sizeof line - 2) {
        va_list ap;
        va_start(ap, kv);
        line[n++] = ' ';
        int m = vsnprintf(line + n, sizeof line - (size_t)n, kv, ap);
        va_end(ap);
        if (m > 0) n += m;
    }
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    pthread_mutex_lock(&log_lock);
    ssize_t w = write(atomic_load(&log_fd), line, (size_t)n);
    pthread_mutex_unlock(&log_lock);
    (void)w;
}
