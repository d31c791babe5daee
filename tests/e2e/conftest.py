"""Fixtures for the end-to-end tests: real moed processes on loopback.

`daemon` starts one (or several) moed with the given flags on a free port, waits until the standard
health check says SERVING, and at teardown stops each with SIGTERM and asserts a clean exit (0), so
every test also checks that the daemon survived what the test did to it. The build folder is
$MOED_BUILD_DIR (default: build/ at the top of the tree); $MOED_BIN overrides the daemon's path.

$MOED_TEST_COMPUTE set (the GPU machine's run, tools/gpu/run-on-gpu.sh) means the daemons must
compute on the GPU: each one, once serving, must report the cuda backend in GetModel, or a broken
CUDA setup would fall back to the CPU and every test would pass on it.
"""
import contextlib
import os
import pathlib
import re
import signal
import socket
import subprocess
import time

import grpc
import pytest

from moed import MoEClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("MOED_BUILD_DIR", ROOT / "build"))
MOED_BIN = pathlib.Path(os.environ.get("MOED_BIN", BUILD / "server" / "moed"))
DEFAULT_SPEC = "layers=2,d=64,ff=96,experts=8,topk=2,act=swiglu,dtype=bf16,seed=1"
CUDA_MODE = bool(os.environ.get("MOED_TEST_COMPUTE"))


def pytest_configure(config):
    # A thread that dies of an exception fails the test it ran in (pytest only warns by default):
    # tests hand work to threads, and one that died would leave the others' results to pass.
    config.addinivalue_line("filterwarnings", "error::pytest.PytestUnhandledThreadExceptionWarning")
    # tests/e2e/run.sh runs the suite in WORKERS processes (pytest-xdist), then these alone.
    config.addinivalue_line("markers", "serial: runs with no other test beside it (tests/e2e/run.sh): "
                                       "it loads the machine on purpose, and its callers' deadlines "
                                       "assume the cores are its own")


_ports_given = set()
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])


def free_port():
    """A port nothing listens on, never the same one twice in this process: the kernel may hand a
    port just closed out again, and a daemon given it for both gRPC and metrics fails to start.
    Nor one another worker of the same run can give (pytest-xdist: worker i of n takes the ports p
    with p // 2 equal to i modulo n; not p itself, since Linux's bind gives odd ports). Free on
    every address (a port free on loopback may be in use on another, which a daemon listening on
    0.0.0.0 would find). Only until another process takes it: where a test can, it lets the daemon
    pick (port 0; conftest's Daemon, prod.ANY_METRICS_PORT)."""
    while True:
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            port = s.getsockname()[1]
        if port // 2 % _WORKERS == _WORKER and port not in _ports_given:
            _ports_given.add(port)
            return port


def logs_ready(args):
    """Whether moed with these flags writes its "ready" line (info) to stderr: not with a log file
    or a threshold over info, in the flags or in a config file."""
    text = " ".join(args)
    if "--config" in args:
        try:
            text += "\n" + pathlib.Path(args[args.index("--config") + 1]).read_text()
        except (OSError, IndexError, UnicodeDecodeError):  # moed says what is wrong with it
            pass
    return not re.search(r"(^|\s|--)log-file\b|(^|\s|--)log-level\s*=?\s*(warn|error)", text, re.M)


