"""torch tensors through MoEClient against the fake moed (conftest.py): CPU tensors in float32,
float16 and bfloat16 give torch tensors of the same dtype on the CPU, equal to the numpy path's;
CUDA tensors (where a GPU answers) give tensors on the same device; non-contiguous and
autograd tensors work; bf16 needs no ml_dtypes. Skipped as a whole where torch is not installed
(CI); the GPU machine and any machine with torch run it."""

import subprocess
import sys

import numpy as np
import pytest

import moed
from moed import _common, wire

torch = pytest.importorskip("torch")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def routing(T, device="cpu"):
    # torch routing tensors of other dtypes, converted by the client
    return dict(expert_ids=torch.zeros((T, 1), dtype=torch.int64, device=device),
                expert_weights=torch.ones((T, 1), dtype=torch.bfloat16, device=device))


def as_numpy(t):
    """A tensor's values as numpy (bf16 as its uint16 bits, numpy having no bfloat16)."""
    t = t.detach().cpu()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_in_torch_out_same_dtype_and_device_as_numpy(server, dtype, device):
    fake, target = server
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
    bf16 = dtype == torch.bfloat16
    with moed.MoEClient(target) as c:
        y = c.forward(0, x, **routing(6, device))
        y_np = c.forward(0, as_numpy(x), dtype="bf16" if bf16 else None, **routing(6))
        r = c.forward(0, x, return_info=True, copy=True, **routing(6, device))
    assert isinstance(y, torch.Tensor) and y.dtype == dtype and y.device == x.device and y.shape == x.shape
    assert torch.equal(y, x * 2)  # doubling is exact in every dtype
    np.testing.assert_array_equal(as_numpy(y), y_np)
    assert torch.equal(r.output, y) and r.output.device == x.device
    assert fake.last.hidden.dtype == {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}[dtype]


def test_cpu_output_is_memory_of_its_own():
    """A CPU output is writable memory the caller owns: an in-place op on it leaves the reply (an
    immutable bytes object) as it came; one copy out of the reply, copy=True or not."""
    x = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    call = _common.now(_common.prepare_forward(0, x, strategy="topk", transport="inline"))
    assert np.shares_memory(call.prepared.tensor["data"], x.numpy())  # written from x's own memory
    reply = wire.encode("moed.v1.ForwardResponse", {"output": {"dtype": 1, "shape": [4, 8], "data": x.numpy() * 3}})
    sent = bytes(bytearray(reply))  # an equal object of its own
    for copy in (False, True):
        call.copy = copy
        y = call.result(reply)
        assert torch.equal(y, x * 3)
        y += 1  # an in-place op: on the caller's memory
        assert reply == sent, f"copy={copy}: the output wrote into the reply's bytes"
        assert torch.equal(call.result(reply), x * 3)


def test_outputs_through_the_client_are_writable(server):
    fake, target = server
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    with moed.MoEClient(target) as c:
        y = c.forward(0, x, **routing(6))
        y.mul_(0.5)  # the caller's own memory: no warning, no effect on anything else
        assert torch.equal(y, x)
        ys = list(c.forward_stream([dict(layer=0, hidden=x, **routing(6))] * 2))
        ys[0].zero_()
        assert torch.equal(ys[1], x * 2)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_and_autograd_tensors(server, device):
    fake, target = server
    base = torch.randn(8, 12, device=device, requires_grad=True)
    x = base.t()[:, ::2]  # [12, 4], non-contiguous, part of a graph
    with moed.MoEClient(target) as c:
        y = c.forward(0, x, **routing(12, device))
    assert y.device == base.device and not y.requires_grad
    assert torch.equal(y, (x * 2).detach())


def test_stream_and_aio_take_torch(server):
    import asyncio

    fake, target = server
    xs = [torch.randn(3, 8).to(dt) for dt in DTYPES]
    reqs = [dict(layer=0, hidden=x, **routing(3)) for x in xs]
    with moed.MoEClient(target) as c:
        outs = list(c.forward_stream(reqs))

    async def main():
        async with moed.aio.MoEClient(target) as c:
            return [await c.forward(0, x, **routing(3)) for x in xs]

    for out in (outs, asyncio.run(main())):
        for y, x in zip(out, xs):
            assert y.dtype == x.dtype and torch.equal(y, x * 2)


def test_torch_bf16_needs_no_ml_dtypes(server):
    fake, target = server
    code = f"""
import sys
sys.modules["ml_dtypes"] = None  # importing it now fails
import torch, moed
x = torch.randn(4, 8).to(torch.bfloat16)
with moed.MoEClient("{target}") as c:
    y = c.forward(0, x, expert_ids=torch.zeros((4, 1), dtype=torch.int32), expert_weights=torch.ones((4, 1)))
assert y.dtype == torch.bfloat16 and torch.equal(y, x * 2)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
