"""moed.fleet's logic without servers: targets and "dns:" names, the shards a fleet's GetModel
answers make (and every configuration error, named), the choice of replicas, and the one rounding
of the summed partial outputs. Fleets of real daemons are tested by tests/e2e/test_fleet.py."""

import socket

import grpc
import ml_dtypes
import numpy as np
import pytest

import moed
from moed import fleet
from moed.fleet import Fleet, Member
from moed.tensors import BF16, F16, F32
from moed.types import LayerInfo, ModelInfo, MoEError


def info(*layers):
    return ModelInfo(model="m", layers=list(layers), backend="cpu", devices=[], version="v",
                     max_message_bytes=1 << 20, max_batch_tokens=64)


def layer(index=0, held=((0, 7),), shared=True, **kw):
    return LayerInfo(**{"index": index, "d_model": 8, "num_experts": 8, "top_k": 2,
                        "num_shared_experts": 1, "experts_held": list(held),
                        "adds_shared_experts": shared, **kw})


def member(target, *layers):
    m = Member(target, None)
    if layers:
        m.info = info(*layers)
    return m


def test_resolve_lists_and_dns_names(monkeypatch):
    assert fleet.resolve("10.0.0.1:50051") == ["10.0.0.1:50051"]
    assert fleet.resolve(["a:1", ("b:2", "c:3")]) == ["a:1", "b:2", "c:3"]
    with pytest.raises(ValueError):
        fleet.resolve([])

    def resolver(host, port, **kw):
        assert host == "moed.svc" and port == 50051
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::2", port, 0, 0)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", port))]

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    want = ["ipv4:10.0.0.9:50051", "ipv6:[fd00::2]:50051"]
    for name in ("dns:///moed.svc:50051", "dns:moed.svc:50051", "dns://8.8.8.8/moed.svc:50051"):
        assert fleet.resolve(name) == want, name
        assert fleet.is_fleet(name)
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda h, p, **kw: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", p))])
    assert fleet.resolve("dns:///moed.svc:50051") == ["dns:///moed.svc:50051"]  # one: gRPC resolves it
    assert not fleet.is_fleet("dns:///moed.svc:50051") and not fleet.is_fleet("host:1")
    assert fleet.is_fleet(["host:1"])
    assert fleet._dns_host_port("dns:///[::1]:7") == ("::1", 7)
    assert fleet._dns_host_port("dns:///name") == ("name", 443)
    with pytest.raises(ValueError):
        fleet._dns_host_port("dns:///:5")


def test_plan_groups_replicas_and_orders_shards():
    a = member("a", layer(held=[(4, 7)], shared=False), layer(index=1))
    b = member("b", layer(held=[(0, 3)]))
    c = member("c", layer(held=[(4, 7)], shared=False))
    shards, err = fleet._plan(0, [a, b, c])
    assert err is None
    assert [(s.ranges, s.adds_shared, [m.target for m in s.members]) for s in shards] == \
        [(((0, 3),), True, ["b"]), (((4, 7),), False, ["a", "c"])]
    shards, err = fleet._plan(1, [a, b, c])
    assert err is None and [m.target for m in shards[0].members] == ["a"]


@pytest.mark.parametrize("members,words", [
    ([member("a", layer(held=[(0, 4)])), member("b", layer(held=[(4, 7)], shared=False))],
     ["expert 4", "experts 0-4 on a", "experts 4-7 on b"]),
    ([member("a", layer(held=[(0, 3)])), member("b", layer(held=[(4, 7)], shared=False, d_model=16))],
     ["differs between a and b", "d_model 8 against 16"]),
    ([member("a", layer(held=[(0, 3)], shared=False)), member("b", layer(held=[(4, 7)], shared=False))],
     ["no shard adds them", "--shared-experts"]),
    ([member("a", layer(held=[(0, 3)])), member("b", layer(held=[(4, 7)]))],
     ["several shards add them", "experts 0-3 on a", "experts 4-7 on b"]),
    ([member("a", layer(held=[(0, 3)])), member("b", layer(held=[(0, 3)], shared=False))],
     ["expert 0 is held both by"]),
])
def test_plan_refuses_a_misconfigured_fleet(members, words):
    with pytest.raises(MoEError) as e:
        fleet._plan(0, members)
    assert e.value.code_name == "FAILED_PRECONDITION"
    for w in words:
        assert w in e.value.message, (w, e.value.message)


