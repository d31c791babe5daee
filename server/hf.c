/*
 * moed_hf — config.json to moed_layer_info, and the Hugging Face tensor names (see hf.h).
 *
 * Each architecture differs from the others in a few keys and defaults only, so one table row per
 * architecture holds those and one reader serves them all. Every value is range-checked here,
 * where the message can name the config key, rather than failing later as a tensor shape mismatch
 * or, worse, as silently wrong routing.
 */
#include "hf.h"

#include "moed_fp8.h"
#include "moed_synth.h"
#include "safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const struct {
    const char *model_type;
    const char *class_name; /* architectures[0] */
    bool norm_default;
} archs[] = {
    [MOED_HF_MIXTRAL] = { "mixtral", "MixtralForCausalLM", true },
    [MOED_HF_QWEN2_MOE] = { "qwen2_moe", "Qwen2MoeForCausalLM", false },
    [MOED_HF_QWEN3_MOE] = { "qwen3_moe", "Qwen3MoeForCausalLM", false },
    [MOED_HF_OLMOE] = { "olmoe", "OlmoeForCausalLM", false },
    [MOED_HF_DEEPSEEK_V3] = { "deepseek_v3", "DeepseekV3ForCausalLM", true },
};
#define N_ARCHS ((int)(sizeof archs / sizeof archs[0]))

/* config.json being read: its path for messages. */
typedef struct cfg {
    const cJSON *root;
    const char *path;
    moed_error *err;
} cfg;

/* A key that is absent or null reads as its default; REQUIRED makes it an error instead. */
#define REQUIRED INT_MIN

static int key_int(const cfg *c, const char *key, int dflt, int min, int *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(c->root, key);
    if (!v || cJSON_IsNull(v)) {
        if (dflt == REQUIRED)
            return moed_fail(c->err, MOED_EFORMAT, "%s has no \"%s\"; moed needs it", c->path, key);
        *out = dflt;
        return 0;
    }
    double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
    if (!(d >= min && d <= INT_MAX) || d != floor(d))
        return moed_fail(c->err, MOED_EFORMAT, "%s: \"%s\" must be an integer >= %d", c->path, key,
                         min);
    *out = (int)d;
    return 0;
}

/* The first of keys that config.json has (an architecture's names for one size). */
static const char *first_key(const cfg *c, const char *const *keys, int n)
{
    for (int i = 0; i < n; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(c->root, keys[i]);
        if (v && !cJSON_IsNull(v)) return keys[i];
    }
    return keys[0];
}

static int key_bool(const cfg *c, const char *key, bool dflt, bool *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(c->root, key);
    *out = dflt;
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsBool(v))
        return moed_fail(c->err, MOED_EFORMAT, "%s: \"%s\" must be true or false", c->path, key);
    *out = cJSON_IsTrue(v);
    return 0;
}

static int key_str(const cfg *c, const char *key, const char *dflt, const char **out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(c->root, key);
    *out = dflt;
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsString(v))
        return moed_fail(c->err, MOED_EFORMAT, "%s: \"%s\" must be a string", c->path, key);
    *out = v->valuestring;
    return 0;
}

static int read_arch(const cfg *c, moed_hf_config *out)
{
    const char *type;
    int rc = key_str(c, "model_type", NULL, &type);
    if (rc) return rc;
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(c->root, "architectures");
    const char *cls =
        cJSON_IsArray(list) && cJSON_IsString(list->child) ? list->child->valuestring : NULL;
    for (int a = 0; a < N_ARCHS; a++)
        if (type ? !strcmp(type, archs[a].model_type) : cls && !strcmp(cls, archs[a].class_name)) {
            out->arch = (moed_hf_arch)a;
            out->arch_name = archs[a].model_type;
            return 0;
        }
    return moed_fail(c->err, MOED_EUNSUPPORTED,
                     "%s: model_type \"%s\" (architectures[0] \"%s\") is not an MoE architecture "
                     "moed loads; it loads mixtral, qwen2_moe, qwen3_moe, olmoe and deepseek_v3",
                     c->path, type ? type : "(none)", cls ? cls : "(none)");
}

