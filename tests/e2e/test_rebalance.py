"""moed --rebalance SECONDS: re-placing split layers by the load measured while serving
(docs/operations.md, "Re-placing split layers by measured load").

Bad values are usage (exit 2, naming the flag). On the CPU backend, which never splits a layer,
the flag is accepted, logs once that it has nothing to do, and GetModel says generation 0 with no
copies. The rest runs on moed-split-test, the daemon linked with a stand-in backend that holds
every layer split over two entries, records each re-placement request in $MOED_FAKE_SPLIT_LOG
and re-cuts by the pairs it is given (tests/e2e/split_backend.c; the CPU computes): the request's
pairs are the pairs sent since the layer's last placement in the backend's numbering (an expert
shard's too) with the launches between; a layer under its minimum is not asked about; the
measurement restarts only after a change; GetModel and the metrics show the new placement, its
copies and generation; a failed re-placement is logged and the daemon serves on; calls are
answered, unchanged, while a slow re-placement runs; SIGTERM during one exits 0; --expert-load's
loads are applied before ready.

test_gpu_rebalance runs only on a GPU run (MOED_TEST_COMPUTE, tools/gpu/run-on-gpu.sh): the CUDA
backend splitting a layer with a shared expert over --devices 0,0, skewed traffic from several
threads, every call answered, the placement changing within seconds, and replies before and
after within one bf16 rounding of a whole-layer daemon's.
"""

import re
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

import conftest
from conftest import BUILD, CUDA_MODE, MOED_BIN, Daemon
from prod import scrape

SPLIT_BIN = BUILD / "tests" / "moed-split-test"
SMALL = "layers=2,d=16,ff=16,experts=8,topk=2,seed=3"
needs_split = pytest.mark.skipif(not SPLIT_BIN.exists(), reason=f"{SPLIT_BIN} is not built")


def moed(*args, timeout=60):
    return subprocess.run([str(MOED_BIN), "--listen", "127.0.0.1:0", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flag,value", [("--rebalance", "-1"), ("--rebalance", "86401"),
                                        ("--rebalance", "1e9"), ("--rebalance-replicas", "65"),
                                        ("--rebalance-replicas", "-1"),
                                        ("--rebalance-min-gain", "1.5"),
                                        ("--rebalance-min-gain", "nan"),
                                        ("--rebalance-min-pairs", "-3")])
def test_bad_values_exit_2(flag, value):
    p = moed("--synthetic", SMALL, f"{flag}={value}")
    assert p.returncode == 2, p.stderr
    assert flag in p.stderr and "weights loaded" not in p.stderr, p.stderr


def test_cpu_has_nothing_to_do(daemon):
    d = daemon("--synthetic", SMALL, "--backend", "cpu", "--threads", "1", "--rebalance", "1")
    assert d.log().count("--rebalance has nothing to do") == 1, d.log()
    with d.client(timeout=10) as c:
        for layer in c.info().layers:
            assert layer.placement_generation == 0 and layer.expert_replicas == []
        x = np.ones((4, 16), np.float32)
        c.forward(0, x)
    time.sleep(1.5)  # no pass runs: still the one line
    assert d.log().count("--rebalance has nothing to do") == 1, d.log()


# ---- over the stand-in split backend ------------------------------------------------------------

def split_daemon(tmp_path, *args, env=None):
    """A Daemon of moed-split-test (conftest's Daemon runs the binary conftest.MOED_BIN names)."""
    saved, conftest.MOED_BIN = conftest.MOED_BIN, SPLIT_BIN
    try:
        return Daemon([*map(str, args)], tmp_path / f"moed-split-{time.monotonic_ns()}.log",
                      env={"MOED_FAKE_SPLIT_LOG": str(tmp_path / "requests.log"), **(env or {})})
    finally:
        conftest.MOED_BIN = saved


def requests(tmp_path):
    """The re-placement requests the backend got: [{slot, launches, max_replicas, min_gain, pairs}]."""
    path = tmp_path / "requests.log"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        kv = dict(w.split("=", 1) for w in line.split())
        out.append({"slot": int(kv["slot"]), "launches": float(kv["launches"]),
                    "max_replicas": int(kv["max_replicas"]), "min_gain": float(kv["min_gain"]),
                    "pairs": [float(v) for v in kv["pairs"].split(",")]})
    return out


