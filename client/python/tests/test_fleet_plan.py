"""moed.fleet_plan, the fleet's policy, against the table of scenarios libmoedclient's planner is
tested against too (tests/data/fleet_scenarios.json, read by tests/unit/test_fleet_plan.c): the same
shards, replicas, schedules, sums and error texts in both languages."""

import json
import pathlib

import grpc
import numpy as np
import pytest

from moed import fleet_plan as P
from moed.retry import NO_RETRY
from moed.tensors import BF16, F16, F32
from moed.types import LayerInfo, ModelInfo, MoEError

TABLE = json.loads((pathlib.Path(__file__).resolve().parents[3] / "tests" / "data" /
                    "fleet_scenarios.json").read_text())
WIRE = {"f32": (F32, np.uint32, np.float32), "f16": (F16, np.uint16, np.float16), "bf16": (BF16, np.uint16, None)}


def layer_info(spec):
    fields = {**TABLE["layer"], **{k: v for k, v in spec.items() if k not in ("held", "adds_shared")}}
    held = [tuple(r) for r in spec.get("held", [[0, fields["num_experts"] - 1]])]
    return LayerInfo(**fields, experts_held=held, adds_shared_experts=spec.get("adds_shared", True))


def model_info(answer):
    return ModelInfo(model="m", layers=[layer_info(li) for li in answer.get("layers", [])], backend="cpu",
                     devices=[], version="v", max_message_bytes=1 << 20, max_batch_tokens=64,
                     model_fingerprint=answer.get("fingerprint", 0))


def tell(fleet, by, rounds, now=0.0):
    for answers in rounds:
        for a in answers:
            if "error" in a:
                fleet.unanswered(by[a["target"]], a["error"], now)
            else:
                fleet.learnt(by[a["target"]], model_info(a), now)


def fleet_of(sc):
    members = [P.Member(t, None) for t in sc["targets"]]
    fleet = P.Fleet(members)
    by = {m.target: m for m in members}
    tell(fleet, by, sc.get("answers", []))
    return fleet, by


def check_error(err, want):
    assert err is not None, f"planned, where the table says {want['code']}"
    assert (err.code_name, err.message) == (want["code"], want["message"])
    assert err.code == getattr(grpc.StatusCode, want["code"])


def named(items):
    return pytest.mark.parametrize("sc", items, ids=[s["name"] for s in items])


def with_defaults(sc, key):
    return {**TABLE[key], **sc}


def test_constants():
    c = TABLE["constants"]
    assert (P.PROBE_TIMEOUT, P.REPROBE, P.DOWN_MIN, P.DOWN_MAX, P.RESOLVE_EVERY) == (
        c["probe_timeout_s"], c["reprobe_s"], c["down_min_s"], c["down_max_s"], c["resolve_every_s"])


@named(TABLE["plans"])
def test_plan(sc):
    fleet, _ = fleet_of(sc)
    try:
        shards, err = fleet.plan(sc["layer"], 0.0)
        if err is None:
            P.check_batch_gating(sc["layer"], shards, sc.get("batch_gating", False))
    except MoEError as e:
        shards, err = None, e
    if "error" in sc:
        check_error(err, sc["error"])
        return
    assert err is None, err
    assert [{"held": [list(r) for r in s.ranges], "adds_shared": s.adds_shared,
             "replicas": [m.target for m in s.members]} for s in shards] == sc["shards"]
    if "expect_fingerprint" in sc:
        assert [s.fingerprint for s in shards] == [sc["expect_fingerprint"]] * len(shards)


@named(TABLE["picks"])
def test_pick(sc):
    sc = with_defaults(sc, "picks_default")
    fleet, by = fleet_of(sc)
    shards, err = fleet.plan(sc["layer"], 0.0)
    assert err is None, err
    shard = shards[sc["shard"]]
    tell(fleet, by, sc.get("then", []))
    for target, state in sc["state"].items():
        for k, v in state.items():
            setattr(by[target], k, v)
    m = P.choose(shard, [by[t] for t in sc["tried"]], sc["turn"], sc["now"])
    assert (m.target if m else None) == sc["pick"]


@named(TABLE["asks"])
def test_ask(sc):
    m = P.Member("a", None)
    spec = sc["member"]
    m.info = model_info({}) if spec["answered"] else None
    m.check, m.retired = spec.get("check", False), spec.get("retired", False)
    m.asked_at, m.down_until = spec.get("asked_at", 0.0), spec.get("down_until", 0.0)
    assert P.to_ask(m, sc.get("again", False), sc["now"]) == sc["ask"]


def test_down_doubles_to_its_most():
    m, now = P.Member("a", None), TABLE["downs"]["now"]
    for want in TABLE["downs"]["down_for"]:
        P.down(m, now)
        assert (m.down_for, m.down_until) == (want, now + want)


def test_every_daemon_is_asked_again_while_a_plan_fails():
    sc = TABLE["rechecks"]
    fleet, _ = fleet_of(sc)
    assert fleet.plan(sc["layer"], 0.0)[1] is not None
    assert [[t, fleet.recheck_due(t)] for t, _ in sc["due"]] == sc["due"]


@named(TABLE["sums"])
def test_sum(sc):
    wire, bits, value = WIRE[sc["dtype"]]
    parts = [np.array(p, bits) if value is None else np.array(p, bits).view(value) for p in sc["parts"]]
    if "rows" not in sc:
        assert P.add_up(wire, parts).view(bits).tolist() == sc["sum"]
        return
    d = len(sc["sum"]) // sc["tokens"]
    rows = [np.array(r, np.int64) for r in sc["rows"]]
    got = P.add_up(wire, [p.reshape(len(r), d) for p, r in zip(parts, rows)], rows, sc["tokens"])
    assert got.view(bits).ravel().tolist() == sc["sum"]


@named(TABLE["slices"])
def test_slices(sc):
    fleet, _ = fleet_of(sc)
    shards, err = fleet.plan(0, 0.0)
    assert err is None, err
    ids = np.array(sc["ids"], np.int32).reshape(-1, sc.get("k", 2))
    weights = np.array(sc["weights"], np.float32) if "weights" in sc else (ids != -1).astype(np.float32)
    assert [r.tolist() for r in P.token_rows(shards, ids, weights.reshape(ids.shape))] == sc["rows"]


@named(TABLE["exhausted"])
def test_a_shard_whose_replicas_failed(sc):
    sc = with_defaults(sc, "exhausted_default")
    fleet, by = fleet_of(sc)
    shard = fleet.plan(sc["layer"], 0.0)[0][sc["shard"]]
    t = P.Attempts(shard, b"")
    for f in sc["failures"]:
        t.member = by[f["target"]]
        t.member.outstanding += 1
        assert t.failed(fleet, getattr(grpc.StatusCode, f["code"]), f["message"], sc["now"]) == f["moves_on"]
    for target, state in sc["members"].items():
        assert {k: getattr(by[target], k) for k in state} == state
    if "error" in sc:
        with pytest.raises(MoEError) as e:
            t.next_round(NO_RETRY, None, sc["now"])
        check_error(e.value, sc["error"])


@named(TABLE["health"])
def test_health(sc):
    fleet, _ = fleet_of(sc)
    status = {t: "SERVING" if t in sc["serving"] else "NOT_SERVING" for t in sc["targets"]}
    assert P.serving(fleet, status, 0.0) == sc["status"]
