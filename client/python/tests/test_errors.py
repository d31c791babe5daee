"""What the client raises itself, against the fake moed (conftest.py): every public call given
arguments it cannot send raises MoEError INVALID_ARGUMENT, its code set, naming what is wrong (and
it is a ValueError and a TypeError too, as these calls raised before), sends nothing and leaves the
client working; errors the client finds in replies carry their status code too; failures of local
resources (shared memory, the CUDA driver) are MoEErrors with the status that fits. Tensors here
are numpy; test_torch.py has torch's."""

import asyncio
import ctypes
import math

import grpc
import numpy as np
import pytest

import moed
from moed import _common, regions, wire
from moed.types import MoEError

X = np.ones((2, 8), np.float32)
IDS, W = np.zeros((2, 1), np.int32), np.ones((2, 1), np.float32)
GOOD = dict(layer=0, hidden=X, expert_ids=IDS, expert_weights=W)


class OnDevice:
    """A DLPack tensor that says it lies on a GPU."""

    def __dlpack__(self, **kw):
        raise AssertionError("never read")

    def __dlpack_device__(self):
        return (2, 0)


def forward_args(fleet=False):
    """Bad arguments of forward(), as (name, args, kwargs); each must be refused before sending (a
    fleet refuses the cuda transport whatever the tensor: test_fleet.py)."""
    def fwd(name, *args, **kw):
        return name, args or (0, X), {"expert_ids": IDS, "expert_weights": W, **kw}

    return [
        ("layer -1", (-1, X), {}), ("layer str", ("a", X), {}), ("layer 2**40", (2 ** 40, X), {}),
        ("layer float", (1.5, X), {}),
        ("hidden None", (0, None), {}), ("hidden str", (0, "abc"), {}), ("hidden object", (0, object()), {}),
        ("hidden 3-d", (0, np.ones((1, 2, 8), np.float32)), {}), ("hidden f64", (0, np.ones((2, 8))), {}),
        ("hidden u16", (0, np.ones((2, 8), np.uint16)), {}), ("hidden on a GPU", (0, OnDevice()), {}),
        fwd("dtype unknown", dtype="zz"), fwd("dtype mismatch", dtype="f16"), fwd("dtype int", dtype=5),
        ("ids alone", (0, X), {"expert_ids": IDS}), ("ids and logits", (0, X),
                                                    {"expert_ids": IDS, "expert_weights": W, "router_logits": W}),
        fwd("ids 1-d", expert_ids=np.zeros(2)), fwd("ids of T 3", expert_ids=np.zeros((3, 1))),
        fwd("ids of strings", expert_ids=np.array([["a"], ["b"]])), fwd("ids object", expert_ids=object()),
        fwd("weights shape", expert_weights=np.ones((2, 2))),
        ("logits of T 3", (0, X), {"router_logits": np.zeros((3, 4))}),
        ("strategy unknown", (0, X), {"strategy": "bogus"}), ("strategy list", (0, X), {"strategy": []}),
        ("top_k -1", (0, X), {"top_k": -1}), ("top_k str", (0, X), {"top_k": "2"}),
        ("k_batch -1", (0, X), {"batch_gating": True, "k_batch": -1}),
        ("threshold str", (0, X), {"strategy": "sigmoid", "threshold": "x"}),
        ("renormalize 3", (0, X), {"renormalize": 3}),
        fwd("request_id int", request_id=5), fwd("request_id surrogate", request_id="\ud800"),
        fwd("transport unknown", transport="x"), fwd("transport int", transport=5),
        *([] if fleet else [fwd("transport cuda on the host", transport="cuda")]),
        fwd("out shape", out=np.zeros((3, 8), np.float32)), fwd("out list", out=[1]),
        fwd("out read-only", out=np.broadcast_to(np.float32(0), (2, 8))),
        fwd("timeout str", timeout="x"), fwd("timeout nan", timeout=math.nan),
    ]


