"""Benchmarks through the daemon on loopback, on the GPU machine (tests/gpu/run-on-gpu.sh e2e|merge).

transport (the CUDA issue): the mixtral shape at T = 8, 128, 2048 with 1 and 8 concurrent callers,
merging off (--max-batch-tokens T: one request per launch), beside the kernel-only time of the same T
from moe-bench (graph-replayed where the backend replays graphs). Tokens/s, p50/p99 latency.

merging (the batching issue): the mixtral shape, T = 8 per request, 1 / 8 / 32 / 64 callers, with
merging off, merging on, and merging on with batch-level gating.

Load comes from moed-load (C, many calls in flight per process); every run's JSON is kept.

usage: python3 bench_daemon.py --bin .gpu/bin [--suite transport,merging] [--json FILE] [--logs DIR]
       [--backend cpu --spec SPEC]   (a quick local check of the script itself, no kernel-only line)
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

MIXTRAL = "layers=1,d=4096,ff=14336,experts=8,topk=2,act=swiglu,dtype=bf16,seed=1"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moed:
    def __init__(self, bin_dir, args, log_path):
        self.addr = f"127.0.0.1:{free_port()}"
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([os.path.join(bin_dir, "moed"), "--listen", self.addr, *args],
                                     stderr=self.log, stdout=subprocess.DEVNULL)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moed exited {self.proc.returncode}; see {log_path}")
            r = subprocess.run([os.path.join(bin_dir, "moectl"), "--target", self.addr, "--timeout", "1", "health"],
                               capture_output=True)
            if r.returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError(f"moed not serving after 180 s; see {log_path}")

    def stop(self):
        self.proc.terminate()
        code = self.proc.wait(60)
        self.log.close()
        if code != 0:
            raise RuntimeError(f"moed exited {code} on SIGTERM")


def load(bin_dir, addr, concurrency, tokens, duration, extra, json_path):
    conns = min(max(concurrency, 1), 8)
    cmd = [os.path.join(bin_dir, "moed-load"), "--target", addr, "--concurrency", str(concurrency),
           "--tokens", str(tokens), "--duration", str(duration), "--warmup", "1", "--dtype", "bf16",
           "--connections", str(conns), "--threads", str(conns), "--no-progress", "--json", json_path,
           *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    with open(json_path[:-5] + ".txt", "w") as f:  # moed-load's own report, kept beside its JSON
        f.write(r.stdout)
    if r.returncode != 0:
        raise RuntimeError(f"moed-load failed ({r.returncode}): {r.stdout[-2000:]} {r.stderr[-2000:]}")
    rep = json.load(open(json_path))
    if isinstance(rep, dict) and "levels" in rep:
        rep = rep["levels"]
    return rep[0] if isinstance(rep, list) else rep


def kernel_ms(bin_dir, tokens, json_path, skip):
    """moe-bench's pipeline time per T (graph-replayed when the backend would replay one)."""
    if skip:  # no GPU (a local check of this script): no kernel-only figures
        return {T: float("nan") for T in tokens}
    out = {}
    for T in tokens:
        graph = ["--graph"] if T * 2 <= 512 else []
        subprocess.run([os.path.join(bin_dir, "moe-bench"), "--shapes", "mixtral", "--tokens", str(T),
                        "--json", json_path, *graph], check=True, capture_output=True)
        out[T] = json.load(open(json_path))["runs"][0]["ms"]
    return out


