"""Import NVIDIA aiconfigurator-core's measured decode kernel tables into perfmodel/data/kernels/.

The aiconfigurator-core wheel (PyPI, Apache-2.0) ships per-GPU tables of single kernels timed
with vLLM, SGLang and TensorRT-LLM (one kernel, one shape each): GEMM, grouped MoE, generation
attention (GQA), MLA (core and whole module), MLA absorb BMMs, KDA decode, the engines' custom
all-reduce, DeepEP low-latency dispatch / combine and NCCL collectives. This script keeps the
decode range of each (<= 1024 tokens, balanced routing, CUDA-graph collectives) as regular grids
in the table's own axes, one compact file per GPU and engine (`<engine>.npz`: a JSON index of the
tables, each with its source file, framework version and licence, and one float32 array of log
latencies per kernel class, so a prediction reads only the classes it prices). Nothing is fitted
here; `perfmodel calibrate --kernels` fits the physical kernel components to these files.

Left out, as not kernel times: vLLM's MLA module table (one Python call of the whole module: its
floor, 65 us at one head and two cached tokens on GB200, is host launch time, not what a CUDA-graph
replay runs; vLLM's MLA is priced kernel by kernel) and vLLM's fp8 block-scaled GEMM tables
(DeepGEMM / FlashInfer kernels: 58-832 us at m = 1 whatever the shape, where SGLang's and
TensorRT-LLM's tables of the same DeepGEMM kernel give 3-50 us).

    pip download --no-deps aiconfigurator-core==0.12.0 -d /tmp/aic
    python experiments/import_kernel_tables.py /tmp/aic/aiconfigurator_core-0.12.0-*.whl

Needs pandas and pyarrow (the tables are parquet); perfmodel itself reads only numpy's .npz.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd

from perfmodel.cost.gpu_kernels import COMM

OUT = Path(__file__).resolve().parent.parent / "perfmodel" / "data" / "kernels"
SYSTEMS = {"h100": "h100_sxm", "h200": "h200_sxm", "b200": "b200_sxm", "gb200": "gb200",
           "b300": "b300_sxm", "gb300": "gb300", "a100": "a100_sxm"}
ENGINES = {"vllm": "0.24.0", "sglang": "0.5.14", "trtllm": "1.3.0rc20"}  # preferred versions
ROOT = "aiconfigurator_core/systems/data/{}/"
DTYPES = {"bfloat16": "bf16", "fp8": "fp8", "fp8_block": "fp8-block128", "nvfp4": "nvfp4",
          "w4a16_mxfp4": "mxfp4", "int4_wo": "int4", "w4a8_mxfp4_mxfp8": "mxfp4-a8", "half": "bf16",
          "fp4": "fp4"}
MAX_TOKENS = 1024
POW2 = tuple(2**i for i in range(11))  # 1 .. 1024 tokens
GEMM_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
GEMM_NK = (128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192,
           10240, 12288, 16384)


def version_key(v: str):
    return [int(x) if x.isdigit() else x for x in re.split(r"[.+]|(?<=\d)(?=rc)", v)]


class Wheel:
    def __init__(self, path: str):
        self.z = zipfile.ZipFile(path)
        self.names = set(self.z.namelist())
        self.version = Path(path).name.split("-")[1]

    def versions(self, system: str, cls: str, engine: str, table: str) -> list[str]:
        pre = ROOT.format(system) + f"{cls}/{engine}/"
        vs = {n[len(pre):].split("/")[0] for n in self.names if n.startswith(pre) and n.endswith("/" + table)}
        return sorted(vs, key=version_key)

    def table(self, system: str, cls: str, engine: str, table: str) -> tuple[pd.DataFrame, str, str] | None:
        """The preferred version's table (else the newest): (frame, version, path in the wheel)."""
        vs = self.versions(system, cls, engine, table)
        if not vs:
            return None
        v = ENGINES.get(engine) if ENGINES.get(engine) in vs else vs[-1]
        path = ROOT.format(system) + f"{cls}/{engine}/{v}/{table}"
        return pd.read_parquet(io.BytesIO(self.z.read(path))), v, path


