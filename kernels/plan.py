"""The megakernel's DMA plan as data (`perfmodel.graph.dmaplan.Copy`), derived from the kernel itself.

The kernel records every DMA issue site while it is traced (`megakernel.Dma`): the layer loop's
body is traced once, so this module walks the layers in Python, replaying for each layer the
sites of its kinds, and expands the ring (each consumed tile issues the one `depth` ahead) and
the data-dependent sites: one routed copy per distinct expert a MoE layer picked, and per
sequence ceil(pos / cache_block) MLA cache blocks and one new cache row per accepted verify row.
Copies are listed in issue order; `bytes` is what the DMA moves, tile padding included, and
write-backs (KDA state, new MLA cache rows) are listed too, since they use the same DMA engine.
"""
from __future__ import annotations

import functools
import math

import jax

from perfmodel.graph.dmaplan import Copy, bytes_by_layer_family
from perfmodel.spec.arch import ModelSpec
from perfmodel.util.errors import require

from . import layout, megakernel, reference
from .layout import KernelConfig


@functools.lru_cache(maxsize=64)
def _records(static: reference.StaticSpec, cfg: KernelConfig) -> tuple[dict, ...]:
    spec = static.spec
    record: list = []
    call = megakernel.build_call(spec, cfg, interpret=None, record=record)
    jax.eval_shape(call, *megakernel.call_args(spec, cfg))
    return tuple(record)


def dma_plan(spec: ModelSpec, cfg: KernelConfig, distinct_experts: list[int] | None = None,
             positions: list[int] | None = None,
             accepted: list[int] | None = None) -> list[Copy]:
    """Every copy the megakernel's DMAs make in one decode step (cfg.rows verify rows per
    sequence), in issue order.

    distinct_experts: per MoE layer (in layer order) the number of distinct experts the batch
    picked (the kernel returns it); None = min(experts, batch * rows * top_k), the most a step
    can fetch. positions: per sequence the position of its first row (the MLA cache blocks
    holding 0..pos-1 are read); None = max_context - rows for every sequence. accepted: per
    sequence the rows written to the caches (one new MLA cache row each); None = all rows.
    """
    layout.check_kernel_spec(spec, cfg)
    return [c for c in _expand(spec, cfg, distinct_experts, positions, accepted)
            if c is not None]


def dma_events(spec: ModelSpec, cfg: KernelConfig, distinct_experts: list[int] | None = None,
               positions: list[int] | None = None,
               accepted: list[int] | None = None) -> list[tuple[str, int, str]]:
    """The plan with the kernel's recorded waits: ("start", layer, name) per copy and
    ("wait", layer, name) where the kernel waits for the copies named `name`, in program
    order (for ordering checks, e.g. no cache row written while block reads are in flight)."""
    layout.check_kernel_spec(spec, cfg)
    return [e for e in _expand(spec, cfg, distinct_experts, positions, accepted, events=True)
            if e is not None]


def _most_experts(spec: ModelSpec, cfg: KernelConfig) -> int:
    return min(spec.moe.experts, cfg.token_rows * spec.moe.top_k)


