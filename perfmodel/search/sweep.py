"""What-if sweeps: `sweep` varies one or two fields in this process (the dashboard's what-if);
`run_design` evaluates a design of up to millions of configurations (perfmodel.search.design) chunk by
chunk on an executor, streams the rows to Parquet or CSV, and keeps the top K and the Pareto
front of throughput per chip against latency. `perfmodel sweep` is its CLI (docs/sweep.md).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import math
import os
import sys
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

from perfmodel.predict import predict
from perfmodel.search import design as design_mod
from perfmodel.search.batch import COLUMNS, OBJECTIVES, run_chunk
from perfmodel.search.executors import EXECUTORS
from perfmodel.search.executors import run as run_chunks
from perfmodel.spec.arch import ModelSpec, load_model
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import Hardware, load_hardware
from perfmodel.util.errors import SpecError, require

DEPLOYMENT_AXES = ("batch", "context", "prefetch_bytes", "expert_slots", "engine", "routing_skew",
                   "routing_correlation")
HARDWARE_AXES = ("onchip_bytes", "hbm_bandwidth_bytes_per_s", "link_latency_s", "dma_sharing")
AXES = DEPLOYMENT_AXES + HARDWARE_AXES


def sweep(model: ModelSpec, hw: Hardware, d: Deployment, axes: dict[str, list]) -> list[dict]:
    """Predict every combination of `axes` values; a point that cannot run records its error."""
    for axis in axes:
        if axis not in AXES:
            raise SpecError("sweep axis", axis, f"must be one of {', '.join(AXES)}")
    rows = []
    names = list(axes)
    for values in itertools.product(*(axes[n] for n in names)):
        point = dict(zip(names, values))
        dd = dataclasses.replace(d, **{k: v for k, v in point.items() if k in DEPLOYMENT_AXES})
        hh = hw.replace(**{k: v for k, v in point.items() if k in HARDWARE_AXES})
        try:
            p = predict(model, hh, dd)
        except SpecError as e:
            rows.append({**point, "error": str(e)})
            continue
        rows.append({**point, "step_s": p.step_s, "tokens_per_s": p.tokens_per_s, "bound": p.bound,
                     "hbm_utilisation": p.hbm_utilisation, "breakdown_s": p.breakdown_s})
    return rows


def saturation(rows: list[dict], axis: str = "prefetch_bytes", within: float = 0.01) -> dict | None:
    """The smallest `axis` value whose step time is within `within` of the best in the sweep."""
    ok = [r for r in rows if r.get("step_s") is not None]
    if not ok:
        return None
    best = min(r["step_s"] for r in ok)
    return min((r for r in ok if r["step_s"] <= best * (1 + within)), key=lambda r: r[axis])


# ----- designs at scale -------------------------------------------------------------------------

def pareto(rows: list[dict], x: str = "token_latency_s", y: str = "tokens_per_s_per_chip") -> list[dict]:
    """The rows that no other row beats with both a lower `x` and a higher `y`, by increasing `x`."""
    front, best = [], -math.inf
    for r in sorted(rows, key=lambda r: (r[x], -r[y], r["point"])):
        if r[y] > best:
            front.append(r)
            best = r[y]
    return front


class Best:
    """The top `k` rows by `objective`, each model's Pareto front and the filtered counts,
    updated chunk by chunk (ties go to the lower point number, so any executor gives the same)."""

    def __init__(self, k: int, objective: str):
        sign = -1 if OBJECTIVES[objective] == "max" else 1
        self.key = lambda r: (sign * r[objective], r["point"])
        self.k, self.objective, self.top, self.fronts, self.points = k, objective, [], {}, 0
        self.filtered: Counter = Counter()
        self.example: dict[str, str] = {}

    def add(self, rows: list[dict]) -> None:
        self.points += len(rows)
        ok = [r for r in rows if r["status"] == "ok"]
        for r in rows:
            if r["status"] != "ok":
                self.filtered[r["constraint"]] += 1
                self.example.setdefault(r["constraint"], r["reason"])
        self.top = sorted(self.top + ok, key=self.key)[:self.k]
        for m in sorted({r["model"] for r in ok}):
            self.fronts[m] = pareto(self.fronts.get(m, []) + [r for r in ok if r["model"] == m])

    def summary(self) -> dict:
        return {"points": self.points, "ok": self.points - sum(self.filtered.values()),
                "filtered": dict(self.filtered), "filtered_reason": self.example, "objective": self.objective,
                "top": self.top, "pareto": [r for m in sorted(self.fronts) for r in self.fronts[m]]}


class RowFile:
    """Rows streamed to .parquet (pyarrow) or .csv as chunks arrive; written under a temporary
    name and renamed when complete, so a failed sweep leaves no partial file."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.format = self.path.suffix.lstrip(".")
        require(self.format in ("parquet", "csv"), "--out", path, "must end in .parquet or .csv")
        require(self.path.parent.is_dir(), "--out", path, "its folder does not exist")
        if self.format == "parquet":
            try:
                import pyarrow as pa
                import pyarrow.parquet as pq
            except ImportError:
                raise SpecError("--out", path, "Parquet needs pyarrow (pip install pyarrow); or write .csv") from None
            types = {int: pa.int64(), float: pa.float64(), str: pa.string()}
            self.schema = pa.schema([(k, types[t]) for k, t in COLUMNS.items()])
            self.pa, self.pq = pa, pq
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")

    def __enter__(self):
        if self.format == "parquet":
            self.writer = self.pq.ParquetWriter(self.tmp, self.schema)
        else:
            self.file = open(self.tmp, "w", newline="")
            self.writer = csv.DictWriter(self.file, fieldnames=list(COLUMNS))
            self.writer.writeheader()
        return self

    def write(self, rows: list[dict]) -> None:
        if self.format == "parquet":
            self.writer.write_table(self.pa.Table.from_pylist(rows, schema=self.schema))
        else:
            self.writer.writerows(rows)

    def __exit__(self, exc_type, *_):
        (self.writer if self.format == "parquet" else self.file).close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