/* A string field of quantization_config that, when present, must be `want`. */
static int quant_str(const cfg *c, const cJSON *q, const char *key, const char *want,
                     const char *why)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(q, key);
    if (!v || cJSON_IsNull(v) || (cJSON_IsString(v) && !strcmp(v->valuestring, want))) return 0;
    return moed_fail(
        c->err, MOED_EUNSUPPORTED, "%s: quantization_config.%s is %s%s%s, not \"%s\": %s", c->path,
        key, cJSON_IsString(v) ? "\"" : "", cJSON_IsString(v) ? v->valuestring : "not a string",
        cJSON_IsString(v) ? "\"" : "", want, why);
}

/* quantization_config of quant_method "compressed-tensors": 2:4 sparsity alone, stored as
 * compressed-tensors' sparse-24-bitmask format (hf.h). Its quantization (config_groups) and other
 * sparsity formats are refused naming the field: the weights would be misread. */
static int read_compressed_tensors(const cfg *c, const cJSON *q, moed_hf_config *h)
{
    const cJSON *groups = cJSON_GetObjectItemCaseSensitive(q, "config_groups");
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(q, "sparsity_config");
    const bool sparse = s && !cJSON_IsNull(s);
    if (groups && !cJSON_IsNull(groups) && cJSON_GetArraySize(groups) > 0)
        return moed_fail(c->err, MOED_EUNSUPPORTED,
                         "%s: quantization_config.config_groups says the weights are quantized by "
                         "compressed-tensors: %s; moed loads compressed-tensors checkpoints of "
                         "BF16, F16 or F32 weights with 2:4 sparsity (sparse-24-bitmask) only",
                         c->path,
                         sparse ? "FP8 (or other quantized) weights with 2:4 sparsity are not "
                                  "supported yet (docs/weights.md)"
                                : "dequantize the checkpoint (e.g. to bf16) first");
    if (!sparse)
        return moed_fail(
            c->err, MOED_EUNSUPPORTED,
            "%s: quantization_config (quant_method \"compressed-tensors\") has neither "
            "config_groups nor sparsity_config: nothing says how the weights are "
            "stored",
            c->path);
    if (!cJSON_IsObject(s))
        return moed_fail(c->err, MOED_EFORMAT,
                         "%s: quantization_config.sparsity_config must be an object", c->path);
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(s, "format");
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(s, "sparsity_structure");
    if (!cJSON_IsString(f) || strcmp(f->valuestring, "sparse-24-bitmask"))
        return moed_fail(c->err, MOED_EUNSUPPORTED,
                         "%s: quantization_config.sparsity_config.format is \"%s\": moed loads "
                         "compressed-tensors' \"sparse-24-bitmask\" (2:4 sparse weights) only; "
                         "decompress this checkpoint to dense weights first",
                         c->path, cJSON_IsString(f) ? f->valuestring : "(missing)");
    if (st && !cJSON_IsNull(st) && !(cJSON_IsString(st) && !strcmp(st->valuestring, "2:4")))
        return moed_fail(c->err, MOED_EUNSUPPORTED,
                         "%s: quantization_config.sparsity_config.sparsity_structure is %s%s%s, "
                         "not \"2:4\": the sparse-24-bitmask format holds 2:4 sparse weights",
                         c->path, cJSON_IsString(st) ? "\"" : "",
                         cJSON_IsString(st) ? st->valuestring : "not a string",
                         cJSON_IsString(st) ? "\"" : "");
    h->sparse24 = true;
    return 0;
}

/* quantization_config: absent, or block-scaled FP8 as DeepSeek-V3 and the Qwen3 -FP8 releases
 * write it (quant_method "fp8", fmt "e4m3", activation_scheme "dynamic", weight_block_size
 * [128, 128]), or compressed-tensors 2:4 sparsity (read_compressed_tensors); any other scheme is
 * refused naming the field that differs. */
