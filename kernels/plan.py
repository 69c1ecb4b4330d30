"""The megakernel's DMA plan as data (`perfmodel.dmaplan.Copy`), derived from the kernel itself.

The kernel records every DMA issue site while it is traced (`megakernel.Dma`); this module
traces it once per (spec, config) and expands the data-dependent sites: one routed copy per
distinct expert a MoE layer picked, and per sequence ceil(pos / cache_block) MLA cache blocks.
Copies are listed in issue order; `bytes` is what the DMA moves, tile padding included, and
write-backs (KDA state, new MLA cache rows) are listed too, since they use the same DMA engine.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from perfmodel.arch import ModelSpec
from perfmodel.dmaplan import Copy, bytes_by_layer_family
from perfmodel.errors import require

from . import layout, megakernel, reference
from .layout import KernelConfig


@functools.lru_cache(maxsize=64)
def _records(static: reference.StaticSpec, cfg: KernelConfig) -> tuple[dict, ...]:
    spec = static.spec
    record: list = []
    call = megakernel.build_call(spec, cfg, interpret=None, record=record)
    t, bp = cfg.tile, cfg.padded_batch
    n_moe = spec.count(ffn="moe")
    e = spec.moe.experts if spec.moe else 1
    tpe = layout.tiles_per_expert(spec, cfg) if spec.moe else 1
    sds = jax.ShapeDtypeStruct
    args = [sds((bp,), jnp.int32), sds((bp,), jnp.int32),
            sds((spec.vocab, 1, spec.hidden), jnp.bfloat16),
            sds((sum(tm.tiles for tm in layout.static_stream(spec, cfg)), t, t), jnp.bfloat16),
            sds((n_moe, e, tpe, t, t) if n_moe else (1, 1, tpe, t, t), jnp.bfloat16),
            sds((len(spec.layers) + 1, layout.vector_rows(spec), layout.LANES), jnp.bfloat16)]
    args += [sds(s, d) for s, d in
             reference.cache_shapes(spec, cfg.batch, cfg.max_context).values()]
    jax.eval_shape(call, *args)
    return tuple(record)


def dma_plan(spec: ModelSpec, cfg: KernelConfig, distinct_experts: list[int] | None = None,
             positions: list[int] | None = None) -> list[Copy]:
    """Every copy the megakernel's DMAs make in one decode step, in issue order.

    distinct_experts: per MoE layer (in layer order) the number of distinct experts the batch
    picked (the kernel returns it); None = min(experts, batch * top_k), the most a step can
    fetch. positions: per sequence the position of the token being decoded (the MLA cache
    blocks holding 0..pos-1 are read); None = max_context - 1 for every sequence.
    """
    layout.check_kernel_spec(spec, cfg)
    n_moe = spec.count(ffn="moe")
    if distinct_experts is None:
        distinct_experts = [min(spec.moe.experts, cfg.batch * spec.moe.top_k)] * n_moe
    require(len(distinct_experts) == n_moe, "distinct_experts", list(distinct_experts),
            f"expected one count per MoE layer ({n_moe})")
    for d in distinct_experts:
        require(0 <= int(d) <= min(spec.moe.experts, cfg.batch * spec.moe.top_k),
                "distinct_experts", list(distinct_experts),
                "each count must lie in [0, min(experts, batch * top_k)]")
    if positions is None:
        positions = [cfg.max_context - 1] * cfg.batch
    require(len(positions) == cfg.batch and all(0 <= p < cfg.max_context for p in positions),
            "positions", list(positions),
            f"expected {cfg.batch} positions in [0, max_context={cfg.max_context})")
    out: list[Copy] = []

    def add(r, name, routed=False):
        out.append(Copy(len(out), r["layer"], r["family"], name, r["bytes"], routed, r["ring"]))

    for r in _records(reference.StaticSpec(spec), cfg):
        rep = r["repeat"]
        if rep is None:
            add(r, r["name"], r["routed"])
        elif rep[0] == "experts":
            for j in range(int(distinct_experts[rep[1]])):
                add(r, f"expert {j} -> slot {j % cfg.expert_slots}", True)
        else:
            for b, p in enumerate(positions):
                for k in range(math.ceil(p / rep[1])):
                    add(r, f"{r['name']} seq {b} block {k}")
    return out


def overhead_bytes(spec: ModelSpec, cfg: KernelConfig,
                   distinct_experts: list[int] | None = None) -> dict[str, int]:
    """What the plan moves beyond the weight / cache bytes an analytic model counts
    (`perfmodel.ops`): "tile_padding", the zeros that pad static matmuls and the routed experts
    fetched this step to whole T x T tiles; "vectors", the small per-layer vectors (norms, conv
    taps, decay constants, router bias, final norm) in 16 x 128 row blocks."""
    pad = sum(tm.tiles * cfg.bank_bytes - 2 * tm.mm.params
              for tm in layout.static_stream(spec, cfg))
    if spec.count(ffn="moe"):
        n_moe = spec.count(ffn="moe")
        if distinct_experts is None:
            distinct_experts = [min(spec.moe.experts, cfg.batch * spec.moe.top_k)] * n_moe
        per_expert = sum(2 * mm.params // mm.experts for mm in layout.expert_matmuls(spec))
        pad += sum(distinct_experts) * (layout.tiles_per_expert(spec, cfg) * cfg.bank_bytes
                                        - per_expert)
    vectors = sum(n * layout.LANES * 2 for layer in (*spec.layers, None)
                  for _, _, n in layout.vector_copies(spec, layer))
    return {"tile_padding": int(pad), "vectors": int(vectors)}


def predicted_step(spec: ModelSpec, cfg: KernelConfig, the_plan: list[Copy], context: int,
                   hardware: str = "tpu-v7"):
    """The schedule simulator run on exactly this plan, on one TensorCore of `hardware`: the
    ring of cfg.depth banks of cfg.bank_bytes, cfg.expert_slots expert buffers (a prediction,
    perfmodel.predict.Prediction, not a measurement)."""
    from perfmodel.deployment import Deployment
    from perfmodel.hardware import load_hardware
    from perfmodel.predict import predict
    hw = load_hardware(hardware).replace(dma_tile_bytes=cfg.bank_bytes)
    d = Deployment(devices=1, tp=1, batch=cfg.batch, context=context,
                   prefetch_bytes=cfg.depth * cfg.bank_bytes, expert_slots=cfg.expert_slots)
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
