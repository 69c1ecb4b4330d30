"""Predict a decode step: per-layer table, step time, tokens/s, bound, and the cause breakdown."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from perfmodel.cost import components as cm
from perfmodel.engine.terms import CAUSES, Timeline, op_weights
from perfmodel.graph import ops as ops_mod
from perfmodel.spec.arch import ModelSpec
from perfmodel.spec.deployment import Deployment, validate
from perfmodel.spec.formats import COMPUTE_DTYPES
from perfmodel.spec.hardware import Hardware
from perfmodel.util.errors import SpecError

if TYPE_CHECKING:  # the engine a deployment names, and plans, are imported where used
    from perfmodel.graph.dmaplan import Copy, KernelPlan


@dataclass
class LayerRow:
    """One layer of a predicted step: its time, where the time went, its FLOPs and bytes."""
    layer: int
    kind: str
    time_s: float
    compute_s: float
    stall_s: float           # waiting on DMA (weights, experts, KV / state)
    collective_s: float
    overhead_s: float        # launch / per-op overhead and pipeline fill / drain
    flops: float
    static_bytes: float
    routed_bytes: float
    kv_bytes: float
    act_bytes: float


@dataclass
class Prediction:
    """A predicted decode step: time, tokens/s, HBM bytes and floors, its bound, the time by
    cause, the per-layer rows and the timeline."""
    model: str
    hardware: str
    deployment: Deployment
    step_s: float            # one (verification) step, draft included
    tokens_per_s: float
    bytes_per_device: float  # HBM bytes one device moves per step
    hbm_floor_s: float       # bytes_per_device / peak bandwidth
    compute_floor_s: float
    bound: str               # memory, compute or latency
    breakdown_s: dict[str, float]
    layers: list[LayerRow]
    timeline: Timeline
    ttft_s: float | None = None  # time to first token of the batch's prompts (perfmodel.step.prefill.with_ttft)

    @property
    def hbm_utilisation(self) -> float:
        return self.hbm_floor_s / self.step_s if self.step_s else 0.0


def simulate(model: ModelSpec, hw: Hardware, d: Deployment, record: bool = False, plan=None,
             experts: list[float] | None = None):
    g = ops_mod.build(model, d)
    if plan is not None:
        experts = ops_mod.planned_experts(g, plan)
    if experts is not None:
        g = ops_mod.with_experts(g, experts)
    w = op_weights(g, model.formats["routed_expert"].bytes_per_value)
    if d.engine == "megakernel":
        from perfmodel.engine.megakernel import simulate_megakernel
        tl = simulate_megakernel(g, hw, d, model.moe.top_k if model.moe else 1, record, plan, w)
    elif d.serving_engine is not None:  # a GPU serving engine: its kernels (perfmodel.engine.serving)
        from perfmodel.engine.serving import simulate_serving
        tl = simulate_serving(model, hw, d, g, record)[0]
    else:
        from perfmodel.engine.multikernel import simulate_multikernel
        tl = simulate_multikernel(g, hw, record, w, d.steps_per_call)
    return g, tl


def predict(model: ModelSpec, hw: Hardware, d: Deployment, record: bool = False,
            plan: list[Copy] | KernelPlan | None = None,
            experts: list[float] | None = None) -> Prediction:
    """`plan`: a megakernel's own DMA plan (perfmodel_kernels.plan.dma_plan: its HBM copies) to simulate
    instead of the model's uniform stream of tiles; the ring's tile size is then the plan's, and
    each MoE layer computes the experts the plan fetched. A KernelPlan (a plan file,
    perfmodel.graph.dmaplan) also brings the kernel's settings, which the engine replays beside
    its copies (plan_model); its deployment must be `d`'s. `experts`: per MoE layer, the distinct
    experts a measured step picked, read and computed instead of the expectation (any engine;
    a plan brings its own)."""
    if plan is not None and d.engine != "megakernel":
        raise SpecError("plan", "given", "a DMA plan is the megakernel's; engine must be megakernel")
    if plan is not None and experts is not None:
        raise SpecError("experts", list(experts), "a plan brings its own experts; give one or the other")
    if plan is not None:
        from perfmodel.graph.dmaplan import KernelPlan
        if isinstance(plan, KernelPlan):
            check_plan_deployment(plan, d)
            model, plan = plan_model(model, plan), plan.hbm_copies
    validate(model, hw, d)
    g, tl = simulate(model, hw, d, record, plan, experts)
    s = summarise(hw, d, tl.step_s, tl.dma_bytes, {c: float(tl.wait_s[c].sum()) for c in CAUSES})
    return Prediction(model.name, hw.name, d, s.step_s, s.tokens_per_s, tl.dma_bytes, s.hbm_floor_s,
                      s.compute_floor_s, s.bound, s.breakdown_s, _layer_rows(g, tl), tl)


@dataclass
class Summary:
    """A step's figures from its timeline (`summarise`)."""
    step_s: float
    tokens_per_s: float
    hbm_floor_s: float
    compute_floor_s: float
    bound: str
    breakdown_s: dict[str, float]


