"""Checks of deploy/ that need no container engine and no cluster (run by tests/deploy-check.sh).

- deploy/moed.conf is a configuration the real daemon starts with (its keys and values parse, its
  ports are the ones the other files use); its metrics endpoint is on loopback, on a port clear of
  dcgm-exporter's and the other common exporters' defaults, and nothing publishes that port.
- deploy/moed.service: systemd-analyze verify passes with no warning; Type=notify; the hardening
  options are set; the stop timeout outlasts the drain timeout.
- deploy/k8s/*.yaml parse; the objects have what the API server requires, and what moed needs: a
  GPU limit, native gRPC readiness/liveness/startup probes on the gRPC port, a non-root security
  context, a grace period longer than the drain, mounts that name volumes that exist, a Service
  whose selector and target ports match the pods, and a ConfigMap equal to deploy/moed.conf.
- deploy/k8s/fleet (a sharded fleet): a StatefulSet whose pods pick their expert shard from the
  pod-index label through the downward API, behind a headless Service; its script run for every
  ordinal gives shards that tile the model's experts with at least two replicas each, and started
  with the real daemon serves the shard it computed.
- deploy/Containerfile: the rules of a linter such as hadolint that matter here (pinned base
  images, named stages, apt hygiene, a non-root USER, a HEALTHCHECK, exec-form ENTRYPOINT/CMD,
  COPY sources that exist, pipefail where pipes are used), plus agreement with the config's ports.
"""

import configparser
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BUILD = pathlib.Path(os.environ.get("MOED_BUILD_DIR", ROOT / "build"))
MOED = BUILD / "server" / "moed"


def conf():
    """deploy/moed.conf as a dict (the daemon's own syntax: `key = value`, # comments)."""
    out = {}
    for line in (DEPLOY / "moed.conf").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            k, v = (s.strip() for s in line.split("=", 1))
            out[k] = v
    return out


def port_of(addr):
    return int(addr.rsplit(":", 1)[1])


GRPC_PORT = port_of(conf()["listen"])
METRICS_PORT = port_of(conf()["metrics-listen"])
METRICS_LOOPBACK = conf()["metrics-listen"].rsplit(":", 1)[0] in ("127.0.0.1", "localhost", "[::1]")
DRAIN_S = int(conf()["drain-timeout"])
# Default ports of exporters that share GPU hosts and pods with moed: node_exporter, dcgm-exporter,
# the OpenTelemetry Prometheus exporter, nvidia_gpu_exporter, process-exporter, cAdvisor, Triton's
# metrics, kubelet and kube-proxy.
EXPORTER_PORTS = {9100, 9400, 9464, 9835, 9256, 8080, 8002, 10250, 10249, 10255}


# ---- the configuration file ----------------------------------------------------------------------

