/*
 * test_route_pack — the packed route's host side (kernels/cuda/route_pack.c), against a reference
 * written token by token: the offsets of a job whose parts bring device routing (k slots a token
 * of a run, the host pairs of every other token), and the packed words of every chunk of it (the
 * offsets rebased, each host pair in its slot with its token number, the runs' slots left as they
 * were for the device to fill), cut anywhere: inside a run, at its edges, between host tokens. A
 * job without runs packs as it always did. The layout of route prep's arrays behind the inputs
 * tiles the buffer moed_cuda_route_words sizes, with room for the null pairs' expert (cursor [E +
 * 1]). Needs no GPU: all of it is arithmetic on the host.
 */
#include "check.h"

#include "moed_cuda.h"
#include "moed_route.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define T_MAX   40
#define P_MAX   (T_MAX * 8)
#define UNTOUCH 0x7eadbeef

static uint64_t rng = 12345;

static unsigned rnd(unsigned n)
{
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (unsigned)(rng >> 33) % n;
}

/* A job of T tokens: host tokens with 0 .. 4 pairs, runs of device-routed tokens with none. */
typedef struct job {
    int64_t T;
    moed_route r;
    moed_cuda_drun runs[8];
    int n_runs;
} job;

static void make_job(job *j, int64_t T)
{
    memset(j, 0, sizeof *j);
    j->T = T;
    CHECK(moed_route_init(&j->r, T, T * 4) == 0);
    int64_t n = 0;
    for (int64_t t = 0; t < T;) {
        if (rnd(3) == 0 && j->n_runs < 8) { /* a run of 1 .. 6 tokens, k 1 .. 7 */
            moed_cuda_drun *u = &j->runs[j->n_runs++];
            u->t0 = t;
            const int64_t rows = 1 + rnd(6);
            u->rows = rows < T - t ? rows : T - t;
            u->k = 1 + (int32_t)rnd(7);
            for (int64_t e = t + u->rows; t < e; t++) j->r.off[t + 1] = n;
            continue;
        }
        const int m = (int)rnd(5);
        for (int q = 0; q < m; q++, n++) {
            j->r.expert[n] = (int32_t)rnd(16);
            j->r.weight[n] = (float)(n + 1) / 8.0f;
        }
        j->r.off[++t] = n;
    }
}

/* The run holding token t, or NULL. */
static const moed_cuda_drun *run_of(const job *j, int64_t t)
{
    for (int i = 0; i < j->n_runs; i++)
        if (t >= j->runs[i].t0 && t < j->runs[i].t0 + j->runs[i].rows) return &j->runs[i];
    return NULL;
}

static void check_chunk(const job *j, const int64_t *lay, int64_t t0, int64_t t1)
{
    const moed_cuda_route_src src = { j->r.off, j->r.expert, j->r.weight, lay, j->runs, j->n_runs };
    const int64_t T = t1 - t0, P = lay[t1] - lay[t0];
    int32_t dst[T_MAX + 1 + 3 * P_MAX];
    for (size_t i = 0; i < sizeof dst / sizeof dst[0]; i++) dst[i] = UNTOUCH;
    moed_cuda_route_pack(dst, &src, t0, t1);
    const int32_t *tok = dst + T + 1, *exp = tok + P;
    const float *w = (const float *)(exp + P);
    int bad = 0;
    for (int64_t t = 0; t <= T; t++) bad += dst[t] != (int32_t)(lay[t0 + t] - lay[t0]);
    for (int64_t t = t0; t < t1; t++) {
        const int64_t s = lay[t] - lay[t0];
        if (run_of(j, t)) { /* k slots, untouched: the device writes them */
            for (int64_t q = s; q < lay[t + 1] - lay[t0]; q++)
                bad += tok[q] != UNTOUCH || exp[q] != UNTOUCH;
            continue;
        }
        for (int64_t q = j->r.off[t]; q < j->r.off[t + 1]; q++) {
            const int64_t at = s + q - j->r.off[t];
            bad += tok[at] != (int32_t)(t - t0) || exp[at] != j->r.expert[q] ||
                   w[at] != j->r.weight[q];
        }
    }
    bad += dst[T + 1 + 3 * P] != UNTOUCH; /* nothing written past the packed words */
    CHECK_MSG(!bad, "chunk [%lld, %lld) of a job of %lld tokens and %d runs: %d words wrong",
              (long long)t0, (long long)t1, (long long)j->T, j->n_runs, bad);
}

