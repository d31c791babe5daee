"""FP8 expert weights (block-scaled e4m3) end to end, on the CPU backend (the reference): checkpoints
as DeepSeek-V3 and the Qwen3 -FP8 releases ship them (F8_E4M3 weights with float32
weight_scale_inv blocks, written here by make_checkpoint.py with ml_dtypes and scales moed never
computes itself) match the float64 numpy model on the dequantized weights; malformed scales and
other FP8 schemes are refused at the start with a message naming the tensor or field; `--weights
fp8` quantizes a bf16 checkpoint and `dtype=fp8` a synthetic model by moed_fp8.h's rule, which
oracle.py and moed.reference each rebuild bit for bit; GetModel reports the weights as fp8; and a
request tensor in FP8 is INVALID_ARGUMENT naming it.
"""

import json
import struct

import grpc
import numpy as np
import pytest

import oracle as O
from make_checkpoint import write_checkpoint
from moed import reference
from test_checkpoint import routing_spec, start_fails

# d and ff not multiples of 128: partial scale blocks at the edges of every matrix
DEEPSEEK = dict(arch="deepseek_v3", layers=3, d=200, ff=160, experts=8, top_k=2, dtype="fp8",
                n_shared=1, n_group=4, topk_group=2, routed_scale=2.5, shards=2, seed=31)
QWEN3 = dict(arch="qwen3_moe", layers=2, d=136, ff=72, experts=6, top_k=2, dtype="fp8", seed=32)


def header(path):
    """The JSON header of a .safetensors file."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])


# safetensors' numpy loader cannot read F8_E4M3 (numpy has no such dtype), so the tests that edit a
# checkpoint read and write the format themselves: the tensors as (dtype string, shape, raw bytes).
NP = {"F32": np.float32, "F8_E4M3": np.uint8}


def st_load(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    h = json.loads(data[8:8 + n])
    meta = h.pop("__metadata__", None)
    body = data[8 + n:]
    return {k: (v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in h.items()}, meta


def st_save(path, tensors, meta):
    h, at, chunks = {}, 0, []
    for k, (dtype, shape, raw) in sorted(tensors.items()):
        h[k] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(raw)]}
        chunks.append(raw)
        at += len(raw)
    if meta:
        h["__metadata__"] = meta
    text = json.dumps(h).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def array(t):
    """A tensor's values (F32, or F8_E4M3 as its uint8 codes), writable, in its shape."""
    dtype, shape, raw = t
    return np.frombuffer(raw, NP[dtype]).reshape(shape).copy()


def check_layer(c, index, w, kw, rng):
    """The layer's own router, client logits and a client choice, against the numpy model."""
    spec = routing_spec(w, kw["experts"])
    x, x64 = O.hidden(rng, 7, kw["d"], "f32", scale=2.0)
    y = c.forward(index, x)
    route = O.gate(O.router_logits(x64, w), "model", spec, bias=w["bias"])
    O.check(y, O.forward(x64, w, route, "swiglu"), "f32", f"layer {index} server router")
    logits = (2 * rng.standard_normal((7, kw["experts"]))).astype(np.float32)
    y = c.forward(index, x, router_logits=logits)
    O.check(y, O.forward(x64, w, O.gate(logits, "model", spec, bias=w["bias"]), "swiglu"), "f32",
            f"layer {index} logits")
    xb, xb64 = O.hidden(rng, 5, kw["d"], "bf16")
    ids = np.stack([rng.permutation(kw["experts"])[:2] for _ in range(5)]).astype(np.int32)
    gw = rng.uniform(0, 1, (5, 2)).astype(np.float32)
    y = c.forward(index, xb, expert_ids=ids, expert_weights=gw)
    O.check(y, O.forward(xb64, w, O.choice_route(ids, gw), "swiglu"), "bf16", f"layer {index} choice")


