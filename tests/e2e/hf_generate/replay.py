"""transformers' own greedy generations (make_generation.py's references), replayed call by call
against a moed serving the same checkpoint, with numpy only (CI has no torch).

Each recorded MoE call (hidden, topk_ids, topk_weights) is sent to moed with the router's choice
as transformers made it, and moed's output is compared with the block's recorded output. The last
MoE layer's output then goes the rest of the way to the token as transformers' own code does it:
added to the residual stream recorded beside it, the final RMSNorm, the LM head (head()); the
token moed's output leads to is the argmax of those logits at the step's last position.
"""

import json
import pathlib

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

HERE = pathlib.Path(__file__).resolve().parent
CHECKPOINTS = sorted(p.parent.name for p in HERE.glob("*/generation.safetensors"))
KINDS = ("f32", "bf16")


def load(arch):
    return load_file(str(HERE / arch / "generation.safetensors"))


def layers(refs, kind):
    return sorted({int(k.split(".")[1]) for k in refs if k.startswith(kind + ".") and
                   k.split(".")[1].isdigit()})


def steps(refs, kind):
    """[(step, rows)] in generation order: rows the slice of the step's tokens in the per-layer
    arrays (the prompt's at step 0, then one token each)."""
    ends = np.cumsum(refs[f"{kind}.rows"])
    return [(s, slice(int(e - n), int(e))) for s, (e, n) in enumerate(zip(ends, refs[f"{kind}.rows"]))]


def as_kind(x, kind):
    """Values as the model held them: float32, or bf16 (ml_dtypes) for the model in bf16."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16 if kind == "bf16" else np.float32)


def forward(client, refs, kind, layer, rows):
    """moed's output for one recorded MoE call, as float64."""
    key = f"{kind}.{layer}."
    y = client.forward(layer, as_kind(refs[key + "hidden"][rows], kind),
                       expert_ids=refs[key + "ids"][rows],
                       expert_weights=refs[key + "weights"][rows])
    return np.asarray(y).astype(np.float64)


class Head:
    """The model's final RMSNorm and LM head, from the checkpoint, computed as transformers does
    for a model in kind: bf16 rounds where the model's tensors are bf16 (the residual sum, the
    normalised hidden, its product with the norm's weight, the logits); float32 work is done in
    float64 here."""

    def __init__(self, arch, kind):
        folder = HERE / arch
        w = load_file(str(folder / "model.safetensors"))
        self.eps = json.loads((folder / "config.json").read_text())["rms_norm_eps"]
        self.norm = w["model.norm.weight"].astype(np.float64)
        self.lm_head = w["lm_head.weight"].astype(np.float64)
        self.kind = kind

    def round(self, x):
        return as_kind(x, self.kind).astype(np.float64) if self.kind == "bf16" else x

    def __call__(self, tail, out):
        """Logits [vocab] of the last position for residual tail and the last block's out [T, d]."""
        h = self.round(np.asarray(tail[-1], np.float64) + out[-1])
        h = self.round(h / np.sqrt(np.mean(h * h) + self.eps))
        h = self.round(self.norm * h)
        return self.round(self.lm_head @ h)


# The top logit's lead over the next that a step needs for its token to be decided by the
# computation rather than by the last rounding: in float32, 1e-3; in bf16, two rounding steps (ulps)
# at the top logit's magnitude. moed computes a block's bf16 output in float32 and rounds it once
# where transformers rounds each intermediate, so its output is a rounding step or so away from
# transformers' (hf_models' bounds); through the last layer that moves the top logit's lead by one
# ulp at most (the CPU backend, every step of the three generations; in float32 by 1e-6). At a
# smaller lead another correct computation may choose the other token, and a bf16 generation has
# one or two such steps in 32 on average: make_generation.py picks prompts whose generations have
# none.
MARGIN = {"f32": 1e-3, "bf16": 2.0}

# A CUDA backend multiplies in bf16 with sums in another order than transformers' kernels, and a
# generation feeds each step's small differences into the next (the KV cache): 32 steps on, a lead
# this small is decided by rounding. Measured on an H200: DeepSeek-V3's step 31 (bf16) leads by 14
# ulps, and transformers' own generation on the GPU picks the other token there too (16 ulps on
# the CPU). The CPU backend computes as transformers does and is held to MARGIN.
COMPOUNDED_MARGIN = 20.0


def leads(logits, kind):
    """Each step's top-logit lead over the next [steps], in MARGIN's units (bf16: ulps)."""
    s = -np.sort(-np.asarray(logits, dtype=np.float64), axis=-1)
    lead = s[..., 0] - s[..., 1]
    if kind == "bf16":
        lead = lead / 2.0 ** (np.floor(np.log2(np.maximum(np.abs(s[..., 0]), 1e-30))) - 7)
    return lead
