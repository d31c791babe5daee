"""Bad input: every kind gets its exact status code and a message that says what was wrong, and
the daemon keeps answering other callers correctly meanwhile.

Every test here runs with good traffic from other clients in background threads (GoodTraffic),
each good reply checked against the numpy model; a bad request that disturbed anyone else's result,
or a daemon that fell over, fails the test. Malformed bytes go through a generic gRPC call with
no serializer, so the daemon's own decoder sees exactly what we send.
"""

import threading

import grpc
import numpy as np
import pytest

import oracle as O
from daemons import DaemonPool, log_of

SPEC = O.Spec(layers=2, d=64, ff=96, experts=8, topk=2, seed=21)
NO_ROUTER = O.Spec(layers=1, d=64, ff=96, experts=8, topk=2, router=0, dtype="f32", seed=22)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = DaemonPool(tmp_path_factory.mktemp("errors"))
    yield p
    p.close()


class GoodTraffic:
    """Threads that keep sending good, varied requests to a daemon (each thread its own channel)
    and check every reply against the numpy model, until stopped. Entering waits until each thread
    has had a good reply, so the traffic runs beside whatever the body does."""

    def __init__(self, daemon, spec, threads=3):
        self.daemon, self.spec = daemon, spec
        self.stop_flag = threading.Event()
        self.ok = 0
        self.failures = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(threads)]
        self.running = [threading.Event() for _ in range(threads)]

    def run(self, seed):
        rng = np.random.default_rng(1000 + seed)
        spec = self.spec
        with self.daemon.client(timeout=30) as c:
            while not self.stop_flag.is_set():
                T = int(rng.integers(1, 12))
                layer = int(rng.integers(0, spec.layers))
                dtype = ("f32", "f16", "bf16")[int(rng.integers(0, 3))]
                x, x64 = O.hidden(rng, T, spec.d, dtype)
                logits = rng.standard_normal((T, spec.experts)).astype(np.float32)
                try:
                    y = c.forward(layer, x, router_logits=logits, strategy="topk")
                    O.check(y, O.forward(x64, spec.layer(layer), O.gate(logits, "topk", spec), spec.act),
                            dtype, "good traffic")
                    with self.lock:
                        self.ok += 1
                    self.running[seed].set()
                except Exception as e:  # any failure of a good call is the finding
                    with self.lock:
                        self.failures.append(repr(e))

    def __enter__(self):
        for t in self.threads:
            t.start()
        for running in self.running:
            if not (running.wait(60) or self.failures):
                self.stop_flag.set()
                raise AssertionError("a traffic thread had no good reply in 60 s")
        return self

    def __exit__(self, *exc):
        self.stop_flag.set()
        for t in self.threads:
            t.join(60)
        if exc[0] is None:
            assert not self.failures, f"good requests failed beside the bad ones: {self.failures[:5]}"
            assert self.ok >= len(self.threads), f"only {self.ok} good replies: the traffic did not run"


def call(daemon, request):
    """Sends a ForwardRequest (or raw bytes); returns (status code, details)."""
    with daemon.channel() as ch:
        f = ch.unary_unary("/moed.v1.Moed/Forward")
        data = request if isinstance(request, bytes) else request.SerializeToString()
        try:
            f(data, timeout=30)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details()


def build(daemon, layer=0, T=3, dtype="f32", **kw):
    x, _ = O.hidden(np.random.default_rng(T), T, SPEC.d, dtype)
    with daemon.client() as c:
        return c.build_request(layer, x, **kw)


def ids_w(ids, w):
    return {"expert_ids": np.array(ids, np.int32), "expert_weights": np.array(w, np.float32)}


def mutate(req, f):
    f(req)
    return req


