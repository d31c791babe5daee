"""Transports: how a hidden-state tensor reaches the server and how the output comes back.

A transport turns an Input (tensors.py) into the moed.v1.Tensor that carries it in the request,
and the reply's output Tensor back into an output of the input's kind. "inline" carries the bytes
in the message itself and works with any server. Transports over tensor regions that a same-host
client registers with the server (shared memory for host tensors, CUDA IPC for device tensors)
plug in here beside it: prepare() then names a region instead of carrying bytes, and asks for the
output to be written into one.

transport="auto" (the default) picks the best one the input and the server allow; today that is
always "inline".
"""

from __future__ import annotations

from typing import Any, Dict

from .tensors import Input, wire_tensor


class Prepared:
    """One call's hidden state, ready to send: `tensor` is the moed.v1.Tensor (a dict for
    wire.encode) that carries it; finish() makes the output from the reply's Tensor (already
    checked against the request). A region transport's Prepared also names where the output is
    to be written, and its finish() reads it from there."""

    __slots__ = ("input", "tensor")

    def __init__(self, inp: Input, tensor: Dict[str, Any]):
        self.input, self.tensor = inp, tensor

    def finish(self, reply_tensor: Dict[str, Any], copy: bool) -> Any:
        """The output from the reply's Tensor, whose dtype and shape are the input's (checked)."""
        return self.input.output(reply_tensor["data"], reply_tensor["shape"], copy)


class Transport:
    """The interface: name, and prepare(Input) -> Prepared."""

    name = ""

    def prepare(self, inp: Input) -> Prepared:
        raise NotImplementedError


class Inline(Transport):
    """Tensor bytes in the messages: the host bytes of the input (one device-to-host copy for a CUDA
    tensor), written into the request once; the output read in place from the reply."""

    name = "inline"

    def prepare(self, inp: Input) -> Prepared:
        return Prepared(inp, wire_tensor(inp.host(), inp.wire))


TRANSPORTS: Dict[str, Transport] = {"inline": Inline()}


def choose(name: str, inp: Input) -> Transport:
    """The transport for one call of input `inp`: `name` is a key of TRANSPORTS, or "auto" for the
    best one for inp (inline, until region transports exist); ValueError if unknown."""
    if name == "auto":
        return TRANSPORTS["inline"]
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}: use auto or {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name]

