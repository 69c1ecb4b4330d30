"""The megakernel's DMA plan as data (`perfmodel.graph.dmaplan.Copy`), derived from the kernel.

The kernel records every DMA issue site while it is traced (`dma.Dma`): the layer loop's body
is traced once, so this module walks the layers in Python, replaying for each layer the sites
of its kinds, and expands the ring (each bank released issues the bank `depth` ahead) and the
data-dependent sites: the copies of each distinct expert a MoE layer picked, per sequence
ceil(pos / cache_block) MLA cache blocks and one new cache row per accepted verify row, and
per collective exchange one remote copy to each other member of the group. Copies are listed
in issue order, one per DMA descriptor; `bytes` is what the DMA moves, counting in `padding`
its zeros and, for an embedding row, the other rows of the bf16 tile it is copied in;
write-backs (KDA state, new MLA cache rows) and remote copies are listed too, since they use
the same DMA engine. The plan is that of one device (`device`) of the mesh.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax

from perfmodel.graph.dmaplan import Copy, KernelPlan, bytes_by_layer_family
from perfmodel.spec.arch import ModelSpec
from perfmodel.util.errors import require

from . import comm, layout, megakernel, quant, reference, stream
from .layout import KernelConfig


@functools.lru_cache(maxsize=64)
def _records(static: reference.StaticSpec, cfg: KernelConfig) -> tuple[dict, ...]:
    spec = static.spec
    record: list = []
    call = megakernel.build_call(spec, cfg, interpret=None, record=record)
    jax.eval_shape(call, *megakernel.call_args(spec, cfg))
    return tuple(record)


def dma_plan(spec: ModelSpec, cfg: KernelConfig, distinct_experts: list[int] | None = None,
             positions: list[int] | None = None, accepted: list[int] | None = None,
             device: int = 0) -> list[Copy]:
    """Every copy the megakernel's DMAs make in one decode step (cfg.rows verify rows per
    sequence) on mesh device `device`, in issue order.

    distinct_experts: per MoE layer (in layer order) the number of distinct experts this device
    fetched (the kernel returns it); None = min(local experts, batch * rows * top_k), the most a
    step can fetch. positions: per sequence the position of its first row (the MLA cache blocks
    holding 0..pos-1 are read); None = max_context - rows for every sequence. accepted: per
    sequence the rows written to the caches (one new MLA cache row each); None = all rows.
    """
    layout.check_kernel_spec(spec, cfg)
    return [c for c in _expand(spec, cfg, distinct_experts, positions, accepted, device)
            if c is not None]


def dma_events(spec: ModelSpec, cfg: KernelConfig, distinct_experts: list[int] | None = None,
               positions: list[int] | None = None,
               accepted: list[int] | None = None) -> list[tuple[str, int, str]]:
    """The plan with the kernel's recorded waits: ("start", layer, name) per copy and
    ("wait", layer, name) where the kernel waits for the copies named `name`, in program
    order (for ordering checks, e.g. no cache row written while block reads are in flight)."""
    layout.check_kernel_spec(spec, cfg)
    return [e for e in _expand(spec, cfg, distinct_experts, positions, accepted, 0, events=True)
            if e is not None]


def most_experts(spec: ModelSpec, cfg: KernelConfig) -> int:
    """The most distinct experts one device can fetch in a step."""
    own = spec.local_experts if layout.tp_of(spec) > 1 else spec.moe.experts
    return min(own, cfg.token_rows * spec.moe.top_k)


def _expand(spec, cfg, distinct_experts, positions, accepted, device, events=False):
    """Replay the recorded sites layer by layer (see the module docstring)."""
    n_moe = spec.count(ffn="moe")
    if distinct_experts is None:
        distinct_experts = [most_experts(spec, cfg)] * n_moe
    require(len(distinct_experts) == n_moe, "distinct_experts", list(distinct_experts),
            f"expected one count per MoE layer ({n_moe})")
    for d in distinct_experts:
        require(0 <= int(d) <= most_experts(spec, cfg), "distinct_experts",
                list(distinct_experts),
                "each count must lie in [0, min(local experts, batch * rows * top_k)]")
    if positions is None:
        positions = [cfg.max_context - cfg.rows] * cfg.batch
    last = cfg.max_context - cfg.rows
    require(len(positions) == cfg.batch and all(0 <= p <= last for p in positions),
            "positions", list(positions),
            f"expected {cfg.batch} positions in [0, max_context - rows = {last}]")
    accepted = [cfg.rows] * cfg.batch if accepted is None else [int(a) for a in accepted]
    require(len(accepted) == cfg.batch and all(0 <= a <= cfg.rows for a in accepted),
            "accepted", accepted, f"expected {cfg.batch} counts in [0, rows={cfg.rows}]")
    tp = layout.tp_of(spec)
    require(0 <= device < tp, "device", device, f"must lie in [0, tp = {tp})")
    s = layout.static_stream(spec, cfg)
    host = comm.host_size(cfg, tp)
    entries = (*spec.layers, None)
    head = len(spec.layers) + 1
    n = 0      # copies so far
    ring = 0   # next bank to issue

    def copy(layer, family, name, nbytes, routed=False, ring_bank=False, padding=0, peer=-1,
             collective=""):
        nonlocal n
        n += 1
        c = Copy(n - 1, layer, family, name, nbytes, routed, ring_bank, padding, peer,
                 collective)
        return ("start", layer, name) if events else c

    def issue_ring(upto):
        nonlocal ring
        while ring < min(upto, len(s.banks)):
            b = s.banks[ring]
            yield copy(b.layer, b.family, f"{b.family}[bank {b.index}]", 2 * b.rows * cfg.tile,
                       ring_bank=True, padding=b.padding_bytes)
            ring += 1

    def sites(records, layer, index):
        for r in records:
            when = r["when"]
            if when and getattr(layer, when[0]) != when[1]:
                continue
            here = r["layer"] if r["layer"] is not None else getattr(layer, "index", None)
            site = r["site"]
            if site == "ring_start":
                yield from issue_ring(cfg.depth)
            elif site == "release":
                first = s.first_bank[(index, r["name"][1])]
                yield from issue_ring(first + r["bank"] + 1 + cfg.depth)
            elif site == "vectors":
                entry = r["layer"] + (0 if layer is None else layer.index - 1)
                for family, _, rows in layout.vector_copies(spec, entries[entry]):
                    yield copy(entry + 1, family, "vectors", rows * layout.LANES * 2)
            elif site == "experts":
                mo = sum(1 for l in spec.layers[:layer.index - 1] if l.ffn == "moe")
                for j in range(int(distinct_experts[mo])):
                    for k, (nb, pad) in enumerate(zip(r["sizes"], r["padding"])):
                        part = " (scales)" if k else ""
                        yield copy(here, r["family"],
                                   f"expert {j} -> slot {j % cfg.expert_slots}{part}", nb,
                                   routed=True, padding=pad)
            elif site == "cache_blocks":
                block = cfg.cache_block
                for b, p in enumerate(positions):
                    for k in range(math.ceil(p / block)):
                        yield copy(here, r["family"], f"{r['name']} seq {b} block {k}",
                                   r["bytes"])
            elif site == "cache_window":   # padding: the bytes beyond the new rows written
                new = 0 if "(read)" in r["name"] else r["row_bytes"]
                for b, a in enumerate(accepted):
                    if a:
                        yield copy(here, r["family"], f"{r['name']} seq {b}", r["bytes"],
                                   padding=r["bytes"] - a * new)
            elif site == "exchange":
                members, pos, member = comm.group(r["kind"], tp, device, host)
                for k in range(members):
                    if k != pos:
                        yield copy(index, "activation",
                                   f"{r['name']} {r['what']} -> device {member(k)}", r["bytes"],
                                   peer=member(k), collective=r["what"])
            elif site == "wait":
                yield ("wait", here, r["name"]) if events else None
            elif site in ("part",):
                continue
            else:
                yield copy(here, r["family"], r["name"], r["bytes"], r["routed"],
                           padding=r.get("padding", 0))

    records = _records(reference.StaticSpec(spec), cfg)
    scoped = {k: [r for r in records if r["scope"] == k] for k in ("pre", "loop", "post")}
    yield from sites(scoped["pre"], None, 0)
    for layer in spec.layers:
        yield from sites(scoped["loop"], layer, layer.index)
    yield from sites(scoped["post"], None, head)


def weight_copies(plan: list[Copy]) -> list[Copy]:
    """The copies of weights (static banks, vectors, embedding rows, routed experts)."""
    return [c for c in plan if c.peer < 0 and c.family not in ("kv_cache", "state")]


def overhead_bytes(plan: list[Copy]) -> dict[str, int]:
    """What the plan moves beyond the bytes an analytic model counts (`perfmodel.graph.ops`):
    "padding", the weight copies' zero bytes and the other rows of the embedding rows' tiles;
    "vectors", the small per-layer vectors (norms, conv taps, decay constants, router bias,
    final norm) in 16 x 128 row blocks, which the model does not count; "cache_window", the MLA
    cache rows read and written back around the new rows (a row is not a whole tile)."""
    w = weight_copies(plan)
    return {"padding": sum(c.padding for c in w),
            "vectors": sum(c.bytes for c in w if c.name == "vectors"),
            "cache_window": sum(c.padding for c in plan if c.family == "kv_cache")}


def matmul_dots(dspec: ModelSpec, cfg: KernelConfig) -> dict[str, int]:
    """"<layer kind>/<matmul>" -> the MXU dots `ring.PartReader` issues for it: one a lane-tile block
    of its group's outputs, one more for each further bank a block's rows reach into (a block
    straddling banks is split at their ends, a dot a piece: fewer the larger the banks), and one a
    tile-wide input chunk of a narrower remainder, all on the group's first member (its fused
    others 0). A part is laid out from its own first bank, so every layer of a kind splits alike."""
    t, out = cfg.tile, {}
    for layer in (*dspec.layers, None):
        for key in stream.layer_parts(dspec, layer):
            p = stream.part(dspec, key, t, cfg.bank_rows)
            b = p.bank_rows
            split = [0] * len(p.groups)
            for it in p.items:
                if it.kind == "block":
                    split[it.group] += (it.row + it.rows - 1) // b - it.row // b
            for k, g in enumerate(p.groups):
                out |= {f"{key[0]}/{n}": (g.blocks(t) + g.chunks(t) + split[k]) if m == 0 else 0
                        for m, n in enumerate(g.names)}
    return out


def settings(dspec: ModelSpec, cfg: KernelConfig, expert_decode: str | None = None) -> dict:
    """The kernel's settings an engine replays beside its copies
    (`perfmodel.graph.dmaplan.KERNEL_FIELDS`): ring, slots, the all-reduce algorithm, wire dtype
    and the rows a message carries, the cache tile its attention walks, the dots of each streamed
    matmul (`matmul_dots`), the values its embed phase selects through (`megakernel.pick_rows`:
    one select a row of the copied bf16 tile over [padded rows, hidden] f32), and how the routed
    experts reach the MXU (expert_decode: the decode a kernel of another commit ran, in place of
    this one's `ExpertLayout.decode_kind`; expert_decode_passes: the passes of its column loop
    over one expert, `ExpertLayout.passes`)."""
    out = {"bank_bytes": cfg.bank_bytes, "depth": cfg.depth, "expert_slots": cfg.expert_slots,
           "cache_block": cfg.cache_block, "matmul_dots": matmul_dots(dspec, cfg),
           "embedding_pick_values": math.prod(layout.embedding_tiles(dspec, cfg))}
    if layout.tp_of(dspec) > 1:
        out |= {"wire": cfg.wire, "all_reduce": comm.algorithm(dspec, cfg),
                "collective_rows": comm.Wire(cfg.token_rows, 1, comm.WIRE[cfg.wire]).padded_rows}
    if dspec.moe and dspec.count(ffn="moe"):
        if dspec.moe.shared_width:
            out["shared_expert"] = "last"   # megakernel.moe: router, routed experts, then the shared one
        lay = layout.expert_layout(dspec, cfg)
        f = lay.fmt
        out["expert_feed"] = quant.feed(f)
        # decoded with their scales into the operand: one LHS row per batch row
        out["expert_scale_rows"] = max(1, f.scale_rows) if f.name in quant.FOUR_BIT \
            and not lay.decodes else 1
        if lay.decodes:
            out["expert_decode"] = expert_decode or lay.decode_kind
            out["expert_decode_passes"] = sum(map(lay.passes, range(len(lay.shapes))))
    return out


def as_kernel_plan(full: ModelSpec, dspec: ModelSpec, cfg: KernelConfig, copies: list[Copy],
                   context: int, source: str = "", expert_decode: str | None = None) -> KernelPlan:
    """A plan of device 0 with the kernel's settings and deployment (a perfmodel plan file)."""
    tp = layout.tp_of(dspec)
    dep = {"devices": tp, "tp": tp, "batch": cfg.batch, "context": context,
           "draft_rows": cfg.rows - 1}
    if tp > 1:
        dep["ep"] = dspec.groups
    return KernelPlan(full.name, dep, settings(dspec, cfg, expert_decode), tuple(copies), source)


