"""moed.wire against the generated protobuf classes of proto/: the tables name every field as the
descriptors do; a ForwardRequest encoded by hand is byte for byte what protobuf writes, and
parses back equal, for every field including edge and unknown enum values; replies parse as
protobuf parses them, also with unknown fields of every wire type, repeated and merged fields,
packed and unpacked numbers; and a malformed or random reply fails exactly when protobuf fails."""

import math
import random
import struct

import numpy as np
import pytest
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import DecodeError

from moed import wire
from moed._proto.grpc.health.v1 import health_pb2
from moed._proto.moed.v1 import moed_pb2
from moed.types import ACTIVATIONS, DTYPES, HEALTH, ROUTER_RULES, STRATEGIES, InvalidArgument

KINDS = {FD.TYPE_INT32: "int32", FD.TYPE_INT64: "int64", FD.TYPE_UINT32: "uint32",
         FD.TYPE_UINT64: "uint64", FD.TYPE_ENUM: "enum", FD.TYPE_BOOL: "bool", FD.TYPE_FLOAT: "float",
         FD.TYPE_STRING: "string", FD.TYPE_BYTES: "bytes"}
CLASSES = {"moed.v1." + n: getattr(moed_pb2, n) for n in moed_pb2.DESCRIPTOR.message_types_by_name}
CLASSES.update({"grpc.health.v1." + n: getattr(health_pb2, n)
                for n in health_pb2.DESCRIPTOR.message_types_by_name})


@pytest.mark.parametrize("msg", sorted(wire.SCHEMAS))
def test_tables_match_the_descriptors(msg):
    d = descriptor_pool.Default().FindMessageTypeByName(msg)
    table = wire.SCHEMAS[msg]
    assert sorted(f.number for f in d.fields) == sorted(table), f"{msg}: fields differ from the proto"
    for f in d.fields:
        ours = table[f.number]
        kind = f.message_type.full_name if f.type == FD.TYPE_MESSAGE else KINDS[f.type]
        oneof = f.containing_oneof.name if f.containing_oneof else None
        assert (ours.name, ours.kind, ours.repeated, ours.oneof) == (f.name, kind, f.is_repeated, oneof), msg


def test_every_message_the_client_exchanges_has_a_table():
    used = {"moed.v1.ForwardRequest", "moed.v1.ForwardResponse", "moed.v1.GetModelRequest",
            "moed.v1.ModelInfo", "moed.v1.RegionCommand", "moed.v1.RegionEvent",
            "moed.v1.ListRegionsRequest", "moed.v1.RegionList", "grpc.health.v1.HealthCheckRequest", "grpc.health.v1.HealthCheckResponse"}
    missing = set()
    for name in used:
        stack = [descriptor_pool.Default().FindMessageTypeByName(name)]
        while stack:
            d = stack.pop()
            if d.full_name not in wire.SCHEMAS:
                missing.add(d.full_name)
            stack += [f.message_type for f in d.fields if f.message_type is not None]
    assert not missing


@pytest.mark.parametrize("table,enum", [
    (DTYPES, moed_pb2.DType), (ACTIVATIONS, moed_pb2.Activation), (ROUTER_RULES, moed_pb2.RouterRule),
    (HEALTH, health_pb2.HealthCheckResponse.ServingStatus)])
def test_enum_tables_match_the_proto(table, enum):
    named = {k.lower(): v for k, v in enum.items() if v != 0 or not k.endswith("UNSPECIFIED")}
    assert {k.lower(): v for k, v in table.items()} == named


def test_strategy_table_matches_the_proto():
    assert {k: v for k, v in STRATEGIES.items() if k != "model"} == \
        {k.lower(): v for k, v in moed_pb2.Strategy.items() if v != 0}
    assert STRATEGIES["model"] == moed_pb2.STRATEGY_UNSPECIFIED


# ---- values and their generated twins ------------------------------------------------------------

def generated(msg, value):
    """The generated message of `msg` holding the same fields as our dict `value`."""
    m = CLASSES[msg]()
    fill(m, msg, value)
    return m


