"""Tiny Hugging Face MoE checkpoints for moed's tests, written with the `safetensors` package.

The end-to-end tests need a checkpoint that moed did not write itself: this module writes one the
way `save_pretrained` lays it out (config.json, model.safetensors or shards plus
model.safetensors.index.json, per-expert tensor names) in Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE or
DeepSeek-V3 naming, from a seed, and returns the weights as moed will hold them, in float64, so a
test can compute the reference output with numpy.

    from make_checkpoint import write_checkpoint
    layers = write_checkpoint(tmpdir, arch="mixtral", layers=2, d=64, ff=128, experts=4, top_k=2)
    layers[0]["w1"]  # [experts, ff, d] float64: exactly the stored bf16 values

dtype="fp8" writes an FP8 checkpoint as DeepSeek-V3 and the Qwen3 -FP8 releases ship them: every
expert matrix (the shared experts' too) F8_E4M3 with a float32 `<name>_scale_inv` of one scale per
128 x 128 block beside it, config.json's quantization_config (quant_method fp8, weight_block_size
[128, 128]), the router and everything else bf16. The scales are drawn at random (not amax / 448),
the codes are the weights divided by them and rounded by ml_dtypes.float8_e4m3fn, and the returned
weights are the dequantized ones: code times scale in float32.

As a script: python make_checkpoint.py DIR --arch deepseek_v3 --shards 2 ...
"""

import argparse
import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")

DTYPES = {
    "bf16": ml_dtypes.bfloat16,
    "bfloat16": ml_dtypes.bfloat16,
    "f16": np.float16,
    "float16": np.float16,
    "f32": np.float32,
    "float32": np.float32,
}

_CLASS = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

# What the flagship model of each architecture sets (Mixtral always renormalises).
_NORM_DEFAULT = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False,
                 "deepseek_v3": True}


FP8_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [128, 128]}


def _dtype(name):
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: use bf16, f16, f32 (or fp8 for the experts)") from None


def fp8_blocks(values, rng):
    """values [rows, cols] as DeepSeek-V3's FP8: (e4m3 codes, float32 scales [ceil(rows/128),
    ceil(cols/128)], the dequantized weights as float64). Each block's scale is its amax / 448
    times a random factor in [1, 4), so no code saturates and the scales are nothing moed computes
    itself."""
    v = np.asarray(values, dtype=np.float32)
    rows, cols = v.shape
    br, bc = -(-rows // 128), -(-cols // 128)
    pad = np.zeros((br * 128, bc * 128), np.float32)
    pad[:rows, :cols] = np.abs(v)
    amax = pad.reshape(br, 128, bc, 128).max(axis=(1, 3))
    scale = (np.maximum(amax, 1e-6) / 448 * rng.uniform(1, 4, amax.shape)).astype(np.float32)
    per = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:rows, :cols]
    codes = (v / per).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale, (codes.astype(np.float32) * per).astype(np.float64)


def _names(arch, layer):
    """The checkpoint names of one MoE layer's tensors (expert names take the expert number)."""
    if arch == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe."
        return {"router": p + "gate.weight",
                "w1": p + "experts.{}.w1.weight", "w3": p + "experts.{}.w3.weight",
                "w2": p + "experts.{}.w2.weight"}
    p = f"model.layers.{layer}.mlp."
    shared = p + ("shared_experts." if arch == "deepseek_v3" else "shared_expert.")
    return {"router": p + "gate.weight", "bias": p + "gate.e_score_correction_bias",
            "w1": p + "experts.{}.gate_proj.weight", "w3": p + "experts.{}.up_proj.weight",
            "w2": p + "experts.{}.down_proj.weight",
            "shared_w1": shared + "gate_proj.weight", "shared_w3": shared + "up_proj.weight",
            "shared_w2": shared + "down_proj.weight"}


