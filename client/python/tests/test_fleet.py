"""The fleet clients without daemons: moed.connect and what it makes of targets and "dns:" names,
MoEClient refusing several daemons, the fleet clients answering the single-daemon clients' interface
(the calls a fleet cannot serve with FAILED_PRECONDITION), and what the table of scenarios
(test_fleet_plan.py) does not hold: each shard's expect, retry rounds, regrouping, the rounding
against ml_dtypes. Fleets of real daemons are tested by tests/e2e/test_fleet.py."""

import asyncio
import inspect
import socket
import threading

import grpc
import ml_dtypes
import numpy as np
import pytest

import moed
import moed.aio
from moed import fleet_plan as P
from moed import targets
from moed.fleet_plan import Fleet, Member
from moed.tensors import BF16, F16, F32
from moed.types import LayerInfo, ModelInfo, MoEError


def info(*layers, fingerprint=0):
    return ModelInfo(model="m", layers=list(layers), backend="cpu", devices=[], version="v",
                     max_message_bytes=1 << 20, max_batch_tokens=64, model_fingerprint=fingerprint)


def layer(index=0, held=((0, 7),), shared=True, **kw):
    return LayerInfo(**{"index": index, "d_model": 8, "num_experts": 8, "top_k": 2,
                        "num_shared_experts": 1, "experts_held": list(held),
                        "adds_shared_experts": shared, **kw})


def member(target, *layers, fingerprint=0):
    m = Member(target, None)
    if layers:
        m.info = info(*layers, fingerprint=fingerprint)
    return m


def two_addresses(monkeypatch):
    """moed.svc resolves to two addresses."""
    def resolver(host, port, **kw):
        assert host == "moed.svc" and port == 50051
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::2", port, 0, 0)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", port))]

    monkeypatch.setattr(socket, "getaddrinfo", resolver)


def test_resolve_lists_and_dns_names(monkeypatch):
    assert targets.resolve("10.0.0.1:50051") == ["10.0.0.1:50051"]
    assert targets.resolve(["a:1", ("b:2", "c:3")]) == ["a:1", "b:2", "c:3"]
    with pytest.raises(ValueError):
        targets.resolve([])
    two_addresses(monkeypatch)
    want = ["ipv4:10.0.0.9:50051", "ipv6:[fd00::2]:50051"]
    for name in ("dns:///moed.svc:50051", "dns:moed.svc:50051", "dns://8.8.8.8/moed.svc:50051"):
        assert targets.resolve(name) == want, name
        assert targets.is_fleet(name) and targets.is_fleet([name])
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda h, p, **kw: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", p))])
    assert targets.resolve("dns:///moed.svc:50051") == ["dns:///moed.svc:50051"]  # one: gRPC resolves it
    assert not targets.is_fleet("dns:///moed.svc:50051") and not targets.is_fleet("host:1")
    assert not targets.is_fleet(["host:1"]) and targets.is_fleet(["host:1", "host:2"])
    assert targets.dns_host_port("dns:///[::1]:7") == ("::1", 7)
    assert targets.dns_host_port("dns:///name") == ("name", 443)
    with pytest.raises(ValueError):
        targets.dns_host_port("dns:///:5")


def test_connect_makes_the_client_a_target_needs(monkeypatch):
    with moed.connect("127.0.0.1:1") as one, moed.connect(["127.0.0.1:1"]) as listed, \
            moed.connect(["127.0.0.1:1", "127.0.0.1:2"], timeout=3) as fl:
        assert type(one) is moed.MoEClient and type(listed) is moed.MoEClient and listed.target == "127.0.0.1:1"
        assert type(fl) is moed.FleetClient and fl.timeout == 3
        assert all(isinstance(c, moed.Client) for c in (one, listed, fl))
        assert [m.target for m in fl.fleet.members] == ["127.0.0.1:1", "127.0.0.1:2"]
        assert all(type(m.client) is moed.MoEClient for m in fl.fleet.members)
    two_addresses(monkeypatch)
    with moed.connect("dns:///moed.svc:50051") as fl:
        assert type(fl) is moed.FleetClient and len(fl.fleet.members) == 2

    async def aio():
        async with moed.aio.connect("127.0.0.1:1") as one, \
                moed.aio.connect(["127.0.0.1:1", "127.0.0.1:2"]) as fl:
            assert type(one) is moed.aio.MoEClient and type(fl) is moed.aio.FleetClient
            assert isinstance(one, moed.aio.AioClient) and isinstance(fl, moed.aio.AioClient)
            assert all(type(m.client) is moed.aio.MoEClient for m in fl.fleet.members)

    asyncio.run(aio())


def test_a_single_daemon_client_refuses_several_pointing_to_connect(monkeypatch):
    for cls in (moed.MoEClient, moed.aio.MoEClient):
        with pytest.raises(TypeError, match=r"connect\(targets\) makes the client several targets need"):
            cls(["127.0.0.1:1", "127.0.0.1:2"])
    two_addresses(monkeypatch)
    with pytest.raises(ValueError) as e:
        moed.MoEClient("dns:///moed.svc:50051")
    assert "names 2 daemons (ipv4:10.0.0.9:50051, ipv6:[fd00::2]:50051)" in str(e.value)
    assert "moed.connect('dns:///moed.svc:50051') makes a fleet client" in str(e.value)


