"""Tests of MoEClient against an in-process fake moed (grpcio server with the generated servicer):
what goes on the wire, what comes back, and how errors surface. The real daemon is tested by
tests/e2e; this checks the client alone, without one."""

from concurrent import futures

import grpc
import ml_dtypes
import numpy as np
import pytest

import moed
from moed._proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from moed._proto.moed.v1 import moed_pb2, moed_pb2_grpc


class FakeMoed(moed_pb2_grpc.MoedServicer):
    """Answers Forward with hidden * 2 (decoded and re-encoded in the same dtype) and records the
    request; layer 7 is 'not resident'."""

    def __init__(self):
        self.last = None

    def Forward(self, request, context):
        self.last = request
        if request.layer == 7:
            context.abort(grpc.StatusCode.NOT_FOUND, "layer 7 is not resident; resident: 0, 1")
        h = request.hidden
        np_dtype = {1: "<f4", 2: "<f2", 3: "<u2"}[h.dtype]
        a = np.frombuffer(h.data, dtype=np_dtype).reshape(tuple(h.shape))
        if h.dtype == 3:
            a = a.view(ml_dtypes.bfloat16)
        out = (a.astype(np.float32) * 2).astype(a.dtype)
        data = out.view(np.uint16).tobytes() if h.dtype == 3 else out.tobytes()
        return moed_pb2.ForwardResponse(
            request_id=request.request_id, output=moed_pb2.Tensor(dtype=h.dtype, shape=h.shape, data=data),
            expert_set=[3, 1] if request.HasField("batch_gating") else [],
            timings=moed_pb2.Timings(queue_us=5, compute_us=7, total_us=20, batch_tokens=h.shape[0],
                                     batch_requests=1))

    def GetModel(self, request, context):
        return moed_pb2.ModelInfo(
            model="layers=1", backend="cpu", version="0.1.0", max_message_bytes=1 << 26,
            max_batch_tokens=4096, devices=[moed_pb2.Device(name="cpu", memory_total=10, memory_used=1)],
            layers=[moed_pb2.LayerInfo(index=0, d_model=8, d_ff=16, num_experts=4, top_k=2,
                                       activation=moed_pb2.GELU, weight_dtype=moed_pb2.BF16,
                                       has_router=True, norm_topk_prob=True,
                                       router_rule=moed_pb2.DEEPSEEK_V3, num_shared_experts=1,
                                       shared_d_ff=16, n_group=2, topk_group=1,
                                       routed_scaling_factor=2.5)])


