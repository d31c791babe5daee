"""The Python client's rows of the data-plane benchmark (bench_dataplane.py --python): for one cell
(a daemon, T, callers, transport) the Python client's p50, p99 and tokens/s, measured right after
moed-load's on the same daemon, so the two stand side by side in the same run.

`callers` threads share one moed.MoEClient (one process, as an inference engine embeds it; the
client's calls release the GIL while gRPC and the copies work), each calling forward() in a loop
for `duration` seconds after a warm-up. Inputs are torch bf16 tensors: on the host for inline and
shm (the shm output a view of the client's arena, dropped after each call), on the GPU for cuda
(through the client's device arena: one device copy each way; the output a new CUDA tensor, its
copy finished when forward() returns). Routing is expert choice with each token's top_k experts
drawn at random, as moed-load's.
"""
import threading
import time

import numpy as np


def hidden(rng, T, d, device):
    """bf16 hidden states: a torch tensor on `device`, or (no torch: a check of this script on a
    machine without it) uint16 bf16 bits for the host transports."""
    x = rng.standard_normal((T, d), dtype=np.float32)
    try:
        import torch
    except ImportError:
        return (x.view(np.uint32) >> 16).astype(np.uint16), {"dtype": "bf16"}
    return torch.from_numpy(x).to(torch.bfloat16).to(device), {}


def cell(addr, dims, T, callers, transport, duration, warmup=0.5):
    """The Python client's figures for one cell of a layer of dims (d, ff, experts, top_k): p50_ms,
    p99_ms, tokens_per_s, calls, and error (the first failure's message, or None)."""
    import moed

    d, _, experts, top_k = dims
    device = "cuda" if transport == "cuda" else "cpu"
    lats, errors, counts = [], [], []
    with moed.MoEClient(addr, timeout=120, transport=transport) as c:
        barrier = threading.Barrier(callers)

        def caller(i):
            rng = np.random.default_rng(i)
            x, kw = hidden(rng, T, d, device)
            ids = np.argsort(rng.random((T, experts)), axis=1)[:, :top_k].astype(np.int32)
            w = np.full(ids.shape, 1.0 / top_k, np.float32)
            lat = []
            try:
                barrier.wait()
                until = time.perf_counter() + warmup
                while time.perf_counter() < until:
                    c.forward(0, x, expert_ids=ids, expert_weights=w, **kw)
                barrier.wait()
                until = time.perf_counter() + duration
                while True:
                    t0 = time.perf_counter()
                    if t0 >= until:
                        break
                    c.forward(0, x, expert_ids=ids, expert_weights=w, **kw)
                    lat.append(time.perf_counter() - t0)
            except Exception as e:  # reported in the row; the other cells go on
                errors.append(f"{type(e).__name__}: {e}")
                barrier.abort()
            lats.extend(lat)
            counts.append(len(lat))

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.perf_counter() - t0
    if errors or not lats:
        return dict(p50_ms=float("nan"), p99_ms=float("nan"), tokens_per_s=float("nan"), calls=len(lats),
                    error=(errors or ["no call completed"])[0][:300])
    ms = np.array(lats) * 1e3
    return dict(p50_ms=float(np.percentile(ms, 50)), p99_ms=float(np.percentile(ms, 99)),
                tokens_per_s=len(lats) * T / min(duration, took), calls=len(lats), error=None)


def markdown(rows):
    """The table of the rows that have Python figures (each row's `python` dict beside moed-load's)."""
    lines = ["Python client (moed.MoEClient, torch bf16 tensors; callers = threads sharing one client) "
             "beside moed-load, same daemon, same run:", "",
             "| shape | T | callers | transport | moed-load p50 ms | Python p50 ms | moed-load p99 ms | "
             "Python p99 ms | moed-load tokens/s | Python tokens/s | Python / moed-load tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("python")
        if p is None:
            continue
        if p["error"]:
            lines.append(f"| {r['shape']} | {r['T']} | {r['callers']} | {r['transport']} | "
                         f"{r['p50_ms']:.3f} | failed: {p['error']} | | | | | |")
            continue
        lines.append(f"| {r['shape']} | {r['T']} | {r['callers']} | {r['transport']} | {r['p50_ms']:.3f} | "
                     f"{p['p50_ms']:.3f} | {r['p99_ms']:.3f} | {p['p99_ms']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{p['tokens_per_s']:.0f} | {p['tokens_per_s'] / r['tokens_per_s']:.2f} |")
    return "\n".join(lines) + "\n"
