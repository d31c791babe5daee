"""Writes the seed corpus of one fuzzer (tests/fuzz/run.sh): KIND is request, region, ring, link,
http, safetensors, npy or expert_load.

request: ForwardRequests encoded by the Python client (as callers send them) for the fuzzer's served
model (fuzz_request.c: layers 0 and 1 with d=8 and 8 experts,
layer 3 with d=16 and 16 experts and DeepSeek routing, layer 7 with d=8, 4 experts, no router).

Most seeds are valid, so the fuzzer starts deep inside validation and gating; a few carry one
classic mistake each (T = 0, unknown layer, id out of range, NaN weight, wrong dtype), a few are
hand-varied encodings a protobuf encoder may also produce (unknown fields, unpacked shape), and
one is an input the fuzzer found a bug with (sparsemax over huge logits).

http: requests as Prometheus, curl and probes send them, with and without a token, and a few
classic refusals (a body, folding, HTTP/2's preface, a head split by bare LFs).

safetensors: files written by the `safetensors` package (every weight dtype, 0-d and empty tensors,
metadata), as checkpoints hold them.

npy: arrays saved by numpy (every dtype the tools read, 0-d, empty, format 2.0, Fortran order).

expert_load: /metrics pages as moed writes them (the counters of a few layers among the other
metrics), with the variations Prometheus text allows (labels in the other order, blanks, a
trailing comma, floats, a timestamp, CRLF), and a few refusals (a negative, NaN or missing value,
an unknown label, a duplicate, an expert id past the largest).

usage: python make_seeds.py KIND OUT_DIR
"""
import io
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
    # Region references (fuzz_request.c: regions 1, 2 and 4 are the caller's, 4 shrunk; 3 is
    # another principal's): hidden, routing tensors and the output in regions.
    x = hidden(rng, 2, 8, "f32")
    ids = np.array([[0, 1], [2, 3]], np.int32)
    w = np.array([[0.5, 0.5], [1.0, 0.0]], np.float32)
    for name, (hid, rid, out_region) in {"region-hidden": (1, None, None),
                                         "region-all": (1, 1, 2),
                                         "region-output": (None, None, 2),
                                         "region-foreign": (3, None, None),
                                         "region-shrunk": (4, None, 2)}.items():
        req = build(None, 0, x, expert_ids=ids, expert_weights=w)
        if hid:
            req.hidden.region.region, req.hidden.region.offset, req.hidden.region.length = hid, 64, 64
        if rid:
            for t, off in ((req.experts.expert_ids, 4096), (req.experts.expert_weights, 128)):
                t.region.region, t.region.offset, t.region.length = rid, off, 16
        if out_region:
            req.output.region, req.output.offset, req.output.length = out_region, 256, 64
        out[name] = req
    req = build(None, 7, hidden(rng, 3, 8, "f32"), router_logits=rng.standard_normal((3, 4)).astype(np.float32))
    req.logits.logits.region.region, req.logits.logits.region.offset = 1, 512
    req.logits.logits.region.length = 48
    out["region-logits"] = req
    blobs = {name: req.SerializeToString() for name, req in out.items()}
    base = blobs["choice-l0-f32-t1"]
    blobs["unknown-fields"] = base + b"\x98\x06\x01" + b"\xa2\x06\x03abc"  # fields 99 and 100
    # Field 3 (hidden) again with an unpacked shape: repeated messages merge, shape appends.
    blobs["unpacked-shape"] = base + b"\x1a\x04\x10\x01\x10\x08"
    return blobs


