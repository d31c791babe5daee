"""The Prometheus endpoint (--metrics-listen): every metric docs/operations.md lists is there, in the text
format (parsed strictly), with values that match exactly what the test sent — requests by method
and status code, tokens, request and response bytes (measured on the wire with raw gRPC calls),
the latency and batch-size histograms — and gauges that describe the daemon. /healthz answers 200
while serving. Malformed HTTP gets 400 (or 404/405/431) and the daemon keeps serving gRPC and
metrics. The option works from a config file as from the command line.

What docs/security.md measures, again: with 100+ idle sockets open a scrape is still answered (200),
and no socket is reset (those over the limits are answered 503); scrapes at a high rate are all
answered; a client that closes is released at once (moed_http_connections back down); a request
head that trickles is cut off with 408; --metrics-token-file guards /metrics but not /healthz.
"""

import select
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest

import oracle as O
from conftest import DEFAULT_SPEC
from daemons import log_of
from moed import MoEClient
from moed._proto.moed.v1 import moed_pb2
from prod import ANY_METRICS_PORT, config_file, get, http, parse_exposition, scrape

SPEC = O.Spec.parse(DEFAULT_SPEC)
FORWARD = "/moed.v1.Moed/Forward"
STREAM = "/moed.v1.Moed/ForwardStream"

