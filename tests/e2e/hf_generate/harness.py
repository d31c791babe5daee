"""Greedy generation by transformers' own causal-LM models with each sparse MoE block served by moed.

    model = harness.load(folder, "bf16")
    with harness.served(model, harness.MoedCall(client)):
        tokens, logits = harness.generate(model, prompt)

What an engine does with moed: each MoE block's router runs in transformers (the block's gate, the
model's own code) and the experts (DeepSeek-V3's shared expert with them) are one call to a moed
serving the same checkpoint (moed --model FOLDER), given the router's topk_ids and topk_weights.
Every MoE call of the generation goes through MoedCall.__call__; the line in it that calls moed is
the one to change for the torch op (torch.ops.moed.forward).

CUDA graphs: generate(..., cache="static") decodes over transformers' StaticCache, the fixed shapes
a captured decode step needs; with the model on a GPU, transformers compiles each decode step and
captures it in a CUDA graph when compile_config allows (CompileConfig(fullgraph=True) once the MoE
call is the torch op, a leaf the graph can hold; until then the call is Python and compiling is
off: COMPILE_OFF).

record() captures what transformers' own MoE blocks receive and return during its own generation
(make_generation.py writes it into the references CI replays); needs torch and transformers.
"""

import contextlib
import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from hf_models.make_hf_checkpoints import DTYPES, moe_blocks  # noqa: E402

NEW_TOKENS = 32
# transformers compiles a decode step over a StaticCache on a GPU unless told not to; the Python
# client cannot be compiled into a graph (the torch op can: pass a CompileConfig then).
COMPILE_OFF = {"disable_compile": True}


def load(folder, kind, device="cpu"):
    """The checkpoint in folder as transformers loads it, in kind ("f32" or "bf16"), for inference."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[kind]).to(device).eval()


def route(block, x):
    """(topk_ids, topk_weights) of the block's own router for x [T, d_model], as transformers
    computes them (the gate of Mixtral, Qwen3-MoE and DeepSeek-V3 alike returns logits, weights,
    ids)."""
    _, topk_weights, topk_ids = block.gate(x)
    return topk_ids, topk_weights


class MoedCall:
    """The MoE call: a moed client's forward of one layer with the router's routing; the output
    has hidden_states' dtype, device and shape (the client converts the routing: int64 ids,
    float32 or bf16 weights)."""

    def __init__(self, client):
        self.client = client

    def __call__(self, hidden_states, topk_ids, topk_weights, layer):
        return self.client.forward(layer, hidden_states, expert_ids=topk_ids, expert_weights=topk_weights)


@contextlib.contextmanager
def served(model, call):
    """Within: each sparse MoE block of model computes call(hidden [T, d], topk_ids, topk_weights,
    layer) after its own router, instead of its experts."""
    blocks = moe_blocks(model)
    for layer, block in blocks.items():
        def forward(hidden_states, block=block, layer=layer):
            x = hidden_states.reshape(-1, hidden_states.shape[-1])
            topk_ids, topk_weights = route(block, x)
            return call(x, topk_ids, topk_weights, layer).reshape(hidden_states.shape)

        block.forward = forward  # the instance's attribute shadows the class's method
    try:
        yield
    finally:
        for block in blocks.values():
            del block.forward


def generate(model, prompt, cache="dynamic", **options):
    """transformers' greedy generation of NEW_TOKENS tokens after prompt (token ids): (tokens
    [NEW_TOKENS] int64, logits [NEW_TOKENS, vocab] float32: each step's, before the argmax), on the
    CPU. cache: "dynamic" (transformers' default) or "static" (a StaticCache; COMPILE_OFF unless
    options say otherwise). No end-of-sequence token stops it (the checkpoints have none)."""
    if cache == "static":
        options = {"cache_implementation": "static", **COMPILE_OFF, **options}
    ids = torch.tensor([list(prompt)], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **options)
    tokens = out.sequences[0, len(prompt):].cpu()
    logits = torch.cat(out.logits).float().cpu()
    assert tokens.shape == (NEW_TOKENS,), f"generated {tokens.shape[0]} tokens, not {NEW_TOKENS}"
    return tokens, logits


def record(model, prompt):
    """transformers' own generation with every MoE call captured: (tokens, logits, calls, tail).
    calls: per MoE call in order (each step, each MoE layer), dict layer, step, hidden [T, d],
    topk_ids [T, k], topk_weights [T, k], out [T, d] (the block's output), in the model's dtype.
    tail: per step, the last MoE layer's residual stream [T, d] (what the block's output is added
    to before the final norm and the LM head)."""
    blocks = moe_blocks(model)
    last = max(blocks)
    calls, tail, step = [], [], [0]

    def block_hook(block, layer):
        def hook(_module, args, out):
            x = args[0].reshape(-1, args[0].shape[-1])
            topk_ids, topk_weights = route(block, x)
            calls.append(dict(layer=layer, step=step[0], hidden=x.clone(), topk_ids=topk_ids,
                              topk_weights=topk_weights, out=out.reshape(x.shape).clone()))
            if layer == last:
                step[0] += 1
        return hook

    def residual_hook(_module, args):
        tail.append(args[0].reshape(-1, args[0].shape[-1]).clone())

    handles = [b.register_forward_hook(block_hook(b, i)) for i, b in blocks.items()]
    handles.append(model.model.layers[last].post_attention_layernorm.register_forward_pre_hook(residual_hook))
    try:
        tokens, logits = generate(model, prompt)
    finally:
        for h in handles:
            h.remove()
    return tokens, logits, calls, tail
