"""Figures in README.md and docs/*.md written from the commands that produce them.

    python experiments/docs.py          # make docs: rewrite every figure block
    python experiments/docs.py --check  # make docs-check: exit 1 naming each stale figure

A figure block in a markdown file is

    <!-- figure NAME -->
    ...generated text...
    <!-- /figure -->

and FIGURES maps NAME to the function that renders it. Predictions are computed afresh, so a
figure must equal what the code prints now (no tolerance). Timings are never re-measured here (a
benchmark takes minutes on a shared machine): their figures are rendered from the results file
their benchmark wrote (experiments/results/*.json), so the check is that the page shows what the
last run measured, and rerunning the benchmark is how a timing figure changes.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import difflib
import io
import json
import os
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
PAGES = [ROOT / "README.md", ROOT / "perfmodel_kernels" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- figure (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figure -->)", re.S)


def cli_json(*argv: str) -> dict:
    """`perfmodel ARGV --json`, in this process."""
    from perfmodel.cli.main import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main([*argv, "--json"])
    if rc:
        raise SystemExit(f"perfmodel {' '.join(argv)} exited {rc}")
    return json.loads(buf.getvalue())


def md_table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A markdown table; `align` is one letter per column (l or r), numbers right by default."""
    align = align or "".join("r" if isinstance(v, (int, float)) else "l" for v in rows[0])
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    body = ["| " + " | ".join(str(v) for v in line) + " |" for line in [headers] + rows]
    return "\n".join(body[:1] + [rule] + body[1:]) + "\n"


def ms(seconds: float) -> str:
    """Milliseconds to 2 decimals, never "-0.00"."""
    return f"{seconds * 1e3 + 0.0:.2f}".replace("-0.00", "0.00")


def results_file(name: str) -> Path:
    path = RESULTS / name
    if not path.exists():
        raise SystemExit(f"{path.relative_to(ROOT)} is missing: run the benchmark that writes it")
    return path


def result(name: str) -> dict:
    return json.loads(results_file(name).read_text())


# ---- the figures -----------------------------------------------------------------------------

def fig_predict() -> str:
    """`make predict` (TPU v7 megakernel) beside the GB200 lines (the recipe's layout: the generic
    multi-kernel engine, nothing fitted, and vLLM's kernels with the preset's fitted kernel
    overlap), with the reported values."""
    from perfmodel.fit.measurements import seed_measurements
    tpu = cli_json("predict", "--model", "kimi-k3", "--hardware", "tpu-v7", "--devices", "32", "--tp", "32",
                   "--ep", "8", "--engine", "megakernel", "--batch", "1,2,4,8")
    gpu = cli_json("predict", "--model", "kimi-k3", "--hardware", "gb200", "--devices", "16", "--tp", "16",
                   "--ep", "1", "--kv-cache", "fp8-kv", "--engine", "multikernel", "--batch", "1,2,4,8")
    vllm = cli_json("predict", *GB200_VLLM, "--batch", "1,2,4,8")
    reported = {(m.platform, m.batch): m.tokens_per_s for m in seed_measurements() if not m.spec_decode}
    tpu_key, gpu_key = (next(p for p, _ in reported if p.startswith(k)) for k in ("tpu", "gb200"))
    rows = [[t["batch"], f"{t['step_s'] * 1e3:.2f}", f"{t['tokens_per_s']:.1f}", f"{reported[tpu_key, t['batch']]:g}",
             f"{g['step_s'] * 1e3:.2f}", f"{g['tokens_per_s']:.1f}", f"{v['tokens_per_s']:.1f}",
             f"{reported[gpu_key, g['batch']]:g}"]
            for t, g, v in zip(tpu["results"], gpu["results"], vllm["results"])]
    return md_table(["batch", "TPU v7 megakernel step ms", "tok/s", "reported", "GB200 multi-kernel step ms",
                     "tok/s", "GB200 vLLM kernels tok/s", "reported"], rows, "rrrrrrrr")


def fig_gain() -> str:
    """`perfmodel predict --ep 8 --batch 1,8 --gain`: multi-kernel minus megakernel by cause."""
    out = cli_json("predict", "--ep", "8", "--batch", "1,8", "--gain")
    causes = [c for c in out["results"][0]["prefetch_gain"]["by_cause_s"] if c != "compute"]
    rows = []
    for r in out["results"]:
        g = r["prefetch_gain"]
        rows.append([r["batch"], f"{g['multikernel_step_s'] * 1e3:.2f}", f"{g['megakernel_step_s'] * 1e3:.2f}",
                     f"{g['gain_s'] * 1e3:.2f} ({g['speedup']:.2f}x)"]
                    + [ms(g["by_cause_s"][c]) for c in causes])
    return md_table(["batch", "multi-kernel", "megakernel", "gain"] + [c.replace("_", " ") for c in causes], rows,
                    "r" * (4 + len(causes)))


def fig_cli_speed() -> str:
    """experiments/bench_cli.py's last run."""
    b = result("bench_cli.json")
    r, t = b["results"], b["targets"]
    load = lambda k: f"{r[k]['load_before']:.1f}"
    rows = [["`python -c \"import numpy\"` (the baseline)", f"{r['import_numpy']['median_s']:.3f} s", "", load("import_numpy")],
            ["one `perfmodel predict` (Kimi K3, TPU v7, batch 1)", f"{r['predict']['median_s']:.3f} s "
             f"({t['predict_vs_numpy']['value']:.2f}x)", "2x", load("predict")],
            *([["one `perfmodel predict --serving-engine vllm` (Kimi K3, 16 GB200, batch 1)",
                f"{r['predict_serving']['median_s']:.3f} s ({t['predict_serving_vs_numpy']['value']:.2f}x)", "2x",
                load("predict_serving")]] if "predict_serving" in r else []),
            ["`perfmodel --help`", f"{r['help']['median_s']:.3f} s ({t['help_vs_numpy']['value']:.2f}x)", "1.5x",
             load("help")],
            ["10,000-configuration `perfmodel sweep --design ... --out rows.parquet`",
             f"{r['sweep_10k']['median_s']:.2f} s (CPU {r['sweep_10k']['cpu_median_s']:.2f} s)", "3 s",
             load("sweep_10k")]]
    if "api_predict" in b:  # the Python API in a fresh process, nothing called first
        api = b["api_predict"]
        rows.append(["`perfmodel.predict` (Kimi K3, TPU v7, batch 1) again in a fresh process "
                     f"(its first call: {api['first_median_s']:.2f} s)", f"{api['warm_median_s'] * 1e3:.2f} ms",
                     "1 ms", f"{api['load_before']:.1f}"])
    return (md_table(["fresh process, default flags", "median", "target", "load"], rows, "lrrr")
            + f"\n{b['machine']}, {b['date']}, medians of {r['predict']['runs']} runs.\n")


def fig_layer_time() -> str:
    """`perfmodel explain --ep 8 --layer L` at batch 1 for a KDA and an MLA layer of Kimi K3 on
    TPU v7: each layer's time by what its ops waited on, and the step beside its HBM floor."""
    rows = []
    for layer in (2, 4):
        ex = cli_json("explain", "--ep", "8", "--layer", str(layer))
        by = {}
        for op in ex["ops"]:
            by[op["waited_on"]] = by.get(op["waited_on"], 0.0) + op["end_s"] - op["start_s"]
        rows.append([layer, ex["kind"], f"{ex['layer_time_s'] * 1e6:.1f}"]
                    + [f"{by.get(w, 0.0) * 1e6:.1f}" for w in WAITS])
    pred = cli_json("predict", "--ep", "8", "--batch", "1")["results"][0]
    return (md_table(["layer", "kind", "layer us"] + [f"{WAITS[w]} us" for w in WAITS], rows, "rlr" + "r" * len(WAITS))
            + f"\nStep {ms(pred['step_s'])} ms at batch 1, of which the per-device HBM floor (bytes at peak bandwidth) is "
              f"{ms(pred['hbm_floor_s'])} ms.\n")


