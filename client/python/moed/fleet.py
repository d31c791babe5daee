"""Fleets: one client over several moed daemons that split the layers (moed --layers) and the experts
of each layer (moed --experts) between them, with replicas of each part.

    with moed.MoEClient(["host1:50051", "host2:50051"]) as c:     # or "dns:///moed-fleet:50051"
        y = c.forward(0, x, expert_ids=ids, expert_weights=w)      # the same call as for one daemon

A target that names several daemons (a list, or a "dns:" name that resolves to several addresses,
as a Kubernetes headless Service does) makes MoEClient (and moed.aio.MoEClient) a fleet client: one
connection per daemon, each a plain single-daemon client (so transports stay what they are; this
module only fans calls out and adds the replies up). A plain string target stays a plain client.

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
layer's numbering). Each request states what the client expects of its daemon (ForwardRequest.
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
the sum is rounded once to hidden's dtype (moed.proto's "Expert shards" note bounds what that costs
in bf16 and f16; in f32 it is float32 summation order only). ForwardResult.timings are those of the
slowest shard. Batch gating needs one daemon holding every expert of the layer: a layer split over
several shards refuses it (FAILED_PRECONDITION), here and on the daemons. forward_stream() sends
each request as forward() does, one after the other.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from . import _common as C
from . import aio, wire
from .client import MoEClient
from .retry import NO_RETRY, RetryPolicy
from .tensors import BF16, WIRE_NP, wire_view
from .types import Device, ForwardResult, LayerInfo, ModelInfo, MoEError, Timings

# How long GetModel of one daemon may take while the fleet is learnt (an address that no longer
# answers must not hold the caller for TCP's connect timeout).
PROBE_TIMEOUT = 5.0
# A replica that answered UNAVAILABLE is passed over for this long, doubling up to DOWN_MAX.
DOWN_MIN, DOWN_MAX = 0.5, 5.0
# "dns:" names are resolved again at most this often (when a call finds a shard unanswered).
RESOLVE_EVERY = 5.0
# LayerInfo fields every daemon holding part of a layer must agree on.
_SAME = ("d_model", "d_ff", "num_experts", "top_k", "activation", "weight_dtype", "has_router",
         "norm_topk_prob", "router_rule", "num_shared_experts", "shared_d_ff", "n_group", "topk_group",
         "routed_scaling_factor")
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_REFUSED = grpc.StatusCode.FAILED_PRECONDITION


# ---- targets ------------------------------------------------------------------------------------

def resolve(target: Any) -> List[str]:
    """The daemons a target names: a list or tuple of targets (each resolved in turn), a "dns:"
    name (one target per address it resolves to; itself when it resolves to one), or any other
    gRPC target (itself)."""
    if not isinstance(target, str):
        out = [t for one in target for t in resolve(one)]
        if not out:
            raise ValueError("the target list is empty: name at least one daemon")
        return out
    if not target.startswith("dns:"):
        return [target]
    host, port = _dns_host_port(target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"{target}: {host} does not resolve ({e})") from None
    addrs = sorted({(fam, sa[0]) for fam, _, _, _, sa in infos})
    if len(addrs) == 1:
        return [target]
    return [f"ipv6:[{a}]:{port}" if fam == socket.AF_INET6 else f"ipv4:{a}:{port}" for fam, a in addrs]


def _dns_host_port(target: str) -> Tuple[str, int]:
    """host and port of "dns:///host:port", "dns://authority/host:port" or "dns:host:port" (gRPC's
    default port, 443, when none is given)."""
    rest = target[4:]
    if rest.startswith("//"):
        rest = rest[2:].partition("/")[2]
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port = rest.rpartition(":") if rest.count(":") == 1 else (rest, "", "")
    if not host:
        raise ValueError(f"{target}: no host name (use dns:///NAME:PORT)")
    try:
        return host, int(port) if port else 443
    except ValueError:
        raise ValueError(f"{target}: port {port!r} is not a number") from None


def is_fleet(target: Any) -> bool:
    """Whether MoEClient(target) is a fleet client: a list or tuple of targets, or a "dns:" name
    that resolves to several addresses. A lone name that does not resolve (now) makes a plain
    client, whose calls report UNAVAILABLE as gRPC finds it."""
    if not isinstance(target, str):
        return True
    try:
        return target.startswith("dns:") and len(resolve(target)) > 1
    except ValueError:
        return False


def _inline(transport: str) -> str:
    """A fleet sends its tensors inline: it keeps no region session with its daemons (auto means
    inline here)."""
    if transport not in ("auto", "inline"):
        raise ValueError(f"transport={transport!r}: a fleet client sends tensors inline (auto or "
                         f"inline); shm and cuda need one daemon on this host")
    return "inline"


class Names:
    """The "dns:" names among a fleet's targets. Pods behind a name come back at new addresses, so
    the name is resolved again (at most every RESOLVE_EVERY seconds) when a call finds a shard with
    no daemon answering: new addresses join the fleet, vanished ones leave it."""

    def __init__(self, target: Any):
        leaves = [target] if isinstance(target, str) else [t for one in target for t in _leaves(one)]
        self.names = [t for t in leaves if t.startswith("dns:")]
        self.at = time.monotonic()

    def due(self, now: float) -> bool:
        return bool(self.names) and now >= self.at + RESOLVE_EVERY

    def addresses(self) -> List[str]:
        self.at = time.monotonic()
        out = []
        for n in self.names:
            try:
                out += resolve(n)
            except ValueError:  # a name that does not resolve now holds nobody
                pass
        return out


def _leaves(target: Any) -> List[str]:
    return [target] if isinstance(target, str) else [t for one in target for t in _leaves(one)]


def ranges_text(ranges: Sequence[Tuple[int, int]]) -> str:
    """[(0, 3), (6, 6)] as "0-3,6"."""
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


# ---- what the fleet holds ---------------------------------------------------------------------

class Member:
    """One daemon of the fleet: its own single-daemon client and what this client knows of it."""

    def __init__(self, target: str, client: Any):
        self.target, self.client = target, client
        self.info: Optional[ModelInfo] = None  # GetModel's answer
        self.error = "not asked yet"  # what went wrong last (for messages)
        self.check = False  # failed since GetModel answered: ask again before its next call
        self.probe: Any = None  # the GetModel on its way, if one is
        self.outstanding = 0  # calls from this client in flight
        self.down_until = 0.0  # passed over until then (time.monotonic())
        self.down_for = 0.0  # how long it was passed over the last time
        self.named = False  # one of the addresses of a "dns:" name (Names)
        self.retired = False  # its name no longer resolves to it: out of the fleet
        self.foreign = False  # it serves another model than the fleet's: left out
        self.heard = False  # its GetModel answered, or failed, at least once

    def layer(self, index: int) -> Optional[LayerInfo]:
        if self.info is None:
            return None
        return next((li for li in self.info.layers if li.index == index), None)

    def state(self) -> str:
        return f"{self.target} ({self.error})"


@dataclass
class Shard:
    """The daemons holding the same experts of one layer (replicas), lowest expert first."""

    layer: int
    ranges: Tuple[Tuple[int, int], ...]
    adds_shared: bool
    members: List[Member]
    fingerprint: int = 0  # the fleet's model (0: not known)
    turn: int = 0  # rotates ties between replicas
    _expect: Optional[bytes] = field(default=None, repr=False, compare=False)

    @property
    def lowest(self) -> int:
        return self.ranges[0][0]

    @property
    def expect(self) -> bytes:
        """ForwardRequest.expect for this shard's daemons, encoded (a request's bytes plus these
        are the request with it)."""
        if self._expect is None:
            self._expect = wire.encode("moed.v1.ForwardRequest", {"expect": {
                "model_fingerprint": self.fingerprint, "adds_shared_experts": self.adds_shared,
                "experts_held": [{"first": a, "last": b} for a, b in self.ranges]}})
        return self._expect

    def holds(self, m: Member) -> bool:
        """Whether m (still) holds this shard: it may have come back with other experts."""
        li = m.layer(self.layer)
        return (li is not None and not m.retired and not m.foreign
                and (tuple(li.experts_held), li.adds_shared_experts) == (self.ranges, self.adds_shared))

    def describe(self) -> str:
        return f"experts {ranges_text(self.ranges)} on {', '.join(m.target for m in self.members)}"


@dataclass
class FleetMember:
    """What fleet clients' members() return: a daemon, its ModelInfo (None if it did not answer
    GetModel) and what went wrong last."""

    target: str
    info: Optional[ModelInfo]
    error: str = ""


def _precondition(msg: str) -> MoEError:
    return MoEError("FAILED_PRECONDITION", msg, grpc.StatusCode.FAILED_PRECONDITION)


def _unavailable(msg: str, attempts: int = 1) -> MoEError:
    return MoEError("UNAVAILABLE", msg, _UNAVAILABLE, attempts)


class Fleet:
    """The members and, per layer, its shards; the choice of replicas. No I/O: the clients ask
    GetModel and make the calls, and tell the fleet what came of them. Thread-safe."""

    def __init__(self, members: List[Member]):
        self.members = members
        self.fingerprint = 0  # the fleet's model, once every daemon was asked and they agreed
        self._lock = threading.Lock()
        self._plans: Dict[int, List[Shard]] = {}
        self._recheck_at = 0.0  # while a plan fails: when every member is asked GetModel again
        self._recheck_for = 0.0

    def to_probe(self, members: Sequence[Member], now: float) -> List[Member]:
        """Of these, the members whose GetModel is to be asked now: never answered, failed since,
        or any while a plan fails and it is time to ask again; not marked down, not being asked
        already."""
        with self._lock:
            again = bool(self._recheck_at) and now >= self._recheck_at
            if again:
                self._recheck(now)
            return [m for m in members if (m.info is None or m.check or again) and m.down_until <= now
                    and m.probe is None and not m.retired]

    def asking(self, m: Member, probe: Any) -> bool:
        """Records that `probe` asks m's GetModel; False if another is on its way already."""
        with self._lock:
            if m.probe is not None:
                return False
            m.probe = probe
            return True

    def probed(self, m: Member, probe: Any, info: Optional[ModelInfo], error: str, now: float) -> None:
        """What `probe` (m's GetModel) came to: an answer, or (info None) why none came, which marks
        m down. Only the first report of a probe counts."""
        with self._lock:
            if m.probe is not probe:
                return
            first, m.probe, m.heard = not m.heard, None, True
            if info is None:
                m.error = error
                self._down(m, now)
                if first and not self.fingerprint:
                    self._plans.clear()  # the fleet's model may have waited on this one
                return
            fp = info.model_fingerprint
            foreign = bool(self.fingerprint and fp and fp != self.fingerprint)
            if m.info is None or _holdings(m.info) != _holdings(info) or foreign != m.foreign:
                self._plans.clear()
            # one serving another model is asked again (0.5 s doubling to 5 s) until it serves ours
            m.info, m.check, m.foreign = info, foreign, foreign
            m.error = (f"serves another model: fingerprint {fp:016x}, the fleet's is {self.fingerprint:016x}"
                       if foreign else "answering")
            if foreign:
                self._down(m, now)

    def unsettled(self) -> bool:
        """Whether the fleet's model waits on a daemon never asked yet (calls wait for its
        GetModel: a daemon of another model must refuse the fleet before any call is answered)."""
        with self._lock:
            return not self.fingerprint and not all(m.heard or m.retired for m in self.members)

    def plan(self, layer: int) -> Tuple[Optional[List[Shard]], Optional[MoEError]]:
        """The layer's shards, or the gap that stands in the way (asking GetModel again may close
        it); a configuration error is raised."""
        with self._lock:
            if layer not in self._plans:
                try:
                    fingerprint = self.fingerprint or _one_model(self.members)
                    if all(m.heard or m.retired for m in self.members):
                        self.fingerprint = fingerprint  # pinned once every daemon was asked
                    shards, err = _plan(layer, self.members, fingerprint)
                except MoEError:
                    self._stale(time.monotonic())
                    raise
                if shards is None:
                    self._stale(time.monotonic())
                    return None, err
                self._plans[layer] = shards
                self._recheck_at = self._recheck_for = 0.0
            return self._plans[layer], None

    def pick(self, shard: Shard, tried: Sequence[Member], now: float) -> Optional[Member]:
        """The replica for the next attempt: still holding the shard, not tried in this round, not
        marked down, not to be checked, fewest calls outstanding (ties in turn); it counts as
        outstanding until done(). None when none is left."""
        with self._lock:
            free = [m for m in shard.members
                    if m not in tried and m.down_until <= now and not m.check and shard.holds(m)]
            if not free:
                return None
            shard.turn += 1
            n = len(free)
            m = min((free[(shard.turn + i) % n] for i in range(n)), key=lambda x: x.outstanding)
            m.outstanding += 1
            return m

    def to_check(self, shard: Shard, tried: Sequence[Member], now: float) -> List[Member]:
        """The shard's replicas that failed before and may be asked GetModel again now."""
        with self._lock:
            return [m for m in shard.members if m not in tried and m.check and m.down_until <= now
                    and m.probe is None and not m.retired]

    def done(self, m: Member, code: Optional[grpc.StatusCode], details: str, now: float) -> None:
        """An attempt on m ended with `code` (None: OK); UNAVAILABLE marks it down, to be checked;
        FAILED_PRECONDITION (m is not what the request expected) marks it to be checked."""
        with self._lock:
            m.outstanding -= 1
            if code is None:
                m.down_for = 0.0
            elif code in (_UNAVAILABLE, _REFUSED):
                m.error, m.check = f"{code.name}: {details}", True
                if code == _UNAVAILABLE:
                    self._down(m, now)

    def regroup(self, addresses: Sequence[str], make) -> bool:
        """The addresses a fleet's "dns:" names resolve to now: members for the new ones (made by
        make(target)), the named members not among them retired. True when anything changed."""
        with self._lock:
            have = {m.target for m in self.members if not m.retired}
            new = [Member(t, make(t)) for t in dict.fromkeys(addresses) if t not in have]
            for m in new:
                m.named = True
            gone = [m for m in self.members if m.named and not m.retired and m.target not in addresses]
            for m in gone:
                m.retired = True
            self.members.extend(new)
            if new or gone:
                self._plans.clear()
            return bool(new or gone)

    def revive(self, shard: Shard, now: float) -> None:
        """A new round of attempts: the shard's replicas marked down get their chance again."""
        with self._lock:
            for m in shard.members:
                m.down_until = min(m.down_until, now)

    def _down(self, m: Member, now: float) -> None:
        m.down_for = min(max(2 * m.down_for, DOWN_MIN), DOWN_MAX)
        m.down_until = now + m.down_for

    def _stale(self, now: float) -> None:
        """A plan failed: every member is asked GetModel again, first after DOWN_MIN."""
        if not self._recheck_at:
            self._recheck_for = 0.0
            self._recheck(now)

    def _recheck(self, now: float) -> None:
        self._recheck_for = min(max(2 * self._recheck_for, DOWN_MIN), DOWN_MAX)
        self._recheck_at = now + self._recheck_for


