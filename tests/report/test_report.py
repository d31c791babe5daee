"""moed-load's --report page in a headless browser (Debian's chromium, which tests/run-all.sh's
report stage installs): runs of two T and two transports against a real moed, one of them with the
daemon's per-expert counters (--metrics), drawn on one page with --from. The page is opened with a
probe script put in front of it that waits for the load event and writes down, for every Chart.js
chart, its datasets, where each point was drawn and the canvas pixel there, and every heat-map
cell; chromium --dump-dom hands that back. The plots must hold the runs' numbers, each point must
lie in its chart's area with its series' colour painted under it, no script may have failed, and
the heat map's cells must be the tokens per expert the runs counted.
"""

import html
import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import e2e

LOAD = e2e.BUILD / "client" / "c" / "moed-load"
CHROMIUM = shutil.which("chromium")

PROBE = """<script>
window.__errors = [];
window.addEventListener('error', (e) => window.__errors.push(String(e.message)));
window.addEventListener('load', () => {
  const out = { errors: window.__errors, charts: [], cells: [], runs: [] };
  for (const c of Object.values(Chart.instances)) {
    const ctx = c.canvas.getContext('2d'), k = c.currentDevicePixelRatio;
    const pixel = (x, y) => Array.from(ctx.getImageData(Math.round(x * k), Math.round(y * k), 1, 1).data);
    out.charts.push({ title: c.options.plugins.title.text, type: c.config.type, area: c.chartArea,
      datasets: c.data.datasets.map((d, i) => ({ label: d.label, data: d.data, type: d.type || c.config.type,
        color: d.backgroundColor,
        points: c.getDatasetMeta(i).data.map((p) => {
          const y = p.base === undefined ? p.y : (p.y + p.base) / 2;  /* a bar: its middle */
          return { x: p.x, y, height: p.base === undefined ? null : p.base - p.y, pixel: pixel(p.x, y) };
        }) })) });
  }
  for (const r of document.querySelectorAll('rect.cell'))
    out.cells.push({ run: r.closest('.heatmap').dataset.run, layer: r.dataset.layer,
                     expert: +r.dataset.expert, tokens: +r.dataset.tokens, fill: r.getAttribute('fill') });
  for (const row of document.querySelectorAll('#runs tr')) out.runs.push(row.textContent);
  const pre = document.createElement('pre');
  pre.id = 'probe';
  pre.textContent = JSON.stringify(out);
  document.body.append(pre);
});
</script>"""


def render(page, tmp_path):
    """What the probe found on page (after chromium ran every script of it)."""
    assert CHROMIUM, "chromium is not installed: tests/run-all.sh report installs it"
    probed = tmp_path / ("probed-" + page.name)
    probed.write_text(page.read_text().replace("<head>", "<head>" + PROBE, 1))
    p = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,2000",
                        "--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HOME": str(tmp_path)})
    m = re.search(r'<pre id="probe">(.*?)</pre>', p.stdout, re.S)
    assert m, f"the probe wrote nothing (exit {p.returncode}):\n{p.stderr[-3000:]}"
    return json.loads(html.unescape(m.group(1)))


def rgb(color):
    return [int(color[i:i + 2], 16) for i in (1, 3, 5)]


