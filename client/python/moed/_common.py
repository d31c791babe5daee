"""What the blocking and the asyncio client share: preparing a Forward (Call), reading its reply,
the stream's bookkeeping (Feed), channel options, and turning replies and errors into moed types.
Nothing here does I/O, so each client adds only its own way of waiting.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from . import wire
from .retry import NO_RETRY, RetryPolicy
from .tensors import F32, I32, hidden_input, host_array, wire_tensor
from .regions import Regions, Steps
from .transport import Prepared, known, prepare
from .types import (ACTIVATIONS, DTYPES, HEALTH, REGION_KINDS, ROUTER_RULES, Device, ForwardResult,
                    InvalidArgument, LayerInfo, ModelInfo, MoEError, Region, RegionLimits, Timings,
                    name_of, strategy_value)

FORWARD = "/moed.v1.Moed/Forward"
FORWARD_STREAM = "/moed.v1.Moed/ForwardStream"
REGIONS = "/moed.v1.Moed/Regions"
COMMAND_TIMEOUT = 60.0  # seconds a region command may wait for its event, without a client timeout
LIST_REGIONS = "/moed.v1.Moed/ListRegions"
GET_MODEL = "/moed.v1.Moed/GetModel"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"

# moed.v1.Renormalize of forward()'s renormalize argument.
_RENORMALIZE = {None: 0, True: 1, False: 2}
# The keyword arguments of forward() that a forward_stream() item may carry (timeout is the
# stream's).
STREAM_ITEM_ARGS = frozenset(("layer", "hidden", "expert_ids", "expert_weights", "router_logits",
                              "strategy", "top_k", "renormalize", "threshold", "batch_gating",
                              "k_batch", "dtype", "request_id", "return_info", "copy", "transport",
                              "out"))
_STATUS = {c.value[0]: c for c in grpc.StatusCode}


def _matrix(name: str, x: Any, wire_dtype: int, T: int) -> np.ndarray:
    a = host_array(x, wire_dtype, name)
    if a.ndim != 2 or a.shape[0] != T:
        raise InvalidArgument(f"{name} must be [T={T}, n], not shape {list(a.shape)}")
    return a


def _routing(T: int, expert_ids, expert_weights, router_logits, strategy, top_k, renormalize,
             threshold, batch_gating, k_batch) -> Dict[str, Any]:
    """The routing fields of a ForwardRequest (as a dict for wire.encode)."""
    if (expert_ids is None) != (expert_weights is None):
        raise InvalidArgument("client routing needs both expert_ids and expert_weights")
    if expert_ids is not None:
        if router_logits is not None or batch_gating:
            raise InvalidArgument("expert_ids/expert_weights exclude router_logits and batch_gating")
        ids = _matrix("expert_ids", expert_ids, I32, T)
        w = _matrix("expert_weights", expert_weights, F32, T)
        if ids.shape != w.shape:
            raise InvalidArgument(f"expert_ids {list(ids.shape)} and expert_weights {list(w.shape)} "
                                  f"differ in shape")
        return {"experts": {"expert_ids": wire_tensor(ids, I32), "expert_weights": wire_tensor(w, F32)}}
    if renormalize not in _RENORMALIZE:
        raise InvalidArgument(f"renormalize={renormalize!r}: use None (the layer's), True or False")
    gating = {"strategy": strategy_value(strategy), "top_k": top_k,
              "renormalize": _RENORMALIZE[renormalize], "threshold": threshold or 0.0}
    fields: Dict[str, Any] = {"batch_gating": {"k_batch": k_batch} if batch_gating else None}
    if router_logits is not None:
        logits = _matrix("router_logits", router_logits, F32, T)
        fields["logits"] = {"logits": wire_tensor(logits, F32), "gating": gating}
    else:
        fields["server_router"] = {"gating": gating}
    return fields


class Call:
    """One Forward, prepared: `payload` is the encoded ForwardRequest, `fields` what it encodes (a
    fleet sends a shard some of its rows: moed.fleet_plan.requests); result() reads its reply."""

    __slots__ = ("payload", "fields", "prepared", "return_info", "copy")

    def __init__(self, payload: bytes, fields: Dict[str, Any], prepared: Prepared, return_info: bool,
                 copy: bool):
        self.payload, self.fields, self.prepared = payload, fields, prepared
        self.return_info, self.copy = return_info, copy

    @property
    def transport(self) -> str:
        return self.prepared.transport

    @property
    def regions(self) -> bool:
        """Whether the request names regions (which a session's end invalidates)."""
        return self.prepared.output is not None

    def failed(self, code_name: str) -> None:
        """The call failed with this status: its slots are freed or retired (moed.regions)."""
        self.prepared.failed(code_name)

    def result(self, reply: bytes) -> Any:
        """The output (or a ForwardResult) from the reply's bytes; MoEError INTERNAL when the reply
        is not what the request asked for."""
        r = decode("moed.v1.ForwardResponse", reply)
        out = check_output(r["output"], self.prepared.input.wire, self.prepared.input.shape)
        y = self.prepared.finish(out, self.copy)
        if not self.return_info:
            return y
        t = r["timings"] or wire.new("moed.v1.Timings")
        return ForwardResult(output=y, expert_set=np.array(r["expert_set"], dtype=np.int32),
                             timings=Timings(t["queue_us"], t["compute_us"], t["total_us"],
                                             t["batch_tokens"], t["batch_requests"]),
                             request_id=r["request_id"])


def check_output(t: Optional[Dict[str, Any]], dtype: int, shape: Sequence[int]) -> Dict[str, Any]:
    """The reply's output Tensor, checked against the request: the dtype and shape of hidden."""
    if t is None:
        raise MoEError("INTERNAL", "the server replied without an output tensor")
    if t["dtype"] != dtype:
        raise MoEError("INTERNAL", f"the server replied with dtype {name_of(DTYPES, t['dtype'], str(t['dtype']))} "
                                   f"to a {name_of(DTYPES, dtype)} request")
    if list(t["shape"]) != list(shape):
        raise MoEError("INTERNAL", f"the server replied with shape {list(t['shape'])} for hidden {list(shape)}")
    return t


def prepare_forward(layer: int, hidden: Any, *, expert_ids=None, expert_weights=None, router_logits=None,
                    strategy=None, top_k: int = 0, renormalize: Optional[bool] = None,
                    threshold: Optional[float] = None, batch_gating: bool = False, k_batch: int = 0,
                    dtype: Optional[str] = None, request_id: str = "", return_info: bool = False,
                    copy: bool = False, transport: str = "auto", out: Any = None,
                    regions: Optional[Regions] = None) -> Steps:
    """Steps (moed.regions) that return the Call for forward()'s arguments (see
    MoEClient.forward); InvalidArgument for what cannot be sent. regions: the client's (None: inline
    only)."""
    inp = hidden_input(hidden, dtype)
    fields = _routing(inp.shape[0], expert_ids, expert_weights, router_logits, strategy, top_k,
                      renormalize, threshold, batch_gating, k_batch)
    if regions is None and transport != "inline":
        raise InvalidArgument(f"transport={transport!r} needs the client's regions")
    prepared = yield from prepare(transport, inp, regions, out)
    fields.update(request_id=request_id, layer=layer, hidden=prepared.tensor, output=prepared.output)
    return Call(wire.encode("moed.v1.ForwardRequest", fields), fields, prepared, return_info, copy)


def now(steps: Steps) -> Any:
    """What steps that need no server return (inline preparation)."""
    try:
        steps.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("these steps need the server")


def prepare_item(item: Any, transport: str, regions: Regions) -> Steps:
    """prepare_forward's steps for one forward_stream() item: a dict of forward()'s keyword
    arguments."""
    check_item(item)
    return prepare_forward(**{"transport": transport, **item, "regions": regions})


def requests_of(requests: Any) -> Any:
    """An iterator over forward_stream()'s requests (InvalidArgument for what is no iterable)."""
    try:
        return iter(requests)
    except TypeError:
        raise InvalidArgument(f"forward_stream() takes an iterable of dicts of forward()'s keyword "
                              f"arguments, not {type(requests).__name__}") from None


def check_item(item: Any) -> None:
    """InvalidArgument unless item is a dict of forward()'s keyword arguments (a
    forward_stream() item)."""
    if not isinstance(item, dict):
        raise InvalidArgument(f"forward_stream() takes dicts of forward()'s keyword arguments, "
                              f"not {type(item).__name__}")
    unknown = set(item) - STREAM_ITEM_ARGS
    if unknown:
        raise InvalidArgument(f"forward_stream() item has unknown argument(s) {sorted(unknown)} "
                              f"(timeout is the stream's: pass it to forward_stream)")
    if "layer" not in item or "hidden" not in item:
        raise InvalidArgument("forward_stream() item needs layer and hidden")


STALE = object()  # Feed.payload(): this attempt of the stream is over


class Feed:
    """The requests of one forward_stream() across the attempts of a retried stream.

    Requests are pulled from the caller's iterable lazily, by gRPC as it sends (one puller at a
    time: pull_lock, a lock of the client's kind), and stay pending until answered. When a stream
    fails UNAVAILABLE and is retried, the new attempt sends the pending requests again, in order,
    before pulling more; an older attempt still pulling finds itself stale and stops, and what it
    pulled is pending, so the new attempt sends it. A bad item or an exception from the caller's
    iterable stops the pulling; it is raised after the replies of the requests before it (end()).
    """

    def __init__(self, source: Any, transport: str, regions: Regions):
        self.source, self.transport, self.regions = source, transport, regions
        self._lock = threading.Lock()  # _pending and the counters; the replies come on another thread
        self._pending: Deque[Call] = deque()  # pulled and not answered, in order
        self._answered = 0  # calls answered so far: the sequence number of _pending[0]
        self._attempt = 0
        self.error: Optional[BaseException] = None
        self.done = False  # nothing more to pull (the iterable ended or failed)

    def start(self) -> Tuple[int, int]:
        """A new attempt: (its id, the sequence number of the first request it sends)."""
        with self._lock:
            self._attempt += 1
            return self._attempt, self._answered

    def payload(self, attempt: int, seq: int) -> Any:
        """The payload of request `seq` if it was pulled already, None if it is next to pull, or
        STALE if a newer attempt took over."""
        with self._lock:
            if attempt != self._attempt:
                return STALE
            i = seq - self._answered
            return self._pending[i].payload if i < len(self._pending) else None

    def steps(self, item: Any) -> Steps:
        """The steps that prepare an item the puller got (run by the client's session)."""
        return prepare_item(item, self.transport, self.regions)

    def pulled(self, call: Call) -> bytes:
        """Takes the Call of an item the puller got; its payload."""
        with self._lock:
            self._pending.append(call)
        return call.payload

    def abandon(self, code_name: str) -> None:
        """The stream failed (or was stopped) with this status: the unanswered calls let go."""
        with self._lock:
            calls, self._pending = list(self._pending), deque()
        for call in calls:
            call.failed(code_name)

    def stop(self, error: Optional[BaseException] = None) -> None:
        """Nothing more to pull: the iterable ended (error None) or raised `error`."""
        self.done = True
        self.error = self.error or error

    def oldest(self) -> Optional[Call]:
        """The oldest request not answered, if any."""
        with self._lock:
            return self._pending[0] if self._pending else None

    def answer(self, reply: bytes) -> Any:
        """The output of the oldest pending request, from its reply."""
        with self._lock:
            if not self._pending:
                raise MoEError("INTERNAL", "the server sent a reply to no request on the stream")
            call = self._pending.popleft()
            self._answered += 1
        return call.result(reply)

    def end(self) -> None:
        """The stream ended OK: every request must have been answered; then any error of the
        caller's iterable or items is raised."""
        if self._pending:
            raise MoEError("INTERNAL", f"the stream ended with {len(self._pending)} request(s) unanswered")
        if self.error is not None:
            raise self.error


_COUNTING = threading.Lock()  # every client's transport_calls increments: each is over at once


def count(client: Any, transport: str) -> None:
    """One more Forward call carried by `transport` in client.transport_calls. Under a lock: a
    client is used from many threads at once, and += on a dict's item reads, then writes."""
    with _COUNTING:
        client.transport_calls[transport] += 1


def seconds(value: Any, what: str) -> Optional[float]:
    """value, checked to be None or a number of seconds (InvalidArgument otherwise)."""
    if value is None or type(value) in (int, float) and value == value:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise InvalidArgument(f"{what}={value!r}: give a number of seconds, or None")
    return float(value)


def retry_policy(retry: Any) -> RetryPolicy:
    """A client's retry argument, checked (None: NO_RETRY)."""
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise InvalidArgument(f"retry={retry!r}: give a moed.RetryPolicy, or None for no retries")
    return retry or NO_RETRY


def deadline(timeout: Optional[float], default: Optional[float]) -> Optional[float]:
    """The time.monotonic() deadline of a call given `timeout` (None: the client's `default`)."""
    timeout = default if timeout is None else seconds(timeout, "timeout")
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: Optional[float]) -> Optional[float]:
    """Seconds left until a time.monotonic() deadline (None: no deadline)."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


class Connection:
    """What both clients hold: the channel, its callables (raw bytes in and out: the messages are
    moed.wire's), the default deadline, retry policy and transport. `grpc_module` is grpc for the
    blocking client and grpc.aio for the asyncio one. The clients' docstrings explain the
    arguments."""

    grpc_module: Any = grpc

    def __init__(self, target: str = "127.0.0.1:50051", timeout: Optional[float] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None, token: Optional[str] = None,
                 options: Optional[Sequence[Tuple[str, Any]]] = None, keepalive: Optional[float] = None,
                 retry: Optional[RetryPolicy] = RetryPolicy(), transport: str = "auto"):
        if credentials is not None and not isinstance(credentials, grpc.ChannelCredentials):
            raise InvalidArgument(f"credentials={credentials!r}: give grpc.ChannelCredentials (e.g. "
                                  f"grpc.ssl_channel_credentials()), or None for plaintext")
        self._opts, self._credentials = channel_options(options, keepalive), credentials
        self.timeout = seconds(timeout, "timeout")
        self.retry = retry_policy(retry)
        self.transport = known(transport)
        self._metadata = metadata(token)
        self.target = target
        self._channel = self.new_channel()
        self._forward = self._channel.unary_unary(FORWARD)
        self._stream = self._channel.stream_stream(FORWARD_STREAM)
        self._get_model = self._channel.unary_unary(GET_MODEL)
        self._health = self._channel.unary_unary(HEALTH_CHECK)
        self._list_regions = self._channel.unary_unary(LIST_REGIONS)
        # Forward calls made per transport, as auto chose them (forward_stream's items too).
        self.transport_calls = {"inline": 0, "shm": 0, "cuda": 0}

    def new_channel(self, *extra: Tuple[str, Any]) -> Any:
        """A channel to the target with the client's options (and `extra`)."""
        opts, m = self._opts + list(extra), self.grpc_module
        if self._credentials is None:
            return m.insecure_channel(self.target, options=opts)
        return m.secure_channel(self.target, self._credentials, options=opts)

    def _deadline(self, timeout: Optional[float]) -> Optional[float]:
        return deadline(timeout, self.timeout)


class SessionBase:
    """A client's region session, but for the waiting (each client's Session adds it): the
    Regions, the stream's call, the commands' sequence numbers and the events' checks. run(steps)
    answers the steps' requests: LIMITS with the server's RegionLimits (GetModel, once), LISTING
    with the principal's regions (ListRegions), a command with its event (the stream opened first
    if it is not open)."""

    def __init__(self, conn: "Connection"):
        self.conn = conn
        self.regions = Regions(conn.target)
        self.call: Any = None
        self.seq = 0
        self.timeout = conn.timeout or COMMAND_TIMEOUT  # for each command's event
        self._channel: Any = None
        self._stub: Any = None

    def stub(self) -> Any:
        """The Regions method on a channel of the session's own: a connection of its own, so its
        long-lived stream never takes one of the forward connection's --max-streams, and channels
        to the same target (which gRPC would otherwise share one connection between) do not add
        up their sessions there either."""
        if self._stub is None:
            self._channel = self.conn.new_channel(("grpc.use_local_subchannel_pool", 1))
            self._stub = self._channel.stream_stream(REGIONS)
        return self._stub

    def timed_out(self) -> MoEError:
        """A command unanswered in time: the session is given up (the next command opens another)."""
        self.call.cancel()
        return MoEError("DEADLINE_EXCEEDED", f"the server did not answer a region command in "
                                             f"{self.timeout:g} s; the region session was closed")

    def alive(self) -> bool:
        return self.call is not None and not self.call.done()

    def check(self) -> None:
        """Before steps run: if the stream has ended, what it registered is gone (the arenas start
        afresh, and a new stream opens with the next command)."""
        if self.call is not None and self.call.done():
            self.call = None
            self.regions.ended()

    def opened(self, call: Any) -> None:
        """A new stream: what an earlier one registered is gone."""
        if self.call is not None:
            self.regions.ended()
        self.call = call
        self.regions.session += 1

    def command(self, cmd: Dict[str, Any]) -> bytes:
        self.seq += 1
        return wire.encode("moed.v1.RegionCommand", {"seq": self.seq, **cmd})

    def event(self, data: Optional[bytes]) -> Dict[str, Any]:
        """The event answering the last command, checked; a failed command is its MoEError."""
        if data is None:
            raise MoEError("UNAVAILABLE", "the region session ended")
        ev = decode("moed.v1.RegionEvent", data)
        if ev["seq"] != self.seq:
            raise MoEError("INTERNAL", f"the server answered region command {self.seq} with the event "
                                       f"of {ev['seq']}")
        if ev["code"]:
            code = _STATUS.get(ev["code"], grpc.StatusCode.UNKNOWN)
            raise MoEError(code.name, ev["message"] or "(no message)", code)
        return ev

    @staticmethod
    def ended(e: grpc.RpcError) -> MoEError:
        """The stream's end as the error of the command waiting on it."""
        err = rpc_error(e)
        return MoEError(err.code_name, f"the region session ended: {err.message}", err.code)

    def closing(self) -> None:
        """The client closes: every region is let go (the stream's end releases them there)."""
        self.regions.ended()
        self.regions.allocations.clear()


def channel_options(options: Optional[Sequence[Tuple[str, Any]]], keepalive: Optional[float]) -> List[Tuple[str, Any]]:
    """The channel arguments: ours (sized for tensors), keepalive's, then the caller's, which win."""
    merged: Dict[str, Any] = {
        # A [T, d_model] batch is easily over gRPC's 4 MiB default; the server enforces its own
        # limit and names it in RESOURCE_EXHAUSTED.
        "grpc.max_send_message_length": -1, "grpc.max_receive_message_length": -1,
        # HTTP/2 sized for tensors, as the server is: large frames and stream window.
        "grpc.http2.max_frame_size": 1 << 20, "grpc.http2.lookahead_bytes": 8 << 20,
    }
    if keepalive is not None:
        if not seconds(keepalive, "keepalive") >= 10:
            raise InvalidArgument(f"keepalive={keepalive}: at least 10 seconds (moed refuses pings "
                                  f"more often than every 10 s on an idle connection)")
        ms = int(keepalive * 1000)
        merged.update({"grpc.keepalive_time_ms": ms, "grpc.keepalive_timeout_ms": min(ms, 20000),
                       "grpc.keepalive_permit_without_calls": 1, "grpc.http2.max_pings_without_data": 0})
    merged.update(_pairs(options))
    return list(merged.items())


def _pairs(options: Any) -> List[Tuple[str, Any]]:
    """The caller's channel arguments, checked to be (name, value) pairs."""
    try:
        pairs = [(name, value) for name, value in options or ()]
    except (TypeError, ValueError):  # not iterable, or an item that is no pair
        pairs = None
    if pairs is None or not all(isinstance(name, str) for name, _ in pairs):
        raise InvalidArgument(f"options={options!r}: give a list of (name, value) pairs, gRPC "
                              f"channel arguments such as ('grpc.enable_retries', 0)")
    return pairs


def metadata(token: Optional[str]) -> Optional[Tuple[Tuple[str, str], ...]]:
    if token is not None and not isinstance(token, str):
        raise InvalidArgument(f"token: give the bearer token as a str, not {type(token).__name__}")
    return (("authorization", f"Bearer {token}"),) if token else None


def rpc_error(e: grpc.RpcError, attempts: int = 1) -> MoEError:
    """A failed call as a MoEError (attempts: how many were made)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return MoEError(code.name, details or "(no message)", code, attempts)


def decode(msg: str, reply: bytes) -> Dict[str, Any]:
    """A reply parsed; one that does not parse is MoEError INTERNAL."""
    try:
        return wire.decode(msg, reply)
    except wire.WireError as e:
        raise MoEError("INTERNAL", f"the server's reply does not parse as {msg}: {e}") from None


def _check_held(l: Dict[str, Any]) -> None:
    """A layer's experts_held must be what moed sends: increasing, disjoint ranges of its experts."""
    nxt = 0
    for r in l["experts_held"]:
        if not nxt <= r["first"] <= r["last"] < l["num_experts"]:
            raise MoEError("INTERNAL", f"the server's ModelInfo is malformed: layer {l['index']}'s "
                                       f"experts_held are not increasing ranges of its experts")
        nxt = r["last"] + 1


def model_info(reply: bytes) -> ModelInfo:
    """A GetModel reply as ModelInfo."""
    m = decode("moed.v1.ModelInfo", reply)
    if m["loading"] is not None:  # nothing is served yet: as a daemon not yet up, to every caller
        p = m["loading"]
        raise MoEError("UNAVAILABLE", f"the server is loading its weights ({p['phase'] or 'starting'}, "
                                      f"{p['percent']:.1f}% of phase {p['phase_number']} of {p['phases']}): "
                                      f"retry once its health says SERVING")
    for l in m["layers"]:
        _check_held(l)
    layers = [LayerInfo(index=l["index"], d_model=l["d_model"], d_ff=l["d_ff"], num_experts=l["num_experts"],
                        top_k=l["top_k"], activation=name_of(ACTIVATIONS, l["activation"]),
                        weight_dtype=name_of(DTYPES, l["weight_dtype"]), has_router=l["has_router"],
                        norm_topk_prob=l["norm_topk_prob"],
                        router_rule=name_of(ROUTER_RULES, l["router_rule"]),
                        num_shared_experts=l["num_shared_experts"], shared_d_ff=l["shared_d_ff"],
                        n_group=l["n_group"], topk_group=l["topk_group"],
                        routed_scaling_factor=l["routed_scaling_factor"],
                        # a moed older than these fields holds every expert and adds the shared ones
                        experts_held=[(r["first"], r["last"]) for r in l["experts_held"]]
                        or [(0, l["num_experts"] - 1)],
                        adds_shared_experts=l["adds_shared_experts"] or not l["experts_held"],
                        home_device=l["home_device"],
                        expert_placement=[(r["first"], r["last"], r["device"])
                                          for r in l["expert_placement"]],
                        expert_replicas=[(r["first"], r["device"]) for r in l["expert_replicas"]],
                        placement_generation=l["placement_generation"],
                        sparse24=l["sparse24"])
              for l in m["layers"]]
    devices = [Device(d["name"], d["memory_total"], d["memory_used"]) for d in m["devices"]]
    return ModelInfo(model=m["model"], layers=layers, backend=m["backend"], devices=devices,
                     version=m["version"], max_message_bytes=m["max_message_bytes"],
                     max_batch_tokens=m["max_batch_tokens"], regions=region_limits(m["regions"]),
                     model_fingerprint=m["model_fingerprint"])


def region_limits(r: Optional[Dict[str, Any]]) -> RegionLimits:
    """ModelInfo.regions as RegionLimits (a server that predates regions sends none: off)."""
    if r is None:
        return RegionLimits()
    return RegionLimits(r["mode"] or "off", r["max_regions"], r["max_region_bytes"],
                        r["max_region_bytes_total"], r["cuda"])


def region_list(reply: bytes) -> List[Region]:
    """A ListRegions reply as Regions."""
    return [Region(r["id"], name_of(REGION_KINDS, r["kind"], "unspecified"), r["name"], r["bytes"],
                   r["device"], r["ready"], r["broken"], r["requests"])
            for r in decode("moed.v1.RegionList", reply)["regions"]]


def health_request(service: str) -> bytes:
    return wire.encode("grpc.health.v1.HealthCheckRequest", {"service": service})


def health_status(reply: bytes) -> str:
    return name_of(HEALTH, decode("grpc.health.v1.HealthCheckResponse", reply)["status"], "UNKNOWN")


