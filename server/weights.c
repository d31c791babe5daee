/*
 * moed_weights — builds the moed_model the daemon serves, from the synthetic generator or from a
 * Hugging Face checkpoint (see weights.h).
 *
 * FP8: a checkpoint whose config.json says block-scaled FP8 keeps its F8_E4M3 expert matrices as
 * they are and reads each one's `_scale_inv` table (converted to float32, checked: the shape its
 * matrix needs, every scale a finite number > 0 and at most moed_fp8_scale_max); with wdtype
 * MOED_FP8 a float checkpoint's expert matrices are quantized at load by moed_fp8.h's rule into
 * buffers the model owns.
 *
 * With MOED_WEIGHTS_MAP a checkpoint's expert matrices are used where they lie in the mapping;
 * with MOED_WEIGHTS_COPY each tensor is read into its own 64-byte-aligned buffer and the files are
 * closed once every tensor is in (weights.h says why and when). The router stays in its own dtype
 * (the server router computes from it as stored); only the DeepSeek router bias, when not
 * float32, is converted into a buffer this module owns.
 *
 * 2:4 (MOED_WEIGHTS_SPARSE24): every routed expert matrix is pruned where the model owns it (a
 * synthetic layer's buffers, a checkpoint's copies; with MOED_WEIGHTS_MAP the expert matrices are
 * copied out of the mapping first, since a mapping is never written), one expert at a time right
 * after it is read, its dense values first fed to the layer's moed_prune probe: the error the log
 * states costs no second copy of the layer.
 *
 * Every held layer's tensors are looked up before any is read: missing ones are reported together
 * (a user who fixes one missing name at a time would otherwise restart the daemon once per name)
 * and before a byte of a large checkpoint is read, and the load knows how many bytes it will take
 * (moed_loading: "reading", counted per tensor taken, copied or mapped; "generating" for synthetic
 * layers). Any other problem (a wrong shape or dtype) stops the load at the first tensor that
 * shows it.
 */
#include "weights.h"

#include "fingerprint.h"
#include "hf.h"
#include "loading.h"
#include "moed_dtype.h"
#include "moed_fp8.h"
#include "moed_sp24.h"
#include "moed_synth.h"
#include "prune.h"
#include "safetensors.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct weights_priv {
    bool synthetic;  /* layers came from moed_synth_layer, which owns their memory */
    moed_st_dir *st; /* MOED_WEIGHTS_MAP: the mappings the layers point into */
    void **owned;    /* copies and converted router biases */
    int n_owned, cap_owned;
} weights_priv;

void moed_weights_release(moed_model *m)
{
    weights_priv *p = m->priv;
    for (int i = 0; i < m->n_layers; i++) {
        if (p && p->synthetic)
            moed_synth_free_layer(&m->layers[i]);
        else
            free(m->layers[i].experts);
    }
    free(m->layers);
    free(m->pruned);
    if (p) {
        for (int i = 0; i < p->n_owned; i++) free(p->owned[i]);
        free(p->owned);
        moed_st_dir_close(p->st);
        free(p);
    }
    memset(m, 0, sizeof *m);
}

const moed_layer *moed_model_layer(const moed_model *m, int index, int *slot)
{
    int lo = 0, hi = m->n_layers - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, at = m->layers[mid].info.index;
        if (at == index) {
            if (slot) *slot = mid;
            return &m->layers[mid];
        }
        if (at < index)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return NULL;
}

int moed_weights_synthetic(const char *spec, int wdtype, moed_model *m, moed_error *err)
{
    return moed_weights_synthetic_held(spec, wdtype, NULL, m, err);
}

/* Expert e's matrices (memory the model owns) pruned to 2:4 in place, the probe first fed its
 * dense values if the batch reaches it. */
static void prune_expert(moed_prune_probe *pr, int e, moed_expert_w *w)
{
    const moed_layer_info *li = &pr->info;
    if (moed_prune_touches(pr, e)) moed_prune_expert(pr, e, w);
    /* owned buffers the loader filled: writable, though the layer shows them const */
    moed_prune_matrix(pr, (void *)w->w1, li->wdtype, li->d_ff, li->d_model);
    if (w->w3) moed_prune_matrix(pr, (void *)w->w3, li->wdtype, li->d_ff, li->d_model);
    moed_prune_matrix(pr, (void *)w->w2, li->wdtype, li->d_model, li->d_ff);
}

/* --weights sparse24 over FP8 expert weights: refused, naming where the FP8 comes from. */
static int refuse_fp8(moed_error *err, const char *what)
{
    return moed_fail(err, MOED_EUNSUPPORTED,
                     "%s: --weights sparse24 prunes BF16, F16 or F32 expert weights; FP8 weights "
                     "with 2:4 sparsity are not supported yet (docs/weights.md), so serve this "
                     "model dense or from BF16 weights",
                     what);
}

/* Synthetic layer l (its memory its own) pruned, the error against its dense self in *out. */
static int prune_synthetic(moed_layer *l, struct moed_pruned *out, moed_error *err)
{
    moed_prune_probe pr;
    int rc = moed_prune_probe_init(&pr, l, err);
    if (rc) return rc;
    if (l->shared.w1) moed_prune_shared(&pr, &l->shared);
    for (int e = 0; e < l->info.n_experts; e++)
        if (l->experts[e].w1) prune_expert(&pr, e, &l->experts[e]);
    *out = (struct moed_pruned){ moed_prune_error(&pr), pr.pairs };
    moed_prune_probe_free(&pr);
    l->info.sparse24 = true;
    return 0;
}

/* The bytes of a layer of li of which `held` is held (NULL: all of it). */
static uint64_t held_bytes(const moed_layer_info *li, const moed_expert_subset *held)
{
    int n = 0;
    for (int e = 0; e < li->n_experts; e++) n += moed_expert_subset_has(held, e);
    uint64_t b = moed_layer_bytes(li) - (uint64_t)(li->n_experts - n) * moed_layer_expert_bytes(li);
    if (!moed_expert_subset_shared(held)) {
        moed_layer_info none = *li;
        none.n_shared = none.shared_d_ff = 0;
        b -= moed_layer_bytes(li) - moed_layer_bytes(&none);
    }
    return b;
}