class FakeHealth(health_pb2_grpc.HealthServicer):
    def Check(self, request, context):
        if request.service not in ("", "moed.v1.Moed"):
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service}")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture(scope="module")
def server():
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    fake = FakeMoed()
    moed_pb2_grpc.add_MoedServicer_to_server(fake, srv)
    health_pb2_grpc.add_HealthServicer_to_server(FakeHealth(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield fake, f"127.0.0.1:{port}"
    srv.stop(None)


@pytest.mark.parametrize("np_dtype,wire", [(np.float32, 1), (np.float16, 2), (ml_dtypes.bfloat16, 3)])
def test_forward_round_trips_each_dtype(server, np_dtype, wire):
    fake, target = server
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np_dtype)
    ids = np.array([[0, 3]] * 5, dtype=np.int64)  # converted to int32 by the client
    w = np.full((5, 2), 0.5)
    with moed.MoEClient(target) as c:
        y = c.forward(0, x, expert_ids=ids, expert_weights=w)
    assert y.dtype == x.dtype and y.shape == x.shape and y.flags.writeable
    np.testing.assert_array_equal(y, (x.astype(np.float32) * 2).astype(np_dtype))
    req = fake.last
    assert req.hidden.dtype == wire and list(req.hidden.shape) == [5, 8]
    assert req.hidden.data == np.ascontiguousarray(x).tobytes()
    assert req.WhichOneof("routing") == "experts"
    assert req.experts.expert_ids.dtype == moed_pb2.I32
    assert np.frombuffer(req.experts.expert_ids.data, "<i4").tolist() == [0, 3] * 5
    assert np.frombuffer(req.experts.expert_weights.data, "<f4").tolist() == [0.5] * 10


def test_bf16_bits_as_uint16_and_non_contiguous_input(server):
    fake, target = server
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(ml_dtypes.bfloat16)[::2, ::2]
    with moed.MoEClient(target) as c:
        y = c.forward(0, x.view(np.uint16),
                      expert_ids=np.zeros((4, 1)), expert_weights=np.ones((4, 1)), dtype="bf16")
        assert y.dtype == np.uint16
        np.testing.assert_array_equal(y.view(ml_dtypes.bfloat16), (x.astype(np.float32) * 2).astype(x.dtype))
        y2 = c.forward(0, x, expert_ids=np.zeros((4, 1)), expert_weights=np.ones((4, 1)))
        np.testing.assert_array_equal(y2, y.view(ml_dtypes.bfloat16))
        with pytest.raises(ValueError, match="dtype='bf16'"):
            c.forward(0, np.zeros((4, 8), np.uint16), expert_ids=np.zeros((4, 1)), expert_weights=np.ones((4, 1)))
        with pytest.raises(ValueError, match="float64"):
            c.forward(0, np.zeros((4, 8)), expert_ids=np.zeros((4, 1)), expert_weights=np.ones((4, 1)))


def test_logits_gating_and_batch_gating_fields(server):
    fake, target = server
    x = np.ones((3, 8), np.float32)
    logits = np.arange(12, dtype=np.float64).reshape(3, 4)
    with moed.MoEClient(target, timeout=10) as c:
        c.forward(0, x, router_logits=logits, strategy="sigmoid", threshold=0.25, renormalize=False)
        req = fake.last
        assert req.WhichOneof("routing") == "logits"
        assert req.logits.gating.strategy == moed_pb2.SIGMOID
        assert req.logits.gating.threshold == 0.25
        assert req.logits.gating.renormalize == moed_pb2.RENORMALIZE_OFF
        assert np.frombuffer(req.logits.logits.data, "<f4").tolist() == list(range(12))
        assert not req.HasField("batch_gating")
        r = c.forward(1, x, strategy="topk", top_k=3, batch_gating=True, k_batch=2, return_info=True,
                      request_id="abc")
        req = fake.last
        assert req.WhichOneof("routing") == "server_router"
        assert req.server_router.gating.strategy == moed_pb2.TOPK and req.server_router.gating.top_k == 3
        assert req.HasField("batch_gating") and req.batch_gating.k_batch == 2
        assert r.expert_set.tolist() == [3, 1] and r.request_id == "abc"
        assert (r.timings.queue_us, r.timings.compute_us, r.timings.total_us) == (5, 7, 20)
        assert r.timings.batch_tokens == 3 and r.timings.batch_requests == 1
        c.forward(0, x)  # no routing arguments: the server's router with the layer's own rule
        assert fake.last.WhichOneof("routing") == "server_router"
        assert fake.last.server_router.gating.strategy == moed_pb2.STRATEGY_UNSPECIFIED


def test_errors_are_moed_errors(server):
    fake, target = server
    with moed.MoEClient(target) as c:
        with pytest.raises(moed.MoEError) as ei:
            c.forward(7, np.ones((1, 8), np.float32), strategy="topk")
        assert ei.value.code == grpc.StatusCode.NOT_FOUND and ei.value.code_name == "NOT_FOUND"
        assert "layer 7 is not resident" in ei.value.message
        with pytest.raises(moed.MoEError) as ei:
            c.health("nope")
        assert ei.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(ValueError, match="unknown gating strategy"):
            c.forward(0, np.ones((1, 8), np.float32), strategy="bogus")
    with moed.MoEClient("127.0.0.1:1", timeout=2) as c:  # nothing listens there
        with pytest.raises(moed.MoEError) as ei:
            c.health()
        assert ei.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_info_and_health(server):
    _, target = server
    with moed.MoEClient(target) as c:
        assert c.health() == "SERVING"
        m = c.info()
    assert (m.model, m.backend, m.version, m.max_batch_tokens) == ("layers=1", "cpu", "0.1.0", 4096)
    assert m.devices == [moed.Device("cpu", 10, 1)]
    li = m.layer(0)
    assert (li.d_model, li.d_ff, li.num_experts, li.top_k) == (8, 16, 4, 2)
    assert (li.activation, li.weight_dtype, li.router_rule) == ("gelu", "bf16", "deepseek_v3")
    assert li.has_router and li.norm_topk_prob
    assert (li.num_shared_experts, li.shared_d_ff, li.n_group, li.topk_group) == (1, 16, 2, 1)
    assert li.routed_scaling_factor == 2.5
    with pytest.raises(KeyError, match="resident layers"):
        m.layer(3)
