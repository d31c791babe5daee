"""An independent float64 numpy reference for what a moed server computes.

Written from the written definitions (proto/moed/v1/moed.proto and common/moed_synth.h), not
from the C code, so that tests comparing the server with it check the C code against the definition
rather than against itself. Three parts:

* synthetic_weights(spec, layer): the seeded generator of `moed --synthetic SPEC`, bit for bit,
  vectorised with uint64 numpy arithmetic. The arrays hold the stored values (after rounding to the
  layer's weight dtype; for dtype=fp8 the dequantized weights, e4m3 code times block scale) as
  float64. quantize_fp8 and dequantize_fp8 are the block-scaled FP8 rule of common/moed_fp8.h
  (`--weights fp8`), with ml_dtypes.float8_e4m3fn.
* gate(...) and batch_gate(...): router logits -> a route, one (expert ids, weights) pair of arrays
  per token, experts in the order the server sums them (decreasing score, ties to the lower index).
* forward(x, weights, route): the layer output in float64.

Gating scores are computed in float64 from the float32 logits, the server in float32: where two
scores are within float32 rounding of each other the chosen experts may differ. Tests should use
logits whose selected scores are well separated, or compare with a tolerance on the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import ml_dtypes
import numpy as np

from .types import ACTIVATIONS, STRATEGIES, LayerInfo, dtype_name, strategy_value

Route = List[Tuple[np.ndarray, np.ndarray]]  # per token: (int32 expert ids, float64 weights)

# Tensor ids of common/moed_synth.h.
W1, W3, W2, ROUTER, SHARED_W1, SHARED_W3, SHARED_W2, BIAS = range(8)

_M64 = (1 << 64) - 1
_SPEC_DEFAULTS = {
    "layers": "2", "d": "256", "ff": "512", "experts": "8", "topk": "2", "act": "swiglu",
    "dtype": "bf16", "seed": "1", "router": "1", "norm": "1", "shared": "0", "shared_ff": "0",
    "rule": "softmax", "groups": "1", "topk_groups": "1", "scale": "1",
}
_RULES = {"softmax": "softmax_topk", "deepseek": "deepseek_v3"}


# ---------------------------------------------------------------------------------------------
# Synthetic weights


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 of every element of a uint64 array (arithmetic mod 2^64, as in moed_synth.h)."""
    z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def synth_uniform(seed: int, layer: int, tensor: int, expert: int, n: int, first: int = 0) -> np.ndarray:
    """u in [0, 1) for flat indices first .. first+n-1 of one tensor (float64, exact)."""
    stream = ((layer << 40) | (tensor << 32) | expert) & _M64
    with np.errstate(over="ignore"):
        s = splitmix64(np.array([seed & _M64], dtype=np.uint64))
        key = splitmix64(s ^ np.uint64(stream))
        idx = np.arange(first, first + n, dtype=np.uint64)
        bits = splitmix64(key + idx) >> np.uint64(40)
    return bits.astype(np.float64) / float(1 << 24)


def _round_to(values: np.ndarray, wdtype: str) -> np.ndarray:
    """float64 -> float32 -> the weight dtype (round to nearest even each time) -> float64."""
    v = values.astype(np.float32)
    if wdtype == "bf16":
        v = v.astype(ml_dtypes.bfloat16)
    elif wdtype == "f16":
        v = v.astype(np.float16)
    return v.astype(np.float64)


FP8_BLOCK = 128
FP8_MAX = 448.0


