"""Predicted vs measured, per layer and per step, from profiler traces (`perfmodel validate`).

A host run of the pure-JAX reference is predicted with the multi-kernel engine on one CPU
device (docs/validation.md):
- one compiled XLA program: no kernel launches (`launch_overhead_s = 0`); the program pays its
  call and its XLA:CPU thunks (`components.host_program_time`, thunks per layer phase counted in
  the reference's compiled HLO by hostbench);
- op by op: every op also pays the measured JAX dispatch overhead (`launch_overhead_s`).
The structure hostbench counted in a model's own compiled programs (components suffixed
`__<model>`) replaces the probe model's for that model (`own_structure`).
A GPU run (a trace of a GPU's kernels) is predicted on the GPU's hardware file as it is, in both
modes: each kernel of a compiled program is a launch too (a CUDA-graph node); the GPU's idle
time and the JAX dispatch around it are not modelled (`traced_busy_s`, `idle_share` report them).
Errors are (predicted - measured) / measured. The step's measured time is the untraced wall
time of the capture (`host_step_s`) when the capture recorded it, else the traced step window;
per-layer times come from the trace (`perfmodel.validate.traces`). MAPE is over the layers.

`matched_efficiency`: optionally replaces `efficiency.hbm` by the hostbench microbenchmark of a
decode-shaped matmul at the run's batch (weight dtype of the capture) over the streaming rate:
still only microbenchmarks, never the decode runs, feed the model.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from perfmodel.util import schema
from perfmodel.util.checks import INT, STR, Num, Req
from perfmodel.util.errors import SpecError, in_file, require
from perfmodel.util.files import check_path, find_files, host_hardware_file
from perfmodel.validate.traces import TraceSummary, parse_trace

DEFAULT_HOST_HARDWARE = str(host_hardware_file())  # where `perfmodel hostbench` writes by default


@dataclass
class LayerCompare:
    layer: int
    kind: str
    predicted_s: float
    measured_s: float
    measured_min_s: float
    measured_max_s: float
    predicted_ops: int       # ops of the model's op graph in this layer
    measured_ops: float      # traced op events per step (XLA thunks / kernels)

    @property
    def rel_error(self) -> float:
        return rel_error(self.predicted_s, self.measured_s)


@dataclass
class Comparison:
    run: str
    model: str
    hardware: str
    mode: str
    batch: int
    context: int
    predicted_step_s: float
    measured_step_s: float
    traced_step_s: float
    unattributed_share: float
    layers: list[LayerCompare]
    hbm_efficiency: float
    traced_busy_s: float = 0.0      # median per traced step: time with an op running
    idle_share: float = 0.0         # of the traced steps: the device waiting on the host (a GPU's)
    platform: str = "cpu"           # whose ops the trace holds (TraceSummary.platform)

    @property
    def step_error(self) -> float:
        return rel_error(self.predicted_step_s, self.measured_step_s)

    @property
    def layer_mape(self) -> float:
        errs = [abs(r.rel_error) for r in self.layers if r.measured_s > 0]
        return statistics.fmean(errs) if errs else float("nan")

    def json(self) -> dict:
        d = {k: getattr(self, k) for k in ("run", "model", "hardware", "mode", "batch", "context",
                                           "predicted_step_s", "measured_step_s", "traced_step_s",
                                           "step_error", "layer_mape", "unattributed_share",
                                           "hbm_efficiency", "traced_busy_s", "idle_share", "platform")}
        d["layers"] = [{**dataclasses.asdict(r), "rel_error": r.rel_error} for r in self.layers]
        return d


def rel_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / |measured| (a gap may be negative)."""
    return (predicted - measured) / abs(measured) if measured else float("nan")


def host_hardware(hw, mode: str):
    """The hardware as one compiled program sees it (no launches) or op by op (as measured)."""
    if mode == "compiled":
        return hw.replace(launch_overhead_s=0.0)
    if mode == "op_by_op":
        return hw
    raise SpecError("mode", mode, "compiled or op_by_op")


def own_structure(hw, model: str):
    """The hardware with the structure counted in `model`'s own compiled programs: hostbench
    writes the components it counted in another model's programs with the suffix `__<model>`
    (perfmodel_jax.hostbench.model_suffix); they replace the unsuffixed ones (the probe model's)
    for that model, and every suffixed one is dropped."""
    suffix = "__" + model.replace("-", "_")
    c = {k: v for k, v in hw.components.items() if "__" not in k}
    c |= {k[:-len(suffix)]: v for k, v in hw.components.items() if k.endswith(suffix)}
    return dataclasses.replace(hw, components=c)


