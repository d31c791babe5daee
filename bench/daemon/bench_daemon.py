"""Benchmarks through the daemon on loopback, on the GPU machine (tools/gpu/run-on-gpu.sh e2e|merge).

transport (the CUDA backend through gRPC): the mixtral shape at T = 8, 128, 2048 with 1 and 8 concurrent callers,
merging off (--max-batch-tokens T: one request per launch), beside the kernel-only time of the same T
from moe-bench (graph-replayed where the backend replays graphs). Tokens/s, p50/p99 latency.

merging (requests merged into launches): the mixtral shape, T = 8 per request, 1 / 8 / 32 / 64 callers, with
merging off, merging on, and merging on with batch-level gating.

multi (expert parallelism, on --gpus N GPUs, 2 by default): DeepSeek-V3's layer (d 7168, ff 2048,
256 experts, top-8, one shared expert) whole on GPU 0, split over GPUs 0 .. N-1 (--devices 0,..,N-1
--expert-parallel), and N such layers on GPU 0 and one per GPU (--devices 0,..,N-1): GetModel must
say where each layer and
expert lives, the same fixed requests must get the same bytes back from the layouts of whole layers
and, split, replies within one bf16 rounding of them (docs/cuda.md: a split sums in another order),
and moed-load measures T = 8 (1 caller) and T = 4096 (8 callers) against each, inline and through
CUDA regions (hidden and outputs in the caller's GPU memory: the wire left out), beside moe-bench's
kernel-only time on one GPU.

Load comes from moed-load (C, many calls in flight per process); every run's JSON is kept.

rebalance (a split layer re-placed while it serves): DeepSeek-V3's layer split over --gpus GPUs
(moed --rebalance 10), moed-load with zipf routing at T = 4096, 8 callers through CUDA regions,
before and after the daemon re-places the layer by the load it measured: tokens/s, GetModel's cut
and generation, no call failed.

usage: python3 bench_daemon.py --bin .gpu/bin [--suite transport,merging,multi,rebalance] [--gpus N]
       [--json FILE] [--logs DIR]
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
DEEPSEEK = "layers=1,d=7168,ff=2048,experts=256,topk=8,act=swiglu,dtype=bf16,seed=1,shared=1,shared_ff=2048"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moed:
    def __init__(self, bin_dir, args, log_path, start_timeout=180, env=None):
        self.addr = f"127.0.0.1:{free_port()}"
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([os.path.join(bin_dir, "moed"), "--listen", self.addr, *args],
                                     stderr=self.log, stdout=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})
        deadline = time.time() + start_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moed exited {self.proc.returncode}; see {log_path}")
            r = subprocess.run([os.path.join(bin_dir, "moectl"), "--target", self.addr, "--timeout", "1", "health"],
                               capture_output=True)
            if r.returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError(f"moed not serving after {start_timeout} s; see {log_path}")

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


def kernel_ms(bin_dir, tokens, json_path, skip, shape="mixtral", k=2):
    """moe-bench's pipeline time per T (graph-replayed when the backend would replay one)."""
    if skip:  # no GPU (a local check of this script): no kernel-only figures
        return {T: float("nan") for T in tokens}
    out = {}
    for T in tokens:
        graph = ["--graph"] if T * k <= 512 else []
        subprocess.run([os.path.join(bin_dir, "moe-bench"), "--shapes", shape, "--tokens", str(T),
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


def placement_ok(info, want):
    """GetModel's placement: each layer as `want` says, (home, [the devices of its expert ranges]),
    the ranges covering every expert in order, a split's expected work evened out within 2 experts
    (the home's shared experts count as shared_d_ff / d_ff x (E / top_k + 1) / 2 routed experts,
    moed_place_shared_work)."""
    got = {l.index: (l.home_device, [dev for _, _, dev in l.expert_placement]) for l in info.layers}
    ok = got == want
    for l in info.layers:
        r = l.expert_placement
        ok = ok and r[0][0] == 0 and r[-1][1] == l.num_experts - 1
        ok = ok and all(r[i][1] + 1 == r[i + 1][0] for i in range(len(r) - 1))
        if len(r) >= 2:
            home_work = l.shared_d_ff / l.d_ff * (l.num_experts / l.top_k + 1) / 2 if l.shared_d_ff else 0
            work = [q[1] - q[0] + 1 + (home_work if q[2] == l.home_device else 0) for q in r]
            ok = ok and max(work) - min(work) <= 2
    return ok, got


def fixed_requests(info, c):
    """The replies to fixed requests (client routing, T = 1, 8, 512 on every layer), as float32 arrays."""
    import numpy as np
    out = []
    for l in info.layers:
        rng = np.random.default_rng(l.index)
        for T in (1, 8, 512):
            x = rng.standard_normal((T, l.d_model), dtype=np.float32)
            ids = np.stack([rng.choice(l.num_experts, l.top_k, replace=False) for _ in range(T)])
            w = rng.random((T, l.top_k), dtype=np.float32)
            y = c.forward(l.index, x, expert_ids=ids.astype(np.int32), expert_weights=w, timeout=120)
            out.append(np.asarray(y, dtype=np.float32))
    return out


def replies_agree(got, ref, split):
    """Whole layers: the same bytes. Split: each token within 2^-7 of its own largest magnitude (one
    bf16 rounding: docs/cuda.md)."""
    import numpy as np
    if got is None or ref is None or len(got) != len(ref):
        return False
    if not split:
        return all(g.tobytes() == r.tobytes() for g, r in zip(got, ref))
    for g, r in zip(got, ref):
        if g.shape != r.shape or not np.isfinite(g).all():
            return False
        bound = 2.0 ** -7 * np.abs(r).max(axis=-1, keepdims=True) + 1e-6
        if (np.abs(g - r) > bound).any():
            return False
    return True


# The multi suite's loads: (T, callers, moed-load --transport).
MULTI_LOADS = ((8, 1, "inline"), (4096, 8, "inline"), (8, 1, "cuda"), (4096, 8, "cuda"))


def multi(a, results):
    from moed import MoEClient
    n = a.gpus
    devs, gpus = ",".join(str(i) for i in range(n)), list(range(n))
    print(f"== multi: DeepSeek-V3's layer on one GPU and split over {n}; {n} layers on one GPU and "
          "one per GPU", flush=True)
    one, many = a.spec, a.spec.replace("layers=1", f"layers={n}")
    # name, tag, spec, flags, the placement GetModel must show, the layout it is compared with
    layouts = [("1 layer, GPU 0", "one", one, ["--devices", "0"], {0: (0, [0])}, None),
               (f"1 layer split over GPUs {devs}", "split", one, ["--devices", devs, "--expert-parallel"],
                {0: (0, gpus)}, "one"),
               (f"{n} layers, GPU 0", "many-one", many, ["--devices", "0"], {i: (0, [0]) for i in gpus}, None),
               (f"{n} layers, one per GPU", "many-each", many, ["--devices", devs],
                {i: (i, [i]) for i in gpus}, "many-one")]
    kms = kernel_ms(a.bin, [8, 4096], os.path.join(a.logs, "kernel-deepseek.json"), a.backend != "cuda",
                    "deepseek-v3", 8)
    rows, replies, failures = [], {}, []
    for name, tag, spec, flags, want, _ in layouts:
        d = Moed(a.bin, ["--backend", a.backend, "--synthetic", spec, "--max-batch-tokens", "4096", *flags],
                 os.path.join(a.logs, f"moed-multi-{tag}.log"))
        try:
            with MoEClient(d.addr) as c:
                info = c.info()
                ok, got = placement_ok(info, want)
                if not ok:
                    failures.append(f"{name}: GetModel placement {got}, wanted {want}")
                replies[tag] = fixed_requests(info, c)
            layers = ["--layers", ",".join(str(i) for i in gpus)] if spec == many else []
            # inline (the wire in the measure), then hidden and outputs in this process's GPU memory
            # (CUDA regions: what a caller on the same host gets, the wire left out)
            for T, callers, transport in MULTI_LOADS:
                if transport != "inline" and a.backend != "cuda":
                    continue
                r = load(a.bin, d.addr, callers, T, a.duration, [*layers, "--transport", transport],
                         os.path.join(a.logs, f"load-multi-{tag}-{T}-{transport}.json"))
                rows.append(dict(layout=name, tag=tag, T=T, callers=callers, transport=transport,
                                 tokens_per_s=r["tokens_per_s"], p50_ms=r["latency_ms"]["p50"],
                                 server_compute_ms=r["server"]["compute_ms"]["p50"],
                                 errors=r["errors_total"], kernel_ms=kms[T]))
                if r["errors_total"]:
                    failures.append(f"{name} T={T} {transport}: {r['errors_total']} calls failed")
        finally:
            d.stop()
    for name, tag, _, flags, _, ref in layouts:
        if ref and not replies_agree(replies.get(tag), replies.get(ref), "--expert-parallel" in flags):
            failures.append(f"replies of '{name}' differ from the same requests on GPU 0 alone")
    refs = {l[1]: l[5] or l[1] for l in layouts}
    tps = {(r["tag"], r["T"], r["transport"]): r["tokens_per_s"] for r in rows}
    print("| layout | T | callers | transport | tokens/s | vs the same on GPU 0 | p50 ms | server compute "
          "p50 ms | kernel-only ms (one layer, one GPU, moe-bench) | calls failed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['T']} | {r['callers']} | {r['transport']} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s'] / tps[(refs[r['tag']], r['T'], r['transport'])]:.2f}x | "
              f"{r['p50_ms']:.3f} | {r['server_compute_ms']:.3f} | {r['kernel_ms']:.3f} | {r['errors']} |")
    same = not any("differ" in f for f in failures)
    print(f"replies as the same requests on GPU 0 alone (whole layers bit-identical, split within one "
          f"bf16 rounding): {'yes' if same else 'NO'} "
          f"({len(replies.get('one', []))} and {len(replies.get('many-one', []))} fixed requests)")
    results["multi"] = dict(rows=rows, failures=failures)
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures else 0



def rebalance(a, results):
    """A split layer re-placed while it serves (moed --rebalance): DeepSeek-V3's layer split over
    --gpus GPUs, moed-load with zipf routing (P(e) ~ 1/(e+1)^1.2) at T = 4096, 8 callers through
    CUDA regions, before and after the daemon re-places the layer by the load it measured, on the
    same daemon; no call may fail, the placement's generation must go up."""
    from moed import MoEClient
    n = a.gpus
    devs = ",".join(str(i) for i in range(n))
    period = 10
    print(f"== rebalance: DeepSeek-V3's layer split over GPUs {devs}, zipf routing, a re-placement "
          f"by measured load (--rebalance {period})", flush=True)
    # (a local check of the script runs tests/e2e's moed-split-test as --bin's moed: the cpu
    # backend, which it reports split)
    split = ["--devices", devs, "--expert-parallel"] if a.backend == "cuda" else []
    d = Moed(a.bin, ["--backend", a.backend, "--synthetic", a.spec, "--max-batch-tokens", "4096",
                     *split, "--rebalance", str(period), "--rebalance-replicas", "0"],
             os.path.join(a.logs, "moed-rebalance.log"))
    rows, failures = [], []
    transport = "cuda" if a.backend == "cuda" else "inline"
    try:
        with MoEClient(d.addr) as c:
            before = c.info().layers[0]
            # one load that ends before the first pass, whose counts that pass weighs
            r = load(a.bin, d.addr, 8, 4096, 3, ["--routing", "zipf:1.2", "--transport", transport],
                     os.path.join(a.logs, "load-rebalance-before.json"))
            rows.append(("placed at start", before, r))
            deadline = time.time() + 3 * period
            while c.info().layers[0].placement_generation == before.placement_generation:
                if time.time() > deadline:
                    failures.append(f"no re-placement in {3 * period} s")
                    break
                time.sleep(0.5)
            after = c.info().layers[0]
            r = load(a.bin, d.addr, 8, 4096, 3, ["--routing", "zipf:1.2", "--transport", transport],
                     os.path.join(a.logs, "load-rebalance-after.json"))
            rows.append(("re-placed by its measured load", after, r))
    finally:
        d.stop()
    print("| placement | experts per GPU | generation | tokens/s | p50 ms | calls failed |")
    print("|---|---|---|---|---|---|")
    for name, l, r in rows:
        cut = ", ".join(f"{q[1] - q[0] + 1}@{q[2]}" for q in l.expert_placement)
        print(f"| {name} | {cut} | {l.placement_generation} | {r['tokens_per_s']:.0f} | "
              f"{r['latency_ms']['p50']:.3f} | {r['errors_total']} |")
        if r["errors_total"]:
            failures.append(f"{name}: {r['errors_total']} calls failed")
    if len(rows) == 2:
        print(f"after / before: {rows[1][2]['tokens_per_s'] / rows[0][2]['tokens_per_s']:.2f}x tokens/s")
    results["rebalance"] = dict(rows=[dict(placement=n_, tokens_per_s=r["tokens_per_s"],
                                           errors=r["errors_total"]) for n_, _, r in rows], failures=failures)
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures else 0

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--suite", default="transport")
    ap.add_argument("--duration", type=float, default=5)
    ap.add_argument("--gpus", type=int, default=2, help="multi: the GPUs a layer is split over")
    ap.add_argument("--json")
    ap.add_argument("--logs", default="/tmp")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--spec", help="the synthetic model (default: the mixtral shape; multi: "
                                   "DeepSeek-V3's, one layer)")
    a = ap.parse_args()
    a.spec = a.spec or (DEEPSEEK if a.suite in ("multi", "rebalance") else MIXTRAL)
    a.daemon = ["--backend", a.backend, "--synthetic", a.spec]
    results, rc = {}, 0
    for s in a.suite.split(","):
        rc |= {"transport": transport, "merging": merging, "multi": multi,
               "rebalance": rebalance}[s](a, results) or 0
    if a.json:
        json.dump(results, open(a.json, "w"), indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