int moed_weights_synthetic_held(const char *spec, int wdtype, const moed_expert_subset *held,
                                moed_model *m, moed_error *err)
{
    memset(m, 0, sizeof *m);
    moed_synth_spec s;
    int rc = moed_synth_parse(spec, &s, err);
    if (rc) return rc;
    const bool prune = wdtype == MOED_WEIGHTS_SPARSE24;
    if (prune && s.layer.wdtype == MOED_FP8)
        return refuse_fp8(err, "the synthetic spec says dtype=fp8");
    if (wdtype && !prune) s.layer.wdtype = wdtype;
    weights_priv *p = calloc(1, sizeof *p);
    m->priv = p;
    m->layers = calloc((size_t)s.layers + 1, sizeof *m->layers);
    if (prune) m->pruned = calloc((size_t)s.layers + 1, sizeof *m->pruned);
    if (!p || !m->layers || (prune && !m->pruned)) {
        rc = moed_fail(err, MOED_ENOMEM, "no memory for %d synthetic layers", s.layers);
        goto err;
    }
    p->synthetic = true;
    const uint64_t layer_bytes = held_bytes(&s.layer, held);
    moed_loading_phase("generating", s.layers, layer_bytes * (uint64_t)s.layers);
    for (int i = 0; i < s.layers; i++) {
        moed_loading_layer(i);
        rc = moed_synth_layer_held(&s, i, held, &m->layers[i], err);
        if (rc) goto err;
        m->n_layers++;
        if (prune && (rc = prune_synthetic(&m->layers[i], &m->pruned[i], err))) goto err;
        moed_loading_bytes(layer_bytes);
        moed_loading_layer_done();
    }
    moed_synth_format(&s, m->source, sizeof m->source);
    /* the pruned model is another model: the spec alone would name the dense one */
    char named[sizeof m->source + 16];
    snprintf(named, sizeof named, "%s%s", m->source, prune ? " sparse24" : "");
    m->fingerprint = moed_fingerprint_synthetic(named);
    snprintf(m->arch, sizeof m->arch, "synthetic");
    return 0;
err:
    moed_weights_release(m);
    return rc;
}

/* ---- checkpoints ---- */

/* Layers as "0-3,7" into buf. */
static const char *format_layers(const unsigned char *flags, int n, char *buf, size_t size)
{
    size_t at = 0;
    buf[0] = 0;
    for (int l = 0; l < n && at < size; l++) {
        if (!flags[l] || (l > 0 && flags[l - 1])) continue;
        int end = l;
        while (end + 1 < n && flags[end + 1]) end++;
        at += (size_t)(end > l ? snprintf(buf + at, size - at, "%s%d-%d", at ? "," : "", l, end)
                               : snprintf(buf + at, size - at, "%s%d", at ? "," : "", l));
    }
    return buf;
}

/* only_layers ("0-3,7") into hold; NULL holds every MoE layer. */
static int select_layers(const char *only, const moed_hf_config *c, unsigned char *hold,
                         moed_error *err)
{
    char moe[128];
    if (!only) {
        memcpy(hold, c->is_moe, (size_t)c->n_layers);
        return 0;
    }
    memset(hold, 0, (size_t)c->n_layers);
    format_layers(c->is_moe, c->n_layers, moe, sizeof moe);
    const char *p = only;
    for (;;) {
        char *end;
        long a = strtol(p, &end, 10), b = a;
        if (end != p && *end == '-') {
            p = end + 1;
            b = strtol(p, &end, 10);
        }
        if (end == p || a < 0 || b < a || (*end && *end != ','))
            return moed_fail(err, MOED_EINVAL,
                             "layer list \"%s\" is not like \"0-3,7\" (layer numbers and ranges "
                             "separated by commas)",
                             only);
        if (b >= c->n_layers)
            return moed_fail(err, MOED_EINVAL,
                             "layer list \"%s\" names layer %ld, but the checkpoint has %d layers; "
                             "its MoE layers are %s",
                             only, b, c->n_layers, moe);
        for (long l = a; l <= b; l++) {
            if (!c->is_moe[l])
                return moed_fail(err, MOED_EINVAL,
                                 "layer list \"%s\" names layer %ld, which is a dense MLP layer, "
                                 "not MoE; the MoE layers are %s",
                                 only, l, moe);
            hold[l] = 1;
        }
        if (!*end) return 0;
        p = end + 1;
    }
}

/* One checkpoint load in progress. */
typedef struct loader {
    const char *dir;
    bool copy;    /* MOED_WEIGHTS_COPY */
    int quantize; /* MOED_FP8: float expert matrices are quantized at load; 0: kept as stored */
    bool prune;   /* MOED_WEIGHTS_SPARSE24: routed expert matrices pruned to 2:4 */
    struct moed_pruned *pruned; /* with prune: where build_layer states the layer's error */
    const moed_hf_config *cfg;
    moed_st_dir *st;
    weights_priv *priv;
    moed_error *err;
    const moed_expert_subset *held; /* the experts (and shared ones) to read; NULL: all */
    const moed_st_tensor *first;    /* the layer's first expert matrix: its dtype is the layer's */
    int n_missing;
    char missing[320]; /* the first few missing names */
} loader;

enum { SLOT_ROUTER, SLOT_BIAS, SLOT_SHARED, SLOT_EXPERTS = SLOT_SHARED + 3 };
#define MISSING_LISTED 4

/* A tensor whose first element is not aligned to its size cannot be read in place: refused. */
static int check_aligned(loader *ld, const moed_st_tensor *t)
{
    if (t->offset % moed_dtype_size(t->mdtype))
        return moed_fail(ld->err, MOED_EFORMAT,
                         "%s: tensor %s starts at byte %llu, not a multiple of its %zu-byte "
                         "elements; rewrite the file with the safetensors package, which aligns "
                         "tensors",
                         t->file, t->name, (unsigned long long)t->offset,
                         moed_dtype_size(t->mdtype));
    return 0;
}

/* ---- compressed-tensors 2:4 (hf.h gives the format) ---- */

static int check_dtype(loader *ld, const moed_st_tensor *t, bool matrix);
static void *owned_buffer(loader *ld, size_t bytes, const char *what);

