"""Tensor regions, the client's side: the region session, arenas that calls borrow slots of, and
tensors a caller registers itself (moed.proto states the server's rules).

The session is one moed.v1.Moed/Regions stream per client, opened on first use and kept open in
the background: it is the lease of everything registered on it. When it ends (close(), the
process dying, the connection dropping, the server draining) the server releases every region of
it; the client then starts a new session on its next call and registers afresh.

Nothing here does I/O. What needs the server is written as generators ("steps") that yield what
they need, a RegionCommand (a dict for moed.wire, without its seq), LIMITS (the server's
RegionLimits) or LISTING (the principal's regions, ListRegions), and are sent back the answer (the
RegionEvent, checked: a failed command is thrown into the steps as MoEError); each client runs
them its own way (a Driver, blocking or awaiting).

Host arena: POSIX shared memory the client creates (/dev/shm/moed-py-PID-RANDOM, mode 0600; so
Linux), registered with the server's challenge and unlinked at once, so a client that dies leaves
no name behind. A call copies hidden into a slot (the one copy), the server computes in place and
writes the output over it, and the output is a view of the slot (read-only for numpy; torch's is
writable: the slot is the output's while it lives). A slot is reused only once nothing references
its output (the array, or anything made from it, keeps it): an output stays valid as long as it
lives, across later calls and after close(). copy=True copies it out and frees the slot at once.

Device arena, one per CUDA device: device memory of its own (cuMemAlloc, seen by torch as a uint8
tensor through __cuda_array_interface__), registered by CUDA IPC handle, all through the CUDA
driver API by ctypes (cuIpcGetMemHandle, the GPU named by cuDeviceGetUuid_v2's UUID). Not torch's
caching allocator: its segments hold many tensors, and CUDA lets the server open an allocation's
handle only once. Nor torch's _share_cuda_(): it ties the memory to torch.multiprocessing's
reference counting, which the server never takes part in. A call copies hidden into a slot (one
device copy on the current stream, synchronized before the request is sent: the server reads it
from another process), the server writes the output in place, and it is copied into a new tensor
(one device copy, synchronized before the slot is reused).

Registered tensors (MoEClient.register): the region is the whole allocation that holds the tensor
(cuMemGetAddressRange), registered once however many of its tensors are registered, and kept until
the last is unregistered. With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torch's memory has
no IPC handle, and register() fails with the driver's error.

Arenas grow: a call that finds no free slot large enough registers a region twice the size of the
last (at least its own need), and regions left empty behind the newest are unregistered at a later
call. A call that fails without a sure sign that the server never took it (a deadline, a cancel,
INTERNAL) retires its region: the server may still write into it, so it gives no more slots. Once
no other call of this client uses it, a later call unregisters it (no request can name it after
that, and the server unmaps it when the last request holding it ends) and the client lets it go:
* host: at once, whatever the server still holds: the client never uses that memory again, and
  the pages go with the server's mapping;
* device: memory the server has open must not be freed (CUDA IPC), so it is unregistered only
  when ListRegions shows no request on it (asked when the arena would otherwise grow), and freed
  when the unregister's event confirms that none held it (the server then unmapped it before
  answering). One that a late request took in between is kept, never freed, for the client's life.
So retired regions never pile up toward --max-regions beyond the requests the server really holds.

Routing tensors (expert ids and weights, logits: a few bytes a token, converted by the client
anyway) travel inline on every transport.
"""

from __future__ import annotations

import bisect
import ctypes
import ipaddress
import mmap
import os
import secrets
import sys
import threading
import weakref
from typing import Any, Dict, Generator, List, Optional, Tuple

import numpy as np

from .types import InvalidArgument, MoEError, local_failure

ALIGN = 256  # slot offsets and sizes: any dtype's alignment, and a GPU cache line
MIB = 1 << 20
HOST_MIN = 4 * MIB  # the first host region
DEVICE_MIN = 32 * MIB  # the first device region (over torch's 10 MiB: a segment of its own)
LIMITS = object()  # what steps yield to be sent the server's RegionLimits
LISTING = object()  # what steps yield to be sent the principal's regions (a list of types.Region)
# Statuses of a failed Forward that say the server did not take the request: its slots are free.
CLEAN = frozenset(("INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
                   "UNAVAILABLE", "UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED",
                   "OUT_OF_RANGE", "ALREADY_EXISTS"))
