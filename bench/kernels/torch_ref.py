"""The reference moed's kernels are measured against, timed in the same run on the GPU machine:
the pipeline a user would write with PyTorch's grouped GEMM — sort the (token, expert)
pairs by expert, gather the token rows, torch._grouped_mm against W1|W3, SwiGLU, torch._grouped_mm
against W2, scale by the routing weights, index_add into the output. bf16, random never-zero data,
the same shapes, T and routing rules as moe-bench, median of CUDA-event timings after warm-up.

Also the harness sonic_ref.py shares (one piece): the shapes, the real models' layers, route(),
time_ms() and the loop that times a forward over shapes x T x routings into the JSON report.py reads.

usage: python3 torch_ref.py [--shapes mixtral,...] [--shape d,ff,E,k]... [--tokens 8,64,...]
                            [--routing uniform,...] --json FILE
--shape runs the layer unpadded (moe-bench pads d and ff to 128 as the backend does) and names its
rows as moe-bench does, d,ff,E,k, so report.py joins them; MODELS names the real models' layers.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SHAPES = {  # d, ff, E, k: moe-bench's named shapes
    "mixtral": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
}

# Real models' MoE layers beyond SHAPES, run as --shape d,ff,E,k (tools/gpu/run-on-gpu.sh's peers
# stage lists the same; a CI test keeps the two equal). From each model's config.json: hidden size,
# the expert's intermediate size, routed experts, experts per token. Together they cover other d
# (2048, 2880, 4096, 6144), d_ff not a multiple of 128 (2880) and E not a power of two (60).
MODELS = {
    "gpt-oss-120b": (2880, 2880, 128, 4),
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
    "olmoe-1b-7b": (2048, 1024, 64, 8),
    "phi-3.5-moe": (4096, 6400, 16, 2),
    "dbrx": (6144, 10752, 16, 4),
    # layers the kernels' table was never tuned on (docs/benchmarks.md)
    "mixtral-8x22b": (6144, 16384, 8, 2),
    "qwen2-57b-a14b": (3584, 2560, 64, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "llama-4-scout": (5120, 8192, 16, 1),
}


def shape_name(d, ff, E, k):
    """A --shape's name as moe-bench prints it."""
    return f"{d},{ff},{E},{k}"


def aligned(n):
    """torch._grouped_mm (and SonicMoE's TMA loads) need row strides that are multiples of 16 bytes:
    d and ff are padded up to multiples of 8 bf16 values where they are not (zeros, which change no
    output); every layer in SHAPES and MODELS already is, so they run unpadded."""
    return -(-n // 8) * 8


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


def uniform(shape, scale, gen):
    """bf16 uniform in (-scale, scale), never all zero, on the GPU."""
    return ((torch.rand(*shape, device="cuda", generator=gen) * 2 - 1) * scale).bfloat16()


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


class TorchLayer:
    """W1|W3 as (E, 2 ff, d) and W2 as (E, d, ff), d and ff aligned()."""
    info = {}  # more fields for each row's JSON

    def __init__(self, d, ff, E, k, gen):
        d8, f8 = aligned(d), aligned(ff)
        self.d = d8
        self.w13 = uniform((E, 2 * f8, d8), (3 / d) ** 0.5, gen)
        self.w2 = uniform((E, d8, f8), (3 / ff) ** 0.5, gen)

    def given(self, ids, wts):
        """The routing as forward() takes it, made outside the timed part."""
        return ids, wts

    def forward(self, x, ids, wts):
        return pipeline(x, self.w13, self.w2, ids, wts)


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


def parse_args(what):
    ap = argparse.ArgumentParser(description=f"times {what} on moe-bench's shapes, T and routings")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="named shapes (empty: none)")
    ap.add_argument("--shape", action="append", default=[], metavar="d,ff,E,k",
                    help="any layer, unpadded (repeatable); rows named d,ff,E,k as moe-bench names them")
    ap.add_argument("--tokens", default="8,64,512,4096,16384")
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--min-ms", type=float, default=200.0, help="timed milliseconds per row at least")
    ap.add_argument("--json", required=True)
    return ap.parse_args()


def selected(a):
    """[(name, (d, ff, E, k))]: the named shapes, then the --shape ones."""
    out = [(n, SHAPES[n]) for n in a.shapes.split(",") if n]
    for s in a.shape:
        d, ff, E, k = (int(v) for v in s.split(","))
        if min(d, ff, E, k) < 1 or k > E:
            raise SystemExit(f"--shape {s} is not d,ff,E,k (k <= E)")
        out.append((shape_name(d, ff, E, k), (d, ff, E, k)))
    return out


def bench(tag, layer_cls, meta):
    """Times layer_cls(d, ff, E, k, gen).forward(x, *layer.given(ids, wts)) on every shape, T and
    routing of the command line; a shape or a row that fails is recorded with its error, and the rest
    still run. Writes the JSON ({device, torch, **meta, runs: [{shape, T, routing, ms, error, ...}]})."""
    a = parse_args(tag)
    gen = torch.Generator(device="cuda").manual_seed(0)
    runs = []
    for name, (d, ff, E, k) in selected(a):
        try:
            layer, err = layer_cls(d, ff, E, k, gen), None
        except Exception as e:  # a peer that cannot hold this shape is reported, not fatal
            layer, err = None, f"{type(e).__name__}: {e}"[:300]
        model = next((m for m, v in MODELS.items() if v == (d, ff, E, k)), None)
        for T in map(int, a.tokens.split(",")):
            for routing in a.routing.split(","):
                ms, row_err = None, err
                ids, wts = route(T, E, k, routing, gen)
                if layer is not None:
                    x = uniform((T, layer.d), 1.0, gen)
                    try:
                        given = layer.given(ids, wts)
                        ms = time_ms(lambda: layer.forward(x, *given), a.min_ms)
                    except Exception as e:  # an unsupported case is reported, not fatal
                        row_err = f"{type(e).__name__}: {e}"[:300]
                runs.append({"shape": name, "model": model, "d": d, "ff": ff, "E": E, "k": k, "T": T,
                             "routing": routing, "ms": ms, "error": row_err, "pairs": T * k,
                             "active_experts": int(torch.unique(ids).numel()), **(layer.info if layer else {})})
                print(f"{tag} {model or name:18s} T={T:6d} {routing:8s} "
                      + (f"{ms:9.3f} ms" if ms else f"failed: {row_err}"), flush=True)
        layer = None  # its weights freed before the next shape
        torch.cuda.empty_cache()
        with open(a.json, "w") as f:  # after each shape: a run stopped by a timeout keeps the rest
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, **meta,
                       "runs": runs}, f, indent=1)


if __name__ == "__main__":
    bench("torch", TorchLayer, {"impl": "torch._grouped_mm"})