def test_plan_names_what_is_missing():
    down = member("c")
    down.error = "UNAVAILABLE: connection refused"
    shards, err = fleet._plan(0, [member("a", layer(held=[(0, 2), (6, 6)])), down])
    assert shards is None and err.code_name == "UNAVAILABLE"
    assert "layer 0: experts 3-5,7" in err.message and "c (UNAVAILABLE: connection refused)" in err.message
    _, err = fleet._plan(5, [member("a", layer())])
    assert err.code_name == "NOT_FOUND" and "layer 5" in err.message
    _, err = fleet._plan(5, [member("a", layer()), down])
    assert err.code_name == "UNAVAILABLE"


def with_model(m, fingerprint):
    m.info.model_fingerprint = fingerprint
    return m


def test_one_model_or_refused_then_the_foreign_left_out():
    """Daemons of two models are refused, naming both; once the fleet's model is known, a member
    answering with another is left out, named where its experts are then missing, and asked again
    on the recheck schedule until it serves the fleet's model again."""
    a = with_model(member("a", layer(held=[(0, 3)])), 0xA)
    b = with_model(member("b", layer(held=[(4, 7)], shared=False)), 0xB)
    f = Fleet([a, b])
    with pytest.raises(MoEError) as e:
        f.plan(0)
    assert e.value.code_name == "FAILED_PRECONDITION"
    assert "a (fingerprint 000000000000000a)" in e.value.message and "b (fingerprint 000000000000000b)" in e.value.message
    assert f.to_probe([a, b], 0.0) == [] and set(f.to_probe([a, b], 1e9)) == {a, b}  # asked again later

    b2 = member("b2", layer(held=[(4, 7)], shared=False))
    a.heard = True  # answered: the fleet's model is pinned once b2 did too
    f = Fleet([a, b2])
    f.probed(b2, None, b.info, "", 0.0)  # b2 answers: the fleet's model
    b2.probe = "p"
    f.probed(b2, "p", with_model(member("x", layer(held=[(4, 7)], shared=False)), 0xA).info, "", 0.0)
    shards, err = f.plan(0)
    assert err is None and f.fingerprint == 0xA and [s.fingerprint for s in shards] == [0xA, 0xA]
    b2.probe = "q"
    f.probed(b2, "q", with_model(member("x", layer(held=[(4, 7)], shared=False)), 0xB).info, "", 0.0)
    assert b2.foreign and "fingerprint 000000000000000b, the fleet's is 000000000000000a" in b2.error
    shards, err = f.plan(0)
    assert shards is None and err.code_name == "FAILED_PRECONDITION"
    assert "experts 4-7" in err.message and "b2 (serves another model" in err.message
    b2.probe = "r"
    f.probed(b2, "r", with_model(member("x", layer(held=[(4, 7)], shared=False)), 0xA).info, "", 0.0)
    assert not b2.foreign and f.plan(0)[1] is None


def test_each_shard_states_what_it_expects():
    f = Fleet([with_model(member("a", layer(held=[(0, 2), (6, 6)])), 0xA),
               with_model(member("b", layer(held=[(3, 5), (7, 7)], shared=False)), 0xA)])
    shards, _ = f.plan(0)
    got = [moed.wire.decode("moed.v1.ForwardRequest", s.expect)["expect"] for s in shards]
    assert [(x["model_fingerprint"], [(r["first"], r["last"]) for r in x["experts_held"]],
             x["adds_shared_experts"]) for x in got] == [(0xA, [(0, 2), (6, 6)], True),
                                                           (0xA, [(3, 5), (7, 7)], False)]


def test_a_round_without_an_attempt_still_retries():
    """Every replica was passed over, so no attempt was made in the round: the retry policy waits
    and tries again (it used to take the time since boot for the attempt's length and give up)."""
    s = fleet.Shard(0, ((0, 7),), True, [member("a", layer())])
    t = fleet._Try(s, b"")
    policy = moed.RetryPolicy(max_attempts=3)
    assert t.next_round(policy, deadline=fleet.time.monotonic() + 30) >= 0 and t.rounds == 2