/* Whether t is the `.compressed` piece of a 2:4 compressed matrix (need() stands it for the
 * matrix). */
static bool is_compressed(const loader *ld, const moed_st_tensor *t)
{
    static const char suffix[] = ".compressed";
    const size_t n = strlen(t->name);
    return ld->cfg->sparse24 && n > sizeof suffix - 1 &&
           !strcmp(t->name + n - (sizeof suffix - 1), suffix);
}

/* The sibling `piece` ("bitmask", "shape") of compressed piece t, or NULL; its name in name. */
static int sibling(loader *ld, const moed_st_tensor *t, const char *piece, char *name, size_t n,
                   const moed_st_tensor **out)
{
    snprintf(name, n, "%.*s.%s", (int)(strlen(t->name) - strlen(".compressed")), t->name, piece);
    return moed_st_find(ld->st, name, out, ld->err);
}

/* The three pieces of compressed matrix t checked against the dense [rows, cols] config.json
 * gives, before anything is read but the few bytes of `.shape`: the values in a weight dtype, the
 * bitmask U8 [rows, ceil(cols / 8)], `.shape` an integer tensor of two elements equal to
 * [rows, cols]. *bitmask_out: the bitmask. */
static int check_compressed(loader *ld, const moed_st_tensor *t, uint64_t rows, uint64_t cols,
                            const char *dims, const moed_st_tensor **bitmask_out)
{
    char bname[300], sname[300], have[160];
    const moed_st_tensor *bm, *sh;
    int rc;
    if (t->mdtype == MOED_FP8)
        return moed_fail(ld->err, MOED_EUNSUPPORTED,
                         "%s: tensor %s is F8_E4M3: FP8 weights with 2:4 sparsity are not "
                         "supported yet (docs/weights.md); moed loads 2:4 compressed BF16, F16 "
                         "or F32 weights",
                         t->file, t->name);
    if ((rc = check_dtype(ld, t, true))) return rc;
    if ((rc = sibling(ld, t, "bitmask", bname, sizeof bname, &bm)) ||
        (rc = sibling(ld, t, "shape", sname, sizeof sname, &sh)))
        return rc;
    if (!bm || !sh)
        return moed_fail(ld->err, MOED_ENOTFOUND,
                         "%s: tensor %s (2:4 compressed values) comes without %s: a "
                         "sparse-24-bitmask matrix is stored as .compressed, .bitmask and .shape",
                         t->file, t->name, !bm ? bname : sname);
    if (t->ndim != 2 || t->shape[0] != rows)
        return moed_fail(ld->err, MOED_EFORMAT,
                         "%s: tensor %s has shape %s; the 2:4 compressed values of a %s = [%llu, "
                         "%llu] matrix from config.json are [%llu, kept values per row]",
                         t->file, t->name, moed_st_shape_str(t, have, sizeof have), dims,
                         (unsigned long long)rows, (unsigned long long)cols,
                         (unsigned long long)rows);
    if (strcmp(bm->dtype, "U8") || bm->ndim != 2 || bm->shape[0] != rows ||
        bm->shape[1] != (cols + 7) / 8)
        return moed_fail(ld->err, MOED_EFORMAT,
                         "%s: tensor %s is %s %s; the bitmask of a %s = [%llu, %llu] matrix from "
                         "config.json is U8 [%llu, %llu] (one bit per weight, 8 to a byte)",
                         bm->file, bm->name, bm->dtype, moed_st_shape_str(bm, have, sizeof have),
                         dims, (unsigned long long)rows, (unsigned long long)cols,
                         (unsigned long long)rows, (unsigned long long)((cols + 7) / 8));
    int64_t v[2] = { -1, -1 };
    const bool i64 = !strcmp(sh->dtype, "I64"), i32 = !strcmp(sh->dtype, "I32");
    const uint64_t n_el = sh->nbytes / (i64 ? 8 : 4);
    if ((i64 || i32) && n_el == 2) {
        unsigned char raw[16];
        if ((rc = moed_st_read_part(ld->st, sh, 0, sh->nbytes, raw, ld->err))) return rc;
        for (int i = 0; i < 2; i++) {
            int32_t x32;
            if (i64) {
                memcpy(&v[i], raw + 8 * i, 8);
            } else {
                memcpy(&x32, raw + 4 * i, 4);
                v[i] = x32;
            }
        }
    }
    if (v[0] < 0 || (uint64_t)v[0] != rows || (uint64_t)v[1] != cols)
        return moed_fail(ld->err, MOED_EFORMAT,
                         "%s: tensor %s %s; config.json gives the matrix %s = [%llu, %llu]",
                         sh->file, sh->name,
                         (i64 || i32) && n_el == 2 ? "says another dense shape"
                                                   : "is not two integers (I64 or I32)",
                         dims, (unsigned long long)rows, (unsigned long long)cols);
    if ((rc = check_aligned(ld, t))) return rc;
    if (bitmask_out) *bitmask_out = bm;
    return 0;
}

/* Looks up tensor id of layer L; a missing one is recorded for the report and leaves *t NULL. In
 * a compressed-tensors 2:4 checkpoint a matrix missing as `.weight` may be there compressed: its
 * `.compressed` piece then stands for it (the others are found when it is checked). */
static int need(loader *ld, int layer, int tensor, int expert, const moed_st_tensor **t)
{
    char name[256];
    moed_hf_tensor_name(ld->cfg, layer, tensor, expert, name, sizeof name);
    int rc = moed_st_find(ld->st, name, t, ld->err);
    if (rc || *t) return rc;
    const size_t n = strlen(name);
    if (ld->cfg->sparse24 && n > 7 && !strcmp(name + n - 7, ".weight")) {
        char piece[280];
        const moed_st_tensor *bm;
        snprintf(piece, sizeof piece, "%.*s.compressed", (int)(n - 7), name);
        if ((rc = moed_st_find(ld->st, piece, t, ld->err)) || *t) return rc;
        snprintf(piece, sizeof piece, "%.*s.bitmask", (int)(n - 7), name);
        if ((rc = moed_st_find(ld->st, piece, &bm, ld->err))) return rc;
        if (bm) /* compressed without its values: that is what is missing */
            snprintf(name, sizeof name, "%.*s.compressed", (int)(n - 7), piece);
    }
    if (ld->n_missing++ < MISSING_LISTED) {
        size_t at = strlen(ld->missing);
        snprintf(ld->missing + at, sizeof ld->missing - at, "%s%s", at ? ", " : "", name);
    }
    return 0;
}

