"""MoEClient: calls a moed server with numpy arrays in and out.

Tensors go on the wire as raw little-endian bytes (moed.v1.Tensor.data), never as repeated floats:
building them is one tobytes() of a C-contiguous array, and the reply is read back the same way.
The channel's message size limits are lifted (-1) because a [T, d_model] batch is easily over
gRPC's 4 MiB default; the server enforces its own limit and says so with RESOURCE_EXHAUSTED.
Every grpc.RpcError becomes a moed.MoEError carrying the status code and the server's message.
"""

from __future__ import annotations

from typing import Optional

import grpc
import ml_dtypes
import numpy as np

from ._proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from ._proto.moed.v1 import moed_pb2, moed_pb2_grpc
from .types import (ACTIVATIONS, DTYPES, ROUTER_RULES, Device, ForwardResult, LayerInfo, ModelInfo,
                    MoEError, Timings, dtype_name, name_of, strategy_value)

# numpy dtype of each wire dtype, little-endian; bf16 is carried as its uint16 bit pattern.
_WIRE_NP = {DTYPES["f32"]: np.dtype("<f4"), DTYPES["f16"]: np.dtype("<f2"),
            DTYPES["bf16"]: np.dtype("<u2"), DTYPES["i32"]: np.dtype("<i4")}
_RENORMALIZE = {None: moed_pb2.RENORMALIZE_DEFAULT, True: moed_pb2.RENORMALIZE_ON,
                False: moed_pb2.RENORMALIZE_OFF}


def _hidden_dtype(hidden: np.ndarray, dtype: Optional[str]) -> int:
    """The wire dtype of a hidden-state array; ValueError if it is not one moed computes in."""
    kinds = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16",
             np.dtype(ml_dtypes.bfloat16): "bf16"}
    if hidden.dtype == np.uint16:
        if dtype is None or dtype_name(dtype) != "bf16":
            raise ValueError("hidden is a uint16 array: pass dtype='bf16' if it holds bf16 bit patterns")
        return DTYPES["bf16"]
    name = kinds.get(hidden.dtype if hidden.dtype.isnative else hidden.dtype.newbyteorder("="))
    if name is None:
        raise ValueError(f"hidden has dtype {hidden.dtype}: use float32, float16, ml_dtypes.bfloat16 "
                         f"(or uint16 bf16 bits with dtype='bf16')")
    if dtype is not None and dtype_name(dtype) != name:
        raise ValueError(f"dtype={dtype!r} does not match hidden's dtype {hidden.dtype}")
    return DTYPES[name]


def _tensor(arr: np.ndarray, wire: int) -> moed_pb2.Tensor:
    """A moed.v1.Tensor with arr's raw bytes (arr already has a dtype of the wire's width)."""
    a = np.ascontiguousarray(arr)
    if wire == DTYPES["bf16"]:
        a = a.view(np.uint16)
    a = a.astype(_WIRE_NP[wire], copy=False)  # a no-op on little-endian hosts
    return moed_pb2.Tensor(dtype=wire, shape=a.shape, data=a.tobytes())


def _matrix(name: str, arr, np_dtype, T: int) -> np.ndarray:
    a = np.asarray(arr, dtype=np_dtype)
    if a.ndim != 2 or a.shape[0] != T:
        raise ValueError(f"{name} must be [T={T}, n], not shape {a.shape}")
    return a


def _rpc_error(e: grpc.RpcError) -> MoEError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return MoEError(code.name, details or "(no message)", code)


