"""Writes the seed corpus of fuzz_request: ForwardRequests encoded by the Python client (as callers
send them) for the fuzzer's served model (fuzz_request.c: layers 0 and 1 with d=8 and 8 experts,
layer 3 with d=16 and 16 experts and DeepSeek routing, layer 7 with d=8, 4 experts, no router).

Most seeds are valid, so the fuzzer starts deep inside validation and gating; a few carry one
classic mistake each (T = 0, unknown layer, id out of range, NaN weight, wrong dtype), a few are
hand-varied encodings a protobuf encoder may also produce (unknown fields, unpacked shape), and
one is an input the fuzzer found a bug with (sparsemax over huge logits).

usage: python make_seeds.py OUT_DIR
"""
import pathlib
import sys

import ml_dtypes
import numpy as np

from moed import MoEClient

LAYERS = {0: (8, 8), 1: (8, 8), 3: (16, 16), 7: (8, 4)}  # layer -> (d_model, experts)


def hidden(rng, T, d, dtype):
    x = rng.standard_normal((T, d)).astype(np.float32)
    return x.astype({"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}[dtype])


def seeds():
    rng = np.random.default_rng(7)
    build = MoEClient.build_request  # needs no connection: called unbound with self=None
    out = {}
    for layer, (d, E) in LAYERS.items():
        for dtype in ("f32", "f16", "bf16"):
            for T in (1, 3):
                ids = rng.integers(0, E, size=(T, 2)).astype(np.int32)
                w = rng.random((T, 2)).astype(np.float32)
                out[f"choice-l{layer}-{dtype}-t{T}"] = build(None, layer, hidden(rng, T, d, dtype),
                                                             expert_ids=ids, expert_weights=w,
                                                             request_id=f"r-{layer}-{T}")
        logits = rng.standard_normal((2, E)).astype(np.float32)
        x = hidden(rng, 2, d, "f32")
        for strategy in ("model", "topk", "sigmoid", "sparsemax", "quadratic", "pioneer"):
            out[f"logits-l{layer}-{strategy}"] = build(
                None, layer, x, router_logits=logits, strategy=strategy,
                top_k=2 if strategy in ("topk", "quadratic", "pioneer") else 0,
                threshold=0.3 if strategy == "sigmoid" else None,
                renormalize=False if strategy == "topk" else None)
        out[f"server-l{layer}"] = build(None, layer, x, strategy="topk", top_k=1, renormalize=True)
        out[f"batch-logits-l{layer}"] = build(None, layer, x, router_logits=logits,
                                              batch_gating=True, k_batch=2)
        out[f"batch-server-l{layer}"] = build(None, layer, x, batch_gating=True)
    x = hidden(rng, 2, 8, "f32")
    ids = np.array([[0, -1], [7, 1]], np.int32)
    w = np.array([[1.0, 0.0], [0.5, 0.5]], np.float32)
    out["padding"] = build(None, 0, x, expert_ids=ids, expert_weights=w, request_id="päd ✓")
    bad = {
        "bad-t0": build(None, 0, np.zeros((0, 8), np.float32), expert_ids=np.zeros((0, 2), np.int32),
                        expert_weights=np.zeros((0, 2), np.float32)),
        "bad-layer": build(None, 5, x, expert_ids=ids, expert_weights=w),
        "bad-id": build(None, 0, x, expert_ids=np.array([[0, 8], [1, 2]], np.int32), expert_weights=w),
        "bad-nan": build(None, 0, x, expert_ids=ids,
                         expert_weights=np.array([[np.nan, 0], [1, 0]], np.float32)),
        "bad-dtype": build(None, 0, x, expert_ids=ids, expert_weights=w),
    }
    bad["bad-dtype"].hidden.dtype = 4  # I32: not a dtype hidden may have
    out.update(bad)
    # Found by this fuzzer: sparsemax over logits above 2^53 gave infinite weights (moed_route.c);
    # kept as a seed so a regression shows at once.
    huge = np.array([[5.4e37, 1.0, -3.0, 0.5], [0.2, -0.3, 1.5, 0.1]], np.float32)
    out["sparsemax-huge-logits"] = build(None, 7, hidden(rng, 2, 8, "f32"), router_logits=huge,
                                         strategy="sparsemax")
    blobs = {name: req.SerializeToString() for name, req in out.items()}
    base = blobs["choice-l0-f32-t1"]
    blobs["unknown-fields"] = base + b"\x98\x06\x01" + b"\xa2\x06\x03abc"  # fields 99 and 100
    # Field 3 (hidden) again with an unpacked shape: repeated messages merge, shape appends.
    blobs["unpacked-shape"] = base + b"\x1a\x04\x10\x01\x10\x08"
    return blobs


def main():
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    blobs = seeds()
    for name, blob in blobs.items():
        (out / f"{name}.bin").write_bytes(blob)
    print(f"make_seeds: {len(blobs)} seeds in {out}")


if __name__ == "__main__":
    main()
