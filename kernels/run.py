"""Generate tokens with the megakernel from seeded random weights.

    python -m kernels.run --preset kimi-k3-mini --batch 4 --steps 8 --depth 6 [--interpret]
    python -m kernels.run --preset PRESET --devices 8 --tp 8 --ep 4 [--interpret]
    python -m kernels.run --rows 4 --accepted 2 [--interpret]     # verify blocks of 4 rows
    python -m kernels.run --preset kimi-k3 --devices 32 --tp 32 --ep 8 --batch 1 --context 4352 \
        --plan-out k3.plan.json                                    # its DMA plan, for perfmodel

Prints the VMEM budget, the DMA plan summary of the first step (bytes per layer by family, of
device 0) and the generated tokens; on a real TPU (without --interpret) also the time per step.
With --devices N > 1 the kernel runs once per device under shard_map (tensor parallel over all
N devices, routed experts in --ep groups); with --interpret on CPU, N virtual devices are made
(XLA_FLAGS). Interpret mode (Pallas TPU interpreter on CPU, race detection on) checks numerics
only: no timing is measured. With --rows R each step verifies a block of R rows per sequence:
row 0 the last token, rows 1.. drafted (a stand-in drafter: seeded random tokens); the first
--accepted K rows are kept (written to the caches), the next block starts with the prediction
of row K-1, and positions advance by K.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from perfmodel.spec.formats import get_format
from perfmodel.spec.loaders import load_model
from perfmodel.util.errors import SpecError

from . import layout, megakernel, parallel, plan, quant, reference, shard, vmem


def _generate(spec, cfg, packed, cache, tokens, positions, step_fn, steps, accepted, rng):
    """Greedy decoding: (the kept tokens of every sequence, incl. the first and the last
    prediction, [B, steps * accepted + 1]; wall time per step); prints the DMA plan of step 1.
    spec: the (device) spec the step runs. cfg.rows > 1: verify blocks (module docstring)."""
    kept, times = [], []
    tp = layout.tp_of(spec)
    acc = jnp.full((cfg.batch,), accepted, jnp.int32)
    for step in range(steps):
        block = tokens if cfg.rows == 1 else jnp.concatenate(
            [tokens[:, None], jnp.asarray(rng.integers(0, spec.vocab, (cfg.batch, cfg.rows - 1)),
                                          jnp.int32)], axis=1)
        t0 = time.perf_counter()
        nxt, _, cache, distinct = step_fn(packed, cache, block, positions,
                                          None if cfg.rows == 1 else acc)
        jax.block_until_ready(nxt)
        times.append(time.perf_counter() - t0)
        if step == 0:
            distinct = [int(d) for d in (distinct[0] if tp > 1 else distinct)]
            first = plan.dma_plan(spec, cfg, distinct, [int(q) for q in positions],
                                  [accepted] * cfg.batch)
            print(f"\nDMA plan of step 1 ({len(first)} copies, distinct experts per MoE layer "
                  f"{distinct}), bytes per layer by family:")
            print(plan.summary(spec, first))
            if tp == 1:  # the simulator's plan input is for one device without collectives
                pred = plan.predicted_step(spec, cfg, first, int(max(positions)),
                                           acceptance_length=accepted)
                print(f"\npredicted on one tpu-v7 TensorCore from this plan (perfmodel simulator, "
                      f"not a measurement): {pred.step_s * 1e6:.1f} us/step, "
                      f"{pred.bytes_per_device:,.0f} B moved, DMA stall "
                      f"{1e6 * (pred.breakdown_s['weight_streaming'] + pred.breakdown_s['expert_fetch']):.1f} us")
        block = np.asarray(block).reshape(cfg.batch, cfg.rows)
        kept.append(block[:, :accepted])
        tokens = jnp.asarray(np.asarray(nxt).reshape(cfg.batch, cfg.rows)[:, accepted - 1])
        positions = positions + accepted
    kept.append(np.asarray(tokens)[:, None])
    return np.concatenate(kept, axis=1), times


def add_block_and_mesh_arguments(p: argparse.ArgumentParser) -> None:
    """The verify-block and mesh options both kernel CLIs take (this one and
    experiments/profile_megakernel.py)."""
    p.add_argument("--rows", type=int, default=1,
                   help="verify rows per sequence and step (a draft block, at most 8)")
    p.add_argument("--accepted", type=int,
                   help="rows of each block kept (written to the caches); default all --rows")
    p.add_argument("--devices", type=int, default=1, help="mesh devices (TensorCores)")
    p.add_argument("--tp", type=int, help="tensor-parallel degree (default and only: --devices)")
    p.add_argument("--ep", type=int, help="expert-parallel groups (default: one per device)")
    p.add_argument("--hierarchical", action="store_true",
                   help="all-reduce with the sibling TensorCore first")
    p.add_argument("--interpret", action="store_true",
                   help="Pallas TPU interpret mode on virtual CPU devices (numerics only, no timing)")


def block_and_mesh(a) -> tuple[int, int]:
    """(tensor-parallel degree, accepted rows) of those options, or a SpecError naming the one
    that cannot run."""
    accepted = a.rows if a.accepted is None else a.accepted
    if not 1 <= accepted <= a.rows:
        raise SpecError("accepted", accepted, f"must be in [1, --rows = {a.rows}] (each step keeps at "
                        "least its first row)")
    tp = a.tp or a.devices
    if tp != a.devices:
        raise SpecError("tp", tp, f"must equal --devices ({a.devices}): the kernel has no data parallelism")
    return tp, accepted


def write_plan(a, spec, dspec, cfg, tp) -> None:
    """--plan-out: device 0's DMA plan of one step at --context - rows cached tokens per sequence
    and the analytic model's distinct experts per layer, with the settings the engine replays
    (perfmodel.graph.dmaplan.KERNEL_FIELDS: this kernel reduces in f32 by reduce-scatter +
    all-gather, pads rows to sublane tiles and dequantises routed experts to bf16)."""
    from perfmodel.graph.dmaplan import KernelPlan, save_plan
    from perfmodel.graph.ops import build
    from perfmodel.spec.deployment import Deployment, SpecDecode
    context = a.context - cfg.rows
    verify = SpecDecode(cfg.rows - 1, acceptance_length=1.0) if cfg.rows > 1 else None
    g = build(spec, Deployment(devices=tp, tp=tp, ep=a.ep if tp > 1 else None, batch=cfg.batch,
                               context=context, spec=verify))
    n = spec.count(ffn="moe")
    most = plan._most_experts(dspec, cfg) if n else 0
    d = min(g.distinct_experts, most)
    distinct = [round((i + 1) * d) - round(i * d) for i in range(n)]
    copies = plan.dma_plan(dspec, cfg, distinct, [context] * cfg.batch)
    kernel = {"bank_bytes": cfg.bank_bytes, "depth": cfg.depth, "expert_slots": cfg.expert_slots,
              "wire": "f32", "all_reduce": "hierarchical" if cfg.hierarchical else "rs_ag",
              "collective_rows": cfg.padded_batch, "expert_feed": "bf16"}
    dep = {"devices": tp, "tp": tp, "batch": cfg.batch, "context": context, "draft_rows": cfg.rows - 1}
    if tp > 1:
        dep["ep"] = dspec.groups
    save_plan(a.plan_out, KernelPlan(a.preset, dep, kernel, tuple(copies),
                                     "python -m kernels.run " + " ".join(sys.argv[1:])))


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--devices", type=int, default=1)
    pre.add_argument("--interpret", action="store_true")
    k, _ = pre.parse_known_args(argv)
    if k.interpret and k.devices > 1 and "host_platform_device_count" not in \
            os.environ.get("XLA_FLAGS", ""):  # before JAX creates its CPU backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={k.devices}")
    p = argparse.ArgumentParser(prog="python -m kernels.run", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="kimi-k3-mini")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--depth", type=int, default=6, help="weight ring banks")
    p.add_argument("--slots", type=int, default=2, help="routed expert slots")
    p.add_argument("--tile", type=int, default=vmem.chip_info().mxu_column_size,
                   help="weight tile edge (bank = 2*T*T bytes); default the MXU width")
    p.add_argument("--context", type=int, default=64, help="MLA cache capacity (tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expert-format", choices=("bf16",) + quant.QUANTISED,
                   help="store the routed experts in this format (default: the preset's)")
    p.add_argument("--trace-dir", help="write a jax.profiler trace of the steps here")
    p.add_argument("--plan-out", help="write one step's DMA plan (device 0, --context - rows cached tokens) as a "
                   "perfmodel plan file for `perfmodel predict --kernel-plan` and exit (no weights, no TPU)")
    add_block_and_mesh_arguments(p)
    a = p.parse_args(argv)
    try:
        spec = load_model(a.preset)
        if a.expert_format:
            spec = dataclasses.replace(spec, formats=spec.formats | {
                "routed_expert": get_format(a.expert_format, "expert-format")})
        cfg = layout.KernelConfig(batch=a.batch, max_context=a.context, depth=a.depth,
                                  tile=a.tile, expert_slots=a.slots,
                                  cache_block=min(256, a.context), hierarchical=a.hierarchical,
                                  rows=a.rows)
        tp, accepted = block_and_mesh(a)
        if a.steps * accepted + a.rows - accepted > a.context:
            raise SpecError("steps", a.steps, f"the last block would end past --context "
                            f"({a.context}): steps * accepted + rows - accepted must be <= it")
        dspec = shard.device_spec(spec, tp, a.ep) if tp > 1 else spec
        budget = vmem.check_vmem(dspec, cfg)
        if a.plan_out:
            write_plan(a, spec, dspec, cfg, tp)
            print(f"wrote {a.plan_out}")
            return 0
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    on_tpu = pltpu.is_tpu_device() and not a.interpret
    if not on_tpu and not a.interpret:
        print("error: no TPU attached; pass --interpret to run in Pallas TPU interpret mode",
              file=sys.stderr)
        return 2
    interpret = pltpu.InterpretParams(detect_races=True) if a.interpret else None
    try:
        step_fn = parallel.make_step(spec, cfg, tp, a.ep, interpret)[1] if tp > 1 else \
            megakernel.make_step(spec, cfg, interpret)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{spec.name}: {len(spec.layers)} layers on {tp} device(s), "
          f"batch {cfg.batch} x {cfg.rows} rows (padded {cfg.padded_batch}),"
          f" ring {cfg.depth} x {cfg.bank_bytes:,} B, {cfg.expert_slots} expert slots")
    print(budget.table())

    weights = reference.init_weights(spec, a.seed)
    cache = reference.init_cache(spec, cfg.batch, cfg.max_context)
    if tp > 1:
        packed, cache = parallel.pack(weights, cfg, dspec), parallel.shard_cache(cache, dspec)
    else:
        packed = layout.pack_weights(weights, cfg)
    rng = np.random.default_rng(a.seed)
    tokens = jnp.asarray(rng.integers(0, spec.vocab, cfg.batch), jnp.int32)
    positions = jnp.zeros((cfg.batch,), jnp.int32)
    tracing = jax.profiler.trace(a.trace_dir) if a.trace_dir else contextlib.nullcontext()
    with tracing:
        generated, times = _generate(dspec, cfg, packed, cache, tokens, positions, step_fn,
                                     a.steps, accepted, rng)
    print("\ntokens (one row per sequence):")
    for row in generated:
        print("  " + " ".join(str(int(t)) for t in row))
    if on_tpu:
        steady = times[1:] or times
        print(f"\ntime per step: first {times[0] * 1e3:.3f} ms (compile included), then "
              f"median {np.median(steady) * 1e3:.3f} ms over {len(steady)} steps")
    else:
        print("\ninterpret mode: timings are not measured (CPU interpretation says nothing "
              "about TPU speed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
