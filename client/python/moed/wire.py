"""The protobuf wire format of the messages the client exchanges with moed, written by hand.

Why not the generated classes: they copy a tensor's bytes into the message, again into the
serialized string, and a reply's bytes into a new object, which at T = 2048 costs more than the
server's compute. Here a message is a list of parts that one bytes.join writes out, so a tensor's
bytes go from the caller's memory into the message gRPC sends in one copy; and a reply's `bytes`
fields are memoryview slices of the received buffer, so reading them copies nothing. It also
leaves the client free of the protobuf runtime and its version pins.

Each message is a table (SCHEMAS): field number -> Field(name, kind, repeated, oneof), where kind
is a scalar kind ("uint32", "string", "bytes", ...) or the full name of a message. A test compares
every table with the generated descriptors of proto/, so the tables cannot drift from the protos.

Values are plain dicts keyed by field name. encode() writes a field when it differs from its
default (proto3), a message field whenever it is present (not None), a oneof member always, and
repeated numbers packed. decode() follows the protobuf parsing rules: unknown fields of every wire
type are skipped, the last value of a scalar wins, a repeated message field appends, a message
field seen twice is merged, repeated numbers are read packed or not, a new oneof member clears the
one before (the dict's entry under the oneof's name says which is set), integers are truncated
to their width, strings must be UTF-8. Absent fields read as their defaults (None for messages).
"""

from __future__ import annotations

import math
import struct
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

Buffer = Union[bytes, bytearray, memoryview]


class Field(NamedTuple):
    """One field of a message table."""

    number: int
    name: str
    kind: str  # a scalar kind (SCALARS) or a message's full name
    repeated: bool = False
    oneof: Optional[str] = None


class WireError(ValueError):
    """A message that does not parse (truncated, a bad length or wire type, invalid UTF-8)."""


# Scalar kinds -> (wire type, integer width in bits, signed); floats have width 0.
SCALARS = {"int32": (0, 32, True), "int64": (0, 64, True), "uint32": (0, 32, False),
           "uint64": (0, 64, False), "enum": (0, 32, True), "bool": (0, 1, False),
           "float": (5, 0, False), "string": (2, 0, False), "bytes": (2, 0, False)}
_DEFAULTS = {"string": "", "bytes": b"", "bool": False, "float": 0.0}


def _table(name: str, *rows) -> Tuple[str, Dict[int, Field]]:
    """A message table from rows (name, number, kind[, oneof]); kind ending in '*' is repeated."""
    fields = {}
    for row in rows:
        fname, number, kind = row[:3]
        fields[number] = Field(number, fname, kind.rstrip("*"), kind.endswith("*"),
                               row[3] if len(row) > 3 else None)
    return name, fields


SCHEMAS: Dict[str, Dict[int, Field]] = dict([
    _table("moed.v1.Tensor", ("dtype", 1, "enum"), ("shape", 2, "int64*"), ("data", 3, "bytes")),
    _table("moed.v1.Gating", ("strategy", 1, "enum"), ("top_k", 2, "uint32"),
           ("renormalize", 3, "enum"), ("threshold", 4, "float")),
    _table("moed.v1.ExpertChoice", ("expert_ids", 1, "moed.v1.Tensor"),
           ("expert_weights", 2, "moed.v1.Tensor")),
    _table("moed.v1.RouterLogits", ("logits", 1, "moed.v1.Tensor"), ("gating", 2, "moed.v1.Gating")),
    _table("moed.v1.ServerRouter", ("gating", 1, "moed.v1.Gating")),
    _table("moed.v1.BatchGating", ("k_batch", 1, "uint32")),
    _table("moed.v1.ForwardRequest", ("request_id", 1, "string"), ("layer", 2, "uint32"),
           ("hidden", 3, "moed.v1.Tensor"), ("experts", 4, "moed.v1.ExpertChoice", "routing"),
           ("logits", 5, "moed.v1.RouterLogits", "routing"),
           ("server_router", 6, "moed.v1.ServerRouter", "routing"),
           ("batch_gating", 7, "moed.v1.BatchGating")),
    _table("moed.v1.Timings", ("queue_us", 1, "uint64"), ("compute_us", 2, "uint64"),
           ("total_us", 3, "uint64"), ("batch_tokens", 4, "uint32"), ("batch_requests", 5, "uint32")),
    _table("moed.v1.ForwardResponse", ("request_id", 1, "string"), ("output", 2, "moed.v1.Tensor"),
           ("expert_set", 3, "int32*"), ("timings", 4, "moed.v1.Timings")),
    _table("moed.v1.GetModelRequest"),
    _table("moed.v1.LayerInfo", ("index", 1, "uint32"), ("d_model", 2, "uint32"), ("d_ff", 3, "uint32"),
           ("num_experts", 4, "uint32"), ("top_k", 5, "uint32"), ("activation", 6, "enum"),
           ("weight_dtype", 7, "enum"), ("has_router", 8, "bool"), ("norm_topk_prob", 9, "bool"),
           ("router_rule", 10, "enum"), ("num_shared_experts", 11, "uint32"),
           ("shared_d_ff", 12, "uint32"), ("n_group", 13, "uint32"), ("topk_group", 14, "uint32"),
           ("routed_scaling_factor", 15, "float")),
    _table("moed.v1.Device", ("name", 1, "string"), ("memory_total", 2, "uint64"),
           ("memory_used", 3, "uint64")),
    _table("moed.v1.ModelInfo", ("model", 1, "string"), ("layers", 2, "moed.v1.LayerInfo*"),
           ("backend", 3, "string"), ("devices", 4, "moed.v1.Device*"), ("version", 5, "string"),
           ("max_message_bytes", 6, "uint64"), ("max_batch_tokens", 7, "uint32")),
    _table("grpc.health.v1.HealthCheckRequest", ("service", 1, "string")),
    _table("grpc.health.v1.HealthCheckResponse", ("status", 1, "enum")),
])
_BY_NAME = {msg: {f.name: f for f in fields.values()} for msg, fields in SCHEMAS.items()}
_ONEOFS = {msg: {f.oneof for f in fields.values() if f.oneof} for msg, fields in SCHEMAS.items()}

