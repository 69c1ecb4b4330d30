"""GPU decode kernels costed from measured kernel tables where they reach, physics where not.

Tables (perfmodel/data/kernels/<gpu>/<engine>.npz, imported from NVIDIA aiconfigurator-core by
experiments/import_kernel_tables.py) hold one kernel's latency over a regular grid of its own
axes (GEMM: m, n, k; grouped MoE: tokens; decode attention: batch, context; ...), keyed by the
discrete fields (dtype, geometry, layout). `table_time` interpolates log-latency multilinearly in
log axes, only inside the grid and only where every corner was measured.

The physical kernel component (`physical_time`) is one formula per class, fitted per GPU, engine
and class to the same tables by `perfmodel calibrate --kernels` (`fit_kernels`; the fitted
parameters and their residuals are perfmodel/data/kernels/<gpu>/fit.json):
  compute kernels:  fixed_s + max(bytes / achieved bandwidth, FLOPs / achieved rate)
  collectives:      fixed_s + (ranks - 1) x per-peer + bus bytes / achieved bus bandwidth
Where no fit covers a GPU, the hardware file's generic components stand in (kernel_fixed_s,
kernel_bandwidth_efficiency, kernel_flops_efficiency, allreduce_*), labelled by their sources.
"""
from __future__ import annotations

import io
import itertools
import math
import re
import zlib
from bisect import bisect_left
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from perfmodel.util import checked, schema
from perfmodel.util.checks import MAX_INT, STR, ListOf, Num, Req
from perfmodel.util.errors import SpecError, in_file, require
from perfmodel.util.files import as_text, read_bytes

KERNEL_DIR = Path(__file__).parents[1] / "data" / "kernels"
COMM = ("all_reduce", "mnnvl", "nccl", "a2a")  # mnnvl: a multi-node NVLink (multicast) collective
UNITS = ("attention", "mla_core", "mla_module")  # classes whose reads split over sequences (x heads)
BYTES_PER_VALUE = {"bf16": 2.0, "fp16": 2.0, "f32": 4.0, "fp8": 1.0, "fp8-block128": 1.0 + 4 / 16384,
                   "fp8-kv": 1.0, "int8": 1.0, "int4": 0.5 + 2 / 32, "mxfp4": 0.5 + 1 / 32,
                   "mxfp4-a8": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16, "fp4": 0.5 + 1 / 16}
MLA_GEOMETRY = {"q_lora": 1536, "kv_lora": 512, "nope": 128, "rope": 64, "v": 128, "hidden": 7168}
# the MLA tables' model (DeepSeek-V3, per head); Kimi K2 / K3 share it per head
# MoE table geometries, by (experts, top-k, hidden), whose model routes by grouped top-k: (groups,
# groups kept). DeepSeek-V3 / R1 config.json: n_group = 8, topk_group = 4
GROUPED_ROUTING = {(256, 8, 7168): (8, 4)}


@dataclass
class Table:
    """One measured kernel table: its class, file and key, and its log latencies over the log grid
    of its axes."""
    cls: str
    file: str
    key: dict
    axes: list[str]
    grid: list[np.ndarray]      # log of each axis' values
    values: np.ndarray          # log latency (s), nan where not measured
    raw_axes: dict

    def points(self):
        """(axis point, latency_s) for every measured cell."""
        shape = [len(g) for g in self.grid]
        for idx in np.ndindex(*shape):
            v = self.values[idx]
            if not np.isnan(v):
                yield {a: self.raw_axes[a][i] for a, i in zip(self.axes, idx)}, float(np.exp(v))