# what an op waited on (explain's `waited_on`) -> its column: ops bound by it
WAITS = {"compute unit (MXU / VPU / SMs)": "compute-bound ops", "DMA engine (HBM -> on-chip)": "weight / KV DMA-bound ops",
         "DMA engine (routed experts, after the router)": "expert DMA-bound ops",
         "links and remote copies (collective)": "collectives"}


def fig_model_speed() -> str:
    """experiments/bench_model.py's last run: the model's own speed in one process."""
    b = result("bench_model.json")
    fmt = lambda v: f"{v:.2f} s" if v >= 1 else f"{v * 1e3:.2f} ms"
    rows = [[r["what"], fmt(r["seconds"]), fmt(r["target_s"]) if r["target_s"] else "", r["detail"]]
            for r in b["results"].values()]
    return (md_table(["in one process", "median", "target", "detail"], rows, "lrrl")
            + f"\n{b['machine']}, {b['date']}, medians of {b['repeats']}, load average {b['load_before']:.1f} "
              f"before and {b['load_after']:.1f} after.\n")


def fig_dashboard_browser() -> str:
    """experiments/bench_dashboard_browser.py's last run: input to the last chart, page loads, the floor."""
    b = result("bench_dashboard_browser.json")
    ms = lambda v: f"{v * 1e3:,.0f} ms"  # noqa: E731
    lb, la = b["load_average_before"][0], b["load_average_after"][0]
    views = b["views"]
    changes = [[f"{v}, {r['changes']} input changes, to the last chart redrawn", ms(r["median_s"]), ms(r["max_s"]),
                r["load_average"]] for v, r in views.items()]
    changes.append(["view switch to its first chart", ms(b["view_switch_median_s"]), ms(b["view_switch_max_s"]), ""])
    met = b["targets_met"]
    cpu = "; ".join(f"{v} server {r['server_cpu_median_s'] * 1e3:.0f} ms, browser {r['browser_cpu_median_s'] * 1e3:.0f} ms"
                    for v, r in views.items())
    split = lambda r: " / ".join(f"{x:.2f}" for x in r["browser_cpu_by_process_s"].values())  # noqa: E731
    kinds = " / ".join(next(iter(b["loads"].values()))["browser_cpu_by_process_s"])
    loads = [[v, f"{ms(r['first_chart_s'])} ({ms(r['first_chart_max_s'])})",
              f"{r['browser_cpu_s']:.2f} s ({r['browser_cpu_max_s']:.2f})", split(r), r["load_average"]]
             for v, r in b["loads"].items()]
    floor = "; ".join(f"{name}: {ms(r['first_content_s'])} to its content for {r['browser_cpu_s']:.2f} CPU-s ({kinds}: "
                      f"{split(r)}; load {r['load_average']})" for name, r in b["floor"].items())
    yes = lambda k: "met" if met[k] else "missed"  # noqa: E731
    per_view = b.get("loads_per_view", 3)  # a run from before the bench recorded it: its default
    return (f"Run on {b['when']} ({b['command']}) at a load average of {lb} (1 min) before and {la} after, each "
            "figure at the load printed beside it:\n\n"
            + md_table(["", "median", "max", "load average"], changes, "lrrr")
            + "\nFirst-round medians (the model runs): "
            + ", ".join(f"{v} {ms(r['cold_median_s'])}" for v, r in views.items())
            + f". CPU per change (median): {cpu}. Targets (median <= 300 ms, max <= 1 s): "
            + ", ".join(f"{v} {yes(v)}" for v in views) + ".\n\n"
            + f"Page loads (a new page opened on the view, to its first chart, median of {per_view} on a warm "
              f"server; Compare on a fresh server: {ms(b['first_chart_cold_server_s'])}):\n\n"
            + md_table(["view", "first chart, median (max)", "browser CPU per load, median (max)",
                        f"of which {kinds} (medians)", "load average"], loads, "lrrrr")
            + f"\nTargets: first chart <= 2.5 s {yes('first chart')}, <= 3 CPU-s of browser time per load "
              f"{yes('page CPU')}. The floor, the same server and browser on a bare Streamlit app: {floor}.\n")


def fig_kernel_compile() -> str:
    """experiments/bench_kernel_compile.py's last run: the full Kimi K3 program exported."""
    b = result("kernel_compile.json")
    loads = ", ".join(f"{x:.1f}" for x in b["load_average_1min"])
    return (md_table(["export of", "median of 3", "trace", "export", "kernel equations", "VMEM"],
                     [[f"{b['preset']} TP{b['tp']} x EP{b['ep']}, batch {b['batch']}, {b['layers']} layers",
                       f"{b['total_s_median']:.1f} s", f"{b['trace_s_median']:.1f} s", f"{b['export_s_median']:.1f} s",
                       f"{b['kernel_jaxpr_equations']:,}", f"{b['vmem_bytes'] / 2**20:.1f} of {b['vmem_limit_bytes'] / 2**20:.1f} MiB"]],
                     "lrrrrr")
            + f"\n`{b['command']}` on {b['machine']}, {b['cpus']} CPUs, JAX {b['jax']}, {b['date']}, load average {loads} "
              f"during the three runs.\n")


def fig_ttft_published() -> str:
    """experiments/validate_prefill_published.py, recomputed: held-out single-request TTFT."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("vpp", ROOT / "experiments" / "validate_prefill_published.py")
    vpp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vpp)
    from perfmodel.spec.deployment import Deployment
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.step.prefill import prefill
    rows, errs = [], {"dense": [], "moe": []}
    for r in vpp.rows():
        model = vpp.model_of(r)
        d = Deployment(devices=int(r["devices"]), tp=int(r["tp"]), ep=int(r["ep"]) if r["ep"] else None,
                       engine=r["engine"])
        p = prefill(model, load_hardware(r["hardware"]), d, int(r["prompt_tokens"])).ttft_s
        m = float(r["measured_ttft_s"])
        errs["moe" if model.moe else "dense"].append(abs(p / m - 1))
        rows.append([r["software"], r["prompt_tokens"], f"{m * 1e3:.1f}", f"{p * 1e3:.1f}", f"{p / m - 1:+.1%}"])
    import statistics
    med = {k: statistics.median(v) for k, v in errs.items()}
    return (md_table(["measured on", "prompt", "measured ms", "predicted ms", "error"], rows, "lrrrr")
            + f"\nMedian |error|: dense {med['dense']:.1%}, MoE {med['moe']:.1%}.\n")


def fig_ttft_host() -> str:
    """experiments/validate_prefill_host.py's last run."""
    b = result("prefill_host_validation.json")
    s = b["summary"]
    rows = [[c["run"], f"{c['predicted_step_s'] * 1e3:.2f}", f"{c['measured_step_s'] * 1e3:.2f}",
             f"{c['step_error']:+.1%}", f"{c['layer_mape']:.1%}"] for c in b["results"]]
    kinds = ", ".join(f"{k} {v:+.1%}" for k, v in s["median_signed_layer_error_by_kind"].items())
    return (md_table(["run", "predicted ms", "measured ms", "step error", "layer MAPE"], rows, "lrrrr")
            + f"\nMedian |step error| {s['median_abs_step_error']:.1%} (signed {s['median_signed_step_error']:+.1%}), "
            f"median |layer error| {s['median_abs_layer_error']:.1%}; signed per layer kind: {kinds}. "
            f"{b['machine']}, {b['date']}, load average {b['load_average_1min']['start']:.1f} at the start, "
            f"{b['load_average_1min']['end']:.1f} at the end.\n")


