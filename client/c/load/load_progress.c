/*
 * load_progress — the progress line's text (load_progress.h).
 */
#include "load_progress.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

double load_progress_left_s(const load_progress *p)
{
    double window_s = p->duration_s, left_s;
    if (p->requests) {
        if (p->rps <= 0) return -1;
        window_s = (double)p->requests / p->rps;
        const uint64_t started = p->started < p->requests ? p->started : p->requests;
        left_s = (double)(p->requests - started) / p->rps;
    } else {
        left_s = p->phase == LOAD_MEASURE && p->elapsed_s < window_s ? window_s - p->elapsed_s : 0;
    }
    if (p->phase == LOAD_WARMUP)
        left_s = (p->warmup_s > p->elapsed_s ? p->warmup_s - p->elapsed_s : 0) + window_s;
    return left_s + (p->n_levels - 1 - p->level) * (p->warmup_s + window_s);
}

/* Appends to buf[*k..size) as printf does, never past its end. */
static void add(char *buf, size_t size, size_t *k, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void add(char *buf, size_t size, size_t *k, const char *fmt, ...)
{
    if (*k + 1 >= size) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + *k, size - *k, fmt, ap);
    va_end(ap);
    if (n > 0) *k += (size_t)n < size - *k ? (size_t)n : size - *k - 1;
}

void load_progress_text(const load_progress *p, int width, char *buf, size_t size)
{
    size_t k = 0;
    buf[0] = 0;
    if (p->concurrency)
        add(buf, size, &k, "[%d/%d c=%d] ", p->level + 1, p->n_levels, p->concurrency);
    else
        add(buf, size, &k, "[%d/%d %g/s] ", p->level + 1, p->n_levels, p->rate);
    if (p->phase == LOAD_WARMUP)
        add(buf, size, &k, "warm-up %.1f/%.1f s", p->elapsed_s, p->warmup_s);
    else if (p->phase == LOAD_FINISH)
        add(buf, size, &k, "finishing the calls in flight");
    else if (p->requests)
        add(buf, size, &k, "%llu/%llu requests (%.0f%%)", (unsigned long long)p->started,
            (unsigned long long)p->requests, 100.0 * (double)p->started / (double)p->requests);
    else
        add(buf, size, &k, "%.1f/%.1f s (%.0f%%)", p->elapsed_s, p->duration_s,
            100.0 * p->elapsed_s / p->duration_s);
    add(buf, size, &k, "  %.0f req/s  ok %llu  errors %llu", p->rps, (unsigned long long)p->ok,
        (unsigned long long)p->errors);
    if (p->expected_errors)
        add(buf, size, &k, " (+%llu expected)", (unsigned long long)p->expected_errors);
    if (p->p50_ms >= 0) add(buf, size, &k, "  p50 %.3f ms  p99 %.3f ms", p->p50_ms, p->p99_ms);
    const double left = load_progress_left_s(p);
    if (left >= 0) add(buf, size, &k, "  run ends in %.0f s", left);
    if (width > 1 && strlen(buf) >= (size_t)width) buf[width - 1] = 0;
}
