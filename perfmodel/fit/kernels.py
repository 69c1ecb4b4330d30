"""Fit the physical GPU kernel components to the imported kernel tables (`perfmodel calibrate --kernels`).

Training data are kernel-level only: every cell of perfmodel/data/kernels/<gpu>/<engine>.npz is
one kernel at one shape, timed alone (NVIDIA aiconfigurator-core). For each GPU, engine and fit
group (class, dtype, the model geometry for attention and MoE, the kernel source where an engine
ships several: `gpu_kernels.fit_group`) the parameters of
`gpu_kernels.physical_time` are fitted by least squares on log(predicted / measured) over every
cell of the group; the residuals of every cell are kept, and their median and worst per engine
and GPU are what `perfmodel calibrate --kernels` prints. Attention and MoE also get one pooled fit
per class and dtype over every geometry (`"pooled": true`, residuals kept per group, not in the
summary), which prices a geometry no table has. No serving (end-to-end) figure enters.
"""
from __future__ import annotations

import json
from datetime import date

import numpy as np
from scipy.optimize import least_squares

from perfmodel.cost import gpu_kernels as gk
from perfmodel.spec.hardware import load_hardware
from perfmodel.util.files import write_atomic

TARGET = 0.10  # median |residual| per engine and GPU
ENGINES = ("vllm", "sglang", "trtllm", "nccl")
HARDWARE = {"h100": "h100", "h200": "h200", "b200": "b200", "gb200": "gb200", "b300": "b300",
            "gb300": "gb300", "a100": "a100"}


def _cells(tabs: gk.Tables, pooled: bool = False) -> dict[str, tuple[str, dict, np.ndarray]]:
    """Per fit group (`pooled`: the groups over every geometry of a class that has geometry
    groups): (class, shape arrays, seconds) of every measured cell."""
    out: dict[str, tuple[str, list, list]] = {}
    for cls in tabs.classes:
        if pooled and cls not in gk.GEOMETRY:
            continue
        for t in tabs.of_class(cls):
            _, shapes, secs = out.setdefault(gk.fit_group(cls, t.key, pooled), (cls, [], []))
            key = {**t.key, "routing": gk.grouped_routing(tabs, t)}  # how its cells were routed
            for point, v in t.points():
                shapes.append(gk.shape(cls, key, point))
                secs.append(v)
    return {g: (cls, {k: np.array([s[k] for s in shapes], float) for k in shapes[0]}, np.array(secs))
            for g, (cls, shapes, secs) in out.items() if secs}


def start(cls: str, t: np.ndarray, peak_bw: float, peak_flops: float) -> list[float]:
    """Physical starting values: fixed cost below the fastest cell, half the peaks."""
    first = {"fixed_s": max(0.8 * t.min(), 1e-7), "bytes_per_s": 0.5 * peak_bw, "flops_per_s": 0.5 * peak_flops,
             "per_peer_s": 1e-7, "min_n": 256.0, "min_k": 256.0, "per_expert_s": 1e-7, "min_units": 16.0, "per_unit_s": 1e-8,
             "tile_n": 128.0, "tile_bytes_per_s": peak_bw / 16, "per_pair_s": 1e-9,
             "overlap": 3.0}
    if cls in gk.COMM:
        first["bytes_per_s"] = 1e11
    return [first[n] for n in gk.param_names(cls)]


def peaks(gpu: str) -> tuple[float, float]:
    """The GPU preset's HBM bandwidth and highest peak rate (any dtype): what starting values and
    bounds are scaled by."""
    hw = load_hardware(HARDWARE[gpu])
    return hw.hbm_bandwidth_bytes_per_s, max(hw.peak_flops_per_s.values())


def bounds(cls: str, peak_bw: float, peak_flops: float) -> tuple[list[float], list[float]]:
    """Physical ranges of the parameters: a rate between a ten-thousandth of the chip's peak and
    four times it (a cache read served from L2 beats HBM; a GEMM column tile's bandwidth alike), a
    collective's bus bandwidth up to 10 TB/s, costs per peer / expert / unit under a millisecond
    and per routed pair under 0.1 ms, partition minima and tile widths up to 10^5,
    the overlap exponent up to 100 (the roofline's max). Without them a term the cells do not
    identify runs off (a bandwidth of 10^28 B/s), harmless inside the table and absurd outside it."""
    rng = {"fixed_s": (1e-9, 1e-2), "bytes_per_s": (1e-4 * peak_bw, 4.0 * peak_bw),
           "flops_per_s": (1e-4 * peak_flops, 4.0 * peak_flops), "per_peer_s": (1e-12, 1e-3),
           "min_n": (1.0, 1e5), "min_k": (1.0, 1e5), "per_expert_s": (1e-12, 1e-3), "min_units": (1e-3, 1e5),
           "tile_n": (8.0, 1e5), "per_pair_s": (1e-14, 1e-4), "tile_bytes_per_s": (1e-4 * peak_bw, 4.0 * peak_bw),
           "per_unit_s": (1e-12, 1e-3), "overlap": (1e-6, 100.0)}
    if cls in gk.COMM:
        rng["bytes_per_s"] = (1e6, 1e13)
    names = gk.param_names(cls)
    return [rng[n][0] for n in names], [rng[n][1] for n in names]