def quantize_fp8(values) -> Tuple[np.ndarray, np.ndarray]:
    """A [rows, cols] matrix to block-scaled FP8 (common/moed_fp8.h): per 128 x 128 block,
    scale = amax / 448 in float32 (1 where that is 0), codes = the float32 quotients rounded to
    nearest-even e4m3, saturating at +-448. Returns (codes as ml_dtypes.float8_e4m3fn [rows, cols],
    scales float32 [ceil(rows/128), ceil(cols/128)]). ValueError for NaN or infinity."""
    v = np.asarray(values, dtype=np.float32)
    if not np.all(np.isfinite(v)):
        raise ValueError("NaN or infinity cannot be quantized to FP8")
    rows, cols = v.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    pad = np.zeros((br * FP8_BLOCK, bc * FP8_BLOCK), np.float32)
    pad[:rows, :cols] = np.abs(v)
    amax = pad.reshape(br, FP8_BLOCK, bc, FP8_BLOCK).max(axis=(1, 3))
    scale = amax / np.float32(FP8_MAX)
    scale[scale == 0] = np.float32(1)
    per = np.repeat(np.repeat(scale, FP8_BLOCK, 0), FP8_BLOCK, 1)[:rows, :cols]
    q = np.clip(v / per, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale.astype(np.float32)


def dequantize_fp8(codes, scales) -> np.ndarray:
    """The weights of block-scaled FP8 codes [rows, cols] (float8_e4m3fn, or their uint8 bits) and
    scales [ceil(rows/128), ceil(cols/128)]: code times its block's scale in float32, as float64."""
    q = np.asarray(codes)
    if q.dtype == np.uint8:
        q = q.view(ml_dtypes.float8_e4m3fn)
    rows, cols = q.shape
    s = np.asarray(scales, dtype=np.float32)
    per = np.repeat(np.repeat(s, FP8_BLOCK, 0), FP8_BLOCK, 1)[:rows, :cols]
    return (q.astype(np.float32) * per).astype(np.float64)


def prune_24(values) -> np.ndarray:
    """A [rows, cols] matrix pruned to 2:4 (common/moed_sp24.h, moed --weights sparse24): in each
    aligned group of four along a row (a short last group as if padded with zeros), the two values
    of largest magnitude stay, a NaN above every number and ties to the lower index; the others
    become +0. Returns float64."""
    v = np.array(values, dtype=np.float64)
    rows, cols = v.shape
    g = np.zeros((rows, -(-cols // 4) * 4))
    g[:, :cols] = v
    g = g.reshape(rows, -1, 4)
    rank = np.argsort(-np.where(np.isnan(g), np.inf, np.abs(g)), axis=2, kind="stable")
    keep = np.zeros(g.shape, dtype=bool)
    np.put_along_axis(keep, rank[:, :, :2], True, axis=2)
    return np.where(keep, g, 0.0).reshape(rows, -1)[:, :cols]


def sparse24_weights(weights: "LayerWeights") -> "LayerWeights":
    """weights as a daemon started with --weights sparse24 serves them: every routed expert matrix
    pruned by prune_24, the router and the shared experts as they are, info.sparse24 set."""
    prune = lambda m: None if m is None else np.stack([prune_24(x) for x in m])  # noqa: E731
    return replace(weights, info=replace(weights.info, sparse24=True), w1=prune(weights.w1),
                   w3=prune(weights.w3), w2=prune(weights.w2))


def synth_matrix(seed: int, layer: int, tensor: int, expert: int, rows: int, cols: int,
                 wdtype: str) -> np.ndarray:
    """One [rows, cols] weight matrix of the generator, as stored (fan_in = cols); dtype fp8: its
    float32 values quantized in 128 x 128 blocks, dequantized."""
    u = synth_uniform(seed, layer, tensor, expert, rows * cols)
    value = (2.0 * u - 1.0) * math.sqrt(3.0 / cols)
    if wdtype == "fp8":
        return dequantize_fp8(*quantize_fp8(value.astype(np.float32).reshape(rows, cols)))
    return _round_to(value, wdtype).reshape(rows, cols)


@dataclass
class LayerWeights:
    """A layer's weights as float64 arrays, in the Hugging Face [out, in] layout.

    w1, w3: [E, d_ff, d_model] (w3 None unless SwiGLU); w2: [E, d_model, d_ff]; router: [E, d_model]
    or None; bias: [E] (DeepSeek correction bias) or None; shared_w1, shared_w3: [shared_d_ff,
    d_model] and shared_w2: [d_model, shared_d_ff], or None without shared experts. Build one by
    hand to compute the reference of a checkpoint.
    """

    info: LayerInfo
    w1: np.ndarray
    w3: Optional[np.ndarray]
    w2: np.ndarray
    router: Optional[np.ndarray] = None
    bias: Optional[np.ndarray] = None
    shared_w1: Optional[np.ndarray] = None
    shared_w3: Optional[np.ndarray] = None
    shared_w2: Optional[np.ndarray] = None


def parse_spec(spec: str) -> Tuple[int, int, LayerInfo]:
    """Parses a `--synthetic` spec ("layers=2,d=256,...", any subset, any order) into
    (number of layers, seed, LayerInfo of layer 0). ValueError names an unknown key or bad value."""
    kv = dict(_SPEC_DEFAULTS)
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in kv:
            raise ValueError(f"synthetic spec: {item!r} is not key=value with a key among {', '.join(kv)}")
        kv[key] = value.strip()

    def integer(key: str, lo: int) -> int:
        text = kv[key]
        # as the server parses: decimal, but the seed also in C's 0x.. hex and 0.. octal
        base = 10
        if key == "seed" and len(text) > 1 and text[0] == "0":
            base = 16 if text[1] in "xX" else 8
        try:
            v = int(text, base)
        except ValueError:
            raise ValueError(f"synthetic spec: {key}={kv[key]!r} is not an integer") from None
        if v < lo:
            raise ValueError(f"synthetic spec: {key}={v} must be at least {lo}")
        return v

    act = kv["act"].lower()
    if act not in ACTIVATIONS:
        raise ValueError(f"synthetic spec: act={kv['act']!r}: use swiglu, gelu or relu")
    rule = kv["rule"].lower()
    if rule not in _RULES:
        raise ValueError(f"synthetic spec: rule={kv['rule']!r}: use softmax or deepseek")
    info = LayerInfo(
        index=0, d_model=integer("d", 1), d_ff=integer("ff", 1), num_experts=integer("experts", 1),
        top_k=integer("topk", 1), activation=act, weight_dtype=dtype_name(kv["dtype"]),
        has_router=integer("router", 0) != 0, norm_topk_prob=integer("norm", 0) != 0,
        router_rule=_RULES[rule], num_shared_experts=integer("shared", 0),
        shared_d_ff=integer("shared_ff", 0), n_group=integer("groups", 1),
        topk_group=integer("topk_groups", 1), routed_scaling_factor=float(kv["scale"]))
    if info.weight_dtype == "i32":
        raise ValueError("synthetic spec: dtype must be f32, f16, bf16 or fp8")
    return integer("layers", 1), integer("seed", 0), info


def synthetic_weights(spec: str, layer: int) -> LayerWeights:
    """Rebuilds layer `layer` (0-based) of `moed --synthetic SPEC` exactly as the server stores it."""
    n_layers, seed, info = parse_spec(spec)
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} is outside the spec's {n_layers} layers")
    info = replace(info, index=layer)
    E, d, ff, wd = info.num_experts, info.d_model, info.d_ff, info.weight_dtype
    swiglu = info.activation == "swiglu"

    def stack(tensor: int, rows: int, cols: int) -> np.ndarray:
        return np.stack([synth_matrix(seed, layer, tensor, e, rows, cols, wd) for e in range(E)])

    lw = LayerWeights(info=info, w1=stack(W1, ff, d), w3=stack(W3, ff, d) if swiglu else None,
                      w2=stack(W2, d, ff))
    if info.has_router:  # never quantized: bf16 beside fp8 experts
        lw.router = synth_matrix(seed, layer, ROUTER, 0, E, d, "bf16" if wd == "fp8" else wd)
    if info.router_rule == "deepseek_v3":
        u = synth_uniform(seed, layer, BIAS, 0, E)
        lw.bias = ((2.0 * u - 1.0) * 0.1).astype(np.float32).astype(np.float64)
    if info.num_shared_experts > 0 and info.shared_d_ff > 0:
        sff = info.shared_d_ff
        lw.shared_w1 = synth_matrix(seed, layer, SHARED_W1, 0, sff, d, wd)
        lw.shared_w3 = synth_matrix(seed, layer, SHARED_W3, 0, sff, d, wd) if swiglu else None
        lw.shared_w2 = synth_matrix(seed, layer, SHARED_W2, 0, d, sff, wd)
    return lw


# ---------------------------------------------------------------------------------------------
# Gating


def _by_score(scores: np.ndarray) -> np.ndarray:
    """Indices by decreasing score, ties to the lower index (the order of a route)."""
    return np.argsort(-scores, kind="stable")


def _softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max())
    return e / e.sum()


def _sigmoid(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-v))


def sparsemax(z: np.ndarray) -> np.ndarray:
    """sparsemax of one vector (Martins & Astudillo 2016): the Euclidean projection onto the simplex."""
    z = np.asarray(z, dtype=np.float64)
    z = z - z.max()  # shift-invariant; without it a logit beyond 2^53 cancels the +1 below
    zs = np.sort(z)[::-1]
    cum = np.cumsum(zs)
    k = np.arange(1, z.size + 1)
    kstar = k[1.0 + k * zs > cum].max()
    tau = (cum[kstar - 1] - 1.0) / kstar
    return np.maximum(z - tau, 0.0)


def _logits64(logits) -> np.ndarray:
    """Logits as the server sees them: float32 [T, E], checked finite, then widened to float64."""
    l32 = np.asarray(logits, dtype=np.float32)
    if l32.ndim != 2 or l32.shape[0] < 1 or l32.shape[1] < 1:
        raise ValueError(f"logits must be [T, E] with T, E >= 1, not shape {l32.shape}")
    bad = np.argwhere(~np.isfinite(l32))
    if bad.size:
        t, e = bad[0]
        raise ValueError(f"logits[{t}, {e}] = {l32[t, e]}: router logits must be finite")
    return l32.astype(np.float64)


def _resolve_renorm(renormalize, info: Optional[LayerInfo]) -> bool:
    if renormalize is None or renormalize == "default":
        if info is None:
            raise ValueError("renormalize=None means the layer's norm_topk_prob: pass info=LayerInfo")
        return bool(info.norm_topk_prob)
    if isinstance(renormalize, str):
        if renormalize not in ("on", "off"):
            raise ValueError(f"renormalize={renormalize!r}: use True/False, 'on'/'off' or None")
        return renormalize == "on"
    return bool(renormalize)


def _resolve_top_k(top_k: int, E: int, info: Optional[LayerInfo]) -> int:
    k = int(top_k or 0)
    if k == 0:
        if info is None:
            raise ValueError("top_k=0 means the layer's top_k: pass info=LayerInfo or a top_k")
        k = info.top_k
    if not 1 <= k <= E:
        raise ValueError(f"top_k={k} is outside 1..{E} (the number of experts)")
    return k


def _topk_route(p: np.ndarray, k: int, renorm: bool) -> Tuple[np.ndarray, np.ndarray]:
    ids = _by_score(p)[:k]
    w = p[ids]
    if renorm:
        w = w / w.sum()
    return ids.astype(np.int32), w


def _selected(p: np.ndarray, mask: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The experts where mask holds, by decreasing p, with weight p."""
    ids = np.array([e for e in _by_score(p) if mask[e]], dtype=np.int32)
    return ids, p[ids]


def _deepseek_route(l: np.ndarray, k: int, renorm: bool, info: LayerInfo,
                    bias: Optional[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    E = l.size
    s = _sigmoid(l)
    c = s + (np.zeros(E) if bias is None else np.asarray(bias, dtype=np.float32).astype(np.float64))
    allowed = np.ones(E, dtype=bool)
    G = int(info.n_group or 1)
    if G > 1:
        if E % G:
            raise ValueError(f"n_group={G} does not divide the {E} experts")
        groups = c.reshape(G, E // G)
        score = np.array([np.sort(g)[::-1][:2].sum() for g in groups])
        keep = _by_score(score)[: int(info.topk_group)]
        allowed = np.zeros((G, E // G), dtype=bool)
        allowed[keep] = True
        allowed = allowed.reshape(E)
    if k > allowed.sum():
        raise ValueError(f"top_k={k} is more than the {allowed.sum()} experts of the kept groups")
    masked = np.where(allowed, c, -np.inf)
    ids = _by_score(masked)[:k].astype(np.int32)
    w = s[ids]
    if renorm:
        w = w / (w.sum() + 1e-20)
    return ids, w * float(info.routed_scaling_factor)


def gate(logits, strategy="model", top_k: int = 0, renormalize=None, threshold: Optional[float] = None,
         info: Optional[LayerInfo] = None, bias=None) -> Route:
    """Router logits [T, E] -> a route: for each token (expert ids int32, weights float64), experts by
    decreasing score (ties to the lower index), which is the order the server sums them in.

    strategy: "model" (info.router_rule), "topk", "sigmoid", "sparsemax", "quadratic", "pioneer".
    top_k: 0 -> info.top_k. renormalize: None -> info.norm_topk_prob, or True/False ("on"/"off").
    threshold (sigmoid): None or 0 -> 0.5; must be in (0, 1). info: the layer (LayerInfo), needed
    for the defaults and the model rule; bias: the DeepSeek correction bias [E] (None: zeros).
    Raises ValueError for non-finite logits and out-of-range parameters, as the server answers
    INVALID_ARGUMENT.
    """
    l = _logits64(logits)
    T, E = l.shape
    st = strategy_value(strategy)
    if st == STRATEGIES["model"] and info is None:
        raise ValueError("strategy 'model' follows the layer's rule: pass info=LayerInfo")
    route: Route = []
    if st == STRATEGIES["sigmoid"]:
        thr = 0.5 if not threshold else float(np.float32(threshold))
        if not 0.0 < thr < 1.0:
            raise ValueError(f"threshold={threshold} must be in (0, 1)")
        for lt in l:
            p = _sigmoid(lt)
            route.append(_selected(p, p > thr))
        return route
    if st == STRATEGIES["sparsemax"]:
        for lt in l:
            p = sparsemax(lt)
            route.append(_selected(p, p > 0.0))
        return route
    k = _resolve_top_k(top_k, E, info)
    renorm = _resolve_renorm(renormalize, info)
    if st == STRATEGIES["model"] and info.router_rule == "deepseek_v3":
        return [_deepseek_route(lt, k, renorm, info, bias) for lt in l]
    transform = {STRATEGIES["quadratic"]: np.square, STRATEGIES["pioneer"]: lambda v: np.cos(v) ** 2}
    f = transform.get(st, lambda v: v)
    return [_topk_route(_softmax(f(lt)), k, renorm) for lt in l]


def batch_gate(logits, k_batch: int) -> Tuple[np.ndarray, Route]:
    """Batch-level dynamic gating over a whole (merged) batch [T, E]: s_e = sum over tokens of l[t, e]
    (float64, tokens in order), S = the k_batch experts of highest s_e (ties to the lower index), and
    every token's route is S with weights softmax(l_t restricted to S). Returns (S int32, route)."""
    l = _logits64(logits)
    T, E = l.shape
    if not 1 <= k_batch <= E:
        raise ValueError(f"k_batch={k_batch} is outside 1..{E}")
    s = np.zeros(E)
    for lt in l:  # sequential over tokens: the order the definition fixes
        s += lt
    S = _by_score(s)[:k_batch].astype(np.int32)
    return S, [(S.copy(), _softmax(lt[S])) for lt in l]


def route_from_choice(expert_ids, expert_weights) -> Route:
    """A client choice (ids [T, k], weights [T, k]) as a route; id -1 with weight 0 is padding."""
    ids = np.asarray(expert_ids, dtype=np.int64)
    w = np.asarray(expert_weights, dtype=np.float32).astype(np.float64)
    if ids.shape != w.shape or ids.ndim != 2:
        raise ValueError(f"expert_ids {ids.shape} and expert_weights {w.shape} must both be [T, k]")
    keep = ~((ids == -1) & (w == 0.0))
    return [(ids[t][keep[t]].astype(np.int32), w[t][keep[t]]) for t in range(ids.shape[0])]


def pad_route(route: Route, k: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """A route as client-choice arrays: ids int32 [T, k] and weights float32 [T, k], padded with
    (-1, 0). k defaults to the longest token's count (at least 1)."""
    kk = max([1] + [len(ids) for ids, _ in route]) if k is None else k
    ids = np.full((len(route), kk), -1, dtype=np.int32)
    w = np.zeros((len(route), kk), dtype=np.float32)
    for t, (e, wt) in enumerate(route):
        if len(e) > kk:
            raise ValueError(f"token {t} has {len(e)} experts, more than k={kk}")
        ids[t, : len(e)] = e
        w[t, : len(e)] = wt
    return ids, w


# ---------------------------------------------------------------------------------------------
# Expert computation

_erf = np.frompyfunc(math.erf, 1, 1)


def to_float64(hidden, dtype: Optional[str] = None) -> np.ndarray:
    """Hidden states as float64, exactly: float32/float16/bfloat16 arrays, or uint16 bit patterns of
    bf16 with dtype="bf16"."""
    h = np.asarray(hidden)
    if h.dtype == np.uint16:
        if dtype is None or dtype_name(dtype) != "bf16":
            raise ValueError("a uint16 array holds bf16 bit patterns only with dtype='bf16'")
        h = h.view(ml_dtypes.bfloat16)
    return h.astype(np.float64)


def _hidden_dtype(hidden, dtype: Optional[str]) -> str:
    if dtype is not None:
        return dtype_name(dtype)
    kind = np.asarray(hidden).dtype
    if kind == np.float16:
        return "f16"
    return "bf16" if kind == ml_dtypes.bfloat16 else "f32"


def router_logits(x, weights: LayerWeights, dtype: Optional[str] = None) -> np.ndarray:
    """The logits the server router computes: x [T, d] @ router.T, and for the softmax top-k rule
    rounded to x's dtype (as the model's gate Linear rounds them; DeepSeek-V3 keeps float32).
    float64 values; dtype as for to_float64."""
    if weights.router is None:
        raise ValueError(f"layer {weights.info.index} has no router weights")
    logits = (to_float64(x, dtype) @ weights.router.T).astype(np.float32)
    kind = _hidden_dtype(x, dtype)
    if weights.info.router_rule == "softmax_topk" and kind != "f32":
        logits = logits.astype(ml_dtypes.bfloat16 if kind == "bf16" else np.float16)
    return logits.astype(np.float64)


def _mlp(x: np.ndarray, w1: np.ndarray, w3: Optional[np.ndarray], w2: np.ndarray, act: str) -> np.ndarray:
    a = x @ w1.T
    if act == "swiglu":
        with np.errstate(over="ignore"):
            h = a / (1.0 + np.exp(-a)) * (x @ w3.T)
    elif act == "gelu":
        h = 0.5 * a * (1.0 + _erf(a / math.sqrt(2.0)).astype(np.float64))
    elif act == "relu":
        h = np.maximum(a, 0.0)
    else:
        raise ValueError(f"unknown activation {act!r}: use swiglu, gelu or relu")
    return h @ w2.T


def forward(x, weights: LayerWeights, route: Route, act: Optional[str] = None,
            dtype: Optional[str] = None) -> np.ndarray:
    """The layer output [T, d_model] in float64: out_t = sum over (e, w) in route[t] of
    w * expert_e(x_t), plus the shared experts (weight 1) when the layer has them.

    x: [T, d_model] hidden states (any float dtype, or uint16 bf16 bits with dtype="bf16");
    weights: LayerWeights (synthetic_weights(), or built from a checkpoint); route: from gate(),
    batch_gate() or route_from_choice(); act defaults to weights.info.activation.
    """
    x64 = to_float64(x, dtype)
    if x64.ndim != 2:
        raise ValueError(f"hidden must be [T, d_model], not shape {x64.shape}")
    if len(route) != x64.shape[0]:
        raise ValueError(f"the route has {len(route)} tokens, hidden has {x64.shape[0]}")
    act = act or weights.info.activation
    out = np.zeros((x64.shape[0], weights.w2.shape[1]))
    tokens = np.concatenate([np.full(len(ids), t) for t, (ids, _) in enumerate(route)] + [np.zeros(0, int)])
    experts = np.concatenate([np.asarray(ids, dtype=np.int64) for ids, _ in route] + [np.zeros(0, int)])
    wts = np.concatenate([np.asarray(w, dtype=np.float64) for _, w in route] + [np.zeros(0)])
    for e in np.unique(experts):
        sel = experts == e
        tok = tokens[sel].astype(np.int64)
        w3 = None if weights.w3 is None else weights.w3[e]
        y = _mlp(x64[tok], weights.w1[e], w3, weights.w2[e], act)
        np.add.at(out, tok, wts[sel][:, None] * y)
    if weights.shared_w1 is not None:
        out += _mlp(x64, weights.shared_w1, weights.shared_w3, weights.shared_w2, act)
    return out
