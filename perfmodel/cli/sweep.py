"""`perfmodel sweep`: what-if grids (--vary) and design files (--design), top K, Pareto front."""
from __future__ import annotations

import argparse
import dataclasses

from perfmodel.cli.args import given, refuse_unused
from perfmodel.cli.inputs import add_deployment_args, check_spec_flags
from perfmodel.search import design as design_mod
from perfmodel.search.batch import OBJECTIVES
from perfmodel.search.executors import EXECUTORS
from perfmodel.util.errors import require
from perfmodel.util.files import check_output


def parse_vary(text: str) -> tuple[str, list]:
    name, _, values = text.partition("=")
    if name not in design_mod.SETTINGS or not values:
        raise argparse.ArgumentTypeError(
            f"expected SETTING=v1,v2,... with SETTING in {', '.join(design_mod.SETTINGS)}; got {text!r}")
    kind = design_mod.SETTINGS[name][0]
    try:
        out = [kind(v.strip()) for v in values.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad value in {text!r}: {name} takes {design_mod.TYPE_WORDS[kind]}s") from None
    if not out:
        raise argparse.ArgumentTypeError(f"no values in {text!r}")
    return name, out


def configure_sweep(p) -> None:
    add_deployment_args(p, devices_default=f"{design_mod.DEFAULTS['devices']}, or the design's")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--vary", type=parse_vary, action="append",
                     help="SETTING=v1,v2,... (repeatable; a grid); settings: " + ", ".join(design_mod.SETTINGS))
    src.add_argument("--design", metavar="FILE", help="sweep file (.toml, or .yaml with PyYAML): docs/sweep.md")
    p.add_argument("--out", metavar="FILE", help="stream every row to FILE.parquet or FILE.csv")
    p.add_argument("--top", type=int, default=10, help="keep the K best configurations (default 10)")
    p.add_argument("--objective", choices=list(OBJECTIVES), default="tokens_per_s_per_chip")
    p.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="local: processes on this machine (default); ray: a Ray cluster (perfmodel[ray])")
    p.add_argument("--address", help="Ray cluster address (ray://HOST:10001 or HOST:6379; default RAY_ADDRESS "
                                     "or a new local instance)")
    p.add_argument("--jobs", type=int, default=None, help="local worker processes after the first chunk (default: one per CPU; 1: this process only)")
    p.add_argument("--chunk", type=int, default=256, help="configurations per task (default 256)")
    p.add_argument("--constraint", type=parse_constraint, action="append", default=[], metavar="NAME=SECONDS",
                   help="serving designs: keep points whose latency percentile is at most SECONDS; NAME one of "
                        + ", ".join(design_mod.CONSTRAINTS) + " (repeatable; adds to the file's [constraints])")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_sweep, batch=1)


def parse_constraint(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=SECONDS (e.g. ttft_p90_s=2), got {text!r}") from None


SWEEP_OPTIONS = ("vary", "design", "out", "top", "objective", "executor", "address", "jobs", "chunk", "constraint")


def cmd_sweep(a: argparse.Namespace) -> dict:
    refuse_unused(a, SWEEP_OPTIONS + tuple(design_mod.SETTINGS),
                  "a sweep point has no such setting (settings: " + ", ".join(design_mod.SETTINGS) + ")")
    require(a.jobs is None or a.executor == "local", "--jobs", a.jobs, "only with --executor local (Ray uses its cluster)")
    if a.out:
        check_output(a.out)
    from perfmodel.search.sweep import run_design, saturation_by_group
    from perfmodel.step.report import SCHEMA_VERSION
    check_spec_flags(a, drafts_elsewhere=a.design is not None or any(n == "draft_rows" for n, _ in a.vary or []))
    # a decode-only option counts only where given: its default must not turn up in a serving design
    base = {k: design_mod.check_setting(f"--{k.replace('_', '-')}", k, v)
            for k, v in vars(a).items() if k in design_mod.SETTINGS and v is not None
            and (k not in design_mod.DECODE_ONLY or given(a, k))}
    d = design_mod.load(a.design, base) if a.design is not None else design_mod.grid_from_vary(a.vary, base)
    if a.constraint:
        d = dataclasses.replace(d, constraints=d.constraints | dict(a.constraint))
    s = run_design(d, executor=a.executor, jobs=a.jobs, address=a.address, out=a.out, top=a.top,
                   objective=a.objective, chunk=a.chunk, progress=False if a.no_progress else None)
    desc = d.describe()
    out = {"schema_version": SCHEMA_VERSION, "command": "sweep", "inputs": design_mod.DEFAULTS | d.base,
           "design": desc, "axes": desc["axes"], **s}
    if d.kind == "grid" and "prefetch_mib" in d.axes and "rows" in s:
        out["saturation"] = saturation_by_group(s["rows"], list(d.axes))
    if not a.json:
        print_summary(out, list(d.axes))
    return out


def print_summary(out: dict, axes: list[str]) -> None:
    from perfmodel.step.report import table
    serving = any(k in out["inputs"] or k in axes for k in design_mod.SERVE_TRAFFIC)
    if serving:  # serving simulations: latency percentiles beside the throughput
        head = axes + ["TTFT p90 s", "TPOT p90 ms", "tokens/s", "tok/s/chip", "chips", "filtered"]
        line = lambda r: [r[k] for k in axes] + (
            [r["ttft_p90_s"], r["tpot_p90_s"] * 1e3, r["tokens_per_s"], r["tokens_per_s_per_chip"], r["chips"],
             "" if r["status"] == "ok" else f"{r['constraint']}: {r['reason']}"]
            if r["ttft_p90_s"] is not None else ["", "", "", "", "", f"{r['constraint']}: {r['reason']}"])
    else:
        head = axes + ["step ms", "tokens/s", "tok/s/chip", "bound", "filtered"]
        line = lambda r: [r[k] for k in axes] + (
            [r["step_s"] * 1e3, r["tokens_per_s"], r["tokens_per_s_per_chip"], r["bound"], ""]
            if r["status"] == "ok" else ["", "", "", "", f"{r['constraint']}: {r['reason']}"])
    rows = out.get("rows")
    if rows is not None and len(rows) <= 50:
        print(table(head, [line(r) for r in sorted(rows, key=lambda r: r["point"])]))
    else:
        print(f"top {len(out['top'])} by {out['objective']}:")
        print(table(head, [line(r) for r in out["top"]]))
    if out["design"].get("constraints"):
        print("constraints: " + ", ".join(f"{k} <= {v:g}" for k, v in out["design"]["constraints"].items()))
    print(f"\nPareto front (tokens/s per chip vs time per token), {len(out['pareto'])} points:")
    print(table(["model"] + head, [[r["model"]] + line(r) for r in out["pareto"]]))
    f = out["filtered"]
    print(f"\n{out['points']} configurations, {out['ok']} evaluated, {sum(f.values())} filtered"
          + "".join(f"\n  {c}: {n} (e.g. {out['filtered_reason'][c]})" for c, n in f.items())
          + f"\n{out['elapsed_s']:.2f} s on the {out['executor']} executor"
          + (f"; rows written to {out['out']}" if out["out"] else ""))
    for s in out.get("saturation", []):
        others = ", ".join(f"{k}={v}" for k, v in s.items() if k not in ("prefetch_mib", "step_s"))
        print(f"gain saturates at {s['prefetch_mib']:g} MiB of prefetch{f' ({others})' if others else ''}: "
              f"{s['step_s'] * 1e3:.3f} ms, within 1 % of the best depth swept")