@pytest.mark.skipif(not MOED.exists(), reason=f"{MOED} not built")
def test_config_starts_the_daemon(tmp_path):
    """Every key of the shipped config is accepted; only the addresses (and the model, to keep the
    check small) are overridden on the command line, which wins over the file."""
    log = tmp_path / "moed.log"
    # Port 0: the kernel picks free ports and the log says which (a port picked here and handed
    # over would be free only until another process took it).
    p = subprocess.Popen([str(MOED), "--config", str(DEPLOY / "moed.conf"),
                          "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                          "--synthetic", "layers=1,d=64,ff=96,experts=4,topk=2", "--threads", "1"],
                         stderr=open(log, "wb"))
    try:
        deadline = time.monotonic() + 60
        while '"ready"' not in log.read_text() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.poll() is None, log.read_text()
        assert '"ready"' in log.read_text(), f"not ready after 60 s:\n{log.read_text()}"
        metrics = re.search(r'msg="metrics listening" addr=(\S+)', log.read_text()).group(1)
        with urllib.request.urlopen(f"http://{metrics}/healthz", timeout=60) as r:
            assert (r.status, r.read()) == (200, b"SERVING\n")
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, log.read_text()
    finally:
        if p.poll() is None:  # a failed check: do not leave it running
            p.kill()
            p.wait()
    assert "metrics listening" in log.read_text()


def test_metrics_are_on_loopback_by_default():
    """The shipped files once bound /metrics to 0.0.0.0:9400, reachable without a token and on
    dcgm-exporter's port (docs/operations.md, "Metrics", says why 8464 on loopback)."""
    assert METRICS_LOOPBACK, conf()["metrics-listen"]
    assert METRICS_PORT not in EXPORTER_PORTS and not 9100 <= METRICS_PORT <= 9999, METRICS_PORT
    assert METRICS_PORT != GRPC_PORT


# ---- systemd -------------------------------------------------------------------------------------

def unit(name="moed.service"):
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # keys are case-sensitive
    cp.read(DEPLOY / name)
    return cp


def unit_env(name):
    """Every Environment= of a unit file (configparser keeps only the last)."""
    lines = (DEPLOY / name).read_text().splitlines()
    return dict(l.split("=", 1)[1].split("=", 1) for l in lines if l.startswith("Environment="))


def seconds(value):
    m = re.fullmatch(r"(\d+)(s|min)?", value)
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


def test_unit_is_a_hardened_notify_service():
    s = unit()["Service"]
    assert s["Type"] == "notify"
    argv = shlex.split(s["ExecStart"])
    assert argv[0] == "/usr/local/bin/moed" and argv[1:] == ["--config", "/etc/moed/moed.conf"]
    for key, want in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "DynamicUser": "yes",
                      "ProtectHome": "yes", "PrivateTmp": "yes", "DevicePolicy": "closed",
                      "CapabilityBoundingSet": "", "KillSignal": "SIGTERM",
                      "RestartPreventExitStatus": "2"}.items():
        assert s.get(key) == want, f"{key}={s.get(key)}"
    assert "PrivateDevices" not in s, "PrivateDevices would hide the GPUs"
    assert "MemoryDenyWriteExecute" not in s, "the CUDA driver JIT needs W+X memory"
    assert seconds(s["TimeoutStopSec"]) > DRAIN_S + 10
    assert unit()["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("name", ["moed.service", "nvidia-mps.service"])
def test_systemd_analyze_verify_is_clean(tmp_path, name):
    """systemd-analyze verify, with ExecStart pointing at a binary that exists here (the MPS
    daemon's too: this machine has no driver); any warning about the unit fails (verify itself
    exits 0 on unknown keys). moed's unit is verified with the MPS drop-in beside it."""
    binary = MOED if MOED.exists() else pathlib.Path("/bin/true")
    text = (DEPLOY / name).read_text().replace("/usr/local/bin/moed", str(binary))
    text = text.replace("/usr/bin/nvidia-cuda-mps-control", "/bin/true")
    u = tmp_path / name
    u.write_text(text)
    if name == "moed.service":
        (tmp_path / "moed.service.d").mkdir()
        (tmp_path / "moed.service.d" / "mps.conf").write_text((DEPLOY / "moed-mps.conf").read_text())
        (tmp_path / "nvidia-mps.service").write_text(
            (DEPLOY / "nvidia-mps.service").read_text().replace("/usr/bin/nvidia-cuda-mps-control",
                                                                "/bin/true"))
    p = subprocess.run(["systemd-analyze", "verify", str(u)], capture_output=True, text=True,
                       timeout=60)
    about_unit = [l for l in (p.stdout + p.stderr).splitlines() if name in l]
    assert p.returncode == 0 and not about_unit, p.stdout + p.stderr


MPS_PIPES = "/run/nvidia-mps"


def test_mps_unit_and_drop_in():
    """The MPS daemon's unit runs the control daemon in the foreground with the pipe directory it
    creates; moed's drop-in requires it, names the same directory, may write there, and runs moed
    as a fixed user (an MPS server serves one user's processes at a time)."""
    s = unit("nvidia-mps.service")["Service"]
    assert shlex.split(s["ExecStart"]) == ["/usr/bin/nvidia-cuda-mps-control", "-f"]
    assert unit_env("nvidia-mps.service")["CUDA_MPS_PIPE_DIRECTORY"] == MPS_PIPES
    assert "/run/" + s["RuntimeDirectory"] == MPS_PIPES
    assert unit("nvidia-mps.service")["Unit"]["Before"] == "moed.service"
    d = unit("moed-mps.conf")
    assert d["Unit"]["Requires"] == "nvidia-mps.service" == d["Unit"]["After"]
    assert unit_env("moed-mps.conf")["CUDA_MPS_PIPE_DIRECTORY"] == MPS_PIPES
    assert d["Service"]["ReadWritePaths"] == MPS_PIPES
    assert d["Service"]["DynamicUser"] == "no" and d["Service"]["User"]


# ---- Kubernetes --------------------------------------------------------------------------------

def manifests():
    docs = {}
    for f in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            if d.get("kind") == "Kustomization":
                continue
            for key in ("apiVersion", "kind", "metadata"):
                assert key in d, f"{f.name}: {key} missing"
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d["metadata"]["name"]), f.name
            docs[d["kind"]] = d
    return docs