@dataclass
class Tables:
    """One GPU and engine's tables; a class's index is read from the file's bytes when first asked
    for (and kept, checked, beside the checks: perfmodel.util.checked.kept), and a table's grid
    only once a lookup's key matches it."""
    gpu: str
    engine: str
    version: dict[str, str]        # file -> framework version
    source: str
    fastest_kernel_s: float | None  # the fastest compute kernel of these tables (a small kernel's floor)
    classes: list[str]
    data: bytes = field(repr=False)  # the file's bytes as read
    path: Path = Path()
    doc: dict = field(default_factory=dict)                   # the file's header (provenance)
    content: str | None = None    # the name of the file's bytes (perfmodel.util.checked)
    index: dict[str, dict] = field(default_factory=dict)      # class -> its index, once read
    values: dict[str, np.ndarray] = field(default_factory=dict)  # class -> its log latencies, once read
    built: dict[tuple[str, int], Table] = field(default_factory=dict)
    grouped: dict[tuple, tuple[int, int] | None] = field(default_factory=dict)  # grouped_routing, once per kernel

    def _index(self, cls: str) -> dict:
        if cls not in self.index:
            if cls in self.classes:
                ix, values = checked.kept(self.content, f"class {cls}", lambda: _read_class(self.data, self.path, cls))
            else:
                ix, values = {"files": [], "fields": [], "axes": [], "grids": [], "tables": []}, b""
            self.index[cls], self.values[cls] = ix, np.frombuffer(values)
        return self.index[cls]

    def _table(self, cls: str, i: int) -> Table:
        if (cls, i) not in self.built:
            ix = self._index(cls)
            file, _, grids, offset = ix["tables"][i]
            raw = {a: ix["grids"][g] for a, g in zip(ix["axes"], grids)}
            shape = [len(raw[a]) for a in ix["axes"]]
            flat = self.values[cls][offset:offset + math.prod(shape)]
            self.built[cls, i] = Table(cls, ix["files"][file], dict(zip(ix["fields"], ix["tables"][i][1])), list(ix["axes"]),
                                       [np.log(np.array(raw[a], float)) for a in ix["axes"]], flat.reshape(shape), raw)
        return self.built[cls, i]

    def of_class(self, cls: str) -> list[Table]:
        return [self._table(cls, i) for i in range(len(self._index(cls)["tables"]))]

    def find(self, cls: str, key: dict, kernel: str = "") -> list[Table]:
        """The tables of `cls` whose key matches `key` (and whose kernel source contains `kernel`)."""
        ix = self._index(cls)
        fields, rows = ix["fields"], ix["tables"]
        if not set(key) <= set(fields) or kernel and "kernel_source" not in fields:
            return []
        hit = range(len(rows))
        for f, v in key.items():   # field by field: few rows are left after the first
            j = fields.index(f)
            hit = [i for i in hit if rows[i][1][j] == v]
        if kernel:
            src = fields.index("kernel_source")
            hit = [i for i in hit if kernel.lower() in str(rows[i][1][src]).lower()]
        return [self._table(cls, i) for i in hit]


# A table file (.npz: numpy arrays, never pickled objects) through the schema layer: its header
# `index` (JSON bytes), per class `index.<class>` (JSON bytes) and `log_s.<class>` (floats).
NAME = re.compile(r"[a-z0-9_]{1,64}")  # a GPU, table or class name: a path component of ours
HEADER = {"files": Req({"*": {"version": Req((STR,)), "*": None}}), "source": Req((STR,)),
          "fastest_kernel_s": Req(Num(0, 1, lo_open=True, null=True)), "classes": Req(ListOf((STR,), 0, 64)), "*": None}
CLASS_INDEX = {"files": Req([(STR,)]), "fields": Req([(STR,)]), "axes": Req([(STR,)]),
               "grids": Req([ListOf(None, 1)])}   # grids and "tables" (thousands of rows): below


def _data_errors() -> tuple:
    """What reading a table file's arrays raises when they are missing, truncated, corrupt or
    pickled (allow_pickle is off)."""
    import zipfile   # here: a file whose classes were all kept before is never opened as a zip
    return KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error


def _open(data: bytes, path: Path):
    """The arrays of a table file's bytes (numpy's .npz reader, each array read when asked for)."""
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except _data_errors() as e:
        raise SpecError("kernel table", str(path), f"not a table file ({type(e).__name__}: {str(e)[:120]})") from None


def _array(npz, key: str, path: Path) -> np.ndarray:
    """Array `key` of a table file, or a SpecError naming the file and the key."""
    try:
        return npz[key]
    except _data_errors() as e:
        raise SpecError(key, "<array>", f"unreadable ({type(e).__name__}: {str(e)[:120]})", file=str(path)) from None


def _json_array(npz, key: str, path: Path):
    """A table file's JSON array `key` (uint8 bytes), parsed through the schema layer."""
    raw = _array(npz, key, path)
    require(raw.dtype == np.uint8 and raw.ndim == 1, key, str(raw.dtype), "must be UTF-8 JSON as a 1-D uint8 array")
    try:
        text = raw.tobytes().decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(key, "<bytes>", "not UTF-8 text", file=str(path)) from None
    return schema.parse(text, "json", key, path)