/* Whether t's dtype may stand where it stands: a float dtype with no quantization scale beside it,
 * or (an expert matrix of an FP8 checkpoint) F8_E4M3, whose scales build_layer reads. */
static int check_dtype(loader *ld, const moed_st_tensor *t, bool matrix)
{
    char name[300];
    const moed_st_tensor *scale;
    int rc;
    if (t->mdtype == MOED_FP8 && matrix && ld->cfg->fp8) return 0;
    if (t->mdtype == MOED_FP8)
        return moed_fail(ld->err, MOED_EUNSUPPORTED,
                         matrix ? "%s: tensor %s is F8_E4M3 but config.json has no "
                                  "quantization_config saying how it is scaled (quant_method "
                                  "\"fp8\", weight_block_size [128, 128])"
                                : "%s: tensor %s is F8_E4M3: moed quantizes expert matrices only; "
                                  "routers and biases must be BF16, F16 or F32",
                         t->file, t->name);
    if (!t->mdtype) {
        bool quantized = !strncmp(t->dtype, "F8", 2) || !strncmp(t->dtype, "F6", 2) ||
                         !strncmp(t->dtype, "F4", 2);
        return moed_fail(ld->err, MOED_EUNSUPPORTED,
                         "%s: tensor %s is %s: %s; moed loads BF16, F16 or F32 weights and "
                         "block-scaled F8_E4M3 expert matrices%s",
                         t->file, t->name, t->dtype,
                         quantized ? "this quantized format is not supported"
                                   : "not a weight dtype",
                         quantized ? ", so dequantize the checkpoint (e.g. to bf16) first" : "");
    }
    static const char *const suffixes[] = { "_scale_inv", "_scale" };
    for (int i = 0; i < 2; i++) {
        snprintf(name, sizeof name, "%s%s", t->name, suffixes[i]);
        if ((rc = moed_st_find(ld->st, name, &scale, ld->err))) return rc;
        if (scale)
            return moed_fail(ld->err, MOED_EUNSUPPORTED,
                             "%s: tensor %s is %s yet comes with a quantization scale %s: moed "
                             "loads plain BF16, F16 or F32 weights, and scales only beside "
                             "F8_E4M3 ones",
                             t->file, t->name, t->dtype, name);
    }
    return 0;
}

/* A dtype check_dtype accepts, the expected shape, and data aligned for its element type (the
 * safetensors writers pad the header to 8 bytes). */
static int check_tensor(loader *ld, const moed_st_tensor *t, bool matrix, int ndim,
                        const uint64_t *want, const char *dims)
{
    char have[160];
    if (ndim == 2 && is_compressed(ld, t))
        return check_compressed(ld, t, want[0], want[1], dims, NULL);
    int rc = check_dtype(ld, t, matrix);
    if (rc) return rc;
    bool same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == want[i];
    if (!same) {
        moed_st_tensor w = { .ndim = ndim };
        memcpy(w.shape, want, sizeof *want * (size_t)ndim);
        char exp[160];
        return moed_fail(ld->err, MOED_EFORMAT,
                         "%s: tensor %s has shape %s, expected %s = %s from config.json", t->file,
                         t->name, moed_st_shape_str(t, have, sizeof have),
                         moed_st_shape_str(&w, exp, sizeof exp), dims);
    }
    if ((rc = check_aligned(ld, t))) return rc;
    return 0;
}

/* An expert matrix: as check_tensor, and in the same dtype as the layer's other matrices. */
static int check_matrix(loader *ld, const moed_st_tensor *t, int rows, int cols, const char *dims)
{
    uint64_t want[2] = { (uint64_t)rows, (uint64_t)cols };
    int rc = check_tensor(ld, t, true, 2, want, dims);
    if (rc) return rc;
    if (!ld->first) ld->first = t;
    if (t->mdtype != ld->first->mdtype)
        return moed_fail(ld->err, MOED_EUNSUPPORTED,
                         "tensor %s (%s) is %s but %s (%s) is %s: every expert matrix of a layer "
                         "must have one dtype; convert the checkpoint to one dtype",
                         t->name, t->file, t->dtype, ld->first->name, ld->first->file,
                         ld->first->dtype);
    return 0;
}

/* Hands p to the model, which frees it on release (p is freed now if that fails). */
static int own(loader *ld, void *p, moed_error *err)
{
    weights_priv *w = ld->priv;
    if (w->n_owned == w->cap_owned) {
        int cap = w->cap_owned ? 2 * w->cap_owned : 64;
        void **grown = realloc(w->owned, sizeof *grown * (size_t)cap);
        if (!grown) {
            free(p);
            return moed_fail(err, MOED_ENOMEM, "no memory for the weights' table");
        }
        w->owned = grown;
        w->cap_owned = cap;
    }
    w->owned[w->n_owned++] = p;
    return 0;
}

/* t's bytes read from its file into a new buffer (the caller's). */
static int read_copy(loader *ld, const moed_st_tensor *t, void **out)
{
    *out = NULL;
    if (posix_memalign(out, 64, t->nbytes ? t->nbytes : 1))
        return moed_fail(ld->err, MOED_ENOMEM, "no memory for tensor %s (%llu bytes)", t->name,
                         (unsigned long long)t->nbytes);
    int rc = moed_st_read(ld->st, t, *out, ld->err);
    if (rc) {
        free(*out);
        *out = NULL;
    }
    return rc;
}

/* t's data as computed from: a copy the model owns, or the mapping itself. */
static int tensor_data(loader *ld, const moed_st_tensor *t, const void **out)
{
    void *copy;
    int rc;
    if (!ld->copy) {
        *out = t->data;
        moed_loading_bytes(t->nbytes);
        return 0;
    }
    if ((rc = read_copy(ld, t, &copy)) || (rc = own(ld, copy, ld->err))) return rc;
    *out = copy;
    moed_loading_bytes(t->nbytes);
    return 0;
}

