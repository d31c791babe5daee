/*
 * moed_backoff — how a thread waits for what another process or a GPU does next: a link's or a
 * ring's answer, a communicator's operation, a call's completion on a compute thread, a scheduler
 * worker's next request. One policy for every such wait, the daemon's and the client's
 * (docs/doorbell.md, "Host calls"; docs/operations.md, "CPU while serving"):
 *
 * - for MOED_BACKOFF_SPIN_NS from the wait's start it spins: MOED_BACKOFF_RELAX pauses of the core
 *   (the lowest latency for an answer that is microseconds away), then yields it, so that a
 *   machine with fewer cores than spinners still runs the others (the CPU backend's compute, the
 *   caller's threads). The spin is longer than a layer's kernels, so an answer is seen as it
 *   lands, and a caller's next call, within a step of its model, finds its waiter awake;
 * - then it sleeps MOED_BACKOFF_NAP_MIN_NS, doubling to MOED_BACKOFF_NAP_MAX_NS: an idle wait
 *   costs little, and a late answer is seen within a millisecond.
 *
 * Contract: moed_backoff_start begins a wait; each moed_backoff_pause is one step of it (the
 * caller checks its condition between steps), never sleeping past `until_ns` (CLOCK_MONOTONIC
 * nanoseconds, moed_now_ns; 0 for no bound); moed_backoff_spinning says whether the wait
 * is still in its spin (for a wait that sleeps on a condition of its own after it). Nothing is
 * shared: a moed_backoff belongs to the waiting thread.
 */
#ifndef MOED_BACKOFF_H
#define MOED_BACKOFF_H

#include "moed_time.h"

#include <stdbool.h>
#include <stdint.h>

#define MOED_BACKOFF_SPIN_NS    20000000ull
#define MOED_BACKOFF_RELAX      512u
#define MOED_BACKOFF_NAP_MIN_NS 50000ull
#define MOED_BACKOFF_NAP_MAX_NS 1000000ull

typedef struct moed_backoff {
    uint64_t start_ns, nap_ns;
    unsigned relaxed;
} moed_backoff;

void moed_backoff_start(moed_backoff *b);
bool moed_backoff_spinning(const moed_backoff *b);
void moed_backoff_pause(moed_backoff *b, uint64_t until_ns);
/* What the pause at `now_ns` does: 0 to spin, else the nanoseconds it sleeps (at most to until_ns;
 * 0 once that has passed, when the caller's own check ends the wait). */
uint64_t moed_backoff_sleep_ns(const moed_backoff *b, uint64_t now_ns, uint64_t until_ns);

#endif
