"""moed's own listener on a unix socket (--listen unix:PATH without TLS, server/unix_listener.h),
which accepts connections itself to learn who connected (SO_PEERCRED) and hands them to gRPC: it
must keep what gRPC's listener gave a connection, and never take a live socket over.

- A second moed on the path of a live socket took it over and the first silently lost its
  clients; now the second refuses to start. A socket nobody answers on (its moed was killed) is
  stale and replaced; a file that is no socket is left alone; the socket goes with its daemon.
- HTTP/2 limits per connection: MAX_CONCURRENT_STREAMS and the header list size advertised, calls
  past twice the stream setting refused unread (gRPC's listener named every unix peer alike, so
  unix connections were never counted: that part failed before).
- gRPC's resource quota (--max-grpc-memory) bounds a unix connection's requests, and its ping
  limits hold.
- A connection that sends nothing is closed after the handshake deadline (10 s).
- With TLS, gRPC's listener: the path is claimed all the same; regions need a token there.
"""

import select
import signal
import time
import socket
import subprocess

import grpc
import h2.errors
import h2.events
import pytest

import hostile
from conftest import DEFAULT_SPEC, MOED_BIN
from moed import MoEClient
from moed._proto.grpc.health.v1 import health_pb2
from prod import Certs
from regions import list_regions

MIB = 1 << 20


def moed(*args, timeout=60):
    return subprocess.run([str(MOED_BIN), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_a_unix_socket_that_answers_is_not_taken_over(daemon, tmp_path):
    sock = tmp_path / "moed.sock"
    first = daemon("--synthetic", "layers=1,d=16,ff=16,experts=2,topk=1,seed=7", "--threads", "1",
                   listen=f"unix:{sock}")
    p = moed("--listen", f"unix:{sock}", "--synthetic", DEFAULT_SPEC, "--threads", "1")
    assert p.returncode == 1 and f"unix:{sock}" in p.stderr and "answers there" in p.stderr, p.stderr
    with first.client(timeout=10) as c:
        assert "seed=7" in c.info().model  # the path still reaches the first daemon
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL and sock.is_socket()  # left behind
    second = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", listen=f"unix:{sock}")
    with second.client(timeout=10) as c:
        assert c.health() == "SERVING"
    assert second.stop() == 0 and not sock.exists(), "the socket outlived its daemon"
    (tmp_path / "file").write_text("keep me\n")
    p = moed("--listen", f"unix:{tmp_path / 'file'}", "--synthetic", DEFAULT_SPEC)
    assert p.returncode == 1 and "not a socket" in p.stderr, p.stderr
    assert (tmp_path / "file").read_text() == "keep me\n"


def test_http2_limits_hold_per_connection(daemon, tmp_path):
    """As test_hardening's TCP test: a connection that opens 12 streams before the SETTINGS are read
    is closed at the call past twice --max-streams, none answered, and the closing names the flag;
    another connection is served."""
    sock = tmp_path / "moed.sock"
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--max-streams", "4", listen=f"unix:{sock}")
    settings = hostile.server_settings(d.address)
    assert settings.get(3) == 4 and settings.get(6) == 16384, settings
    answered, closed = hostile.open_streams(d.address, 12)
    assert closed and not answered, (closed, answered)
    deadline = time.monotonic() + 30  # a hang guard: the line follows the closing
    while "connection closed" not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.02)
    assert "peer=fd:" in d.log() and "--max-streams" in d.log(), d.log()
    with MoEClient(d.address, timeout=10) as c:
        assert c.health() == "SERVING"


def test_the_resource_quota_bounds_a_unix_connection(daemon, tmp_path):
    """A 200 MiB health check (read for anyone) against a 64 MiB --max-grpc-memory is cut short by
    gRPC's quota, as over TCP; the daemon serves on."""
    sock = tmp_path / "moed.sock"
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--max-grpc-memory", "64MiB",
               listen=f"unix:{sock}")
    status, _, sent = hostile.upload(d.address, 200 * MIB, path="/grpc.health.v1.Health/Check", timeout=30)
    assert sent < 200 * MIB, f"the whole body went in ({status}): the quota did not act"
    with MoEClient(d.address, timeout=10) as c:
        assert c.health() == "SERVING"


def test_ping_limits_hold(daemon, tmp_path):
    """The keepalive arguments reach a unix connection too: a peer that pings without data, flat
    out, is sent GOAWAY ENHANCE_YOUR_CALM ("too_many_pings") after its second strike."""
    sock = tmp_path / "moed.sock"
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", listen=f"unix:{sock}")
    s, conn = hostile._connect(d.address)
    goaway, sent, closed = None, 0, False
    try:
        while goaway is None and not closed and sent < 1000:  # a few do; 1000 is the guard
            try:
                conn.ping(sent.to_bytes(8, "big"))
                s.sendall(conn.data_to_send())
                sent += 1
            except OSError:  # closed after its GOAWAY: what is left to read says why
                pass
            if not select.select([s], [], [], 0.05)[0]:
                continue
            data = s.recv(1 << 16)
            closed = not data
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ConnectionTerminated):
                    goaway = (ev.error_code, ev.additional_data)
    finally:
        s.close()
    assert goaway == (h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, b"too_many_pings"), (goaway, sent)


def test_a_silent_connection_is_closed(daemon, tmp_path):
    """A connection that never sends a byte is closed after the handshake deadline, 10 s (the
    read below is a hang guard, six times that), and costs the daemon nothing after."""
    sock = tmp_path / "moed.sock"
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", listen=f"unix:{sock}")
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(60)
    s.connect(str(sock))
    try:
        while s.recv(1 << 16):  # until the server closes it (a timeout fails the test)
            pass
    finally:
        s.close()
    with MoEClient(d.address, timeout=10) as c:
        assert c.health() == "SERVING"


def test_with_tls_the_path_is_claimed_and_regions_need_a_token(daemon, tmp_path):
    """TLS on a unix socket keeps gRPC's listener (gRPC 1.51 takes descriptors only without TLS): its
    path is claimed all the same, and its peers have no user, so without a token ListRegions (as
    every region use) is FAILED_PRECONDITION saying so."""
    (tmp_path / "pki").mkdir()
    certs = Certs(tmp_path / "pki")
    sock = tmp_path / "moed.sock"
    tls = ["--tls-cert", certs.path("server.crt"), "--tls-key", certs.path("server.key")]
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", *tls, listen=f"unix:{sock}", wait=False)
    # the certificate names localhost, which grpcio does not take for a unix target by itself
    named = [("grpc.ssl_target_name_override", "localhost")]
    with grpc.secure_channel(d.address, certs.credentials(), options=named) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check",
                               request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                               response_deserializer=health_pb2.HealthCheckResponse.FromString)
        assert check(health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=60).status == 1
        with pytest.raises(grpc.RpcError) as e:
            list_regions(ch)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
    assert "TLS on a unix socket" in e.value.details() and "token" in e.value.details(), e.value
    p = moed("--listen", f"unix:{sock}", "--synthetic", DEFAULT_SPEC, *tls)
    assert p.returncode == 1 and "answers there" in p.stderr, p.stderr
