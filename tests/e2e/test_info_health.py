"""GetModel (every field) and the standard grpc.health.v1 service (Check and Watch).

The health calls use the stubs the moed package generates from proto/grpc/health/v1/health.proto,
the standard proto unchanged (grpcio-health-checking cannot be imported next to them: it registers
the same message names under another file name, and protobuf refuses the duplicate). So that the
test does not rest on our own copy of the proto alone, one Check is also made with hand-written
wire bytes through a generic call: what any stock client sends, and what it must get back.
"""

import subprocess

import grpc
import numpy as np
import pytest

import oracle as O
from conftest import DEFAULT_SPEC, MOED_BIN
from moed._proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from moed import MoEClient
from moed._proto.moed.v1 import moed_pb2, moed_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
SPEC = O.Spec(layers=4, d=48, ff=40, experts=6, topk=3, act="gelu", dtype="f16", seed=3, norm=0)
DEEPSEEK = O.Spec(layers=2, d=32, ff=16, experts=8, topk=2, rule="deepseek", groups=2, topk_groups=1,
                  scale=1.5, shared=1, shared_ff=24, router=1, dtype="f32")


def model_info(d):
    with d.channel() as ch:
        return moed_pb2_grpc.MoedStub(ch).GetModel(moed_pb2.GetModelRequest(), timeout=30)


def test_get_model_every_field(daemon):
    d = daemon("--synthetic", str(SPEC), "--layers", "1,3", "--threads", "1",
               "--max-message-bytes", "3MiB", "--max-batch-tokens", "777")
    m = model_info(d)
    version = subprocess.run([str(MOED_BIN), "--version"], capture_output=True, text=True).stdout
    assert m.version and m.version in version
    # The model is the spec in canonical form: every key, so a client can rebuild the weights.
    assert dict(kv.split("=") for kv in m.model.split(",")) == dict(kv.split("=") for kv in str(SPEC).split(","))
    assert m.backend == "cpu"
    assert m.max_message_bytes == 3 << 20 and m.max_batch_tokens == 777
    assert len(m.devices) == 1 and m.devices[0].name == "cpu"
    assert 0 < m.devices[0].memory_used <= m.devices[0].memory_total
    assert [l.index for l in m.layers] == [1, 3], "--layers 1,3 serves exactly those"
    for l in m.layers:
        assert (l.d_model, l.d_ff, l.num_experts, l.top_k) == (48, 40, 6, 3)
        assert l.activation == moed_pb2.GELU and l.weight_dtype == moed_pb2.F16
        assert l.has_router and not l.norm_topk_prob and l.router_rule == moed_pb2.SOFTMAX_TOPK
        assert (l.num_shared_experts, l.shared_d_ff, l.n_group, l.topk_group) == (0, 0, 1, 1)
        assert l.routed_scaling_factor == 1.0


def test_get_model_says_where_experts_live(daemon):
    """LayerInfo.home_device and expert_placement: on one device every held expert is on device 0,
    in the whole layer's numbering (an expert shard's ranges as it holds them); the log says the
    same per layer; the Python client reads it."""
    d = daemon("--synthetic", str(SPEC), "--layers", "1,3", "--threads", "1")
    for l in model_info(d).layers:
        assert l.home_device == 0
        assert [(r.first, r.last, r.device) for r in l.expert_placement] == [(0, 5, 0)]
    placed = [line for line in d.log().splitlines() if 'msg="layer placed"' in line]
    assert len(placed) == 2 and all('home_device=0 split=0 experts="0-5@0"' in p for p in placed), placed
    with MoEClient(d.address) as c:
        assert [(l.home_device, l.expert_placement) for l in c.info().layers] == [(0, [(0, 5, 0)])] * 2
    shard = daemon("--synthetic", str(SPEC), "--experts", "1-2,5", "--threads", "1")
    for l in model_info(shard).layers:
        assert [(r.first, r.last, r.device) for r in l.expert_placement] == [(1, 2, 0), (5, 5, 0)]


def test_get_model_deepseek_fields(daemon):
    d = daemon("--synthetic", str(DEEPSEEK), "--threads", "1")
    m = model_info(d)
    assert [l.index for l in m.layers] == [0, 1]
    for l in m.layers:
        assert l.router_rule == moed_pb2.DEEPSEEK_V3 and l.weight_dtype == moed_pb2.F32
        assert l.activation == moed_pb2.SWIGLU and l.norm_topk_prob
        assert (l.num_shared_experts, l.shared_d_ff, l.n_group, l.topk_group) == (1, 24, 2, 1)
        assert l.routed_scaling_factor == pytest.approx(1.5)
    # the same through the Python client's types
    with d.client() as c:
        info = c.info()
    assert info.layer(1).router_rule == "deepseek_v3" and info.layer(1).shared_d_ff == 24


def test_health_check(shared_daemon):
    with shared_daemon.channel() as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "moed.v1.Moed"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status == SERVING
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no.such.Service" in e.value.details()


def test_health_check_raw_wire_bytes(shared_daemon):
    """HealthCheckRequest{service: ""} is zero bytes; SERVING is field 1, varint 1: 08 01."""
    with shared_daemon.channel() as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check")
        assert check(b"", timeout=30) == b"\x08\x01"
        # service "moed.v1.Moed": field 1, length-delimited
        assert check(b"\x0a\x0cmoed.v1.Moed", timeout=30) == b"\x08\x01"


def test_health_watch(shared_daemon):
    with shared_daemon.channel() as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert next(watch).status == SERVING, "Watch sends the current status at once"
        watch.cancel()
        unknown = stub.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
        assert next(unknown).status == SERVICE_UNKNOWN, "Watch on an unknown service streams SERVICE_UNKNOWN"
        unknown.cancel()


def test_many_watchers_do_not_disturb_forward(shared_daemon):
    """Open watches hold calls on the server; Forward must still be answered."""
    spec = O.Spec.parse(DEFAULT_SPEC)
    with shared_daemon.channel() as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        watches = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(8)]
        assert all(next(w).status == SERVING for w in watches)
        x, x64 = O.hidden(np.random.default_rng(1), 3, 64, "f32")
        ids = np.array([[0, 1]] * 3, np.int32)
        gw = np.full((3, 2), 0.5, np.float32)
        with shared_daemon.client(timeout=30) as c:
            y = c.forward(0, x, expert_ids=ids, expert_weights=gw)
        O.check(y, O.forward(x64, spec.layer(0), O.choice_route(ids, gw), "swiglu"), "f32")
        for w in watches:
            w.cancel()