def grids(d: pd.DataFrame, cls: str, key: list[str], axes: list[str], meta: dict) -> list[dict]:
    """One regular grid per distinct key: the table's own axes and latencies (us; null where the
    table has no row)."""
    out = []
    d = d.groupby(key + axes, as_index=False)["latency_us"].median()
    for k, part in d.groupby(key):
        k = k if isinstance(k, tuple) else (k,)
        ax = {a: sorted(int(x) for x in part[a].unique()) for a in axes}
        full = pd.MultiIndex.from_product([ax[a] for a in axes], names=axes)
        vals = part.set_index(axes)["latency_us"].reindex(full).to_numpy()
        out.append({"class": cls, "file": meta["file"], "key": {n: (v if isinstance(v, str) else int(v)) for n, v in zip(key, k)},
                    "axes": ax, "latency_us": [None if np.isnan(x) else float(f"{x:.4g}") for x in vals],
                    "_meta": json.dumps({k: v for k, v in meta.items() if k != "file"})})
    return out


def dominant(d: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Per `by` group, the rows of the kernel with the most rows (the one the engine ships for it)."""
    counts = d.groupby(by + ["kernel_source"]).size().rename("n").reset_index()
    best = counts.sort_values("n").groupby(by).tail(1)[by + ["kernel_source"]]
    return d.merge(best, on=by + ["kernel_source"])


def engine_tables(w: Wheel, system: str, engine: str) -> list[dict]:
    out = []

    def get(cls, table):
        t = w.table(system, cls, engine, table)
        if t is None:
            return None, None
        d, v, path = t
        d = d.copy()
        d["latency_us"] = d["latency"] * 1e3
        return d, {"engine": engine, "version": v, "file": path.split("data/", 1)[1]}

    d, m = get("gemm", "gemm_perf.parquet")
    if d is not None:
        d = d[d.m.isin(GEMM_M) & d.n.isin(GEMM_NK) & d.k.isin(GEMM_NK) & d.gemm_dtype.isin(DTYPES)]
        if engine == "vllm":  # host time, not the kernel (module docstring)
            d = d[d.gemm_dtype != "fp8_block"]
        d = dominant(d.assign(dtype=d.gemm_dtype.map(DTYPES)), ["dtype"])
        for dt, part in d.groupby("dtype"):
            out += grids(part, "gemm", ["dtype", "kernel_source"], ["m", "n", "k"], m)
    d, m = get("moe", "moe_perf.parquet")
    if d is not None:
        d = d[(d.distribution == "balanced") & d.num_tokens.isin(POW2) & d.moe_dtype.isin(DTYPES)]
        d = d.assign(dtype=d.moe_dtype.map(DTYPES), tokens=d.num_tokens, hidden=d.hidden_size, inter=d.inter_size,
                     experts=d.num_experts, tp=d.moe_tp_size, ep=d.moe_ep_size)
        geo = ["dtype", "hidden", "inter", "topk", "experts"]
        out += grids(dominant(d, geo), "moe", geo + ["tp", "ep", "kernel_source"], ["tokens"], m)
    d, m = get("attention", "generation_attention_perf.parquet")
    if d is not None:
        d = d[(d.get("window_size", 0) == 0) & (d.batch_size <= 256)]
        d = d.assign(kv_dtype=d.kv_cache_dtype.map(DTYPES), heads=d.num_heads, kv_heads=d.num_key_value_heads,
                     batch=d.batch_size, context=d.step)
        d = dominant(d, ["kv_dtype", "head_dim"])
        out += grids(d, "attention", ["kv_dtype", "heads", "kv_heads", "head_dim", "kernel_source"],
                     ["batch", "context"], m)
    d, m = get("mla", "mla_generation_module_perf.parquet") if engine != "vllm" else (None, None)
    if d is not None:
        d = d[d.batch_size <= 512].assign(kv_dtype=d.kv_cache_dtype.map(DTYPES), dtype=d.gemm_type.map(DTYPES),
                                           heads=d.num_heads, batch=d.batch_size, context=d.step)
        out += grids(d, "mla_module", ["kv_dtype", "dtype", "kernel_source"], ["heads", "batch", "context"], m)
    d, m = get("mla", "generation_mla_perf.parquet")
    if d is not None:
        d = d[d.batch_size <= 512]
        d = d.assign(kv_dtype=d.kv_cache_dtype.map(DTYPES), heads=d.num_heads // d.tp_size, batch=d.batch_size,
                     context=d.step)
        out += grids(d[d.heads >= 1], "mla_core", ["kv_dtype", "kernel_source"], ["heads", "batch", "context"], m)
    d, m = get("mla_bmm", "mla_bmm_perf.parquet")
    if d is not None:
        d = d[d.num_tokens <= MAX_TOKENS].assign(dtype=d.bmm_dtype.map(DTYPES), op=d.op_name, heads=d.num_heads,
                                                 tokens=d.num_tokens)
        out += grids(d, "mla_bmm", ["op", "dtype", "kernel_source"], ["heads", "tokens"], m)
    for v in w.versions(system, "kda", engine, "kda_perf.parquet")[-1:]:
        d, v_, path = w.table(system, "kda", engine, "kda_perf.parquet")
        d = d[(d.phase == "generation") & (d.batch_size <= MAX_TOKENS)].copy()
        d["latency_us"] = d["latency"] * 1e3
        d = d.assign(kernel=d.kernel_source, heads=d.num_k_heads, batch=d.batch_size)
        out += grids(d, "kda", ["kernel", "head_k_dim", "kernel_source"], ["heads", "batch"],
                     {"engine": engine, "version": v_, "file": path.split("data/", 1)[1]})
    d, m = get("comm", "custom_allreduce_perf.parquet")
    if d is not None:
        d = d[d.kernel_source.str.contains("graph") | d.kernel_source.str.startswith("TRTLLM")]
        # TensorRT-LLM's MNNVL all-reduce is one kernel family: one-shot up to the message size
        # where the table switches to two-shot (as its AllReduce strategy does): one grid
        d = d.assign(kernel_source=d.kernel_source.str.replace(r"^TRTLLM_MNNVL_.*", "TRTLLM_MNNVL", regex=True))
        d = d.assign(ranks=d.num_gpus, bytes=2 * d.message_size)
        d = d[d.bytes <= 2 * 2**20]
        out += grids(d, "all_reduce", ["kernel_source"], ["ranks", "bytes"], m)
    for table in ("moe_a2a_perf.parquet",):
        d, m = get("comm", table)
        if d is not None:
            d = d[d.comm_backend.str.endswith("deepep_ll") & (d.num_tokens <= MAX_TOKENS)]
            if "comm_dtype" in d:
                d = d[d.comm_dtype.isin(["default", "bfloat16"])]
            d = d.assign(hidden=d.hidden_size, tokens=d.num_tokens, ep=d.ep_size, experts=d.num_experts,
                         latency_us=d.latency)  # the a2a tables give microseconds
            out += grids(d, "a2a", ["phase", "hidden", "topk", "experts", "ep", "kernel_source"], ["tokens"], m)
    if engine == "sglang":
        t = w.table(system, "comm", "sglang", "wideep_deepep_ll_perf.parquet")
        if t is not None:
            d, v, path = t
            per_node = 4 if system.startswith("gb") else 8
            d = d[d.num_token <= MAX_TOKENS]
            rows = [d.assign(phase=p, latency_us=d[f"{p}_avg_t_us"]) for p in ("dispatch", "combine")]
            d = pd.concat(rows).assign(hidden=lambda x: x.hidden_size, tokens=lambda x: x.num_token,
                                       topk=lambda x: x.num_topk, experts=lambda x: x.num_experts,
                                       ep=lambda x: x.node_num * per_node)
            out += grids(d, "a2a", ["phase", "hidden", "topk", "experts", "ep", "kernel_source"], ["tokens"],
                         {"engine": engine, "version": v, "file": path.split("data/", 1)[1],
                          "note": f"ep = {per_node} GPUs per node x node_num (the table gives nodes)"})
    return out


def nccl_tables(w: Wheel, system: str) -> list[dict]:
    t = w.table(system, "comm", "nccl", "nccl_perf.parquet")
    if t is None:
        return []
    d, v, path = t
    d = d[d.nccl_dtype == "half"].copy()
    d["latency_us"] = d["latency"] * 1e3
    d = d.assign(ranks=d.num_gpus, bytes=2 * d.message_size)
    d = d[d.bytes <= 2 * 2**20]
    return grids(d, "nccl", ["op_name"], ["ranks", "bytes"], {"engine": "nccl", "version": v,
                                                              "file": path.split("data/", 1)[1]})


def provenance(version: str, system: str) -> dict:
    return {"source": f"NVIDIA aiconfigurator-core {version} (PyPI aiconfigurator-core, Apache-2.0): "
                      f"aiconfigurator_core/systems/data/{system}/",
            "licence": "Apache-2.0 (SPDX-FileCopyrightText: NVIDIA CORPORATION & AFFILIATES)",
            "imported_by": f"python experiments/import_kernel_tables.py aiconfigurator_core-{version}-*.whl",
            "units": "log_s: natural log of the latency in seconds per kernel call (median of the table's "
                     "timed repetitions), NaN where not measured; axes: the table's own (bytes: message bytes, "
                     "bf16 values x 2; context: cached tokens, the table's `step`)"}


def write_npz(path: Path, head: dict, tables: list[dict]) -> None:
    """One GPU and engine: `index` (JSON: the provenance and the classes), per class `index.<class>`
    (JSON, columnar: its source files, key fields and axis names, each distinct axis grid once, and
    per table its file, key values, grids and offset) and `log_s.<class>` (float32 log latencies,
    NaN where not measured)."""
    arrays, classes, compute = {}, sorted({t["class"] for t in tables}), []
    for cls in classes:
        ts = [t for t in tables if t["class"] == cls]
        fields, axes = list(ts[0]["key"]), list(ts[0]["axes"])
        assert all(list(t["key"]) == fields and list(t["axes"]) == axes for t in ts), cls
        files = sorted({t["file"] for t in ts})
        grids: list[list[int]] = []
        rows, values = [], []
        for t in ts:
            ids = []
            for a in axes:
                if t["axes"][a] not in grids:
                    grids.append(t["axes"][a])
                ids.append(grids.index(t["axes"][a]))
            rows.append([files.index(t["file"]), [t["key"][f] for f in fields], ids, len(values)])
            values += [math.nan if x is None else math.log(x * 1e-6) for x in t["latency_us"]]
        if cls not in COMM:
            compute += [v for v in values if v == v]
        arrays[f"index.{cls}"] = _json_bytes({"files": files, "fields": fields, "axes": axes, "grids": grids,
                                              "tables": rows})
        arrays[f"log_s.{cls}"] = np.asarray(values, np.float32)
    fastest = float(f"{math.exp(min(compute)):.4g}") if compute else None  # nccl: collectives only
    arrays["index"] = _json_bytes({**head, "classes": classes, "fastest_kernel_s": fastest})
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".", suffix=".tmp", delete=False) as f:
        np.savez_compressed(f, **arrays)
    os.chmod(f.name, 0o644)
    Path(f.name).replace(path)


def _json_bytes(doc) -> np.ndarray:
    return np.frombuffer(json.dumps(doc, separators=(",", ":")).encode(), np.uint8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", help="the downloaded aiconfigurator_core wheel")
    a = ap.parse_args()
    if not zipfile.is_zipfile(a.wheel):
        raise SystemExit(f"wheel: {a.wheel!r} is not a wheel (zip) file")
    w = Wheel(a.wheel)
    for gpu, system in SYSTEMS.items():
        for engine in (*ENGINES, "nccl"):
            tables = nccl_tables(w, system) if engine == "nccl" else engine_tables(w, system, engine)
            if not tables:
                continue
            files = sorted({(t["file"], t.pop("_meta")) for t in tables})
            files = {f: json.loads(m) for f, m in files}
            path = OUT / gpu / f"{engine}.npz"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_npz(path, {"gpu": gpu, "engine": engine, "system": system, "files": files,
                             **provenance(w.version, system)}, tables)
            print(f"{path.relative_to(OUT.parent.parent.parent)}: {len(tables)} tables, "
                  f"{sum(len(t['latency_us']) for t in tables)} cells")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