def region_seeds():
    """RegionCommands in fuzz_region.c's framing (2-byte length, then the command), several per
    seed: the two steps of a host registration of the harness's object, unregistering, CUDA
    handles, bad names and sizes."""
    from moed._proto.moed.v1 import moed_pb2 as pb

    name = "/moed-fuzz-region-0000000"  # the harness puts its own object's name here

    def frame(*cmds):
        out = b""
        for c in cmds:
            b = c.SerializeToString() if hasattr(c, "SerializeToString") else c
            out += len(b).to_bytes(2, "little") + b
        return out

    C = pb.RegionCommand
    reg = C(seq=1, register_host=pb.RegisterHostRegion(name=name, bytes=4096))
    rings_reg = C(seq=1, register_host=pb.RegisterHostRegion(name="/moed-fuzz-rings--0000000", bytes=4096))

    def ring(seq, region, offset, slots):
        return C(seq=seq, register_ring=pb.RegisterRing(region=region, offset=offset, slots=slots))
    return {
        "register-confirm-unregister": frame(reg, C(seq=2, confirm_host=pb.ConfirmHostRegion(region=1)),
                                             C(seq=3, unregister=pb.UnregisterRegion(region=1))),
        "register-twice": frame(reg, C(seq=2, register_host=pb.RegisterHostRegion(name=name, bytes=16))),
        "register-too-big": frame(C(seq=1, register_host=pb.RegisterHostRegion(name=name, bytes=1 << 30))),
        "bad-names": frame(*[C(seq=i, register_host=pb.RegisterHostRegion(name=n, bytes=64))
                             for i, n in enumerate(["/a/b", "/..", "noslash", "/" + "x" * 300], 1)]),
        "cuda": frame(C(seq=1, register_cuda=pb.RegisterCudaRegion(ipc_handle=bytes(64),
                                                                   device_uuid="GPU-0", bytes=64))),
        "empty-and-junk": frame(C(seq=9), b"\xff\xff\xff", b""),
        "unregister-unknown": frame(C(seq=1, unregister=pb.UnregisterRegion(region=77))),
        # unknown groups (protobuf-c cannot skip them; moed drops them first), nested, and inside
        # the register_host sub-message: field 9 start, a varint, field 9 end
        "groups": frame(b"\x08\x01\x4b\x4b\x08\x07\x4c\x4c" + reg.SerializeToString()[2:],
                        b"\x08\x02\x2a\x06\x4b\x08\x01\x4c\x08\x4d"),
        # rings in the object that confirms (a ring header of 4 slots at 256): register, a second
        # over the cap of 2... , unregister, a bad offset, slots that disagree
        "rings": frame(rings_reg, C(seq=2, confirm_host=pb.ConfirmHostRegion(region=1)),
                       ring(3, 1, 256, 4), ring(4, 1, 256, 4), ring(5, 1, 256, 4),
                       C(seq=6, unregister=pb.UnregisterRegion(region=1)),
                       C(seq=7, unregister_ring=pb.UnregisterRing(ring=2)), ring(8, 1, 320, 4)),
        "ring-bad": frame(rings_reg, C(seq=2, confirm_host=pb.ConfirmHostRegion(region=1)),
                          ring(3, 1, 256, 3), ring(4, 1, 100, 4), ring(5, 1, 3840, 4), ring(6, 7, 256, 4),
                          C(seq=7, unregister_ring=pb.UnregisterRing(ring=99))),
    }


def ring_seeds():
    """fuzz_ring.c's inputs: a ring header, the slots and bytes register_ring gives, then call
    descriptors naming the harness's regions (1 and 2 the caller's host regions, 3 another
    principal's, 4 shrunk, 5 and 6 CUDA regions of devices 0 and 1) for its layers 0 (d=8, 8
    experts) and 3 (d=16, 16 experts): valid ones, host and device routed, and a few mistakes."""
    import struct

    def header(slots=8, magic=0x4752444D, version=1):
        return struct.pack("<IHHII", magic, version, 256, 512, slots).ljust(256, b"\0")

    def desc(layer=0, dtype=1, T=2, k=2, hidden=(1, 0), ids=(1, 4096), weights=(1, 16), out=(2, 0),
             d=8, flags=0, deadline=0):
        size = {1: 4, 2: 2, 3: 2}.get(dtype, 4)
        b = struct.pack("<IIIIIIIIQ", 1, flags, layer, dtype, T, k, deadline, 0, 42)
        for (region, off), n in ((hidden, T * d * size), (ids, T * k * 4), (weights, T * k * 4),
                                 (out, T * d * size)):
            b += struct.pack("<QQQ", region, off, n)
        return b.ljust(256, b"\0")

    good = header() + struct.pack("<IQ", 8, 1 << 20)
    return {
        "host": good + desc() + desc(dtype=3, T=3) + desc(layer=3, d=16, T=1, k=4),
        "device": good + desc(ids=(5, 4), weights=(5, 2048)) + desc(ids=(5, 4), weights=(6, 2048)),
        "mistakes": good + desc(layer=1) + desc(T=0) + desc(hidden=(3, 0)) + desc(hidden=(4, 0)),
        "more-mistakes": good + desc(flags=1) + desc(k=0) + desc(out=(1, 2 ** 64 - 64)) + desc(dtype=4),
        "huge-k": good + desc(k=2 ** 31) + desc(T=64, k=2 ** 32 - 1, ids=(5, 0), weights=(5, 0)),
        "bad-header": header(magic=0) + struct.pack("<IQ", 8, 4096) + desc(deadline=5),
        "big-ring": header(4096) + struct.pack("<IQ", 4096, 2 ** 64 - 1),
    }