_LOCAL_NAMES = {"localhost", "ip6-localhost", "ip6-loopback"}

Steps = Generator[Any, Any, Any]


def local_target(target: str) -> bool:
    """Whether a gRPC target names this host without resolving anything: a unix: socket, or a
    loopback address or name ("127.0.0.1:50051", "localhost:50051", "[::1]:50051", "ipv4:127.0.0.1:
    50051", "dns:///localhost:50051"). Another name of this host counts as remote: the server
    takes regions only from loopback and unix peers (--regions local) anyway."""
    t = target.strip()
    if t.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("dns:", "ipv4:", "ipv6:"):
        if t.startswith(scheme):
            t = t[len(scheme):]
            if t.startswith("//"):
                t = t[2:].partition("/")[2]
            break
    hosts = []
    for addr in t.split(","):  # ipv4:/ipv6: may list several
        if addr.startswith("["):
            hosts.append(addr[1:addr.find("]")])
        else:
            hosts.append(addr.rsplit(":", 1)[0] if addr.count(":") == 1 else addr)
    return all(_loopback(h) for h in hosts)


def _loopback(host: str) -> bool:
    if host.lower() in _LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


class Pool:
    """First-fit allocation of ALIGN-rounded byte ranges of one region. Thread-safe: slots are
    given back by the garbage collector, on whichever thread drops an output."""

    def __init__(self, size: int):
        self.size = size
        self.used = 0
        self._free: List[Tuple[int, int]] = [(0, size)]  # (offset, length), sorted, merged
        self._lock = threading.Lock()

    def take(self, n: int) -> Optional[int]:
        """The offset of n free bytes, or None."""
        n = _round(max(n, 1), ALIGN)
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= n:
                    if length == n:
                        del self._free[i]
                    else:
                        self._free[i] = (off + n, length - n)
                    self.used += n
                    return off
        return None

    def give(self, off: int, n: int) -> None:
        """Gives back what take(n) returned as off."""
        n = _round(max(n, 1), ALIGN)
        with self._lock:
            self.used -= n
            i = bisect.bisect(self._free, (off, 0))
            if i < len(self._free) and off + n == self._free[i][0]:
                n += self._free.pop(i)[1]
            if i and self._free[i - 1][0] + self._free[i - 1][1] == off:
                off, n = self._free[i - 1][0], self._free[i - 1][1] + n
                i -= 1
                del self._free[i]
            self._free.insert(i, (off, n))


class Chunk:
    """What a region of an arena has whatever its kind: its size and id, its slots, the calls using
    it (under the arena's lock) and the slots of calls that failed uncertainly."""

    def __init__(self, size: int):
        self.size, self.id, self.pool = size, 0, Pool(size)
        self.calls = 0  # calls given a slot of it that have not ended
        self.stuck: List[Tuple[int, int]] = []  # (offset, bytes) the server may still write


class HostChunk(Chunk):
    """A region of POSIX shared memory the client created and mapped."""

    kind = "host"
    device = -1

    def __init__(self, size: int):
        self.name = f"/moed-py-{os.getpid()}-{secrets.token_hex(8)}"
        path = "/dev/shm" + self.name
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as e:  # no /dev/shm, no descriptor left
            raise self.failure(e, size) from e
        try:
            os.ftruncate(fd, size)
            # The pages now, or ENOSPC now: a tmpfs that fills later (a container's 64 MiB
            # /dev/shm) would kill the process with SIGBUS on the first write past its end.
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        except OSError as e:
            os.unlink(path)
            raise self.failure(e, size) from e
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        super().__init__(size)

    @staticmethod
    def failure(e: OSError, size: int) -> MoEError:
        return local_failure(e, f"cannot make {size} bytes of shared memory in /dev/shm ({e.strerror}): "
                                f"enlarge it (docker run --shm-size) or use transport='inline'")

    def register(self) -> Steps:
        """The two steps: the server maps it and answers a challenge, written here, then confirmed."""
        try:
            ev = yield {"register_host": {"name": self.name, "bytes": self.size}}
            if ev["region"] is None or len(ev["challenge"]) != 16:
                raise MoEError("INTERNAL", "the server's answer to register_host lacks the region or "
                                           "its challenge")
            self.id = ev["region"]["id"]
            self.map[0:16] = ev["challenge"]
            yield {"confirm_host": {"region": self.id}}
            self.map[0:16] = bytes(16)
        finally:
            self.unlink()

    def unlink(self) -> None:
        try:
            os.unlink("/dev/shm" + self.name)
        except FileNotFoundError:
            pass

    def bytes_at(self, off: int, n: int, writable: bool) -> np.ndarray:
        """n bytes at off, as a uint8 array over the mapping."""
        a = np.frombuffer(self.map, np.uint8, count=n, offset=off)
        a.flags.writeable = writable
        return a

    def close(self) -> None:
        """Unmaps, unless a slot is out (a call preparing, an output viewing it): the mapping then
        goes with the last of them, by reference counting."""
        if self.pool.used == 0:
            try:
                self.map.close()
            except BufferError:
                pass


