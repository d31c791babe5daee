"""The daemons a target names, for moed.connect and the fleet clients: a list of targets, a "dns:"
name (one daemon per address it resolves to, as a Kubernetes headless Service lists its pods), or
any other gRPC target (itself); and the arguments each daemon's own client gets in a fleet.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Dict, List, Tuple

from .fleet_plan import DOWN_MAX, DOWN_MIN, RESOLVE_EVERY, Member
from .retry import NO_RETRY
from .types import InvalidArgument, MoEError


def resolve(target: Any) -> List[str]:
    """The daemons a target names: a list or tuple of targets (each resolved in turn), a "dns:"
    name (one target per address it resolves to; itself when it resolves to one), or any other
    gRPC target (itself). InvalidArgument for what is no target; MoEError UNAVAILABLE for a "dns:"
    name that does not resolve (now)."""
    if not isinstance(target, str):
        return [t for one in leaves(target) for t in resolve(one)]
    if not target.startswith("dns:"):
        return [target]
    host, port = dns_host_port(target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise MoEError("UNAVAILABLE", f"{target}: {host} does not resolve ({e})") from None
    addrs = sorted({(fam, sa[0]) for fam, _, _, _, sa in infos})
    if len(addrs) == 1:
        return [target]
    return [f"ipv6:[{a}]:{port}" if fam == socket.AF_INET6 else f"ipv4:{a}:{port}" for fam, a in addrs]


def dns_host_port(target: str) -> Tuple[str, int]:
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
        raise InvalidArgument(f"{target}: no host name (use dns:///NAME:PORT)")
    try:
        return host, int(port) if port else 443
    except ValueError:
        raise InvalidArgument(f"{target}: port {port!r} is not a number") from None


def is_fleet(target: Any) -> bool:
    """Whether target names several daemons: a list or tuple of targets that resolves to several,
    or a "dns:" name with several addresses. A name that does not resolve (now) is one daemon,
    whose calls report UNAVAILABLE as gRPC finds it."""
    if isinstance(target, str) and not target.startswith("dns:"):
        return False
    try:
        return len(resolve(target)) > 1
    except MoEError:
        return False


def one(target: Any) -> str:
    """The one target a target that is no fleet names (a list of one: its item)."""
    return target if isinstance(target, str) else resolve(target)[0]


def leaves(target: Any) -> List[str]:
    """The targets a target lists, "dns:" names unresolved; InvalidArgument for what is neither a
    str nor a list of them, and for a list of none."""
    if isinstance(target, str):
        return [target]
    try:
        parts = list(target)
    except TypeError:
        raise InvalidArgument(f"a target is a str (\"HOST:PORT\", \"unix:/PATH\", \"dns:///NAME:PORT\") "
                              f"or a list of them, not {type(target).__name__}") from None
    out = [t for one in parts for t in leaves(one)]
    if not out:
        raise InvalidArgument("the target list is empty: name at least one daemon")
    return out


class Names:
    """The "dns:" names among a fleet's targets. Pods behind a name come back at new addresses, so
    the name is resolved again (at most every RESOLVE_EVERY seconds) when a call finds a shard with
    no daemon answering: new addresses join the fleet, vanished ones leave it."""

    def __init__(self, target: Any):
        self.names = [t for t in leaves(target) if t.startswith("dns:")]
        self.at = time.monotonic()

    def due(self, now: float) -> bool:
        return bool(self.names) and now >= self.at + RESOLVE_EVERY

    def addresses(self) -> List[str]:
        self.at = time.monotonic()
        out = []
        for n in self.names:
            try:
                out += resolve(n)
            except MoEError:  # a name that does not resolve now holds nobody
                pass
        return out


# A member's channel retries its connection on the fleet's schedule (gRPC's default starts at 1 s
# and grows to 120 s: a daemon back would go unnoticed for that long).
RECONNECT = [("grpc.initial_reconnect_backoff_ms", int(DOWN_MIN * 1000)),
             ("grpc.min_reconnect_backoff_ms", int(DOWN_MIN * 1000)),
             ("grpc.max_reconnect_backoff_ms", int(DOWN_MAX * 1000))]


def member_kwargs(target: str, original: Any, kw: Dict[str, Any]) -> Dict[str, Any]:
    """A member's client arguments: the fleet client's (its channel options after the reconnect
    schedule, so they win), without retries (the fleet retries across replicas), inline (a fleet
    keeps no region session), with TLS checking the DNS name when the member is one of its
    addresses."""
    kw = {**kw, "retry": NO_RETRY, "timeout": None, "transport": "inline",
          "options": [*RECONNECT, *(kw.get("options") or ())]}
    if (kw.get("credentials") is not None and isinstance(original, str) and original.startswith("dns:")
            and target != original):
        host = dns_host_port(original)[0]
        kw["options"] = [("grpc.ssl_target_name_override", host), *(kw.get("options") or ())]
    return kw


def members(target: Any, make) -> List[Member]:
    """The fleet's members, one per daemon the target names (made by make(target)); those from
    "dns:" names marked."""
    out = []
    for leaf in leaves(target):
        for t in resolve(leaf):
            out.append(Member(t, make(t)))
            out[-1].named = leaf.startswith("dns:")
    return out


def single(target: Any, client: str, connect: str) -> str:
    """target, checked to name one daemon for a client of one (`client`, made by `connect` for a
    fleet): InvalidArgument for a list or a "dns:" name of several addresses."""
    if not isinstance(target, str):
        raise InvalidArgument(f"{client} talks to one daemon, and its target is a {type(target).__name__}: "
                              f"{connect}(targets) makes the client several targets need (a fleet "
                              f"client, or this one for a list of one)")
    if target.startswith("dns:") and is_fleet(target):
        daemons = resolve(target)
        raise InvalidArgument(f"{target} names {len(daemons)} daemons ({', '.join(daemons)}) and "
                              f"{client} talks to one: {connect}({target!r}) makes a fleet client of "
                              f"them; \"HOST:PORT\" without \"dns:\" is one channel to one of its "
                              f"addresses")
    return target
