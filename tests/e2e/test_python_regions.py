"""The Python client's region transports (docs/regions.md) against real daemons on the CPU backend: the
shm transport gives, bit for bit, what inline gives, for every routing kind (expert choice,
router logits under each gating strategy, the server's router, batch gating) in f32, f16 and bf16,
from the blocking and the asyncio client and through forward_stream; auto takes shared memory for
a loopback or unix: target (from 64 KiB of hidden; a smaller one goes inline and opens no session)
and inline for another target or a daemon with --regions off, and shm
with a remote target is refused by the client; closing the client releases its regions on the
server (ListRegions empty, moed_regions 0), and so does SIGKILLing the client's process, leaving no
shared-memory name behind; the arena grows for a big call, outputs held stay valid while later
calls reuse the arena, and the emptied regions behind the newest are let go; timed-out calls give
their regions back (never piling up toward --max-regions) and auto says why it goes inline; a
restarted server gets a new session on its own. No torch needed (tests/gpu/test_python_torch.py has the torch and
CUDA cases).
"""

import asyncio
import concurrent.futures
import glob
import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import oracle as O
from conftest import DEFAULT_SPEC, Daemon
from prod import ANY_METRICS_PORT, scrape

import moed
from moed import MoEError, aio, regions, transport

SPEC = O.Spec.parse(DEFAULT_SPEC)
DTYPES = ("f32", "f16", "bf16")
KINDS = ("experts", "topk", "sigmoid", "sparsemax", "quadratic", "pioneer", "server", "batch")
BIG_SPEC = "layers=1,d=256,ff=32,experts=4,topk=2,act=swiglu,dtype=bf16,seed=3"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A daemon with metrics on, shared by the module: (daemon, metrics port)."""
    d = Daemon(["--synthetic", DEFAULT_SPEC, "--threads", "2", *ANY_METRICS_PORT],
               tmp_path_factory.mktemp("moed") / "moed.log")
    yield d, d.metrics_port
    assert d.stop() == 0, d.log()


def request(kind, rng, T, dtype, layer=0):
    """forward()'s keyword arguments for one request of routing `kind`."""
    x, _ = O.hidden(rng, T, SPEC.d, dtype)
    kw = dict(layer=layer, hidden=x)
    if kind == "experts":
        kw["expert_ids"] = np.stack([rng.permutation(SPEC.experts)[:2] for _ in range(T)]).astype(np.int32)
        kw["expert_weights"] = rng.uniform(0, 1, (T, 2)).astype(np.float32)
    elif kind == "server":
        kw.update(strategy="topk", top_k=2)
    else:
        kw["router_logits"] = (2 * rng.standard_normal((T, SPEC.experts))).astype(np.float32)
        kw.update(strategy="topk" if kind == "batch" else kind, top_k=2)
        if kind == "batch":
            kw.update(batch_gating=True, k_batch=3)
    return kw


def bits(y):
    return np.ascontiguousarray(y).view(np.uint8)


def host_regions(port):
    m = scrape(port)
    return m.get("moed_regions", kind="host"), m.get("moed_region_bytes", kind="host")


def wait_released(c, port, timeout=10):
    """Waits until the server lists no region of the (anonymous) principal; (regions, metrics)."""
    deadline = time.monotonic() + timeout
    while True:
        left, metric = c.regions(), host_regions(port)
        if (not left and metric == (0, 0)) or time.monotonic() > deadline:
            return left, metric
        time.sleep(0.05)


def released(d, port):
    """Waits until the module's daemon holds no region: what earlier clients registered is released
    after they close, asynchronously, and counting starts from nothing."""
    with d.client(timeout=30) as c:
        assert wait_released(c, port) == ([], (0, 0))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shm_is_inline_bit_for_bit(served, dtype, kind):
    d, _ = served
    rng = np.random.default_rng([7, DTYPES.index(dtype), KINDS.index(kind)])
    with d.client(timeout=30) as c:
        for T in (1, 5, 33):
            kw = request(kind, rng, T, dtype, layer=T % 2)
            inline = c.forward(**kw, transport="inline", return_info=True)
            shm = c.forward(**kw, transport="shm", return_info=True)
            assert shm.output.dtype == kw["hidden"].dtype and not shm.output.flags.writeable
            assert np.array_equal(bits(shm.output), bits(inline.output)), (dtype, kind, T)
            assert np.array_equal(shm.expert_set, inline.expert_set)
        assert c.transport_calls == {"inline": 3, "shm": 3, "cuda": 0}
        assert [r.kind for r in c.regions()] == ["host"]


