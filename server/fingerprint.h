/*
 * moed_fingerprint — the identity of the model a daemon serves (ModelInfo.model_fingerprint): 64
 * bits equal on every daemon serving the same model, whatever layers (--layers) and experts
 * (--experts) each holds and whichever backend computes, and different for another model, even one
 * of the same shapes. A fleet client checks its daemons agree on it and states it in each request,
 * so a daemon restarted with other weights refuses calls instead of answering them.
 *
 * It is a hash, not a digest of every weight: it detects a daemon given other weights by mistake,
 * not a forgery. A synthetic model's is the hash of its canonical spec (seed included). A
 * checkpoint's covers what config.json says of its MoE layers, the weight dtype served, and, for
 * every tensor of every MoE layer moed would read (routers, DeepSeek's bias, shared and routed
 * experts' matrices and FP8 block scales, whether this daemon holds them or not), its name, dtype,
 * shape and four 64-byte pieces of its data (at its start, a third, two thirds and its end), read
 * with pread: a few kilobytes per layer, however large the model. A matrix stored 2:4 compressed
 * (compressed-tensors, hf.h) counts by its `.compressed` values and its `.bitmask`; served pruned
 * (moed --weights sparse24), a model is another model: wdtype says so.
 */
#ifndef MOED_FINGERPRINT_H
#define MOED_FINGERPRINT_H

#include "hf.h"
#include "safetensors.h"

#include <stdint.h>

/* The fingerprint of the synthetic model whose canonical spec (moed_synth_format) is `spec`. */
uint64_t moed_fingerprint_synthetic(const char *spec);

/* The fingerprint of checkpoint folder st, whose config.json says cfg, served in weight dtype
 * wdtype (0: as stored; MOED_FP8: quantized at load; MOED_WEIGHTS_SPARSE24: pruned at load). Opens
 * the files it needs (with an index, every shard holding a MoE layer's tensors). A tensor it cannot
 * read (say a broken shard of a layer this daemon does not hold, which its load does not need)
 * counts as unreadable: it changes the fingerprint rather than failing the load. */
uint64_t moed_fingerprint_checkpoint(moed_st_dir *st, const moed_hf_config *cfg, int wdtype);

#endif