@pytest.mark.parametrize("one,many", [(moed.MoEClient, moed.FleetClient),
                                      (moed.aio.MoEClient, moed.aio.FleetClient)])
def test_a_fleet_client_has_the_interface_of_one(one, many):
    base = moed.Client if one is moed.MoEClient else moed.aio.AioClient
    methods = [n for n, f in inspect.getmembers(base) if getattr(f, "__isabstractmethod__", False)]
    assert {"forward", "forward_stream", "info", "health", "register", "unregister", "regions",
            "close"} <= set(methods)
    for name in methods:
        a, b = getattr(one, name), getattr(many, name)
        assert inspect.signature(a) == inspect.signature(b), name
        assert inspect.iscoroutinefunction(a) == inspect.iscoroutinefunction(b), name


def what_a_fleet_cannot_serve(c):
    x = np.zeros((1, 8), np.float32)
    return {"regions": lambda: c.regions(), "register": lambda: c.register(x),
            "unregister": lambda: c.unregister(None),
            "shm": lambda: c.forward(0, x, expert_ids=np.zeros((1, 1), np.int32),
                                     expert_weights=np.ones((1, 1), np.float32), transport="shm"),
            "cuda": lambda: c.forward(0, x, transport="cuda")}


def check_refused(name, e):
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION and e.code_name == "FAILED_PRECONDITION", name
    assert "fleet of several" in e.message and "one daemon" in e.message, (name, e.message)


def test_a_fleet_refuses_what_needs_one_daemon():
    """These raised AttributeError ('_list_regions', '_session') or ValueError, or did not take
    out= (TypeError), when MoEClient([...]) was a FleetClient that never ran MoEClient.__init__."""
    with moed.connect(["127.0.0.1:1", "127.0.0.1:2"]) as c:
        for name, call in what_a_fleet_cannot_serve(c).items():
            with pytest.raises(MoEError) as e:
                call()
            check_refused(name, e.value)
        with pytest.raises(ValueError, match="unknown transport"):
            c.forward(0, np.zeros((1, 8), np.float32), transport="carrier pigeon")
    with moed.connect(["127.0.0.1:1", "127.0.0.1:2"], transport="shm") as c:  # a default for calls
        with pytest.raises(MoEError) as e:
            c.forward(0, np.zeros((1, 8), np.float32))
        check_refused("the client's shm", e.value)
    with pytest.raises(ValueError, match="unknown transport"):
        moed.connect(["127.0.0.1:1", "127.0.0.1:2"], transport="carrier pigeon")

    async def aio():
        async with moed.aio.connect(["127.0.0.1:1", "127.0.0.1:2"]) as c:
            for name, call in what_a_fleet_cannot_serve(c).items():
                with pytest.raises(MoEError) as e:
                    await call()
                check_refused(name, e.value)

    asyncio.run(aio())


def test_a_fleet_writes_out(server):
    """forward(out=...) as one daemon's client takes it: two replicas of the fake daemon."""
    _, target = server
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    out = np.zeros_like(x)
    with moed.connect([target, target], timeout=30) as fl:
        y = fl.forward(0, x, expert_ids=np.zeros((2, 1), np.int32), expert_weights=np.ones((2, 1), np.float32),
                       out=out)
        assert y is out and np.array_equal(out, 2 * x) and fl.transport_calls["inline"] == 1


class Watched:
    """A lock that sets `contended` (a threading.Event) when a thread finds it held."""

    def __init__(self, lock, contended):
        self.lock, self.contended = lock, contended

    def acquire(self, blocking=True, timeout=-1):
        if self.lock.acquire(False):
            return True
        self.contended.set()
        return self.lock.acquire(blocking, timeout)

    def release(self):
        self.lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


class HeldProbe:
    """A member's GetModel whose first future() is made only once `go` is set: the thread that
    counted the member as asked is held between that and its probe's start for as long as a
    scheduler could hold it (a channel's first call starts a thread, which gives others the
    interpreter: that was enough to lose the race most times)."""

    def __init__(self, rpc, go):
        self.rpc, self.go, self.first = rpc, go, True

    def future(self, *args, **kw):
        if self.first:
            self.first = False
            assert self.go.wait(60), "hang guard: the other call neither ended nor waited on the fleet"
        return self.rpc.future(*args, **kw)


