"""The doorbell beside the gRPC shared-memory path, on this machine's CPU backend and a tiny layer
(docs/doorbell.md quotes its table): one caller, one call at a time, every tensor and the output in
one shared-memory region, the same tensors each way.

  doorbell     a call written into a ring slot and rung (tests/e2e/ring.py's writer), its `done`
               waited for in a busy loop that yields the core: what the same-host path costs
  grpc-shm     Forward over gRPC with every tensor in the region, from Python (the generated stubs)
  moed-load    Forward over gRPC with tensors in regions, from C (moed-load --transport shm): the
               gRPC path's own floor

Each reports p50 and p99 of the round trip, and the server's compute time per call (the
completion's compute_us, the reply's timings) so the transport's share is the rest.

usage: python3 bench/daemon/bench_doorbell.py [--build build] [--tokens 1,8,64] [--calls 2000]
       [--md FILE] [--json FILE]
"""
import argparse
import json
import os
import pathlib
import statistics
import struct
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
sys.path.insert(0, str(ROOT / "bench" / "daemon"))
import grpc  # noqa: E402
import numpy as np  # noqa: E402
from bench_daemon import Moed  # noqa: E402
from regions import Session, Shm, unary  # noqa: E402
from ring import Ring  # noqa: E402

from moed._proto.moed.v1 import moed_pb2 as pb  # noqa: E402

SPEC = "layers=1,d=64,ff=96,experts=8,topk=2,act=swiglu,dtype=bf16,seed=1"
D, E, K = 64, 8, 2


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


class Placed:
    """T tokens of f32 hidden, ids and weights in the region, and room for the output."""

    def __init__(self, shm, region, T, at):
        rng = np.random.default_rng(T)
        x = rng.standard_normal((T, D)).astype(np.float32)
        ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
        w = rng.uniform(0, 1, (T, K)).astype(np.float32)
        self.refs = {}
        for name, a in (("hidden", x), ("ids", ids), ("weights", w), ("output", x)):
            shm.put(at, a)
            self.refs[name] = (region, at, a.nbytes)
            at = (at + a.nbytes + 4095) // 4096 * 4096
        self.T, self.end = T, at

    def request(self):
        r = {k: pb.RegionRef(region=v[0], offset=v[1], length=v[2]) for k, v in self.refs.items()}
        q = pb.ForwardRequest(layer=0, hidden=pb.Tensor(dtype=pb.F32, shape=[self.T, D], region=r["hidden"]))
        q.experts.CopyFrom(pb.ExpertChoice(expert_ids=pb.Tensor(dtype=pb.I32, shape=[self.T, K], region=r["ids"]),
                                           expert_weights=pb.Tensor(dtype=pb.F32, shape=[self.T, K],
                                                                    region=r["weights"])))
        q.output.CopyFrom(r["output"])
        return q


def doorbell(ring, placed, calls):
    """Round trips of `calls` calls through slot 0, done awaited in a busy loop that yields
    (seconds), and the server's compute_us of each."""
    ring.write(0, 0, pb.F32, placed.T, K, placed.refs["hidden"], placed.refs["ids"], placed.refs["weights"],
               placed.refs["output"])
    mem, done_at = ring.shm.map, ring.slot_at(0) + 256
    rtt, compute = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        ticket = ring.ring(0)
        while struct.unpack_from("<I", mem, done_at)[0] != ticket:
            os.sched_yield()  # a spinning caller on a small machine must leave the compute a core
        rtt.append(time.perf_counter() - t0)
        c = ring.completion(0)
        assert c.status == 0, c.message
        compute.append(c.compute_us)
    return rtt, compute


def grpc_shm(ch, placed, calls):
    fwd = unary(ch, "Forward", pb.ForwardRequest, pb.ForwardResponse)
    q = placed.request()
    rtt, compute = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        r = fwd(q)
        rtt.append(time.perf_counter() - t0)
        compute.append(r.timings.compute_us)
    return rtt, compute


def moed_load(bins, addr, T, calls, json_path):
    """moed-load's p50 and p99 for one caller with tensors in regions (--transport shm)."""
    subprocess.run([os.path.join(bins, "moed-load"), "--target", addr, "--transport", "shm", "--tokens", str(T),
                    "--dtype", "f32", "--requests", str(calls), "--warmup", "0.5", "--no-progress",
                    "--json", json_path], check=True, capture_output=True)
    lat = json.load(open(json_path))["levels"][0]["latency_ms"]
    return {"p50_us": 1000 * lat["p50"], "p99_us": 1000 * lat["p99"]}


def summary(rtt, compute):
    return {"p50_us": 1e6 * statistics.median(rtt), "p99_us": 1e6 * percentile(rtt, 99),
            "compute_us": statistics.median(compute), "calls": len(rtt)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--md")
    ap.add_argument("--json")
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    bins = tempfile.mkdtemp(prefix="moed-bench-bin-")  # moed and moed-load side by side, as Moed wants
    for name, sub in (("moed", "server"), ("moed-load", "client/c"), ("moectl", "client/c")):
        os.symlink(os.path.join(a.build, sub, name), os.path.join(bins, name))
    logs = tempfile.mkdtemp(prefix="moed-bench-doorbell-")
    d = Moed(bins, ["--synthetic", SPEC, "--threads", "1"], os.path.join(logs, "moed.log"))
    rows = []
    try:
        with grpc.insecure_channel(d.addr) as ch:
            shm = Shm(4 << 20)
            s = Session(ch)
            region = s.host(shm)
            ring = Ring(s, shm, region, 0, 4)
            at = 1 << 16
            for T in tokens:
                placed = Placed(shm, region, T, at)
                at = placed.end
                warm = max(a.calls // 10, 10)
                doorbell(ring, placed, warm)
                grpc_shm(ch, placed, warm)
                row = {"T": T, "doorbell": summary(*doorbell(ring, placed, a.calls)),
                       "grpc-shm": summary(*grpc_shm(ch, placed, a.calls))}
                row["moed-load"] = moed_load(bins, d.addr, T, a.calls, os.path.join(logs, f"load-{T}.json"))
                rows.append(row)
                print(json.dumps(row), flush=True)
            s.close()
            shm.close()
    finally:
        d.stop()
    lines = ["| T | doorbell p50 / p99 (us) | gRPC shm, Python p50 / p99 | gRPC shm, C (moed-load) p50 / p99 "
             "| compute (us) |", "|---|---|---|---|---|"]
    for r in rows:
        db, gs, ml = r["doorbell"], r["grpc-shm"], r["moed-load"]
        lines.append(f"| {r['T']} | {db['p50_us']:.0f} / {db['p99_us']:.0f} | {gs['p50_us']:.0f} / "
                     f"{gs['p99_us']:.0f} | {ml['p50_us']:.0f} / {ml['p99_us']:.0f} | {db['compute_us']:.0f} |")
    print("\n".join(lines))
    if a.md:
        pathlib.Path(a.md).write_text("\n".join(lines) + "\n")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1))
    subprocess.run(["rm", "-rf", bins])


if __name__ == "__main__":
    main()