# ---- encoding ---------------------------------------------------------------------------------
# Each message compiles, on first use, to one function per field in field-number order that
# appends the field's parts to a list and returns their size; a nested message is encoded into a
# list of its own first, because its length precedes it.

_SMALL = [bytes((i,)) for i in range(128)]
_U64 = (1 << 64) - 1


def varint(n: int) -> bytes:
    """The varint of 0 <= n < 2**64."""
    if n < 128:
        return _SMALL[n]
    out = bytearray()
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def _int_bits(f: Field):
    """v -> the unsigned value its varint carries; TypeError/ValueError when v does not fit f."""
    _, width, signed = SCALARS[f.kind]
    lo, hi = (-(1 << (width - 1)), 1 << (width - 1)) if signed else (0, 1 << width)

    def bits(v: Any) -> int:
        if type(v) is not int:
            if isinstance(v, float) or not hasattr(v, "__index__"):
                raise TypeError(f"{f.name} must be an integer, not {type(v).__name__}")
            v = v.__index__()
        if not lo <= v < hi:
            raise ValueError(f"{f.name} = {v} is out of range for {f.kind}")
        return v & _U64  # negative: 64-bit two's complement, as protobuf writes int32

    return bits


def _f32(v: Any) -> bytes:
    """v rounded to float32, little-endian; beyond float32's range it is +-inf, as protobuf does."""
    try:
        return _F32.pack(v)
    except OverflowError:
        return _F32.pack(math.copysign(math.inf, v))


def _raw(f: Field):
    """v -> (the bytes a string or bytes field carries, their length)."""
    if f.kind == "string":
        def utf8(v):
            if not isinstance(v, str):
                raise TypeError(f"{f.name} must be a str, not {type(v).__name__}")
            b = v.encode("utf-8")
            return b, len(b)

        return utf8

    def buffer(v):
        m = memoryview(v)
        if not m.c_contiguous:
            raise ValueError(f"{f.name} must be contiguous memory")
        return m, m.nbytes

    return buffer


