"""A whole model on one host (tools/gpu/run-on-gpu.sh model): a DeepSeek-V3-shaped synthetic model in
FP8 (d 7168, ff 2048, 256 experts, top 8, one shared expert; --layers of its 58 MoE layers, as many as
the GPUs hold) served by one moed over --gpus GPUs, and a decode step through every layer from one
caller on GPU 0, timed at each --tokens T.

Each --placements entry is one daemon: "split" (--expert-parallel: every layer's experts over all the
GPUs, the home of each layer going round them) or "layers" (each layer whole on one GPU, by bytes).
For each: the load time (moed started to serving, with the log's generating and placing phases),
each GPU's memory used and total as GetModel reports them, then doorbell-graph --mode graph --layers
all --calls L: one caller's L stream-ordered doorbell calls (hidden, routing and output in CUDA
regions on GPU 0), one to each layer in turn, captured in one CUDA graph and replayed; a replay is
the decode step. Its outputs are checked bit for bit against the same calls made one by one from
the host. Beside it in the same run, the reference: moe-bench's kernel-only time of one such layer
(FP8, graph-replayed where the backend replays graphs) on GPU 0 alone, times L: what the step's
kernels cost on one GPU back to back, had it held them all.

usage: python3 bench_model.py --bin .gpu/bin [--gpus 4] [--layers 40] [--tokens 8,64,512]
       [--placements split,layers] [--replays 30] [--json FILE] [--logs DIR]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_daemon import Moed  # noqa: E402

SPEC = ("layers={L},d=7168,ff=2048,experts=256,topk=8,act=swiglu,dtype=bf16,seed=1,shared=1,"
        "shared_ff=2048")


def log_times(path):
    """The log's timestamps (seconds) of its first line, "weights loaded" and "layers resident"."""
    marks = {}
    for line in open(path, errors="replace"):
        m = re.match(r'ts=(\S+)Z .*msg="([^"]+)"', line)
        if not m:
            continue
        t = time.mktime(time.strptime(m.group(1)[:19], "%Y-%m-%dT%H:%M:%S")) + float("0" + m.group(1)[19:])
        marks.setdefault("start", t)
        if m.group(2) in ("weights loaded", "layers resident"):
            marks.setdefault(m.group(2), t)
    return marks


def kernel_ms(bin_dir, T, logs):
    path = os.path.join(logs, f"kernel-fp8-{T}.json")
    graph = ["--graph"] if T * 8 <= 512 else []
    subprocess.run([os.path.join(bin_dir, "moe-bench"), "--shapes", "deepseek-v3", "--weights", "fp8",
                    "--tokens", str(T), "--json", path, *graph], check=True, capture_output=True)
    return json.load(open(path))["runs"][0]["ms"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--tokens", default="8,64,512")
    ap.add_argument("--placements", default="split,layers")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--json")
    ap.add_argument("--logs", default="/tmp")
    a = ap.parse_args()
    from moed import MoEClient
    tokens = [int(t) for t in a.tokens.split(",")]
    devs = ",".join(str(i) for i in range(a.gpus))
    L = a.layers
    kms = {T: kernel_ms(a.bin, T, a.logs) for T in tokens}
    rows, loads, failures = [], [], []
    for placement in a.placements.split(","):
        flags = ["--devices", devs, "--weights", "fp8", "--max-batch-tokens", str(max(tokens))]
        if placement == "split":
            flags.append("--expert-parallel")
        log = os.path.join(a.logs, f"moed-model-{placement}.log")
        t0 = time.time()
        d = Moed(a.bin, ["--synthetic", SPEC.format(L=L), *flags], log, start_timeout=900)
        ready = time.time() - t0
        try:
            with MoEClient(d.addr) as c:
                info = c.info()
            marks = log_times(log)
            gen = marks.get("weights loaded", 0) - marks.get("start", 0)
            place = marks.get("layers resident", 0) - marks.get("weights loaded", 0)
            mem = [(dv.memory_used / 2**30, dv.memory_total / 2**30) for dv in info.devices]
            loads.append(dict(placement=placement, layers=len(info.layers), ready_s=ready, generating_s=gen,
                              placing_s=place, memory_gib=mem))
            if len(info.layers) != L:
                failures.append(f"{placement}: GetModel lists {len(info.layers)} layers, not {L}")
            for T in tokens:
                out = os.path.join(a.logs, f"step-{placement}-{T}.json")
                r = subprocess.run([os.path.join(a.bin, "doorbell-graph"), "--target", d.addr, "--mode", "graph",
                                    "--layers", "all", "--calls", str(L), "--tokens", str(T), "--replays",
                                    str(a.replays), "--json", out], capture_output=True, text=True)
                print(r.stdout.strip(), r.stderr.strip()[-2000:], flush=True)
                if r.returncode:
                    failures.append(f"{placement} T={T}: doorbell-graph exited {r.returncode}")
                    continue
                g = json.load(open(out))
                rows.append(dict(placement=placement, T=T, step_p50_ms=g["p50_ms"], step_p99_ms=g["p99_ms"],
                                 per_layer_us=g["p50_ms"] * 1e3 / L, tokens_per_s=T / (g["p50_ms"] / 1e3),
                                 kernel_ms=kms[T], verified=g["verified"]))
        finally:
            d.stop()
    print(f"A DeepSeek-V3-shaped model in FP8, {L} MoE layers, over {a.gpus} GPUs ({devs})")
    print("| placement | layers | serving after (s) | generating (s) | placing on the GPUs (s) | "
          "memory used per GPU (GiB of total) |")
    print("|---|---|---|---|---|---|")
    for r in loads:
        mem = ", ".join(f"{u:.1f}/{t:.0f}" for u, t in r["memory_gib"])
        print(f"| {r['placement']} | {r['layers']} | {r['ready_s']:.0f} | {r['generating_s']:.0f} | "
              f"{r['placing_s']:.0f} | {mem} |")
    print(f"\n| placement | T | decode step p50 (ms) | p99 (ms) | per layer (us) | tokens/s | "
          f"{L} x one layer's kernels on GPU 0 (ms) | step / kernels | outputs as from the host |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = r["kernel_ms"] * L
        print(f"| {r['placement']} | {r['T']} | {r['step_p50_ms']:.3f} | {r['step_p99_ms']:.3f} | "
              f"{r['per_layer_us']:.1f} | {r['tokens_per_s']:.0f} | {ref:.3f} | {r['step_p50_ms'] / ref:.2f}x | "
              f"{'yes' if r['verified'] else 'NO'} |")
    if a.json:
        json.dump(dict(layers=L, gpus=a.gpus, loads=loads, rows=rows, failures=failures), open(a.json, "w"),
                  indent=1)
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures or not all(r["verified"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
