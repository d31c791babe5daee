/*
 * moed_timings — where one request's time went: what the scheduler measures and a reply's Timings
 * message carries (proto/moed/v1/moed.proto). Its own header so the scheduler and the wire codec
 * share the type without depending on each other.
 */
#ifndef MOED_TIMINGS_H
#define MOED_TIMINGS_H

#include <stdint.h>

typedef struct moed_timings {
    uint64_t queue_us;       /* from queued to launched */
    uint64_t compute_us;     /* the launch it was part of: staging, routing, the backend */
    uint64_t total_us;       /* from received to reply ready */
    uint32_t batch_tokens;   /* tokens in that launch (its own and the others merged with it) */
    uint32_t batch_requests; /* requests in that launch */
} moed_timings;

#endif
