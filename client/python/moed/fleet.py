"""Fleets: one client over several moed daemons that split the layers (moed --layers) and the experts
of each layer (moed --experts) between them, with replicas of each part.

    with moed.connect(["host1:50051", "host2:50051"]) as c:     # or "dns:///moed-fleet:50051"
        y = c.forward(0, x, expert_ids=ids, expert_weights=w)    # the same call as for one daemon

moed.connect (and moed.aio.connect) makes a FleetClient (moed.aio.FleetClient) of a target that
names several daemons (a list, or a "dns:" name that resolves to several addresses, as a Kubernetes
headless Service does), and a MoEClient of one. A fleet client answers the interface every client
does (moed.interface): one connection per daemon, each a plain single-daemon client; this module
fans calls out and adds the replies up, moed.fleet_plan decides how. Its tensors travel inline: the
calls that need one daemon on this host (register, unregister, regions; transport shm or cuda)
raise MoEError FAILED_PRECONDITION saying so.

What the fleet holds is learnt from GetModel of every daemon: per layer, which experts each holds
(LayerInfo.experts_held) and whether it adds the shared experts. Daemons that hold the same experts
of a layer are replicas of one shard; a layer's shards must be disjoint, cover every expert, and
exactly one of them must add the shared experts (else FAILED_PRECONDITION, naming the daemons).
The daemons must serve one model (ModelInfo.model_fingerprint): a call waits until every daemon was
asked GetModel once (the first call does), and while daemons that answered differ, every call fails
FAILED_PRECONDITION naming them; once every daemon was asked and they agreed on
one, the fleet's model is fixed for the client's life, and a daemon found serving another is left
out (a layer that then lacks experts fails FAILED_PRECONDITION naming it) and asked again until it
serves the fleet's model. While a layer cannot be planned, every daemon's GetModel is asked again
(after 0.5 s, doubling to 5 s), so a fleet put right is used again.

A call goes to one replica of each shard of its layer, in parallel (the route is in the whole
layer's numbering). Where the client chose the experts (expert_ids), a shard gets only the tokens
with a pair on an expert it holds (all of them for the one adding the shared experts), and one
that has none gets no call (moed.fleet_plan.token_rows). Each request states what the client expects of its daemon (ForwardRequest.
expect: the fleet's model and the shard's experts), so a daemon restarted as something else
refuses it (FAILED_PRECONDITION) and no partial output that no longer fits is ever added up. The
replica is the one with the fewest calls outstanding from this client, among those not marked
down. A replica answering UNAVAILABLE (draining, queue full, unreachable) is marked down for a
while (0.5 s, doubling to 5 s) and the call goes at once to another replica of the shard; so does
one that refuses the call, and the call fails FAILED_PRECONDITION naming it when no replica of
the shard is left. Once every replica failed UNAVAILABLE (or was passed over), the client's
RetryPolicy says whether and when to try them all again. A replica that failed is asked for its
GetModel again before it gets more calls, so a daemon restarted with another shard is noticed. A
shard with no reachable replica fails the call UNAVAILABLE naming the layer, the experts missing
and every target tried with what it said. Members' channels retry their connection after 0.5 s,
growing to 5 s (gRPC's reconnect backoff, set so), so a daemon back is found within seconds.

The replies are partial outputs in hidden's dtype. With one shard the reply is the output, as from
one daemon. With several, they are added in float32 in the order of each shard's lowest expert and
the sum is rounded once to hidden's dtype (a shard's partial for a token it did not get counts as
the +0.0 it would have answered: the sum is the same bits as with every token sent to every shard) (moed.proto's "Expert shards" note bounds what that costs
in bf16 and f16; in f32 it is float32 summation order only). ForwardResult.timings are those of the
slowest shard. Batch gating needs one daemon holding every expert of the layer: a layer split over
several shards refuses it (FAILED_PRECONDITION), here and on the daemons. forward_stream() sends
each request as forward() does, one after the other.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import grpc

from . import _common as C
from . import fleet_plan as P
from .client import MoEClient
from .interface import Client
from .regions import Registration
from .retry import RetryPolicy
from .targets import Names, member_kwargs, members
from .transport import known
from .types import ModelInfo, MoEError, Region


class Replan(Exception):
    """The fleet changed (its names resolved to other daemons) while a call was on its way."""


def probe_wait(deadline: Optional[float]) -> float:
    """How long to wait for GetModel answers: PROBE_TIMEOUT, or less as the deadline says."""
    return P.PROBE_TIMEOUT if deadline is None else min(P.PROBE_TIMEOUT, C.remaining(deadline))


def stream_items(requests: Iterable[dict]) -> Iterator[dict]:
    """forward_stream()'s items, checked as a single daemon's stream checks them."""
    for item in C.requests_of(requests):
        C.check_item(item)
        yield item


class FleetBase:
    """What both fleet clients hold: the arguments, the planner's Fleet over one client per
    daemon (made by `single`, the single-daemon client of the fleet client's kind), the "dns:"
    names; a Forward prepared."""

    def __init__(self, single: Any, target: Any, timeout: Optional[float],
                 credentials: Optional[grpc.ChannelCredentials], token: Optional[str],
                 options: Optional[Sequence[Tuple[str, Any]]], keepalive: Optional[float],
                 retry: Optional[RetryPolicy], transport: str):
        known(transport)  # shm and cuda: each call refuses them
        kw = dict(credentials=credentials, token=token, options=options, keepalive=keepalive)
        self.target, self.transport = target, transport
        self.timeout, self.retry = C.seconds(timeout, "timeout"), C.retry_policy(retry)
        self.transport_calls = {"inline": 0, "shm": 0, "cuda": 0}
        self._make = lambda t: single(t, **member_kwargs(t, target, kw))
        self._names = Names(target)
        self.fleet = P.Fleet(members(target, self._make))

    def _deadline(self, timeout: Optional[float]) -> Optional[float]:
        return C.deadline(timeout, self.timeout)

    def _prepare(self, layer: int, hidden: Any, transport: Optional[str], **kw) -> C.Call:
        call = C.now(C.prepare_forward(layer, hidden, transport=P.inline(transport or self.transport), **kw))
        C.count(self, call.transport)
        return call

    def _try_plan(self, layer: int) -> Tuple[Optional[List[P.Shard]], Optional[MoEError]]:
        """The layer's plan, its configuration error returned too (GetModel asked again may clear
        it)."""
        try:
            return self.fleet.plan(layer, time.monotonic())
        except MoEError as e:
            return None, e

    def _members(self) -> List[P.FleetMember]:
        return [P.FleetMember(m.target, m.info, m.error) for m in self.fleet.members]


class FleetClient(FleetBase, Client):
    """A blocking client of several daemons (see the module's text); moed.connect(targets) makes
    one. Arguments as moed.MoEClient's, target naming several daemons. It makes no threads: calls
    and GetModel probes are gRPC futures, shared by the threads calling it (a call that needs a
    daemon another call is asking waits for that answer). members() tells each daemon's GetModel."""

    def __init__(self, target: Any = "127.0.0.1:50051", timeout: Optional[float] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None, token: Optional[str] = None,
                 options: Optional[Sequence[Tuple[str, Any]]] = None, keepalive: Optional[float] = None,
                 retry: Optional[RetryPolicy] = RetryPolicy(), transport: str = "auto"):
        super().__init__(MoEClient, target, timeout, credentials, token, options, keepalive, retry,
                         transport)

    def close(self) -> None:
        for m in self.fleet.members:
            m.client.close()

    def _regroup(self) -> bool:
        """The "dns:" names resolved again, when due; True when the fleet changed."""
        return self._names.due(time.monotonic()) and self.fleet.regroup(self._names.addresses(), self._make)

    # -- learning the fleet --

    @staticmethod
    def _start(m: P.Member) -> Any:
        """m's GetModel started (the fleet's to_probe and to_check call it under their lock)."""
        return m.client._get_model.future(b"", timeout=P.PROBE_TIMEOUT, metadata=m.client._metadata)

    def _probe(self, probes: List[Tuple[P.Member, Any]]) -> List[Tuple[P.Member, Any]]:
        """The probes to_probe or to_check started, each to record its answer when it comes."""
        for m, f in probes:
            f.add_done_callback(lambda f, m=m: self._probed(m, f))
        return probes

    def _probed(self, m: P.Member, f) -> None:
        """Records what a finished probe came to (from its callback, or from _wait: once)."""
        now = time.monotonic()
        try:
            self.fleet.probed(m, f, C.model_info(f.result()), "", now)
        except grpc.RpcError as e:
            self.fleet.probed(m, f, None, f"{e.code().name}: {e.details()}", now)
        except (MoEError, grpc.FutureCancelledError) as e:
            self.fleet.probed(m, f, None, str(e), now)

    def _wait(self, probes: Sequence[Tuple[P.Member, Any]], deadline: Optional[float]) -> None:
        """Waits for probes (up to PROBE_TIMEOUT and the deadline) and records those that ended."""
        end = time.monotonic() + probe_wait(deadline)
        for m, f in probes:
            try:
                f.result(timeout=max(0.0, end - time.monotonic()))
            except Exception:  # what it came to is recorded below
                pass
            if f.done():
                self._probed(m, f)

    def _learn(self, members: Sequence[P.Member], deadline: Optional[float]) -> None:
        """GetModel of those of these members that need it (and those being asked), waited for."""
        probes = self._probe(self.fleet.to_probe(members, time.monotonic(), self._start))
        probes += [(m, f) for m in members for f in [m.probe] if f is not None and (m, f) not in probes]
        self._wait(probes, deadline)

    def _shards(self, layer: int, deadline: Optional[float]) -> List[P.Shard]:
        """The layer's shards. Members that need GetModel are asked in the background; the call
        waits for them only when the layer cannot be planned now (asking again may put it right)."""
        self._probe(self.fleet.to_probe(self.fleet.members, time.monotonic(), self._start))
        if self.fleet.unsettled():
            self._learn(self.fleet.members, deadline)
        shards, err = self._try_plan(layer)
        if err is not None:
            self._regroup()
            self._learn(self.fleet.members, deadline)
            shards, err = self.fleet.plan(layer, time.monotonic())
        if err is not None:
            raise err
        return shards

    # -- calls --

    def _begin(self, t: P.Attempts, deadline: Optional[float]) -> bool:
        """Starts t's next attempt; False when no replica is left in this round."""
        while True:
            now = time.monotonic()
            m = self.fleet.pick(t.shard, t.tried, now)
            if m is not None:
                break
            probes = self._probe(self.fleet.to_check(t.shard, t.tried, now, self._start))
            if not probes:
                return False
            self._wait(probes, deadline)
        t.member, t.started = m, now
        t.attempt = m.client._forward.future(t.payload, timeout=C.remaining(deadline),
                                             metadata=m.client._metadata)
        return True

    def _finish(self, t: P.Attempts, deadline: Optional[float]) -> bytes:
        """t's reply: its attempt waited for, other replicas (and rounds of them) tried on
        UNAVAILABLE or a refusal."""
        while True:
            if t.attempt is not None:
                try:
                    reply = t.attempt.result()
                    self.fleet.done(t.member, None, "", time.monotonic())
                    return reply
                except grpc.RpcError as e:
                    if not t.failed(self.fleet, e.code(), e.details(), time.monotonic()):
                        raise C.rpc_error(e) from None
            if self._begin(t, deadline):
                continue
            if self._regroup():
                raise Replan()
            time.sleep(t.next_round(self.retry, deadline, time.monotonic()))
            self.fleet.revive(t.shard, time.monotonic())

    def forward(self, layer: int, hidden: Any, *, expert_ids=None, expert_weights=None,
                router_logits=None, strategy=None, top_k: int = 0, renormalize: Optional[bool] = None,
                threshold: Optional[float] = None, batch_gating: bool = False, k_batch: int = 0,
                dtype: Optional[str] = None, request_id: str = "", return_info: bool = False,
                copy: bool = False, transport: Optional[str] = None, out: Any = None,
                timeout: Optional[float] = None):
        """moed.MoEClient.forward over the fleet (transport auto or inline: both are inline)."""
        call = self._prepare(layer, hidden, transport, expert_ids=expert_ids, expert_weights=expert_weights,
                             router_logits=router_logits, strategy=strategy, top_k=top_k,
                             renormalize=renormalize, threshold=threshold, batch_gating=batch_gating,
                             k_batch=k_batch, dtype=dtype, request_id=request_id,
                             return_info=return_info, copy=copy, out=out)
        deadline = self._deadline(timeout)
        try:
            return self._fan_out(layer, call, batch_gating, deadline)
        except Replan:  # the fleet changed under the call: once more on its new plan
            return self._fan_out(layer, call, batch_gating, deadline)

    def _fan_out(self, layer: int, call: C.Call, batch_gating: bool, deadline: Optional[float]) -> Any:
        shards = self._shards(layer, deadline)
        P.check_batch_gating(layer, shards, batch_gating)
        parts = P.requests(call, shards)
        tries = [P.Attempts(s, payload) for s, _, payload in parts]
        try:
            for t in tries:
                self._begin(t, deadline)
            return P.combine(call, len(shards),
                             [(rows, self._finish(t, deadline)) for (_, rows, _), t in zip(parts, tries)])
        except BaseException:
            for t in tries:
                if t.attempt is not None:
                    t.attempt.cancel()
            raise

    def forward_stream(self, requests: Iterable[dict], *, timeout: Optional[float] = None,
                       transport: Optional[str] = None) -> Iterator[Any]:
        """moed.MoEClient.forward_stream over the fleet: each request as forward() sends it, in
        order; timeout covers the whole stream."""
        deadline = self._deadline(timeout)
        for item in stream_items(requests):
            yield self.forward(**{"transport": transport, **item, "timeout": C.remaining(deadline)})

    def info(self, timeout: Optional[float] = None) -> ModelInfo:
        """The fleet's ModelInfo (moed.fleet_plan.merged_info); members() has each daemon's."""
        self._learn(self.fleet.members, self._deadline(timeout))
        return P.merged_info(self.fleet.members)

    def members(self, timeout: Optional[float] = None) -> List[P.FleetMember]:
        """Each daemon of the fleet, with its GetModel (asked now where it was not answered)."""
        self._learn(self.fleet.members, self._deadline(timeout))
        return self._members()

    def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        """SERVING when every layer the fleet serves has every expert on a SERVING daemon."""
        deadline = self._deadline(timeout)
        self._learn(self.fleet.members, deadline)
        futures = [m.client._health.future(C.health_request(service), timeout=probe_wait(deadline),
                                           metadata=m.client._metadata) for m in self.fleet.members]
        status: Dict[str, str] = {}
        for m, f in zip(self.fleet.members, futures):
            try:
                status[m.target] = C.health_status(f.result())
            except (grpc.RpcError, MoEError):
                status[m.target] = "UNKNOWN"
        return P.serving(self.fleet, status, time.monotonic())

    def register(self, tensor: Any) -> Registration:
        """Refused: a region needs one daemon (MoEError FAILED_PRECONDITION)."""
        raise P.needs_one_daemon("register()")

    def unregister(self, registration: Registration) -> None:
        """Refused: a region needs one daemon (MoEError FAILED_PRECONDITION)."""
        raise P.needs_one_daemon("unregister()")

    def regions(self, timeout: Optional[float] = None) -> List[Region]:
        """Refused: ListRegions asks one daemon (MoEError FAILED_PRECONDITION)."""
        raise P.no_listing()
