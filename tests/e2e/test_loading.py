"""While moed loads its weights: gRPC answers from the start of the load, health says NOT_SERVING,
GetModel (and moectl info) says how far the load has come, the log says it every few seconds, every
other call is UNAVAILABLE saying so; once every layer is resident it serves.

The load is held half done by the test hook MOED_TEST_LOAD_GATE (loading.h): after each layer it
has counted, moed waits while the gate file exists. So the test sees the state after exactly one
layer on any machine, and lets the load go on by removing the file.
"""

import re
import subprocess
import time

import grpc
import pytest

from conftest import BUILD
from make_checkpoint import write_checkpoint
from moed import MoEClient, MoEError
from moed._proto.grpc.health.v1 import health_pb2, health_pb2_grpc
from moed._proto.moed.v1 import moed_pb2, moed_pb2_grpc
from prod import ANY_METRICS_PORT, get

MOECTL = BUILD / "client" / "c" / "moectl"
LAYERS, D, FF, EXPERTS = 4, 64, 128, 4
# a layer's bytes in the files, bf16: the router [E, d] and every expert's w1, w3 [ff, d], w2 [d, ff]
LAYER_BYTES = 2 * (EXPERTS * D + 3 * EXPERTS * FF * D)


def wait_for(what, probe, timeout=120):
    """probe() until it returns something true (a hang guard only: the state it waits for holds
    once reached, the load being held at the gate)."""
    deadline = time.monotonic() + timeout
    while not (got := probe()):
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.05)
    return got


@pytest.mark.parametrize("kind", ["checkpoint", "synthetic"])
def test_progress_while_the_weights_load(daemon, tmp_path, kind):
    gate = tmp_path / "gate"
    gate.touch()
    if kind == "checkpoint":
        model = tmp_path / "ckpt"
        write_checkpoint(model, layers=LAYERS, d=D, ff=FF, experts=EXPERTS)
        flags, what, phase, layer_bytes = ("--model", model), str(model), "reading", LAYER_BYTES
    else:
        what = f"layers={LAYERS},d={D},ff={FF},experts={EXPERTS},topk=2,dtype=bf16"
        # synthetic layers hold the router too (bf16), as the checkpoint's
        flags, phase, layer_bytes = ("--synthetic", what), "generating", LAYER_BYTES
    d = daemon(*flags, "--threads", "1", *ANY_METRICS_PORT, env={"MOED_TEST_LOAD_GATE": str(gate)},
               wait=False)
    addr = d.logged_address("grpc listening")
    channel = grpc.insecure_channel(addr)
    stub = moed_pb2_grpc.MoedStub(channel)

    def one_layer_done():
        info = stub.GetModel(moed_pb2.GetModelRequest(), timeout=10)
        return info if info.HasField("loading") and info.loading.layers_done == 1 else None

    info = wait_for("GetModel after one layer", one_layer_done)
    p = info.loading
    assert (p.phase, p.phase_number, p.phases) == (phase, 1, 2), p
    assert (p.layer, p.layers_done, p.layers_total) == (-1, 1, LAYERS), p
    assert (p.bytes_done, p.bytes_total) == (layer_bytes, LAYERS * layer_bytes), p
    assert p.percent == 25.0 and p.eta_seconds >= 0 and p.elapsed_seconds > 0, p
    assert info.model == what and info.backend == "cpu" and info.version and not info.layers
    assert not info.HasField("regions") and info.model_fingerprint == 0

    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert get(d.metrics_port, "/healthz") == (503, "NOT_SERVING\n")
    with pytest.raises(grpc.RpcError) as e:
        stub.Forward(moed_pb2.ForwardRequest(layer=0), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"moed is loading its weights ({phase} (1 of {LAYERS} layers done), 25.0%" in e.value.details()
    with pytest.raises(MoEError) as e:  # the Python client: as a daemon not yet up
        MoEClient(addr, timeout=10).info()
    assert e.value.code_name == "UNAVAILABLE" and "loading its weights" in str(e.value)

    out = subprocess.run([str(MOECTL), "--target", addr, "info"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"model     {what}\n" in out.stdout
    assert f"loading   {phase} (1 of {LAYERS} layers done): 25.0% of " in out.stdout, out.stdout
    assert "phase 1 of 2" in out.stdout and "layer  d_model" not in out.stdout
    out = subprocess.run([str(MOECTL), "--target", addr, "health"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and out.stdout == "NOT_SERVING\n"

    line = wait_for("'loading' log line", lambda: re.search(
        r'msg="loading" phase=(\S+) phase_no=1 phases=2 layer=-1 layers_done=1 layers=4 bytes=(\d+) '
        r'bytes_total=(\d+) percent=25\.0 rate_mib_s=\S+ eta_s=\d+ elapsed_s=\S+', d.log()))
    assert line.groups() == (phase, str(layer_bytes), str(LAYERS * layer_bytes))
    assert '"weights loaded"' not in d.log()

    gate.unlink()
    d.wait_serving()
    info = stub.GetModel(moed_pb2.GetModelRequest(), timeout=10)
    assert not info.HasField("loading") and len(info.layers) == LAYERS and info.model_fingerprint
    channel.close()
