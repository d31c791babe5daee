"""The Python client with torch on the GPU machine: torch CPU and CUDA tensors in f32,
f16 and bf16 through every transport (inline, shm, cuda, auto) give, bit for bit, what the numpy
inline path gives, from the blocking and the asyncio client and through forward_stream; the CUDA
path goes through a CUDA region with no tensor byte in the messages (the daemon's
moed_request_bytes_total and moed_response_bytes_total grow by less than one hidden state over all
the calls, ListRegions lists a CUDA region on the device); tensors the caller registered are read
and written in place (no device arena is ever made); the input is produced by GPU work queued just
before the call (the client must wait for it); timed-out calls give their device regions back
once the server holds them no more; forward_stream() items made on a side stream are read after
its work; an out= on the device is written once, with no device tensor made on the way; a
CPU-backend daemon refuses the cuda transport with its FAILED_PRECONDITION and auto falls back to
shared memory there.

    python3 tests/gpu/test_python_torch.py --bin .gpu/bin     (tools/gpu/run-on-gpu.sh python)

Exits 77 (skipped) when torch, a GPU or the daemon is missing; otherwise pytest's status.
"""

import asyncio
import concurrent.futures
import os
import sys
import time

if __name__ == "__main__":  # the stage's entry: the daemon's folder, or exit 77
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "gpu"))
    from torch_stage import run_stage

    run_stage(__file__)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no GPU answered torch.cuda.is_available()", allow_module_level=True)

from conftest import Daemon, free_port  # noqa: E402
from prod import scrape  # noqa: E402

from moed import MoEError, aio  # noqa: E402
from moed.transport import SHM_MIN_BYTES  # noqa: E402

SPEC = "layers=2,d=256,ff=128,experts=8,topk=2,act=swiglu,dtype=bf16,seed=5"
D = 256
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TRANSPORTS = ["inline", "shm", "cuda", "auto"]


@pytest.fixture(scope="module")
def cuda_daemon(tmp_path_factory):
    port = free_port()
    d = Daemon(["--backend", "cuda", "--synthetic", SPEC, "--metrics-listen", f"127.0.0.1:{port}"],
               tmp_path_factory.mktemp("moed") / "moed-cuda.log")
    d.metrics = port
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def cpu_daemon(tmp_path_factory):
    d = Daemon(["--backend", "cpu", "--synthetic", SPEC], tmp_path_factory.mktemp("moed") / "moed-cpu.log")
    yield d
    assert d.stop() == 0, d.log()


