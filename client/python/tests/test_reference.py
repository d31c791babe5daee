"""Tests of moed.reference: the generator against a scalar pure-Python reading of moed_synth.h, and
gating, batch gating and the expert computation on small cases worked out by hand."""

import math
import struct

import ml_dtypes
import numpy as np
import pytest

from moed import reference as ref
from moed.types import LayerInfo

M64 = (1 << 64) - 1


# --- a scalar, pure-Python transcription of common/moed_synth.h -------------------------

def splitmix64_scalar(x):
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def f32_scalar(v):
    return struct.unpack("<f", struct.pack("<f", v))[0]


def bf16_scalar(v):
    """float32 value -> bf16 (round to nearest even on the bit pattern) -> float."""
    u = struct.unpack("<I", struct.pack("<f", v))[0]
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", u))[0]


def f16_scalar(v):
    return struct.unpack("<e", struct.pack("<e", v))[0]


def synth_scalar(seed, layer, tensor, expert, i, fan_in, dtype):
    key = splitmix64_scalar(splitmix64_scalar(seed) ^ ((layer << 40) | (tensor << 32) | expert))
    u = (splitmix64_scalar((key + i) & M64) >> 40) / float(1 << 24)
    v = f32_scalar((2.0 * u - 1.0) * math.sqrt(3.0 / fan_in))
    return {"f32": lambda a: a, "bf16": bf16_scalar, "f16": f16_scalar}[dtype](v)


def test_splitmix64_known_value():
    # Vigna's splitmix64 seeded with 0 first returns 0xE220A8397B1DCDAF.
    assert splitmix64_scalar(0) == 0xE220A8397B1DCDAF
    xs = np.array([0, 1, 0xFFFFFFFFFFFFFFFF, 0x123456789ABCDEF0], dtype=np.uint64)
    assert [int(v) for v in ref.splitmix64(xs)] == [splitmix64_scalar(int(x)) for x in xs]


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_synthetic_weights_match_scalar_formula(dtype):
    spec = f"layers=3,d=12,ff=20,experts=5,seed=987654321987,dtype={dtype},act=swiglu,shared=2,shared_ff=6,rule=deepseek"
    layer = 2
    lw = ref.synthetic_weights(spec, layer)
    rng = np.random.default_rng(0)
    checks = [("w1", ref.W1, 20, 12), ("w3", ref.W3, 20, 12), ("w2", ref.W2, 12, 20)]
    for name, tensor, rows, cols in checks:
        arr = getattr(lw, name)
        assert arr.shape == (5, rows, cols)
        for _ in range(40):
            e, r, c = rng.integers(5), rng.integers(rows), rng.integers(cols)
            want = synth_scalar(987654321987, layer, tensor, int(e), int(r * cols + c), cols, dtype)
            assert arr[e, r, c] == want, (name, e, r, c)
    assert lw.router.shape == (5, 12)
    assert lw.router[3, 7] == synth_scalar(987654321987, layer, ref.ROUTER, 0, 3 * 12 + 7, 12, dtype)
    assert lw.shared_w2.shape == (12, 6)
    assert lw.shared_w2[11, 5] == synth_scalar(987654321987, layer, ref.SHARED_W2, 0, 71, 6, dtype)
    assert lw.shared_w1[0, 0] == synth_scalar(987654321987, layer, ref.SHARED_W1, 0, 0, 12, dtype)
    for e in range(5):  # the bias: float32 (2u - 1) * 0.1, expert 0, i = the expert number
        key = splitmix64_scalar(splitmix64_scalar(987654321987) ^ ((layer << 40) | (ref.BIAS << 32)))
        u = (splitmix64_scalar(key + e) >> 40) / float(1 << 24)
        assert lw.bias[e] == f32_scalar((2.0 * u - 1.0) * 0.1)


