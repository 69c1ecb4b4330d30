"""Generate tokens with the megakernel from seeded random weights, or print its DMA plan.

    python -m perfmodel_kernels.run --preset kimi-k3-mini --batch 4 --steps 8 --depth 6 [--interpret]
    python -m perfmodel_kernels.run --preset PRESET --devices 8 --tp 8 --ep 4 [--interpret]
    python -m perfmodel_kernels.run --rows 4 --accepted 2 [--interpret]     # verify blocks of 4 rows
    python -m perfmodel_kernels.run --preset kimi-k3 --devices 32 --tp 32 --ep 8 --batch 1 --plan-only --json
    python -m perfmodel_kernels.run --preset kimi-k3 --devices 32 --tp 32 --ep 8 --batch 1 --plan-out k3.plan.json

--plan-only traces the kernel for one device's shapes (no weights, no TPU) and prints its DMA
plan at --context cached tokens per sequence (default 4096): weight descriptors per device,
padding, remote copies, VMEM, and the model's prediction of this plan next to its prediction
of its own default megakernel (`perfmodel_kernels.plan.report`; --json: that dict). --plan-out writes the
same plan with the kernel's settings as a perfmodel plan file (`perfmodel predict --kernel-plan`).

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
import json
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

from . import comm, layout, megakernel, parallel, plan, quant, reference, shard, tuned, vmem


def _generate(spec, cfg, packed, cache, tokens, positions, step_fn, steps, accepted, rng,
              full=None):
    """Greedy decoding: (the kept tokens of every sequence, incl. the first and the last
    prediction, [B, steps * accepted + 1]; wall time per step); prints the DMA plan of step 1.
    spec: the (device) spec the step runs, full: the model it shards (None: one device).
    cfg.rows > 1: verify blocks (module docstring)."""
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
            pred = plan.predicted_step(spec, cfg, first, int(max(positions)),
                                       acceptance_length=accepted, full=full)
            stall = pred.breakdown_s["weight_streaming"] + pred.breakdown_s["expert_fetch"]
            print(f"\npredicted on {tp} tpu-v7 TensorCore(s) from this plan (perfmodel "
                  f"simulator, not a measurement): {pred.step_s * 1e6:.1f} us/step, "
                  f"{pred.bytes_per_device:,.0f} B moved per device, DMA stall "
                  f"{1e6 * stall:.1f} us")
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
    if a.devices < 1:
        raise SpecError("devices", a.devices, "must be at least 1")
    accepted = a.rows if a.accepted is None else a.accepted
    if not 1 <= accepted <= a.rows:
        raise SpecError("accepted", accepted, f"must be in [1, --rows = {a.rows}] (each step keeps at "
                        "least its first row)")
    tp = a.tp or a.devices
    if tp != a.devices:
        raise SpecError("tp", tp, f"must equal --devices ({a.devices}): the kernel has no data parallelism")
    return tp, accepted


def config_arguments(p: argparse.ArgumentParser) -> None:
    """The kernel configuration options (defaults: `perfmodel_kernels.tuned` for the preset and mesh)."""
    p.add_argument("--depth", type=int, help="weight ring banks in flight")
    p.add_argument("--bank-rows", type=int, help="rows of a ring bank (x tile x 2 B)")
    p.add_argument("--slots", type=int, help="routed expert slots")
    p.add_argument("--wire", choices=("f32", "bf16"), help="dtype of reductions between devices")
    p.add_argument("--host-devices", type=int,
                   help="mesh devices per host for the two-level one-shot all-reduce (default: "
                        "the TPU's devices per process, else the tpu-v7 hardware file's)")
    p.add_argument("--tile", type=int, default=0,
                   help="stream lanes and expert tile edge; default the chip's MXU width")
    p.add_argument("--chip", default="", help="the TPU to build for (v5e, v6e, 7x, ...; default "
                   "the attached one, else 7x; `perfmodel_kernels.chip`)")


def kernel_config(a, spec, batch: int, max_context: int, on_tpu: bool = False
                  ) -> layout.KernelConfig:
    """The KernelConfig of the parsed options (tuned defaults for the preset and mesh)."""
    t = tuned.tuned(a.preset, a.devices)
    host = a.host_devices
    if host is None:
        host = jax.local_device_count() if on_tpu else hardware_host_devices("tpu-v7")
    return layout.KernelConfig(
        batch=batch, max_context=max_context, depth=a.depth or t.depth, tile=a.tile,
        expert_slots=a.slots or t.expert_slots, cache_block=min(256, max_context),
        hierarchical=a.hierarchical, rows=a.rows, bank_rows=a.bank_rows or t.bank_rows,
        host_devices=host, wire=a.wire or t.wire, chip=a.chip)


def hardware_host_devices(name: str) -> int:
    """Devices (TensorCores) per host of a hardware preset."""
    from perfmodel.spec.hardware import load_hardware
    hw = load_hardware(name)
    return int(hw.components.get("chips_per_host", 0)) * hw.cores_per_chip


def plan_context(a, spec) -> tuple[int, layout.KernelConfig]:
    """(cached tokens per sequence, KernelConfig) of --plan-only / --plan-out: --context tokens
    (default 4096), the MLA cache capacity the next multiple of 256 that holds the rows."""
    context = 4096 if a.context is None else a.context
    cap = -(-(context + a.rows) // 256) * 256
    return context, kernel_config(a, spec, a.batch, cap)


def plan_only(a, spec) -> int:
    """--plan-only: the DMA plan's figures (`perfmodel_kernels.plan.report`)."""
    context, cfg = plan_context(a, spec)
    res = plan.report(spec, cfg, a.devices, a.ep if a.devices > 1 else None, context)
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    for k, v in res.items():
        print(f"{k:>32}: {v}")
    return 0


