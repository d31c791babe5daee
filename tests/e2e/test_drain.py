"""SIGTERM / SIGINT with calls in flight: every call is answered (correctly), health goes
NOT_SERVING for watchers, and the daemon exits 0; an idle region session (and its connection) does
not hold the exit.

The calls are held in a merge window (a minute, waiting for one request more than are sent) until
the signal, which the test sends only once the server counts them all queued: the drain's flush is
what answers them. A held call (HEADERS without a message, held.py) keeps the drain going for as
long as a test looks at what a new caller sees meanwhile.
"""

import select
import signal
import threading
import time

import grpc
import h2.events
import numpy as np
import pytest

import hostile
import oracle as O
from daemons import log_of, wait_exit
from held import held_call
from moed import MoEError
from moed._proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from moed._proto.moed.v1 import moed_pb2 as pb
from prod import ANY_METRICS_PORT, get, server_counts, wait_counts

SPEC = O.Spec(layers=1, d=256, ff=512, experts=8, topk=2, dtype="bf16", seed=51)
CALLS = 16
T = 192


def holding(daemon, calls):
    """A daemon that holds up to `calls` calls in its queue until the drain flushes them."""
    return daemon("--synthetic", str(SPEC), "--threads", "1", "--max-delay-us", "60000000",
                  "--min-batch-requests", str(calls + 1), *ANY_METRICS_PORT)


def case(i, spec=SPEC, tokens=T):
    rng = np.random.default_rng(900 + i)
    x, x64 = O.hidden(rng, tokens, spec.d, "bf16")
    ids = np.stack([rng.permutation(spec.experts)[:2] for _ in range(tokens)]).astype(np.int32)
    gw = rng.uniform(0, 1, (tokens, 2)).astype(np.float32)
    return x, ids, gw, x64


class Watcher(threading.Thread):
    """Follows grpc.health.v1 Watch and records every status until the stream ends."""

    def __init__(self, d):
        super().__init__(daemon=True)
        self.channel = d.channel()
        self.statuses, self.end = [], None
        self.first = threading.Event()

    def run(self):
        try:
            for r in health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(), timeout=60):
                self.statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
                self.first.set()
            self.end = "OK"
        except grpc.RpcError as e:
            self.end = e.code().name
        self.first.set()


@pytest.mark.parametrize("sig", (signal.SIGTERM, signal.SIGINT), ids=("SIGTERM", "SIGINT"))
def test_signal_drains_every_call_in_flight(daemon, sig):
    d = holding(daemon, CALLS)
    watcher = Watcher(d)
    watcher.start()
    assert watcher.first.wait(60) and watcher.statuses == ["SERVING"]

    cases = [case(i) for i in range(CALLS)]
    done, errors = {}, []
    before = server_counts(d.metrics_port)

    def call(i):
        x, ids, gw, _ = cases[i]
        with d.client(timeout=120) as c:
            try:
                done[i] = (c.forward(0, x, expert_ids=ids, expert_weights=gw), time.monotonic())
            except Exception as e:
                errors.append((i, repr(e)))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(CALLS)]
    for t in threads:
        t.start()
    wait_counts(d.metrics_port, before, {"queued": CALLS}, timeout=60)
    signalled = time.monotonic()
    d.send_signal(sig)
    for t in threads:
        t.join(120)
    code = wait_exit(d)

    assert not errors, f"calls in flight were not answered: {errors}"
    assert len(done) == CALLS
    assert all(at > signalled for _, at in done.values()), "a call held for the drain ended before it"
    w = SPEC.layer(0)
    for i, (y, _) in done.items():
        x, ids, gw, x64 = cases[i]
        O.check(y, O.forward(x64, w, O.choice_route(ids, gw), SPEC.act), "bf16", f"call {i}")
    assert code == 0, f"moed exited {code}:\n{log_of(d)}"
    watcher.join(10)
    assert watcher.statuses[:2] == ["SERVING", "NOT_SERVING"], watcher.statuses
    assert watcher.end is not None, "the Watch stream did not end with the server"
    log = log_of(d)
    assert "draining" in log and ("SIGTERM" if sig == signal.SIGTERM else "SIGINT") in log
    watcher.channel.close()


