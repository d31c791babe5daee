"""Greedy generation by transformers' own causal-LM models with each sparse MoE block served by moed.

    model = harness.load(folder, "bf16")
    with harness.served(model, harness.MoedCall(client)):
        tokens, logits = harness.generate(model, prompt)

What an engine does with moed: each MoE block's router runs in transformers (the block's gate, the
model's own code) and the experts (DeepSeek-V3's shared expert with them) are one call to a moed
serving the same checkpoint (moed --model FOLDER), given the router's topk_ids and topk_weights.
Every MoE call goes through MoedCall.__call__: via="client" the Python client's forward (torch
tensors in and out, CPU or CUDA), via="op" the torch op torch.ops.moed.forward(hidden, topk_ids,
topk_weights, layer, client), client then the op's integer handle (op_client()).

generate() is transformers' own generate(); generate_static() the same greedy decoding written out
over transformers' StaticCache, one decode step of fixed shapes that graph=True captures in one
CUDA graph and replays for every token (the MoE call inside it must then be the op).

record() captures what transformers' own MoE blocks receive and return during its own generation
(make_generation.py writes it into the references CI replays). Needs torch and transformers.
"""

import contextlib
import importlib
import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM, StaticCache

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from hf_models.make_hf_checkpoints import DTYPES, moe_blocks  # noqa: E402

NEW_TOKENS = 32


def load(folder, kind, device="cpu"):
    """The checkpoint in folder as transformers loads it, in kind ("f32" or "bf16"), for inference."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[kind]).to(device).eval()


def route(block, x):
    """(topk_ids, topk_weights) of the block's own router for x [T, d_model], as transformers
    computes them (the gate of Mixtral, Qwen3-MoE and DeepSeek-V3 alike returns logits, weights,
    ids)."""
    _, topk_weights, topk_ids = block.gate(x)
    return topk_ids, topk_weights


def import_op():
    """Imports moed.torch_op, which registers torch.ops.moed.forward; None where it cannot be."""
    try:
        return importlib.import_module("moed.torch_op")
    except ImportError:
        return None


@contextlib.contextmanager
def op_client(address):
    """The op's client handle for the moed at address (a doorbell client: moed.RingClient)."""
    import moed

    with moed.RingClient(address) as ring:
        yield ring.handle


class MoedCall:
    """The MoE call: moed's experts for one layer with the router's routing; the output has
    hidden_states' dtype, device and shape. via="client": client is a moed.MoEClient (it converts
    the routing: int64 ids, float32 or bf16 weights); via="op": client is the op's handle
    (op_client())."""

    def __init__(self, client, via="client"):
        if via == "op" and import_op() is None:
            raise ImportError("via='op' needs torch.ops.moed (moed.torch_op)")
        if via not in ("client", "op"):
            raise ValueError(f"via must be 'client' or 'op', not {via!r}")
        self.client, self.via = client, via

    def __call__(self, hidden_states, topk_ids, topk_weights, layer):
        if self.via == "op":
            return torch.ops.moed.forward(hidden_states, topk_ids, topk_weights, layer, self.client)
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


def generate(model, prompt):
    """transformers' greedy generation of NEW_TOKENS tokens after prompt (token ids): (tokens
    [NEW_TOKENS] int64, logits [NEW_TOKENS, vocab] float32: each step's, before the argmax), on the
    CPU. No end-of-sequence token stops it (the checkpoints have none)."""
    ids = torch.tensor([list(prompt)], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].cpu()
    logits = torch.cat(out.logits).float().cpu()
    assert tokens.shape == (NEW_TOKENS,), f"generated {tokens.shape[0]} tokens, not {NEW_TOKENS}"
    return tokens, logits


def generate_static(model, prompt, graph=False):
    """generate()'s greedy decoding written out: the prompt in one forward, then each token by one
    decode step over a StaticCache of fixed length, fed from two fixed tensors (the last token and
    its position); same return. graph=True (model on a GPU) captures the decode step once in a CUDA
    graph, after one eager run of it (allocations, the cache's first use), and replays the graph
    for every token; the eager run computes the same step, so it writes the same cache entries."""
    dev, n = model.device, len(prompt)
    cache = StaticCache(config=model.config, max_cache_len=n + NEW_TOKENS)
    token = torch.zeros((1, 1), dtype=torch.long, device=dev)
    position = torch.zeros(1, dtype=torch.long, device=dev)

    def step():
        return model(input_ids=token, past_key_values=cache, cache_position=position,
                     use_cache=True).logits[0, -1]

    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([list(prompt)], device=dev), past_key_values=cache,
                        cache_position=torch.arange(n, device=dev), use_cache=True).logits[0, -1]]
        decode = step
        if graph:
            token.copy_(logits[0].argmax().view(1, 1))
            position.fill_(n)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                out = step()

            def decode():
                captured.replay()
                return out
        for i in range(1, NEW_TOKENS):
            token.copy_(logits[-1].argmax().view(1, 1))
            position.fill_(n + i - 1)
            logits.append(decode().clone())
    logits = torch.stack(logits).float().cpu()
    return logits.argmax(-1), logits


def record(model, prompt):
    """transformers' own generation with every MoE call captured: (tokens, logits, calls, tail).
    calls: per MoE call in order (each step, each MoE layer), dict layer, step, hidden [T, d],
    topk_ids [T, k], topk_weights [T, k], out [T, d] (the block's output), in the model's dtype.
    tail: per step, the last MoE layer's residual stream [T, d] (what the block's output is added
    to before the final norm and the LM head)."""
    blocks = moe_blocks(model)
    last = max(blocks)
    assert last == len(model.model.layers) - 1, "tail is the last layer's: its block must be MoE"
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
