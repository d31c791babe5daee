"""The doorbell from Python with torch CUDA tensors, on the GPU machine against a CUDA daemon:
RingClient's stream-ordered calls (and torch.ops.moed.forward) on a side stream, their input made
by GPU work queued just before, give bit for bit what the host path gives for the same values; a
torch.cuda.graph capturing several layers' calls, replayed with new inputs, gives the eager calls'
outputs; every CUDA region the client registers is a segment of torch's caching allocator (the
client allocates no device memory of its own); after torch.cuda.empty_cache() new segments are
registered and the old ones let go, outputs still right; forward_async's handle waits on the
stream; a call with host tensors while capturing is refused FAILED_PRECONDITION.

    python3 tests/gpu/test_ring_torch.py --bin .gpu/bin     (tools/gpu/run-on-gpu.sh torch-op)

Exits 77 (skipped) when torch, a GPU or the daemon is missing; otherwise pytest's status.
"""

import os
import sys

if __name__ == "__main__":  # the stage's entry: the daemon's folder, or exit 77
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "gpu"))
    from torch_stage import run_stage

    run_stage(__file__)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no GPU answered torch.cuda.is_available()", allow_module_level=True)

from conftest import Daemon  # noqa: E402

import moed.torch_op  # noqa: E402,F401  (registers torch.ops.moed)
from moed import MoEClient, MoEError, RingClient  # noqa: E402

SPEC = "layers=4,d=256,ff=128,experts=8,topk=2,act=swiglu,dtype=bf16,seed=5"
D, E, LAYERS = 256, 8, 4
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def cuda_daemon(tmp_path_factory):
    d = Daemon(["--backend", "cuda", "--max-regions", "1024", "--synthetic", SPEC], tmp_path_factory.mktemp("moed") / "moed.log")
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def rc(cuda_daemon):
    torch.cuda.init()
    with RingClient(cuda_daemon.address) as c:
        yield c
        torch.cuda.synchronize()