/* t's bytes as read: the mapping, or (MOED_WEIGHTS_COPY) a copy in *tmp for the caller to free. */
static int read_bytes(loader *ld, const moed_st_tensor *t, const void **p, void **tmp)
{
    *tmp = NULL;
    *p = t->data;
    if (!ld->copy) return 0;
    int rc = read_copy(ld, t, tmp);
    if (!rc) *p = *tmp;
    return rc;
}

/* Compressed matrix t (dense [rows, cols], checked by check_compressed) into a zeroed buffer the
 * model owns: each set bit of the bitmask, row-major, takes the next value. A bitmask with more
 * than two bits in an aligned group of four along a row (not 2:4), a bit past a row's end, or
 * set bits that do not count the values is refused, naming the tensor. */
static int decompress(loader *ld, const moed_st_tensor *t, uint64_t rows, uint64_t cols,
                      const void **out)
{
    const moed_st_tensor *bm = NULL;
    int rc = check_compressed(ld, t, rows, cols, "the matrix", &bm);
    if (rc) return rc;
    const size_t es = moed_dtype_size(t->mdtype);
    const uint64_t n_values = t->nbytes / es, bpr = (cols + 7) / 8;
    const void *vp, *bp;
    void *vtmp = NULL, *btmp = NULL;
    unsigned char *dense = owned_buffer(ld, (size_t)(rows * cols * es), t->name);
    if (!dense) return ld->err->code;
    memset(dense, 0, (size_t)(rows * cols * es));
    if ((rc = read_bytes(ld, t, &vp, &vtmp)) || (rc = read_bytes(ld, bm, &bp, &btmp))) goto out;
    const unsigned char *mask = bp, *values = vp;
    uint64_t k = 0;
    for (uint64_t r = 0; r < rows && !rc; r++) {
        const unsigned char *row = mask + r * bpr;
        for (uint64_t c = 0; c < bpr * 8 && !rc; c += 4) {
            int bits = 0;
            for (uint64_t j = c; j < c + 4; j++) {
                if (!(row[j / 8] >> (j % 8) & 1)) continue;
                if (j >= cols)
                    rc = moed_fail(ld->err, MOED_EFORMAT,
                                   "%s: tensor %s sets bit %llu of row %llu, past the row's %llu "
                                   "columns",
                                   bm->file, bm->name, (unsigned long long)j, (unsigned long long)r,
                                   (unsigned long long)cols);
                else if (++bits > 2)
                    rc = moed_fail(ld->err, MOED_EFORMAT,
                                   "%s: tensor %s is not 2:4: row %llu, columns %llu to %llu keep "
                                   "more than two values",
                                   bm->file, bm->name, (unsigned long long)r, (unsigned long long)c,
                                   (unsigned long long)c + 3);
                else if (k < n_values)
                    memcpy(dense + (r * cols + j) * es, values + k * es, es);
                k += !rc;
            }
        }
    }
    if (!rc && k != n_values)
        rc = moed_fail(ld->err, MOED_EFORMAT,
                       "%s: tensor %s holds %llu values but its bitmask %s sets %llu bits: each "
                       "kept weight is one value",
                       t->file, t->name, (unsigned long long)n_values, bm->name,
                       (unsigned long long)k);
    if (!rc) moed_loading_bytes(t->nbytes + bm->nbytes);
out:
    free(vtmp);
    free(btmp);
    if (!rc) *out = dense;
    return rc;
}

/* A matrix's data as computed from ([rows, cols]): tensor_data, or decompressed. */
static int dense_data(loader *ld, const moed_st_tensor *t, uint64_t rows, uint64_t cols,
                      const void **out)
{
    return is_compressed(ld, t) ? decompress(ld, t, rows, cols, out) : tensor_data(ld, t, out);
}

/* t's data in dtype: as tensor_data, or converted into a buffer the model owns. */
static int as_dtype(loader *ld, const moed_st_tensor *t, int dtype, const void **out)
{
    uint64_t n = t->nbytes / moed_dtype_size(t->mdtype);
    if (t->mdtype == dtype) return tensor_data(ld, t, out);
    void *copy = NULL;
    const void *src = t->data;
    int rc = ld->copy ? read_copy(ld, t, &copy) : 0;
    if (rc) return rc;
    if (copy) src = copy;
    float *f32 = malloc(n * sizeof *f32);
    void *buf = malloc(n * moed_dtype_size(dtype));
    if (f32 && buf) {
        moed_to_f32(t->mdtype, src, f32, n);
        moed_from_f32(dtype, f32, buf, n);
    }
    free(f32);
    free(copy);
    if (!f32 || !buf) {
        free(buf);
        return moed_fail(ld->err, MOED_ENOMEM, "no memory to convert %s", t->name);
    }
    if ((rc = own(ld, buf, ld->err))) return rc;
    *out = buf;
    moed_loading_bytes(t->nbytes);
    return 0;
}

/* Looks up every tensor of layer L into t; a missing one is recorded (need) and left NULL. */
static int find_layer(loader *ld, int L, const moed_st_tensor **t)
{
    const moed_layer_info *li = &ld->cfg->layer;
    int rc;
    const moed_st_tensor *gate;
    char name[256];
    if (moed_hf_tensor_name(ld->cfg, L, MOED_HF_SHARED_GATE, 0, name, sizeof name)) {
        if ((rc = moed_st_find(ld->st, name, &gate, ld->err))) return rc;
        if (gate)
            return moed_fail(ld->err, MOED_EUNSUPPORTED,
                             "%s: tensor %s: Qwen2-MoE's sigmoid gate on the shared expert is not "
                             "supported (moed adds shared experts with weight 1), so this model "
                             "cannot be served exactly",
                             gate->file, gate->name);
    }
    if ((rc = need(ld, L, MOED_SYNTH_ROUTER, 0, &t[SLOT_ROUTER]))) return rc;
    if (li->rule == MOED_RULE_DEEPSEEK_V3 && (rc = need(ld, L, MOED_SYNTH_BIAS, 0, &t[SLOT_BIAS])))
        return rc;
    for (int k = 0; li->n_shared && moed_expert_subset_shared(ld->held) && k < 3; k++)
        if ((rc = need(ld, L, MOED_SYNTH_SHARED_W1 + k, 0, &t[SLOT_SHARED + k]))) return rc;
    for (int e = 0; e < li->n_experts; e++)
        for (int k = 0; moed_expert_subset_has(ld->held, e) && k < 3; k++)
            if ((rc = need(ld, L, MOED_SYNTH_W1 + k, e, &t[SLOT_EXPERTS + 3 * e + k]))) return rc;
    return 0;
}