def link_seeds():
    """fuzz_link's inputs (its comment has the format): good calls (a header, then its payload),
    several in a row, a wrong key, a refused layer, a payload of the wrong size, a header whose
    magic or seq is wrong, T over the link's max_tokens."""
    def rec(kind, b=b""):
        return bytes([kind]) + len(b).to_bytes(2, "little") + b

    def call(layer=0, dtype=0, T=2, k=2, xor=b"", payload=b"\x00\x00\x00\x00"):
        return rec(0, bytes([layer, dtype, T - 1, k - 1]) + xor) + rec(2, payload)

    return {
        "good": b"\x00" + call(),
        "three": b"\x00" + call(T=1) + call(dtype=1, T=8, k=4) + call(dtype=2, T=3, k=1),
        "wrong-key": b"\x01" + call(),
        "refused-layer": b"\x00" + call(layer=1) + call(),
        "short-payload": b"\x00" + rec(0, bytes(4)) + rec(1, b"\x00" * 16) + call(),
        "bad-magic": b"\x00" + rec(0, bytes(4) + b"\x01"),
        "bad-seq": b"\x00" + rec(0, bytes(4) + bytes(8) + b"\x02"),
        "over-max-tokens": b"\x00" + rec(0, bytes(4) + bytes(24) + b"\x08"),
    }


def http_seeds():
    token = "Authorization: Bearer " + "ab" * 32 + "\r\n"
    heads = {
        "prometheus": "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:8464\r\nUser-Agent: Prometheus/2.53.0\r\n"
                      "Accept: application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.4\r\n"
                      "Accept-Encoding: gzip\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n",
        "prometheus-token": "GET /metrics HTTP/1.1\r\nHost: x\r\n" + token + "\r\n",
        "curl": "GET /healthz HTTP/1.1\r\nHost: localhost:8464\r\nUser-Agent: curl/7.88.1\r\nAccept: */*\r\n\r\n",
        "head-query": "HEAD /metrics?name[]=moed_up HTTP/1.0\n\n",
        "probe": "GET /healthz HTTP/1.1\r\nHost: 10.0.0.5:8464\r\nUser-Agent: kube-probe/1.30\r\n"
                 "Connection: close\r\n\r\n",
        "content-length-0": "GET /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
        "post": "POST /metrics HTTP/1.1\r\nContent-Length: 4\r\n\r\nbody",
        "chunked": "GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "folded": "GET /metrics HTTP/1.1\r\nX: a\r\n b\r\n\r\n",
        "two-tokens": "GET /metrics HTTP/1.1\r\n" + token + token + "\r\n",
        "h2-preface": "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        "bare-lf": "GET / HTTP/1.1\nA: b\n\r\n",
    }
    blobs = {k: v.encode() for k, v in heads.items()}
    blobs["long-header"] = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 8200 + b"\r\n\r\n"
    return blobs


def safetensors_seeds():
    from safetensors.numpy import save
    rng = np.random.default_rng(1)
    w = {"model.layers.0.mlp.experts.0.gate_proj.weight": rng.standard_normal((4, 8)).astype(np.float32),
         "model.layers.0.mlp.gate.weight": rng.standard_normal((2, 8)).astype(np.float16),
         "bias": np.zeros(3, np.float64), "ids": np.arange(5, dtype=np.int64)}
    bf = rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16)
    return {
        "mixed": save(w, metadata={"format": "pt"}),
        "bf16": save({"x": bf}),
        "scalar-and-empty": save({"s": np.float32(3.0).reshape(()), "e": np.zeros((0, 4), np.float32),
                                  "b": np.array([True, False])}),
        "one": save({"a": np.ones(1, np.uint8)}),
    }


