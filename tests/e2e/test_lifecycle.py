"""Running under a service manager: sd_notify, the bounded drain, log rotation, the config file.

- $NOTIFY_SOCKET (a path or an abstract name): STATUS while starting, READY=1 only once health
  says SERVING (with MAINPID), STOPPING=1 on SIGTERM; a failed start says why in STATUS.
- --drain-timeout: calls still open that long after SIGTERM are cancelled (gRPC ends them with a
  GOAWAY, which callers see as UNAVAILABLE), the log says how many, the exit status is 0, and
  calls answered before the timeout are correct. Given in a config file here. (/healthz while
  draining: test_drain.py.)
- SIGHUP reopens --log-file, so logrotate can move it away; SIGUSR2 logs every thread's stack.
- Config-file values are checked like flags (a bad one names the file and line, exit 2).
"""

import os
import re
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

import oracle as O
from conftest import DEFAULT_SPEC, MOED_BIN
from daemons import Worker, log_of, wait_exit
from held import held_call
from moed import MoEError
from prod import config_file, server_counts, wait_counts


# ---- sd_notify -------------------------------------------------------------------------------

class NotifySocket:
    """A datagram socket standing in for systemd's notification socket."""

    def __init__(self, tmp_path, abstract):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"moed-test-{os.getpid()}-{time.monotonic_ns()}"
            self.sock.bind("\0" + name)
            self.env = "@" + name
        else:
            self.env = str(tmp_path / "notify")
            self.sock.bind(self.env)
        self.messages = []

    def _recv(self, timeout):
        """The next datagram's fields as a dict, or None after timeout seconds."""
        self.sock.settimeout(max(0.01, timeout))
        try:
            msg = self.sock.recv(4096).decode()
        except socket.timeout:
            return None
        fields = dict(line.split("=", 1) for line in msg.split("\n") if line)
        self.messages.append(fields)
        return fields

    def wait_for(self, assignment, timeout=60):
        """Reads datagrams until one carries `assignment` ("READY=1"); returns its fields."""
        key, value = assignment.split("=", 1)
        deadline = time.monotonic() + timeout
        while (fields := self._recv(deadline - time.monotonic())) is not None:
            if fields.get(key) == value:
                return fields
        raise AssertionError(f"no {assignment} in {self.messages}")

    def pending(self):
        """Every datagram already sent (waiting up to 1 s for the first)."""
        out = []
        while (fields := self._recv(1.0 if not out else 0.2)) is not None:
            out.append(fields)
        return out

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("abstract", (False, True), ids=("path", "abstract"))
def test_notify_ready_and_stopping(daemon, tmp_path, abstract):
    n = NotifySocket(tmp_path, abstract)
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", env={"NOTIFY_SOCKET": n.env},
               wait=False)
    ready = n.wait_for("READY=1")
    with d.client(timeout=5) as c:
        assert c.health() == "SERVING"  # READY=1 comes only once it serves
    assert ready["MAINPID"] == str(d.proc.pid)
    assert ready["STATUS"].startswith(f"serving on {d.address}: layers 0-1")
    assert n.messages[0]["STATUS"].startswith("starting")
    d.send_signal(signal.SIGTERM)
    stopping = n.wait_for("STOPPING=1")
    assert re.match(r"draining after SIGTERM: \d+ calls open", stopping["STATUS"]), stopping
    assert wait_exit(d) == 0
    n.close()


def test_notify_says_why_a_start_failed(daemon, tmp_path):
    n = NotifySocket(tmp_path, False)
    d = daemon("--synthetic", DEFAULT_SPEC, "--auth-token-file", str(tmp_path / "absent"),
               env={"NOTIFY_SOCKET": n.env}, wait=False)
    assert d.proc.wait(30) == 1
    d.stop()
    msgs = n.pending()
    assert any(m.get("STATUS", "").startswith("start failed (security):") and
               "absent" in m["STATUS"] for m in msgs), msgs
    assert not any("READY" in m for m in msgs)
    n.close()


# ---- the bounded drain -----------------------------------------------------------------------

# Calls held in a merge window (a minute, waiting for one request more than are sent) until the
# drain flushes them, and a held call (HEADERS without a message, held.py) that only the drain's
# end can cancel: which calls are answered and which cancelled depends on nothing but the test.
CALLS = 4
HOLD = dict(synthetic=DEFAULT_SPEC, threads=1, max_delay_us=60000000, min_batch_requests=CALLS + 1,
            metrics_listen="127.0.0.1:0")
SPEC = O.Spec.parse(DEFAULT_SPEC)


def case(i):
    rng = np.random.default_rng(300 + i)
    x, x64 = O.hidden(rng, 3 + i, SPEC.d, "bf16")
    ids = np.stack([rng.permutation(SPEC.experts)[:2] for _ in range(3 + i)]).astype(np.int32)
    w = rng.uniform(0, 1, (3 + i, 2)).astype(np.float32)
    return x, ids, w, O.forward(x64, SPEC.layer(0), O.choice_route(ids, w), SPEC.act)


class Drained:
    """CALLS calls queued and a held call open, then SIGTERM: `results` says how each call ended
    ("OK" once checked against the oracle, or its status), `held` the held call."""

    def __init__(self, d):
        self.d, self.results = d, {}
        before = server_counts(d.metrics_port)
        self.threads = [Worker(self.call, i) for i in range(CALLS)]
        for t in self.threads:
            t.start()
        wait_counts(d.metrics_port, before, {"queued": CALLS}, timeout=60)
        self.held = held_call(d)
        self.signalled = time.monotonic()
        d.send_signal(signal.SIGTERM)

    def call(self, i):
        x, ids, w, ref = case(i)
        with self.d.client(timeout=120) as c:
            try:
                O.check(c.forward(0, x, expert_ids=ids, expert_weights=w), ref, "bf16", f"call {i}")
                self.results[i] = "OK"
            except MoEError as e:
                self.results[i] = e.code_name

    def finish(self):
        """Waits for the exit and the calls; the exit code."""
        code = wait_exit(self.d, timeout=120)
        for t in self.threads:
            t.join(60)
        assert self.held.ended.wait(30), "the held call is still open after the exit"
        self.held.close()
        return code