def _config(arch, layers, d, ff, experts, top_k, dtype, n_shared, shared_ff, first_dense,
            n_group, topk_group, routed_scale, norm_topk):
    c = {"architectures": [_CLASS[arch]], "model_type": arch, "hidden_size": d,
         "num_hidden_layers": layers, "num_experts_per_tok": top_k, "hidden_act": "silu",
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 16,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
         "torch_dtype": {"bf16": "bfloat16", "f16": "float16", "f32": "float32",
                         "fp8": "bfloat16"}.get(dtype, dtype)}
    if dtype == "fp8":
        c["quantization_config"] = dict(FP8_QUANTIZATION)
    if arch == "mixtral":
        c.update(num_local_experts=experts, intermediate_size=ff)
    elif arch == "olmoe":
        c.update(num_experts=experts, intermediate_size=ff, norm_topk_prob=norm_topk)
    elif arch in ("qwen2_moe", "qwen3_moe"):
        c.update(num_experts=experts, moe_intermediate_size=ff, intermediate_size=2 * ff,
                 norm_topk_prob=norm_topk, decoder_sparse_step=1,
                 mlp_only_layers=list(range(first_dense)))
        if arch == "qwen2_moe":
            c["shared_expert_intermediate_size"] = shared_ff
    else:
        c.update(n_routed_experts=experts, moe_intermediate_size=ff, intermediate_size=2 * ff,
                 n_shared_experts=n_shared or None, first_k_dense_replace=first_dense,
                 moe_layer_freq=1, n_group=n_group, topk_group=topk_group,
                 routed_scaling_factor=routed_scale, norm_topk_prob=norm_topk,
                 scoring_func="sigmoid", topk_method="noaux_tc")
    return c


