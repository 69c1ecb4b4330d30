"""Design spaces for `perfmodel sweep`: the settings a configuration has, grid and random designs
(from a TOML / YAML sweep file or from `--vary`), and their split into chunks that share a model
and a chip (the unit an evaluator and an executor work on).

A setting uses the CLI flag's name (`prefetch_mib`, `vmem_mib`, ...); docs/sweep.md has the
sweep file format.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterator

import numpy as np

from perfmodel.spec.deployment import ENGINES
from perfmodel.spec.hardware import DMA_SHARING
from perfmodel.util.checks import MAX_MIB, MAX_SKEW
from perfmodel.util import limits, schema
from perfmodel.util.errors import SpecError, in_file, require
from perfmodel.util.files import check_path

MAX_POINTS = 10_000_000   # a sweep file's design (streamed in chunks; written to --out)
MAX_VARY_POINTS = 10_000  # a grid typed on the command line (its rows are printed and held)
MAX_CELLS = 2**25         # axis values a design holds (about 40 B each: 1.3 GB), checked before any is built
MAX_SERVE_REQUESTS = limits.MAX_REQUESTS  # requests one serving point simulates
MAX_SERVE_POINTS = 10_000  # points of a serving design (each a simulation of seconds)


# setting -> (type, domain check or None, what the domain is); a value None means "the default"
SETTINGS = {
    "model": (str, None, ""), "hardware": (str, None, ""),
    "devices": (int, lambda v: v > 0, "> 0"), "tp": (int, lambda v: v > 0, "> 0"),
    "ep": (int, lambda v: v > 0, "> 0"), "engine": (str, lambda v: v in ENGINES, f"one of {ENGINES}"),
    "batch": (int, lambda v: v > 0, "> 0"), "context": (int, lambda v: v >= 0, ">= 0"),
    "prefetch_mib": (float, lambda v: 0 < v <= MAX_MIB, f"in (0, {MAX_MIB}]"),
    "expert_slots": (int, lambda v: v > 0, "> 0"),
    "vmem_mib": (float, lambda v: 0 < v <= MAX_MIB, f"in (0, {MAX_MIB}]"),
    "routing_skew": (float, lambda v: 0 <= v <= MAX_SKEW, f"in [0, {MAX_SKEW:g}]"),
    "routing_correlation": (float, lambda v: 0 <= v <= 1, "in [0, 1]"),
    "draft_rows": (int, lambda v: v >= 0, ">= 0"), "acceptance_length": (float, lambda v: v >= 1, ">= 1"),
    "acceptance_prob": (float, lambda v: 0 <= v < 1, "in [0, 1)"), "draft_cost": (float, lambda v: v >= 0, ">= 0"),
    "hbm_gbps": (float, lambda v: v > 0, "> 0"), "link_latency_us": (float, lambda v: v >= 0, ">= 0"),
    "dma_sharing": (str, lambda v: v in DMA_SHARING, f"one of {DMA_SHARING}"),
    "steps_per_call": (int, lambda v: v > 0, "> 0"),
    # serving (perfmodel.serve): a point with a rate or a concurrency is a serving simulation
    "rate": (float, lambda v: v > 0, "> 0"), "concurrency": (int, lambda v: v > 0, "> 0"),
    "requests": (int, lambda v: 0 < v <= MAX_SERVE_REQUESTS, f"in 1..{MAX_SERVE_REQUESTS}"),
    "input_len": (int, lambda v: 0 < v <= limits.MAX_TOKENS, f"in 1..{limits.MAX_TOKENS}"),
    "output_len": (int, lambda v: 0 < v <= limits.MAX_TOKENS, f"in 1..{limits.MAX_TOKENS}"),
    "max_batch": (int, lambda v: v > 0, "> 0"), "max_tokens_per_step": (int, lambda v: v > 0, "> 0"),
    "prefill_chunk": (int, lambda v: v > 0, "> 0"), "prefill_devices": (int, lambda v: v > 0, "> 0"),
    "prefill_tp": (int, lambda v: v > 0, "> 0"), "prefill_ep": (int, lambda v: v > 0, "> 0"),
    "serve_seed": (int, lambda v: v >= 0, ">= 0"),
}
SERVE_TRAFFIC = ("rate", "concurrency")
# settings only a serving point uses, and settings a serving point has no use for (its scheduler
# decides each step's rows and their context; it runs a step per call and no draft rows)
SERVE_ONLY = ("requests", "input_len", "output_len", "max_batch", "max_tokens_per_step", "prefill_chunk",
              "prefill_devices", "prefill_tp", "prefill_ep", "serve_seed")
DECODE_ONLY = ("batch", "context", "steps_per_call", "draft_rows", "acceptance_length", "acceptance_prob",
               "draft_cost")
# latency constraints of serving designs: <metric>_<percentile>_s <= value
CONSTRAINTS = tuple(f"{m}_p{q}_s" for m in ("ttft", "tpot", "e2e") for q in (50, 90, 99))
TYPE_WORDS = {int: "an integer", float: "a number", str: "a string"}
DEFAULTS = {"model": "kimi-k3", "hardware": "tpu-v7", "devices": 32, "engine": "megakernel", "batch": 1,
            "context": 4096, "draft_rows": 0, "draft_cost": 0.05}
# settings the op graph depends on: a chunk is ordered by them so neighbours share one graph
GRAPH_SETTINGS = ("devices", "tp", "ep", "batch", "context", "draft_rows", "routing_skew",
                  "routing_correlation")


def check_setting(where: str, name: str, value):
    """`value` converted to the setting's type; a SpecError naming `where` otherwise."""
    require(name in SETTINGS, where, name, f"unknown setting; known: {', '.join(SETTINGS)}")
    if value is None:
        return None
    kind, ok, domain = SETTINGS[name]
    fits = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
    require(fits, where, value, f"{name} must be {TYPE_WORDS[kind]}")
    if kind is str:  # written to CSV / Parquet as UTF-8
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise SpecError(where, value, f"{name} must be UTF-8 text (it holds an undecodable byte)") from None
    try:
        v = kind(value)
    except OverflowError:
        raise SpecError(where, value, f"{name} must be a finite number") from None
    require(kind is not float or math.isfinite(v), where, value, f"{name} must be a finite number")
    require(ok is None or ok(v), where, value, f"{name} must be {domain}")
    return v


