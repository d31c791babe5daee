"""Transports: how a hidden-state tensor reaches the server and how the output comes back.

  inline  the bytes in the messages: written once into the request, the output read in place from
          the reply (a CUDA tensor is copied to the host and back). Works with any server.
  shm     host tensors through the client's shared-memory arena: hidden copied in once, the
          output written there by the server and returned as a view of it (a CUDA tensor is
          copied to the host and back). Needs the server on this host.
  cuda    CUDA torch tensors through the client's device arena (one device copy in, one out), or
          straight from and into tensors the caller registered (MoEClient.register): no copy.
          Needs the server on this host and on the cuda backend (the cpu backend answers
          FAILED_PRECONDITION).
  auto    (the default) cuda for a CUDA tensor when the server takes CUDA regions, shm for one of
          at least SHM_MIN_BYTES when the server is on this host and takes regions, inline
          otherwise; a region that cannot be had (the server draining or refusing it, regions off,
          no shared memory) makes the call go inline, logged (logger "moed.transport": a warning,
          only info for --regions off) when auto starts going inline and when it stops, not for
          every call. Below SHM_MIN_BYTES a message costs about what the copy into shared
          memory does, and a client that only sends small tensors (a probe, a CLI, a test) never
          pays for a session (a GetModel, a stream on a connection of its own, a registration).

"On this host" is decided from the target alone (moed.regions.local_target: a unix: socket or a
loopback address); shm and cuda with another target are refused by the client. Arenas, slots and
how long an output stays valid: moed.regions.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Dict, Optional

from .regions import LIMITS, Regions, Slot, Steps, remote_message
from .tensors import Input, wire_tensor
from .types import InvalidArgument, MoEError

NAMES = ("auto", "inline", "shm", "cuda")
SHM_MIN_BYTES = 64 << 10  # auto's least hidden for shared memory (mixtral's d 4096 in bf16: T = 8)
log = logging.getLogger(__name__)


class Prepared:
    """One call's hidden state, ready to send: `tensor` is the moed.v1.Tensor (a dict for
    wire.encode) that carries it, `output` the RegionRef the output is to be written to (None:
    in the reply). finish() makes the output from the reply's Tensor (already checked against the
    request); failed() is told when the call failed instead."""

    __slots__ = ("input", "tensor", "output", "out")
    transport = "inline"

    def __init__(self, inp: Input, tensor: Dict[str, Any], output: Optional[Dict[str, int]] = None,
                 out: Any = None):
        self.input, self.tensor, self.output, self.out = inp, tensor, output, out

    def finish(self, reply_tensor: Dict[str, Any], copy: bool) -> Any:
        return self.input.output(reply_tensor["data"], reply_tensor["shape"], copy, self.out)

    def failed(self, code_name: str) -> None:
        pass

    def _check_ref(self, reply_tensor: Dict[str, Any]) -> None:
        if reply_tensor["contents"] != "region" or reply_tensor["region"] != self.output:
            raise MoEError("INTERNAL", "the server's reply does not name the region the request "
                                       "asked the output to be written to")


class HostPrepared(Prepared):
    """hidden in a slot of the shared-memory arena, the output written over it."""

    __slots__ = ("slot",)
    transport = "shm"

    def __init__(self, inp: Input, slot: Slot, out: Any):
        ref = slot.ref()
        super().__init__(inp, {"dtype": inp.wire, "shape": inp.shape, "region": ref}, ref, out)
        self.slot = slot

    def finish(self, reply_tensor: Dict[str, Any], copy: bool) -> Any:
        self._check_ref(reply_tensor)
        lent = self.slot.lent(self.input.writable_views)
        return self.input.output(lent, reply_tensor["shape"], copy, self.out)

    def failed(self, code_name: str) -> None:
        self.slot.failed(code_name)


class DevicePrepared(Prepared):
    """hidden and the output in device memory: the caller's registered tensors, or a slot of the
    device arena (hidden copied in and the output written over it, or the output's alone when
    hidden is registered, or hidden's alone when out is)."""

    __slots__ = ("slot", "in_out")
    transport = "cuda"

    def __init__(self, inp: Input, ref: Dict[str, int], output: Dict[str, int], slot: Optional[Slot],
                 out: Any):
        super().__init__(inp, {"dtype": inp.wire, "shape": inp.shape, "region": ref}, output, out)
        self.slot = slot
        self.in_out = slot is not None and output == slot.ref()  # the output lands in the slot

    def finish(self, reply_tensor: Dict[str, Any], copy: bool) -> Any:
        self._check_ref(reply_tensor)
        if not self.in_out:  # written into the caller's registered out; hidden's slot is free
            if self.slot is not None:
                self.slot.give()
            return self.out
        torch, x = sys.modules["torch"], self.input.obj
        view = self.slot.chunk.bytes_at(self.slot.off, self.slot.n).view(x.dtype).view(x.shape)
        y = self.out if self.out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        y.copy_(view)
        torch.cuda.current_stream(x.device).synchronize()  # the copy is done: the slot is free
        self.slot.give()
        return y

    def failed(self, code_name: str) -> None:
        if self.slot is not None:
            self.slot.failed(code_name)


def known(name: str) -> str:
    """name, checked to be one of NAMES (InvalidArgument otherwise)."""
    if name not in NAMES:
        raise InvalidArgument(f"unknown transport {name!r}: use {', '.join(NAMES)}")
    return name


def inline(inp: Input, out: Any) -> Prepared:
    return Prepared(inp, wire_tensor(inp.host(), inp.wire), None, out)


def shm(inp: Input, regions: Regions, out: Any) -> Steps:
    slot = yield from regions.host.slot(inp.nbytes)
    try:
        inp.write(slot.chunk.bytes_at(slot.off, slot.n, True))
    except BaseException:
        slot.give()
        raise
    return HostPrepared(inp, slot, out)


def cuda(inp: Input, regions: Regions, out: Any) -> Steps:
    if not inp.cuda:
        raise InvalidArgument("transport='cuda' takes torch CUDA tensors: hidden is on the host (use shm)")
    torch, x = sys.modules["torch"], inp.obj.detach()
    ref = yield from regions.registered(x)
    out_ref = None if out is None else (yield from regions.registered(out))
    slot = None
    if ref is None or out_ref is None:
        slot = yield from regions.device(x.device.index).slot(inp.nbytes)
    try:
        if ref is None:
            slot.chunk.bytes_at(slot.off, slot.n).view(x.dtype).view(x.shape).copy_(x)
            ref = slot.ref()
        # The server reads hidden (and writes out) from another process: whatever the caller's
        # stream still has queued on them must be done before the request goes.
        torch.cuda.current_stream(x.device).synchronize()
    except BaseException:
        if slot is not None:
            slot.give()
        raise
    return DevicePrepared(inp, ref, out_ref or slot.ref(), slot, out)


def prepare(name: str, inp: Input, regions: Regions, out: Any = None) -> Steps:
    """Steps (moed.regions) that return the Prepared of input `inp` on transport `name` (one of
    NAMES); InvalidArgument for a transport that cannot carry it, another MoEError for one that
    cannot be had (the server refuses it, or no shared memory)."""
    known(name)
    if out is not None:
        inp.check_out(out)
    if name == "inline" or (name == "auto" and (not regions.local or
                                                (not inp.cuda and inp.nbytes < SHM_MIN_BYTES))):
        return inline(inp, out)
    if not regions.local:
        raise InvalidArgument(remote_message(f"transport={name!r}", regions.target))
    if name != "auto":
        return (yield from (cuda if name == "cuda" else shm)(inp, regions, out))
    try:
        limits = yield LIMITS
        if limits.mode == "off":
            return fallback(regions, inp, out, "the server takes no regions (--regions off)", logging.INFO)
        if inp.cuda and limits.cuda:
            prepared = yield from cuda(inp, regions, out)
        elif inp.nbytes < SHM_MIN_BYTES:
            return inline(inp, out)
        else:
            prepared = yield from shm(inp, regions, out)
    except InvalidArgument:  # the caller's to mend, not a region that cannot be had
        raise
    except MoEError as e:  # no session, no region, or no shared memory to be had
        return fallback(regions, inp, out, str(e), logging.WARNING)
    if regions.inline_why is not None:
        regions.inline_why = None
        log.info("transport='auto' on %s: regions work again", regions.target)
    return prepared


def fallback(regions: Regions, inp: Input, out: Any, why: str, level: int) -> Prepared:
    """auto sends this call inline for reason `why`, logged at `level` unless the call before went
    inline too (Regions.inline_why: set until a region works again)."""
    if regions.inline_why is None:
        log.log(level, "transport='auto' on %s sends hidden inline until regions work again: %s",
                regions.target, why)
    regions.inline_why = why
    return inline(inp, out)
