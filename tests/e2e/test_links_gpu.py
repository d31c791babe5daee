"""Links on GPUs (docs/fleets.md, "Over NCCL"): only on a GPU run (MOED_TEST_COMPUTE, tools/gpu/run-on-gpu.sh
links), with the CUDA build's link-bench (bench/daemon/link_bench.c) beside MOED_BIN (or at MOED_LINK_BENCH).

The caller is on GPU 0 and the daemons on the others (GPU 1, 2, 3; with fewer GPUs they share them):
- one daemon, and fleets of two and three expert shards, in f32, f16 and bf16 and T = 1, 37, 300:
  every call's output over links the same bits as over gRPC for the same daemons, deterministic
  from call to call, and within the fleet's bound of one daemon holding every expert;
- a link that closes while another idles (its daemon waiting on the GPU for that link's next
  header): the close is logged at once, and a third caller's link and gRPC calls are answered while
  the idle one still waits;
- the three-shard fleet with NCCL's socket transport forced in every process (the path two hosts
  take): the same bits;
- a shard killed with SIGKILL while a caller calls as fast as it can: with a replica of that shard,
  calls go on over the replica and none answers wrong; without one, every call after the kill fails
  UNAVAILABLE naming the daemon killed, none answers wrong, and none hangs;
- the Python client (moed.Links) with torch tensors on the current stream: the same bits as the
  gRPC fleet, and the output left alone by a call that fails.
"""
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import CUDA_MODE, MOED_BIN

SPEC = "layers=2,d=512,ff=256,experts=16,topk=4,act=swiglu,shared=1,shared_ff=256,dtype=bf16,seed=5"
DRIVER = Path(os.environ.get("MOED_LINK_BENCH", MOED_BIN.parent / "link-bench"))
SOCKET = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
# per token, the fleet's rounding per shard beside one daemon's (docs/fleets.md, Numerics): u (S + 2)
UNIT = {"f32": 2.0 ** -23, "f16": 2.0 ** -11, "bf16": 2.0 ** -8}

pytestmark = pytest.mark.skipif(not CUDA_MODE or not DRIVER.exists(),
                                reason="needs a GPU run (MOED_TEST_COMPUTE) and link-bench")


def gpus():
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return max(1, sum(1 for line in out.splitlines() if line.startswith("GPU ")))


def gpu(i):
    """The daemon GPU for the i-th daemon: 1, 2, 3 ... leaving GPU 0 to the caller where there are more."""
    n = gpus()
    return 1 + i % (n - 1) if n > 1 else 0


def shards(n, experts=16):
    return [f"{i * experts // n}-{(i + 1) * experts // n - 1}" for i in range(n)]


def start(daemon, i, experts=None, env=None):
    args = ["--synthetic", SPEC, "--backend", "cuda", "--devices", str(gpu(i))]
    if experts:
        args += ["--experts", experts]
    return daemon(*args, env=env)


def stacks(pid):
    """Every thread's stack of process pid, by cuda-gdb (the GPU machine has no gdb), for a hang's report."""
    debugger = shutil.which("cuda-gdb") or shutil.which("gdb")
    if not debugger:
        return "(no debugger to show its stacks)"
    r = subprocess.run([debugger, "-batch", "-p", str(pid), "-ex", "thread apply all bt"],
                       capture_output=True, text=True, timeout=120)
    return r.stdout[-12000:] + r.stderr[-2000:]


def daemon_stacks(d):
    """The thread stacks daemon d logged last (SIGUSR2)."""
    lines = d.log().splitlines()
    last = max((i for i, ln in enumerate(lines) if 'msg="thread stacks"' in ln), default=None)
    if last is None:
        return "(none logged)"
    first = last
    while first > 0 and 'msg="thread stack"' in lines[first - 1]:
        first -= 1
    return "\n".join(lines[first:last + 1])[-12000:]