class DeviceChunk(Chunk):
    """A region of device memory: an allocation of its own (cuMemAlloc, not torch's caching
    allocator, whose segments hold several tensors: CUDA lets a process open an allocation's IPC
    handle only once, so two regions in one segment would fail), seen as a torch.uint8 tensor."""

    kind = "cuda"

    def __init__(self, size: int, device: int):
        torch = sys.modules["torch"]
        self.tensor = torch.as_tensor(DeviceMemory(size, device))
        if self.tensor.device != torch.device("cuda", device):  # torch reads the device off the pointer
            raise MoEError("INTERNAL", f"device memory made on GPU {device} shows as {self.tensor.device}")
        super().__init__(size)
        self.device = device

    def register(self) -> Steps:
        ev = yield cuda_command(self.tensor.data_ptr(), self.device)[0]
        self.id = region_id(ev)

    def bytes_at(self, off: int, n: int, writable: bool = True) -> Any:
        return self.tensor[off:off + n]

    def close(self) -> None:
        """Lets the memory go, unless a slot is out (it then goes with the last of them)."""
        if self.pool.used == 0:
            self.tensor = None


def region_id(ev: Dict[str, Any]) -> int:
    if ev["region"] is None:
        raise MoEError("INTERNAL", "the server's answer to a region command lacks the region")
    return ev["region"]["id"]


class Slot:
    """n bytes at off of a chunk, lent to one call."""

    __slots__ = ("chunk", "off", "n", "arena")

    def __init__(self, arena: "Arena", chunk: Any, off: int, n: int):
        self.arena, self.chunk, self.off, self.n = arena, chunk, off, n

    def ref(self) -> Dict[str, int]:
        """The moed.v1.RegionRef of the slot."""
        return {"region": self.chunk.id, "offset": self.off, "length": self.n}

    def give(self) -> None:
        """The call ended and the slot is free."""
        self.chunk.pool.give(self.off, self.n)
        self.arena.ended(self.chunk)

    def lent(self, writable: bool = False) -> np.ndarray:
        """A host view of the slot (read-only unless `writable`: the server is done writing it, and
        nothing else will until it is given back) that gives it back when the last array made from
        it is dropped (host chunks). numpy makes `a` the base of every view made from it (its own
        base is the mapping, not an array, so the chain of bases stops there), and torch.frombuffer
        holds it: the slot is in use exactly as long as something can see it."""
        a = self.chunk.bytes_at(self.off, self.n, writable)
        weakref.finalize(a, self.chunk.pool.give, self.off, self.n)
        self.arena.ended(self.chunk)
        return a

    def failed(self, code_name: str) -> None:
        """The call that had it failed with code_name: freed, or its chunk retired (see the top)."""
        if code_name in CLEAN:
            self.give()
        else:
            self.arena.retire(self)