def wait_for(what, cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not (v := cond()):
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.02)
    return v


def send(c, layer, ids, calls=1, d=16):
    """calls Forwards of len(ids) tokens routed to ids [T, 2] (global ids); the replies."""
    ids = np.asarray(ids, np.int32)
    x = np.random.default_rng(7).standard_normal((len(ids), d)).astype(np.float32)
    w = np.full(ids.shape, 0.5, np.float32)
    return [c.forward(layer, x, expert_ids=ids, expert_weights=w) for _ in range(calls)]


HOT = [[0, 1]] * 16  # 16 tokens on experts 0 and 1: 32 pairs a call


def layer_info(c, layer):
    return next(l for l in c.info().layers if l.index == layer)


@needs_split
def test_measured_load_re_places(tmp_path):
    d = split_daemon(tmp_path, "--synthetic", SMALL, "--threads", "1", "--rebalance", "1",
                     "--rebalance-min-pairs", "90", "--rebalance-replicas", "3",
                     "--rebalance-min-gain", "0.1", "--metrics-listen", "127.0.0.1:0")
    try:
        with d.client(timeout=10) as c:
            before = layer_info(c, 0)
            assert before.expert_placement == [(0, 3, 0), (4, 7, 1)] and before.placement_generation == 0
            send(c, 0, HOT, calls=3)  # 96 pairs: over the minimum (64, after two calls, is not)
            send(c, 1, HOT, calls=2)  # 64 pairs: under it, never asked about
            info = wait_for("a re-placement", lambda: (l := layer_info(c, 0)).placement_generation and l)
            reqs = requests(tmp_path)
            assert [r["slot"] for r in reqs] == [0], reqs
            assert reqs[0]["pairs"] == [48, 48, 0, 0, 0, 0, 0, 0] and reqs[0]["launches"] == 3, reqs
            assert reqs[0]["max_replicas"] == 3 and reqs[0]["min_gain"] == pytest.approx(0.1)
            assert info.placement_generation == 1 and info.expert_placement != before.expert_placement
            assert info.expert_replicas and all(a == b for a, b in [(e, e) for e, _ in info.expert_replicas])
            assert layer_info(c, 1).placement_generation == 0
            m = re.search(r'msg="layer re-placed" layer=0 load=measured pairs=96 launches=3 before=\S+ '
                          r'after=\S+ gain=\S+ home_device=0 experts="([^"]+)" replicas="([^"]+)" '
                          r'generation=1', d.log())
            assert m, d.log()
            assert m.group(1) == ",".join(f"{a}-{b}@{dev}" if a != b else f"{a}@{dev}"
                                          for a, b, dev in info.expert_placement)
            assert m.group(2) == ",".join(f"{e}@{dev}" for e, dev in info.expert_replicas)
            metrics = scrape(d.metrics_port)
            assert metrics.get("moed_rebalances_total", layer="0", result="changed") == 1
            assert metrics.get("moed_layer_placement_generation", layer="0") == 1
            assert metrics.get("moed_layer_launches_total", layer="0") == 3
            # The measurement restarted at the change: nothing new, nothing asked.
            time.sleep(2.2)
            assert len(requests(tmp_path)) == 1
            # The same skew again is no gain (unchanged): the measurement goes on, so a later
            # request weighs both batches since the change.
            send(c, 0, HOT, calls=3)
            wait_for("a second request", lambda: len(requests(tmp_path)) >= 2)
            assert requests(tmp_path)[1]["pairs"][:2] == [48, 48], requests(tmp_path)
            send(c, 0, HOT, calls=3)
            wait_for("the request weighing both", lambda: any(
                r["pairs"][:2] == [96, 96] and r["launches"] == 6 for r in requests(tmp_path)))
            assert layer_info(c, 0).placement_generation == 1
            assert scrape(d.metrics_port).get("moed_rebalances_total", layer="0", result="unchanged") >= 1
    finally:
        assert d.stop() == 0, d.log()