def test_synthetic_weights_statistics_and_options():
    lw = ref.synthetic_weights("d=64,ff=32,experts=4,act=gelu,dtype=f32,router=0", 1)
    assert lw.w3 is None and lw.router is None and lw.bias is None and lw.shared_w1 is None
    bound = math.sqrt(3.0 / 64)
    assert np.abs(lw.w1).max() < bound and np.abs(lw.w1).max() > 0.9 * bound
    assert abs(lw.w1.var() * 64 - 1.0) < 0.05  # variance 1 / fan_in
    assert not np.array_equal(lw.w1[0], lw.w1[1])  # experts differ
    other_layer = ref.synthetic_weights("d=64,ff=32,experts=4,act=gelu,dtype=f32,router=0", 0)
    assert not np.array_equal(lw.w1, other_layer.w1)
    bf = ref.synthetic_weights("d=64,ff=32,experts=4,act=gelu,router=0", 1)  # default bf16
    assert np.array_equal(bf.w1, lw.w1.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64))
    with pytest.raises(ValueError, match="colour"):
        ref.parse_spec("colour=red")
    with pytest.raises(ValueError, match="layer 2"):
        ref.synthetic_weights("layers=2", 2)


# --- gating -------------------------------------------------------------------------------------

def softmax(v):
    e = np.exp(np.asarray(v, dtype=np.float64) - np.max(v))
    return e / e.sum()


def test_topk_orders_by_score_and_renormalizes():
    l = np.array([[1.0, 3.0, 2.0, 0.0]], dtype=np.float32)
    p = softmax(l[0])
    (ids, w), = ref.gate(l, "topk", top_k=2, renormalize=False)
    assert ids.tolist() == [1, 2]
    np.testing.assert_allclose(w, [p[1], p[2]], rtol=1e-12)
    (ids, w), = ref.gate(l, "topk", top_k=2, renormalize=True)
    np.testing.assert_allclose(w, [p[1] / (p[1] + p[2]), p[2] / (p[1] + p[2])], rtol=1e-12)


def test_ties_go_to_the_lower_index():
    l = np.array([[0.5, 2.0, 2.0, 2.0]], dtype=np.float32)
    (ids, w), = ref.gate(l, "topk", top_k=2, renormalize=True)
    assert ids.tolist() == [1, 2]
    np.testing.assert_allclose(w, [0.5, 0.5])


def test_defaults_come_from_the_layer():
    info = LayerInfo(num_experts=4, top_k=3, norm_topk_prob=False)
    l = np.array([[4.0, 1.0, 3.0, 2.0]], dtype=np.float32)
    (ids, w), = ref.gate(l, "model", info=info)
    assert ids.tolist() == [0, 2, 3]
    np.testing.assert_allclose(w, softmax(l[0])[[0, 2, 3]], rtol=1e-12)
    with pytest.raises(ValueError, match="info"):
        ref.gate(l, "topk")  # top_k=0 needs the layer
    with pytest.raises(ValueError, match="top_k=5"):
        ref.gate(l, "topk", top_k=5, renormalize=True)


def test_quadratic_and_pioneer_transform_the_logits():
    l = np.array([[-3.0, 1.0, 2.0]], dtype=np.float32)
    (ids, w), = ref.gate(l, "quadratic", top_k=2, renormalize=False)
    assert ids.tolist() == [0, 2]
    np.testing.assert_allclose(w, softmax(np.square(l[0].astype(np.float64)))[[0, 2]], rtol=1e-12)
    lp = np.array([[math.pi / 2, 0.1, math.pi, 1.0]], dtype=np.float32)  # cos^2: ~0, ~0.99, 1, 0.29
    (ids, _), = ref.gate(lp, "pioneer", top_k=2, renormalize=True)
    assert ids.tolist() == [2, 1]


def test_sigmoid_threshold_and_empty_routes():
    l = np.array([[2.0, -1.0, 0.5, 0.0], [-5.0, -4.0, -3.0, -2.0]], dtype=np.float32)
    (ids, w), (ids2, w2) = ref.gate(l, "sigmoid", threshold=0.6)
    assert ids.tolist() == [0, 2]  # sigmoid 0.881, 0.622 > 0.6; 0.5 is not
    np.testing.assert_allclose(w, 1 / (1 + np.exp(-np.array([2.0, 0.5]))), rtol=1e-12)
    assert ids2.size == 0 and w2.size == 0
    (ids, _), _ = ref.gate(l, "sigmoid")  # default threshold 0.5: p = 0.5 exactly is not selected
    assert ids.tolist() == [0, 2]
    with pytest.raises(ValueError, match="threshold"):
        ref.gate(l, "sigmoid", threshold=1.5)


