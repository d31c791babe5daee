"""ForwardStream under stress: replies in request order when launches finish out of order, the
stream's window of open requests (reading pauses when it is full and resumes as replies go), and
the drain reaching an open stream.

Each test sets the scheduler up so that what it asserts really happens, and checks from the
server's side (/metrics, and the timings in the replies) that it did: a request that finishes
before an earlier one, a queue that holds exactly the stream's window. Requests are held by merge
windows of a minute (hang guards) that only the test ends, by sending what fills the launch.
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
from held import held_call
from moed._proto.moed.v1 import moed_pb2_grpc
from prod import ANY_METRICS_PORT, get, server_counts, wait_counts

SPEC = O.Spec.parse(DEFAULT_SPEC)
# Requests one stream may have open (server/forward.c); the window test sends more than twice it.
STREAM_WINDOW = int(re.search(r"#define STREAM_WINDOW (\d+)",
                              (ROOT / "server" / "forward.c").read_text()).group(1))


def metered(daemon, *flags):
    return daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--max-delay-us", "60000000",
                  *ANY_METRICS_PORT, *flags)


def fed(q):
    """A request iterator the test feeds through queue q (None ends it)."""
    while (r := q.get()) is not None:
        yield r


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
    """--min-batch-requests 2 --max-batch-tokens 16: a 2-token request for layer 0 waits for a
    second request of its layer, while a 16-token request for layer 1 behind it fills a batch and
    runs at once. The second finishes first (the server's counters show its launch, alone, while
    no reply has reached the client); only then does a third request, for layer 0, let the first
    go. The replies come in request order."""
    d = metered(daemon, "--min-batch-requests", "2", "--max-batch-tokens", "16")
    port = d.metrics_port
    sent = queue.Queue()
    with d.client() as c:
        cases = [case(c, 2, 0, 1, "first-2-tokens"), case(c, 16, 1, 2, "second-16-tokens"),
                 case(c, 1, 0, 3, "third-1-token")]
        before = server_counts(port)
        with d.channel() as ch:
            reader = Reader(moed_pb2_grpc.MoedStub(ch).ForwardStream(fed(sent), timeout=60))
            reader.start()
            sent.put(cases[0][0])
            sent.put(cases[1][0])
            wait_counts(port, before, {"ForwardStream:OK": 1, "launches": 1,
                                        "launched_requests": 1, "launched_tokens": 16,
                                        "queue_waits": 1, "queued": 1})
            assert reader.replies == [], "a reply came before the first request was computed"
            sent.put(cases[2][0])
            sent.put(None)
            reader.join(60)
        assert reader.end == "OK", (reader.end, reader.details)
        check_replies(c, reader.replies, cases)
    first, second, third = (r.timings for r, _ in reader.replies)
    assert (first.batch_tokens, second.batch_tokens, third.batch_tokens) == (3, 16, 3)
    assert second.queue_us < first.queue_us, (first, second)
    wait_counts(port, before, {"ForwardStream:OK": 3, "launches": 2, "launched_requests": 3,
                               "launched_tokens": 19, "queue_waits": 3})


def test_more_requests_than_the_window_pause_and_resume_reading(daemon):
    """2.5 windows of 1-token requests sent at once, where a launch needs one token more than a
    window holds: the server reads exactly STREAM_WINDOW of them and stops (the queue stays at
    that), until another caller's request fills the launch; then it reads on as the replies go,
    again a window's worth. Every request is answered, in order, correctly, in one launch a window."""
    n = 2 * STREAM_WINDOW + STREAM_WINDOW // 2
    full = STREAM_WINDOW + 1
    d = metered(daemon, "--max-batch-tokens", str(full))
    port = d.metrics_port
    with d.client() as c:
        cases = [case(c, 1, 0, 10 + i, f"s{i}") for i in range(n)]
        before = server_counts(port)
        with d.channel() as ch:
            reader = Reader(moed_pb2_grpc.MoedStub(ch).ForwardStream(iter([q for q, _ in cases]),
                                                                     timeout=120))
            reader.start()
            answered, tokens = 0, 0
            for k in range(3):
                window = min(STREAM_WINDOW, n - answered)
                want = {"ForwardStream:OK": answered, "Forward:OK": k, "launches": k,
                        "launched_requests": answered + k, "launched_tokens": tokens,
                        "queue_waits": answered + k, "queued": window}
                wait_counts(port, before, want)  # the stream's reading has stopped at a window
                release, ref = case(c, full - window, 0, 100 + k, f"release-{k}")
                with d.channel() as other:
                    r = moed_pb2_grpc.MoedStub(other).Forward(release, timeout=60)
                O.check(c.decode_output(r.output, O.NP_DTYPE["bf16"]), ref, "bf16", f"release {k}")
                assert (r.timings.batch_tokens, r.timings.batch_requests) == (full, window + 1), r.timings
                answered, tokens = answered + window, tokens + full
            reader.join(120)
        assert reader.end == "OK", (reader.end, reader.details)
        check_replies(c, reader.replies, cases)
    wait_counts(port, before, {"ForwardStream:OK": n, "Forward:OK": 3, "launches": 3,
                               "launched_requests": n + 3, "launched_tokens": 3 * full,
                               "queue_waits": n + 3})


def test_drain_ends_an_open_stream_after_answering_what_it_took(daemon):
    """SIGTERM while a stream is open with a request held in a merge window: that request is
    answered, a request sent on the stream after the drain began is not taken, and the stream ends
    UNAVAILABLE with the draining message; a new stream is refused the same way (a held call keeps
    the drain going until then). Exit 0."""
    d = metered(daemon, "--min-batch-requests", "2")
    port = d.metrics_port
    sent = queue.Queue()
    with d.client() as c:
        cases = [case(c, 3, 0, 20, "before-the-drain"), case(c, 2, 1, 21, "after-the-drain")]
        before = server_counts(port)
        ch = d.channel()
        stub = moed_pb2_grpc.MoedStub(ch)
        reader = Reader(stub.ForwardStream(fed(sent), timeout=60))
        reader.start()
        sent.put(cases[0][0])
        wait_counts(port, before, {"queued": 1})
        held = held_call(d)
        d.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while get(port, "/healthz")[0] != 503:  # answered on the thread that began the drain
            assert time.monotonic() < deadline, "/healthz did not say 503 after SIGTERM"
            time.sleep(0.01)
        late = Reader(stub.ForwardStream(iter([cases[1][0]]), timeout=30))
        late.start()
        sent.put(cases[1][0])
        sent.put(None)
        reader.join(60)
        late.join(60)
        ch.close()
        held.release()
        assert [r.request_id for r, _ in reader.replies] == ["before-the-drain"]
        check_replies(c, reader.replies, cases[:1])
    assert reader.end == "UNAVAILABLE" and "draining" in reader.details, (reader.end, reader.details)
    assert late.end == "UNAVAILABLE" and "draining" in late.details, (late.end, late.details)
    assert late.replies == []
    assert wait_exit(d) == 0, log_of(d)
