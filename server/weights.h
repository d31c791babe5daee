/*
 * moed_weights — the model a daemon serves: every MoE layer's weights in host memory, from a
 * Hugging Face safetensors checkpoint or from the seeded synthetic generator.
 *
 * A loaded moed_model stays valid until moed_weights_release; backends may keep pointers into it
 * (the CPU backend computes straight from it), so the daemon releases it only after the backend is
 * destroyed.
 *
 * A checkpoint's tensors are either copied into memory the model owns (MOED_WEIGHTS_COPY: read
 * with pread, the files closed after the load) or left in the files' mappings (MOED_WEIGHTS_MAP).
 * Only a copy is safe to compute from for as long as the daemon runs: a mapping of a file that is
 * truncated faults (SIGBUS) when read, and one rewritten in place changes under the reader. So a
 * backend that computes from host memory (CPU) gets a copy; one that copies the weights to its
 * device while loading (CUDA) reads the mapping once and need not pay for host memory it never
 * reads again. Either way a file that changed while it was read fails the load (its size or
 * modification time moved), and a file that shrank fails it cleanly in copy mode.
 */
#ifndef MOED_WEIGHTS_H
#define MOED_WEIGHTS_H

#include "moed_err.h"
#include "moed_model.h"

#include <stdint.h>

typedef struct moed_model {
    char source[512]; /* the checkpoint folder, or the canonical synthetic spec */
    char arch[64];    /* "synthetic", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3" */
    uint64_t fingerprint; /* the model's identity (fingerprint.h) */
    int n_layers;         /* MoE layers held */
    moed_layer *layers;   /* by increasing info.index */
    /* With MOED_WEIGHTS_SPARSE24, per layer: the relative error of the pruned layer against its
     * dense weights on moed_prune's batch (prune.h) and the (token, expert) pairs it was measured
     * on (0: the batch reached none of the experts held, the error NaN); NULL otherwise. */
    struct moed_pruned {
        double error;
        int pairs;
    } * pruned;
    void *priv; /* mappings and allocations */
} moed_model;

/* A wdtype that is not a dtype: every routed expert matrix of a BF16, F16 or F32 model is pruned
 * to 2:4 at load (moed_sp24_prune, into memory the model owns: never into a file's mapping) and
 * its layers are marked sparse24; the shared experts and the router stay dense. FP8 expert
 * weights are refused (2:4 over FP8 is not supported yet). Pruning changes the model, so each
 * layer's error against the dense weights is measured (pruned). */
enum { MOED_WEIGHTS_SPARSE24 = 24 };

/* --synthetic SPEC (moed_synth.h gives the syntax and the generator); wdtype, if not 0, replaces
 * the spec's dtype (`--weights fp8` is dtype=fp8), or is MOED_WEIGHTS_SPARSE24. */
int moed_weights_synthetic(const char *spec, int wdtype, moed_model *m, moed_error *err);

typedef enum moed_weights_mode { MOED_WEIGHTS_COPY, MOED_WEIGHTS_MAP } moed_weights_mode;

/* --model DIR: config.json plus model.safetensors or model.safetensors.index.json and its shards.
 * only_layers, if not NULL, is a list like "0-3,7" of checkpoint layer numbers to hold (the others
 * are not read). wdtype 0 serves the expert matrices as stored (block-scaled F8_E4M3 ones with
 * their scales; a compressed-tensors 2:4 checkpoint's decompressed, hf.h); MOED_FP8 quantizes
 * float ones at load (moed_fp8.h's rule; the router stays as stored); MOED_WEIGHTS_SPARSE24 prunes
 * them. Every problem (missing file, missing or misshapen tensor or block scales, a scale that
 * is not a finite number > 0 or is over moed_fp8_scale_max, unsupported dtype, quantization or
 * architecture, a file that is not a regular file or changed while read) fails with one message
 * naming the file and tensor and what was expected. */
int moed_weights_checkpoint(const char *dir, const char *only_layers, moed_weights_mode mode,
                            int wdtype, moed_model *m, moed_error *err);

/* The same for a daemon holding an expert shard (moed --experts): only the experts `held` names,
 * and the shared experts only if it says so, are generated or read; the other experts' matrices
 * stay NULL (routers are read whole). held NULL: everything, as the calls above. An id past a
 * layer's experts fails with MOED_EINVAL naming it. */
int moed_weights_synthetic_held(const char *spec, int wdtype, const moed_expert_subset *held,
                                moed_model *m, moed_error *err);
int moed_weights_checkpoint_held(const char *dir, const char *only_layers, moed_weights_mode mode,
                                 int wdtype, const moed_expert_subset *held, moed_model *m,
                                 moed_error *err);

void moed_weights_release(moed_model *m);

/* The layer with checkpoint number index, or NULL. */
const moed_layer *moed_model_layer(const moed_model *m, int index, int *slot);

#endif