NAMES = {
    "moed_up": "gauge", "moed_build_info": "gauge", "moed_start_time_seconds": "gauge",
    "moed_serving": "gauge", "moed_requests_total": "counter", "moed_tokens_total": "counter",
    "moed_request_bytes_total": "counter", "moed_response_bytes_total": "counter",
    "moed_request_duration_seconds": "histogram", "moed_queue_duration_seconds": "histogram",
    "moed_compute_duration_seconds": "histogram", "moed_batch_tokens": "histogram",
    "moed_batch_requests": "histogram", "moed_queue_requests": "gauge",
    "moed_calls_active": "gauge", "moed_connections_closed_total": "counter", "moed_stream_pool_busy": "gauge",
    "moed_stream_pool_size": "gauge", "moed_device_memory_used_bytes": "gauge",
    "moed_device_memory_total_bytes": "gauge", "moed_http_connections": "gauge",
    "moed_http_refused_total": "counter",
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One daemon with metrics on, from a config file (so the file form is what is tested here;
    test_flag_form covers the flag), --max-delay-us 0 and one thread so every request runs as its
    own launch when sent one at a time."""
    from conftest import Daemon
    tmp = tmp_path_factory.mktemp("metrics")
    cfg = config_file(tmp / "moed.conf", metrics_listen=ANY_METRICS_PORT[1], synthetic=DEFAULT_SPEC, threads=1)
    d = Daemon(["--config", cfg], tmp / "moed.log")
    yield d
    assert d.stop() == 0, d.log()


def request(T, layer=0, bad_id=False, seed=0):
    rng = np.random.default_rng(seed)
    x, _ = O.hidden(rng, T, SPEC.d, "bf16")
    ids = np.stack([rng.permutation(SPEC.experts)[:2] for _ in range(T)]).astype(np.int32)
    if bad_id:
        ids[0, 0] = SPEC.experts  # out of range: INVALID_ARGUMENT
    w = rng.uniform(0, 1, (T, 2)).astype(np.float32)
    return MoEClient.build_request(None, layer, x, expert_ids=ids, expert_weights=w).SerializeToString()


def raw_forward(channel, payload):
    """Sends serialized bytes and returns the serialized reply (both as they are on the wire)."""
    return channel.unary_unary(FORWARD, request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)(payload, timeout=30)


def test_counts_match_what_was_sent(served):
    before = scrape(served.metrics_port)
    for name, kind in NAMES.items():
        assert before.types.get(name) == kind, f"{name}: {before.types.get(name)}"
    sent = recv = tokens = 0
    good = [request(T, seed=T) for T in (1, 5, 17, 64)]
    bad_arg = [request(3, bad_id=True, seed=9), request(2, bad_id=True, seed=10)]
    bad_layer = [request(4, layer=9, seed=11)]
    with served.channel() as ch:
        for p in good:
            reply = raw_forward(ch, p)
            sent, recv = sent + len(p), recv + len(reply)
            tokens += moed_pb2.ForwardRequest.FromString(p).hidden.shape[0]
            assert len(moed_pb2.ForwardResponse.FromString(reply).output.data) > 0
        for p, code in [(p, "INVALID_ARGUMENT") for p in bad_arg] + [(p, "NOT_FOUND") for p in bad_layer]:
            with pytest.raises(Exception) as err:
                raw_forward(ch, p)
            assert err.value.code().name == code
            sent += len(p)
        # Three requests on one stream: each counts as one ForwardStream request.
        stream = ch.stream_stream(STREAM, request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
        replies = list(stream(iter(good[:3]), timeout=30))
        assert len(replies) == 3
        sent += sum(len(p) for p in good[:3])
        recv += sum(len(r) for r in replies)
        tokens += 1 + 5 + 17
    with served.client() as c:
        c.info()
    after = scrape(served.metrics_port)

    def delta(name, **labels):
        return (after.get(name, **labels) or 0) - (before.get(name, **labels) or 0)

    assert delta("moed_requests_total", method="Forward", code="OK") == 4
    assert delta("moed_requests_total", method="Forward", code="INVALID_ARGUMENT") == 2
    assert delta("moed_requests_total", method="Forward", code="NOT_FOUND") == 1
    assert delta("moed_requests_total", method="ForwardStream", code="OK") == 3
    assert delta("moed_requests_total", method="GetModel", code="OK") == 1
    assert delta("moed_tokens_total") == tokens
    assert delta("moed_request_bytes_total") == sent
    assert delta("moed_response_bytes_total") == recv
    # Every Forward answer has a duration; only the computed ones waited in a queue.
    assert delta("moed_request_duration_seconds_count") == 4 + 3 + 3
    assert delta("moed_queue_duration_seconds_count") == 4 + 3
    assert delta("moed_batch_requests_sum") == 4 + 3
    assert delta("moed_batch_tokens_sum") == tokens
    launches = delta("moed_compute_duration_seconds_count")
    assert 5 <= launches <= 7  # the stream's three may merge; the unary ones ran one by one
    assert delta("moed_batch_tokens_count") == launches
    assert delta("moed_batch_tokens_bucket", le="64") == launches  # none over 64 + 5 + ... tokens
    assert delta("moed_request_duration_seconds_sum") > 0
    assert after.get("moed_up") == 1 and after.get("moed_serving") == 1
    assert after.get("moed_build_info", version="0.1.0", backend="cpu") == 1
    assert after.get("moed_stream_pool_size") == 1
    assert after.get("moed_stream_pool_busy") == 0 and after.get("moed_queue_requests") == 0
    total = after.get("moed_device_memory_total_bytes", device="0", name="cpu")
    used = after.get("moed_device_memory_used_bytes", device="0", name="cpu")
    assert total > 0 and 0 < used <= total


def test_healthz_and_paths(served):
    assert get(served.metrics_port, "/healthz") == (200, "SERVING\n")
    assert get(served.metrics_port, "/nothing")[0] == 404
    status, answer = http(served.metrics_port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200 and answer.endswith(b"\r\n\r\n")  # no body
    status, answer = http(served.metrics_port, b"DELETE /metrics HTTP/1.1\r\n\r\n")
    assert status == 405 and b"Allow: GET, HEAD" in answer


MALFORMED = [
    (b"\x00\x01\x02garbage\r\n\r\n", 400),
    (b"GET /metrics\r\n\r\n", 400),
    (b"GET /metrics HTTP/9.9\r\n\r\n", 400),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nbroken header\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nContent-Length: 4\r\n\r\nbody", 400),
    (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 9000, 431),
]


def test_malformed_http_is_refused_and_nothing_breaks(served):
    for req, want in MALFORMED:
        status, answer = http(served.metrics_port, req)
        assert status == want, (req[:40], answer[:80])
    # A client that connects and leaves, and one that sends half a request and leaves.
    http(served.metrics_port, b"", read=False)
    http(served.metrics_port, b"GET /met", read=False)
    assert scrape(served.metrics_port).get("moed_up") == 1
    with served.client() as c:
        assert c.health() == "SERVING"
        y = c.forward(0, np.zeros((2, SPEC.d), np.float32), expert_ids=np.zeros((2, 1), np.int32),
                      expert_weights=np.ones((2, 1), np.float32))
        assert y.shape == (2, SPEC.d)
    assert served.proc.poll() is None


def test_flag_form_and_default_off(daemon):
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", *ANY_METRICS_PORT)
    assert "metrics listening" in d.log()
    e = scrape(d.metrics_port)
    assert e.get("moed_serving") == 1
    off = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1")
    assert "metrics listening" not in off.log()


def test_bad_metrics_address_fails_start(daemon):
    d = daemon("--synthetic", DEFAULT_SPEC, "--metrics-listen", "nowhere:9400", wait=False)
    assert d.proc.wait(30) == 1
    d.stop()
    assert "--metrics-listen 'nowhere:9400'" in log_of(d)
    first = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", *ANY_METRICS_PORT)
    taken = f"127.0.0.1:{first.metrics_port}"
    second = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--metrics-listen", taken, wait=False)
    assert second.proc.wait(30) == 1
    second.stop()
    assert f"cannot listen on --metrics-listen {taken}" in log_of(second)
    assert first.proc.poll() is None


def test_parser_rejects_what_prometheus_would():
    """The strict parser used above would notice a malformed page (so passing means something)."""
    good = "# HELP a x\n# TYPE a counter\na 1\n"
    parse_exposition(good)
    for bad in ("a 1\n", good + "a 2\n", good.replace("a 1", "a{l=\"x} 1"),
                "# HELP h x\n# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\n"
                "h_sum 1\nh_count 1\n"):
        with pytest.raises(AssertionError):
            parse_exposition(bad)


# ---- limits (docs/security.md, "The metrics endpoint") -----------------------------------------

# server/http.c: connections from one address that may wait for their request; how old a waiting
# one must be before a newcomer may take its place; how long one may take to send its head; how
# long an answered one lingers for its client's close.
MAX_PER_PEER, EVICT_AGE_S, HEAD_TIMEOUT_S, LINGER_S = 32, 0.25, 5.0, 2.0


def _idle(port, n):
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        socks.append(s)
    return socks


def _told(s):
    """What the server told a socket that has something to read: "503", "reset" or "closed"."""
    try:
        data = s.recv(64)
    except ConnectionResetError:
        return "reset"
    return "503" if data.startswith(b"HTTP/1.1 503 ") else "closed"


def _answers(socks, n, timeout=60):
    """Waits until n of socks have been told something; {index: what}."""
    told, deadline = {}, time.monotonic() + timeout
    while len(told) < n:
        assert time.monotonic() < deadline, f"only {len(told)} of {n} connections were answered: {told}"
        rest = [s for i, s in enumerate(socks) if i not in told]
        for s in select.select(rest, [], [], 0.1)[0]:
            told[socks.index(s)] = _told(s)
    return told


def _open_connections(port):
    return scrape(port).get("moed_http_connections")


def _released_before(port, by):
    """Whether a scrape that ended before time.monotonic() reached `by` found the endpoint back to
    one open connection (the scrape asking). False also when the test was too late to look (a
    scrape that ends after `by` proves nothing either way): its caller tries again."""
    while True:
        released = _open_connections(port) == 1
        if time.monotonic() >= by:
            return False
        if released:
            return True
        time.sleep(0.01)


def test_idle_sockets_do_not_take_the_endpoint_down(served):
    """150 idle connections: 32 wait for their request, and every other one is answered 503 (or
    takes the place of the oldest, which is); once the waiting ones are older than the eviction
    age a scrape takes the oldest one's place (503) and is answered; nothing is reset. Once they close,
    the waiting ones are released before their head timeout could have done it."""
    port = served.metrics_port
    for _ in range(10):  # a try whose release the test could not see in time is made again
        refused0 = scrape(port).get("moed_http_refused_total")
        opened = time.monotonic()
        socks = _idle(port, 150)
        try:
            told = _answers(socks, 150 - MAX_PER_PEER)
            assert set(told.values()) == {"503"}, told
            waiting = [i for i in range(150) if i not in told]
            # Each was admitted before the answers just seen: after this sleep all are older than
            # the eviction age.
            time.sleep(EVICT_AGE_S + 0.05)
            assert scrape(port).get("moed_up") == 1
            assert get(port, "/healthz") == (200, "SERVING\n")
            # The oldest made room for the first scrape, and was answered before it; the others
            # still wait (the scrapes after it found room).
            evicted = _answers([socks[i] for i in waiting], 1, timeout=10)
            assert evicted == {0: "503"}, evicted
            assert not select.select([socks[i] for i in waiting[1:]], [], [], 0)[0]
            e = scrape(port)
            assert e.get("moed_http_refused_total") - refused0 == 150 - MAX_PER_PEER + 1
            assert 2 <= e.get("moed_http_connections") <= 32 + 64 + 1
        finally:
            for s in socks:
                s.close()
        if _released_before(port, opened + HEAD_TIMEOUT_S):
            return
    pytest.fail("in 10 tries the idle connections were never seen released before their head "
                "timeout could have done it")


def test_closed_clients_are_released_at_once(served):
    """Answered connections whose clients close are released then, not after the linger."""
    port = served.metrics_port
    for _ in range(10):  # a try whose release the test could not see in time is made again
        sent = time.monotonic()
        for _ in range(50):
            assert get(port, "/healthz")[0] == 200
        if _released_before(port, sent + LINGER_S):
            return
    pytest.fail("in 10 tries the closed connections were never seen released before the linger "
                "could have done it")


def test_scrapes_at_a_high_rate_are_all_answered(served):
    """200 scrapes/s offered for 2 s from fresh connections (the old server answered 32/s and
    reset the rest), never more at once than may wait from one address (a stalled test would
    otherwise offer its backlog all at once)."""
    port = served.metrics_port
    results, lock = [], threading.Lock()
    at_once = threading.Semaphore(MAX_PER_PEER)

    def one():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
                status = r.status
                r.read()
        except Exception as err:  # a reset shows here
            status = repr(err)
        finally:
            at_once.release()
        with lock:
            results.append(status)

    threads, t0 = [], time.monotonic()
    for i in range(400):
        delay = t0 + i / 200 - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        at_once.acquire()
        t = threading.Thread(target=one)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    assert results.count(200) == 400, sorted(set(map(str, results)))


def test_trickling_request_head_gets_408(served):
    """Slowloris: the head must be complete within 5 s, however slowly it comes. It trickles here
    at 10 bytes a second and would be complete after 12.8 s: the 408 comes before, and no sooner
    than 5 s after the connection (the clock starts before it)."""
    head = b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 100 + b"\r\n\r\n"
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", served.metrics_port), timeout=60) as s:
        answer, sent = b"", 0
        for ch in head:
            try:
                s.send(bytes([ch]))
            except OSError:
                break
            sent += 1
            if select.select([s], [], [], 0.1)[0]:
                answer = s.recv(4096)
                break
        took = time.monotonic() - t0
        if not answer:
            answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert sent < len(head), "the whole head went out before the server answered"
    assert took >= HEAD_TIMEOUT_S - 0.01, took  # libuv's clock counts whole ms


def test_metrics_token(daemon, tmp_path):
    token = "m3trics-" + "ab" * 16
    (tmp_path / "token").write_text(token + "\n")
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", *ANY_METRICS_PORT,
               "--metrics-token-file", tmp_path / "token")
    port = d.metrics_port
    assert "metrics_token=on" in d.log()
    status, body = get(port, "/metrics")
    assert status == 401 and "--metrics-token-file" in body
    status, answer = http(port, b"GET /metrics HTTP/1.1\r\n\r\n")
    assert b"WWW-Authenticate: Bearer" in answer
    for wrong in ("Bearer nope", "Bearer " + token + "x", token, "Basic " + token):
        assert http(port, f"GET /metrics HTTP/1.1\r\nAuthorization: {wrong}\r\n\r\n".encode())[0] == 401
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200 and b"moed_up 1" in r.read()
    assert get(port, "/healthz") == (200, "SERVING\n")  # health stays open
    assert token not in d.log()


def test_warns_beyond_loopback_without_a_token(daemon, tmp_path):
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--metrics-listen", "0.0.0.0:0")
    assert "metrics listening beyond this host without a token" in d.log()
    (tmp_path / "token").write_text("t\n")
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--metrics-listen", "0.0.0.0:0",
               "--metrics-token-file", tmp_path / "token")
    assert "without a token" not in d.log()


@pytest.mark.parametrize("content,says", [("\n", "no token"), (None, "No such file")])
def test_bad_metrics_token_file_stops_the_start(daemon, tmp_path, content, says):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    d = daemon("--synthetic", DEFAULT_SPEC, *ANY_METRICS_PORT, "--metrics-token-file", path, wait=False)
    assert d.proc.wait(30) == 1
    d.stop()
    log = log_of(d)
    assert "--metrics-token-file" in log and says in log and str(path) in log, log


def loading_model(layers):
    """About 0.1 s and 0.1 GB of synthetic weights to generate per layer."""
    return f"layers={layers},d=1024,ff=2048,experts=8,topk=2,act=swiglu,dtype=bf16,seed=3"


def test_healthz_503_until_the_weights_are_resident(daemon):
    """The endpoint answers from the start: /healthz 503 NOT_SERVING (and /metrics 503) while the
    weights load, which the log proves (no "weights loaded" yet when the answer came), then 200
    once gRPC health says SERVING. A try in which the test got no answer while the weights loaded
    is made again with twice the weights."""
    for layers in (4, 8, 16):
        d = daemon("--synthetic", loading_model(layers), "--threads", "1", *ANY_METRICS_PORT, wait=False)
        port = d.metrics_port  # logged before the weights load
        seen = []  # (/healthz status and body, /metrics status, weights loaded before the answer)
        deadline = time.monotonic() + 120
        while not seen or seen[-1][0] != 200:
            assert d.proc.poll() is None and time.monotonic() < deadline, f"{seen}\n{d.log()}"
            status, body = get(port, "/healthz")
            metrics_status = get(port, "/metrics")[0]
            seen.append((status, body, metrics_status, '"weights loaded"' in d.log()))
            time.sleep(0.02)
        if not all(s[3] for s in seen):
            break
        assert d.stop() == 0
    else:
        pytest.fail(f"no answer came while {layers} layers loaded, nor with fewer")
    loading = [s for s in seen if not s[3]]
    assert loading and all(s[:3] == (503, "NOT_SERVING\n", 503) for s in loading), seen
    assert seen[-1][:3] == (200, "SERVING\n", 200), seen
    d.wait_serving()