_STAT = {"min": Req(Num(0)), "median": Req(Num(0)), "max": Req(Num(0))}
_STATS = {"*": _STAT}
_COUNTS = {"model": (STR,), "batch": (INT,), "context": (INT,), "*": Num(0)}
# the JSON `perfmodel hostbench` writes beside its hardware file (perfmodel_jax.hostbench.HostBench.json)
HOSTBENCH_JSON = {
    "cpu": (STR,), "date": (STR,), "repeats": (INT,), "devices": (INT,), "llc_bytes": Num(0), "ram_bytes": Num(0),
    "read_bandwidth_bytes_per_s": Req(_STATS), "matvec_bandwidth_bytes_per_s": Req(_STATS),
    **dict.fromkeys(("copy_bandwidth_bytes_per_s", "matmul_flops_per_s", "decode_matmul_flops_per_s", "thunk_chain_s",
                     "dispatch_s_by_args", "expert_loop_s_per_expert", "convert_bf16_f32_s", "argmax_f32_s",
                     "dot_chain_s_per_dot", "absorbed_kv_b_s", "temp_pages_s", "stack_copy_s"), _STATS),
    "dispatch_s": _STAT, "op_overhead_s": _STAT, "reference_thunks": _COUNTS, "temp_per_cache_byte": _COUNTS,
    "stack_copies": _COUNTS, "model_memory": {"*": {"temp_per_cache_byte": _COUNTS, "stack_copies": _COUNTS}},
    "page_bytes": Num(0), "flops_efficiency": Num(0), "load_average_1min": Num(0, null=True)}


def with_prefill_structure(hw, structure: dict):
    """The hardware with a prefill program's own counted structure (perfmodel_jax.capture.
    prefill_structure: its thunks per phase, loops expanded, and its loops' bytes) in place of the
    decode step's; the decode step's cache copies and temporaries per cache byte do not apply to
    it and are set to 0 (a prefill writes each cache once; its temporaries are not counted)."""
    c = {k: v for k, v in hw.components.items() if not k.startswith(("host_thunks_", "host_loop_bytes_"))}
    c |= {k: 0.0 for k in c if k.startswith(("host_stack_copies_", "host_temp_per_cache_byte"))}
    return dataclasses.replace(hw, components=c | {k: float(v) for k, v in structure.items()})


def matched_hbm_efficiency(hw_path: str, dtype: str, batch: int) -> float:
    """Decode-matmul bandwidth at `batch` rows / streaming bandwidth, from hostbench's JSON."""
    jpath = Path(hw_path).with_suffix(".json")
    if not jpath.exists():
        raise SpecError("--matched-efficiency", str(jpath), "needs the hostbench JSON beside the "
                        "hardware file (run `perfmodel hostbench`)")
    data = schema.load(jpath, HOSTBENCH_JSON, "--matched-efficiency", fmt="json")
    with in_file(jpath):
        key = {"bfloat16": "bf16"}.get(dtype, dtype)
        curve = {}
        for k, v in data["matvec_bandwidth_bytes_per_s"].items():
            kind, _, rows = k.partition("/")
            require(rows.isdigit() and int(rows) > 0, f"matvec_bandwidth_bytes_per_s.{k}", k, "keys are <dtype>/<rows>")
            if kind == key:
                curve[int(rows)] = v["median"]
        read = data["read_bandwidth_bytes_per_s"]
        require(all(k.isdigit() for k in read), "read_bandwidth_bytes_per_s", sorted(read), "keys are sizes in bytes")
        require(curve, "matvec_bandwidth_bytes_per_s", sorted(data["matvec_bandwidth_bytes_per_s"]),
                f"no {key} entries")
        require(read, "read_bandwidth_bytes_per_s", read, "no entries")
        stream = read[max(read, key=int)]["median"]
        require(stream > 0, "read_bandwidth_bytes_per_s", stream, "the streaming bandwidth must be > 0")
        rows = min(curve, key=lambda r: (abs(r - batch), r))  # nearest measured batch
        eff = curve[rows] / stream
        require(eff > 0, f"matvec_bandwidth_bytes_per_s.{key}/{rows}", curve[rows], "must be > 0")
    return min(1.0, eff)


