/*
 * moed_stacks — every thread's stack in the log, on request (SIGUSR2, docs/operations.md): what a
 * daemon that stopped answering is waiting in, without a debugger on the machine.
 *
 * moed_stacks_install sets the handler of the signal each thread is asked with (a real-time one,
 * MOED_STACKS_SIGNAL) and takes a first backtrace, so that the handler loads nothing later.
 * moed_stacks_log, from an ordinary thread (the loop's), asks the process's threads one at a time
 * and logs a line for each: msg="thread stack" tid=N name=NAME frames="object(symbol+offset) < ..."
 * (innermost first; the daemon's own functions as moed(+offset), which `addr2line -f -e moed
 * OFFSET` names), or answered=false for a thread that did not answer within 200 ms (it blocks the
 * signal); then msg="thread stacks" with the counts. A thread that answers too late writes
 * nothing. One dump at a time.
 */
#ifndef MOED_STACKS_H
#define MOED_STACKS_H

#include <signal.h>

#define MOED_STACKS_SIGNAL (SIGRTMIN + 7) /* one no library of ours uses */

/* 0, or -1 with errno from sigaction. */
int moed_stacks_install(void);
void moed_stacks_log(void);

#endif
