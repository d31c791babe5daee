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

from .types import InvalidArgument

Buffer = Union[bytes, bytearray, memoryview]


class Field(NamedTuple):
    """One field of a message table."""

    number: int
    name: str
    kind: str  # a scalar kind (SCALARS) or a message's full name
    repeated: bool = False
    oneof: Optional[str] = None


class WireError(ValueError):
    """A message that does not parse (truncated, a bad length or wire type, invalid UTF-8). A value
    that cannot be encoded is moed.types.InvalidArgument instead: it is the caller's argument."""


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
    _table("moed.v1.RegionRef", ("region", 1, "uint64"), ("offset", 2, "uint64"),
           ("length", 3, "uint64")),
    _table("moed.v1.Tensor", ("dtype", 1, "enum"), ("shape", 2, "int64*"),
           ("data", 3, "bytes", "contents"), ("region", 4, "moed.v1.RegionRef", "contents")),
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
           ("batch_gating", 7, "moed.v1.BatchGating"), ("output", 8, "moed.v1.RegionRef"),
           ("expect", 9, "moed.v1.Expectation")),
    _table("moed.v1.Expectation", ("model_fingerprint", 1, "uint64"),
           ("experts_held", 2, "moed.v1.ExpertRange*"), ("adds_shared_experts", 3, "bool")),
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
           ("routed_scaling_factor", 15, "float"), ("experts_held", 16, "moed.v1.ExpertRange*"),
           ("adds_shared_experts", 17, "bool"), ("home_device", 18, "uint32"),
           ("expert_placement", 19, "moed.v1.ExpertPlacement*"), ("sparse24", 20, "bool"),
           ("expert_replicas", 21, "moed.v1.ExpertPlacement*"), ("placement_generation", 22, "uint32")),
    _table("moed.v1.ExpertRange", ("first", 1, "uint32"), ("last", 2, "uint32")),
    _table("moed.v1.ExpertPlacement", ("first", 1, "uint32"), ("last", 2, "uint32"),
           ("device", 3, "uint32")),
    _table("moed.v1.Device", ("name", 1, "string"), ("memory_total", 2, "uint64"),
           ("memory_used", 3, "uint64")),
    _table("moed.v1.ModelInfo", ("model", 1, "string"), ("layers", 2, "moed.v1.LayerInfo*"),
           ("backend", 3, "string"), ("devices", 4, "moed.v1.Device*"), ("version", 5, "string"),
           ("max_message_bytes", 6, "uint64"), ("max_batch_tokens", 7, "uint32"),
           ("regions", 8, "moed.v1.RegionLimits"), ("model_fingerprint", 9, "uint64"),
           ("loading", 10, "moed.v1.LoadProgress")),
    _table("moed.v1.LoadProgress", ("phase", 1, "string"), ("phase_number", 2, "uint32"),
           ("phases", 3, "uint32"), ("layer", 4, "int32"), ("layers_done", 5, "uint32"),
           ("layers_total", 6, "uint32"), ("bytes_done", 7, "uint64"), ("bytes_total", 8, "uint64"),
           ("percent", 9, "float"), ("elapsed_seconds", 10, "float"),
           ("bytes_per_second", 11, "float"), ("eta_seconds", 12, "float")),
    _table("moed.v1.RegionLimits", ("mode", 1, "string"), ("max_regions", 2, "uint32"),
           ("max_region_bytes", 3, "uint64"), ("max_region_bytes_total", 4, "uint64"),
           ("cuda", 5, "bool"), ("max_rings", 6, "uint32")),
    _table("moed.v1.RegionCommand", ("seq", 1, "uint64"),
           ("register_host", 2, "moed.v1.RegisterHostRegion", "command"),
           ("confirm_host", 3, "moed.v1.ConfirmHostRegion", "command"),
           ("register_cuda", 4, "moed.v1.RegisterCudaRegion", "command"),
           ("unregister", 5, "moed.v1.UnregisterRegion", "command"),
           ("register_ring", 6, "moed.v1.RegisterRing", "command"),
           ("unregister_ring", 7, "moed.v1.UnregisterRing", "command"),
           ("open_link", 8, "moed.v1.OpenLink", "command"),
           ("close_link", 9, "moed.v1.CloseLink", "command")),
    _table("moed.v1.RegisterHostRegion", ("name", 1, "string"), ("bytes", 2, "uint64")),
    _table("moed.v1.ConfirmHostRegion", ("region", 1, "uint64")),
    _table("moed.v1.RegisterCudaRegion", ("ipc_handle", 1, "bytes"), ("device_uuid", 2, "string"),
           ("device", 3, "uint32"), ("bytes", 4, "uint64"), ("offset", 5, "uint64")),
    _table("moed.v1.UnregisterRegion", ("region", 1, "uint64")),
    _table("moed.v1.RegisterRing", ("region", 1, "uint64"), ("offset", 2, "uint64"), ("slots", 3, "uint32")),
    _table("moed.v1.UnregisterRing", ("ring", 1, "uint64")),
    _table("moed.v1.Ring", ("id", 1, "uint64"), ("region", 2, "uint64"), ("offset", 3, "uint64"),
           ("slots", 4, "uint32"), ("version", 5, "uint32")),
    _table("moed.v1.OpenLink", ("max_tokens", 1, "uint32"), ("max_top_k", 2, "uint32"),
           ("device_plus_one", 3, "uint32")),
    _table("moed.v1.CloseLink", ("link", 1, "uint64")),
    _table("moed.v1.Link", ("id", 1, "uint64"), ("unique_id", 2, "bytes"), ("key", 3, "bytes"),
           ("device", 4, "uint32"), ("version", 5, "uint32"), ("nccl_version", 6, "uint32"),
           ("max_payload_bytes", 7, "uint64")),
    _table("moed.v1.RegionEvent", ("seq", 1, "uint64"), ("code", 2, "int32"), ("message", 3, "string"),
           ("region", 4, "moed.v1.Region"), ("challenge", 5, "bytes"), ("ring", 6, "moed.v1.Ring"),
           ("link", 7, "moed.v1.Link")),
    _table("moed.v1.Region", ("id", 1, "uint64"), ("kind", 2, "enum"), ("name", 3, "string"),
           ("bytes", 4, "uint64"), ("device", 5, "uint32"), ("ready", 6, "bool"), ("broken", 7, "bool"),
           ("requests", 8, "uint32")),
    _table("moed.v1.ListRegionsRequest"),
    _table("moed.v1.RegionList", ("regions", 1, "moed.v1.Region*")),
    _table("grpc.health.v1.HealthCheckRequest", ("service", 1, "string")),
    _table("grpc.health.v1.HealthCheckResponse", ("status", 1, "enum")),
])
_BY_NAME = {msg: {f.name: f for f in fields.values()} for msg, fields in SCHEMAS.items()}
_ONEOFS = {msg: {f.oneof for f in fields.values() if f.oneof} for msg, fields in SCHEMAS.items()}