def fig_serve_sweep() -> str:
    """experiments/serve_sweeps.py's last run: the best layout per chip under the targets."""
    rows, note = [], []
    for chip in ("tpu-v7", "gb200"):
        b = result(f"serve_sweep_{chip}.json")
        r = b["top"][0]
        rows.append([chip, f"{r['chips']} ({r['devices']} devices)", r["tp"], r["ep"], r["engine"], r["concurrency"],
                     f"{r['ttft_p90_s']:.3f}", f"{r['tpot_p90_s'] * 1e3:.2f}", f"{r['tokens_per_s']:.0f}",
                     f"**{r['tokens_per_s_per_chip']:.1f}**"])
        note.append(f"{chip}: `{b['command']}`, {b['points']} points, {b['ok']} within the targets "
                    f"({', '.join(f'{n} {k}' for k, n in b['filtered'].items())} filtered), {b['elapsed_s']:.0f} s "
                    f"at load {b['load_average_1min']['start']:.1f}")
    return (md_table(["chip", "chips", "tp", "ep", "engine", "clients", "TTFT p90 s", "TPOT p90 ms", "tokens/s",
                      "tokens/s per chip"], rows, "lrrrlrrrrr") + "\n" + "; ".join(note) + ".\n")


def fig_serve_speed() -> str:
    """experiments/bench_serve.py's last run."""
    b = result("bench_serve.json")
    r = b["results"]
    rows = [[f"`{r[k]['command']}`" if k == "serve_megakernel" else "the same, `--engine multikernel`",
             f"{r[k]['median_s']:.2f} s", f"{r[k]['steps']}", f"{r[k]['step_shapes_costed']}", "10 s"]
            for k in ("serve_megakernel", "serve_multikernel")]
    load = b["load_average"]
    return (md_table(["fresh process", "median of 3", "steps", "step shapes costed", "target"], rows, "lrrrr")
            + f"\n{b['machine']}, {b['cpus']} CPUs, {b['date']}, load average {load['start'][0]:.1f} at the start, "
            f"{load['end'][0]:.1f} at the end.\n")


GB200_VLLM = ("--model", "kimi-k3", "--hardware", "gb200", "--devices", "16", "--tp", "16", "--ep", "1",
              "--engine", "multikernel", "--serving-engine", "vllm", "--kv-cache", "fp8-kv", "--routing-skew", "0")


def fig_gb200_kernels() -> str:
    """Kimi K3 on 16 GB200 as vLLM's kernels (the Dynamo recipe's layout): each kernel as its table
    times it alone, with the kernel-level overlap of consecutive kernels the gb200 preset holds
    (`perfmodel predict`: reproduce's no-seed-fit column) and with the overlap refitted on the seed
    table (`perfmodel reproduce`)."""
    from perfmodel.fit.measurements import seed_measurements
    from perfmodel.fit.seed import deployment_for, model_for
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.step.predict import predict
    out = cli_json("predict", *GB200_VLLM, "--batch", "1,2,4,8")
    fitted = {p["batch"]: p for p in cli_json("reproduce")["points"] if p["platform"] == "gb200" and not p["spec_decode"]}
    runs = {m.batch: m for m in seed_measurements() if m.platform == "gb200" and not m.spec_decode}
    none = load_hardware("gb200").with_components(graph_kernel_overlap_s=0.0)
    alone = {b: predict(model_for(m), none, deployment_for(m)).tokens_per_s for b, m in runs.items()}
    signed = lambda e: f"{100 * e:+.1f} %"
    rows = []
    for r in out["results"]:
        b, reported = r["batch"], runs[r["batch"]].tokens_per_s
        rows.append([b, f"{reported:g}", f"{alone[b]:.1f}", signed(alone[b] / reported - 1), f"{r['step_s'] * 1e3:.2f}",
                     f"{r['tokens_per_s']:.1f}", signed(r["tokens_per_s"] / reported - 1),
                     f"{fitted[b]['predicted_tokens_per_s']:.1f}", signed(fitted[b]["error"]),
                     f"{100 * r['kernels']['measured_share']:.0f} %"])
    return md_table(["batch", "reported tok/s", "kernels alone tok/s", "error", "preset overlap: step ms", "tok/s",
                     "error", "seed-fitted overlap: tok/s", "error", "time from measured tables"], rows, "rrrrrrrrrr")


def fig_gb200_layers() -> str:
    """`perfmodel explain ... --layer 2` and `--layer 4` at batch 1 and 8: every kernel's time."""
    cols, names = {}, []
    for layer in (2, 4):
        for b in (1, 8):
            ex = cli_json("explain", *GB200_VLLM, "--batch", str(b), "--layer", str(layer))
            for r in ex["ops"]:
                for k in r.get("kernels", []):
                    key = (layer, r["op"], k["kernel"])
                    if key not in cols:
                        names.append(key)
                        cols[key] = {"from": "table" if k["measured"] else "physical"}
                    cols[key][b] = cols[key].get(b, 0.0) + k["seconds"]
            cols[(layer, "", "total")] = {**cols.get((layer, "", "total"), {"from": ""}), b: ex["layer_time_s"]}
        names.append((layer, "", "total"))
    rows = [[("KDA + MoE" if layer == 2 else "MLA + MoE") if i == 0 or names[i - 1][0] != layer else "",
             f"**{kernel}**" if kernel == "total" else kernel, op, f"{cols[layer, op, kernel][1] * 1e6:.1f}",
             f"{cols[layer, op, kernel][8] * 1e6:.1f}", cols[layer, op, kernel]["from"]]
            for i, (layer, op, kernel) in enumerate(names)]
    return md_table(["layer", "kernel", "op", "batch 1 us", "batch 8 us", "from"], rows, "lllrrl")


KERNEL_CLASSES = {"gemm": "GEMMs", "moe": "routed experts (grouped MoE)", "mnnvl": "MNNVL collectives",
                  "elementwise": "small elementwise kernels", "kda": "KDA decode", "mla_core": "MLA decode",
                  "mla_bmm": "MLA absorb BMMs", "nccl": "NCCL"}


def fig_gb200_classes() -> str:
    """`perfmodel predict ... --serving-engine vllm --json` at batch 1 and 8: the replayed kernels
    by class (each as its table times it alone), and what of them the step does not pay."""
    out = {b: cli_json("predict", *GB200_VLLM, "--batch", str(b))["results"][0] for b in (1, 8)}
    by, count = {b: {} for b in out}, {}
    for b, r in out.items():
        for k in r["kernels"]["by_kernel"]:
            by[b][k["class"]] = by[b].get(k["class"], 0.0) + k["seconds"]
            if b == 1:
                count[k["class"]] = count.get(k["class"], 0) + k["count"]
    total = {b: r["kernels"]["seconds"] for b, r in out.items()}
    rows = [[KERNEL_CLASSES.get(c, c), count[c]]
            + [f"{ms(by[b][c])} ({by[b][c] / total[b]:.0%})".replace("%", " %") for b in out]
            for c in sorted(count, key=lambda c: -by[1][c])]
    rows.append(["**all, timed alone**", sum(count.values())] + [f"**{ms(total[b])}**" for b in out])
    k1, k8 = out[1]["kernels"], out[8]["kernels"]
    return (md_table(["class", "kernels a step", "batch 1 ms", "batch 8 ms"], rows, "lrrr")
            + f"\nOf those, the shared experts on vLLM's second stream hide {ms(k1['hidden_s'])} ms (batch 1) and "
              f"{ms(k8['hidden_s'])} ms (batch 8) beside the routed experts, and the preset's overlap of consecutive "
              f"kernels in the graph hides {ms(k1['overlap_hidden_s'])} ms: the step is {ms(out[1]['step_s'])} ms at "
              f"batch 1 and {ms(out[8]['step_s'])} ms at batch 8.\n")