def plan_out(a, spec) -> int:
    """--plan-out: device 0's plan at --context cached tokens as a perfmodel plan file."""
    from perfmodel.graph.dmaplan import save_plan
    context, cfg = plan_context(a, spec)
    tp = a.devices
    save_plan(a.plan_out, plan.kernel_plan(spec, cfg, tp, a.ep if tp > 1 else None, context,
                                           "python -m perfmodel_kernels.run " + " ".join(sys.argv[1:])))
    print(f"wrote {a.plan_out}")
    return 0


class OneLineParser(argparse.ArgumentParser):
    """Bad options get one line naming the option and value (exit 2), not the whole usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    pre = OneLineParser(prog="python -m perfmodel_kernels.run", add_help=False)
    pre.add_argument("--devices", type=int, default=1)
    pre.add_argument("--interpret", action="store_true")
    k, _ = pre.parse_known_args(argv)
    if k.interpret and k.devices > 1 and "host_platform_device_count" not in \
            os.environ.get("XLA_FLAGS", ""):  # before JAX creates its CPU backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={k.devices}")
    p = OneLineParser(prog="python -m perfmodel_kernels.run", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="kimi-k3-mini")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--context", type=int, help="MLA cache capacity (tokens; default 64); with "
                   "--plan-only the cached tokens per sequence (default 4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expert-format", choices=("bf16",) + quant.QUANTISED,
                   help="store the routed experts in this format (default: the preset's)")
    p.add_argument("--trace-dir", help="write a jax.profiler trace of the steps here")
    p.add_argument("--plan-only", action="store_true",
                   help="print the DMA plan's figures (no weights, no TPU needed)")
    p.add_argument("--json", action="store_true", help="with --plan-only: one JSON object")
    p.add_argument("--plan-out", help="write that plan with the kernel's settings as a perfmodel "
                   "plan file (`perfmodel predict --kernel-plan`; no weights, no TPU)")
    config_arguments(p)
    add_block_and_mesh_arguments(p)
    a = p.parse_args(argv)
    try:
        spec = load_model(a.preset)
        if a.expert_format:
            spec = dataclasses.replace(spec, formats=spec.formats | {
                "routed_expert": get_format(a.expert_format, "expert-format")})
        tp, accepted = block_and_mesh(a)
        if a.plan_only:
            return plan_only(a, spec)
        if a.plan_out:
            return plan_out(a, spec)
        context = 64 if a.context is None else a.context
        on_tpu = pltpu.is_tpu_device() and not a.interpret
        cfg = kernel_config(a, spec, a.batch, context, on_tpu)
        if a.steps * accepted + a.rows - accepted > context:
            raise SpecError("steps", a.steps, f"the last block would end past --context "
                            f"({context}): steps * accepted + rows - accepted must be <= it")
        dspec = shard.device_spec(spec, tp, a.ep) if tp > 1 else spec
        budget = vmem.check_vmem(dspec, cfg)
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
          f" ring {cfg.depth} x {cfg.bank_bytes:,} B, {cfg.expert_slots} expert slots, "
          f"all-reduce {comm.algorithm(dspec, cfg)} ({cfg.wire} wire)")
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
                                     a.steps, accepted, rng, spec if tp > 1 else None)
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
