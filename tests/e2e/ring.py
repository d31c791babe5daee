"""Doorbell rings from the tests' side: the layout of common/moed_ring.h written with struct into a
host region of a Regions session (regions.py), registered with the generated stubs, so the daemon
is checked against the layout and the protocol as written, not against a client library.

A call: write the descriptor into a slot, store its ticket, then the bell; wait for `done` to equal
the ticket. Python's stores into the mapping land in program order (x86), as the layout asks.
"""

import struct
import time

from regions import Shm

from moed._proto.moed.v1 import moed_pb2 as pb

MAGIC = 0x4752444D
VERSION = 1
HEADER = 256
SLOT = 512
BELL, STATE, FAILURES, COMPLETED = 64, 128, 132, 136
SERVING, DRAINING, CLOSED = 1, 2, 3
REQUEST = struct.Struct("<IIIIIIIIQ")  # ticket flags layer dtype tokens top_k deadline_us reserved tag
REF = struct.Struct("<QQQ")
COMPLETION = struct.Struct("<IiIIIIII")  # done status queue_us compute_us batch_tokens batch_requests
#                                          completions reserved
MESSAGE = 288  # within a slot
OK = 0


def ring_bytes(slots):
    return HEADER + SLOT * slots


def write_header(shm, offset, slots, magic=MAGIC, version=VERSION, header_bytes=HEADER, slot_bytes=SLOT,
                 n_slots=None):
    struct.pack_into("<IHHII", shm.map, offset, magic, version, header_bytes, slot_bytes,
                     slots if n_slots is None else n_slots)


class Completion:
    def __init__(self, raw, message):
        (self.done, self.status, self.queue_us, self.compute_us, self.batch_tokens, self.batch_requests,
         self.completions, _) = raw
        self.message = message

    def __repr__(self):
        return f"Completion(status={self.status}, message={self.message!r})"


class Ring:
    """A ring of `slots` slots at `offset` of shm (a confirmed region of session), registered."""

    def __init__(self, session, shm, region, offset=0, slots=8, register=True):
        self.session, self.shm, self.region, self.offset, self.slots = session, shm, region, offset, slots
        self.tickets = [0] * slots
        write_header(shm, offset, slots)
        self.id = None
        if register:
            ev = self.register()
            assert ev.code == 0, ev.message
            self.id = ev.ring.id

    def register(self, offset=None, slots=None, region=None):
        return self.session.command(register_ring=pb.RegisterRing(
            region=self.region if region is None else region, offset=self.offset if offset is None else offset,
            slots=self.slots if slots is None else slots))

    def unregister(self):
        return self.session.command(unregister_ring=pb.UnregisterRing(ring=self.id))

    def word(self, at):
        return struct.unpack_from("<I", self.shm.map, self.offset + at)[0]

    def state(self):
        return self.word(STATE)

    def failures(self):
        return self.word(FAILURES)

    def completed(self):
        return self.word(COMPLETED)

    def slot_at(self, i):
        return self.offset + HEADER + SLOT * i

    def write(self, i, layer, dtype, tokens, top_k, hidden, ids, weights, output, deadline_us=0, tag=0,
              flags=0, reserved=0):
        """The request half of slot i, its ticket left 0; refs are (region, offset, length)."""
        at = self.slot_at(i)
        REQUEST.pack_into(self.shm.map, at, 0, flags, layer, dtype, tokens, top_k, deadline_us, reserved, tag)
        for k, r in enumerate((hidden, ids, weights, output)):
            REF.pack_into(self.shm.map, at + 40 + 24 * k, *r)

    def ring(self, i, ticket=None, bell=True):
        """Rings slot i with its next ticket (or the one given); returns the ticket."""
        if ticket is None:
            ticket = self.tickets[i] + 1 if self.tickets[i] + 1 < 2 ** 32 else 1
        self.tickets[i] = ticket
        struct.pack_into("<I", self.shm.map, self.slot_at(i), ticket)
        if bell:
            struct.pack_into("<I", self.shm.map, self.offset + BELL, 1)
        return ticket

    def ticket(self, i):
        return struct.unpack_from("<I", self.shm.map, self.slot_at(i))[0]

    def completion(self, i):
        at = self.slot_at(i) + 256
        raw = COMPLETION.unpack_from(self.shm.map, at)
        msg = bytes(self.shm.map[self.slot_at(i) + MESSAGE:self.slot_at(i) + SLOT])
        return Completion(raw, msg.split(b"\0", 1)[0].decode())

    def wait(self, i, ticket=None, timeout=60):
        """The completion of slot i's call with `ticket` (default: the last rung), once `done` says
        so; the timeout is a hang guard only."""
        ticket = self.tickets[i] if ticket is None else ticket
        deadline = time.monotonic() + timeout
        at = self.slot_at(i) + 256
        while struct.unpack_from("<I", self.shm.map, at)[0] != ticket:
            assert time.monotonic() < deadline, f"slot {i} not completed in {timeout} s (state {self.state()})"
            time.sleep(0.0002)
        return self.completion(i)

    def call(self, i, *args, **kw):
        self.write(i, *args, **kw)
        self.ring(i)
        return self.wait(i)


def wait_for(what, fn, timeout=60):
    """Waits for fn() to be true (a state the test can observe); the timeout is a hang guard."""
    deadline = time.monotonic() + timeout
    while not (v := fn()):
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        time.sleep(0.005)
    return v


__all__ = ["Ring", "Shm", "write_header", "ring_bytes", "wait_for", "SERVING", "DRAINING", "CLOSED"]