def _holdings(info: ModelInfo) -> Any:
    return (info.model_fingerprint,
            [(li.index, tuple(li.experts_held), li.adds_shared_experts) for li in info.layers])


def _one_model(members: Sequence[Member]) -> int:
    """The model the members that answered serve (0: none said); FAILED_PRECONDITION naming each
    of them when they differ."""
    members = [m for m in members if not m.retired]
    fps = {m.info.model_fingerprint for m in members if m.info is not None and m.info.model_fingerprint}
    if len(fps) > 1:
        said = "; ".join(f"{m.target} (fingerprint {m.info.model_fingerprint:016x})" for m in members
                         if m.info is not None and m.info.model_fingerprint)
        raise _precondition(f"the fleet's daemons serve different models: {said}; a fleet serves one "
                            f"model (ModelInfo.model_fingerprint)")
    return next(iter(fps), 0)


def _plan(layer: int, members: Sequence[Member],
          fingerprint: int = 0) -> Tuple[Optional[List[Shard]], Optional[MoEError]]:
    """Groups the members holding `layer` into shards and checks them (see the module's text);
    fingerprint: the fleet's model (0: not known), which members left out as foreign do not
    serve."""
    members = [m for m in members if not m.retired]
    foreign = [m for m in members if m.foreign]
    members = [m for m in members if not m.foreign]
    holders = [(m, m.layer(layer)) for m in members]
    holders = [(m, li) for m, li in holders if li is not None]
    if not holders:
        return None, _foreign_gap(layer, "all", foreign, fingerprint) if foreign else _not_served(layer, members)
    first_m, first = holders[0]
    for m, li in holders[1:]:
        for f in _SAME:
            if getattr(li, f) != getattr(first, f):
                raise _precondition(f"layer {layer} differs between {first_m.target} and {m.target}: "
                                    f"{f} {getattr(first, f)} against {getattr(li, f)}; a fleet "
                                    f"serves one model")
    groups: Dict[Tuple[Any, bool], Shard] = {}
    for m, li in holders:
        key = (tuple(li.experts_held), li.adds_shared_experts)
        groups.setdefault(key, Shard(layer, key[0], key[1], [], fingerprint)).members.append(m)
    shards = sorted(groups.values(), key=lambda s: s.lowest)
    owner: Dict[int, Shard] = {}
    for s in shards:
        for a, b in s.ranges:
            for e in range(a, b + 1):
                if e in owner:
                    raise _precondition(f"layer {layer}: expert {e} is held both by "
                                        f"{owner[e].describe()} and by {s.describe()}: a fleet's "
                                        f"expert shards must be disjoint (replicas hold the same "
                                        f"experts and the same shared-experts role)")
                owner[e] = s
    missing = [e for e in range(first.num_experts) if e not in owner]
    if missing:
        runs = ranges_text(_runs(missing))
        return None, _foreign_gap(layer, runs, foreign, fingerprint) if foreign else _gap(layer, runs, members)
    adders = [s for s in shards if s.adds_shared]
    if first.num_shared_experts and len(adders) != 1:
        what = ("no shard adds them: start the one holding expert 0 with --shared-experts auto or "
                "on" if not adders else
                "several shards add them: " + "; ".join(s.describe() for s in adders))
        raise _precondition(f"layer {layer} has {first.num_shared_experts} shared expert(s), and "
                            f"exactly one expert shard must add them; {what}")
    return shards, None


