"""MoEClient and moed.aio.MoEClient against the in-process fake moed (conftest.py): what goes on the
wire, what comes back and how (read-only views of the reply, copies only where documented), the
kinds of tensors taken, streams, retries of UNAVAILABLE, channel options, and how errors surface.
The real daemon is tested by tests/e2e."""

import asyncio
import queue
import subprocess
import sys
import threading

import grpc
import ml_dtypes
import numpy as np
import pytest

import moed
from moed import _common, wire
from moed._proto.moed.v1 import moed_pb2
from moed.retry import NO_RETRY, RetryPolicy

CHOICE = dict(expert_ids=np.zeros((5, 1), np.int32), expert_weights=np.ones((5, 1), np.float32))


def twice(x):
    return (x.astype(np.float32) * 2).astype(x.dtype)


def reply_buffer(a):
    """The object at the end of an array's base chain (for a view of a reply: its bytes)."""
    while isinstance(a, np.ndarray):
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


class DLPackOnly:
    """An object that offers its memory only through DLPack (as a JAX or CuPy host array would)."""

    def __init__(self, a, device=(1, 0)):
        self.a, self.device = a, device

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.device


@pytest.mark.parametrize("np_dtype,wire_dtype", [(np.float32, 1), (np.float16, 2), (ml_dtypes.bfloat16, 3)])
def test_forward_round_trips_each_dtype(server, np_dtype, wire_dtype):
    fake, target = server
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np_dtype)
    ids = np.array([[0, 3]] * 5, dtype=np.int64)  # converted to int32 by the client
    w = np.full((5, 2), 0.5)
    with moed.MoEClient(target) as c:
        y = c.forward(0, x, expert_ids=ids, expert_weights=w)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(y, twice(x))
    req = fake.last
    assert req.hidden.dtype == wire_dtype and list(req.hidden.shape) == [5, 8]
    assert req.hidden.data == np.ascontiguousarray(x).tobytes()
    assert req.WhichOneof("routing") == "experts"
    assert req.experts.expert_ids.dtype == moed_pb2.I32
    assert np.frombuffer(req.experts.expert_ids.data, "<i4").tolist() == [0, 3] * 5
    assert np.frombuffer(req.experts.expert_weights.data, "<f4").tolist() == [0.5] * 10


def test_output_is_a_read_only_view_of_the_reply_unless_copied(server):
    fake, target = server
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    with moed.MoEClient(target) as c:
        y = c.forward(0, x, **CHOICE)
        buf = reply_buffer(y)
        assert isinstance(buf, bytes) and len(buf) == fake.reply_bytes  # the received message itself
        assert np.shares_memory(y, np.frombuffer(buf, np.uint8))
        assert not y.flags.writeable
        with pytest.raises(ValueError):
            y[0, 0] = 1
        z = c.forward(0, x, copy=True, **CHOICE)
        assert z.flags.writeable and z.flags.owndata
        z[0, 0] = 1  # its own memory
        np.testing.assert_array_equal(y, twice(x))


def test_reply_is_read_in_place_and_request_written_from_the_callers_memory():
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    call = _common.now(_common.prepare_forward(0, x, expert_ids=np.zeros((4, 1)), expert_weights=np.ones((4, 1)),
                                               transport="inline"))
    assert np.shares_memory(call.prepared.tensor["data"], x)  # no copy before the message's own
    reply = wire.encode("moed.v1.ForwardResponse", {"output": {"dtype": 1, "shape": [4, 8], "data": x * 3}})
    y = call.result(reply)
    assert np.shares_memory(y, np.frombuffer(reply, np.uint8))
    np.testing.assert_array_equal(y, x * 3)


def test_non_contiguous_and_big_endian_inputs_are_copied_once_and_correct(server):
    fake, target = server
    x = np.random.default_rng(2).standard_normal((10, 16)).astype(np.float32)[::2, ::2]
    call = _common.now(_common.prepare_forward(0, x, **CHOICE, transport="inline"))
    assert not np.shares_memory(call.prepared.tensor["data"], x)
    with moed.MoEClient(target) as c:
        np.testing.assert_array_equal(c.forward(0, x, **CHOICE), twice(x))
        xb = np.ascontiguousarray(x).astype(">f4")
        y = c.forward(0, xb, **CHOICE)
        assert y.dtype == np.float32 and y.dtype.isnative
        np.testing.assert_array_equal(y, twice(x))


