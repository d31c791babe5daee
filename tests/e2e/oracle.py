"""The end-to-end tests' own float64 numpy model of what moed computes.

Written here, from the written definitions (the comments of proto/moed/v1/moed.proto and the
generator documented in common/moed_synth.h), and deliberately NOT from moed.reference or the C code:
a test that compared the daemon with a reference sharing its author's reading of the definition
would only check the code against itself. test_forward.py cross-checks this module against
moed.reference, so a disagreement between the two readings shows up as a failure too.

Contents: the seeded synthetic generator (Spec, synth_layer), bf16 rounding by bit manipulation,
e4m3 rounding from the OCP FP8 table and the 128 x 128 block quantization of FP8 weights
(fp8_quantize, fp8_dequantize: the rule of common/moed_fp8.h, written here again without
ml_dtypes), the expert MLPs and the combine (forward), the five gating strategies and DeepSeek-V3's
rule (gate), batch-level gating (batch_gate), and a per-token comparison with a tolerance suited to
each dtype (check).
"""

import math
import os
from dataclasses import dataclass, field

import ml_dtypes

import numpy as np

# Tensor numbers of the generator (common/moed_synth.h).
T_W1, T_W3, T_W2, T_ROUTER, T_SW1, T_SW3, T_SW2, T_BIAS = range(8)

# Largest error allowed in one token's output (one row), relative to that token's own largest
# reference magnitude, for an output in each dtype: half an ulp of the output dtype at the top of
# the row, plus float32 accumulation, plus slack for intermediates the server may keep in the
# weight dtype; and ATOL, an absolute floor for rows whose reference is zero or nearly so (no
# expert, or tiny gate weights). Per token, not per batch: a bound relative to the batch's largest
# value lets the smallest rows be several percent wrong, or dropped, and still pass.
#
# Measured over the whole suite (every check, 18,000 tokens) against the CPU backend, which computes
# in float32: the largest error/magnitude ratio was 5.3e-6 for f32 outputs, 4.9e-4 for f16 and
# 3.9e-3 for bf16 (the output's rounding: half an ulp is 2^-11 and 2^-8 of the value), so each
# bound has 2.6x to 4x of room. With the CUDA backend (bf16 compute, on an H100: test_forward,
# test_concurrency and test_errors, 15,000 tokens) the largest was 9.2e-3, p99 6.4e-3: COMPUTE_TOL
# below gives it 2.2x.
TOL = {"f32": 2e-5, "f16": 2e-3, "bf16": 1e-2}
ATOL = {"f32": 1e-7, "f16": 1e-5, "bf16": 1e-4}


@dataclass
class Spec:
    """A `--synthetic` model: keyword values as the daemon takes them (every key is sent, so the
    test never relies on the daemon's defaults)."""

    layers: int = 1
    d: int = 64
    ff: int = 96
    experts: int = 8
    topk: int = 2
    act: str = "swiglu"
    dtype: str = "bf16"
    seed: int = 1
    router: int = 1
    norm: int = 1
    shared: int = 0
    shared_ff: int = 0
    rule: str = "softmax"
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __str__(self):
        keys = ("layers", "d", "ff", "experts", "topk", "act", "dtype", "seed", "router", "norm",
                "shared", "shared_ff", "rule", "groups", "topk_groups", "scale")
        return ",".join(f"{k}={getattr(self, k):g}" if isinstance(getattr(self, k), float)
                        else f"{k}={getattr(self, k)}" for k in keys)

    @classmethod
    def parse(cls, text):
        """A Spec from "key=value,..." (the keys not given keep the defaults above)."""
        kw = {}
        for item in text.split(","):
            key, value = item.split("=")
            kind = type(getattr(cls, key))
            kw[key] = kind(value) if kind is not int else int(value, 0)
        return cls(**kw)

    def layer(self, index):
        """The weights of layer `index` (cached)."""
        if index not in self._cache:
            self._cache[index] = synth_layer(self, index)
        return self._cache[index]


