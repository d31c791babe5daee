"""`python -m moed`, the Python client's command line, against a real moed: health, info, forward
with --verify (which must also fail against a server that spoils a row), and its exit codes: 0 ok,
1 a failed call or verification, 2 usage.
"""

import subprocess
import sys

import pytest

from conftest import refused_address
from test_load import liar  # noqa: F401  (a fixture: a proxy that spoils one row of each reply)


def pymoed(target, *args, timeout=60):
    return subprocess.run([sys.executable, "-m", "moed", "--target", target, "--timeout", "30",
                           *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_health_and_info(shared_daemon):
    p = pymoed(shared_daemon.address, "health")
    assert (p.returncode, p.stdout) == (0, "SERVING\n"), p.stderr
    p = pymoed(shared_daemon.address, "info")
    assert p.returncode == 0, p.stderr
    assert "cpu" in p.stdout and "layers=2,d=64" in p.stdout, p.stdout
    assert "regions  local, CUDA no" in p.stdout, p.stdout


@pytest.mark.parametrize("transport,tokens,took", [("shm", 5, "shm"), ("auto", 5, "inline"),
                                                   ("auto", 600, "shm"), ("inline", 600, "inline")])
def test_forward_over_each_transport(shared_daemon, transport, tokens, took):
    p = pymoed(shared_daemon.address, "forward", "--tokens", tokens, "--transport", transport,
               "--strategy", "topk", "--verify")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"transport {took}\n" in p.stdout and "verify:" in p.stdout, p.stdout


@pytest.mark.parametrize("dtype", ("f32", "f16", "bf16"))
def test_forward_verified(shared_daemon, dtype):
    p = pymoed(shared_daemon.address, "forward", "--layer", 1, "--tokens", 5, "--dtype", dtype,
               "--strategy", "topk", "--verify")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[5, 64]" in p.stdout and "verify:" in p.stdout, p.stdout


def test_verify_fails_on_a_spoiled_row(liar):  # noqa: F811
    p = pymoed(liar("row"), "forward", "--tokens", 8, "--dtype", "bf16", "--verify")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "verify:" in p.stdout, p.stdout


def test_failed_calls_exit_1(shared_daemon):
    p = pymoed(shared_daemon.address, "forward", "--tokens", 8193)  # over --max-batch-tokens
    assert p.returncode == 1 and "RESOURCE_EXHAUSTED" in p.stderr, p.stderr
    with refused_address() as target:
        p = pymoed(target, "health")
    assert p.returncode == 1 and "UNAVAILABLE" in p.stderr, p.stderr


def test_a_layer_the_server_lacks_is_a_usage_error(shared_daemon):
    """The layer is checked against GetModel before anything is sent."""
    p = pymoed(shared_daemon.address, "forward", "--layer", 9)
    assert p.returncode == 2 and "layer 9" in p.stderr, p.stderr


@pytest.mark.parametrize("args", [(), ("frobnicate",), ("forward", "--dtype", "i32"),
                                  ("forward", "--tokens", "x"), ("forward", "--strategy", "best")],
                         ids=lambda a: " ".join(a) or "no command")
def test_usage_errors_exit_2(shared_daemon, args):
    p = pymoed(shared_daemon.address, *args)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert p.stderr and p.stdout == "", p.stderr
