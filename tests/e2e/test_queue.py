"""Requests while they wait in the scheduler's queue, asserted from the server's side.

The proto promises that DEADLINE_EXCEEDED and CANCELLED are honoured while a request is queued, and
that a full queue answers UNAVAILABLE. What a client sees proves little: gRPC ends a call at its
deadline on the client whatever the server does. So these tests read the server's own counters
(/metrics: requests by code, launches and what they held, the queue gauge) and the timings of the
neighbours' replies: a request that expired or was cancelled in the queue must leave it at once, be
counted under that code, and never be computed, not even in the next launch.

The daemons hold requests deterministically: a merge window of a minute that only
--min-batch-requests can cut short, so a lone request stays queued until a neighbour comes.
"""

import threading
import time

import grpc
import numpy as np
import pytest

import oracle as O
from conftest import DEFAULT_SPEC
from moed import MoEError
from moed._proto.moed.v1 import moed_pb2_grpc
from prod import ANY_METRICS_PORT, server_counts, wait_counts

SPEC = O.Spec.parse(DEFAULT_SPEC)
HOLD = ("--threads", "1", "--max-delay-us", "60000000")


def held_daemon(daemon, min_requests, *flags):
    """A daemon whose queue launches only once `min_requests` requests wait (or after a minute)."""
    return daemon("--synthetic", DEFAULT_SPEC, *HOLD, "--min-batch-requests", str(min_requests),
                  *ANY_METRICS_PORT, *flags)


