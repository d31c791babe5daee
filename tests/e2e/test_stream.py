"""ForwardStream under stress: replies in request order when launches finish out of order, the
stream's window of open requests (reading pauses when it is full and resumes as replies go), and
the drain reaching an open stream.

Each test sets the scheduler up so that what it asserts really happens, and checks from the
server's side (/metrics, and the timings in the replies) that it did: a request that finishes
before an earlier one, a queue that holds exactly the stream's window.
"""

import queue
import re
import signal
import time

import grpc
import numpy as np
import pytest

import oracle as O
from conftest import DEFAULT_SPEC, ROOT
from daemons import Worker, log_of, wait_exit
from moed._proto.moed.v1 import moed_pb2_grpc
from prod import get, metrics_flags, server_counts, wait_counts

SPEC = O.Spec.parse(DEFAULT_SPEC)
# Requests one stream may have open (server/forward.c); the window test sends more than twice it.
STREAM_WINDOW = int(re.search(r"#define STREAM_WINDOW (\d+)",
                              (ROOT / "server" / "forward.c").read_text()).group(1))


def metered(daemon, *flags):
    mflags, port = metrics_flags()
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", *mflags, *flags)
    d.metrics_port = port
    return d


def case(c, T, layer, seed, request_id):
    """(request, its float64 reference)."""
    rng = np.random.default_rng(seed)
    x, x64 = O.hidden(rng, T, SPEC.d, "bf16")
    ids = np.stack([rng.permutation(SPEC.experts)[:2] for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0.1, 1, (T, 2)).astype(np.float32)
    req = c.build_request(layer, x, expert_ids=ids, expert_weights=w, request_id=request_id)
    return req, O.forward(x64, SPEC.layer(layer), O.choice_route(ids, w), SPEC.act)


class Reader(Worker):
    """Reads a stream's replies as they come, with the time each arrived; `end` is "OK" or the
    status code it ended with, `details` its message."""

    def __init__(self, stream):
        super().__init__(self.read)
        self.stream, self.replies, self.end, self.details = stream, [], None, ""

    def read(self):
        try:
            for r in self.stream:
                self.replies.append((r, time.monotonic()))
            self.end = "OK"
        except grpc.RpcError as e:
            self.end, self.details = e.code().name, e.details()


def check_replies(c, replies, cases):
    assert [r.request_id for r, _ in replies] == [q.request_id for q, _ in cases], \
        "replies out of request order"
    for (r, _), (q, ref) in zip(replies, cases):
        O.check(c.decode_output(r.output, O.NP_DTYPE["bf16"]), ref, "bf16", q.request_id)


def test_replies_in_request_order_when_the_second_finishes_first(daemon):
    """--max-delay-us 500000 --max-batch-tokens 16: a 2-token request for layer 0 waits out the
    window, while a 16-token request for layer 1 behind it fills a batch and runs at once. The
    second finishes first (the server's counters show its launch, alone, while no reply has
    reached the client), yet the replies come in request order."""
    d = metered(daemon, "--max-delay-us", "500000", "--max-batch-tokens", "16")
    port = d.metrics_port
    with d.client() as c:
        cases = [case(c, 2, 0, 1, "first-2-tokens"), case(c, 16, 1, 2, "second-16-tokens")]
        before = server_counts(port)
        with d.channel() as ch:
            reader = Reader(moed_pb2_grpc.MoedStub(ch).ForwardStream(iter([q for q, _ in cases]),
                                                                     timeout=60))
            reader.start()
            wait_counts(port, before, {"ForwardStream:OK": 1, "launches": 1,
                                        "launched_requests": 1, "launched_tokens": 16,
                                        "queue_waits": 1, "queued": 1})
            assert reader.replies == [], "a reply came before the first request was computed"
            reader.join(60)
        assert reader.end == "OK", (reader.end, reader.details)
        check_replies(c, reader.replies, cases)
    first, second = (r.timings for r, _ in reader.replies)
    assert (first.batch_tokens, second.batch_tokens) == (2, 16)
    assert first.queue_us >= 400000, f"the first did not wait out the window: {first}"
    assert second.queue_us < first.queue_us and second.total_us < first.total_us, (first, second)
    wait_counts(port, before, {"ForwardStream:OK": 2, "launches": 2, "launched_requests": 2,
                               "launched_tokens": 18, "queue_waits": 2})


def test_more_requests_than_the_window_pause_and_resume_reading(daemon):
    """2.5 windows of 1-token requests sent at once, each held by a 300 ms merge window: the server
    reads exactly STREAM_WINDOW of them and stops (its queue never holds more), then reads on as
    replies go; every request is answered, in order, correctly, in as few launches as windows."""
    n = 2 * STREAM_WINDOW + STREAM_WINDOW // 2
    d = metered(daemon, "--max-delay-us", "300000")
    port = d.metrics_port
    with d.client() as c:
        cases = [case(c, 1, 0, 10 + i, f"s{i}") for i in range(n)]
        before = server_counts(port)
        with d.channel() as ch:
            reader = Reader(moed_pb2_grpc.MoedStub(ch).ForwardStream(iter([q for q, _ in cases]),
                                                                     timeout=120))
            reader.start()
            queued = []
            while reader.is_alive():
                queued.append(server_counts(port)["queued"])
                time.sleep(0.05)
            reader.join()
        assert reader.end == "OK", (reader.end, reader.details)
        check_replies(c, reader.replies, cases)
    assert max(queued) == STREAM_WINDOW, f"queued over time: {queued}"
    windows = -(-n // STREAM_WINDOW)
    wait_counts(port, before, {"ForwardStream:OK": n, "launches": windows,
                               "launched_requests": n, "launched_tokens": n, "queue_waits": n})


def test_drain_ends_an_open_stream_after_answering_what_it_took(daemon):
    """SIGTERM while a stream is open with a request held in a merge window: that request is
    answered, a request sent on the stream after the drain began is not taken, and the stream ends
    UNAVAILABLE with the draining message; a new stream is refused the same way. Exit 0."""
    d = metered(daemon, "--max-delay-us", "1000000")
    port = d.metrics_port
    sent = queue.Queue()

    def requests():
        while (q := sent.get()) is not None:
            yield q

    with d.client() as c:
        cases = [case(c, 3, 0, 20, "before-the-drain"), case(c, 2, 1, 21, "after-the-drain")]
        before = server_counts(port)
        ch = d.channel()
        stub = moed_pb2_grpc.MoedStub(ch)
        reader = Reader(stub.ForwardStream(requests(), timeout=60))
        reader.start()
        sent.put(cases[0][0])
        wait_counts(port, before, {"queued": 1})
        d.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while get(port, "/healthz")[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.01)
        late = Reader(stub.ForwardStream(iter([cases[1][0]]), timeout=30))
        late.start()
        sent.put(cases[1][0])
        sent.put(None)
        reader.join(60)
        late.join(60)
        ch.close()
        assert [r.request_id for r, _ in reader.replies] == ["before-the-drain"]
        check_replies(c, reader.replies, cases[:1])
    assert reader.end == "UNAVAILABLE" and "draining" in reader.details, (reader.end, reader.details)
    assert late.end == "UNAVAILABLE" and "draining" in late.details, (late.end, late.details)
    assert late.replies == []
    assert wait_exit(d) == 0, log_of(d)
