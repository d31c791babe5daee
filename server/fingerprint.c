/*
 * moed_fingerprint — the model's identity (see fingerprint.h).
 *
 * The hash folds 8-byte little-endian words into a 64-bit state through splitmix64 (a bijection:
 * two inputs of one length that differ in one word always differ), then the length; each string
 * and piece is folded with its length, so no two sequences of fields run into each other.
 */
#include "fingerprint.h"

#include "moed_dtype.h"
#include "moed_synth.h"

#include <stdio.h>
#include <string.h>

#define PIECES      4
#define PIECE_BYTES 64

static uint64_t fold(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t at = 0; at < n; at += 8) {
        uint64_t w = 0;
        for (size_t i = 0; i < 8 && at + i < n; i++) w |= (uint64_t)b[at + i] << (8 * i);
        h = moed_splitmix64(h ^ w);
    }
    return moed_splitmix64(h ^ (uint64_t)n);
}

static uint64_t fold_u64(uint64_t h, uint64_t v)
{
    unsigned char b[8];
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
    return fold(h, b, sizeof b);
}

static uint64_t fold_str(uint64_t h, const char *s)
{
    return fold(h, s, strlen(s));
}

uint64_t moed_fingerprint_synthetic(const char *spec)
{
    return fold_str(fold_str(0, "moed synthetic"), spec);
}

/* What config.json says of the MoE layers, as moed reads it. */
static uint64_t fold_config(uint64_t h, const moed_hf_config *c, int wdtype)
{
    const moed_layer_info *l = &c->layer;
    float scale = l->routed_scale;
    uint32_t scale_bits;
    memcpy(&scale_bits, &scale, 4);
    const int64_t v[] = { c->n_layers,    l->d_model,    l->d_ff,      l->n_experts,
                          l->top_k,       l->act,        l->norm_topk, l->rule,
                          l->n_group,     l->topk_group, scale_bits,   l->n_shared,
                          l->shared_d_ff, l->has_router, c->fp8,       wdtype };
    h = fold_str(fold_str(h, "moed checkpoint"), c->arch_name);
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) h = fold_u64(h, (uint64_t)v[i]);
    return fold(h, c->is_moe, (size_t)c->n_layers);
}

/* Tensor `name`: absent, unreadable, or its dtype, shape and pieces (and an FP8 matrix's block
 * scales). */
static uint64_t fold_tensor(uint64_t h, moed_st_dir *st, const char *name)
{
    const moed_st_tensor *t;
    moed_error err;
    h = fold_str(h, name);
    if (moed_st_find(st, name, &t, &err)) return fold_str(h, "unreadable");
    const size_t len = strlen(name);
    if (!t && len > 7 && !strcmp(name + len - 7, ".weight")) {
        /* a compressed-tensors 2:4 matrix (hf.h): its kept values and where they lie */
        char piece[300];
        snprintf(piece, sizeof piece, "%.*s.compressed", (int)(len - 7), name);
        if (moed_st_find(st, piece, &t, &err)) return fold_str(h, "unreadable");
        if (t) {
            snprintf(piece, sizeof piece, "%.*s.compressed", (int)(len - 7), name);
            h = fold_tensor(h, st, piece);
            snprintf(piece, sizeof piece, "%.*s.bitmask", (int)(len - 7), name);
            return fold_tensor(h, st, piece);
        }
    }
    if (!t) return fold_str(h, "absent");
    h = fold_str(h, t->dtype);
    for (int i = 0; i < t->ndim; i++) h = fold_u64(h, t->shape[i]);
    unsigned char piece[PIECE_BYTES];
    const uint64_t n = t->nbytes < PIECE_BYTES ? t->nbytes : PIECE_BYTES;
    for (int i = 0; i < PIECES; i++) {
        const uint64_t at = (t->nbytes - n) * (uint64_t)i / (PIECES - 1);
        h = moed_st_read_part(st, t, at, n, piece, &err) ? fold_str(h, "unreadable")
                                                         : fold(h, piece, (size_t)n);
    }
    if (t->mdtype != MOED_FP8) return h;
    char scale[300];
    snprintf(scale, sizeof scale, "%s_scale_inv", name);
    return fold_tensor(h, st, scale);
}

uint64_t moed_fingerprint_checkpoint(moed_st_dir *st, const moed_hf_config *cfg, int wdtype)
{
    static const int per_layer[] = { MOED_SYNTH_ROUTER, MOED_SYNTH_BIAS, MOED_SYNTH_SHARED_W1,
                                     MOED_SYNTH_SHARED_W3, MOED_SYNTH_SHARED_W2 };
    uint64_t h = fold_config(0, cfg, wdtype);
    char name[256];
    for (int L = 0; L < cfg->n_layers; L++) {
        if (!cfg->is_moe[L]) continue;
        for (size_t k = 0; k < sizeof per_layer / sizeof per_layer[0]; k++) {
            const bool shared =
                per_layer[k] >= MOED_SYNTH_SHARED_W1 && per_layer[k] <= MOED_SYNTH_SHARED_W2;
            if ((!shared || cfg->layer.n_shared) &&
                moed_hf_tensor_name(cfg, L, per_layer[k], 0, name, sizeof name))
                h = fold_tensor(h, st, name);
        }
        for (int e = 0; e < cfg->layer.n_experts; e++)
            for (int k = MOED_SYNTH_W1; k <= MOED_SYNTH_W2; k++)
                if (moed_hf_tensor_name(cfg, L, k, e, name, sizeof name))
                    h = fold_tensor(h, st, name);
    }
    return h;
}