def summarise(hw: Hardware, d: Deployment, timeline_s: float, dma_bytes: float, totals: dict[str, float]) -> Summary:
    """A step's figures from its simulated timeline (seconds, HBM bytes, and the total wait by
    cause): the draft's cost added, tokens/s, the floors and what bounds the step."""
    draft = d.spec.draft_cost_fraction if d.spec else 0.0
    step = timeline_s * (1 + draft)
    accepted = d.batch * (d.spec.tokens_per_step if d.spec else 1.0)
    hbm_floor = dma_bytes / hw.core_hbm_bandwidth_bytes_per_s
    compute_floor = totals["compute"] * hw.efficiency.flops
    latency = totals["collective"] + totals["launch"]
    bound = max((hbm_floor, "memory"), (compute_floor, "compute"), (latency, "latency"))[1]
    breakdown = {c: totals.get(c, 0.0) for c in CAUSES}
    if draft:
        breakdown["draft"] = timeline_s * draft
    return Summary(step, accepted / step if step else 0.0, hbm_floor, compute_floor, bound, breakdown)


def _layer_rows(g: ops_mod.OpGraph, tl: Timeline) -> list[LayerRow]:
    n = int(g.layer.max()) + 1
    per = lambda v: np.bincount(g.layer, weights=v, minlength=n).tolist()
    w = {c: per(v) for c, v in tl.wait_s.items()}
    ends = np.maximum.accumulate(np.maximum.reduceat(tl.end_s, np.flatnonzero(np.diff(g.layer, prepend=-1))))
    time_s = np.diff(ends, prepend=0.0).tolist()
    flops, st, ro, kv, act = (per(v) for v in (g.flops, g.static_bytes, g.routed_bytes, g.kv_bytes, g.act_bytes))
    return [LayerRow(i, g.layer_kind[i], time_s[i], w["compute"][i],
                     w["weight_streaming"][i] + w["expert_fetch"][i], w["collective"][i],
                     w["launch"][i] + w["fill_drain"][i], flops[i], st[i], ro[i], kv[i], act[i])
            for i in range(n)]


def prefetch_gain(model: ModelSpec, hw: Hardware, d: Deployment) -> dict:
    """Multi-kernel minus megakernel step time on the same hardware and layout, by cause."""
    mega = predict(model, hw, dataclasses.replace(d, engine="megakernel"))
    multi = predict(model, hw, dataclasses.replace(d, engine="multikernel"))
    causes = sorted(set(mega.breakdown_s) | set(multi.breakdown_s), key=list(CAUSES + ("draft",)).index)
    return {"megakernel_step_s": mega.step_s, "multikernel_step_s": multi.step_s,
            "gain_s": multi.step_s - mega.step_s, "speedup": multi.step_s / mega.step_s,
            "by_cause_s": {c: multi.breakdown_s.get(c, 0.0) - mega.breakdown_s.get(c, 0.0) for c in causes}}


