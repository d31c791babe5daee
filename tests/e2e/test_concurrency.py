"""Many clients at once: each gets its own correct result, merged launches change no one's result,
and batch gating over merged requests computes the set over all of them.
"""

import threading

import numpy as np
import pytest

import oracle as O

SPEC = O.Spec(layers=2, d=64, ff=96, experts=8, topk=2, seed=31)
CLIENTS = 20


def client_case(i):
    """Client i's distinct request: its own T, dtype, layer and routing."""
    rng = np.random.default_rng(500 + i)
    T = 1 + (i * 7) % 23
    dtype = ("f32", "f16", "bf16", "bf16u16")[i % 4]
    layer = i % 2
    x, x64 = O.hidden(rng, T, SPEC.d, dtype)
    kw = {"dtype": "bf16"} if dtype == "bf16u16" else {}
    w = SPEC.layer(layer)
    if i % 3 == 0:
        ids = np.stack([rng.permutation(SPEC.experts)[:2] for _ in range(T)]).astype(np.int32)
        gw = rng.uniform(0, 1, (T, 2)).astype(np.float32)
        kw.update(expert_ids=ids, expert_weights=gw)
        route = O.choice_route(ids, gw)
    elif i % 3 == 1:
        logits = (2 * rng.standard_normal((T, SPEC.experts))).astype(np.float32)
        strategy = ("topk", "sparsemax", "sigmoid", "pioneer")[i % 4]
        kw.update(router_logits=logits, strategy=strategy)
        route = O.gate(logits, strategy, SPEC)
    else:
        kw.update(strategy="topk", top_k=3)
        route = O.gate(O.router_logits(x64, w, dtype), "topk", SPEC, top_k=3)
    return layer, x, kw, O.forward(x64, w, route, SPEC.act), dtype


def run_clients(d, n, calls, start_barrier=True):
    """n threads, each with its own client (own connection), each sending its case `calls` times.
    Returns {i: [ForwardResult, ...]} and the exceptions raised."""
    results, errors = {}, []
    barrier = threading.Barrier(n)

    def worker(i):
        layer, x, kw, _, _ = client_case(i)
        try:
            with d.client(timeout=60) as c:
                c.health()  # connect before the barrier, so the calls really overlap
                barrier.wait(30)
                results[i] = [c.forward(layer, x, request_id=f"client-{i}-{j}", return_info=True, **kw)
                              for j in range(calls)]
        except Exception as e:
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results, errors


def check_results(results, calls):
    for i, rs in results.items():
        _, _, _, ref, dtype = client_case(i)
        assert [r.request_id for r in rs] == [f"client-{i}-{j}" for j in range(calls)]
        for r in rs:
            O.check(r.output, ref, dtype, f"client {i}")


def test_concurrent_clients_each_get_their_own_result(daemon):
    d = daemon("--synthetic", str(SPEC), "--threads", "2")
    results, errors = run_clients(d, CLIENTS, calls=4)
    assert not errors, errors
    assert len(results) == CLIENTS
    check_results(results, 4)


def test_merged_launches_are_bit_identical_to_solo(daemon):
    """Concurrent requests share launches; each one's output must be exactly, bit for bit, what it
    gets alone. The clients come in four merge keys (layer, wire dtype) of five; one daemon
    computes each request alone, another (the same weights) holds each key's queue until all five
    of a round are in (--min-batch-requests 5, a minute's window as a hang guard), so every launch
    merges exactly five."""
    flags = ("--synthetic", str(SPEC), "--threads", "1")
    alone = daemon(*flags)
    merging = daemon(*flags, "--max-delay-us", "60000000", "--min-batch-requests", "5")
    keys = {}
    for i in range(CLIENTS):
        layer, _, _, _, dtype = client_case(i)
        keys.setdefault((layer, dtype.replace("bf16u16", "bf16")), []).append(i)
    assert sorted(len(k) for k in keys.values()) == [5] * 4, keys
    solo = {}
    with alone.client(timeout=60) as c:
        for i in range(CLIENTS):
            layer, x, kw, _, _ = client_case(i)
            r = c.forward(layer, x, return_info=True, **kw)
            assert r.timings.batch_requests == 1, "a lone request must run alone"
            solo[i] = r.output
    results, errors = run_clients(merging, CLIENTS, calls=3)
    assert not errors, errors
    check_results(results, 3)
    for i, rs in results.items():
        for r in rs:
            assert r.timings.batch_requests == 5, r.timings
            assert r.output.tobytes() == solo[i].tobytes(), \
                f"client {i}: merged with {r.timings.batch_requests - 1} others, the output changed"
            assert r.timings.batch_tokens >= r.output.shape[0]


def test_batch_gating_over_merged_requests(daemon):
    """Two callers asking for batch gating in the same window share one set S, chosen over both
    requests' tokens; each gets its own rows. --min-batch-requests 2 makes the merge deterministic:
    the queue waits (up to a 30 s window) until both requests are in."""
    d = daemon("--synthetic", str(SPEC), "--threads", "1", "--max-delay-us", "30000000",
               "--min-batch-requests", "2")
    rng = np.random.default_rng(41)
    xs = [O.hidden(rng, T, SPEC.d, "f32") for T in (3, 5)]
    # Opposite preferences, so the merged set differs from either request's own set.
    logits = [(rng.standard_normal((3, 8)) + np.array([4, 3, 0, 0, 0, 0, -2, -2])).astype(np.float32),
              (rng.standard_normal((5, 8)) + np.array([-2, 0, 0, 0, 0, 0, 4, 3.5])).astype(np.float32)]
    out = [None, None]
    barrier = threading.Barrier(2)

    def call(j):
        with d.client(timeout=60) as c:
            c.health()
            barrier.wait(30)
            out[j] = c.forward(0, xs[j][0], router_logits=logits[j], batch_gating=True, k_batch=3,
                               return_info=True)

    threads = [threading.Thread(target=call, args=(j,)) for j in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(o is not None for o in out)
    assert all(o.timings.batch_requests == 2 for o in out), [o.timings for o in out]
    assert list(out[0].expert_set) == list(out[1].expert_set)
    # The merged batch is the two requests' tokens in either order; the set does not depend on it.
    S, route = O.batch_gate(np.concatenate(logits), 3)
    assert list(out[0].expert_set) == S
    assert S != O.batch_gate(logits[0], 3)[0] and S != O.batch_gate(logits[1], 3)[0]
    for j in (0, 1):
        rows = route[:3] if j == 0 else route[3:]
        O.check(out[j].output, O.forward(xs[j][1], SPEC.layer(0), rows, SPEC.act), "f32", f"request {j}")