/* The bytes a layer's load takes of the files: its n tensors t (NULL: not held) and, for FP8
 * matrices, their block scales. */
static int layer_bytes(loader *ld, const moed_st_tensor **t, size_t n, uint64_t *bytes)
{
    for (size_t i = 0; i < n; i++) {
        char name[300];
        const moed_st_tensor *scale = NULL;
        if (!t[i]) continue;
        *bytes += t[i]->nbytes;
        if (is_compressed(ld, t[i])) { /* and its bitmask */
            char bname[300];
            const moed_st_tensor *bm;
            int rc = sibling(ld, t[i], "bitmask", bname, sizeof bname, &bm);
            if (rc) return rc;
            if (bm) *bytes += bm->nbytes;
            continue;
        }
        snprintf(name, sizeof name, "%s_scale_inv", t[i]->name);
        int rc = i >= SLOT_SHARED && t[i]->mdtype == MOED_FP8 && ld->cfg->fp8
                     ? moed_st_find(ld->st, name, &scale, ld->err)
                     : 0;
        if (rc) return rc;
        if (scale) *bytes += scale->nbytes;
    }
    return 0;
}

/* A new buffer of `bytes` that the model owns. */
static void *owned_buffer(loader *ld, size_t bytes, const char *what)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 1)) {
        moed_fail(ld->err, MOED_ENOMEM, "no memory for %s (%zu bytes)", what, bytes);
        return NULL;
    }
    return own(ld, p, ld->err) ? NULL : p;
}

/* The block scales of FP8 matrix t ([rows, cols]): its `_scale_inv` tensor, as float32, checked. */
static int scale_table(loader *ld, const moed_st_tensor *t, int rows, int cols, const float **out)
{
    char name[300], have[160], exp[160];
    const moed_st_tensor *s;
    int rc;
    snprintf(name, sizeof name, "%s_scale_inv", t->name);
    if ((rc = moed_st_find(ld->st, name, &s, ld->err))) return rc;
    if (!s)
        return moed_fail(ld->err, MOED_ENOTFOUND,
                         "%s: tensor %s is F8_E4M3 but its block scales %s are missing: an FP8 "
                         "checkpoint holds a float32 [ceil(rows/128), ceil(cols/128)] table beside "
                         "every F8_E4M3 weight",
                         t->file, t->name, name);
    moed_st_tensor w = {
        .ndim = 2, .shape = { (uint64_t)moed_fp8_blocks(rows), (uint64_t)moed_fp8_blocks(cols) }
    };
    if (!moed_dtype_is_float(s->mdtype) || s->ndim != 2 || s->shape[0] != w.shape[0] ||
        s->shape[1] != w.shape[1])
        return moed_fail(ld->err, MOED_EFORMAT,
                         "%s: tensor %s is %s %s; the scales of %s ([%d, %d], 128 x 128 blocks) "
                         "must be F32 (or BF16, F16) %s",
                         s->file, name, s->dtype, moed_st_shape_str(s, have, sizeof have), t->name,
                         rows, cols, moed_st_shape_str(&w, exp, sizeof exp));
    const void *p;
    if ((rc = as_dtype(ld, s, MOED_F32, &p))) return rc;
    const int64_t n = moed_fp8_scale_count(rows, cols), bad = moed_fp8_check_scales(p, n, cols);
    if (bad >= 0)
        return moed_fail(
            ld->err, MOED_EFORMAT,
            "%s: tensor %s holds %g at [%lld, %lld]: every block scale must be a "
            "finite number > 0 and at most %g = FLT_MAX / (448 x %d columns): past "
            "it, a row of weights summed over activations of 1 overflows float32",
            s->file, name, (double)((const float *)p)[bad], (long long)(bad / (int64_t)w.shape[1]),
            (long long)(bad % (int64_t)w.shape[1]), (double)moed_fp8_scale_max(cols), cols);
    *out = p;
    return 0;
}

/* Float matrix t ([rows, cols]) quantized to FP8 in buffers the model owns. */
static int quantize_matrix(loader *ld, const moed_st_tensor *t, int rows, int cols,
                           const void **q_out, const float **s_out)
{
    void *copy = NULL;
    int rc = ld->copy ? read_copy(ld, t, &copy) : 0;
    if (rc) return rc;
    uint8_t *q = owned_buffer(ld, (size_t)rows * (size_t)cols, t->name);
    float *s =
        q ? owned_buffer(ld, sizeof(float) * (size_t)moed_fp8_scale_count(rows, cols), t->name)
          : NULL;
    int64_t bad = -1;
    rc = !s ? ld->err->code
            : moed_fp8_quantize(copy ? copy : t->data, t->mdtype, rows, cols, q, s, &bad);
    free(copy);
    if (rc == MOED_EINVAL)
        return moed_fail(ld->err, MOED_EFORMAT,
                         "%s: tensor %s holds NaN or infinity at [%lld, %lld]: it cannot be "
                         "quantized to FP8 (--weights fp8)",
                         t->file, t->name, (long long)(bad / cols), (long long)(bad % cols));
    if (rc == MOED_ENOMEM)
        return moed_fail(ld->err, rc, "no memory to quantize tensor %s", t->name);
    if (rc) return rc;
    *q_out = q;
    *s_out = s;
    moed_loading_bytes(t->nbytes);
    return 0;
}

/* An FP8 matrix must hold numbers: e4m3's NaN codes (S.1111.111) would make every output they
 * touch NaN, and the portable GPU path decodes codes as numbers only. */
