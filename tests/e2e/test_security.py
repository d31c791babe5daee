"""Transport security and authentication, against real daemons and certificates made by openssl:

- TLS (--tls-cert/--tls-key): a client trusting the CA gets the same result as a plaintext daemon
  of the same model; a plaintext client cannot call; the health check answers over TLS.
- Mutual TLS (--tls-client-ca): a client certificate from the CA is required; none, or one from
  another CA, is refused.
- Bad TLS material stops the start with a message naming the file: a key of another certificate,
  a missing file, a file that is not PEM, an encrypted key; a lone --tls-cert, --tls-key or
  --tls-client-ca is a usage error (exit 2).
- The bearer token (--auth-token-file, or $MOED_AUTH_TOKEN): calls without it, or with a wrong
  one, get UNAUTHENTICATED and a message; with it they succeed; health stays open without it.
- A warning when listening beyond loopback with neither TLS nor a token.
- Every option also from a config file.
"""

import os
import subprocess

import grpc
import numpy as np
import pytest

import oracle as O
from conftest import DEFAULT_SPEC
from daemons import log_of
from moed import MoEClient, MoEError
from moed._proto.moed.v1 import moed_pb2
from prod import Certs, config_file, metrics_flags, scrape, wait_serving

SPEC = O.Spec.parse(DEFAULT_SPEC)
TOKEN = "t0ken-" + "9f" * 16


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return Certs(tmp_path_factory.mktemp("pki"))


def case(T=6, seed=3):
    rng = np.random.default_rng(seed)
    x, x64 = O.hidden(rng, T, SPEC.d, "bf16")
    ids = np.stack([rng.permutation(SPEC.experts)[:2] for _ in range(T)]).astype(np.int32)
    w = rng.uniform(0, 1, (T, 2)).astype(np.float32)
    return x, ids, w, O.forward(x64, SPEC.layer(0), O.choice_route(ids, w), SPEC.act)


def forward(client):
    x, ids, w, ref = case()
    # inline: the metrics below count the calls made here (auto would first ask GetModel for the
    # server's region limits)
    y = client.forward(0, x, expert_ids=ids, expert_weights=w, transport="inline")
    O.check(y, ref, "bf16", "over TLS")
    return np.asarray(y)


def start(daemon, *flags, env=None):
    return daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", *flags, env=env, wait=False)


def refused_start(daemon, *flags):
    """Starts a daemon that must refuse to start; returns (exit code, log)."""
    d = start(daemon, *flags)
    code = d.proc.wait(30)
    d.stop()
    return code, log_of(d)


# ---- TLS -------------------------------------------------------------------------------------

def test_tls_serves_the_same_results(daemon, certs):
    d = start(daemon, "--tls-cert", certs.path("server.crt"), "--tls-key", certs.path("server.key"))
    wait_serving(d, credentials=certs.credentials())
    plain = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1")
    with MoEClient(d.address, timeout=10, credentials=certs.credentials()) as c:
        assert c.health() == "SERVING"
        y = forward(c)
    with MoEClient(f"localhost:{d.port}", timeout=10, credentials=certs.credentials()) as c:
        assert np.array_equal(forward(c), y)  # the certificate names localhost too
    with plain.client(timeout=10) as c:
        assert np.array_equal(forward(c), y)
    with MoEClient(d.address, timeout=30) as c:  # plaintext against a TLS port
        with pytest.raises(MoEError) as err:
            c.health()
        assert err.value.code_name == "UNAVAILABLE"
    assert "tls=on client_certs=off" in d.log()


def test_mutual_tls_requires_a_client_certificate_from_the_ca(daemon, tmp_path, certs):
    cfg = config_file(tmp_path / "moed.conf", tls_cert=certs.path("server.crt"),
                      tls_key=certs.path("server.key"), tls_client_ca=certs.path("ca.crt"))
    d = start(daemon, "--config", cfg)
    wait_serving(d, credentials=certs.credentials("client"))
    with MoEClient(d.address, timeout=10, credentials=certs.credentials("client")) as c:
        forward(c)
    for who in (None, "stranger"):
        with MoEClient(d.address, timeout=30, credentials=certs.credentials(who)) as c:
            with pytest.raises(MoEError) as err:
                c.health()
            assert err.value.code_name == "UNAVAILABLE", who
    assert "tls=on client_certs=required" in d.log()


