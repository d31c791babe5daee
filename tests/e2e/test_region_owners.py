"""Who owns a tensor region (moed.proto's ownership rule): with tokens, the token; without, the
local user who connected, as the kernel reports it (SO_PEERCRED on moed's unix socket, the owner of
a loopback TCP peer's socket); a caller moed cannot place gets no regions at all. And no error
message echoes a value it read from a tensor.

The case that made the rule, in the default configuration (no token, loopback): a process of uid 65534
listed a root-owned mode-0600 region, overwrote it with zeros by naming it as `output`, and read its
words back from the message of a request that named it as `expert_ids` ("expert_ids[0][0] =
1148846080 is out of range"). Here that process (other_user.py, started as uid 65534: the tests
need root, which CI is) must see none of root's regions, get NOT_FOUND worded as for an id that
never existed, write nothing and read nothing, over TCP and over a unix socket; while its own
regions serve it on every connection it opens, and tokens keep deciding when there are tokens.
"""

import base64
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile

import grpc
import numpy as np
import pytest

import oracle as O
from conftest import Daemon, free_port
from regions import Session, Shm, list_regions, ref, tensor, unary
from test_regions import Case, SPEC, refused

from moed._proto.moed.v1 import moed_pb2 as pb

NOBODY = 65534
HERE = os.path.dirname(os.path.abspath(__file__))
# 1000.0f: the word the leaking message gave back, 1148846080 as an int32
SECRET = np.full(1024, 1000.0, np.float32)
SECRET_WORD = str(SECRET[:1].view(np.int32)[0])

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="starting a process of another user needs root")


class Agent:
    """A client process of uid 65534 on a connection of its own (other_user.py); ask() runs one op."""

    def __init__(self, target, token=None):
        env = {**os.environ, "PYTHONPATH": HERE, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "other_user.py"), str(NOBODY),
                                      target, *([token] if token else [])], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd="/", env=env)

    def ask(self, **op):
        self.proc.stdin.write(json.dumps(op) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"other_user.py died: exit {self.proc.wait(30)}"
        return json.loads(line)

    def forward(self, q):
        return self.ask(op="forward", request=base64.b64encode(q.SerializeToString()).decode())

    def close(self):
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0


@pytest.fixture(params=["tcp", "unix"])
def served(request, tmp_path):
    """A daemon without tokens on loopback TCP or on a unix socket that uid 65534 may connect to;
    its target. (pytest's tmp_path is root's alone, so the socket lives in a folder others may
    enter.)"""
    flags = ["--synthetic", str(SPEC), "--threads", "1"]
    if request.param == "tcp":
        d = Daemon(flags, tmp_path / "moed.log")
        yield d.address
        assert d.stop() == 0, d.log()
        return
    folder = tempfile.mkdtemp(prefix="moed-owners-")
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "moed.sock")
    try:
        d = Daemon(flags, tmp_path / "moed.log", listen=f"unix:{path}")
        os.chmod(path, 0o666)  # what an operator's umask or a chmod decides: everyone may connect
        yield d.address
        assert d.stop() == 0, d.log()
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(folder)


def forward(ch, q, md=()):
    return unary(ch, "Forward", pb.ForwardRequest, pb.ForwardResponse)(q, metadata=md, timeout=30)


def with_output(case, region, offset=64):
    return case.request(output=(region, offset))


def with_ids_in(case, region, offset=64):
    q = case.request()
    ids = case.tensors["expert_ids"][1]
    q.experts.expert_ids.CopyFrom(tensor("i32", ids, (region, offset)))
    return q


def same_but_id(a, b, id_a, id_b):
    return a.replace(str(id_a), "ID") == b.replace(str(id_b), "ID")


@root_only
def test_another_user_sees_and_touches_none_of_a_region(served):
    """The red team's steps, as uid 65534 against root's region: listing shows none of it, naming
    it as output or as expert_ids is NOT_FOUND in the words an unknown id gets, nothing is written,
    and no word of it comes back. Root's own calls through it still work."""
    shm = Shm(1 << 16)  # root's, mode 0600
    c = Case("experts", 4, 25)
    unknown = 0x5EC0FFEE
    agent = None
    try:
        with grpc.insecure_channel(served) as ch:
            s = Session(ch)
            region = s.host(shm)
            shm.put(64, SECRET)
            before = shm.get(0, shm.size)
            agent = Agent(served)
            assert agent.ask(op="list") == {"ids": []}
            for make in (with_output, with_ids_in):
                theirs, none = agent.forward(make(c, region)), agent.forward(make(c, unknown))
                assert theirs["code"] == none["code"] == "NOT_FOUND", (theirs, none)
                assert same_but_id(theirs["message"], none["message"], region, unknown), (theirs, none)
                assert SECRET_WORD not in theirs["message"], theirs
            assert shm.get(0, shm.size) == before, "the other user's request wrote into root's region"
            want = forward(ch, c.request()).output.data
            assert forward(ch, with_output(c, region)).output.data == b""  # root: still its own
            assert shm.get(64, c.out_bytes) == want
            s.close()
    finally:
        if agent:
            agent.close()
        shm.close()