@dataclass(frozen=True)
class Range:
    """A numeric axis given by its bounds: `steps` values on a grid, or drawn uniformly at random
    (in log space when `log`)."""
    min: float
    max: float
    steps: int | None = None
    log: bool = False

    def grid(self, name: str) -> list:
        xs = (np.geomspace if self.log else np.linspace)(self.min, self.max, self.steps)
        return [_typed(name, x) for x in xs]


def _typed(name: str, x):
    return int(round(float(x))) if SETTINGS[name][0] is int else float(f"{x:.12g}")


@dataclass(frozen=True)
class Design:
    """`base` settings, and axes: a grid (every combination) or `samples` random draws."""
    base: dict
    axes: dict[str, list | Range]
    kind: str = "grid"            # grid or random
    samples: int = 0
    seed: int = 0
    source: str = "--vary"
    constraints: dict = field(default_factory=dict)  # serving: CONSTRAINTS name -> most seconds

    def __post_init__(self):
        for name, v in self.constraints.items():
            require(name in CONSTRAINTS, f"constraints.{name}", v, f"unknown constraint; known: {', '.join(CONSTRAINTS)}")
            require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
                    f"constraints.{name}", v, "must be a number of seconds > 0")
        serving = any(k in self.axes or self.base.get(k) is not None for k in SERVE_TRAFFIC)
        require(not self.constraints or serving, "constraints", ", ".join(self.constraints),
                "latency constraints need serving traffic: a rate or a concurrency (docs/sweep.md)")
        given = lambda k: k in self.axes or self.base.get(k) is not None
        for k in SERVE_ONLY if not serving else ():
            if given(k):
                self.refuse(k, "a serving setting: it needs traffic, a rate or a concurrency (a point without is "
                             "one decode step and would not use it)")
        for k in DECODE_ONLY if serving else ():
            if given(k) and (k != "draft_rows" or any(_values(self.axes.get(k, self.base.get(k))))):
                self.refuse(k, "a serving point does not use it: its scheduler sets each step's rows and their "
                             "context, one step per device call, without draft rows")
        for k in ("prefill_tp", "prefill_ep"):
            if given(k) and not given("prefill_devices"):
                self.refuse(k, "needs prefill_devices (a separate prefill pool); without it the point serves "
                             "aggregated and would not use it")
        drafts = self.axes.get("draft_rows", [self.base.get("draft_rows") or 0])
        if (drafts.max if isinstance(drafts, Range) else max(drafts)) > 0:
            require(given("acceptance_length") or given("acceptance_prob"), "acceptance_length", None,
                    "speculative decoding (draft_rows > 0) needs acceptance_length or acceptance_prob")

    def refuse(self, k: str, why: str) -> None:
        """SpecError naming setting `k` where the design gives it (an axis or the base)."""
        if self.source == "--vary":
            where = f"--vary {k}" if k in self.axes else f"--{k.replace('_', '-')}"
        else:
            where = f"{self.kind}.{k}" if k in self.axes else f"base.{k}"
        v = self.axes[k] if k in self.axes else self.base[k]
        raise SpecError(where, vars(v) if isinstance(v, Range) else v, why)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    @cached_property
    def columns(self) -> dict[str, list]:
        """The axis values of every point, one list per axis (the points themselves are never
        built as dicts: a design may hold millions)."""
        names = list(self.axes)
        if self.kind == "grid":
            n = math.prod(a.steps if isinstance(a, Range) else len(a) for a in self.axes.values())
            require(n <= MAX_POINTS, "sweep design", n, f"has more than {MAX_POINTS} points")
            require(n * len(names) <= MAX_CELLS, "sweep design", f"{n} points x {len(names)} axes",
                    f"more than {MAX_CELLS} values to hold; fewer axes or points")
            values = [a.grid(n) if isinstance(a, Range) else a for n, a in self.axes.items()]
            idx = np.indices([len(v) for v in values]).reshape(len(values), -1)
            return {name: [v[i] for i in ix.tolist()] for name, v, ix in zip(names, values, idx)}
        require(self.samples * len(names) <= MAX_CELLS, "sweep design", f"{self.samples} samples x {len(names)} axes",
                f"more than {MAX_CELLS} values to hold; fewer axes or samples")
        rng = np.random.default_rng(self.seed)
        cols = {}
        for name, a in self.axes.items():
            if isinstance(a, Range):
                lo, hi = (math.log(a.min), math.log(a.max)) if a.log else (a.min, a.max)
                x = rng.uniform(lo, hi, self.samples)
                cols[name] = [_typed(name, v) for v in (np.exp(x) if a.log else x).tolist()]
            else:
                cols[name] = [a[i] for i in rng.integers(0, len(a), self.samples).tolist()]
        return cols

    def settings(self, i: int) -> dict:
        """Point `i`'s full settings: the defaults, then the base, then its axis values."""
        s = DEFAULTS | self.base | {k: v[i] for k, v in self.columns.items()}
        if s.get("tp") is None:
            s["tp"] = s["devices"]
        return s

    def describe(self) -> dict:
        axes = {k: (vars(a) if isinstance(a, Range) else a) for k, a in self.axes.items()}
        out = {"source": self.source, "kind": self.kind, "base": self.base, "axes": axes}
        if self.constraints:
            out["constraints"] = self.constraints
        return out | ({"samples": self.samples, "seed": self.seed} if self.kind == "random" else {})


