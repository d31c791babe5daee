"""Messages as another protobuf stack may write them, sent as raw bytes: unknown fields of every wire
type, groups among them, are skipped by every method as protobuf's own parsers skip them. Groups
(a proto2 encoding no moed client sends) may nest 100 deep, as deep as protobuf's default
recursion limit lets its parsers read; deeper is refused naming the bound. A RegionCommand that
does not parse is answered with the seq it carried, so a caller can tell which command failed.
"""

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError

import oracle as O
from conftest import DEFAULT_SPEC
from moed import MoEClient
from moed._proto.grpc.health.v1 import health_pb2
from moed._proto.moed.v1 import moed_pb2 as pb

SPEC = O.Spec.parse(DEFAULT_SPEC)


def varint(v):
    out = b""
    while v >= 0x80:
        out += bytes([v & 0x7F | 0x80])
        v >>= 7
    return out + bytes([v])


def tag(field, wt):
    return varint(field << 3 | wt)


def group(field, depth):
    """An unknown group `depth` deep, holding a varint, a string and a 32-bit value innermost."""
    inner = group(field, depth - 1) if depth > 1 else tag(1, 0) + varint(7) + tag(2, 2) + b"\x02hi" + tag(3, 5) + b"abcd"
    return tag(field, 3) + inner + tag(field, 4)


def message(field, body):
    return tag(field, 2) + varint(len(body)) + body


def forward(d, body):
    """The output tensor Forward answers the raw request bytes with."""
    with d.channel() as ch:
        return pb.ForwardResponse.FromString(ch.unary_unary("/moed.v1.Moed/Forward")(body, timeout=30)).output


@pytest.fixture(scope="module")
def served(shared_daemon):
    d = shared_daemon
    rng = np.random.default_rng(3)
    x, _ = O.hidden(rng, 4, SPEC.d, "f32")
    ids = np.stack([rng.permutation(SPEC.experts)[:2] for _ in range(4)]).astype(np.int32)
    w = rng.uniform(0.1, 1, (4, 2)).astype(np.float32)
    with MoEClient(d.address, timeout=30) as c:
        req = c.build_request(0, x, expert_ids=ids, expert_weights=w).SerializeToString()
    return d, req, forward(d, req)


def test_forward_skips_groups_as_deep_as_protobuf_reads_them(served):
    d, req, want = served
    r = pb.ForwardRequest.FromString(req)
    hidden = r.hidden.SerializeToString()
    r.ClearField("hidden")
    rest = r.SerializeToString()
    for depth in (1, 17, 100):
        assert pb.ForwardRequest.FromString(req + group(99, depth))  # protobuf reads it
        assert forward(d, group(98, depth) + req + group(99, depth)) == want, depth
        # inside a sub-message too (the hidden tensor holds one)
        assert forward(d, rest + message(3, hidden + group(97, depth - 1 or 1))) == want, depth
    with pytest.raises(DecodeError):
        pb.ForwardRequest.FromString(req + group(99, 101))  # past protobuf's limit too
    with pytest.raises(grpc.RpcError) as e:
        forward(d, req + group(99, 101))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "deeper than 100" in e.value.details()


def test_health_skips_unknown_groups(served):
    d, _, _ = served
    body = health_pb2.HealthCheckRequest(service="moed.v1.Moed").SerializeToString()
    with d.channel() as ch:
        for extra in (group(5, 1), group(5, 100), tag(6, 0) + varint(1) + group(7, 3) + message(8, b"x")):
            got = ch.unary_unary("/grpc.health.v1.Health/Check")(extra + body + extra, timeout=30)
            assert health_pb2.HealthCheckResponse.FromString(got).status == health_pb2.HealthCheckResponse.SERVING


def regions_stream(ch):
    """(send raw command bytes, receive one RegionEvent)."""
    import queue

    q = queue.Queue()
    events = ch.stream_stream("/moed.v1.Moed/Regions")(iter(q.get, None), timeout=60)

    def send(body):
        q.put(body)
        return pb.RegionEvent.FromString(next(events))

    return send, lambda: q.put(None)


def test_region_commands_skip_unknown_groups_and_name_their_seq(served):
    d, _, _ = served
    with d.channel() as ch:
        send, close = regions_stream(ch)
        try:
            # unregister of a region that does not exist: NOT_FOUND, the command understood
            unregister = message(5, tag(1, 0) + varint(12345))
            for seq, extra in enumerate((group(9, 1), group(9, 100), tag(10, 1) + b"8 bytes!" + group(11, 2)), 1):
                ev = send(tag(1, 0) + varint(seq) + extra + unregister + extra)
                assert ev.seq == seq and ev.code == grpc.StatusCode.NOT_FOUND.value[0], (seq, ev)
                assert "12345" in ev.message, ev.message
            # a group inside the known sub-message too
            ev = send(tag(1, 0) + varint(7) + message(5, group(3, 4) + tag(1, 0) + varint(777)))
            assert ev.seq == 7 and ev.code == grpc.StatusCode.NOT_FOUND.value[0] and "777" in ev.message, ev
            # a command that does not parse is answered with the seq it carried
            for seq, bad in ((8, b"\x0f"), (9, group(9, 101)), (10, message(5, b"\xff"))):
                ev = send(tag(1, 0) + varint(seq) + bad)
                assert ev.seq == seq and ev.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], (seq, ev)
                assert ev.message, ev
        finally:
            close()