@root_only
def test_a_user_keeps_its_regions_on_every_connection(served):
    """Uid 65534 registers a region from one process; another process of the same user (another
    connection) lists it and computes into it. Root, another user, sees and reaches none of it."""
    c = Case("experts", 3, 26)
    owner, other = Agent(served), None
    try:
        mine = owner.ask(op="register", bytes=1 << 16)["id"]
        other = Agent(served)
        assert other.ask(op="list") == {"ids": [mine]}
        assert other.forward(with_output(c, mine)) == {"data": ""}
        with grpc.insecure_channel(served) as ch:
            want = forward(ch, c.request()).output.data
            got = owner.ask(op="get", id=mine, offset=64, n=c.out_bytes)["data"]
            assert base64.b64decode(got) == want
            assert mine not in [r.id for r in list_regions(ch)]
            code, msg = refused(lambda: forward(ch, with_output(c, mine)))
            assert code == grpc.StatusCode.NOT_FOUND and "not registered for this caller" in msg, msg
    finally:
        owner.close()
        if other:
            other.close()


@root_only
def test_with_tokens_the_token_owns_whoever_connects(tmp_path):
    """With --auth-token-file the token is the principal, whichever user sends it: uid 65534 with
    root's token uses root's region; with another token it is NOT_FOUND, as ever."""
    tokens = ["owners-" + secrets.token_hex(8) for _ in range(2)]
    (tmp_path / "tokens").write_text("\n".join(tokens) + "\n")
    d = Daemon(["--synthetic", str(SPEC), "--threads", "1", "--auth-token-file",
                str(tmp_path / "tokens")], tmp_path / "moed.log")
    shm = Shm(1 << 16)
    c = Case("experts", 2, 27)
    md = [("authorization", f"Bearer {tokens[0]}")]
    agents = []
    try:
        with d.channel() as ch:
            s = Session(ch, md)
            region = s.host(shm)
            same, other = Agent(d.address, tokens[0]), Agent(d.address, tokens[1])
            agents = [same, other]
            assert same.ask(op="list") == {"ids": [region]}
            assert same.forward(with_output(c, region)) == {"data": ""}
            assert shm.get(64, c.out_bytes) == forward(ch, c.request(), md).output.data
            assert other.ask(op="list") == {"ids": []}
            assert other.forward(with_output(c, region))["code"] == "NOT_FOUND"
            s.close()
    finally:
        for a in agents:
            a.close()
        shm.close()
    assert d.stop() == 0, d.log()


def host_address():
    """This host's address on its default route, or None when it has only loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # picks the source address, sends nothing
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


def test_callers_moed_cannot_place_get_no_regions(tmp_path):
    """Without tokens, a caller whose local user moed cannot tell gets no regions: a remote peer
    (--regions any lets it try), and a loopback one of a wildcard --listen (which of the host's
    addresses it reached, and so its socket, is not known). Session, ListRegions and a region
    reference answer FAILED_PRECONDITION saying what to do; inline calls are served."""
    port = free_port()
    d = Daemon(["--synthetic", str(SPEC), "--threads", "1", "--regions", "any", "--listen",
                f"0.0.0.0:{port}"], tmp_path / "moed.log", port=port)
    targets = [f"127.0.0.1:{port}"] + ([f"{host_address()}:{port}"] if host_address() else [])
    c = Case("experts", 2, 28)
    try:
        for target in targets:
            with grpc.insecure_channel(target) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    Session(ch).command(unregister=pb.UnregisterRegion(region=1))
                calls = [(e.value.code(), e.value.details()),
                         refused(lambda: list_regions(ch)),
                         refused(lambda: forward(ch, with_output(c, 12345)))]
                for code, msg in calls:
                    assert code == grpc.StatusCode.FAILED_PRECONDITION, (target, code, msg)
                    assert "bearer token" in msg and "inline" in msg, (target, msg)
                assert len(forward(ch, c.request()).output.data) == c.out_bytes
    finally:
        assert d.stop() == 0, d.log()


VALUE_CASES = [
    # (what, tensor name, bytes in the region, the value as a message would print it)
    ("ids", "expert_ids", np.array([[1148846080, 1], [2, 3]], np.int32), "1148846080"),
    ("weights", "expert_weights", np.array([[0.5, 0.5], [-0.375, 0.5]], np.float32), "-0.375"),
    ("weights_nan", "expert_weights", np.array([[0.5, np.nan], [0.5, 0.5]], np.float32), "nan"),
    ("logits", "logits", np.array([[0.0] * 7 + [-np.inf], [0.0] * 8], np.float32), "-inf"),
]


@pytest.mark.parametrize("what, name, bad, printed", VALUE_CASES, ids=[v[0] for v in VALUE_CASES])
@pytest.mark.parametrize("where", ["region", "inline"])
def test_no_message_echoes_a_tensor_value(daemon, what, name, bad, printed, where):
    """A bad routing tensor is named by its position and the rule it breaks, never by its value:
    not from a region (which would let anyone who may name a region read it word by word), and not
    inline either (one rule, which the shared routing checks keep without knowing where their
    bytes came from)."""
    d = daemon("--synthetic", str(SPEC), "--threads", "1")
    c = Case("topk" if name == "logits" else "experts", 2, 29)
    c.tensors[name] = (c.tensors[name][0], bad)
    shm = Shm(1 << 16)
    try:
        with d.channel() as ch:
            s = Session(ch)
            q = c.request((shm, s.host(shm), 64)) if where == "region" else c.request()
            code, msg = refused(lambda: forward(ch, q))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, msg
            row, col = [int(i[0]) for i in np.nonzero(~np.isfinite(bad) | (bad < 0) | (bad > 8))]
            assert f"{name}[{row}][{col}]" in msg, msg
            assert f"= {printed}" not in msg and f" {printed}" not in msg, msg
            s.close()
    finally:
        shm.close()