def stream_args():
    """Bad arguments of forward_stream(), as (name, requests, kwargs)."""
    return [("not iterable", 5, {}), ("not a dict", [X], {}), ("unknown key", [dict(GOOD, foo=1)], {}),
            ("no hidden", [dict(layer=0)], {}), ("item timeout", [dict(GOOD, timeout=1)], {}),
            ("item f64", [dict(layer=0, hidden=np.ones((2, 8)))], {}),
            ("timeout str", [GOOD], {"timeout": "x"}), ("transport unknown", [GOOD], {"transport": "x"})]


def other_calls(c):
    """Bad arguments of the other calls, as (name, call)."""
    return [("health service int", lambda: c.health(5)), ("health timeout", lambda: c.health(timeout="x")),
            ("info timeout", lambda: c.info(timeout="x")), ("regions timeout", lambda: c.regions(timeout="x")),
            ("register numpy", lambda: c.register(X)), ("register int", lambda: c.register(5)),
            ("unregister None", lambda: c.unregister(None)), ("unregister str", lambda: c.unregister("x"))]


def constructors(target):
    """Bad arguments of the constructors, as (name, call)."""
    C = moed.MoEClient
    return [("target int", lambda: C(5)), ("target list", lambda: C([target, target])),
            ("timeout", lambda: C(target, timeout="x")), ("token", lambda: C(target, token=5)),
            ("options int", lambda: C(target, options=5)), ("options pair", lambda: C(target, options=[("a",)])),
            ("keepalive 5", lambda: C(target, keepalive=5)), ("keepalive str", lambda: C(target, keepalive="x")),
            ("retry", lambda: C(target, retry=5)), ("credentials", lambda: C(target, credentials="x")),
            ("transport", lambda: C(target, transport="x")),
            ("connect []", lambda: moed.connect([])), ("connect int", lambda: moed.connect(5)),
            ("fleet []", lambda: moed.FleetClient([])), ("fleet int", lambda: moed.FleetClient(5)),
            ("fleet transport", lambda: moed.FleetClient([target, target], transport="x")),
            ("fleet timeout", lambda: moed.FleetClient([target, target], timeout="x")),
            ("retry attempts 0", lambda: moed.RetryPolicy(max_attempts=0)),
            ("retry attempts str", lambda: moed.RetryPolicy(max_attempts="x")),
            ("retry backoff 0", lambda: moed.RetryPolicy(initial_backoff=0)),
            ("retry multiplier", lambda: moed.RetryPolicy(multiplier=0.5)),
            ("build_request", lambda: moed.MoEClient.build_request(None, 0, None))]


def wrong(e):
    """What is wrong with e as what a bad argument must raise; None if nothing."""
    if e is None:
        return "nothing was raised"
    if not isinstance(e, MoEError):
        return f"{type(e).__name__}: {e}"
    if e.code != grpc.StatusCode.INVALID_ARGUMENT or e.code_name != "INVALID_ARGUMENT":
        return f"{e.code_name} (code {e.code}): {e.message}"
    if not (isinstance(e, ValueError) and isinstance(e, TypeError)):  # what these calls raised before
        return "neither a ValueError nor a TypeError"
    if not (e.message and str(e).startswith("INVALID_ARGUMENT: ")):
        return f"no message: {e}"
    return None


def refused(name, e):
    """e is what a bad argument must raise."""
    assert wrong(e) is None, f"{name}: {wrong(e)}"


class Walk:
    """The calls of a walk that raised something else than they must (all of them, listed)."""

    def __init__(self):
        self.bad = []

    def check(self, name, e):
        if wrong(e) is not None:
            self.bad.append(f"{name}: {wrong(e)}")

    def done(self):
        assert not self.bad, f"{len(self.bad)} wrong:\n" + "\n".join(self.bad)


