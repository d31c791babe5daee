"""Merges moe-bench's, torch_ref.py's and (--peer) sonic_ref.py's JSON from one GPU run into the
benchmark table (markdown), and checks the bf16 kernel targets (docs/kernels-notes.md, "The bf16
kernel push") against it: at T >= 4096 >= 1.15x torch._grouped_mm and SonicMoE on every layer; at
T = 16384 >= 75% of the matmul ceiling; at T <= 64 weights streamed at >= 90% of copy bandwidth. Small-T targets use the graph-replayed
pipeline (kernel "auto+g", what the backend runs for small batches) where the run has it. Rows of a
--shape d,ff,E,k layer are joined on d, ff, E, k and named by the model torch_ref.py gives them.

usage: python3 report.py torch.json moe.json [moe-graph.json ...] [--peer sonic.json] [--brief]
                         [--out report.md]
       python3 report.py --fp8 moe.json [moe-graph.json ...] [--out report.md]
       python3 report.py --sparse moe.json [moe-graph.json ...] [--peer torch-sp24.json] [--out sparse.md]
       python3 report.py --ab base1.json base2.json ... --vs new1.json new2.json ... [--out ab.md]
--brief prints one short line per row and target instead of the markdown (which --out still gets).

--ab: one change timed against the build before it, moe-bench run by each in turn on the same
GPU several times (run-on-gpu.sh's ab stage): per row the median of each side, their ratio, the
up and down GEMMs' medians' ratios, and each side's spread, since a single alternation reads 3-5%
noise on an H200 as an effect (docs/kernels-notes.md).

--fp8: moe-bench runs with bf16 and FP8 weights side by side (--weights bf16,fp8), as the FP8
table and the FP8 targets: at T <= 64 FP8 weight bytes at >= 85% of copy bandwidth; at
T >= 4096 >= 1.5x the bf16 path; at T = 16384 >= 60% of the FP8 matmul ceiling.
--sparse: the same for --weights bf16,sparse24, with torch's semi-structured sparse matmul
(torch_sparse_ref.py's JSON as --peer) beside it, and the 2:4 targets: >= 1.6x the bf16 path at
T <= 64, >= 1.4x at T >= 4096 (an aim for a wgmma.sp kernel; mma.sp is not expected to meet it).
"""
import argparse
import json
import re
import statistics


def weights_report(paths, kind, peer=None):
    """The table of one weight kind beside bf16 (kind "fp8" or "sp24", as moe-bench names them) and
    its targets, from moe-bench JSON files of one run; for sp24, torch_sparse_ref.py's JSON (peer)
    adds torch's semi-structured sparse matmul on the same layers and T."""
    runs = [json.load(open(f)) for f in paths]
    moe = dict(runs[0], runs=[r for m in runs for r in m["runs"]])
    mm, mm8, cp = moe["matmul_tflops"], moe.get("fp8_matmul_tflops", 0), moe["copy_gbs"]
    ceil, label = (mm8, "fp8 matmul") if kind == "fp8" else (mm, "bf16 matmul")
    ref = by_layer(json.load(open(peer))) if peer else {}
    by = {(r["shape"], r["T"], r["routing"], r["kernel"], r["weights"]): r for r in moe["runs"]}
    lines = [f"Device: {moe['device']} (sm_{moe['sm']}). Ceilings measured in this run: {mm:.0f} "
             f"TFLOP/s (cuBLAS bf16 8192³), {mm8:.0f} TFLOP/s (cuBLASLt FP8 e4m3 8192³), {cp:.0f} GB/s "
             "(device-to-device copy, read+write).", "",
             f"| shape | T | kernel | bf16 ms | {kind} ms | {kind} speedup | "
             + ("torch sparse ms | x torch sparse | " if kind == "sp24" else "")
             + f"{kind} TFLOP/s | % {label} | {kind} weights+act GB/s | % copy |",
             "|---|---|---|---|---|---|" + ("---|---|" if kind == "sp24" else "") + "---|---|---|---|"]
    checks = []
    for (shape, T, routing, kernel, w), r in by.items():
        if w != kind:
            continue
        b = by.get((shape, T, routing, kernel, "bf16"))
        sp = b["ms"] / r["ms"] if b else None
        torch_cols = (fmt(*ratio(ref.get((layer_key(shape), T, routing)), r)) + " | "
                      if kind == "sp24" else "")
        lines.append(f"| {shape} | {T} | {kernel} (bm {r['bm']}) | "
                     + (f"{b['ms']:.3f}" if b else "-") + f" | {r['ms']:.3f} | "
                     + (f"{sp:.2f}x" if sp else "-") + " | " + torch_cols
                     + f"{r['tflops']:.0f} | {100 * r['tflops'] / ceil if ceil else 0:.0f}% | "
                     f"{r['gbs']:.0f} | {100 * r['gbs'] / cp:.0f}% |")
        if routing != "uniform" or kernel not in ("auto", "auto+g"):
            continue
        graphed = (shape, T, routing, "auto+g", kind) in by
        small = T <= 64 and (kernel == "auto+g" or not graphed)
        if kind == "fp8":
            if small:
                checks.append((f"{shape} T={T}: fp8 weights at >= 85% of copy",
                               r["gbs"] >= 0.85 * cp, f"{100 * r['gbs'] / cp:.0f}%"))
            if T >= 4096 and sp is not None:
                checks.append((f"{shape} T={T}: fp8 >= 1.5x bf16", sp >= 1.5, f"{sp:.2f}x"))
            if T == 16384 and mm8:
                checks.append((f"{shape} T={T}: >= 60% of the FP8 matmul ceiling",
                               r["tflops"] >= 0.6 * mm8, f"{100 * r['tflops'] / mm8:.0f}%"))
        elif sp is not None and (small or T >= 4096):
            want = 1.6 if T <= 64 else 1.4
            checks.append((f"{shape} T={T}: sp24 >= {want}x bf16", sp >= want, f"{sp:.2f}x"))
    lines += ["", "| target | met | figure |", "|---|---|---|"]
    lines += [f"| {n} | {'yes' if ok else 'NO'} | {fig} |" for n, ok, fig in checks]
    return "\n".join(lines)