def case(T, seed, layer=0):
    """(request, its float64 reference) routed by the client."""
    rng = np.random.default_rng(seed)
    x, x64 = O.hidden(rng, T, SPEC.d, "bf16")
    ids = np.stack([rng.permutation(SPEC.experts)[:2] for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1, (T, 2)).astype(np.float32)
    return x, ids, w, O.forward(x64, SPEC.layer(layer), O.choice_route(ids, w), SPEC.act)


def forward_bytes(d, T, seed, layer=0):
    x, ids, w, _ = case(T, seed, layer)
    with d.client() as c:
        return c.build_request(layer, x, expert_ids=ids, expert_weights=w).SerializeToString()


def run_neighbours(d, sizes, seed=100):
    """Sends one request per size at once (each from its own client) and returns their
    ForwardResults, each checked against the oracle."""
    out, errors = {}, []
    barrier = threading.Barrier(len(sizes))

    def call(i):
        x, ids, w, ref = case(sizes[i], seed + i)
        try:
            with d.client(timeout=60) as c:
                c.health()
                barrier.wait(30)
                r = c.forward(0, x, expert_ids=ids, expert_weights=w, return_info=True)
            O.check(r.output, ref, "bf16", f"neighbour {i}")
            out[i] = r
        except Exception as e:  # reported below: the test fails on it
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(out) == len(sizes), errors
    return [out[i] for i in range(len(sizes))]


def ran(d, before, sizes):
    """The neighbours of `sizes` ran as one launch of exactly them: their replies and the server's
    counters say so (an expired or cancelled request that had stayed queued would have joined it)."""
    results = run_neighbours(d, sizes)
    for r in results:
        assert (r.timings.batch_requests, r.timings.batch_tokens) == (len(sizes), sum(sizes)), r.timings
    return results


def test_expired_in_the_queue_is_never_computed_and_counts_as_deadline_exceeded(daemon):
    d = held_daemon(daemon, 2)
    port = d.metrics_port
    # The request must reach the queue before its deadline, or it proves nothing: the test sees it
    # queued before the call ends, and doubles the deadline of another try where it did not.
    for timeout in (0.5, 1, 2, 4, 8, 16):
        before = server_counts(port)
        with d.channel() as ch:
            fut = ch.unary_unary("/moed.v1.Moed/Forward").future(forward_bytes(d, 3, 1), timeout=timeout)
            seen = False
            while not fut.done() and not seen:
                seen = server_counts(port)["queued"] == 1
                time.sleep(0.005)
            with pytest.raises(grpc.RpcError) as e:
                fut.result()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if seen:
            break
        deadline = time.monotonic() + 60
        while server_counts(port)["queued"]:  # a late one expires there too before the next try
            assert time.monotonic() < deadline, "a request stayed queued past its deadline"
            time.sleep(0.05)
    else:
        pytest.fail("a request with a 16 s deadline never reached the queue")
    # The server's side: it left the queue at its deadline (the window still had a minute to go),
    # counted as expired, and no launch ran.
    wait_counts(port, before, {"Forward:DEADLINE_EXCEEDED": 1, "queued": 0}, timeout=10)
    # Nor does it run later: the next two requests launch together, just the two of them.
    mid = server_counts(port)
    ran(d, mid, [2, 5])
    wait_counts(port, mid, {"Forward:OK": 2, "launches": 1, "launched_requests": 2,
                            "launched_tokens": 7, "queue_waits": 2})


def cancel_unary(d, port, before):
    """A Forward that waits in the queue until its caller cancels it."""
    with d.channel() as ch:
        fut = ch.unary_unary("/moed.v1.Moed/Forward").future(forward_bytes(d, 3, 2), timeout=60)
        wait_counts(port, before, {"queued": 1})
        fut.cancel()
        assert fut.cancelled()
    return {"Forward:CANCELLED": 1}


def cancel_stream(d, port, before):
    """A ForwardStream whose two requests wait in the queue until its caller cancels the stream."""
    reqs = [forward_bytes(d, 3, 3), forward_bytes(d, 1, 4)]
    with d.channel() as ch:
        stream = ch.stream_stream("/moed.v1.Moed/ForwardStream")(iter(reqs), timeout=60)
        wait_counts(port, before, {"queued": 2})
        stream.cancel()
        with pytest.raises(grpc.RpcError) as e:
            next(stream)
        assert e.value.code() == grpc.StatusCode.CANCELLED
    return {"ForwardStream:CANCELLED": 2}


@pytest.mark.parametrize("cancel", (cancel_unary, cancel_stream), ids=("Forward", "ForwardStream"))
def test_cancelled_in_the_queue_is_never_computed_and_counts_as_cancelled(daemon, cancel):
    # A stream's two requests must not be enough to launch: the window waits for a third.
    d = held_daemon(daemon, 3)
    port = d.metrics_port
    before = server_counts(port)
    counted = cancel(d, port, before)
    wait_counts(port, before, {**counted, "queued": 0}, timeout=10)
    mid = server_counts(port)
    ran(d, mid, [2, 5, 1])
    wait_counts(port, mid, {"Forward:OK": 3, "launches": 1, "launched_requests": 3,
                            "launched_tokens": 8, "queue_waits": 3})


def test_full_queue_answers_unavailable_and_keeps_serving(daemon):
    """--max-queue-requests 3 with three requests held (two for layer 0, one for layer 1: neither
    queue has the three a launch waits for): the fourth is refused UNAVAILABLE naming the flag,
    counted so, and never queued; once the three are gone the server serves as before."""
    d = held_daemon(daemon, 3, "--max-queue-requests", "3")
    port = d.metrics_port
    before = server_counts(port)
    with d.channel() as ch:
        forward = ch.unary_unary("/moed.v1.Moed/Forward")
        held = [forward.future(forward_bytes(d, 2, 10 + i, layer=i // 2), timeout=60)
                for i in range(3)]
        wait_counts(port, before, {"queued": 3})
        x, ids, w, _ = case(4, 12)
        with d.client(timeout=30, retry=None) as c:  # one attempt: one refusal to count
            with pytest.raises(MoEError) as e:
                c.forward(0, x, expert_ids=ids, expert_weights=w)
        assert e.value.code_name == "UNAVAILABLE", e.value
        assert "queue is full" in e.value.message and "--max-queue-requests" in e.value.message
        wait_counts(port, before, {"Forward:UNAVAILABLE": 1, "queued": 3})
        for f in held:
            f.cancel()
    wait_counts(port, before, {"Forward:UNAVAILABLE": 1, "Forward:CANCELLED": 3, "queued": 0})
    mid = server_counts(port)
    ran(d, mid, [1, 2, 3])
    wait_counts(port, mid, {"Forward:OK": 3, "launches": 1, "launched_requests": 3,
                            "launched_tokens": 6, "queue_waits": 3})
