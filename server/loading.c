/*
 * moed_loading — the progress of the weights' load (loading.h).
 */
#include "loading.h"

#include "moed_time.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define GATE_POLL_NS 10000000 /* how often the test gate is looked at */

static struct {
    pthread_mutex_t mu;
    moed_loading_state s; /* elapsed, percent, rate and eta are filled by moed_loading_get */
    double t0, t_phase;
} load = { .mu = PTHREAD_MUTEX_INITIALIZER, .s = { .phase = "", .layer = -1 } };

void moed_loading_begin(const char *what, int phases)
{
    pthread_mutex_lock(&load.mu);
    memset(&load.s, 0, sizeof load.s);
    load.s.active = true;
    snprintf(load.s.what, sizeof load.s.what, "%s", what ? what : "");
    load.s.phase = "";
    load.s.phases = phases;
    load.s.layer = -1;
    load.t0 = load.t_phase = moed_now_s();
    pthread_mutex_unlock(&load.mu);
}

void moed_loading_phase(const char *phase, int layers, uint64_t bytes)
{
    pthread_mutex_lock(&load.mu);
    load.s.phase = phase;
    load.s.phase_no++;
    load.s.layer = -1;
    load.s.layers_done = 0;
    load.s.layers_total = layers;
    load.s.bytes_done = 0;
    load.s.bytes_total = bytes;
    load.t_phase = moed_now_s();
    pthread_mutex_unlock(&load.mu);
}

void moed_loading_layer(int index)
{
    pthread_mutex_lock(&load.mu);
    load.s.layer = index;
    pthread_mutex_unlock(&load.mu);
}

void moed_loading_bytes(uint64_t n)
{
    pthread_mutex_lock(&load.mu);
    load.s.bytes_done += n;
    pthread_mutex_unlock(&load.mu);
}

/* For tests: waits while the file MOED_TEST_LOAD_GATE names exists. */
static void gate(void)
{
    const char *path = getenv("MOED_TEST_LOAD_GATE");
    struct stat st;
    while (path && *path && !stat(path, &st)) {
        struct timespec ts = { 0, GATE_POLL_NS };
        nanosleep(&ts, NULL);
    }
}

void moed_loading_layer_done(void)
{
    pthread_mutex_lock(&load.mu);
    load.s.layers_done++;
    load.s.layer = -1;
    pthread_mutex_unlock(&load.mu);
    gate();
}

void moed_loading_end(void)
{
    pthread_mutex_lock(&load.mu);
    load.s.active = false;
    pthread_mutex_unlock(&load.mu);
}

void moed_loading_get(moed_loading_state *out)
{
    pthread_mutex_lock(&load.mu);
    *out = load.s;
    const double t = moed_now_s();
    out->elapsed_s = t - load.t0;
    out->phase_elapsed_s = t - load.t_phase;
    pthread_mutex_unlock(&load.mu);
    double done = 0; /* the phase's share done, by bytes where it counts them */
    if (out->bytes_total)
        done = (double)out->bytes_done / (double)out->bytes_total;
    else if (out->layers_total)
        done = (double)out->layers_done / out->layers_total;
    done = done > 1 ? 1 : done;
    out->percent = 100 * done;
    out->rate_bps = out->phase_elapsed_s > 0 ? (double)out->bytes_done / out->phase_elapsed_s : 0;
    out->eta_s = done > 0 ? out->phase_elapsed_s * (1 - done) / done : -1;
}

void moed_loading_describe(const moed_loading_state *s, char *buf, unsigned size)
{
    int n = snprintf(buf, size, "%s", s->phase[0] ? s->phase : "starting");
    if (n >= 0 && (unsigned)n < size && s->layer >= 0)
        n += snprintf(buf + n, size - (unsigned)n, " layer %d", s->layer);
    if (n >= 0 && (unsigned)n < size && s->phase[0])
        n += snprintf(buf + n, size - (unsigned)n, " (%d of %d layers done), %.1f%%",
                      s->layers_done, s->layers_total, s->percent);
    if (n >= 0 && (unsigned)n < size && s->bytes_total)
        n += snprintf(buf + n, size - (unsigned)n, " of %.2f GiB at %.0f MiB/s",
                      (double)s->bytes_total / (1 << 30), s->rate_bps / (1 << 20));
    if (n >= 0 && (unsigned)n < size && s->eta_s >= 0)
        snprintf(buf + n, size - (unsigned)n, ", about %.0f s left", s->eta_s);
}
