"""The command lines: moed's flags, usage errors and exit codes, its config file; moectl's health,
info and forward over .npy files (outputs compared with the numpy model), its exit codes and a usage
error (exit 2, naming the flag) for every kind of bad word; a Unix-socket target; and that the
flag list of docs/operations.md is `moed --help` word for word.
"""

import os
import re
import resource
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import oracle as O
from conftest import BUILD, DEFAULT_SPEC, MOED_BIN, ROOT, refused_address

MOECTL = BUILD / "client" / "c" / "moectl"
SPEC = O.Spec.parse(DEFAULT_SPEC)
FLAGS = ("listen", "model", "synthetic", "layers", "backend", "threads", "streams", "devices",
         "expert-load", "cq-threads", "max-message-bytes", "max-batch-tokens", "max-delay-us", "max-queue-requests",
         "log-level", "log-file", "config", "help", "version")


def moed(*args, timeout=30):
    return subprocess.run([str(MOED_BIN), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def moectl(d, *args, timeout=60):
    target = ["--target", d.address] if d is not None else []
    return subprocess.run([str(MOECTL), *target, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


# ---- moed -------------------------------------------------------------------------------------

def test_help_lists_every_flag():
    p = moed("--help")
    assert p.returncode == 0 and p.stderr == ""
    for flag in FLAGS:
        assert f"--{flag}" in p.stdout, f"--help does not mention --{flag}"
    assert "127.0.0.1:50051" in p.stdout, "the default address is shown"


def test_version():
    p = moed("--version")
    assert p.returncode == 0
    assert re.fullmatch(r"moed \d+\.\d+\.\d+\n", p.stdout), p.stdout


def test_documented_flags_are_moed_help():
    """docs/operations.md carries `moed --help` verbatim; `make readme-flags` rewrites it."""
    sys.path.insert(0, str(ROOT / "tests"))
    from readme_flags import PAGE, flags_block

    block = flags_block(PAGE.read_text())
    assert block is not None, "docs/operations.md lacks the marked `moed --help` block"
    assert block == moed("--help").stdout, "docs/operations.md's flags differ from `moed --help`: run make readme-flags"


BAD_VALUES = [
    (["--threads", "abc"], ["--threads", "'abc'", "integer"]),
    (["--threads", "-1"], ["--threads", "-1"]),
    (["--max-message-bytes", "1"], ["--max-message-bytes", "4096"]),
    (["--max-message-bytes", "12XB"], ["--max-message-bytes", "12XB"]),
    (["--max-batch-tokens", "0"], ["--max-batch-tokens", "0"]),
    (["--backend", "tpu"], ["--backend", "tpu", "cpu|cuda|auto"]),
    (["--log-level", "loud"], ["--log-level", "loud"]),
    (["--layers", "3-1"], ["--layers", "3-1"]),
    (["--cq-threads", "0"], ["--cq-threads", "0"]),
    (["--config", "/nonexistent/moed.conf"], ["--config", "/nonexistent/moed.conf"]),
    # Refused at once (a directory was read as empty, /dev/zero spun forever), and ports past 65535
    # were taken modulo 65536 (docs/security.md: files and addresses).
    (["--config", "/tmp"], ["--config", "/tmp", "a directory"]),
    (["--config", "/dev/zero"], ["--config", "/dev/zero", "character device"]),
    (["--listen", "127.0.0.1:70000"], ["--listen", "70000", "1 to 65535"]),
    (["--metrics-listen", "127.0.0.1:70000"], ["--metrics-listen", "70000", "1 to 65535"]),
    (["--listen", "127.0.0.1"], ["--listen", "host:port"]),
    # Forms gRPC's server cannot bind ended with its raw reason and exit 1: usage errors now.
    (["--listen", "ipv4:127.0.0.1:0"], ["--listen", "ipv4:", "host:port"]),
    (["--listen", "dns:///localhost:0"], ["--listen", "dns:", "host:port"]),
    (["--listen", ":0"], ["--listen", "':0'", "host"]),
    (["--listen", "256.1.1.1:0"], ["--listen", "256.1.1.1", "IPv4"]),
    (["--listen", "[::1x]:0"], ["--listen", "[::1x]", "IPv6"]),
    (["--listen", "unix:/tmp/" + "s" * 120], ["--listen", "107"]),
    (["--layers", "0-99999"], ["--layers", "65535"]),
    (["--bogus"], ["--bogus"]),
    (["--threads"], ["--threads", "value"]),
    (["stray"], ["stray"]),
]


@pytest.mark.parametrize("args,words", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_usage_exits_2_naming_the_flag(args, words):
    p = moed(*args)
    assert p.returncode == 2, (p.returncode, p.stderr)
    for w in words:
        assert w in p.stderr, f"{p.stderr!r} does not say {w!r}"
    assert p.stdout == ""


def test_bad_synthetic_spec_fails_naming_the_key():
    p = moed("--listen", "127.0.0.1:0", "--synthetic", "layers=1,bogus=3")
    assert p.returncode == 2
    assert "bogus" in p.stderr
    p = moed("--listen", "127.0.0.1:0", "--synthetic", "layers=1,experts=2,topk=3")
    assert p.returncode == 2
    assert "topk=3" in p.stderr and "experts=2" in p.stderr


def test_bad_synthetic_spec_is_a_usage_error():
    p = moed("--listen", "127.0.0.1:0", "--synthetic", "layers=1,bogus=3")
    assert p.returncode == 2 and "--synthetic" in p.stderr


def test_config_file_and_command_line_precedence(daemon, tmp_path):
    conf = tmp_path / "moed.conf"
    conf.write_text(f"# a comment\nsynthetic = {DEFAULT_SPEC}\nmax-batch-tokens = 99\n"
                    "max-message-bytes = 64KiB\nthreads = 1\n")
    d = daemon("--config", conf, "--max-batch-tokens", "123")
    with d.client(timeout=10) as c:
        m = c.info()
    assert m.max_batch_tokens == 123, "the command line wins over the file"
    assert m.max_message_bytes == 64 << 10, "the file's value is used"
    assert [l.index for l in m.layers] == [0, 1]


def test_config_file_error_names_file_and_line(tmp_path):
    conf = tmp_path / "bad.conf"
    conf.write_text("threads = 2\n\nmax-delay-us = soon\n")
    p = moed("--config", conf)
    assert p.returncode == 2
    assert f"{conf}:3" in p.stderr and "soon" in p.stderr
    conf.write_text("no-such-key = 1\n")
    p = moed("--config", conf)
    assert p.returncode == 2 and "no-such-key" in p.stderr and f"{conf}:1" in p.stderr


def test_config_fifo_fails_at_once(tmp_path):
    """A FIFO with no writer blocked the start forever: now refused without waiting."""
    fifo = tmp_path / "moed.conf"
    os.mkfifo(fifo)
    p = moed("--config", fifo, timeout=10)
    assert p.returncode == 2 and "FIFO" in p.stderr and str(fifo) in p.stderr, p.stderr


def test_config_file_too_big(tmp_path):
    conf = tmp_path / "big.conf"
    conf.write_text("# padding\n" * 200000)  # 2 MB of comments
    p = moed("--config", conf)
    assert p.returncode == 2 and "1024 KiB" in p.stderr and str(conf) in p.stderr, p.stderr


def test_config_quoted_value_keeps_hash(daemon, tmp_path):
    """`key = "a # b"` keeps the # (it was cut there): the log file name proves it."""
    log = tmp_path / "a # b.log"
    conf = tmp_path / "moed.conf"
    conf.write_text(f'synthetic = {DEFAULT_SPEC}  # the demo model\nthreads = 1\n'
                    f'log-file = "{log}"   # quoted: the # inside is part of the name\n')
    d = daemon("--config", conf)
    assert d.proc.poll() is None
    assert 'msg="ready"' in log.read_text()


def test_long_layer_list_is_fast(tmp_path):
    """--layers 50000-100000,0-49999 took over 20 s of CPU (a quadratic sort); now a bounded list
    is expanded in linear time and checked against the model at once. The CPU time moed used is
    measured, not the wall time, which other work on the machine would stretch."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = moed("--listen", "127.0.0.1:0", "--synthetic", DEFAULT_SPEC, "--layers", "50000-65535,0-49999",
             timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert p.returncode == 1 and "--layers names layer 2" in p.stderr, p.stderr
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert cpu < 5, f"{cpu:.1f} s of CPU"


def test_busy_port_exits_1(daemon):
    d = daemon("--synthetic", "layers=1,d=16,ff=16,experts=2,topk=1", "--threads", "1")
    p = moed("--listen", d.address, "--synthetic", "layers=1,d=16,ff=16,experts=2,topk=1")
    assert p.returncode == 1
    assert d.address in p.stderr and "--listen" in p.stderr


def test_missing_model_dir_exits_1(tmp_path):
    p = moed("--listen", "127.0.0.1:0", "--model", tmp_path / "nothing-here")
    assert p.returncode == 1
    assert "nothing-here" in p.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU may be present")
def test_cuda_backend_without_gpu_exits_1():
    p = moed("--listen", "127.0.0.1:0", "--synthetic", "layers=1,d=16,ff=16,experts=2,topk=1",
             "--backend", "cuda")
    assert p.returncode == 1
    assert "cuda" in p.stderr.lower() and "--backend cpu" in p.stderr


def test_expert_parallel_on_cpu_exits_1():
    """--expert-parallel splits layers over GPUs: the CPU backend (one device, computing from host
    memory) refuses it at start, naming the flag and what to do, rather than ignoring it."""
    p = moed("--listen", "127.0.0.1:0", "--synthetic", "layers=1,d=16,ff=16,experts=2,topk=1",
             "--backend", "cpu", "--expert-parallel")
    assert p.returncode == 1
    assert "--expert-parallel" in p.stderr and "--backend cuda" in p.stderr, p.stderr


def test_log_lines_are_structured(shared_daemon):
    lines = [l for l in shared_daemon.log().splitlines() if l.strip()]
    assert lines
    for l in lines:
        assert re.match(r'ts=\S+ level=(debug|info|warn|error) msg="', l), l
    assert any('msg="ready"' in l and shared_daemon.address in l for l in lines)


# ---- moectl -----------------------------------------------------------------------------------

def test_moectl_health_and_info(shared_daemon):
    p = moectl(shared_daemon, "health")
    assert p.returncode == 0 and p.stdout.strip() == "SERVING", p
    p = moectl(shared_daemon, "info")
    assert p.returncode == 0, p.stderr
    assert "backend   cpu" in p.stdout
    rows = [l.split() for l in p.stdout.splitlines() if re.match(r"\s+\d+\s+64\s+96\s+8\s+2\s", l)]
    assert [r[0] for r in rows] == ["0", "1"], p.stdout


def test_moectl_health_without_server_exits_1():
    with refused_address() as target:
        p = subprocess.run([str(MOECTL), "--target", target, "--timeout", "30", "health"],
                           capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert "UNAVAILABLE" in p.stderr


def forward_case(tmp_path, rng, dtype, T=6):
    x, x64 = O.hidden(rng, T, SPEC.d, dtype)
    path = tmp_path / f"x-{dtype}.npy"
    np.save(path, x)  # bf16 from ml_dtypes saves as '<V2'; bf16u16 as '<u2'
    return path, x64


def load_output(path):
    y = np.load(path)
    return O.from_bf16_bits(y).astype(np.float64) if y.dtype == np.uint16 else y.astype(np.float64)


@pytest.mark.parametrize("dtype", ("f32", "f16", "bf16", "bf16u16"))
def test_moectl_forward_with_client_routing(shared_daemon, tmp_path, dtype):
    rng = np.random.default_rng(70)
    xp, x64 = forward_case(tmp_path, rng, dtype)
    ids = np.array([[0, 3], [7, -1], [2, 2], [5, 1], [-1, -1], [4, 6]], np.int64)  # int64 is accepted
    gw = np.array([[.5, .5], [1, 0], [.25, .5], [.9, .1], [0, 0], [.3, .7]], np.float32)
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "w.npy", gw)
    out = tmp_path / "y.npy"
    extra = ["--dtype", "bf16"] if dtype == "bf16u16" else []
    p = moectl(shared_daemon, "forward", "--layer", "1", "--hidden", xp, "--ids", tmp_path / "ids.npy",
               "--weights", tmp_path / "w.npy", "--out", out, "--request-id", "cli-1", *extra)
    assert p.returncode == 0, p.stderr
    assert f"wrote {out}: [6, 64]" in p.stdout
    y = np.load(out)
    assert y.dtype == {"f32": np.float32, "f16": np.float16}.get(dtype, np.uint16)
    ref = O.forward(x64, SPEC.layer(1), O.choice_route(ids, gw), SPEC.act)
    assert O.rel_err(load_output(out), ref) <= O.TOL["bf16" if dtype.startswith("bf16") else dtype]


@pytest.mark.parametrize("args,strategy,kw", [
    (["--strategy", "sigmoid", "--threshold", "0.3"], "sigmoid", {"threshold": 0.3}),
    (["--strategy", "pioneer", "--top-k", "3", "--renormalize", "off"], "pioneer", {"top_k": 3, "renorm": False}),
    ([], "model", {}),
])
def test_moectl_forward_with_logits(shared_daemon, tmp_path, args, strategy, kw):
    rng = np.random.default_rng(71)
    xp, x64 = forward_case(tmp_path, rng, "f32", T=5)
    logits = (2 * rng.standard_normal((5, 8))).astype(np.float32)
    np.save(tmp_path / "l.npy", logits)
    p = moectl(shared_daemon, "forward", "--layer", "0", "--hidden", xp, "--logits", tmp_path / "l.npy",
               *args, "--out", tmp_path / "y.npy")
    assert p.returncode == 0, p.stderr
    ref = O.forward(x64, SPEC.layer(0), O.gate(logits, strategy, SPEC, **kw), SPEC.act)
    assert O.rel_err(load_output(tmp_path / "y.npy"), ref) <= O.TOL["f32"]


def test_moectl_forward_server_router_and_batch_gating(shared_daemon, tmp_path):
    rng = np.random.default_rng(72)
    xp, x64 = forward_case(tmp_path, rng, "f32", T=4)
    w = SPEC.layer(0)
    p = moectl(shared_daemon, "forward", "--layer", "0", "--hidden", xp, "--server-router",
               "--strategy", "topk", "--top-k", "3", "--out", tmp_path / "y.npy")
    assert p.returncode == 0, p.stderr
    ref = O.forward(x64, w, O.gate(O.router_logits(x64, w), "topk", SPEC, top_k=3), SPEC.act)
    assert O.rel_err(load_output(tmp_path / "y.npy"), ref) <= O.TOL["f32"]

    logits = (2 * rng.standard_normal((4, 8))).astype(np.float32)
    np.save(tmp_path / "l.npy", logits)
    p = moectl(shared_daemon, "forward", "--layer", "0", "--hidden", xp, "--logits", tmp_path / "l.npy",
               "--batch-gating", "3", "--out", tmp_path / "y.npy")
    assert p.returncode == 0, p.stderr
    S, route = O.batch_gate(logits, 3)
    assert f"expert set: {' '.join(map(str, S))}" in p.stdout
    assert O.rel_err(load_output(tmp_path / "y.npy"), O.forward(x64, w, route, SPEC.act)) <= O.TOL["f32"]


def test_moectl_exit_codes(shared_daemon, tmp_path):
    xp, _ = forward_case(tmp_path, np.random.default_rng(73), "f32", T=2)
    np.save(tmp_path / "l.npy", np.zeros((2, 8), np.float32))
    np.save(tmp_path / "l7.npy", np.zeros((2, 7), np.float32))
    fwd = ["forward", "--hidden", xp, "--out", tmp_path / "y.npy"]
    # the call fails: 1, with the status and the server's message
    p = moectl(shared_daemon, *fwd, "--layer", "9", "--logits", tmp_path / "l.npy")
    assert p.returncode == 1 and "NOT_FOUND" in p.stderr and "layer 9" in p.stderr, p
    p = moectl(shared_daemon, *fwd, "--layer", "0", "--logits", tmp_path / "l7.npy")
    assert p.returncode == 1 and "INVALID_ARGUMENT" in p.stderr and "[2, 7]" in p.stderr, p
    # bad usage or input: 2
    for args, word in ((["--layer", "0"], "routing"),
                       (["--layer", "0", "--logits", tmp_path / "missing.npy"], "missing.npy"),
                       (["--layer", "x", "--logits", tmp_path / "l.npy"], "--layer"),
                       (["--layer", "0", "--logits", tmp_path / "l.npy", "--strategy", "best"], "best"),
                       (["--layer", "0", "--ids", tmp_path / "l.npy"], "--weights")):
        p = moectl(shared_daemon, *fwd, *args)
        assert p.returncode == 2 and word in p.stderr, (args, p)
    p = moectl(None, "frobnicate")
    assert p.returncode == 2 and "frobnicate" in p.stderr
    for args in (["--help"], ["forward", "--help"]):
        p = moectl(None, *args)
        assert p.returncode == 0 and "usage: moectl" in p.stdout


MOECTL_USAGE = [
    (["--timeout", "0", "health"], "--timeout 0: give seconds > 0"),
    (["--timeout", "soon", "health"], "--timeout soon"),
    (["--timeout", "health"], "--timeout health: give seconds > 0"),  # a value may be any word
    (["health", "--timeout"], "--timeout needs a value"),
    (["forward", "--layer", "-1"], "--layer -1: give a layer index >= 0"),
    (["forward", "--top-k", "x"], "--top-k x: give a count >= 0"),
    (["forward", "--renormalize", "maybe"], "--renormalize maybe: use on or off"),
    (["forward", "--threshold", "nan"], "--threshold nan"),
    (["forward", "--batch-gating", "-2"], "--batch-gating -2"),
    (["forward", "--strategy", "best"], "--strategy best: use model, topk"),
    (["forward", "--server-router=1"], "--server-router takes no value"),
    (["health", "--layer", "0"], "--layer belongs to 'forward', not 'health'"),
    (["info", "--service", "moed"], "--service belongs to 'health', not 'info'"),
    (["health", "--bogus"], "unknown option --bogus"),
    (["health", "-v"], "unknown option -v"),
    (["--t", "x", "health"], "ambiguous option --t"),
    (["health", "extra"], "unexpected argument 'extra'"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    (["--token", "a", "--token-file", "/dev/null", "health"], "--token or --token-file, not both"),
    (["--token-file", "/nonexistent/token", "health"], "--token-file /nonexistent/token: cannot open"),
    (["--token-file", "/dev/null", "health"], "--token-file /dev/null is not a regular file"),
    (["--tls-key", "client.key", "health"], "--tls-key needs --tls-cert"),
]


@pytest.mark.parametrize("args,says", MOECTL_USAGE, ids=[" ".join(a) for a, _ in MOECTL_USAGE])
def test_moectl_usage_errors_exit_2_naming_the_flag(args, says):
    p = moectl(None, *args)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert says in p.stderr and "(moectl --help, or moectl COMMAND --help)" in p.stderr, p.stderr
    assert p.stdout == ""


def test_moectl_without_a_command_prints_its_usage_and_exits_2():
    p = moectl(None)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("usage: moectl") and "--target ADDR" in p.stderr


def test_moectl_help_comes_from_the_option_table():
    """Each command's help lists its own options (with the defaults the table holds) and no other
    command's; every option listed is one moectl takes."""
    main = moectl(None, "--help").stdout
    fwd = moectl(None, "forward", "--help").stdout
    health = moectl(None, "health", "--help").stdout
    assert "(default 127.0.0.1:50051)" in main and "--tls-ca FILE" in main and "--layer" not in main
    assert "--layer N" in fwd and "--service" not in fwd and "--target" not in fwd
    assert "--service NAME" in health and "--layer" not in health
    for text, command in ((main, []), (fwd, ["forward"]), (health, ["health"])):
        for flag in set(re.findall(r"^  (--[a-z-]+)", text, re.M)):
            p = moectl(None, *command, flag)
            assert "unknown option" not in p.stderr, (flag, p.stderr)


def test_moectl_token_file(daemon, tmp_path):
    """--token-file sends the file's first line as the bearer token (an empty one, or one with a
    space, is refused before any call)."""
    (tmp_path / "empty").write_text("\n\ntoken-on-line-3\n")
    p = moectl(None, "--token-file", tmp_path / "empty", "health")
    assert p.returncode == 2 and "its first line is empty" in p.stderr, p.stderr
    (tmp_path / "spaced").write_text("two words\n")
    p = moectl(None, "--token-file", tmp_path / "spaced", "health")
    assert p.returncode == 2 and "bearer_token holds a space" in p.stderr, p.stderr
    (tmp_path / "token").write_text("s3cret-token\n")
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--auth-token-file", tmp_path / "token")
    assert moectl(d, "info").returncode == 1
    p = moectl(d, "--token-file", tmp_path / "token", "info")
    assert p.returncode == 0 and "backend   cpu" in p.stdout, p.stderr
    (tmp_path / "wrong").write_text("  other-token  \n")
    p = moectl(d, "--token-file", tmp_path / "wrong", "info")
    assert p.returncode == 1 and "UNAUTHENTICATED" in p.stderr


def test_moectl_over_a_unix_socket(tmp_path):
    """moed --listen unix:PATH, moectl --target unix:PATH: the same calls as over TCP."""
    sock = tmp_path / "moed.sock"
    log = open(tmp_path / "moed.log", "wb")
    proc = subprocess.Popen([str(MOED_BIN), "--listen", f"unix:{sock}", "--synthetic", DEFAULT_SPEC,
                             "--threads", "1"], stderr=log)
    target = ["--target", f"unix:{sock}", "--timeout", "30"]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            p = subprocess.run([str(MOECTL), *target, "health"], capture_output=True, text=True)
            if p.returncode == 0:
                break
            time.sleep(0.05)
        assert p.returncode == 0 and p.stdout == "SERVING\n", p.stderr
        p = subprocess.run([str(MOECTL), *target, "info"], capture_output=True, text=True)
        assert p.returncode == 0 and "backend   cpu" in p.stdout, p.stderr
        assert sock.is_socket()
    finally:
        proc.terminate()
        code = proc.wait(30)
        log.close()
    text = (tmp_path / "moed.log").read_text()
    assert code == 0, text
    assert f"addr=unix:{sock} " in text, text  # the socket's path, not gRPC's port number for it
