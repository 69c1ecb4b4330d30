"""Lower the megakernel's full Kimi K3 per-device program for TPU7x on this machine (no TPU).

    python experiments/bench_kernel_compile.py [--tp 32] [--batch 4] [--context 1024]

Builds one device's shapes (`kernels.shard.device_spec`, TP over `--tp` devices, routed experts
in the preset's format (Kimi K3: MXFP4) or --expert-format), traces the kernel (its layer loop is traced once per kind) and
exports the step with `jax.export` for an abstract mesh of `--tp` TPU7x devices (one pallas_call
per device under shard_map, collectives as remote DMAs): every op must have a Pallas TPU
(Mosaic) lowering. Prints the trace size, the time of each phase and the size of
the exported module, and the VMEM budget (whole routed experts in bf16 per slot do not fit a
TensorCore's VMEM at this size: reported, not enforced here); writes
experiments/results/kernel_compile.json. Mosaic's own compilation
(layout passes, LLO) runs only on a TPU host and is not part of this figure.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-k3")
    ap.add_argument("--tp", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1, help="verify rows per sequence (at most 8)")
    ap.add_argument("--expert-format", help="routed-expert format (default: the preset's)")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "kernel_compile.json"))
    a = ap.parse_args(argv)

    import jax
    from jax import export
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, PartitionSpec as P
    from jax.sharding import use_abstract_mesh

    from kernels import comm, layout, megakernel, shard, vmem
    from perfmodel.spec.arch import derive

    t0 = time.perf_counter()
    full = derive(a.preset, **({"formats": {"routed_expert": a.expert_format}}
                               if a.expert_format else {}))
    dspec = shard.device_spec(full, a.tp)
    cfg = layout.KernelConfig(batch=a.batch, max_context=a.context, depth=a.depth,
                              expert_slots=a.slots, cache_block=256, rows=a.rows)
    eqns = megakernel.kernel_equations(dspec, cfg)
    t1 = time.perf_counter()
    call = megakernel.build_call(dspec, cfg, vmem_limit_bytes=64 << 20)
    tpu = AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    mesh = AbstractMesh((a.tp,), (comm.AXIS,), (AxisType.Auto,), abstract_device=tpu)
    # one pallas_call per device: every argument and result gets a leading device axis
    step = jax.shard_map(call, mesh=mesh, in_specs=P(comm.AXIS), out_specs=P(comm.AXIS),
                         check_vma=False)
    args = [jax.ShapeDtypeStruct((a.tp * s.shape[0],) + s.shape[1:], s.dtype)
            for s in megakernel.call_args(dspec, cfg)]
    with use_abstract_mesh(mesh):
        exported = export.export(jax.jit(step), platforms=["tpu"])(*args)
    text = exported.mlir_module()
    t2 = time.perf_counter()
    buffers = vmem.buffers(dspec, cfg, vmem.chip_info())  # reported, not enforced here
    largest = max(buffers, key=lambda b: b.bytes)
    res = {"preset": a.preset, "routed_expert": full.formats["routed_expert"].name, "tp": a.tp, "batch": a.batch, "rows": a.rows, "context": a.context,
           "layers": len(full.layers), "kernel_jaxpr_equations": eqns,
           "trace_s": round(t1 - t0, 2), "export_s": round(t2 - t1, 2),
           "total_s": round(t2 - t0, 2), "mlir_chars": len(text),
           "module_bytes": len(exported.mlir_module_serialized),
           "tpu_custom_calls": text.count("tpu_custom_call"),
           "vmem_bytes": sum(b.bytes for b in buffers),
           "vmem_capacity_bytes": vmem.chip_info().vmem_capacity_bytes,
           "vmem_largest": f"{largest.name} {largest.bytes:,} B",
           "machine": platform.processor() or platform.machine(), "jax": jax.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python " + " ".join(sys.argv)}
    for k, v in res.items():
        print(f"{k:>24}: {v}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