def npy_seeds():
    def npy(a, version=None):
        buf = io.BytesIO()
        if version:
            np.lib.format.write_array(buf, a, version=version)
        else:
            np.save(buf, a)
        return buf.getvalue()

    rng = np.random.default_rng(2)
    return {
        "f32": npy(rng.standard_normal((3, 4)).astype(np.float32)),
        "f16": npy(rng.standard_normal((2, 2)).astype(np.float16)),
        "f64": npy(rng.standard_normal(5)),
        "i32": npy(np.arange(6, dtype=np.int32).reshape(2, 3)),
        "i64": npy(np.arange(4, dtype=np.int64)),
        "u16": npy(np.arange(4, dtype=np.uint16)),
        "bf16": npy(rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16)),
        "scalar": npy(np.float32(1.5)),
        "empty": npy(np.zeros((0, 3), np.float32)),
        "v2": npy(np.ones((2, 2), np.float32), version=(2, 0)),
        "fortran": npy(np.asfortranarray(np.ones((2, 3), np.float32))),
        "big-endian": npy(np.ones(3, ">f4")),
    }


def expert_load_seeds():
    head = ("# HELP moed_tokens_total Tokens computed (rows of hidden, over every launch).\n"
            "# TYPE moed_tokens_total counter\nmoed_tokens_total 4096\n"
            "# HELP moed_expert_tokens_total (token, expert) pairs computed, by layer and expert "
            "(the whole layer's numbering; a daemon holding an expert shard counts its own "
            "experts).\n# TYPE moed_expert_tokens_total counter\n")
    tail = ("# HELP moed_request_bytes_total Bytes of Forward request messages received.\n"
            "# TYPE moed_request_bytes_total counter\nmoed_request_bytes_total 123\n"
            'moed_forward_seconds_bucket{le="+Inf"} 3\n')
    rng = np.random.default_rng(3)
    page = head + "".join(f'moed_expert_tokens_total{{layer="{layer}",expert="{e}"}} '
                          f"{int(rng.integers(0, 10 ** 6))}\n"
                          for layer in (0, 1, 3) for e in range(8)) + tail
    s = "moed_expert_tokens_total"
    texts = {
        "page": page,
        "page-crlf": page.replace("\n", "\r\n"),
        "variants": f'{s}{{expert="2",layer="1"}} 1.5e+06\n  {s} {{ layer = "1" ,\texpert="3", }}  7  '
                    f'1712345678901\n{s}{{layer="1",expert="4"}} 0.25\n{s}{{layer="1",expert="5"}} -0',
        "zeros": f'{s}{{layer="2",expert="0"}} 0\n{s}{{layer="2",expert="1"}} 0\n',
        "empty": "",
        "bad-negative": f'{s}{{layer="0",expert="0"}} -3\n',
        "bad-nan": f'{s}{{layer="0",expert="0"}} NaN\n',
        "bad-no-value": f'{s}{{layer="0",expert="0"}}\n',
        "bad-label": f'{s}{{layer="0",expert="0",instance="h:1"}} 1\n',
        "bad-duplicate": f'{s}{{layer="0",expert="0"}} 1\n{s}{{expert="0",layer="0"}} 2\n',
        "bad-id": f'{s}{{layer="0",expert="65536"}} 1\n',
    }
    return {name: text.encode() for name, text in texts.items()}


KINDS = {"request": lambda: seeds(), "region": region_seeds, "ring": ring_seeds, "link": link_seeds,
         "http": http_seeds,
         "safetensors": safetensors_seeds, "npy": npy_seeds, "expert_load": expert_load_seeds}


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in KINDS:
        sys.exit(f"usage: make_seeds.py {'|'.join(KINDS)} OUT_DIR")
    out = pathlib.Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    blobs = KINDS[sys.argv[1]]()
    for name, blob in blobs.items():
        (out / f"{name}.bin").write_bytes(blob)
    print(f"make_seeds: {len(blobs)} {sys.argv[1]} seeds in {out}")


if __name__ == "__main__":
    main()