# (name, request maker(daemon), expected code, substrings the message must contain)
BAD = [
    ("id_out_of_range", lambda d: build(d, T=2, **ids_w([[0, 1], [2, 8]], [[.5, .5]] * 2)),
     INVALID, ["expert_ids[1][1] is out of range", "[0, 8)"]),
    ("id_negative", lambda d: build(d, T=2, **ids_w([[0, 1], [-2, 3]], [[.5, .5]] * 2)),
     INVALID, ["expert_ids[1][0] is out of range"]),
    ("id_minus_one_with_weight", lambda d: build(d, T=1, **ids_w([[-1, 3]], [[.5, .5]])),
     INVALID, ["expert_ids[0][0] marks padding", "weight 0"]),
    ("weight_nan", lambda d: build(d, T=2, **ids_w([[0, 1]] * 2, [[.5, .5], [.5, np.nan]])),
     INVALID, ["expert_weights[1][1] is not finite"]),
    ("weight_inf", lambda d: build(d, T=1, **ids_w([[0, 1]], [[np.inf, .5]])),
     INVALID, ["expert_weights[0][0] is not finite"]),
    ("weight_negative", lambda d: build(d, T=1, **ids_w([[0, 1]], [[.5, -.25]])),
     INVALID, ["expert_weights[0][1] is negative", ">= 0"]),
    ("ids_not_i32", lambda d: mutate(build(d, **ids_w([[0, 1]] * 3, [[.5, .5]] * 3)),
                                     lambda r: setattr(r.experts.expert_ids, "dtype", 1)),
     INVALID, ["expert_ids", "f32", "i32"]),
    ("weights_shape_differs", lambda d: mutate(build(d, **ids_w([[0, 1]] * 3, [[.5, .5]] * 3)),
                                               lambda r: r.experts.expert_weights.shape.__setitem__(
                                                   slice(None), [3, 1, 2])),
     INVALID, ["expert_weights", "[3, 1, 2]", "k = 2"]),
    ("ids_rows_not_T", lambda d: mutate(build(d, T=3, **ids_w([[0, 1]] * 3, [[.5, .5]] * 3)),
                                        lambda r: r.hidden.CopyFrom(build(d, T=4, strategy="topk").hidden)),
     INVALID, ["T = 4"]),
    ("hidden_wrong_width", lambda d: mutate(build(d, strategy="topk"),
                                            lambda r: r.hidden.shape.__setitem__(1, 32) or
                                            setattr(r.hidden, "data", r.hidden.data[:3 * 32 * 4])),
     INVALID, ["[3, 32]", "[T, 64]"]),
    ("hidden_3d", lambda d: mutate(build(d, strategy="topk"), lambda r: r.hidden.shape.append(1)),
     INVALID, ["[3, 64, 1]"]),
    ("hidden_i32", lambda d: mutate(build(d, strategy="topk"), lambda r: setattr(r.hidden, "dtype", 4)),
     INVALID, ["dtype i32", "F32, F16 or BF16"]),
    ("hidden_dtype_unset", lambda d: mutate(build(d, strategy="topk"), lambda r: setattr(r.hidden, "dtype", 0)),
     INVALID, ["dtype", "F32, F16 or BF16"]),
    ("hidden_dtype_unknown", lambda d: mutate(build(d, strategy="topk"), lambda r: setattr(r.hidden, "dtype", 77)),
     INVALID, ["77", "F32, F16 or BF16"]),
    ("data_short", lambda d: mutate(build(d, strategy="topk"),
                                    lambda r: setattr(r.hidden, "data", r.hidden.data[:-1])),
     INVALID, ["767", "768"]),
    ("data_long_bf16", lambda d: mutate(build(d, dtype="bf16", strategy="topk"),
                                        lambda r: setattr(r.hidden, "data", r.hidden.data + b"\0\0")),
     INVALID, ["386", "384"]),
    ("T_zero", lambda d: build(d, T=0, strategy="topk"), INVALID, ["T = 0"]),
    ("hidden_missing", lambda d: mutate(build(d, strategy="topk"), lambda r: r.ClearField("hidden")),
     INVALID, ["hidden is missing"]),
    ("no_routing", lambda d: mutate(build(d, strategy="topk"), lambda r: r.ClearField("server_router")),
     INVALID, ["no routing"]),
    ("logits_nan", lambda d: build(d, T=2, router_logits=np.array([[0.] * 8, [0.] * 7 + [np.nan]]),
                                   strategy="topk"),
     INVALID, ["logits[1][7] is not finite"]),
    ("logits_inf", lambda d: build(d, T=1, router_logits=np.array([[-np.inf] + [0.] * 7]), strategy="topk"),
     INVALID, ["logits[0][0] is not finite"]),
    ("logits_wrong_width", lambda d: build(d, router_logits=np.zeros((3, 7)), strategy="topk"),
     INVALID, ["[3, 7]", "num_experts = 8"]),
    ("unknown_layer", lambda d: build(d, layer=5, strategy="topk"),
     grpc.StatusCode.NOT_FOUND, ["layer 5", "0-1"]),
    ("unknown_strategy", lambda d: mutate(build(d, strategy="topk"),
                                          lambda r: setattr(r.server_router.gating, "strategy", 9)),
     INVALID, ["strategy 9", "topk"]),
    ("unknown_renormalize", lambda d: mutate(build(d, strategy="topk"),
                                             lambda r: setattr(r.server_router.gating, "renormalize", 7)),
     INVALID, ["renormalize = 7"]),
    ("top_k_too_big", lambda d: build(d, strategy="topk", top_k=9), INVALID, ["top_k = 9", "[1, 8]"]),
    ("top_k_uint32_max", lambda d: build(d, strategy="topk", top_k=2**32 - 1), INVALID,
     ["top_k = 4294967295 is out of range"]),
    ("top_k_too_big_quadratic", lambda d: build(d, router_logits=np.zeros((3, 8)), strategy="quadratic",
                                                top_k=100), INVALID, ["top_k = 100"]),
    ("threshold_above_1", lambda d: build(d, strategy="sigmoid", threshold=1.5), INVALID, ["threshold = 1.5", "(0, 1)"]),
    ("threshold_1", lambda d: build(d, strategy="sigmoid", threshold=1.0), INVALID, ["threshold = 1", "(0, 1)"]),
    ("threshold_negative", lambda d: build(d, strategy="sigmoid", threshold=-0.5), INVALID, ["threshold = -0.5"]),
    ("threshold_nan", lambda d: build(d, strategy="sigmoid", threshold=float("nan")), INVALID, ["threshold = nan"]),
    ("batch_gating_with_expert_choice",
     lambda d: mutate(build(d, **ids_w([[0, 1]] * 3, [[.5, .5]] * 3)), lambda r: setattr(r.batch_gating, "k_batch", 2)),
     INVALID, ["batch_gating", "logits"]),
    ("batch_gating_without_routing",
     lambda d: mutate(build(d, batch_gating=True, k_batch=2), lambda r: r.ClearField("server_router")),
     INVALID, ["no routing"]),
    ("k_batch_too_big", lambda d: build(d, router_logits=np.zeros((3, 8)), batch_gating=True, k_batch=9),
     INVALID, ["k_batch = 9", "1..8"]),
    ("request_id_too_long", lambda d: build(d, strategy="topk", request_id="r" * 129), INVALID, ["129", "128"]),
]


