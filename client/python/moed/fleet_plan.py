"""A fleet's policy, with no I/O (moed.fleet says what a fleet does): what each daemon holds as the
fleet learnt it, the fleet's model, the shards of each layer and every reason one cannot be served,
when a daemon is asked GetModel again, the choice of replicas, what an attempt's failure does to its
daemon, which tokens of a call each shard gets, and the sum of the shards' partial outputs. The fleet clients (moed.fleet, moed.aio_fleet)
ask GetModel and make the calls, and tell the planner what came of them.

libmoedclient's moedc_plan is the same policy in C, and both are tested against one table of
scenarios (tests/data/fleet_scenarios.json): the texts of the errors are the same in both. Time is
passed in (time.monotonic() seconds).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from . import _common as C
from . import wire
from .retry import RetryPolicy
from .tensors import BF16, F32, I32, WIRE_NP, wire_tensor, wire_view
from .transport import known
from .types import ForwardResult, LayerInfo, ModelInfo, MoEError, Timings

# How long GetModel of one daemon may take (an address that no longer answers must not hold the
# caller for TCP's connect timeout).
PROBE_TIMEOUT = 5.0
# A daemon that never answered GetModel is asked again at most this often.
REPROBE = 1.0
# A daemon turned away is passed over for this long, doubling up to DOWN_MAX.
DOWN_MIN, DOWN_MAX = 0.5, 5.0
# "dns:" names are resolved again at most this often (when a call finds a shard unanswered).
RESOLVE_EVERY = 5.0
# LayerInfo fields every daemon holding part of a layer must agree on (moed.proto's names).
SAME = ("d_model", "d_ff", "num_experts", "top_k", "activation", "weight_dtype", "has_router",
        "norm_topk_prob", "router_rule", "num_shared_experts", "shared_d_ff", "n_group", "topk_group",
        "routed_scaling_factor", "sparse24")
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
REFUSED = grpc.StatusCode.FAILED_PRECONDITION


def precondition(msg: str) -> MoEError:
    return MoEError("FAILED_PRECONDITION", msg, REFUSED)


def unavailable(msg: str, attempts: int = 1) -> MoEError:
    return MoEError("UNAVAILABLE", msg, UNAVAILABLE, attempts)


def needs_one_daemon(what: str) -> MoEError:
    """What a region call (register, unregister; forward on transport shm or cuda) on a fleet
    raises."""
    return precondition(f"{what} needs a region session with one daemon on this host; this client is "
                        f"a fleet of several (its calls carry their tensors inline)")


def no_listing() -> MoEError:
    """What regions() on a fleet raises."""
    return precondition("ListRegions asks one daemon; this client is a fleet of several: ask a member "
                        "by its own target")


def inline(transport: str) -> str:
    """A fleet call's transport: auto and inline are inline; shm and cuda need one daemon."""
    if known(transport) not in ("auto", "inline"):
        raise needs_one_daemon(f"transport={transport!r}")
    return "inline"


def ranges_text(ranges: Sequence[Tuple[int, int]]) -> str:
    """[(0, 3), (6, 6)] as "0-3,6"."""
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def runs(experts: Sequence[int]) -> List[Tuple[int, int]]:
    """Increasing expert numbers as ranges."""
    out: List[Tuple[int, int]] = []
    for e in experts:
        if out and out[-1][1] == e - 1:
            out[-1] = (out[-1][0], e)
        else:
            out.append((e, e))
    return out


# ---- what the fleet holds ---------------------------------------------------------------------

