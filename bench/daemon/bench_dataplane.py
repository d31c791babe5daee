"""The data-plane benchmark (tensor regions against inline), on the GPU machine
(tools/gpu/run-on-gpu.sh dataplane).

For the mixtral (d 4096, ff 14336, 8 experts, top-2) and qwen3-30b-a3b (d 2048, ff 768, 128
experts, top-8) shapes in bf16: T in {8, 128, 2048, 8192} x callers {1, 8} x transport {inline, shm,
cuda}, each with its own daemon per T (--max-batch-tokens T: one request per launch, as the kernel
alone), load from moed-load on loopback; beside it, in the same run, the kernel-only time of the
same T (moe-bench, graph-replayed where the daemon replays a graph), the RPC floor (T = 1 on a tiny
layer, inline, one caller) and the pinned PCIe bandwidth (cudaMemcpy of 16 MiB each way, through
ctypes). Reports p50, p99, tokens/s, their ratio to kernel-only, the server's compute span, and the
data plane's targets met or missed; writes the table as markdown (--md) and every figure as JSON.

usage: python3 bench_dataplane.py --bin .gpu/bin [--md FILE] [--json FILE] [--logs DIR]
       [--duration S] [--shapes mixtral,qwen3-30b-a3b] [--tokens 8,128,2048,8192]
       [--python [--python-duration S]]
--python adds the Python client's p50, p99 and tokens/s to every cell, measured on the same daemon
right after moed-load (bench_python.py), and its table beside moed-load's to the markdown.
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_python  # noqa: E402
from bench_daemon import Moed, load  # noqa: E402

SHAPES = {"mixtral": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8)}
GRAPH_MAX_PAIRS = 512  # the CUDA backend replays a graph at or under this many pairs


def spec(shape):
    d, ff, e, k = SHAPES[shape] if shape in SHAPES else shape
    return f"layers=1,d={d},ff={ff},experts={e},topk={k},act=swiglu,dtype=bf16,seed=1"


def kernel_ms(bin_dir, shape, tokens, logs):
    """moe-bench's pipeline time per T (graph-replayed where the daemon would replay one)."""
    out = {}
    k = SHAPES[shape][3]
    for T in tokens:
        path = os.path.join(logs, f"kernel-{shape}-{T}.json")
        graph = ["--graph"] if T * k <= GRAPH_MAX_PAIRS else []
        subprocess.run([os.path.join(bin_dir, "moe-bench"), "--shapes", shape, "--tokens", str(T),
                        "--json", path, *graph], check=True, capture_output=True)
        out[T] = json.load(open(path))["runs"][0]["ms"]
    return out


def pcie_gbps(nbytes=16 << 20, reps=20):
    """Pinned host <-> device bandwidth in GB/s, each way (cudaMemcpy through libcudart)."""
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            rt = ctypes.CDLL(name)
            break
        except OSError:
            rt = None
    if rt is None:
        return float("nan"), float("nan")
    host, dev = ctypes.c_void_p(), ctypes.c_void_p()
    rt.cudaHostAlloc(ctypes.byref(host), ctypes.c_size_t(nbytes), 0)
    rt.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(nbytes))
    rates = []
    for kind, (dst, src) in ((1, (dev, host)), (2, (host, dev))):  # H2D, D2H
        rt.cudaMemcpy(dst, src, ctypes.c_size_t(nbytes), kind)
        rt.cudaDeviceSynchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            rt.cudaMemcpy(dst, src, ctypes.c_size_t(nbytes), kind)
        rt.cudaDeviceSynchronize()
        rates.append(nbytes * reps / (time.perf_counter() - t0) / 1e9)
    rt.cudaFreeHost(host)
    rt.cudaFree(dev)
    return rates[0], rates[1]


def run_shape(a, shape, kms, rows):
    d = SHAPES[shape][0]
    for T in a.tokens:
        m = Moed(a.bin, ["--backend", "cuda", "--synthetic", spec(shape), "--max-batch-tokens", str(T)],
                 os.path.join(a.logs, f"moed-{shape}-{T}.log"))
        try:
            for callers in (1, 8):
                for tr in ("inline", "shm", "cuda"):
                    r = load(a.bin, m.addr, callers, T, a.duration, ["--transport", tr],
                             os.path.join(a.logs, f"load-{shape}-{T}-{callers}-{tr}.json"))
                    k_tok = T / (kms[T] * 1e-3)
                    rows.append(dict(shape=shape, T=T, callers=callers, transport=tr,
                                     p50_ms=r["latency_ms"]["p50"], p99_ms=r["latency_ms"]["p99"],
                                     tokens_per_s=r["tokens_per_s"], kernel_ms=kms[T],
                                     kernel_tokens_per_s=k_tok, ratio=r["tokens_per_s"] / k_tok,
                                     server_compute_ms=r["server"]["compute_ms"]["p50"],
                                     bytes=T * d * 2, errors=r["errors_total"]))
                    print(f"{shape} T={T} callers={callers} {tr}: p50 {rows[-1]['p50_ms']:.3f} ms, "
                          f"kernel {kms[T]:.3f} ms, {rows[-1]['tokens_per_s']:.0f} tok/s", flush=True)
                    if a.python:
                        p = rows[-1]["python"] = bench_python.cell(m.addr, SHAPES[shape], T, callers, tr,
                                                                   a.python_duration)
                        print(f"  python: p50 {p['p50_ms']:.3f} ms, {p['tokens_per_s']:.0f} tok/s"
                              f"{', ' + p['error'] if p['error'] else ''}", flush=True)
        finally:
            m.stop()