class MoEClient:
    """A connection to one moed server.

    MoEClient(target, timeout=None, credentials=None, token=None): target is "host:port" (or any
    gRPC target); timeout the default deadline of each call in seconds (None: none); credentials
    grpc.ChannelCredentials for TLS (None: plaintext); token a bearer token sent as
    "authorization: Bearer TOKEN" metadata. Use as a context manager or call close().
    One client may be used from many threads at once.
    """

    def __init__(self, target: str = "127.0.0.1:50051", timeout: Optional[float] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None, token: Optional[str] = None):
        # HTTP/2 sized for tensors (as the server is): large frames and stream window.
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
                   ("grpc.http2.max_frame_size", 1 << 20), ("grpc.http2.lookahead_bytes", 8 << 20)]
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=options)
        self.target = target
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._moed = moed_pb2_grpc.MoedStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> "MoEClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request, timeout):
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout,
                          metadata=self._metadata)
        except grpc.RpcError as e:
            raise _rpc_error(e) from None

    def build_request(self, layer: int, hidden: np.ndarray, *, expert_ids=None, expert_weights=None,
                      router_logits=None, strategy=None, top_k: int = 0,
                      renormalize: Optional[bool] = None, threshold: Optional[float] = None,
                      batch_gating: bool = False, k_batch: int = 0, dtype: Optional[str] = None,
                      request_id: str = "") -> moed_pb2.ForwardRequest:
        """The moed.v1.ForwardRequest that forward() sends (same arguments); useful for streaming
        or for sending a request byte for byte."""
        hidden = np.asarray(hidden)
        if hidden.ndim != 2:
            raise ValueError(f"hidden must be [T, d_model], not shape {hidden.shape}")
        T = hidden.shape[0]
        req = moed_pb2.ForwardRequest(request_id=request_id, layer=layer,
                                      hidden=_tensor(hidden, _hidden_dtype(hidden, dtype)))
        if (expert_ids is None) != (expert_weights is None):
            raise ValueError("client routing needs both expert_ids and expert_weights")
        if expert_ids is not None:
            if router_logits is not None or batch_gating:
                raise ValueError("expert_ids/expert_weights exclude router_logits and batch_gating")
            ids = _matrix("expert_ids", expert_ids, np.int32, T)
            w = _matrix("expert_weights", expert_weights, np.float32, T)
            if ids.shape != w.shape:
                raise ValueError(f"expert_ids {ids.shape} and expert_weights {w.shape} differ in shape")
            req.experts.expert_ids.CopyFrom(_tensor(ids, DTYPES["i32"]))
            req.experts.expert_weights.CopyFrom(_tensor(w, DTYPES["f32"]))
            return req
        if renormalize not in _RENORMALIZE:
            raise ValueError(f"renormalize={renormalize!r}: use None (the layer's), True or False")
        gating = moed_pb2.Gating(strategy=strategy_value(strategy), top_k=top_k,
                                 renormalize=_RENORMALIZE[renormalize], threshold=threshold or 0.0)
        if router_logits is not None:
            logits = _matrix("router_logits", router_logits, np.float32, T)
            req.logits.logits.CopyFrom(_tensor(logits, DTYPES["f32"]))
            req.logits.gating.CopyFrom(gating)
        else:
            req.server_router.gating.CopyFrom(gating)
        if batch_gating:
            req.batch_gating.k_batch = k_batch
        return req

    def forward(self, layer: int, hidden: np.ndarray, *, expert_ids=None, expert_weights=None,
                router_logits=None, strategy=None, top_k: int = 0, renormalize: Optional[bool] = None,
                threshold: Optional[float] = None, batch_gating: bool = False, k_batch: int = 0,
                dtype: Optional[str] = None, request_id: str = "", return_info: bool = False,
                timeout: Optional[float] = None):
        """Computes MoE layer `layer` for hidden [T, d_model]; returns the output [T, d_model] in
        hidden's dtype (a new array of the same kind), or a ForwardResult if return_info.

        hidden: float32, float16 or ml_dtypes.bfloat16; or uint16 bf16 bit patterns with dtype="bf16"
        (the output is then uint16 too). Routing, one of:
          * expert_ids int32 [T, k] and expert_weights float32 [T, k] (id -1 with weight 0 pads);
          * router_logits float32 [T, num_experts], gated by the server with `strategy`;
          * neither: the server's router computes the logits (the layer must have one).
        strategy: None or "model" (the layer's own rule), "topk", "sigmoid", "sparsemax",
        "quadratic", "pioneer"; top_k: 0 for the layer's; renormalize: None for the layer's
        norm_topk_prob, True or False; threshold: sigmoid's, None for 0.5.
        batch_gating: batch-level dynamic gating over the merged batch with k_batch experts (0: the
        layer's top_k); ForwardResult.expert_set then names the set.
        timeout: seconds, None for the client's default. Raises MoEError on a failed call and
        ValueError on arguments that cannot be sent.
        """
        req = self.build_request(layer, hidden, expert_ids=expert_ids, expert_weights=expert_weights,
                                 router_logits=router_logits, strategy=strategy, top_k=top_k,
                                 renormalize=renormalize, threshold=threshold,
                                 batch_gating=batch_gating, k_batch=k_batch, dtype=dtype,
                                 request_id=request_id)
        resp = self._call(self._moed.Forward, req, timeout)
        out = self.decode_output(resp.output, np.asarray(hidden).dtype)
        if not return_info:
            return out
        t = resp.timings
        return ForwardResult(output=out, expert_set=np.array(resp.expert_set, dtype=np.int32),
                             timings=Timings(t.queue_us, t.compute_us, t.total_us, t.batch_tokens,
                                             t.batch_requests),
                             request_id=resp.request_id)

    @staticmethod
    def decode_output(tensor: moed_pb2.Tensor, like: np.dtype) -> np.ndarray:
        """A reply's Tensor as a new numpy array, bf16 as `like` says (bfloat16 or uint16 bits)."""
        if tensor.dtype not in _WIRE_NP:
            raise MoEError("INTERNAL", f"the server replied with unknown dtype {tensor.dtype}")
        wire = _WIRE_NP[tensor.dtype]
        n = int(np.prod(tensor.shape, dtype=np.int64))
        if len(tensor.data) != n * wire.itemsize:
            raise MoEError("INTERNAL", f"the server replied with {len(tensor.data)} bytes for shape "
                                       f"{list(tensor.shape)} of {name_of(DTYPES, tensor.dtype)}")
        a = np.frombuffer(tensor.data, dtype=wire).reshape(tuple(tensor.shape))
        a = a.astype(wire.newbyteorder("="))  # the copy makes it writable and native-endian
        if tensor.dtype == DTYPES["bf16"] and like != np.uint16:
            a = a.view(ml_dtypes.bfloat16)
        return a

    def info(self, timeout: Optional[float] = None) -> ModelInfo:
        """What the server holds: ModelInfo(model, layers=[LayerInfo...], backend, devices, version,
        max_message_bytes, max_batch_tokens)."""
        m = self._call(self._moed.GetModel, moed_pb2.GetModelRequest(), timeout)
        layers = [LayerInfo(index=l.index, d_model=l.d_model, d_ff=l.d_ff, num_experts=l.num_experts,
                            top_k=l.top_k, activation=name_of(ACTIVATIONS, l.activation),
                            weight_dtype=name_of(DTYPES, l.weight_dtype), has_router=l.has_router,
                            norm_topk_prob=l.norm_topk_prob,
                            router_rule=name_of(ROUTER_RULES, l.router_rule),
                            num_shared_experts=l.num_shared_experts, shared_d_ff=l.shared_d_ff,
                            n_group=l.n_group, topk_group=l.topk_group,
                            routed_scaling_factor=l.routed_scaling_factor)
                  for l in m.layers]
        devices = [Device(d.name, d.memory_total, d.memory_used) for d in m.devices]
        return ModelInfo(model=m.model, layers=layers, backend=m.backend, devices=devices,
                         version=m.version, max_message_bytes=m.max_message_bytes,
                         max_batch_tokens=m.max_batch_tokens)

    def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN"."""
        r = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
