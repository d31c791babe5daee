"""Writes tiny random Mixtral, Qwen3-MoE, OLMoE and DeepSeek-V3 checkpoints with transformers'
own save_pretrained, in F32 and BF16, and what transformers computes for them: for a fixed seeded
hidden batch, each MoE block's output and its router's logits, expert ids and routing weights.

    python make_hf_checkpoints.py [--out DIR]      (default: the folder of this script)

Needs torch and transformers (5.17 wrote the committed files); CI does not, and reads the committed
references instead (hf_refs.py). Each checkpoint goes to DIR/<arch>_<dtype>/ (config.json,
generation_config.json, model.safetensors) with refs.safetensors beside it:
    x                       float32 [T, d_model], the hidden batch (standard normal, seeded)
    f32.<layer>.out|logits|ids|weights
                            the model loaded in float32 (a BF16 checkpoint upcast), x as is
    bf16.<layer>.out|logits|ids|weights     (BF16 checkpoints only)
                            the model in its own dtype, x rounded to bf16; values stored as float32
references() recomputes the same dictionary from a checkpoint folder, for hf_refs.py's live mode.
"""

import argparse
import pathlib

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers import (AutoModelForCausalLM, DeepseekV3Config, MixtralConfig, OlmoeConfig,
                          Qwen3MoeConfig)

HERE = pathlib.Path(__file__).resolve().parent
T = 64  # tokens of the hidden batch
SEED = 8

# Small enough that the whole set stays near 1 MB: d_model 64, 8 experts of width 16, top-2.
COMMON = dict(vocab_size=32, hidden_size=64, intermediate_size=16, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, num_experts_per_tok=2)
# Each takes overrides of these (the generation checkpoints, tests/e2e/hf_generate, have more
# layers and tokens).
CONFIGS = {
    # renormalised softmax top-k (always, whatever the config says)
    "mixtral": lambda **kw: MixtralConfig(**{**COMMON, "num_hidden_layers": 1, "num_local_experts": 8,
                                             **kw}),
    # softmax top-k renormalised (norm_topk_prob), routing weights cast to the activation dtype
    "qwen3_moe": lambda **kw: Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 1,
                                                "moe_intermediate_size": 16, "num_experts": 8,
                                                "norm_topk_prob": True, "head_dim": 16, **kw}),
    # softmax top-k, not renormalised
    "olmoe": lambda **kw: OlmoeConfig(**{**COMMON, "num_hidden_layers": 1, "num_experts": 8,
                                         "norm_topk_prob": False, **kw}),
    # sigmoid + correction bias, 4 groups of 2 with 2 kept, scaled, one shared expert; layer 0 dense
    "deepseek_v3": lambda **kw: DeepseekV3Config(**{
        **COMMON, "num_hidden_layers": 2, "first_k_dense_replace": 1, "moe_intermediate_size": 16,
        "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": None,
        "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, **kw}),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def moe_blocks(model):
    """{layer index: MoE block} of a causal-LM model."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp
        if hasattr(block, "gate") and hasattr(block, "experts"):
            out[i] = block
    return out


def randomise(model, seed):
    """Weights of 1/sqrt(fan_in) scale (transformers' 0.02 init gives logits so small that every
    token's experts nearly tie), and a DeepSeek correction bias that is not all zeros."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def block_refs(block, x, tag):
    """What one MoE block computes for x [T, d] (already in the model's dtype)."""
    with torch.no_grad():
        logits, weights, ids = block.gate(x)
        out = block(x.unsqueeze(0)).squeeze(0)
    f32 = lambda t: t.detach().to(torch.float32).numpy()
    return {f"{tag}.out": f32(out), f"{tag}.logits": f32(logits),
            f"{tag}.ids": ids.detach().to(torch.int32).numpy(), f"{tag}.weights": f32(weights)}


def references(folder, x):
    """The reference dictionary (without x) for the checkpoint in folder and hidden x (float32)."""
    folder = pathlib.Path(folder)
    kinds = ["f32"] + (["bf16"] if folder.name.endswith("_bf16") else [])
    refs = {}
    for kind in kinds:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[kind]).eval()
        xt = torch.from_numpy(np.asarray(x, dtype=np.float32)).to(DTYPES[kind])
        for layer, block in moe_blocks(model).items():
            refs.update(block_refs(block, xt, f"{kind}.{layer}"))
    return refs


def write(out, arch, kind):
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch]())
    randomise(model, SEED + len(arch))
    model = model.to(DTYPES[kind]).eval()
    folder = out / f"{arch}_{kind}"
    model.save_pretrained(folder)
    x = torch.randn((T, model.config.hidden_size), generator=torch.Generator().manual_seed(SEED))
    refs = {"x": x.numpy()}
    refs.update(references(folder, refs["x"]))
    save_file({k: np.ascontiguousarray(v) for k, v in refs.items()}, str(folder / "refs.safetensors"))
    return folder


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=HERE)
    a = ap.parse_args()
    for arch in CONFIGS:
        for kind in DTYPES:
            folder = write(a.out, arch, kind)
            size = sum(f.stat().st_size for f in folder.iterdir())
            print(f"{folder}: {size / 1024:.0f} KiB, layers {sorted({k.split('.')[1] for k in load_file(str(folder / 'refs.safetensors')) if '.' in k})}")


if __name__ == "__main__":
    main()
