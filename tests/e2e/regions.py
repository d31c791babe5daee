"""Tensor regions from the tests' side: POSIX shared memory made by hand (an object under /dev/shm
is what shm_open names), the Regions stream and Forward driven with the generated protobuf classes,
so the daemon is checked against the protocol as written, not against a client library.
"""

import mmap
import os
import queue
import secrets

import numpy as np

from moed._proto.moed.v1 import moed_pb2 as pb

DTYPES = {"f32": (pb.F32, np.float32), "bf16": (pb.BF16, np.uint16), "i32": (pb.I32, np.int32)}


class Shm:
    """A shared-memory object of `size` bytes, mapped here."""

    def __init__(self, size, name=None):
        self.name = name or f"/moed-test-{os.getpid()}-{secrets.token_hex(6)}"
        self.path = "/dev/shm" + self.name
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, size)
        self.map = mmap.mmap(fd, size)
        os.close(fd)
        self.size = size

    def put(self, offset, a):
        b = np.ascontiguousarray(a).tobytes()
        self.map[offset:offset + len(b)] = b
        return offset

    def get(self, offset, n):
        return bytes(self.map[offset:offset + n])

    def truncate(self, size):
        os.truncate(self.path, size)

    def close(self):
        if os.path.exists(self.path):
            os.unlink(self.path)


class Session:
    """One Regions stream: command() sends a RegionCommand and returns its RegionEvent."""

    def __init__(self, channel, metadata=()):
        self._q = queue.Queue()
        call = channel.stream_stream("/moed.v1.Moed/Regions",
                                     request_serializer=pb.RegionCommand.SerializeToString,
                                     response_deserializer=pb.RegionEvent.FromString)
        self._events = call(iter(self._q.get, None), metadata=metadata)
        self.seq = 0

    def command(self, **kw):
        self.seq += 1
        self._q.put(pb.RegionCommand(seq=self.seq, **kw))
        ev = next(self._events)
        assert ev.seq == self.seq, (ev.seq, self.seq)
        return ev

    def register_host(self, shm, size=None, challenge=None):
        """Both steps; returns the confirm's event (or the register's, when it failed)."""
        ev = self.command(register_host=pb.RegisterHostRegion(name=shm.name, bytes=size or shm.size))
        if ev.code:
            return ev
        shm.map[0:16] = challenge if challenge is not None else ev.challenge
        return self.command(confirm_host=pb.ConfirmHostRegion(region=ev.region.id))

    def host(self, shm):
        """A confirmed region of shm; its id."""
        ev = self.register_host(shm)
        assert ev.code == 0, ev.message
        return ev.region.id

    def unregister(self, region):
        return self.command(unregister=pb.UnregisterRegion(region=region))

    def close(self):
        """Ends the stream from this side and waits for the server's status."""
        self._q.put(None)
        for _ in self._events:
            pass


def unary(channel, method, req_cls, resp_cls):
    return channel.unary_unary(f"/moed.v1.Moed/{method}", request_serializer=req_cls.SerializeToString,
                               response_deserializer=resp_cls.FromString)


def tensor(dtype, a, ref=None):
    """A Tensor of array a in dtype ("f32", "bf16" as uint16 bits, "i32"): its bytes inline, or a
    reference (region, offset) to where they are."""
    wire, _ = DTYPES[dtype]
    t = pb.Tensor(dtype=wire, shape=list(a.shape))
    if ref is None:
        t.data = np.ascontiguousarray(a).tobytes()
    else:
        t.region.CopyFrom(pb.RegionRef(region=ref[0], offset=ref[1], length=a.nbytes))
    return t


def ref(region, offset, length):
    return pb.RegionRef(region=region, offset=offset, length=length)


def list_regions(channel, metadata=()):
    return unary(channel, "ListRegions", pb.ListRegionsRequest, pb.RegionList)(
        pb.ListRegionsRequest(), metadata=metadata).regions