def as_numpy(t):
    """(numpy array of t's values, forward()'s dtype argument): bf16 as its uint16 bits."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), "bf16"
    return t.numpy(), None


def raw(y):
    """The bytes of an output, numpy or torch on any device."""
    if isinstance(y, torch.Tensor):
        y = as_numpy(y)[0]
    return np.ascontiguousarray(y).view(np.uint8)


def routing(T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)]).to(torch.int32)
    return dict(expert_ids=ids.numpy(), expert_weights=torch.rand(T, 2, generator=g).numpy())


def hidden(T, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, D, generator=g).to(dtype).to(device)


def reference(c, x, kw):
    """What the numpy inline path gives for x."""
    a, dtype = as_numpy(x)
    return raw(c.forward(0, a, dtype=dtype, transport="inline", **kw))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_device_and_transport_is_the_numpy_inline_path(cuda_daemon, dtype, device, transport):
    if transport == "cuda" and device == "cpu":
        pytest.skip("the cuda transport takes CUDA tensors (a host tensor is refused: checked below)")
    with cuda_daemon.client(timeout=60) as c:
        for T, seed in ((1, 1), (8, 2), (300, 3)):
            x, kw = hidden(T, dtype, device, seed), routing(T, seed)
            took = transport
            if transport == "auto":  # CUDA regions on this daemon; shared memory from 64 KiB
                took = "cuda" if device == "cuda" else "shm" if x.nbytes >= SHM_MIN_BYTES else "inline"
            before = c.transport_calls[took]
            y = c.forward(0, x, **kw, transport=transport)
            assert c.transport_calls[took] == before + 1, (transport, took)
            assert isinstance(y, torch.Tensor) and y.dtype == dtype and y.device == x.device
            assert np.array_equal(raw(y), reference(c, x, kw)), (dtype, device, transport, T)
        if transport == "cuda":
            with pytest.raises(ValueError, match="CUDA tensors"):
                c.forward(0, x.cpu(), **kw, transport="cuda")


def test_cuda_calls_carry_no_tensor_bytes_and_use_a_cuda_region(cuda_daemon):
    T, calls = 512, 20
    before = scrape(cuda_daemon.metrics)
    with cuda_daemon.client(timeout=60) as c:
        x = hidden(T, torch.bfloat16, "cuda", 7)
        ys = [c.forward(0, x, strategy="topk", top_k=2, transport="cuda") for _ in range(calls)]
        listed = c.regions()
        assert [r.kind for r in listed] == ["cuda"] and listed[0].ready
    after = scrape(cuda_daemon.metrics)
    sent = after.get("moed_request_bytes_total") - before.get("moed_request_bytes_total")
    got = after.get("moed_response_bytes_total") - before.get("moed_response_bytes_total")
    hidden_bytes = T * D * 2
    assert sent < hidden_bytes and got < hidden_bytes, (sent, got, hidden_bytes)
    assert all(torch.equal(y, ys[0]) for y in ys)


def test_registered_tensors_are_read_and_written_in_place(cuda_daemon):
    with cuda_daemon.client(timeout=60) as c:
        for dtype in DTYPES:
            # over torch's 10 MiB: an allocation of its own, as a caller's arena would be
            buf = torch.empty(12 << 20, dtype=torch.uint8, device="cuda")
            n = 64 * D * buf.new_empty(0, dtype=dtype).element_size()
            x, out = (buf[i * n:(i + 1) * n].view(dtype).view(64, D) for i in (0, 1))
            reg = c.register(buf)
            # hidden made by GPU work queued just before the call: the client must wait for it
            big = torch.randn(2048, 2048, device="cuda")
            x.copy_(((big @ big)[:64, :D] * 0).to(dtype) + hidden(64, dtype, "cuda", 8))
            kw = routing(64, 8)
            y = c.forward(0, x, **kw, out=out)
            assert y is out and not c._session.regions.devices  # no device arena was needed
            assert np.array_equal(raw(out), reference(c, x, kw))
            assert [r.kind for r in c.regions()] == ["cuda"]
            c.unregister(reg)
            assert c.regions() == []
        x = hidden(64, torch.float16, "cuda", 9)
        reg = c.register(x)
        y = c.forward(0, x, **routing(64, 9))  # hidden registered, the output through the arena
        assert np.array_equal(raw(y), reference(c, x, routing(64, 9)))
        assert len(c._session.regions.devices[0].chunks) == 1 and len(c.regions()) == 2
        assert c.transport_calls["cuda"] == len(DTYPES) + 1


def test_streams_and_aio_with_cuda_tensors(cuda_daemon):
    items = [dict(layer=i % 2, hidden=hidden(3 + i, DTYPES[i % 3], "cuda", 20 + i), **routing(3 + i, 20 + i))
             for i in range(9)]
    with cuda_daemon.client(timeout=60) as c:
        want = [raw(c.forward(**kw, transport="inline")) for kw in items]
        got = [raw(y) for y in c.forward_stream(items)]
        assert c.transport_calls["cuda"] == len(items)

    async def run():
        async with aio.MoEClient(cuda_daemon.address, timeout=60) as c:
            one = [raw(await c.forward(**kw)) for kw in items]
            streamed = [raw(y) async for y in c.forward_stream(items)]
            assert c.transport_calls["cuda"] == 2 * len(items)
            return one, streamed

    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    for outputs in asyncio.run(run()):
        assert all(np.array_equal(a, b) for a, b in zip(outputs, want))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stream_items_are_read_after_the_callers_stream(cuda_daemon, transport):
    """Items written on a side stream that the caller iterates forward_stream() on are read after
    that stream's work: the GPU is kept busy on it before each is written, so a read ordered on any
    other stream (gRPC's request thread has the default one) would see zeros."""
    side = torch.cuda.Stream()
    with cuda_daemon.client(timeout=60) as c:
        values = [hidden(8, torch.bfloat16, "cuda", 60 + i) for i in range(4)]
        kws = [routing(8, 60 + i) for i in range(4)]
        want = [reference(c, v, kw) for v, kw in zip(values, kws)]
        xs = [torch.zeros_like(v) for v in values]
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            for x, v in zip(xs, values):
                torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU time on the side stream
                x.copy_(v)
            items = [dict(layer=0, hidden=x, transport=transport, **kw) for x, kw in zip(xs, kws)]
            got = [raw(y) for y in c.forward_stream(items)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want)), transport


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_a_cuda_out_is_written_once(cuda_daemon, transport):
    """out= on the device takes the output straight from the host bytes (the reply, or the shared
    memory arena): no device tensor is made on the way (torch's allocator serves nothing during
    the call), and out holds what the numpy path gives."""
    with cuda_daemon.client(timeout=60) as c:
        x, kw = hidden(64, torch.bfloat16, "cuda", 50), routing(64, 50)
        want = reference(c, x, kw)
        out = torch.empty_like(x)
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        y = c.forward(0, x, out=out, transport=transport, **kw)
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, "a device tensor was made"
        assert y is out and np.array_equal(raw(out), want)