def kernel_plan(full: ModelSpec, cfg: KernelConfig, devices: int, ep: int | None, context: int,
                source: str = "") -> KernelPlan:
    """Device 0's plan at `context` cached tokens per sequence, for the distinct experts the
    analytic model expects of the busiest expert group (`distinct_per_layer`)."""
    from . import shard
    dspec = shard.device_spec(full, devices, ep) if devices > 1 else full
    distinct = distinct_per_layer(full, dspec, cfg, context, devices, ep)
    copies = dma_plan(dspec, cfg, distinct, [context] * cfg.batch)
    return as_kernel_plan(full, dspec, cfg, copies, context, source)


def predicted_step(spec: ModelSpec, cfg: KernelConfig, the_plan: list[Copy], context: int,
                   hardware: str = "tpu-v7", acceptance_length: float = 1.0,
                   full: ModelSpec | None = None, kernel_dots: bool = True,
                   expert_decode: str | None = None):
    """The schedule simulator run on this plan with the kernel's settings (`settings`): the
    ring of cfg.depth banks of cfg.bank_bytes, cfg.expert_slots expert buffers, its all-reduce
    and wire, its experts' MXU feed, cfg.rows rows per sequence (rows > 1: speculative decoding
    with cfg.rows - 1 drafted rows; acceptance_length, tokens per step, sets the tokens/s, not
    the step time), on tp devices of `hardware` when `spec` is a device spec (`full` the model it
    shards). The engine replays the plan's HBM copies; its collectives are the model's own terms
    with the kernel's algorithm and wire (the plan's remote copies are not replayed one by one).
    Without `kernel_dots`, each streamed matmul issues one dot (the model's own kernel), not the
    kernel's `matmul_dots`; expert_decode as `settings`. A prediction
    (perfmodel.step.predict.Prediction), not a measurement."""
    from perfmodel.spec.deployment import SpecDecode
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.step.predict import plan_deployment, predict
    kp = as_kernel_plan(full or spec, spec, cfg, the_plan, context, expert_decode=expert_decode)
    if not kernel_dots:
        kp = dataclasses.replace(kp, kernel={k: v for k, v in kp.kernel.items() if k != "matmul_dots"})
    d = plan_deployment(kp)
    if cfg.rows > 1:
        d = dataclasses.replace(d, spec=SpecDecode(cfg.rows - 1,
                                                   acceptance_length=acceptance_length))
    return predict(full or spec, load_hardware(hardware), d, plan=kp)


