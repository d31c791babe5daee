"""MoEClient: a blocking client of one moed server (moed.aio.MoEClient is its asyncio twin;
moed.FleetClient the client of several, behind the same interface, moed.interface.Client).

Tensors go as raw little-endian bytes (moed.v1.Tensor.data), never as repeated floats. Requests are
encoded by moed.wire, not by the generated protobuf classes: a tensor's bytes are written once,
straight from the caller's memory into the message handed to gRPC (the channel's callables take
and give raw bytes), and a reply's output is read in place (see moed.tensors). Every
grpc.RpcError becomes a moed.MoEError carrying the status code and the server's message; calls
answered UNAVAILABLE are retried as the client's RetryPolicy says.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterable, Iterator, List, Optional

import grpc

from . import _common as C
from .handover import Desk
from .interface import Client
from .regions import LIMITS, LISTING, Registration, Steps
from .targets import single
from .types import ModelInfo, MoEError, Region


class Session(C.SessionBase):
    """The blocking client's region session: the Regions stream fed from a queue (gRPC sends it
    from a thread of its own), one command and its event at a time."""

    def __init__(self, conn: "MoEClient"):
        super().__init__(conn)
        self._lock = threading.Lock()
        self._limits_lock = threading.Lock()
        self._q: Any = None  # the commands to send
        self._events: Any = None  # the events received

    def run(self, steps: Steps) -> Any:
        """Runs steps to their end; their value."""
        self.check()
        answer, error = None, None
        while True:
            try:
                op = steps.send(answer) if error is None else steps.throw(error)
            except StopIteration as stop:
                return stop.value
            answer, error = None, None
            try:
                answer = (self._limits() if op is LIMITS else self.conn.regions() if op is LISTING
                          else self._command(op))
            except MoEError as e:
                error = e

    def _limits(self) -> Any:
        with self._limits_lock:
            if self.regions.limits is None:
                self.regions.limits = self.conn.info().regions
            return self.regions.limits

    def _command(self, cmd: dict) -> dict:
        with self._lock:
            if not self.alive():
                self._q, self._events = queue.SimpleQueue(), queue.SimpleQueue()
                self.opened(self.stub()(iter(self._q.get, None), metadata=self.conn._metadata))
                threading.Thread(target=self._read, args=(self.call, self._events), daemon=True,
                                 name="moed-regions").start()
            self._q.put(self.command(cmd))
            try:
                item = self._events.get(timeout=self.timeout)
            except queue.Empty:
                raise self.timed_out() from None
            if isinstance(item, grpc.RpcError):
                raise self.ended(item)
            return self.event(item)

    @staticmethod
    def _read(call: Any, events: "queue.SimpleQueue") -> None:
        """The stream's events, into `events` (None at its end, or the error that ended it), read
        on a thread of their own so that a command can wait for its event with a timeout."""
        try:
            for data in call:
                events.put(data)
            events.put(None)
        except grpc.RpcError as e:
            events.put(e)

    def close(self) -> None:
        """Ends the stream (waiting a little for the server's end of it) and lets go of everything."""
        with self._lock:
            if self.alive():
                done = threading.Event()
                self.call.add_done_callback(lambda _: done.set())
                self._q.put(None)
                if not done.wait(5):
                    self.call.cancel()
            self.closing()
            if self._channel is not None:
                self._channel.close()
                self._channel = self._stub = None


class MoEClient(C.Connection, Client):
    """A connection to one moed server; one client may be used from many threads at once.

    MoEClient(target, timeout=None, credentials=None, token=None, options=None, keepalive=None,
    retry=RetryPolicy(), transport="auto"):
      target      "host:port", "unix:/path", or any gRPC target;
      timeout     the default deadline of each call in seconds (None: none); a call's deadline
                  covers its retries;
      credentials grpc.ChannelCredentials for TLS (None: plaintext);
      token       a bearer token, sent as "authorization: Bearer TOKEN";
      options     gRPC channel arguments [(name, value), ...], applied over the client's own
                  (which lift the message size limits and size HTTP/2 for tensors);
      keepalive   seconds between HTTP/2 keepalive pings, also on an idle connection (>= 10, the
                  server's minimum); None: gRPC's default (no pings);
      retry       RetryPolicy for calls answered UNAVAILABLE (queue full, draining, unreachable);
                  None or moed.retry.NO_RETRY: never retry;
      transport   how tensors travel by default: "auto", "inline", "shm" or "cuda" (see
                  moed.transport: auto takes shared or device memory for a server on this host).
    Use as a context manager, or call close(). transport_calls counts the Forward calls each
    transport carried; the region session behind shm and cuda is opened on first use and ended
    by close() (moed.regions).

    MoEClient talks to one daemon: a list of targets, or a "dns:" name that resolves to several
    addresses, raises InvalidArgument pointing to moed.connect, which makes a fleet client
    (moed.FleetClient) of several daemons and this client of one.
    """

    def __init__(self, target: str = "127.0.0.1:50051", *args, **kwargs):
        super().__init__(single(target, "moed.MoEClient", "moed.connect"), *args, **kwargs)
        self._session = Session(self)

    def close(self) -> None:
        """Ends the region session (the server releases every region of it; outputs that view the
        shared-memory arena stay valid) and closes the channel; calls in flight are cancelled."""
        self._session.close()
        self._channel.close()

    def _unary(self, method, payload: bytes, timeout: Optional[float]) -> bytes:
        """One unary call with the retry policy; the reply's bytes."""
        deadline = self._deadline(timeout)
        attempt = 1
        while True:
            start = time.monotonic()
            try:
                return method(payload, timeout=C.remaining(deadline), metadata=self._metadata)
            except grpc.RpcError as e:
                now = time.monotonic()
                wait = self.retry.delay(attempt, e.code(), now, deadline, now - start)
                if wait is None:
                    raise C.rpc_error(e, attempt) from None
            time.sleep(wait)
            attempt += 1

    def build_request(self, layer: int, hidden: Any, *, expert_ids=None, expert_weights=None,
                      router_logits=None, strategy=None, top_k: int = 0,
                      renormalize: Optional[bool] = None, threshold: Optional[float] = None,
                      batch_gating: bool = False, k_batch: int = 0, dtype: Optional[str] = None,
                      request_id: str = ""):
        """The moed.v1.ForwardRequest that forward() sends (same arguments), as a generated protobuf
        message, for sending by hand or inspecting; needs the protobuf package (nothing else in the
        client does). Uses no connection: MoEClient.build_request(None, ...) works too."""
        from ._proto.moed.v1 import moed_pb2

        call = C.prepare_forward(layer, hidden, expert_ids=expert_ids, expert_weights=expert_weights,
                                 router_logits=router_logits, strategy=strategy, top_k=top_k,
                                 renormalize=renormalize, threshold=threshold,
                                 batch_gating=batch_gating, k_batch=k_batch, dtype=dtype,
                                 request_id=request_id, transport="inline")
        call = C.now(call).payload
        return moed_pb2.ForwardRequest.FromString(call)

    def forward(self, layer: int, hidden: Any, *, expert_ids=None, expert_weights=None,
                router_logits=None, strategy=None, top_k: int = 0, renormalize: Optional[bool] = None,
                threshold: Optional[float] = None, batch_gating: bool = False, k_batch: int = 0,
                dtype: Optional[str] = None, request_id: str = "", return_info: bool = False,
                copy: bool = False, transport: Optional[str] = None, out: Any = None,
                timeout: Optional[float] = None):
        """Computes MoE layer `layer` for hidden [T, d_model]; returns the output [T, d_model] in
        hidden's dtype and of hidden's kind, or a ForwardResult if return_info.

        hidden: a numpy array, a torch tensor (CPU or CUDA), or another object with __dlpack__ on
        the host; float32, float16 or bfloat16 (numpy: ml_dtypes.bfloat16), or uint16 bf16 bit
        patterns with dtype="bf16" (the output is then uint16 too). The output is a numpy array
        (torch tensor in: a torch tensor on the same device). A numpy output is a read-only view
        of the reply's bytes (copy=True gives one that owns its memory), a torch one memory of its
        own (moed.tensors says what each kind costs). A non-contiguous hidden is copied once. On
        the shm transport the output is a view of the client's shared-memory arena instead (torch:
        writable), valid as long as it is referenced (moed.regions); a CUDA output is a new tensor
        on hidden's device.
        Routing, one of:
          * expert_ids int32 [T, k] and expert_weights float32 [T, k] (id -1 with weight 0 pads);
          * router_logits float32 [T, num_experts], gated by the server with `strategy`;
          * neither: the server's router computes the logits (the layer must have one).
        (Routing tensors may be of any kind and dtype: they are converted.)
        strategy: None or "model" (the layer's own rule), "topk", "sigmoid", "sparsemax",
        "quadratic", "pioneer"; top_k: 0 for the layer's; renormalize: None for the layer's
        norm_topk_prob, True or False; threshold: sigmoid's, None for 0.5.
        batch_gating: batch-level dynamic gating over the merged batch with k_batch experts (0: the
        layer's top_k); ForwardResult.expert_set then names the set.
        transport: "auto", "inline", "shm" or "cuda" (moed.transport), None for the client's.
        out: where to write the output (of hidden's kind, dtype, shape and device, contiguous),
        returned; a CUDA out that lies in a registered tensor (register()) is written by the
        server itself, and with hidden registered too the call copies nothing.
        timeout: seconds, None for the client's default.
        Raises MoEError: the server's status, or the client's own (moed.types.MoEError says which),
        INVALID_ARGUMENT for arguments that cannot be sent, found before anything is sent.
        """
        for again in (False, True):
            call = self._session.run(C.prepare_forward(
                layer, hidden, expert_ids=expert_ids, expert_weights=expert_weights,
                router_logits=router_logits, strategy=strategy, top_k=top_k, renormalize=renormalize,
                threshold=threshold, batch_gating=batch_gating, k_batch=k_batch, dtype=dtype,
                request_id=request_id, return_info=return_info, copy=copy,
                transport=transport or self.transport, out=out, regions=self._session.regions))
            C.count(self, call.transport)
            try:
                reply = self._unary(self._forward, call.payload, timeout)
            except MoEError as e:
                call.failed(e.code_name)
                # Its regions went with a session that ended (a restarted server): once more.
                if again or not call.regions or self._session.alive():
                    raise
                continue
            return call.result(reply)

    def register(self, tensor: Any) -> Registration:
        """Registers a torch CUDA tensor as a region of the client's session: a forward() whose
        hidden or out lies in it names it instead of copying through the device arena. The region
        is the whole CUDA allocation that holds the tensor (an IPC handle names a whole allocation,
        and the server may open each only once), shared by every registered tensor in it. The
        client keeps the tensor alive until unregister() or close(); it is registered again by
        itself if the session ends and a new one starts. The caller must not change hidden (or
        read out) while a call that names it is in flight."""
        return self._session.run(self._session.regions.register(tensor))

    def unregister(self, registration: Registration) -> None:
        """Ends a registration made by register()."""
        self._session.run(self._session.regions.unregister(registration))

    def regions(self, timeout: Optional[float] = None) -> List[Region]:
        """The server's list of the regions of this client's principal (ListRegions): from every
        session of it, this client's arenas and registrations among them."""
        return C.region_list(self._unary(self._list_regions, b"", timeout))

    def forward_stream(self, requests: Iterable[dict], *, timeout: Optional[float] = None,
                       transport: Optional[str] = None) -> Iterator[Any]:
        """forward() over one ForwardStream, for workers that call every layer: `requests` is an
        iterable of dicts of forward()'s keyword arguments (layer and hidden required; not
        timeout), consumed as the stream sends; yields each output (or ForwardResult) in order, as
        forward() returns it. A bad item raises its InvalidArgument after the outputs before it.
        timeout covers the whole stream. A stream failing UNAVAILABLE is retried: the requests not
        yet answered are sent again on a new stream (the retry count restarts with each reply).
        Stopping the iteration early cancels the stream.
        The iterable is pulled by gRPC's request thread (so a generator may wait for the outputs
        before it: a queue the loop feeds works), but each item is prepared, its tensors read, on
        the thread iterating this generator while it waits for an output, as forward() would
        read them there: a CUDA tensor after the work queued on that thread's current stream.
        Keep the stream that wrote the tensors current while iterating (moed.handover).
        """
        feed = C.Feed(C.requests_of(requests), transport or self.transport, self._session.regions)
        desk = Desk(lambda item: self._prepare_item(feed, item))
        pull_lock = threading.Lock()
        deadline = self._deadline(timeout)
        failures = 0
        try:
            while True:
                call = self._stream(self._requests(feed, pull_lock, desk), timeout=C.remaining(deadline),
                                    metadata=self._metadata)
                try:
                    for reply in desk.replies(call):
                        failures = 0
                        yield feed.answer(reply)
                    break
                except grpc.RpcError as e:
                    failures += 1
                    wait = self.retry.delay(failures, e.code(), time.monotonic(), deadline)
                    if wait is None:
                        feed.abandon(e.code().name)
                        raise C.rpc_error(e, failures) from None
                except GeneratorExit:
                    feed.abandon("CANCELLED")
                    raise
                finally:
                    call.cancel()  # a no-op once the stream ended; stops it if the caller stopped early
                time.sleep(wait)
            feed.end()
        finally:
            desk.close()

    def _prepare_item(self, feed: C.Feed, item: Any) -> C.Call:
        """A stream's item prepared (on the thread iterating the stream) and counted."""
        call = self._session.run(feed.steps(item))
        C.count(self, call.transport)
        return call

    def _requests(self, feed: C.Feed, pull_lock: threading.Lock, desk: Desk) -> Iterator[bytes]:
        """The payloads of one attempt of a stream (gRPC iterates this on its own thread; each item
        it pulls is prepared at the desk)."""
        attempt, seq = feed.start()
        while True:
            payload = feed.payload(attempt, seq)
            if payload is None:
                with pull_lock:  # one puller of the caller's iterable at a time
                    payload = feed.payload(attempt, seq)
                    if payload is None:
                        if feed.done:
                            return
                        try:
                            item = next(feed.source)
                        except StopIteration:
                            feed.stop()
                            return
                        except Exception as e:  # the caller's iterable failed: raised in order
                            feed.stop(e)
                            return
                        try:
                            call = desk.hand_over(item)
                        except Exception as e:  # a bad item: raised in order
                            feed.stop(e)
                            return
                        if call is None:  # the iteration has ended
                            return
                        payload = feed.pulled(call)
            if payload is C.STALE:
                return
            yield payload
            seq += 1

    @staticmethod
    def decode_output(tensor, like) -> Any:
        """A generated moed.v1.Tensor (a reply's output) as a new writable numpy array; bf16 as
        `like` (a numpy dtype) says: uint16 bits, else ml_dtypes.bfloat16."""
        import numpy as np

        from .tensors import BF16, WIRE_NP, wire_view

        if tensor.dtype not in WIRE_NP:
            raise MoEError("INTERNAL", f"the server replied with unknown dtype {tensor.dtype}")
        a = wire_view(memoryview(tensor.data), tensor.dtype, tuple(tensor.shape))
        a = a.astype(WIRE_NP[tensor.dtype].newbyteorder("="))  # a copy: writable, native order
        if tensor.dtype == BF16 and np.dtype(like) != np.uint16:
            import ml_dtypes

            a = a.view(ml_dtypes.bfloat16)
        return a

    def info(self, timeout: Optional[float] = None) -> ModelInfo:
        """What the server holds: ModelInfo(model, layers=[LayerInfo...], backend, devices, version,
        max_message_bytes, max_batch_tokens)."""
        return C.model_info(self._unary(self._get_model, b"", timeout))

    def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"."""
        return C.health_status(self._unary(self._health, C.health_request(service), timeout))