def fill(m, msg, value):
    fields = {f.name: f for f in wire.SCHEMAS[msg].values()}
    for name, v in value.items():
        if v is None:
            continue
        f = fields[name]
        if f.kind in wire.SCHEMAS:
            if f.repeated:
                for item in v:
                    fill(getattr(m, name).add(), f.kind, item)
            else:
                getattr(m, name).SetInParent()
                fill(getattr(m, name), f.kind, v)
        elif f.repeated:
            getattr(m, name).extend(v)
        else:
            setattr(m, name, bytes(v) if f.kind == "bytes" else v)


def as_dict(m, msg):
    """A generated message as our decode() dict (floats as their float32 bits, bytes as bytes)."""
    d = {}
    for f in wire.SCHEMAS[msg].values():
        v = getattr(m, f.name)
        if f.kind in wire.SCHEMAS:
            d[f.name] = [as_dict(x, f.kind) for x in v] if f.repeated else \
                (as_dict(v, f.kind) if m.HasField(f.name) else None)
        else:
            d[f.name] = list(v) if f.repeated else v
    for oneof in {f.oneof for f in wire.SCHEMAS[msg].values() if f.oneof}:
        d[oneof] = m.WhichOneof(oneof)
    return normal(d)


def normal(v):
    if isinstance(v, dict):
        return {k: normal(x) for k, x in v.items()}
    if isinstance(v, list):
        return [normal(x) for x in v]
    if isinstance(v, float):
        return struct.pack("<f", v)
    if isinstance(v, memoryview):
        return bytes(v)
    return v


INT32_EDGES = [0, 1, 127, 128, 300, 2**31 - 1, -1, -2**31]
UINT32_EDGES = [0, 1, 127, 128, 16383, 16384, 2**32 - 1]
INT64_EDGES = [0, 1, 8, 2048, 2**35, 2**63 - 1, -1, -2**63]
FLOAT_EDGES = [0.0, -0.0, 0.5, -2.5, 1e-45, 3.4028234663852886e38, 1e39, -1e39, math.inf, -math.inf]


def rand_tensor(rng, absent_ok=True):
    if absent_ok and rng.random() < 0.15:
        return None
    if rng.random() < 0.1:
        return {}  # present, every field at its default
    n = rng.randrange(0, 40)
    return {"dtype": rng.choice(INT32_EDGES + [1, 2, 3, 4, 99]),
            "shape": [rng.choice(INT64_EDGES) for _ in range(rng.randrange(0, 4))],
            "data": rng.randbytes(n) if rng.random() < 0.5 else np.frombuffer(rng.randbytes(n), np.uint8)}


def rand_gating(rng):
    if rng.random() < 0.1:
        return None
    return {"strategy": rng.choice(INT32_EDGES + [1, 5, 17]), "top_k": rng.choice(UINT32_EDGES),
            "renormalize": rng.choice(INT32_EDGES + [1, 2]), "threshold": rng.choice(FLOAT_EDGES)}


def rand_request(rng):
    v = {"request_id": rng.choice(["", "r1", "päd ✓", "x" * 200, "\u0000\uffff\U0001F600"]),
         "layer": rng.choice(UINT32_EDGES), "hidden": rand_tensor(rng)}
    routing = rng.choice(["experts", "logits", "server_router", None])
    if routing == "experts":
        v["experts"] = {"expert_ids": rand_tensor(rng), "expert_weights": rand_tensor(rng)}
    elif routing == "logits":
        v["logits"] = {"logits": rand_tensor(rng), "gating": rand_gating(rng)}
    elif routing == "server_router":
        v["server_router"] = {"gating": rand_gating(rng)}
    if rng.random() < 0.5:
        v["batch_gating"] = {"k_batch": rng.choice(UINT32_EDGES)} if rng.random() < 0.8 else {}
    return v


def test_forward_request_is_what_protobuf_writes():
    rng = random.Random(12)
    for i in range(400):
        v = rand_request(rng)
        ours = wire.encode("moed.v1.ForwardRequest", v)
        ref = generated("moed.v1.ForwardRequest", v)
        assert ours == ref.SerializeToString(deterministic=True), (i, v)
        back = moed_pb2.ForwardRequest.FromString(ours)
        assert back == ref and back.WhichOneof("routing") == ref.WhichOneof("routing"), (i, v)
        assert back.HasField("batch_gating") == ("batch_gating" in v), (i, v)
        # our own decoder reads it back too (its oneof bookkeeping included)
        assert normal(wire.decode("moed.v1.ForwardRequest", ours)) == as_dict(ref, "moed.v1.ForwardRequest")


