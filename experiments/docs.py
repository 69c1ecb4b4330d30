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
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
PAGES = [ROOT / "README.md", ROOT / "kernels" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
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


def result(name: str) -> dict:
    path = RESULTS / name
    if not path.exists():
        raise SystemExit(f"{path.relative_to(ROOT)} is missing: run the benchmark that writes it")
    return json.loads(path.read_text())


# ---- the figures -----------------------------------------------------------------------------

def fig_predict() -> str:
    """`make predict` (TPU v7 megakernel) beside the GB200 lines (the recipe's layout: the generic
    multi-kernel engine with its fitted collective scale, and vLLM's kernels with nothing fitted),
    with the reported values."""
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
             f"{r['sweep_10k']['median_s']:.2f} s", "3 s", load("sweep_10k")]]
    return (md_table(["fresh process, default flags", "median", "target", "load"], rows, "lrrr")
            + f"\n{b['machine']}, {b['date']}, medians of {r['predict']['runs']} runs.\n")


GB200_VLLM = ("--model", "kimi-k3", "--hardware", "gb200", "--devices", "16", "--tp", "16", "--ep", "1",
              "--engine", "multikernel", "--serving-engine", "vllm", "--kv-cache", "fp8-kv", "--routing-skew", "0")


def fig_gb200_kernels() -> str:
    """Kimi K3 on 16 GB200 as vLLM's kernels (the Dynamo recipe's layout), nothing fitted."""
    from perfmodel.fit.measurements import seed_measurements
    out = cli_json("predict", *GB200_VLLM, "--batch", "1,2,4,8")
    reported = {m.batch: m.tokens_per_s for m in seed_measurements() if m.platform == "gb200" and not m.spec_decode}
    rows = [[r["batch"], f"{r['step_s'] * 1e3:.2f}", f"{r['tokens_per_s']:.1f}", f"{reported[r['batch']]:g}",
             f"{100 * (r['tokens_per_s'] / reported[r['batch']] - 1):+.1f} %", f"{100 * r['kernels']['measured_share']:.0f} %"]
            for r in out["results"]]
    return md_table(["batch", "step ms", "tok/s", "reported", "error", "time from measured tables"], rows, "rrrrrr")


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


def fig_seed() -> str:
    """`perfmodel reproduce`: the fitted parameters and the seed table, with the no-fit errors and,
    for GB200, vLLM's kernels (nothing fitted)."""
    out = cli_json("reproduce")
    us = lambda k, v: f"{v * 1e6:.3g} us" if k.endswith("_s") else f"{v:.3g}"
    pars = [[f"`{k}`: {v['why']}", us(k, v["value"]), f"{us(k, v['plausible_range'][0])} .. {us(k, v['plausible_range'][1])}"]
            for k, v in out["fitted_parameters"].items()]
    name = {"tpu-v7": "TPU v7 megakernel", "gb200": "GB200 vLLM (generic engine)"}
    pct = lambda e: f"{100 * e:+.1f} %"
    rows = [[name.get(p["platform"], p["platform"]) + (", spec. decoding" if p["spec_decode"] else ""), p["batch"],
             f"{p['predicted_tokens_per_s']:.1f}", f"{p['reported_tokens_per_s']:g}", pct(p["error"]),
             pct(p["no_fit_error"]), p["role"].replace("-", " "),
             f"{p['kernels']['predicted_tokens_per_s']:.1f} ({pct(p['kernels']['error'])})" if "kernels" in p else ""]
            for p in out["points"]]
    return (md_table(["fitted parameter", "value", "plausible range"], pars, "lrl") + "\n"
            + md_table(["platform", "batch", "predicted", "reported", "error", "no fit", "role",
                        "vLLM kernels, nothing fitted"], rows, "lrrrrrll"))


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


FIGURES = {"predict": fig_predict, "gain": fig_gain, "cli-speed": fig_cli_speed, "gb200-kernels": fig_gb200_kernels,
           "gb200-layers": fig_gb200_layers, "kernel-fit": fig_kernel_fit, "seed": fig_seed}


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
