"""HeldCall: a Forward call that stays open on the server for exactly as long as a test wants.

Its HEADERS go out and its message never does, so the daemon has the call in flight (it counts in
moed_calls_active, and a drain waits for it) without anything being computed: no timing decides
how long it lasts, only release() (the client resets it, as a cancelled caller does) or the server
ending it (--drain-timeout, a second SIGTERM). Spoken as raw HTTP/2 (the `h2` package), since a
gRPC client always sends its whole message at once.
"""

import socket
import threading
import time

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from prod import scrape

FORWARD = "/moed.v1.Moed/Forward"


def held_call(d, timeout=60):
    """A HeldCall to daemon d (started with prod.ANY_METRICS_PORT), returned once d counts it among
    its open calls: a signal sent after that finds it in flight. Nothing else may open or end a
    call meanwhile."""
    before = scrape(d.metrics_port).get("moed_calls_active")
    call = HeldCall(d.address)
    deadline = time.monotonic() + timeout
    while scrape(d.metrics_port).get("moed_calls_active") != before + 1:
        assert time.monotonic() < deadline, f"moed did not count the held call in {timeout} s"
        time.sleep(0.01)
    return call


class HeldCall:
    """Opens the call on a connection of its own. `status` is the grpc-status the server ended it
    with, `reset` whether the server reset the stream, `goaway` whether it sent GOAWAY; `ended`
    is set once the server ended the call or closed the connection."""

    def __init__(self, address, path=FORWARD):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                                         header_encoding="utf-8"))
        self.lock = threading.Lock()
        self.status = None
        self.reset = self.goaway = False
        self.ended = threading.Event()
        with self.lock:
            self.conn.initiate_connection()
            self.sid = self.conn.get_next_available_stream_id()
            self.conn.send_headers(self.sid, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                              (":authority", address), ("content-type", "application/grpc"),
                                              ("te", "trailers")])
            self.sock.sendall(self.conn.data_to_send())
        self.sock.settimeout(None)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        """Answers the server's SETTINGS and PINGs and records how the call ends."""
        try:
            while data := self.sock.recv(65536):
                with self.lock:
                    for ev in self.conn.receive_data(data):
                        if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                            status = dict(ev.headers).get("grpc-status")
                            if status is not None:
                                self.status = int(status)
                                self.ended.set()
                        elif isinstance(ev, h2.events.StreamReset) and ev.stream_id == self.sid:
                            self.reset = True
                            self.ended.set()
                        elif isinstance(ev, h2.events.ConnectionTerminated):
                            self.goaway = True
                    self.sock.sendall(self.conn.data_to_send())
        except OSError:
            pass
        except h2.exceptions.ProtocolError:  # a frame after the GOAWAY that ended the connection
            self.goaway = self.conn.state_machine.state == h2.connection.ConnectionState.CLOSED
        self.ended.set()

    def release(self):
        """Cancels the call (RST_STREAM CANCEL) and closes the connection."""
        if not self.ended.is_set():
            with self.lock:
                try:
                    self.conn.reset_stream(self.sid, 8)
                    self.sock.sendall(self.conn.data_to_send())
                except (OSError, h2.exceptions.ProtocolError):
                    pass
        self.close()

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.reader.join(30)