def test_encoding_refuses_what_protobuf_refuses():
    """Each as InvalidArgument: a value that cannot be encoded is the caller's argument."""
    bad = [{"layer": -1}, {"layer": 2**32}, {"layer": 1.0}, {"layer": "3"}, {"request_id": "\ud800"},
           {"hidden": {"dtype": 2**31}}, {"hidden": {"shape": [2**63]}}, {"hidden": {"data": "text"}},
           {"logits": {"gating": {"threshold": "0.5"}}}]
    for value in bad:
        with pytest.raises(InvalidArgument):
            wire.encode("moed.v1.ForwardRequest", value)
        with pytest.raises((ValueError, TypeError)):  # protobuf refuses the same (if differently)
            generated("moed.v1.ForwardRequest", value).SerializeToString()
    # Stricter than protobuf, which would take bytes for a string and keep the last oneof member:
    for value in ({"request_id": b"id"}, {"experts": {}, "logits": {}}, {"bogus": 1}):
        with pytest.raises(InvalidArgument):
            wire.encode("moed.v1.ForwardRequest", value)


def test_non_contiguous_bytes_are_refused():
    a = np.arange(16, dtype=np.uint8)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        wire.encode("moed.v1.Tensor", {"data": a})


def test_bytes_fields_are_written_from_the_callers_memory():
    a = np.arange(64, dtype=np.uint8)
    parts = []
    wire.encode_parts("moed.v1.ForwardRequest", {"hidden": {"dtype": 1, "shape": [4, 4], "data": a}}, parts)
    views = [p for p in parts if isinstance(p, memoryview)]
    assert len(views) == 1 and np.shares_memory(np.asarray(views[0]), a)


# ---- decoding ----------------------------------------------------------------------------------

def rand_response(rng):
    v = {"request_id": rng.choice(["", "s0", "ü" * 10]), "output": rand_tensor(rng),
         "expert_set": [rng.choice(INT32_EDGES) for _ in range(rng.randrange(0, 5))]}
    if rng.random() < 0.8:
        v["timings"] = {"queue_us": rng.choice(INT64_EDGES[:6]), "compute_us": rng.randrange(0, 2**64),
                        "total_us": 0, "batch_tokens": rng.choice(UINT32_EDGES),
                        "batch_requests": rng.choice(UINT32_EDGES)}
    return v


def rand_model(rng):
    layer = {"index": rng.choice(UINT32_EDGES), "d_model": 4096, "d_ff": 14336, "num_experts": 8,
             "top_k": 2, "activation": rng.choice(INT32_EDGES), "weight_dtype": 3,
             "has_router": rng.random() < 0.5, "norm_topk_prob": True, "router_rule": 2,
             "num_shared_experts": 1, "shared_d_ff": 2048, "n_group": 8, "topk_group": 4,
             "routed_scaling_factor": rng.choice(FLOAT_EDGES)}
    return {"model": "layers=2", "layers": [dict(layer) for _ in range(rng.randrange(0, 3))],
            "backend": "cuda", "devices": [{"name": "H200", "memory_total": 2**37, "memory_used": 5}],
            "version": "0.1.0", "max_message_bytes": 2**28, "max_batch_tokens": 8192}


def unknown_fields(rng):
    """Fields no table knows, one of each wire type (a group included)."""
    n = rng.choice([20, 99, 536870911])
    return rng.choice([wire.varint(n << 3) + wire.varint(rng.randrange(2**64)),
                       wire.varint(n << 3 | 1) + rng.randbytes(8),
                       wire.varint(n << 3 | 2) + wire.varint(3) + b"abc",
                       wire.varint(n << 3 | 5) + rng.randbytes(4),
                       wire.varint(n << 3 | 3) + wire.varint(7 << 3) + b"\x01" + wire.varint(n << 3 | 4)])


def same_parse(msg, data):
    """Our decode and protobuf's parse agree: both fail, or both give the same message."""
    try:
        ref = CLASSES[msg].FromString(data)
    except DecodeError:
        ref = None
    try:
        ours = wire.decode(msg, data)
    except wire.WireError:
        ours = None
    assert (ours is None) == (ref is None), (msg, data, ours, ref)
    if ref is not None:
        assert normal(ours) == as_dict(ref, msg), (msg, data)