@pytest.mark.parametrize("kw", [DEEPSEEK, QWEN3], ids=["deepseek_v3", "qwen3_moe"])
def test_fp8_checkpoint_matches_the_dequantized_model(daemon, tmp_path, kw):
    layers = write_checkpoint(tmp_path, **kw)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    files = sorted(tmp_path.glob("*.safetensors"))
    first = min(layers)
    name = f"model.layers.{first}.mlp.experts.0.down_proj.weight"
    h = next(header(f) for f in files if name in header(f))
    assert h[name]["dtype"] == "F8_E4M3" and h[name]["shape"] == [kw["d"], kw["ff"]]
    assert h[name + "_scale_inv"]["dtype"] == "F32"
    assert h[name + "_scale_inv"]["shape"] == [-(-kw["d"] // 128), -(-kw["ff"] // 128)]
    assert h[f"model.layers.{first}.mlp.gate.weight"]["dtype"] == "BF16"  # routers stay as they are

    d = daemon("--model", tmp_path, "--threads", "1", "--backend", "cpu")
    rng = np.random.default_rng(kw["seed"])
    with d.client(timeout=30) as c:
        info = c.info()
        assert sorted(layers) == [l.index for l in info.layers]
        for index, w in layers.items():
            li = info.layer(index)
            assert li.weight_dtype == "fp8"
            assert (li.num_shared_experts > 0) == (w["shared_w1"] is not None)
            check_layer(c, index, w, kw, rng)


SMALL = dict(arch="deepseek_v3", layers=2, d=160, ff=136, experts=4, top_k=2, dtype="fp8",
             n_shared=1, seed=35)
W2 = "model.layers.1.mlp.experts.2.down_proj.weight"


def _set_scale(value):
    def change(t):
        s = array(t[W2 + "_scale_inv"])
        s[1, 0] = value
        t[W2 + "_scale_inv"] = ("F32", s.shape, s.tobytes())
    return change


def _pop_scale(t):
    t.pop(W2 + "_scale_inv")


def _misshape_scale(t):
    t[W2 + "_scale_inv"] = ("F32", (1, 2), np.ones((1, 2), np.float32).tobytes())


def _nan_code(t):
    q = array(t[W2])
    q[3, 5] = 0xFF
    t[W2] = ("F8_E4M3", q.shape, q.tobytes())


BROKEN = {
    "scale_missing": (_pop_scale, [W2 + "_scale_inv", "missing"]),
    "scale_wrong_shape": (_misshape_scale, [W2 + "_scale_inv", "[1, 2]", "[2, 2]"]),
    "scale_nan": (_set_scale(np.nan), [W2 + "_scale_inv", "nan", "[1, 0]", "finite number > 0"]),
    "scale_negative": (_set_scale(-0.5), [W2 + "_scale_inv", "-0.5", "finite number > 0"]),
    "scale_zero": (_set_scale(0.0), [W2 + "_scale_inv", "[1, 0]", "finite number > 0"]),
    "scale_infinite": (_set_scale(np.inf), [W2 + "_scale_inv", "inf", "finite number > 0"]),
    # finite, but 448 x 1e38 is not (W2 is [160, 136]: its rows sum 136 products)
    "scale_huge": (_set_scale(1e38), [W2 + "_scale_inv", "1e+38", "[1, 0]", "at most 5.58499e+33",
                                      "448 x 136 columns"]),
    "weight_nan_code": (_nan_code, [W2, "NaN code", "[3, 5]"]),
}


@pytest.mark.parametrize("name", BROKEN)
def test_malformed_scales_are_refused_naming_the_tensor(tmp_path, name):
    change, words = BROKEN[name]
    write_checkpoint(tmp_path, **SMALL)
    file = tmp_path / "model.safetensors"
    tensors, meta = st_load(file)
    change(tensors)
    st_save(file, tensors, meta)
    code, err = start_fails(tmp_path)
    assert code == 1, err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("change,words", [
    ({"weight_block_size": [64, 64]}, ["quantization_config.weight_block_size", "[64,64]", "[128, 128]"]),
    ({"weight_block_size": None}, ["quantization_config.weight_block_size", "missing"]),
    ({"quant_method": "gptq"}, ["quantization_config.quant_method", "gptq"]),
    ({"fmt": "e5m2"}, ["quantization_config.fmt", "e5m2"]),
    ({"activation_scheme": "static"}, ["quantization_config.activation_scheme", "static"]),
    (None, ["F8_E4M3", "no quantization_config"]),
], ids=["block_64", "no_block_size", "gptq", "e5m2", "static_activations", "no_config"])
def test_other_fp8_schemes_are_refused_naming_the_field(tmp_path, change, words):
    write_checkpoint(tmp_path, **SMALL)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    if change is None:
        del config["quantization_config"]
    else:
        q = config["quantization_config"]
        q.update(change)
        for k in [k for k, v in q.items() if v is None]:
            del q[k]
    path.write_text(json.dumps(config))
    code, err = start_fails(tmp_path)
    assert code == 1, err
    for word in words:
        assert word in err, err


def quantized(w):
    """A checkpoint's float weights as --weights fp8 serves them (the router is kept)."""
    q = dict(w)
    for k in ("w1", "w3", "w2"):
        q[k] = np.stack([O.fp8_weights(m.astype(np.float32)) for m in w[k]])
    for k in ("shared_w1", "shared_w3", "shared_w2"):
        if w[k] is not None:
            q[k] = O.fp8_weights(w[k].astype(np.float32))
    return q


def test_weights_fp8_quantizes_a_bf16_checkpoint(daemon, tmp_path):
    kw = dict(arch="deepseek_v3", layers=2, d=200, ff=136, experts=4, top_k=2, dtype="bf16",
              n_shared=1, seed=36)
    layers = write_checkpoint(tmp_path, **kw)
    d = daemon("--model", tmp_path, "--weights", "fp8", "--threads", "1", "--backend", "cpu")
    rng = np.random.default_rng(36)
    with d.client(timeout=30) as c:
        for index, w in layers.items():
            assert c.info().layer(index).weight_dtype == "fp8"
            q = quantized(w)
            check_layer(c, index, q, kw, rng)
            # the quantization is real: the unquantized model is off by far more than float32 sums
            x, x64 = O.hidden(rng, 6, kw["d"], "f32")
            ids = np.array([[0, 1]] * 6, np.int32)
            gw = np.full((6, 2), 0.5, np.float32)
            y = c.forward(index, x, expert_ids=ids, expert_weights=gw)
            exact = O.forward(x64, w, O.choice_route(ids, gw), "swiglu")
            off = O.rel_err(y, exact)
            assert 1e-4 < off < 0.2, off


def test_synthetic_fp8_is_rebuilt_bit_for_bit(daemon):
    spec = O.Spec(layers=1, d=200, ff=136, experts=6, topk=2, dtype="fp8", seed=37, shared=1,
                  shared_ff=72, rule="deepseek", groups=2, topk_groups=1, scale=2.0)
    d = daemon("--synthetic", str(spec), "--threads", "1", "--backend", "cpu")
    rng = np.random.default_rng(37)
    with d.client(timeout=30) as c:
        info = c.info()
        assert "dtype=fp8" in info.model and info.layers[0].weight_dtype == "fp8"
        w = spec.layer(0)
        ref = reference.synthetic_weights(info.model, 0)  # the client's reading of the same rule
        for k in ("w1", "w3", "w2", "router", "shared_w1", "shared_w3", "shared_w2"):
            assert np.array_equal(getattr(ref, k), w[k]), k
        x, x64 = O.hidden(rng, 9, spec.d, "f32")
        y = c.forward(0, x)
        route = O.gate(O.router_logits(x64, w, "f32", "deepseek"), "model", spec, bias=w["bias"])
        O.check(y, O.forward(x64, w, route, "swiglu"), "f32", "synthetic fp8")


def test_weights_fp8_with_a_synthetic_spec_is_dtype_fp8(daemon):
    spec = O.Spec(layers=1, d=64, ff=96, experts=4, topk=2, dtype="bf16", seed=38)
    d = daemon("--synthetic", str(spec), "--weights", "fp8", "--threads", "1", "--backend", "cpu")
    fp8 = O.Spec(**{**spec.__dict__, "dtype": "fp8", "_cache": {}})
    rng = np.random.default_rng(38)
    with d.client(timeout=30) as c:
        info = c.info()
        assert "dtype=fp8" in info.model and info.layers[0].weight_dtype == "fp8"
        x, x64 = O.hidden(rng, 5, spec.d, "f32")
        ids = np.array([[1, 3]] * 5, np.int32)
        gw = np.full((5, 2), 0.5, np.float32)
        y = c.forward(0, x, expert_ids=ids, expert_weights=gw)
        O.check(y, O.forward(x64, fp8.layer(0), O.choice_route(ids, gw), "swiglu"), "f32")


def test_an_fp8_request_tensor_is_invalid_argument(daemon):
    spec = O.Spec(layers=1, d=64, ff=96, experts=4, topk=2, dtype="fp8", seed=39)
    d = daemon("--synthetic", str(spec), "--threads", "1", "--backend", "cpu")
    x, _ = O.hidden(np.random.default_rng(39), 3, spec.d, "f32")
    with d.client(timeout=30) as c:
        req = c.build_request(0, x, strategy="topk")
    req.hidden.dtype = 5  # FP8
    req.hidden.data = req.hidden.data[: 3 * spec.d]
    with d.channel() as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/moed.v1.Moed/Forward")(req.SerializeToString(), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hidden" in e.value.details() and "fp8" in e.value.details(), e.value.details()
    with d.client(timeout=30) as c:  # and the daemon still serves
        assert c.health() == "SERVING"
