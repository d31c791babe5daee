"""Links: Forwards whose tensors move over NCCL, GPU to GPU (libmoedclient's moedc_links through
ctypes; moedclient.h states what a link does, docs/fleets.md "Over NCCL" why).

    links = moed.links.open_links(["h1:50051", "h2:50051"], max_tokens=4096, max_top_k=8)
    if links:                                   # None: logged why, use gRPC (moed.connect)
        y = links.forward(0, hidden, topk_ids, topk_weights)   # torch CUDA tensors

The call is ordered on torch.cuda.current_stream() (the work queued before it is done first) and
blocks until the output is written; the output is bit for bit the gRPC fleet's for the same
daemons. hidden is f32, f16 or bf16 [T, d_model] on the links' device; topk_ids and topk_weights
[T, k] are cast to int32 and float32 on the stream when they are not already. out= (may be hidden
itself) is written in place, else a new tensor is returned. A failed call raises MoEError with its
status (UNAVAILABLE naming the daemons that did not answer) and never writes the output.

send= chooses which tokens a fleet's call sends each shard: "chosen", only those with an expert it
holds (the call reads the choices to the host first, waiting for the stream to reach it); "all",
every token, nothing read on the host (the same bits); "auto" (the default), "all" where "chosen"
would save few bytes (moedclient.h, moedc_links_opts.send).

Captured: a call made while torch captures a CUDA graph (torch.cuda.graph) is recorded, and each
replay makes it again with the tensors' contents at that time (every shard gets every token; the
bits are the same). A replay that fails writes no output and is counted in failures(); a watchdog
aborts the links of a daemon that is gone, so replays never hang. Destroy the graphs before
close(). moedclient.h (moedc_links_forward) has the rules.

Which transport is used is logged on the "moed.links" logger: "links: nccl 2.27.3: 2 links
(daemons ...)", or why links are not used and calls go over gRPC.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Optional, Sequence, Union

from . import _clib as L
from .types import MoEError

log = logging.getLogger("moed.links")

_DTYPES = {"torch.float32": 1, "torch.float16": 2, "torch.bfloat16": 3}  # MOEDC_F32, F16, BF16


def _targets(target: Union[str, Sequence[str]]) -> list:
    if isinstance(target, str):
        return [target]
    return [str(t) for t in target]


# moedc_links_opts.send, in the order of its values: which tokens a fleet's call sends each shard
_SENDS = ("auto", "chosen", "all")


class Links:
    """Links to the daemons `target` names (one, a list, or a dns: name of several): see the module.
    Raises MoEError when links cannot be used (no NCCL, no GPU, a daemon that refuses them)."""

    def __init__(self, target: Union[str, Sequence[str]] = "127.0.0.1:50051", *, device: Optional[int] = None,
                 max_tokens: int = 4096, max_top_k: int = 8, timeout: float = 30.0,
                 token: Optional[str] = None, send: str = "auto"):
        if send not in _SENDS:
            raise MoEError("INVALID_ARGUMENT", f"send={send!r}: use one of {', '.join(_SENDS)}")
        self._lib = L.load()
        self._lock = threading.Lock()
        self._c = ctypes.c_void_p()
        self._l = ctypes.c_void_p()
        if device is None:
            import torch
            device = torch.cuda.current_device()
        self.device = int(device)
        names = _targets(target)
        arr = (ctypes.c_char_p * len(names))(*[n.encode() for n in names])
        opts = L.Opts(timeout_s=0.0, bearer_token=token.encode() if token else None)
        err = L.Error()
        L.check(self._lib.moedc_connect_many(arr, len(names), ctypes.byref(opts), ctypes.byref(self._c),
                                             ctypes.byref(err)), err)
        o = L.LinksOpts(device=self.device, max_tokens=int(max_tokens), max_top_k=int(max_top_k),
                        timeout_s=float(timeout), send=_SENDS.index(send))
        rc = self._lib.moedc_links_open(self._c, ctypes.byref(o), ctypes.byref(self._l), ctypes.byref(err))
        if rc < 0:
            self._lib.moedc_close(self._c)
            self._c = ctypes.c_void_p()
            L.check(rc, err)

    def describe(self) -> str:
        """The C library's line: "nccl 2.27.3: 2 links (daemons a, b)"."""
        return self._lib.moedc_links_describe(self._l).decode(errors="replace")

    def forward(self, layer: int, hidden: Any, expert_ids: Any, expert_weights: Any, out: Any = None) -> Any:
        """The layer's output for hidden [T, d_model] (a torch CUDA tensor) routed by the caller's
        expert choices, on the current stream: out when given, else a new tensor like hidden."""
        import torch
        if not self._l:
            raise MoEError("FAILED_PRECONDITION", "these links are closed")
        dtype = _DTYPES.get(str(hidden.dtype))
        if not hidden.is_cuda or dtype is None or hidden.dim() != 2:
            raise MoEError("INVALID_ARGUMENT", f"hidden must be a 2-D float32, float16 or bfloat16 CUDA "
                                               f"tensor (got {hidden.dtype}, {tuple(hidden.shape)} on "
                                               f"{hidden.device})")
        if hidden.device.index != self.device:
            raise MoEError("INVALID_ARGUMENT", f"hidden is on cuda:{hidden.device.index}; these links "
                                               f"were opened for cuda:{self.device}")
        T, d = hidden.shape
        hidden = hidden.contiguous()
        ids = expert_ids.to(device=hidden.device, dtype=torch.int32).contiguous()
        w = expert_weights.to(device=hidden.device, dtype=torch.float32).contiguous()
        if ids.dim() != 2 or ids.shape[0] != T or tuple(w.shape) != tuple(ids.shape):
            raise MoEError("INVALID_ARGUMENT", f"expert_ids and expert_weights must both be [T, k] with "
                                               f"T = {T} (got {tuple(ids.shape)}, {tuple(w.shape)})")
        if out is None:
            out = torch.empty_like(hidden)
        elif out.dtype != hidden.dtype or tuple(out.shape) != (T, d) or not out.is_contiguous() \
                or out.device != hidden.device:
            raise MoEError("INVALID_ARGUMENT", "out must be a contiguous tensor of hidden's shape, dtype "
                                               "and device")
        call = L.LinkCall(layer=int(layer), dtype=dtype, tokens=T, d_model=d, k=ids.shape[1],
                          hidden=hidden.data_ptr(), expert_ids=ids.data_ptr(), expert_weights=w.data_ptr(),
                          output=out.data_ptr(), stream=torch.cuda.current_stream(hidden.device).cuda_stream)
        err = L.Error()
        with self._lock:
            L.check(self._lib.moedc_links_forward(self._l, ctypes.byref(call), None, ctypes.byref(err)), err)
        return out

    def failures(self) -> int:
        """Calls whose output was not written, captured replays included, since the links opened
        (synchronise the stream that ran them first)."""
        if not self._l:
            raise MoEError("FAILED_PRECONDITION", "these links are closed")
        n = ctypes.c_uint64()
        err = L.Error()
        with self._lock:
            L.check(self._lib.moedc_links_failures(self._l, ctypes.byref(n), ctypes.byref(err)), err)
        return int(n.value)

    def close(self) -> None:
        with self._lock:
            if self._l:
                self._lib.moedc_links_close(self._l)
                self._l = ctypes.c_void_p()
            if self._c:
                self._lib.moedc_close(self._c)
                self._c = ctypes.c_void_p()

    def __enter__(self) -> "Links":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass


def open_links(target: Union[str, Sequence[str]] = "127.0.0.1:50051", **kwargs: Any) -> Optional[Links]:
    """Links to target (keyword arguments as Links'), or None when links cannot be used; either way
    the transport is logged: "links: nccl ..." or "links: not used (why); calls go over gRPC"."""
    try:
        links = Links(target, **kwargs)
    except (MoEError, ImportError, RuntimeError) as e:
        log.info("links: not used (%s); calls go over gRPC", e)
        return None
    log.info("links: %s", links.describe())
    return links
