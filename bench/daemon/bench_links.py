"""A fleet over NCCL links beside the same fleet over gRPC, on the GPU machine (tools/gpu/run-on-gpu.sh links).

DeepSeek-V3's layer (d 7168, ff 2048, 256 experts, top 8, one shared expert, bf16) sharded by experts
over daemons on GPUs 1 .. N (N = 2 and 3: --experts cut for equal work at large T, the shard holding
expert 0 adding the shared expert: cuts()), one caller on GPU 0 (link-bench, bench/daemon/link_bench.c), and the whole layer in one daemon on
GPU 1 as the reference. For each fleet and T: the links' p50 / p90 latency and tokens/s, the slowest
shard's compute time as its daemon reports it (the kernel the call waited for), the same calls over
gRPC (the fleet client's inline path), whether the two gave the same bits, and one call captured in a
CUDA graph and replayed (link-bench --graph). Then the links to the
one daemon holding every expert (tokens/s of one GPU), and the 3-shard fleet again with NCCL's socket
transport forced (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 in every process: the path two hosts take).
Each row also says where a call's time goes on the daemons' side: the medians of their debug log's
`link call` lines for its calls (the header's check, then to the payload in, the forward with its
queue and compute, the reply's send); the rest of the p50 is the caller's side and NCCL's
messages.

With --callers N (N >= 2), at each T >= 4096 the one daemon and every NVLink fleet also serve N
callers at once: N link-bench processes on GPU 0, each with links of its own, timing one window
(--start-at) of back-to-back calls; tokens/s is every caller's tokens over the window from the
first call's start to the last one's end, the throughput an engine with N micro-batches in flight
would see (the daemons merge or overlap the callers' calls; a single caller's calls leave the
shards idle while its payloads and replies cross GPU 0's NVLink).

usage: python3 bench_links.py --bin .gpu/bin [--tokens 8,128,4096] [--calls 200] [--fleets 2,3] [--json FILE]
       [--logs DIR] [--callers N]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_daemon import DEEPSEEK, Moed  # noqa: E402

EXPERTS = 256


TOP_K, SHARED = 8, 1
# What a token's shared-expert row costs against a routed pair's at T = 4096: the shared expert's
# GEMMs run on every token at once, a routed expert's on about 128 rows. Measured on four H200s
# (docs/benchmarks.md, "2026-11-28 (sixth)"): with the shared row counted as a whole pair the
# shard adding it (0-63) computed 2.51 ms against 2.81 and 2.98 for 96 experts; at 0-74 2.85
# against 2.66 and 2.68. Three quarters of a pair evens them out (0-68).
SHARED_COST = 0.75


def cuts(n):
    """Expert ranges of n shards with equal expected work at large T: a token brings TOP_K routed
    pairs and SHARED shared ones (each SHARED_COST of a pair's work), and the shard holding expert 0
    adds the shared expert, so it holds fewer routed experts (DeepSeek-V3 over 3: 0-68 and the
    shared, 69-162, 163-255)."""
    shared = SHARED * SHARED_COST
    per = (TOP_K + shared) / n
    first = max(1, round((per - shared) / TOP_K * EXPERTS)) if n > 1 else EXPERTS
    bounds = [0, first] + [first + round(i * (EXPERTS - first) / (n - 1)) for i in range(1, n)]
    return [f"{bounds[i]}-{bounds[i + 1] - 1}" for i in range(n)]


def link_bench(a, targets, tokens, calls, warmup, extra=()):
    """The command line of a caller on GPU 0: DeepSeek-V3's bf16 calls of `tokens` tokens, top 8."""
    return [os.path.join(a.bin, "link-bench"), "--target", ",".join(targets), "--device", "0",
            "--tokens", str(tokens), "--top-k", "8", "--dtype", "bf16", "--calls", str(calls),
            "--warmup", str(warmup), "--seed", "7", *extra]


def driver(a, targets, tokens, env=None, extra=()):
    calls = a.calls if tokens < 4096 else max(a.calls // 4, 20)
    cmd = link_bench(a, targets, tokens, calls, 10, extra)
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})},
                       timeout=300)
    sys.stderr.write(r.stderr[-2000:])
    if r.returncode != 0:
        raise RuntimeError(f"link-bench exited {r.returncode}: {r.stdout[-2000:]} {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def callers(a, targets, tokens, n):
    """n link-bench processes at once on GPU 0 against targets, timing one window: every caller's
    tokens over it, each caller's p50, and their calls' failures and wrong answers."""
    calls = max(a.calls, 40)  # a window long against the callers' start skew (under 10 ms)
    start_at = time.monotonic() + 25  # every caller's links opened and warmed up by then
    cmd = link_bench(a, targets, tokens, calls, 5, ["--start-at", f"{start_at:.3f}"])
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        sys.stderr.write(err[-2000:])
        if p.returncode != 0:
            raise RuntimeError(f"link-bench (one of {n} callers) exited {p.returncode}: {out[-2000:]}")
        rows.append(json.loads(out)["links"])
    begin = min(r["window_s"][0] for r in rows)
    end = max(r["window_s"][1] for r in rows)
    late = max(r["window_s"][0] for r in rows) - begin
    if late > 0.01:
        raise RuntimeError(f"the callers' windows began {late * 1e3:.0f} ms apart: raise the start margin")
    return {"callers": n, "tokens_per_s": tokens * sum(r["ok"] for r in rows) / (end - begin),
            "p50_us": statistics.median(r["p50_us"] for r in rows),
            "failed": sum(r["calls"] - r["ok"] for r in rows), "wrong": sum(r["wrong"] for r in rows)}


def gpu_count():
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return max(1, sum(1 for line in out.splitlines() if line.startswith("GPU ")))


def start(a, i, experts, name, env=None):
    """Daemon i on GPU 1 + i, or sharing GPUs 1 .. n-1 where there are fewer (GPU 0 is the caller's)."""
    n = gpu_count()
    args = ["--synthetic", DEEPSEEK, "--backend", "cuda", "--devices", str(1 + i % (n - 1) if n > 1 else 0)]
    if experts:
        args += ["--experts", experts]
    d = Moed(a.bin, [*args, "--log-level", "debug"], os.path.join(a.logs, f"moed-{name}.log"),
             start_timeout=300, env=env)
    d.log_path = os.path.join(a.logs, f"moed-{name}.log")
    return d


STAGES = ("header_us", "payload_us", "forward_us", "queue_us", "compute_us", "reply_us")


def log_marks(daemons):
    return [os.path.getsize(d.log_path) for d in daemons]


def daemon_side(daemons, marks):
    """The medians of each stage over the `link call` lines the daemons logged since marks, the
    slowest daemon's (by forward) for a fleet."""
    worst = None
    for d, at in zip(daemons, marks):
        with open(d.log_path, "rb") as f:
            f.seek(at)
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if 'msg="link call"' in ln]
        vals = {k: [int(m.group(1)) for ln in lines if (m := re.search(rf"\b{k}=(\d+)", ln))] for k in STAGES}
        if not vals["forward_us"]:
            continue
        med = {k: statistics.median(v) for k, v in vals.items() if v}
        if worst is None or med["forward_us"] > worst["forward_us"]:
            worst = med
    return worst