static int read_quantization(const cfg *c, moed_hf_config *h)
{
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(c->root, "quantization_config");
    if (!q || cJSON_IsNull(q)) return 0;
    if (!cJSON_IsObject(q))
        return moed_fail(c->err, MOED_EFORMAT, "%s: quantization_config must be an object",
                         c->path);
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(q, "quant_method");
    if (cJSON_IsString(m) && !strcmp(m->valuestring, "compressed-tensors"))
        return read_compressed_tensors(c, q, h);
    if (!cJSON_IsString(m) || strcmp(m->valuestring, "fp8"))
        return moed_fail(c->err, MOED_EUNSUPPORTED,
                         "%s: quantization_config.quant_method is \"%s\": moed loads block-scaled "
                         "FP8 checkpoints (quant_method \"fp8\", weight_block_size [128, 128]), "
                         "compressed-tensors 2:4 sparse ones (sparse-24-bitmask) and unquantized "
                         "BF16, F16 or F32 ones; dequantize this one first",
                         c->path, cJSON_IsString(m) ? m->valuestring : "(missing)");
    int rc;
    if ((rc = quant_str(c, q, "fmt", "e4m3", "moed loads e4m3 weights")) ||
        (rc = quant_str(c, q, "activation_scheme", "dynamic",
                        "moed quantizes activations itself, per token and 128 channels, and "
                        "has no use for static activation scales")))
        return rc;
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(q, "weight_block_size");
    const cJSON *b0 = cJSON_IsArray(b) ? cJSON_GetArrayItem(b, 0) : NULL;
    const cJSON *b1 = cJSON_IsArray(b) ? cJSON_GetArrayItem(b, 1) : NULL;
    if (!(cJSON_GetArraySize(b) == 2 && cJSON_IsNumber(b0) && cJSON_IsNumber(b1) &&
          b0->valuedouble == MOED_FP8_BLOCK && b1->valuedouble == MOED_FP8_BLOCK)) {
        char *text = b ? cJSON_PrintUnformatted(b) : NULL;
        rc = moed_fail(c->err, MOED_EUNSUPPORTED,
                       "%s: quantization_config.weight_block_size is %s: moed loads FP8 weights "
                       "with one scale per 128 x 128 block (weight_block_size [128, 128]); "
                       "per-tensor, per-channel and other block sizes are not supported",
                       c->path, text ? text : "missing");
        cJSON_free(text);
        return rc;
    }
    h->fp8 = true;
    return 0;
}

/* The sizes every architecture has, under one of its names. */
static int read_sizes(const cfg *c, moed_hf_config *h)
{
    static const char *const experts[] = { "num_local_experts", "num_experts", "n_routed_experts" };
    static const char *const width[] = { "moe_intermediate_size", "intermediate_size" };
    moed_layer_info *li = &h->layer;
    const char *act;
    int rc;
    if ((rc = key_int(c, "num_hidden_layers", REQUIRED, 1, &h->n_layers)) ||
        (rc = key_int(c, "hidden_size", REQUIRED, 1, &li->d_model)) ||
        (rc = key_int(c, first_key(c, experts, 3), REQUIRED, 1, &li->n_experts)) ||
        (rc = key_int(c, "num_experts_per_tok", REQUIRED, 1, &li->top_k)) ||
        (rc = key_int(c, first_key(c, width, 2), REQUIRED, 1, &li->d_ff)) ||
        (rc = key_str(c, "hidden_act", "silu", &act)))
        return rc;
    if (li->top_k > li->n_experts)
        return moed_fail(c->err, MOED_EFORMAT, "%s: num_experts_per_tok %d is over the %d experts",
                         c->path, li->top_k, li->n_experts);
    if (strcmp(act, "silu") && strcmp(act, "swish"))
        return moed_fail(c->err, MOED_EUNSUPPORTED,
                         "%s: hidden_act \"%s\": moed computes these gated experts with silu "
                         "(SwiGLU) only",
                         c->path, act);
    li->act = MOED_ACT_SWIGLU;
    li->has_router = true;
    li->rule = MOED_RULE_SOFTMAX_TOPK;
    li->n_group = 1;
    li->topk_group = 1;
    li->routed_scale = 1.0f;
    if (h->arch == MOED_HF_MIXTRAL) { /* Mixtral's router renormalises whatever the config says */
        li->norm_topk = true;
        return 0;
    }
    return key_bool(c, "norm_topk_prob", archs[h->arch].norm_default, &li->norm_topk);
}

