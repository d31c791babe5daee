"""The Python client against real daemons: every kind of input (numpy in each dtype, bf16 bits,
DLPack objects, non-contiguous arrays; torch tensors where torch is installed) against the oracle,
inline and through shared memory; outputs that are read-only views of the reply (or of the
client's shared memory); forward_stream() in order, with its errors in
place; the asyncio client; retries of UNAVAILABLE against a full queue and a draining daemon,
bounded by attempts and by the deadline; channel options and deadlines.

Needs neither protobuf nor torch: test_python_pins.py runs it with the lowest grpcio and numpy the
client claims to support.
"""

import asyncio
import collections
import dataclasses
import json
import mmap
import random
import signal
import subprocess
import sys
import threading
import time

import grpc

import numpy as np
import pytest

import oracle as O
from conftest import BUILD, DEFAULT_SPEC, ROOT
from daemons import Worker, log_of, wait_exit
from held import held_call
from moed import MoEClient, MoEError, RetryPolicy
from moed import aio
from prod import ANY_METRICS_PORT, server_counts, wait_counts

SPEC = O.Spec.parse(DEFAULT_SPEC)
# A queue held full for as long as a test wants: --max-queue-requests 1, and a request of fewer than
# FULL tokens waits in a merge window (60 s, a hang guard) for a second request, which the full
# queue never lets in; the test ends the hold by cancelling it. A request of FULL tokens fills a
# batch and is computed at once. --max-streams: the clients of a test share one HTTP/2 connection,
# whose stream limit would otherwise follow --max-queue-requests down to 1 and hold the second call
# in the client instead of letting the server refuse it.
FULL = 8
HOLD = ("--threads", "1", "--max-queue-requests", "1", "--max-streams", "16", "--max-delay-us", "60000000",
        "--min-batch-requests", "2", "--max-batch-tokens", str(FULL), *ANY_METRICS_PORT)
Decision = collections.namedtuple("Decision", "failures code now deadline took wait")


@dataclasses.dataclass(frozen=True)
class Recorded(RetryPolicy):
    """A RetryPolicy that records what the client asked it and what it answered, and sets `refused`
    at the first failure."""
    decisions: list = dataclasses.field(default_factory=list, compare=False)
    refused: threading.Event = dataclasses.field(default_factory=threading.Event, compare=False)

    def delay(self, failures, code, now, deadline, took=0.0, rand=random.random):
        wait = super().delay(failures, code, now, deadline, took, rand)
        self.decisions.append(Decision(failures, code, now, deadline, took, wait))
        self.refused.set()
        return wait

    def longest_wait(self, failures):
        return min(self.max_backoff, self.initial_backoff * self.multiplier ** (failures - 1))


# Patient enough to outlast any hold: the tests end a hold once they have seen a refusal.
def patient():
    return Recorded(max_attempts=1 << 30, initial_backoff=0.01, max_backoff=0.05)


