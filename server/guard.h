/*
 * moed_guard — the one way moed's CPU touches memory another process can take away: a copy that
 * survives SIGBUS.
 *
 * A client may shrink the shared-memory object behind a host region (ftruncate) after the server
 * mapped it; reading or writing a page past the new end then raises SIGBUS in whichever thread
 * touched it. moed_guard_copy runs the copy under a per-thread recovery point: a fault inside it
 * returns MOED_EPRECOND instead of killing the daemon. A SIGBUS anywhere else keeps its default
 * action (the process ends with a core), as it would without this module.
 *
 * Thread-safe; the handler is installed once, on first use (or by moed_guard_init).
 */
#ifndef MOED_GUARD_H
#define MOED_GUARD_H

#include <stddef.h>

/* Installs the process's SIGBUS handler (idempotent). */
void moed_guard_init(void);

/* memcpy(dst, src, n), returning 0, or MOED_EPRECOND when either side faulted part way (dst is
 * then partly written). */
int moed_guard_copy(void *dst, const void *src, size_t n);

/* fn(arg) under the same recovery point: 0, or MOED_EPRECOND when it faulted, cut short where it
 * was (so fn takes no lock and allocates nothing: a fault skips whatever it would have done next).
 * For code that reads and writes several words of shared memory in a row (the doorbell's rings). */
int moed_guard_run(void (*fn)(void *arg), void *arg);

#endif
