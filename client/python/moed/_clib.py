"""libmoedclient through ctypes: the C client's structs and the calls the doorbell and the links
need.

The library is loaded on first use, from $MOED_CLIENT_LIB when it is set (a build's own,
build/client/c/libmoedclient.so), else from the copy `pip install ./client/python` builds into
the package (moed/_lib/, where the build found CMake and gRPC's development files). Without
either, load() raises MoEError FAILED_PRECONDITION saying how to get one. ctypes releases the GIL
for the whole of every foreign call, so a thread waiting in moedc_ring_wait lets the others run.

The structs mirror client/c/include/moedclient.h field for field; tests/e2e/test_python_ring.py
compiles a program against the header and checks every size and offset here against the C
compiler's. Functions return 0 or a negative MOEDC_E* code and fill a moedc_error; check() turns
a failure into the MoEError of its gRPC status.
"""

from __future__ import annotations

import ctypes
import os
import threading
from ctypes import (POINTER, Structure, c_bool, c_char, c_char_p, c_double, c_int, c_int64, c_size_t,
                    c_uint32, c_uint64, c_void_p)
from typing import Optional

from .types import MoEError

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGED = os.path.join(HERE, "_lib", "libmoedclient.so")

# moedclient.h's codes that Python looks at by name
EFULL, EUNAVAIL = -4, -15
HOST, CUDA = 1, 2  # MOEDC_REGION_*


class Error(Structure):
    _fields_ = [("code", c_int), ("msg", c_char * 480)]


class Opts(Structure):
    _fields_ = [("timeout_s", c_double), ("bearer_token", c_char_p), ("tls", c_bool),
                ("tls_ca", c_char_p), ("tls_cert", c_char_p), ("tls_key", c_char_p),
                ("tls_server_name", c_char_p)]


class Region(Structure):
    _fields_ = [("id", c_uint64), ("kind", c_int), ("ptr", c_void_p), ("bytes", c_size_t),
                ("device", c_int), ("name", c_char * 256), ("session", c_void_p)]


class Ref(Structure):
    _fields_ = [("region", POINTER(Region)), ("offset", c_uint64)]


class RingCall(Structure):
    _fields_ = [("layer", c_uint32), ("dtype", c_int), ("tokens", c_int64), ("d_model", c_int64),
                ("k", c_int), ("hidden", Ref), ("expert_ids", Ref), ("expert_weights", Ref),
                ("output", Ref), ("timeout_s", c_double), ("tag", c_uint64)]


class Ticket(Structure):
    _fields_ = [("slot", c_uint32), ("ticket", c_uint32)]


class Timings(Structure):
    _fields_ = [("queue_us", c_uint64), ("compute_us", c_uint64), ("total_us", c_uint64),
                ("batch_tokens", c_uint32), ("batch_requests", c_uint32)]


class RingResult(Structure):
    _fields_ = [("status", c_int), ("message", c_char * 224), ("timings", Timings)]


class LinksOpts(Structure):
    _fields_ = [("device", c_int), ("max_tokens", c_uint32), ("max_top_k", c_uint32),
                ("timeout_s", c_double), ("send", c_int)]


class LinkCall(Structure):
    _fields_ = [("layer", c_uint32), ("dtype", c_int), ("tokens", c_int64), ("d_model", c_int64),
                ("k", c_int), ("hidden", c_void_p), ("expert_ids", c_void_p),
                ("expert_weights", c_void_p), ("output", c_void_p), ("stream", c_void_p)]


# What test_python_ring.py checks against the header: each struct's C name and class.
STRUCTS = {"moedc_error": Error, "moedc_opts": Opts, "moedc_region": Region, "moedc_ref": Ref,
           "moedc_ring_call": RingCall, "moedc_ring_ticket": Ticket, "moedc_timings": Timings,
           "moedc_ring_result": RingResult, "moedc_links_opts": LinksOpts,
           "moedc_link_call": LinkCall}