class Member:
    """One daemon of the fleet: its own single-daemon client (what the fleet client made for it)
    and what the fleet knows of it."""

    def __init__(self, target: str, client: Any):
        self.target, self.client = target, client
        self.info: Optional[ModelInfo] = None  # GetModel's answer
        self.error = "not asked yet"  # what went wrong last (for messages)
        self.check = False  # failed since GetModel answered: ask again before its next call
        self.probe: Any = None  # the GetModel on its way, if one is
        self.outstanding = 0  # calls from this client in flight
        self.down_until = 0.0  # passed over until then
        self.down_for = 0.0  # how long it was passed over the last time
        self.asked_at = 0.0  # when its GetModel was last asked
        self.named = False  # one of the addresses of a "dns:" name
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
    num_experts: int = 0  # the layer's, as its daemons said when it was planned
    num_shared: int = 0  # the layer's shared experts
    turn: int = 0  # rotates ties between replicas
    _expect: Optional[bytes] = field(default=None, repr=False, compare=False)

    @property
    def adds_every_token(self) -> bool:
        """Whether its daemons add the shared experts, a term for every token."""
        return self.adds_shared and self.num_shared > 0

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
        li = None if m.retired or m.foreign else m.layer(self.layer)
        return li is not None and (tuple(li.experts_held), li.adds_shared_experts) == (self.ranges, self.adds_shared)

    def describe(self) -> str:
        return f"experts {ranges_text(self.ranges)} on {', '.join(m.target for m in self.members)}"


@dataclass
class FleetMember:
    """What fleet clients' members() return: a daemon, its ModelInfo (None if it did not answer
    GetModel) and what went wrong last."""

    target: str
    info: Optional[ModelInfo]
    error: str = ""


def down(m: Member, now: float) -> None:
    """Passes m over for DOWN_MIN, doubling each time to DOWN_MAX."""
    m.down_for = min(max(2 * m.down_for, DOWN_MIN), DOWN_MAX)
    m.down_until = now + m.down_for


def to_ask(m: Member, again: bool, now: float) -> bool:
    """Whether m is to be asked GetModel now: never answered (at most every REPROBE), turned a call
    away since, or `again`; never while it is passed over."""
    return ((m.info is None or m.check or again) and not m.retired and now >= m.down_until
            and now >= m.asked_at + (REPROBE if m.info is None else 0.0))


def choose(shard: Shard, tried: Sequence[Member], turn: int, now: float) -> Optional[Member]:
    """The replica for an attempt of the shard: not tried, not to be asked GetModel first, still
    holding the shard, not passed over, the fewest calls outstanding (ties: the first from `turn`
    on in the shard's order); None when none is."""
    best, n = None, len(shard.members)
    for j in range(n):
        m = shard.members[(turn + j) % n]
        if m in tried or m.check or m.down_until > now or not shard.holds(m):
            continue
        if best is None or m.outstanding < best.outstanding:
            best = m
    return best


# What a fleet client gives to_probe and to_check: starts m's GetModel and returns the probe (what
# the client waits on and reports to probed: a grpc future, an asyncio task).
Start = Callable[[Member], Any]