def run_load(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    p = subprocess.run([str(LOAD), "--no-progress", "--json", str(out), *map(str, args)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return out, json.loads(out.read_text())


def expert_sums(run, source):
    out = {}
    for lv in run["levels"]:
        for layer, counts in lv["expert_tokens"].get(source, {}).items():
            row = out.setdefault(layer, [0] * len(counts))
            for e, v in enumerate(counts):
                row[e] += v
    return out


def test_sweep_page_renders_the_runs(daemon, tmp_path):
    """Two runs of a concurrency sweep on one page: T=4 inline with the daemon's counters read
    (--metrics), T=32 over shared memory with zipf routing."""
    d = daemon("--synthetic", e2e.DEFAULT_SPEC, "--threads", "2", "--metrics-listen", "127.0.0.1:0")
    common = ("--target", d.address, "--concurrency", "1:4:3", "--requests", 60, "--warmup", 0)
    a, ra = run_load(tmp_path, "t4-inline", *common, "--tokens", 4, "--layers", "0,1",
                     "--metrics", f"127.0.0.1:{d.metrics_port}")
    b, rb = run_load(tmp_path, "t32-shm", *common, "--tokens", 32, "--transport", "shm",
                     "--routing", "zipf:1.5")
    page = tmp_path / "sweep.html"
    p = subprocess.run([str(LOAD), "--report", str(page), "--from", f"{a},{b}"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = render(page, tmp_path)
    assert out["errors"] == []
    assert any("T=4, inline" in row and "pass" in row for row in out["runs"]), out["runs"]
    assert any("T=32, shm" in row for row in out["runs"]), out["runs"]
    charts = {c["title"]: c for c in out["charts"]}
    assert set(charts) == {"latency percentiles of ok replies (ms)", "throughput",
                           "T=4, inline, uniform, layers 0,1: where the mean latency goes",
                           "T=32, shm, zipf:1.5, layers 0: where the mean latency goes"}, set(charts)

    # the plotted numbers are the runs' numbers, one point per level
    lines = {ds["label"]: ds for c in out["charts"] for ds in c["datasets"]}
    for name, r in (("T=4, inline, uniform, layers 0,1", ra), ("T=32, shm, zipf:1.5, layers 0", rb)):
        assert [pt["y"] for pt in lines[f"{name} tokens/s"]["data"]] == [lv["tokens_per_s"] for lv in r["levels"]]
        assert [pt["x"] for pt in lines[f"{name} p99"]["data"]] == [1, 4]
        assert [pt["y"] for pt in lines[f"{name} p99"]["data"]] == [lv["latency_ms"]["p99"] for lv in r["levels"]]
        spans = charts[f"{name}: where the mean latency goes"]["datasets"]
        assert spans[0]["data"] == [lv["server"]["queue_ms"]["mean"] for lv in r["levels"]]
        assert spans[1]["data"] == [lv["server"]["compute_ms"]["mean"] for lv in r["levels"]]

    # drawn: every point inside its chart's area, and its series' colour painted where it is
    painted = drawn = 0
    for c in out["charts"]:
        a_ = c["area"]
        for ds in c["datasets"]:
            assert len(ds["points"]) == 2, (c["title"], ds["label"])
            for pt in ds["points"]:
                assert a_["left"] - 1 <= pt["x"] <= a_["right"] + 1 and a_["top"] - 1 <= pt["y"] <= a_["bottom"] + 1, \
                    (c["title"], ds["label"], pt, a_)
                if pt["height"] is not None and pt["height"] < 3:
                    continue  # a bar too thin to sample
                drawn += 1
                painted += pt["pixel"][3] == 255 and all(abs(u - v) <= 8 for u, v in zip(pt["pixel"], rgb(ds["color"])))
    assert drawn >= 20 and painted >= 0.6 * drawn, f"{painted} of {drawn} points show their series' colour"

    # the heat maps: a cell per (layer, expert), holding the tokens the run counted
    cells = {}
    for cell in out["cells"]:
        cells.setdefault(cell["run"], {}).setdefault(cell["layer"], {})[cell["expert"]] = cell
    for name, r, source in (("T=4, inline, uniform, layers 0,1", ra, "servers"),
                            ("T=32, shm, zipf:1.5, layers 0", rb, "sent")):
        sums = expert_sums(r, source)
        assert sorted(cells[name]) == sorted(sums)
        for layer, row in sums.items():
            assert [cells[name][layer][e]["tokens"] for e in range(len(row))] == row
    zipf = cells["T=32, shm, zipf:1.5, layers 0"]["0"]
    darkest = min(zipf.values(), key=lambda c: sum(map(int, re.findall(r"\d+", c["fill"]))))
    assert darkest["expert"] == 0 and darkest["tokens"] == max(c["tokens"] for c in zipf.values())


def test_open_loop_run_page(shared_daemon, tmp_path):
    """The page moed-load writes at the end of an open-loop sweep: its plots against the rate
    asked, its numbers."""
    page = tmp_path / "open.html"
    out, r = run_load(tmp_path, "open", "--target", shared_daemon.address, "--rate", "50:100:50",
                      "--requests", 30, "--warmup", 0, "--report", page)
    got = render(page, tmp_path)
    assert got["errors"] == []
    charts = {c["title"]: c for c in got["charts"]}
    lat = charts["latency percentiles of ok replies (ms)"]["datasets"]
    assert [pt["x"] for pt in lat[0]["data"]] == [50, 100]
    assert [pt["y"] for pt in lat[0]["data"]] == [lv["latency_ms"]["p50"] for lv in r["levels"]]
    assert any(ds["label"].endswith("requests/s") for ds in charts["throughput"]["datasets"])
    assert len(got["cells"]) == 8  # layer 0's experts, from the routes sent