_P = c_void_p
_ERR = POINTER(Error)
_PROTOS = {
    "moedc_strerror": (c_char_p, [c_int]),
    "moedc_code_to_grpc": (c_int, [c_int]),
    "moedc_grpc_status_name": (c_char_p, [c_int]),
    "moedc_connect": (c_int, [c_char_p, POINTER(Opts), POINTER(_P), _ERR]),
    "moedc_connect_many": (c_int, [POINTER(c_char_p), c_int, POINTER(Opts), POINTER(_P), _ERR]),
    "moedc_close": (None, [_P]),
    "moedc_session_open": (c_int, [_P, POINTER(_P), _ERR]),
    "moedc_session_close": (None, [_P]),
    "moedc_region_create_host": (c_int, [_P, c_size_t, ctypes.c_uint, POINTER(POINTER(Region)), _ERR]),
    "moedc_region_register_cuda": (c_int, [_P, c_void_p, c_size_t, POINTER(POINTER(Region)), _ERR]),
    "moedc_region_free": (c_int, [POINTER(Region), _ERR]),
    "moedc_ring_open": (c_int, [_P, c_uint32, POINTER(_P), _ERR]),
    "moedc_ring_start": (c_int, [_P, POINTER(RingCall), POINTER(Ticket), _ERR]),
    "moedc_ring_wait": (c_int, [_P, POINTER(Ticket), c_double, POINTER(RingResult), _ERR]),
    "moedc_ring_enqueue": (c_int, [_P, POINTER(RingCall), c_void_p, POINTER(Ticket), _ERR]),
    "moedc_ring_stream_result": (c_int, [_P, POINTER(Ticket), POINTER(RingResult), _ERR]),
    "moedc_ring_release": (c_int, [_P, POINTER(Ticket), _ERR]),
    "moedc_ring_failures": (c_uint32, [_P]),
    "moedc_ring_close": (None, [_P]),
    "moedc_links_open": (c_int, [_P, POINTER(LinksOpts), POINTER(_P), _ERR]),
    "moedc_links_forward": (c_int, [_P, POINTER(LinkCall), POINTER(Timings), _ERR]),
    "moedc_links_describe": (c_char_p, [_P]),
    "moedc_links_failures": (c_int, [_P, POINTER(c_uint64), _ERR]),
    "moedc_links_close": (None, [_P]),
}

_lib: Optional[ctypes.CDLL] = None
_lock = threading.Lock()


def path() -> Optional[str]:
    """The library load() opens: $MOED_CLIENT_LIB, else the package's copy; None without either."""
    env = os.environ.get("MOED_CLIENT_LIB")
    if env:
        return env
    return PACKAGED if os.path.isfile(PACKAGED) else None


def load() -> ctypes.CDLL:
    """libmoedclient with every prototype set (once per process)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        where = path()
        if where is None:
            raise MoEError("FAILED_PRECONDITION",
                           "the doorbell needs libmoedclient, which this install of moed-client lacks: "
                           "reinstall it from the moed repository with CMake and gRPC's development "
                           "files present (pip install ./client/python builds it in), or point "
                           "$MOED_CLIENT_LIB at a libmoedclient.so (build/client/c/ of a moed build)")
        try:
            lib = ctypes.CDLL(where)
        except OSError as e:
            raise MoEError("FAILED_PRECONDITION", f"cannot load libmoedclient from {where}: {e} (is "
                                                  f"its gRPC C core on the library path?)") from None
        for name, (res, args) in _PROTOS.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _lib = lib
        return lib


def status_name(code: int) -> str:
    """The gRPC status name of a MOEDC_E* code ("UNAVAILABLE", ...)."""
    lib = load()
    return lib.moedc_grpc_status_name(lib.moedc_code_to_grpc(code)).decode()


def failure(code: int, message: str) -> MoEError:
    """The MoEError of a MOEDC_E* code with a message."""
    return MoEError(status_name(code), message)


def check(rc: int, err: Error) -> int:
    """rc when it is not a failure; else raises the MoEError of err."""
    if rc < 0:
        raise failure(rc, err.msg.decode(errors="replace") or load().moedc_strerror(rc).decode())
    return rc