def _members_text(members: Sequence[Member]) -> str:
    out = []
    for m in members:
        if m.info is None or m.foreign:
            out.append(m.state())
        else:
            held = [f"{li.index}:{ranges_text(li.experts_held)}" for li in m.info.layers]
            out.append(f"{m.target} (layer:experts {' '.join(held)})")
    return "; ".join(out)


def _not_served(layer: int, members: Sequence[Member]) -> MoEError:
    if any(m.info is None for m in members):
        return _unavailable(f"layer {layer} is held by no reachable daemon of the fleet; targets "
                            f"tried: {_members_text(members)}")
    return MoEError("NOT_FOUND", f"layer {layer} is not served by the fleet: {_members_text(members)}",
                    grpc.StatusCode.NOT_FOUND)


def _runs(experts: Sequence[int]) -> List[Tuple[int, int]]:
    """Increasing expert numbers as ranges."""
    runs: List[Tuple[int, int]] = []
    for e in experts:
        if runs and runs[-1][1] == e - 1:
            runs[-1] = (runs[-1][0], e)
        else:
            runs.append((e, e))
    return runs


def _gap(layer: int, runs: str, members: Sequence[Member]) -> MoEError:
    return _unavailable(f"layer {layer}: experts {runs} are held by no reachable daemon of the fleet; "
                        f"targets tried: {_members_text(members)}")