static int read_deepseek(const cfg *c, moed_hf_config *h)
{
    moed_layer_info *li = &h->layer;
    const char *scoring;
    int first_dense, freq, rc;
    const cJSON *scale = cJSON_GetObjectItemCaseSensitive(c->root, "routed_scaling_factor");
    if ((rc = key_int(c, "n_group", 8, 1, &li->n_group)) ||
        (rc = key_int(c, "topk_group", 4, 1, &li->topk_group)) ||
        (rc = key_int(c, "n_shared_experts", 0, 0, &li->n_shared)) ||
        (rc = key_int(c, "first_k_dense_replace", 3, 0, &first_dense)) ||
        (rc = key_int(c, "moe_layer_freq", 1, 1, &freq)) ||
        (rc = key_str(c, "scoring_func", "sigmoid", &scoring)))
        return rc;
    /* null means none; absent means transformers' default of one shared expert */
    if (!cJSON_GetObjectItemCaseSensitive(c->root, "n_shared_experts")) li->n_shared = 1;
    li->rule = MOED_RULE_DEEPSEEK_V3;
    li->routed_scale = 2.5f;
    if (scale && !cJSON_IsNull(scale)) {
        double s = cJSON_IsNumber(scale) ? scale->valuedouble : NAN;
        if (!(s > 0 && s < 1e30))
            return moed_fail(c->err, MOED_EFORMAT,
                             "%s: routed_scaling_factor must be a positive number", c->path);
        li->routed_scale = (float)s;
    }
    if (strcmp(scoring, "sigmoid"))
        return moed_fail(
            c->err, MOED_EUNSUPPORTED,
            "%s: scoring_func \"%s\": moed routes deepseek_v3 with sigmoid scoring only", c->path,
            scoring);
    int per_group = li->n_experts / li->n_group;
    if (li->n_experts % li->n_group || li->topk_group > li->n_group ||
        (li->n_group > 1 && per_group < 2) || li->top_k > li->topk_group * per_group)
        return moed_fail(c->err, MOED_EFORMAT,
                         "%s: n_group %d, topk_group %d and num_experts_per_tok %d do not fit %d "
                         "experts (n_group must divide them into groups of at least 2, topk_group "
                         "<= n_group, and the kept groups must hold num_experts_per_tok experts)",
                         c->path, li->n_group, li->topk_group, li->top_k, li->n_experts);
    li->shared_d_ff = li->n_shared * li->d_ff;
    for (int l = 0; l < h->n_layers; l++) h->is_moe[l] = l >= first_dense && l % freq == 0;
    return 0;
}

static int read_qwen(const cfg *c, moed_hf_config *h)
{
    int step, rc;
    if ((rc = key_int(c, "decoder_sparse_step", 1, 1, &step))) return rc;
    if (h->arch == MOED_HF_QWEN2_MOE) {
        rc = key_int(c, "shared_expert_intermediate_size", 0, 0, &h->layer.shared_d_ff);
        if (rc) return rc;
        h->layer.n_shared = h->layer.shared_d_ff > 0;
    }
    for (int l = 0; l < h->n_layers; l++) h->is_moe[l] = (l + 1) % step == 0;
    const cJSON *only = cJSON_GetObjectItemCaseSensitive(c->root, "mlp_only_layers");
    if (!only || cJSON_IsNull(only)) return 0;
    if (!cJSON_IsArray(only))
        return moed_fail(c->err, MOED_EFORMAT, "%s: mlp_only_layers must be a list of layers",
                         c->path);
    const cJSON *v;
    cJSON_ArrayForEach(v, only)
    {
        double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
        if (!(d >= 0 && d < h->n_layers) || d != floor(d))
            return moed_fail(c->err, MOED_EFORMAT,
                             "%s: mlp_only_layers holds %s, not a layer number below "
                             "num_hidden_layers %d",
                             c->path, cJSON_IsNumber(v) ? "an out-of-range value" : "a non-number",
                             h->n_layers);
        h->is_moe[(int)d] = 0;
    }
    return 0;
}