# ---- the generator --------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z):
    """splitmix64 over a uint64 array (numpy wraps mod 2^64)."""
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def bf16_round(a):
    """float32 values rounded to bf16 (nearest, ties to even), as float32: done on the bits so it
    does not depend on ml_dtypes' conversion."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> np.uint64(16)) & np.uint64(1))) & np.uint64(0xFFFF0000)
    return u.astype(np.uint32).view(np.float32)


def bf16_bits(a):
    """bf16 bit patterns (uint16) of float values, rounded to nearest even."""
    return (bf16_round(a).view(np.uint32) >> 16).astype(np.uint16)


def from_bf16_bits(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def round_to(values, dtype):
    """float64 -> float32 -> dtype, as float64 (the generator's double rounding)."""
    v = np.asarray(values, dtype=np.float64).astype(np.float32)
    if dtype == "bf16":
        v = bf16_round(v)
    elif dtype == "f16":
        v = v.astype(np.float16)
    return v.astype(np.float64)


# ---- FP8 (e4m3, block-scaled) ------------------------------------------------------------------

# The non-negative e4m3 values in code order (codes 0 .. 126; 127 is NaN): the OCP definition,
# 2^(e-7) (1 + m/8) and, for e = 0, m 2^-9. Increasing, so a code's parity is its index's.
E4M3 = np.array([m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
                 for e in range(16) for m in range(8)][:127])


def e4m3_round(x):
    """float values to the nearest e4m3 value (ties to the even code), saturating at +-448, as
    float64."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), E4M3[-1])
    hi = np.clip(np.searchsorted(E4M3, a), 1, 126)
    lo = hi - 1
    dlo, dhi = a - E4M3[lo], E4M3[hi] - a
    pick = np.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)
    return np.copysign(E4M3[pick], x)


def fp8_quantize(values):
    """float32 values [rows, cols] to (e4m3 values [rows, cols] as float64, float32 scales
    [ceil(rows/128), ceil(cols/128)]): per block scale = amax / 448 in float32 (1 where 0), the
    float32 quotient value / scale rounded to e4m3."""
    v = np.asarray(values, dtype=np.float32)
    rows, cols = v.shape
    scales = np.ones((-(-rows // 128), -(-cols // 128)), np.float32)
    q = np.zeros((rows, cols))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = v[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            s = np.float32(np.max(np.abs(blk))) / np.float32(448)
            scales[i, j] = s if s != 0 else np.float32(1)
            q[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)] = e4m3_round(blk / scales[i, j])
    return q, scales


def fp8_dequantize(q, scales):
    """The weights of e4m3 values q (float64) and block scales: q times its scale in float32."""
    q = np.asarray(q, dtype=np.float32)
    out = np.zeros(q.shape, np.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            sl = np.s_[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            out[sl] = q[sl] * np.float32(scales[i, j])
    return out.astype(np.float64)


def fp8_weights(values):
    """What moed serves for float32 weights quantized at load (--weights fp8, dtype=fp8)."""
    return fp8_dequantize(*fp8_quantize(values))


def synth_uniform(seed, layer, tensor, expert, n):
    key = _mix(_mix(np.array([seed], np.uint64)) ^ np.uint64((layer << 40) | (tensor << 32) | expert))
    with np.errstate(over="ignore"):
        bits = _mix(key + np.arange(n, dtype=np.uint64)) >> np.uint64(40)
    return bits.astype(np.float64) / 2.0 ** 24


def synth_matrix(spec, layer, tensor, expert, rows, cols):
    u = synth_uniform(spec.seed, layer, tensor, expert, rows * cols)
    v = ((2 * u - 1) * math.sqrt(3.0 / cols)).reshape(rows, cols)
    if spec.dtype != "fp8":
        return round_to(v, spec.dtype)
    if tensor == T_ROUTER:  # routers are never quantized: bf16 beside fp8 experts
        return round_to(v, "bf16")
    return fp8_weights(v.astype(np.float32))


def synth_layer(spec, layer):
    """dict of float64 weights (Hugging Face [out, in] layout) of one synthetic layer."""
    E, d, ff = spec.experts, spec.d, spec.ff
    glu = spec.act == "swiglu"
    w = {"w1": np.stack([synth_matrix(spec, layer, T_W1, e, ff, d) for e in range(E)]),
         "w3": np.stack([synth_matrix(spec, layer, T_W3, e, ff, d) for e in range(E)]) if glu else None,
         "w2": np.stack([synth_matrix(spec, layer, T_W2, e, d, ff) for e in range(E)]),
         "router": synth_matrix(spec, layer, T_ROUTER, 0, E, d) if spec.router else None,
         "bias": None, "shared_w1": None, "shared_w3": None, "shared_w2": None}
    if spec.rule == "deepseek":
        u = synth_uniform(spec.seed, layer, T_BIAS, 0, E)
        w["bias"] = ((2 * u - 1) * 0.1).astype(np.float32).astype(np.float64)
    if spec.shared and spec.shared_ff:
        s = spec.shared_ff
        w["shared_w1"] = synth_matrix(spec, layer, T_SW1, 0, s, d)
        w["shared_w3"] = synth_matrix(spec, layer, T_SW3, 0, s, d) if glu else None
        w["shared_w2"] = synth_matrix(spec, layer, T_SW2, 0, d, s)
    return w


# ---- experts and combine --------------------------------------------------------------------

_erf = np.vectorize(math.erf, otypes=[np.float64])


def mlp(x, w1, w3, w2, act):
    """One expert on rows x [n, d]: W2 act(W1 x) (SwiGLU: W2 (silu(W1 x) * W3 x)), float64."""
    a = x @ w1.T
    if act == "swiglu":
        h = a / (1.0 + np.exp(-a)) * (x @ w3.T)
    elif act == "gelu":
        h = 0.5 * a * (1.0 + _erf(a / math.sqrt(2.0)))
    elif act == "relu":
        h = np.maximum(a, 0.0)
    else:
        raise ValueError(act)
    return h @ w2.T


def forward(x, w, route, act):
    """out_t = sum over (e, g) in route[t] of g * expert_e(x_t), plus the shared experts (weight 1).
    x: float64 [T, d]; route: per token a list of (expert, weight) pairs."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros((x.shape[0], w["w2"].shape[1]))
    for t, pairs in enumerate(route):
        for e, g in pairs:
            w3 = None if w["w3"] is None else w["w3"][e]
            out[t] += g * mlp(x[t:t + 1], w["w1"][e], w3, w["w2"][e], act)[0]
    if w["shared_w1"] is not None:
        out += mlp(x, w["shared_w1"], w["shared_w3"], w["shared_w2"], act)
    return out


def choice_route(ids, weights):
    """A client's expert_ids/expert_weights as a route; (-1, 0) pairs are padding."""
    return [[(int(e), float(np.float32(g))) for e, g in zip(ri, rw) if not (e == -1 and g == 0)]
            for ri, rw in zip(ids, weights)]


# ---- gating ----------------------------------------------------------------------------------

def _order(scores):
    """Indices by decreasing score, equal scores by increasing index."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def _softmax(v):
    e = np.exp(v - np.max(v))
    return e / e.sum()


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _sparsemax(z):
    zs = np.sort(z)[::-1]
    cs = np.cumsum(zs)
    ks = np.arange(1, len(z) + 1)
    k = ks[1 + ks * zs > cs][-1]
    tau = (cs[k - 1] - 1) / k
    return np.maximum(z - tau, 0.0)


def _topk(p, k, renorm):
    ids = _order(p)[:k]
    total = sum(p[i] for i in ids)
    return [(i, p[i] / total if renorm else p[i]) for i in ids]


def _deepseek(l, k, renorm, spec, bias):
    s = _sigmoid(l)
    c = s + (bias if bias is not None else 0.0)
    E, G = len(l), spec.groups
    allowed = set(range(E))
    if G > 1:
        size = E // G
        gscore = [sum(sorted(c[q * size:(q + 1) * size])[::-1][:2]) for q in range(G)]
        kept = _order(gscore)[:spec.topk_groups]
        allowed = {e for q in kept for e in range(q * size, (q + 1) * size)}
    ids = [e for e in _order(c) if e in allowed][:k]
    total = sum(s[i] for i in ids)
    return [(i, (s[i] / (total + 1e-20) if renorm else s[i]) * spec.scale) for i in ids]


def gate(logits, strategy, spec, top_k=0, renorm=None, threshold=0.0, bias=None):
    """Router logits (float32 [T, E]) -> a route. strategy: "model", "topk", "sigmoid", "sparsemax",
    "quadratic", "pioneer". top_k 0 and renorm None mean the layer's; threshold 0 means 0.5."""
    l32 = np.asarray(logits, dtype=np.float32).astype(np.float64)
    k = top_k or spec.topk
    rn = bool(spec.norm) if renorm is None else renorm
    thr = float(np.float32(threshold)) if threshold else 0.5
    route = []
    for l in l32:
        if strategy == "sigmoid":
            p = _sigmoid(l)
            route.append([(i, p[i]) for i in _order(p) if p[i] > thr])
        elif strategy == "sparsemax":
            p = _sparsemax(l)
            route.append([(i, p[i]) for i in _order(p) if p[i] > 0])
        elif strategy == "model" and spec.rule == "deepseek":
            route.append(_deepseek(l, k, rn, spec, bias))
        elif strategy in ("model", "topk"):
            route.append(_topk(_softmax(l), k, rn))
        elif strategy == "quadratic":
            route.append(_topk(_softmax(l * l), k, rn))
        elif strategy == "pioneer":
            route.append(_topk(_softmax(np.cos(l) ** 2), k, rn))
        else:
            raise ValueError(strategy)
    return route


def batch_gate(logits, k_batch):
    """(S, route) of batch-level gating over one batch: S = the k_batch experts of highest summed
    logit; every token uses S with weights softmax(l_t restricted to S)."""
    l = np.asarray(logits, dtype=np.float32).astype(np.float64)
    S = _order(l.sum(axis=0))[:k_batch]
    return S, [list(zip(S, _softmax(row[S]))) for row in l]


def router_logits(x, w, dtype="f32", rule="softmax"):
    """The server router's logits for hidden x (float64 values) sent in dtype: x @ router^T, and for
    the softmax rule rounded to dtype as the model's gate Linear rounds them (proto: ServerRouter)."""
    logits = np.asarray(x, dtype=np.float64) @ w["router"].T
    if rule == "deepseek" or dtype == "f32":
        return logits
    return round_to(logits, "bf16" if dtype == "bf16u16" else dtype)


# ---- inputs and comparison -------------------------------------------------------------------

NP_DTYPE = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def hidden(rng, T, d, dtype, scale=1.0):
    """Random hidden states: (the array to send in `dtype`, its exact values in float64). For
    "bf16u16" the array is uint16 bit patterns (send with dtype="bf16")."""
    v = (scale * rng.standard_normal((T, d))).astype(np.float32)
    if dtype == "bf16u16":
        bits = bf16_bits(v)
        return bits, from_bf16_bits(bits).astype(np.float64)
    if dtype == "bf16":
        a = bf16_round(v).astype(ml_dtypes.bfloat16)  # exact: already a bf16 value
        return a, bf16_round(v).astype(np.float64)
    a = v.astype(NP_DTYPE[dtype])
    return a, a.astype(np.float64)


def as_float64(y, dtype=None):
    y = np.asarray(y)
    if y.dtype == np.uint16:
        return from_bf16_bits(y).astype(np.float64)
    return y.astype(np.float64)


def token_errors(y, ref):
    """(per-token largest error, per-token largest reference magnitude): one value per row."""
    y = as_float64(y).reshape(ref.shape[0], -1)
    ref = np.asarray(ref, dtype=np.float64).reshape(ref.shape[0], -1)
    return np.max(np.abs(y - ref), axis=1), np.max(np.abs(ref), axis=1)


def rel_err(y, ref):
    """The worst token's error relative to that token's own magnitude (a row whose reference is
    zero must come back zero, or the result is inf)."""
    err, mag = token_errors(y, ref)
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.max(np.where(err == 0, 0.0, err / mag)))


