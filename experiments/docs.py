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
    """`make predict` (TPU v7 megakernel) beside the GB200 multi-kernel line, with the reported values."""
    from perfmodel.fit.measurements import seed_measurements
    tpu = cli_json("predict", "--model", "kimi-k3", "--hardware", "tpu-v7", "--devices", "32", "--tp", "32",
                   "--ep", "8", "--engine", "megakernel", "--batch", "1,2,4,8")
    gpu = cli_json("predict", "--model", "kimi-k3", "--hardware", "gb200", "--devices", "16", "--tp", "16",
                   "--ep", "16", "--engine", "multikernel", "--batch", "1,2,4,8")
    reported = {(m.platform, m.batch): m.tokens_per_s for m in seed_measurements() if not m.spec_decode}
    tpu_key, gpu_key = (next(p for p, _ in reported if p.startswith(k)) for k in ("tpu", "gb200"))
    rows = [[t["batch"], f"{t['step_s'] * 1e3:.2f}", f"{t['tokens_per_s']:.1f}", f"{reported[tpu_key, t['batch']]:g}",
             f"{g['step_s'] * 1e3:.2f}", f"{g['tokens_per_s']:.1f}", f"{reported[gpu_key, g['batch']]:g}"]
            for t, g in zip(tpu["results"], gpu["results"])]
    return md_table(["batch", "TPU v7 megakernel step ms", "tok/s", "reported", "GB200 multi-kernel step ms",
                     "tok/s", "reported"], rows, "rrrrrrr")


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
            ["`perfmodel --help`", f"{r['help']['median_s']:.3f} s ({t['help_vs_numpy']['value']:.2f}x)", "1.5x",
             load("help")],
            ["10,000-configuration `perfmodel sweep --design ... --out rows.parquet`",
             f"{r['sweep_10k']['median_s']:.2f} s", "3 s", load("sweep_10k")]]
    return (md_table(["fresh process, default flags", "median", "target", "load"], rows, "lrrr")
            + f"\n{b['machine']}, {b['date']}, medians of {r['predict']['runs']} runs.\n")


FIGURES = {"predict": fig_predict, "gain": fig_gain, "cli-speed": fig_cli_speed}


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