def _foreign_gap(layer: int, runs: str, foreign: Sequence[Member], fingerprint: int) -> MoEError:
    return _precondition(f"layer {layer}: experts {runs} are held by no daemon serving the fleet's model "
                         f"(fingerprint {fingerprint:016x}): {'; '.join(m.state() for m in foreign)}")


# ---- adding the partial outputs -----------------------------------------------------------------

def _widen(t: Dict[str, Any]) -> np.ndarray:
    """A reply's output Tensor as float32 (exact for every hidden dtype)."""
    a = wire_view(t["data"], t["dtype"], t["shape"])
    if t["dtype"] == BF16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _narrow(acc: np.ndarray, wire: int) -> np.ndarray:
    """float32 values rounded once (to nearest, ties to even) to the wire dtype's numpy type."""
    if wire == BF16:
        bits = acc.view(np.uint32)
        r = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(acc), np.uint16(0x7FC0), r).astype(WIRE_NP[BF16])
    with np.errstate(over="ignore"):  # past f16's range: inf, as rounding says
        return acc.astype(WIRE_NP[wire])


def combine(call: C.Call, replies: Sequence[bytes]) -> Any:
    """The output of a call from its shards' replies, in shard order (lowest expert first)."""
    if len(replies) == 1:
        return call.result(replies[0])
    inp = call.prepared.input
    decoded = [C.decode("moed.v1.ForwardResponse", r) for r in replies]
    acc = None
    for r in decoded:
        part = _widen(C.check_output(r["output"], inp.wire, inp.shape))
        acc = part.copy() if acc is None else np.add(acc, part, out=acc)
    out = {"dtype": inp.wire, "shape": list(inp.shape), "data": memoryview(_narrow(acc, inp.wire).tobytes())}
    y = call.prepared.finish(out, call.copy)
    if not call.return_info:
        return y
    slowest = max(decoded, key=lambda r: (r["timings"] or {}).get("total_us", 0))
    t = slowest["timings"] or wire.new("moed.v1.Timings")
    return ForwardResult(output=y, expert_set=np.array(slowest["expert_set"], dtype=np.int32),
                         timings=Timings(t["queue_us"], t["compute_us"], t["total_us"],
                                         t["batch_tokens"], t["batch_requests"]),
                         request_id=slowest["request_id"])