def fit_group(cls: str, s: dict, t: np.ndarray, peak_bw: float, peak_flops: float) -> tuple[dict, np.ndarray]:
    """(params, residuals) of one group: least squares on log(predicted / measured) with a soft-l1
    loss of 2 % scale, nearly the mean absolute log residual: the cells a kernel's own heuristics
    make slow or fast (a tactic switch along one axis) do not set the fit, and the median residual
    the fit is judged by is what it lowers (a 10 % scale left every engine's median 0.3-0.7 points
    higher); each parameter within its physical range (`bounds`)."""
    names = gk.param_names(cls)
    model = lambda x: gk.physical_time(dict(zip(names, np.exp(x))), cls, s)
    lo, hi = bounds(cls, peak_bw, peak_flops)
    x0 = np.clip(np.log(start(cls, t, peak_bw, peak_flops)), np.log(lo) + 1e-9, np.log(hi) - 1e-9)
    res = least_squares(lambda x: np.log(model(x) / t), x0, bounds=(np.log(lo), np.log(hi)),
                        method="trf", loss="soft_l1", f_scale=0.02)
    resid = model(res.x) / t - 1
    params = {n: float(f"{v:.6g}") for n, v in zip(names, np.exp(res.x))}
    return params | {"cells": int(len(t)), "median_abs_residual": float(np.median(np.abs(resid))),
                     "worst_residual": float(resid[np.argmax(np.abs(resid))])}, resid


def fit_gpu(gpu: str) -> dict:
    """Every engine's fit groups on one GPU: {engine: {group: params + residual summary}} and the
    per-engine summary."""
    peak_bw, peak = peaks(gpu)
    engines, summary = {}, {}
    for engine in ENGINES:
        tabs = gk.tables(gpu, engine)
        if tabs is None:
            continue
        groups, all_res = {}, []
        for g, (cls, s, t) in sorted(_cells(tabs).items()):
            params, resid = fit_group(cls, s, t, peak_bw, peak)
            groups[g] = params
            all_res.append(resid)
        for g, (cls, s, t) in sorted(_cells(tabs, pooled=True).items()):  # for geometries no table has
            groups[g] = fit_group(cls, s, t, peak_bw, peak)[0] | {"pooled": True}
        res = np.concatenate(all_res)
        engines[engine] = groups
        summary[engine] = {"cells": int(len(res)), "median_abs_residual": float(np.median(np.abs(res))),
                           "worst_residual": float(res[np.argmax(np.abs(res))]),
                           "within_10_percent": float(np.mean(np.abs(res) <= 0.10))}
    return {"gpu": gpu, "fitted_by": f"perfmodel calibrate --kernels on {date.today()}",
            "model": "perfmodel.cost.gpu_kernels.physical_time",
            "training_data": "the kernel tables beside this file (kernel-level only)",
            "summary": summary, "engines": engines}


def fit_json(doc: dict) -> str:
    """A fit.json's text: the header indented, each fit group on one line."""
    head = {k: v for k, v in doc.items() if k != "engines"}
    engines = ",\n".join(f"  {json.dumps(e)}: {{\n" + ",\n".join(
        f"   {json.dumps(g)}: {json.dumps(p, separators=(',', ':'))}" for g, p in groups.items()) + "\n  }"
        for e, groups in doc["engines"].items())
    return json.dumps(head, indent=1)[:-2] + ',\n "engines": {\n' + engines + "\n }\n}\n"


def calibrate_kernels(gpus: list[str] | None = None, write: bool = False) -> dict:
    out = {}
    for gpu in gpus or gk.gpus_with_tables():
        doc = fit_gpu(gpu)
        out[gpu] = doc
        if write:
            write_atomic(gk.KERNEL_DIR / gpu / "fit.json", fit_json(doc))
    gk.forget_fits()
    return out
