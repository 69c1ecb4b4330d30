"""`perfmodel explain`: one layer (or one op) term by term: bytes, FLOPs, each latency term with
its mechanism (a perfmodel.cost.components function) and source, and the resource the op waited on;
and a megakernel step phase by phase (perfmodel.step.phases), beside a published profile.

    perfmodel explain --ep 8 --batch 1 --layer 4 [--op routed_experts] [--json]
    perfmodel explain --profile musespark [--json]
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from perfmodel.cost import components as cm
from perfmodel.engine.megakernel import kernel_terms, vector_copies
from perfmodel.engine.terms import (RECURRENCES, collective_terms, op_compute_s, op_feeds, op_weights, stream_terms,
                                    tpu_matmuls, whole_batch_experts)
from perfmodel.graph import ops as ops_mod
from perfmodel.spec.recipe import to_table as recipe_table
from perfmodel.step.phases import (SKIPPED, attention_parts, compare, kernel_model, over_harness,
                                   stated_checks)
from perfmodel.step.predict import predict
from perfmodel.step.report import SCHEMA_VERSION, deployment_json
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


KERNEL_TERMS = {"bank_dots": ("one MXU dot per ring bank the matmul streams over, beyond its first",
                              "components.matmul_time", ("mxu_dot_issue_s",)),
                "attention_core": ("the attention core's latency (per sequence and per cache tile walked)",
                                   "components.attention_core_time", ("attention_core_s", "attention_tile_s")),
                "top_k": ("routing's pick", "components.topk_time", ("topk_round_s",)),
                "embed_pick": ("the pick of each sequence's embedding row out of its copied tile",
                               "components.embed_pick_time", ("embed_pick_s",)),
                "xla_embedding": ("embedding lookup + psum in XLA glue around the kernel",
                                  "components.xla_embedding_time", ("xla_embedding_s",)),
                "xla_sampling": ("greedy pick (argmax + all-gather) in XLA glue after the kernel",
                                 "components.xla_sampling_time", ("xla_embedding_s",))}


def terms(g: ops_mod.OpGraph, hw, j: int, weights: np.ndarray, coll_s: np.ndarray, megakernel: bool,
          extra: dict[str, np.ndarray], feeds, compute: np.ndarray, dequantised: frozenset[int]) -> list[dict]:
    """The latency terms of op `j` in isolation (`coll_s`: the graph's collective seconds; `extra`:
    the megakernel's kernel_terms; `feeds`: op_feeds; `compute`: op_compute_s; `dequantised`: the
    matmuls dequantised to bf16 first, tpu_matmuls), each with its mechanism and source."""
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
    comp = float(compute[j])
    mxu = cm.is_tpu_model(c) and weights[j] > 0 and g.flops[j] > 0
    fmt = g.fmt[j] if g.fmt else None
    fed = ""
    if fmt is not None and feeds is not None:
        dtype, rows = feeds[0][j], feeds[1][j]
        how = "natively" if dtype == fmt.compute_dtype else f"its fallback ({hw.name} takes no {fmt.compute_dtype})"
        fed = f"; {fmt.name} fed as {dtype} {how}" + (f", {rows} LHS rows per batch row" if rows > 1 else "")
        if j in dequantised:
            fed = f"; {fmt.name} dequantised to bf16 first (cheaper than its block-diagonal {dtype} dot at these rows)"
        if g.routed_bytes[j] > 0 and whole_batch_experts(g, hw, megakernel):
            fed += "; each expert's dots over the whole batch"
    if megakernel and g.name[j] in RECURRENCES and cm.recurrence_on_vpu(c):
        out.append({"term": "recurrence: the core's latency and its FLOPs on the vector unit", "seconds": comp,
                    "mechanism": "components.recurrence_time",
                    "source": _source(hw, "attention_core_s", "vpu_flops_per_s")})
    else:
        dots = f" ({g.dots[j]:.0f} dots)" if mxu and g.dots is not None and g.routed_bytes[j] == 0 else ""
        out.append({"term": ("matmul weight push" + dots if mxu else "compute (peak x efficiency.flops)") + fed,
                    "seconds": comp, "mechanism": "components.matmul_time" if mxu else "engine.terms.op_compute_s",
                    "source": (_source(hw, "mxu_push_bf16_s", "mxu_push_fp8_s", "mxu_dot_issue_s") if mxu
                               else _source(hw, "peak_flops_per_s", "flops"))
                    + (f"; format {fmt.name}: {fmt.source}" if fmt is not None and fmt.source else "")})
    for key, v in (extra or {}).items():
        if v[j] > 0:
            what, mech, params = KERNEL_TERMS[key]
            out.append({"term": what + (f" ({g.recipe.top_k})" if key == "top_k" else ""), "seconds": float(v[j]),
                        "mechanism": mech, "source": _source(hw, *params)})
    moved = float(g.static_bytes[j] + g.routed_bytes[j] + g.kv_bytes[j])
    layer = int(g.layer[j])
    if moved > 0:
        bw, lat, desc = stream_terms(hw)
        copies = max(1, math.ceil(g.distinct_experts)) if g.routed_bytes[j] > 0 else 1
        per = g.expert_descriptors if g.routed_bytes[j] > 0 and megakernel else 1
        tiles = g.kv_copies.get(layer, 1) if megakernel and g.kv_bytes[j] > 0 else 1
        out.append({"term": "HBM -> on-chip stream" + (f" ({copies} expert copies of {per} descriptors)"
                                                       if g.routed_bytes[j] > 0 else "")
                    + (f" ({tiles} cache tile copies)" if tiles > 1 else ""),
                    "seconds": lat + copies * per * tiles * desc + moved / bw,
                    "mechanism": "components.dma_stream_time" if cm.is_tpu_model(c) else "bytes / bandwidth",
                    "source": _source(hw, "dma_bandwidth_bytes_per_s", "dma_latency_s") if cm.is_tpu_model(c)
                    else _source(hw, "hbm_bandwidth_bytes_per_s", "kernel_bandwidth_efficiency", "hbm")})
    if megakernel and g.kv_bytes[j] > 0 and layer in g.writeback and j == int(np.flatnonzero(
            (g.layer == layer) & (g.kv_bytes > 0))[0]):
        nbytes, descriptors = g.writeback[layer]
        out.append(_copy_term(hw, f"cache write-back (a {g.recipe.kv_tile_tokens}-token tile a sequence, "
                                  f"{descriptors} descriptors), issued as it starts, waited for before the layer's "
                                  "next collective", nbytes, descriptors, "kv_tile_tokens"))
    vectors = vector_copies(g).get(layer) if megakernel else None
    if vectors and j == int(np.flatnonzero(g.layer == layer)[0]):
        nbytes, copies = vectors
        out.append(_copy_term(hw, f"the next layer's vectors ({copies} copies, {nbytes / 1024:.0f} KiB), issued "
                                  "as the layer starts, before its KV; no op of this layer waits for them",
                              nbytes, copies, "layer_vector_bytes"))
    return out


def _copy_term(hw, what: str, nbytes: float, descriptors: int, setting: str) -> dict:
    """A copy the model's kernel issues beside the ops' own streams ([megakernel] `setting`), in
    isolation: first-byte latency, its descriptors and its bytes at the engine's bandwidth."""
    bw, lat, desc = stream_terms(hw)
    tpu = cm.is_tpu_model(hw.components)
    return {"term": what, "seconds": lat + descriptors * desc + nbytes / bw,
            "mechanism": "components.dma_stream_time" if tpu else "bytes / bandwidth",
            "source": f"[megakernel] {setting}; " + (_source(hw, "dma_bandwidth_bytes_per_s", "dma_latency_s") if tpu
                                                      else _source(hw, "hbm_bandwidth_bytes_per_s", "hbm"))}


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
    extra = kernel_terms(g, hw) if megakernel else {}
    feeds = op_feeds(g, hw)
    compute = op_compute_s(g, hw, weights, megakernel=megakernel)
    dequantised = frozenset(k for k, (_, deq) in tpu_matmuls(g, hw, weights, megakernel, feeds).items() if deq) \
        if cm.is_tpu_model(hw.components) else frozenset()
    rows = []
    for j in idx:
        waits = {k: float(v[j]) for k, v in tl.wait_s.items() if k != "compute" and v[j] > 0}
        cause = max(waits, key=waits.get) if waits else "compute"
        rows.append({"op": g.name[j], "flops": float(g.flops[j]), "static_bytes": float(g.static_bytes[j]),
                     "routed_bytes": float(g.routed_bytes[j]), "kv_bytes": float(g.kv_bytes[j]),
                     "act_bytes": float(g.act_bytes[j]), "start_s": float(tl.start_s[j]),
                     "end_s": float(tl.end_s[j]), "waits_s": waits, "waited_on": RESOURCE[cause],
                     "terms": terms(g, hw, j, weights, coll_s, megakernel, extra, feeds, compute, dequantised)})
    if d.serving_engine:  # each op's kernels: time, measured table or physical extrapolation
        from perfmodel.step.serving_report import kernel_rows
        krows = kernel_rows(model, hw, d)[0]
        for j, r in zip(idx, rows):
            r["kernels"] = [k for k in krows if k["op_index"] == j]
    row = next((r for r in p.layers if r.layer == layer), None)
    return {"schema_version": SCHEMA_VERSION, "command": "explain", "model": model.name, "hardware": hw.name,
            "deployment": deployment_json(d), "layer": layer, "kind": g.layer_kind.get(layer, ""),
            "layer_time_s": row.time_s if row else None, "step_s": p.step_s, "ops": rows,
            "megakernel": recipe_table(model.megakernel) if megakernel else None}