def finish(p, targets, timeout):
    """link-bench p's report (its exit code, its last JSON line, its stderr) once it ends; a test failure
    with its threads' stacks and the daemons' logs if it has not ended in timeout s."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        where = stacks(p.pid)
        p.kill()
        err = p.communicate()[1]
        for d in targets:  # each daemon logs its threads' stacks (moed_stacks, docs/operations.md)
            if d.proc.poll() is None:
                d.send_signal(signal.SIGUSR2)
        time.sleep(3)
        logs = "\n".join(f"--- {d.address}:\n{d.log()[-3000:]}\nits threads:\n{daemon_stacks(d)}"
                         for d in targets)
        pytest.fail(f"link-bench did not end in {timeout} s: {' '.join(p.args)}\nits stacks:\n{where}\n"
                    f"its stderr:\n{err[-3000:]}\nthe daemons' logs:\n{logs}")
    assert out.strip(), f"link-bench printed nothing (exit {p.returncode}): {err[-3000:]}"
    return p.returncode, json.loads(out.strip().splitlines()[-1]), err


def drive(targets, *args, env=None, timeout=240):
    cmd = [str(DRIVER), "--target", ",".join(d.address for d in targets), "--device", "0", *map(str, args)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})})
    return finish(p, targets, timeout)


# send: "auto" sends these fleets' shards every token (they would skip a tenth of the tokens on
# average), "chosen" each shard only its tokens: both must give the gRPC fleet's bits
@pytest.mark.parametrize("n,send", [(1, "auto"), (2, "chosen"), (3, "auto"), (3, "chosen")])
def test_links_match_grpc_and_one_daemon(daemon, n, send):
    whole = start(daemon, 0)
    fleet = [whole] if n == 1 else [start(daemon, i, e) for i, e in enumerate(shards(n))]
    for dtype in ("bf16", "f32", "f16"):
        for T in (1, 37, 300):
            rc, r, err = drive(fleet, "--tokens", T, "--top-k", 4, "--dtype", dtype, "--calls", 5,
                               "--warmup", 1, "--grpc", "--ref", whole.address, "--layer", T % 2,
                               "--send", send)
            where = f"{n} daemon(s), send {send}, {dtype}, T={T}: {r} {err[-2000:]}"
            assert rc == 0 and r["links"]["ok"] == 5 and r["links"]["wrong"] == 0, where
            assert r["same_bits"] is True, where
            assert r["ref_worst_token"] <= UNIT[dtype] * (n + 2) * 4, where


def wait_logged(d, msg, count, timeout):
    """Waits until daemon d's log holds `count` lines of msg; a test failure with its log if not."""
    deadline = time.monotonic() + timeout
    while d.log().count(f'msg="{msg}"') < count:
        if time.monotonic() > deadline:
            pytest.fail(f"{d.address} did not log {count} x {msg!r} in {timeout} s:\n{d.log()[-3000:]}")
        time.sleep(0.1)


