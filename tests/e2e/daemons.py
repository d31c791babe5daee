"""A pool of moed daemons shared by the tests of one module, one per distinct set of flags.

conftest's `daemon` fixture starts a daemon per test; tests that sweep many models (every activation
and weight dtype) would start the same ones again and again. The pool starts each flag set once,
and close() stops them all with SIGTERM and asserts that every one exited 0, so a daemon that a test
upset fails the module even when the test itself passed.
"""

import threading

from conftest import Daemon


class DaemonPool:
    def __init__(self, tmp_dir):
        self.tmp_dir = tmp_dir
        self.daemons = {}

    def get(self, *args):
        """The daemon started with these flags (after --listen), started on first use."""
        key = tuple(str(a) for a in args)
        if key not in self.daemons:
            self.daemons[key] = Daemon(list(key), self.tmp_dir / f"moed-{len(self.daemons)}.log")
        return self.daemons[key]

    def synthetic(self, spec, *flags):
        return self.get("--synthetic", str(spec), "--threads", "1", *flags)

    def close(self):
        failed = []
        for d in self.daemons.values():
            code = d.stop()
            if code != 0:
                failed.append(f"{' '.join(d.argv)} exited {code}:\n{log_of(d)[-4000:]}")
        assert not failed, "\n".join(failed)


def log_of(d):
    """A daemon's log, also after stop() (conftest's Daemon.log() flushes the closed file then)."""
    return d.log_path.read_text(errors="replace")


def wait_exit(d, timeout=60):
    """Waits for a daemon that was already signalled to exit by itself, and returns its code
    (stop() would signal it again)."""
    d.proc.wait(timeout)
    return d.stop()


class Worker(threading.Thread):
    """A thread whose death the test sees: join() re-raises what killed it, and fails when it is
    still running after the timeout (a bare Thread would die with a traceback on stderr and the
    test would pass on whatever the others recorded)."""

    def __init__(self, target, *args):
        super().__init__(daemon=True)
        self.target, self.args, self.error = target, args, None

    def run(self):
        try:
            self.target(*self.args)
        except BaseException as e:  # re-raised by join
            self.error = e

    def join(self, timeout=None):
        super().join(timeout)
        assert not self.is_alive(), f"{self.target.__name__}{self.args} still running after {timeout} s"
        if self.error is not None:
            raise self.error