def test_dlpack_objects_go_in_and_numpy_comes_out(server):
    fake, target = server
    x = np.random.default_rng(3).standard_normal((5, 8)).astype(np.float16)
    with moed.MoEClient(target) as c:
        y = c.forward(0, DLPackOnly(x), expert_ids=DLPackOnly(CHOICE["expert_ids"]),
                      expert_weights=DLPackOnly(CHOICE["expert_weights"]))
        assert isinstance(y, np.ndarray) and y.dtype == np.float16
        np.testing.assert_array_equal(y, twice(x))
        call = _common.now(_common.prepare_forward(0, DLPackOnly(x), **CHOICE, transport="inline"))
        assert np.shares_memory(call.prepared.tensor["data"], x)
        with pytest.raises(ValueError, match="not on the host"):
            c.forward(0, DLPackOnly(x, device=(2, 0)), **CHOICE)


def test_bf16_bits_as_uint16_and_bad_dtypes(server):
    fake, target = server
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(ml_dtypes.bfloat16)
    with moed.MoEClient(target) as c:
        y = c.forward(0, x.view(np.uint16), expert_ids=np.zeros((4, 1)), expert_weights=np.ones((4, 1)),
                      dtype="bf16")
        assert y.dtype == np.uint16
        np.testing.assert_array_equal(y.view(ml_dtypes.bfloat16), twice(x))
        with pytest.raises(ValueError, match="dtype='bf16'"):
            c.forward(0, np.zeros((4, 8), np.uint16), expert_ids=np.zeros((4, 1)), expert_weights=np.ones((4, 1)))
        with pytest.raises(ValueError, match="float64"):
            c.forward(0, np.zeros((4, 8)), expert_ids=np.zeros((4, 1)), expert_weights=np.ones((4, 1)))
        with pytest.raises(ValueError, match="does not match"):
            c.forward(0, x, dtype="f16", expert_ids=np.zeros((4, 1)), expert_weights=np.ones((4, 1)))
        with pytest.raises(ValueError, match=r"\[T, d_model\]"):
            c.forward(0, np.zeros(8, np.float32))
        with pytest.raises(ValueError, match="unknown transport"):
            c.forward(0, x, transport="carrier-pigeon")
        assert fake.calls == 1


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


def test_build_request_is_what_forward_sends(server):
    fake, target = server
    x = np.random.default_rng(4).standard_normal((5, 8)).astype(np.float32)
    with moed.MoEClient(target) as c:
        c.forward(0, x, request_id="q", **CHOICE)
    assert moed.MoEClient.build_request(None, 0, x, request_id="q", **CHOICE) == fake.last


def test_errors_are_moed_errors(server):
    fake, target = server
    with moed.MoEClient(target) as c:
        with pytest.raises(moed.MoEError) as ei:
            c.forward(7, np.ones((1, 8), np.float32), strategy="topk")
        assert ei.value.code == grpc.StatusCode.NOT_FOUND and ei.value.code_name == "NOT_FOUND"
        assert "layer 7 is not resident" in ei.value.message and ei.value.attempts == 1
        with pytest.raises(moed.MoEError) as ei:
            c.health("nope")
        assert ei.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(ValueError, match="unknown gating strategy"):
            c.forward(0, np.ones((1, 8), np.float32), strategy="bogus")
    with moed.MoEClient("127.0.0.1:1", timeout=2) as c:  # nothing listens there
        with pytest.raises(moed.MoEError) as ei:
            c.health()
        assert ei.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_a_reply_unlike_the_request_is_an_internal_error():
    x = np.ones((2, 4), np.float32)
    call = _common.now(_common.prepare_forward(0, x, strategy="topk", transport="inline"))
    cases = [(b"", "without an output"), (b"\x12\x02\x08\x02", "dtype f16"),
             (wire.encode("moed.v1.ForwardResponse", {"output": {"dtype": 1, "shape": [2, 3]}}), r"shape \[2, 3\]"),
             (wire.encode("moed.v1.ForwardResponse", {"output": {"dtype": 1, "shape": [2, 4], "data": b"\0" * 8}}),
              "8 bytes"),
             (b"\x12\x09", "does not parse")]
    for reply, says in cases:
        with pytest.raises(moed.MoEError, match=says) as ei:
            call.result(reply)
        assert ei.value.code_name == "INTERNAL"


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