def merged_info(members: Sequence[Member]) -> ModelInfo:
    """One ModelInfo for the fleet: every layer once, with the experts the reachable daemons hold
    between them; the smallest limits; every device."""
    known = [m.info for m in members if m.info is not None and not m.retired and not m.foreign]
    if not known:
        raise _unavailable(f"no daemon of the fleet answered GetModel: {_members_text(members)}")
    layers: Dict[int, LayerInfo] = {}
    held: Dict[int, set] = {}
    for info in known:
        for li in info.layers:
            layers.setdefault(li.index, li)
            held.setdefault(li.index, set()).update(e for a, b in li.experts_held for e in range(a, b + 1))
    out = []
    for index in sorted(layers):
        runs: List[Tuple[int, int]] = []
        for e in sorted(held[index]):
            runs = runs[:-1] + [(runs[-1][0], e)] if runs and runs[-1][1] == e - 1 else runs + [(e, e)]
        li = layers[index]
        out.append(LayerInfo(**{**li.__dict__, "experts_held": runs, "adds_shared_experts": True}))
    return ModelInfo(model=known[0].model, layers=out,
                     backend=",".join(sorted({i.backend for i in known})),
                     devices=[d for i in known for d in i.devices], version=known[0].version,
                     max_message_bytes=min(i.max_message_bytes for i in known),
                     max_batch_tokens=min(i.max_batch_tokens for i in known),
                     model_fingerprint=known[0].model_fingerprint)


def _try_plan(fleet: Fleet, layer: int) -> Tuple[Optional[List[Shard]], Optional[MoEError]]:
    """fleet.plan(layer), its configuration errors returned too (GetModel asked again may clear
    them)."""
    try:
        return fleet.plan(layer)
    except MoEError as e:
        return None, e


def _check_batch_gating(layer: int, shards: List[Shard], batch_gating: bool) -> None:
    if batch_gating and len(shards) > 1:
        raise _precondition(f"batch_gating needs one daemon holding every expert of layer {layer}, "
                            f"but this fleet splits them over {len(shards)} shards ("
                            f"{'; '.join(s.describe() for s in shards)}): the expert set would be "
                            f"chosen over a different merged batch on each")


def _exhausted(shard: Shard, rounds: int) -> MoEError:
    return _unavailable(f"layer {shard.layer}: no replica of {shard.describe()} answered: "
                        f"{'; '.join(m.state() for m in shard.members)}", rounds)


def _refused(shard: Shard) -> MoEError:
    return _precondition(f"layer {shard.layer}: no replica of {shard.describe()} is what the fleet took "
                         f"it for: {'; '.join(m.state() for m in shard.members)}")


class _Try:
    """One shard's part of a call: its request (the call's, with the shard's expect), the attempt
    in flight, the replicas tried in this round and what came of them."""

    def __init__(self, shard: Shard, payload: bytes):
        self.shard = shard
        self.payload = payload + shard.expect
        self.member: Optional[Member] = None
        self.attempt: Any = None  # a grpc future (blocking client) or task (asyncio)
        self.tried: List[Member] = []
        self.rounds = 1
        self.started = 0.0  # when the attempt in flight started
        self.took = 0.0  # how long this round's last attempt took (0: none was made)
        self.refused = False  # a replica refused it in this round (FAILED_PRECONDITION)

    def failed(self, fleet: "Fleet", e: grpc.RpcError) -> None:
        """The attempt in flight failed: recorded; raised unless another replica may answer."""
        now = time.monotonic()
        fleet.done(self.member, e.code(), e.details(), now)
        if e.code() not in (_UNAVAILABLE, _REFUSED):
            raise C.rpc_error(e) from None
        self.refused |= e.code() == _REFUSED
        self.tried.append(self.member)
        self.took, self.attempt = now - self.started, None

    def next_round(self, retry: RetryPolicy, deadline: Optional[float]) -> float:
        """No replica is left in this round: the wait before the next (the retry policy's, after
        UNAVAILABLE), or the call's error raised."""
        if self.refused:
            raise _refused(self.shard)
        now = time.monotonic()
        wait = retry.delay(self.rounds, _UNAVAILABLE, now, deadline, self.took)
        if wait is None:
            raise _exhausted(self.shard, self.rounds)
        self.rounds, self.tried, self.took = self.rounds + 1, [], 0.0
        return wait


# A member's channel retries its connection on the fleet's schedule (gRPC's default starts at 1 s
# and grows to 120 s: a daemon back would go unnoticed for that long).
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", int(DOWN_MIN * 1000)),
              ("grpc.min_reconnect_backoff_ms", int(DOWN_MIN * 1000)),
              ("grpc.max_reconnect_backoff_ms", int(DOWN_MAX * 1000))]


def _member_kwargs(target: str, original: Any, kw: Dict[str, Any]) -> Dict[str, Any]:
    """A member's client arguments: the fleet client's (its channel options after the reconnect
    schedule, so they win), without retries (the fleet retries across replicas), with TLS checking
    the DNS name when the member is one of its addresses."""
    kw = {**kw, "retry": NO_RETRY, "timeout": None, "options": [*_RECONNECT, *(kw.get("options") or ())]}
    if (kw.get("credentials") is not None and isinstance(original, str) and original.startswith("dns:")
            and target != original):
        host = _dns_host_port(original)[0]
        kw["options"] = [("grpc.ssl_target_name_override", host), *(kw.get("options") or ())]
    return kw


def _members(target: Any, make) -> List[Member]:
    """The fleet's members, one per daemon the target names; those from "dns:" names marked."""
    out = []
    for leaf in _leaves(target):
        for t in resolve(leaf):
            out.append(Member(t, make(t)))
            out[-1].named = leaf.startswith("dns:")
    return out


