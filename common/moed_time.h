/*
 * moed_time — the one clock every module times with: CLOCK_MONOTONIC, in nanoseconds or in
 * seconds. It never goes back and is not wall time (the logs stamp their own lines). And a sleep
 * of a number of seconds.
 */
#ifndef MOED_TIME_H
#define MOED_TIME_H

#include <errno.h>
#include <stdint.h>
#include <time.h>

static inline uint64_t moed_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline double moed_now_s(void)
{
    return (double)moed_now_ns() * 1e-9;
}

/* Sleeps s seconds (nothing when s <= 0), all of them: a signal's interruption sleeps on. */
static inline void moed_sleep_s(double s)
{
    if (!(s > 0)) return;
    struct timespec ts = { (time_t)s, (long)((s - (double)(time_t)s) * 1e9) };
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

#endif