@needs_split
def test_expert_shard_numbering(tmp_path):
    d = split_daemon(tmp_path, "--synthetic", SMALL, "--threads", "1", "--experts", "2-5",
                     "--layers", "0", "--rebalance", "1", "--rebalance-min-pairs", "10",
                     "--rebalance-replicas", "8")
    try:
        with d.client(timeout=10) as c:
            assert layer_info(c, 0).expert_placement == [(2, 3, 0), (4, 5, 1)]
            send(c, 0, [[4, 7]] * 20)  # expert 4 held (local 2), expert 7 not
            info = wait_for("a re-placement", lambda: (l := layer_info(c, 0)).placement_generation and l)
            assert requests(tmp_path)[0]["pairs"] == [0, 0, 20, 0], requests(tmp_path)
            assert info.expert_replicas == [(4, 0)], info  # the hot one, in the whole numbering
            assert info.expert_placement == [(2, 2, 0), (3, 5, 1)], info
    finally:
        assert d.stop() == 0, d.log()


@needs_split
def test_failure_is_logged_and_serving_goes_on(tmp_path):
    d = split_daemon(tmp_path, "--synthetic", SMALL, "--threads", "1", "--rebalance", "1",
                     "--rebalance-min-pairs", "10", env={"MOED_FAKE_SPLIT_FAIL": "1"})
    try:
        with d.client(timeout=10) as c:
            first = send(c, 0, HOT)[0]
            wait_for("the failure's warning", lambda: "re-placement failed" in d.log())
            assert re.search(r'level=warn msg="re-placement failed: the layer keeps its placement" '
                             r'layer=0 load=measured code=-8 reason="split_backend: no room', d.log())
            assert layer_info(c, 0).placement_generation == 0
            np.testing.assert_array_equal(send(c, 0, HOT)[0], first)  # still served, the same
            info = wait_for("the retry", lambda: (l := layer_info(c, 0)).placement_generation and l)
            # the failure left the measurement running: the retry weighs both calls
            assert requests(tmp_path)[-1]["pairs"][:2] == [32, 32], requests(tmp_path)
            assert info.placement_generation == 1
    finally:
        assert d.stop() == 0, d.log()


@needs_split
def test_calls_answered_during_a_slow_re_placement(tmp_path):
    d = split_daemon(tmp_path, "--synthetic", SMALL, "--threads", "1", "--rebalance", "1",
                     "--rebalance-min-pairs", "10", env={"MOED_FAKE_SPLIT_DELAY_MS": "2000"})
    stop, done, errors = threading.Event(), [], []
    try:
        with d.client(timeout=10) as c:
            ref = send(c, 0, HOT)[0]

            def caller():
                with d.client(timeout=10) as cc:
                    while not stop.is_set():
                        try:
                            y = send(cc, 0, HOT)[0]
                            np.testing.assert_array_equal(y, ref)
                            done.append(time.monotonic())
                        except Exception as e:  # noqa: BLE001 - every failure is reported
                            errors.append(e)

            threads = [threading.Thread(target=caller) for _ in range(3)]
            for t in threads:
                t.start()
            wait_for("the re-placement to begin", lambda: requests(tmp_path), timeout=15)
            began = time.monotonic()
            wait_for("the re-placement to end", lambda: layer_info(c, 0).placement_generation, timeout=15)
            ended = time.monotonic()
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors[:3]
        during = [t for t in done if began < t < ended]
        assert len(during) >= 5, f"{len(during)} calls answered in the {ended - began:.1f} s re-placement"
    finally:
        stop.set()
        assert d.stop() == 0, d.log()


@needs_split
def test_sigterm_during_a_re_placement_exits_0(tmp_path):
    d = split_daemon(tmp_path, "--synthetic", SMALL, "--threads", "1", "--rebalance", "1",
                     "--rebalance-min-pairs", "10", env={"MOED_FAKE_SPLIT_DELAY_MS": "3000"})
    with d.client(timeout=10) as c:
        send(c, 0, HOT)
        send(c, 1, HOT)  # a second layer, whose re-placement must not start after SIGTERM
    wait_for("the re-placement to begin", lambda: requests(tmp_path), timeout=15)
    t0 = time.monotonic()
    assert d.stop(signal.SIGTERM, timeout=20) == 0, d.log()
    assert time.monotonic() - t0 < 10, d.log()
    assert len(requests(tmp_path)) == 1, requests(tmp_path)
    assert 'msg="stopped" exit=0' in d.log()