class Fleet:
    """The members and, per layer, its shards; the choice of replicas. Thread-safe (the clients'
    calls and probes tell it what came of them from several threads or tasks)."""

    def __init__(self, members: List[Member]):
        self.members = members
        self.fingerprint = 0  # the fleet's model, once every daemon was asked and they agreed
        self._lock = threading.Lock()
        self._plans: Dict[int, List[Shard]] = {}
        self._recheck_at = 0.0  # while a plan fails: when every member is asked GetModel again
        self._recheck_for = 0.0

    def to_probe(self, members: Sequence[Member], now: float, start: Start) -> List[Tuple[Member, Any]]:
        """Starts GetModel of those of these members to be asked now (to_ask; any while a plan
        fails and it is time to ask again) and not being asked already; each counts as asked now.
        start(m) makes m's probe, recorded as m.probe at once (see _start). The probes started."""
        with self._lock:
            again = self._recheck_due(now)
            out = [m for m in members if to_ask(m, again, now) and m.probe is None]
            for m in out:
                m.asked_at = now
            return self._start(out, start)

    def _start(self, members: Sequence[Member], start: Start) -> List[Tuple[Member, Any]]:
        """Each member's probe made by start(m) and recorded, under the lock that chose them: a
        member is never seen chosen (counted as asked, or as checked) with no probe on its way, so
        every other call needing it finds the probe (m.probe) and waits for its answer. start must
        not report the probe's end itself before it returns (probed takes the lock)."""
        for m in members:
            m.probe = start(m)
        return [(m, m.probe) for m in members]

    def recheck_due(self, now: float) -> bool:
        """Whether every member is to be asked GetModel again now (a plan fails, and its time
        came); the next time is set."""
        with self._lock:
            return self._recheck_due(now)

    def _recheck_due(self, now: float) -> bool:
        if not self._recheck_at or now < self._recheck_at:
            return False
        self._recheck(now)
        return True

    def probed(self, m: Member, probe: Any, info: Optional[ModelInfo], error: str, now: float) -> None:
        """What `probe` (m's GetModel) came to: an answer, or (info None) why none came. Only the
        first report of a probe counts."""
        with self._lock:
            if m.probe is not probe:
                return
            m.probe = None
            if info is None:
                self._unanswered(m, error, now)
            else:
                self._learnt(m, info, now)

    def learnt(self, m: Member, info: ModelInfo, now: float) -> None:
        """m's GetModel answered info: a member serving another model than the fleet's is left
        out (and asked again, DOWN_MIN doubling to DOWN_MAX, until it serves the fleet's)."""
        with self._lock:
            self._learnt(m, info, now)

    def unanswered(self, m: Member, why: str, now: float) -> None:
        """m's GetModel failed (why: "STATUS: message"): passed over a while."""
        with self._lock:
            self._unanswered(m, why, now)

    def _learnt(self, m: Member, info: ModelInfo, now: float) -> None:
        fp = info.model_fingerprint
        foreign = bool(self.fingerprint and fp and fp != self.fingerprint)
        if m.info is None or _holdings(m.info) != _holdings(info) or foreign != m.foreign:
            self._plans.clear()
        m.heard = True
        m.info, m.check, m.foreign = info, foreign, foreign
        m.error = (f"serves another model: fingerprint {fp:016x}, the fleet's is {self.fingerprint:016x}"
                   if foreign else "answering")
        if foreign:
            down(m, now)
        self._pin()

    def _unanswered(self, m: Member, why: str, now: float) -> None:
        first, m.heard, m.error = not m.heard, True, why
        down(m, now)
        if first and not self.fingerprint:
            self._plans.clear()  # the fleet's model may have waited on this one
            self._pin()

    def _pin(self) -> None:
        """The fleet's model is fixed once every member was asked and those that answered agree."""
        if self.fingerprint or not all(m.heard or m.retired for m in self.members):
            return
        try:
            self.fingerprint = _one_model(self.members)
        except MoEError:  # they differ: every plan says so
            pass

    def unsettled(self) -> bool:
        """Whether the fleet's model waits on a daemon never asked yet (calls wait for its
        GetModel: a daemon of another model must refuse the fleet before any call is answered)."""
        with self._lock:
            return not self.fingerprint and not all(m.heard or m.retired for m in self.members)

    def plan(self, layer: int, now: float) -> Tuple[Optional[List[Shard]], Optional[MoEError]]:
        """The layer's shards, or the gap that stands in the way (asking GetModel again may close
        it); a configuration error is raised. While either stands, every member is to be asked
        again (to_probe)."""
        with self._lock:
            if layer not in self._plans:
                try:
                    self._pin()
                    fingerprint = self.fingerprint or _one_model(self.members)
                    shards, err = plan_layer(layer, self.members, fingerprint)
                except MoEError:
                    self._stale(now)
                    raise
                if shards is None:
                    self._stale(now)
                    return None, err
                self._plans[layer] = shards
                self._recheck_at = self._recheck_for = 0.0
            return self._plans[layer], None

    def pick(self, shard: Shard, tried: Sequence[Member], now: float) -> Optional[Member]:
        """choose()'s replica for the next attempt, the shard's turn moved on; it counts as
        outstanding until done()."""
        with self._lock:
            m = choose(shard, tried, shard.turn, now)
            shard.turn += 1
            if m is not None:
                m.outstanding += 1
            return m

    def to_check(self, shard: Shard, tried: Sequence[Member], now: float,
                 start: Start) -> List[Tuple[Member, Any]]:
        """Starts GetModel (start(m), as to_probe) of the shard's replicas that failed before and
        may be asked again now. The probes started."""
        with self._lock:
            return self._start([m for m in shard.members if m not in tried and m.check
                                and m.down_until <= now and m.probe is None and not m.retired], start)

    def done(self, m: Member, code: Optional[grpc.StatusCode], details: str, now: float) -> bool:
        """An attempt on m ended with `code` (None: OK): UNAVAILABLE passes m over, and it and
        FAILED_PRECONDITION (m is not what the call expected) have m asked GetModel before its next
        call. True when the part may go on to another replica (those two)."""
        with self._lock:
            m.outstanding -= 1
            if code is None:
                m.down_for = 0.0
                return False
            if code not in (UNAVAILABLE, REFUSED):
                return False
            m.error, m.check = f"{code.name}: {details}", True
            if code == UNAVAILABLE:
                down(m, now)
            return True

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
        """A new round of attempts: the shard's replicas passed over get their chance again."""
        with self._lock:
            for m in shard.members:
                m.down_until = min(m.down_until, now)

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
    said = [m for m in members if not m.retired and m.info is not None and m.info.model_fingerprint]
    fps = {m.info.model_fingerprint for m in said}
    if len(fps) > 1:
        names = "; ".join(f"{m.target} (fingerprint {m.info.model_fingerprint:016x})" for m in said)
        raise precondition(f"the fleet's daemons serve different models: {names}; a fleet serves one "
                           f"model (ModelInfo.model_fingerprint)")
    return next(iter(fps), 0)