class Arena:
    """The regions of one kind (and device) that calls borrow slots of; grown as needed."""

    def __init__(self, make, minimum: int):
        self.make, self.minimum = make, minimum  # make(size) -> a new chunk
        self.chunks: List[Any] = []  # registered, newest last
        self.retired: List[Any] = []  # given no more slots, registered until reclaimed (see the top)
        self.held: List[Any] = []  # device memory unregistered while a request held it: never freed
        self._lock = threading.Lock()  # chunks, retired, the chunks' calls, and taking from them

    def take(self, n: int) -> Optional[Slot]:
        with self._lock:
            for chunk in reversed(self.chunks):
                off = chunk.pool.take(n)
                if off is not None:
                    chunk.calls += 1
                    return Slot(self, chunk, off, n)
        return None

    def ended(self, chunk: Any) -> None:
        """A call given a slot of chunk ended (its slot given back, lent to its output, or stuck)."""
        with self._lock:
            chunk.calls -= 1

    def slot(self, n: int) -> Steps:
        """A Slot of n bytes, growing the arena if none is free; regions left empty behind the
        newest are unregistered first, and retired ones reclaimed (see the top)."""
        yield from self.reclaim(growing=False)
        with self._lock:
            empty = [c for c in self.chunks[:-1] if c.pool.used == 0]
            for chunk in empty:
                self.chunks.remove(chunk)
        for chunk in empty:
            yield {"unregister": {"region": chunk.id}}
            chunk.close()
        while True:
            s = self.take(n)
            if s is not None:
                return s
            yield from self.reclaim(growing=True)
            last = self.chunks[-1].size if self.chunks else 0
            chunk = self.make(max(self.minimum, 2 * last, _round(n, MIB)))
            try:
                yield from chunk.register()
            except BaseException:
                chunk.close()
                raise
            with self._lock:
                self.chunks.append(chunk)

    def retire(self, slot: Slot) -> None:
        """slot's call failed uncertainly: the slot is stuck, its chunk retired."""
        chunk = slot.chunk
        with self._lock:
            chunk.calls -= 1
            chunk.stuck.append((slot.off, slot.n))
            if chunk in self.chunks:
                self.chunks.remove(chunk)
                self.retired.append(chunk)

    def reclaim(self, growing: bool) -> Steps:
        """Unregisters the retired regions no call of this client uses, and lets them go (see the
        top); a device region only when `growing` (the arena needs another) and the server lists
        no request on it."""
        with self._lock:
            quiet = [c for c in self.retired if c.calls == 0]
        if quiet and quiet[0].kind == "cuda":
            if not growing:
                return
            try:
                listed = yield LISTING
            except MoEError:  # asked again at the next growth
                return
            unheld = {r.id for r in listed if r.requests == 0}
            quiet = [c for c in quiet if c.id in unheld]
        for chunk in quiet:
            with self._lock:
                if chunk not in self.retired:  # another call reclaimed it, or the session ended
                    continue
                self.retired.remove(chunk)
            try:
                ev = yield {"unregister": {"region": chunk.id}}
                unmapped = ev["region"] is not None and ev["region"]["requests"] == 0
            except MoEError:  # the session ended: the server releases it with the others
                unmapped = False
            if unmapped:
                for off, n in chunk.stuck:
                    chunk.pool.give(off, n)
                chunk.stuck.clear()
                chunk.close()
            elif chunk.kind == "cuda":
                self.held.append(chunk)
            # else a host region's mapping here goes with its last reference

    def close(self) -> None:
        """Lets go of every region here (the session that held them has ended); device memory a
        request may still hold is kept (see the top)."""
        with self._lock:
            chunks, self.chunks, self.retired = self.chunks + self.retired, [], []
            self.held += [c for c in chunks if c.kind == "cuda" and c.stuck]
        for chunk in chunks:
            chunk.close()

    def sizes(self) -> List[int]:
        with self._lock:
            return [c.size for c in self.chunks]