# ---- encoding and decoding, compiled --------------------------------------------------------------
# Each table compiles, on first use, into one Python function for encoding and one for decoding,
# generated as source with every field's key, width and name written in as constants: a message is
# then a straight run of dict lookups and byte appends, without a call per field (a closure per
# field costs twice as much, and the client encodes and decodes on every call).

_U64 = (1 << 64) - 1
_SMALL = [bytes((i,)) for i in range(128)]


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


def _bits(f: Field, v: Any) -> int:
    """v as the unsigned integer its varint carries; InvalidArgument when it does not fit f."""
    if isinstance(v, float) or not hasattr(v, "__index__"):
        raise InvalidArgument(f"{f.name} must be an integer, not {type(v).__name__}")
    n = v.__index__()
    _, width, signed = SCALARS[f.kind]
    lo, hi = (-(1 << (width - 1)), 1 << (width - 1)) if signed else (0, 1 << width)
    if f.kind == "bool":
        lo, hi = 0, 2
    if not lo <= n < hi:
        raise InvalidArgument(f"{f.name} = {n} is out of range for {f.kind}")
    return n & _U64  # negative: 64-bit two's complement, as protobuf writes int32


def _f32(f: Field, v: Any) -> bytes:
    """v rounded to float32, little-endian; beyond float32's range it is +-inf, as protobuf does."""
    try:
        return _F32.pack(v)
    except OverflowError:
        return _F32.pack(math.copysign(math.inf, v))
    except struct.error:
        raise InvalidArgument(f"{f.name} must be a number, not {type(v).__name__}") from None


def _utf8(f: Field, v: Any) -> bytes:
    """A string field's value that is not a str (a subclass is encoded; anything else refused)."""
    if not isinstance(v, str):
        raise InvalidArgument(f"{f.name} must be a str, not {type(v).__name__}")
    return v.encode("utf-8")


def _buffer(f: Field, v: Any) -> None:
    """Refuses a bytes field's value that is not one contiguous buffer."""
    raise InvalidArgument(f"{f.name} must be contiguous memory")


def _int_fast(f: Field) -> str:
    """The condition under which an int of field f needs no check (the fast path)."""
    _, width, signed = SCALARS[f.kind]
    lo, hi = (-(1 << (width - 1)), 1 << (width - 1)) if signed else (0, 1 << width)
    return f"type(x) is int and {lo} <= x < {hi}" if f.kind != "bool" else "type(x) is bool"