def fig_gpu_checks() -> str:
    """The serving engines beside the generic engine on the layouts the GPU issue names (batch 1
    unless stated, `--routing-skew 0`): H200 / H100 step ratios, EP8 / EP1 on 8 GPUs, B200 steps and
    two HGX H100 nodes against one (fictitious) 16-GPU NVLink domain."""
    from perfmodel.spec.deployment import Deployment
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.spec.loaders import load_model
    from perfmodel.step.predict import predict
    engines = (None, "vllm", "sglang", "trtllm")
    head = ["generic", "vLLM", "SGLang", "TensorRT-LLM"]

    def step(model, hw, devices, tp, ep, batch=1, engine=None) -> float:
        d = Deployment(devices=devices, tp=tp, ep=ep, engine="multikernel", batch=batch, serving_engine=engine,
                       routing_skew=0.0)
        return predict(load_model(model), hw if not isinstance(hw, str) else load_hardware(hw), d).step_s

    ratio = [[name, b] + [f"{step(m, 'h200', *lay, b, e) / step(m, 'h100', *lay, b, e):.2f}" for e in engines]
             for name, m, lay in (("Llama 3.3 70B, TP8", "llama-3.3-70b", (8, 8, 1)),
                                  ("Qwen3-235B, TP8 EP8", "qwen3-235b-a22b", (8, 8, 8)),
                                  ("gpt-oss-120b, one GPU", "gpt-oss-120b", (1, 1, 1))) for b in (1, 32)]
    ep = [[name, hw] + [f"{step(m, hw, 8, 8, 8, 1, e) / step(m, hw, 8, 8, 1, 1, e):.2f}x" for e in engines]
          for name, m, hw in (("DeepSeek-V3", "deepseek-v3", "h200"), ("Qwen3-235B", "qwen3-235b-a22b", "h100"),
                              ("Qwen3-235B", "qwen3-235b-a22b", "b200"), ("Kimi K2", "kimi-k2", "h200"))]
    b200 = [[name] + [ms(step(m, "b200", *lay, 1, e)) for e in engines]
            for name, m, lay in (("DeepSeek-V3, 8 GPUs, EP8", "deepseek-v3", (8, 8, 8)),
                                 ("Llama 3.3 70B, TP8", "llama-3.3-70b", (8, 8, 1)),
                                 ("gpt-oss-120b, one GPU", "gpt-oss-120b", (1, 1, 1)))]
    h100 = load_hardware("h100")
    two, one = (step("deepseek-v3", hw, 16, 16, 16, 1, "vllm") for hw in (h100, h100.replace(domain_devices=16,
                                                                                              node_devices=16)))
    return ("H200 / H100 step time:\n\n" + md_table(["model", "batch"] + head, ratio, "lrrrrr")
            + "\nEP8 / EP1 step time at batch 1 on 8 GPUs:\n\n" + md_table(["model", "GPU"] + head, ep, "llrrrr")
            + "\nB200 step ms at batch 1:\n\n" + md_table(["model"] + head, b200, "lrrrr")
            + f"\nDeepSeek-V3, TP16 on two HGX H100 nodes over InfiniBand, vLLM, batch 1: {ms(two)} ms; the same "
              f"kernels in one (fictitious) 16-GPU NVLink domain: {ms(one)} ms; the generic engine, which has no "
              f"fabric: {ms(step('deepseek-v3', h100, 16, 16, 16))} ms.\n")


def fig_kernel_fit() -> str:
    """The stored kernel fits' residuals (perfmodel/data/kernels/<gpu>/fit.json, written by
    `perfmodel calibrate --kernels --write`)."""
    from perfmodel.cost.gpu_kernels import KERNEL_DIR, gpus_with_tables
    engines = ("vllm", "sglang", "trtllm", "nccl")
    rows = []
    for gpu in gpus_with_tables():
        s = json.loads((KERNEL_DIR / gpu / "fit.json").read_text())["summary"]
        rows.append([gpu] + [f"{100 * s[e]['median_abs_residual']:.1f} % ({s[e]['cells']})" if e in s else "-"
                             for e in engines])
    return md_table(["GPU", "vLLM", "SGLang", "TensorRT-LLM", "NCCL"], rows, "lrrrr")


def fig_phase_profile() -> str:
    """`perfmodel explain --profile musespark`: each kernel's phases, predicted beside measured, its
    attention by part, and the stated gains of single changes beside the model's."""
    from perfmodel.step.phases import attention_parts_text
    pp = cli_json("explain", "--profile", "musespark")["phase_profile"]
    text = ""
    for name, k in pp["kernels"].items():
        settings = ", ".join(f"`{key} = {str(v).lower()}`" for key, v in k["megakernel"].items()) or "the preset"
        text += f"\n{name} kernel ({settings}; predicted step {k['step_us'] / 1e3:.2f} ms):\n\n"
        text += md_table(["phase", "per", "measured us", "predicted us", "error", "within"],
                         [[r["phase"].replace("_", " "), r["per"], f"{r['measured_us']:g}", f"{r['predicted_us']:.1f}",
                           f"{100 * r['error']:+.1f} %", f"{'yes' if r['within'] else 'no'} ({100 * r['tolerance']:.0f} %)"]
                          for r in k["phases"]], "llrrrl")
        for r in k["phases"]:
            if r.get("megakernel"):
                own = ", ".join(f"`{key} = {str(v).lower()}`" for key, v in r["megakernel"].items())
                text += f"\n{r['phase'].replace('_', ' ')}: predicted with {own} as well: {r['reading']}.\n"
        text += f"\n{attention_parts_text(k['attention_parts_us'])}.\n"
    if pp["checks"]:
        text += "\nstated gains of single changes (checks, nothing fitted to them):\n\n"
        text += md_table(["change", "measured on", "per", "measured us", "predicted us", "error"],
                         [[c["what"], ", ".join([f"{c['kernel']} kernel", *(f"`{key} = {str(v).lower()}`"
                                                                          for key, v in c["megakernel"].items())]),
                           c["per"], f"{c['measured_us']:g}", f"{c['predicted_us']:.1f}", f"{100 * c['error']:+.1f} %"]
                          for c in pp["checks"]], "llrrrr")
    return text.lstrip("\n")


def fig_reproduce() -> str:
    """`perfmodel reproduce`: the fitted parameters and the seed table, fitted and held out, with the
    errors of no fit."""
    out = cli_json("reproduce")
    us = lambda k, v: f"{v * 1e6:.3g} us" if k.endswith("_s") else f"{v:.3g}"
    params = md_table(["fitted parameter", "value", "plausible range"],
                      [[f"`{k}`: {v['why']}" if v.get("why") else f"`{k}`", us(k, v["value"]),
                        f"{us(k, v['plausible_range'][0])} .. {us(k, v['plausible_range'][1])}"]
                       for k, v in out["fitted_parameters"].items()], "lrl")
    name = {"tpu-v7": "TPU v7 megakernel", "gb200": "GB200, vLLM's kernels"}
    signed = lambda e: f"{100 * e:+.1f} %"
    rows = []
    for p in out["points"]:
        spec = p["spec_decode"]
        what = name[p["platform"]] + (f", spec. decoding ({spec['draft_rows']} draft rows, tau {spec['acceptance_length']:g})"
                                      if spec else "")
        rows.append([what, p["batch"], f"{p['predicted_tokens_per_s']:.1f}", f"{p['reported_tokens_per_s']:g}",
                     signed(p["error"]), signed(p["no_fit_error"]), p["role"]])
    return params + "\n" + md_table(["platform", "batch", "predicted", "reported", "error", "no seed fit", "role"],
                                     rows, "lrrrrrl")