# The server's compute type bounds the error too: the CUDA backend multiplies in bf16 (f16 for f16
# weights) whatever the request's dtype. MOED_TEST_COMPUTE=bf16 declares it (the GPU machine's run);
# its per-token bounds are the GPU suite's (tests/gpu/test_cuda_backend.c).
COMPUTE = os.environ.get("MOED_TEST_COMPUTE", "f32")
COMPUTE_TOL = {"f32": 0.0, "f16": 3e-3, "bf16": 2e-2}


def check(y, ref, dtype, what=""):
    """Asserts y (the server's output) matches the float64 reference token by token: every row's
    largest error within dtype's tolerance (or the server's compute type's, if coarser) of that
    row's largest reference magnitude, plus the floor."""
    key = "bf16" if dtype in ("bf16", "bf16u16") else dtype
    tol, atol = max(TOL[key], COMPUTE_TOL[COMPUTE]), ATOL[key]
    assert y.shape == ref.shape, f"{what}: shape {y.shape}, expected {ref.shape}"
    assert np.all(np.isfinite(as_float64(y))), f"{what}: non-finite output"
    err, mag = token_errors(y, ref)
    bad = np.flatnonzero(err > tol * mag + atol)
    if bad.size:
        t = bad[np.argmax((err / (tol * mag + atol))[bad])]
        raise AssertionError(f"{what}: {bad.size} of {len(err)} tokens over the bound; token {t}: max "
                             f"error {err[t]:.3g}, {err[t] / max(mag[t], 1e-30):.3g} of its max |ref| "
                             f"{mag[t]:.3g} (bound {tol:g} of it + {atol:g}; {key} out, {COMPUTE} compute)")
