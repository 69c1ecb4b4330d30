"""The traffic a serving simulation replays: how requests arrive and how long they are.

Arrivals: a Poisson process of `rate` requests per second, a closed loop of `concurrency`
clients (each sends its next request when its previous one completes), or the arrival times of
a trace file. Lengths (prompt tokens, generated tokens): fixed, uniform over an inclusive range,
or the rows of a trace file. Everything random is drawn from one seeded generator, so a seed
gives the same requests on any machine.

Trace files: CSV with a header, or JSON lines, one request per row: `input_len` and `output_len`
(Azure LLM inference trace names `ContextTokens` and `GeneratedTokens` are accepted too) and
optionally `arrival_s` (seconds from the start, non-decreasing).
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass

import numpy as np

from perfmodel.util import schema
from perfmodel.util.errors import SpecError, require
from perfmodel.util.files import read_text
from perfmodel.util.limits import MAX_REQUESTS, MAX_SIM_SECONDS, MAX_TOKENS
COLUMNS = {"input_len": ("input_len", "ContextTokens"), "output_len": ("output_len", "GeneratedTokens"),
           "arrival_s": ("arrival_s",)}


@dataclass(frozen=True)
class Lengths:
    """A length distribution: `lo` == `hi` fixed, else uniform over [lo, hi] (integers)."""
    lo: int
    hi: int

    def __post_init__(self):
        for v in (self.lo, self.hi):
            require(isinstance(v, int) and 1 <= v <= MAX_TOKENS, "length", v, f"must be an integer in [1, {MAX_TOKENS}]")
        require(self.lo <= self.hi, "length", f"{self.lo}:{self.hi}", "the range needs lo <= hi")

    @classmethod
    def parse(cls, text: str, field: str) -> "Lengths":
        """`N` (fixed) or `LO:HI` (uniform)."""
        lo, sep, hi = str(text).partition(":")
        try:
            a, b = int(lo), int(hi if sep else lo)
        except ValueError:
            raise SpecError(field, text, "expected N or LO:HI (integers)") from None
        try:
            return cls(a, b)
        except SpecError as e:
            raise SpecError(field, text, e.why) from None

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.lo == self.hi:
            return np.full(n, self.lo, np.int64)
        return rng.integers(self.lo, self.hi + 1, n)

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2

    def describe(self):
        return self.lo if self.lo == self.hi else {"uniform": [self.lo, self.hi]}


@dataclass(frozen=True)
class Trace:
    """The rows of a trace file."""
    path: str
    input_len: np.ndarray
    output_len: np.ndarray
    arrival_s: np.ndarray | None


@dataclass(frozen=True)
class Workload:
    """`requests` requests; arrivals by `rate` (Poisson) or `concurrency` (closed loop) or the
    trace's times; lengths from `input_len` / `output_len` or the trace's rows (cycled when
    `requests` exceeds them); drawn with `seed`."""
    requests: int
    input_len: Lengths | None = None
    output_len: Lengths | None = None
    rate: float | None = None
    concurrency: int | None = None
    trace: Trace | None = None
    seed: int = 0

    def __post_init__(self):
        require(isinstance(self.requests, int) and 1 <= self.requests <= MAX_REQUESTS, "requests",
                self.requests, f"must be an integer in [1, {MAX_REQUESTS}]")
        require(self.rate is None or self.concurrency is None, "rate", self.rate, "give --rate or --concurrency, not both")
        replay = self.trace is not None and self.trace.arrival_s is not None
        require(self.rate is not None or self.concurrency is not None or replay, "rate", None,
                "needs --rate (Poisson arrivals) or --concurrency (closed loop), or a trace with arrival_s")
        if self.rate is not None:
            require(isinstance(self.rate, (int, float)) and math.isfinite(self.rate) and self.rate > 0, "rate",
                    self.rate, "must be a finite number > 0 (requests per second)")
            span = self.requests / self.rate  # the arrivals' expected span
            require(span <= MAX_SIM_SECONDS, "rate", self.rate,
                    f"{self.requests} requests at {self.rate:g} per second arrive over about {span:.3g} s; the "
                    f"simulated clock keeps a step's precision up to {MAX_SIM_SECONDS:g} s: a higher rate or "
                    "fewer requests")
        if self.concurrency is not None:
            require(isinstance(self.concurrency, int) and self.concurrency > 0, "concurrency", self.concurrency,
                    "must be a positive integer")
        for name in ("input_len", "output_len"):
            require(self.trace is not None or getattr(self, name) is not None, name, None,
                    "needs a length (N or LO:HI) or a trace file")
        require(isinstance(self.seed, int), "seed", self.seed, "must be an integer")

    @property
    def arrivals(self) -> str:
        return "concurrency" if self.concurrency else "poisson" if self.rate else "trace"

    def draw(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(prompt tokens, generated tokens, arrival seconds or None for a closed loop), one
        entry per request."""
        rng = np.random.default_rng(self.seed)
        n = self.requests
        if self.trace is not None:
            idx = np.arange(n) % len(self.trace.input_len)
            inp = self.input_len.draw(rng, n) if self.input_len else self.trace.input_len[idx]
            out = self.output_len.draw(rng, n) if self.output_len else self.trace.output_len[idx]
        else:
            inp, out = self.input_len.draw(rng, n), self.output_len.draw(rng, n)
        if self.concurrency:
            return inp, out, None
        if self.rate:
            return inp, out, np.cumsum(rng.exponential(1.0 / self.rate, n))
        t = self.trace.arrival_s
        require(n <= len(t), "requests", n, f"the trace has arrival times for {len(t)} requests only")
        return inp, out, t[:n] - t[0]

    def describe(self) -> dict:
        out = {"requests": self.requests, "arrivals": self.arrivals, "rate": self.rate,
               "concurrency": self.concurrency, "seed": self.seed,
               "input_len": self.input_len.describe() if self.input_len else "trace",
               "output_len": self.output_len.describe() if self.output_len else "trace"}
        if self.trace is not None:
            out["trace"] = {"path": self.trace.path, "rows": len(self.trace.input_len)}
        return out


