/*
 * moed_loading — how far the daemon's load of its weights has come: what the log says every few
 * seconds while it lasts, GetModel answers (ModelInfo.loading) and systemd's STATUS= shows. The
 * daemon loads one model once, so there is one load per process: the loader's steps write it
 * (weights.c while it reads or generates the layers, main.c while it places them in the backend),
 * and any thread reads a snapshot of it (a mutex, taken a few times per tensor).
 *
 * A load goes through phases, each over the layers held: "reading" (a checkpoint's tensors, copied
 * or mapped), "generating" (synthetic layers), then "placing" (each layer into the backend: the
 * CUDA backend copies it to its devices there, from the files' mappings). A phase counts layers
 * and bytes; its percent, rate and time left are of that phase, from its bytes (its layers where
 * it counts none).
 *
 * For tests only: with MOED_TEST_LOAD_GATE=PATH in the environment, the load stops after each layer
 * it has counted for as long as PATH exists, so a test can see it half done whatever the
 * machine's speed (create PATH before the start, remove it to let the load go on).
 */
#ifndef MOED_LOADING_H
#define MOED_LOADING_H

#include <stdbool.h>
#include <stdint.h>

typedef struct moed_loading_state {
    bool active;       /* between moed_loading_begin and moed_loading_end */
    char what[512];    /* the checkpoint folder, or the synthetic spec, as given */
    const char *phase; /* "reading", "generating", "placing"; "" before the first */
    int phase_no, phases;
    int layer; /* the checkpoint index of the layer in hand; -1 between layers */
    int layers_done, layers_total;
    uint64_t bytes_done, bytes_total; /* bytes_total 0: this phase counts layers only */
    double elapsed_s, phase_elapsed_s;
    double percent;  /* of this phase, 0 .. 100 */
    double rate_bps; /* bytes per second of this phase so far; 0 before any */
    double eta_s;    /* this phase's time left; < 0 while unknown */
} moed_loading_state;

/* The load of `what` starts; it has `phases` phases. */
void moed_loading_begin(const char *what, int phases);
/* The next phase starts: `layers` layers, `bytes` bytes in all (0: not counted in bytes). */
void moed_loading_phase(const char *phase, int layers, uint64_t bytes);
/* Layer `index` (the checkpoint's numbering) is in hand. */
void moed_loading_layer(int index);
/* n more bytes of this phase are done. */
void moed_loading_bytes(uint64_t n);
/* The layer in hand is done (and, for tests, the gate is waited for). */
void moed_loading_layer_done(void);
/* Every phase is done (or the load failed). */
void moed_loading_end(void);

void moed_loading_get(moed_loading_state *out);

/* The state as one sentence for people ("reading layer 3 (2 of 8 done), 25.0% of 1.2 GiB at
 * 310 MiB/s, about 3 s left"). */
void moed_loading_describe(const moed_loading_state *s, char *buf, unsigned size);

#endif