def summary(spec: ModelSpec, plan: list[Copy]) -> str:
    """Bytes per layer by family, as a text table (remote copies as "activation")."""
    per = bytes_by_layer_family(plan)
    families = sorted({f for _, f in per})
    names = {0: "embed", len(spec.layers) + 1: "head"}
    lines = ["layer    " + "".join(f"{f:>15}" for f in families) + f"{'total':>12}"]
    for layer in sorted({l for l, _ in per}):
        row = [per.get((layer, f), 0) for f in families]
        label = names.get(layer, f"layer_{layer:02d}")
        lines.append(f"{label:<9}" + "".join(f"{v:>15,}" for v in row) + f"{sum(row):>12,}")
    total = [sum(v for (l, f), v in per.items() if f == fam) for fam in families]
    lines.append(f"{'total':<9}" + "".join(f"{v:>15,}" for v in total) + f"{sum(total):>12,}")
    return "\n".join(lines)


def distinct_per_layer(full: ModelSpec, dspec: ModelSpec, cfg: KernelConfig, context: int,
                       devices: int, ep: int | None) -> list[int]:
    """Per MoE layer, the distinct experts the busiest expert group fetches at this batch in
    the analytic model (`perfmodel.graph.moe`: expected maximum over groups), as integers that
    add up to the model's expectation over the layers."""
    from perfmodel.graph.ops import build
    from perfmodel.spec.deployment import Deployment
    n = full.count(ffn="moe")
    if not n:
        return []
    g = build(full, Deployment(devices=devices, tp=devices, ep=ep, batch=cfg.batch,
                               context=context))
    d = min(g.distinct_experts, most_experts(dspec, cfg))
    return [round((i + 1) * d) - round(i * d) for i in range(n)]


