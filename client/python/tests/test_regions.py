"""moed.regions without a server: which targets count as this host, the slot allocator (first fit,
freed ranges merged, any order), slots given back when the last array viewing them goes, and
retired regions after a call that failed without the server saying it never took it; auto's
warning when the server refuses a CUDA region. The region session against real daemons:
tests/e2e/test_python_regions.py."""

import gc
import logging
import mmap
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from moed import regions, tensors, transport, types
from moed.types import MoEError


@pytest.mark.parametrize("target,local", [
    ("127.0.0.1:50051", True), ("127.8.9.1:1", True), ("localhost:50051", True), ("[::1]:50051", True),
    ("ipv4:127.0.0.1:1,127.0.0.2:2", True), ("ipv6:[::1]:50051", True), ("dns:///localhost:50051", True),
    ("dns://8.8.8.8/localhost:1", True), ("unix:/run/moed.sock", True), ("unix-abstract:moed", True),
    ("10.0.0.1:50051", False), ("moed.example:50051", False), ("[2001:db8::1]:1", False),
    ("ipv4:127.0.0.1:1,10.0.0.1:1", False), ("dns:///moed.example:1", False), ("0.0.0.0:1", False)])
def test_local_targets(target, local):
    assert regions.local_target(target) is local


def test_pool_first_fit_and_merging():
    p = regions.Pool(4096)
    offs = [p.take(100) for _ in range(16)]  # 256 each
    assert offs == [256 * i for i in range(16)] and p.take(1) is None and p.used == 4096
    for i in (1, 3, 2):  # freed out of order: merged into one 768-byte range
        p.give(offs[i], 100)
    assert p.take(700) == 256 and p.take(1) is None
    for i in (0, 4, 5, 15, 6, 7, 8, 9, 10, 11, 12, 13, 14):
        p.give(offs[i], 100)
    p.give(256, 700)
    assert p.used == 0 and p._free == [(0, 4096)]


class FakeChunk:
    kind, id = "host", 1

    def __init__(self, size):
        self.size, self.pool = size, regions.Pool(size)
        self.calls, self.stuck, self.closed = 0, [], False
        self.buf = mmap.mmap(-1, size)  # as HostChunk: arrays over a mapping, not over an array

    def register(self):
        self.id = (yield {"register": self.size})["region"]["id"]

    def close(self):
        self.closed = True

    def bytes_at(self, off, n, writable):
        a = np.frombuffer(self.buf, np.uint8, count=n, offset=off)
        a.flags.writeable = writable
        return a


def test_a_slot_comes_back_when_its_last_view_goes():
    arena = regions.Arena(FakeChunk, 4096)
    chunk = FakeChunk(4096)
    arena.chunks.append(chunk)
    s = arena.take(1000)
    view = s.lent().view(np.float32)[10:20]  # anything made from the lent bytes keeps the slot
    assert not view.flags.writeable and chunk.pool.used == 1024
    gc.collect()
    assert chunk.pool.used == 1024
    del view
    gc.collect()
    assert chunk.pool.used == 0


def test_a_call_failing_uncertainly_retires_its_region():
    arena = regions.Arena(FakeChunk, 4096)
    arena.chunks.append(FakeChunk(4096))
    arena.take(10).failed("INVALID_ARGUMENT")  # refused: the slot is free again
    assert arena.chunks and arena.chunks[0].pool.used == 0
    arena.take(10).failed("DEADLINE_EXCEEDED")  # the server may still write it
    assert not arena.chunks and len(arena.retired) == 1 and arena.take(10) is None


class FakeDeviceChunk(FakeChunk):
    kind = "cuda"


class Server:
    """Answers what an arena's steps yield as the session would: ids from 1 for registrations,
    `held` (region id -> requests holding it) for ListRegions and in an unregister's event."""

    def __init__(self):
        self.ops, self.held, self.next_id = [], {}, 1

    def run(self, steps):
        answer = None
        while True:
            try:
                op = steps.send(answer)
            except StopIteration as stop:
                return stop.value
            self.ops.append(op)
            if op is regions.LISTING:
                answer = [types.Region(i, "cuda", "", 0, 0, True, False, n) for i, n in self.held.items()]
            elif "register" in op:
                answer, self.held[self.next_id] = {"region": {"id": self.next_id}}, 0
                self.next_id += 1
            else:
                i = op["unregister"]["region"]
                answer = {"region": {"id": i, "requests": self.held.pop(i)}}

    def unregistered(self):
        return [op["unregister"]["region"] for op in self.ops if op is not regions.LISTING and "unregister" in op]


def test_a_retired_host_region_is_unregistered_and_unmapped_once_no_call_uses_it():
    """Unregistered at once (no request can name it after that); its memory is the client's again
    when the server answers that no request held it, and dropped by the client anyway (never used
    again, the server's mapping kept until its request ends)."""
    arena, server = regions.Arena(FakeChunk, 4096), Server()
    a, b = server.run(arena.slot(10)), server.run(arena.slot(10))  # two calls in one region
    first = a.chunk
    a.failed("DEADLINE_EXCEEDED")
    server.held[first.id] = 1
    c = server.run(arena.slot(10))  # b is still in flight: nothing is unregistered
    assert server.unregistered() == [] and arena.retired == [first] and c.chunk is not first
    b.give()
    server.held[first.id] = 0  # the server let go of a's request
    c.give()
    d = server.run(arena.slot(10))
    assert server.unregistered() == [first.id] and regions.LISTING not in server.ops
    assert arena.retired == [] and first.closed and first.pool.used == 0 and d.chunk is c.chunk
    # One the server still held when unregistered is let go by the client all the same.
    d.failed("CANCELLED")
    server.held[d.chunk.id] = 1
    server.run(arena.slot(10))
    assert server.unregistered() == [first.id, d.chunk.id] and arena.retired == [] and arena.held == []


