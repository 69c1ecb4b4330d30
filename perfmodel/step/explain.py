"""`perfmodel explain`: one layer (or one op) term by term: bytes, FLOPs, each latency term with
its mechanism (a perfmodel.cost.components function) and source, and the resource the op waited on.

    perfmodel explain --ep 8 --batch 1 --layer 4 [--op routed_experts] [--json]
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from perfmodel.cost import components as cm
from perfmodel.engine.terms import collective_terms, op_compute_s, op_weights, stream_terms
from perfmodel.graph import ops as ops_mod
from perfmodel.step.predict import predict
from perfmodel.step.report import SCHEMA_VERSION
from perfmodel.util.errors import SpecError

# wait cause -> the resource the op waited on
RESOURCE = {"compute": "compute unit (MXU / VPU / SMs)", "weight_streaming": "DMA engine (HBM -> on-chip)",
            "expert_fetch": "DMA engine (routed experts, after the router)",
            "collective": "links and remote copies (collective)", "launch": "host / kernel launch",
            "fill_drain": "pipeline fill and drain of a kernel"}


def _source(hw, *names: str) -> str:
    found = [f"{n}: {hw.sources[k]}" for n in names
             for k in (f"components.{n}", n, f"efficiency.{n}") if k in hw.sources][:len(names)]
    return "; ".join(found) or "assumption (no source entry)"


def terms(g: ops_mod.OpGraph, hw, j: int, weights: np.ndarray, coll_s: np.ndarray, megakernel: bool) -> list[dict]:
    """The latency terms of op `j` in isolation (`coll_s`: the graph's collective seconds), each
    with its mechanism and source."""
    c, out = hw.components, []
    if g.is_collective[j]:
        t = float(coll_s[j])
        k, m, p = g.coll_kind[j], float(g.coll_bytes[j]), int(g.coll_group[j])
        if cm.is_tpu_model(c):
            fixed = g.kernel_all_reduce if megakernel and k == "all_reduce" else ""
            _, alg, phases = cm.collective_time(c, k, m, p, hw.cores_per_chip, fixed or None)
            how = "the model's kernel at these rows" if fixed else "the fastest for the payload"
            out.append({"term": f"{k} ({alg}: {how}; {len(phases)} phases of remote copies)", "seconds": t,
                        "mechanism": "components.collective_time", "source": _source(
                            hw, *(("chips_per_host",) if alg == "one_shot" else ()), "collective_call_s",
                            "collective_phase_s", "chip_bandwidth_bytes_per_s")})
        elif cm.is_gpu_model(c):
            out.append({"term": f"{k} library call over {p} ranks", "seconds": t,
                        "mechanism": "components.gpu_all_reduce_time",
                        "source": _source(hw, "allreduce_base_s", "allreduce_bytes_per_s")})
        else:
            out.append({"term": f"{k} over {p} devices", "seconds": t, "mechanism": "collectives.collective_time_s",
                        "source": _source(hw, "link_latency_s", "link_bandwidth_bytes_per_s")})
        return out
    comp = float(op_compute_s(g, hw, weights)[j])
    if g.routed_bytes[j] > 0 and hw.efficiency.expert_overhead_s > 0:
        fixed = math.ceil(max(1.0, g.distinct_experts)) * hw.efficiency.expert_overhead_s
        comp -= fixed
        out.append({"term": "fixed cost per distinct expert (whole-step parameter)", "seconds": fixed,
                    "mechanism": "efficiency.expert_overhead_s", "source": _source(hw, "efficiency")})
    mxu = cm.is_tpu_model(c) and weights[j] > 0 and g.flops[j] > 0
    out.append({"term": "matmul weight push" if mxu else "compute (peak x efficiency.flops)", "seconds": comp,
                "mechanism": "components.matmul_time" if mxu else "engine.terms.op_compute_s",
                "source": _source(hw, "mxu_push_bf16_s", "mxu_push_fp8_s", "mxu_dot_issue_s") if mxu
                else _source(hw, "peak_flops_per_s", "flops")})
    moved = float(g.static_bytes[j] + g.routed_bytes[j] + g.kv_bytes[j])
    if moved > 0:
        bw, lat, desc = stream_terms(hw)
        out.append({"term": "HBM -> on-chip stream", "seconds": lat + desc + moved / bw,
                    "mechanism": "components.dma_stream_time" if cm.is_tpu_model(c) else "bytes / bandwidth",
                    "source": _source(hw, "dma_bandwidth_bytes_per_s", "dma_latency_s") if cm.is_tpu_model(c)
                    else _source(hw, "hbm_bandwidth_bytes_per_s", "kernel_bandwidth_efficiency", "hbm")})
    return out


def explain(model, hw, d, layer: int, op: str | None = None) -> dict:
    p = predict(model, hw, d)
    g = ops_mod.build(model, d)
    weights = op_weights(g, model.formats["routed_expert"].bytes_per_value)
    idx = [j for j in range(len(g)) if g.layer[j] == layer and (op is None or g.name[j] == op)]
    if not idx:
        known = sorted({g.name[j] for j in range(len(g)) if g.layer[j] == layer})
        raise SpecError("--op" if op else "--layer", op or layer,
                        f"not in the model; ops of layer {layer}: {', '.join(known)}" if known
                        else f"layers are 0..{int(g.layer.max())}")
    tl = p.timeline
    megakernel = d.engine == "megakernel"
    coll_s = collective_terms(g, hw, megakernel)[0]
    rows = []
    for j in idx:
        waits = {k: float(v[j]) for k, v in tl.wait_s.items() if k != "compute" and v[j] > 0}
        cause = max(waits, key=waits.get) if waits else "compute"
        rows.append({"op": g.name[j], "flops": float(g.flops[j]), "static_bytes": float(g.static_bytes[j]),
                     "routed_bytes": float(g.routed_bytes[j]), "kv_bytes": float(g.kv_bytes[j]),
                     "act_bytes": float(g.act_bytes[j]), "start_s": float(tl.start_s[j]),
                     "end_s": float(tl.end_s[j]), "waits_s": waits, "waited_on": RESOURCE[cause],
                     "terms": terms(g, hw, j, weights, coll_s, megakernel)})
    if d.serving_engine:  # each op's kernels: time, measured table or physical extrapolation
        from perfmodel.step.serving_report import kernel_rows
        krows = kernel_rows(model, hw, d)[0]
        for j, r in zip(idx, rows):
            r["kernels"] = [k for k in krows if k["op_index"] == j]
    row = next((r for r in p.layers if r.layer == layer), None)
    return {"schema_version": SCHEMA_VERSION, "command": "explain", "model": model.name, "hardware": hw.name,
            "deployment": dataclasses.asdict(d), "layer": layer, "kind": g.layer_kind.get(layer, ""),
            "layer_time_s": row.time_s if row else None, "step_s": p.step_s, "ops": rows}