def _expand(spec, cfg, distinct_experts, positions, accepted, events=False):
    """Replay the recorded sites layer by layer (see the module docstring)."""
    n_moe = spec.count(ffn="moe")
    if distinct_experts is None:
        distinct_experts = [_most_experts(spec, cfg)] * n_moe
    require(len(distinct_experts) == n_moe, "distinct_experts", list(distinct_experts),
            f"expected one count per MoE layer ({n_moe})")
    for d in distinct_experts:
        require(0 <= int(d) <= _most_experts(spec, cfg), "distinct_experts",
                list(distinct_experts),
                "each count must lie in [0, min(experts, batch * rows * top_k)]")
    if positions is None:
        positions = [cfg.max_context - cfg.rows] * cfg.batch
    last = cfg.max_context - cfg.rows
    require(len(positions) == cfg.batch and all(0 <= p <= last for p in positions),
            "positions", list(positions),
            f"expected {cfg.batch} positions in [0, max_context - rows = {last}]")
    accepted = [cfg.rows] * cfg.batch if accepted is None else [int(a) for a in accepted]
    require(len(accepted) == cfg.batch and all(0 <= a <= cfg.rows for a in accepted),
            "accepted", accepted, f"expected {cfg.batch} counts in [0, rows={cfg.rows}]")
    stream = layout.static_stream(spec, cfg)
    owner = [tm for tm in stream for _ in range(tm.tiles)]
    by_name = {(tm.layer, tm.mm.name): tm for tm in stream}
    entries = (*spec.layers, None)
    n = 0      # copies so far
    ring = 0   # next static tile to issue

    def copy(layer, family, name, nbytes, routed=False, ring_tile=False):
        nonlocal n
        n += 1
        c = Copy(n - 1, layer, family, name, nbytes, routed, ring_tile)
        return ("start", layer, name) if events else c

    def issue_ring(upto):
        nonlocal ring
        while ring < min(upto, len(owner)):
            tm = owner[ring]
            yield copy(tm.layer, tm.mm.family, f"{tm.mm.name}[tile {ring - tm.first}]",
                       cfg.bank_bytes, ring_tile=True)
            ring += 1

    def sites(records, layer):
        for r in records:
            when = r["when"]
            if when and getattr(layer, when[0]) != when[1]:
                continue
            here = r["layer"] if r["layer"] is not None else getattr(layer, "index", None)
            site = r["site"]
            if site == "ring_start":
                yield from issue_ring(cfg.depth)
            elif site == "ring":
                tm = by_name[(len(spec.layers) + 1 if layer is None else layer.index, r["name"])]
                for k in range(tm.tiles):
                    yield from issue_ring(tm.first + k + 1 + cfg.depth)
            elif site == "vectors":
                entry = r["layer"] + (0 if layer is None else layer.index - 1)
                for family, _, rows in layout.vector_copies(spec, entries[entry]):
                    yield copy(entry + 1, family, "vectors", rows * layout.LANES * 2)
            elif site == "experts":
                mo = sum(1 for l in spec.layers[:layer.index - 1] if l.ffn == "moe")
                for j in range(int(distinct_experts[mo])):
                    yield copy(here, r["family"], f"expert {j} -> slot {j % cfg.expert_slots}",
                               r["bytes"], routed=True)
            elif site == "cache_blocks":
                block = cfg.cache_block
                for b, p in enumerate(positions):
                    for k in range(math.ceil(p / block)):
                        yield copy(here, r["family"], f"{r['name']} seq {b} block {k}",
                                   r["bytes"])
            elif site == "cache_rows":
                for a in accepted:
                    for _ in range(a):
                        yield copy(here, r["family"], r["name"], r["bytes"])
            elif site == "wait":
                yield ("wait", here, r["name"]) if events else None
            else:
                yield copy(here, r["family"], r["name"], r["bytes"], r["routed"])

    records = _records(reference.StaticSpec(spec), cfg)
    scoped = {s: [r for r in records if r["scope"] == s] for s in ("pre", "loop", "post")}
    yield from sites(scoped["pre"], None)
    for layer in spec.layers:
        yield from sites(scoped["loop"], layer)
    yield from sites(scoped["post"], None)


def overhead_bytes(spec: ModelSpec, cfg: KernelConfig,
                   distinct_experts: list[int] | None = None) -> dict[str, int]:
    """What the plan moves beyond the weight / cache bytes an analytic model counts
    (`perfmodel.graph.ops`): "tile_padding", the zeros that pad static matmuls and the routed experts
    fetched this step to whole T x T tiles (quantised experts: plus the per-channel scales of
    int8 / fp8, which the model's formats do not count); "vectors", the small per-layer
    vectors (norms, conv taps, decay constants, router bias, final norm) in 16 x 128 row
    blocks."""
    pad = sum(tm.tiles * cfg.bank_bytes - 2 * tm.mm.params
              for tm in layout.static_stream(spec, cfg))
    if spec.count(ffn="moe"):
        n_moe = spec.count(ffn="moe")
        if distinct_experts is None:
            distinct_experts = [_most_experts(spec, cfg)] * n_moe
        per_expert = sum(mm.params // mm.experts for mm in layout.expert_matmuls(spec)) \
            * spec.formats["routed_expert"].bytes_per_value
        pad += sum(distinct_experts) * (sum(layout.expert_bytes(spec, cfg)) - per_expert)
    vectors = sum(n * layout.LANES * 2 for layer in (*spec.layers, None)
                  for _, _, n in layout.vector_copies(spec, layer))
    return {"tile_padding": int(pad), "vectors": int(vectors)}


def predicted_step(spec: ModelSpec, cfg: KernelConfig, the_plan: list[Copy], context: int,
                   hardware: str = "tpu-v7", acceptance_length: float = 1.0):
    """The schedule simulator run on exactly this plan, on one TensorCore of `hardware`: the
    ring of cfg.depth banks of cfg.bank_bytes, cfg.expert_slots expert buffers, cfg.rows rows
    per sequence (rows > 1: speculative decoding with cfg.rows - 1 drafted rows;
    acceptance_length, tokens per step, sets the tokens/s, not the step time) (a prediction,
    perfmodel.step.predict.Prediction, not a measurement)."""
    from perfmodel.spec.deployment import Deployment, SpecDecode
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.step.predict import predict
    hw = load_hardware(hardware).replace(dma_tile_bytes=cfg.bank_bytes)
    verify = SpecDecode(draft_rows=cfg.rows - 1, acceptance_length=acceptance_length) \
        if cfg.rows > 1 else None
    d = Deployment(devices=1, tp=1, batch=cfg.batch, context=context,
                   prefetch_bytes=cfg.depth * cfg.bank_bytes, expert_slots=cfg.expert_slots,
                   spec=verify)
    return predict(spec, hw, d, plan=the_plan)


def summary(spec: ModelSpec, plan: list[Copy]) -> str:
    """Bytes per layer by family, as a text table."""
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