def targets(rows, h2d, d2h):
    """The data plane's targets on the mixtral shape: (what, value, bound, met)."""
    def row(T, callers, tr):
        return next((r for r in rows if r["shape"] == "mixtral" and r["T"] == T and
                     r["callers"] == callers and r["transport"] == tr), None)
    out = []
    r = row(8, 1, "cuda")
    if r:
        out.append(("cuda, 1 caller, T=8: p50 <= kernel + 0.15 ms", r["p50_ms"], r["kernel_ms"] + 0.15))
    for T in (2048, 8192):
        r = row(T, 1, "cuda")
        if r:
            out.append((f"cuda, 1 caller, T={T}: p50 <= 1.1 x kernel + 0.15 ms", r["p50_ms"],
                        1.1 * r["kernel_ms"] + 0.15))
    r = row(2048, 1, "shm")
    if r:
        out.append(("shm, 1 caller, T=2048: p50 <= kernel + 1.0 ms", r["p50_ms"], r["kernel_ms"] + 1.0))
    r = row(2048, 8, "inline")
    if r:
        out.append(("inline, 8 callers, T=2048: tokens/s >= 60% of kernel-only (as a deficit)",
                    -r["tokens_per_s"], -0.6 * r["kernel_tokens_per_s"]))
    r = row(2048, 1, "inline")
    if r:
        pcie = r["bytes"] / (h2d * 1e9) * 1e3 + r["bytes"] / (d2h * 1e9) * 1e3
        out.append(("inline, T=2048: server compute <= kernel + PCIe of its bytes + 0.1 ms",
                    r["server_compute_ms"], r["kernel_ms"] + pcie + 0.1))
    return [(w, v, b, v <= b) for w, v, b in out]


def markdown(rows, floor, h2d, d2h, device, checks):
    lines = [f"Data plane on {device}, bf16, one request per launch (--max-batch-tokens T); "
             f"RPC floor (T = 1, d 64, inline, 1 caller) p50 {floor:.3f} ms; pinned PCIe "
             f"{h2d:.1f} GB/s host to device, {d2h:.1f} GB/s back.", "",
             "| shape | T | callers | transport | p50 ms | p99 ms | tokens/s | kernel-only ms | "
             "tokens/s / kernel-only | p50 - kernel ms | server compute p50 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['T']} | {r['callers']} | {r['transport']} | {r['p50_ms']:.3f} | "
                     f"{r['p99_ms']:.3f} | {r['tokens_per_s']:.0f} | {r['kernel_ms']:.3f} | "
                     f"{r['ratio']:.2f} | {r['p50_ms'] - r['kernel_ms']:.3f} | {r['server_compute_ms']:.3f} |")
    lines += ["", "| target (mixtral) | measured | bound | |", "|---|---|---|---|"]
    for what, v, b, met in checks:
        lines.append(f"| {what} | {abs(v):.3f} | {abs(b):.3f} | {'met' if met else 'MISSED'} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--duration", type=float, default=3)
    ap.add_argument("--shapes", default="mixtral,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="8,128,2048,8192")
    ap.add_argument("--md")
    ap.add_argument("--json")
    ap.add_argument("--logs", default="/tmp")
    ap.add_argument("--python", action="store_true",
                    help="the Python client's figures beside moed-load's in every cell (bench_python.py)")
    ap.add_argument("--python-duration", type=float, default=2)
    a = ap.parse_args()
    a.tokens = [int(t) for t in a.tokens.split(",")]
    h2d, d2h = pcie_gbps()
    device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip().splitlines()[0]
    m = Moed(a.bin, ["--backend", "cuda", "--synthetic", "layers=1,d=64,ff=128,experts=8,topk=2"],
             os.path.join(a.logs, "moed-floor.log"))
    try:
        floor = load(a.bin, m.addr, 1, 1, a.duration, [], os.path.join(a.logs, "load-floor.json"))
    finally:
        m.stop()
    rows = []
    for shape in a.shapes.split(","):
        kms = kernel_ms(a.bin, shape, a.tokens, a.logs)
        run_shape(a, shape, kms, rows)
    checks = targets(rows, h2d, d2h)
    md = markdown(rows, floor["latency_ms"]["p50"], h2d, d2h, device, checks)
    if a.python:
        md += "\n" + bench_python.markdown(rows)
    print(md)
    if a.md:
        open(a.md, "w").write(md)
    if a.json:
        json.dump(dict(device=device, h2d_gbs=h2d, d2h_gbs=d2h, floor=floor, rows=rows,
                       targets=[dict(what=w, value=v, bound=b, met=ok) for w, v, b, ok in checks]),
                  open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