def read_trace(path: str) -> Trace:
    """A trace file (module doc), checked: positive integer lengths, finite non-decreasing
    arrival times."""
    text = read_text(path, "--trace")
    rows: list[dict] = []
    if str(path).endswith((".jsonl", ".json")):
        # one flat object a line: nesting bounded before any line is parsed
        require(not schema.too_deep(text, "json", 2), "--trace", path, "nested more than 2 deep: each line "
                "must be one flat JSON object")
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    r = json.loads(line)
                except ValueError as e:
                    raise SpecError("--trace", f"{path}:{i}", f"not a JSON object: {e}") from None
                require(isinstance(r, dict), "--trace", f"{path}:{i}", "each line must be a JSON object")
                rows.append(r)
                require(len(rows) <= MAX_REQUESTS, "--trace", path, f"more than {MAX_REQUESTS:,} requests (rows)")
    else:
        try:
            reader = csv.DictReader(io.StringIO(text))
            for r in reader:
                rows.append(r)
                require(len(rows) <= MAX_REQUESTS, "--trace", path, f"more than {MAX_REQUESTS:,} requests (rows)")
        except csv.Error as e:
            raise SpecError("--trace", path, f"not a CSV file: {e}") from None
    require(rows, "--trace", path, "holds no requests")
    cols = {}
    for key, names in COLUMNS.items():
        name = next((n for n in names if n in rows[0]), None)
        if name is None:
            require(key == "arrival_s", "--trace", path, f"needs a column {' or '.join(names)}")
            continue
        kind = float if key == "arrival_s" else int
        vals = []
        for i, r in enumerate(rows, 1):
            raw = r.get(name)
            try:  # a number as JSON gives it or as CSV text; never a bool, a list or an object
                x = float(raw) if isinstance(raw, (int, float, str)) and not isinstance(raw, bool) else math.nan
            except (ValueError, OverflowError):
                x = math.nan
            if kind is int:
                ok = math.isfinite(x) and x == int(x) and 1 <= x <= MAX_TOKENS
            else:
                ok = math.isfinite(x) and 0 <= x <= MAX_SIM_SECONDS
            require(ok, "--trace", f"{path} row {i}", f"{name} = {raw!r}: expected "
                    + (f"a number of seconds in [0, {MAX_SIM_SECONDS:g}]" if kind is float
                       else f"an integer in [1, {MAX_TOKENS}]"))
            vals.append(int(x) if kind is int else x)
        cols[key] = np.asarray(vals, float if kind is float else np.int64)
    t = cols.get("arrival_s")
    if t is not None:
        require(bool(np.all(np.diff(t) >= 0)), "--trace", path, "arrival_s must be non-decreasing")
    return Trace(str(path), cols["input_len"], cols["output_len"], t)