def write_checkpoint(dir, arch="mixtral", layers=2, d=64, ff=128, experts=4, top_k=2,
                     dtype="bf16", seed=0, shards=1, router_dtype=None, n_shared=None,
                     shared_ff=None, first_dense=None, n_group=1, topk_group=1, routed_scale=1.0,
                     norm_topk=None, bias_dtype="f32"):
    """Writes a checkpoint into dir (created if needed) and returns {layer: weights} for its MoE
    layers, each a dict of float64 arrays as moed holds them:
      w1, w3 [experts, ff, d]; w2 [experts, d, ff]; router [experts, d] (in its own dtype: moed
      computes the server router from it as stored); bias [experts] (float32 values,
      deepseek_v3) or None; shared_w1, shared_w3 [shared_ff, d], shared_w2 [d, shared_ff] or None;
    and the routing it uses: top_k, norm_topk, rule ("softmax" or "deepseek"), n_group,
    topk_group, routed_scale.

    n_shared: shared experts (deepseek_v3: default 1, fused to shared_ff = n_shared * ff wide;
    qwen2_moe: 0 or 1, shared_ff wide, default ff). first_dense: leading dense-MLP layers
    (deepseek_v3 first_k_dense_replace, default 1; qwen mlp_only_layers; default 0).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r}: use one of {', '.join(ARCHS)}")
    deepseek = arch == "deepseek_v3"
    n_shared = (1 if deepseek else 0) if n_shared is None else n_shared
    first_dense = (1 if deepseek else 0) if first_dense is None else first_dense
    norm_topk = _NORM_DEFAULT[arch] if norm_topk is None else bool(norm_topk)
    if arch == "mixtral" and not norm_topk:
        raise ValueError("Mixtral always renormalises its top-k weights: norm_topk must be True")
    if n_shared and arch not in ("deepseek_v3", "qwen2_moe") or arch == "qwen2_moe" and n_shared > 1:
        raise ValueError(f"{arch} cannot have {n_shared} shared experts")
    if first_dense and arch in ("mixtral", "olmoe"):
        raise ValueError(f"every {arch} layer is MoE: first_dense must be 0")
    if not deepseek and (n_group, topk_group, routed_scale) != (1, 1, 1.0):
        raise ValueError("n_group, topk_group and routed_scale are deepseek_v3 settings")
    if not 0 <= first_dense < layers:
        raise ValueError(f"first_dense {first_dense} leaves no MoE layer among {layers}")
    shared_ff = (n_shared * ff if deepseek else ff) if shared_ff is None else shared_ff
    shared_ff = shared_ff if n_shared else 0
    fp8 = dtype == "fp8"
    wdt = _dtype("bf16" if fp8 else dtype)
    rdt, bdt = _dtype(router_dtype or ("bf16" if fp8 else dtype)), _dtype(bias_dtype)

    rng = np.random.default_rng(seed)
    tensors = [{} for _ in range(max(shards, 1))]
    out = {}

    def put(layer, name, values, dt):
        """Stores values rounded to dt and returns the stored values in float64."""
        stored = np.ascontiguousarray(values.astype(np.float32).astype(dt))
        tensors[layer % len(tensors) if layer >= 0 else 0][name] = stored
        return stored.astype(np.float64)

    def rand(shape, fan_in):
        return rng.standard_normal(shape) / np.sqrt(fan_in)

    def put_matrix(layer, name, values):
        """An expert matrix in the checkpoint's weight dtype (fp8: codes and scales)."""
        if not fp8:
            return put(layer, name, values, wdt)
        codes, scale, deq = fp8_blocks(values, rng)
        shard = tensors[layer % len(tensors)]
        shard[name] = np.ascontiguousarray(codes)
        shard[name + "_scale_inv"] = np.ascontiguousarray(scale)
        return deq

    put(-1, "model.embed_tokens.weight", rand((16, d), 1), wdt)
    put(-1, "model.norm.weight", np.ones(d), wdt)
    for layer in range(layers):
        put(layer, f"model.layers.{layer}.input_layernorm.weight", np.ones(d), wdt)
        put(layer, f"model.layers.{layer}.post_attention_layernorm.weight", np.ones(d), wdt)
        if layer < first_dense:
            p = f"model.layers.{layer}.mlp."
            put(layer, p + "gate_proj.weight", rand((2 * ff, d), d), wdt)
            put(layer, p + "up_proj.weight", rand((2 * ff, d), d), wdt)
            put(layer, p + "down_proj.weight", rand((d, 2 * ff), 2 * ff), wdt)
            continue
        names = _names(arch, layer)
        w = {"top_k": top_k, "norm_topk": norm_topk, "rule": "deepseek" if deepseek else "softmax",
             "n_group": n_group if deepseek else 1, "topk_group": topk_group if deepseek else 1,
             "routed_scale": float(routed_scale) if deepseek else 1.0, "n_shared": n_shared,
             "bias": None, "shared_w1": None, "shared_w3": None, "shared_w2": None}
        w["router"] = put(layer, names["router"], rand((experts, d), d), rdt)
        if deepseek:
            bias = put(layer, names["bias"], 0.1 * rng.standard_normal(experts), bdt)
            w["bias"] = bias.astype(np.float32).astype(np.float64)
        for k, rows, cols in (("w1", ff, d), ("w3", ff, d), ("w2", d, ff)):
            w[k] = np.stack([put_matrix(layer, names[k].format(e), rand((rows, cols), cols))
                             for e in range(experts)])
        if shared_ff:
            for k, rows, cols in (("shared_w1", shared_ff, d), ("shared_w3", shared_ff, d),
                                  ("shared_w2", d, shared_ff)):
                w[k] = put_matrix(layer, names[k], rand((rows, cols), cols))
        out[layer] = w

    os.makedirs(dir, exist_ok=True)
    config = _config(arch, layers, d, ff, experts, top_k, dtype, n_shared, shared_ff, first_dense,
                     n_group, topk_group, routed_scale, norm_topk)
    with open(os.path.join(dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if len(tensors) == 1:
        save_file(tensors[0], os.path.join(dir, "model.safetensors"), metadata={"format": "pt"})
        return out
    weight_map, total = {}, 0
    for i, shard in enumerate(tensors):
        file = f"model-{i + 1:05d}-of-{len(tensors):05d}.safetensors"
        save_file(shard, os.path.join(dir, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
        total += sum(t.nbytes for t in shard.values())
    with open(os.path.join(dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                  f, indent=2)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--arch", default="mixtral", choices=ARCHS)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--ff", type=int, default=128)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32", "fp8"))
    ap.add_argument("--router-dtype", choices=("bf16", "f16", "f32"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--n-shared", type=int)
    ap.add_argument("--first-dense", type=int)
    ap.add_argument("--n-group", type=int, default=1)
    ap.add_argument("--topk-group", type=int, default=1)
    ap.add_argument("--routed-scale", type=float, default=1.0)
    a = ap.parse_args(argv)
    out = write_checkpoint(a.dir, arch=a.arch, layers=a.layers, d=a.d, ff=a.ff,
                           experts=a.experts, top_k=a.top_k, dtype=a.dtype, seed=a.seed,
                           shards=a.shards, router_dtype=a.router_dtype, n_shared=a.n_shared,
                           first_dense=a.first_dense, n_group=a.n_group,
                           topk_group=a.topk_group, routed_scale=a.routed_scale)
    print(f"wrote {a.arch} checkpoint to {a.dir}: MoE layers {sorted(out)}")


if __name__ == "__main__":
    main()