def test_sparsemax_cases_and_properties():
    np.testing.assert_allclose(ref.sparsemax([0.0, 0.0, 0.0]), [1 / 3] * 3)
    np.testing.assert_allclose(ref.sparsemax([2.0, 0.0, 0.0]), [1.0, 0.0, 0.0])
    np.testing.assert_allclose(ref.sparsemax([0.5, 0.3, -1.0]), [0.6, 0.4, 0.0])
    rng = np.random.default_rng(1)
    for _ in range(200):
        z = rng.standard_normal(rng.integers(2, 20)) * rng.choice([0.1, 1.0, 10.0])
        p = ref.sparsemax(z)
        assert p.min() >= 0.0 and abs(p.sum() - 1.0) < 1e-12
        # KKT conditions of the projection onto the simplex: z - p is one constant tau on the
        # support, and z <= tau off it; the order of z is kept.
        sup = p > 0
        tau = (z - p)[sup]
        assert np.ptp(tau) < 1e-9 and np.all(z[~sup] <= tau[0] + 1e-9)
        assert np.all(np.diff(p[np.argsort(-z)]) <= 1e-12)
    l = np.array([[0.5, -1.0, 0.3]], dtype=np.float32)
    (ids, w), = ref.gate(l, "sparsemax")
    assert ids.tolist() == [0, 2]
    np.testing.assert_allclose(w, [0.6, 0.4], atol=1e-7)


def test_deepseek_groups_bias_and_scale():
    info = LayerInfo(num_experts=8, top_k=2, norm_topk_prob=True, router_rule="deepseek_v3",
                     n_group=4, topk_group=2, routed_scaling_factor=2.5)
    # groups {0,1} {2,3} {4,5} {6,7}; expert 6 has the best single score but its group's top-2
    # sum is low, so groups 2 and 0 are kept; the bias lifts expert 4 to the top of the choice.
    l = np.array([[2.0, 1.5, -3.0, -3.0, 1.0, 1.8, 3.0, -6.0]], dtype=np.float32)
    bias = np.array([0.0, 0.0, 0.0, 0.0, 0.4, 0.0, 0.0, 0.0], dtype=np.float32)
    s = 1 / (1 + np.exp(-l[0].astype(np.float64)))
    c = s + bias.astype(np.float64)
    gsum = [sorted(c[2 * g: 2 * g + 2])[-1] + sorted(c[2 * g: 2 * g + 2])[-2] for g in range(4)]
    assert np.argsort(gsum)[::-1][:2].tolist() == [2, 0]
    (ids, w), = ref.gate(l, "model", info=info, bias=bias)
    assert ids.tolist() == [4, 0]  # c: 0.731+0.4 = 1.131 > 0.881; expert 6 excluded with group 3
    np.testing.assert_allclose(w, 2.5 * s[[4, 0]] / (s[4] + s[0] + 1e-20), rtol=1e-12)
    (ids, w), = ref.gate(l, "model", info=info, bias=bias, renormalize=False)
    np.testing.assert_allclose(w, 2.5 * s[[4, 0]], rtol=1e-12)


def test_batch_gate():
    l = np.array([[1.0, 0.0, 2.0, 0.5], [3.0, 0.0, -1.0, 0.5]], dtype=np.float32)
    S, route = ref.batch_gate(l, 2)
    assert S.tolist() == [0, 2]  # sums 4, 0, 1, 1: expert 2 wins the tie with 3
    for t in range(2):
        assert route[t][0].tolist() == [0, 2]
        np.testing.assert_allclose(route[t][1], softmax(l[t, [0, 2]]), rtol=1e-12)


def test_bad_logits_are_refused():
    with pytest.raises(ValueError, match=r"logits\[1, 0\]"):
        ref.gate(np.array([[0.0, 1.0], [np.nan, 0.0]]), "topk", top_k=1, renormalize=True)
    with pytest.raises(ValueError, match="unknown gating strategy"):
        ref.gate(np.zeros((1, 2)), "bogus", top_k=1)