# ---- streams -----------------------------------------------------------------------------------

def items(n, rng=None, **extra):
    rng = rng or np.random.default_rng(5)
    dtypes = (np.float32, ml_dtypes.bfloat16, np.float16)
    return [dict(layer=i % 2, hidden=rng.standard_normal((1 + i % 3, 8)).astype(dtypes[i % 3]),
                 request_id=f"s{i}", expert_ids=np.zeros((1 + i % 3, 1)), expert_weights=np.ones((1 + i % 3, 1)),
                 **extra) for i in range(n)]


def test_forward_stream_yields_outputs_in_order(server):
    fake, target = server
    reqs = items(7)
    with moed.MoEClient(target) as c:
        outs = list(c.forward_stream(iter(reqs)))
        infos = list(c.forward_stream(reqs[:2], timeout=10))
        assert all(isinstance(r, np.ndarray) for r in infos)
        infos = list(c.forward_stream([dict(r, return_info=True) for r in reqs[:2]]))
    assert len(outs) == 7 and len(fake.streams) == 3 and fake.streams[0] == [f"s{i}" for i in range(7)]
    for y, r in zip(outs, reqs):
        assert y.dtype == r["hidden"].dtype
        np.testing.assert_array_equal(y, twice(r["hidden"]))
    assert [r.request_id for r in infos] == ["s0", "s1"]


def test_forward_stream_bad_item_raises_after_the_outputs_before_it(server):
    fake, target = server
    reqs = items(3)
    reqs.insert(2, dict(layer=0, hidden=np.zeros((2, 8))))  # float64: cannot be sent
    got = []
    with moed.MoEClient(target) as c:
        with pytest.raises(ValueError, match="float64"):
            for y in c.forward_stream(reqs):
                got.append(y)
        assert len(got) == 2
        with pytest.raises(ValueError, match="timeout"):
            list(c.forward_stream([dict(reqs[0], timeout=1)]))
        with pytest.raises(TypeError, match="dicts"):
            list(c.forward_stream([reqs[0]["hidden"]]))

        def failing():
            yield reqs[0]
            raise RuntimeError("the caller's own generator broke")

        got = []
        with pytest.raises(RuntimeError, match="own generator"):
            for y in c.forward_stream(failing()):
                got.append(y)
        assert len(got) == 1


def test_forward_stream_error_status_ends_it(server):
    fake, target = server
    reqs = items(4)
    reqs[1]["layer"] = 7
    got = []
    with moed.MoEClient(target) as c:
        with pytest.raises(moed.MoEError) as ei:
            for y in c.forward_stream(reqs):
                got.append(y)
    assert len(got) == 1 and ei.value.code_name == "NOT_FOUND" and len(fake.streams) == 1


def test_forward_stream_retry_resends_what_was_not_answered(server):
    fake, target = server
    fake.stream_fail_after = 3  # the first stream answers s0..s2, then fails UNAVAILABLE
    reqs = items(9)
    with moed.MoEClient(target, retry=RetryPolicy(initial_backoff=0.01)) as c:
        outs = list(c.forward_stream(reqs))
    assert len(outs) == 9
    for y, r in zip(outs, reqs):
        np.testing.assert_array_equal(y, twice(r["hidden"]))
    assert len(fake.streams) == 2
    assert fake.streams[0][:4] == ["s0", "s1", "s2", "s3"]
    assert fake.streams[1] == [f"s{i}" for i in range(3, 9)]  # every unanswered one, in order, once
    fake.stream_fail_after = 0
    with moed.MoEClient(target, retry=None) as c:
        with pytest.raises(moed.MoEError) as ei:
            list(c.forward_stream(reqs))
    assert ei.value.code_name == "UNAVAILABLE" and "draining" in ei.value.message


