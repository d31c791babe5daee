/*
 * route_pack — a batch's route as the kernels read it: the packed inputs (tok_off, pair_tok,
 * pair_exp, pair_w as int32 words, rebased to the batch's first token) that move host to device,
 * and the layout of route prep's arrays behind them. Host code alone, no CUDA call: what it writes
 * is a pure function of the job's route and of where its device-routed tokens are.
 *
 * A device-routed token (moed_cuda_drun) holds k slots, one per column of its choice, padding
 * included: the host writes the offsets, so every token's slots are known before any kernel runs,
 * and route_choice.cu fills the run's slots on the device. A job without runs packs exactly as it
 * did before runs existed.
 */
#include "moed_cuda.h"

#include <string.h>

size_t moed_cuda_route_in_words(int64_t T, int64_t P)
{
    return (size_t)(T + 1) + 3 * (size_t)P;
}

size_t moed_cuda_route_words(int64_t T, int64_t P, int E, int32_t max_tiles)
{
    return moed_cuda_route_in_words(T, P) + 2 * ((size_t)E + 1) /* exp_off, cursor */
           + 2 * (size_t)P                                      /* slot_tok, pair_slot */
           + 2 * (size_t)max_tiles + 1;                         /* tile_exp, tile_row, n_tiles */
}

void moed_cuda_route_offsets(int64_t *lay, const int64_t *off, int64_t T,
                             const moed_cuda_drun *runs, int n_runs)
{
    int r = 0;
    lay[0] = 0;
    for (int64_t t = 0; t < T; t++) {
        while (r < n_runs && runs[r].t0 + runs[r].rows <= t) r++;
        const int in_run = r < n_runs && runs[r].t0 <= t;
        lay[t + 1] = lay[t] + (in_run ? runs[r].k : off[t + 1] - off[t]);
    }
}

/* The host pairs of tokens [a, b) (none in a run) into their slots, b - a tokens from slot `at` of
 * pair_tok, pair_exp and pair_w, token numbers counted from t0. */
static void pack_host(const moed_cuda_route_src *src, int64_t t0, int64_t a, int64_t b,
                      int32_t *pair_tok, int32_t *pair_exp, float *pair_w, int64_t at)
{
    const int64_t p0 = src->off[a], n = src->off[b] - p0;
    for (int64_t t = a; t < b; t++)
        for (int64_t j = src->off[t]; j < src->off[t + 1]; j++)
            pair_tok[at + j - p0] = (int32_t)(t - t0);
    memcpy(pair_exp + at, src->expert + p0, sizeof(int32_t) * (size_t)n);
    memcpy(pair_w + at, src->weight + p0, sizeof(float) * (size_t)n);
}

void moed_cuda_route_pack(int32_t *dst, const moed_cuda_route_src *src, int64_t t0, int64_t t1)
{
    const int64_t *lay = src->lay, T = t1 - t0, P = lay[t1] - lay[t0];
    int32_t *pair_tok = dst + T + 1, *pair_exp = pair_tok + P;
    float *pair_w = (float *)(pair_exp + P);
    for (int64_t t = 0; t <= T; t++) dst[t] = (int32_t)(lay[t0 + t] - lay[t0]);
    /* Alternately a range of host tokens [a, b) and the part of a run that follows it. */
    int r = 0;
    for (int64_t a = t0; a < t1;) {
        while (r < src->n_runs && src->runs[r].t0 + src->runs[r].rows <= a) r++;
        const moed_cuda_drun *run = r < src->n_runs && src->runs[r].t0 < t1 ? &src->runs[r] : NULL;
        const int64_t b = !run ? t1 : run->t0 > a ? run->t0 : a;
        pack_host(src, t0, a, b, pair_tok, pair_exp, pair_w, lay[a] - lay[t0]);
        a = !run ? t1 : run->t0 + run->rows < t1 ? run->t0 + run->rows : t1;
    }
}

void moed_cuda_route_layout(moed_cuda_route_dev *r, int32_t *dev, int64_t T, int64_t P, int E,
                            int bm)
{
    r->T = (int32_t)T;
    r->P = (int32_t)P;
    r->E = E;
    r->tok_off = dev;
    r->pair_tok = dev + T + 1;
    r->pair_exp = r->pair_tok + P;
    r->pair_w = (const float *)(r->pair_exp + P);
    r->exp_off = dev + moed_cuda_route_in_words(T, P);
    r->cursor = r->exp_off + E + 1;
    r->slot_tok = r->cursor + E + 1;
    r->pair_slot = r->slot_tok + P;
    r->bm = bm;
    r->max_tiles = moed_cuda_route_max_tiles((int32_t)P, E, bm);
    r->tile_exp = r->pair_slot + P;
    r->tile_row = r->tile_exp + r->max_tiles;
    r->n_tiles = r->tile_row + r->max_tiles;
}
