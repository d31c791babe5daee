"""Checks of deploy/grafana/moed-dashboard.json and deploy/prometheus/moed-alerts.yaml (run by
tests/deploy-check.sh, which provides promtool from Debian's prometheus package).

- Every metric the dashboard's queries and the alert rules name exists in a live daemon's /metrics
  (the CPU backend's: every metric moed has is there, the GPUs' memory as the host's), with every
  label their selectors name (but instance and job, which Prometheus adds); a histogram's
  _bucket, _sum and _count are its series.
- The dashboard is one Grafana dashboard: unique panel ids, a grid place for each, every query on
  the $datasource variable, and each variable it uses defined; every query parses as PromQL
  (promtool reads them as recording rules, Grafana's $-variables replaced by values).
- The alert rules pass `promtool check rules`, and `promtool test rules` on
  tests/deploy/moed-alerts.test.yaml: series that must fire each alert, with its labels and
  annotations, and some that must not.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("MOED_BUILD_DIR", ROOT / "build"))
MOED = BUILD / "server" / "moed"
LOAD = BUILD / "client" / "c" / "moed-load"
DASHBOARD = ROOT / "deploy" / "grafana" / "moed-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "moed-alerts.yaml"
ALERT_TESTS = pathlib.Path(__file__).parent / "moed-alerts.test.yaml"
PROMTOOL = os.environ.get("PROMTOOL") or shutil.which("promtool")

SELECTOR = re.compile(r"\b(moed_[a-z0-9_]+)(\{([^}]*)\})?")
LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)")
# labels Prometheus gives every series of a scrape target (moed's /metrics has none of them)
TARGET_LABELS = {"instance", "job"}
# Grafana's variables as a query would reach Prometheus
VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$instance": ".*", "$layer": ".*"}


def dashboard():
    return json.loads(DASHBOARD.read_text())


def panels():
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def dashboard_queries():
    return [t["expr"] for p in panels() for t in p["targets"]]


def alert_rules():
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def selectors(expr):
    """(metric, {label names}) for every moed_ metric an expression names."""
    return [(m.group(1), {l.group(1) for l in LABEL.finditer(m.group(3) or "")} - TARGET_LABELS)
            for m in SELECTOR.finditer(expr)]


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory):
    """A CPU daemon's /metrics after a few Forward calls, some of them failing (so requests_total
    has series with method and code): {series name: [set of label names of each series]}."""
    assert MOED.exists() and LOAD.exists(), f"build first: {MOED}, {LOAD}"
    log = tmp_path_factory.mktemp("moed") / "moed.log"
    p = subprocess.Popen([str(MOED), "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                          "--synthetic", "layers=2,d=64,ff=96,experts=4,topk=2", "--threads", "1"],
                         stderr=open(log, "wb"))
    try:
        deadline = time.monotonic() + 60
        while '"ready"' not in log.read_text() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert '"ready"' in log.read_text(), log.read_text()
        grpc_addr = re.search(r'msg="ready" addr=(\S+)', log.read_text()).group(1)
        metrics = re.search(r'msg="metrics listening" addr=(\S+)', log.read_text()).group(1)
        load = subprocess.run([str(LOAD), "--target", grpc_addr, "--requests", "40", "--concurrency", "2",
                               "--bad-fraction", "0.25", "--layers", "0,1", "--no-progress"],
                              capture_output=True, text=True, timeout=120)
        assert load.returncode == 0, load.stderr
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=60) as r:
            text = r.read().decode()
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, log.read_text()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    series = {}
    for line in text.splitlines():
        m = re.match(r"(moed_[a-z0-9_]+)(\{(.*)\})? ", line)
        if m:
            series.setdefault(m.group(1), []).append(set(re.findall(r'([a-zA-Z_]\w*)="', m.group(3) or "")))
    return series


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_named_exists_with_its_labels(live_metrics, source):
    exprs = dashboard_queries() if source == "dashboard" else [r["expr"] for r in alert_rules()]
    named = [s for e in exprs for s in selectors(e)]
    assert named, f"the {source} names no moed metric"
    missing = sorted({m for m, _ in named if m not in live_metrics})
    assert not missing, f"the {source} names metrics a live daemon does not have: {missing}"
    for metric, labels in named:
        assert any(labels <= have for have in live_metrics[metric]), \
            f"the {source}'s {metric} selects on {sorted(labels)}; its series have {live_metrics[metric]}"


def test_dashboard_is_one_grafana_dashboard():
    d = dashboard()
    assert d["uid"] == "moed" and d["title"] and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), ids
    defined = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "instance", "layer"} <= defined
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert p["description"], f"panel {p['title']!r} says nothing of what it shows"
        for t in p["targets"]:
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval", "__range"}
            assert used <= defined, (p["title"], used - defined)
    titles = [p["title"] for p in panels()]
    for needed in ("Errors by status", "Forward latency", "Queue depth", "Merging",
                   "Expert load imbalance", "Device memory", "Tensor regions"):
        assert needed in titles, f"no panel {needed!r}: {titles}"


def promtool(*args, cwd=None):
    assert PROMTOOL and pathlib.Path(PROMTOOL).exists(), \
        "promtool is missing: tests/deploy-check.sh fetches it (Debian's prometheus package)"
    return subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_dashboard_queries_parse(tmp_path):
    exprs = dashboard_queries()
    for name, value in VARIABLES.items():
        exprs = [e.replace(name, value) for e in exprs]
    assert not [e for e in exprs if "$" in e], "a query uses a variable this test does not know"
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    f = tmp_path / "dashboard-queries.yaml"
    f.write_text(yaml.safe_dump(rules))
    p = promtool("check", "rules", f)
    assert p.returncode == 0, p.stdout + p.stderr


def test_alert_rules_check_and_fire():
    p = promtool("check", "rules", ALERTS)
    assert p.returncode == 0 and f"SUCCESS: {len(alert_rules())} rules found" in p.stdout, p.stdout + p.stderr
    for r in alert_rules():
        assert r["labels"]["severity"] in ("critical", "warning", "info") and r["annotations"]["summary"], r
    p = promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert p.returncode == 0, p.stdout + p.stderr
    tested = set(re.findall(r"alertname: (\w+)", ALERT_TESTS.read_text()))
    assert tested == {r["alert"] for r in alert_rules()}, "every alert needs a case in the test file"
