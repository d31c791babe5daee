"""What the client takes as a tensor, and how it hands back one of the same kind.

Accepted: numpy arrays; torch tensors on the CPU or a CUDA device; any other object with
`__dlpack__` that lives on the host (read through numpy.from_dlpack, so its output is a numpy
array); anything numpy.asarray takes. Hidden states are float32, float16 or bfloat16 (numpy's
bfloat16 is ml_dtypes'; uint16 arrays of bf16 bit patterns with dtype="bf16" also work). torch is
never imported here: a torch tensor is recognised by its type's module, and torch, already loaded
by whoever made the tensor, is taken from sys.modules.

Copies, on the inline transport: a contiguous little-endian host tensor is read where it lies
(wire.py writes its bytes into the message: the one copy); a non-contiguous one is first made
contiguous (one more copy, on the tensor's own device); a CUDA tensor is copied to the host once.
The output: numpy arrays are read-only views of the reply's bytes (copy=True gives a writable
array of their own); torch tensors, which cannot be read-only, are memory of their own, one copy
out of the reply (copy=True adds none); CUDA outputs are one host-to-device copy. An out= is
written once, from the reply's bytes. On the shm transport the one copy in is into the client's
shared memory (write(), from any layout or device) and the output views the memory the server
wrote it to, the client's while the output lives (read-only for numpy, writable for torch); the
cuda transport is moed.transport's and moed.regions' business.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from .types import DTYPES, InvalidArgument, MoEError, dtype_name, name_of

F32, F16, BF16, I32 = DTYPES["f32"], DTYPES["f16"], DTYPES["bf16"], DTYPES["i32"]
# numpy dtype of each wire dtype: little-endian, bf16 as its uint16 bit pattern.
WIRE_NP = {F32: np.dtype("<f4"), F16: np.dtype("<f2"), BF16: np.dtype("<u2"), I32: np.dtype("<i4")}
_HIDDEN = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # numpy and torch dtype names
_KDL_CPU = 1  # DLPack's device type of host memory
_BIG_ENDIAN = sys.byteorder == "big"


_NP_NAMES: Dict[np.dtype, str] = {}  # dtype.name per dtype: numpy computes it in Python each time


def _np_name(dt: np.dtype) -> str:
    name = _NP_NAMES.get(dt)
    if name is None:
        name = _NP_NAMES[dt] = dt.name
    return name


def is_torch(x: Any) -> bool:
    """Whether x is a torch tensor, without importing torch."""
    mod = type(x).__module__
    return (mod == "torch" or mod.startswith("torch.")) and hasattr(x, "device") and hasattr(x, "dtype")


def _wire_dtype(name: str, dtype: Optional[str], what: str) -> int:
    """The wire dtype of a hidden tensor whose dtype is called `name` ("float32", "uint16", ...)."""
    if name == "uint16":
        if dtype is None or dtype_name(dtype) != "bf16":
            raise InvalidArgument(f"{what} is a uint16 array: pass dtype='bf16' if it holds bf16 bit "
                                  f"patterns")
        return BF16
    if name not in _HIDDEN:
        raise InvalidArgument(f"{what} has dtype {name}: use float32, float16 or bfloat16 (numpy: "
                              f"ml_dtypes.bfloat16, or uint16 bf16 bits with dtype='bf16')")
    if dtype is not None and dtype_name(dtype) != _HIDDEN[name]:
        raise InvalidArgument(f"dtype={dtype!r} does not match {what}'s dtype {name}")
    return DTYPES[_HIDDEN[name]]


def _from_dlpack(x: Any, what: str) -> np.ndarray:
    """A host __dlpack__ object as a numpy array over its memory."""
    device = x.__dlpack_device__() if hasattr(x, "__dlpack_device__") else (_KDL_CPU, 0)
    if int(device[0]) != _KDL_CPU:
        raise InvalidArgument(f"{what} is a DLPack tensor on device {tuple(device)}, not on the host: "
                              f"pass a torch tensor (CUDA works) or copy it to the host first")
    try:
        return np.from_dlpack(x)
    except (BufferError, RuntimeError, TypeError) as e:
        raise InvalidArgument(f"{what}: numpy cannot read this __dlpack__ object ({e}); pass a "
                              f"numpy array or a torch tensor") from None


def wire_tensor(a: np.ndarray, wire: int) -> Dict[str, Any]:
    """A moed.v1.Tensor (a dict for moed.wire) carrying host array `a` (C-contiguous, of the wire
    dtype's numpy type) in place: its memory is read when the message is written."""
    return {"dtype": wire, "shape": a.shape, "data": a}


def wire_view(data: memoryview, wire: int, shape: Sequence[int]) -> np.ndarray:
    """A reply's tensor bytes as a read-only little-endian array of `shape` over them (no copy);
    MoEError INTERNAL when their size is not the shape's."""
    if any(n < 0 for n in shape) or len(data) != math.prod(shape) * WIRE_NP[wire].itemsize:
        raise MoEError("INTERNAL", f"the server replied with {len(data)} bytes for shape {list(shape)} "
                                   f"of {name_of(DTYPES, wire)}")
    return np.frombuffer(data, dtype=WIRE_NP[wire]).reshape(tuple(shape))


class Input:
    """A hidden-state tensor as the client sees it: its wire dtype and shape, its bytes on the
    host (host()), and how to make an output like it (output()). obj is the caller's tensor."""

    __slots__ = ("obj", "wire", "shape")
    # Whether a view of memory the client lends an output (a shared-memory slot) must be writable:
    # numpy's can be read-only, torch has no read-only tensors.
    writable_views = False

    def __init__(self, obj: Any, wire: int, shape: Tuple[int, ...]):
        self.obj, self.wire, self.shape = obj, wire, shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * WIRE_NP[self.wire].itemsize

    @property
    def cuda(self) -> bool:
        """Whether the tensor lies in CUDA device memory."""
        return False

    def host(self) -> np.ndarray:
        """The bytes as a C-contiguous little-endian host array of the wire dtype's numpy type."""
        raise NotImplementedError

    def write(self, dst: np.ndarray) -> None:
        """Copies the tensor's bytes into dst (nbytes of uint8 host memory): one copy, from any
        layout and device."""
        raise NotImplementedError

    def check_out(self, out: Any) -> None:
        """InvalidArgument unless `out` can take the output: of the input's kind, dtype, shape (and
        device), C-contiguous and writable."""
        raise NotImplementedError

    def output(self, data: Any, shape: Sequence[int], copy: bool, out: Any = None) -> Any:
        """An output of the input's kind from its bytes (already checked against shape): the
        reply's (read-only), or a slot of shared memory lent to it (writable if writable_views),
        which the output may view; written into `out` (checked) when given, and returned."""
        raise NotImplementedError


class NumpyInput(Input):
    """A numpy array (also what a host __dlpack__ object reads as); the output is numpy."""

    __slots__ = ()

    def host(self) -> np.ndarray:
        a = self.obj.view(np.uint16) if self.wire == BF16 else self.obj
        return a.astype(WIRE_NP[self.wire], order="C", copy=False)  # a copy only if it must

    def write(self, dst: np.ndarray) -> None:
        src = self.obj.view(np.uint16) if self.wire == BF16 else self.obj
        np.copyto(dst.view(WIRE_NP[self.wire]).reshape(self.shape), src)

    def check_out(self, out: Any) -> None:
        if not (isinstance(out, np.ndarray) and out.dtype == self.obj.dtype and out.shape == self.shape
                and out.flags.c_contiguous and out.flags.writeable):
            raise InvalidArgument(f"out must be a writable C-contiguous numpy array of hidden's "
                                  f"dtype {self.obj.dtype} and shape {list(self.shape)}")

    def output(self, data: Any, shape: Sequence[int], copy: bool, out: Any = None) -> np.ndarray:
        like = self.obj.dtype if self.wire == BF16 else self.obj.dtype.newbyteorder("=")
        a = wire_view(data, self.wire, shape)
        y = a.astype(like) if _BIG_ENDIAN else a.view(like)  # big-endian: converted, a copy
        if out is not None:
            np.copyto(out, y)
            return out
        return y.copy() if copy and not _BIG_ENDIAN else y


class TorchInput(Input):
    """A torch tensor on the CPU or a CUDA device; the output is a torch tensor on that device."""

    __slots__ = ()
    writable_views = True

    def host(self) -> np.ndarray:
        t = self.obj.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.device.type != "cpu":
            t = t.cpu()
        if self.wire == BF16:  # numpy has no bfloat16: its bits
            t = t.view(sys.modules["torch"].int16)
        a = t.numpy()
        return a.view(np.uint16) if self.wire == BF16 else a.astype(WIRE_NP[self.wire], copy=False)

    @property
    def cuda(self) -> bool:
        return self.obj.device.type == "cuda"

    def write(self, dst: np.ndarray) -> None:
        torch = sys.modules["torch"]
        torch.from_numpy(dst).view(self.obj.dtype).view(self.shape).copy_(self.obj.detach())

    def check_out(self, out: Any) -> None:
        if not (is_torch(out) and out.dtype == self.obj.dtype and tuple(out.shape) == self.shape
                and out.device == self.obj.device and out.is_contiguous()):
            raise InvalidArgument(f"out must be a contiguous torch tensor of hidden's dtype "
                                  f"{self.obj.dtype}, shape {list(self.shape)} and device "
                                  f"{self.obj.device}")

    def output(self, data: Any, shape: Sequence[int], copy: bool, out: Any = None) -> Any:
        torch = sys.modules["torch"]
        dtype, shape = self.obj.dtype, tuple(shape)
        a = wire_view(data, self.wire, shape)
        own = True  # whether `host` is memory of its own
        if a.size == 0:
            host = torch.empty(shape, dtype=dtype)
        elif _BIG_ENDIAN:  # torch holds native byte order: convert (a copy)
            a = a.astype(a.dtype.newbyteorder("="))
            host = torch.from_numpy(a.view(np.int16) if self.wire == BF16 else a).view(dtype)
        else:
            with warnings.catch_warnings():
                # torch warns of a read-only buffer: the reply's bytes are only read (below)
                warnings.simplefilter("ignore", UserWarning)
                host = torch.frombuffer(data, dtype=dtype).view(shape)
            own = not memoryview(data).readonly  # a slot lent writable: the output's own
        if out is not None:
            return out.copy_(host)
        if self.obj.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=self.obj.device).copy_(host)
        # The reply's bytes are an immutable object: an in-place op on a view would write into it.
        return host.clone() if copy or not own else host


