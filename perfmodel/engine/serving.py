"""GPU serving engines (vLLM, SGLang, TensorRT-LLM): a decode step as the kernels the engine launches.

The engine's kernel inventory is data (perfmodel/data/serving_engines/<engine>.toml): which
matrices it fuses into one GEMM or keeps whole, the kernels around them per op of the op graph,
its attention / MLA / KDA kernels, its all-reduce and MoE dispatch. `kernels` expands one step's
op graph into that list (each kernel attached to the op it implements); each kernel is costed by
perfmodel.cost.gpu_kernels (`cost`): the engine's measured table where it reaches, else the
physical component fitted to the tables, else the hardware file's generic components. The step
replays them back to back on one stream (one CUDA graph), but for the shared experts of an engine
that runs them on a second stream beside the routed experts at few rows (the inventory's
[shared_experts_stream]): only what the routed experts' time does not cover of them is added.

Layouts: attention TP over `tp`, attention data parallelism over devices / (tp x pp), experts
over `ep` groups of devices / ep; MoE tokens reach the experts by all-reduce (tokens replicated
per attention replica; with DP, all-gathered and reduce-scattered) or by all-to-all dispatch /
combine (`Deployment.moe_comm`); pipeline stages pass the hidden state point to point. A
collective over more GPUs than the hardware's NVLink domain (`domain_devices`) runs in two
levels: the engine's kernel inside the domain and the inter-node fabric between domains.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from perfmodel.cost import components as cm
from perfmodel.cost import gpu_kernels as gk
from perfmodel.engine.terms import Timeline
from perfmodel.graph.ops import ACT_BYTES, OpGraph
from perfmodel.spec.arch import GQA, KDA, MLA, ModelSpec
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.engines import ROW_PARALLEL, inventory
from perfmodel.spec.hardware import Hardware
from perfmodel.util import limits
from perfmodel.util.errors import SpecError

TABLE_DTYPE = {"fp8-kv": "fp8", "int4-group32": "int4", "int4-g128-f32": "int4"}
SHARED_EXPERT_OPS = ("shared_gate_up", "shared_down")


@dataclass
class Kernel:
    """One kernel of the step: the op it belongs to, what it is, its shape and its cost."""
    op: int
    name: str
    cls: str
    key: dict
    point: dict
    seconds: float = 0.0
    source: str = ""          # "table: <file> (<engine> <version>)" or "physical: <fit or components>"
    measured: bool = False
    cause: str = "compute"    # where its time goes in the step's breakdown
    levels: list = field(default_factory=list)  # a collective's (scope, seconds) beyond one domain
    stream: str = "main"      # "aux": on the second stream, beside the layer's routed experts


def _values(expr: str, names: dict) -> float:
    """A product of names and numbers ("2*hidden")."""
    out = 1.0
    for f in expr.split("*"):
        f = f.strip()
        out *= float(f) if f.replace(".", "").isdigit() else names[f]
    return out


def _dtype(fmt_name: str) -> str:
    return TABLE_DTYPE.get(fmt_name, "int4" if fmt_name.startswith("int4") else fmt_name)


def _layer_names(model: ModelSpec, layer, d: Deployment) -> dict:
    h, a, tp = model.hidden, model.attn(layer.attention) if layer else None, d.tp
    n = {"hidden": h, "latent": (model.moe.latent_dim or h) if model.moe else h, "vocab": model.vocab / tp,
         "experts": model.moe.experts if model.moe else 0, "ffn_width": model.dense_width / tp,
         "shared_width": (model.moe.shared_width if model.moe else 0) / tp,
         "heads": 0, "head_dim": 0, "kv_heads": 0, "q_width": 0, "kv_width": 0, "lora": 0, "rope": 0, "v_width": 0}
    if isinstance(a, GQA):
        kvl = -(-a.kv_heads // tp)
        n |= {"heads": a.heads // tp, "head_dim": a.head_dim, "kv_heads": kvl, "q_width": a.heads // tp * a.head_dim,
              "kv_width": kvl * a.head_dim, "v_width": a.heads // tp * (a.v_head_dim or a.head_dim)}
    elif isinstance(a, MLA):
        n |= {"heads": a.heads // tp, "lora": a.q_lora_rank + a.kv_lora_rank + a.qk_rope_dim, "rope": a.qk_rope_dim,
              "v_width": a.heads // tp * a.v_head_dim}
    elif a is not None and hasattr(a, "heads"):
        n |= {"heads": a.heads // tp, "head_dim": getattr(a, "head_dim", 0),
              "v_width": a.heads // tp * getattr(a, "head_dim", 0)}
    return n


def kernels(model: ModelSpec, hw: Hardware, d: Deployment, g: OpGraph) -> list[Kernel]:
    """The step's kernels in launch order, costed (the last step's list is kept: predict and its
    report ask for the same one). Callers must not mutate it."""
    key = (id(model), id(hw), d, id(g))
    if _LAST and _LAST[0] == key:
        return _LAST[2]
    ks = _kernels(model, hw, d, g)
    _LAST[:] = [key, (model, hw, g), ks]  # the objects kept alive so their ids stay theirs
    return ks


_LAST: list = []


def _kernels(model: ModelSpec, hw: Hardware, d: Deployment, g: OpGraph) -> list[Kernel]:
    inv = inventory(d.serving_engine)
    tabs = gk.tables(_gpu(hw), inv["kernel_tables"])
    out: list[Kernel] = []
    by_layer: dict[int, list[int]] = {}
    for j, l in enumerate(g.layer.tolist()):
        by_layer.setdefault(l, []).append(j)
    memo: dict = {}
    for l, idx in by_layer.items():
        layer = model.layers[l - 1] if 1 <= l <= len(model.layers) else None
        sig = (l if layer is None else None, None if layer is None else (layer.attention, layer.ffn),
               tuple(g.name[j] for j in idx))
        if sig not in memo:
            memo[sig] = (idx[0], _layer_kernels(model, hw, d, g, inv, tabs, layer, idx))
        first, ks = memo[sig]
        out += [_at(k, k.op - first + idx[0]) for k in ks]
    out += _pp_kernels(model, hw, d, g)
    return out


def _at(k: Kernel, op: int) -> Kernel:
    """A shallow copy of k for op `op` (a layer's kernels reused for each layer of its kind; a
    thousand per step, where dataclasses.replace costs 5 us each)."""
    c = object.__new__(Kernel)
    c.__dict__.update(k.__dict__)
    c.op = op
    return c


def _gpu(hw: Hardware) -> str:
    return hw.name if hw.name in gk.gpus_with_tables() else ""


def _layer_kernels(model, hw, d, g, inv, tabs, layer, idx) -> list[Kernel]:
    names = {g.name[j]: j for j in idx}
    nm = _layer_names(model, layer, d)
    t = g.tokens
    b = -(-d.batch // (d.dp * d.pp))
    ks: list[Kernel] = []
    mms = {}
    if layer is not None:
        mms = {mm.name: mm for mm in model.layer_matmuls(layer)}
    elif g.name[idx[0]] == "final_norm" or "lm_head" in names:
        from perfmodel.spec.arch import Matmul
        mms = {"lm_head": Matmul("lm_head", "lm_head" if not model.tie_embeddings else "embedding", model.hidden,
                                 model.vocab)}
    groups = {k: v for k, v in inv.get("gemm_groups", {}).items()}
    replicated = set(inv.get("replicated", {}).get("matmuls", []))
    grouped = {m: gname for gname, ms in groups.items() if all(x in mms for x in ms) for m in ms}
    a = model.attn(layer.attention) if layer is not None else None
    module_covers = set()
    if isinstance(a, MLA):  # decode absorbs kv_b into the BMMs around the MLA core (or the module)
        module_covers = {"q_b", "kv_b", "o_proj"} if inv.get("mla") == "module" else {"kv_b"}
    norm_fused = inv.get("norm_in_all_reduce", False)
    prev_ar = False
    kind = type(a).__name__.lower() if a is not None else ""
    extra = {k["op"]: [] for k in inv.get("kernel", [])}
    for k in inv.get("kernel", []):
        if k.get("attention", kind) == kind:  # a kernel only beside one attention kind
            extra[k["op"]].append(k)
    done_groups = set()
    latent_moe = layer is not None and layer.ffn == "moe" and bool(model.moe.latent_dim)
    fused_tail = latent_moe and _latent_tail(model, inv, hw, d, t)
    ar_names = ("attn_all_reduce", "ffn_all_reduce", "moe_all_reduce", "expert_all_reduce", "embedding_all_reduce")
    for j in idx:
        op = g.name[j]
        before = [k for k in extra.get(op, []) if k.get("before")]
        after = [k for k in extra.get(op, []) if not k.get("before")]
        for k in before:
            ks.append(_elementwise(k, nm, t, j, hw, tabs, inv))
        if op.endswith("_norm") and norm_fused and prev_ar:
            after = []  # inside the all-reduce kernel before it
        elif latent_moe and op in ("expert_all_reduce", "latent_up", "moe_all_reduce") and d.dp == 1:
            ks += _moe_tail(op, j, g, model, d, t, hw, tabs, inv, nm, mms, fused_tail)
        elif op in mms and op not in module_covers:
            if op in grouped:
                gname = grouped[op]
                if gname not in done_groups:
                    done_groups.add(gname)
                    ks += _gemm(model, inv, [mms[m] for m in groups[gname]], gname, j, t, d.tp,
                                all(m in replicated for m in groups[gname]), hw, tabs, nm)
            else:
                ks += _gemm(model, inv, [mms[op]], op, j, t, d.tp, op in replicated, hw, tabs, nm)
        elif op == "mla_attention":
            ks += _mla(model, inv, a, j, t, b, d, hw, tabs)
        elif op == "kda_recurrence":
            ks += [_cost(Kernel(j, kname, "kda", {"kernel": kname}, {"heads": a.heads // d.tp, "batch": b}), hw, tabs, inv)
                   for kname in inv["kda"]]
        elif op == "gqa_attention":
            kvd = _dtype(model.formats["kv_cache"].name)
            ks.append(_cost(Kernel(j, "decode_attention", "attention",
                                   {"kv_dtype": "fp8" if kvd == "fp8" else "bf16", "heads": nm["heads"],
                                    "kv_heads": nm["kv_heads"], "head_dim": a.head_dim},
                                   {"batch": b, "context": max(d.context, 1)}), hw, tabs, inv))
        elif op == "routed_experts":
            ks += _moe(model, inv, j, t, d, hw, tabs)
        elif op in ar_names:
            if op == "expert_all_reduce" and inv.get("fused_moe_reduce") and d.dp == 1 and "moe_all_reduce" in names:
                pass  # one all-reduce for routed + shared experts (moe_all_reduce)
            elif op == "expert_all_reduce" and d.dp > 1:
                pass  # DP: the experts' tokens come back by reduce-scatter / combine (_moe)
            else:
                ks.append(_collective(j, "all_reduce", float(g.coll_bytes[j]), int(g.coll_group[j]), hw, tabs, inv))
        elif op == "latent_all_gather" and "latent_down" in replicated:
            pass  # the latent projection is replicated: nothing to gather
        elif g.is_collective[j]:
            ks.append(_collective(j, g.coll_kind[j], float(g.coll_bytes[j]), int(g.coll_group[j]), hw, tabs, inv))
        elif op not in module_covers and not (op in mms) and not any(k["op"] == op for k in inv.get("kernel", [])):
            # an op with no kernel named in the inventory: one kernel of its own bytes and FLOPs
            ks.append(_cost(Kernel(j, op, "elementwise", {}, {"bytes": float(g.bytes[j]), "flops": float(g.flops[j])}),
                            hw, tabs, inv))
        for k in after:
            ks.append(_elementwise(k, nm, t, j, hw, tabs, inv))
        prev_ar = op in ar_names and any(k.op == j for k in ks)
    if "routed_experts" in names and t * d.dp <= inv.get("shared_experts_stream", {}).get("max_rows", -1):
        for k in ks:  # the shared experts on the second stream, beside the routed experts
            if g.name[k.op] in SHARED_EXPERT_OPS:
                k.stream = "aux"
    return ks


def _elementwise(spec: dict, names: dict, t: int, j: int, hw, tabs, inv) -> Kernel:
    k = Kernel(j, spec["name"], "elementwise", {}, {"bytes": ACT_BYTES * t * _values(spec["values"], names), "flops": 0.0})
    return _cost(k, hw, tabs, inv)


def _gemm(model, inv, mms, name, j, t, tp, replicated, hw, tabs, nm) -> list[Kernel]:
    mm = mms[0]
    fmt = model.matmul_format(mm)
    dt = _dtype(fmt.name)
    n = sum(m.d_out for m in mms)
    k = mm.d_in
    if not replicated:
        if mm.name in ROW_PARALLEL:
            k = k // tp
        else:
            n = -(-n // tp)
    out = []
    if inv.get("act_quant") and fmt.compute_dtype in ("fp8", "fp4"):
        out.append(_cost(Kernel(j, f"{name}_quantize_input", "elementwise", {},
                                {"bytes": 3.0 * t * k, "flops": 0.0}), hw, tabs, inv))
    out.append(_cost(Kernel(j, f"{name}_gemm", "gemm", {"dtype": dt}, {"m": t, "n": n, "k": k}), hw, tabs, inv))
    return out


def _mla(model, inv, a, j, t, b, d, hw, tabs) -> list[Kernel]:
    kv = _dtype(model.formats["kv_cache"].name)
    kv = "fp8" if kv == "fp8" else "bf16"
    heads = a.heads // d.tp
    pt = {"heads": heads, "batch": b, "context": max(d.context, 1)}
    if inv.get("mla") == "module":
        dt = _dtype(model.formats["attention"].name)
        return [_cost(Kernel(j, "mla_decode_module", "mla_module", {"kv_dtype": kv, "dtype": dt}, pt), hw, tabs, inv)]
    return [_cost(Kernel(j, "mla_absorb_q", "mla_bmm", {"op": "mla_gen_pre", "dtype": "bf16"},
                         {"heads": heads, "tokens": t}), hw, tabs, inv),
            _cost(Kernel(j, "mla_decode", "mla_core", {"kv_dtype": kv}, pt), hw, tabs, inv),
            _cost(Kernel(j, "mla_absorb_v", "mla_bmm", {"op": "mla_gen_post", "dtype": "bf16"},
                         {"heads": heads, "tokens": t}), hw, tabs, inv)]


def _moe(model, inv, j, t, d, hw, tabs) -> list[Kernel]:
    m = model.moe
    dexp = m.latent_dim or model.hidden
    tokens = t * d.dp                     # every attention replica's rows reach the experts
    ep, etp = d.expert_groups, d.devices // d.expert_groups
    dt = _dtype(model.formats["routed_expert"].name)
    key = {"dtype": dt, "hidden": dexp, "inter": m.expert_width, "topk": m.top_k, "experts": m.experts,
           "tp": etp, "ep": ep}
    out = []
    a2a = d.moe_comm == "all_to_all" and d.devices > 1
    if a2a:
        out.append(_dispatch(j, "dispatch", t, dexp, m, d, hw, tabs, inv))
    elif d.dp > 1:
        out.append(_collective(j, "all_gather", ACT_BYTES * tokens * dexp, d.devices, hw, tabs, inv))
    out.append(_cost(Kernel(j, "fused_moe", "moe", key, {"tokens": tokens}), hw, tabs, inv))
    if a2a:
        out.append(_dispatch(j, "combine", t, dexp, m, d, hw, tabs, inv))
    elif d.dp > 1:
        out.append(_collective(j, "reduce_scatter", ACT_BYTES * tokens * dexp, d.devices, hw, tabs, inv))
    return out


def _dispatch(j, phase, t, dexp, m, d, hw, tabs, inv) -> Kernel:
    k = Kernel(j, f"deepep_ll_{phase}", "a2a", {"phase": phase, "hidden": dexp, "topk": m.top_k,
                                              "experts": m.experts, "ep": d.devices}, {"tokens": t})
    return _cost(k, hw, tabs, inv)


def _collective(j, kind, nbytes, ranks, hw, tabs, inv, name: str = "") -> Kernel:
    """One collective: the engine's kernel inside the NVLink domain, the fabric between domains.
    Inside a domain: the engine's custom all-reduce within one node, its multi-node NVLink
    (multicast, `all_reduce_nvlink_domain = "mnnvl"`) all-reduce across the nodes of a domain,
    else NCCL."""
    dom = hw.domain_devices or ranks
    inner = min(ranks, dom)
    node = hw.node_devices or dom
    pt = {"ranks": inner, "bytes": nbytes}
    if kind == "all_reduce" and ranks == inner and inner <= node and inv.get("all_reduce") == "custom":
        k = _cost(Kernel(j, name or "custom_all_reduce", "all_reduce", {}, pt), hw, tabs, inv)
    elif kind == "all_reduce" and ranks == inner and inner > node and inv.get("all_reduce_nvlink_domain") == "mnnvl":
        k = _cost(Kernel(j, name or "mnnvl_all_reduce", "mnnvl", {}, pt), hw, tabs, inv)
    else:
        k = _cost(Kernel(j, name or f"nccl_{kind}", "nccl", {"op_name": kind}, pt), hw,
                  gk.tables(_gpu(hw), "nccl"), inv)
    k.point = {"ranks": ranks, "bytes": nbytes}
    if ranks > inner:
        k.levels = [("inside the NVLink domain", k.seconds)]
        fabric = fabric_time(hw, nbytes / inner, ranks // inner, kind)
        k.levels.append(("inter-node fabric", fabric))
        k.seconds += fabric
        k.source += f"; + inter-node fabric over {ranks // inner} domains (fabric_latency_s, fabric_bandwidth_bytes_per_s)"
    k.cause = "collective"
    return k


def _latent_tail(model, inv, hw, d, t) -> bool:
    """Whether the engine's fused latent-MoE tail (inventory [latent_moe_tail]) runs this step."""
    c = inv.get("latent_moe_tail")
    return bool(c and model.moe.latent_dim and d.dp == 1 and d.tp in c["tp"] and t <= c["max_rows"]
                and _gpu(hw) in c["gpus"])


