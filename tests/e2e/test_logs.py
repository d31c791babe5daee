"""Log forging (docs/security.md, "Logs"): values that came from a client are escaped by the log module, so a
request_id holding quotes, newlines, control bytes or bytes that are not UTF-8 stays inside its
field of one line at --log-level debug, and no line the client wrote appears in the log.

Every line of the log is parsed as strict logfmt (bare or quoted values, the escapes the log
module writes); the request ids read back from the log are the ones sent (U+FFFD standing in for
bytes that are not UTF-8).
"""

import contextlib
import re

import grpc
import numpy as np
import pytest

from conftest import DEFAULT_SPEC
from moed import MoEClient

FORWARD = "/moed.v1.Moed/Forward"
FORGED = 'ts=2026-11-22T00:00:00.000Z level=error msg="FORGED admin login" user=root'

_ESC = {'"': '"', "\\": "\\", "n": "\n", "r": "\r", "t": "\t"}
_PAIR = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)=("(?:[^"\\\x00-\x1f]|\\["\\nrt]|\\u[0-9a-f]{4})*"|[^\s"=]*)( |$)')


def parse_logfmt(line):
    """A line as {key: value}, decoding the escapes; AssertionError unless the whole line parses."""
    out, at = {}, 0
    while at < len(line):
        m = _PAIR.match(line, at)
        assert m, f"not logfmt at byte {at}: {line!r}"
        key, value = m.group(1), m.group(2)
        if value.startswith('"'):
            value = re.sub(r'\\(u[0-9a-f]{4}|.)',
                           lambda e: chr(int(e.group(1)[1:], 16)) if e.group(1)[0] == "u" and len(e.group(1)) == 5
                           else _ESC[e.group(1)], value[1:-1])
        assert key not in out, f"key {key} twice: {line!r}"
        out[key] = value
        at = m.end()
    return out


def raw_request(request_id: bytes, layer):
    """A Forward request for `layer` whose request_id is exactly these bytes (UTF-8 or not):
    field 1 written by hand in front of the other fields, as an encoder would put it."""
    x = np.zeros((1, 64), np.float32)
    rest = MoEClient.build_request(None, layer, x, expert_ids=np.zeros((1, 1), np.int32),
                                   expert_weights=np.ones((1, 1), np.float32)).SerializeToString()
    n, length = len(request_id), b""
    while True:
        length += bytes([n & 0x7F | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            break
    return b"\x0a" + length + request_id + rest


IDS = [
    ('x" level=error msg="FORGED admin login', None),
    ("a\n" + FORGED, None),
    ("cr\r\n" + FORGED + "\r\n", None),
    ('quote \\" backslash \\\\ tab\t bell\x07 esc\x1b[2J del\x7f', None),
    ("nel\u0085 ls\u2028 ps\u2029 " + FORGED, None),
    (None, b"bad \xff\xfe utf-8 \xc3\n" + FORGED.encode()),
]


def test_request_ids_cannot_forge_log_lines(daemon):
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--log-level", "debug")
    sent = []
    with d.channel() as ch:
        call = ch.unary_unary(FORWARD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        for text, raw in IDS:
            rid = raw if raw is not None else text.encode()
            for layer in (9, 0):  # NOT_FOUND (an unknown layer), and a valid layer
                with pytest.raises(grpc.RpcError) if raw is not None or layer == 9 else contextlib.nullcontext():
                    call(raw_request(rid, layer), timeout=30)
            sent.append(rid.decode("utf-8", errors="replace"))
    log = d.log()
    assert "\r" not in log
    lines = log.split("\n")
    assert lines[-1] == ""
    failed = []
    for line in lines[:-1]:
        fields = parse_logfmt(line)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", fields.get("ts", "")), line
        assert fields["level"] in ("debug", "info", "warn", "error"), line
        assert "FORGED" not in fields["msg"] and "user" not in fields, line
        if fields["msg"] == "forward failed":
            failed.append(fields["request_id"])
    # One "forward failed" line per refused request (the unknown layer for every id, and the id
    # that is not UTF-8 on layer 0 too), each carrying the whole id.
    want = sent + [sent[-1]]
    assert sorted(failed) == sorted(want), failed