@contextlib.contextmanager
def refused_address():
    """127.0.0.1:PORT where connections are refused for as long as this lasts: a socket holds the
    port bound without listening on it, so nothing else can listen there meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


class Daemon:
    """One moed process. `args` are its flags after --listen; its stderr goes to `log_path`.
    listen: the address to serve on (default 127.0.0.1 at `port`, or at a port the kernel picks).

    Without a port the daemon listens on port 0 and its log's "ready" line says which port it got:
    a port picked here and handed over stays free only until some other process (any client's
    connect, another test run on the machine) takes it. Where that line does not come to stderr
    (logs_ready) a free port is picked here instead."""

    def __init__(self, args, log_path, env=None, port=None, wait=True, timeout=60.0, listen=None):
        assert MOED_BIN.exists(), f"{MOED_BIN} does not exist: build first (or set MOED_BUILD_DIR)"
        args = [str(a) for a in args]
        if listen is None:
            if port is None and logs_ready(args):
                listen = "127.0.0.1:0"
            else:
                listen = f"127.0.0.1:{port or free_port()}"
        self.listen = listen
        self._address = None if listen.endswith(":0") else listen.replace("0.0.0.0:", "127.0.0.1:")
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.argv = [str(MOED_BIN), "--listen", self.listen, *args]
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=self._log,
                                     env={**os.environ, **(env or {})})
        self.returncode = None
        if wait:
            try:
                self.wait_serving(timeout)
            except BaseException:  # the caller gets no Daemon to stop: do not leave it running
                self.proc.kill()
                self.proc.wait()
                self._log.close()
                raise

    @property
    def address(self):
        """host:port to call (for a port the kernel picked, once the log says it: this waits)."""
        if self._address is None:
            self._address = self.logged_address("ready").replace("0.0.0.0:", "127.0.0.1:")
        return self._address

    @address.setter
    def address(self, value):  # where a later --listen among the flags wins
        self._address = value

    @property
    def port(self):
        return int(self.address.rsplit(":", 1)[1])

    @property
    def metrics_port(self):
        """The metrics endpoint's port, as the log says (give --metrics-listen 127.0.0.1:0)."""
        return int(self.logged_address("metrics listening").rsplit(":", 1)[1])

    def logged_address(self, msg, timeout=60.0):
        """The addr= of the log line with msg="<msg>", waiting for it while the daemon runs."""
        pattern = re.compile(r'msg="' + re.escape(msg) + r'" addr=(\S+)')
        deadline = time.monotonic() + timeout
        while not (m := pattern.search(self.log())):
            if self.proc.poll() is not None:
                raise AssertionError(f"moed exited with {self.proc.returncode} before logging "
                                     f"{msg!r}:\n{self.log()}")
            assert time.monotonic() < deadline, f"moed did not log {msg!r} in {timeout} s:\n{self.log()}"
            time.sleep(0.02)
        return m.group(1)

    def log(self):
        if not self._log.closed:
            self._log.flush()
        return pathlib.Path(self.log_path).read_text(errors="replace")

    def wait_serving(self, timeout=60.0):
        deadline = time.monotonic() + timeout
        if self._address is None:
            self.logged_address("ready", timeout)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"moed exited with {self.proc.returncode} before serving:\n{self.log()}")
            if self.serving():
                self.check_backend()
                return
            time.sleep(0.05)
        raise AssertionError(f"moed not SERVING after {timeout}s:\n{self.log()}")

    def serving(self):
        try:
            with MoEClient(self.address, timeout=1.0) as c:
                return c.health() == "SERVING"
        except Exception:  # not listening yet
            return False

    def check_backend(self):
        """In CUDA mode, a daemon not told to use the CPU must serve on cuda (a daemon that wants a
        token cannot be asked here)."""
        if not CUDA_MODE or "cpu" in self.argv or "--auth-token-file" in self.argv:
            return
        with MoEClient(self.address, timeout=10.0) as c:
            backend = c.info().backend
        assert backend == "cuda", (f"MOED_TEST_COMPUTE is set (a GPU run), but moed serves on the "
                                   f"{backend} backend:\n{self.log()}")

    def client(self, **kw):
        return MoEClient(self.address, **kw)

    def channel(self):
        return grpc.insecure_channel(self.address, options=[("grpc.max_send_message_length", -1),
                                                            ("grpc.max_receive_message_length", -1)])

    def send_signal(self, sig):
        self.proc.send_signal(sig)

    def begin_drain(self, hang_guard_s=60.0):
        """SIGTERM, and back once moed drains (health NOT_SERVING, or no answer: it is gone): the
        signal is handled asynchronously, so a call made right after send_signal may still be
        answered as before it."""
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + hang_guard_s
        while self.serving():
            assert time.monotonic() < deadline, f"moed still SERVING after SIGTERM:\n{self.log()}"
            time.sleep(0.01)

    def pause(self, hang_guard_s=60.0):
        """SIGSTOP, and back once every thread of the daemon is stopped: the signal is delivered
        asynchronously, so a thread (the doorbell's poller, say) may otherwise still take a call
        after send_signal returns."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + hang_guard_s
        task = f"/proc/{self.proc.pid}/task"
        while True:
            states = []
            for t in os.listdir(task):
                try:
                    with open(f"{task}/{t}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except FileNotFoundError:  # a thread that ended meanwhile
                    pass
            if states and all(st in ("T", "t") for st in states):
                return
            assert time.monotonic() < deadline, f"moed's threads did not stop: {states}"
            time.sleep(0.001)

    def stop(self, sig=signal.SIGTERM, timeout=60.0):
        """Sends sig and waits; returns the exit code (the process is killed if it hangs)."""
        if self.returncode is not None:
            return self.returncode
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"moed did not exit {timeout}s after signal {sig}:\n{self.log()}")
        finally:
            self._log.close()
        return self.returncode


@pytest.fixture
def daemon(tmp_path):
    """Factory: daemon(*flags, env=None, wait=True, listen=None) -> Daemon. Every daemon started
    is stopped at teardown with SIGTERM and must exit 0 (a test that stops one itself checks its own code)."""
    started = []

    def start(*args, env=None, wait=True, timeout=60.0, listen=None):
        d = Daemon(list(args), tmp_path / f"moed-{len(started)}.log", env=env, wait=wait, timeout=timeout,
                   listen=listen)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.returncode is None:
            code = d.stop()
            assert code == 0, f"moed exited {code} at teardown:\n{d.log()}"


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    """One daemon with the small default synthetic model, shared by a test module."""
    d = Daemon(["--synthetic", DEFAULT_SPEC, "--threads", "2"],
               tmp_path_factory.mktemp("moed") / "moed.log")
    yield d
    code = d.stop()
    assert code == 0, f"moed exited {code}:\n{d.log()}"