def transport(a, results):
    print("== transport: mixtral, merging off, moed-load on loopback", flush=True)
    kms = kernel_ms(a.bin, [8, 128, 2048], os.path.join(a.logs, "kernel-only.json"), a.backend != "cuda")
    rows = []
    for T in (8, 128, 2048):
        d = Moed(a.bin, [*a.daemon, "--max-batch-tokens", str(T)],
                 os.path.join(a.logs, f"moed-transport-{T}.log"))
        try:
            for callers in (1, 8):
                r = load(a.bin, d.addr, callers, T, a.duration, [],
                         os.path.join(a.logs, f"load-transport-{T}-{callers}.json"))
                k_tok = T / (kms[T] * 1e-3)
                rows.append(dict(T=T, callers=callers, tokens_per_s=r["tokens_per_s"],
                                 p50_ms=r["latency_ms"]["p50"], p99_ms=r["latency_ms"]["p99"],
                                 kernel_ms=kms[T], kernel_tokens_per_s=k_tok,
                                 server_compute_ms=r["server"]["compute_ms"]["p50"], errors=r["errors_total"]))
        finally:
            d.stop()
    print("| T | callers | tokens/s | p50 ms | p99 ms | server compute p50 ms | kernel-only ms | kernel-only tokens/s | e2e / kernel |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['callers']} | {r['tokens_per_s']:.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
              f"{r['server_compute_ms']:.3f} | {r['kernel_ms']:.3f} | {r['kernel_tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / r['kernel_tokens_per_s']:.2f} |")
    t8 = next(r for r in rows if r["T"] == 8 and r["callers"] == 1)
    t2k = next(r for r in rows if r["T"] == 2048 and r["callers"] == 8)
    print(f"target T=2048, 8 callers: e2e tokens/s >= 60% of kernel-only: "
          f"{100 * t2k['tokens_per_s'] / t2k['kernel_tokens_per_s']:.0f}% "
          f"({'met' if t2k['tokens_per_s'] >= 0.6 * t2k['kernel_tokens_per_s'] else 'MISSED'})")
    print(f"target T=8, 1 caller: p50 <= kernel + 0.2 ms: p50 {t8['p50_ms']:.3f} vs {t8['kernel_ms'] + 0.2:.3f} "
          f"({'met' if t8['p50_ms'] <= t8['kernel_ms'] + 0.2 else 'MISSED'})")
    results["transport"] = rows


def merging(a, results):
    print("== merging: mixtral, T=8 per request", flush=True)
    modes = [("off", ["--max-batch-tokens", "8"], []),
             ("on", ["--max-batch-tokens", "8192"], []),
             ("on + batch gating", ["--max-batch-tokens", "8192"], ["--routing", "logits", "--batch-gating", "2"])]
    rows = []
    for name, flags, load_flags in modes:
        d = Moed(a.bin, [*a.daemon, *flags], os.path.join(a.logs, f"moed-merge-{name.split()[0]}.log"))
        try:
            for callers in (1, 8, 32, 64):
                r = load(a.bin, d.addr, callers, 8, a.duration, load_flags,
                         os.path.join(a.logs, f"load-merge-{name.split()[0]}-{len(load_flags)}-{callers}.json"))
                rows.append(dict(mode=name, callers=callers, rps=r["rps"], tokens_per_s=r["tokens_per_s"],
                                 p50_ms=r["latency_ms"]["p50"], p99_ms=r["latency_ms"]["p99"],
                                 batch_requests=r["server"]["batch_requests_mean"], errors=r["errors_total"]))
        finally:
            d.stop()
    print("| merging | callers | requests/s | tokens/s | p50 ms | p99 ms | requests per launch |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['callers']} | {r['rps']:.0f} | {r['tokens_per_s']:.0f} | {r['p50_ms']:.3f} | "
              f"{r['p99_ms']:.3f} | {r['batch_requests']:.1f} |")
    off32 = next(r for r in rows if r["mode"] == "off" and r["callers"] == 32)
    on32 = next(r for r in rows if r["mode"] == "on" and r["callers"] == 32)
    alone = next(r for r in rows if r["mode"] == "off" and r["callers"] == 1)
    print(f"target 32 callers: merging >= 8x the throughput of merging off: {on32['rps'] / off32['rps']:.1f}x "
          f"({'met' if on32['rps'] >= 8 * off32['rps'] else 'MISSED'})")
    print(f"target 32 callers: p99 <= 3x one call alone: {on32['p99_ms']:.3f} vs 3 x {alone['p50_ms']:.3f} "
          f"({'met' if on32['p99_ms'] <= 3 * alone['p50_ms'] else 'MISSED'})")
    results["merging"] = rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--suite", default="transport")
    ap.add_argument("--duration", type=float, default=5)
    ap.add_argument("--json")
    ap.add_argument("--logs", default="/tmp")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--spec", default=MIXTRAL, help="the synthetic model (default: the mixtral shape)")
    a = ap.parse_args()
    a.daemon = ["--backend", a.backend, "--synthetic", a.spec]
    results = {}
    for s in a.suite.split(","):
        {"transport": transport, "merging": merging}[s](a, results)
    if a.json:
        json.dump(results, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