def _read_header(data: bytes, path: Path) -> dict:
    """A table file's header (`index`), checked: HEADER, and each class's arrays in the file."""
    npz = _open(data, path)
    doc = _json_array(npz, "index", path)
    with in_file(path):
        schema.check_tree({"index": doc}, {"index": HEADER})  # errors name index.<key>
        for c in doc["classes"]:
            require(NAME.fullmatch(c) is not None, "index.classes", c, "must be a class name (letters, digits, _)")
            for key in (f"index.{c}", f"log_s.{c}"):
                require(key in npz.files, "index.classes", c, f"the file holds no {key}")
    return doc


def _read_class(data: bytes, path: Path, cls: str) -> tuple[dict, bytes]:
    """A class of a table file, checked: its index (each table's row a tuple: thousands of rows the
    garbage collector need not track) and its log latencies (float64 bytes)."""
    npz = _open(data, path)
    ix = _json_array(npz, f"index.{cls}", path)
    values = _array(npz, f"log_s.{cls}", path)
    with in_file(path):
        require(values.ndim == 1 and values.dtype.kind == "f", f"log_s.{cls}", str(values.dtype),
                "must be a 1-D array of floats")
        check_class_index(cls, ix, len(values))
    ix["tables"] = [(file, tuple(key), tuple(grids), offset) for file, key, grids, offset in ix["tables"]]
    return ix, values.astype(float).tobytes()


def check_class_index(cls: str, ix, n_values: int) -> None:
    """A class index (`index.<class>`) of a table file: its lists, and each table's file, key,
    grids and place in `log_s.<class>` (n_values floats) within them."""
    head = {k: v for k, v in ix.items() if k != "tables"} if isinstance(ix, dict) else ix
    schema.check_tree({f"index.{cls}": head}, {f"index.{cls}": CLASS_INDEX})  # errors name index.<class>.<key>
    require(isinstance(ix.get("tables"), list), f"index.{cls}.tables", ix.get("tables"),
            "required, a list of [file, key, grids, offset]")
    for g, grid in enumerate(ix["grids"]):   # as arrays: a CLI call reads thousands of grid points
        a = np.asarray(grid)
        require(a.ndim == 1 and a.dtype.kind in "iuf" and bool((a > 0).all()), f"index.{cls}.grids[{g}]",
                grid[:8], "must be a list of numbers > 0")
        require(bool((a[1:] > a[:-1]).all()), f"index.{cls}.grids[{g}]", grid[:8],
                "must be strictly increasing")
    n_files, n_fields, n_axes, n_grids = (len(ix[k]) for k in ("files", "fields", "axes", "grids"))
    for i, t in enumerate(ix["tables"]):
        where = f"index.{cls}.tables[{i}]"
        require(isinstance(t, list) and len(t) == 4, where, t, "must be [file, key, grids, offset]")
        file, key, grids, offset = t
        require(type(file) is int and 0 <= file < n_files, f"{where}[0]", file, f"must be a file number < {n_files}")
        require(isinstance(key, list) and len(key) == n_fields and
                all(type(v) is str or type(v) is int and abs(v) <= MAX_INT or type(v) is float and math.isfinite(v)
                    for v in key), f"{where}[1]", key, f"must be {n_fields} field values (strings or finite numbers)")
        require(isinstance(grids, list) and len(grids) == n_axes and
                all(type(g) is int and 0 <= g < n_grids for g in grids), f"{where}[2]", grids,
                f"must be {n_axes} grid numbers < {n_grids}")
        size = math.prod(len(ix["grids"][g]) for g in grids)
        require(type(offset) is int and 0 <= offset and offset + size <= n_values, f"{where}[3]", offset,
                f"must place its {size} cells within log_s.{cls} ({n_values} values)")


@lru_cache(maxsize=None)
def tables(gpu: str, engine: str) -> Tables | None:
    """The imported tables of one GPU and engine (`nccl` for the NCCL collectives), or None;
    read through the schema layer (HEADER; each class's index when first used), once per content
    of the file (perfmodel.util.checked.kept)."""
    if not gpu:
        return None
    require(NAME.fullmatch(gpu) is not None, "gpu", gpu, "must be a GPU name (letters, digits, _)")
    require(NAME.fullmatch(engine) is not None, "kernel_tables", engine, "must be a table name (letters, digits, _)")
    path = KERNEL_DIR / gpu / f"{engine}.npz"
    if not path.exists():
        return None
    data = read_bytes(path, "kernel table")
    content = checked.content(data)
    doc = checked.kept(content, "header", lambda: _read_header(data, path))
    return Tables(gpu, engine, {f: m["version"] for f, m in doc["files"].items()}, doc["source"],
                  doc["fastest_kernel_s"], doc["classes"], data, path, doc, content=content)