def _values(axis) -> list:
    """An axis' values (a range: its bounds)."""
    return [axis.min, axis.max] if isinstance(axis, Range) else list(axis) if isinstance(axis, list) else [axis]


def _axis(where: str, name: str, spec, kind: str) -> list | Range:
    if isinstance(spec, list):
        require(len(spec) > 0, where, spec, "needs at least one value")
        return [check_setting(where, name, v) for v in spec]
    require(isinstance(spec, dict), where, spec, "must be a list of values or a table {min, max, ...}")
    require(SETTINGS.get(name, (None,))[0] in (int, float), where, name, "only numeric settings take a range")
    known = {"min", "max", "steps", "log"} if kind == "grid" else {"min", "max", "log"}
    for k in spec:
        require(k in known, f"{where}.{k}", spec[k], f"unknown key; known: {', '.join(sorted(known))}")
    require("min" in spec and "max" in spec, where, spec, "a range needs min and max")
    lo, hi = check_setting(f"{where}.min", name, spec["min"]), check_setting(f"{where}.max", name, spec["max"])
    require(lo <= hi, f"{where}.max", hi, f"must be >= min ({lo})")
    log = spec.get("log", False)
    require(isinstance(log, bool), f"{where}.log", log, "must be true or false")
    require(not log or lo > 0, f"{where}.min", lo, "a log range needs min > 0")
    steps = None
    if kind == "grid":
        steps = spec.get("steps")
        require(isinstance(steps, int) and not isinstance(steps, bool) and steps > 0, f"{where}.steps", steps,
                "a grid range needs steps, a positive integer")
    return Range(float(lo), float(hi), steps, log)


