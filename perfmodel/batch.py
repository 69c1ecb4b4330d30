"""Evaluate a chunk of configurations that share a model and a chip: one result row each.

`evaluate` is the seam a batched simulator plugs into: it receives every configuration of a chunk
at once (same model, same chip preset; deployment and hardware overrides differ) and today runs
the scalar `predict` on each. A configuration that does not fit is a filtered row naming the
constraint: `memory` (weights + caches exceed a device's HBM), `vmem` (prefetch ring or expert
buffers exceed the on-chip buffer) or `layout` (the parallel layout or spec-decode settings
cannot run), with the one-line reason.
"""
from __future__ import annotations

import math

from . import arch, hardware
from .deployment import Deployment, SpecDecode, resident_bytes_per_device
from .design import SETTINGS, Chunk
from .errors import SpecError
from .predict import predict
from .schedule import CAUSES

MiB = 2**20
VMEM_FIELDS = ("prefetch_bytes", "expert_slots")  # the simulator's on-chip budget errors
BREAKDOWN = CAUSES + ("draft",)
# result columns and their types
RESULTS = {"status": str, "constraint": str, "reason": str, "step_s": float, "token_latency_s": float,
           "tokens_per_s": float, "tokens_per_s_per_chip": float, "chips": int, "bound": str,
           "hbm_utilisation": float, "resident_bytes_per_device": float,
           **{f"{c}_s": float for c in BREAKDOWN}}
COLUMNS = {"point": int, **{k: kind for k, (kind, _, _) in SETTINGS.items()}, **RESULTS}  # a row, in order
OBJECTIVES = {"tokens_per_s": "max", "tokens_per_s_per_chip": "max", "step_s": "min", "token_latency_s": "min"}


def configure(chip: hardware.Hardware, s: dict) -> tuple[Deployment, hardware.Hardware]:
    """The Deployment and the chip (with any hardware overrides) of one configuration's settings."""
    spec = None
    if s.get("draft_rows"):
        if s.get("acceptance_length") is None and s.get("acceptance_prob") is None:
            raise SpecError("acceptance_length", None, "speculative decoding needs an acceptance")
        spec = SpecDecode(s["draft_rows"], s.get("acceptance_prob"), s.get("acceptance_length"), s["draft_cost"])
    pf = s.get("prefetch_mib")
    d = Deployment(devices=s["devices"], tp=s["tp"], engine=s["engine"], ep=s.get("ep"), batch=s["batch"],
                   context=s["context"], prefetch_bytes=None if pf is None else pf * MiB,
                   expert_slots=s.get("expert_slots"), spec=spec, routing_skew=s.get("routing_skew"),
                   routing_correlation=s.get("routing_correlation"))
    changes = {}
    if s.get("vmem_mib") is not None:
        changes["onchip_bytes"] = s["vmem_mib"] * MiB
    if s.get("hbm_gbps") is not None:
        changes["hbm_bandwidth_bytes_per_s"] = s["hbm_gbps"] * 1e9
    if s.get("link_latency_us") is not None:
        changes["link_latency_s"] = s["link_latency_us"] * 1e-6
    if s.get("dma_sharing") is not None:
        changes["dma_sharing"] = s["dma_sharing"]
    return d, chip.replace(**changes) if changes else chip


def evaluate(model: arch.ModelSpec, chip: hardware.Hardware, settings: list[dict]) -> list[dict]:
    """Result columns (RESULTS) for each configuration; all share `model` and the `chip` preset."""
    return [_one(model, chip, s) for s in settings]


def _one(model, chip, s: dict) -> dict:
    d = None
    try:
        d, hw = configure(chip, s)
        p = predict(model, hw, d)
    except SpecError as e:
        if e.field in VMEM_FIELDS:
            constraint = "vmem"
        elif d is not None and e.field == "devices" and resident_bytes_per_device(model, d) > hw.core_hbm_bytes:
            constraint = "memory"
        else:
            constraint = "layout"
        return dict.fromkeys(RESULTS) | {"status": "filtered", "constraint": constraint, "reason": str(e)}
    chips = math.ceil(d.devices / hw.cores_per_chip)
    per_seq = d.spec.tokens_per_step if d.spec else 1.0
    return {"status": "ok", "constraint": None, "reason": None, "step_s": p.step_s,
            "token_latency_s": p.step_s / per_seq, "tokens_per_s": p.tokens_per_s,
            "tokens_per_s_per_chip": p.tokens_per_s / chips, "chips": chips, "bound": p.bound,
            "hbm_utilisation": p.hbm_utilisation, "resident_bytes_per_device": resident_bytes_per_device(model, d),
            **{f"{c}_s": p.breakdown_s.get(c, 0.0) for c in BREAKDOWN}}


_LOADED: dict[tuple[str, str], object] = {}  # per process: presets and files loaded once


def _load(kind: str, ref: str):
    if (kind, ref) not in _LOADED:
        _LOADED[kind, ref] = arch.load_model(ref) if kind == "model" else hardware.load_hardware(ref)
    return _LOADED[kind, ref]


def run_chunk(chunk: Chunk) -> list[dict]:
    """A chunk's rows: point number, every setting (None: the default) and the results. Runs in
    any process (the executors send it chunks); model and chip are loaded once per process."""
    model, chip = _load("model", chunk.model), _load("hardware", chunk.hardware)
    results = evaluate(model, chip, chunk.settings)
    return [{"point": i, **{k: s.get(k) for k in SETTINGS}, **r}
            for i, s, r in zip(chunk.points, chunk.settings, results)]