def test_a_retired_device_region_is_freed_only_once_the_server_holds_it_no_more():
    """Device memory the server has open must not be freed (CUDA IPC): the arena asks ListRegions
    before it would grow, unregisters what no request holds, and frees it when the unregister's
    event confirms that none held it then; one a request took meanwhile is kept, never freed."""
    arena, server = regions.Arena(FakeDeviceChunk, 4096), Server()
    s = server.run(arena.slot(10))
    first = s.chunk
    s.failed("DEADLINE_EXCEEDED")
    server.held[first.id] = 1
    s = server.run(arena.slot(10))  # grows: the server still holds the retired region
    assert server.ops.count(regions.LISTING) == 1 and server.unregistered() == []
    s.give()
    server.run(arena.slot(10)).give()  # no growth, no question
    assert server.ops.count(regions.LISTING) == 1 and arena.retired == [first] and not first.closed
    server.held[first.id] = 0
    s = server.run(arena.slot(2 << 20))  # grows again: the first region is unheld now
    assert server.unregistered() == [first.id] and first.closed and first.pool.used == 0
    assert arena.retired == [] and arena.held == []
    # Unheld when listed, held again when unregistered (a late request): kept, not freed.
    second = s.chunk
    s.failed("INTERNAL")
    steps = arena.slot(4 << 20)  # more than any region has
    assert steps.send(None) is regions.LISTING
    op = steps.send([types.Region(second.id, "cuda", "", 0, 0, True, False, 0)])
    assert op == {"unregister": {"region": second.id}}
    op = steps.send({"region": {"id": second.id, "requests": 1}})
    assert "register" in op and arena.held == [second] and not second.closed and arena.retired == []


def test_shared_memory_that_cannot_be_had_is_refused_up_front():
    """Reserved when made, so a full /dev/shm is an error now, not a SIGBUS at the first write."""
    import glob
    import os

    with pytest.raises(MoEError, match="/dev/shm") as e:
        regions.HostChunk(1 << 50)
    assert e.value.code_name == "RESOURCE_EXHAUSTED"
    assert not glob.glob(f"/dev/shm/moed-py-{os.getpid()}-*")
    c = regions.HostChunk(1 << 20)
    c.unlink()
    assert c.pool.take(1 << 20) == 0 and len(c.map) == 1 << 20


class DeviceArray(np.ndarray):
    """A CUDA tensor as transport.cuda() sees one, on GPU 0 (its bytes on the host here)."""

    device = SimpleNamespace(type="cuda", index=0)

    def detach(self):
        return self


class CudaInput(tensors.NumpyInput):
    __slots__ = ()
    cuda = True


# What the cuda backend answers for a region on a GPU its process does not see (kernels/cuda).
REFUSAL = ("GPU GPU-0a1b2c3d-0000-0000-0000-000000000000 is not visible to this server (it sees 1 "
           "GPU: 0 GPU-0a1b2c3d-1111-1111-1111-111111111111; CUDA_VISIBLE_DEVICES=1): make that GPU "
           "visible to moed, or register a host region")


def test_auto_says_why_when_the_server_refuses_a_cuda_region(monkeypatch, caplog):
    """A CUDA tensor whose device region the server refuses (FAILED_PRECONDITION: a GPU the server
    does not see) goes inline, with a warning on moed.transport carrying the server's message:
    once, not for every call while it lasts; the refused region is let go."""
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or SimpleNamespace())
    regs = regions.Regions("unix:/run/moed.sock")
    arena = regs.devices[0] = regions.Arena(FakeDeviceChunk, 4096)
    x = np.arange(8 * 64, dtype=np.float32).reshape(8, 64).view(DeviceArray)
    sent = []

    def run(steps):
        answer, error = None, None
        while True:
            try:
                op = steps.send(answer) if error is None else steps.throw(error)
            except StopIteration as stop:
                return stop.value
            answer, error = None, None
            sent.append(op)
            if op is regions.LIMITS:
                answer = types.RegionLimits(mode="local", cuda=True)
            else:
                error = MoEError("FAILED_PRECONDITION", REFUSAL)

    with caplog.at_level(logging.INFO, logger="moed"):
        for _ in range(2):
            p = run(transport.prepare("auto", CudaInput(x, tensors.F32, x.shape), regs))
            assert p.transport == "inline" and p.output is None
            assert np.array_equal(p.tensor["data"], x)
    assert [op for op in sent if op is not regions.LIMITS] == [{"register": 1 << 20}] * 2
    warned = [r for r in caplog.records if r.name.startswith("moed")]
    assert len(warned) == 1 and warned[0].name == "moed.transport", warned
    assert warned[0].levelno == logging.WARNING and "inline" in warned[0].getMessage()
    assert REFUSAL in warned[0].getMessage()
    assert REFUSAL in regs.inline_why and arena.chunks == [] and arena.retired == []