def explain_profile(profile: dict, hw) -> dict:
    """A published phase profile beside the prediction of each of its kernels (perfmodel.step.phases),
    with each kernel's attention parts (phases.attention_parts) in microseconds."""
    kernels = compare(profile, hw)
    for name, k in kernels.items():
        model = kernel_model(profile["kernels"][name])
        parts = over_harness(profile, lambda d: attention_parts(model, hw, d))
        k["attention_parts_us"] = {part: v * 1e6 for part, v in parts.items()}
    return {"schema_version": SCHEMA_VERSION, "command": "explain", "hardware": hw.name,
            "phase_profile": {"source": profile.get("source", ""), "harness": profile.get("harness", {}),
                              "skipped": SKIPPED, "kernels": kernels, "checks": stated_checks(profile, hw)}}


def kernel_plan_comparison(model, hw, plan, steps_per_call: int = 1) -> dict:
    """The two megakernels of one deployment side by side: the model's own ([megakernel], the
    Inferact recipe where the model file names it) on the model's uniform stream, and the kernel
    whose plan file `plan` is (perfmodel.graph.dmaplan.KernelPlan), replayed copy by copy with its
    settings; what makes them differ, term by term, and the step by cause."""
    from perfmodel.engine.megakernel import bank_bytes, sizing
    from perfmodel.step.predict import plan_deployment, plan_model
    d = dataclasses.replace(plan_deployment(plan), steps_per_call=steps_per_call)
    recipe = predict(model, hw, d)
    kernel = predict(model, hw, d, plan=plan)
    kmodel = plan_model(model, plan)
    g, gk = ops_mod.build(model, d), ops_mod.build(kmodel, d)
    top_k = model.moe.top_k if model.moe else 1
    s, sk = sizing(g, hw, d, top_k), sizing(gk, hw, d, top_k)
    hbm = plan.hbm_copies
    experts = max(1, math.ceil(g.distinct_experts)) * int(model.count(ffn="moe")) if model.moe else 0
    ring_tiles = math.ceil(float(g.static_bytes.sum()) / bank_bytes(g, hw))
    feed = lambda graph: next((f"{graph.fmt[j].name} as {op_feeds(graph, hw)[0][j]}"
                               for j in range(len(graph)) if graph.routed_bytes[j] > 0), "-")
    all_reduce = lambda graph: graph.kernel_all_reduce or "fastest per payload"
    rows = [
        ("ring", f"{s.banks} x {s.tile_bytes / 2**20:.3g} MiB banks", f"{sk.banks} x {sk.tile_bytes / 2**20:.3g} MiB banks"),
        ("HBM descriptors per step", ring_tiles + experts * g.expert_descriptors + len(model.layers) + 2, len(hbm)),
        ("HBM bytes per device", recipe.bytes_per_device, kernel.bytes_per_device),
        ("of which padding", 0, sum(c.padding for c in hbm) or kernel.bytes_per_device - recipe.bytes_per_device),
        ("expert slots", s.slots, sk.slots),
        ("routed experts fed", feed(g), feed(gk)),
        ("all-reduce", all_reduce(g), all_reduce(gk)),
        ("collective wire, rows", f"{model.megakernel.collective_wire}, >= {model.megakernel.collective_rows}",
         f"{kmodel.megakernel.collective_wire}, >= {kmodel.megakernel.collective_rows}"),
        ("remote copies in the plan", "-", len(plan.remote_copies)),
    ]
    causes = sorted(set(recipe.breakdown_s) | set(kernel.breakdown_s))
    return {"schema_version": SCHEMA_VERSION, "command": "explain", "model": model.name, "hardware": hw.name,
            "deployment": deployment_json(d), "plan_source": plan.source,
            "recipe_step_s": recipe.step_s, "kernel_step_s": kernel.step_s,
            "recipe_tokens_per_s": recipe.tokens_per_s, "kernel_tokens_per_s": kernel.tokens_per_s,
            "differences": [{"what": w, "recipe": a, "kernel": b} for w, a, b in rows],
            "by_cause_s": {c: {"recipe": recipe.breakdown_s.get(c, 0.0), "kernel": kernel.breakdown_s.get(c, 0.0)}
                           for c in causes}}
