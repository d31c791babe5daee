"""What a hostile peer does to the gRPC port, spoken as raw HTTP/2 (the `h2` package), and the
daemon's memory while it does: the hardening tests (test_hardening.py) use these with small, bounded
counts; run as a script they repeat the measurements at full size and print the figures that
docs/security.md quotes ("Hostile peers"):

    .venv/bin/python tests/e2e/hostile.py build/server/moed [bodies|work|flood|floodN|window]...

- flood(): connections that open Forward streams (HEADERS + an empty DATA frame, `per_write` per
  write), never reading what the server sends (so never acknowledging its SETTINGS either), and
  reconnecting when closed if asked; flood_process() runs it in a process of its own (32
  connections for the script's floods, N for floodN);
- upload(): one request body of any size pushed as fast as flow control lets it, with or without
  a token, plain or gzip-compressed (a gzip "bomb": a small body that inflates enormously);
- open_streams(): many streams at once on one connection, before the server's SETTINGS are read;
  server_settings(): the SETTINGS it advertises;
- reset_mid_upload(): a call reset by its client before its message is whole;
- withhold_window(): ForwardStream requests from a client that reads but grants no HTTP/2 window;
- Rss: the process's resident memory, sampled, with its peak.

The script also times the case of docs/security.md's "Bounded work": one request with expert_ids
[1, 2M] whose caller gives up after 2 s, beside three other callers with 2 s deadlines.
"""

import select
import socket
import struct
import sys
import threading
import time
import zlib

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack

FORWARD = "/moed.v1.Moed/Forward"
FORWARD_STREAM = "/moed.v1.Moed/ForwardStream"


def _connect(address, timeout=10.0, silent_s=0.0):
    """host:port, or unix:PATH; the HTTP/2 preface and SETTINGS are sent `silent_s` s after the
    connection is made."""
    if address.startswith("unix:"):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(timeout)
        s.connect(address[5:])
    else:
        host, port = address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    time.sleep(silent_s)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    s.sendall(conn.data_to_send())
    return s, conn


def _headers(address, path, token=None, encoding=None):
    h = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", address),
         ("content-type", "application/grpc"), ("te", "trailers")]
    if token:
        h.append(("authorization", f"Bearer {token}"))
    if encoding:
        h.append(("grpc-encoding", encoding))
    return h


class Rss:
    """Samples /proc/PID/status every `period` s in a thread: `peak` (the most seen, also VmHWM's
    when the process is still there) and `now()` in bytes."""

    def __init__(self, pid, period=0.02):
        self.pid, self.period, self.peak = pid, period, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _field(self, name):
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith(name + ":"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def now(self):
        return self._field("VmRSS")

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self.period)

    def __enter__(self):
        self.peak = self.now()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.now())


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _frame(kind, flags, sid, payload=b""):
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, sid) + payload


def flood(address, seconds, connections=2, per_write=100, reset=False, path=FORWARD, stop=None,
          reconnect=False, closed=None, started=None, min_streams=1):
    """Opens Forward streams on `connections` raw connections for `seconds`: each write carries
    `per_write` streams (HEADERS, then an empty DATA frame; with `reset`, RST_STREAM(CANCEL) after
    them), made by hand so the sender is not the bottleneck. Nothing the server sends is ever read,
    so its SETTINGS are never acknowledged. Returns the streams sent. A connection the server
    closes ends its sender, unless `reconnect`: then it connects again and goes on (`closed`, a
    list, if given, gets one entry per connection the server closed). Every sender stops when the
    time is up or once `stop()`, if given, says so; `started`, a threading.Event if given, is set
    once `min_streams` streams are out."""
    block = hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(k, v) for k, v in _headers(address, path)])
    opened = [0] * connections
    end = time.monotonic() + seconds
    going = lambda: time.monotonic() < end and not (stop and stop())

    def one(i):
        while going():
            try:
                s, _ = _connect(address)
            except OSError:
                return
            s.setblocking(False)  # a write the server does not read waits, while stop() is watched
            sid, pending = 1, memoryview(b"")
            try:
                while going():
                    if not pending:
                        out = []
                        for _ in range(per_write):
                            out += [_frame(1, 4, sid, block), _frame(0, 0, sid)]  # HEADERS (END_HEADERS), DATA
                            if reset:
                                out.append(_frame(3, 0, sid, struct.pack(">I", 8)))  # RST_STREAM(CANCEL)
                            sid += 2
                        pending = memoryview(b"".join(out))
                    if not select.select([], [s], [], 0.1)[1]:
                        continue
                    try:
                        pending = pending[s.send(pending):]
                    except BlockingIOError:
                        continue
                    if not pending:
                        opened[i] += per_write
                        if started is not None and sum(opened) >= min_streams:
                            started.set()
            except OSError:  # the server closed the connection
                if closed is not None:
                    closed.append(i)
                if not reconnect:
                    return
            finally:
                s.close()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return sum(opened)