class _Replan(Exception):
    """The fleet changed (its names resolved to other daemons) while a call was on its way."""


def _stream_items(requests: Iterable[dict]) -> Iterator[dict]:
    """forward_stream()'s items, checked as a single daemon's stream checks them."""
    for item in requests:
        C.check_item(item)
        yield item


# ---- the blocking fleet client ------------------------------------------------------------------

class FleetClient(MoEClient):
    """moed.MoEClient over several daemons (see the module's text); MoEClient(targets) makes one.
    It makes no threads: calls and GetModel probes are gRPC futures."""

    def __init__(self, target: Any = "127.0.0.1:50051", timeout: Optional[float] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None, token: Optional[str] = None,
                 options: Optional[Sequence[Tuple[str, Any]]] = None, keepalive: Optional[float] = None,
                 retry: Optional[RetryPolicy] = RetryPolicy(), transport: str = "auto"):
        kw = dict(credentials=credentials, token=token, options=options, keepalive=keepalive,
                  transport=transport)
        self.target, self.timeout, self.retry, self.transport = target, timeout, retry or NO_RETRY, transport
        self._make = lambda t: MoEClient(t, **_member_kwargs(t, target, kw))
        self._names = Names(target)
        self.fleet = Fleet(_members(target, self._make))

    def close(self) -> None:
        for m in self.fleet.members:
            m.client.close()

    def _regroup(self) -> bool:
        """The "dns:" names resolved again, when due; True when the fleet changed."""
        return self._names.due(time.monotonic()) and self.fleet.regroup(self._names.addresses(), self._make)

    # -- learning the fleet --

    def _probe(self, members: Sequence[Member]) -> List[Tuple[Member, Any]]:
        """Asks these members' GetModel (as fleet.to_probe chose them): the probes, which record
        their answers when they come."""
        probes = []
        for m in members:
            f = m.client._get_model.future(b"", timeout=PROBE_TIMEOUT, metadata=m.client._metadata)
            if not self.fleet.asking(m, f):
                f.cancel()
                continue
            f.add_done_callback(lambda f, m=m: self._probed(m, f))
            probes.append((m, f))
        return probes

    def _probed(self, m: Member, f) -> None:
        """Records what a finished probe came to (from its callback, or from _wait: once)."""
        now = time.monotonic()
        try:
            self.fleet.probed(m, f, C.model_info(f.result()), "", now)
        except grpc.RpcError as e:
            self.fleet.probed(m, f, None, f"{e.code().name}: {e.details()}", now)
        except (MoEError, grpc.FutureCancelledError) as e:
            self.fleet.probed(m, f, None, str(e), now)

    def _wait(self, probes: Sequence[Tuple[Member, Any]], deadline: Optional[float]) -> None:
        """Waits for probes (up to PROBE_TIMEOUT and the deadline) and records those that ended."""
        end = time.monotonic() + _probe_wait(deadline)
        for m, f in probes:
            try:
                f.result(timeout=max(0.0, end - time.monotonic()))
            except Exception:  # what it came to is recorded below
                pass
            if f.done():
                self._probed(m, f)

    def _learn(self, members: Sequence[Member], deadline: Optional[float]) -> None:
        """GetModel of those of these members that need it (and those being asked), waited for."""
        probes = self._probe(self.fleet.to_probe(members, time.monotonic()))
        probes += [(m, m.probe) for m in members if m.probe is not None and (m, m.probe) not in probes]
        self._wait(probes, deadline)

    def _shards(self, layer: int, deadline: Optional[float]) -> List[Shard]:
        """The layer's shards. Members that need GetModel are asked in the background; the call
        waits for them only when the layer cannot be planned now (asking again may put it right)."""
        self._probe(self.fleet.to_probe(self.fleet.members, time.monotonic()))
        if self.fleet.unsettled():
            self._learn(self.fleet.members, deadline)
        shards, err = _try_plan(self.fleet, layer)
        if err is not None:
            self._regroup()
            self._learn(self.fleet.members, deadline)
            shards, err = self.fleet.plan(layer)
        if err is not None:
            raise err
        return shards

    # -- calls --

    def _begin(self, t: _Try, deadline: Optional[float]) -> bool:
        """Starts t's next attempt; False when no replica is left in this round."""
        while True:
            now = time.monotonic()
            m = self.fleet.pick(t.shard, t.tried, now)
            if m is not None:
                break
            probes = self._probe(self.fleet.to_check(t.shard, t.tried, now))
            if not probes:
                return False
            self._wait(probes, deadline)
        t.member, t.started = m, now
        t.attempt = m.client._forward.future(t.payload, timeout=C.remaining(deadline),
                                             metadata=m.client._metadata)
        return True

    def _finish(self, t: _Try, deadline: Optional[float]) -> bytes:
        """t's reply: its attempt waited for, other replicas (and rounds of them) tried on
        UNAVAILABLE or a refusal."""
        while True:
            if t.attempt is not None:
                try:
                    reply = t.attempt.result()
                    self.fleet.done(t.member, None, "", time.monotonic())
                    return reply
                except grpc.RpcError as e:
                    t.failed(self.fleet, e)
            if self._begin(t, deadline):
                continue
            if self._regroup():
                raise _Replan()
            time.sleep(t.next_round(self.retry, deadline))
            self.fleet.revive(t.shard, time.monotonic())

    def forward(self, layer: int, hidden: Any, *, expert_ids=None, expert_weights=None,
                router_logits=None, strategy=None, top_k: int = 0, renormalize: Optional[bool] = None,
                threshold: Optional[float] = None, batch_gating: bool = False, k_batch: int = 0,
                dtype: Optional[str] = None, request_id: str = "", return_info: bool = False,
                copy: bool = False, transport: Optional[str] = None, timeout: Optional[float] = None):
        """moed.MoEClient.forward over the fleet."""
        call = C.now(C.prepare_forward(layer, hidden, expert_ids=expert_ids, expert_weights=expert_weights,
                                       router_logits=router_logits, strategy=strategy, top_k=top_k,
                                       renormalize=renormalize, threshold=threshold,
                                       batch_gating=batch_gating, k_batch=k_batch, dtype=dtype,
                                       request_id=request_id, return_info=return_info, copy=copy,
                                       transport=_inline(transport or self.transport)))
        deadline = self._deadline(timeout)
        try:
            return self._fan_out(layer, call, batch_gating, deadline)
        except _Replan:  # the fleet changed under the call: once more on its new plan
            return self._fan_out(layer, call, batch_gating, deadline)

    def _fan_out(self, layer: int, call: C.Call, batch_gating: bool, deadline: Optional[float]) -> Any:
        shards = self._shards(layer, deadline)
        _check_batch_gating(layer, shards, batch_gating)
        tries = [_Try(s, call.payload) for s in shards]
        try:
            for t in tries:
                self._begin(t, deadline)
            return combine(call, [self._finish(t, deadline) for t in tries])
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
        for item in _stream_items(requests):
            yield self.forward(**{"transport": transport, **item, "timeout": C.remaining(deadline)})

    def info(self, timeout: Optional[float] = None) -> ModelInfo:
        """The fleet's ModelInfo (see merged_info); members() has each daemon's."""
        self._learn(self.fleet.members, self._deadline(timeout))
        return merged_info(self.fleet.members)

    def members(self, timeout: Optional[float] = None) -> List[FleetMember]:
        """Each daemon of the fleet, with its GetModel (asked now where it was not answered)."""
        self._learn(self.fleet.members, self._deadline(timeout))
        return [FleetMember(m.target, m.info, m.error) for m in self.fleet.members]

    def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        """SERVING when every layer the fleet serves has every expert on a SERVING daemon."""
        deadline = self._deadline(timeout)
        self._learn(self.fleet.members, deadline)
        futures = [m.client._health.future(C.health_request(service), timeout=_probe_wait(deadline),
                                           metadata=m.client._metadata) for m in self.fleet.members]
        status = {}
        for m, f in zip(self.fleet.members, futures):
            try:
                status[m.target] = C.health_status(f.result())
            except (grpc.RpcError, MoEError):
                status[m.target] = "UNKNOWN"
        return fleet_health(self.fleet.members, status, self.fleet.fingerprint)