int moed_hf_config_load(const char *dir, moed_hf_config *h, moed_error *err)
{
    memset(h, 0, sizeof *h);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    cJSON *root = NULL;
    int rc = moed_json_load(path, &root, err);
    struct stat st;
    if (rc == MOED_ENOTFOUND && stat(dir, &st))
        return moed_fail(err, rc, "checkpoint folder %s: %s", dir, strerror(errno));
    if (rc == MOED_ENOTFOUND)
        return moed_fail(err, rc,
                         "%s has no config.json: a Hugging Face checkpoint folder needs the "
                         "config.json its model was saved with",
                         dir);
    if (rc) return rc;
    const cfg c = { root, path, err };
    if ((rc = read_arch(&c, h)) || (rc = read_quantization(&c, h)) || (rc = read_sizes(&c, h)))
        goto err;
    h->is_moe = malloc((size_t)h->n_layers);
    if (!h->is_moe) {
        rc = moed_fail(err, MOED_ENOMEM, "no memory for %d layers", h->n_layers);
        goto err;
    }
    memset(h->is_moe, 1, (size_t)h->n_layers);
    if (h->arch == MOED_HF_DEEPSEEK_V3)
        rc = read_deepseek(&c, h);
    else if (h->arch == MOED_HF_QWEN2_MOE || h->arch == MOED_HF_QWEN3_MOE)
        rc = read_qwen(&c, h);
    if (rc) goto err;
    if (!memchr(h->is_moe, 1, (size_t)h->n_layers)) {
        rc = moed_fail(err, MOED_EFORMAT, "%s describes no MoE layer among its %d layers", path,
                       h->n_layers);
        goto err;
    }
    cJSON_Delete(root);
    return 0;
err:
    cJSON_Delete(root);
    moed_hf_config_free(h);
    return rc;
}

void moed_hf_config_free(moed_hf_config *h)
{
    free(h->is_moe);
    memset(h, 0, sizeof *h);
}

const char *moed_hf_tensor_name(const moed_hf_config *c, int layer, int tensor, int expert,
                                char *buf, size_t n)
{
    static const char *const mixtral_mats[] = { "w1", "w3", "w2" };
    static const char *const mats[] = { "gate_proj", "up_proj", "down_proj" };
    bool mix = c->arch == MOED_HF_MIXTRAL;
    const char *block = mix ? "block_sparse_moe" : "mlp";
    const char *shared = c->arch == MOED_HF_DEEPSEEK_V3 ? "shared_experts"
                         : c->arch == MOED_HF_QWEN2_MOE ? "shared_expert"
                                                        : NULL;
    switch (tensor) {
    case MOED_SYNTH_W1:
    case MOED_SYNTH_W3:
    case MOED_SYNTH_W2:
        snprintf(buf, n, "model.layers.%d.%s.experts.%d.%s.weight", layer, block, expert,
                 (mix ? mixtral_mats : mats)[tensor]);
        return buf;
    case MOED_SYNTH_ROUTER:
        snprintf(buf, n, "model.layers.%d.%s.gate.weight", layer, block);
        return buf;
    case MOED_SYNTH_SHARED_W1:
    case MOED_SYNTH_SHARED_W3:
    case MOED_SYNTH_SHARED_W2:
        if (!shared) return NULL;
        snprintf(buf, n, "model.layers.%d.mlp.%s.%s.weight", layer, shared,
                 mats[tensor - MOED_SYNTH_SHARED_W1]);
        return buf;
    case MOED_SYNTH_BIAS:
        if (c->arch != MOED_HF_DEEPSEEK_V3) return NULL;
        snprintf(buf, n, "model.layers.%d.mlp.gate.e_score_correction_bias", layer);
        return buf;
    case MOED_HF_SHARED_GATE:
        if (c->arch != MOED_HF_QWEN2_MOE) return NULL;
        snprintf(buf, n, "model.layers.%d.mlp.shared_expert_gate.weight", layer);
        return buf;
    }
    return NULL;
}
