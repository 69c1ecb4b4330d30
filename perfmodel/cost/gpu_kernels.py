"""GPU decode kernels costed from measured kernel tables where they reach, physics where not.

Tables (perfmodel/data/kernels/<gpu>/<engine>.json, imported from NVIDIA aiconfigurator-core by
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

import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from perfmodel.util import schema
from perfmodel.util.errors import SpecError
from perfmodel.util.files import read_text

KERNEL_DIR = Path(__file__).parents[1] / "data" / "kernels"
COMM = ("all_reduce", "nccl", "a2a")
UNITS = ("attention", "mla_core", "mla_module")  # classes whose reads split over sequences (x heads)
BYTES_PER_VALUE = {"bf16": 2.0, "fp16": 2.0, "f32": 4.0, "fp8": 1.0, "fp8-block128": 1.0 + 4 / 16384,
                   "fp8-kv": 1.0, "int8": 1.0, "int4": 0.5 + 2 / 32, "mxfp4": 0.5 + 1 / 32,
                   "mxfp4-a8": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16, "fp4": 0.5 + 1 / 16}
PEAK_DTYPE = {"fp8-block128": "fp8", "fp8-kv": "fp8", "nvfp4": "fp4", "mxfp4-a8": "fp8", "fp4": "fp4",
              "int8": "fp8"}  # the matrix-unit rate a table dtype runs at (weight-only formats: bf16)
MLA_GEOMETRY = {"q_lora": 1536, "kv_lora": 512, "nope": 128, "rope": 64, "v": 128, "hidden": 7168}
# the MLA tables' model (DeepSeek-V3, per head); Kimi K2 / K3 share it per head


@dataclass
class Table:
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
    gpu: str
    engine: str
    version: dict[str, str]        # file -> framework version
    by_class: dict[str, list[Table]] = field(default_factory=dict)
    source: str = ""

    def find(self, cls: str, key: dict) -> list[Table]:
        return [t for t in self.by_class.get(cls, []) if all(t.key.get(k) == v for k, v in key.items())]


@lru_cache(maxsize=None)
def tables(gpu: str, engine: str) -> Tables | None:
    """The imported tables of one GPU and engine (`nccl` for the NCCL collectives), or None."""
    path = KERNEL_DIR / gpu / f"{engine}.json"
    if not path.exists():
        return None
    doc = _read(path)
    out = Tables(gpu, engine, {f: m["version"] for f, m in doc["files"].items()}, source=doc["source"])
    for t in doc["tables"]:
        axes = list(t["axes"])
        vals = np.array([np.nan if v is None else v for v in t["latency_us"]], float) * 1e-6
        shape = [len(t["axes"][a]) for a in axes]
        out.by_class.setdefault(t["class"], []).append(Table(
            t["class"], t["file"], t["key"], axes, [np.log(np.array(t["axes"][a], float)) for a in axes],
            np.log(vals).reshape(shape), t["axes"]))
    return out


def gpus_with_tables() -> list[str]:
    return sorted(p.name for p in KERNEL_DIR.iterdir() if p.is_dir()) if KERNEL_DIR.exists() else []


def interpolate(t: Table, point: dict) -> float | None:
    """Multilinear interpolation of log latency in log axes; None outside the grid or where a
    corner was not measured."""
    lo, w = [], []
    for a, g in zip(t.axes, t.grid):
        x = math.log(max(point[a], 1e-30))
        if x < g[0] - 1e-9 or x > g[-1] + 1e-9:
            return None
        i = int(np.clip(np.searchsorted(g, x) - 1, 0, max(len(g) - 2, 0)))
        if len(g) == 1:
            lo.append(0), w.append(0.0)
            continue
        lo.append(i), w.append(float(np.clip((x - g[i]) / (g[i + 1] - g[i]), 0.0, 1.0)))
    total = 0.0
    for corner in np.ndindex(*([2] * len(lo))):
        weight = math.prod(wi if c else 1 - wi for c, wi in zip(corner, w))
        if weight == 0.0:
            continue
        v = t.values[tuple(i + c for i, c in zip(lo, corner))]
        if np.isnan(v):
            return None
        total += weight * v
    return math.exp(total)


def table_time(tabs: Tables | None, cls: str, key: dict, point: dict) -> tuple[float, Table] | None:
    """The first table of `cls` matching `key` that reaches `point`: (seconds, table)."""
    if tabs is None:
        return None
    for t in tabs.find(cls, key):
        v = interpolate(t, point)
        if v is not None:
            return v, t
    return None


# ---- the physical kernel component ---------------------------------------------------------

def features(cls: str, key: dict, point: dict) -> tuple[float, float, float]:
    """(bytes moved, FLOPs, ranks) of one table cell or one engine kernel, by class. Collectives:
    (bus bytes per rank, 0, ranks)."""
    bpv = lambda dt: BYTES_PER_VALUE.get(dt, 2.0)
    if cls == "gemm":
        m, n, k = point["m"], point["n"], point["k"]
        return n * k * bpv(key["dtype"]) + 2.0 * m * (n + k), 2.0 * m * n * k, 1
    if cls == "moe":
        tokens, e, ep = point["tokens"], key["experts"], key["ep"]
        distinct = min(e, tokens * key["topk"]) / ep  # balanced routing: pairs spread evenly
        per_expert = 3.0 * key["hidden"] * key["inter"] / key["tp"]
        pairs = tokens * key["topk"] / ep
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


PARAMS = {"gemm": ("fixed_s", "bytes_per_s", "flops_per_s", "min_n", "min_k"),
          "moe": ("fixed_s", "bytes_per_s", "flops_per_s", "per_expert_s"),
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
        out["experts"] = min(key["experts"], point["tokens"] * key["topk"]) / key["ep"]
    if cls in UNITS:  # cached sequences x KV heads the kernel splits its reads over
        units = point["batch"] * (key["kv_heads"] if cls == "attention" else 1)
        out |= {"units": units, "cache": features(cls, key, {**point, "heads": 0} if cls == "mla_module" else point)[0]
                if cls != "mla_module" else point["batch"] * point["context"] * (MLA_GEOMETRY["kv_lora"] + MLA_GEOMETRY["rope"])
                * BYTES_PER_VALUE.get(key["kv_dtype"], 2.0)}
    return out


def physical_time(params: dict, cls: str, s: dict):
    """The physical component of one kernel (or arrays of them) of class `cls` and shape `s`
    (`shape`) from its fitted `params`:
      GEMM:        fixed + max((max(n, min_n) max(k, min_k) bytes/weight + activations) / bandwidth,
                               2 m max(n, min_n) k / rate)  -- a kernel streams no fewer columns
                   and rows than its smallest partition (its tile / split), whatever the matrix;
      grouped MoE: fixed + distinct experts x per_expert + max(bytes / bandwidth, FLOPs / rate);
      attention / MLA: as others, the cache read at least as if min_units sequence-heads were
                   read (a decode kernel splits its reads over sequences and KV heads);
      collectives: fixed + (ranks - 1) x per_peer + bus bytes / bus bandwidth;
      others:      fixed + max(bytes / bandwidth, FLOPs / rate)."""
    p = params
    if cls in COMM:
        return p["fixed_s"] + np.maximum(s["ranks"] - 1, 0) * p["per_peer_s"] + s["bytes"] / p["bytes_per_s"]
    if cls == "gemm":
        n, k, m = np.maximum(s["n"], p["min_n"]), np.maximum(s["k"], p["min_k"]), s["m"]
        return p["fixed_s"] + np.maximum((n * k * s["bpv"] + 2.0 * m * (s["n"] + s["k"])) / p["bytes_per_s"],
                                         2.0 * m * n * s["k"] / p["flops_per_s"])
    nbytes = s["bytes"]
    if cls in UNITS:  # too few sequence-heads to keep every SM streaming: the reads of min_units
        nbytes = nbytes + s["cache"] * (np.maximum(s["units"], p["min_units"]) / s["units"] - 1)
    t = p["fixed_s"] + np.maximum(nbytes / p["bytes_per_s"], s["flops"] / p["flops_per_s"])
    if cls in UNITS:  # each sequence-head's partial results combined (split-KV reduction, bookkeeping)
        t = t + s["units"] * p["per_unit_s"]
    return t + s["experts"] * p["per_expert_s"] if cls == "moe" else t


def fit_group(t: Table) -> str:
    """The fit a table's cells belong to: class and (weight) dtype."""
    k = t.key
    kind = k.get('dtype') or k.get('kv_dtype') or k.get('kernel') or k.get('op_name') or k.get('phase') or ''
    return f"{t.cls}/{kind}" + (f"/{k['kernel_source']}" if t.cls == "moe" and "kernel_source" in k else "")