def raised(call):
    """What call() raised (None: nothing; what it made is closed)."""
    try:
        made = call()
    except BaseException as e:  # noqa: B902: what it raised is the subject
        return e
    if isinstance(made, moed.Client):
        made.close()
    return None


@pytest.mark.parametrize("fleet", [False, True], ids=["one", "fleet"])
def test_bad_arguments_are_invalid_argument_everywhere(server, fleet):
    fake, target = server
    walk = Walk()
    with moed.connect([target, target] if fleet else target, timeout=60) as c:
        for name, args, kw in forward_args(fleet):
            walk.check(name, raised(lambda: c.forward(*args, **kw)))
        for name, requests, kw in stream_args():
            walk.check(f"stream {name}", raised(lambda: list(c.forward_stream(requests, **kw))))
        if not fleet:  # a fleet refuses these whatever the arguments (test_fleet.py)
            for name, call in other_calls(c):
                walk.check(name, raised(call))
        walk.done()
        assert fake.calls == 0, "a request was sent"
        assert c.health() == "SERVING"
        np.testing.assert_array_equal(c.forward(0, X, expert_ids=IDS, expert_weights=W), X * 2)
    remote = moed.MoEClient("192.0.2.1:50051")  # TEST-NET: never connected to here
    refused("shm to a remote target", raised(lambda: remote.forward(0, X, transport="shm")))
    remote.close()


def test_bad_constructor_arguments_are_invalid_argument(server):
    _, target = server
    walk = Walk()
    for name, call in constructors(target):
        walk.check(name, raised(call))
    walk.done()


@pytest.mark.parametrize("fleet", [False, True], ids=["one", "fleet"])
def test_the_aio_clients_refuse_the_same(server, fleet):
    fake, target = server

    async def main():
        walk = Walk()
        async with moed.aio.connect([target, target] if fleet else target, timeout=60) as c:
            for name, args, kw in forward_args(fleet):
                walk.check(name, await araised(c.forward(*args, **kw)))
            for name, requests, kw in stream_args():
                walk.check(f"stream {name}", await araised(alist(c.forward_stream(requests, **kw))))
            if not fleet:
                for name, call in other_calls(c):
                    walk.check(name, await araised(call()))
            walk.done()
            assert await c.health() == "SERVING"

    async def alist(agen):
        return [y async for y in agen]

    async def araised(coro):
        try:
            await coro
        except BaseException as e:  # noqa: B902
            return e
        return None

    asyncio.run(main())
    assert fake.calls == 0


def test_errors_the_client_finds_carry_their_code():
    call = _common.now(_common.prepare_forward(0, X, strategy="topk", transport="inline"))
    e = raised(lambda: call.result(b""))
    assert isinstance(e, MoEError) and e.code == grpc.StatusCode.INTERNAL and e.code_name == "INTERNAL"
    e = raised(lambda: _common.model_info(b"\x12\x09"))
    assert e.code == grpc.StatusCode.INTERNAL
    for name in ("UNAVAILABLE", "FAILED_PRECONDITION", "DEADLINE_EXCEEDED"):
        assert MoEError(name, "m").code == grpc.StatusCode[name]


def test_local_resources_that_fail_are_moed_errors(monkeypatch):
    e = raised(lambda: regions.HostChunk(1 << 50))  # more than any /dev/shm holds
    assert isinstance(e, MoEError) and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e
    assert "/dev/shm" in e.message and isinstance(e.__cause__, OSError)

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(regions, "_driver", None)
    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    e = raised(lambda: regions.cuda_command(1 << 30, 0))
    assert isinstance(e, MoEError) and e.code == grpc.StatusCode.FAILED_PRECONDITION, e
    assert "libcuda.so.1" in e.message


def test_the_wire_encoder_names_what_it_refuses():
    e = raised(lambda: wire.encode("moed.v1.ForwardRequest", {"layer": "3"}))
    refused("layer", e)
    assert "layer" in e.message