def test_timed_out_cuda_calls_give_their_device_regions_back(tmp_path):
    """A timed-out call retires its device region; once the server lists no request on it, the
    next call that needs a region unregisters it and frees the memory (the event confirms none held
    it): the principal stays at one region, far from --max-regions."""
    held = ["--threads", "1", "--max-delay-us", "60000000", "--min-batch-requests", "2"]
    d = Daemon(["--backend", "cuda", "--synthetic", SPEC, *held, "--max-regions", "3"], tmp_path / "moed.log")
    try:
        x, kw = hidden(64, torch.bfloat16, "cuda", 40), routing(64, 40)
        with d.client(timeout=60, transport="cuda") as c:
            arena = None
            for i in range(6):
                with pytest.raises(MoEError) as e:
                    c.forward(0, x, **kw, timeout=0.5)  # alone in the queue past its deadline
                assert e.value.code_name == "DEADLINE_EXCEEDED", (i, e.value)
                deadline = time.monotonic() + 60  # a hang guard
                while any(r.requests for r in c.regions()):  # until the server lets go of it
                    assert time.monotonic() < deadline, c.regions()
                    time.sleep(0.05)
                arena = c._session.regions.devices[0]
                assert len(c.regions()) == 1 and len(arena.retired) == 1 and arena.held == [], i
            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two: the queue launches them
                y = pool.submit(c.forward, 0, x, **kw)
                ref = pool.submit(reference, c, x, kw)
                assert np.array_equal(raw(y.result(60)), ref.result(60))
            assert len(c.regions()) == 1 and arena.retired == [] and arena.held == []
    finally:
        assert d.stop() == 0, d.log()


def test_a_cpu_daemon_refuses_the_cuda_transport_and_auto_takes_shm(cpu_daemon):
    x = hidden(256, torch.bfloat16, "cuda", 30)  # 128 KiB: over auto's least for shared memory
    kw = routing(256, 30)
    with cpu_daemon.client(timeout=60) as c:
        with pytest.raises(MoEError) as e:
            c.forward(0, x, **kw, transport="cuda")
        assert e.value.code_name == "FAILED_PRECONDITION" and "cpu backend" in e.value.message
        y = c.forward(0, x, **kw)
        assert c.transport_calls["shm"] == 1 and y.device == x.device
        assert np.array_equal(raw(y), reference(c, x, kw))