static int check_codes(loader *ld, const moed_st_tensor *t, const uint8_t *q, int cols)
{
    for (uint64_t i = 0; i < t->nbytes; i++)
        if ((q[i] & 0x7f) == 0x7f)
            return moed_fail(ld->err, MOED_EFORMAT,
                             "%s: tensor %s holds the e4m3 NaN code 0x%02x at [%llu, %llu]",
                             t->file, t->name, q[i], (unsigned long long)(i / (uint64_t)cols),
                             (unsigned long long)(i % (uint64_t)cols));
    return 0;
}

/* One expert matrix as served: as stored (FP8 with its scales), or quantized at load; `own`: in a
 * buffer the model owns even with MOED_WEIGHTS_MAP (it is to be pruned in place). */
static int matrix_data(loader *ld, const moed_st_tensor *t, int rows, int cols, bool own_it,
                       const void **p, const float **scale)
{
    *scale = NULL;
    if (t->mdtype != MOED_FP8 && ld->quantize == MOED_FP8)
        return quantize_matrix(ld, t, rows, cols, p, scale);
    if (is_compressed(ld, t)) return decompress(ld, t, (uint64_t)rows, (uint64_t)cols, p);
    if (own_it && !ld->copy) {
        void *buf = owned_buffer(ld, t->nbytes, t->name);
        if (!buf) return ld->err->code;
        memcpy(buf, t->data, t->nbytes);
        *p = buf;
        moed_loading_bytes(t->nbytes);
        return 0;
    }
    int rc = tensor_data(ld, t, p);
    if (!rc && t->mdtype == MOED_FP8 && !(rc = check_codes(ld, t, *p, cols)))
        rc = scale_table(ld, t, rows, cols, scale);
    return rc;
}

/* An expert's three matrices (w1, w3, w2 in t[0..2]; W1 and W3 are [ff, d], W2 [d, ff]), in
 * buffers the model owns if own_it. */
static int matrices(loader *ld, const moed_st_tensor **t, int ff, bool own_it, moed_expert_w *out)
{
    const int d = ld->cfg->layer.d_model;
    const void *p[3];
    const float *s[3];
    for (int k = 0; k < 3; k++) {
        int rc = matrix_data(ld, t[k], k < 2 ? ff : d, k < 2 ? d : ff, own_it, &p[k], &s[k]);
        if (rc) return rc;
    }
    *out = (moed_expert_w){ p[0], p[1], p[2], s[0], s[1], s[2] };
    return 0;
}

/* Checks the tensors of layer L that find_layer found and points out's weights at them. */
static int build_layer(loader *ld, int L, const moed_st_tensor **t, moed_layer *out)
{
    const moed_layer_info *li = &ld->cfg->layer;
    int d = li->d_model, ff = li->d_ff, sff = li->shared_d_ff, E = li->n_experts, rc;
    ld->first = NULL;
    for (int e = 0; e < E; e++) {
        const moed_st_tensor **m = &t[SLOT_EXPERTS + 3 * e];
        if (!m[0]) continue; /* not held */
        if ((rc = check_matrix(ld, m[0], ff, d, "[expert width, hidden_size]")) ||
            (rc = check_matrix(ld, m[1], ff, d, "[expert width, hidden_size]")) ||
            (rc = check_matrix(ld, m[2], d, ff, "[hidden_size, expert width]")))
            return rc;
    }
    for (int k = 0; t[SLOT_SHARED] && k < 3; k++) {
        const char *dims =
            k < 2 ? "[shared experts' width, hidden_size]" : "[hidden_size, shared experts' width]";
        if ((rc = check_matrix(ld, t[SLOT_SHARED + k], k < 2 ? sff : d, k < 2 ? d : sff, dims)))
            return rc;
    }
    uint64_t router_shape[2] = { (uint64_t)E, (uint64_t)d }, bias_shape[1] = { (uint64_t)E };
    if ((rc = check_tensor(ld, t[SLOT_ROUTER], false, 2, router_shape, "[experts, hidden_size]")))
        return rc;
    if (t[SLOT_BIAS] && (rc = check_tensor(ld, t[SLOT_BIAS], false, 1, bias_shape, "[experts]")))
        return rc;

    *out = (moed_layer){ .info = *li };
    out->info.index = L;
    out->info.wdtype = ld->quantize ? ld->quantize : ld->first->mdtype;
    const void *router = NULL;
    if ((rc = dense_data(ld, t[SLOT_ROUTER], (uint64_t)E, (uint64_t)d, &router))) return rc;
    out->router = router;
    out->router_dtype = t[SLOT_ROUTER]->mdtype;
    if (t[SLOT_BIAS]) {
        const void *bias = NULL;
        if ((rc = as_dtype(ld, t[SLOT_BIAS], MOED_F32, &bias))) return rc;
        out->router_bias = bias;
    }
    if (t[SLOT_SHARED] && (rc = matrices(ld, &t[SLOT_SHARED], sff, false, &out->shared))) return rc;
    moed_prune_probe pr = { 0 };
    if (ld->prune && (rc = moed_prune_probe_init(&pr, out, ld->err))) return rc;
    if (ld->prune && out->shared.w1) moed_prune_shared(&pr, &out->shared);
    out->experts = calloc((size_t)E, sizeof *out->experts);
    if (!out->experts) rc = moed_fail(ld->err, MOED_ENOMEM, "no memory for layer %d", L);
    for (int e = 0; e < E && !rc; e++) {
        if (!t[SLOT_EXPERTS + 3 * e]) continue;
        rc = matrices(ld, &t[SLOT_EXPERTS + 3 * e], ff, ld->prune, &out->experts[e]);
        if (!rc && ld->prune) prune_expert(&pr, e, &out->experts[e]);
    }
    if (!rc && ld->prune) {
        *ld->pruned = (struct moed_pruned){ moed_prune_error(&pr), pr.pairs };
        out->info.sparse24 = true;
    } else if (!rc && ld->cfg->sparse24) { /* 2:4 if every routed matrix is, compressed or not */
        out->info.sparse24 = true;
        for (int e = 0; e < E && out->info.sparse24; e++) {
            const moed_expert_w *w = &out->experts[e];
            if (!w->w1) continue;
            out->info.sparse24 =
                moed_sp24_check(w->w1, out->info.wdtype, ff, d, NULL, NULL) &&
                (!w->w3 || moed_sp24_check(w->w3, out->info.wdtype, ff, d, NULL, NULL)) &&
                moed_sp24_check(w->w2, out->info.wdtype, d, ff, NULL, NULL);
        }
    }
    moed_prune_probe_free(&pr);
    if (rc) { /* the layer is not counted, so release would not free this */
        free(out->experts);
        out->experts = NULL;
    }
    return rc;
}