def first_calls(fl, x, ids, w):
    """Two threads' first calls on fl at once: what each came to (an output or a MoEError)."""
    start, got = threading.Barrier(2), [None, None]

    def call(i):
        start.wait()
        try:
            got[i] = fl.forward(0, x, expert_ids=ids, expert_weights=w, timeout=60)
        except MoEError as e:
            got[i] = e
        finally:
            fl.test_ended.set()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_threads_first_calls_wait_for_the_probes_another_started(fake_halves):
    """A call that finds a member counted as asked by another thread's call waits for that probe
    and uses its answer (it used to plan at once, with the member unheard, and fail UNAVAILABLE
    "not asked yet"). First the window held open: the first probe starts only once the other call
    ended or waits on the fleet (found its lock held); then fresh clients as they come."""
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    ids, w = np.array([[0, 3], [2, 1]], np.int32), np.full((2, 2), 0.5, np.float32)
    for n in range(21):
        with moed.connect(fake_halves) as fl:
            fl.test_ended = threading.Event()
            if n == 0:
                fl.fleet._lock = Watched(fl.fleet._lock, fl.test_ended)
                m = fl.fleet.members[0]
                m.client._get_model = HeldProbe(m.client._get_model, fl.test_ended)
            for y in first_calls(fl, x, ids, w):
                assert not isinstance(y, MoEError), f"client {n}: {y}"
                np.testing.assert_array_equal(y, 4 * x)  # each shard's fake answers hidden * 2


def test_each_shard_states_what_it_expects():
    f = Fleet([member("a", layer(held=[(0, 2), (6, 6)]), fingerprint=0xA),
               member("b", layer(held=[(3, 5), (7, 7)], shared=False), fingerprint=0xA)])
    shards, _ = f.plan(0, 0.0)
    got = [moed.wire.decode("moed.v1.ForwardRequest", s.expect)["expect"] for s in shards]
    assert [(x["model_fingerprint"], [(r["first"], r["last"]) for r in x["experts_held"]],
             x["adds_shared_experts"]) for x in got] == [(0xA, [(0, 2), (6, 6)], True),
                                                           (0xA, [(3, 5), (7, 7)], False)]


def test_a_round_without_an_attempt_still_retries():
    """Every replica was passed over, so no attempt was made in the round: the retry policy waits
    and tries again (it used to take the time since boot for the attempt's length and give up)."""
    t = P.Attempts(P.Shard(0, ((0, 7),), True, [member("a", layer())]), b"")
    assert t.next_round(moed.RetryPolicy(max_attempts=3), deadline=130.0, now=100.0) >= 0 and t.rounds == 2


@pytest.mark.parametrize("wire", [F32, F16, BF16])
def test_one_rounding_to_the_hidden_dtype(wire):
    rng = np.random.default_rng(0)
    v = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 3,
                        np.array([np.nan, np.inf, -np.inf, 3.4e38, -0.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8,
                                  65519.0, 65520.0], np.float32)])
    got = P.narrow(v.copy(), wire)
    with np.errstate(over="ignore"):
        want = {F32: v, F16: v.astype(np.float16), BF16: v.astype(ml_dtypes.bfloat16)}[wire]
    np.testing.assert_array_equal(got.view(want.dtype).astype(np.float32), want.astype(np.float32))


@pytest.mark.parametrize("held", [[(0, 3), (3, 5)], [(4, 5), (0, 1)], [(2, 1)], [(0, 8)]])
def test_malformed_held_ranges_are_refused(held):
    from moed import _common, wire
    spec = {"index": 3, "num_experts": 8, "experts_held": [{"first": a, "last": b} for a, b in held]}
    reply = wire.encode("moed.v1.ModelInfo", {"layers": [spec]})
    with pytest.raises(MoEError) as e:
        _common.model_info(reply)
    assert e.value.code_name == "INTERNAL" and "layer 3's experts_held" in e.value.message
    ok = wire.encode("moed.v1.ModelInfo", {"layers": [{**spec, "experts_held": [{"first": 1, "last": 7}]}]})
    assert _common.model_info(ok).layers[0].experts_held == [(1, 7)]


def test_regroup_adds_new_addresses_and_retires_vanished_ones(monkeypatch):
    made = []
    f = Fleet([member("ipv4:10.0.0.1:1", layer(held=[(0, 3)])),
               member("ipv4:10.0.0.2:1", layer(held=[(4, 7)], shared=False))])
    for m in f.members:
        m.named = True
    assert f.plan(0, 0.0)[1] is None
    assert not f.regroup(["ipv4:10.0.0.1:1", "ipv4:10.0.0.2:1"], made.append)
    assert f.regroup(["ipv4:10.0.0.1:1", "ipv4:10.0.0.3:1"], lambda t: made.append(t) or t)
    assert made == ["ipv4:10.0.0.3:1"] and f.members[1].retired and f.members[2].named
    shards, err = f.plan(0, 0.0)  # the new daemon has not answered GetModel yet: experts 4-7 are missing
    assert shards is None and "experts 4-7" in err.message and "10.0.0.2" not in err.message
    names = targets.Names(["dns:///a.svc:1", "b:2"])
    assert names.names == ["dns:///a.svc:1"] and not names.due(names.at + 1)
    monkeypatch.setattr(targets, "resolve", lambda n: ["ipv4:10.0.0.9:1"])
    assert names.due(names.at + P.RESOLVE_EVERY) and names.addresses() == ["ipv4:10.0.0.9:1"]