def layer_key(name):
    """moe-bench's name of a layer joined with torch_ref's: a --shape's d, ff, E, k (both print it
    as d,ff,E,k), else the named shape."""
    m = re.fullmatch(r"(\d+),(\d+),(\d+),(\d+)", name)
    return tuple(map(int, m.groups())) if m else name


def by_layer(ref):
    """{(layer, T, routing): row} of a torch_ref/sonic_ref JSON; {} where there is none."""
    return {(layer_key(r["shape"]), r["T"], r["routing"]): r for r in (ref or {}).get("runs", [])}


def ratio(peer, r):
    """(peer ms, peer ms / moed ms) where the peer timed the row, else (None, None)."""
    return (peer["ms"], peer["ms"] / r["ms"]) if peer and peer.get("ms") else (None, None)


def fmt(ms, sp):
    return f"{ms:.3f} | {sp:.2f}x" if ms else "- | -"


def targets(r, graphed, sp_t, sp_s, sonic_err, mm, cp):
    """The targets a moed row speaks for: [(target, met: True/False/None, figure)]."""
    name, T, out = r["label"], r["T"], []
    if r["routing"] != "uniform" or r["kernel"] not in ("auto", "auto+g"):
        return out
    if T <= 64 and (r["kernel"] == "auto+g" or not graphed):
        out.append((f"{name} T={T}: weights at >= 90% of copy", r["gbs"] >= 0.9 * cp,
                    f"{100 * r['gbs'] / cp:.0f}%"))
    if T >= 4096 and r["kernel"] == "auto":
        out.append((f"{name} T={T}: >= 1.15x torch", sp_t >= 1.15 if sp_t else None,
                    f"{sp_t:.2f}x" if sp_t else "torch not timed"))
        if sp_s or sonic_err:
            out.append((f"{name} T={T}: >= 1.15x SonicMoE", sp_s >= 1.15 if sp_s else None,
                        f"{sp_s:.2f}x" if sp_s else f"SonicMoE failed: {sonic_err[:80]}"))
    if T == 16384 and r["kernel"] == "auto":
        out.append((f"{name} T={T}: >= 75% of the matmul ceiling", r["tflops"] >= 0.75 * mm,
                    f"{100 * r['tflops'] / mm:.0f}%"))
    return out