def fig_slot_depth() -> str:
    """`python experiments/sweep_slots_depth.py`: Muse Spark's profiled deployment, step ms."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from sweep_slots_depth import BANKS, SLOTS, sweep
    grid, bank = sweep("muse-spark", 1)
    best = min((v, k) for k, v in grid.items() if v)[1]
    cell = lambda s, b: "VMEM" if grid[s, b] is None else (f"**{grid[s, b] * 1e3:.3f}**" if (s, b) == best
                                                           else f"{grid[s, b] * 1e3:.3f}")
    banks = BANKS["muse-spark"]
    return md_table(["slots \\ ring banks (MiB)"] + [f"{b} ({b * bank // 2**20})" for b in banks],
                    [[s] + [cell(s, b) for b in banks] for s in SLOTS], "r" * (1 + len(banks)))


def fig_recipe_settings() -> str:
    """`python experiments/recipe_settings.py`: Muse Spark's [megakernel] settings, each alone on the
    generic megakernel, batch 1 and 8."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from recipe_settings import rows, settings_effect
    batches = (1, 8)
    value = lambda v: f"{len(v)} vectors, {sum(v) / 2**10:.0f} KiB" if isinstance(v, list) else f"`{v}`"
    table = rows(settings_effect("muse-spark", batches), batches, value)
    table[1:-1] = [[f"`{r[0]}`", *r[1:]] for r in table[1:-1]]
    return md_table(["setting alone", "value"] + [f"batch {b} step ms" for b in batches], table, "llrr")


def fig_kernel_plan() -> str:
    """experiments/kernel_plan_predict.py's last run: Kimi K3 TP32 from this project's kernel's own plan."""
    out = result("kernel_plan_kimi-k3.json")
    rows = [[p["deployment"]["batch"], ms(p["recipe_step_s"]), f"{p['recipe_tokens_per_s']:.1f}",
             ms(p["kernel_step_s"]), f"{p['kernel_tokens_per_s']:.1f}", f"{p['kernel_step_s'] / p['recipe_step_s']:.2f}x"]
            for p in out["kernel_plans"]]
    first = {r["what"]: r for r in out["kernel_plans"][0]["differences"]}
    fmt = lambda v: f"{v:,.0f}" if isinstance(v, (int, float)) else str(v)
    diff = md_table(["batch 1", "the model's own megakernel", "this project's kernel (its plan)"],
                    [[w, fmt(r["recipe"]), fmt(r["kernel"])] for w, r in first.items()], "lll")
    causes = out["kernel_plans"][0]["by_cause_s"]
    cause = md_table(["batch 1, cause", "own megakernel ms", "project kernel ms"],
                     [[c.replace("_", " "), ms(v["recipe"]), ms(v["kernel"])] for c, v in causes.items() if v["recipe"] or v["kernel"]],
                     "lrr")
    return (md_table(["batch", "own megakernel step ms", "tok/s", "project kernel step ms", "tok/s", "ratio"], rows,
                     "rrrrrr") + "\n" + diff + "\n" + cause + f"\n{out['machine']}.\n")


def fig_tpu_v5e() -> str:
    """experiments/tpu_megakernel.py's committed results: the megakernel measured on a TPU v5e."""
    import tpu_megakernel
    return tpu_megakernel.table(result("tpu_megakernel.json"))


# ---- host validation (experiments/validate_host.py and the hostbench files it wrote) --------------

def pct(x: float, signed: bool = False) -> str:
    """A fraction as a percentage to one decimal (signed: with its sign), never "-0.0 %" or "+0.0 %"."""
    text = f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"
    return ("0.0" if text.lstrip("+-") == "0.0" else text) + " %"


