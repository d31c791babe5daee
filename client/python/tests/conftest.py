"""An in-process fake moed (a grpcio server with the generated servicer) for the client's own tests:
Forward and ForwardStream answer hidden * 2 (decoded and re-encoded in the same dtype) and record
what they got; layer 7 is 'not resident'; the next N unary calls, or a stream after its Nth
request, can be made to fail UNAVAILABLE. Two more (fake_halves) split layer 0's experts between
them, a fleet's shards. The real daemon is tested by tests/e2e."""

import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

from moed._proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from moed._proto.moed.v1 import moed_pb2, moed_pb2_grpc

WIRE_NP = {1: "<f4", 2: "<f2", 3: "<u2"}


def doubled(h):
    """hidden * 2 in hidden's dtype (exact: bf16 through float32, whose low bits stay zero)."""
    a = np.frombuffer(h.data, dtype=WIRE_NP[h.dtype]).reshape(tuple(h.shape))
    if h.dtype == 3:
        f = (a.astype(np.uint32) << 16).view(np.float32) * 2
        return (f.view(np.uint32) >> 16).astype("<u2").tobytes()
    return (a * 2).astype(a.dtype).tobytes()


class FakeMoed(moed_pb2_grpc.MoedServicer):
    def __init__(self, held=None):
        self.held = held  # (first, last): the experts of layer 0 it says it holds (None: all)
        self.reset()

    def reset(self):
        self.last = None
        self.clock = None  # a FakeClock the client runs on: each Forward moves it on by its `took`
        self.remaining = []  # per Forward: the seconds its deadline left when it came (None: none)
        self.calls = 0  # Forward calls received
        self.unavailable = 0  # the next this many Forward calls fail UNAVAILABLE
        self.stream_fail_after = None  # the next stream fails UNAVAILABLE on its request of this index
        self.streams = []  # per stream: the request ids it received
        self.reply_bytes = 0  # size of the last reply

    def reply(self, request, context):
        self.last = request
        if request.layer == 7:
            context.abort(grpc.StatusCode.NOT_FOUND, "layer 7 is not resident; resident: 0, 1")
        h = request.hidden
        r = moed_pb2.ForwardResponse(
            request_id=request.request_id,
            output=moed_pb2.Tensor(dtype=h.dtype, shape=h.shape, data=doubled(h)),
            expert_set=[3, 1] if request.HasField("batch_gating") else [],
            timings=moed_pb2.Timings(queue_us=5, compute_us=7, total_us=20, batch_tokens=h.shape[0],
                                     batch_requests=1))
        self.reply_bytes = r.ByteSize()
        return r

    def Forward(self, request, context):
        self.calls += 1
        self.remaining.append(context.time_remaining())
        if self.clock:
            self.clock.sleep(self.clock.took)
        if self.unavailable:
            self.unavailable -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "the queue is full (--max-queue-requests 1)")
        return self.reply(request, context)

    def ForwardStream(self, request_iterator, context):
        fail_after, self.stream_fail_after = self.stream_fail_after, None
        ids = []
        self.streams.append(ids)
        for i, request in enumerate(request_iterator):
            ids.append(request.request_id)
            if i == fail_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the server is draining")
            yield self.reply(request, context)

    def GetModel(self, request, context):
        info = moed_pb2.ModelInfo(
            model="layers=1", backend="cpu", version="0.1.0", max_message_bytes=1 << 26,
            max_batch_tokens=4096, devices=[moed_pb2.Device(name="cpu", memory_total=10, memory_used=1)],
            layers=[moed_pb2.LayerInfo(index=0, d_model=8, d_ff=16, num_experts=4, top_k=2,
                                       activation=moed_pb2.GELU, weight_dtype=moed_pb2.BF16,
                                       has_router=True, norm_topk_prob=True,
                                       router_rule=moed_pb2.DEEPSEEK_V3, num_shared_experts=1,
                                       shared_d_ff=16, n_group=2, topk_group=1,
                                       routed_scaling_factor=2.5)])
        if self.held:
            info.layers[0].experts_held.add(first=self.held[0], last=self.held[1])
            info.layers[0].adds_shared_experts = self.held[0] == 0
        return info


class FakeHealth(health_pb2_grpc.HealthServicer):
    def Check(self, request, context):
        if request.service not in ("", "moed.v1.Moed"):
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service}")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class FakeClock:
    """time.monotonic and time.sleep for the client under test: its time moves only when it sleeps
    and when the fake server takes an attempt (`took` seconds each), so its retry decisions depend
    on nothing the machine's load could change. Its deadlines are fake seconds too; what gRPC gets
    is as many real ones, hang guards when `took` is seconds long."""

    def __init__(self, took):
        self.now, self.took = 0.0, took
        self.lock = threading.Lock()

    def monotonic(self):
        with self.lock:
            return self.now

    def sleep(self, seconds):
        with self.lock:
            self.now += seconds


@pytest.fixture
def fake_clock(server, monkeypatch):
    """Sets the client's clock (moed.client's and moed._common's `time`) to a FakeClock(took=10)
    that the fake server moves on too; (fake, target, clock)."""
    from moed import _common, client
    clock = FakeClock(took=10.0)
    monkeypatch.setattr(client, "time", clock)
    monkeypatch.setattr(_common, "time", clock)
    server[0].clock = clock
    return (*server, clock)


def serve(fake):
    """A started server of `fake`; (server, target)."""
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    moed_pb2_grpc.add_MoedServicer_to_server(fake, srv)
    health_pb2_grpc.add_HealthServicer_to_server(FakeHealth(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    return srv, f"127.0.0.1:{port}"


@pytest.fixture(scope="session")
def fake_server():
    fake = FakeMoed()
    srv, target = serve(fake)
    yield fake, target
    srv.stop(None)


@pytest.fixture(scope="session")
def fake_halves():
    """Two fakes holding experts 0-1 (adding the shared experts) and 2-3 of layer 0: a fleet of two
    shards, whose sum of replies is hidden * 4; their targets."""
    servers = [serve(FakeMoed(held)) for held in ((0, 1), (2, 3))]
    yield [target for _, target in servers]
    for srv, _ in servers:
        srv.stop(None)


@pytest.fixture
def server(fake_server):
    """(fake, target), the fake's state reset for the test."""
    fake_server[0].reset()
    return fake_server
