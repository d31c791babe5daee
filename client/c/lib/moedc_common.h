/*
 * moedc_common — what libmoedclient's own files share (private to lib/): filling a moedc_error
 * the way the daemon's modules fill theirs, and the watchdog threads' waits (a ring's, the links').
 */
#ifndef MOEDC_COMMON_H
#define MOEDC_COMMON_H

#include "moedclient.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

/* Records code and a printf-style message in err (which may be NULL) and returns code. */
int moedc_fail(moedc_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* A watchdog's condition, on the monotonic clock (a wall-clock step never stretches a wait). */
void moedc_watch_cond_init(pthread_cond_t *cv);
/* Waits on cv (mu held) for at most ns nanoseconds, or until signalled. */
void moedc_watch_wait(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t ns);
/* Sets *stop under mu, wakes the watchdog waiting on cv and joins it. */
void moedc_watch_stop(pthread_mutex_t *mu, pthread_cond_t *cv, bool *stop, pthread_t thread);

#endif
