"""bench/kernels/report.py, the GPU benchmark's table and targets, checked here without a GPU on
JSON made to the formats of moe-bench, torch_ref.py and sonic_ref.py: rows of a --shape layer join
the references whichever way moe-bench names them, the model's name labels them, the ratios and the
kernel targets come out of the figures (graph-replayed rows speaking for small T), a peer that did
not run leaves its targets unmet-but-unjudged; and run-on-gpu.sh runs the layers torch_ref.py names.
"""
import ast
import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT

BENCH = ROOT / "bench" / "kernels"
MM, COPY = 800.0, 4000.0  # the ceilings of the made-up run


def moe_row(shape, T, ms, kernel="auto", tflops=100.0, gbs=100.0):
    return {"shape": shape, "weights": "bf16", "T": T, "routing": "uniform", "kernel": kernel, "pairs": T,
            "active_experts": 8, "bm": 64, "ms": ms, "tflops": tflops, "gbs": gbs}


def ref_row(shape, T, ms, model=None, error=None):
    return {"shape": shape, "model": model, "T": T, "routing": "uniform", "ms": ms, "error": error}


@pytest.fixture
def report(tmp_path):
    """report(moe_rows, graph_rows, torch_rows, sonic_rows or None or "missing") -> (markdown, brief)"""

    def run(moe, graph, torch, sonic):
        def put(name, doc):
            (tmp_path / name).write_text(json.dumps(doc))
            return str(tmp_path / name)

        head = {"device": "Stand-in GPU", "sm": 90, "matmul_tflops": MM, "fp8_matmul_tflops": 0, "copy_gbs": COPY}
        args = [put("torch.json", {"device": "Stand-in GPU", "torch": "2.11", "runs": torch}),
                put("moe.json", dict(head, runs=moe)), put("graph.json", dict(head, runs=graph))]
        if sonic == "missing":
            args += ["--peer", str(tmp_path / "absent.json")]
        elif sonic is not None:
            args += ["--peer", put("sonic.json", {"device": "Stand-in GPU", "impl": "fixed-k", "runs": sonic})]
        out = tmp_path / "report.md"
        brief = subprocess.run([sys.executable, str(BENCH / "report.py"), *args, "--out", str(out), "--brief"],
                               capture_output=True, text=True, check=True).stdout
        return out.read_text(), brief

    return run


def target(md, name):
    """(met, figure) of the target line that starts with name."""
    line = next((l for l in md.splitlines() if l.startswith(f"| {name}")), None)
    assert line, f"no target '{name}' in\n{md}"
    return tuple(c.strip() for c in line.split("|")[2:4])


@pytest.mark.parametrize("moe_name", ["2880,2880,128,4"])
def test_a_model_layer_joins_its_references_and_is_judged(report, moe_name):
    md, brief = report(
        moe=[moe_row(moe_name, 4096, 2.0), moe_row(moe_name, 16384, 8.0, tflops=0.8 * MM),
             moe_row(moe_name, 8, 0.05, gbs=0.95 * COPY)],
        graph=[moe_row(moe_name, 8, 0.04, kernel="auto+g", gbs=0.85 * COPY)],
        torch=[ref_row("2880,2880,128,4", 4096, 2.4, "gpt-oss-120b"),
               ref_row("2880,2880,128,4", 16384, 9.0, "gpt-oss-120b")],
        sonic=[ref_row("2880,2880,128,4", 4096, 2.2), ref_row("2880,2880,128,4", 16384, 10.0)])
    row = next(l for l in md.splitlines() if l.startswith("| gpt-oss-120b | 4096 "))
    assert "| 2.400 | 1.20x | 2.200 | 1.10x |" in row, row
    assert target(md, "gpt-oss-120b T=4096: >= 1.15x torch") == ("yes", "1.20x")
    assert target(md, "gpt-oss-120b T=4096: >= 1.15x SonicMoE") == ("NO", "1.10x")
    assert target(md, "gpt-oss-120b T=16384: >= 1.15x SonicMoE") == ("yes", "1.25x")
    assert target(md, "gpt-oss-120b T=16384: >= 75% of the matmul ceiling") == ("yes", "80%")
    # the graph-replayed run (85%) speaks for T = 8, not the plain launch (95%)
    assert target(md, "gpt-oss-120b T=8: weights at >= 90% of copy") == ("NO", "85%")
    assert md.count("T=8: weights") == 1
    assert target(md, "gpt-oss-120b T=16384: >= 1.15x torch") == ("NO", "1.12x")
    assert "Targets met: 3 of 6." in md and "Targets met: 3 of 6." in brief
    assert re.search(r"gpt-oss-120b\s+4096 .* torch\s+2\.400\s+1\.20x sonic\s+2\.200\s+1\.10x", brief), brief