def cancelled_calls(log):
    return int(log.split("cancelling the calls still open")[1].split("calls=")[1].split()[0])


def test_drain_timeout_cancels_what_is_left(daemon, tmp_path):
    """The held call is still open at the timeout (1 s) and is cancelled then, and nothing but
    the timeout could end it: the exit comes no sooner. The queued calls were flushed by the drain
    and are answered, correctly (or, on a machine too slow to compute them in that second,
    cancelled too)."""
    d = daemon("--config", config_file(tmp_path / "moed.conf", drain_timeout=1, **HOLD))
    drained = Drained(d)
    code = drained.finish()
    took = time.monotonic() - drained.signalled
    log = log_of(d)
    assert code == 0, log
    assert len(drained.results) == CALLS and set(drained.results.values()) <= {"OK", "UNAVAILABLE"}, \
        drained.results
    assert "cancelling the calls still open" in log and 'why="--drain-timeout of 1 s passed"' in log, log
    assert cancelled_calls(log) >= 1 + list(drained.results.values()).count("UNAVAILABLE"), log
    assert took >= 0.99, took  # the timeout was waited for (libuv's clock counts whole ms)


def test_drain_timeout_zero_cancels_at_once(daemon, tmp_path):
    d = daemon("--config", config_file(tmp_path / "moed.conf", drain_timeout=0, **HOLD))
    drained = Drained(d)
    assert drained.finish() == 0
    assert set(drained.results.values()) <= {"OK", "UNAVAILABLE"}, drained.results
    log = log_of(d)
    assert 'why="--drain-timeout of 0 s passed"' in log
    assert cancelled_calls(log) >= 1 + list(drained.results.values()).count("UNAVAILABLE"), log


def test_second_sigterm_cancels_at_once(daemon, tmp_path):
    """A second SIGTERM cuts the drain short (docs/operations.md): the calls still open (the held one) are
    cancelled, the log says why, and moed exits 0 at once, not after the drain timeout (600 s
    here: Drained.finish waits 120 s at most); the calls answered are correct."""
    d = daemon("--config", config_file(tmp_path / "moed.conf", drain_timeout=600, **HOLD))
    drained = Drained(d)
    deadline = time.monotonic() + 60
    while '"draining"' not in log_of(d):
        assert time.monotonic() < deadline, log_of(d)
        time.sleep(0.01)
    d.send_signal(signal.SIGTERM)
    code = drained.finish()
    log = log_of(d)
    assert code == 0, log
    assert 'why="a second SIGTERM"' in log, log
    assert len(drained.results) == CALLS and set(drained.results.values()) <= {"OK", "UNAVAILABLE"}, \
        drained.results
    assert cancelled_calls(log) >= 1, log


# ---- the log and the config file ---------------------------------------------------------------

def test_sighup_reopens_the_log_file(daemon, tmp_path):
    log = tmp_path / "moed.log"
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--log-file", str(log))
    assert "ready" in log.read_text()
    log.rename(tmp_path / "moed.log.1")  # what logrotate does
    d.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while not (log.exists() and "log reopened" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.exists() and "log reopened" in log.read_text()
    assert "log reopened" not in (tmp_path / "moed.log.1").read_text()
    with d.client(timeout=5) as c:
        assert c.health() == "SERVING"  # still serving after the signal
    assert d.stop() == 0
    assert '"stopped"' in log.read_text()


def test_sigusr2_logs_every_threads_stack(daemon):
    """SIGUSR2: a line per thread with its frames (moed_stacks), twice, and the daemon serves on.
    The loop's own line runs through uv_run in main."""
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "2")
    with d.client(timeout=5) as c:
        for n in (1, 2):
            d.send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while d.log().count('msg="thread stacks"') < n and time.monotonic() < deadline:
                time.sleep(0.05)
            log = d.log()
            summaries = re.findall(r'msg="thread stacks" threads=(\d+) answered=(\d+)', log)
            assert len(summaries) == n, log[-3000:]
            threads, answered = map(int, summaries[-1])
            lines = [ln for ln in log.splitlines() if 'msg="thread stack"' in ln]
            assert threads >= 3 and answered == threads and len(lines) == n * threads, log[-3000:]
            assert any("uv_run" in ln and "moed(+0x" in ln for ln in lines), lines[:3]
            assert c.health() == "SERVING"  # it goes on serving
    assert d.stop() == 0


@pytest.mark.parametrize("line, says", [
    ("drain-timeout = -1", "-1 is out of range"),
    ("drain-timeout = soon", "'soon' is not an integer"),
    ("metrics-listen =", "empty value"),
    ("tls-cert = /x.crt", "--tls-cert '/x.crt' given without --tls-key"),
], ids=["negative", "not-a-number", "empty", "lone-cert"])
def test_config_file_values_are_checked(tmp_path, line, says):
    cfg = tmp_path / "moed.conf"
    cfg.write_text(f"# comment\n{line}\n")
    p = subprocess.run([str(MOED_BIN), "--config", str(cfg)], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 2, p.stderr
    assert says in p.stderr, p.stderr
    if "given without" not in says:
        assert f"{cfg}:2:" in p.stderr, p.stderr  # names the file and line