@needs_split
def test_expert_load_applied_before_ready(tmp_path):
    load = tmp_path / "load.prom"
    load.write_text("".join(f'moed_expert_tokens_total{{layer="0",expert="{e}"}} {v}\n'
                            for e, v in enumerate([900, 10, 10, 10, 10, 10, 10, 10])) +
                    "moed_batch_tokens_count 40\n")
    d = split_daemon(tmp_path, "--synthetic", SMALL, "--threads", "1", "--expert-load", load,
                     "--rebalance-replicas", "8")
    try:
        with d.client(timeout=10) as c:
            assert layer_info(c, 0).placement_generation == 1  # already at the first call
            assert layer_info(c, 1).placement_generation == 0  # no load in the file
            assert layer_info(c, 0).expert_replicas == [(0, 1)]
        log = d.log()
        assert log.index('msg="layer re-placed" layer=0 load=--expert-load') < log.index('msg="ready"'), log
        r = requests(tmp_path)
        assert len(r) == 1 and r[0]["pairs"][:2] == [900, 10] and r[0]["launches"] == 40, r
    finally:
        assert d.stop() == 0, d.log()
    # no copies allowed: the file's loads cut the ranges at load, and nothing more is asked
    (tmp_path / "requests.log").unlink()
    d = split_daemon(tmp_path, "--synthetic", SMALL, "--threads", "1", "--expert-load", load,
                     "--rebalance-replicas", "0")
    try:
        with d.client(timeout=10) as c:
            assert layer_info(c, 0).placement_generation == 0
        assert requests(tmp_path) == []
    finally:
        assert d.stop() == 0, d.log()


# ---- on a GPU ---------------------------------------------------------------------------------

GPU_SPEC = "layers=1,d=256,ff=128,experts=16,topk=2,shared=1,shared_ff=256,dtype=bf16,seed=5"


@pytest.mark.skipif(not CUDA_MODE, reason="needs a GPU run (MOED_TEST_COMPUTE) and the CUDA build")
def test_gpu_rebalance(daemon):
    import ml_dtypes

    split = daemon("--synthetic", GPU_SPEC, "--backend", "cuda", "--devices", "0,0",
                   "--expert-parallel", "--rebalance", "1", "--rebalance-min-pairs", "256")
    whole = daemon("--synthetic", GPU_SPEC, "--backend", "cuda", "--devices", "0")
    rng = np.random.default_rng(11)
    zipf = 1.0 / np.arange(1, 17) ** 1.2
    zipf /= zipf.sum()
    batches = []
    for _ in range(24):
        ids = np.stack([rng.choice(16, size=2, replace=False, p=zipf) for _ in range(32)]).astype(np.int32)
        x = rng.standard_normal((32, 256)).astype(ml_dtypes.bfloat16)
        batches.append((x, ids, np.full(ids.shape, 0.5, np.float32)))
    with whole.client(timeout=30) as c:
        expected = [c.forward(0, x, expert_ids=i, expert_weights=w) for x, i, w in batches]
    with split.client(timeout=30) as c:
        first = layer_info(c, 0)
    errors, got, stop = [], {}, threading.Event()

    def caller(k):  # until a second after the swap: replies from before and after it
        with split.client(timeout=30) as c:
            while not stop.is_set():
                for j in range(k, len(batches), 4):
                    x, i, w = batches[j]
                    try:
                        got.setdefault(j, []).append(c.forward(0, x, expert_ids=i, expert_weights=w))
                    except Exception as e:  # noqa: BLE001 - every failure is reported
                        errors.append(e)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    with split.client(timeout=30) as c:
        try:
            info = wait_for("the placement to change",
                            lambda: (l := layer_info(c, 0)).placement_generation and l, timeout=30)
            time.sleep(1.0)
        finally:
            stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert (info.expert_placement, info.expert_replicas) != (first.expert_placement, first.expert_replicas)
    for j, ys in got.items():
        ref = np.asarray(expected[j], np.float32)
        for y in ys:  # before and after the swap: within one bf16 rounding of the whole layer's
            tol = 2.0 ** -7 * np.abs(ref).max(axis=1, keepdims=True) + 1e-6
            assert (np.abs(np.asarray(y, np.float32) - ref) <= tol).all(), j