def test_pick_least_outstanding_in_turn_skipping_the_down():
    a, b, c = member("a", layer()), member("b", layer()), member("c", layer())
    f = Fleet([a, b, c])
    shards, _ = f.plan(0)
    s = shards[0]
    picks = [f.pick(s, [], 0.0) for _ in range(3)]
    assert sorted(m.target for m in picks) == ["a", "b", "c"]  # each once: least outstanding
    for m in picks:
        f.done(m, None, "", 0.0)
    assert {f.pick(s, [], 0.0).target for _ in range(6)} == {"a", "b", "c"}  # ties rotate
    for m in (a, b, c):
        m.outstanding = 0
    f.done(_counted(a), grpc.StatusCode.UNAVAILABLE, "draining", 10.0)
    assert a.check and a.down_until == 10.0 + fleet.DOWN_MIN and a.error == "UNAVAILABLE: draining"
    assert all(f.pick(s, [], 10.1) is not a for _ in range(4))
    assert f.pick(s, [b, c], 10.1) is None  # a is down and b, c were tried
    assert f.to_check(s, [b, c], 10.1 + fleet.DOWN_MIN) == [a]
    f.done(_counted(a), grpc.StatusCode.UNAVAILABLE, "gone", 20.0)
    assert a.down_until == 20.0 + 2 * fleet.DOWN_MIN  # doubles
    f.probed(a, None, None, "not asked", 30.0)  # not the probe on its way: ignored
    a.probe = "p"
    f.probed(a, "p", info(layer(held=[(0, 3)])), "", 30.0)  # it came back holding other experts
    assert not a.check and f.pick(s, [b, c], 30.0) is None  # so it no longer serves this shard


def _counted(m):
    m.outstanding += 1
    return m


@pytest.mark.parametrize("wire", [F32, F16, BF16])
def test_one_rounding_to_the_hidden_dtype(wire):
    rng = np.random.default_rng(0)
    v = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 3,
                        np.array([np.nan, np.inf, -np.inf, 3.4e38, -0.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8,
                                  65519.0, 65520.0], np.float32)])
    got = fleet._narrow(v.copy(), wire)
    with np.errstate(over="ignore"):
        want = {F32: v, F16: v.astype(np.float16), BF16: v.astype(ml_dtypes.bfloat16)}[wire]
    np.testing.assert_array_equal(got.view(want.dtype).astype(np.float32), want.astype(np.float32))


def test_fleet_client_is_made_for_several_targets():
    with moed.MoEClient(["127.0.0.1:1", "127.0.0.1:2"]) as c:
        assert isinstance(c, moed.MoEClient) and type(c).__name__ == "FleetClient"
        assert [m.target for m in c.fleet.members] == ["127.0.0.1:1", "127.0.0.1:2"]
        assert all(type(m.client) is moed.MoEClient for m in c.fleet.members)
    with moed.MoEClient("127.0.0.1:1") as c:
        assert type(c) is moed.MoEClient


@pytest.mark.parametrize("held", [[(0, 3), (3, 5)], [(4, 5), (0, 1)], [(2, 1)], [(0, 8)]])
def test_malformed_held_ranges_are_refused(held):
    from moed import _common, wire
    layer = {"index": 3, "num_experts": 8, "experts_held": [{"first": a, "last": b} for a, b in held]}
    reply = wire.encode("moed.v1.ModelInfo", {"layers": [layer]})
    with pytest.raises(MoEError) as e:
        _common.model_info(reply)
    assert e.value.code_name == "INTERNAL" and "layer 3's experts_held" in e.value.message
    ok = wire.encode("moed.v1.ModelInfo", {"layers": [{**layer, "experts_held": [{"first": 1, "last": 7}]}]})
    assert _common.model_info(ok).layers[0].experts_held == [(1, 7)]


def test_regroup_adds_new_addresses_and_retires_vanished_ones(monkeypatch):
    made = []
    f = Fleet([member("ipv4:10.0.0.1:1", layer(held=[(0, 3)])), member("ipv4:10.0.0.2:1", layer(held=[(4, 7)], shared=False))])
    for m in f.members:
        m.named = True
    assert f.plan(0)[1] is None
    assert not f.regroup(["ipv4:10.0.0.1:1", "ipv4:10.0.0.2:1"], made.append)
    assert f.regroup(["ipv4:10.0.0.1:1", "ipv4:10.0.0.3:1"], lambda t: made.append(t) or t)
    assert made == ["ipv4:10.0.0.3:1"] and f.members[1].retired and f.members[2].named
    shards, err = f.plan(0)  # the new daemon has not answered GetModel yet: experts 4-7 are missing
    assert shards is None and "experts 4-7" in err.message and "10.0.0.2" not in err.message
    names = fleet.Names(["dns:///a.svc:1", "b:2"])
    assert names.names == ["dns:///a.svc:1"] and not names.due(names.at + 1)
    monkeypatch.setattr(fleet, "resolve", lambda n: ["ipv4:10.0.0.9:1"])
    assert names.due(names.at + fleet.RESOLVE_EVERY) and names.addresses() == ["ipv4:10.0.0.9:1"]