def test_stopping_a_stream_early_cancels_it(server):
    fake, target = server

    def endless():
        i = 0
        while True:
            yield dict(layer=0, hidden=np.ones((1, 8), np.float32), strategy="topk", request_id=str(i))
            i += 1

    with moed.MoEClient(target) as c:
        for n, y in enumerate(c.forward_stream(endless())):
            if n == 4:
                break
        assert c.health() == "SERVING"
    assert len(fake.streams) == 1 and len(fake.streams[0]) >= 5


class ReadsRecorded(DLPackOnly):
    """A host tensor offered through DLPack that notes the thread each read of it runs on."""

    def __init__(self, a, reads):
        super().__init__(a)
        self.reads = reads

    def __dlpack__(self, **kw):
        self.reads.append(threading.get_ident())
        return super().__dlpack__(**kw)


def test_forward_stream_reads_each_item_on_the_iterating_thread(server):
    """Each item's tensors are read where forward() would read them: on the thread iterating the
    stream (for CUDA tensors, after the work queued on that thread's current stream), not on
    gRPC's request thread, whose current CUDA stream is the default one."""
    fake, target = server
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((1 + i % 3, 8)).astype((np.float32, np.float16)[i % 2]) for i in range(6)]
    reads = []
    reqs = [dict(layer=0, hidden=ReadsRecorded(x, reads), expert_ids=ReadsRecorded(np.zeros((len(x), 1)), reads),
                 expert_weights=ReadsRecorded(np.ones((len(x), 1)), reads)) for x in xs]
    with moed.MoEClient(target, timeout=60) as c:
        outs = list(c.forward_stream(reqs))
    assert len(outs) == 6 and len(reads) == 18
    assert set(reads) == {threading.get_ident()}, "an item was read on another thread"
    for y, x in zip(outs, xs):
        np.testing.assert_array_equal(y, twice(x))


def test_forward_stream_pulls_items_as_the_stream_sends(server):
    """The iterable is pulled lazily: a generator that waits for the output before it (a worker
    feeding each layer its previous output) gets it; the stream's deadline is a hang guard."""
    fake, target = server
    todo = queue.SimpleQueue()
    x = np.ones((2, 8), np.float32)
    todo.put(dict(layer=0, hidden=x, **{k: v[:2] for k, v in CHOICE.items()}))
    got = []
    with moed.MoEClient(target) as c:
        for y in c.forward_stream(iter(todo.get, None), timeout=60):
            got.append(y)
            todo.put(dict(layer=0, hidden=y, **{k: v[:2] for k, v in CHOICE.items()}) if len(got) < 4 else None)
    assert [float(y[0, 0]) for y in got] == [2, 4, 8, 16]


class RacyCounts(dict):
    """transport_calls whose reads wait (up to a second) for a second thread to read too: two
    increments that are not serialised then both read the old count and one is lost."""

    def __init__(self, counts):
        super().__init__(counts)
        self.both = threading.Barrier(2)

    def __getitem__(self, key):
        value = super().__getitem__(key)
        try:
            self.both.wait(timeout=1)
        except threading.BrokenBarrierError:  # the other thread could not read meanwhile
            pass
        return value


COUNTED = {"forward": lambda c, x: c.forward(0, x, **CHOICE),
           "stream": lambda c, x: list(c.forward_stream([dict(layer=0, hidden=x, **CHOICE)]))}