def _encode_field(f: Field) -> List[str]:
    """Source lines (indented for enc's body) that append present field `x` of f to out."""
    wire = 2 if f.kind in SCHEMAS or f.repeated else SCALARS[f.kind][0]
    key = varint((f.number << 3) | wire)
    implicit = not f.repeated and f.oneof is None  # proto3: a default value is not written
    F = f"_F[{f.number}]"
    if f.kind in SCHEMAS:
        one = [f"sub = []", f"n = _ENC[{f.kind!r}](x, sub)", f"h = {key!r} + varint(n)",
               "out.append(h)", "out += sub", "size += len(h) + n"]
        return (["for x in x:"] + ["    " + line for line in one]) if f.repeated else one
    if f.kind in ("string", "bytes"):
        raw = ([f"b = x.encode('utf-8') if type(x) is str else _utf8({F}, x)", "n = len(b)"]
               if f.kind == "string" else
               ["b = x if type(x) is memoryview else memoryview(x)", "if not b.c_contiguous:",
                f"    _buffer({F}, x)", "n = b.nbytes"])
        put = [f"h = {key!r} + varint(n)", "out.append(h)", "out.append(b)", "size += len(h) + n"]
        if f.repeated:
            return ["for x in x:"] + ["    " + line for line in raw + put]
        return raw + ([f"if n:"] + ["    " + line for line in put] if implicit else put)
    if f.kind == "float":
        value, default = f"_f32({F}, x)", b"\0\0\0\0"  # -0.0 differs from the default: it is written
    else:
        value = (f"(_SMALL[x] if 0 <= x < 128 else varint(x & {_U64})) if {_int_fast(f)} "
                 f"else varint(_bits({F}, x))")
        default = b"\0"
    if f.repeated:  # packed
        return ["if len(x):", f"    body = b''.join([{value} for x in x])",
                f"    h = {key!r} + varint(len(body))", "    out.append(h)", "    out.append(body)",
                "    size += len(h) + len(body)"]
    put = [f"b = {value}"] + ([f"if b != {default!r}:"] if implicit else ["if True:"])
    return put + [f"    out.append({key!r} + b)", f"    size += {len(key)} + len(b)"]


def _compile_encoder(msg: str):
    fields = sorted(SCHEMAS[msg].values(), key=lambda f: f.number)
    src = ["def enc(v, out):", "    if not _NAMES.issuperset(v):", "        _unknown(v)"]
    for oneof in sorted(_ONEOFS[msg]):
        members = [f.name for f in fields if f.oneof == oneof]
        present = " + ".join(f"(v.get({m!r}) is not None)" for m in members)
        src += [f"    if {present} > 1:",
                f"        _two_members({oneof!r}, v, {members!r})"]
    src.append("    size = 0")
    for f in fields:
        src += [f"    x = v.get({f.name!r})", "    if x is not None:"]
        src += ["        " + line for line in _encode_field(f)]
    src.append("    return size")

    def unknown(v):
        raise InvalidArgument(f"{msg} has no field {sorted(set(v) - names)[0]!r}")

    def two_members(oneof, v, members):
        set_ = [m for m in members if v.get(m) is not None]
        raise InvalidArgument(f"{msg}: {' and '.join(set_)} are members of oneof {oneof}: set one")

    names = frozenset(f.name for f in fields)
    return _exec(src, "enc", _NAMES=names, _unknown=unknown, _two_members=two_members,
                 _F=SCHEMAS[msg])


def _int_value(f: Field) -> str:
    """The expression turning varint bits n into f's value (truncated to its width, as protobuf)."""
    _, width, signed = SCALARS[f.kind]
    if f.kind == "bool":
        return "n != 0"  # a bool is any non-zero varint
    if not signed:
        return "n" if width == 64 else f"n & {(1 << width) - 1}"
    return f"(n & {(1 << width) - 1}) - ((n & {1 << (width - 1)}) << 1)"


def _read_varint_lines(end: str) -> List[str]:
    """Source lines reading the varint at pos (bounded by the variable `end`) into n."""
    return [f"n = buf[pos] if pos < {end} else 128", "if n < 128:", "    pos += 1", "else:",
            f"    n, pos = _read_varint(buf, pos, {end})"]


