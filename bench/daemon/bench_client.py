"""The Python client's latency beside moed-load's, against the same running daemon, in one run.

For each T, --rounds times: moed-load (C, one call in flight) for --requests calls after a warm-up,
then the Python client (MoEClient.forward in a loop, one call in flight) for as many; the figures
are the medians over the rounds of each one's p50 and of its client CPU time per call (moed-load's
own figure; the Python process's, gRPC's threads included), so both see the same drift of a
shared machine.
Both send bf16 hidden states with uniform expert choice (the layer's top_k) to the first layer the
daemon holds. The Python input kind is --input: numpy (ml_dtypes.bfloat16), torch (a CPU tensor)
or torch-cuda.

usage: python3 bench/daemon/bench_client.py --target ADDR --load PATH/moed-load [--tokens 8,2048]
                           [--requests 2000] [--rounds 3] [--input numpy|torch|torch-cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from moed import MoEClient


def load_p50(load: str, target: str, tokens: int, requests: int) -> dict:
    """moed-load's figures for one level: p50/p99 ms and the server's compute p50."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "load.json")
        cmd = [load, "--target", target, "--concurrency", "1", "--tokens", str(tokens),
               "--requests", str(requests), "--warmup", "1", "--dtype", "bf16", "--no-progress",
               "--json", path]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"moed-load failed ({r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}")
        with open(path) as f:
            rep = json.load(f)
    rep = rep["levels"][0] if isinstance(rep, dict) and "levels" in rep else rep
    rep = rep[0] if isinstance(rep, list) else rep
    return {"p50_ms": rep["latency_ms"]["p50"], "p99_ms": rep["latency_ms"]["p99"],
            "cpu_us_per_call": rep["client"]["cpu_us_per_call"]}


def make_input(kind: str, x32: np.ndarray):
    if kind == "numpy":
        import ml_dtypes

        return x32.astype(ml_dtypes.bfloat16)
    import torch

    t = torch.from_numpy(x32).to(torch.bfloat16)
    return t.cuda() if kind == "torch-cuda" else t


def python_p50(target: str, tokens: int, requests: int, kind: str) -> dict:
    with MoEClient(target, timeout=60) as c:
        layer = c.info().layers[0]
        rng = np.random.default_rng(tokens)
        x = make_input(kind, rng.standard_normal((tokens, layer.d_model)).astype(np.float32))
        ids = np.stack([rng.permutation(layer.num_experts)[:layer.top_k] for _ in range(tokens)])
        ids = ids.astype(np.int32)
        w = np.full(ids.shape, 1.0 / layer.top_k, np.float32)
        # a CUDA output counts once its host-to-device copy is done
        sync = (lambda y: sys.modules["torch"].cuda.synchronize()) if kind == "torch-cuda" else (lambda y: y)
        warm_until = time.perf_counter() + 1.0
        while time.perf_counter() < warm_until:
            sync(c.forward(layer.index, x, expert_ids=ids, expert_weights=w))
        lat = np.empty(requests)
        cpu = time.process_time()
        for i in range(requests):
            t0 = time.perf_counter()
            sync(c.forward(layer.index, x, expert_ids=ids, expert_weights=w))
            lat[i] = time.perf_counter() - t0
        cpu = time.process_time() - cpu
    return {"p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "cpu_us_per_call": cpu / requests * 1e6}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--load", required=True, help="the moed-load binary")
    p.add_argument("--tokens", default="8,2048", help="comma-separated T values (default %(default)s)")
    p.add_argument("--requests", type=int, default=2000, help="measured calls per line")
    p.add_argument("--rounds", type=int, default=3, help="alternations of moed-load and Python per T")
    p.add_argument("--input", choices=("numpy", "torch", "torch-cuda"), default="numpy")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    rows = []
    print(f"{'T':>6} {'moed-load p50 ms':>17} {'python p50 ms':>14} {'diff ms':>8} {'ratio':>6} "
          f"{'moed-load cpu us':>17} {'python cpu us':>14}")
    for T in (int(t) for t in args.tokens.split(",")):
        load, py = [], []
        for _ in range(args.rounds):
            load.append(load_p50(args.load, args.target, T, args.requests))
            py.append(python_p50(args.target, T, args.requests, args.input))
        med = {k: float(np.median([r[k2] for r in runs])) for k, runs, k2 in (
            ("moed_load_p50_ms", load, "p50_ms"), ("python_p50_ms", py, "p50_ms"),
            ("moed_load_cpu_us", load, "cpu_us_per_call"), ("python_cpu_us", py, "cpu_us_per_call"))}
        a, b = med["moed_load_p50_ms"], med["python_p50_ms"]
        rows.append({"tokens": T, "input": args.input, "moed_load": load, "python": py, **med,
                     "diff_ms": b - a, "ratio": b / a})
        print(f"{T:>6} {a:>17.3f} {b:>14.3f} {b - a:>8.3f} {b / a:>6.2f} "
              f"{med['moed_load_cpu_us']:>17.0f} {med['python_cpu_us']:>14.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
