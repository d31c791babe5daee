"""The client's plain data types and the names it shares with the server.

These are plain dataclasses, not protobuf messages, so that code using moed (and the numpy reference
in moed.reference, which must work without a server) never depends on the generated stubs. Enum
values are given by lower-case names ("swiglu", "bf16", "deepseek_v3"); the tables below map the
names to the wire values of proto/moed/v1/moed.proto in one place.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import Any, List, Tuple

import grpc
import numpy as np

# moed.v1.DType (fp8: block-scaled e4m3 weights; never a request's tensor)
DTYPES = {"f32": 1, "f16": 2, "bf16": 3, "i32": 4, "fp8": 5}
DTYPE_ALIASES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32",
                 "e4m3": "fp8", "float8_e4m3fn": "fp8"}
# moed.v1.Activation
ACTIVATIONS = {"swiglu": 1, "gelu": 2, "relu": 3}
# moed.v1.Strategy ("model" is STRATEGY_UNSPECIFIED: the layer's own rule)
STRATEGIES = {"model": 0, "topk": 1, "sigmoid": 2, "sparsemax": 3, "quadratic": 4, "pioneer": 5}
# moed.v1.RouterRule
ROUTER_RULES = {"softmax_topk": 1, "deepseek_v3": 2}
# grpc.health.v1.HealthCheckResponse.ServingStatus
HEALTH = {"UNKNOWN": 0, "SERVING": 1, "NOT_SERVING": 2, "SERVICE_UNKNOWN": 3}


def name_of(table: dict, value: int, default: str = "unspecified") -> str:
    """The name of a wire value in one of the tables above."""
    for k, v in table.items():
        if v == value:
            return k
    return default


def dtype_name(name: str) -> str:
    """Canonical dtype name ("f32", "f16", "bf16", "i32", "fp8") for a name or alias;
    InvalidArgument if unknown."""
    key = str(name).lower()
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise InvalidArgument(f"unknown dtype {name!r}: use one of f32, f16, bf16 (or float32, "
                              f"float16, bfloat16), or fp8 for weights")
    return key


def strategy_value(strategy) -> int:
    """The moed.v1.Strategy value of a strategy name ("topk", ...), None/"model" -> 0."""
    if strategy is None:
        return 0
    if isinstance(strategy, (int, np.integer)) and int(strategy) in STRATEGIES.values():
        return int(strategy)
    key = str(strategy).lower()
    if key not in STRATEGIES:
        raise InvalidArgument(f"unknown gating strategy {strategy!r}: use one of "
                              f"{', '.join(STRATEGIES)}")
    return STRATEGIES[key]


@dataclass
class LayerInfo:
    """One resident MoE layer (moed.v1.LayerInfo); also what moed.reference gates and computes with."""

    index: int = 0
    d_model: int = 0
    d_ff: int = 0
    num_experts: int = 0
    top_k: int = 0
    activation: str = "swiglu"
    weight_dtype: str = "bf16"
    has_router: bool = False
    norm_topk_prob: bool = True
    router_rule: str = "softmax_topk"
    num_shared_experts: int = 0
    shared_d_ff: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # The experts whose terms the server computes, as inclusive (first, last) ranges (moed
    # --experts); empty: every expert. adds_shared_experts: its replies include the shared experts'
    # term (one expert shard of a fleet adds them).
    experts_held: List[Tuple[int, int]] = field(default_factory=list)
    adds_shared_experts: bool = True
    # Where the layer lives on the server's devices (indexes into ModelInfo.devices): the home
    # device (router, shared experts, where its calls run) and each held expert's device, as
    # inclusive (first, last, device) ranges; several devices when its experts are split over them
    # (moed --expert-parallel). Empty from a server older than these fields.
    home_device: int = 0
    expert_placement: List[Tuple[int, int, int]] = field(default_factory=list)
    # Extra copies of hot experts of a split layer, as (expert, device) pairs, beside the device
    # expert_placement puts each on: made by a re-placement by measured load (moed --rebalance;
    # a token's pairs are shared among an expert's copies by a hash of its own expert ids, so
    # replies stay deterministic for a placement). placement_generation: the re-placements applied
    # so far (0: the placement made at load). Empty and 0 from a server older than these fields.
    expert_replicas: List[Tuple[int, int]] = field(default_factory=list)
    placement_generation: int = 0
    # Every routed expert's matrices are 2:4 sparse, the zeros part of the weights served (moed
    # --weights sparse24 pruned them, or a compressed-tensors 2:4 checkpoint; docs/weights.md).
    sparse24: bool = False


@dataclass
class Device:
    """A device the server computes on (moed.v1.Device); memory in bytes."""

    name: str
    memory_total: int
    memory_used: int


# moed.v1.RegionKind
REGION_KINDS = {"host": 1, "cuda": 2}


@dataclass
class RegionLimits:
    """Whether and how much the server takes tensor regions (moed.v1.RegionLimits): mode "off",
    "local" (same-host peers only) or "any"; caps per principal and in all; cuda: CUDA regions
    accepted (the cuda backend)."""

    mode: str = "off"
    max_regions: int = 0
    max_region_bytes: int = 0
    max_region_bytes_total: int = 0
    cuda: bool = False


@dataclass
class Region:
    """A registered tensor region, as the server lists it (moed.v1.Region): kind "host" or "cuda";
    requests: the references requests hold on it now."""

    id: int
    kind: str
    name: str
    bytes: int
    device: int
    ready: bool
    broken: bool
    requests: int


@dataclass
class ModelInfo:
    """What the server holds (moed.v1.ModelInfo); regions: its RegionLimits."""

    model: str
    layers: List[LayerInfo]
    backend: str
    devices: List[Device]
    version: str
    max_message_bytes: int
    max_batch_tokens: int
    regions: RegionLimits = field(default_factory=RegionLimits)
    # The model's identity (moed.proto's ModelInfo.model_fingerprint): equal on every daemon
    # serving the same model; 0 from a moed older than it.
    model_fingerprint: int = 0

    def layer(self, index: int) -> LayerInfo:
        """The LayerInfo whose index (checkpoint layer number) is `index`; KeyError if not resident."""
        for li in self.layers:
            if li.index == index:
                return li
        raise KeyError(f"layer {index} is not resident; resident layers: {[li.index for li in self.layers]}")


@dataclass
class Timings:
    """Server-side timings of one Forward (moed.v1.Timings), microseconds."""

    queue_us: int = 0
    compute_us: int = 0
    total_us: int = 0
    batch_tokens: int = 0
    batch_requests: int = 0


@dataclass
class ForwardResult:
    """What forward(..., return_info=True) returns.

    output: [T, d_model] in the input's dtype, of the input's kind (numpy array or torch tensor);
    expert_set: the batch-gating set S (int32 array, empty without batch gating); timings:
    Timings; request_id: echoed by the server.
    """

    output: Any
    expert_set: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    timings: Timings = field(default_factory=Timings)
    request_id: str = ""


class MoEError(Exception):
    """A failed call: .code is the grpc.StatusCode, .code_name its name ("INVALID_ARGUMENT"),
    .message the status message (written for a person), .attempts how many attempts were made
    (more than 1 when UNAVAILABLE was retried; see RetryPolicy).

    Raised with the server's status, and with the client's own where the client finds the fault:
    arguments it cannot send are INVALID_ARGUMENT (InvalidArgument, also a ValueError and a
    TypeError, as these were before), a reply unlike its request INTERNAL, a local resource that
    cannot be had (shared memory, the CUDA driver) RESOURCE_EXHAUSTED or FAILED_PRECONDITION
    (local_failure), a call a fleet cannot serve FAILED_PRECONDITION. .code is set on every one."""

    def __init__(self, code_name: str, message: str, code=None, attempts: int = 1):
        after = f" (after {attempts} attempts)" if attempts > 1 else ""
        super().__init__(f"{code_name}: {message}{after}")
        self.code_name = code_name
        self.message = message
        self.code = status_code(code_name) if code is None else code
        self.attempts = attempts


class InvalidArgument(MoEError, ValueError, TypeError):
    """MoEError INVALID_ARGUMENT: an argument the client cannot send, found before anything is
    sent. Also a ValueError and a TypeError, which the same calls raised before."""

    def __init__(self, message: str):
        super().__init__("INVALID_ARGUMENT", message)


# errno values that say a local resource is used up (RESOURCE_EXHAUSTED); any other is
# FAILED_PRECONDITION: this host lacks what the call needs (no /dev/shm, no CUDA driver).
_EXHAUSTED = frozenset((errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EMFILE, errno.ENFILE,
                        errno.EDQUOT))


def local_failure(e: OSError, message: str) -> MoEError:
    """An OSError of a local resource as the MoEError that says what it means for the call
    (raise it from e, which keeps the errno)."""
    return MoEError("RESOURCE_EXHAUSTED" if e.errno in _EXHAUSTED else "FAILED_PRECONDITION", message)


def status_code(name: str) -> Any:
    """The grpc.StatusCode called `name` (UNKNOWN for a name that is none)."""
    return grpc.StatusCode.__members__.get(name, grpc.StatusCode.UNKNOWN)
