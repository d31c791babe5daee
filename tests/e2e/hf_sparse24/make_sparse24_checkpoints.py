"""Writes tiny compressed-tensors 2:4 checkpoints ("sparse-24-bitmask", BF16), as llm-compressor
saves a 2:4 pruned model and vLLM loads it: the matrices the compressor takes are stored as
`<name>.compressed`, `.bitmask` and `.shape` by compressed-tensors' own Sparse24BitMaskCompressor,
and config.json gets its quantization_config by the package's own ModelCompressor.update_config.

    PYTHONPATH=<compressed-tensors 0.10> python make_sparse24_checkpoints.py [--out DIR]

Needs torch, transformers (5.17 wrote the committed files) and compressed-tensors 0.10.x (0.10.2
wrote them; 0.20 keeps the format's config class but no longer has its compressor). CI needs none
of them: test_sparse24.py reads the committed files and decompresses them itself, in numpy.

The models are hf_models/make_hf_checkpoints.py's tiny Mixtral, Qwen3-MoE and DeepSeek-V3 (same
configs, seeds and weight scale), saved by transformers' save_pretrained, then compressed; each
case takes other matrices, so the loader meets each thing the format allows:
    mixtral_bf16      every Linear but lm_head: the experts, the router and attention
    qwen3_moe_bf16    the routed experts only; expert 3's down_proj left dense (in "ignore"), so a
                      layer mixes compressed and plain `.weight` expert matrices
    deepseek_v3_bf16  the routed and the shared experts; the router dense
Each folder is config.json, generation_config.json and model.safetensors (about 100 KB).
"""

import argparse
import pathlib
import re
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from compressed_tensors.compressors import ModelCompressor, Sparse24BitMaskCompressor
from compressed_tensors.config import Sparse24BitMaskConfig

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "hf_models"))
import make_hf_checkpoints as H  # noqa: E402

# name: (architecture, targets, ignore), as compressed-tensors' config states them ("re:" regular
# expressions over module names, matched in full).
CASES = {
    "mixtral_bf16": ("mixtral", [r"re:.*\.(self_attn\.[qkvo]_proj|block_sparse_moe\.gate|"
                                 r"block_sparse_moe\.experts\.\d+\.w[123])$"], ["lm_head"]),
    "qwen3_moe_bf16": ("qwen3_moe", [r"re:.*\.mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                       ["lm_head", "model.layers.0.mlp.experts.3.down_proj"]),
    "deepseek_v3_bf16": ("deepseek_v3", [r"re:.*\.mlp\.(shared_experts|experts\.\d+)\."
                                         r"(gate|up|down)_proj$"], ["lm_head"]),
}


def targeted(modules, targets, ignore):
    """The module names (a weight's name less `.weight`) that targets take and ignore leaves."""
    pats = [re.compile(t[3:]) for t in targets]
    return {m for m in modules if m not in ignore and any(p.fullmatch(m) for p in pats)}


def write(out, name):
    arch, targets, ignore = CASES[name]
    torch.manual_seed(H.SEED)
    model = AutoModelForCausalLM.from_config(H.CONFIGS[arch]())
    H.randomise(model, H.SEED + len(arch))
    model = model.to(torch.bfloat16).eval()
    folder = out / name
    model.save_pretrained(folder)
    path = folder / "model.safetensors"
    dense = load_file(str(path))
    names = targeted({k[:-len(".weight")] for k in dense if k.endswith(".weight")}, targets, ignore)
    config = Sparse24BitMaskConfig(targets=targets, ignore=ignore)
    compressed = Sparse24BitMaskCompressor(config).compress(dense, compression_targets=names)
    save_file(compressed, str(path), metadata={"format": "pt"})
    ModelCompressor(sparsity_config=config).update_config(str(folder))
    # The package's own decompression gives back each taken matrix with two of every four kept.
    back = dict(Sparse24BitMaskCompressor(config).decompress(str(folder)))
    for m in names:
        w = back[m + ".weight"]
        assert w.shape == dense[m + ".weight"].shape and w.dtype == torch.bfloat16, m
        assert ((w.reshape(-1, 4) != 0).sum(dim=1) <= 2).all(), m
    return folder, len(names)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=HERE)
    a = ap.parse_args()
    for name in CASES:
        folder, n = write(a.out, name)
        size = sum(f.stat().st_size for f in folder.iterdir())
        print(f"{folder}: {size / 1024:.0f} KiB, {n} matrices compressed")


if __name__ == "__main__":
    main()