def compare(t: TraceSummary, model=None, hardware: str = DEFAULT_HOST_HARDWARE,
            batch: int | None = None, context: int | None = None, mode: str | None = None,
            matched_efficiency: bool = False) -> Comparison:
    """Predict a traced run (its capture.json supplies what the arguments leave out): a host
    run (compiled / op_by_op, multi-kernel engine) or a megakernel run (one device)."""
    from perfmodel.spec.deployment import Deployment
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.spec.loaders import load_model
    from perfmodel.step.predict import predict
    meta = t.meta
    model = model or meta.get("model")
    batch = batch or meta.get("batch")
    context = context if context is not None else meta.get("context")
    mode = mode or meta.get("mode")
    for name, v in (("--model", model), ("--batch", batch), ("--context", context), ("--mode", mode)):
        if v is None:
            raise SpecError(name, None, f"{t.path} has no capture.json: give {name}")
    spec = load_model(model)
    if hardware == DEFAULT_HOST_HARDWARE and not Path(hardware).exists():
        raise SpecError("--hardware", hardware, "no hostbench file here yet: run `perfmodel hostbench` "
                        "or give --hardware")
    hw = own_structure(load_hardware(hardware), spec.name)
    if matched_efficiency:
        hw = hw.with_efficiency(hbm=matched_hbm_efficiency(hardware, meta.get("weights_dtype", "f32"),
                                                           batch))
    if mode == "prefill":  # the reference's prefill of whole prompts, on its own program's structure
        from perfmodel.step.prefill import prefill_prediction
        require(meta.get("prompt"), "--trace", t.path, "a prefill run's capture.json needs its prompt")
        hw = with_prefill_structure(host_hardware(hw, "compiled"), meta.get("structure", {}))
        d = Deployment(devices=1, tp=1, engine="multikernel")
        return against(t, spec, hw, prefill_prediction(spec, hw, d, meta["prompt"], batch), mode)
    if mode == "megakernel":  # a TPU trace of the megakernel on one device, default ring
        d = Deployment(devices=1, tp=1, engine="megakernel", batch=batch, context=context)
    else:  # a GPU launches every kernel of a compiled program too (a CUDA-graph node each)
        hw = hw if t.platform == "gpu" else host_hardware(hw, mode)
        d = Deployment(devices=1, tp=1, engine="multikernel", batch=batch, context=context)
    p = predict(spec, hw, d)
    return against(t, spec, hw, p, mode)


def against(t: TraceSummary, spec, hw, p, mode: str) -> Comparison:
    """Per-layer and step comparison of one trace with one prediction of it."""
    from perfmodel.graph.ops import build
    n = len(spec.layers)
    if t.n_layers not in (n, 0):
        raise SpecError("--model", spec.name, f"has {n} layers, the trace {t.n_layers}")
    graph_ops = np.bincount(build(spec, p.deployment).layer, minlength=n + 2)
    rows = []
    for r in p.layers:
        m = t.layer_s.get(r.layer)
        rows.append(LayerCompare(r.layer, r.kind, r.time_s, m.median if m else 0.0,
                                 m.min if m else 0.0, m.max if m else 0.0,
                                 int(graph_ops[r.layer]), t.layer_ops.get(r.layer, 0)))
    measured = t.host_step_s.median if t.host_step_s else t.step_s.median
    d = p.deployment
    return Comparison(Path(t.run_dir).name, spec.name, hw.name, mode, d.batch, d.context,
                      p.step_s, measured, t.step_s.median, t.unattributed_share, rows,
                      hw.efficiency.hbm, statistics.median(s.busy_s for s in t.steps), t.idle_share,
                      t.platform)


def run_dirs(trace: str | Path) -> list[Path]:
    """Every captured run under `trace` (directories holding capture.json), or `trace` itself."""
    p = check_path("--trace", trace)
    runs = [f.parent for f in find_files(p, "capture.json", "--trace")] if p.is_dir() else []
    return runs or [p]


def gaps(results: list[Comparison]) -> list[dict]:
    """Op-by-op minus one-program step time, measured and predicted, per (model, batch, context)."""
    by = {(c.model, c.batch, c.context, c.mode): c for c in results}
    out = []
    for (m, b, ctx, mode), c in sorted(by.items()):
        o = by.get((m, b, ctx, "op_by_op"))
        if mode != "compiled" or o is None:
            continue
        measured = o.measured_step_s - c.measured_step_s
        predicted = o.predicted_step_s - c.predicted_step_s
        out.append({"model": m, "batch": b, "context": ctx, "measured_gap_s": measured,
                    "predicted_gap_s": predicted, "gap_error": rel_error(predicted, measured)})
    return out


def summary(results: list[Comparison]) -> dict:
    """Median absolute step error, median absolute per-layer error, gap error, coverage."""
    def med(xs):
        xs = [x for x in xs if x == x]
        return statistics.median(xs) if xs else float("nan")
    layer_errs = [abs(r.rel_error) for c in results for r in c.layers if r.measured_s > 0]
    g = gaps(results)
    return {"runs": len(results),
            "median_abs_step_error": med([abs(c.step_error) for c in results]),
            "median_abs_layer_error": med(layer_errs),
            "mean_layer_mape": med([c.layer_mape for c in results]),
            "median_abs_gap_error": med([abs(x["gap_error"]) for x in g]),
            "max_unattributed_share": max((c.unattributed_share for c in results), default=0.0),
            "gaps": g}


def validate(trace: str | Path, model=None, hardware: str = DEFAULT_HOST_HARDWARE, batch=None,
             context=None, mode=None, matched_efficiency: bool = False,
             skip_first: int = 0) -> list[Comparison]:
    return [compare(parse_trace(r, skip_first=skip_first), model, hardware, batch, context, mode,
                    matched_efficiency) for r in run_dirs(trace)]


def _pct(x: float) -> str:
    return f"{x:+.1%}" if x == x else "n/a"