def bf16_report(torch_path, moe_paths, peer_path):
    """(markdown, brief lines) of the bf16 table beside torch and the peer, and its targets."""
    ref = json.load(open(torch_path))
    peer = None
    if peer_path:
        try:
            peer = json.load(open(peer_path))
        except (OSError, ValueError) as e:  # the peer did not run (or not to its end): its rows say so
            peer = {"runs": [], "import_error": f"no results ({type(e).__name__}: {e})"}
    runs = [json.load(open(f)) for f in moe_paths]
    moe = dict(runs[0], runs=[r for m in runs for r in m["runs"]])
    tref, sref = by_layer(ref), by_layer(peer)
    models = {layer_key(r["shape"]): r["model"] for r in ref["runs"] if r.get("model")}
    mm, cp = moe["matmul_tflops"], moe["copy_gbs"]
    graphed = {(r["shape"], r["T"], r["routing"]) for r in moe["runs"] if r["kernel"] == "auto+g"}
    lines = [f"Device: {moe['device']} (sm_{moe['sm']}). Ceilings measured in this run: "
             f"{mm:.0f} TFLOP/s (cuBLAS bf16 8192³), {cp:.0f} GB/s (device-to-device copy, read+write). "
             f"Reference: torch {ref['torch']} torch._grouped_mm pipeline, same run."]
    if peer:
        stored = any(q.get("inference_mode") is False for q in peer["runs"])
        lines[0] += (f" Peer: SonicMoE {peer.get('impl', '')} on {peer.get('device', '?')}"
                     + (f", QuACK autotuned at T >= {peer['autotune_min_T']}" if "autotune_min_T" in peer else "")
                     + (", pre-activation stored" if stored else "")
                     + (f" (not importable: {peer['import_error']})" if peer.get("import_error") else "")
                     + "; x columns: the other's ms over moed's (moed faster > 1).")
    cols = "| layer | T | routing | kernel | moed ms | torch ms | x torch |" + (
        " SonicMoE ms | x SonicMoE |" if peer else "") + " TFLOP/s | % matmul | weights+act GB/s | % copy |"
    lines += ["", cols, "|" + "---|" * (cols.count("|") - 1)]
    brief, checks = [], []
    for r in moe["runs"]:
        key = (layer_key(r["shape"]), r["T"], r["routing"])
        t, s = tref.get(key), sref.get(key)
        r = dict(r, label=models.get(key[0], r["shape"]))
        t_ms, sp_t = ratio(t, r)
        s_ms, sp_s = ratio(s, r)
        mm_pct, cp_pct = 100 * r["tflops"] / mm, 100 * r["gbs"] / cp
        lines.append(f"| {r['label']} | {r['T']} | {r['routing']} | {r['kernel']} (bm {r['bm']}) | {r['ms']:.3f} | "
                     + fmt(t_ms, sp_t) + (" | " + fmt(s_ms, sp_s) if peer else "")
                     + f" | {r['tflops']:.0f} | {mm_pct:.0f}% | {r['gbs']:.0f} | {cp_pct:.0f}% |")
        brief.append(f"{r['label'][:18]:18s} {r['T']:6d} {r['routing'][:7]:7s} {r['kernel']:6s} {r['ms']:8.3f}"
                     + (f" torch {t_ms:8.3f} {sp_t:5.2f}x" if t_ms else " torch        -      -")
                     + ((f" sonic {s_ms:8.3f} {sp_s:5.2f}x" if s_ms else " sonic        -      -") if peer else "")
                     + f" mm {mm_pct:3.0f}% copy {cp_pct:3.0f}%")
        sonic_err = peer and ((s or {}).get("error") or peer.get("import_error") or "not timed")
        checks += targets(r, (r["shape"], r["T"], r["routing"]) in graphed, sp_t, sp_s, sonic_err, mm, cp)
    mark = {True: "yes", False: "NO", None: "n/a"}
    lines += ["", "| target | met | figure |", "|---|---|---|"]
    lines += [f"| {n} | {mark[ok]} | {fig} |" for n, ok, fig in checks]
    met = sum(ok is True for _, ok, _ in checks)
    lines += ["", f"Targets met: {met} of {len(checks)}."]
    brief += [f"{mark[ok]:3s} {n}: {fig}" for n, ok, fig in checks] + [lines[-1]]
    return "\n".join(lines), "\n".join(brief)