def run_design(design: design_mod.Design, *, executor: str = "local", jobs: int | None = None,
               address: str | None = None, out: str | None = None, top: int = 10,
               objective: str = "tokens_per_s_per_chip", chunk: int = 256, keep_rows: bool | None = None,
               progress: bool | None = None) -> dict:
    """Evaluate every point of `design`. Returns the summary (counts, top, Pareto front) and, when
    `keep_rows` (default: when there is no `out` file), every row in output order."""
    require(objective in OBJECTIVES, "--objective", objective, f"must be one of {', '.join(OBJECTIVES)}")
    require(isinstance(top, int) and top >= 0, "--top", top, "must be an integer >= 0")
    for name in ("model", "hardware"):  # refuse a bad preset name here, not in a worker
        for ref in set(design.columns.get(name, [(design_mod.DEFAULTS | design.base)[name]])):
            (load_model if name == "model" else load_hardware)(ref)
    n = len(design)
    keep_rows = out is None if keep_rows is None else keep_rows
    if jobs is None and executor == "local" and n <= chunk:
        jobs = 1  # one chunk: starting processes would cost more than it saves
    from tqdm import tqdm
    best, rows, t0 = Best(top, objective), [], time.perf_counter()
    sink = RowFile(out) if out else None
    with sink or nullcontext(), tqdm(total=n, unit="config", disable=None if progress is None else not progress,
                                    file=sys.stderr, desc="sweep") as bar:
        for part in run_chunks(run_chunk, design_mod.chunks(design, chunk), executor, jobs, address):
            best.add(part)
            if sink:
                sink.write(part)
            if keep_rows:
                rows.extend(part)
            bar.update(len(part))
    summary = best.summary() | {"out": str(out) if out else None, "format": sink.format if sink else None,
                                "executor": executor, "elapsed_s": time.perf_counter() - t0}
    if keep_rows:
        summary["rows"] = rows
    return summary


def saturation_by_group(rows: list[dict], axes: list[str]) -> list[dict]:
    """Per combination of the other varied axes, the smallest prefetch depth within 1 % of the best."""
    others = [a for a in axes if a != "prefetch_mib"]
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault(tuple(r[a] for a in others), []).append(r)
    return [{**dict(zip(others, k)), "prefetch_mib": s["prefetch_mib"], "step_s": s["step_s"]}
            for k, rs in groups.items() if (s := saturation(rs, "prefetch_mib"))]


# ----- CLI --------------------------------------------------------------------------------------

def parse_vary(text: str) -> tuple[str, list]:
    name, _, values = text.partition("=")
    if name not in design_mod.SETTINGS or not values:
        raise argparse.ArgumentTypeError(
            f"expected SETTING=v1,v2,... with SETTING in {', '.join(design_mod.SETTINGS)}; got {text!r}")
    kind = design_mod.SETTINGS[name][0]
    try:
        return name, [kind(v.strip()) for v in values.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad value in {text!r}: {name} takes {design_mod.TYPE_WORDS[kind]}s") from None


def add_parser(sub) -> None:
    from perfmodel.cli.main import add_deployment_args
    p = sub.add_parser("sweep", help="what-if and design search: --vary axes or a --design file, "
                                     "top K and Pareto front, Parquet/CSV out, local or Ray executor")
    add_deployment_args(p)
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
    p.add_argument("--jobs", type=int, default=None, help="local processes (default: one per CPU)")
    p.add_argument("--chunk", type=int, default=256, help="configurations per task (default 256)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run, batch=1)


def run(a: argparse.Namespace) -> dict:
    from perfmodel.report import SCHEMA_VERSION
    base = {k: design_mod.check_setting(f"--{k.replace('_', '-')}", k, v)
            for k, v in vars(a).items() if k in design_mod.SETTINGS and v is not None}
    d = design_mod.load(a.design, base) if a.design else design_mod.grid_from_vary(a.vary, base)
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
    from perfmodel.report import table
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
    print(f"\nPareto front (tokens/s per chip vs time per token), {len(out['pareto'])} points:")
    print(table(["model"] + head, [[r["model"]] + line(r) for r in out["pareto"]]))
    f = out["filtered"]
    print(f"\n{out['points']} configurations, {out['ok']} evaluated, {sum(f.values())} filtered"
          + "".join(f"\n  {c}: {n} (e.g. {out['filtered_reason'][c]})" for c, n in f.items())
          + f"\n{out['elapsed_s']:.2f} s on the {out['executor']} executor"
          + (f"; rows written to {out['out']}" if out["out"] else ""))
    for s in out.get("saturation", []):
        print(f"gain saturates at {s['prefetch_mib']:g} MiB of prefetch "
              f"({', '.join(f'{k}={v}' for k, v in s.items() if k not in ('prefetch_mib', 'step_s'))}): "
              f"{s['step_s'] * 1e3:.3f} ms, within 1 % of the best depth swept")
