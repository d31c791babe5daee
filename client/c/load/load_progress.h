/*
 * load_progress — moed-load's progress line, as text (load_run.c prints it on stderr every half
 * second while a level runs, when stderr is a terminal or --progress says so): which level of the
 * run, where it is (warming up, its window in seconds or requests with the share done, or
 * finishing the calls in flight), the rate of the last interval, the replies and errors and the
 * latency of the window so far, and the time the run has left. Pure: no I/O, no clock.
 */
#ifndef LOAD_PROGRESS_H
#define LOAD_PROGRESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum { LOAD_WARMUP, LOAD_MEASURE, LOAD_FINISH } load_phase;

typedef struct load_progress {
    int level, n_levels; /* 0-based, of the run's levels */
    int concurrency;     /* the level: closed loop, or 0 */
    double rate;         /* open loop: the rate asked */
    load_phase phase;
    double elapsed_s;  /* of the phase */
    double warmup_s;   /* --warmup */
    double duration_s; /* --duration, or 0 with --requests */
    uint64_t requests; /* --requests, or 0 */
    uint64_t started;  /* measured requests started so far */
    double rps;        /* completions per second over the last interval */
    uint64_t ok, errors, expected_errors;
    double p50_ms, p99_ms; /* of the window's ok replies; < 0: none yet */
} load_progress;

/* Seconds the run has left: the rest of this level (its window, or its requests at rps) and each
 * level after it (its warm-up and a window as long); < 0 while not known (--requests, no rate
 * yet). */
double load_progress_left_s(const load_progress *p);

/* The line into buf (always terminated), cut to width - 1 columns when width > 1, so that it fits
 * one terminal row and \r can rewrite it. */
void load_progress_text(const load_progress *p, int width, char *buf, size_t size);

#endif
