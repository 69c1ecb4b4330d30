"""Profile the Pallas megakernel on a TPU VM: measured prefetch-depth curve next to the simulator's.

    python experiments/profile_megakernel.py --preset kimi-k3-mini --batch 1,2,4,8 --depths 1,2,4,8,12
    python experiments/profile_megakernel.py --devices 8 --ep 4 [--hierarchical]   # on a mesh
    python experiments/profile_megakernel.py --devices 2 --interpret   # CPU: numerics only
    python experiments/profile_megakernel.py --rows 4 --accepted 2   # verify blocks of 4 rows

For each batch and ring depth: runs `perfmodel_kernels.megakernel.decode_step` under `jax.profiler.trace`
(one `StepTraceAnnotation("decode_step")` per step), parses the trace with `perfmodel.validate.traces`
(the kernel's `jax.named_scope` per layer and phase appear as in-kernel trace markers), predicts
the same configuration with the megakernel simulator (ring of `depth` banks of the kernel's tile
bytes, its expert slots) and writes per-layer and per-step predicted vs measured to
experiments/results/megakernel_profile.csv (+ .json), with the machine, date and command.

TPU runtime flags (set here before jax is imported; extend with PERFMODEL_TPU_TRACE_FLAGS):
    LIBTPU_INIT_ARGS += --xla_enable_custom_call_region_trace=true
        (emit trace events for the named regions inside a Mosaic custom call: the markers)
    LIBTPU_INIT_ARGS += --xla_xprof_register_llo_debug_info=true
        (keep the kernel's scope names in the trace)
These flags have not been exercised here (no TPU on the development machine): if a libtpu
version rejects or renames one, set PERFMODEL_TPU_TRACE_FLAGS to the working set.
With --devices N the kernel runs on N mesh devices (tensor parallel over all of them, routed
experts in --ep groups; `perfmodel_kernels.parallel`) and the prediction uses the same deployment. With
--interpret (no TPU) it runs every configuration once in Pallas TPU interpret mode on N virtual
CPU devices and reports tokens only: interpret-mode time says nothing about TPU speed.
With --rows R every step is a verify block of R rows per sequence (causal within the block) of
which --accepted K are written to the caches (a synthetic workload: the same block positions
every step); the prediction is speculative decoding with R - 1 drafted rows and acceptance
length K.
Without a TPU and without --interpret the script exits with status 2 and a message; its
parsing and comparison code (`compare_run`) is covered by tests/test_traces.py on constructed
TPU traces.
"""
from __future__ import annotations

import os

TRACE_FLAGS = os.environ.get("PERFMODEL_TPU_TRACE_FLAGS",
                             "--xla_enable_custom_call_region_trace=true "
                             "--xla_xprof_register_llo_debug_info=true")
os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " " + TRACE_FLAGS).strip()

import argparse  # noqa: E402  (the flags above must precede any jax import)
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from perfmodel_kernels.run import add_block_and_mesh_arguments, block_and_mesh  # noqa: E402
from perfmodel.cli.args import int_list  # noqa: E402
from perfmodel.spec.deployment import Deployment, SpecDecode  # noqa: E402
from perfmodel.spec.hardware import load_hardware  # noqa: E402
from perfmodel.spec.loaders import load_model  # noqa: E402
from perfmodel.step.predict import predict  # noqa: E402
from perfmodel.util.errors import SpecError  # noqa: E402
from perfmodel.util.files import write_atomic, write_csv  # noqa: E402
from perfmodel.validate.host import Comparison, against  # noqa: E402
from perfmodel.validate.traces import STEP_NAME, TraceSummary, parse_trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def compare_run(t: TraceSummary, preset: str, hardware: str, batch: int, context: int,
                depth: int, bank_bytes: int, slots: int, devices: int = 1,
                ep: int | None = None, rows: int = 1, accepted: int = 1) -> Comparison:
    """The megakernel simulator's prediction of one traced run, layer by layer: `devices`
    devices, all tensor parallel, `ep` expert groups, a ring of `depth` banks of `bank_bytes`
    (the simulator's tile set to the kernel's bank); rows > 1: verify blocks of `rows` rows,
    `accepted` kept per step."""
    spec = load_model(preset)
    hw = load_hardware(hardware)
    hw = hw.replace(dma_tile_bytes=bank_bytes)
    verify = SpecDecode(draft_rows=rows - 1, acceptance_length=accepted) if rows > 1 else None
    d = Deployment(devices=devices, tp=devices, ep=ep, engine="megakernel", batch=batch,
                   context=context, prefetch_bytes=float(depth * bank_bytes), expert_slots=slots,
                   spec=verify)
    return against(t, spec, hw, predict(spec, hw, d), f"megakernel depth {depth}")


def rows_of(c: Comparison, depth: int) -> list[list]:
    out = [[c.batch, depth, "step", c.predicted_step_s, c.measured_step_s, c.step_error]]
    return out + [[c.batch, depth, r.layer, r.predicted_s, r.measured_s, r.rel_error]
                  for r in c.layers]


def _config(a, batch: int, depth: int):
    from perfmodel_kernels import layout
    return layout.KernelConfig(batch=batch, max_context=a.context, depth=depth, tile=a.tile,
                               expert_slots=a.slots, cache_block=min(256, a.context),
                               hierarchical=a.hierarchical, rows=a.rows)


