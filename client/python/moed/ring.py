"""RingClient: Forward calls through moed's doorbell (docs/doorbell.md), from Python at the C
client's cost: libmoedclient's rings through ctypes (moed._clib), no grpcio on a call's path, the
GIL released while a call is waited for.

    rc = moed.RingClient("127.0.0.1:50051")       # a daemon on this host
    y = rc.forward(0, x, topk_ids, topk_weights)  # numpy, torch CPU or torch CUDA tensors
    h = rc.forward_async(0, x2, ids2, w2)         # another micro-batch meanwhile ...
    y2 = h.wait()

A client of its own rather than a transport of MoEClient: a doorbell call takes the caller's
expert choices only, every tensor lives in a registered region, and a CUDA call is ordered on the
caller's stream with no host sync, so nothing of MoEClient's request path (messages, arenas,
retries, fleets) applies; RingClient keeps one libmoedclient connection, one region session and
its rings, and answers forward, forward_async and the torch op (moed.torch_op).

Host tensors (numpy arrays, torch CPU tensors): each call's tensors are copied into a host region
of the client's (a buffer per call in flight, reused), rung with moedc_ring_start and waited for
with moedc_ring_wait; the output is copied out into an array of the caller's (or out=). Tensors
that already lie in a region the client made (host_array()) are named where they lie, no copy.

CUDA tensors (torch): hidden, the routing and the output are named where they lie: the caching
allocator's segment holding each is registered once as a CUDA region (found with the driver's
cuPointerGetAttributes, cached by its range and buffer id, registered again when the segment is
new, e.g. after torch.cuda.empty_cache()); topk_ids and topk_weights are cast to int32 and float32
on the caller's current stream when they are not already; then ONE moedc_ring_enqueue on
torch.cuda.current_stream(): the call is rung when the stream's earlier work is done, and later
work sees the output. No host sync, no copy by moed. A call on a capturing stream is captured
(each replay makes it again); its slot, in a ring of captured calls, stays the call's until
release_captured(), which the caller makes once the graphs that captured calls are destroyed.
A failure of a stream call is not known when the call returns: the next call on the client (or
check()) raises it, and a graph's replays are checked with check() after synchronising.

Threads: any number may call one client at once. Fork: a client belongs to the process that
opened it; in a forked child its calls raise FAILED_PRECONDITION (open a new client there).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import sys
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from . import _clib as L
from . import _cuda
from .tensors import F32, I32, WIRE_NP, hidden_input, host_array, is_torch
from .types import InvalidArgument, MoEError, Timings

_ALIGN = 256  # every tensor of a buffer starts at a multiple of this
_MIN_BUFFER = 1 << 16

_clients: Dict[int, "RingClient"] = {}  # handle -> client, for the torch op
_handles = itertools.count(1)
_open: "weakref.WeakSet[RingClient]" = weakref.WeakSet()


def client_of(handle: int) -> "RingClient":
    """The open RingClient whose .handle is `handle` (what the torch op's `client` argument is)."""
    c = _clients.get(int(handle))
    if c is None:
        raise MoEError("INVALID_ARGUMENT", f"no open RingClient has handle {handle}: pass "
                                           f"RingClient.handle of a client that is still open")
    return c


def _after_fork() -> None:
    for c in list(_open):
        c._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Buffer:
    """A host region of the client's: one call's tensors, carved at _ALIGN offsets."""

    __slots__ = ("region", "bytes", "mem")

    def __init__(self, region: Any):
        self.region = region
        self.bytes = region.contents.bytes
        self.mem = np.ctypeslib.as_array(ctypes.cast(region.contents.ptr, ctypes.POINTER(ctypes.c_uint8)),
                                         (self.bytes,))


class _Segment:
    __slots__ = ("base", "size", "buffer_id", "region")

    def __init__(self, base: int, size: int, buffer_id: int, region: Any):
        self.base, self.size, self.buffer_id, self.region = base, size, buffer_id, region


class ForwardHandle:
    """A call in flight (RingClient.forward_async): wait() returns its output, done() says whether
    it completed. Wait for each handle from one thread at a time; a host call's slot and buffer are
    its own until it is waited for (close() waits for those still in flight)."""

    def __init__(self, client: "RingClient", ticket: Any = None, finish: Any = None, event: Any = None,
                 output: Any = None):
        self._client, self._ticket, self._finish = client, ticket, finish
        self._event, self._output = event, output
        self.timings: Optional[Timings] = None
        self._result: Any = None
        self._over = False

    def done(self) -> bool:
        """Whether the call completed (a CUDA call: whether its stream passed it)."""
        if self._over:
            return True
        if self._event is not None:
            return bool(self._event.query())
        return self._wait_host(0.0)

    def wait(self, timeout: Optional[float] = None) -> Any:
        """The output once the call completed; MoEError with the call's status if it failed, or
        DEADLINE_EXCEEDED when `timeout` seconds passed first (the call is still in flight: wait
        again). A CUDA call's wait synchronises with the event recorded after it."""
        if not self._over:
            if self._event is not None:
                self._wait_event(timeout)
            elif not self._wait_host(-1.0 if timeout is None else max(0.0, float(timeout))):
                raise MoEError("DEADLINE_EXCEEDED", f"the call did not complete within {timeout} s; it is "
                                                    f"still in flight: wait again")
        if isinstance(self._result, MoEError):
            raise self._result
        return self._result

    def _wait_host(self, timeout: float) -> bool:
        res, err = L.RingResult(), L.Error()
        c = self._client
        rc = c._lib.moedc_ring_wait(c._ring, ctypes.byref(self._ticket), timeout, ctypes.byref(res),
                                    ctypes.byref(err))
        if rc == 0:
            return False
        self._over = True
        with c._lock:
            c._inflight.discard(self)
        if rc < 0:
            self._result = L.failure(rc, err.msg.decode(errors="replace"))
        else:
            self.timings = _timings(res.timings)
            self._result = (L.failure(res.status, res.message.decode(errors="replace")) if res.status
                            else None)
        self._result = self._finish(self._result)
        return True

    def _wait_event(self, timeout: Optional[float]) -> None:
        if timeout is None:
            self._event.synchronize()
        else:
            end = time.monotonic() + timeout
            while not self._event.query():
                if time.monotonic() >= end:
                    raise MoEError("DEADLINE_EXCEEDED", f"the stream did not pass the call within "
                                                        f"{timeout} s: wait again")
                time.sleep(5e-5)
        self._over = True
        self._client.check()
        self._result = self._output


def _timings(t: Any) -> Timings:
    return Timings(t.queue_us, t.compute_us, t.total_us, t.batch_tokens, t.batch_requests)


class RingClient:
    """Doorbell calls to the moed at `target` (on this host). token: its bearer token; timeout:
    the server's deadline of each call, seconds (None: none); slots: the calls one ring holds in
    flight (host and eager stream calls; a start with none free raises RESOURCE_EXHAUSTED);
    capture_slots: the ring of captured stream calls, opened at the first capture; tls_*: as
    moedc_opts (a TLS daemon's CA, client certificate and key, name). .handle names the client to
    the torch op."""

    def __init__(self, target: str = "127.0.0.1:50051", *, token: Optional[str] = None,
                 timeout: Optional[float] = None, slots: int = 64, capture_slots: int = 1024,
                 tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, tls_server_name: Optional[str] = None):
        self._lib = L.load()
        self.target, self.timeout = target, timeout
        self._slots, self._capture_slots = int(slots), int(capture_slots)
        self._lock = threading.Lock()
        self._buffers: List[_Buffer] = []  # free
        self._all_buffers: List[_Buffer] = []
        self._regions: List[Tuple[int, int, Any]] = []  # host_array()s: (base, end, region)
        self._segments: Dict[int, _Segment] = {}  # by base
        self._pending: List[Any] = []  # eager stream calls not yet seen past
        self._captured: List[Any] = []  # tickets of captured calls
        self._inflight: Set[ForwardHandle] = set()  # host calls not waited for yet
        self._failures_seen = 0
        self._forked = False
        self._conn = self._session = self._ring = self._capture_ring = None
        err = L.Error()
        enc = (lambda s: None if s is None else str(s).encode())
        opts = L.Opts(timeout_s=0.0, bearer_token=enc(token), tls=False, tls_ca=enc(tls_ca),
                      tls_cert=enc(tls_cert), tls_key=enc(tls_key), tls_server_name=enc(tls_server_name))
        conn, session, ring = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        L.check(self._lib.moedc_connect(str(target).encode(), ctypes.byref(opts), ctypes.byref(conn),
                                        ctypes.byref(err)), err)
        self._conn = conn
        try:
            L.check(self._lib.moedc_session_open(conn, ctypes.byref(session), ctypes.byref(err)), err)
            self._session = session
            with self._maybe_relaxed():
                L.check(self._lib.moedc_ring_open(session, self._slots, ctypes.byref(ring),
                                                  ctypes.byref(err)), err)
            self._ring = ring
        except BaseException:
            self.close()
            raise
        self.handle = next(_handles)
        _clients[self.handle] = self
        _open.add(self)

    # ---- lifetime ----

    def close(self) -> None:
        """Waits for the host calls in flight, then closes the rings and the session (the server
        releases every region of the client's). Synchronise the streams that made calls, and
        destroy the graphs that captured some, first."""
        _clients.pop(getattr(self, "handle", None), None)
        if self._forked:  # the parent's memory and threads: nothing here is ours to close
            self._conn = self._session = self._ring = self._capture_ring = None
            return
        for h in list(self._inflight):
            try:
                h.wait()
            except MoEError:
                pass
        self.release_captured()
        if self._session is not None:
            self._lib.moedc_session_close(self._session)  # closes its rings and frees its regions
        if self._conn is not None:
            self._lib.moedc_close(self._conn)
        self._conn = self._session = self._ring = self._capture_ring = None

    def __enter__(self) -> "RingClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _usable(self) -> None:
        if self._forked:
            raise MoEError("FAILED_PRECONDITION", "this RingClient was opened in the parent process "
                                                  "before a fork: open a new one in this process")
        if self._ring is None:
            raise MoEError("FAILED_PRECONDITION", "this RingClient is closed")

    # ---- host regions ----

    def host_array(self, nbytes: int) -> np.ndarray:
        """`nbytes` of a new host region of the client's, as a uint8 array: tensors made over it
        (numpy views, torch.from_numpy) are named where they lie by every call, no copy. It lives
        until the client closes."""
        self._usable()
        region = self._create_host(int(nbytes))
        buf = _Buffer(region)
        with self._lock:
            self._regions.append((region.contents.ptr, region.contents.ptr + buf.bytes, region))
        return buf.mem

    def _create_host(self, nbytes: int) -> Any:
        region, err = ctypes.POINTER(L.Region)(), L.Error()
        L.check(self._lib.moedc_region_create_host(self._session, nbytes, 0, ctypes.byref(region),
                                                   ctypes.byref(err)), err)
        return region

    def _take_buffer(self, nbytes: int) -> _Buffer:
        """A free buffer of at least nbytes, made when none is; as many as the ring has slots at
        most: with every one taken, every slot is, and the call is refused before it costs a region."""
        with self._lock:
            for i, b in enumerate(self._buffers):
                if b.bytes >= nbytes:
                    return self._buffers.pop(i)
            if len(self._all_buffers) - len(self._buffers) >= self._slots:
                raise _full("every buffer is a call's in flight")
            if len(self._all_buffers) >= self._slots:  # a free one too small: made anew, larger
                old = self._buffers.pop(0)
                self._all_buffers.remove(old)
                self._lib.moedc_region_free(old.region, ctypes.byref(L.Error()))
            self._all_buffers.append(None)  # its place, taken while the region is made
        try:
            b = _Buffer(self._create_host(max(_MIN_BUFFER, 1 << (nbytes - 1).bit_length())))
        finally:
            with self._lock:
                self._all_buffers.remove(None)
        with self._lock:
            self._all_buffers.append(b)
        return b

    def _give_buffer(self, b: _Buffer) -> None:
        with self._lock:
            self._buffers.append(b)

    # ---- calls ----

    def forward(self, layer: int, hidden: Any, topk_ids: Any = None, topk_weights: Any = None, *,
                expert_ids: Any = None, expert_weights: Any = None, out: Any = None) -> Any:
        """moed's layer `layer` on hidden [T, d_model] (f32, f16 or bf16) with the caller's expert
        choices topk_ids [T, k] (any integer type; -1 pads, with weight 0) and topk_weights [T, k]
        (any float type): [T, d_model] of hidden's dtype and kind (numpy, torch CPU, torch CUDA on
        hidden's device), or written into `out` and returned. expert_ids / expert_weights are
        other names of the two. A CUDA call returns once it is enqueued on the current stream."""
        ids, w = self._routing(topk_ids, topk_weights, expert_ids, expert_weights)
        if is_torch(hidden) and hidden.device.type == "cuda":
            return self._stream_call(int(layer), hidden, ids, w, out)
        return self._host_call(int(layer), hidden, ids, w, out).wait()

    def forward_async(self, layer: int, hidden: Any, topk_ids: Any = None, topk_weights: Any = None, *,
                      expert_ids: Any = None, expert_weights: Any = None, out: Any = None) -> ForwardHandle:
        """forward(), started: a ForwardHandle to wait() for. Host tensors: the call is rung now
        and computed while the caller goes on. CUDA tensors: enqueued on the current stream (as
        forward); the handle's wait synchronises with an event recorded on the stream after it."""
        ids, w = self._routing(topk_ids, topk_weights, expert_ids, expert_weights)
        if is_torch(hidden) and hidden.device.type == "cuda":
            torch = sys.modules["torch"]
            with torch.cuda.device(hidden.device):
                if torch.cuda.is_current_stream_capturing():
                    raise MoEError("FAILED_PRECONDITION", "forward_async cannot be captured (its handle "
                                                          "waits on the host): use forward while capturing")
                y = self._stream_call(int(layer), hidden, ids, w, out)
                event = torch.cuda.Event()
                event.record()
            return ForwardHandle(self, event=event, output=y)
        return self._host_call(int(layer), hidden, ids, w, out)

    def _routing(self, topk_ids: Any, topk_weights: Any, expert_ids: Any, expert_weights: Any) -> Tuple[Any, Any]:
        self._usable()
        ids = topk_ids if expert_ids is None else expert_ids
        w = topk_weights if expert_weights is None else expert_weights
        if ids is None or w is None:
            raise InvalidArgument("the doorbell takes the caller's expert choices: pass topk_ids and "
                                  "topk_weights ([T, k])")
        return ids, w

    def check(self) -> None:
        """Raises the failure of an earlier stream call (its status and message) if one failed
        since the last check: eager calls the stream passed, and captured calls' replays (by the
        ring's failure count; synchronise the stream first)."""
        self._usable()
        self._reap()
        if self._capture_ring is None:
            return
        n = self._lib.moedc_ring_failures(self._capture_ring)
        with self._lock:
            new, self._failures_seen = (n - self._failures_seen) & 0xFFFFFFFF, n
        if new:
            raise MoEError("UNKNOWN", f"{new} captured call(s) failed in the graphs' replays since the "
                                      f"last check (the server's log says why at --log-level debug)")

    def release_captured(self) -> int:
        """Frees the slots of every call captured so far (destroy the graphs that hold them, and
        let their launches finish, first); returns how many."""
        with self._lock:
            tickets, self._captured = self._captured, []
        err = L.Error()
        for t in tickets:
            self._lib.moedc_ring_release(self._capture_ring, ctypes.byref(t), ctypes.byref(err))
        return len(tickets)

    @property
    def captured(self) -> int:
        """How many captured calls hold a slot."""
        return len(self._captured)

    def _call(self, layer: int, wire: int, shape: Tuple[int, int], k: int) -> L.RingCall:
        return L.RingCall(layer=layer, dtype=wire, tokens=shape[0], d_model=shape[1], k=k,
                          timeout_s=-1.0 if self.timeout is None else float(self.timeout), tag=0)

    def _start(self, ring: Any, call: L.RingCall, stream: Any = None) -> Any:
        t, err = L.Ticket(), L.Error()
        if stream is None:
            rc = self._lib.moedc_ring_start(ring, ctypes.byref(call), ctypes.byref(t), ctypes.byref(err))
        else:
            rc = self._lib.moedc_ring_enqueue(ring, ctypes.byref(call), stream, ctypes.byref(t),
                                              ctypes.byref(err))
        if rc == L.EFULL:
            raise _full(err.msg.decode(errors="replace"))
        L.check(rc, err)
        return t

    # ---- host tensors ----

    def _host_call(self, layer: int, hidden: Any, ids: Any, w: Any, out: Any) -> ForwardHandle:
        _refuse_capture()
        inp = hidden_input(hidden)
        T, d = inp.shape
        ids_a = host_array(ids, I32, "topk_ids")
        w_a = host_array(w, F32, "topk_weights")
        if ids_a.ndim != 2 or ids_a.shape[0] != T or w_a.shape != ids_a.shape:
            raise InvalidArgument(f"topk_ids and topk_weights must both be [T, k] with hidden's T = {T}, "
                                  f"not {list(ids_a.shape)} and {list(w_a.shape)}")
        if out is not None:
            inp.check_out(out)
        k = ids_a.shape[1]
        call = self._call(layer, inp.wire, (T, d), k)
        x_bytes, r_bytes = inp.nbytes, T * k * 4
        # each tensor in place where it lies in a region of the client's, else in this call's buffer
        x_at = self._in_region(hidden, x_bytes, inp.wire)
        y_at = None if out is None else self._in_region(out, x_bytes, inp.wire)
        need = (0 if x_at else _up(x_bytes)) + 2 * _up(r_bytes) + (0 if y_at else _up(x_bytes))
        buf = self._take_buffer(need)
        try:
            at = 0
            if x_at is None:
                inp.write(buf.mem[:x_bytes])
                x_at, at = (buf.region, 0), _up(x_bytes)
            buf.mem[at:at + r_bytes].view(np.int32)[:] = ids_a.reshape(-1)
            buf.mem[at + _up(r_bytes):at + _up(r_bytes) + r_bytes].view(np.float32)[:] = w_a.reshape(-1)
            call.expert_ids = L.Ref(buf.region, at)
            call.expert_weights = L.Ref(buf.region, at + _up(r_bytes))
            at += 2 * _up(r_bytes)
            copy_out = y_at is None
            if copy_out:
                y_at = (buf.region, at)
            call.hidden, call.output = L.Ref(*x_at), L.Ref(*y_at)
            ticket = self._start(self._ring, call)
        except BaseException:
            self._give_buffer(buf)
            raise

        def finish(failed: Optional[MoEError]) -> Any:
            try:
                if failed is not None:
                    return failed
                return _copy_out(inp, buf.mem[at:at + x_bytes], out) if copy_out else out
            finally:
                self._give_buffer(buf)

        h = ForwardHandle(self, ticket=ticket, finish=finish)
        with self._lock:
            self._inflight.add(h)
        return h

    def _in_region(self, t: Any, nbytes: int, wire: int) -> Optional[Tuple[Any, int]]:
        """(region, offset) of a host tensor lying, as the wire lays it out, in a host_array() of
        the client's; None otherwise."""
        if not self._regions:
            return None
        if isinstance(t, np.ndarray):
            if not (t.flags.c_contiguous and t.dtype.itemsize == WIRE_NP[wire].itemsize
                    and t.dtype.byteorder in "=<|"):
                return None
            ptr = t.__array_interface__["data"][0]
        elif is_torch(t) and t.device.type == "cpu" and t.is_contiguous():
            ptr = t.data_ptr()
        else:
            return None
        for base, end, region in self._regions:
            if base <= ptr and ptr + nbytes <= end:
                return region, ptr - base
        return None

    # ---- CUDA tensors ----

    def _stream_call(self, layer: int, hidden: Any, ids: Any, w: Any, out: Any) -> Any:
        """Enqueues the call on hidden's device's current stream; returns the output tensor."""
        torch = sys.modules["torch"]
        inp = hidden_input(hidden)
        T, d = inp.shape
        dev = hidden.device
        for name, t in (("topk_ids", ids), ("topk_weights", w)):
            if not is_torch(t) or t.device != dev:
                raise InvalidArgument(f"{name} must be a torch tensor on hidden's device {dev}")
        if ids.dim() != 2 or ids.shape[0] != T or tuple(w.shape) != tuple(ids.shape):
            raise InvalidArgument(f"topk_ids and topk_weights must both be [T, k] with hidden's T = {T}, "
                                  f"not {list(ids.shape)} and {list(w.shape)}")
        if not T or not d or not ids.shape[1]:  # no memory to name (a null pointer)
            raise InvalidArgument(f"a call needs T, d_model and k of at least 1, not {T}, {d} and "
                                  f"{ids.shape[1]}")
        if out is not None:
            inp.check_out(out)
        self._reap()
        here = dev.index is None or dev.index == torch.cuda.current_device()
        with contextlib.nullcontext() if here else torch.cuda.device(dev):
            capturing = torch.cuda.is_current_stream_capturing()
            x = hidden if hidden.is_contiguous() else hidden.contiguous()
            ids = ids.to(torch.int32).contiguous()  # no-ops when they already are
            w = w.to(torch.float32).contiguous()
            y = torch.empty_like(x) if out is None else out
            call = self._call(layer, inp.wire, (T, d), ids.shape[1])
            with self._maybe_relaxed(capturing):
                call.hidden = self._segment_ref(x.data_ptr())
                call.expert_ids = self._segment_ref(ids.data_ptr())
                call.expert_weights = self._segment_ref(w.data_ptr())
                call.output = self._segment_ref(y.data_ptr())
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            if capturing:
                ticket = self._start(self._ring_for_capture(), call, stream)
            else:
                ticket = self._start_stream(call, stream)
        with self._lock:
            (self._captured if capturing else self._pending).append(ticket)
        return y

    def _start_stream(self, call: L.RingCall, stream: Any) -> Any:
        """An eager stream call; with every slot taken by calls the streams have not passed yet, it
        waits for the oldest to be passed (the streams run on without the host), then tries again."""
        while True:
            try:
                return self._start(self._ring, call, stream)
            except MoEError as e:
                if e.code_name != "RESOURCE_EXHAUSTED" or not self._pending:
                    raise
            with self._lock:
                oldest = self._pending[0] if self._pending else None
            if oldest is None:  # another thread reaped them meanwhile: slots are free again
                continue
            res, err = L.RingResult(), L.Error()
            end = time.monotonic() + 600  # a hang guard only: a stream passes its calls
            while self._lib.moedc_ring_stream_result(self._ring, ctypes.byref(oldest), ctypes.byref(res),
                                                     ctypes.byref(err)) == 0:
                if time.monotonic() > end:
                    raise MoEError("RESOURCE_EXHAUSTED", "every slot of the client's ring is taken by "
                                                         "stream calls that no stream passed in 600 s")
                time.sleep(2e-5)
            self._reap()

    def _ring_for_capture(self) -> Any:
        with self._lock:
            if self._capture_ring is None:
                ring, err = ctypes.c_void_p(), L.Error()
                with self._maybe_relaxed():
                    L.check(self._lib.moedc_ring_open(self._session, self._capture_slots,
                                                      ctypes.byref(ring), ctypes.byref(err)), err)
                self._capture_ring = ring
                self._failures_seen = 0
            return self._capture_ring

    def _segment_ref(self, ptr: int) -> L.Ref:
        """The CUDA region (registered once per allocator segment) and offset of device pointer ptr."""
        base, size, buf_id = _cuda.allocation(ptr)
        with self._lock:
            seg = self._segments.get(base)
            if seg is not None and seg.size == size and seg.buffer_id == buf_id:
                return L.Ref(seg.region, ptr - base)
            self._prune()
            err = L.Error()
            region = ctypes.POINTER(L.Region)()
            L.check(self._lib.moedc_region_register_cuda(self._session, ctypes.c_void_p(base), size,
                                                         ctypes.byref(region), ctypes.byref(err)), err)
            self._segments[base] = _Segment(base, size, buf_id, region)
            return L.Ref(region, ptr - base)

    def _prune(self) -> None:
        """Lets go of the regions of segments the allocator has freed since (a rare event, when a
        segment is registered: the driver asked once for each held)."""
        err = L.Error()
        for seg in list(self._segments.values()):
            try:
                live = _cuda.allocation(seg.base) == (seg.base, seg.size, seg.buffer_id)
            except MoEError:
                live = False
            if not live:
                del self._segments[seg.base]  # the server unmaps it once no call holds it
                self._lib.moedc_region_free(seg.region, ctypes.byref(err))

    @property
    def segments(self) -> int:
        """How many CUDA allocator segments the client holds registered."""
        return len(self._segments)

    def _reap(self) -> None:
        """Raises the first failure among eager stream calls the stream has passed. They are looked
        at oldest first, up to the first one still ahead of its stream (a stream passes its calls
        in order), so a call costs one look however far its stream runs behind."""
        if not self._pending:
            return
        res, err = L.RingResult(), L.Error()
        failed = None
        with self._lock:
            n = 0
            for t in self._pending:
                rc = self._lib.moedc_ring_stream_result(self._ring, ctypes.byref(t), ctypes.byref(res),
                                                        ctypes.byref(err))
                if rc == 0:
                    break
                n += 1
                if rc == 1 and res.status and failed is None:
                    failed = L.failure(res.status, "an earlier stream call failed: " +
                                       res.message.decode(errors="replace"))
            del self._pending[:n]
        if failed is not None:
            raise failed

    @staticmethod
    def _maybe_relaxed(capturing: bool = True):
        torch = sys.modules.get("torch")
        if capturing and torch is not None and torch.cuda.is_initialized():
            return _cuda.relaxed_capture()
        return contextlib.nullcontext()


def _full(why: str) -> MoEError:
    return MoEError("RESOURCE_EXHAUSTED", f"every slot of the client's ring is taken by a call in "
                                          f"flight ({why}): wait for some, or open the RingClient "
                                          f"with more slots")


def _refuse_capture() -> None:
    """MoEError FAILED_PRECONDITION for a host call made while the current CUDA stream captures:
    nothing of it could be replayed."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise MoEError("FAILED_PRECONDITION", "a call with host tensors cannot be captured in a CUDA "
                                              "graph (the current stream is capturing): pass CUDA "
                                              "tensors, whose call is stream-ordered and captured")


def _copy_out(inp: Any, src: np.ndarray, out: Any) -> Any:
    """The output of a host call from its bytes in the call's buffer: into `out`, or into a new
    array (tensor) of the caller's own, of hidden's kind and dtype."""
    if is_torch(inp.obj):
        torch = sys.modules["torch"]
        y = torch.empty(inp.shape, dtype=inp.obj.dtype) if out is None else out
        y.view(-1).view(torch.uint8).copy_(torch.from_numpy(src))
        return y
    y = np.empty(inp.shape, inp.obj.dtype.newbyteorder("=")) if out is None else out
    y.reshape(-1).view(np.uint8)[:] = src
    return y