def inputs(T, k, dtype, seed):
    """hidden [T, D] and the router's choices, made on the GPU as a model's router leaves them:
    topk_ids int64 (padding -1 with weight 0 in every third row), topk_weights of hidden's dtype."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, generator=g, device="cuda").to(dtype)
    logits = torch.randn(T, E, generator=g, device="cuda")
    w, ids = torch.topk(torch.softmax(logits, -1), k)
    if k > 1:
        ids[::3, -1], w[::3, -1] = -1, 0
    return x, ids, w.to(dtype)


def host_path(rc, layer, x, ids, w):
    """The same call with CPU tensors (the host ring)."""
    return rc.forward(layer, x.cpu(), ids.cpu(), w.cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_side_stream_calls_equal_the_host_path(rc, dtype):
    side = torch.cuda.Stream()
    for T, k in ((1, 1), (8, 2), (300, 4)):
        x0, ids0, w0 = inputs(T, k, dtype, seed=T)
        want = host_path(rc, 1, x0, ids0, w0)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # the input is made by GPU work queued right before the call, on the same stream
            x = torch.empty_like(x0).copy_(x0)
            y = rc.forward(1, x, ids0, w0)
            z = torch.ops.moed.forward(x, ids0, w0, 1, rc.handle)
            out = torch.empty_like(x)
            torch.ops.moed.forward_out(x, ids0, w0, 1, rc.handle, out)
        side.synchronize()
        for got in (y, z, out):
            assert got.device == x0.device and got.dtype == dtype
            assert torch.equal(got.cpu(), want), (dtype, T, k)
    rc.check()


def test_regions_are_the_allocators_segments(cuda_daemon, rc):
    """Every CUDA region the client registered is one segment of torch's caching allocator, address
    and size: nothing of the client's own in device memory; the daemon lists as many. (Before any
    graph or empty_cache: no segment has been freed yet.)"""
    for T in (1, 100, 2000):
        x, ids, w = inputs(T, 2, torch.float16, seed=T)
        rc.forward(0, x, ids, w)
    torch.cuda.synchronize()
    segments = {(s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()}
    mine = {(s.base, s.size) for s in rc._segments.values()}
    assert mine and mine <= segments, (mine, segments)
    with MoEClient(cuda_daemon.address) as c:
        cuda_regions = [r for r in c.regions() if r.kind == "cuda"]
    assert len(cuda_regions) == len(mine)


def test_forward_async_waits_on_the_stream(rc):
    x, ids, w = inputs(64, 2, torch.bfloat16, seed=3)
    want = host_path(rc, 0, x, ids, w)
    h = rc.forward_async(0, x, ids, w)
    y = h.wait(timeout=120)
    assert h.done() and torch.equal(y.cpu(), want)


def test_graph_of_layers_replays_the_eager_calls(rc):
    """Four layers chained (each layer's output the next one's input), captured once, replayed with
    three new inputs: each replay equals the eager chain; the captured slots are released after."""
    T, k = 16, 2

    def chain(x, ids, w):
        h = x
        for layer in range(LAYERS):
            h = torch.ops.moed.forward(h, ids, w, layer, rc.handle) + h
        return h

    x_s, ids_s, w_s = inputs(T, k, torch.bfloat16, seed=40)
    chain(x_s, ids_s, w_s)  # warm-up: every segment registered, the rings pinned
    torch.cuda.synchronize()
    held = rc.captured
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y_s = chain(x_s, ids_s, w_s)
    assert rc.captured == held + LAYERS
    for seed in (41, 42, 43):
        x, ids, w = inputs(T, k, torch.bfloat16, seed)
        want = chain(x, ids, w)
        x_s.copy_(x), ids_s.copy_(ids), w_s.copy_(w)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_s, want), seed
    rc.check()
    del g
    torch.cuda.synchronize()
    assert rc.release_captured() == held + LAYERS and rc.captured == 0


def test_new_segments_after_empty_cache(cuda_daemon, rc):
    """hidden carved from a 64 MiB tensor (a segment of its own); after torch.cuda.empty_cache()
    the same carving lies in a new segment (maybe at the same address): it is registered anew, the
    stale region let go, and outputs stay right."""
    T, nbytes = 512, 64 << 20

    def carved(x):
        blob = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        return blob[:x.numel() * 4].view(torch.float32).view(x.shape).copy_(x)

    for round_ in range(3):
        x0, ids, w = inputs(T, 2, torch.float32, seed=round_)
        want = host_path(rc, 2, x0, ids, w)
        x = carved(x0)
        assert torch.equal(rc.forward(2, x, ids, w).cpu(), want)
        torch.cuda.synchronize()
        old = {(s.base, s.buffer_id) for s in rc._segments.values()}
        del x
        torch.cuda.empty_cache()
        x = carved(x0)
        assert torch.equal(rc.forward(2, x, ids, w).cpu(), want), round_
        torch.cuda.synchronize()
        seg = [s for s in rc._segments.values() if s.base <= x.data_ptr() < s.base + s.size]
        assert len(seg) == 1 and (seg[0].base, seg[0].buffer_id) not in old, round_
        del x
    live = {(s["address"], s["total_size"]) for s in torch.cuda.memory_snapshot()}
    mine = {(s.base, s.size) for s in rc._segments.values()}
    assert mine <= live, (mine, live)  # no stale registration kept
    with MoEClient(cuda_daemon.address) as c:
        assert len([r for r in c.regions() if r.kind == "cuda"]) == len(mine)


def test_host_tensors_while_capturing_are_refused(rc):
    x, ids, w = (t.cpu() for t in inputs(4, 2, torch.float32, seed=9))
    g = torch.cuda.CUDAGraph()
    with pytest.raises(MoEError) as e:
        with torch.cuda.graph(g):
            rc.forward(0, x, ids, w)
    assert e.value.code_name == "FAILED_PRECONDITION" and "captured" in e.value.message, e.value