def members_text(members: Sequence[Member]) -> str:
    """"A (layer:experts 0:0-3 1:0-3); B (UNAVAILABLE: ...)" for messages: every member in the
    fleet."""
    out = []
    for m in members:
        if m.retired:
            continue
        if m.info is None or m.foreign:
            out.append(m.state())
        else:
            held = " ".join(f"{li.index}:{ranges_text(li.experts_held)}" for li in m.info.layers)
            out.append(f"{m.target} ({'layer:experts ' + held if held else ''})")
    return "; ".join(out)


def plan_layer(layer: int, members: Sequence[Member],
               fingerprint: int = 0) -> Tuple[Optional[List[Shard]], Optional[MoEError]]:
    """Groups the members holding `layer` into shards and checks them (see moed.fleet):
    configuration errors are raised, the gaps that asking GetModel again may close returned.
    fingerprint: the fleet's model (0: not known), which members left out as foreign do not
    serve."""
    holders = [(m, li) for m in members if not m.retired and not m.foreign
               for li in [m.layer(layer)] if li is not None]
    if not holders:
        return None, _no_holder(layer, members, fingerprint)
    first_m, first = holders[0]
    for m, li in holders[1:]:
        for f in SAME:
            if getattr(li, f) != getattr(first, f):
                raise precondition(f"layer {layer} differs between {first_m.target} and {m.target} in "
                                   f"{f}: a fleet serves one model")
    groups: Dict[Tuple[Any, bool], Shard] = {}
    for m, li in holders:
        key = (tuple(li.experts_held), li.adds_shared_experts)
        groups.setdefault(key, Shard(layer, key[0], key[1], [], fingerprint, first.num_experts,
                                     first.num_shared_experts)).members.append(m)
    shards = sorted(groups.values(), key=lambda s: s.lowest)
    owner: Dict[int, Shard] = {}
    for s in shards:
        for a, b in s.ranges:
            for e in range(a, b + 1):
                if e in owner:
                    raise precondition(f"layer {layer}: expert {e} is held both by {owner[e].describe()} "
                                       f"and by {s.describe()}: a fleet's expert shards must be "
                                       f"disjoint (replicas hold the same experts and the same "
                                       f"shared-experts role)")
                owner[e] = s
    missing = ranges_text(runs([e for e in range(first.num_experts) if e not in owner]))
    if missing:
        if any(m.foreign and not m.retired for m in members):
            return None, precondition(f"layer {layer}: experts {missing} are held by no daemon serving "
                                      f"the fleet's model (fingerprint {fingerprint:016x}); targets: "
                                      f"{members_text(members)}")
        return None, unavailable(f"layer {layer}: experts {missing} are held by no reachable daemon of "
                                 f"the fleet; targets tried: {members_text(members)}")
    adders = [s for s in shards if s.adds_shared]
    if first.num_shared_experts and len(adders) != 1:
        what = ("no shard adds them: start the one holding expert 0 with --shared-experts auto or "
                "on" if not adders else
                "several shards add them: " + "; ".join(s.describe() for s in adders))
        raise precondition(f"layer {layer} has {first.num_shared_experts} shared expert(s), and "
                           f"exactly one expert shard must add them; {what}")
    return shards, None