class Allocation:
    """A CUDA allocation that holds tensors the caller registered, registered once as one region
    (a process may open an allocation's IPC handle only once): its whole extent, since the handle
    names the whole allocation anyway. It keeps the registered tensors alive."""

    def __init__(self, command: Dict[str, Any], base: int, device: int):
        self.command, self.base, self.device = command, base, device
        self.bytes = command["register_cuda"]["bytes"]
        self.tensors: List[Any] = []
        self.id = 0
        self.session = -1  # the session it was registered on

    def ref(self, t: Any) -> Optional[Dict[str, int]]:
        """The RegionRef of contiguous tensor t if it lies here, else None."""
        if t.device.type != "cuda" or t.device.index != self.device or not t.is_contiguous():
            return None
        p, n = t.data_ptr(), t.numel() * t.element_size()
        if not (self.base <= p and p + n <= self.base + self.bytes):
            return None
        return {"region": self.id, "offset": p - self.base, "length": n}

    def register(self) -> Steps:
        ev = yield self.command
        self.id = region_id(ev)


class Registration:
    """What MoEClient.register returns: one registered tensor, in its Allocation."""

    def __init__(self, allocation: Allocation, tensor: Any):
        self.allocation, self.tensor = allocation, tensor

    @property
    def id(self) -> int:
        """The id of the region of the tensor's allocation."""
        return self.allocation.id


class Regions:
    """One client's regions: the arenas, the caller's registrations, the session's bookkeeping and
    the server's RegionLimits (fetched once by the driver). `session` counts the sessions opened:
    what was registered on an earlier one is gone."""

    def __init__(self, target: str):
        self.target = target
        self.local = local_target(target)
        self.limits: Any = None
        self.session = 0
        self.host = Arena(HostChunk, HOST_MIN)
        self.devices: Dict[int, Arena] = {}
        self.allocations: List[Allocation] = []  # holding the caller's registered tensors
        self.inline_why: Optional[str] = None  # why auto's last call went inline (moed.transport)
        self._lock = threading.Lock()

    def device(self, index: int) -> Arena:
        with self._lock:
            if index not in self.devices:
                self.devices[index] = Arena(lambda size: DeviceChunk(size, index), DEVICE_MIN)
            return self.devices[index]

    def ended(self) -> None:
        """The session ended: everything registered on it is gone on the server."""
        for arena in [self.host, *self.devices.values()]:
            arena.close()

    def registered(self, t: Any) -> Steps:
        """The RegionRef of CUDA tensor t if it lies in an allocation holding registered tensors
        (registered again first when the session it was registered on has ended), else None."""
        for alloc in list(self.allocations):
            ref = alloc.ref(t)
            if ref is not None:
                if alloc.session != self.session:
                    yield from alloc.register()
                    alloc.session = self.session
                    ref["region"] = alloc.id
                return ref
        return None

    def register(self, tensor: Any) -> Steps:
        """Registers a caller's CUDA tensor; returns its Registration."""
        if type(tensor).__module__.split(".")[0] != "torch" or tensor.device.type != "cuda":
            raise InvalidArgument("register() takes a torch CUDA tensor (host tensors go through "
                                  "the client's shared-memory arena)")
        if not self.local:
            raise InvalidArgument(remote_message("register()", self.target))
        command, base = cuda_command(tensor.data_ptr(), tensor.device.index)
        alloc = next((a for a in self.allocations if a.device == tensor.device.index and a.base == base),
                     None)
        if alloc is None:
            alloc = Allocation(command, base, tensor.device.index)
            yield from alloc.register()
            alloc.session = self.session
            self.allocations.append(alloc)
        alloc.tensors.append(tensor)
        return Registration(alloc, tensor)

    def unregister(self, reg: Registration) -> Steps:
        """Ends a registration made by register(); the region goes with the last in its allocation."""
        if not isinstance(reg, Registration):
            raise InvalidArgument(f"unregister() takes what register() returned, not {type(reg).__name__}")
        alloc = reg.allocation
        i = next((i for i, t in enumerate(alloc.tensors) if t is reg.tensor), None)
        if i is not None:
            del alloc.tensors[i]
            if not alloc.tensors and alloc in self.allocations:
                self.allocations.remove(alloc)
                if alloc.session == self.session:
                    yield {"unregister": {"region": alloc.id}}
        reg.tensor = None


def remote_message(what: str, target: str) -> str:
    return (f"{what} needs the server on this host: target {target!r} is neither a unix: socket nor "
            f"a loopback address (the server takes regions only from same-host peers); use "
            f"transport='inline'")


# ---- the CUDA driver, for IPC handles --------------------------------------------------------

class _CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


