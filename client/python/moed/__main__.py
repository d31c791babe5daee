"""python -m moed: a small command line (moed.connect), to poke at a server or a fleet by hand.

    python -m moed [--target ADDR] [--timeout S] health | info | forward [--layer N] [--tokens T]
                   [--dtype f32|f16|bf16] [--strategy S] [--top-k K] [--seed N] [--verify]

forward sends random hidden states and random router logits, prints a summary of the reply, and
with --verify (synthetic models only) compares it with moed.reference. Exit codes: 0 ok, 1 a failed
call (or a failed verification), 2 usage.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from . import Client, MoEError, connect
from .types import InvalidArgument

_DTYPES = ("bf16", "f16", "f32")


def _np_dtype(name: str):
    """The numpy type of a dtype name (bf16 needs ml_dtypes, imported only then)."""
    if name == "bf16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return {"f32": np.float32, "f16": np.float16}[name]


def _info(c: Client) -> int:
    m = c.info()
    print(f"model    {m.model}\nbackend  {m.backend}   version {m.version}")
    print(f"limits   {m.max_message_bytes} bytes per message, {m.max_batch_tokens} tokens per request")
    r = m.regions
    print(f"regions  {r.mode}, CUDA {'yes' if r.cuda else 'no'}; per principal {r.max_regions} regions, "
          f"{r.max_region_bytes} bytes; {r.max_region_bytes_total} bytes in all")
    for d in m.devices:
        print(f"device   {d.name}: {d.memory_used / 2**20:.0f} / {d.memory_total / 2**20:.0f} MiB used")
    print(f"{'layer':>5} {'d_model':>7} {'d_ff':>6} {'experts':>7} {'top_k':>5} {'act':>6} {'dtype':>5} "
          f"{'router':>6} {'norm':>4} {'rule':>12} {'shared':>6} {'groups':>6} {'scale':>5} held")
    for l in m.layers:
        held = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in l.experts_held)
        held += "+shared" if l.num_shared_experts and l.adds_shared_experts else ""
        if len({dev for _, _, dev in l.expert_placement} | {l.home_device}) > 1:  # split: say where
            held += f" (home device {l.home_device}; " + ",".join(
                f"{a}-{b}@{dev}" for a, b, dev in l.expert_placement)
            if l.expert_replicas:
                held += "; copies " + ",".join(f"{e}@{dev}" for e, dev in l.expert_replicas)
            if l.placement_generation:
                held += f"; re-placed {l.placement_generation}x"
            held += ")"
        print(f"{l.index:>5} {l.d_model:>7} {l.d_ff:>6} {l.num_experts:>7} {l.top_k:>5} {l.activation:>6} "
              f"{l.weight_dtype + ('/2:4' if l.sparse24 else ''):>5} {'yes' if l.has_router else 'no':>6} {int(l.norm_topk_prob):>4} "
              f"{l.router_rule:>12} {l.num_shared_experts}x{l.shared_d_ff:<4} "
              f"{l.n_group}/{l.topk_group:<4} {l.routed_scaling_factor:>5g} {held}")
    return 0


def _verify(c: Client, args, x, logits, y) -> int:
    from . import reference

    m = c.info()
    try:
        weights = reference.synthetic_weights(m.model, args.layer)
    except ValueError as e:
        print(f"verify: the model {m.model!r} is not a synthetic spec ({e}); nothing to compare with")
        return 1
    served, rebuilt = m.layer(args.layer), weights.info
    keys = ("d_model", "d_ff", "num_experts", "activation", "weight_dtype", "router_rule")
    if any(getattr(served, k) != getattr(rebuilt, k) for k in keys):
        print(f"verify: the server's layer {args.layer} is not what its spec {m.model!r} describes: "
              f"{[(k, getattr(served, k), getattr(rebuilt, k)) for k in keys]}")
        return 1
    if served.sparse24:  # moed --weights sparse24: the spec's weights, pruned as the server did
        weights = reference.sparse24_weights(weights)
    route = reference.gate(logits, args.strategy, args.top_k, info=weights.info, bias=weights.bias)
    ref = reference.forward(x, weights, route)
    err = np.abs(y.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30)
    tols = {"f32": 1e-4, "f16": 2e-3, "bf16": 1.6e-2}
    tol = tols[args.dtype]
    if m.backend == "cuda":  # it multiplies in f16 for f16 layers, else in bf16 (docs/cuda.md)
        tol = max(tol, tols["f16" if served.weight_dtype == "f16" else "bf16"])
    print(f"verify: max |y - reference| / max |reference| = {err:.3g} (tolerance {tol:g} for {args.dtype})")
    return 0 if err <= tol else 1


def _forward(c: Client, args) -> int:
    layer = c.info().layer(args.layer)
    rng = np.random.default_rng(args.seed)
    x = rng.standard_normal((args.tokens, layer.d_model)).astype(_np_dtype(args.dtype))
    logits = rng.standard_normal((args.tokens, layer.num_experts)).astype(np.float32)
    r = c.forward(args.layer, x, router_logits=logits, strategy=args.strategy, top_k=args.top_k,
                  return_info=True, transport=args.transport)
    y, t = r.output, r.timings
    print(f"transport {next(k for k, n in c.transport_calls.items() if n)}")
    y64 = y.astype(np.float64)
    print(f"output   {list(y.shape)} {y.dtype}: mean {y64.mean():.4g} std {y64.std():.4g} "
          f"min {y64.min():.4g} max {y64.max():.4g}")
    print(f"timings  queue {t.queue_us} us, compute {t.compute_us} us, total {t.total_us} us, "
          f"batch of {t.batch_tokens} tokens / {t.batch_requests} requests")
    return _verify(c, args, x, logits, y) if args.verify else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moed", description="Call a moed server.")
    p.add_argument("--target", default="127.0.0.1:50051",
                   help="server address (default %(default)s); several, comma-separated: a fleet")
    p.add_argument("--timeout", type=float, default=None, help="deadline of each call, seconds")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("health", help="print the health status")
    sub.add_parser("info", help="print the layers, backend, devices and limits")
    f = sub.add_parser("forward", help="send random data, print a summary of the reply")
    f.add_argument("--layer", type=int, default=0)
    f.add_argument("--tokens", type=int, default=8)
    f.add_argument("--dtype", choices=_DTYPES, default="f32")
    f.add_argument("--strategy", default="model",
                   help="model|topk|sigmoid|sparsemax|quadratic|pioneer (default %(default)s)")
    f.add_argument("--top-k", type=int, default=0, help="0: the layer's top_k")
    f.add_argument("--seed", type=int, default=0, help="random data seed")
    f.add_argument("--verify", action="store_true", help="compare with moed.reference (synthetic models)")
    f.add_argument("--transport", choices=("auto", "inline", "shm"), default="auto",
                   help="how hidden travels (moed.transport; default %(default)s: shared memory from "
                        "64 KiB when the server is on this host)")
    args = p.parse_args(argv)
    try:
        several = "," in args.target and not args.target.startswith(("ipv4:", "ipv6:"))
        with connect(args.target.split(",") if several else args.target, timeout=args.timeout) as c:
            if args.cmd == "health":
                print(c.health())
                return 0
            if args.cmd == "info":
                return _info(c)
            return _forward(c, args)
    except InvalidArgument as e:  # what the client refused to send: a usage error
        print(f"moed: {e.message}", file=sys.stderr)
        return 2
    except MoEError as e:
        print(f"moed: {e.code_name}: {e.message}", file=sys.stderr)
        return 1
    except (KeyError, ValueError) as e:
        print(f"moed: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
