"""Validate the megakernel on a TPU VM in one command: Kimi K3-shaped slices, depth and slot
sweeps, profiler traces, phases from the kernel's markers, and the model's prediction of each
run from the kernel's own DMA plan.

    pip install -e '.[tpu]'
    python experiments/tpu_megakernel.py               # on a TPU VM (TPU7x: 4 chips = 8 cores)
    python experiments/tpu_megakernel.py --allow-cpu   # no TPU: the same pipeline, interpret mode

Slices (4 layers as Kimi K3 begins and ends: KDA + dense FFN, 2 x KDA + MoE, MLA + MoE; routed
experts MXFP4 as the preset):
- "one core": one TensorCore with the per-core widths of Kimi K3 at TP32 x EP8 (3 heads of
  each attention, dense width 1056, 112 experts of width 768, shared width 192, vocabulary
  5120, top-4: about the 4.2 distinct experts the busiest expert group fetches at batch 1 in
  `perfmodel.graph.moe`); a mesh shards and gathers the low-rank projections (q_a, kv_a,
  decay_a, latent_down), which this one core computes whole;
- "tp8": the same 4 layers at Kimi K3's full widths over the 8 cores of one TPU7x host, experts
  in 2 groups of 4 cores (each expert split 4 ways, as at TP32 x EP8), `--tp8-experts` experts
  (default 32: a TPU VM host builds and quantises the random weights).
With --allow-cpu both slices shrink to the MINI preset with 8 heads (one device; TP8 on 8
virtual CPU devices, one configuration) and run in Pallas TPU interpret mode with race
detection: the pipeline is checked end to end, and its timings are CPU interpretation, not TPU
timings.

For each slice, batch, ring depth (--depths) and expert slots (--slots): build the step (VMEM
budget checked), compile and warm up, trace --steps steps under `jax.profiler.trace` (one
`StepTraceAnnotation` a step; on a TPU the libtpu flags of experiments/profile_megakernel.py
make the kernel's named scopes trace markers), attribute each step's time to the kernel's
phases (embed, layer_XX/attention, layer_XX/ffn, head; `perfmodel.validate.traces`), and
predict the same run with `kernels.plan.predicted_step` on the kernel's plan for the experts it
actually fetched. Writes experiments/results/tpu_megakernel.csv (one row a run), .json (every
figure, the machine, the command) and .md (a short report); traces under
out/tpu_megakernel_traces/.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import profile_megakernel  # noqa: F401  (sets the libtpu trace flags before jax is imported)

ROOT = Path(__file__).resolve().parent.parent
MOE_LAYERS = dict(layers=4, attention={"default": "kda", "mla_layers": [4]},
                  ffn={"dense_layers": [1]})


def slices(cpu: bool, tp8_experts: int):
    """[(name, full spec, devices, expert groups)] of the run."""
    from perfmodel.spec.arch import derive
    if cpu:
        mini = derive("kimi-k3-mini", kda={"heads": 8}, mla={"heads": 8})
        return [("one core", mini, 1, None), ("tp8", mini, 8, 2)]
    one = derive("kimi-k3", name="kimi-k3-core-slice", vocab=163840 // 32,
                 kda={"heads": 3}, mla={"heads": 3},
                 ffn={"dense_layers": [1], "dense_width": 33792 // 32},
                 moe={"experts": 896 // 8, "top_k": 4, "expert_width": 3072 // 4,
                      "shared_width": 6144 // 32}, **{k: v for k, v in MOE_LAYERS.items()
                                                      if k != "ffn"})
    tp8 = derive("kimi-k3", name="kimi-k3-tp8-slice", moe={"experts": tp8_experts, "top_k": 8},
                 **MOE_LAYERS)
    return [("one core", one, 1, None), ("tp8", tp8, 8, 2)]


def run_one(name, full, devices, ep, batch, depth, slots, a, interpret, traces: Path):
    """Build, warm up, trace and predict one configuration: a result dict."""
    import jax
    import jax.numpy as jnp
    from kernels import layout, megakernel, parallel, plan, reference, shard, tuned, vmem
    from perfmodel.util.errors import SpecError
    from perfmodel.validate.traces import STEP_NAME, parse_trace

    t = tuned.tuned("kimi-k3", 32)
    host = 8 if interpret else jax.local_device_count()
    cfg = layout.KernelConfig(batch=batch, max_context=a.context, depth=depth,
                              tile=vmem.chip_info().mxu_column_size, expert_slots=slots,
                              cache_block=min(256, a.context), bank_rows=a.bank_rows or
                              (256 if interpret else t.bank_rows), host_devices=host,
                              wire="f32" if interpret else t.wire)
    dspec = shard.device_spec(full, devices, ep) if devices > 1 else full
    budget = vmem.check_vmem(dspec, cfg)
    weights = reference.init_weights(full, 0)
    cache = reference.init_cache(full, batch, a.context)
    if devices > 1:
        _, step = parallel.make_step(full, cfg, devices, ep, interpret)
        packed, cache = parallel.pack(weights, cfg, dspec), parallel.shard_cache(cache, dspec)
    else:
        step, packed = megakernel.make_step(full, cfg, interpret), layout.pack_weights(weights, cfg)
    del weights
    pos = a.context // 2
    tokens = jnp.zeros((batch,), jnp.int32)
    positions = jnp.full((batch,), pos, jnp.int32)
    for _ in range(a.warmup):   # compile, warm up
        tokens, _, cache, distinct = step(packed, cache, tokens, positions)
    jax.block_until_ready(tokens)
    label = f"{name.replace(' ', '_')}_b{batch}_d{depth}_s{slots}"
    trace_dir = traces / label
    walls = []
    with jax.profiler.trace(str(trace_dir)):
        for i in range(a.steps):
            with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
                t0 = time.perf_counter()
                tokens, _, cache, distinct = step(packed, cache, tokens, positions)
                jax.block_until_ready(tokens)
                walls.append(time.perf_counter() - t0)
    d = [int(x) for x in (distinct[0] if devices > 1 else distinct)]
    the_plan = plan.dma_plan(dspec, cfg, d, [pos] * batch)
    pred = plan.predicted_step(dspec, cfg, the_plan, pos, full=full if devices > 1 else None)
    w = plan.weight_copies(the_plan)
    phases, unattributed, measured, note = {}, None, None, ""
    try:
        tr = parse_trace(trace_dir, n_layers=len(full.layers))
        measured = tr.step_s.median
        unattributed = tr.unattributed_share
        for scope, spread in tr.phase_s.items():
            phases[scope] = spread.median
    except SpecError as e:
        note = f"trace not attributed: {e}"
    return {"slice": name, "model": full.name, "devices": devices, "ep": ep, "batch": batch,
            "depth": depth, "expert_slots": slots, "bank_bytes": cfg.bank_bytes,
            "context": pos, "vmem_bytes": budget.total_bytes,
            "distinct_experts": d, "weight_descriptors": len(w),
            "padding_fraction": sum(c.padding for c in w) / max(1, sum(c.bytes for c in w)),
            "remote_descriptors": sum(c.peer >= 0 for c in the_plan),
            "wall_step_s": statistics.median(walls), "traced_step_s": measured,
            "predicted_step_s": pred.step_s,
            "error": (pred.step_s / measured - 1) if measured and not interpret else None,
            "phases_s": phases, "unattributed_share": unattributed, "trace": str(trace_dir),
            "note": note}


def report(res: dict) -> str:
    lines = ["# Megakernel on " + res["machine"], "",
             f"`{res['command']}` ({res['date']})", ""]
    if res["interpret"]:
        lines += ["Pallas TPU interpret mode on CPU: the pipeline ran end to end; the timings are "
                  "CPU interpretation and say nothing about a TPU.", ""]
    lines += ["| slice | batch | depth | slots | weight DMAs | step (traced) us | "
              "predicted us | error |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["runs"]:
        meas = f"{r['traced_step_s'] * 1e6:.1f}" if r["traced_step_s"] else "-"
        err = f"{r['error']:+.1%}" if r["error"] is not None else "-"
        lines.append(f"| {r['slice']} | {r['batch']} | {r['depth']} | {r['expert_slots']} | "
                     f"{r['weight_descriptors']} | {meas} | {r['predicted_step_s'] * 1e6:.1f} | "
                     f"{err} |")
    lines += ["", "Predicted: `kernels.plan.predicted_step` on each run's own DMA plan (the "
              "experts it fetched); phases per run in the JSON."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from perfmodel.cli.args import int_list
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allow-cpu", action="store_true",
                    help="without a TPU: run the pipeline in interpret mode (timings mean nothing)")
    ap.add_argument("--batch", type=int_list, help="batches (default 1,8; CPU: 2)")
    ap.add_argument("--depths", type=int_list, help="ring depths in banks (default 4,8,12; CPU: 3)")
    ap.add_argument("--slots", type=int_list, help="expert slots (default 2,4; CPU: 1,2)")
    ap.add_argument("--bank-rows", type=int, help="rows of a ring bank (default: kernels.tuned)")
    ap.add_argument("--context", type=int, help="MLA cache capacity (default 1024; CPU 32)")
    ap.add_argument("--steps", type=int, default=5, help="traced steps a run (CPU: 1)")
    ap.add_argument("--warmup", type=int, default=2, help="untraced steps first (CPU: 0)")
    ap.add_argument("--tp8-experts", type=int, default=32)
    ap.add_argument("--only", choices=("one core", "tp8"), help="run one slice only")
    ap.add_argument("--traces", default=str(ROOT / "out" / "tpu_megakernel_traces"))
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "tpu_megakernel.csv"))
    a = ap.parse_args(argv)
    if a.allow_cpu and "host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8")
    import jax
    from jax.experimental.pallas import tpu as pltpu
    from perfmodel.util.errors import SpecError
    from perfmodel.util.files import write_atomic, write_csv

    on_tpu = pltpu.is_tpu_device()
    if not on_tpu and not a.allow_cpu:
        print(f"tpu_megakernel: no TPU attached (JAX backend: {jax.default_backend()}); run it "
              "on a TPU VM, or pass --allow-cpu for the interpret-mode smoke test",
              file=sys.stderr)
        return 2
    cpu = not on_tpu
    interpret = pltpu.InterpretParams(detect_races=True) if cpu else None
    a.batch = a.batch or ([2] if cpu else [1, 8])
    a.depths = a.depths or ([3] if cpu else [4, 8, 12])
    a.slots = a.slots or ([1, 2] if cpu else [2, 4])
    a.context = a.context or (32 if cpu else 1024)
    a.steps = 1 if cpu else a.steps
    a.warmup = 0 if cpu else a.warmup
    runs = []
    try:
        for name, full, devices, ep in slices(cpu, a.tp8_experts):
            if a.only and name != a.only:
                continue
            # on CPU the TP8 slice runs once (interpreting 8 devices is slow)
            depths, slot_counts = ([a.depths[0]], [a.slots[-1]]) if cpu and devices > 1 else \
                (a.depths, a.slots)
            for batch in a.batch:
                for depth in depths:
                    for slots in slot_counts:
                        r = run_one(name, full, devices, ep, batch, depth, slots, a, interpret,
                                    Path(a.traces))
                        runs.append(r)
                        meas = f"{r['traced_step_s'] * 1e6:.1f} us" if r["traced_step_s"] \
                            else "not traced"
                        print(f"{name:>8} batch {batch} depth {depth:2d} slots {slots}: traced "
                              f"{meas}, predicted {r['predicted_step_s'] * 1e6:.1f} us, "
                              f"{r['weight_descriptors']} weight DMAs"
                              + (" (interpret mode: not a TPU timing)" if cpu else ""))
    except SpecError as e:
        print(f"tpu_megakernel: {e}", file=sys.stderr)
        return 2
    machine = jax.devices()[0].device_kind if on_tpu else \
        f"CPU ({platform.processor() or platform.machine()})"
    res = {"machine": machine, "interpret": cpu, "jax": jax.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python " + " ".join(sys.argv), "trace_flags": profile_megakernel.TRACE_FLAGS,
           "note": ("interpret mode on CPU: a smoke test of the pipeline; these are not TPU timings"
                    if cpu else "measured on a TPU; predicted from each run's DMA plan"),
           "runs": runs}
    out = Path(a.out)
    cols = ["slice", "batch", "depth", "expert_slots", "weight_descriptors", "padding_fraction",
            "remote_descriptors", "wall_step_s", "traced_step_s", "predicted_step_s", "error",
            "unattributed_share"]
    write_csv(out, [f"machine: {machine}", f"date: {res['date']}", f"command: {res['command']}",
                    f"note: {res['note']}"], cols, [[r[c] for c in cols] for r in runs])
    write_atomic(out.with_suffix(".json"), json.dumps(res, indent=1) + "\n")
    write_atomic(out.with_suffix(".md"), report(res))
    print(f"wrote {out}, {out.with_suffix('.json').name}, {out.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