@pytest.mark.parametrize("flags, says", [
    (("--tls-cert", "server.crt", "--tls-key", "unrelated.key"),
     ["unrelated.key' does not match the certificate in --tls-cert", "server.crt"]),
    (("--tls-cert", "server.crt", "--tls-key", "client.key"), ["client.key' does not match"]),
    (("--tls-cert", "missing.crt", "--tls-key", "server.key"),
     ["--tls-cert: cannot open", "missing.crt: No such file or directory"]),
    (("--tls-cert", "server.key", "--tls-key", "server.key"), ["holds no PEM certificate"]),
    (("--tls-cert", "server.crt", "--tls-key", "server.crt"), ["holds no PEM private key"]),
    (("--tls-cert", "server.crt", "--tls-key", "encrypted.key"), ["is encrypted with a passphrase"]),
    (("--tls-cert", "server.crt", "--tls-key", "server.key", "--tls-client-ca", "server.key"),
     ["--tls-client-ca", "holds no PEM certificate"]),
], ids=["other-key", "client-key", "missing", "cert-not-pem", "key-not-pem", "encrypted",
        "ca-not-pem"])
def test_bad_tls_files_stop_the_start(daemon, certs, flags, says):
    if not (certs.dir / "encrypted.key").exists():
        subprocess.run(["openssl", "pkey", "-in", certs.path("server.key"), "-aes256", "-passout",
                        "pass:secret", "-out", certs.path("encrypted.key")], check=True)
    flags = [certs.path(f) if f.endswith((".crt", ".key")) else f for f in flags]
    code, log = refused_start(daemon, *flags)
    assert code == 1, log
    for s in says:
        assert s in log, log
    assert "start failed" in log and "step=security" in log
    assert "weights loaded" not in log  # refused before the slow steps