def result_csv(name: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """A results CSV: its `# key: value` header lines and its rows."""
    lines = results_file(name).read_text().splitlines()
    header = dict(line[2:].split(": ", 1) for line in lines if line.startswith("# "))
    return header, list(csv.DictReader(line for line in lines if not line.startswith("#")))


def host_run() -> tuple[dict, list[dict[str, str]]]:
    """host_validation.json and the CSV rows of the same run (an error if they are of two runs)."""
    v = result("host_validation.json")
    header, rows = result_csv("host_validation.csv")
    if header.get("date") != v["meta"]["date"]:
        raise SystemExit(f"experiments/results/host_validation.csv ({header.get('date')}) and .json "
                         f"({v['meta']['date']}) are of two runs: rerun experiments/validate_host.py")
    return v, rows


def run_line(meta: dict) -> str:
    load = meta["load_average_1min"]
    return (f"Run of {meta['date'][:16].replace('T', ' ')} UTC on {meta['machine']} (`{meta['command']}`, "
            f"{meta['weights_dtype']} weights, {meta['steps']} traced steps per point), 1-minute load average "
            f"{load['start']:.2f} at the start and {load['end']:.2f} at the end.\n")


def host_predictions_note(rows: list[dict[str, str]]) -> str:
    """Whether the run's recorded step predictions (hardware file as measured) are what the current
    code predicts from the committed hardware file: the errors shown are the run's."""
    from perfmodel.spec.deployment import Deployment
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.spec.loaders import load_model
    from perfmodel.step.predict import predict
    from perfmodel.validate.host import host_hardware, own_structure
    hw = load_hardware(str(results_file("host-cpu.toml")))
    steps = [r for r in rows if r["variant"] == "file" and r["layer"] == "step"]
    off = []
    for r in steps:
        spec = load_model(r["model"])
        now = predict(spec, host_hardware(own_structure(hw, spec.name), r["mode"]),
                      Deployment(devices=1, tp=1, engine="multikernel", batch=int(r["batch"]),
                                 context=int(r["context"]))).step_s
        if abs(now / float(r["predicted_s"]) - 1) > 1e-9:
            off.append(abs(now / float(r["predicted_s"]) - 1))
    if not off:
        return (f"The run's {len(steps)} step predictions (hardware file as measured) are what the current "
                f"code predicts from the committed hardware file.\n")
    return (f"**Stale:** {len(off)} of the run's {len(steps)} step predictions differ from what the current code "
            f"predicts from the committed hardware file (by up to {pct(max(off))}): the model changed since "
            f"the run; rerun `python experiments/validate_host.py` to measure it.\n")


def fig_host_validation() -> str:
    """Median |step error|, |layer error| and |gap error| per model and variant of the last host
    validation run, the signed median step error and how many runs the model predicts too fast."""
    v, rows = host_run()
    label = {"file": "hardware file as measured", "matched": "`--matched-efficiency`"}
    table = []
    for variant, s in v["summary"].items():
        steps = [float(r["rel_error"]) for r in rows if r["variant"] == variant and r["layer"] == "step"]
        if len(steps) != s["runs"]:
            raise SystemExit(f"host_validation.csv has {len(steps)} {variant} steps, the JSON {s['runs']}")
        by_model = {m: [float(r["rel_error"]) for r in rows
                        if r["variant"] == variant and r["layer"] == "step" and r["model"] == m]
                    for m in s["per_model"]}
        for name, sm, errs in [(f"all, {s['runs']}", s, steps),
                               *((f"{m}, {s['per_model'][m]['runs']}", s["per_model"][m], by_model[m])
                                 for m in s["per_model"])]:
            table.append([label.get(variant, variant), name, pct(sm["median_abs_step_error"]),
                          pct(statistics.median(errs), signed=True), f"{sum(e < 0 for e in errs)} of {len(errs)}",
                          pct(sm["median_abs_layer_error"]), pct(sm["median_abs_gap_error"])])
    t = v["summary"]["file"]["targets"]
    met = lambda k: f"<= {t[k]['target']:.0%} ({'met' if t[k]['met'] else 'missed'})".replace("%", " %")
    table.append(["target (hardware file, all runs)", "", met("median_abs_step_error"), "", "",
                  met("median_abs_layer_error"), met("median_abs_gap_error")])
    share = max(s["max_unattributed_share"] for s in v["summary"].values())
    gaps = v["summary"]["file"]["gaps"]
    negative = sum(g["measured_gap_s"] < 0 for g in gaps)
    return (md_table(["variant", "runs", "median abs. step error", "signed median", "too fast",
                      "median abs. layer error", "median abs. gap error"], table, "llrrrrr")
            + "\n" + run_line(v["meta"])
            + f"Traced op time not attributed to a layer: at most {100 * share:.2f} % of a run. The measured "
              f"op-by-op gap (op by op less one program) is negative at {negative} of {len(gaps)} points. "
            + host_predictions_note(rows))


def fig_host_steps() -> str:
    """Signed step error of every run (hardware file as measured), by model, context and mode
    against batch."""
    _, rows = host_run()
    steps = [r for r in rows if r["variant"] == "file" and r["layer"] == "step"]
    batches = sorted({int(r["batch"]) for r in steps})
    error = {(r["model"], int(r["context"]), r["mode"], int(r["batch"])): float(r["rel_error"]) for r in steps}
    table = [[m.removeprefix("kimi-k3-host-"), c, mode.replace("_", " ")]
             + [pct(error[m, c, mode, b], signed=True) if (m, c, mode, b) in error else "" for b in batches]
             for m, c, mode in sorted({k[:3] for k in error})]
    return md_table(["model", "context", "mode"] + [f"batch {b}" for b in batches], table,
                    "lrl" + "r" * len(batches))


def fig_host_layer_kinds() -> str:
    """Median signed error per layer kind, model and mode (hardware file as measured)."""
    _, rows = host_run()
    rows = [r for r in rows if r["variant"] == "file" and r["rel_error"] != ""]
    cols = sorted({(r["model"], r["mode"]) for r in rows})
    kinds = list(dict.fromkeys(r["kind"] for r in rows if r["kind"] != "step")) + ["step"]
    table = []
    for k in kinds:
        line = [k]
        for m, mode in cols:
            errs = [float(r["rel_error"]) for r in rows if (r["model"], r["mode"], r["kind"]) == (m, mode, k)]
            line.append(f"{pct(statistics.median(errs), signed=True)} ({len(errs)})" if errs else "")
        table.append(line)
    return md_table(["layer kind"] + [f"{m.removeprefix('kimi-k3-host-')}, {mode.replace('_', ' ')}"
                                      for m, mode in cols], table, "l" + "r" * len(cols))


def fig_host_bench() -> str:
    """hostbench's headline figures before and after the last host validation run."""
    v, _ = host_run()
    b, a = v["hostbench"], v["hostbench_after"]
    big = lambda d: str(max(map(int, d)))
    gb, us = (1e-9, ".1f", "GB/s"), (1e6, ".2f", "us")
    figures = [("streaming read, f32 sum over {} MiB", "read_bandwidth_bytes_per_s", big, gb),
               ("copy (read + write), {} MiB", "copy_bandwidth_bytes_per_s", big, gb),
               *((f"f32 dot over a 256 MiB weight, {r} row{'s' if r > 1 else ''}", "matvec_bandwidth_bytes_per_s",
                  lambda d, r=r: f"f32/{r}", gb) for r in (1, 8, 32)),
               ("bf16 dot over a 256 MiB weight, 1 row", "matvec_bandwidth_bytes_per_s", lambda d: "bf16/1", gb),
               ("2048^3 matmul, f32", "matmul_flops_per_s", lambda d: "f32", (1e-9, ".0f", "GFLOP/s")),
               ("one jitted tiny op, dispatched and waited on", "dispatch_s", None, us),
               ("program of {} thunks, per call", "thunk_chain_s", big, (1e6, ".0f", "us"))]
    table = []
    for name, key, sub, (scale, spec, unit) in figures:
        k = sub(b[key]) if sub else None
        table.append([name.format(k)] + [f"{(x[key][k] if k else x[key])['median'] * scale:{spec}} {unit}"
                                         for x in (b, a)])
    table.append(["1-minute load average", f"{b['load_average_1min']:.2f}", f"{a['load_average_1min']:.2f}"])
    return md_table(["hostbench (median)", "before the runs", "after"], table, "lrr")


# calibrate's group -> the component function of perfmodel/cost/components.py it fits
COMPONENT_FUNCTIONS = {
    "dma": "dma_stream_time", "mxu": "matmul_time", "vpu_dequant": "dequant_matmul_time",
    "vpu_decode": "vpu_decode_time", "expert_pass": "decode_pass_time",
    "remote_copy": "remote_copy_time", "collective": "collective_time", "vpu": "topk_time, attention_core_time",
    "xla_glue": "xla_embedding_time",
    "host": "device_call_time", "gpu_launch": "kernel_launch_time", "gpu_kernel": "kernel_stream_time",
    "gpu_all_reduce": "gpu_all_reduce_time", "gpu_graph_overlap": "graph_overlap_time",
    "host_dot": "host_dot_time", "host_expert": "host_expert_time", "host_convert": "host_convert_time",
    "xla_expert": "xla_expert_time", "xla_dot": "xla_dot_time", "xla_copy": "xla_cache_copy_time", "embed": "embed_pick_time",
    "host_program": "host_program_time", "host_pages": "host_fresh_pages_time",
    "host_stack_copy": "host_stack_copy_time", "host_argmax": "host_argmax_time",
    "host_absorb": "host_absorbed_kv_b_time"}


def param_value(name: str, value: float) -> str:
    """A component parameter in the unit its name ends with (3 significant figures; below a
    thousandth of that unit, 0 with the fitted value)."""
    for suffix, scale, unit in (("_bytes_per_s", 1e-9, "GB/s"), ("_values_per_s", 1e-9, "G values/s"),
                                ("_s_per_byte", 1e12, "ps/B"), ("_s", 1e6, "us")):
        if name.endswith(suffix):
            x = value * scale
            if unit == "GB/s" and x >= 1000:
                x, unit = x / 1000, "TB/s"
            if unit == "us" and 1e-3 <= x * 1e3 < 1e3:
                x, unit = x * 1e3, "ns"
            return f"{x:#.3g}".rstrip(".") + f" {unit}" if x >= 1e-3 else f"0 {unit} (fitted {value:.1e})"
    return f"{value:g}"


def ids_pattern(ids: list[str]) -> str:
    """Micro-benchmark ids as their common prefix up to a dash and a count: host-dot-* (12)."""
    prefix = os.path.commonprefix(ids)
    return f"{prefix[:prefix.rfind('-') + 1]}* ({len(ids)})" if len(ids) > 1 else ids[0]


def components_table(microbench: str, *hardware: str) -> str:
    """`perfmodel calibrate --microbench FILE [--hardware H]` for each H: per component, its fitted
    parameters, the micro-benchmarks it is fitted to and their residuals; then the entries reported
    but not fitted, by the reason the file gives."""
    from perfmodel.fit.microbench import GROUPS
    table, unfitted, target = [], {}, 0.1
    for hw in hardware or (None,):
        out = cli_json("calibrate", "--microbench", microbench, *(("--hardware", hw) if hw else ()))
        target = out["target"]
        for group in dict.fromkeys(r["group"] for r in out["residuals"] if r["group"]):
            res = [r for r in out["residuals"] if r["group"] == group and r["within_target"] is not None]
            if not res:
                continue
            errs = [r["error"] for r in res]
            params = ", ".join(f"`{n}` {param_value(n, out['components'][n])}" for n in GROUPS[group][0]
                               if n in out["components"])
            mechanisms = ", ".join(dict.fromkeys(r["mechanism"].replace("_", " ") for r in res))
            table.append(([Path(hw).stem] if len(hardware) > 1 else [])
                         + [f"`{COMPONENT_FUNCTIONS[group]}`", params, f"{mechanisms} ({len(res)})",
                            f"{pct(min(errs), signed=True)} .. {pct(max(errs), signed=True)}",
                            f"{sum(r['within_target'] for r in res)} of {len(res)}"])
        for r in out["residuals"]:
            if r["within_target"] is None and r["error"] is not None:
                unfitted.setdefault(r.get("not_modelled") or "not fitted", {})[r["id"]] = r["error"]
    head = (["hardware"] if len(hardware) > 1 else []) + ["component", "fitted parameters", "micro-benchmarks",
                                                          "residuals", f"within {target:.0%}".replace("%", " %")]
    text = md_table(head, table, ("l" if len(hardware) > 1 else "") + "lllrr")
    for why, errs in unfitted.items():
        text += (f"\nReported, not fitted: {ids_pattern(list(errs))}, {pct(min(errs.values()), signed=True)} .. "
                 f"{pct(max(errs.values()), signed=True)} ({why}).\n")
    return text


def fig_tpu_v5e_validation() -> str:
    """experiments/validate_tpu.py's committed comparison: each v5e run's step (and, traced, each
    layer) predicted from micro-benchmarks only, against the chip."""
    v = result("tpu_validation.json")
    us = lambda x: f"{x * 1e6:.0f}"
    rows = []
    for r in v["runs"]:
        c = r["comparison"]
        rows.append([r["run"], "step", us(c["predicted_step_s"]), us(c["measured_step_s"]),
                     f"{c['step_error']:+.1%}"])
        for layer in c["layers"] if r["traced"] else []:
            rows.append(["", f"layer {layer['layer']} {layer['kind']} (trace)", us(layer["predicted_s"]),
                         us(layer["measured_s"]), f"{layer['rel_error']:+.1%}"])
    rows += [[f"XLA {x['run']}", "step", us(x["predicted_step_s"]), us(x["measured_step_s"]),
              f"{x['step_error']:+.1%}"] for x in v["xla"]]
    import validate_tpu
    sweep = [[validate_tpu.sweep_name(w), f"{w['knob']} {x}", us(pr), us(me),
              f"{pr / me - 1:+.1%}"]
             for w in v.get("whatif", []) for x, pr, me in zip(w["values"], w["predicted_s"], w["measured_s"])]
    best = "".join(f"\n- {validate_tpu.sweep_name(w)}: best predicted {w['predicted_best']}, measured "
                   f"{w['measured_best']}{validate_tpu.best_words(w)}; gain from {w['values'][0]} to the best predicted "
                   f"{us(w['predicted_gain_s'])} us, measured {us(w['measured_gain_s'])} us "
                   f"({validate_tpu.gain_words(w)})" for w in v.get("whatif", []))
    return md_table(["run", "what", "predicted us", "measured us", "error"], rows) + \
        ("\n\nThe sweeps (one knob from the tuned config at a time):\n\n"
         + md_table(["run", "point", "predicted us", "measured us", "error"], sweep) + best
         if sweep else "") + f"\n\n{validate_tpu.summary_line(v['summary'])}\n"


def fig_tpu_v5e_model() -> str:
    """The README's view of experiments/validate_tpu.py's comparison: tokens/s on the v5e per
    slice, expert format and batch, predicted (micro-benchmarks only) and measured, for the
    megakernel (its latest speed run of each point that is not a sweep: the current kernel) and
    the XLA reference (its latest run of each point)."""
    from perfmodel_kernels.specs import slice_spec
    v = result("tpu_validation.json")
    kernel = {}
    for r in v["runs"]:
        if not r["sweep"] and not r.get("trace_only"):
            kernel[r["slice"], r["format"], r["batch"]] = r["comparison"]
    xla = {(x["slice"], x["format"], x["batch"]): x for x in v["xla"]}
    tok = lambda b, s: f"{b / s:.0f}"  # noqa: E731
    rows = []
    for key in sorted(set(kernel) | set(xla)):
        sl, fmt, b = key
        c, x = kernel.get(key), xla.get(key)
        rows.append([sl, fmt if slice_spec(sl).count(ffn="moe") else "none (dense)", b,
                     *((tok(b, c["predicted_step_s"]), tok(b, c["measured_step_s"]), pct(c["step_error"], True))
                       if c else ("-", "-", "-")),
                     *((tok(b, x["predicted_step_s"]), tok(b, x["measured_step_s"]), pct(x["step_error"], True))
                       if x else ("-", "-", "-"))])
    return md_table(["slice", "experts", "batch", "kernel tok/s predicted", "measured", "step error",
                     "XLA tok/s predicted", "measured", "step error"], rows, "llrrrrrrr") + \
        "\n\nStep error: predicted step time over measured, less one (device time).\n"


def fig_tpu_v5e_whatif() -> str:
    """The README's what-if on the chip: experiments/validate_tpu.py's ring depth and expert slot
    sweeps of the current kernel (its expert decode: that of the latest speed run of a swept
    format), each family's best value and the gain to it from the smallest value, predicted and
    measured."""
    import validate_tpu
    v = result("tpu_validation.json")
    swept = {w["expert_decode"] for w in v["whatif"]}
    current = [r["expert_decode"] for r in v["runs"] if not r["sweep"] and not r.get("trace_only")
               and r.get("expert_decode") in swept][-1]
    us = lambda x: f"{x * 1e6:.0f}"  # noqa: E731
    rows = [[validate_tpu.sweep_name(w), ", ".join(map(str, w["values"])),
             f"{w['predicted_best']} / {w['measured_best']}{validate_tpu.best_words(w)}",
             f"{us(w['predicted_gain_s'])} / {us(w['measured_gain_s'])}", validate_tpu.gain_words(w)]
            for w in v["whatif"] if w["knob"] in ("depth", "expert_slots") and w["expert_decode"] == current]
    return md_table(["sweep", "points", "best predicted / measured", "gain from the first, us", "gain error"],
                    rows) + "\n"


def fig_components_tpu() -> str:
    """The TPU7x components against their micro-benchmarks (perfmodel/data/microbench/tpu7x.json)."""
    return components_table("tpu7x.json")


def fig_components_gpu() -> str:
    """The GPU components against their micro-benchmarks (perfmodel/data/microbench/gpu.json)."""
    return components_table("gpu.json", "h100", "h200", "gb200")


def fig_host_components() -> str:
    """The host components against this machine's micro-benchmarks (hostbench's last run)."""
    return components_table(str(RESULTS / "host-cpu.microbench.json"), str(RESULTS / "host-cpu.toml"))


def fig_gpu_validation() -> str:
    """The GPU runs of the reference step, compiled program: the untraced wall step, the GPU's
    kernel time and idle share in the traced steps, kernels against the model's ops, and the
    model's step against each; the op-by-op runs and the layers in one line each."""
    from perfmodel.spec.deployment import Deployment
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.spec.loaders import load_model
    from perfmodel.step.predict import predict
    v = result("gpu_validation.json")
    header, rows = result_csv("gpu_validation.csv")
    if header.get("date") != v["meta"]["date"]:
        raise SystemExit("experiments/results/gpu_validation.csv and .json are of two runs: rerun "
                         "experiments/validate_gpu.py --compare-only")
    runs = {(r["model"], r["mode"], r["batch"], r["context"]): {} for r in rows}
    for r in rows:
        runs[(r["model"], r["mode"], r["batch"], r["context"])][r["layer"]] = r
    results = {(c["model"], c["mode"], str(c["batch"]), str(c["context"])): c for c in v["runs"]}
    hw = load_hardware(v["meta"]["hardware_file"])
    table, stale, floor = [], 0, {}
    for key in sorted(runs, key=lambda k: (k[0], k[1], int(k[2]), int(k[3]))):
        (model, mode, batch, context), run = key, runs[key]
        step, kern, c = run["step"], run["kernels"], results[key]
        now = predict(load_model(model), hw, Deployment(devices=1, tp=1, engine="multikernel", batch=int(batch),
                                                         context=int(context))).step_s
        stale += abs(now / float(step["predicted_s"]) - 1) > 1e-9
        if mode == "compiled":
            us = lambda x: f"{float(x) * 1e6:.0f}"
            table.append([model, batch, context, us(step["measured_s"]), us(kern["measured_s"]),
                          pct(c["idle_share"]), step["traced_ops"].split(".")[0], step["model_ops"],
                          us(step["predicted_s"]), pct(float(step["rel_error"]), signed=True),
                          pct(float(kern["rel_error"]), signed=True)])
            floor[int(batch), context, model] = (float(step["traced_ops"]) * hw.components["kernel_launch_s"]
                                                 / float(kern["measured_s"]))
    s = v["summary"]["preset"]
    share = lambda xs: f"{min(xs):.0%} to {max(xs):.0%}"
    op = [float(r["step"]["measured_s"]) / float(runs[(k[0], "compiled", k[2], k[3])]["step"]["measured_s"])
          for k, r in runs.items() if k[1] == "op_by_op"]
    meta = v["meta"]
    note = (f"**Stale:** {stale} of the {len(runs)} step predictions differ from what the current code predicts: "
            f"rerun `python experiments/validate_gpu.py --compare-only` on the captured runs.\n" if stale else
            f"The {len(runs)} step predictions are what the current code predicts from the `{meta['hardware_file']}` preset.\n")
    return (md_table(["model", "batch", "context", "wall step us", "GPU kernel time us", "GPU idle",
                      "kernels", "model ops", "predicted us", "error (wall)", "error (kernels)"], table,
                     "lrrrrrrrrrr")
            + f"\nA diagnostic, not a prediction: the traced kernels at {hw.components['kernel_launch_s'] * 1e6:.2f} us "
              f"each (`components.kernel_launch_s`, a trivial kernel's node in a CUDA graph) make "
              + "; ".join(f"{share([x for (_, _, m), x in floor.items() if m == model])} of the kernel time for {model}"
                          for model in sorted({m for *_, m in floor}))
              + " (the rest is work beyond a trivial kernel's, more of it in the larger model).\n"
              f"Op by op (one jitted call per phase): the wall step {statistics.median(op):.1f}x the compiled "
              f"program's (median), the same kernels. Per layer (each layer's kernel time, both modes): median "
              f"|error| {pct(s['median_abs_layer_error'])}; traced time without a scope: at most "
              f"{pct(s['max_unattributed_share'])}.\n"
              f"Captured {meta['date'][:16].replace('T', ' ')} UTC on {meta['machine']} ({meta['weights_dtype']} "
              f"weights, {meta['steps']} traced steps per run), compared by `{meta['command']}`. " + note)


def fig_h200_gemv_check() -> str:
    """This project's H200 GEMV measurements (experiments/gpu_microbench.py) against the imported
    public kernel tables of the same GPU at the same shapes (bf16, one row)."""
    from perfmodel.cost import gpu_kernels as gk
    from perfmodel.spec.hardware import load_hardware
    m = result("gpu_microbench.json")
    engines = ("vllm", "sglang", "trtllm")
    hbm = {p: load_hardware(p).hbm_bandwidth_bytes_per_s for p in {e["platform"] for e in m["entries"]}}
    table = []
    for e in m["entries"]:
        if e["mechanism"] != "gemv_bandwidth":
            continue
        k, n = e["inputs"]["k"], e["inputs"]["n"]
        # the entry's fraction is of the preset's datasheet bandwidth (the script's --hbm-bytes-per-s)
        measured = 2 * k * n / (e["value"] * hbm[e["platform"]])
        row = [f"[1, {k}] @ [{k}, {n}]", f"{measured * 1e6:.1f}"]
        for eng in engines:
            hit = gk.table_time(gk.tables(e["platform"], eng), "gemm", {"dtype": "bf16"}, {"m": 1, "n": n, "k": k})
            row.append(f"{hit[0] * 1e6:.1f} ({pct(hit[0] / measured - 1, signed=True)})" if hit else "outside the table")
        table.append(row)
    return (md_table(["bf16 GEMV", "measured us", "vLLM table us", "SGLang table us", "TensorRT-LLM table us"], table,
                     "lrrrr")
            + f"\nMeasured on one {m['machine']}, {m['date'][:10]} (`python experiments/gpu_microbench.py`, the "
              f"median of {m['repeats']} replays of a CUDA graph of 20 calls); the tables time one call of the "
              "engine's own GEMM path.\n")


def fig_host_structure() -> str:
    """The counts hostbench took from the compiled reference programs (structure, not timings),
    the probe model's and each other model's own, from the committed host hardware file."""
    import tomllib
    c = tomllib.loads(results_file("host-cpu.toml").read_text())["components"]
    bench = result("host-cpu.json")
    thunks, memory = bench["reference_thunks"], bench["stack_copies"]
    keys = [k for k in c if k.startswith(("host_thunks_", "host_stack_copies_", "host_temp_per_cache_byte"))]
    others = sorted({k.split("__", 1)[1] for k in keys if "__" in k})
    table = [[f"`{k}`", f"{c[k]:.3g}"] + [f"{c[f'{k}__{m}']:.3g}" if f"{k}__{m}" in c else "the probe's"
                                           for m in others] for k in keys if "__" not in k]
    return (md_table(["count", f"{memory['model']} (probe)"] + [m.replace("_", "-") for m in others], table,
                     "l" + "r" * (1 + len(others)))
            + f"\nCounted by hostbench on {bench['cpu']}, {bench['date']} (`experiments/results/host-cpu.toml`): "
              f"thunks at batch {thunks['batch']}, copies and temporaries at batch {memory['batch']}, "
              f"context {memory['context']}.\n")


FIGURES = {"predict": fig_predict, "gain": fig_gain, "cli-speed": fig_cli_speed, "gb200-kernels": fig_gb200_kernels,
           "gb200-layers": fig_gb200_layers, "gb200-classes": fig_gb200_classes, "gpu-checks": fig_gpu_checks, "kernel-fit": fig_kernel_fit, "h200-gemv-check": fig_h200_gemv_check,
           "host-validation": fig_host_validation, "host-steps": fig_host_steps, "gpu-validation": fig_gpu_validation,
           "host-layer-kinds": fig_host_layer_kinds, "host-bench": fig_host_bench,
           "host-components": fig_host_components, "host-structure": fig_host_structure,
           "phase-profile": fig_phase_profile, "reproduce": fig_reproduce, "slot-depth": fig_slot_depth,
           "kernel-plan": fig_kernel_plan, "recipe-settings": fig_recipe_settings, "components-tpu": fig_components_tpu,
           "components-gpu": fig_components_gpu, "model-speed": fig_model_speed, "layer-time": fig_layer_time,
           "kernel-compile": fig_kernel_compile, "dashboard-browser": fig_dashboard_browser, "ttft-published": fig_ttft_published, "ttft-host": fig_ttft_host,
           "serve-sweep": fig_serve_sweep, "serve-speed": fig_serve_speed, "tpu-v5e": fig_tpu_v5e,
           "tpu-v5e-validation": fig_tpu_v5e_validation, "tpu-v5e-model": fig_tpu_v5e_model,
           "tpu-v5e-whatif": fig_tpu_v5e_whatif}


# ---- the pages --------------------------------------------------------------------------------

def render(text: str, cache: dict[str, str], page: Path) -> str:
    def one(m: re.Match) -> str:
        name = m["name"]
        if name not in FIGURES:
            raise SystemExit(f"{page.relative_to(ROOT)}: unknown figure {name!r}; known: {', '.join(FIGURES)}")
        if name not in cache:
            cache[name] = FIGURES[name]()
        return m.group(1) + cache[name] + m.group(4)
    return BLOCK.sub(one, text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a figure is stale")
    a = ap.parse_args()
    from perfmodel.engine import megakernel_sim
    from perfmodel.util.files import write_atomic
    megakernel_sim.compile_loops()
    cache: dict[str, str] = {}
    stale = []
    for page in PAGES:
        old = page.read_text()
        new = render(old, cache, page)
        if new == old:
            continue
        if a.check:
            stale.append(page)
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       str(page.relative_to(ROOT)), "now", n=1))
        else:
            write_atomic(page, new)
            print(f"wrote {page.relative_to(ROOT)}")
    if stale:
        print(f"stale figures in {', '.join(str(p.relative_to(ROOT)) for p in stale)}: run `make docs`")
        return 1
    print(f"{len(cache)} figures {'checked' if a.check else 'rendered'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