def test_without_a_peer_the_table_is_torch_alone(report):
    md, _ = report(moe=[moe_row("mixtral", 4096, 5.0)], graph=[], torch=[ref_row("mixtral", 4096, 5.5)],
                   sonic=None)
    assert "SonicMoE" not in md
    assert target(md, "mixtral T=4096: >= 1.15x torch") == ("NO", "1.10x")


@pytest.mark.parametrize("sonic", ["missing", [ref_row("mixtral", 4096, None, error="RuntimeError: no sm_90a")]])
def test_a_peer_that_did_not_run_is_not_judged_met(report, sonic):
    md, _ = report(moe=[moe_row("mixtral", 4096, 5.0)], graph=[], torch=[ref_row("mixtral", 4096, 6.0)],
                   sonic=sonic)
    met, figure = target(md, "mixtral T=4096: >= 1.15x SonicMoE")
    assert met == "n/a" and "SonicMoE failed" in figure, figure
    assert "Targets met: 1 of 2." in md


def test_ab_takes_medians_of_each_build_and_names_rows_one_side_lacks(tmp_path):
    """--ab: a change's runs against the build before it's, taken in turn: per row the median of
    each side (an outlier run moves neither), base over new, the GEMMs' own ratios, the spreads; a
    row one side did not run is listed as such and left out of the summary."""
    def run(name, ms, up, down, extra=()):
        rows = [dict(moe_row("mixtral", 4096, ms), stages_ms={"up": up, "down": down}), *extra]
        (tmp_path / name).write_text(json.dumps({"device": "Stand-in GPU", "sm": 90, "matmul_tflops": MM,
                                                 "fp8_matmul_tflops": 0, "copy_gbs": COPY, "runs": rows}))
        return str(tmp_path / name)

    gone = moe_row("qwen3-30b-a3b", 16384, 3.0)
    base = [run(f"b{i}.json", ms, 0.6, 0.4, [gone]) for i, ms in enumerate((1.0, 1.1, 0.5))]
    new = [run(f"n{i}.json", ms, 0.5, 0.4) for i, ms in enumerate((0.8, 0.85, 2.0))]
    out = tmp_path / "ab.md"
    brief = subprocess.run([sys.executable, str(BENCH / "report.py"), "--ab", *base, "--vs", *new, "--out", str(out),
                            "--brief"], capture_output=True, text=True, check=True).stdout
    md = out.read_text()
    row = next(l for l in md.splitlines() if l.startswith("| mixtral | bf16 | 4096 "))
    assert "| 1.000 | 0.850 | 1.176x | 1.200x | 1.000x | 60.0% | 141.2% |" in row, row
    assert "| qwen3-30b-a3b | bf16 | 16384 | uniform | auto | 3.000 | - | not in the new runs |" in md, md
    assert "Rows: 1; the new build 2% or more faster on 1, 2% or more slower on 0; geometric mean 1.176x." in md
    assert re.search(r"mixtral\s+bf16\s+4096 auto\s+1\.000\s+0\.850\s+1\.176x up\s+1\.200x down\s+1\.000x",
                     brief), brief
    lone = subprocess.run([sys.executable, str(BENCH / "report.py"), "--ab", *base], capture_output=True, text=True)
    assert lone.returncode == 2 and "--ab and --vs go together" in lone.stderr, lone.stderr


def test_run_on_gpu_benchmarks_the_models_torch_ref_names():
    tree = ast.parse((BENCH / "torch_ref.py").read_text())
    models = next(ast.literal_eval(n.value) for n in tree.body
                  if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "MODELS")
    script = (ROOT / "tools" / "gpu" / "run-on-gpu.sh").read_text()
    listed = re.search(r"^MODEL_SHAPES=\(([^)]*)\)", script, re.M).group(1).split()
    assert sorted(",".join(map(str, v)) for v in models.values()) == sorted(listed)
    assert len(models) >= 5