def report(full: ModelSpec, cfg: KernelConfig, devices: int, ep: int | None, context: int,
           hardware: str = "tpu-v7") -> dict:
    """The plan of device 0 at `context` cached tokens per sequence, from the kernel's trace
    alone (no weights): its descriptors, padding, remote copies, and the model's predictions
    of this plan (`predicted_step_s`; `one_dot_step_s` with one dot a streamed matmul, as the
    model's own kernel issues) and of its own default megakernel for the same deployment
    (`model_step_s`)."""
    from perfmodel.spec.deployment import Deployment, SpecDecode
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.step.predict import predict
    from . import shard, vmem
    dspec = shard.device_spec(full, devices, ep) if devices > 1 else full
    kp = kernel_plan(full, cfg, devices, ep, context)
    p = list(kp.copies)
    distinct = distinct_per_layer(full, dspec, cfg, context, devices, ep)
    w, remote = weight_copies(p), kp.remote_copies
    weight_bytes, pad = sum(c.bytes for c in w), sum(c.padding for c in w)
    pred = predicted_step(dspec, cfg, p, context, hardware, full=full if devices > 1 else None)
    one_dot = predicted_step(dspec, cfg, p, context, hardware, full=full if devices > 1 else None, kernel_dots=False)
    verify = SpecDecode(draft_rows=cfg.rows - 1, acceptance_length=1.0) if cfg.rows > 1 else None
    model = predict(full, load_hardware(hardware),
                    Deployment(devices=devices, tp=devices, ep=ep if devices > 1 else None,
                               batch=cfg.batch, context=context, spec=verify))
    budget = vmem.check_vmem(dspec, cfg)
    return {
        "preset": full.name, "devices": devices, "tp": devices, "ep": ep, "batch": cfg.batch,
        "rows": cfg.rows, "context": context, "hardware": hardware,
        "bank_bytes": cfg.bank_bytes, "depth": cfg.depth, "expert_slots": cfg.expert_slots,
        "distinct_experts_per_layer": sum(distinct) / len(distinct) if distinct else 0.0,
        "weight_descriptors_per_device": len(w),
        "weight_descriptors_by_kind": {
            "ring banks": sum(c.ring for c in w), "routed experts": sum(c.routed for c in w),
            "vectors": sum(c.name == "vectors" for c in w),
            "embedding rows": sum(c.family == "embedding" for c in w)},
        "cache_descriptors_per_device": sum(1 for c in p if c.peer < 0) - len(w),
        "remote_descriptors_per_device": len(remote),
        "weight_bytes_per_device": weight_bytes, "padding_bytes_per_device": pad,
        "padding_fraction": pad / weight_bytes if weight_bytes else 0.0,
        "remote_bytes_per_device": sum(c.bytes for c in remote),
        "vmem_bytes": budget.total_bytes, "vmem_limit_bytes": budget.limit_bytes,
        "kernel": kp.kernel,
        "predicted_step_s": pred.step_s,
        "one_dot_step_s": one_dot.step_s,
        "predicted_note": "perfmodel.step.predict on this plan's HBM copies with the kernel's "
                          "settings; its collectives are the model's terms with the kernel's "
                          "algorithm and wire (the remote copies are listed, not replayed)",
        "model_step_s": model.step_s,
        "model_note": "perfmodel.step.predict of the model's own megakernel for the same "
                      "deployment",
    }