def expert_tiling_cost(model: ModelSpec, hw: Hardware, p: Prediction) -> dict | None:
    """What streaming experts in tiles cost prediction `p` (megakernel, an expert larger than the
    on-chip room beside the ring): tiles per expert, and the step against the same chip given
    just enough room for whole-expert buffers beside the same ring. None when experts are
    copied whole."""
    s = p.timeline.sizing
    if s is None or s.tiles_per_expert == 1:
        return None
    whole = dataclasses.replace(p.deployment, prefetch_bytes=float(s.ring_bytes), expert_slots=s.slots)
    room = math.ceil(s.ring_bytes + s.slots * s.expert_bytes) + 1  # a byte over: rounding leaves no slot short
    untiled = predict(model, hw.replace(onchip_bytes=room), whole).step_s
    return {"expert_slots": s.slots, "tiles_per_expert": s.tiles_per_expert, "expert_bytes": s.expert_bytes,
            "step_s": float(p.step_s), "whole_expert_step_s": float(untiled), "cost_s": float(p.step_s - untiled)}


def plan_model(model: ModelSpec, plan: KernelPlan) -> ModelSpec:
    """`model` as the plan's kernel runs it: its [megakernel] settings replaced by the kernel's
    (bank, ring depth, slots, collective wire and rows, all-reduce algorithm, cache tile, dots a
    matmul, embed pick, where the shared expert runs) and its routed experts fed as the kernel feeds them (expert_feed,
    expert_scale_rows)."""
    k = plan.kernel
    change = {name: k[key] for key, name in (("bank_bytes", "bank_bytes"), ("depth", "ring_banks"),
                                              ("expert_slots", "expert_slots"), ("wire", "collective_wire"),
                                              ("all_reduce", "all_reduce"), ("collective_rows", "collective_rows"),
                                              ("cache_block", "attention_tile_tokens"),
                                              ("embedding_pick_values", "embedding_pick_values"),
                                              ("shared_expert", "shared_expert"))
              if key in k and not (key == "bank_bytes" and k[key] == 0)}  # a bank of 0: the chip's
    if "matmul_dots" in k:
        change["matmul_dots"] = sorted(k["matmul_dots"].items())
    from perfmodel.spec.recipe import from_table, to_table
    recipe = from_table({**to_table(model.megakernel), **change})
    formats = dict(model.formats)
    if "expert_feed" in k:
        if k["expert_feed"] not in COMPUTE_DTYPES:
            raise SpecError("kernel.expert_feed", k["expert_feed"], f"one of {', '.join(COMPUTE_DTYPES)}")
        decode = k.get("expert_decode", "")
        if decode not in ("",) + cm.DECODE_KINDS:
            raise SpecError("kernel.expert_decode", decode, f"one of {', '.join(cm.DECODE_KINDS)}")
        passes = k.get("expert_decode_passes", 0)
        if passes < 0:
            raise SpecError("kernel.expert_decode_passes", passes, "a count of passes, >= 0")
        f = formats["routed_expert"]
        formats["routed_expert"] = dataclasses.replace(
            f, name=f"{f.name} fed {k['expert_feed']}" + (f" after a {decode} decode" if decode else ""),
            compute_dtype=k["expert_feed"], scale_rows=int(k.get("expert_scale_rows", 1)),
            fallback_dtype="", decode=decode, decode_passes=passes)
    return dataclasses.replace(model, megakernel=recipe, formats=formats)


def check_plan_deployment(plan: KernelPlan, d: Deployment) -> None:
    """SpecError unless the plan is of deployment `d` (devices, tp, ep, batch, context, rows)."""
    want = {"devices": d.devices, "tp": d.tp, "ep": d.expert_groups, "batch": d.batch, "context": d.context,
            "draft_rows": d.spec.draft_rows if d.spec else 0}
    for k, v in plan.deployment.items():
        if k in want and v != want[k]:
            raise SpecError(f"plan.deployment.{k}", v, f"the plan is not of this deployment ({k} = {want[k]})")


def plan_deployment(plan: KernelPlan, engine: str = "megakernel") -> Deployment:
    """The Deployment a plan file is of."""
    p = plan.deployment
    spec = None
    if p.get("draft_rows"):
        from perfmodel.spec.deployment import SpecDecode
        spec = SpecDecode(p["draft_rows"], acceptance_length=1.0)
    return Deployment(devices=p["devices"], tp=p["tp"], ep=p.get("ep"), batch=p["batch"],
                      context=p.get("context", 4096), steps_per_call=p.get("steps_per_call", 1), spec=spec,
                      engine=engine)