def _no_holder(layer: int, members: Sequence[Member], fingerprint: int) -> MoEError:
    """Why no member serving the fleet's model holds the layer."""
    text = members_text(members)
    if any(m.foreign and not m.retired and m.layer(layer) is not None for m in members):
        return precondition(f"layer {layer} is held by no daemon serving the fleet's model (fingerprint "
                            f"{fingerprint:016x}); targets: {text}")
    if any(m.info is None and not m.retired for m in members):
        return unavailable(f"layer {layer} is held by no reachable daemon of the fleet; targets tried: "
                           f"{text}")
    return MoEError("NOT_FOUND", f"layer {layer} is not served by the fleet: {text}",
                    grpc.StatusCode.NOT_FOUND)


def check_batch_gating(layer: int, shards: List[Shard], batch_gating: bool) -> None:
    if batch_gating and len(shards) > 1:
        raise precondition(f"batch_gating needs one daemon holding every expert of layer {layer}, but "
                           f"this fleet splits them over {len(shards)} shards ("
                           f"{'; '.join(s.describe() for s in shards)}): the expert set would be "
                           f"chosen over a different merged batch on each")


# ---- which tokens each shard gets -------------------------------------------------------------

def token_rows(shards: Sequence[Shard], ids: np.ndarray, weights: np.ndarray) -> List[np.ndarray]:
    """Which tokens (rows of ids and weights [T, k], the client's choice of experts) each of a
    layer's shards gets, increasing: a shard's partial output for a token with no pair on an
    expert it holds is exactly +0.0 (its sum starts at zero), which add_up counts in without it.
    The shard that adds the shared experts gets every token (it has a term for each); another,
    those with at least one pair the daemons accept, not padding, on an expert it holds (an empty
    list: it gets no call). Every shard gets every token, as for logits and the server router,
    when the layer is one shard; when a pair is one the daemons refuse (moed_choice_rule in
    moed_route.h: an id outside [0, num_experts) but -1, -1 with a weight not 0, a weight NaN,
    infinite or negative), so their error names its row in the caller's numbering; and when no
    shard would get a token (an empty batch; only padding and no shared experts), so the daemons
    answer it (their zeros, or their refusal) as before."""
    T = ids.shape[0]
    every = [np.arange(T)] * len(shards)
    if len(shards) < 2:
        return every
    E = shards[0].num_experts
    pad = ids == -1
    accepted = (ids >= 0) & (ids < E) & np.isfinite(weights) & (weights >= 0)
    if not np.all(accepted | (pad & (weights == 0))):
        return every
    owner = np.full(E, -1, np.int64)
    for i, s in enumerate(shards):
        for a, b in s.ranges:
            owner[a:b + 1] = i
    whose = np.where(accepted, owner[np.where(accepted, ids, 0)], -1)
    rows = [np.arange(T) if s.adds_every_token else np.flatnonzero((whose == i).any(axis=1))
            for i, s in enumerate(shards)]
    return rows if any(len(r) for r in rows) else every