def _field_encoder(f: Field):
    """(value, out) -> bytes appended, for one present field."""
    wire = 2 if f.kind in SCHEMAS or f.repeated else SCALARS[f.kind][0]
    key = varint((f.number << 3) | wire)
    implicit = not f.repeated and f.oneof is None  # proto3: the default is not written
    if f.kind in SCHEMAS:
        def message(v, out, encoders=_ENCODERS):
            sub: List[Any] = []
            n = encoders[f.kind](v, sub)
            head = key + varint(n)
            out.append(head)
            out += sub
            return len(head) + n

        return (lambda vs, out: sum([message(v, out) for v in vs])) if f.repeated else message
    if f.kind in ("string", "bytes"):
        raw = _raw(f)

        def one(v, out):
            b, n = raw(v)
            if n == 0 and implicit:
                return 0
            head = key + varint(n)
            out.append(head)
            out.append(b)
            return len(head) + n

        return (lambda vs, out: sum([one(v, out) for v in vs])) if f.repeated else one
    if f.kind == "float":
        value = _f32
        default = b"\0\0\0\0"  # not -0.0: protobuf writes that one
    else:
        bits = _int_bits(f)

        def value(v, small=_SMALL):
            return small[v] if type(v) is int and 0 <= v < 128 else varint(bits(v))

        default = b"\0"
    if f.repeated:  # packed
        def packed(vs, out):
            if len(vs) == 0:
                return 0
            body = b"".join([value(v) for v in vs])
            head = key + varint(len(body))
            out.append(head)
            out.append(body)
            return len(head) + len(body)

        return packed

    def scalar(v, out):
        b = value(v)
        if implicit and b == default:
            return 0
        out.append(key + b)
        return len(key) + len(b)

    return scalar


def _compile_encoder(msg: str):
    fields = sorted(SCHEMAS[msg].values(), key=lambda f: f.number)
    steps = [(f.name, _field_encoder(f)) for f in fields]
    names = frozenset(f.name for f in fields)
    oneofs = [(o, [f.name for f in fields if f.oneof == o]) for o in sorted(_ONEOFS[msg])]

    def enc(value: Dict[str, Any], out: List[Any]) -> int:
        if not names.issuperset(value):
            raise ValueError(f"{msg} has no field {sorted(set(value) - names)[0]!r}")
        for oneof, members in oneofs:
            set_ = [m for m in members if value.get(m) is not None]
            if len(set_) > 1:
                raise ValueError(f"{msg}: {' and '.join(set_)} are members of oneof {oneof}: set one")
        size = 0
        for name, step in steps:
            v = value.get(name)
            if v is not None:
                size += step(v, out)
        return size

    return enc


class _Compiled(dict):
    """message name -> its compiled function, compiled on first use."""

    def __init__(self, compile_):
        super().__init__()
        self.compile = compile_

    def __missing__(self, msg):
        fn = self[msg] = self.compile(msg)
        return fn


_ENCODERS = _Compiled(_compile_encoder)


def encode_parts(msg: str, value: Dict[str, Any], out: List[Any]) -> int:
    """Appends the encoding of `value` (a dict) as message `msg` to `out`; returns its size.
    Buffers in `out` are the caller's memory (bytes fields): join them while it is unchanged."""
    return _ENCODERS[msg](value, out)


def encode(msg: str, value: Dict[str, Any]) -> bytes:
    """Message `msg` with the fields of `value`, serialized; a bytes field's memory is copied once."""
    parts: List[Any] = []
    _ENCODERS[msg](value, parts)
    return b"".join(parts)


# ---- decoding ---------------------------------------------------------------------------------
# Each message compiles to a table: key (field number and wire type) -> a handler that reads one
# value at pos into the message's dict and returns the position after it. A key not in the table
# (an unknown field, or a known one in another wire type, which protobuf also treats as unknown)
# is skipped.

_F32 = struct.Struct("<f")


def _read_varint(buf: memoryview, pos: int, end: int) -> Tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        n |= (b & 127) << shift
        if b < 128:
            return n & _U64, pos  # bits past 64 are dropped, as protobuf does
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes")


def _skip(buf: memoryview, pos: int, end: int, key: int) -> int:
    """The position after an unknown field's value (groups included, as protobuf accepts them)."""
    wire, number = key & 7, key >> 3
    if not 0 < number < 1 << 29:
        raise WireError(f"field number {number}")
    if wire == 0:
        return _read_varint(buf, pos, end)[1]
    if wire == 1 or wire == 5:
        pos += 8 if wire == 1 else 4
    elif wire == 2:
        n, pos = _read_varint(buf, pos, end)
        pos += n
    elif wire == 3:
        while True:
            inner, pos = _read_varint(buf, pos, end)
            if inner & 7 == 4:
                if inner >> 3 != number:
                    raise WireError("mismatched end of group")
                return pos
            pos = _skip(buf, pos, end, inner)
    else:
        raise WireError(f"wire type {wire}")
    if pos > end:
        raise WireError("truncated field")
    return pos


def _span(buf: memoryview, pos: int, end: int, name: str) -> Tuple[int, int]:
    """A length-delimited value at pos: (start, stop) of its contents."""
    n = buf[pos] if pos < end else 128
    if n < 128:
        pos += 1
    else:
        n, pos = _read_varint(buf, pos, end)
    if pos + n > end:
        raise WireError(f"{name}: length {n} past the end of the message")
    return pos, pos + n