def provenance(gpu: str, engine: str) -> dict:
    """A table file's header: source, licence, importer, units and files with their versions."""
    t = tables(gpu, engine)
    return dict(t.doc) if t else {}


@lru_cache(maxsize=None)
def gpus_with_tables() -> list[str]:
    return sorted(p.name for p in KERNEL_DIR.iterdir() if p.is_dir()) if KERNEL_DIR.exists() else []


def interpolate(t: Table, point: dict) -> float | None:
    """Multilinear interpolation of log latency in log axes; None outside the grid or where a
    corner was not measured. Scalar by scalar (numpy's per-call overhead would be most of it)."""
    lo, w = [], []
    for a, g in zip(t.axes, t.grid):
        x = math.log(max(point[a], 1e-30))
        if x < g[0] - 1e-9 or x > g[-1] + 1e-9:
            return None
        if len(g) == 1:
            lo.append(0), w.append(0.0)
            continue
        i = min(max(bisect_left(g, x) - 1, 0), len(g) - 2)
        lo.append(i), w.append(float(min(max((x - g[i]) / (g[i + 1] - g[i]), 0.0), 1.0)))
    total = 0.0
    for corner in itertools.product((0, 1), repeat=len(lo)):
        weight = math.prod(wi if c else 1 - wi for c, wi in zip(corner, w))
        if weight == 0.0:
            continue
        v = t.values[tuple(i + c for i, c in zip(lo, corner))]
        if math.isnan(v):
            return None
        total += weight * v
    return math.exp(total)


def table_time(tabs: Tables | None, cls: str, key: dict, point: dict, kernel: str = "") -> tuple[float, Table] | None:
    """The first table of `cls` matching `key` (and `kernel`, part of its kernel source) that
    reaches `point`: (seconds, table)."""
    if tabs is None:
        return None
    for t in tabs.find(cls, key, kernel):
        v = interpolate(t, point)
        if v is not None:
            return v, t
    return None


# ---- the physical kernel component ---------------------------------------------------------

def rank_share(tokens, topk: int, experts: int, ep: int):
    """(distinct experts, routed pairs) of one expert-parallel rank of a grouped MoE kernel: the
    batch's tokens x top-k pairs spread evenly over the ranks, but never less than one pair (and
    one expert) while the batch routes any: the tables' balanced routing gives rank 0 expert 0's
    pick at every EP degree (aiconfigurator's `balanced_logits`), and a deployment's busiest rank
    holds at least one. Scalars or arrays."""
    pairs = tokens * topk
    floor = np.minimum(pairs, 1.0)
    return np.maximum(np.minimum(experts, pairs) / ep, floor), np.maximum(pairs / ep, floor)


def grouped_routing(tabs: Tables, t: Table) -> tuple[int, int] | None:
    """(groups, groups kept) when MoE table `t` timed its kernel routing the collector's balanced
    logits by its model's grouped top-k, else None. The collector's logits give each token one
    pick per stride of experts and tie every other expert (`balanced_logits`: softmax of the
    picks' one-hot counts); a kernel that routes them itself by DeepSeek-V3's grouped top-k (each
    group scored by its top two, the best 4 of 8 kept) finds every group tied and keeps groups 0-3
    (experts 0-127), then the tied experts of lowest index: rank 0 of EP 2 holds every pick. Read
    from the tables: such a kernel's one-token cell at EP 2 is its EP 1 cell (B200 vLLM fp8:
    81 / 82 us), where a kernel given the picks takes about half (B200 TensorRT-LLM DeepGEMM:
    110 / 194 us); within 10 % counts as equal. Read at TP 1 for every TP of the same kernel
    source, dtype and geometry (the routing is the kernel's)."""
    k = t.key
    geometry = GROUPED_ROUTING.get((k.get("experts"), k.get("topk"), k.get("hidden")))
    if t.cls != "moe" or geometry is None:
        return None
    kernel = tuple(sorted((f, v) for f, v in k.items() if f not in ("tp", "ep")))
    if kernel not in tabs.grouped:
        one = {}
        for ep in (1, 2):
            for u in tabs.find("moe", {**k, "tp": 1, "ep": ep}):
                one |= {ep: v for p, v in u.points() if p.get("tokens") == 1}
        tabs.grouped[kernel] = geometry if len(one) == 2 and one[2] >= 0.9 * one[1] else None
    return tabs.grouped[kernel]