def requests(call: C.Call, shards: Sequence[Shard]) -> List[Tuple[Shard, np.ndarray, bytes]]:
    """A call's part for each shard that gets tokens (token_rows, where the client chose the
    experts; else every token): the shard, its rows, and its request (the call's, with only those
    rows of hidden, expert_ids and expert_weights where it gets fewer than every token)."""
    choice = call.fields.get("experts")
    T = call.prepared.input.shape[0]
    if choice is None:
        return [(s, np.arange(T), call.payload) for s in shards]
    ids, weights = choice["expert_ids"]["data"], choice["expert_weights"]["data"]
    out = []
    for s, rows in zip(shards, token_rows(shards, ids, weights)):
        if len(rows) == T:
            out.append((s, rows, call.payload))
        elif len(rows):
            h = call.fields["hidden"]
            fields = {**call.fields, "hidden": wire_tensor(h["data"][rows], h["dtype"]),
                      "experts": {"expert_ids": wire_tensor(ids[rows], I32),
                                  "expert_weights": wire_tensor(weights[rows], F32)}}
            out.append((s, rows, wire.encode("moed.v1.ForwardRequest", fields)))
    return out


def exhausted(shard: Shard, refused: bool, rounds: int = 1) -> MoEError:
    """A shard whose replicas all failed: its error, naming each and what it said; refused (a
    replica was not what the fleet took it for): FAILED_PRECONDITION, else UNAVAILABLE."""
    said = "; ".join(m.state() for m in shard.members)
    if refused:
        return precondition(f"layer {shard.layer}: no replica of {shard.describe()} is what the fleet "
                            f"took it for: {said}")
    return unavailable(f"layer {shard.layer}: no replica of {shard.describe()} answered: {said}", rounds)


def serving(fleet: Fleet, status: Dict[str, str], now: float) -> str:
    """The fleet's health: SERVING when every layer its members hold is planned and each of its
    shards has a replica whose status is SERVING."""
    layers = {li.index for m in fleet.members if m.info is not None and not m.retired
              for li in m.info.layers}
    for layer in sorted(layers):
        try:
            shards, err = fleet.plan(layer, now)
        except MoEError:
            return "NOT_SERVING"
        if err is not None or not all(any(status.get(m.target) == "SERVING" for m in s.members)
                                      for s in shards):
            return "NOT_SERVING"
    return "SERVING" if layers else "NOT_SERVING"


class Attempts:
    """One shard's part of a call: its request (the call's, with the shard's expect), the attempt
    in flight, the replicas tried in this round and what came of them; rounds of them as the
    client's RetryPolicy says."""

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

    def failed(self, fleet: Fleet, code: grpc.StatusCode, details: str, now: float) -> bool:
        """The attempt in flight failed: recorded. False when no other replica may answer (the
        call fails with this error)."""
        if not fleet.done(self.member, code, details, now):
            return False
        self.refused |= code == REFUSED
        self.tried.append(self.member)
        self.took, self.attempt = now - self.started, None
        return True

    def next_round(self, retry: RetryPolicy, deadline: Optional[float], now: float) -> float:
        """No replica is left in this round: the wait before the next (the retry policy's, after
        UNAVAILABLE), or the call's error raised."""
        if self.refused:
            raise exhausted(self.shard, True)
        wait = retry.delay(self.rounds, UNAVAILABLE, now, deadline, self.took)
        if wait is None:
            raise exhausted(self.shard, False, self.rounds)
        self.rounds, self.tried, self.took = self.rounds + 1, [], 0.0
        return wait


# ---- the fleet's answers ----------------------------------------------------------------------

def widen(a: np.ndarray, wire_dtype: int) -> np.ndarray:
    """An array of a wire dtype (bf16 as its uint16 bits) as float32 (exact for each)."""
    if wire_dtype == BF16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def narrow(acc: np.ndarray, wire_dtype: int) -> np.ndarray:
    """float32 values rounded once (to nearest, ties to even; NaN stays NaN, as moed_dtype rounds)
    to the wire dtype's numpy type."""
    if wire_dtype == BF16:
        bits = acc.view(np.uint32)
        r = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        quiet = ((bits >> 16) | 0x40).astype(np.uint16)
        return np.where(np.isnan(acc), quiet, r).astype(WIRE_NP[BF16])
    with np.errstate(over="ignore"):  # past f16's range: inf, as rounding says
        return acc.astype(WIRE_NP[wire_dtype])