def _reader(f: Field):
    """(buf, pos, end, previous) -> (value, position after it), for one value in f's wire type."""
    name, kind = f.name, f.kind
    if kind in SCHEMAS:
        def message(buf, pos, end, prev):
            start, stop = _span(buf, pos, end, name)
            sub = prev if prev is not None else new(kind)
            _DECODERS[kind](buf, start, stop, sub)
            return sub, stop

        return message
    if kind == "bytes":
        def raw(buf, pos, end, prev):
            start, stop = _span(buf, pos, end, name)
            return buf[start:stop], stop

        return raw
    if kind == "string":
        def text(buf, pos, end, prev):
            start, stop = _span(buf, pos, end, name)
            try:
                return str(buf[start:stop], "utf-8"), stop
            except UnicodeDecodeError:
                raise WireError(f"{name} is not valid UTF-8") from None

        return text
    if kind == "float":
        def f32(buf, pos, end, prev):
            if pos + 4 > end:
                raise WireError(f"{name}: truncated float")
            return _F32.unpack_from(buf, pos)[0], pos + 4

        return f32
    _, width, signed = SCALARS[kind]
    mask = _U64 if kind == "bool" else (1 << width) - 1  # a bool is any non-zero varint
    sign = 1 << (width - 1) if signed else 0  # two's complement: subtract twice the sign bit

    def integer(buf, pos, end, prev):
        n = buf[pos] if pos < end else 128
        if n < 128:
            pos += 1
        else:
            n, pos = _read_varint(buf, pos, end)
        n = (n & mask) - ((n & sign) << 1)
        return (n != 0 if kind == "bool" else n), pos

    return integer


def _handlers(f: Field) -> Dict[int, Any]:
    """key -> handler(buf, pos, end, d) -> pos, for field f."""
    read = _reader(f)
    wire = 2 if f.kind in SCHEMAS else SCALARS[f.kind][0]
    name, oneof = f.name, f.oneof
    if f.repeated:
        def append(buf, pos, end, d):
            v, pos = read(buf, pos, end, None)
            d[name].append(v)
            return pos

        out = {(f.number << 3) | wire: append}
        if wire != 2:  # numbers: packed too
            def packed(buf, pos, end, d):
                start, stop = _span(buf, pos, end, name)
                values = d[name]
                while start < stop:
                    v, start = read(buf, start, stop, None)
                    values.append(v)
                return stop

            out[(f.number << 3) | 2] = packed
        return out

    def assign(buf, pos, end, d):
        d[name], pos = read(buf, pos, end, d[name])
        return pos

    def assign_member(buf, pos, end, d):
        other = d[oneof]
        if other is not None and other != name:
            d[other] = None  # a new member of a oneof clears the one before
        d[oneof] = name
        return assign(buf, pos, end, d)

    return {(f.number << 3) | wire: assign if oneof is None else assign_member}


def _compile_decoder(msg: str):
    table: Dict[int, Any] = {}
    for f in SCHEMAS[msg].values():
        table.update(_handlers(f))
    get = table.get

    def dec(buf: memoryview, pos: int, end: int, d: Dict[str, Any]) -> None:
        while pos < end:
            key = buf[pos]
            if key < 128:
                pos += 1
            else:
                key, pos = _read_varint(buf, pos, end)
            h = get(key)
            pos = h(buf, pos, end, d) if h is not None else _skip(buf, pos, end, key)

    return dec


_DECODERS = _Compiled(_compile_decoder)


def _template(msg: str) -> Tuple[Dict[str, Any], List[str]]:
    d: Dict[str, Any] = {}
    lists = []
    for f in SCHEMAS[msg].values():
        if f.repeated:
            lists.append(f.name)
        d[f.name] = None if f.kind in SCHEMAS or f.repeated else _DEFAULTS.get(f.kind, 0)
    for oneof in _ONEOFS[msg]:
        d[oneof] = None
    return d, lists


_TEMPLATES = _Compiled(_template)


def new(msg: str) -> Dict[str, Any]:
    """Message `msg` with every field at its default (repeated: [], message: None)."""
    template, lists = _TEMPLATES[msg]
    d = dict(template)
    for name in lists:
        d[name] = []
    return d


def decode(msg: str, data: Buffer) -> Dict[str, Any]:
    """Message `msg` parsed from data; bytes fields are memoryview slices of data (no copy)."""
    buf = memoryview(data)
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B")
    d = new(msg)
    _DECODERS[msg](buf, 0, len(buf), d)
    return d
