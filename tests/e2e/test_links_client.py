"""The links' client side (moedc_links in libmoedclient, moed.Links over it) where no link can be
made: against a daemon on the CPU backend moedc_links_open fails with the daemon's own refusal of
open_link, naming the daemon, and the daemon goes on serving; with MOED_NCCL_LIB naming no library
it fails UNIMPLEMENTED (MOEDC_EUNSUPPORTED) naming MOED_NCCL_LIB, before any daemon is asked;
moed.open_links logs why links are not used and answers None, so the caller keeps gRPC. The
ctypes structs are checked against the header with the others (test_python_ring.py, L.STRUCTS).
"""

import logging
import os
import subprocess
import sys
import textwrap

import pytest

import test_python_ring  # noqa: F401  (sets MOED_CLIENT_LIB to the build's library)
from conftest import ROOT

import moed
import moed._clib as L
from moed import MoEClient, MoEError


def test_cpu_daemon_refuses_links(shared_daemon, caplog):
    """The daemon's refusal comes back with its status and message, naming the daemon."""
    with pytest.raises(MoEError) as e:
        moed.Links(shared_daemon.address, device=0, max_tokens=64, max_top_k=2)
    assert f"daemon {shared_daemon.address}: " in e.value.message, e.value.message
    assert e.value.code_name not in ("OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"), e.value
    with caplog.at_level(logging.INFO, logger="moed.links"):
        assert moed.open_links(shared_daemon.address, device=0) is None
    assert "links: not used (" in caplog.text and "calls go over gRPC" in caplog.text
    with MoEClient(shared_daemon.address) as c:  # it goes on serving
        assert c.health() == "SERVING"


def test_bad_arguments_refused_before_asking():
    """Limits a link cannot have are refused by the client, naming them."""
    with pytest.raises(MoEError) as e:
        moed.Links("127.0.0.1:1", device=0, max_tokens=64, max_top_k=65)
    assert e.value.code_name == "INVALID_ARGUMENT" and "max_top_k 1 .. 64" in e.value.message
    with pytest.raises(MoEError) as e:
        moed.Links("127.0.0.1:1", device=0, send="some")
    assert e.value.code_name == "INVALID_ARGUMENT" and "auto, chosen, all" in e.value.message


def test_no_nccl_names_the_variable(shared_daemon):
    """MOED_NCCL_LIB naming no library: UNIMPLEMENTED (MOEDC_EUNSUPPORTED) naming it, and the
    daemon never asked (its log shows no region session)."""
    before = shared_daemon.log().count("region session")
    prog = textwrap.dedent(f"""
        import moed
        try:
            moed.Links({shared_daemon.address!r}, device=0)
        except moed.MoEError as e:
            print(e.code_name, e.message)
    """)
    env = dict(os.environ, MOED_NCCL_LIB="/nonexistent/libnccl.so.2")
    out = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True,
                         timeout=60, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("UNIMPLEMENTED ") and "MOED_NCCL_LIB" in out.stdout, out.stdout
    assert shared_daemon.log().count("region session") == before