def side_text(side, p50):
    if not side:
        return "daemon side: no link call lines"
    rest = p50 - side["header_us"] - side["payload_us"] - side["forward_us"] - side["reply_us"]
    return (f"daemon side p50s: header {side['header_us']:.0f} us, payload {side['payload_us']:.0f} us, "
            f"forward {side['forward_us']:.0f} "
            f"(queue {side['queue_us']:.0f}, compute {side['compute_us']:.0f}), reply {side['reply_us']:.0f}; "
            f"caller and messages {rest:.0f} us")


def start_all(a, n, env, label):
    """The fleet's daemons, started at once (each loads its weights for tens of seconds)."""
    with ThreadPoolExecutor(n) as ex:
        futures = [ex.submit(start, a, i, c, f"{label}-{n}-{i}", env) for i, c in enumerate(cuts(n))]
    failed = [f.exception() for f in futures if f.exception()]
    if failed:
        for f in futures:
            if not f.exception():
                f.result().stop()
        raise failed[0]
    return [f.result() for f in futures]


def fleet_rows(a, n, env, label, results):
    daemons = start_all(a, n, env, label)
    try:
        for t in a.tokens:
            marks = log_marks(daemons)
            row = driver(a, [d.addr for d in daemons], t, env, ["--grpc", "--graph"])
            row.update(fleet=n, transport=label, tokens=t, daemon_side=daemon_side(daemons, marks))
            if a.callers > 1 and label == "nvlink" and t >= 4096:
                row["concurrent"] = callers(a, [d.addr for d in daemons], t, a.callers)
            results.append(row)
            print(f"links {label} {n} shards T={t}: p50 {row['links']['p50_us']:.0f} us "
                  f"(slowest shard's compute p50 {row['links']['compute_p50_us']:.0f} us), "
                  f"{row['links']['tokens_per_s']:.0f} tok/s; grpc p50 {row['grpc']['p50_us']:.0f} us, "
                  f"{row['grpc']['tokens_per_s']:.0f} tok/s; same bits {row['same_bits']}; "
                  f"captured in a graph p50 {row['graph']['p50_us']:.0f} us; "
                  f"{side_text(row['daemon_side'], row['links']['p50_us'])}", flush=True)
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
    ap.add_argument("--callers", type=int, default=1,
                    help="at T >= 4096 also N callers at once (tokens/s over one window)")
    a = ap.parse_args()
    a.tokens = [int(t) for t in a.tokens.split(",")]
    os.makedirs(a.logs, exist_ok=True)
    results = []
    one = start(a, 0, None, "one")
    try:
        for t in a.tokens:
            marks = log_marks([one])
            row = driver(a, [one.addr], t, extra=["--grpc", "--graph"])
            row.update(fleet=1, transport="nvlink", tokens=t, daemon_side=daemon_side([one], marks))
            if a.callers > 1 and t >= 4096:
                row["concurrent"] = callers(a, [one.addr], t, a.callers)
            results.append(row)
            print(f"links to one daemon T={t}: p50 {row['links']['p50_us']:.0f} us "
                  f"(compute p50 {row['links']['compute_p50_us']:.0f} us), "
                  f"{row['links']['tokens_per_s']:.0f} tok/s; grpc p50 {row['grpc']['p50_us']:.0f} us; "
                  f"same bits {row['same_bits']}; captured in a graph p50 {row['graph']['p50_us']:.0f} us; "
                  f"{side_text(row['daemon_side'], row['links']['p50_us'])}",
                  flush=True)
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
    the one daemon's at the same T (against 2.5x at T >= 4096), for one caller and, where measured,
    for several at once against the one daemon serving as many."""
    ones = [r for r in results if r["fleet"] == 1 and r["transport"] == "nvlink"]
    one = {r["tokens"]: r["links"]["tokens_per_s"] for r in ones}
    one_n = {r["tokens"]: r["concurrent"]["tokens_per_s"] for r in ones if "concurrent" in r}
    for r in results:
        over = r["links"]["p50_us"] - r["links"]["compute_p50_us"]
        ratio = r["links"]["tokens_per_s"] / one[r["tokens"]] if one.get(r["tokens"]) else None
        r["over_compute_us"], r["vs_one_daemon"] = over, ratio
        line = (f"{r['fleet']} daemon(s) {r['transport']} T={r['tokens']}: {over:.0f} us over the slowest "
                f"compute" + (f", {ratio:.2f}x one daemon's tokens/s" if ratio else ""))
        if "concurrent" in r and one_n.get(r["tokens"]):
            c = r["concurrent"]
            c["vs_one_daemon"] = c["tokens_per_s"] / one_n[r["tokens"]]
            line += (f"; {c['callers']} callers at once {c['tokens_per_s']:.0f} tok/s "
                     f"({c['tokens_per_s'] / r['links']['tokens_per_s']:.2f}x one caller's), "
                     f"{c['vs_one_daemon']:.2f}x the one daemon's with as many, p50 {c['p50_us']:.0f} us, "
                     f"{c['failed']} failed, {c['wrong']} wrong")
        print(line, flush=True)


if __name__ == "__main__":
    main()