def test_aio_and_streams_through_shm_are_inline(served):
    d, port = served
    rng = np.random.default_rng(8)
    items = [request(KINDS[i % len(KINDS)], rng, 3 + i, DTYPES[i % 3], layer=i % 2) for i in range(12)]
    with d.client(timeout=30) as c:
        want = [bits(c.forward(**kw, transport="inline")) for kw in items]
        got = [bits(y) for y in c.forward_stream(items, transport="shm")]
        assert c.transport_calls["shm"] == len(items)

    async def run():
        async with aio.MoEClient(d.address, timeout=30, transport="shm") as c:
            one = [bits(await c.forward(**kw)) for kw in items]
            streamed = [bits(y) async for y in c.forward_stream(items)]
            both = await asyncio.gather(*(c.forward(**kw) for kw in items))  # concurrent slots
            assert c.transport_calls["shm"] == 3 * len(items)
            assert [r.kind for r in await c.regions()] == ["host"]
            return one, streamed, [bits(y) for y in both]

    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    released(d, port)  # the blocking client's region, listed below otherwise
    for outputs in asyncio.run(run()):
        assert all(np.array_equal(a, b) for a, b in zip(outputs, want))


def non_loopback_address():
    """An address of this host that is not loopback (None if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


BIG_T = transport.SHM_MIN_BYTES // (SPEC.d * 4)  # f32 rows: auto's least for shared memory


def test_torch_cpu_outputs_view_the_arena_and_are_writable(served):
    """A torch CPU output through shm is the slot the server wrote (no copy out), writable (torch
    has no read-only tensors), and the slot stays the output's: later calls leave it alone. Skipped
    without torch (CI's venv); the GPU machine has it."""
    torch = pytest.importorskip("torch")
    d, _ = served
    kw = request("experts", np.random.default_rng(9), 6, "f32")
    x = torch.from_numpy(kw.pop("hidden"))
    with d.client(timeout=30) as c:
        want = c.forward(hidden=x, **kw, transport="inline")
        y = c.forward(hidden=x, **kw, transport="shm")
        chunk = c._session.regions.host.chunks[-1]
        start = np.frombuffer(chunk.map, np.uint8).ctypes.data
        assert start <= y.data_ptr() < start + chunk.size, "the output was copied out of the arena"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y.add_(1)
        again = c.forward(hidden=x, **kw, transport="shm")
        assert torch.equal(again, want) and torch.equal(y, want + 1)


def test_auto_takes_shm_on_this_host_and_inline_otherwise(served, daemon, tmp_path):
    d, port = served
    rng = np.random.default_rng(9)
    kw, small = request("experts", rng, BIG_T, "f32"), request("experts", rng, BIG_T - 1, "f32")
    want = d.client().forward(**kw, transport="inline")
    path = tmp_path / "moed.sock"
    daemon("--synthetic", DEFAULT_SPEC, listen=f"unix:{path}")
    for target in (d.address, f"localhost:{d.port}", f"ipv4:127.0.0.1:{d.port}", f"unix:{path}"):
        if not target.startswith("unix:"):
            released(d, port)
        with moed.MoEClient(target, timeout=30) as c:
            c.forward(**small)  # under SHM_MIN_BYTES: inline, and no session for it
            assert c._session.call is None and c.transport_calls["inline"] == 1
            assert np.array_equal(c.forward(**kw), want)
            assert c.transport_calls == {"inline": 1, "shm": 1, "cuda": 0}, target
            assert len(c.regions()) == 1
            if target == d.address:
                assert host_regions(port)[0] == 1
    ip = non_loopback_address()
    if ip is None:
        pytest.skip("this host has no address but loopback: the remote case needs one")
    anywhere = daemon("--synthetic", DEFAULT_SPEC, listen="0.0.0.0:0")
    with moed.MoEClient(f"{ip}:{anywhere.port}", timeout=30) as c:
        assert np.array_equal(c.forward(**kw), want)
        assert c.transport_calls == {"inline": 1, "shm": 0, "cuda": 0}
        assert c._session.call is None  # no region session was even opened
        with pytest.raises(ValueError, match="needs the server on this host"):
            c.forward(**kw, transport="shm")


def test_regions_off_means_inline_for_auto_and_the_servers_refusal_for_shm(daemon):
    d = daemon("--synthetic", DEFAULT_SPEC, "--regions", "off")
    rng = np.random.default_rng(10)
    kw = request("server", rng, 2 * BIG_T, "bf16")
    with d.client(timeout=30) as c:
        assert c.info().regions.mode == "off"
        y = c.forward(**kw)
        assert c.transport_calls == {"inline": 1, "shm": 0, "cuda": 0}
        with pytest.raises(MoEError) as e:
            c.forward(**kw, transport="shm")
        assert e.value.code_name == "FAILED_PRECONDITION" and "region" in e.value.message
        assert np.array_equal(bits(c.forward(**kw, transport="inline")), bits(y))


def test_remote_shm_is_refused_by_the_client():
    x = np.zeros((2, SPEC.d), np.float32)
    for target in ("192.0.2.1:50051", "dns:///moed.example:50051", "[2001:db8::1]:50051"):
        assert not regions.local_target(target)
        with moed.MoEClient(target, transport="shm") as c:
            with pytest.raises(ValueError, match="needs the server on this host"):
                c.forward(0, x, strategy="topk")
    for target in ("127.0.0.1:1", "localhost:1", "[::1]:1", "ipv6:[::1]:1", "unix:/x", "dns:///localhost:1"):
        assert regions.local_target(target), target


def test_closing_the_client_releases_its_regions(served):
    d, port = served
    rng = np.random.default_rng(11)
    kw = request("experts", rng, 6, "f16")
    released(d, port)
    with d.client(timeout=30, transport="shm") as c:
        y = c.forward(**kw)
        listed = c.regions()
        assert len(listed) == 1 and listed[0].ready and listed[0].kind == "host"
        assert host_regions(port) == (1, listed[0].bytes)
    with d.client(timeout=30) as other:
        assert wait_released(other, port) == ([], (0, 0))
    assert np.array_equal(bits(y), bits(d.client().forward(**kw, transport="inline")))  # still valid


KILLED = """
import sys, numpy as np, moed
c = moed.MoEClient(sys.argv[1], timeout=30)
y = c.forward(0, np.ones((4, int(sys.argv[2])), np.float32), strategy="topk", top_k=2)
big = c.forward(0, np.ones((4096, int(sys.argv[2])), np.float32), strategy="topk", top_k=2)
print(len(c.regions()), flush=True)
sys.stdin.read()
"""


def test_a_killed_client_leaves_no_region_and_no_name(served):
    d, port = served
    p = subprocess.Popen([sys.executable, "-c", KILLED, d.address, str(SPEC.d)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert int(p.stdout.readline()) >= 1
        assert host_regions(port)[0] >= 1
        assert not glob.glob(f"/dev/shm/moed-py-{p.pid}-*")  # unlinked once the server mapped it
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        with d.client(timeout=30) as c:
            assert wait_released(c, port) == ([], (0, 0))
            assert c.health() == "SERVING"
    finally:
        if p.poll() is None:
            p.kill()


def test_the_arena_grows_for_a_big_call_and_outputs_stay_valid(daemon):
    d = daemon("--synthetic", BIG_SPEC, "--threads", "2")
    spec = O.Spec.parse(BIG_SPEC)
    rng = np.random.default_rng(12)

    def call(T):
        x = rng.standard_normal((T, spec.d)).astype(np.float32)
        return x, dict(layer=0, hidden=x, strategy="topk", top_k=2)

    with d.client(timeout=60, transport="shm") as c:
        arena = c._session.regions.host
        _, kw = call(8)
        c.forward(**kw)
        assert arena.sizes() == [regions.HOST_MIN]
        _, kw = call(8192)  # 8 MiB of f32: over the first region
        big = c.forward(**kw)
        assert np.array_equal(bits(big), bits(c.forward(**kw, transport="inline")))
        assert max(arena.sizes()) >= 8192 * spec.d * 4 and len(c.regions()) == len(arena.sizes())
        # Consecutive calls reuse the arena; the outputs kept stay as they were computed.
        kept = []
        for i in range(40):
            _, kw = call(int(rng.integers(1, 1500)))
            y = c.forward(**kw)
            if i % 3 == 0:
                kept.append((y, kw))
        for y, kw in kept:
            assert np.array_equal(bits(y), bits(c.forward(**kw, transport="inline")))
        sizes = arena.sizes()
        del big, kept, y
        _, kw = call(8)
        c.forward(**kw, copy=True)  # copied out: its slot is free at once
        c.forward(**kw, copy=True)
        # Everything but the newest region was emptied and let go; nothing grew meanwhile.
        assert arena.sizes() == sizes[-1:] and len(c.regions()) == 1
        assert arena.chunks[0].pool.used == 0


# Lone requests wait in the queue for a minute: a call with a short deadline times out there.
HELD = ("--threads", "1", "--max-delay-us", "60000000", "--min-batch-requests", "2")


def shm_maps(pid):
    """The Python client's shared-memory objects that process `pid` has mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return {w for line in f for w in line.split() if w.startswith("/dev/shm/moed-py-")}


def wait_unheld(c, timeout=60):
    """Waits until no request of the server holds a region of the principal."""
    deadline = time.monotonic() + timeout
    while any(r.requests for r in c.regions()):
        assert time.monotonic() < deadline, c.regions()
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ("shm", "auto"))
def test_timed_out_calls_give_their_regions_back(daemon, caplog, mode):
    """A call that times out retires its region (the server may still write there); once the server
    let go of the request, the next call unregisters it and unmaps it. So timeouts never pile up
    regions: the principal stays at one, far from --max-regions, and neither process keeps more
    than one object of shared memory mapped."""
    d = daemon("--synthetic", DEFAULT_SPEC, *HELD, "--max-regions", "3")
    kw = request("experts", np.random.default_rng(14), BIG_T, "f32")
    names = set()  # of every region this client registered

    def mapped():
        """(regions listed, this client's objects mapped here, objects the server maps)."""
        listed = c.regions()
        names.update("/dev/shm" + r.name for r in listed)
        return len(listed), len(shm_maps(os.getpid()) & names), len(shm_maps(d.proc.pid))

    with d.client(timeout=60, transport=mode) as c:
        for i in range(8):
            with pytest.raises(MoEError) as e:
                c.forward(**kw, timeout=0.5)  # alone in the queue: held there past its deadline
            assert e.value.code_name == "DEADLINE_EXCEEDED", (i, e.value)
            wait_unheld(c)
            assert mapped() == (1, 1, 1), i
        assert c.transport_calls == {"inline": 0, "shm": 8, "cuda": 0}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two: the queue launches them
            y = pool.submit(c.forward, **kw)
            ref = pool.submit(c.forward, **kw, transport="inline")
            assert np.array_equal(bits(y.result(60)), bits(ref.result(60)))
        assert c.transport_calls == {"inline": 1, "shm": 9, "cuda": 0}
        assert mapped() == (1, 1, 1)
    assert not [r for r in caplog.records if r.name.startswith("moed")]


def test_auto_says_why_it_goes_inline(daemon, caplog):
    """auto falls back to inline when no region can be had, with a warning naming the reason (once,
    until regions work again), never silently."""
    d = daemon("--synthetic", DEFAULT_SPEC, "--max-region-bytes", "1048576")  # under HOST_MIN
    kw = request("experts", np.random.default_rng(15), BIG_T, "f32")
    with d.client(timeout=30) as c, caplog.at_level("INFO", logger="moed"):
        y = c.forward(**kw)
        c.forward(**kw)
        assert c.transport_calls == {"inline": 2, "shm": 0, "cuda": 0}
        assert np.array_equal(bits(y), bits(c.forward(**kw, transport="inline")))
    warned = [r for r in caplog.records if r.name.startswith("moed")]
    assert len(warned) == 1 and warned[0].levelname == "WARNING", warned
    assert "inline" in warned[0].getMessage() and "--max-region-bytes" in warned[0].getMessage()


def test_a_restarted_server_gets_a_new_session(daemon, tmp_path):
    path = tmp_path / "moed.sock"
    rng = np.random.default_rng(13)
    kw = request("experts", rng, 5, "bf16")
    first = daemon("--synthetic", DEFAULT_SPEC, listen=f"unix:{path}")
    with moed.MoEClient(f"unix:{path}", timeout=30, transport="shm") as c:
        y = c.forward(**kw, copy=True)
        assert first.stop() == 0
        daemon("--synthetic", DEFAULT_SPEC, listen=f"unix:{path}")
        assert np.array_equal(bits(c.forward(**kw)), bits(y))
        assert c.transport_calls["shm"] == 2 and len(c.regions()) == 1