def test_idle_daemon_exits_zero_at_once(daemon):
    """Nothing in flight: the drain ends at once, not at --drain-timeout (600 s here, far past the
    stop's own 60 s guard)."""
    d = daemon("--synthetic", str(SPEC), "--threads", "1", "--drain-timeout", "600")
    assert d.stop() == 0
    assert "every call answered" in log_of(d) and "cancelling" not in log_of(d)


class Draining:
    """A daemon draining with calls still in flight: the calls are queued, SIGTERM follows, and the
    body runs once a Watch has seen NOT_SERVING, while a held call keeps the drain going. At the
    end the held call is released, every call must have been answered correctly (the drain's
    flush computes them) and the daemon must have exited 0."""

    def __init__(self, d, calls=4):
        self.d = d
        self.cases = [case(i) for i in range(calls)]
        self.results, self.threads = [], []

    def call(self, i):
        x, ids, gw, x64 = self.cases[i]
        with self.d.client(timeout=120) as c:
            try:
                y = c.forward(0, x, expert_ids=ids, expert_weights=gw)
                O.check(y, O.forward(x64, SPEC.layer(0), O.choice_route(ids, gw), SPEC.act), "bf16")
                self.results.append("OK")
            except Exception as e:
                self.results.append(repr(e))

    def __enter__(self):
        watcher = Watcher(self.d)
        watcher.start()
        assert watcher.first.wait(60)
        before = server_counts(self.d.metrics_port)
        self.threads = [threading.Thread(target=self.call, args=(i,)) for i in range(len(self.cases))]
        for t in self.threads:
            t.start()
        wait_counts(self.d.metrics_port, before, {"queued": len(self.cases)}, timeout=60)
        self.held = held_call(self.d)
        self.d.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while "NOT_SERVING" not in watcher.statuses:
            assert time.monotonic() < deadline, f"no NOT_SERVING after SIGTERM: {watcher.statuses}"
            time.sleep(0.001)
        return self

    def __exit__(self, *exc):
        self.held.release()
        for t in self.threads:
            t.join(120)
        code = wait_exit(self.d)
        if exc[0] is None:
            assert self.results == ["OK"] * len(self.cases), self.results
            assert code == 0, f"moed exited {code}:\n{log_of(self.d)}"


def test_new_connection_during_drain_is_answered(daemon):
    """While calls are still in flight the server keeps accepting, so a new connection is told
    what is going on: health NOT_SERVING, and a Forward UNAVAILABLE naming the drain; /healthz
    says 503."""
    d = holding(daemon, 4)
    _, ids, gw, _ = case(99)
    with Draining(d, calls=4):
        with d.client(timeout=60) as c:
            assert c.health() == "NOT_SERVING"
            with pytest.raises(MoEError) as e:
                c.forward(0, np.zeros((2, SPEC.d), np.float32), expert_ids=ids[:2], expert_weights=gw[:2])
        assert get(d.metrics_port, "/healthz") == (503, "NOT_SERVING\n")
    assert e.value.code_name == "UNAVAILABLE" and "drain" in e.value.message, e.value


def test_new_call_on_open_connection_during_drain_is_unavailable(daemon):
    d = holding(daemon, 4)
    x = np.zeros((2, SPEC.d), np.float32)
    ids = np.array([[0, 1], [2, 3]], np.int32)
    gw = np.full((2, 2), 0.5, np.float32)
    with d.client(timeout=60) as c:
        assert c.health() == "SERVING"  # the connection is open before the drain
        with Draining(d, calls=4):
            with pytest.raises(MoEError) as e:
                c.forward(0, x, expert_ids=ids, expert_weights=gw)
    assert e.value.code_name == "UNAVAILABLE" and "drain" in e.value.message, e.value


def test_repeated_sigterm_still_exits_zero(daemon):
    """Supervisors and impatient people signal more than once; each later SIGTERM may only hurry
    the drain along, never turn a clean stop into a crash."""
    d = daemon("--synthetic", str(SPEC), "--threads", "1")
    while d.proc.poll() is None:
        d.send_signal(signal.SIGTERM)
        time.sleep(0.0005)
    code = wait_exit(d)
    assert code == 0, f"moed exited {code}:\n{log_of(d)}"