/* Every held layer into m->layers: all are looked up first (missing tensors reported once, before
 * anything is read), then read. */
static int load_layers(loader *ld, const unsigned char *hold, moed_model *m)
{
    int rc = 0, n_held = 0, i = 0;
    uint64_t bytes = 0;
    size_t n = SLOT_EXPERTS + 3 * (size_t)ld->cfg->layer.n_experts;
    for (int L = 0; L < ld->cfg->n_layers; L++) n_held += hold[L] != 0;
    const moed_st_tensor **t = calloc(n * (size_t)(n_held ? n_held : 1), sizeof *t);
    if (!t) return moed_fail(ld->err, MOED_ENOMEM, "no memory for the tensor list");
    for (int L = 0; L < ld->cfg->n_layers && !rc; L++)
        if (hold[L] && !(rc = find_layer(ld, L, t + n * (size_t)i)))
            rc = layer_bytes(ld, t + n * (size_t)i++, n, &bytes);
    if (!rc && !ld->n_missing) moed_loading_phase("reading", n_held, bytes);
    for (int L = 0, j = 0; L < ld->cfg->n_layers && !rc && !ld->n_missing; L++) {
        if (!hold[L]) continue;
        moed_loading_layer(L);
        if (m->pruned) ld->pruned = &m->pruned[m->n_layers];
        rc = build_layer(ld, L, t + n * (size_t)j++, &m->layers[m->n_layers]);
        if (rc) break;
        m->n_layers++;
        moed_loading_layer_done();
    }
    free(t);
    if (!rc && ld->n_missing) {
        char held[128];
        format_layers(hold, ld->cfg->n_layers, held, sizeof held);
        char more[32] = "";
        if (ld->n_missing > MISSING_LISTED)
            snprintf(more, sizeof more, " and %d more", ld->n_missing - MISSING_LISTED);
        rc = moed_fail(ld->err, MOED_ENOTFOUND,
                       "%s (%s) lacks %d tensor(s) that its config.json (%s, holding MoE layers "
                       "%s) needs: %s%s",
                       ld->dir, moed_st_dir_layout(ld->st), ld->n_missing, ld->cfg->arch_name, held,
                       ld->missing, more);
    }
    return rc;
}

int moed_weights_checkpoint(const char *dir, const char *only_layers, moed_weights_mode mode,
                            int wdtype, moed_model *m, moed_error *err)
{
    return moed_weights_checkpoint_held(dir, only_layers, mode, wdtype, NULL, m, err);
}

int moed_weights_checkpoint_held(const char *dir, const char *only_layers, moed_weights_mode mode,
                                 int wdtype, const moed_expert_subset *held, moed_model *m,
                                 moed_error *err)
{
    memset(m, 0, sizeof *m);
    moed_hf_config cfg;
    unsigned char *hold = NULL;
    int rc = moed_hf_config_load(dir, &cfg, err);
    if (rc) return rc;
    weights_priv *p = calloc(1, sizeof *p);
    m->priv = p;
    hold = malloc((size_t)cfg.n_layers);
    m->layers = calloc((size_t)cfg.n_layers, sizeof *m->layers);
    if (!p || !hold || !m->layers) {
        rc = moed_fail(err, MOED_ENOMEM, "no memory to load %s", dir);
        goto err;
    }
    if ((rc = select_layers(only_layers, &cfg, hold, err)) ||
        (rc = moed_expert_subset_check(held, &cfg.layer, err)))
        goto err;
    if (wdtype == MOED_WEIGHTS_SPARSE24 && cfg.fp8) {
        char what[4200];
        snprintf(what, sizeof what,
                 "%s/config.json: quantization_config says block-scaled FP8 expert weights", dir);
        rc = refuse_fp8(err, what);
        goto err;
    }
    if (wdtype == MOED_FP8 && cfg.sparse24) {
        rc = moed_fail(err, MOED_EUNSUPPORTED,
                       "%s/config.json: a compressed-tensors 2:4 sparse checkpoint: --weights fp8 "
                       "would quantize its 2:4 sparse weights, and FP8 weights with 2:4 sparsity "
                       "are not supported yet (docs/weights.md); serve it as stored",
                       dir);
        goto err;
    }
    if (wdtype == MOED_WEIGHTS_SPARSE24 &&
        !(m->pruned = calloc((size_t)cfg.n_layers, sizeof *m->pruned))) {
        rc = moed_fail(err, MOED_ENOMEM, "no memory to load %s", dir);
        goto err;
    }
    if ((rc = moed_st_dir_open(dir, &p->st, err))) goto err;
    loader ld = { .dir = dir,
                  .copy = mode == MOED_WEIGHTS_COPY,
                  .quantize = wdtype == MOED_FP8 ? MOED_FP8 : 0,
                  .prune = wdtype == MOED_WEIGHTS_SPARSE24,
                  .cfg = &cfg,
                  .st = p->st,
                  .priv = p,
                  .err = err,
                  .held = held };
    if ((rc = load_layers(&ld, hold, m))) goto err;
    /* the fingerprint reads the files too: the check after it covers its reads as well */
    m->fingerprint = moed_fingerprint_checkpoint(p->st, &cfg,
                                                 cfg.fp8       ? 0
                                                 : ld.quantize ? ld.quantize
                                                               : wdtype);
    if ((rc = moed_st_dir_check(p->st, err))) goto err;
    if (ld.copy) { /* nothing points into the files now */
        moed_st_dir_close(p->st);
        p->st = NULL;
    }
    snprintf(m->source, sizeof m->source, "%s", dir);
    snprintf(m->arch, sizeof m->arch, "%s", cfg.arch_name);
    free(hold);
    moed_hf_config_free(&cfg);
    return 0;
err:
    free(hold);
    moed_hf_config_free(&cfg);
    moed_weights_release(m);
    return rc;
}