def test_pad_and_choice_round_trip():
    route = [(np.array([3, 1], np.int32), np.array([0.75, 0.25])), (np.array([], np.int32), np.array([]))]
    ids, w = ref.pad_route(route, 3)
    assert ids.tolist() == [[3, 1, -1], [-1, -1, -1]]
    back = ref.route_from_choice(ids, w)
    assert back[0][0].tolist() == [3, 1] and back[0][1].tolist() == [0.75, 0.25]
    assert back[1][0].size == 0


# --- the expert computation ---------------------------------------------------------------------

def expert_scalar(x, w1, w3, w2, act):
    """out = W2 h(x) with explicit loops: the definition of the proto, nothing vectorised."""
    d_ff, d = w1.shape
    h = []
    for j in range(d_ff):
        a = sum(w1[j, i] * x[i] for i in range(d))
        if act == "swiglu":
            b = sum(w3[j, i] * x[i] for i in range(d))
            h.append(a / (1 + math.exp(-a)) * b)
        elif act == "gelu":
            h.append(0.5 * a * (1 + math.erf(a / math.sqrt(2))))
        else:
            h.append(max(a, 0.0))
    return [sum(w2[o, j] * h[j] for j in range(d_ff)) for o in range(w2.shape[0])]


@pytest.mark.parametrize("act", ["swiglu", "gelu", "relu"])
def test_forward_matches_loops(act):
    spec = f"d=6,ff=5,experts=3,act={act},dtype=f32,shared=1,shared_ff=4"
    lw = ref.synthetic_weights(spec, 0)
    x = np.random.default_rng(2).standard_normal((3, 6)).astype(ml_dtypes.bfloat16)
    route = [(np.array([2, 0], np.int32), np.array([0.7, 0.3])),
             (np.array([], np.int32), np.array([])),
             (np.array([1, 1], np.int32), np.array([0.5, 0.25]))]  # a repeated expert adds up
    out = ref.forward(x, lw, route)
    xf = x.astype(np.float64)
    for t, (ids, w) in enumerate(route):
        want = np.array(expert_scalar(xf[t], lw.shared_w1, lw.shared_w3, lw.shared_w2, act))
        for e, we in zip(ids, w):
            w3 = None if lw.w3 is None else lw.w3[e]
            want += we * np.array(expert_scalar(xf[t], lw.w1[e], w3, lw.w2[e], act))
        np.testing.assert_allclose(out[t], want, rtol=1e-10, atol=1e-12)
    bits = x.view(np.uint16)  # bf16 given as uint16 bit patterns computes the same
    np.testing.assert_array_equal(ref.forward(bits, lw, route, dtype="bf16"), out)


def test_sparsemax_huge_logits():
    # Beyond 2^53 the textbook formula cancels the +1 and divides by zero; sparsemax is
    # shift-invariant, so the reference (like the server) works on z - max(z).
    p = ref.sparsemax(np.array([5.4e37, 1.0, -3.0, 0.5], dtype=np.float32))
    assert np.all(np.isfinite(p))
    np.testing.assert_array_equal(p, [1.0, 0.0, 0.0, 0.0])


def test_router_logits_follow_the_models_rounding():
    """Softmax-rule layers round the server router's logits to the hidden dtype (the model's gate
    Linear runs in it); DeepSeek-V3 layers and float32 hidden keep the float32 sums."""
    soft = ref.synthetic_weights("layers=1,d=48,ff=16,experts=6,topk=2,dtype=f32,seed=3", 0)
    deep = ref.synthetic_weights("layers=1,d=48,ff=16,experts=6,topk=2,dtype=f32,seed=3,rule=deepseek", 0)
    x = np.random.default_rng(0).standard_normal((5, 48)).astype(np.float32)
    sums = (x.astype(np.float64) @ soft.router.T).astype(np.float32).astype(np.float64)
    assert np.array_equal(ref.router_logits(x, soft), sums)
    for kind, np_type in (("bf16", ml_dtypes.bfloat16), ("f16", np.float16)):
        xk = x.astype(np_type)
        exact = (xk.astype(np.float64) @ soft.router.T).astype(np.float32)
        assert np.array_equal(ref.router_logits(xk, soft), exact.astype(np_type).astype(np.float64))
        assert np.array_equal(ref.router_logits(xk, deep), exact.astype(np.float64))
        assert not np.array_equal(exact.astype(np_type).astype(np.float32), exact), kind
    bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(ref.router_logits(bits, soft, "bf16"),
                          ref.router_logits(x.astype(ml_dtypes.bfloat16), soft))