def case(rng, T, dtype, layer=0, spec=SPEC, ref_rows=None):
    """Hidden states, expert choice and the oracle's output (of the first ref_rows tokens only, if
    given: a token's output depends on its own row and route alone)."""
    x, x64 = O.hidden(rng, T, spec.d, dtype)
    ids = np.stack([rng.permutation(spec.experts)[:2] for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0, 1, (T, 2)).astype(np.float32)
    n = T if ref_rows is None else ref_rows
    ref = O.forward(x64[:n], spec.layer(layer), O.choice_route(ids[:n], w[:n]), spec.act)
    return x, ids, w, ref


def send_kw(dtype):
    return {"dtype": "bf16"} if dtype == "bf16u16" else {}


def reply_buffer(a):
    while isinstance(a, np.ndarray):
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


class DLPackOnly:
    """A host tensor that offers its memory only through DLPack."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


@pytest.mark.parametrize("transport", ["inline", "shm"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "bf16u16"])
def test_numpy_and_dlpack_inputs_match_the_oracle(shared_daemon, dtype, transport):
    rng = np.random.default_rng(40)
    x, ids, w, ref = case(rng, 9, dtype)
    with shared_daemon.client(timeout=30, transport=transport) as c:
        y = c.forward(0, x, expert_ids=ids, expert_weights=w, **send_kw(dtype))
        O.check(y, ref, dtype, "numpy")
        assert y.dtype == x.dtype and not y.flags.writeable
        # a view of the received message (inline) or of the client's shared memory: not a copy
        assert isinstance(reply_buffer(y), bytes if transport == "inline" else mmap.mmap)
        z = c.forward(0, x, expert_ids=ids, expert_weights=w, copy=True, **send_kw(dtype))
        assert z.flags.writeable and np.array_equal(z, y)
        if dtype != "bf16":  # numpy's DLPack has no bfloat16
            d = c.forward(0, DLPackOnly(x), expert_ids=DLPackOnly(ids), expert_weights=w, **send_kw(dtype))
            assert isinstance(d, np.ndarray) and np.array_equal(d, y)
        wide = np.zeros((9, 2 * SPEC.d), x.dtype)
        wide[:, ::2] = x  # non-contiguous: one copy, the same result
        assert np.array_equal(c.forward(0, wide[:, ::2], expert_ids=ids, expert_weights=w, **send_kw(dtype)), y)


def test_forward_stream_answers_in_order(shared_daemon):
    rng = np.random.default_rng(41)
    cases, items = [], []
    for i, dtype in enumerate(("f32", "bf16", "f16", "bf16u16", "f32", "bf16")):
        x, ids, w, ref = case(rng, 1 + i, dtype, layer=i % 2)
        cases.append((ref, dtype))
        items.append(dict(layer=i % 2, hidden=x, expert_ids=ids, expert_weights=w, request_id=f"s{i}",
                          return_info=i % 3 == 0, **send_kw(dtype)))
    with shared_daemon.client(timeout=30) as c:
        outs = list(c.forward_stream(iter(items)))
    assert len(outs) == len(items)
    for i, (out, (ref, dtype)) in enumerate(zip(outs, cases)):
        if i % 3 == 0:
            assert out.request_id == f"s{i}" and out.timings.batch_tokens >= 1 + i
            out = out.output
        O.check(out, ref, dtype, f"stream item {i}")


def test_forward_stream_errors_come_in_place(shared_daemon):
    rng = np.random.default_rng(42)
    good = [dict(layer=0, hidden=case(rng, 2, "f32")[0], strategy="topk") for _ in range(3)]
    with shared_daemon.client(timeout=30) as c:
        got = []
        with pytest.raises(MoEError) as e:
            for y in c.forward_stream(good[:1] + [dict(layer=9, hidden=good[0]["hidden"])] + good[1:]):
                got.append(y)
        assert len(got) == 1 and e.value.code_name == "NOT_FOUND" and "layer 9" in e.value.message
        got = []
        with pytest.raises(ValueError, match="float64"):
            for y in c.forward_stream(good[:2] + [dict(layer=0, hidden=np.zeros((2, SPEC.d)))] + good):
                got.append(y)
        assert len(got) == 2
        assert c.health() == "SERVING"


def test_aio_client_forward_stream_and_gather(shared_daemon):
    rng = np.random.default_rng(43)
    cases = [case(rng, 1 + i % 5, ("f32", "bf16", "f16")[i % 3], layer=i % 2) for i in range(12)]

    async def items():
        for i, (x, ids, w, _) in enumerate(cases):
            await asyncio.sleep(0)
            yield dict(layer=i % 2, hidden=x, expert_ids=ids, expert_weights=w)

    async def main():
        async with aio.MoEClient(shared_daemon.address, timeout=30) as c:
            assert await c.health() == "SERVING"
            assert [li.index for li in (await c.info()).layers] == [0, 1]
            gathered = await asyncio.gather(*(c.forward(i % 2, x, expert_ids=ids, expert_weights=w)
                                              for i, (x, ids, w, _) in enumerate(cases)))
            streamed = [y async for y in c.forward_stream(items())]
            with pytest.raises(MoEError) as e:
                await c.forward(9, cases[0][0], strategy="topk")
            assert e.value.code_name == "NOT_FOUND"
            return gathered, streamed

    gathered, streamed = asyncio.run(main())
    for outs in (gathered, streamed):
        for i, (y, (x, _, _, ref)) in enumerate(zip(outs, cases)):
            O.check(y, ref, ("f32", "bf16", "f16")[i % 3], f"aio {i}")


def no_doomed_retry(e, policy):
    """Checks a call that failed on a full queue against what its client knew at each failure:
    every retry it made fitted before the deadline (its wait plus as long as the failed attempt
    took), and it stopped at the first failure after which none could, with the UNAVAILABLE it got.
    True when the call ended that way after more than one attempt; False when the scheduler made
    an attempt outlast its predecessor's time and the deadline passed meanwhile (DEADLINE_EXCEEDED:
    not a doomed retry, nothing to check), or when no retry could fit at all."""
    decisions = policy.decisions
    assert e.attempts == len(decisions), (e, decisions)
    *retried, last = decisions
    for d in retried:
        assert d.code == grpc.StatusCode.UNAVAILABLE and d.wait is not None, d
        assert d.now + d.wait + d.took < d.deadline, f"a retry that could not end in time: {d}"
    assert last.wait is None, last
    if e.code_name == "DEADLINE_EXCEEDED":
        return False
    assert e.code_name == "UNAVAILABLE" and "queue is full" in e.message, e
    assert last.failures < policy.max_attempts, "it stopped for its attempts, not for the deadline"
    assert last.now + last.took + policy.longest_wait(last.failures) >= last.deadline, \
        f"it stopped though a retry could still end in time: {last}"
    return e.attempts > 1


def test_retry_waits_out_a_full_queue(daemon):
    d = daemon("--synthetic", DEFAULT_SPEC, *HOLD)
    port = d.metrics_port
    rng = np.random.default_rng(44)
    x, ids, w, ref = case(rng, FULL, "f32")
    small = dict(expert_ids=ids[:4], expert_weights=w[:4])
    before = server_counts(port)
    holder = d.client(timeout=60, retry=None)

    def hold():  # fills the queue until the holder's channel closes
        with pytest.raises(MoEError) as e:
            holder.forward(0, x[:4], **small)
        assert e.value.code_name == "CANCELLED", e.value

    held = Worker(hold)
    held.start()
    wait_counts(port, before, {"queued": 1})
    with d.client(timeout=30, retry=None) as c:
        with pytest.raises(MoEError) as e:
            c.forward(0, x, expert_ids=ids, expert_weights=w)
        assert e.value.code_name == "UNAVAILABLE" and "queue is full" in e.value.message and e.value.attempts == 1
    # A deadline the full queue outlasts: no doomed retry. Each call is checked; one that made more
    # than one attempt and ended UNAVAILABLE (almost always the first) shows the bound at work.
    for _ in range(20):
        policy = Recorded(max_attempts=40, initial_backoff=0.05, max_backoff=0.25)
        with d.client(timeout=0.5, retry=policy) as c:
            with pytest.raises(MoEError) as e:
                c.forward(0, x, expert_ids=ids, expert_weights=w)
        if no_doomed_retry(e.value, policy):
            break
    else:
        pytest.fail(f"20 calls never ended UNAVAILABLE after a retry; the last: {policy.decisions}")
    # A patient call waits the hold out: refused at least once, then answered once the hold ends.
    policy, retried = patient(), {}

    def retry():
        with d.client(timeout=60, retry=policy) as c:
            retried["y"] = c.forward(0, x, expert_ids=ids, expert_weights=w)

    waiter = Worker(retry)
    waiter.start()
    assert policy.refused.wait(60), "the patient call was never refused"
    holder.close()
    held.join(60)
    waiter.join(60)
    O.check(retried["y"], ref, "f32", "retried")
    assert all(dec.code == grpc.StatusCode.UNAVAILABLE for dec in policy.decisions), policy.decisions


def test_aio_retry_waits_out_a_full_queue(daemon):
    d = daemon("--synthetic", DEFAULT_SPEC, *HOLD)
    port = d.metrics_port
    x, ids, w, ref = case(np.random.default_rng(45), FULL, "bf16")
    policy = patient()

    async def main():
        before = await asyncio.to_thread(server_counts, port)
        async with aio.MoEClient(d.address, timeout=60, retry=None) as holder, \
                aio.MoEClient(d.address, timeout=60, retry=policy) as c:
            first = asyncio.ensure_future(holder.forward(0, x[:4], expert_ids=ids[:4], expert_weights=w[:4]))
            await asyncio.to_thread(wait_counts, port, before, {"queued": 1})
            with pytest.raises(MoEError, match="queue is full"):
                await holder.forward(0, x, expert_ids=ids, expert_weights=w)
            retried = asyncio.ensure_future(c.forward(0, x, expert_ids=ids, expert_weights=w))
            assert await asyncio.to_thread(policy.refused.wait, 60), "the retried call was never refused"
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            streamed = [y async for y in c.forward_stream([dict(layer=0, hidden=x, expert_ids=ids,
                                                                expert_weights=w)] * 2)]
            return await retried, streamed

    retried, streamed = asyncio.run(main())
    for y in [retried] + streamed:
        O.check(y, ref, "bf16", "aio retried")
    assert all(dec.code == grpc.StatusCode.UNAVAILABLE for dec in policy.decisions), policy.decisions


def test_retries_against_a_draining_daemon_are_bounded(daemon):
    """While a daemon drains (a call still in flight) a new call is refused UNAVAILABLE: it is
    retried as the policy says and then fails with the drain's own message; the call that was
    waiting in a merge window is answered. A held call (HEADERS without a message) keeps the
    drain going until the test has seen all that."""
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--max-delay-us", "60000000",
               "--min-batch-requests", "2", *ANY_METRICS_PORT)
    port = d.metrics_port
    rng = np.random.default_rng(46)
    x, ids, w, ref = case(rng, 4, "bf16")
    answered = []
    busy = d.client(timeout=120, retry=None)
    in_flight = Worker(lambda: answered.append(busy.forward(0, x, expert_ids=ids, expert_weights=w)))
    before = server_counts(port)
    with d.client(timeout=60, retry=RetryPolicy(max_attempts=3, initial_backoff=0.02, max_backoff=0.05)) as c:
        assert c.health() == "SERVING"  # connected before the drain
        in_flight.start()
        wait_counts(port, before, {"queued": 1})
        held = held_call(d)
        d.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while c.health() != "NOT_SERVING":
            assert time.monotonic() < deadline, "health did not say NOT_SERVING after SIGTERM"
            time.sleep(0.01)
        with pytest.raises(MoEError) as e:
            c.forward(0, x, expert_ids=ids, expert_weights=w)
    assert e.value.code_name == "UNAVAILABLE" and "draining" in e.value.message and e.value.attempts == 3
    in_flight.join(120)
    busy.close()
    held.release()
    assert wait_exit(d) == 0, log_of(d)
    assert len(answered) == 1
    O.check(answered[0], ref, "bf16", "the call in flight")


def test_options_keepalive_and_deadlines(daemon):
    d = daemon("--synthetic", DEFAULT_SPEC, *HOLD)
    x, ids, w, ref = case(np.random.default_rng(47), FULL, "f32")
    with MoEClient(d.address, options=[("grpc.max_receive_message_length", 256)], retry=None) as c:
        with pytest.raises(MoEError) as e:  # the caller's channel argument wins over the client's
            c.forward(0, x, expert_ids=ids, expert_weights=w, timeout=30)
        assert e.value.code_name == "RESOURCE_EXHAUSTED"
    with MoEClient(d.address, keepalive=10, timeout=30) as c:
        O.check(c.forward(0, x, expert_ids=ids, expert_weights=w), ref, "f32", "keepalive")
        with pytest.raises(MoEError) as e:  # held in the merge window (a minute) past its deadline
            c.forward(0, x[:4], expert_ids=ids[:4], expert_weights=w[:4], timeout=0.2)
        assert e.value.code_name == "DEADLINE_EXCEEDED"
    with pytest.raises(ValueError, match="10 seconds"):
        MoEClient(d.address, keepalive=1)


def test_readme_python_examples(shared_daemon, capsys):
    """README's Python examples run as written (the asyncio one, which needs torch and a worker's
    requests, is compiled)."""
    examples = (ROOT / "README.md").read_text().split("## Examples", 1)[1].split("```python\n")
    blocking, asyncio_one = (e.split("```", 1)[0] for e in examples[1:3])
    exec(compile(blocking.replace('"127.0.0.1:50051"', repr(shared_daemon.address)), "README.md", "exec"), {})
    assert "SERVING" in capsys.readouterr().out
    compile(asyncio_one, "README.md", "exec")


def test_bench_runs(shared_daemon, tmp_path):
    """bench/daemon/bench_client.py (the Python client beside moed-load) gives its figures."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "daemon" / "bench_client.py"), "--target",
                        shared_daemon.address, "--load", str(BUILD / "client" / "c" / "moed-load"), "--tokens",
                        "4", "--requests", "30", "--rounds", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = json.loads(out.read_text())
    assert row["tokens"] == 4 and row["moed_load_p50_ms"] > 0 and row["python_p50_ms"] > 0
    assert f"{row['python_p50_ms']:.3f}" in r.stdout


# ---- torch, where it is installed (the GPU machine) ----------------------------------------------

def torch_devices():
    torch = pytest.importorskip("torch")
    return torch, ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_torch_tensors_give_the_numpy_results(shared_daemon):
    torch, devices = torch_devices()
    rng = np.random.default_rng(48)
    with shared_daemon.client(timeout=30) as c:
        for dtype, tdtype in (("f32", torch.float32), ("f16", torch.float16), ("bf16u16", torch.bfloat16)):
            x, ids, w, ref = case(rng, 7, dtype)
            y_np = c.forward(0, x, expert_ids=ids, expert_weights=w, **send_kw(dtype))
            t = torch.from_numpy(x.view(np.int16) if dtype == "bf16u16" else x)
            t = t.view(torch.bfloat16) if dtype == "bf16u16" else t
            for device in devices:
                y = c.forward(0, t.to(device), expert_ids=torch.from_numpy(ids).to(device),
                              expert_weights=torch.from_numpy(w).to(device))
                assert y.dtype == tdtype and y.device.type == device
                got = y.cpu()
                got = got.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16u16" else got.numpy()
                assert np.array_equal(got, y_np), (dtype, device)  # the same bits as the numpy path