def _probe_wait(deadline: Optional[float]) -> float:
    """How long to wait for GetModel answers: PROBE_TIMEOUT, or less as the deadline says."""
    return PROBE_TIMEOUT if deadline is None else min(PROBE_TIMEOUT, C.remaining(deadline))


def fleet_health(members: Sequence[Member], status: Dict[str, str], fingerprint: int) -> str:
    serving = [m for m in members if status.get(m.target) == "SERVING"]
    layers = {li.index for m in members if m.info for li in m.info.layers}
    if not layers or not serving:
        return "NOT_SERVING"
    try:
        ok = all(_plan(layer, serving, fingerprint)[0] is not None for layer in layers)
    except MoEError:
        ok = False
    return "SERVING" if ok else "NOT_SERVING"


# ---- the asyncio fleet client -------------------------------------------------------------------

class AioFleetClient(aio.MoEClient):
    """moed.aio.MoEClient over several daemons: FleetClient's behaviour, awaited; the shards of a
    call run as tasks. moed.aio.MoEClient(targets) makes one, in the running event loop."""

    def __init__(self, target: Any = "127.0.0.1:50051", timeout: Optional[float] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None, token: Optional[str] = None,
                 options: Optional[Sequence[Tuple[str, Any]]] = None, keepalive: Optional[float] = None,
                 retry: Optional[RetryPolicy] = RetryPolicy(), transport: str = "auto"):
        kw = dict(credentials=credentials, token=token, options=options, keepalive=keepalive,
                  transport=transport)
        self.target, self.timeout, self.retry, self.transport = target, timeout, retry or NO_RETRY, transport
        self._make = lambda t: aio.MoEClient(t, **_member_kwargs(t, target, kw))
        self._names = Names(target)
        self.fleet = Fleet(_members(target, self._make))

    async def close(self) -> None:
        for m in self.fleet.members:
            await m.client.close()

    async def _regroup(self) -> bool:
        if not self._names.due(time.monotonic()):
            return False
        addresses = await asyncio.get_running_loop().run_in_executor(None, self._names.addresses)
        return self.fleet.regroup(addresses, self._make)

    # -- learning the fleet --

    def _probe(self, members: Sequence[Member]) -> List[asyncio.Future]:
        probes = []
        for m in members:
            task = asyncio.ensure_future(self._ask(m))
            if not self.fleet.asking(m, task):
                task.cancel()
                continue
            probes.append(task)
        return probes

    async def _ask(self, m: Member) -> None:
        """One probe: m's GetModel, recorded when it comes (the task is the probe)."""
        me = asyncio.current_task()  # _probe recorded it as m's probe before it first runs
        try:
            reply = await m.client._get_model(b"", timeout=PROBE_TIMEOUT, metadata=m.client._metadata)
            self.fleet.probed(m, me, C.model_info(reply), "", time.monotonic())
        except grpc.RpcError as e:
            self.fleet.probed(m, me, None, f"{e.code().name}: {e.details()}", time.monotonic())
        except MoEError as e:
            self.fleet.probed(m, me, None, str(e), time.monotonic())
        except asyncio.CancelledError:
            self.fleet.probed(m, me, None, "GetModel cancelled", time.monotonic())
            raise

    async def _learn(self, members: Sequence[Member], deadline: Optional[float]) -> None:
        probes = self._probe(self.fleet.to_probe(members, time.monotonic()))
        probes += [m.probe for m in members if m.probe is not None and m.probe not in probes]
        if probes:
            await asyncio.wait(probes, timeout=_probe_wait(deadline))

    async def _shards(self, layer: int, deadline: Optional[float]) -> List[Shard]:
        self._probe(self.fleet.to_probe(self.fleet.members, time.monotonic()))
        if self.fleet.unsettled():
            await self._learn(self.fleet.members, deadline)
        shards, err = _try_plan(self.fleet, layer)
        if err is not None:
            await self._regroup()
            await self._learn(self.fleet.members, deadline)
            shards, err = self.fleet.plan(layer)
        if err is not None:
            raise err
        return shards

    # -- calls --

    async def _begin(self, t: _Try, deadline: Optional[float]) -> bool:
        while True:
            now = time.monotonic()
            m = self.fleet.pick(t.shard, t.tried, now)
            if m is not None:
                break
            probes = self._probe(self.fleet.to_check(t.shard, t.tried, now))
            if not probes:
                return False
            await asyncio.wait(probes, timeout=_probe_wait(deadline))
        t.member, t.started = m, now
        t.attempt = asyncio.ensure_future(
            m.client._forward(t.payload, timeout=C.remaining(deadline), metadata=m.client._metadata))
        return True

    async def _finish(self, t: _Try, deadline: Optional[float]) -> bytes:
        while True:
            if t.attempt is not None:
                try:
                    reply = await t.attempt
                    self.fleet.done(t.member, None, "", time.monotonic())
                    return reply
                except grpc.RpcError as e:
                    t.failed(self.fleet, e)
            if await self._begin(t, deadline):
                continue
            if await self._regroup():
                raise _Replan()
            await asyncio.sleep(t.next_round(self.retry, deadline))
            self.fleet.revive(t.shard, time.monotonic())

    async def forward(self, layer: int, hidden: Any, *, expert_ids=None, expert_weights=None,
                      router_logits=None, strategy=None, top_k: int = 0,
                      renormalize: Optional[bool] = None, threshold: Optional[float] = None,
                      batch_gating: bool = False, k_batch: int = 0, dtype: Optional[str] = None,
                      request_id: str = "", return_info: bool = False, copy: bool = False,
                      transport: Optional[str] = None, timeout: Optional[float] = None):
        """moed.aio.MoEClient.forward over the fleet."""
        call = C.now(C.prepare_forward(layer, hidden, expert_ids=expert_ids, expert_weights=expert_weights,
                                       router_logits=router_logits, strategy=strategy, top_k=top_k,
                                       renormalize=renormalize, threshold=threshold,
                                       batch_gating=batch_gating, k_batch=k_batch, dtype=dtype,
                                       request_id=request_id, return_info=return_info, copy=copy,
                                       transport=_inline(transport or self.transport)))
        deadline = self._deadline(timeout)
        try:
            return await self._fan_out(layer, call, batch_gating, deadline)
        except _Replan:  # the fleet changed under the call: once more on its new plan
            return await self._fan_out(layer, call, batch_gating, deadline)

    async def _fan_out(self, layer: int, call: C.Call, batch_gating: bool,
                       deadline: Optional[float]) -> Any:
        shards = await self._shards(layer, deadline)
        _check_batch_gating(layer, shards, batch_gating)
        tries = [_Try(s, call.payload) for s in shards]
        try:
            for t in tries:
                await self._begin(t, deadline)
            replies = await asyncio.gather(*(self._finish(t, deadline) for t in tries))
            return combine(call, replies)
        except BaseException:
            for t in tries:
                if t.attempt is not None:
                    t.attempt.cancel()
            raise

    async def forward_stream(self, requests: Any, *, timeout: Optional[float] = None,
                             transport: Optional[str] = None) -> AsyncIterator[Any]:
        """moed.aio.MoEClient.forward_stream over the fleet: each request as forward() sends it."""
        deadline = self._deadline(timeout)
        if hasattr(requests, "__aiter__"):
            async for item in requests:
                C.check_item(item)
                yield await self.forward(**{"transport": transport, **item, "timeout": C.remaining(deadline)})
        else:
            for item in _stream_items(requests):
                yield await self.forward(**{"transport": transport, **item, "timeout": C.remaining(deadline)})

    async def info(self, timeout: Optional[float] = None) -> ModelInfo:
        await self._learn(self.fleet.members, self._deadline(timeout))
        return merged_info(self.fleet.members)

    async def members(self, timeout: Optional[float] = None) -> List[FleetMember]:
        await self._learn(self.fleet.members, self._deadline(timeout))
        return [FleetMember(m.target, m.info, m.error) for m in self.fleet.members]

    async def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        deadline = self._deadline(timeout)
        await self._learn(self.fleet.members, deadline)

        async def one(m: Member) -> str:
            try:
                return C.health_status(await m.client._health(
                    C.health_request(service), timeout=_probe_wait(deadline), metadata=m.client._metadata))
            except (grpc.RpcError, MoEError):
                return "UNKNOWN"

        found = await asyncio.gather(*(one(m) for m in self.fleet.members))
        return fleet_health(self.fleet.members, {m.target: st for m, st in zip(self.fleet.members, found)},
                            self.fleet.fingerprint)
