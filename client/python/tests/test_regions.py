"""moed.regions without a server: which targets count as this host, the slot allocator (first fit,
freed ranges merged, any order), slots given back when the last array viewing them goes, and
retired regions after a call that failed without the server saying it never took it. The region
session against real daemons: tests/e2e/test_python_regions.py."""

import gc
import mmap

import numpy as np
import pytest

from moed import regions


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
        self.buf = mmap.mmap(-1, size)  # as HostChunk: arrays over a mapping, not over an array

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


def test_shared_memory_that_cannot_be_had_is_refused_up_front():
    """Reserved when made, so a full /dev/shm is an error now, not a SIGBUS at the first write."""
    import glob
    import os

    with pytest.raises(OSError, match="/dev/shm"):
        regions.HostChunk(1 << 50)
    assert not glob.glob(f"/dev/shm/moed-py-{os.getpid()}-*")
    c = regions.HostChunk(1 << 20)
    c.unlink()
    assert c.pool.take(1 << 20) == 0 and len(c.map) == 1 << 20