@lru_cache(maxsize=None)
def fits(gpu: str) -> dict:
    """perfmodel/data/kernels/<gpu>/fit.json: {engine: {group: params}} ({} when none)."""
    path = KERNEL_DIR / gpu / "fit.json"
    return _read(path)["engines"] if path.exists() else {}


def _read(path: Path) -> dict:
    """A shipped kernel-table or fit file: read bounded and parsed through the schema layer (its
    content is checked by tests/test_schema.py, not on every load: 0.4 s a file)."""
    return schema.parse(read_text(path, "kernel table"), "json", "kernel table", path)


def fitted_params(gpu: str, engine: str, group: str) -> tuple[dict, str] | None:
    """The fitted physical parameters for a kernel group: this engine's, else the same group of
    another engine on this GPU, else this engine's fit of the class with the most cells.
    Returns (params, which fit)."""
    f = fits(gpu)
    own = f.get(engine, {})
    if group in own:
        return own[group], f"{gpu}/{engine}/{group}"
    for e, groups in sorted(f.items()):
        if group in groups:
            return groups[group], f"{gpu}/{e}/{group}"
    for prefix in ("/".join(group.split("/")[:2]), group.split("/")[0]):  # same dtype, then same class
        same = sorted(((p["cells"], g) for g, p in own.items() if g.startswith(prefix)), reverse=True)
        if same:
            return own[same[0][1]], f"{gpu}/{engine}/{same[0][1]}"
    return None