def grpc_frame(payload, compressed=False):
    return struct.pack(">BI", 1 if compressed else 0, len(payload)) + payload


def gzip_bomb(inflated_bytes, chunk=1 << 20):
    """A gzip stream of `inflated_bytes` zero bytes (about 1/1000 of the size), made in chunks."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(chunk)
    out = []
    for _ in range(inflated_bytes // chunk):
        out.append(z.compress(zeros))
    out.append(z.compress(bytes(inflated_bytes % chunk)))
    out.append(z.flush())
    return b"".join(out)


def upload(address, body_len, token=None, compressed_body=None, path=FORWARD, timeout=30.0,
           encoding="gzip", silent_s=0.0):
    """One unary call whose message claims `body_len` bytes (zeros, sent as fast as flow control
    allows), or carries `compressed_body` (flagged compressed, with grpc-encoding `encoding`; None:
    no such header), on a connection silent for its first `silent_s` s. Returns (grpc-status or
    None, grpc-message, message bytes the server let us send) once the server has answered or reset
    the stream, or the time is up."""
    if compressed_body is not None:
        data = grpc_frame(compressed_body, compressed=True)
        piece, total = (lambda off, n: data[off:off + n]), len(data)
    else:
        prefix = struct.pack(">BI", 0, body_len)
        piece = lambda off, n: prefix[off:off + n] + bytes(n - len(prefix[off:off + n]))
        total = body_len + 5
    s, conn = _connect(address, timeout, silent_s)
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, _headers(address, path, token, encoding if compressed_body is not None else None))
    sent, status, message, done = 0, None, "", False
    end = time.monotonic() + timeout
    try:
        while not done and time.monotonic() < end:
            n = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size, total - sent)
            if n > 0:
                conn.send_data(sid, piece(sent, n), end_stream=(sent + n == total))
                sent += n
            s.sendall(conn.data_to_send())
            if not select.select([s], [], [], 0 if n > 0 else 0.05)[0]:
                continue
            got = s.recv(1 << 16)
            if not got:
                break
            for ev in conn.receive_data(got):
                if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    h = dict(ev.headers)
                    if "grpc-status" in h:
                        status, message, done = int(h["grpc-status"]), h.get("grpc-message", ""), True
                elif isinstance(ev, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                    done = True
            s.sendall(conn.data_to_send())
    except (OSError, h2.exceptions.ProtocolError):
        pass
    finally:
        s.close()
    return status, message, max(0, sent - 5)


def server_settings(address, wait=60.0):
    """The SETTINGS the server advertises, as {code: value} (3 is MAX_CONCURRENT_STREAMS, 4
    INITIAL_WINDOW_SIZE, 6 MAX_HEADER_LIST_SIZE), read on a connection that sends nothing else
    (`wait` s: a hang guard)."""
    s, conn = _connect(address)
    try:
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if not select.select([s], [], [], 0.05)[0]:
                continue
            got = s.recv(1 << 16)
            if not got:
                break
            if any(isinstance(ev, h2.events.RemoteSettingsChanged) for ev in conn.receive_data(got)):
                return {int(k): v for k, v in conn.remote_settings.items()}
    finally:
        s.close()
    raise AssertionError("the server sent no SETTINGS")


def open_streams(address, n, path=FORWARD, wait=60.0):
    """Opens n streams at once on one connection, headers only (no message), before reading the
    server's SETTINGS, then reads until the server closes the connection (or `wait` s pass: a hang
    guard). Returns ({stream id: (grpc-status, grpc-message)} for the streams the server answered,
    whether the server closed the connection)."""
    s, conn = _connect(address)
    answered, closed = {}, False
    try:
        for _ in range(n):
            conn.send_headers(conn.get_next_available_stream_id(), _headers(address, path))
        s.sendall(conn.data_to_send())
        end = time.monotonic() + wait
        while not closed and time.monotonic() < end:
            if not select.select([s], [], [], 0.05)[0]:
                continue
            try:
                got = s.recv(1 << 16)
            except ConnectionResetError:
                got = b""
            if not got:
                closed = True
                break
            for ev in conn.receive_data(got):
                if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    h = dict(ev.headers)
                    if "grpc-status" in h:
                        answered[ev.stream_id] = (int(h["grpc-status"]), h.get("grpc-message", ""))
            try:
                s.sendall(conn.data_to_send())
            except OSError:
                closed = True
    except OSError:  # reset while the streams went out
        closed = True
    finally:
        s.close()
    return answered, closed


def withhold_window(address, request, streams=1, per_stream=1, gzip=False, guard_s=120.0):
    """A ForwardStream client that reads its socket but grants no HTTP/2 window (its SETTINGS say
    INITIAL_WINDOW_SIZE 0, and it never sends WINDOW_UPDATE): it opens `streams` streams and sends
    `per_stream` copies of `request` (a serialized ForwardRequest; with `gzip`, compressed: a
    small request for a large reply) on each as flow control lets it, then reads until the server
    closes the connection (or guard_s passes). Returns (whether the server closed it, the requests
    sent)."""
    s, conn = _connect(address)
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    body = zlib.compress(request, 9, wbits=31) if gzip else request
    msg, sent, closed = grpc_frame(body, compressed=gzip), {}, False
    try:
        for _ in range(streams):
            conn.send_headers(conn.get_next_available_stream_id(),
                              _headers(address, FORWARD_STREAM, encoding="gzip" if gzip else None))
        s.sendall(conn.data_to_send())
        end = time.monotonic() + guard_s
        while not closed and time.monotonic() < end:
            for sid in list(conn.streams):
                try:
                    while sent.get(sid, 0) < per_stream and conn.local_flow_control_window(sid) >= len(msg):
                        conn.send_data(sid, msg)
                        sent[sid] = sent.get(sid, 0) + 1
                except h2.exceptions.StreamClosedError:  # the server ended it (quota, or an error)
                    sent[sid] = per_stream
            try:
                s.sendall(conn.data_to_send())
                if not select.select([s], [], [], 0.1)[0]:
                    continue
                got = s.recv(1 << 20)
                if got:
                    conn.receive_data(got)  # SETTINGS and pings are answered; no window granted
            except (OSError, h2.exceptions.ProtocolError):  # reset, or ended by a GOAWAY
                got = b""
            if not got:
                closed = True
                break
    finally:
        s.close()
    return closed, sum(sent.values())


def reset_mid_upload(address, path=FORWARD, claimed=1 << 20, send=1000, wait=0.3, token=None):
    """A call whose message claims `claimed` bytes, of which `send` go out; `wait` s later the
    client resets the stream (RST_STREAM CANCEL), as a cancelled call or a dropped client does."""
    s, conn = _connect(address)
    try:
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, _headers(address, path, token))
        conn.send_data(sid, struct.pack(">BI", 0, claimed) + bytes(send))
        s.sendall(conn.data_to_send())
        time.sleep(wait)
        conn.reset_stream(sid, 8)
        s.sendall(conn.data_to_send())
        time.sleep(0.05)
    finally:
        s.close()


def parallel(fn, n):
    """fn(i) in n threads; their results in order."""
    out = [None] * n

    def run(i):
        out[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# ---- the measurements of docs/security.md, full size ------------------------------------------

MIB = 1 << 20
RSS_CAP = 6 << 30  # a flood is stopped here: the machine running it is shared


def _measure(moed_bin, parts=("bodies", "work", "flood", "window")):
    import pathlib
    import subprocess
    import tempfile

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from conftest import free_port
    from moed import MoEClient

    tmp = pathlib.Path(tempfile.mkdtemp())
    (tmp / "token").write_text("s3cret-token\n")

    def start(*flags):
        port = free_port()
        log = tmp / f"moed-{port}.log"
        p = subprocess.Popen([moed_bin, "--listen", f"127.0.0.1:{port}", "--threads", "1", *flags],
                             stderr=open(log, "wb"))
        addr = f"127.0.0.1:{port}"
        for _ in range(600):
            try:
                with MoEClient(addr, timeout=1) as c:
                    if c.health() == "SERVING":
                        return p, addr
            except Exception:
                time.sleep(0.05)
        raise SystemExit(f"moed did not start: {log.read_text()}")

    def attack(p, what, fn):
        with Rss(p.pid) as r:
            before = r.now()
            res = fn()
        time.sleep(3)
        print(f"{what}: rss {before / MIB:.0f} MiB -> peak {r.peak / MIB:.0f} MiB, 3 s later "
              f"{r.now() / MIB:.0f} MiB; {res}")

    def answers(res):
        return (f"answers {sorted(set((x[0], x[1][:50]) for x in res), key=str)}, at most "
                f"{max(x[2] for x in res) / MIB:.1f} MiB sent before the answer")

    print(f"# {moed_bin}")
    if "bodies" in parts:
        _bodies(start, attack, answers, tmp)
    if "work" in parts:
        _work(start)
    for part in parts:  # flood, or floodN: N connections (32)
        if part.startswith("flood"):
            _floods(start, tmp, int(part[5:] or 32))
    if "window" in parts:
        _window(start)


def _bodies(start, attack, answers, tmp):
    bomb = gzip_bomb(500 * MIB)
    p, addr = start("--auth-token-file", str(tmp / "token"))
    attack(p, "8 x 400 MiB requests, no token",
           lambda: answers(parallel(lambda i: upload(addr, 400 * MIB, timeout=60), 8)))
    attack(p, f"8 gzip bombs ({len(bomb) / 1e6:.2f} MB -> 500 MiB), no token",
           lambda: answers(parallel(lambda i: upload(addr, 0, compressed_body=bomb, timeout=60), 8)))
    attack(p, "8 x 400 MiB health checks (open to all)",
           lambda: answers(parallel(lambda i: upload(addr, 400 * MIB, path="/grpc.health.v1.Health/Check",
                                                     timeout=60), 8)))
    p.terminate()
    p.wait(60)


def _work(start):
    import numpy as np

    from moed import MoEClient

    p, addr = start()
    with MoEClient(addr, timeout=60) as c:
        x1 = np.zeros((1, 256), np.float32)
        big = dict(expert_ids=np.zeros((1, 2 << 20), np.int32), expert_weights=np.zeros((1, 2 << 20), np.float32))
        small = dict(expert_ids=np.zeros((4, 2), np.int32), expert_weights=np.full((4, 2), 0.5, np.float32))
        outcome = []

        def huge():
            t0 = time.monotonic()
            try:
                c.forward(0, x1, timeout=2.0, **big)
                outcome.append(f"huge: OK after {time.monotonic() - t0:.1f} s")
            except Exception as e:
                outcome.append(f"huge: {str(e)[:60]} after {time.monotonic() - t0:.2f} s")

        def other(i):
            t0 = time.monotonic()
            try:
                c.forward(0, np.zeros((4, 256), np.float32), timeout=2.0, **small)
                return f"OK in {time.monotonic() - t0:.2f} s"
            except Exception as e:
                return str(e)[:40]

        h = threading.Thread(target=huge)
        h.start()
        time.sleep(0.5)
        others = parallel(other, 3)
        h.join()
        t0 = time.monotonic()
        while True:  # how long the execution slot stays taken: until a fresh call is answered
            try:
                c.forward(0, np.zeros((4, 256), np.float32), timeout=60, **small)
                break
            except Exception:
                time.sleep(0.1)
        print(f"[1, 2M] expert_ids, caller gives up after 2 s: {outcome[0]}; 3 other 2 s callers: {others}; "
              f"a call after the caller gave up waited {time.monotonic() - t0:.1f} s")
    p.terminate()
    p.wait(60)


def _floods(start, tmp, connections):
    import collections
    import statistics

    import numpy as np

    from moed import MoEClient

    for flags, what in (((), "no token"), (("--auth-token-file", str(tmp / "token")), "token required")):
        for reset in (False, True):
            p, addr = start(*flags)
            took, errors, stop, rss = [], collections.Counter(), threading.Event(), Rss(p.pid)

            def legit():  # a new client, on a connection of its own, every 0.5 s
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        with MoEClient(addr, timeout=6.0, token="s3cret-token",
                                       options=[("grpc.use_local_subchannel_pool", 1)]) as c:
                            c.forward(0, np.zeros((4, 256), np.float32), expert_ids=np.zeros((4, 2), np.int32),
                                      expert_weights=np.full((4, 2), 0.5, np.float32))
                        took.append(time.monotonic() - t0)
                    except Exception as e:
                        took.append(None)
                        errors[getattr(e, "code_name", type(e).__name__)] += 1
                    stop.wait(max(0, 0.5 - (time.monotonic() - t0)))

            with rss:
                before = rss.now()
                attacker = flood_process(addr, connections, reset=reset)
                lt = threading.Thread(target=legit)
                lt.start()
                end = time.monotonic() + 15
                while time.monotonic() < end and rss.peak <= RSS_CAP:
                    time.sleep(0.05)
                n, closed = stop_flood(attacker)
                stop.set()
                lt.join()
            time.sleep(3)
            ok = [t for t in took if t is not None]
            capped = " (stopped at the RSS cap)" if rss.peak > RSS_CAP else ""
            print(f"flood 15 s, {connections} connections (reconnecting), {what}{', with resets' if reset else ''}: "
                  f"rss {before / MIB:.0f} MiB -> peak {rss.peak / MIB:.0f} MiB, 3 s later {rss.now() / MIB:.0f} MiB; "
                  f"{n} streams{capped}, {closed} connections closed by moed; calls from new clients (6 s deadline): "
                  f"{len(ok)} of {len(took)} answered, median {statistics.median(ok) if ok else 0:.2f} s, "
                  f"max {max(ok) if ok else 0:.2f} s{'; errors ' + str(dict(errors)) if errors else ''}; "
                  f"moed {'up' if p.poll() is None else 'DEAD'}")
            p.terminate()
            p.wait(60)


def _window(start):
    """A ForwardStream client that grants no HTTP/2 window: 50 streams x 16 requests of 2048
    tokens (2 MiB replies), for at most 60 s."""
    import numpy as np

    from moed import MoEClient

    p, addr = start()
    with MoEClient(addr) as c:
        request = c.build_request(0, np.zeros((2048, 256), np.float32), expert_ids=np.zeros((2048, 2), np.int32),
                                  expert_weights=np.full((2048, 2), 0.5, np.float32)).SerializeToString()
    with Rss(p.pid) as rss:
        before, t0 = rss.now(), time.monotonic()
        closed, sent = withhold_window(addr, request, streams=50, per_stream=16, guard_s=60)
        took = time.monotonic() - t0
        at_end = rss.now()
    time.sleep(3)
    print(f"a client granting no window, 50 streams x 16 requests of 2048 tokens: rss {before / MIB:.0f} MiB -> "
          f"peak {rss.peak / MIB:.0f} MiB, {at_end / MIB:.0f} MiB at the end, 3 s later {rss.now() / MIB:.0f} MiB; "
          f"{sent} requests sent; {'closed by moed after' if closed else 'still open after'} {took:.1f} s")
    p.terminate()
    p.wait(60)


def flood_process(address, connections, reset=False, min_streams=1, guard_s=300):
    """flood() with `connections` connections, reconnecting to any the server closes, in a process
    of its own (the attacker is not the callers' process: no shared interpreter lock), until it is
    sent SIGTERM (or guard_s passes). It prints "flooding" once `min_streams` streams are out (or
    "stopped" if it ends first), and at its end the streams sent and the connections the server
    closed (stop_flood reads them)."""
    import subprocess
    return subprocess.Popen([sys.executable, __file__, "flood", address, str(connections), "reset" if reset else "open",
                             str(min_streams), str(guard_s)], stdout=subprocess.PIPE, text=True)


def wait_flooding(p):
    """Waits until flood_process p has its first `min_streams` out; False if it ended first."""
    return p.stdout.readline().strip() == "flooding"


def stop_flood(p, timeout=60):
    """Stops flood_process p (if it still runs); returns (streams sent, connections the server
    closed)."""
    p.terminate()
    p.wait(timeout)
    streams, closed = p.stdout.read().split()[-2:]  # read, not communicate: wait_flooding buffered
    p.stdout.close()
    return int(streams), int(closed)


def _flood_main(address, connections, how, min_streams, guard_s):
    import signal
    stop, started, closed = threading.Event(), threading.Event(), []
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    result = []
    t = threading.Thread(target=lambda: result.append(flood(
        address, guard_s, connections=connections, reset=how == "reset", stop=stop.is_set, reconnect=True,
        closed=closed, started=started, min_streams=min_streams)))
    t.start()
    while not started.wait(0.1):
        if not t.is_alive():
            break
    print("flooding" if started.is_set() else "stopped", flush=True)
    t.join()
    print(result[0], len(closed), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["flood"]:
        _flood_main(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), float(sys.argv[6]))
    else:  # hostile.py MOED [bodies|work|flood]...
        _measure(sys.argv[1] if len(sys.argv) > 1 else "build/server/moed", sys.argv[2:] or
                 ("bodies", "work", "flood", "window"))
