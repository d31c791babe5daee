"""The CUDA driver calls the doorbell's CUDA path makes itself, through ctypes on libcuda.so.1 (the
driver torch or any CUDA runtime already loaded): where an allocation lies, and a thread's stream
capture mode. libmoedclient opens the same driver for its own calls (registering, streams).

An allocation is known by its range and its buffer id (CU_POINTER_ATTRIBUTE_BUFFER_ID, unique in
the process over its life): a range freed and allocated again at the same address (the caching
allocator after torch.cuda.empty_cache) has a new id, so a region registered for the old one is
never taken for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Iterator, Optional, Tuple

from .types import MoEError

# CUpointer_attribute
_BUFFER_ID, _RANGE_START, _RANGE_SIZE = 7, 11, 12
_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED
_INVALID_CONTEXT = 201

_cu: Optional[ctypes.CDLL] = None


def driver() -> ctypes.CDLL:
    global _cu
    if _cu is None:
        try:
            cu = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise MoEError("FAILED_PRECONDITION", f"the CUDA driver (libcuda.so.1) cannot be loaded: {e}") from None
        cu.cuPointerGetAttributes.restype = ctypes.c_int
        cu.cuPointerGetAttributes.argtypes = [ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                                              ctypes.c_uint64]
        _cu = cu
    return _cu


class _Query(threading.local):
    """cuPointerGetAttributes' arguments, made once per thread (a call costs a microsecond or so)."""

    def __init__(self):
        self.base, self.size, self.buf = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_uint64()
        self.attrs = (ctypes.c_int * 3)(_RANGE_START, _RANGE_SIZE, _BUFFER_ID)
        self.data = (ctypes.c_void_p * 3)(*(ctypes.addressof(v) for v in (self.base, self.size, self.buf)))


_query = _Query()


def allocation(ptr: int) -> Tuple[int, int, int]:
    """(base, size, buffer id) of the device allocation holding ptr; MoEError naming the driver's
    error otherwise. The caller's torch calls just before (the stream's capture state, the output's
    allocation) made the device's context current on this thread."""
    q = _query
    rc = driver().cuPointerGetAttributes(3, q.attrs, q.data, ptr)
    if rc == _INVALID_CONTEXT:
        raise MoEError("FAILED_PRECONDITION", "no CUDA context is current on this thread: make the "
                                              "tensors' device current (torch.cuda.set_device) first")
    if rc or not q.size.value:
        raise MoEError("INVALID_ARGUMENT", f"the CUDA driver cannot say where the allocation of "
                                           f"{ptr:#x} lies (cuPointerGetAttributes: error {rc}): "
                                           f"is it device memory of this process?")
    return q.base.value, q.size.value, q.buf.value


@contextlib.contextmanager
def relaxed_capture() -> Iterator[None]:
    """This thread's stream capture mode relaxed for the block: registering memory (pinning the
    ring, an IPC handle of a segment the capture's pool just made) is then allowed while a stream
    captures in torch's default "global" mode; nothing of it is captured."""
    fn = getattr(driver(), "cuThreadExchangeStreamCaptureMode", None)
    if fn is None:  # a driver without captures of its own (the tests' fake)
        yield
        return
    mode = ctypes.c_int(_RELAXED)
    fn(ctypes.byref(mode))
    try:
        yield
    finally:
        fn(ctypes.byref(mode))