@pytest.fixture(scope="module")
def busy(pool):
    """The daemon under test, with good traffic running through every test of this module."""
    d = pool.synthetic(SPEC)
    with GoodTraffic(d, SPEC):
        yield d
    assert d.proc.poll() is None, f"moed died:\n{log_of(d)}"


@pytest.mark.parametrize("name,make,code,words", BAD, ids=[b[0] for b in BAD])
def test_bad_request(busy, name, make, code, words):
    got, msg = call(busy, make(busy))
    assert got == code, f"{name}: {got} ({msg!r}), expected {code}"
    for w in words:
        assert w in msg, f"{name}: the message {msg!r} does not say {w!r}"


def test_top_k_zero_means_the_layers(busy):
    """top_k 0 is not an error: it is the layer's num_experts_per_tok."""
    x, x64 = O.hidden(np.random.default_rng(3), 5, SPEC.d, "f32")
    logits = np.random.default_rng(4).standard_normal((5, 8)).astype(np.float32)
    with busy.client(timeout=30) as c:
        y = c.forward(0, x, router_logits=logits, strategy="topk", top_k=0)
    O.check(y, O.forward(x64, SPEC.layer(0), O.gate(logits, "topk", SPEC, top_k=SPEC.topk), SPEC.act), "f32")


def test_truncated_bytes(busy):
    good = build(busy, T=2, dtype="bf16", **ids_w([[0, 1]] * 2, [[.5, .5]] * 2)).SerializeToString()
    assert call(busy, good)[0] == grpc.StatusCode.OK
    for cut in range(0, len(good) - 1, 3):
        code, msg = call(busy, good[:cut])
        assert code == INVALID, f"cut at {cut}: {code} {msg!r}"
        assert msg, f"cut at {cut}: no message"


def test_random_bytes(busy):
    rng = np.random.default_rng(77)
    for i in range(150):
        data = rng.bytes(int(rng.integers(1, 400)))
        code, msg = call(busy, data)
        assert code == INVALID, f"random buffer {i} ({data[:16].hex()}...): {code} {msg!r}"
        assert msg