def _asarray(x: Any, what: str) -> np.ndarray:
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as e:  # ragged nested lists, objects numpy refuses
        raise InvalidArgument(f"{what} is no array numpy can read: {e}") from None


def hidden_input(x: Any, dtype: Optional[str] = None, what: str = "hidden") -> Input:
    """x (numpy, torch, __dlpack__, or anything numpy.asarray takes) as a 2-D Input."""
    if type(x) is not np.ndarray and is_torch(x):
        inp: Input = TorchInput(x, _wire_dtype(str(x.dtype).rpartition(".")[2], dtype, what), tuple(x.shape))
    else:
        if not isinstance(x, np.ndarray):
            x = _from_dlpack(x, what) if hasattr(x, "__dlpack__") else _asarray(x, what)
        inp = NumpyInput(x, _wire_dtype(_np_name(x.dtype), dtype, what), x.shape)
    if len(inp.shape) != 2:
        raise InvalidArgument(f"{what} must be [T, d_model], not shape {list(inp.shape)}")
    return inp


def host_array(x: Any, wire: int, what: str) -> np.ndarray:
    """A routing tensor (ids, weights, logits) as a C-contiguous little-endian host array of the
    wire dtype's numpy type; converted from any dtype, copied from any device; InvalidArgument for
    what holds no such numbers."""
    try:
        if type(x) is np.ndarray:
            return x.astype(WIRE_NP[wire], order="C", copy=False)
        if is_torch(x):
            t = x.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            x = t.float().numpy() if str(t.dtype) == "torch.bfloat16" else t.numpy()
        elif not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__"):
            x = _from_dlpack(x, what)
        return np.asarray(x).astype(WIRE_NP[wire], order="C", copy=False)
    except InvalidArgument:
        raise
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"{what} cannot be read as {name_of(DTYPES, wire)} numbers: {e}") from None