@lru_cache(maxsize=4096)
def collector_share(tokens: int, topk: int, experts: int, ep: int, groups: int, kept: int) -> tuple[float, float]:
    """(distinct experts, routed pairs) on rank 0 (experts below experts / ep) when a kernel routes
    the collector's balanced logits for `tokens` tokens by grouped top-k (`grouped_routing`): per
    token the `kept` groups of highest top-two sum, then its `topk` best experts among them, ties
    to the lower index (the order the tables show: at one token rank 0 holds 8 picks at EP 2, 6 at
    EP 4, 5 at EP 8 to 32, 4 at EP 64)."""
    stride = math.ceil(experts / topk)
    t, i = np.arange(tokens)[:, None], np.arange(topk)[None, :]
    hot = (t + i * stride) % experts if tokens >= stride else ((t * stride / tokens + i * stride) % experts).astype(int)
    counts = np.zeros((tokens, experts))
    np.add.at(counts, (np.repeat(np.arange(tokens), topk), hot.ravel()), 1.0)
    per = experts // groups
    top2 = -np.sort(-counts.reshape(tokens, groups, per), axis=2)[:, :, :2].sum(2)
    best = np.argsort(-top2, axis=1, kind="stable")[:, :kept]
    allowed = np.zeros((tokens, groups), bool)
    np.put_along_axis(allowed, best, True, axis=1)
    scores = np.where(np.repeat(allowed, per, axis=1), counts, -np.inf)
    picks = np.argsort(-scores, axis=1, kind="stable")[:, :topk]
    local = picks[picks < experts // ep]
    return float(len(np.unique(local))), float(local.size)


def moe_share(key: dict, tokens):
    """(distinct experts, routed pairs) of the rank a MoE kernel of `key` runs for: as the collector
    routed the cells where the key says they were routed by grouped top-k (`key["routing"]`,
    collector_share), else the even share (rank_share)."""
    if key.get("routing"):
        return collector_share(int(tokens), key["topk"], key["experts"], key["ep"], *key["routing"])
    return rank_share(tokens, key["topk"], key["experts"], key["ep"])


def features(cls: str, key: dict, point: dict) -> tuple[float, float, float]:
    """(bytes moved, FLOPs, ranks) of one table cell or one engine kernel, by class. Collectives:
    (bus bytes per rank, 0, ranks)."""
    bpv = lambda dt: BYTES_PER_VALUE.get(dt, 2.0)
    if cls == "gemm":
        m, n, k = point["m"], point["n"], point["k"]
        return n * k * bpv(key["dtype"]) + 2.0 * m * (n + k), 2.0 * m * n * k, 1
    if cls == "moe":
        distinct, pairs = moe_share(key, point["tokens"])
        per_expert = 3.0 * key["hidden"] * key["inter"] / key["tp"]
        return (distinct * per_expert * bpv(key["dtype"]) + 2.0 * pairs * (2 * key["hidden"] + key["inter"] / key["tp"]),
                2.0 * pairs * per_expert, 1)
    if cls == "attention":
        b, L = point["batch"], point["context"]
        kvb = 2.0 * b * L * key["kv_heads"] * key["head_dim"] * bpv(key["kv_dtype"])
        return kvb, 4.0 * b * key["heads"] * key["head_dim"] * L, 1
    if cls in ("mla_module", "mla_core"):
        g, h, b, L = MLA_GEOMETRY, point["heads"], point["batch"], point["context"]
        cache = b * L * (g["kv_lora"] + g["rope"]) * bpv(key["kv_dtype"])
        flops = b * h * L * (4.0 * g["kv_lora"] + 2.0 * g["rope"])
        if cls == "mla_core":
            return cache, flops, 1
        w = h * (g["q_lora"] * (g["nope"] + g["rope"]) + g["kv_lora"] * (g["nope"] + g["v"]) + g["v"] * g["hidden"])
        return cache + w * bpv(key.get("dtype", "bf16")), flops + 2.0 * b * w, 1
    if cls == "mla_bmm":
        w = point["heads"] * MLA_GEOMETRY["nope"] * MLA_GEOMETRY["kv_lora"]
        return w * bpv(key.get("dtype", "bf16")), 2.0 * point["tokens"] * w, 1
    if cls == "kda":
        b, hk, d = point["batch"], point["heads"], key.get("head_k_dim", 128)
        state = 2.0 * b * hk * d * d * 4  # f32 recurrent state read and written
        conv = 2.0 * b * 3 * hk * d * 4 * 2  # conv state (width 4, bf16) of q, k, v
        kernel = key.get("kernel", "")
        if kernel.startswith("causal_conv1d"):
            return conv, 8.0 * b * 3 * hk * d, 1
        return state + (conv if kernel == "fused_kda_decode" else 0.0), 7.0 * b * hk * d * d, 1
    if cls in COMM:
        r = point.get("ranks") or key.get("ep") or 1
        if cls == "a2a":  # each token's hidden state to (and back from) its top-k ranks
            return point["tokens"] * key["topk"] * key["hidden"] * 2.0, 0.0, r
        return 2.0 * (r - 1) / r * point["bytes"], 0.0, r
    if cls == "elementwise":
        return point["bytes"], point.get("flops", 0.0), 1
    raise SpecError("kernel class", cls, "no physical model")


PARAMS = {"gemm": ("fixed_s", "bytes_per_s", "flops_per_s", "min_n", "min_k", "tile_n", "tile_bytes_per_s", "overlap"),
          "moe": ("fixed_s", "bytes_per_s", "flops_per_s", "per_expert_s", "overlap", "per_pair_s"),
          "comm": ("fixed_s", "per_peer_s", "bytes_per_s"),
          "attention": ("fixed_s", "bytes_per_s", "flops_per_s", "min_units", "per_unit_s"),
          "mla_core": ("fixed_s", "bytes_per_s", "flops_per_s", "min_units", "per_unit_s"),
          "mla_module": ("fixed_s", "bytes_per_s", "flops_per_s", "min_units", "per_unit_s"),
          "kernel": ("fixed_s", "bytes_per_s", "flops_per_s")}


def param_names(cls: str) -> tuple[str, ...]:
    return PARAMS["comm" if cls in COMM else cls if cls in PARAMS else "kernel"]


def shape(cls: str, key: dict, point: dict) -> dict:
    """What the physical model of `cls` reads of one kernel: bytes, FLOPs, ranks and, for a GEMM,
    its m, n, k and bytes per weight; for a MoE kernel the distinct experts per rank."""
    b, f, r = features(cls, key, point)
    out = {"bytes": b, "flops": f, "ranks": r}
    if cls == "gemm":
        out |= {"m": point["m"], "n": point["n"], "k": point["k"], "bpv": BYTES_PER_VALUE.get(key["dtype"], 2.0)}
    if cls == "moe":
        out["experts"] = moe_share(key, point["tokens"])[0]
        out["pairs"] = point["tokens"] * key["topk"]  # of the whole batch, whichever rank holds the expert
    if cls in UNITS:  # cached sequences x KV heads the kernel splits its reads over
        units = point["batch"] * (key["kv_heads"] if cls == "attention" else 1)
        out |= {"units": units, "cache": features(cls, key, {**point, "heads": 0} if cls == "mla_module" else point)[0]
                if cls != "mla_module" else point["batch"] * point["context"] * (MLA_GEOMETRY["kv_lora"] + MLA_GEOMETRY["rope"])
                * BYTES_PER_VALUE.get(key["kv_dtype"], 2.0)}
    return out


def _overlapped(a, b, overlap):
    """Loads taking `a` seconds and math taking `b` that overlap only partly: their p-norm,
    p = 1 + overlap (overlap 0: they add up; large: the slower one alone, a roofline)."""
    q = 1.0 + overlap
    top = np.maximum(np.maximum(a, b), 1e-300)  # scaled by the larger, so no power overflows
    return top * ((a / top) ** q + (b / top) ** q) ** (1 / q)


def physical_time(params: dict, cls: str, s: dict):
    """The physical component of one kernel (or arrays of them) of class `cls` and shape `s`
    (`shape`) from its fitted `params`:
      GEMM:        fixed + overlapped((max(n, min_n) max(k, min_k) bytes/weight + activations) / stream,
                                      2 m max(n, min_n) k / rate)  -- a kernel streams no fewer
                   columns and rows than its smallest partition (its tile / split), whatever the
                   matrix; stream = min(bandwidth, max(n / tile_n, 1) x tile_bytes_per_s): a matrix
                   of few column tiles runs on as few SMs, each streaming its tile at most that fast;
      grouped MoE: fixed + distinct experts x per_expert + overlapped(bytes / bandwidth, FLOPs / rate)
                   + pairs x per_pair; pairs: the whole batch's tokens x top-k,
                   which the kernel sorts and launches blocks for whichever rank holds their expert
                   (expert parallelism divides the bytes and math, not these);
      attention / MLA: as others, the cache read at least as if min_units sequence-heads were
                   read (a decode kernel splits its reads over sequences and KV heads);
      collectives: fixed + (ranks - 1) x per_peer + bus bytes / bus bandwidth;
      others:      fixed + max(bytes / bandwidth, FLOPs / rate);
    overlapped(loads, math) = (loads^q + math^q)^(1/q), q = 1 + overlap: loads and math overlap
    only partly (overlap 0 adds them, a large one is the roofline's max; a weight-only int4 GEMM
    dequantises what it loads before its math)."""
    p = params
    if cls in COMM:
        return p["fixed_s"] + np.maximum(s["ranks"] - 1, 0) * p["per_peer_s"] + s["bytes"] / p["bytes_per_s"]
    if cls == "gemm":
        n, k, m = np.maximum(s["n"], p["min_n"]), np.maximum(s["k"], p["min_k"]), s["m"]
        stream = np.minimum(p["bytes_per_s"], np.maximum(s["n"] / p["tile_n"], 1.0) * p["tile_bytes_per_s"])
        return p["fixed_s"] + _overlapped((n * k * s["bpv"] + 2.0 * m * (s["n"] + s["k"])) / stream,
                                          2.0 * m * n * s["k"] / p["flops_per_s"], p["overlap"])
    nbytes = s["bytes"]
    if cls in UNITS:  # too few sequence-heads to keep every SM streaming: the reads of min_units
        nbytes = nbytes + s["cache"] * (np.maximum(s["units"], p["min_units"]) / s["units"] - 1)
    if cls == "moe":
        t = p["fixed_s"] + _overlapped(nbytes / p["bytes_per_s"], s["flops"] / p["flops_per_s"], p["overlap"])
    else:
        t = p["fixed_s"] + np.maximum(nbytes / p["bytes_per_s"], s["flops"] / p["flops_per_s"])
    if cls in UNITS:  # each sequence-head's partial results combined (split-KV reduction, bookkeeping)
        t = t + s["units"] * p["per_unit_s"]
    return t + s["experts"] * p["per_expert_s"] + s["pairs"] * p["per_pair_s"] if cls == "moe" else t


GEOMETRY = {"attention": ("heads", "kv_heads", "head_dim"), "moe": ("hidden", "inter", "topk", "experts")}
BY_KERNEL = ("attention", "moe", "all_reduce")  # classes one engine ships several kernels of


def fit_group(cls: str, key: dict, pooled: bool = False) -> str:
    """The fit a table (or kernel) of `cls` and `key` belongs to: class, (weight / cache) dtype,
    for attention and MoE the model geometry (not with `pooled`: one fit over every geometry, for
    a geometry no table has), and the kernel source where an engine ships several."""
    kind = key.get("dtype") or key.get("kv_dtype") or key.get("kernel") or key.get("op_name") or key.get("phase") or ""
    parts = [cls, kind]
    if cls in GEOMETRY and not pooled:
        parts.append("-".join(f"{a}{key[a]}" for a in GEOMETRY[cls]))
    if cls in BY_KERNEL and key.get("kernel_source"):
        parts.append(key["kernel_source"])
    return "/".join(parts)


# the fitted parameters physical_time reads, by class (a group is "<class>/..."), each > 0 where
# it divides and >= 0 otherwise
FIT_PARAMS = {"comm": ("fixed_s", "per_peer_s", "bytes_per_s"),
              "gemm": ("fixed_s", "bytes_per_s", "flops_per_s", "min_n", "min_k", "tile_n", "tile_bytes_per_s",
                       "overlap"),
              "moe": ("fixed_s", "bytes_per_s", "flops_per_s", "overlap", "per_expert_s", "per_pair_s"),
              "units": ("fixed_s", "bytes_per_s", "flops_per_s", "min_units", "per_unit_s"),
              "other": ("fixed_s", "bytes_per_s", "flops_per_s")}
DIVISORS = ("bytes_per_s", "flops_per_s", "tile_n", "tile_bytes_per_s")
FIT_GROUPS = {"*": {"cells": Req(Num(0, integer=True)), "*": None}}   # one engine's groups


@lru_cache(maxsize=None)
def _fit_file(gpu: str) -> tuple[Path, bytes, str] | None:
    """perfmodel/data/kernels/<gpu>/fit.json: its path, bytes and the name of its content
    (perfmodel.util.checked); None when there is none."""
    if not gpu:
        return None
    require(NAME.fullmatch(gpu) is not None, "gpu", gpu, "must be a GPU name (letters, digits, _)")
    path = KERNEL_DIR / gpu / "fit.json"
    if not path.exists():
        return None
    raw = read_bytes(path, "kernel table")
    return path, raw, checked.content(raw)


@lru_cache(maxsize=None)
def _fit_engines(gpu: str) -> dict:
    """A fit file's engines, unchecked; the rest of the file checked through the schema layer."""
    path, raw, _ = _fit_file(gpu)
    data = schema.parse(as_text(raw, "kernel table", path), "json", "kernel table", path)
    require(isinstance(data, dict), "kernel table", str(path), "must hold an object at the top")
    with in_file(path):
        engines = data.get("engines")
        require(isinstance(engines, dict) and all(isinstance(v, dict) for v in engines.values()),
                "engines", None, "required, a table of engines, each a table of fit groups")
        schema.check_tree({k: v for k, v in data.items() if k != "engines"}, None, "file")
    return engines


@lru_cache(maxsize=None)
def fit_engines(gpu: str) -> list[str]:
    """The engines `gpu`'s fit file holds fits of."""
    f = _fit_file(gpu)
    return checked.kept(f[2], "fit engines", lambda: sorted(_fit_engines(gpu))) if f else []


@lru_cache(maxsize=None)
def engine_fits(gpu: str, engine: str) -> dict:
    """One engine's fits in perfmodel/data/kernels/<gpu>/fit.json: {group: params} ({} when
    none), checked (FIT_GROUPS, and the parameters its class needs) and kept per engine (a command
    line asks for one engine of a file of several), once per content of the file."""
    f = _fit_file(gpu)

    def read():
        groups = _fit_engines(gpu).get(engine, {})
        with in_file(f[0]):
            schema.check_tree(groups, FIT_GROUPS, f"engines.{engine}", 1)
            for group, p in groups.items():
                cls = group.split("/")[0]
                kind = "comm" if cls in COMM else cls if cls in ("gemm", "moe") else "units" if cls in UNITS else "other"
                for name in FIT_PARAMS[kind]:
                    v = p.get(name)
                    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v > 0 if name in DIVISORS else v >= 0)
                    require(ok, f"engines.{engine}.{group}.{name}", v,
                            "required, a number " + ("> 0" if name in DIVISORS else ">= 0"))
        return groups
    return checked.kept(f[2], f"fit engine {engine}", read) if f else {}


def forget_fits() -> None:
    """Drop the fit files read so far (after one is rewritten)."""
    for cache in (_fit_file, _fit_engines, fit_engines, engine_fits):
        cache.cache_clear()


def fitted_params(gpu: str, engine: str, cls: str, key: dict, kernel: str = "") -> tuple[dict, str] | None:
    """The fitted physical parameters for a kernel of `cls` and `key` on one GPU and engine: the
    fit of its own geometry (any kernel source containing `kernel`), else the pooled fit of its
    class and dtype; of several, the one with the most cells. Returns (params, which fit)."""
    groups = engine_fits(gpu, engine)
    for prefix in (fit_group(cls, key), fit_group(cls, key, pooled=True)):
        same = sorted((p["cells"], g) for g, p in groups.items()
                      if (g == prefix or g.startswith(prefix + "/")) and kernel.lower() in g[len(prefix):].lower())
        if same:
            return groups[same[-1][1]], f"{gpu}/{engine}/{same[-1][1]}"
    return None
