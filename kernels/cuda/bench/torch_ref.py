"""The reference moed's kernels are measured against, timed in the same run on the GPU machine:
the pipeline a user would write with PyTorch's grouped GEMM — sort the (token, expert)
pairs by expert, gather the token rows, torch._grouped_mm against W1|W3, SwiGLU, torch._grouped_mm
against W2, scale by the routing weights, index_add into the output. bf16, random never-zero data,
the same shapes, T and routing rules as moe-bench, median of CUDA-event timings after warm-up.

usage: python3 torch_ref.py [--shapes ...] [--tokens 8,64,...] [--routing uniform,...] --json FILE
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SHAPES = {  # d, ff, E, k
    "mixtral": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
}


def route(T, E, k, routing, gen):
    """k distinct experts per token by the same rules as moe-bench's choose()."""
    dev = "cuda"
    if routing == "zipf":
        p = torch.arange(1, E + 1, dtype=torch.float64, device=dev) ** -1.2
        ids = torch.multinomial(p.expand(T, E), k, replacement=False, generator=gen)
    elif routing == "hot":
        rest = torch.rand(T, E - 1, device=dev, generator=gen).topk(k - 1).indices + 1
        ids = torch.cat([torch.zeros(T, 1, dtype=torch.long, device=dev), rest], 1)
    elif routing == "empty":
        ids = torch.rand(T, max(E // 4, k), device=dev, generator=gen).topk(k).indices
    else:
        ids = torch.rand(T, E, device=dev, generator=gen).topk(k).indices
    w = 0.1 + 0.9 * torch.rand(T, k, device=dev, generator=gen)
    return ids.to(torch.int64), w.float()


def pipeline(x, w13, w2, ids, wts):
    T, k = ids.shape
    E = w13.shape[0]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    tok = order // k
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    h = torch._grouped_mm(x[tok], w13.transpose(-2, -1), offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs=offs)
    y = y * wts.flatten()[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)


def time_ms(fn, min_ms=200.0):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times, spent = [], 0.0
    while len(times) < 10 or spent < min_ms:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        spent += times[-1]
        if len(times) >= 500:
            break
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="8,64,512,4096,16384")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    runs = []
    for name in a.shapes.split(","):
        d, ff, E, k = SHAPES[name]
        w13 = ((torch.rand(E, 2 * ff, d, device="cuda", generator=gen) * 2 - 1) * (3 / d) ** 0.5).bfloat16()
        w2 = ((torch.rand(E, d, ff, device="cuda", generator=gen) * 2 - 1) * (3 / ff) ** 0.5).bfloat16()
        for T in map(int, a.tokens.split(",")):
            for routing in a.routing.split(","):
                x = (torch.rand(T, d, device="cuda", generator=gen) * 2 - 1).bfloat16()
                ids, wts = route(T, E, k, routing, gen)
                try:
                    ms = time_ms(lambda: pipeline(x, w13, w2, ids, wts))
                    err = None
                except Exception as e:  # an unsupported case is reported, not fatal
                    ms, err = None, str(e)[:200]
                active = int(torch.unique(ids).numel())
                runs.append({"shape": name, "T": T, "routing": routing, "ms": ms, "error": err,
                             "active_experts": active, "pairs": T * k})
                print(f"torch {name:14s} T={T:6d} {routing:8s} " + (f"{ms:9.3f} ms" if ms else f"failed: {err}"),
                      flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    with open(a.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
