"""A fleet over NCCL links beside the same fleet over gRPC, on the GPU machine (tools/gpu/run-on-gpu.sh links).

DeepSeek-V3's layer (d 7168, ff 2048, 256 experts, top 8, one shared expert, bf16) sharded by experts
over daemons on GPUs 1 .. N (N = 2 and 3: --experts cut evenly, the shard holding expert 0 adding the
shared expert), one caller on GPU 0 (link-bench, bench/daemon/link_bench.c), and the whole layer in one daemon on
GPU 1 as the reference. For each fleet and T: the links' p50 / p90 latency and tokens/s, the slowest
shard's compute time as its daemon reports it (the kernel the call waited for), the same calls over
gRPC (the fleet client's inline path), and whether the two gave the same bits. Then the links to the
one daemon holding every expert (tokens/s of one GPU), and the 3-shard fleet again with NCCL's socket
transport forced (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 in every process: the path two hosts take).

usage: python3 bench_links.py --bin .gpu/bin [--tokens 8,128,4096] [--calls 200] [--fleets 2,3] [--json FILE]
       [--logs DIR]
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_daemon import DEEPSEEK, Moed  # noqa: E402

EXPERTS = 256


def cuts(n):
    return [f"{i * EXPERTS // n}-{(i + 1) * EXPERTS // n - 1}" for i in range(n)]


def driver(a, targets, tokens, env=None, extra=()):
    calls = a.calls if tokens < 4096 else max(a.calls // 4, 20)
    cmd = [os.path.join(a.bin, "link-bench"), "--target", ",".join(targets), "--device", "0",
           "--tokens", str(tokens), "--top-k", "8", "--dtype", "bf16", "--calls", str(calls),
           "--warmup", "10", "--seed", "7", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})},
                       timeout=300)
    sys.stderr.write(r.stderr[-2000:])
    if r.returncode != 0:
        raise RuntimeError(f"link-bench exited {r.returncode}: {r.stdout[-2000:]} {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def gpu_count():
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return max(1, sum(1 for line in out.splitlines() if line.startswith("GPU ")))


def start(a, i, experts, name, env=None):
    """Daemon i on GPU 1 + i, or sharing GPUs 1 .. n-1 where there are fewer (GPU 0 is the caller's)."""
    n = gpu_count()
    args = ["--synthetic", DEEPSEEK, "--backend", "cuda", "--devices", str(1 + i % (n - 1) if n > 1 else 0)]
    if experts:
        args += ["--experts", experts]
    return Moed(a.bin, args, os.path.join(a.logs, f"moed-{name}.log"), start_timeout=300, env=env)


def fleet_rows(a, n, env, label, results):
    daemons = [start(a, i, c, f"{label}-{n}-{i}", env) for i, c in enumerate(cuts(n))]
    try:
        for t in a.tokens:
            row = driver(a, [d.addr for d in daemons], t, env, ["--grpc"])
            row.update(fleet=n, transport=label, tokens=t)
            results.append(row)
            print(f"links {label} {n} shards T={t}: p50 {row['links']['p50_us']:.0f} us "
                  f"(slowest shard's compute p50 {row['links']['compute_p50_us']:.0f} us), "
                  f"{row['links']['tokens_per_s']:.0f} tok/s; grpc p50 {row['grpc']['p50_us']:.0f} us, "
                  f"{row['grpc']['tokens_per_s']:.0f} tok/s; same bits {row['same_bits']}", flush=True)
    finally:
        for d in daemons:
            d.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--tokens", default="8,128,4096")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--fleets", default="2,3", help="shard counts of the NVLink fleets")
    ap.add_argument("--socket", type=int, default=3, help="shards of the socket-transport fleet (0: none)")
    ap.add_argument("--json", default="links.json")
    ap.add_argument("--logs", default=".")
    a = ap.parse_args()
    a.tokens = [int(t) for t in a.tokens.split(",")]
    os.makedirs(a.logs, exist_ok=True)
    results = []
    one = start(a, 0, None, "one")
    try:
        for t in a.tokens:
            row = driver(a, [one.addr], t, extra=["--grpc"])
            row.update(fleet=1, transport="nvlink", tokens=t)
            results.append(row)
            print(f"links to one daemon T={t}: p50 {row['links']['p50_us']:.0f} us "
                  f"(compute p50 {row['links']['compute_p50_us']:.0f} us), "
                  f"{row['links']['tokens_per_s']:.0f} tok/s; grpc p50 {row['grpc']['p50_us']:.0f} us; "
                  f"same bits {row['same_bits']}", flush=True)
    finally:
        one.stop()
    for n in [int(f) for f in a.fleets.split(",") if f]:
        fleet_rows(a, n, None, "nvlink", results)
    if a.socket:
        fleet_rows(a, a.socket, {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}, "socket", results)
    verdicts(results)
    with open(a.json, "w") as f:
        json.dump(results, f, indent=1)


def verdicts(results):
    """The targets docs/fleets.md measures links by, per fleet row: the call's cost over the slowest
    daemon's compute (p50 - compute p50, against 80 us over NVLink at T <= 128) and tokens/s over
    the one daemon's at the same T (against 2.5x at T >= 4096)."""
    one = {r["tokens"]: r["links"]["tokens_per_s"] for r in results if r["fleet"] == 1 and r["transport"] == "nvlink"}
    for r in results:
        over = r["links"]["p50_us"] - r["links"]["compute_p50_us"]
        ratio = r["links"]["tokens_per_s"] / one[r["tokens"]] if one.get(r["tokens"]) else None
        r["over_compute_us"], r["vs_one_daemon"] = over, ratio
        print(f"{r['fleet']} daemon(s) {r['transport']} T={r['tokens']}: {over:.0f} us over the slowest "
              f"compute" + (f", {ratio:.2f}x one daemon's tokens/s" if ratio else ""), flush=True)


if __name__ == "__main__":
    main()