def add_up(wire_dtype: int, parts: Sequence[np.ndarray], rows: Optional[Sequence[np.ndarray]] = None,
           tokens: Optional[int] = None) -> np.ndarray:
    """The shards' partial outputs (arrays of the wire dtype, lowest expert first) added in float32
    in the order given and rounded once to the wire dtype. rows[i]: the tokens (output rows,
    increasing) part i holds, its rows in that order (None: every part holds all `tokens`). A
    shard that got no row for a token would have answered +0.0 there, so such a token's sum starts
    at +0.0; one every part holds starts at -0.0, which adding a part leaves as it is: the sum is
    bit for bit the one of every shard's answer for every token."""
    if rows is None:
        rows, tokens = [None] * len(parts), len(parts[0])
    held = np.zeros(tokens, np.int64)
    for r in rows:
        held[slice(None) if r is None else r] += 1
    width = parts[0].shape[1:]
    acc = np.empty((tokens,) + width, np.float32)
    acc[...] = np.where(held == len(parts), np.float32(-0.0), np.float32(0.0)).reshape((-1,) + (1,) * len(width))
    with np.errstate(over="ignore"):  # past float32's range: inf, as adding says
        for p, r in zip(parts, rows):
            if r is None or len(r) == tokens:
                np.add(acc, widen(p, wire_dtype), out=acc)
            else:
                acc[r] += widen(p, wire_dtype)
    return narrow(acc, wire_dtype)


def combine(call: C.Call, shards: int, replies: Sequence[Tuple[np.ndarray, bytes]]) -> Any:
    """The output of a call to a layer of `shards` shards from the replies of those that got
    tokens (their rows, their reply), in shard order; timings, request_id and expert_set those of
    the slowest reply."""
    if shards == 1:
        return call.result(replies[0][1])
    inp = call.prepared.input
    decoded = [C.decode("moed.v1.ForwardResponse", r) for _, r in replies]
    parts = []
    for (rows, _), r in zip(replies, decoded):
        t = C.check_output(r["output"], inp.wire, (len(rows),) + tuple(inp.shape[1:]))
        parts.append(wire_view(t["data"], t["dtype"], t["shape"]))
    out = {"dtype": inp.wire, "shape": list(inp.shape),
           "data": memoryview(add_up(inp.wire, parts, [rows for rows, _ in replies], inp.shape[0]).tobytes())}
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
    """One ModelInfo for the fleet: every layer once, with the experts the daemons serving the
    fleet's model hold between them; the smallest limits; every device."""
    answered = [m.info for m in members if m.info is not None and not m.retired and not m.foreign]
    if not answered:
        raise unavailable(f"no daemon of the fleet answered GetModel: {members_text(members)}")
    layers: Dict[int, LayerInfo] = {}
    held: Dict[int, set] = {}
    for info in answered:
        for li in info.layers:
            layers.setdefault(li.index, li)
            held.setdefault(li.index, set()).update(e for a, b in li.experts_held for e in range(a, b + 1))
    out = [LayerInfo(**{**layers[i].__dict__, "experts_held": runs(sorted(held[i])),
                        "adds_shared_experts": True, "home_device": 0, "expert_placement": [],
                        "expert_replicas": [], "placement_generation": 0})
           for i in sorted(layers)]
    return ModelInfo(model=answered[0].model, layers=out,
                     backend=",".join(sorted({i.backend for i in answered})),
                     devices=[d for i in answered for d in i.devices], version=answered[0].version,
                     max_message_bytes=min(i.max_message_bytes for i in answered),
                     max_batch_tokens=min(i.max_batch_tokens for i in answered),
                     model_fingerprint=answered[0].model_fingerprint)
