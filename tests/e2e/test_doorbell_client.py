"""The doorbell from the C client's side, on the CPU backend: libmoedclient's rings
(moedc_ring_*) through tests/e2e/ring_driver.c, and moed-load --transport doorbell --verify.

A ring call's output equals, bit for bit, the same call made over gRPC; tickets cross their wrap
(every ring's slots start four calls before it) with the same answers; a full ring refuses a start
at once (MOEDC_EFULL) and takes one again after a wait; a daemon killed with a call rung, or with a
call it took and holds in its queue, or drained, leaves the caller's wait answered UNAVAILABLE (the
library's watchdog), never hanging, and later starts refused. Stream-ordered calls answer
MOEDC_EUNSUPPORTED where no CUDA driver loads; over the fake driver of tests/unit (streams run by
threads) they, and a capture of several replayed, equal the host calls, and a capture replayed on a
dead ring completes UNAVAILABLE with its failures counted.
"""

import ctypes
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import BUILD
from prod import ANY_METRICS_PORT, scrape

SPEC = "layers=1,d=64,ff=96,experts=8,topk=2,act=swiglu,dtype=f32,seed=5"
T, D, K = 5, 64, 2
FAKE_CUDA = BUILD / "tests" / "fake-cuda"


def inputs(seed=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, D)).astype(np.float32)
    ids = np.stack([rng.choice(8, K, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32) + 0.1
    ids[1, 1], w[1, 1] = -1, 0.0  # a padding pair, as the gRPC path takes it
    return x, ids, w


def grpc_output(d, x, ids, w):
    with d.client(timeout=30) as c:
        return c.forward(0, x, expert_ids=ids, expert_weights=w)


class Ring:
    """A ring of the C client kept open by ring_driver; each method sends one line and returns the
    answer: an output array, ("ERR", status, message), or the answer's words."""

    def __init__(self, tmp_path, target, slots, fake_cuda=False, seed=3):
        from test_c_library import INCLUDE, LIBDIR, sanitizer_flags
        exe = tmp_path / "ring_driver"
        if not exe.exists():
            p = subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", *sanitizer_flags(),
                                str(os.path.join(os.path.dirname(__file__), "ring_driver.c")), "-I",
                                str(INCLUDE), "-L", str(LIBDIR), "-lmoedclient", "-ldl",
                                "-lpthread", f"-Wl,-rpath,{LIBDIR}", "-o", str(exe)],
                               capture_output=True, text=True)
            assert p.returncode == 0, p.stderr
        self.x, self.ids, self.w = inputs(seed)
        files = []
        for name, a in (("x", self.x), ("ids", self.ids), ("w", self.w)):
            files.append(tmp_path / f"{name}.bin")
            files[-1].write_bytes(a.tobytes())
        env = dict(os.environ)
        if fake_cuda:
            env["LD_LIBRARY_PATH"] = f"{FAKE_CUDA}:{env.get('LD_LIBRARY_PATH', '')}"
        self.proc = subprocess.Popen([str(exe), target, *map(str, files), str(T), str(D), str(K),
                                      str(slots)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        opened = self.answer()
        assert opened == ("OPEN",), opened

    def answer(self):
        line = self.proc.stdout.readline()
        assert line, f"ring_driver ended ({self.proc.poll()})"
        word, _, rest = line.rstrip("\n").partition(" ")
        if word == "OK":
            return np.frombuffer(bytes.fromhex(rest), np.float32).reshape(T, D)
        if word == "ERR":
            return ("ERR", *rest.split(" ", 1))
        return (word, *rest.split())

    def send(self, line, answers=1):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = [self.answer() for _ in range(answers)]
        return out[0] if answers == 1 else out

    def close(self):
        self.proc.stdin.close()
        assert self.proc.wait(60) == 0


def unavailable(a):
    return isinstance(a, tuple) and a[:2] == ("ERR", "UNAVAILABLE")


def test_calls_equal_grpc_and_tickets_wrap(daemon, tmp_path):
    """Host calls through a ring of one slot: each output is the gRPC path's bit for bit, and the
    slot's tickets run past 2^32 - 1 to 1 (skipping 0) with the same answers."""
    d = daemon("--synthetic", SPEC)
    r = Ring(tmp_path, d.address, 1)
    want = grpc_output(d, r.x, r.ids, r.w)
    tickets = []
    for _ in range(7):
        t = r.send("start")
        assert t[0] == "TICKET", t
        tickets.append(int(t[2]))
        y = r.send(f"wait {t[1]} {t[2]}")
        assert isinstance(y, np.ndarray), y
        assert y.tobytes() == want.tobytes()
    assert tickets == [2**32 - 3, 2**32 - 2, 2**32 - 1, 1, 2, 3, 4], tickets
    assert r.send("failures") == ("FAILURES", "0")
    r.close()


def test_full_ring_refuses_at_once(daemon, tmp_path):
    """Two slots, two calls not waited for: the third start is MOEDC_EFULL (UNAVAILABLE on the
    wire's scale) saying why, at once; a wait frees a slot and the next start takes it."""
    d = daemon("--synthetic", SPEC)
    r = Ring(tmp_path, d.address, 2)
    want = grpc_output(d, r.x, r.ids, r.w)
    a, b = r.send("start"), r.send("start")
    assert a[0] == b[0] == "TICKET" and a[1] != b[1], (a, b)
    full = r.send("start")
    assert unavailable(full) and "all 2 slots of the ring hold calls" in full[2], full
    assert r.send(f"wait {a[1]} {a[2]}").tobytes() == want.tobytes()
    c = r.send("start")
    assert c[0] == "TICKET" and c[1] == a[1], c
    for t in (b, c):
        assert r.send(f"wait {t[1]} {t[2]}").tobytes() == want.tobytes()
    stale = r.send(f"wait {a[1]} {a[2]}")
    assert stale[:2] == ("ERR", "INVALID_ARGUMENT") and "not a host call in flight" in stale[2], stale
    r.close()


def test_threads_share_a_ring(daemon, tmp_path):
    """Five threads at once on one ring of six slots (the first call alone, then four threads of 40
    host calls): every output is the same bytes as the gRPC path's, no call getting another's slot
    or completion."""
    d = daemon("--synthetic", SPEC)
    r = Ring(tmp_path, d.address, 6)
    assert r.send("threads 5 40") == ("THREADS", "ok")
    assert r.send("call").tobytes() == grpc_output(d, r.x, r.ids, r.w).tobytes()
    assert r.send("failures") == ("FAILURES", "0")
    r.close()


def test_daemon_killed_with_a_call_rung(daemon, tmp_path):
    """The daemon stopped (SIGSTOP) so it cannot take the call, the call rung, the daemon killed:
    the wait returns UNAVAILABLE naming the session's end, later starts are refused, and the
    failure is counted."""
    d = daemon("--synthetic", SPEC)
    r = Ring(tmp_path, d.address, 2)
    d.send_signal(signal.SIGSTOP)
    t = r.send("start")
    assert t[0] == "TICKET", t
    d.stop(signal.SIGKILL)
    got = r.send(f"wait {t[1]} {t[2]}")
    assert unavailable(got) and "session ended" in got[2], got
    later = r.send("call")
    assert unavailable(later), later
    assert r.send("failures") == ("FAILURES", "1")
    r.close()


def queued(port):
    return scrape(port).get("moed_queue_requests") or 0


def test_daemon_killed_with_a_call_taken(daemon, tmp_path):
    """The daemon took the call into its queue (it waits for a second request to merge with, for
    30 s) and is killed there: the wait returns UNAVAILABLE, no hang."""
    d = daemon("--synthetic", SPEC, "--min-batch-requests", "2", "--max-delay-us", "30000000",
               *ANY_METRICS_PORT)
    r = Ring(tmp_path, d.address, 2)
    t = r.send("start")
    assert t[0] == "TICKET", t
    deadline = time.monotonic() + 60  # a hang guard: the call is taken long before
    while queued(d.metrics_port) != 1:
        assert time.monotonic() < deadline, "the ring call never reached the queue"
        time.sleep(0.01)
    d.stop(signal.SIGKILL)
    got = r.send(f"wait {t[1]} {t[2]}")
    assert unavailable(got) and "session ended" in got[2], got
    r.close()


def test_drained_daemon_closes_the_ring(daemon, tmp_path):
    """SIGTERM: the daemon drains and exits 0 with a ring open and idle; a call made afterwards is
    UNAVAILABLE, refused at the start or completed by the watchdog, never waited for in vain."""
    d = daemon("--synthetic", SPEC)
    r = Ring(tmp_path, d.address, 2)
    want = grpc_output(d, r.x, r.ids, r.w)
    assert r.send("call").tobytes() == want.tobytes()
    assert d.stop() == 0, d.log()
    got = r.send("call")
    assert unavailable(got), got
    r.close()


def driver_loads():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(driver_loads(), reason="a CUDA driver is installed here")
def test_stream_calls_need_a_driver(daemon, tmp_path):
    """No CUDA driver: a stream-ordered call is MOEDC_EUNSUPPORTED (UNIMPLEMENTED) saying so, and
    host calls on the same ring still work."""
    d = daemon("--synthetic", SPEC)
    r = Ring(tmp_path, d.address, 2)
    got = r.send("stream")
    assert got[:2] == ("ERR", "UNIMPLEMENTED"), got
    assert "stream-ordered calls need the CUDA driver" in got[2] and "no CUDA driver" in got[2], got
    assert isinstance(r.send("call"), np.ndarray)
    r.close()


def test_stream_calls_over_the_fake_driver(daemon, tmp_path):
    """Stream-ordered calls, one by one and captured (four calls, replayed three times), equal the
    host calls bit for bit; released captured slots serve host calls again."""
    d = daemon("--synthetic", SPEC)
    r = Ring(tmp_path, d.address, 6, fake_cuda=True)
    want = r.send("call")
    assert isinstance(want, np.ndarray), want
    for _ in range(3):
        y = r.send("stream")
        assert isinstance(y, np.ndarray), y
        assert y.tobytes() == want.tobytes()
    assert r.send("capture 4") == ("CAPTURED",)
    for _ in range(3):
        for y in r.send("replay", answers=4):
            assert isinstance(y, np.ndarray), y
            assert y.tobytes() == want.tobytes()
    assert r.send("release") == ("RELEASED",)
    assert r.send("failures") == ("FAILURES", "0")
    for _ in range(6):
        assert r.send("call").tobytes() == want.tobytes()
    r.close()


def test_capture_replayed_on_a_dead_ring(daemon, tmp_path):
    """A capture replayed after its daemon was killed proceeds: every call UNAVAILABLE, counted in
    the ring's failures, and the stream never waits for ever."""
    d = daemon("--synthetic", SPEC)
    r = Ring(tmp_path, d.address, 4, fake_cuda=True)
    assert r.send("capture 3") == ("CAPTURED",)
    assert all(isinstance(y, np.ndarray) for y in r.send("replay", answers=3))
    d.stop(signal.SIGKILL)
    for _ in range(2):
        got = r.send("replay", answers=3)
        assert all(unavailable(g) for g in got), got
    failures = int(r.send("failures")[1])
    assert failures >= 6, failures
    r.close()


def test_moed_load_doorbell_verify(daemon):
    """moed-load --transport doorbell: three callers, each its own ring, tokens 1..16, every reply
    checked against the CPU reference; nothing of moed-load's is left registered afterwards."""
    d = daemon("--synthetic", SPEC)
    load = str(BUILD / "client" / "c" / "moed-load")
    r = subprocess.run([load, "--target", d.address, "--transport", "doorbell", "--concurrency", "3",
                        "--tokens", "1:16", "--dtype", "f32", "--duration", "0.5", "--warmup", "0",
                        "--verify", "60", "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "transport doorbell" in r.stdout and " 0 mismatches" in r.stdout, r.stdout
    with d.client() as c:
        assert not c.regions()
    bad = subprocess.run([load, "--target", d.address, "--transport", "doorbell", "--routing",
                          "logits", "--duration", "0.1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "takes the client's expert choices" in bad.stderr, bad.stderr