@pytest.mark.parametrize("msg,make", [("moed.v1.ForwardResponse", rand_response),
                                      ("moed.v1.ModelInfo", rand_model)])
def test_replies_parse_as_protobuf_parses_them(msg, make):
    rng = random.Random(34)
    for _ in range(150):
        a = generated(msg, make(rng)).SerializeToString()
        b = generated(msg, make(rng)).SerializeToString()
        same_parse(msg, a)
        same_parse(msg, a + b)  # every field seen twice: scalars replaced, messages merged, lists appended
        same_parse(msg, unknown_fields(rng) + a + unknown_fields(rng))


def test_unpacked_and_packed_numbers_both_read():
    unpacked = b"".join(b"\x18" + wire.varint(v & (2**64 - 1)) for v in (3, -1, 7))
    packed = generated("moed.v1.ForwardResponse", {"expert_set": [1, 2]}).SerializeToString()
    for data in (unpacked, packed + unpacked, unpacked + packed):
        same_parse("moed.v1.ForwardResponse", data)
    assert wire.decode("moed.v1.ForwardResponse", unpacked)["expert_set"] == [3, -1, 7]


def test_integers_are_truncated_to_their_width_as_protobuf_does():
    for _, data in (("expert_set", b"\x18" + b"\xff" * 9 + b"\x01"),
                        ("timings", b"\x22\x0b\x20" + b"\xff" * 9 + b"\x01"),
                        ("timings", b"\x22\x0b\x08" + b"\xff" * 9 + b"\x7f")):
        same_parse("moed.v1.ForwardResponse", data)
    for value in (24, 2**63, 2**64 - 1):  # a bool is any non-zero varint
        same_parse("moed.v1.LayerInfo", b"\x40" + wire.varint(value))
        assert wire.decode("moed.v1.LayerInfo", b"\x40" + wire.varint(value))["has_router"] is True


def test_a_new_oneof_member_clears_the_one_before():
    a = generated("moed.v1.ForwardRequest", {"experts": {}, "layer": 1}).SerializeToString()
    b = generated("moed.v1.ForwardRequest", {"server_router": {"gating": {"top_k": 2}}}).SerializeToString()
    for data in (a + b, b + a, a + b + a):
        same_parse("moed.v1.ForwardRequest", data)
    d = wire.decode("moed.v1.ForwardRequest", a + b)
    assert d["routing"] == "server_router" and d["experts"] is None


def test_every_truncation_and_random_bytes_fail_as_protobuf_fails():
    rng = random.Random(56)
    for _ in range(20):
        data = generated("moed.v1.ForwardResponse", rand_response(rng)).SerializeToString()
        for cut in range(len(data)):
            same_parse("moed.v1.ForwardResponse", data[:cut])
    for _ in range(3000):
        same_parse("moed.v1.ForwardResponse", rng.randbytes(rng.randrange(0, 24)))
    for _ in range(1500):  # valid messages with a few bytes changed
        msg, make = rng.choice([("moed.v1.ForwardResponse", rand_response), ("moed.v1.ModelInfo", rand_model)])
        data = bytearray(generated(msg, make(rng)).SerializeToString())
        for _ in range(rng.randrange(1, 4)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        same_parse(msg, bytes(data))
    for bad in (b"\x0a\x02\xff\xfe",  # request_id not UTF-8
                b"\x00\x00",  # field number 0
                b"\x08" + b"\xff" * 10 + b"\x01",  # a varint of 11 bytes
                b"\x1b\x18\x01",  # a group that never ends
                b"\x1b\x24",  # a group ended by another field number
                b"\x0c",  # an end of group with no start
                b"\x12\x05\x08\x01"):  # a length past the end
        same_parse("moed.v1.ForwardResponse", bad)
        with pytest.raises(wire.WireError):
            wire.decode("moed.v1.ForwardResponse", bad)


def test_bytes_are_read_in_place():
    data = generated("moed.v1.ForwardResponse", {"output": {"dtype": 1, "shape": [2], "data": b"\1" * 8}}
                     ).SerializeToString()
    out = wire.decode("moed.v1.ForwardResponse", data)["output"]["data"]
    assert isinstance(out, memoryview) and out.obj is data and bytes(out) == b"\1" * 8
