"""What-if sweeps: `sweep` varies one or two fields in this process (the dashboard's what-if);
`run_design` evaluates a design of up to millions of configurations (perfmodel.search.design) chunk by
chunk on an executor, streams the rows to Parquet or CSV, and keeps the top K and the Pareto
front of throughput per chip against latency. `perfmodel sweep` is its CLI (docs/sweep.md).
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import itertools
import math
import sys
import time
from collections import Counter
from contextlib import nullcontext

import numpy as np

from perfmodel.search import design as design_mod
from perfmodel.search.batch import COLUMNS, OBJECTIVES, run_chunk, serving_work
from perfmodel.search.executors import EXECUTORS, run as run_chunks
from perfmodel.spec.arch import ModelSpec
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import Hardware, load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.predict import predict
from perfmodel.util.errors import SpecError, require
from perfmodel.util.files import AtomicFile, check_output

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


ARROW_TYPES = {int: lambda pa: pa.int64(), float: lambda pa: pa.float64(), str: lambda pa: pa.string()}


def arrow_column(pa, kind: type, values: list):
    """`values` (None: null) as an Arrow array of `kind`, built from its buffers: pyarrow's
    converters from Python objects import pandas where it is installed (about 0.6 s)."""
    n, nulls = len(values), values.count(None)
    if nulls == n:
        return pa.nulls(n, ARROW_TYPES[kind](pa))
    mask = pa.py_buffer(np.packbits([v is not None for v in values], bitorder="little")) if nulls else None
    if kind is str:
        data = [v.encode() if v is not None else b"" for v in values]
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum([len(b) for b in data], out=offsets[1:])
        return pa.Array.from_buffers(pa.string(), n, [mask, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))],
                                     nulls)
    x = np.array([0 if v is None else v for v in values] if nulls else values, np.int64 if kind is int else np.float64)
    return pa.Array.from_buffers(ARROW_TYPES[kind](pa), n, [mask, pa.py_buffer(x)], nulls)


class RowFile:
    """Rows streamed to .parquet (pyarrow) or .csv as chunks arrive, through one AtomicFile: the
    file appears whole when the sweep completes, and a failed or interrupted sweep leaves the old
    file (or none) and no temporary."""

    def __init__(self, path: str):
        self.path = check_output(path)
        self.format = self.path.suffix.lstrip(".")
        require(self.format in ("parquet", "csv"), "--out", path, "must end in .parquet or .csv")
        if self.format == "parquet":
            try:
                import pyarrow as pa
                import pyarrow.parquet as pq
            except ImportError:
                raise SpecError("--out", path, "Parquet needs pyarrow (pip install pyarrow); or write .csv") from None
            self.schema = pa.schema([(k, ARROW_TYPES[t](pa)) for k, t in COLUMNS.items()])
            self.pa, self.pq = pa, pq
        self.atomic = AtomicFile(self.path, "--out", binary=self.format == "parquet", newline="")

    def __enter__(self):
        f = self.atomic.stage()
        try:
            if self.format == "parquet":
                self.writer = self.pq.ParquetWriter(f, self.schema)
            else:
                self.writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
                self.writer.writeheader()
        except BaseException:
            self.atomic.discard()
            raise
        return self

    def write(self, rows: list[dict]) -> None:
        try:
            if self.format == "parquet":
                columns = [arrow_column(self.pa, kind, [r[k] for r in rows]) for k, kind in COLUMNS.items()]
                self.writer.write_table(self.pa.Table.from_arrays(columns, schema=self.schema))
            else:
                self.writer.writerows(rows)
        except OSError as e:
            raise SpecError("--out", str(self.path), f"cannot write: {e.strerror or e}") from None

    def __exit__(self, exc_type, *_):
        if exc_type is not None:
            if self.format == "parquet":
                with contextlib.suppress(Exception):  # its footer goes to the discarded file
                    self.writer.close()
            self.atomic.discard()
            return False
        try:
            if self.format == "parquet":
                self.writer.close()
        except OSError as e:
            self.atomic.discard()
            raise SpecError("--out", str(self.path), f"cannot write: {e.strerror or e}") from None
        self.atomic.commit(last=True)
        return False


def _bar(total: int, disable: bool | None):
    """A progress bar on stderr (tqdm; None: shown on a terminal only) without tqdm's monitor
    thread, so that the local executor may fork this process."""
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0
    return Bar(total=total, unit="config", disable=disable, file=sys.stderr, desc="sweep")


def run_design(design: design_mod.Design, *, executor: str = "local", jobs: int | None = None,
               address: str | None = None, out: str | None = None, top: int = 10,
               objective: str = "tokens_per_s_per_chip", chunk: int = 256, keep_rows: bool | None = None,
               progress: bool | None = None) -> dict:
    """Evaluate every point of `design`. Returns the summary (counts, top, Pareto front) and, when
    `keep_rows` (default: when there is no `out` file), every row in output order."""
    require(objective in OBJECTIVES, "--objective", objective, f"must be one of {', '.join(OBJECTIVES)}")
    require(isinstance(top, int) and top >= 0, "--top", top, "must be an integer >= 0")
    require(isinstance(chunk, int) and chunk > 0, "--chunk", chunk, "must be a positive integer")
    require(jobs is None or (isinstance(jobs, int) and jobs > 0), "--jobs", jobs, "must be a positive integer")
    require(executor in EXECUTORS, "--executor", executor, f"must be one of {EXECUTORS}")
    require(address is None or executor == "ray", "--address", address, "needs --executor ray")
    for name in ("model", "hardware"):  # refuse a bad preset name here, not in a worker
        for ref in set(design.columns.get(name, [(design_mod.DEFAULTS | design.base)[name]])):
            (load_model if name == "model" else load_hardware)(ref)
    serving_work(design)  # the serving points' work within its limits, before any runs
    n = len(design)
    keep_rows = out is None if keep_rows is None else keep_rows
    best, rows, t0 = Best(top, objective), [], time.perf_counter()
    sink = RowFile(out) if out else None
    with sink or nullcontext(), _bar(n, None if progress is None else not progress) as bar:
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