@pytest.mark.parametrize("fleet", [False, True], ids=["one", "fleet"])
@pytest.mark.parametrize("call", sorted(COUNTED))
def test_transport_calls_count_every_call_from_every_thread(server, call, fleet):
    fake, target = server
    x = np.ones((5, 8), np.float32)
    failed = []

    def one_call(c):
        try:
            COUNTED[call](c, x)
        except Exception as e:  # noqa: B902: reported below
            failed.append(e)

    with moed.connect([target, target] if fleet else target, timeout=60) as c:
        c.info()  # a fleet learns its daemons first (its first calls from two threads race there)
        c.transport_calls = RacyCounts(c.transport_calls)
        threads = [threading.Thread(target=one_call, args=(c,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failed, failed
        assert dict(c.transport_calls) == {"inline": 2, "shm": 0, "cuda": 0}, "a count was lost"


# ---- retries, deadlines, options ---------------------------------------------------------------

def test_unavailable_is_retried_with_bounded_attempts(server):
    fake, target = server
    x = np.ones((5, 8), np.float32)
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02)
    with moed.MoEClient(target, retry=policy) as c:
        fake.unavailable = 2
        np.testing.assert_array_equal(c.forward(0, x, **CHOICE), x * 2)
        assert fake.calls == 3
        fake.unavailable, fake.calls = 5, 0
        with pytest.raises(moed.MoEError) as ei:
            c.forward(0, x, **CHOICE)
        assert fake.calls == 3 and ei.value.attempts == 3 and ei.value.code_name == "UNAVAILABLE"
        assert "queue is full" in ei.value.message and "after 3 attempts" in str(ei.value)
        fake.unavailable, fake.calls = 0, 0
        with pytest.raises(moed.MoEError, match="NOT_FOUND"):  # other statuses: never retried
            c.forward(7, x, **CHOICE)
        assert fake.calls == 1
    fake.unavailable, fake.calls = 1, 0
    with moed.MoEClient(target, retry=None) as c:
        with pytest.raises(moed.MoEError, match="UNAVAILABLE"):
            c.forward(0, x, **CHOICE)
    assert fake.calls == 1


def test_no_retry_past_the_deadline(fake_clock):
    """A 60 s deadline, attempts of 10 s each (a FakeClock): the client retries while another
    attempt and its wait fit, and then fails with the UNAVAILABLE it got (not DEADLINE_EXCEEDED: no
    doomed retry), never having gone past the deadline."""
    fake, target, clock = fake_clock
    fake.unavailable = 1000
    policy = RetryPolicy(max_attempts=1000, initial_backoff=5, max_backoff=10)
    with moed.MoEClient(target, retry=policy, timeout=60) as c:
        with pytest.raises(moed.MoEError) as ei:
            c.forward(0, np.ones((5, 8), np.float32), **CHOICE)
    assert ei.value.code_name == "UNAVAILABLE", ei.value
    assert 1 < ei.value.attempts == fake.calls
    assert clock.now <= 60, "an attempt ran past the deadline"
    assert clock.now + 10 + 10 >= 60, "it stopped while another attempt could still fit"


def test_retry_policy_delays():
    p = RetryPolicy(max_attempts=4, initial_backoff=0.1, max_backoff=0.3, multiplier=2)
    U = grpc.StatusCode.UNAVAILABLE
    assert [p.delay(n, U, 0.0, None, rand=lambda: 1.0) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.3, None]
    assert p.delay(1, U, 0.0, None, rand=lambda: 0.0) == 0.0
    waits = [p.delay(2, U, 0.0, None) for _ in range(200)]
    assert all(0 <= w <= 0.2 for w in waits) and len(set(waits)) > 100  # jittered
    assert p.delay(1, grpc.StatusCode.RESOURCE_EXHAUSTED, 0.0, None) is None
    assert p.delay(1, grpc.StatusCode.DEADLINE_EXCEEDED, 0.0, None) is None
    assert p.delay(1, U, 10.0, 10.05, rand=lambda: 0.6) is None  # 10.06 would be past the deadline
    assert p.delay(1, U, 10.0, 10.07, rand=lambda: 0.6) == pytest.approx(0.06)
    assert p.delay(1, U, 10.0, 10.07, took=0.02, rand=lambda: 0.6) is None  # no time for the attempt
    assert NO_RETRY.delay(1, U, 0.0, None) is None
    for bad in (dict(max_attempts=0), dict(initial_backoff=0), dict(max_backoff=0.01), dict(multiplier=0.5)):
        with pytest.raises(ValueError):
            RetryPolicy(**bad)


def test_channel_options_apply_over_the_clients_own(server):
    fake, target = server
    opts = _common.channel_options([("grpc.max_receive_message_length", 64)], keepalive=30)
    assert dict(opts)["grpc.max_receive_message_length"] == 64
    assert dict(opts)["grpc.keepalive_time_ms"] == 30000 and dict(opts)["grpc.max_send_message_length"] == -1
    with pytest.raises(ValueError, match="10 seconds"):
        _common.channel_options(None, keepalive=5)
    x = np.ones((5, 8), np.float32)
    with moed.MoEClient(target, options=[("grpc.max_receive_message_length", 64)], retry=None) as c:
        with pytest.raises(moed.MoEError) as ei:
            c.forward(0, x, **CHOICE)  # the reply is over 160 bytes
        assert ei.value.code_name == "RESOURCE_EXHAUSTED"
    with moed.MoEClient(target, keepalive=10) as c:
        np.testing.assert_array_equal(c.forward(0, x, **CHOICE), x * 2)


def test_per_call_timeout_overrides_the_clients(fake_clock):
    """timeout=30 on the call, 3000 on the client: the attempts carry the call's deadline, and
    with attempts of 10 s (a FakeClock) two fit before it; the call fails with the UNAVAILABLE it
    got at 20 s, not after hundreds of attempts."""
    fake, target, clock = fake_clock
    fake.unavailable = 1000
    with moed.MoEClient(target, timeout=3000, retry=RetryPolicy(max_attempts=1000, initial_backoff=0.02,
                                                                max_backoff=0.02)) as c:
        with pytest.raises(moed.MoEError, match="UNAVAILABLE"):
            c.forward(0, np.ones((5, 8), np.float32), timeout=30, **CHOICE)
    assert fake.calls == 2 and clock.now < 30
    # gRPC rounds a deadline up as it sends it: a little over 30 s, never near the client's 3000
    assert all(r < 60 for r in fake.remaining), fake.remaining


# ---- asyncio -----------------------------------------------------------------------------------

def test_aio_client_has_the_same_methods(server):
    fake, target = server
    reqs = items(5)

    async def source():
        for r in reqs:
            await asyncio.sleep(0)
            yield r

    async def main():
        async with moed.aio.MoEClient(target, retry=RetryPolicy(initial_backoff=0.01)) as c:
            assert await c.health() == "SERVING"
            assert (await c.info()).layer(0).d_ff == 16
            ys = await asyncio.gather(*(c.forward(r["layer"], r["hidden"], expert_ids=r["expert_ids"],
                                                  expert_weights=r["expert_weights"]) for r in reqs))
            streamed = [y async for y in c.forward_stream(source())]
            fake.stream_fail_after = 2
            retried = [y async for y in c.forward_stream(reqs)]  # a plain iterable works too
            last_stream = fake.streams[-1]
            fake.unavailable = 2
            r = await c.forward(0, reqs[0]["hidden"], return_info=True, expert_ids=reqs[0]["expert_ids"],
                                expert_weights=reqs[0]["expert_weights"])
            with pytest.raises(moed.MoEError, match="NOT_FOUND"):
                await c.forward(7, reqs[0]["hidden"], strategy="topk")
            bad = [dict(q) for q in reqs]
            bad[3]["layer"] = 7
            got = []
            with pytest.raises(moed.MoEError) as ei:  # the server's status, also where grpc.aio hid it
                async for y in c.forward_stream(bad):
                    got.append(y)
            assert ei.value.code_name == "NOT_FOUND" and len(got) == 3
            return ys, streamed, retried, r, last_stream

    ys, streamed, retried, r, last_stream = asyncio.run(main())
    for outs in (ys, streamed, retried):
        assert len(outs) == 5
        for y, req in zip(outs, reqs):
            np.testing.assert_array_equal(y, twice(req["hidden"]))
    # s2.. went again on a new stream (or s2 alone as a unary call first, where grpc.aio hid the
    # stream's status: see moed.aio_client)
    assert last_stream[-1] == "s4" and last_stream[0] in ("s2", "s3")
    np.testing.assert_array_equal(r.output, twice(reqs[0]["hidden"]))


def test_importing_moed_loads_neither_torch_nor_protobuf_nor_ml_dtypes():
    code = ("import sys, moed, moed.aio; "
            "print(sorted(m for m in ('torch', 'google.protobuf', 'ml_dtypes', 'moed._proto') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