def _read_lines(f: Field, end: str) -> List[str]:
    """Source lines reading one value of f, in its own wire type, at pos (bounded by `end`) into v."""
    name = f.name
    if f.kind == "float":
        return [f"if pos + 4 > {end}:", f"    raise WireError('{name}: truncated float')",
                "v = _F32.unpack_from(buf, pos)[0]", "pos += 4"]
    if SCALARS.get(f.kind, (2,))[0] == 0:
        return _read_varint_lines(end) + [f"v = {_int_value(f)}"]
    read = _read_varint_lines(end) + ["stop = pos + n", f"if stop > {end}:",
                                      f"    raise WireError('{name}: length ' + str(n) + ' past the end')"]
    if f.kind == "bytes":
        read.append("v = buf[pos:stop]")
    elif f.kind == "string":
        read.append(f"v = _text(buf, pos, stop, {name!r})")
    else:  # a message: merged into the one already there (a repeated one: a new one each time)
        read += ["v = None" if f.repeated else f"v = d[{name!r}]", "if v is None:",
                 f"    v = _new({f.kind!r})", f"_DEC[{f.kind!r}](buf, pos, stop, v)"]
    return read + ["pos = stop"]


def _decode_field(f: Field) -> List[Tuple[int, List[str]]]:
    """(key, source lines that read one occurrence at pos into d) for each key field f may come
    under (repeated numbers: packed and not)."""
    name, wire = f.name, 2 if f.kind in SCHEMAS else SCALARS[f.kind][0]
    if f.repeated:
        out = [((f.number << 3) | wire, _read_lines(f, "end") + [f"d[{name!r}].append(v)"])]
        if wire != 2:  # numbers: also packed, as protobuf reads them
            loop = _read_lines(f, "stop") + [f"d[{name!r}].append(v)"]
            out.append(((f.number << 3) | 2,
                        _read_varint_lines("end") + ["stop = pos + n", "if stop > end:",
                                                     f"    raise WireError('{name}: packed length past the end')",
                                                     "while pos < stop:"] + ["    " + line for line in loop]))
        return out
    lines = []
    if f.oneof is not None:  # a new member of a oneof clears the one before
        lines = [f"o = d[{f.oneof!r}]", f"if o is not None and o != {name!r}:", "    d[o] = None",
                 f"d[{f.oneof!r}] = {name!r}"]
    return [((f.number << 3) | wire, lines + _read_lines(f, "end") + [f"d[{name!r}] = v"])]


def _compile_decoder(msg: str):
    src = ["def dec(buf, pos, end, d):", "    while pos < end:", "        key = buf[pos]",
           "        if key < 128:", "            pos += 1", "        else:",
           "            key, pos = _read_varint(buf, pos, end)"]
    branch = "if"
    for f in sorted(SCHEMAS[msg].values(), key=lambda f: f.number):
        for key, lines in _decode_field(f):
            src.append(f"        {branch} key == {key}:")
            src += ["            " + line for line in lines]
            branch = "elif"
    src += ["        else:" if branch == "elif" else "        if True:",
            "            pos = _skip(buf, pos, end, key)"]
    return _exec(src, "dec")


def _text(buf: memoryview, start: int, stop: int, name: str) -> str:
    try:
        return str(buf[start:stop], "utf-8")
    except UnicodeDecodeError:
        raise WireError(f"{name} is not valid UTF-8") from None


def _exec(src: List[str], name: str, **extra):
    """The function `name` defined by the source lines."""
    namespace = {"varint": varint, "_SMALL": _SMALL, "_bits": _bits, "_f32": _f32, "_utf8": _utf8,
                 "_buffer": _buffer, "_ENC": _ENCODERS, "_DEC": _DECODERS, "_new": new,
                 "_read_varint": _read_varint, "_skip": _skip, "_text": _text, "_F32": _F32,
                 "WireError": WireError, **extra}
    exec(compile("\n".join(src), f"<moed.wire {name}>", "exec"), namespace)
    return namespace[name]


class _Compiled(dict):
    """message name -> its compiled function, compiled on first use."""

    def __init__(self, compile_):
        super().__init__()
        self.compile = compile_

    def __missing__(self, msg):
        fn = self[msg] = self.compile(msg)
        return fn


_ENCODERS = _Compiled(_compile_encoder)
_DECODERS = _Compiled(_compile_decoder)
_F32 = struct.Struct("<f")


def encode_parts(msg: str, value: Dict[str, Any], out: List[Any]) -> int:
    """Appends the encoding of `value` (a dict) as message `msg` to `out`; returns its size.
    Buffers in `out` are the caller's memory (bytes fields): join them while it is unchanged.
    A value that cannot be encoded is InvalidArgument."""
    try:
        return _ENCODERS[msg](value, out)
    except InvalidArgument:
        raise
    except (TypeError, ValueError) as e:  # a bytes field that is no buffer, a str that is no UTF-8
        raise InvalidArgument(f"cannot encode {msg}: {e}") from None


def encode(msg: str, value: Dict[str, Any]) -> bytes:
    """Message `msg` with the fields of `value`, serialized; a bytes field's memory is copied once."""
    parts: List[Any] = []
    encode_parts(msg, value, parts)
    return b"".join(parts)


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
