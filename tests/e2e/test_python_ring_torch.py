"""torch.ops.moed.forward and forward_out (moed.torch_op) with torch CPU tensors, on the CPU backend:
the schemas, outputs equal to the gRPC path's bit for bit, out= written in place, the fake
implementations (FakeTensorMode, opcheck), the op as a leaf of torch.compile(fullgraph=True) with
the eager and aot_eager backends, and a host call while a stream captures refused by name.
Skipped without torch (CI's .venv has none); the GPU machine's tests/gpu/test_ring_torch.py covers
CUDA tensors, streams and CUDA graphs.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_python_ring import SPEC, grpc_output, inputs, served  # noqa: E402,F401  (served: the fixture)

import moed.torch_op  # noqa: E402,F401  (registers the ops)
from moed import MoEError, RingClient  # noqa: E402

TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def rc(served):  # noqa: F811
    with RingClient(served.address) as c:
        yield c


def tensors(T, k, dtype, seed=1):
    x, ids, w = inputs(np.random.default_rng(seed), T, k)
    return (x, ids, w), (torch.from_numpy(x).to(TORCH[dtype]), torch.from_numpy(ids), torch.from_numpy(w))


def test_schemas():
    assert str(torch.ops.moed.forward.default._schema) == (
        "moed::forward(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int layer, int client) -> Tensor")
    assert str(torch.ops.moed.forward_out.default._schema) == (
        "moed::forward_out(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int layer, int client, "
        "Tensor(a!) out) -> ()")


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_op_equals_grpc(served, rc, dtype):  # noqa: F811
    for T, k in ((1, 1), (9, 2), (130, 4)):
        _, (x, ids, w) = tensors(T, k, dtype, seed=T)
        want = grpc_output(served.address, 1, x, ids, w)
        y = torch.ops.moed.forward(x, ids, w, 1, rc.handle)
        assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(y, want)
        y.add_(1)  # the output is the caller's own memory
        out = torch.empty_like(x)
        assert torch.ops.moed.forward_out(x, ids, w, 1, rc.handle, out) is None
        assert torch.equal(out, want)
        assert torch.equal(rc.forward(1, x, ids, w), want)


def test_fake_implementations(rc):
    _, (x, ids, w) = tensors(5, 2, "bf16")
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fx, fids, fw = (mode.from_tensor(t) for t in (x, ids, w))
        y = torch.ops.moed.forward(fx, fids, fw, 0, rc.handle)
        assert y.shape == x.shape and y.dtype == x.dtype
        torch.ops.moed.forward_out(fx, fids, fw, 0, rc.handle, torch.empty_like(fx))
    got = torch.library.opcheck(torch.ops.moed.forward.default, (x, ids, w, 0, rc.handle),
                                test_utils=("test_schema", "test_faketensor"))
    assert set(got.values()) == {"SUCCESS"}, got


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_leaf(served, rc, backend):  # noqa: F811
    """Under torch.compile(fullgraph=True) the op is one node of the graph (no graph break), and
    the compiled function gives the eager one's output."""
    _, (x, ids, w) = tensors(6, 2, "f32")
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm.code)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    def block(x, ids, w):
        h = x * 2
        y = torch.ops.moed.forward(h, ids, w, 0, rc.handle)
        out = torch.empty_like(h)
        torch.ops.moed.forward_out(h, ids, w, 1, rc.handle, out)
        return y + out

    torch._dynamo.reset()
    got = torch.compile(block, backend=recording, fullgraph=True)(x, ids, w)
    assert torch.equal(got, block(x, ids, w))
    assert len(graphs) == 1 and "moed.forward" in graphs[0] and "moed.forward_out" in graphs[0], graphs


def test_host_call_while_capturing_is_refused(rc, monkeypatch):
    """A call with CPU tensors while the current stream captures raises FAILED_PRECONDITION naming
    the way out, before anything is rung (the capture is simulated: CPU torch cannot capture)."""
    _, (x, ids, w) = tensors(2, 2, "f32")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(MoEError) as e:
        torch.ops.moed.forward(x, ids, w, 0, rc.handle)
    assert e.value.code_name == "FAILED_PRECONDITION" and "captured" in e.value.message, e.value
    monkeypatch.undo()
    torch.ops.moed.forward(x, ids, w, 0, rc.handle)


def test_unknown_client_handle(rc):
    _, (x, ids, w) = tensors(2, 2, "f32")
    with pytest.raises(MoEError) as e:
        torch.ops.moed.forward(x, ids, w, 0, rc.handle + 1000)
    assert e.value.code_name == "INVALID_ARGUMENT" and "RingClient.handle" in e.value.message