def from_dict(data: dict, base: dict | None = None, source: str = "<dict>") -> Design:
    """A design from a sweep file's content; `base` (e.g. the CLI's flags) is overridden by the
    file's [base] table."""
    for k in data:
        require(k in ("base", "grid", "random", "constraints"), f"{source}: {k}", "",
                "unknown table; known: base, grid, random, constraints")
    require(("grid" in data) != ("random" in data), source, "", "needs exactly one of [grid] or [random]")
    for k in data:
        require(isinstance(data[k], dict), k, data[k], "must be a table")
    merged = dict(base or {})
    for k, v in data.get("base", {}).items():
        merged[k] = check_setting(f"base.{k}", k, v)
    if "grid" in data:
        kind, table = "grid", data["grid"]
        samples, seed = 0, 0
    else:
        kind, table = "random", dict(data["random"])
        samples, seed = table.pop("samples", None), table.pop("seed", 0)
        require(isinstance(samples, int) and not isinstance(samples, bool) and 0 < samples <= MAX_POINTS,
                "random.samples", samples, f"must be an integer in 1..{MAX_POINTS}")
        require(isinstance(seed, int) and not isinstance(seed, bool), "random.seed", seed, "must be an integer")
        if "axes" in table:
            require(len(table) == 1, "random", ", ".join(k for k in table if k != "axes"),
                    "axes go either in [random.axes] or directly in [random], not both")
            table = table["axes"]
    require(isinstance(table, dict) and table, kind, table, "needs at least one axis")
    axes = {name: _axis(f"{kind}.{name}", name, spec, kind) for name, spec in table.items()}
    return Design(merged, axes, kind, samples, seed, source, dict(data.get("constraints", {})))


def load(path: str, base: dict | None = None) -> Design:
    """A sweep file: .toml, or .yaml / .yml when PyYAML is installed."""
    p = check_path("--design", path)
    require(p.is_file(), "--design", path, "file not found")
    require(p.suffix in (".toml", ".yaml", ".yml"), "--design", path, "must be a .toml, .yaml or .yml file")
    data = schema.load(p, {"base": {"*": None}, "grid": {"*": None}, "random": {"*": None}, "constraints": {"*": None}},
                       "--design")
    with in_file(p):
        return from_dict(data, base, source=p.name)


@dataclass
class Chunk:
    """Configurations that share a model and a chip: point numbers and their full settings (and
    the design's latency constraints)."""
    model: str
    hardware: str
    points: list[int]
    settings: list[dict]
    constraints: dict = field(default_factory=dict)


def chunks(design: Design, size: int = 256) -> Iterator[Chunk]:
    """The design split by (model, hardware), each group ordered by the op-graph settings and cut
    into chunks of at most `size` points at op-graph boundaries where it can (whole runs of points
    sharing a graph per chunk, so no graph is built and simulated in two chunks; a run longer
    than `size` is cut); settings are built one chunk at a time."""
    require(isinstance(size, int) and size > 0, "--chunk", size, "must be a positive integer")
    fixed = DEFAULTS | design.base
    value = lambda name, i: design.columns[name][i] if name in design.columns else fixed[name]
    groups: dict[tuple, list[int]] = {}
    for i in range(len(design)):
        groups.setdefault((value("model", i), value("hardware", i)), []).append(i)
    varied = [[(v is None, v or 0) for v in design.columns[k]] for k in GRAPH_SETTINGS if k in design.columns]
    graph = list(zip(*varied)) if varied else [()] * len(design)  # each point's op-graph key
    for (model, hw), idx in groups.items():
        idx.sort(key=graph.__getitem__)
        for a, b in _cuts([graph[i] for i in idx], size):
            part = idx[a:b]
            yield Chunk(_ref(model), _ref(hw), part, [design.settings(i) for i in part], design.constraints)


def _cuts(keys: list, size: int) -> Iterator[tuple[int, int]]:
    """Consecutive [a, b) ranges of at most `size` items, ending where `keys` changes unless a
    run of equal keys alone exceeds `size` (then the run is cut every `size` items)."""
    a = 0
    while a < len(keys):
        b = min(a + size, len(keys))
        if b < len(keys) and keys[b] == keys[b - 1]:  # b would split a run: end before it
            start = b - 1
            while start > a and keys[start - 1] == keys[b - 1]:
                start -= 1
            b = start if start > a else b
        yield a, b
        a = b


def _ref(name: str) -> str:
    """A preset name as is; a file as an absolute path (a worker may run in another folder)."""
    p = Path(name)
    return str(p.resolve()) if p.suffix in (".toml", ".json") or p.is_dir() else name


def grid_from_vary(vary: list[tuple[str, list]], base: dict) -> Design:
    """`--vary AXIS=v1,v2 ...` as a grid design."""
    axes = {}
    for name, values in vary:
        require(name not in axes, "--vary", name, "given twice")
        axes[name] = [check_setting(f"--vary {name}", name, v) for v in values]
    n = math.prod(len(v) for v in axes.values())
    require(n <= MAX_VARY_POINTS, "--vary", f"{n} points",
            f"at most {MAX_VARY_POINTS} on the command line; larger designs go in a sweep file (--design)")
    return Design(dict(base), axes)