def _moe_tail(op, j, g, model, d, t, hw, tabs, inv, nm, mms, fused) -> list[Kernel]:
    """A latent MoE's reductions and up-projection (ops expert_all_reduce, latent_up,
    moe_all_reduce). Fused tail: one collective (routed latent all-reduce + RMSNorm + shared
    experts' reduce-scatter), the up-projection on each rank's slice of the hidden outputs, a
    multicast all-gather of the slices. Otherwise: the routed latent all-reduce, its RMSNorm, the
    replicated up-projection and the shared experts' own all-reduce."""
    lat, h = model.moe.latent_dim, model.hidden
    if fused:
        if op == "expert_all_reduce":
            return [_collective(j, "all_reduce", ACT_BYTES * t * (lat + h), d.tp, hw, tabs, inv, "latent_tail_collective")]
        if op == "latent_up":
            return [_cost(Kernel(j, "latent_up_slice_gemm", "gemm", {"dtype": _dtype(model.matmul_format(mms["latent_up"]).name)},
                                 {"m": t, "n": h // d.tp, "k": lat}), hw, tabs, inv)]
        return [_collective(j, "all_reduce", ACT_BYTES * t * h, d.tp, hw, tabs, inv, "latent_tail_all_gather")]
    if op == "expert_all_reduce":
        return [_collective(j, "all_reduce", float(g.coll_bytes[j]), int(g.coll_group[j]), hw, tabs, inv),
                _cost(Kernel(j, "latent_rms_norm", "elementwise", {}, {"bytes": ACT_BYTES * t * 2 * lat, "flops": 0.0}),
                      hw, tabs, inv)]
    if op == "latent_up":
        replicated = "latent_up" in set(inv.get("replicated", {}).get("matmuls", []))
        return _gemm(model, inv, [mms["latent_up"]], "latent_up", j, t, d.tp, replicated, hw, tabs, nm)
    return [_collective(j, "all_reduce", float(g.coll_bytes[j]), int(g.coll_group[j]), hw, tabs, inv)]


def fabric_time(hw: Hardware, shard_bytes: float, nodes: int, kind: str = "all_reduce") -> float:
    """The inter-node level of a two-level collective: each GPU exchanges its shard (the payload
    over the domain's GPUs) with the same GPU of the other domains, one fabric latency per
    doubling of the domains and the bus bytes over its NIC."""
    if hw.fabric_bandwidth_bytes_per_s <= 0:
        raise SpecError("fabric_bandwidth_bytes_per_s", hw.fabric_bandwidth_bytes_per_s,
                        f"the layout spans {nodes} NVLink domains of {hw.domain_devices} GPUs; {hw.name} gives no "
                        "inter-node fabric")
    factor = 2.0 if kind == "all_reduce" else 1.0
    return (math.ceil(math.log2(nodes)) * hw.fabric_latency_s
            + factor * (nodes - 1) / nodes * shard_bytes / hw.fabric_bandwidth_bytes_per_s)


def _pp_kernels(model, hw, d, g) -> list[Kernel]:
    """Pipeline parallelism: the hidden state of the micro-batch sent to the next stage, once per
    stage boundary (over NVLink inside a domain, else the fabric)."""
    if d.pp <= 1:
        return []
    n = len(model.layers)
    stage = -(-n // d.pp)
    out = []
    nbytes = ACT_BYTES * g.tokens * model.hidden
    per_stage = d.devices // d.pp
    for s in range(1, d.pp):
        last = s * stage
        j = int(np.flatnonzero(g.layer == min(last, n))[-1])
        cross = hw.domain_devices and (s * per_stage) // hw.domain_devices != (s * per_stage - 1) // hw.domain_devices
        if cross:
            t = fabric_time(hw, nbytes, 2, "send")
            src = "point-to-point send over the inter-node fabric (fabric_latency_s, fabric_bandwidth_bytes_per_s)"
        else:
            t = hw.link_latency_s + nbytes / hw.link_bandwidth_bytes_per_s
            src = "point-to-point send over NVLink (link_latency_s, link_bandwidth_bytes_per_s)"
        out.append(Kernel(j, "pp_send", "p2p", {}, {"bytes": nbytes}, t, "physical: " + src, False, "collective"))
    return out


def measured_as(inv: dict, k: Kernel, gpu: str) -> dict | None:
    """The inventory's [[measured_as]] entry for a kernel the engine launches but whose own tables
    time another kernel (or none): the kernel source to match, in which engines' tables. An entry
    may hold for one dtype, some GPUs and one expert-parallel size (`ep`) only."""
    for m in inv.get("measured_as", []):
        if m["class"] == k.cls and all(m.get(f, k.key.get(f)) == k.key.get(f) for f in ("dtype", "ep")) \
                and (not m.get("gpus") or gpu in m["gpus"]):
            return m
    return None


def _cost(k: Kernel, hw: Hardware, tabs, inv) -> Kernel:
    """The kernel's seconds and where they came from: the engine's table (or, for a kernel the
    inventory says is measured as another's, that kernel's tables on this GPU, then for a
    collective on `collective_tables`' GPU), else the physical fit, else the hardware file's
    generic components."""
    if k.cls == "elementwise":
        k.cause = "weight_streaming" if k.point["bytes"] else "compute"
    if k.cls == "moe":
        k.cause = "expert_fetch"
    if k.cls in ("gemm", "mla_bmm"):  # a decode GEMM streams its weights
        k.cause = "weight_streaming"
    if k.cls in gk.COMM:
        k.cause = "collective"
    gpu = _gpu(hw)
    eng = tabs.engine if tabs is not None else (inv or {}).get("kernel_tables", "")
    m = measured_as(inv, k, gpu) if gpu else None
    cls, kernel = (m.get("table_class", k.cls), m["kernel"]) if m else (k.cls, "")
    gpus = [gpu] + ([hw.collective_tables] if k.cls in gk.COMM and hw.collective_tables else [])
    where = [(g, e) for g in gpus for e in m["tables"]] if m else [(gpu, eng)]
    skipped = ""
    if k.cls != "elementwise":
        for g, e in where:
            t_e = tabs if (g, e) == (gpu, eng) else gk.tables(g, e)
            hit = gk.table_time(t_e, cls, k.key, k.point, kernel)
            if hit is not None and k.cls == "moe" and gk.grouped_routing(t_e, hit[1]):
                skipped = f"; not its table {hit[1].file}: its cells time the collector's tied logits routed " \
                          "by grouped top-k into the lowest groups (gpu_kernels.grouped_routing)"
                continue
            if hit is not None:
                k.seconds, t = hit
                ver = t_e.version.get(t.file, "?")
                also = f"; {m['why']}" if m else ""
                k.source = f"table: {t.file} ({e} {ver}, {t.key.get('kernel_source', cls)}, interpolated in " \
                           f"{', '.join(t.axes)}{also})"
                k.measured = True
                return k
    s = gk.shape(k.cls, k.key, k.point) if k.cls != "elementwise" else {
        "bytes": k.point["bytes"], "flops": k.point["flops"], "ranks": 1}
    found = None
    if gpu and k.cls != "elementwise":  # the listed (else own, then any other) engine's fit on this GPU
        if not m:
            where += [(gpu, e) for e in gk.fit_engines(gpu) if e != eng]
        found = next((f for g, e in where if (f := gk.fitted_params(g, e, cls, k.key, kernel))), None)
    if found is not None:
        params, which = found
        k.seconds = float(gk.physical_time(params, k.cls, s))
        why = f"; {m['why']}" if m else ""
        k.source = (f"physical: fitted to the kernel tables ({which}; "
                    f"perfmodel/data/kernels/{which.split('/')[0]}/fit.json{why}){skipped}")
        return k
    k.seconds, k.source = generic_time(hw, k.cls, s, gpu, eng)
    k.source += skipped
    return k


def generic_time(hw: Hardware, cls: str, s: dict, gpu: str, engine: str) -> tuple[float, str]:
    """A kernel no table or fit covers: a small kernel's floor (the GPU's fastest measured kernel
    where it has tables, else its launch component) + bytes at the achieved decode-kernel
    bandwidth or FLOPs at peak x efficiency.flops; collectives by the hardware's all-reduce
    component."""
    c = hw.components
    if cls in gk.COMM:
        return (cm.gpu_all_reduce_time(c, s["bytes"] * s["ranks"] / max(2 * (s["ranks"] - 1), 1), s["ranks"]),
                "physical: hardware components allreduce_base_s, allreduce_per_peer_s, allreduce_bytes_per_s")
    fastest = fastest_kernel_s(gpu, engine) if gpu else None
    floor, what = (fastest, f"the fastest kernel in {gpu}'s {engine} tables") if fastest else \
        (cm.kernel_launch_time(c), "components.kernel_launch_s")
    dtype_rate = max(hw.peak_flops_per_s.values()) * hw.efficiency.flops
    t = floor + max(cm.kernel_stream_time(c, s["bytes"], hw.hbm_bandwidth_bytes_per_s), s["flops"] / dtype_rate)
    return t, f"physical: {what} + bytes / (HBM x components.kernel_bandwidth_efficiency)"


def fastest_kernel_s(gpu: str, engine: str) -> float | None:
    t = gk.tables(gpu, engine)
    return t.fastest_kernel_s if t is not None else None


def paid_seconds(ks: list[Kernel], g: OpGraph, overlap_s: float = 0.0) -> list[float]:
    """Per kernel, the time the step pays for it: on the main stream its time less what hides under
    the kernel before it in the graph (`overlap_s`, the hardware's components.graph_kernel_overlap_s,
    never more than the kernel's own time); on the second stream its share of what the layer's
    routed experts (on the main stream meanwhile) do not cover."""
    layers, aux, beside = g.layer.tolist(), {}, {}
    for k in ks:
        layer = layers[k.op]
        if k.stream == "aux":
            aux[layer] = aux.get(layer, 0.0) + k.seconds
        elif g.name[k.op] == "routed_experts":
            beside[layer] = beside.get(layer, 0.0) + k.seconds
    share = {layer: max(0.0, a - beside.get(layer, 0.0)) / a if a > 0 else 0.0 for layer, a in aux.items()}
    return [k.seconds * share[layers[k.op]] if k.stream == "aux" else k.seconds - min(overlap_s, k.seconds)
            for k in ks]


def simulate_serving(model: ModelSpec, hw: Hardware, d: Deployment, g: OpGraph, record: bool = False
                     ) -> tuple[Timeline, list[Kernel]]:
    """The step as the engine's kernels back to back: per-op start / end and waits by cause (each
    kernel's time to its cause: collectives, routed experts, the rest compute or streaming); a
    kernel on the main stream pays its time less what hides under the one before it, one on the
    second stream only its share not hidden beside the routed experts (`paid_seconds`), and its
    event lies on the "aux" lane."""
    limits.spend("layer_steps", int(g.layer[-1]) + 1 if len(g) else 0)
    ks = kernels(model, hw, d, g)
    n = len(g)
    dur = [0.0] * n   # summed as Python floats (the same sums; a numpy item update costs far more)
    wait = {c: [0.0] * n for c in ("compute", "weight_streaming", "expert_fetch", "collective", "launch", "fill_drain")}
    paid = paid_seconds(ks, g, cm.graph_overlap_time(hw.components))
    for k, p in zip(ks, paid):
        dur[k.op] += p
        wait[k.cause][k.op] += p
    dur, wait = np.array(dur), {c: np.array(w) for c, w in wait.items()}
    end = np.cumsum(dur)
    start = end - dur
    tl = Timeline(start, end, wait, float(end[-1]) if n else 0.0, float(g.bytes.sum()))
    if record:
        t0, aux_t = start.copy(), {}
        for k, p in zip(ks, paid):
            if k.stream == "aux":  # back to back on their own lane from the first one's start
                layer = int(g.layer[k.op])
                a = aux_t.setdefault(layer, start[k.op])
                tl.events.append(("aux", k.name, layer, a, a + k.seconds))
                aux_t[layer] = a + k.seconds
                continue
            lane = "link" if k.cause == "collective" else "compute"
            tl.events.append((lane, k.name, int(g.layer[k.op]), t0[k.op], t0[k.op] + p))
            t0[k.op] += p
    return tl, ks