_driver: Any = None
_CUDA_ERROR_OUT_OF_MEMORY = 2


def _cuda() -> Any:
    """libcuda, loaded once (the driver is there wherever torch sees a GPU)."""
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise local_failure(e, f"no CUDA driver: libcuda.so.1 cannot be loaded ({e})") from e
        u64, p = ctypes.c_uint64, ctypes.POINTER
        for name, args in (("cuInit", [ctypes.c_uint]), ("cuDeviceGet", [p(ctypes.c_int), ctypes.c_int]),
                           ("cuDeviceGetUuid_v2", [p(_CUuuid), ctypes.c_int]),
                           ("cuDevicePrimaryCtxRetain", [p(ctypes.c_void_p), ctypes.c_int]),
                           ("cuDevicePrimaryCtxRelease_v2", [ctypes.c_int]),
                           ("cuCtxPushCurrent_v2", [ctypes.c_void_p]),
                           ("cuCtxPopCurrent_v2", [p(ctypes.c_void_p)]),
                           ("cuMemGetAddressRange_v2", [p(u64), p(ctypes.c_size_t), u64]),
                           ("cuIpcGetMemHandle", [p(_CUipcMemHandle), u64]),
                           ("cuMemAlloc_v2", [p(u64), ctypes.c_size_t]), ("cuMemFree_v2", [u64]),
                           ("cuGetErrorName", [ctypes.c_int, p(ctypes.c_char_p)])):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int
        _driver = lib
    return _driver


def _check(rc: int, what: str) -> None:
    if rc:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(rc, ctypes.byref(name))
        hint = (" (torch's expandable segments allocate memory without IPC handles: unset "
                "expandable_segments in PYTORCH_CUDA_ALLOC_CONF)" if what == "cuIpcGetMemHandle" else "")
        code = "RESOURCE_EXHAUSTED" if rc == _CUDA_ERROR_OUT_OF_MEMORY else "FAILED_PRECONDITION"
        raise MoEError(code, f"{what}: {(name.value or b'?').decode()} ({rc}){hint}")


def _in_context(device: int, fn) -> Any:
    """fn() with the primary context of torch's device index `device` current (the driver API needs
    one; torch made it, so retaining it creates nothing)."""
    cu = _cuda()
    _check(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    _check(cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    _check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    try:
        _check(cu.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            return fn(cu, dev)
        finally:
            cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cu.cuDevicePrimaryCtxRelease_v2(dev)


def cuda_command(ptr: int, device: int) -> Tuple[Dict[str, Any], int]:
    """(the RegisterCudaRegion command for the whole allocation that holds device pointer ptr on
    torch's device index `device`: its IPC handle, size and GPU UUID; the allocation's base)."""
    def describe(cu, dev):
        base, size, handle, uuid = ctypes.c_uint64(), ctypes.c_size_t(), _CUipcMemHandle(), _CUuuid()
        _check(cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
               "cuMemGetAddressRange")
        _check(cu.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
        _check(cu.cuDeviceGetUuid_v2(ctypes.byref(uuid), dev), "cuDeviceGetUuid")
        b = bytes(uuid.bytes).hex()
        return ({"register_cuda": {"ipc_handle": bytes(handle.reserved), "device": device,
                                   "bytes": size.value, "offset": 0,
                                   "device_uuid": f"GPU-{b[:8]}-{b[8:12]}-{b[12:16]}-{b[16:20]}-{b[20:]}"}},
                base.value)

    return _in_context(device, describe)


class DeviceMemory:
    """Device memory of its own (cuMemAlloc), for torch through __cuda_array_interface__: torch
    keeps this object while a tensor over it lives, and the memory is freed with it."""

    def __init__(self, size: int, device: int):
        def alloc(cu, dev):
            p = ctypes.c_uint64()
            _check(cu.cuMemAlloc_v2(ctypes.byref(p), size), "cuMemAlloc")
            return p.value

        self.ptr, self.device = _in_context(device, alloc), device
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (self.ptr, False),
                                         "version": 2}

    def __del__(self):
        try:
            _in_context(self.device, lambda cu, dev: cu.cuMemFree_v2(self.ptr))
        except Exception:  # the interpreter is going: the process's end frees it
            pass