def _inputs(a, batch: int):
    """(tokens [B] or a verify block [B, rows], positions [B], accepted [B] or None)."""
    import jax.numpy as jnp
    tokens = jnp.zeros((batch,) if a.rows == 1 else (batch, a.rows), jnp.int32)
    accepted = None if a.rows == 1 else jnp.full((batch,), a.accepted, jnp.int32)
    return tokens, jnp.full((batch,), a.context // 2, jnp.int32), accepted


def _prepare(a, spec, weights, cfg, interpret):
    """(step, packed weights, cache) on one device or on the mesh of --devices."""
    from perfmodel_kernels import layout, megakernel, parallel, reference
    cache = reference.init_cache(spec, cfg.batch, cfg.max_context)
    if a.devices == 1:
        return megakernel.make_step(spec, cfg, interpret), layout.pack_weights(weights, cfg), cache
    dspec, step = parallel.make_step(spec, cfg, a.devices, a.ep, interpret)
    return step, parallel.pack(weights, cfg, dspec), parallel.shard_cache(cache, dspec)


def _interpret(a) -> int:
    """Every configuration once in interpret mode: tokens only, no timing."""
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from perfmodel_kernels import reference
    spec = load_model(a.preset)
    weights = reference.init_weights(spec, 0)
    for batch in a.batch:
        for depth in a.depths:
            cfg = _config(a, batch, depth)
            step, packed, cache = _prepare(a, spec, weights, cfg,
                                           pltpu.InterpretParams(detect_races=True))
            tokens, _, _, _ = step(packed, cache, *_inputs(a, batch))
            print(f"batch {batch} depth {depth:2d} rows {a.rows} on {a.devices} device(s): next "
                  f"tokens {jnp.asarray(tokens).tolist()} (interpret mode: no timing)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-k3-mini")
    ap.add_argument("--hardware", default="tpu-v7")
    ap.add_argument("--batch", type=int_list, default=[1, 2, 4, 8])
    ap.add_argument("--depths", type=int_list, default=[1, 2, 4, 8, 12])
    ap.add_argument("--context", type=int, default=64, help="MLA cache capacity (tokens)")
    ap.add_argument("--tile", type=int, default=256)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    add_block_and_mesh_arguments(ap)
    ap.add_argument("--traces", default=str(ROOT / "out" / "megakernel_traces"))
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "megakernel_profile.csv"))
    a = ap.parse_args(argv)

    try:
        _, a.accepted = block_and_mesh(a)
        if not (a.rows <= 8 and a.context // 2 + a.rows <= a.context):
            raise SpecError("rows", a.rows, "must be <= 8 and <= --context / 2")
    except SpecError as e:
        print(f"profile_megakernel: {e}", file=sys.stderr)
        return 2
    if a.interpret and a.devices > 1:  # before JAX creates its CPU backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={a.devices}")
    import jax
    from jax.experimental.pallas import tpu as pltpu
    if a.interpret:
        return _interpret(a)
    if not pltpu.is_tpu_device():
        print(f"profile_megakernel: no TPU attached (JAX backend: {jax.default_backend()}); this "
              "experiment needs a TPU VM. Its trace parsing and comparison are tested on "
              "constructed TPU traces (tests/test_traces.py).", file=sys.stderr)
        return 2
    from perfmodel_kernels import layout, reference
    spec = load_model(a.preset)
    weights = reference.init_weights(spec, 0)
    results, rows = [], []
    for batch in a.batch:
        for depth in a.depths:
            cfg = _config(a, batch, depth)
            step, packed, cache = _prepare(a, spec, weights, cfg, None)
            tokens, positions, accepted = _inputs(a, batch)
            for _ in range(2):  # compile, warm up
                tokens, _, cache, _ = step(packed, cache, tokens, positions, accepted)
            jax.block_until_ready(tokens)
            run = Path(a.traces) / f"{spec.name}_n{a.devices}_b{batch}_d{depth}_r{a.rows}"
            with jax.profiler.trace(str(run)):
                for i in range(a.steps):
                    with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
                        tokens, _, cache, _ = step(packed, cache, tokens, positions, accepted)
                        jax.block_until_ready(tokens)
            t = parse_trace(run, n_layers=len(spec.layers))
            # the kernel attends over positions < pos: the model's context is that length
            c = compare_run(t, a.preset, a.hardware, batch, a.context // 2, depth, cfg.bank_bytes,
                            a.slots, a.devices, a.ep, a.rows, a.accepted)
            results.append({"depth": depth, **c.json()})
            rows += rows_of(c, depth)
            print(f"batch {batch} depth {depth:2d}: step measured {c.measured_step_s * 1e6:.1f} us,"
                  f" predicted {c.predicted_step_s * 1e6:.1f} us ({c.step_error:+.1%}), layer MAPE "
                  f"{c.layer_mape:.1%}, unattributed {c.unattributed_share:.1%}")
    out = Path(a.out)
    write_csv(out, [f"machine: {jax.devices()[0].device_kind}",
                    f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
                    f"command: python {' '.join(sys.argv)}", f"trace flags: {TRACE_FLAGS}"],
              ["batch", "depth", "layer", "predicted_s", "measured_s", "rel_error"], rows)
    write_atomic(out.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