class RawSession:
    """A Regions stream over raw HTTP/2 (hostile.py's connection) whose client answers what the
    server sends, pings too after a GOAWAY (as a gRPC client's idle channel does), and never ends
    anything itself: not the stream, not the connection."""

    def __init__(self, address):
        self.s, self.conn = hostile._connect(address)
        self.stream = self.conn.get_next_available_stream_id()
        self.conn.send_headers(self.stream, hostile._headers(address, "/moed.v1.Moed/Regions"))
        self.s.sendall(self.conn.data_to_send())
        self.events, self.trailers, self.goaway, self.raw = b"", None, False, b""

    def send(self, command):
        self.conn.send_data(self.stream, hostile.grpc_frame(command.SerializeToString()))
        self.s.sendall(self.conn.data_to_send())

    def _frame(self, frame):
        """One frame from the server: to h2 until a GOAWAY, after which h2 takes nothing more, so
        the pings that still come are answered here."""
        if self.goaway:
            if frame[3] == 6 and not frame[4] & 1:
                self.s.sendall(hostile._frame(6, 1, 0, frame[9:]))
            return
        for ev in self.conn.receive_data(frame):
            if isinstance(ev, h2.events.DataReceived):
                self.events += ev.data
                self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                if "grpc-status" in dict(ev.headers):
                    self.trailers = dict(ev.headers)
            elif isinstance(ev, h2.events.ConnectionTerminated):
                self.goaway = True
        self.s.sendall(self.conn.data_to_send())

    def read_until(self, done, timeout):
        """Reads until done(), the server closes the connection, or the hang guard `timeout`
        passes; whether the server closed it."""
        end = time.monotonic() + timeout
        while not done() and time.monotonic() < end:
            if not select.select([self.s], [], [], 0.05)[0]:
                continue
            got = self.s.recv(1 << 16)
            if not got:
                return True
            self.raw += got
            while len(self.raw) >= 9 and len(self.raw) >= 9 + int.from_bytes(self.raw[:3], "big"):
                n = 9 + int.from_bytes(self.raw[:3], "big")
                frame, self.raw = self.raw[:n], self.raw[n:]
                self._frame(frame)
        return False


def test_an_idle_session_does_not_hold_the_exit(daemon):
    """An idle Regions session held SIGTERM's exit. Its client here keeps the session and
    its connection open, ends neither, and reads nothing once the session has answered a command
    (so the session is open on the server, and idle): as a client process busy elsewhere, or an
    idle gRPC channel that nobody polls, reads nothing. moed used to wait for such a connection
    until a timer closed it: gRPC's answer-my-GOAWAY-ping timeout (20 s, rpc.c's keepalive timeout)
    or --drain-timeout (an hour here). So it could not exit inside the 15 s hang guard; now it
    must, exit 0, with the session ended UNAVAILABLE saying why and no cancel in the log."""
    d = daemon("--synthetic", str(SPEC), "--threads", "1", "--drain-timeout", "3600")
    session = RawSession(d.address)
    try:
        session.send(pb.RegionCommand(seq=1, unregister=pb.UnregisterRegion(region=1)))
        session.read_until(lambda: len(session.events) > 5, 30)
        assert len(session.events) > 5, "the session never answered its command"
        d.send_signal(signal.SIGTERM)
        code = wait_exit(d, timeout=15)
        session.read_until(lambda: session.trailers is not None, 10)  # what the socket holds
    finally:
        session.s.close()
    assert code == 0, f"moed exited {code}:\n{log_of(d)}"
    assert session.trailers is not None, "the session was not ended"
    assert session.trailers["grpc-status"] == str(grpc.StatusCode.UNAVAILABLE.value[0]), session.trailers
    assert "draining" in session.trailers.get("grpc-message", ""), session.trailers
    assert "cancelling the calls still open" not in log_of(d), log_of(d)
