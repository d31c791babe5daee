"""torch.ops.moed.forward: moed's layer as a torch custom op, for inference engines (docs/engines.md).

    import moed, moed.torch_op                      # importing this module registers the ops
    rc = moed.RingClient("127.0.0.1:50051")
    y = torch.ops.moed.forward(hidden, topk_ids, topk_weights, layer, rc.handle)
    torch.ops.moed.forward_out(hidden, topk_ids, topk_weights, layer, rc.handle, out)

The schemas, with vLLM's argument names:

    moed::forward(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int layer, int client) -> Tensor
    moed::forward_out(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int layer, int client,
                      Tensor(a!) out) -> ()

`client` is RingClient.handle, an integer naming an open client (an op takes no Python objects).
Both run RingClient.forward: CUDA tensors are one stream-ordered doorbell call on the current
stream, which a torch.cuda.graph captures; CPU tensors are a host call (refused while a stream
captures). Their fake implementations give the output's shape, dtype and device without a call,
so torch.compile(fullgraph=True) traces them as leaves, and vLLM's piecewise CUDA graphs can split
at "moed::forward" (splitting_ops).
"""

from __future__ import annotations

import torch

from .ring import client_of

_lib = torch.library.Library("moed", "DEF")
_lib.define("forward(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int layer, int client) -> Tensor")
_lib.define("forward_out(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int layer, int client, "
            "Tensor(a!) out) -> ()")


def _forward(hidden, topk_ids, topk_weights, layer, client):
    return client_of(client).forward(layer, hidden, topk_ids, topk_weights)


def _forward_out(hidden, topk_ids, topk_weights, layer, client, out):
    client_of(client).forward(layer, hidden, topk_ids, topk_weights, out=out)


for _key in ("CPU", "CUDA"):
    _lib.impl("forward", _forward, _key)
    _lib.impl("forward_out", _forward_out, _key)


@torch.library.register_fake("moed::forward", lib=_lib)
def _forward_fake(hidden, topk_ids, topk_weights, layer, client):
    return hidden.new_empty(hidden.shape)


@torch.library.register_fake("moed::forward_out", lib=_lib)
def _forward_out_fake(hidden, topk_ids, topk_weights, layer, client, out):
    return None
