"""Lower the megakernel's full Kimi K3 per-device program for TPU7x on this machine (no TPU).

    python experiments/bench_kernel_compile.py [--tp 32] [--ep 8] [--batch 4] [--repeats 3]

Builds one device's shapes (`perfmodel_kernels.shard.device_spec`, TP over `--tp` devices, routed experts
in `--ep` groups, in the preset's format (Kimi K3: MXFP4) or --expert-format), with the tuned
ring and slots of `perfmodel_kernels.tuned`, traces the kernel (its layer loop is traced once per kind)
and exports the step with `jax.export` for an abstract mesh of `--tp` TPU7x devices (one
pallas_call per device under shard_map, collectives as remote DMAs): every op must have a
Pallas TPU (Mosaic) lowering. Repeats trace + export `--repeats` times in this process and
prints the median of each phase, the trace size, the module size, the VMEM budget and the
machine's load average; writes experiments/results/kernel_compile.json. Mosaic's own
compilation (layout passes, LLO) runs only on a TPU host and is not part of this figure.
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

ROOT = Path(__file__).resolve().parent.parent


def export_once(dspec, cfg, tp: int):
    """(kernel jaxpr equations, trace seconds, export seconds, exported module)."""
    import jax
    from jax import export
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, PartitionSpec as P
    from jax.sharding import use_abstract_mesh

    from perfmodel_kernels import comm, megakernel, vmem

    t0 = time.perf_counter()
    eqns = megakernel.kernel_equations(dspec, cfg)
    t1 = time.perf_counter()
    call = megakernel.build_call(dspec, cfg, vmem_limit_bytes=cfg.target.vmem_bytes)
    tpu = AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    mesh = AbstractMesh((tp,), (comm.AXIS,), (AxisType.Auto,), abstract_device=tpu)
    # one pallas_call per device: every argument and result gets a leading device axis
    step = jax.shard_map(call, mesh=mesh, in_specs=P(comm.AXIS), out_specs=P(comm.AXIS),
                         check_vma=False)
    args = [jax.ShapeDtypeStruct((tp * s.shape[0],) + s.shape[1:], s.dtype)
            for s in megakernel.call_args(dspec, cfg)]
    with use_abstract_mesh(mesh):
        exported = export.export(jax.jit(step), platforms=["tpu"])(*args)
    exported.mlir_module()
    return eqns, t1 - t0, time.perf_counter() - t1, exported


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-k3")
    ap.add_argument("--tp", type=int, default=32)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=1, help="verify rows per sequence (at most 8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--expert-format", help="routed-expert format (default: the preset's)")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "kernel_compile.json"))
    a = ap.parse_args(argv)

    import jax

    from perfmodel_kernels import layout, shard, tuned, vmem
    from perfmodel.spec.arch import derive
    from perfmodel.util.files import write_atomic

    full = derive(a.preset, **({"formats": {"routed_expert": a.expert_format}}
                               if a.expert_format else {}))
    dspec = shard.device_spec(full, a.tp, a.ep)
    t = tuned.tuned(a.preset, a.tp)
    cfg = layout.KernelConfig(batch=a.batch, max_context=a.context, depth=t.depth,
                              expert_slots=t.expert_slots, cache_block=256, rows=a.rows,
                              bank_rows=t.bank_rows, wire=t.wire, host_devices=8)
    runs, load = [], []
    for _ in range(a.repeats):
        load.append(os.getloadavg()[0])
        eqns, trace_s, export_s, exported = export_once(dspec, cfg, a.tp)
        runs.append((trace_s, export_s))
    text = exported.mlir_module()
    med = lambda k: round(statistics.median(r[k] for r in runs), 2)
    budget = vmem.check_vmem(dspec, cfg)
    largest = max(budget.buffers, key=lambda b: b.bytes)
    res = {"preset": a.preset, "routed_expert": full.formats["routed_expert"].name,
           "tp": a.tp, "ep": a.ep, "batch": a.batch, "rows": a.rows, "context": a.context,
           "bank_bytes": cfg.bank_bytes, "depth": cfg.depth, "expert_slots": cfg.expert_slots,
           "layers": len(full.layers), "kernel_jaxpr_equations": eqns, "repeats": a.repeats,
           "trace_s_median": med(0), "export_s_median": med(1),
           "total_s_median": round(statistics.median(x + y for x, y in runs), 2),
           "total_s_each": [round(x + y, 2) for x, y in runs],
           "load_average_1min": [round(v, 2) for v in load],
           "cpus": os.cpu_count(), "mlir_chars": len(text),
           "module_bytes": len(exported.mlir_module_serialized),
           "tpu_custom_calls": text.count("tpu_custom_call"),
           "vmem_bytes": budget.total_bytes, "vmem_limit_bytes": budget.limit_bytes,
           "vmem_largest": f"{largest.name} {largest.bytes:,} B",
           "machine": platform.processor() or platform.machine(), "jax": jax.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python " + " ".join(sys.argv)}
    for k, v in res.items():
        print(f"{k:>24}: {v}")
    write_atomic(Path(a.out), json.dumps(res, indent=1) + "\n", parents=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