def test_mutated_bytes_never_crash(busy):
    """Bytes of a valid request with one byte changed: some are still valid requests (a changed
    hidden value), the rest must be refused as bad input, never an internal error."""
    good = build(busy, T=2, **ids_w([[0, 1]] * 2, [[.5, .5]] * 2)).SerializeToString()
    rng = np.random.default_rng(78)
    allowed = {grpc.StatusCode.OK, INVALID, grpc.StatusCode.NOT_FOUND}
    seen = set()
    for _ in range(200):
        b = bytearray(good)
        b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
        code, msg = call(busy, bytes(b))
        assert code in allowed, f"{code} {msg!r} for {bytes(b).hex()}"
        seen.add(code)
    assert INVALID in seen


def test_server_router_without_router(pool):
    d = pool.synthetic(NO_ROUTER)
    with GoodTraffic(d, NO_ROUTER, threads=2):
        for strategy in ("model", "topk"):
            code, msg = call(d, build(d, strategy=strategy))
            assert code == INVALID
            assert "no router weights" in msg and "layer 0" in msg
        # the same layer with client logits works
        x, x64 = O.hidden(np.random.default_rng(1), 3, NO_ROUTER.d, "f32")
        logits = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
        with d.client(timeout=30) as c:
            assert not c.info().layer(0).has_router
            y = c.forward(0, x, router_logits=logits, strategy="topk")
        O.check(y, O.forward(x64, NO_ROUTER.layer(0), O.gate(logits, "topk", NO_ROUTER), "swiglu"), "f32")


def test_batch_gating_without_logits_uses_server_router(busy):
    """Batch gating needs logits: with the server router it takes the router's."""
    x, x64 = O.hidden(np.random.default_rng(6), 4, SPEC.d, "f32")
    with busy.client(timeout=30) as c:
        r = c.forward(1, x, batch_gating=True, k_batch=3, return_info=True)
    w = SPEC.layer(1)
    S, route = O.batch_gate(O.router_logits(x64, w).astype(np.float32), 3)
    # The background traffic asks for no batch gating, so it is never merged with this request.
    assert list(r.expert_set) == S
    O.check(r.output, O.forward(x64, w, route, SPEC.act), "f32")


SMALL_LIMIT = 8192


def oversize_request(d, T):
    return build(d, T=T, router_logits=np.zeros((T, 8)), strategy="topk")


def test_over_size_message(pool):
    """Over --max-message-bytes: RESOURCE_EXHAUSTED with a message naming the limit."""
    d = pool.synthetic(SPEC, "--max-message-bytes", SMALL_LIMIT)
    with GoodTraffic(d, SPEC, threads=2):
        req = oversize_request(d, 31)
        size = req.ByteSize()
        assert SMALL_LIMIT < size < 2 * SMALL_LIMIT
        code, msg = call(d, req)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(size) in msg and str(SMALL_LIMIT) in msg and "--max-message-bytes" in msg
        code, msg = call(d, oversize_request(d, 200))  # far over: the code at least must be right
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, msg
        assert call(d, oversize_request(d, 20))[0] == grpc.StatusCode.OK


@pytest.mark.xfail(strict=True, reason="gap: a request over twice --max-message-bytes is refused by gRPC "
                                       "core's own receive limit (set to 2x the flag in server/rpc.c), "
                                       "whose text 'Received message larger than max (N vs. M)' neither "
                                       "names the flag nor moed's limit (M is twice it)")
def test_far_over_size_message_names_the_flag(pool):
    d = pool.synthetic(SPEC, "--max-message-bytes", SMALL_LIMIT)
    code, msg = call(d, oversize_request(d, 200))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-message-bytes" in msg, msg


def test_too_many_tokens(pool):
    d = pool.synthetic(SPEC, "--max-batch-tokens", 16)
    code, msg = call(d, oversize_request(d, 17))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "T = 17" in msg and "--max-batch-tokens" in msg and "16" in msg
    assert call(d, oversize_request(d, 16))[0] == grpc.StatusCode.OK


def test_other_methods_reject_garbage(busy):
    with busy.channel() as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/grpc.health.v1.Health/Check")(b"\xff\xff\xff", timeout=10)
        assert e.value.code() == INVALID and e.value.details()
        # GetModelRequest has no fields: whatever it carries, the reply is the model (or a refusal).
        try:
            reply = ch.unary_unary("/moed.v1.Moed/GetModel")(b"\xff\xff\xff", timeout=10)
            assert b"layers=2" in reply
        except grpc.RpcError as e:
            assert e.code() == INVALID
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/moed.v1.Moed/NoSuchMethod")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
