/*
 * moed_hf — what a Hugging Face checkpoint's config.json says about its MoE layers, and the names
 * its MoE tensors have.
 *
 * Architectures (config.json "model_type", else "architectures"[0]):
 *   mixtral      model.layers.{L}.block_sparse_moe.experts.{e}.w1|w3|w2.weight, ...gate.weight;
 *                every layer is MoE; softmax top-k, always renormalised.
 *   qwen2_moe    model.layers.{L}.mlp.experts.{e}.gate_proj|up_proj|down_proj.weight,
 * mlp.gate.weight, an optional mlp.shared_expert.* (shared_expert_intermediate_size wide). Its
 *                mlp.shared_expert_gate (a sigmoid gate on the shared expert) is not supported.
 *   qwen3_moe    as qwen2_moe without shared experts. For both, layer L is MoE unless it is in
 *                mlp_only_layers, and only if (L + 1) % decoder_sparse_step == 0.
 *   olmoe        as qwen3_moe, every layer MoE.
 *   deepseek_v3  the same expert names, plus mlp.shared_experts.* (n_shared_experts fused along
 *                d_ff) and mlp.gate.e_score_correction_bias; layer L is MoE if
 *                L >= first_k_dense_replace and L % moe_layer_freq == 0; sigmoid scoring with
 *                group-limited top-k (n_group, topk_group) scaled by routed_scaling_factor.
 * Sizes (hidden_size, the expert count, num_experts_per_tok, the expert width, num_hidden_layers)
 * must be in config.json. A routing key it leaves out takes the default of transformers' config
 * class for that model_type (norm_topk_prob false, but true for deepseek_v3; deepseek_v3: n_group
 * 8, topk_group 4, routed_scaling_factor 2.5, n_shared_experts 1, first_k_dense_replace 3), so a
 * checkpoint computes what it computes in transformers. A quantization_config must be block-scaled
 * FP8 (quant_method "fp8", weight_block_size [128, 128], e4m3, dynamic activations: DeepSeek-V3,
 * R1, Kimi-K2, Qwen3 -FP8); its expert matrices then come as F8_E4M3 with a `<name>_scale_inv`
 * beside each. Or it is compressed-tensors 2:4 sparsity without quantization (quant_method
 * "compressed-tensors", sparsity_config format "sparse-24-bitmask", sparsity_structure "2:4", no
 * config_groups), as llm-compressor writes it and vLLM loads it: a matrix the compressor took is
 * stored as `<name without .weight>.compressed` (its kept values, [rows, cols / 2], the weight's
 * dtype), `.bitmask` (U8 [rows, ceil(cols / 8)], bit c % 8 of byte c / 8 of a row set where column
 * c holds a kept value: numpy.packbits' little bit order) and `.shape` (the dense [rows, cols], an
 * integer tensor), any other as a plain `.weight` (weights.c reads both). Quantized compressed
 * tensors (FP8 with 2:4 too) and unstructured sparsity are refused. Any other quantization is
 * refused, naming the field.
 */
#ifndef MOED_HF_H
#define MOED_HF_H

#include "moed_err.h"
#include "moed_model.h"

typedef enum moed_hf_arch {
    MOED_HF_MIXTRAL,
    MOED_HF_QWEN2_MOE,
    MOED_HF_QWEN3_MOE,
    MOED_HF_OLMOE,
    MOED_HF_DEEPSEEK_V3,
} moed_hf_arch;

typedef struct moed_hf_config {
    moed_hf_arch arch;
    const char *arch_name; /* the model_type: "mixtral", ... */
    int n_layers;          /* num_hidden_layers */
    unsigned char *is_moe; /* n_layers flags: which layers are MoE */
    moed_layer_info layer; /* what every MoE layer is; index 0 and wdtype NONE (the tensors say) */
    bool fp8;              /* quantization_config says block-scaled FP8 */
    bool sparse24;         /* quantization_config says compressed-tensors sparse-24-bitmask */
} moed_hf_config;

/* Reads dir/config.json. Errors: MOED_ENOTFOUND (no config.json), MOED_EFORMAT (a key missing or
 * of the wrong type, inconsistent sizes), MOED_EUNSUPPORTED (architecture, activation,
 * quantization), MOED_ENOMEM, MOED_EIO. */
int moed_hf_config_load(const char *dir, moed_hf_config *c, moed_error *err);
void moed_hf_config_free(moed_hf_config *c);

/* Tensor ids: moed_synth.h's MOED_SYNTH_W1 .. MOED_SYNTH_BIAS, and the Qwen2-MoE shared expert's
 * gate, which moed looks for only to refuse it. */
enum { MOED_HF_SHARED_GATE = 8 };

/* The checkpoint name of tensor id of layer L (expert e for the routed experts' matrices) into buf;
 * returns buf, or NULL if the architecture has no such tensor. */
const char *moed_hf_tensor_name(const moed_hf_config *c, int layer, int tensor, int expert,
                                char *buf, size_t n);

#endif
