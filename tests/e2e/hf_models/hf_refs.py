"""Checkpoints written by transformers itself and what transformers computes for them, and the
comparison of a moed daemon's outputs with it; shared by test_hf_models.py and table.py.

The checkpoints and refs.safetensors beside them come from make_hf_checkpoints.py. Where torch and
transformers import (the GPU machine has both), the references are recomputed live from the
checkpoint by transformers instead of read from the file; CI has neither and reads the file.

A moed layer is driven three ways for the same hidden batch: "server router" (moed's own router and
the layer's rule), "client logits" (transformers' router logits, gated by moed with the layer's
rule) and "client ids" (transformers' expert ids and routing weights). Each output is compared with
transformers' MoE block output, per token (relative error of the row) and as a whole (relative
Frobenius error).
"""

import pathlib

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

HERE = pathlib.Path(__file__).resolve().parent
CHECKPOINTS = sorted(p.parent.name for p in HERE.glob("*/refs.safetensors"))
MODES = ("client logits", "client ids", "server router")
# Per-token relative error and relative Frobenius error bounds of a block's output, by what the
# reference ran in and what the server multiplies in: float32 against float32 is rounding only;
# a bf16 side (transformers rounds each intermediate to bf16, moed's CPU backend only the output,
# the CUDA backend multiplies in bf16) a few bf16 steps (2^-8 relative) of the row.
BOUNDS = {("f32", "f32"): (1e-5, 1e-6), ("f32", "bf16"): (3e-2, 1.5e-2),
          ("bf16", "f32"): (3e-2, 1.5e-2), ("bf16", "bf16"): (3e-2, 1.5e-2)}


def live():
    """True when torch and transformers can recompute the references."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def load(name):
    """The references of checkpoint `name`: {"x": hidden, "<kind>.<layer>.<what>": array}; kind is
    "f32" (the model in float32) or "bf16" (BF16 checkpoints: the model and x in bf16)."""
    refs = load_file(str(HERE / name / "refs.safetensors"))
    if live():
        from .make_hf_checkpoints import references

        refs.update(references(HERE / name, refs["x"]))
    return refs


def kinds(refs):
    return sorted({k.split(".")[0] for k in refs if k != "x"}, key=lambda k: k != "f32")


def layers(refs, kind):
    return sorted({int(k.split(".")[1]) for k in refs if k.startswith(kind + ".")})


def hidden(refs, kind):
    """x as sent for a kind: float32, or rounded to bf16 for the model run in bf16."""
    x = refs["x"]
    return x.astype(ml_dtypes.bfloat16) if kind == "bf16" else x


def forward(client, layer, refs, kind, mode):
    """One mode's output for the kind's hidden batch, as float64."""
    x, key = hidden(refs, kind), f"{kind}.{layer}."
    if mode == "server router":
        y = client.forward(layer, x)
    elif mode == "client logits":
        y = client.forward(layer, x, router_logits=refs[key + "logits"].astype(np.float32))
    elif mode == "client ids":
        y = client.forward(layer, x, expert_ids=refs[key + "ids"].astype(np.int32),
                           expert_weights=refs[key + "weights"].astype(np.float32))
    else:
        raise ValueError(mode)
    return np.asarray(y).astype(np.float64)


def token_errors(y, ref):
    """Per-token relative error ||y_t - ref_t|| / ||ref_t||."""
    ref = np.asarray(ref, dtype=np.float64)
    return np.linalg.norm(y - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)


def frobenius_error(y, ref):
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def ambiguous_tokens(name, refs, kind, layer):
    """Tokens whose choice transformers made at a tie too close to call: its k-th and (k+1)-th
    choice scores within one bf16 step (softmax rule, logits rounded to bf16) or 1e-5 relative
    (float32 logits; DeepSeek-V3's scores are sigmoid plus the checkpoint's correction bias).
    Another backend may order such a pair either way."""
    key = f"{kind}.{layer}."
    scores = refs[key + "logits"].astype(np.float64)
    deepseek = name.startswith("deepseek")
    if deepseek:
        w = load_file(str(HERE / name / "model.safetensors"))
        bias = w[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"].astype(np.float64)
        scores = 1.0 / (1.0 + np.exp(-scores)) + bias
    k = refs[key + "ids"].shape[1]
    s = -np.sort(-scores, axis=1)
    gap = s[:, k - 1] - s[:, k]
    if kind == "bf16" and not deepseek:
        step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(s[:, k - 1]), 1e-30))) - 7)
        return gap <= step
    return gap <= 1e-5 * np.max(np.abs(s), axis=1)