def ab_report(base_paths, new_paths):
    """(markdown, brief lines) of one build's moe-bench runs (new) against another's (base), row by
    row: medians over the runs, base over new (> 1: the change is faster), and spreads."""
    def rows(docs):
        out = {}
        for doc in docs:
            for r in doc["runs"]:
                out.setdefault((r["shape"], r["weights"], r["T"], r["routing"], r["kernel"]), []).append(r)
        return out

    def spread(rs):
        ms = [r["ms"] for r in rs]
        return (max(ms) - min(ms)) / statistics.median(ms)

    def stage(rs, name):
        return statistics.median([r.get("stages_ms", {}).get(name, 0.0) for r in rs])

    new_docs = [json.load(open(f)) for f in new_paths]
    base, new = rows(json.load(open(f)) for f in base_paths), rows(new_docs)
    head = new_docs[0]
    lines = [f"Device: {head['device']} (sm_{head['sm']}). {len(base_paths)} runs of the base build and "
             f"{len(new_paths)} of the new, taken in turn; medians; x: base ms over new ms (the new "
             "build faster > 1); spread: (max - min) / median of a side's runs.", "",
             "| shape | weights | T | routing | kernel | base ms | new ms | x | x up | x down | "
             "spread base | spread new |", "|" + "---|" * 12]
    brief, ratios = [], []
    for key in list(base) + [k for k in new if k not in base]:
        b, n = base.get(key), new.get(key)
        bm, nm = (statistics.median([r["ms"] for r in rs]) if rs else None for rs in (b, n))
        if not (b and n):
            cells = " | ".join(f"{v:.3f}" if v else "-" for v in (bm, nm))
            lines.append("| " + " | ".join(map(str, key)) + f" | {cells} | not in the "
                         f"{'new' if b else 'base'} runs | | | | |")
            continue
        x = bm / nm
        ratios.append(x)
        pairs = ((stage(b, s), stage(n, s)) for s in ("up", "down"))
        cells = [f"{sb / sn:.3f}x" if sb and sn else "-" for sb, sn in pairs]
        lines.append("| " + " | ".join(map(str, key)) + f" | {bm:.3f} | {nm:.3f} | {x:.3f}x | {cells[0]} | "
                     f"{cells[1]} | {100 * spread(b):.1f}% | {100 * spread(n):.1f}% |")
        brief.append(f"{key[0][:18]:18s} {key[1]:8s} {key[2]:6d} {key[4]:6s} {bm:8.3f} {nm:8.3f} {x:6.3f}x "
                     f"up {cells[0]:>7s} down {cells[1]:>7s}")
    if ratios:
        geo = statistics.geometric_mean(ratios)
        faster, slower = sum(x >= 1.02 for x in ratios), sum(x <= 1 / 1.02 for x in ratios)
        lines += ["", f"Rows: {len(ratios)}; the new build 2% or more faster on {faster}, 2% or more "
                  f"slower on {slower}; geometric mean {geo:.3f}x."]
        brief.append(lines[-1])
    return "\n".join(lines), "\n".join(brief)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fp8", action="store_true", help="the FP8-beside-bf16 table (no torch file)")
    ap.add_argument("--sparse", action="store_true",
                    help="the 2:4-sparse-beside-bf16 table (no torch file; --peer: torch_sparse_ref.py's)")
    ap.add_argument("torch")
    ap.add_argument("moe", nargs="*")
    ap.add_argument("--peer", help="sonic_ref.py's JSON of the same run: SonicMoE's columns and targets"
                    " (with --sparse: torch_sparse_ref.py's)")
    ap.add_argument("--ab", action="store_true",
                    help="the base build's moe-bench runs (the files) against the new build's (--vs)")
    ap.add_argument("--vs", nargs="+", help="with --ab: the new build's moe-bench runs")
    ap.add_argument("--brief", action="store_true", help="print one line per row and target")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.ab != bool(a.vs):
        ap.error("--ab and --vs go together: report.py --ab BASE.json ... --vs NEW.json ...")
    if a.ab:
        text, brief = ab_report([a.torch] + a.moe, a.vs)
    elif a.fp8 or a.sparse:
        text = brief = weights_report([a.torch] + a.moe, "fp8" if a.fp8 else "sp24", a.peer)
    else:
        text, brief = bf16_report(a.torch, a.moe, a.peer)
    print(brief if a.brief else text)
    if a.out:
        open(a.out, "w").write(text + "\n")


if __name__ == "__main__":
    main()