@pytest.mark.parametrize("flags, says", [
    (("--tls-cert", "server.crt"), "--tls-cert '{}' given without --tls-key"),
    (("--tls-key", "server.key"), "--tls-key '{}' given without --tls-cert"),
    (("--tls-client-ca", "ca.crt"), "--tls-client-ca '{}' given without --tls-cert"),
], ids=["cert-alone", "key-alone", "ca-alone"])
def test_tls_flags_come_in_pairs(certs, flags, says):
    from conftest import MOED_BIN
    path = certs.path(flags[1])
    p = subprocess.run([str(MOED_BIN), flags[0], path], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert says.format(path) in p.stderr


# ---- the bearer token --------------------------------------------------------------------------

def expect_unauthenticated(call, why):
    with pytest.raises(MoEError) as err:
        call()
    assert err.value.code_name == "UNAUTHENTICATED", err.value
    assert why in str(err.value), err.value


def token_checks(d, metrics_port=None):
    with d.client(timeout=10) as c:  # no token
        assert c.health() == "SERVING"  # health stays open (Kubernetes probes send no token)
        expect_unauthenticated(lambda: forward(c), "requires a bearer token")
        expect_unauthenticated(c.info, "authorization: Bearer <token>")
    with d.client(timeout=10, token="wrong") as c:
        expect_unauthenticated(lambda: forward(c), "was not accepted")
    with d.client(timeout=10, token=TOKEN) as c:
        forward(c)
        assert c.info().layers
    # A stream without the token is refused before it reads anything.
    with d.channel() as ch:
        stream = ch.stream_stream("/moed.v1.Moed/ForwardStream",
                                  request_serializer=moed_pb2.ForwardRequest.SerializeToString,
                                  response_deserializer=moed_pb2.ForwardResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(stream(iter([]), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    if metrics_port:
        e = scrape(metrics_port)
        assert e.get("moed_requests_total", method="Forward", code="UNAUTHENTICATED") == 2
        assert e.get("moed_requests_total", method="GetModel", code="UNAUTHENTICATED") == 1
        assert e.get("moed_requests_total", method="ForwardStream", code="UNAUTHENTICATED") == 1
        assert e.get("moed_requests_total", method="Forward", code="OK") == 1


def test_token_from_file(daemon, tmp_path):
    (tmp_path / "token").write_text(f"{TOKEN}\n")
    flags, port = metrics_flags()
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", "--auth-token-file",
               str(tmp_path / "token"), *flags)
    token_checks(d, port)
    assert "token=--auth-token-file" in d.log()
    assert TOKEN not in d.log()


def test_token_from_environment_and_config(daemon, tmp_path):
    d = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1", env={"MOED_AUTH_TOKEN": TOKEN})
    token_checks(d)
    assert "token=MOED_AUTH_TOKEN" in d.log()
    (tmp_path / "token").write_text(f"  {TOKEN}  \n")
    cfg = config_file(tmp_path / "moed.conf", auth_token_file=tmp_path / "token",
                      synthetic=DEFAULT_SPEC, threads=1)
    token_checks(daemon("--config", cfg))


def test_token_and_mutual_tls_together(daemon, tmp_path, certs):
    (tmp_path / "token").write_text(TOKEN)
    d = start(daemon, "--tls-cert", certs.path("server.crt"), "--tls-key", certs.path("server.key"),
              "--tls-client-ca", certs.path("ca.crt"), "--auth-token-file", str(tmp_path / "token"))
    creds = certs.credentials("client")
    wait_serving(d, credentials=creds)
    with MoEClient(d.address, timeout=10, credentials=creds) as c:
        expect_unauthenticated(lambda: forward(c), "requires a bearer token")
    with MoEClient(d.address, timeout=10, credentials=creds, token=TOKEN) as c:
        forward(c)


@pytest.mark.parametrize("content, says", [("", "is empty"), ("two words\n", "has a space")])
def test_bad_token_file_stops_the_start(daemon, tmp_path, content, says):
    (tmp_path / "token").write_text(content)
    code, log = refused_start(daemon, "--auth-token-file", str(tmp_path / "token"))
    assert code == 1 and says in log and "step=security" in log, log
    code, log = refused_start(daemon, "--auth-token-file", str(tmp_path / "absent"))
    assert code == 1 and f"cannot open {tmp_path / 'absent'}" in log, log


@pytest.mark.parametrize("flag", ["--auth-token-file", "--tls-cert"])
def test_fifo_for_a_secret_fails_at_once(daemon, tmp_path, certs, flag):
    """A FIFO as --auth-token-file hung the start (opening it waits for a writer), where
    --metrics-token-file refuses one. Now refused at once naming it, as every file moed reads at
    start is (refused_start's wait is the hang guard)."""
    fifo = tmp_path / "secret"
    os.mkfifo(fifo)
    more = ["--tls-key", certs.path("server.key")] if flag == "--tls-cert" else []
    code, log = refused_start(daemon, flag, str(fifo), *more)
    assert code == 1 and "FIFO" in log and str(fifo) in log and "step=security" in log, log


# ---- where it listens --------------------------------------------------------------------------

def test_warns_beyond_loopback_without_tls_or_token(daemon, tmp_path):
    d = start(daemon, "--listen", "0.0.0.0:0")  # its log's "ready" line names the port
    wait_serving(d)
    assert "listening beyond this host without TLS or a token" in d.log()
    (tmp_path / "token").write_text(TOKEN)
    d = start(daemon, "--listen", "0.0.0.0:0", "--auth-token-file", str(tmp_path / "token"))
    wait_serving(d)
    assert "without TLS or a token" not in d.log()
    quiet = daemon("--synthetic", DEFAULT_SPEC, "--threads", "1")  # loopback: no warning
    assert "without TLS or a token" not in quiet.log()