# --- block-scaled FP8 (common/moed_fp8.h) --------------------------------------------------

def test_quantize_fp8_follows_the_rule():
    rng = np.random.default_rng(5)
    v = (rng.standard_normal((200, 130)) * 0.05).astype(np.float32)
    v[0:128, 128:130] = 0.0  # a block of zeros: scale 1
    v[3, 7] = -2.0           # block (0, 0)'s largest magnitude
    q, s = ref.quantize_fp8(v)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == v.shape
    assert s.shape == (2, 2) and s.dtype == np.float32
    assert s[0, 0] == np.float32(2.0) / np.float32(448) and s[0, 1] == 1.0
    assert float(q[3, 7]) == -448.0
    for (i, j), sc in np.ndenumerate(s):  # each code: the float32 quotient, rounded to nearest e4m3
        blk = v[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
        assert sc == (np.float32(np.abs(blk).max()) / np.float32(448) or 1)
        want = (blk / sc).astype(ml_dtypes.float8_e4m3fn)
        assert np.array_equal(q[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].view(np.uint8),
                              want.view(np.uint8))
    w = ref.dequantize_fp8(q, s)
    assert w[3, 7] == -2.0 and np.array_equal(w, ref.dequantize_fp8(q.view(np.uint8), s))
    assert np.max(np.abs(w - v)) <= np.max(np.abs(v)) / 16  # 3 mantissa bits
    with pytest.raises(ValueError):
        ref.quantize_fp8(np.array([[1.0, np.nan]], np.float32))


def test_synthetic_fp8_layer():
    spec = "layers=1,d=136,ff=40,experts=2,topk=1,dtype=fp8,seed=9"
    w = ref.synthetic_weights(spec, 0)
    assert w.info.weight_dtype == "fp8"
    # the experts are the float32 generator values quantized; the router stays bf16
    u = ref.synth_uniform(9, 0, ref.W1, 1, 40 * 136)
    v = ((2.0 * u - 1.0) * math.sqrt(3.0 / 136)).astype(np.float32).reshape(40, 136)
    assert np.array_equal(w.w1[1], ref.dequantize_fp8(*ref.quantize_fp8(v)))
    assert np.array_equal(w.router, ref.synth_matrix(9, 0, ref.ROUTER, 0, 2, 136, "bf16"))


# --- 2:4 pruning ---------------------------------------------------------------------------

def test_prune_24_keeps_two_of_largest_magnitude_per_group_of_four():
    row = [1, -3, 2, 0.5, 7, 7, 7, 1, math.nan, 0, 5, -5, 1, 2]  # the last group is short: both stay
    got = ref.prune_24(np.array([row, [0.0] * 14]))
    want = [0, -3, 2, 0, 7, 7, 0, 0, math.nan, 0, 5, 0, 1, 2]  # ties to the lower index, NaN kept
    np.testing.assert_array_equal(got[0], want)
    assert not np.any(got[1]) and got.dtype == np.float64


def test_sparse24_weights_prunes_the_routed_experts_only():
    w = ref.synthetic_weights("layers=1,d=8,ff=12,experts=3,topk=2,dtype=f32,shared=1,shared_ff=4", 0)
    p = ref.sparse24_weights(w)
    assert p.info.sparse24 and not w.info.sparse24
    for name in ("w1", "w3", "w2"):
        dense, pruned = getattr(w, name), getattr(p, name)
        assert pruned.shape == dense.shape
        for e in range(3):
            np.testing.assert_array_equal(pruned[e], ref.prune_24(dense[e]))
            groups = pruned[e].reshape(pruned.shape[1], -1, 4)
            assert (np.count_nonzero(groups, axis=2) == 2).all()  # random values: no zero among them
    for name in ("router", "shared_w1", "shared_w3", "shared_w2"):
        np.testing.assert_array_equal(getattr(p, name), getattr(w, name))