def test_a_close_while_another_link_idles_holds_off_nothing(daemon):
    """A link that closes while another one idles (its daemon waiting on the GPU for that link's next
    header) frees nothing then (docs/fleets.md, "What waits for an idle link"): its close is logged at
    once, and a third caller's link and gRPC calls are answered while the idle link still waits. Freed
    at once (NCCL's abort), the close waited for the idle link's next call, and could hold off the
    daemon's other CUDA calls as long."""
    d = start(daemon, 0)
    idle = subprocess.Popen([str(DRIVER), "--target", d.address, "--device", "0", "--tokens", "8",
                             "--top-k", "4", "--calls", "2", "--warmup", "0", "--hold", "40"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_logged(d, "link opened", 1, 60)
    time.sleep(2)  # its calls made: the daemon waits for its next header
    rc, r, err = drive([d], "--tokens", 8, "--top-k", 4, "--calls", 3, "--warmup", 0, timeout=60)
    assert rc == 0 and r["links"]["ok"] == 3, (r, err[-2000:])
    wait_logged(d, "link closed", 1, 15)
    rc, r, err = drive([d], "--tokens", 8, "--top-k", 4, "--calls", 3, "--warmup", 0, "--grpc",
                       timeout=25)
    assert rc == 0 and r["links"]["ok"] == 3 and r["same_bits"] is True, (r, err[-2000:])
    assert idle.poll() is None, "the idle link ended before the others were checked: --hold too short"
    rc, r, err = finish(idle, [d], 60)
    assert rc == 0 and r["links"]["ok"] == 2, (r, err[-2000:])
    wait_logged(d, "link closed", 3, 15)


def test_links_over_sockets(daemon):
    whole = start(daemon, 0)
    fleet = [start(daemon, i, e, env=SOCKET) for i, e in enumerate(shards(3))]
    rc, r, err = drive(fleet, "--tokens", 300, "--top-k", 4, "--dtype", "bf16", "--calls", 5,
                       "--grpc", "--ref", whole.address, env=SOCKET)
    assert rc == 0 and r["same_bits"] is True and r["links"]["wrong"] == 0, (r, err[-2000:])
    assert r["ref_worst_token"] <= UNIT["bf16"] * 5 * 4, r


def kill_under_load(daemon, fleet, victim, timeout_s):
    """Runs the driver flat out over fleet for 8 s, SIGKILLs victim 4 s in (its links open by then);
    the driver's report."""
    cmd = [str(DRIVER), "--target", ",".join(d.address for d in fleet), "--device", "0", "--tokens", "64",
           "--top-k", "4", "--calls", "1000000", "--duration", "8", "--warmup", "3", "--keep-going",
           "--timeout", str(timeout_s)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(4)
    victim.proc.send_signal(signal.SIGKILL)
    victim.returncode = victim.proc.wait()  # the fixture stops only the daemons still running
    _, r, err = finish(p, fleet, 120)
    return r, err


def test_shard_killed_fails_over_to_its_replica(daemon):
    cut = shards(2)
    first = start(daemon, 0, cut[0])
    replicas = [start(daemon, 1, cut[1]), start(daemon, 2, cut[1])]
    r, err = kill_under_load(daemon, [first, *replicas], replicas[0], 2)
    links = r["links"]
    assert links["wrong"] == 0, (r, err[-2000:])
    assert links["ok"] > 0, r
    # a call in flight when the daemon died may fail, naming it; the calls after go to the replica
    for status, f in links["failed"].items():
        assert status == "UNAVAILABLE" and replicas[0].address in f["first"], r
    assert sum(f["count"] for f in links["failed"].values()) <= 3, r


def test_shard_killed_without_replica_fails_naming_it(daemon):
    fleet = [start(daemon, i, e) for i, e in enumerate(shards(2))]
    t0 = time.monotonic()
    r, err = kill_under_load(daemon, fleet, fleet[1], 2)
    links = r["links"]
    assert links["wrong"] == 0 and links["ok"] > 0, (r, err[-2000:])
    assert set(links["failed"]) == {"UNAVAILABLE"}, r
    assert fleet[1].address in links["failed"]["UNAVAILABLE"]["first"], r
    assert time.monotonic() - t0 < 100, "calls to a dead shard must fail, not hang"


def test_python_links_with_torch(daemon):
    torch = pytest.importorskip("torch")
    import moed

    fleet = [start(daemon, i, e) for i, e in enumerate(shards(2))]
    targets = [d.address for d in fleet]
    g = torch.Generator(device="cuda:0").manual_seed(3)
    with torch.cuda.device(0):
        x = torch.randn(37, 512, device="cuda:0", generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(16, device="cuda:0", generator=g)[:4] for _ in range(37)]).int()
        w = torch.rand(37, 4, device="cuda:0", generator=g) + 0.05
        with moed.Links(targets, device=0, max_tokens=64, max_top_k=4) as links:
            assert "nccl" in links.describe()
            y = links.forward(1, x, ids, w)
            torch.cuda.synchronize()
            bad = torch.full_like(x, 7.0)
            with pytest.raises(moed.MoEError) as e:  # layer 9 is not served: refused by the daemons
                links.forward(9, x, ids, w, out=bad)
            assert e.value.code == "INVALID_ARGUMENT" or "layer" in str(e.value), e.value
            assert bool((bad == 7.0).all()), "a failed call wrote its output"
            again = links.forward(1, x, ids, w)  # the links go on after a refused call
        assert torch.equal(y, again)
    import ml_dtypes

    with moed.connect(targets) as c:  # the gRPC fleet, the same inputs from the host
        want = c.forward(1, x.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16),
                         expert_ids=ids.cpu().numpy(), expert_weights=w.cpu().numpy())
    assert np.array_equal(y.cpu().view(torch.int16).numpy(), np.asarray(want).view(np.int16))


def test_links_captured_in_a_cuda_graph(daemon):
    """A call captured by torch.cuda.graph, replayed with new inputs, gives the blocking call's bits
    on the same inputs (host calls between replays keep the links in step); a shard killed between
    replays makes the next replay end (not hang), counted, its output untouched."""
    torch = pytest.importorskip("torch")
    import moed

    fleet = [start(daemon, i, e) for i, e in enumerate(shards(2))]
    g = torch.Generator(device="cuda:0").manual_seed(11)

    def inputs(T=37):
        x = torch.randn(T, 512, device="cuda:0", generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(16, device="cuda:0", generator=g)[:4] for _ in range(T)]).int()
        return x, ids, torch.rand(T, 4, device="cuda:0", generator=g) + 0.05

    with torch.cuda.device(0):
        x, ids, w = inputs()
        out = torch.empty_like(x)
        # "chosen": the blocking calls below plan each shard's tokens, the replays send all
        links = moed.Links([d.address for d in fleet], device=0, max_tokens=64, max_top_k=4, send="chosen")
        links.forward(1, x, ids, w)  # outside the capture first, as torch's own warm-up does
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            links.forward(1, x, ids, w, out=out)
        for _ in range(3):
            nx, nids, nw = inputs()
            x.copy_(nx), ids.copy_(nids), w.copy_(nw)
            graph.replay()
            torch.cuda.synchronize()
            want = links.forward(1, nx, nids, nw)  # planned, each shard only its tokens
            assert torch.equal(out, want), "a replay's output is not the blocking call's"
        assert links.failures() == 0
        fleet[1].proc.send_signal(signal.SIGKILL)
        fleet[1].returncode = fleet[1].proc.wait()
        out.fill_(7.0)
        graph.replay()
        done = torch.cuda.Event()
        done.record()
        t0 = time.monotonic()
        while not done.query():
            assert time.monotonic() - t0 < 60, "a replay waited on a daemon that is gone"
            time.sleep(0.01)
        assert bool((out == 7.0).all()), "a failed replay wrote its output"
        assert links.failures() >= 1
        del graph  # before close: NCCL releases the communicators only then
        torch.cuda.synchronize()
        links.close()