def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    files = {f.name for f in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == files


def test_deployment():
    docs = manifests()
    dep = docs["Deployment"]
    assert dep["apiVersion"] == "apps/v1"
    spec, pod = dep["spec"], dep["spec"]["template"]["spec"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    # A loopback endpoint is not published, nor advertised for annotation-based scraping.
    assert ports == {"grpc": GRPC_PORT} if METRICS_LOOPBACK else {"grpc": GRPC_PORT, "metrics": METRICS_PORT}
    annotations = dep["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") != "true" or not METRICS_LOOPBACK
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == GRPC_PORT, probe
        assert set(c[probe]) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, probe
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod["terminationGracePeriodSeconds"] > DRAIN_S + 5  # + the preStop sleep
    volumes = {v["name"]: v for v in pod["volumes"]}
    for m in c["volumeMounts"]:
        assert m["name"] in volumes, m
    config_mount = next(m for m in c["volumeMounts"] if volumes[m["name"]].get("configMap"))
    cfg_arg = c["args"][c["args"].index("--config") + 1]
    assert cfg_arg == config_mount["mountPath"] + "/moed.conf"
    assert volumes[config_mount["name"]]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    env = {e["name"]: e for e in c.get("env", [])}
    assert env["MOED_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True


def test_service_matches_the_pods():
    docs = manifests()
    svc, dep = docs["Service"], docs["Deployment"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    names = {p["name"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in names, p


def test_configmap_is_the_config_file():
    cm = manifests()["ConfigMap"]
    assert cm["data"]["moed.conf"] == (DEPLOY / "moed.conf").read_text(), \
        "deploy/k8s/configmap.yaml differs from deploy/moed.conf: copy it over"


# ---- Kubernetes: the sharded fleet ---------------------------------------------------------------

FLEET = DEPLOY / "k8s" / "fleet"


def fleet():
    docs = {}
    for f in sorted(FLEET.glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            if d.get("kind") != "Kustomization":
                docs[d["kind"]] = d
    return docs


def test_fleet_kustomization_lists_every_manifest():
    k = yaml.safe_load((FLEET / "kustomization.yaml").read_text())
    assert set(k["resources"]) == {f.name for f in FLEET.glob("*.yaml")} - {"kustomization.yaml"}


def test_fleet_lets_link_callers_reach_nccl():
    """Links move tensors over NCCL, whose ports are ephemeral: the fleet's policy must keep gRPC
    open to the namespace and let labelled callers in on every TCP port, and the pods must name
    the interface NCCL uses."""
    docs = fleet()
    pol, sts = docs["NetworkPolicy"], docs["StatefulSet"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    grpc_rule, caller_rule = pol["spec"]["ingress"]
    assert grpc_rule["ports"] == [{"port": GRPC_PORT, "protocol": "TCP"}]
    assert grpc_rule["from"] == [{"podSelector": {}}]
    assert "ports" not in caller_rule, "NCCL's ports are ephemeral: the rule must allow them all"
    assert caller_rule["from"] == [{"podSelector": {"matchLabels": {"moed.io/caller": "true"}}}]
    _, env = fleet_env()
    assert env["NCCL_SOCKET_IFNAME"]["value"]


def fleet_env():
    c = fleet()["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    return c, {e["name"]: e for e in c["env"]}


def test_fleet_statefulset_behind_a_headless_service():
    docs = fleet()
    sts, svc = docs["StatefulSet"], docs["Service"]
    assert sts["apiVersion"] == "apps/v1" and svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    pod, labels = sts["spec"]["template"]["spec"], sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    c, env = fleet_env()
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == [p["name"] for p in c["ports"]] == ["grpc"]
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["MOED_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == GRPC_PORT, probe
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["terminationGracePeriodSeconds"] > DRAIN_S + 5
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert all(m["name"] in volumes for m in c["volumeMounts"])
    assert volumes["config"]["configMap"]["name"] == manifests()["ConfigMap"]["metadata"]["name"]
    # as many experts as the model moed-config serves, and two replicas of every shard at least
    spec = dict(kv.split("=") for kv in conf()["synthetic"].split(","))
    assert env["EXPERTS"]["value"] == spec["experts"]
    assert sts["spec"]["replicas"] >= 2 * int(env["SHARDS"]["value"])


def fleet_script(moed_path="/usr/local/bin/moed", extra=""):
    c, _ = fleet_env()
    assert c["command"] == ["/bin/sh", "-c"]
    (script,) = c["args"]
    assert "exec /usr/local/bin/moed --config /etc/moed/moed.conf --experts" in script
    return script.replace("/usr/local/bin/moed --config /etc/moed/moed.conf",
                          f"{moed_path} --config {DEPLOY / 'moed.conf'}{extra}")


def pod_env(ordinal):
    _, env = fleet_env()
    return {**os.environ, "POD_INDEX": str(ordinal), "SHARDS": env["SHARDS"]["value"],
            "EXPERTS": env["EXPERTS"]["value"]}


def test_fleet_shards_tile_the_experts():
    """Every ordinal's --experts, as its script computes them: shards that tile the experts, each
    held by the same number of pods (two or more)."""
    sts = fleet()["StatefulSet"]
    held = {}
    for i in range(sts["spec"]["replicas"]):
        p = subprocess.run(["/bin/sh", "-c", fleet_script("echo")], env=pod_env(i),
                           capture_output=True, text=True, timeout=10)
        assert p.returncode == 0, p.stderr
        first, last = map(int, p.stdout.split("--experts ")[1].split("-"))
        held.setdefault((first, last), []).append(i)
    experts = int(pod_env(0)["EXPERTS"])
    ranges = sorted(held)
    assert ranges[0][0] == 0 and ranges[-1][1] == experts - 1
    assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:])), ranges
    assert len({len(v) for v in held.values()}) == 1 and min(map(len, held.values())) >= 2, held


@pytest.mark.skipif(not MOED.exists(), reason=f"{MOED} not built")
def test_fleet_pod_serves_its_shard(tmp_path):
    log = tmp_path / "moed.log"
    script = fleet_script(str(MOED), " --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --threads 1")
    p = subprocess.Popen(["/bin/sh", "-c", script], env=pod_env(3), stderr=open(log, "wb"))
    deadline = time.monotonic() + 60
    while '"ready"' not in log.read_text() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.poll() is None and '"ready"' in log.read_text(), log.read_text()
    p.send_signal(signal.SIGTERM)  # the shell exec'd moed: the signal reaches it
    assert p.wait(60) == 0, log.read_text()
    assert 'experts="4-7 shared=off"' in log.read_text(), log.read_text()


# ---- the container file ------------------------------------------------------------------------

def instructions():
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Containerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages():
    """[(stage name, [(instruction, args)...])] from FROM to FROM."""
    out = []
    for ins, args in instructions():
        if ins == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args, re.I)
            out.append((m.group(2), [(ins, m.group(1))]))
        elif out:
            out[-1][1].append((ins, args))
    return out


def test_containerfile_rules():
    ins = instructions()
    args = dict(re.match(r"(\w+)=(\S+)", a).groups() for i, a in ins if i == "ARG")
    st = stages()
    assert len(st) >= 2, "a multi-stage build: tools stay out of the runtime image"
    names = []
    for name, body in st:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], body[0][1])
        assert ":" in image and not image.endswith(":latest"), f"pin the base image: {image}"
        assert name, "name every stage"
        names.append(name)
        assert image.startswith("nvidia/cuda:13.0"), image
    assert "-runtime-" in re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], st[-1][1][0][1])
    for i, a in ins:
        assert i != "ADD", "use COPY (ADD fetches URLs and unpacks archives)"
        assert "sudo " not in a
        if i == "RUN" and "apt-get install" in a:
            assert "-y" in a.split() and "--no-install-recommends" in a, a
            assert "rm -rf /var/lib/apt/lists" in a, "clean the apt lists in the same layer"
            assert "apt-get update" in a, "update in the same RUN as install"
        if i == "RUN" and "|" in a.replace("||", ""):
            shells = [x for x, y in ins[:ins.index((i, a))] if x == "SHELL"]
            assert shells, f"a pipe needs SHELL [..., \"-o\", \"pipefail\", ...]: {a[:60]}"
        if i == "COPY":
            m = re.match(r"--from=(\S+)\s", a)
            if m:
                assert m.group(1) in names[:-1] or m.group(1) in names, a
            else:
                for src in a.split()[:-1]:
                    assert (ROOT / src).exists(), f"COPY source {src} is not in the repository"
    final = dict((i, a) for i, a in st[-1][1])
    user = final.get("USER", "root").split(":")[0]
    assert user not in ("root", "0"), "the image must run as a non-root user"
    for key in ("ENTRYPOINT", "CMD"):
        assert final[key].startswith("["), f"{key} in exec (JSON) form"
    hc = final["HEALTHCHECK"]
    assert "CMD [" in hc and f"127.0.0.1:{GRPC_PORT}" in hc and "health" in hc
    assert set(final["EXPOSE"].split()) == ({str(GRPC_PORT)} if METRICS_LOOPBACK
                                            else {str(GRPC_PORT), str(METRICS_PORT)})
    assert "/etc/moed/moed.conf" in final["CMD"]
    ignore = (DEPLOY / "Containerfile.dockerignore").read_text()
    for _, body in st:
        for i, a in body:
            if i == "COPY" and not a.startswith("--from"):
                for src in a.split()[:-1]:
                    assert f"!{src.rstrip('/')}" in ignore.replace("/\n", "\n"), \
                        f"{src} is copied but excluded by Containerfile.dockerignore"


MPS = DEPLOY / "k8s" / "mps"


def test_mps_overlay():
    """deploy/k8s/mps: the base plus an MPS control daemon per GPU node, and moed's Deployment
    patched to join it: the host's IPC namespace (the doorbell's shared memory and MPS's), the
    pipe directory from the host under the same path and variable as the daemon's, and the
    daemon running as moed's user."""
    k = yaml.safe_load((MPS / "kustomization.yaml").read_text())
    assert k["resources"] == ["..", "daemonset.yaml"]
    assert [p["path"] for p in k["patches"]] == ["deployment-patch.yaml"]
    assert {f.name for f in MPS.glob("*.yaml")} == {"kustomization.yaml", "daemonset.yaml",
                                                    "deployment-patch.yaml"}
    ds = yaml.safe_load((MPS / "daemonset.yaml").read_text())
    patch = yaml.safe_load((MPS / "deployment-patch.yaml").read_text())
    base = manifests()["Deployment"]
    assert ds["kind"] == "DaemonSet" and patch["kind"] == "Deployment"
    assert patch["metadata"]["name"] == base["metadata"]["name"]
    for pod in (ds["spec"]["template"]["spec"], patch["spec"]["template"]["spec"]):
        assert pod["hostIPC"] is True
        c = pod["containers"][0]
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == MPS_PIPES
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == MPS_PIPES)
        vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert vol["hostPath"]["path"] == MPS_PIPES
    assert patch["spec"]["template"]["spec"]["containers"][0]["name"] == \
        base["spec"]["template"]["spec"]["containers"][0]["name"]
    ds_pod = ds["spec"]["template"]["spec"]
    assert ds_pod["containers"][0]["command"] == ["nvidia-cuda-mps-control", "-f"]
    assert ds_pod["securityContext"]["runAsUser"] == \
        base["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