static void test_offsets_and_chunks(void)
{
    for (int round = 0; round < 300; round++) {
        job j;
        make_job(&j, 1 + rnd(T_MAX));
        int64_t lay[T_MAX + 1];
        moed_cuda_route_offsets(lay, j.r.off, j.T, j.runs, j.n_runs);
        int bad = lay[0] != 0;
        for (int64_t t = 0; t < j.T; t++) {
            const moed_cuda_drun *u = run_of(&j, t);
            bad += lay[t + 1] - lay[t] != (u ? u->k : j.r.off[t + 1] - j.r.off[t]);
        }
        CHECK_MSG(!bad, "offsets of a job of %lld tokens and %d runs", (long long)j.T, j.n_runs);
        check_chunk(&j, lay, 0, j.T);
        for (int c = 0; c < 6; c++) { /* chunks cut anywhere */
            const int64_t a = rnd((unsigned)j.T), b = a + 1 + rnd((unsigned)(j.T - a));
            check_chunk(&j, lay, a, b);
        }
        for (int i = 0; i < j.n_runs; i++) { /* at a run's edges and inside it */
            const moed_cuda_drun *u = &j.runs[i];
            check_chunk(&j, lay, u->t0, u->t0 + u->rows);
            if (u->rows > 1) check_chunk(&j, lay, u->t0 + 1, u->t0 + u->rows);
            if (u->t0 > 0) check_chunk(&j, lay, u->t0 - 1, u->t0 + 1);
        }
        moed_route_free(&j.r);
    }
}

/* No runs: lay is the route's own offsets, and every pair lands where the route has it. */
static void test_host_only(void)
{
    job j;
    make_job(&j, T_MAX);
    j.n_runs = 0;
    for (int64_t t = 0; t < j.T; t++) j.r.off[t + 1] = j.r.off[t] + (t % 3); /* refill: no runs */
    for (int64_t q = 0; q < j.r.off[j.T]; q++) {
        j.r.expert[q] = (int32_t)(q % 16);
        j.r.weight[q] = (float)q;
    }
    int64_t lay[T_MAX + 1];
    moed_cuda_route_offsets(lay, j.r.off, j.T, NULL, 0);
    CHECK(!memcmp(lay, j.r.off, sizeof(int64_t) * (size_t)(j.T + 1)));
    check_chunk(&j, j.r.off, 0, j.T);
    check_chunk(&j, j.r.off, 7, 23);
    moed_route_free(&j.r);
}

/* Route prep's arrays follow the inputs, each at its size, and end where the buffer does. */
static void test_layout(void)
{
    const int64_t T = 37, P = 91;
    const int E = 13, bm = 16;
    const int32_t tiles = moed_cuda_route_max_tiles((int32_t)P, E, bm);
    const size_t words = moed_cuda_route_words(T, P, E, tiles);
    int32_t *buf = calloc(words, sizeof *buf);
    moed_cuda_route_dev r;
    moed_cuda_route_layout(&r, buf, T, P, E, bm);
    CHECK(r.tok_off == buf && r.pair_tok == buf + T + 1 && r.pair_exp == r.pair_tok + P);
    CHECK((const int32_t *)r.pair_w == r.pair_exp + P);
    CHECK(r.exp_off == buf + moed_cuda_route_in_words(T, P));
    CHECK(r.cursor == r.exp_off + E + 1);  /* exp_off [E + 1] */
    CHECK(r.slot_tok == r.cursor + E + 1); /* cursor [E + 1]: the null expert's rows too */
    CHECK(r.pair_slot == r.slot_tok + P);
    CHECK(r.tile_exp == r.pair_slot + P && r.tile_row == r.tile_exp + tiles);
    CHECK(r.n_tiles == r.tile_row + tiles && r.n_tiles + 1 == buf + words);
    free(buf);
}

int main(void)
{
    test_offsets_and_chunks();
    test_host_only();
    test_layout();
    return check_status("test_route_pack");
}
