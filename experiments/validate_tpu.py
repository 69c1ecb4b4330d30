"""TPU v5e validation: the megakernel's runs on the chip against the model's prediction of each.

    python experiments/validate_tpu.py [--results experiments/results/tpu_megakernel.json]
        [--hardware tpu-v5e] [--out experiments/results] [--quiet]

No TPU needed: it reads the results `python experiments/tpu_megakernel.py` wrote on a TPU v5e and
predicts every run on the `tpu-v5e` preset, whose components come from the chip's own
micro-benchmarks only (`perfmodel calibrate --microbench tpu_v5e_microbench.json`). Nothing is
fitted on these runs: they are held out.

- A megakernel run: its DMA plan rebuilt from the kernel (`perfmodel_kernels.plan.dma_plan`: the slice's
  spec from `perfmodel_kernels.specs.slice_spec`, the run's KernelConfig, the distinct experts each MoE
  layer fetched, the positions) and replayed by the schedule simulator
  (`perfmodel_kernels.plan.predicted_step`, one step a call, context = the largest position). Compared, on
  device time (the prediction less its call's host dispatch, `components.host_dispatch_s`): the
  step against the run's `step_s` (the slope of a call's wall time over the steps it runs) and
  against the trace's step window; each layer (0 embed, 1..n, n + 1 head) and each phase (embed,
  layer_XX/attention, layer_XX/ffn, head; a trace's nested scopes summed into theirs) against the
  trace, through `perfmodel.validate.host.against`, the comparison the host validation uses. The
  one-step call's wall time, dispatch included, is printed beside it without a tolerance.
- An XLA run (the pure-JAX reference as one XLA program; every weight in bf16, the routed experts
  dequantised): the multi-kernel engine (`perfmodel.predict`, engine multikernel) on the same
  slice with bf16 experts and batch, at its MLA cache's capacity as context (the reference reads
  the whole cache every step, masked); its device time against `step_s`.
- Per slice, format and batch with both: the megakernel's speed-up over XLA, predicted and measured.

Tolerances (exit status 1 when one is missed, 2 on a bad input): per-layer median |error| <= 5 %,
every layer and phase within 10 %, every megakernel step within 5 %, every XLA step within 10 %.
A run the model cannot predict is listed with the reason and counts as a miss. Writes
tpu_validation.json (comparisons, speed-ups, summary) and tpu_validation.csv (a row per step,
layer, phase and speed-up) under --out; the last line printed is the summary.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

import validation_report
from perfmodel.util import schema
from perfmodel.util.checks import COUNT, STR, ListOf, Num, Req, check_tree
from perfmodel.util.errors import SpecError, in_file, require

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"


def shown(path: Path) -> str:
    """A path as the results file records it: relative to the repository when inside it."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)
DEFAULT_RESULTS = RESULTS / "tpu_megakernel.json"
TOLERANCES = {"layer_median": 0.05, "layer_phase_max": 0.10, "step_max": 0.05, "xla_step_max": 0.10,
              "whatif_gain": 0.15}
KNOBS = ("depth", "expert_slots", "bank_rows")   # what the sweeps vary, one at a time

_SECONDS = Num(0, lo_open=True)
_PICKS = ListOf(ListOf(Num(0, integer=True)), 1)   # each step's distinct experts per MoE layer
RESULTS_FILE = {"machine": Req((STR,)), "chip": (STR,), "jax": (STR,), "libtpu": (STR, None), "python": (STR,),
                "date": Req((STR,)), "command": (STR,), "runs": Req(ListOf({"kind": Req((STR,)), "*": None})),
                "*": None}
_RUN = {"kind": Req((STR,)), "slice": Req((STR,)), "format": Req((STR,)), "batch": Req((COUNT,)), "*": None}
MEGAKERNEL_RUN = {**_RUN, "config": Req({"*": None}), "positions": Req(ListOf(Num(0, integer=True), 1)),
                  "distinct_experts": Req(ListOf(Num(0, integer=True))), "step_s": Req(_SECONDS),
                  "wall_step_s": _SECONDS, "trace": None, "plan_bytes": Num(0),
                  "distinct_experts_steps": _PICKS, "commit": (STR, None), "kernel_source": (STR, None)}
XLA_RUN = {**_RUN, "step_s": Req(_SECONDS), "wall_step_s": _SECONDS, "positions": ListOf(Num(0, integer=True), 1),
           "cache_tokens": (COUNT,), "distinct_experts": ListOf(Num(0, integer=True)),
           "distinct_experts_steps": _PICKS}
# the MLA cache capacity of the XLA runs recorded before their records named it (`cache_tokens`):
# tpu_megakernel.py's CONTEXT, 2048 since its first run
CACHE_TOKENS_BEFORE_RECORDED = 2048
TRACE = {"step_s": Req(_SECONDS), "layers_s": Req({"*": Num(0)}), "phases_s": Req({"*": Num(0)}),
         "distinct_experts_steps": _PICKS, "*": None}
TRACE_RUN = {**_RUN, "config": {"*": None}, "error": (STR,), "step_s": _SECONDS, "layers_s": {"*": Num(0)},
             "phases_s": {"*": Num(0)}, "distinct_experts_steps": _PICKS,
             "positions": ListOf(Num(0, integer=True), 1), "expert_decode": (STR, None)}


def load(path: Path) -> dict:
    """The results file, checked: its header, each megakernel, XLA and trace record (other kinds
    are kept and listed as not compared)."""
    data = schema.load(path, RESULTS_FILE, "--results", fmt="json")
    rules = {"megakernel": MEGAKERNEL_RUN, "xla": XLA_RUN, "trace": TRACE_RUN}
    with in_file(path):
        for i, r in enumerate(data["runs"]):
            if r["kind"] in rules:
                check_tree(r, rules[r["kind"]], f"runs[{i}]", 1)
            if r["kind"] == "megakernel" and r.get("trace") is not None:
                check_tree(r["trace"], TRACE, f"runs[{i}].trace", 2)
            if r["kind"] == "trace" and "error" not in r:
                for k in ("step_s", "layers_s", "phases_s"):
                    require(k in r, f"runs[{i}].{k}", None, "a trace record without `error` needs its times")
    return data


def label(r: dict) -> str:
    c = r.get("config") or {}
    extra = (f" depth {c['depth']} slots {c['expert_slots']}" if "depth" in c else "") + \
        (f" bank {c['bank_rows']}" if "bank_rows" in c else "")
    words = " words" if r.get("expert_decode") == "e2m1_words" else ""   # the mxfp4 word decode's runs
    kind = " (sweep)" if r.get("sweep") else " (trace alone)" if r.get("trace_only") else ""
    return f"{r['slice']} {r['format']}{words} b{r['batch']}{extra}{kind}"


TRACED = ("step_s", "layers_s", "phases_s", "sub_phases_s", "distinct_experts_steps")   # what a run takes of its trace


def attach_traces(runs: list[dict]) -> tuple[list[str], list[tuple[int, dict]]]:
    """Trace records (kind "trace") given to the first megakernel run of the same slice, format,
    batch, config and expert decode that has none of its own, one of the same commit (the same
    kernel) first. A trace with no run of its commit that records its own positions, decode and
    picks is a run of its own (`trace_run`); older ones go to a run of another commit.
    (notes on those not compared, (index, run) of the traces run on their own)."""
    notes, alone = [], []
    for i, t in enumerate(runs):
        if t["kind"] != "trace":
            continue
        if "error" in t:
            notes.append(f"trace of {label(t)}: {t['error']}")
            continue
        key = lambda r: (r["slice"], r["format"], r["batch"], r.get("config"))
        free = [r for r in runs if r["kind"] == "megakernel" and r.get("trace") is None and key(r) == key(t)
                and ("expert_decode" not in t or r.get("expert_decode") == t["expert_decode"])]
        run = next((r for r in free if r.get("commit") == t.get("commit")), None)
        if run is None and all(k in t for k in ("positions", "expert_decode", "distinct_experts_steps")):
            alone.append((i, trace_run(t)))
            continue
        run = run or (free[0] if free else None)
        if run is None:
            notes.append(f"trace of {label(t)}: no megakernel run of the same slice, format, batch and config")
            continue
        run["trace"] = {k: t[k] for k in TRACED if k in t}
    return notes, alone


def trace_run(t: dict) -> dict:
    """A trace record as a megakernel run of its own: its traced step the measured step (no
    wall clock), its steps' median picks the run's."""
    trace = {k: t[k] for k in TRACED if k in t}
    own = {k: v for k, v in t.items() if k not in TRACED}   # its step and picks are the trace's
    return {**own, "step_s": t["step_s"], "kind": "megakernel", "trace_only": True, "wall_step_s": None,
            "distinct_experts": traced_picks({"trace": trace}), "trace": trace}


# ---- the prediction of a run ---------------------------------------------------------------

def dispatch_s(hw, d) -> float:
    """The host dispatch a prediction's step carries (one call over its steps): the device-time
    prediction is the step less this (it shifts the whole timeline: the embedding layer holds it)."""
    from perfmodel.engine.terms import call_s
    return call_s(hw) / d.steps_per_call


def mean_over_steps(run: dict, step_s) -> float | None:
    """The mean of step_s(picks) over the steps a run's time per step spans, each with the
    distinct experts it picked (`distinct_experts_steps`, kept by speed runs since 2026-12-07;
    each distinct picks predicted once); None for a run that kept its last step's picks alone,
    predicted at those (one step's picks had set a batch-4 prediction up to 7.6 % apart)."""
    steps = run.get("distinct_experts_steps")
    if not steps:
        return None
    seen = {}
    for s in map(tuple, steps):
        if s not in seen:
            seen[s] = step_s(list(s))
    return statistics.mean(seen[tuple(s)] for s in steps)


def scope_of(layer: int, phase: str, n: int) -> str:
    """The kernel's scope of a model op: embed, layer_XX/attention, layer_XX/ffn (the rest of a layer: its
    FFN or MoE and their norm), head."""
    if layer == 0:
        return "embed"
    if layer == n + 1:
        return "head"
    return f"layer_{layer:02d}/{'attention' if phase == 'attention' else 'ffn'}"


def phase_times(g, tl, n: int) -> dict[str, float]:
    """Predicted seconds of each scope of one step: each run of its ops in program order the
    advance of the step's running end (as perfmodel.step.predict does per layer)."""
    keys = [scope_of(l, ph, n) for l, ph in zip(g.layer.tolist(), g.phase)]
    ends = np.maximum.accumulate(tl.end_s).tolist()
    out, prev = defaultdict(float), 0.0
    for i, k in enumerate(keys):
        if i + 1 == len(keys) or keys[i + 1] != k:
            out[k] += ends[i] - prev
            prev = ends[i]
    return dict(out)


# what the kernel's markers inside a phase hold, as the model's ops: name -> (the markers, summed:
# the ring's reader runs a bank's dots as it arrives, so the first projection's marker holds the
# others' dots of its banks, and the model's recurrence waits for the state the kernel waits for
# under `state_wait`; the model's ops they span, in program order; the layer kind). The MLA core's
# `tile_wait` (its cache tiles' waits) is nested in `core`, whose time holds it.
MARKED = {"projections": (("q_proj", "k_proj", "v_proj", "decay", "beta_proj", "gate_proj"),
                          ("q_proj", "k_proj", "v_proj", "decay_a", "decay_b", "beta_proj", "gate_proj"), "kda"),
          "recurrence": (("state_wait", "recurrence"), ("kda_recurrence",), "kda"),
          "o_proj": (("o_proj",), ("o_proj",), "kda"),
          "core": (("core",), ("mla_attention",), "mla"),
          "router": (("router",), ("router", "top_k"), "moe"),
          "experts": (("experts",), ("latent_down", "routed_experts", "latent_up"), "moe"),
          "shared": (("shared",), ("shared_gate_up", "shared_down"), "moe")}


def marker_times(g, tl, n: int) -> dict[str, float]:
    """Predicted seconds of each `MARKED` group's ops as `<phase scope>/<group>`: the advance of
    the step's running end over them, their waits and their work (a marker spans its dots' waits
    for their weights and the dots)."""
    ends = np.maximum.accumulate(tl.end_s).tolist()
    of_op = {op: group for group, (_, ops, _) in MARKED.items() for op in ops}
    spans: dict[str, list[int]] = {}
    for i, (layer, phase, name) in enumerate(zip(g.layer.tolist(), g.phase, g.name)):
        group = of_op.get(name)
        if group and i and MARKED[group][2] in g.layer_kind.get(layer, "").split("+"):
            spans.setdefault(f"{scope_of(layer, phase, n)}/{group}", []).append(i)
    return {k: ends[max(ix)] - ends[min(ix) - 1] for k, ix in spans.items()}


def measured_markers(sub_phases_s: dict[str, float]) -> dict[str, float]:
    """A trace's in-kernel markers summed into their `MARKED` groups, `<phase scope>/<group>`."""
    group_of = {m: group for group, (markers, _, _) in MARKED.items() for m in markers}
    out: dict[str, float] = defaultdict(float)
    for k, v in sub_phases_s.items():
        scope, _, marker = k.rpartition("/")
        if marker in group_of:
            out[f"{scope}/{group_of[marker]}"] += v
    return dict(out)


def measured_phases(phases_s: dict[str, float]) -> dict[str, float]:
    """A trace's scopes summed into their top-level scope (a nested marker's time is shared with
    the one around it: the sum is the scope's time); moe named ffn, as the kernel names it."""
    from perfmodel.validate.traces import scope_of as trace_scope
    out = defaultdict(float)
    for k, v in phases_s.items():
        s = trace_scope(k)
        if s is None:
            continue
        out[s[0] if s[1] is None else f"layer_{s[1]:02d}/{'ffn' if s[2] == 'moe' else s[2]}"] += v
    return dict(out)


def trace_summary(run: dict, n: int, source: str):
    """The run's trace (or, untraced, its step alone) as the host validation's TraceSummary: the
    untraced step (step_s) as `host_step_s`, the traced window as `step_s`."""
    from perfmodel.validate.traces import Spread, Step, TraceSummary, layer_index
    from perfmodel.validate.traces import scope_of as trace_scope
    t = run.get("trace") or {}
    phases = t.get("phases_s", {})
    layers = {}
    for k, v in t.get("layers_s", {}).items():
        if k.isdigit() or trace_scope(k):
            layers[int(k) if k.isdigit() else layer_index(k, n)] = v
    for name, idx in (("embed", 0), ("head", n + 1)):
        if idx not in layers and name in phases:
            layers[idx] = phases[name]
    window = t.get("step_s", math.nan)
    return TraceSummary(source, label(run), {}, n, [Step(0, window, window, 0.0, dict(phases))],
                        Spread.of([window]), {k: Spread.of([v]) for k, v in layers.items()}, {},
                        {k: Spread.of([v]) for k, v in phases.items()}, 0.0, Spread.of([run["step_s"]]),
                        platform="tpu")


def run_decode(run: dict, spec, cfg) -> str | None:
    """The routed-expert decode a run's kernel ran (None: none): recorded with the run since the
    mxfp4 word decode (commit 71cd019); every kernel before it decoded e2m1 codes in f32 ("e2m1")
    where this one decodes words."""
    if "expert_decode" in run:
        return run["expert_decode"]
    from perfmodel_kernels import layout
    current = layout.expert_layout(spec, cfg).decode_kind if spec.moe and spec.count(ffn="moe") else ""
    return ("e2m1" if current == "e2m1_words" else current) or None


def kernel_step(run: dict, hw_name: str, picks: list[int]):
    """(spec, config, its DMA plan at `picks`, the kernel's prediction with the host dispatch in,
    the expert decode) of a megakernel run at those distinct experts per MoE layer."""
    from perfmodel_kernels import plan as kplan
    from perfmodel_kernels.layout import KernelConfig
    from perfmodel_kernels.specs import slice_spec
    spec = slice_spec(run["slice"], run["format"])
    try:
        cfg = KernelConfig(**run["config"])
    except TypeError as e:
        raise SpecError("config", sorted(run["config"]), f"not the fields of KernelConfig: {e}") from None
    decode = run_decode(run, spec, cfg)
    the_plan = kplan.dma_plan(spec, cfg, picks, run["positions"])
    p = kplan.predicted_step(spec, cfg, the_plan, max(run["positions"]), hardware=hw_name, expert_decode=decode)
    return spec, cfg, the_plan, p, decode


def predict_megakernel(run: dict, hw_name: str):
    """(spec, hardware, device-time prediction at the last step's picks, its phases, the dispatch
    taken out, its marked ops (`marker_times`)) of a megakernel run; `megakernel_step_s` gives the
    step over all its steps."""
    from perfmodel_kernels import plan as kplan
    from perfmodel.graph.ops import build
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.step.predict import plan_model
    spec, cfg, the_plan, p, decode = kernel_step(run, hw_name, run["distinct_experts"])
    hw = load_hardware(hw_name)
    t0 = dispatch_s(hw, p.deployment)
    g = build(plan_model(spec, kplan.as_kernel_plan(spec, spec, cfg, the_plan, max(run["positions"]),
                                                    expert_decode=decode)), p.deployment)
    require(len(g) == len(p.timeline.end_s), "plan", label(run), "the op graph is not the prediction's")
    phases = phase_times(g, p.timeline, len(spec.layers))
    phases["embed"] = phases.get("embed", 0.0) - t0
    layers = [dataclasses.replace(r, time_s=r.time_s - t0) if r.layer == 0 else r for r in p.layers]
    return (spec, hw, dataclasses.replace(p, step_s=p.step_s - t0, layers=layers), phases, t0,
            marker_times(g, p.timeline, len(spec.layers)))


def megakernel_step_s(run: dict, hw_name: str, last_step_s: float, t0: float) -> float:
    """The device time a megakernel run's time per step is predicted at: the mean over its steps'
    picks (`mean_over_steps`, the dispatch t0 taken out), else `last_step_s` (the prediction at
    its last step's picks)."""
    mean = mean_over_steps(run, lambda picks: kernel_step(run, hw_name, picks)[3].step_s - t0)
    return last_step_s if mean is None else mean


def reference_context(run: dict) -> int:
    """The context an XLA run is predicted at: its MLA cache's capacity, which the reference's
    attention reads whole every step (masked past each sequence's position) and XLA copies
    whole around its update (`components.xla_cache_copy_time`), whatever the positions."""
    return run.get("cache_tokens", CACHE_TOKENS_BEFORE_RECORDED)


def predict_xla(run: dict, context: int, hw_name: str, prediction: bool = False):
    """(device time, wall time with one call a step) the multi-kernel engine predicts for an XLA
    run at `context` (`reference_context`): the slice with its routed experts in bf16 (the
    reference's dequantised weights), each MoE layer reading the distinct experts the run's steps
    picked where it recorded them (the reference reads only those; the mean over its steps,
    `mean_over_steps`, else at its last step's), else the analytic expectation. prediction: the
    prediction at the last step's picks itself and the call's dispatch instead."""
    import perfmodel
    from perfmodel_kernels.specs import slice_spec
    spec = slice_spec(run["slice"], "bf16")
    hw = perfmodel.load_hardware(hw_name)
    d = perfmodel.Deployment(devices=1, tp=1, engine="multikernel", batch=run["batch"], context=context)
    p = perfmodel.predict(spec, hw, d, experts=run.get("distinct_experts"))
    t0 = dispatch_s(hw, d)
    if prediction:
        return p.step_s - t0, p.step_s, p, t0
    mean = mean_over_steps(run, lambda s: perfmodel.predict(spec, hw, d, experts=s).step_s)
    step = p.step_s if mean is None else mean
    return step - t0, step


def compare_xla_layers(run: dict, runs: list[dict], hw_name: str, where: Path) -> dict:
    """A traced XLA run (kind "xla_trace") per layer: the device time its ops take in a step
    (`traces.xla_layer_times`: its committed trace, `where`/xla_<slice>_<format>_b<B>.xplane.pb.gz,
    read with the program's HLO compiled ahead of time for the chip by the same libtpu,
    `where`/xla_<slice>_b<B>.hlo.txt.gz: experiments/xla_reference_hlo.py) against the model's
    layers (the call's dispatch taken out of layer 0)."""
    import gzip
    from perfmodel.validate.traces import xla_layer_times
    trace = where / f"xla_{run['slice']}_{run['format']}_b{run['batch']}.xplane.pb.gz"
    hlo = where / f"xla_{run['slice']}_b{run['batch']}.hlo.txt.gz"
    for f in (trace, hlo):
        require(f.exists(), "file", shown(f), "not committed: the traced XLA run cannot be read per layer")
    xla = next((r for r in runs if r["kind"] == "xla" and _point(r) == _point(run)), None)
    require(xla is not None, "xla", None, f"no XLA run of {label(run)} to predict the trace at")
    _, _, p, t0 = predict_xla(run, reference_context(xla), hw_name, prediction=True)
    layers, per_call, steps = xla_layer_times(trace, gzip.decompress(hlo.read_bytes()).decode(), len(p.layers) - 2)
    rows = [{"layer": r.layer, "kind": r.kind, "predicted_s": r.time_s - (t0 if r.layer == 0 else 0.0),
             "traced_s": layers.get(r.layer, 0.0)} for r in p.layers]
    for r in rows:
        r["rel_error"] = rel(r["predicted_s"], r["traced_s"])
    return {"run": label(run), "slice": run["slice"], "format": run["format"], "batch": run["batch"],
            "steps": steps, "per_call_s": per_call, "layers": rows,
            "trace": shown(trace), "hlo": shown(hlo)}


def _point(r: dict) -> tuple:
    return r["slice"], r["format"], r["batch"]


# ---- comparisons -----------------------------------------------------------------------------

def rel(predicted, measured) -> float:
    from perfmodel.validate.host import rel_error
    return rel_error(predicted, measured) if measured else math.nan


def traced_picks(run: dict) -> list[int] | None:
    """The distinct experts per MoE layer the run's traced steps picked (their median, rounded),
    or None where the trace record predates keeping them (its steps are then predicted with the
    speed run's picks, which its other tokens need not share)."""
    steps = (run.get("trace") or {}).get("distinct_experts_steps")
    return [round(statistics.median(layer)) for layer in zip(*steps)] if steps else None


def compare_megakernel(run: dict, hw_name: str, source: str) -> dict:
    from perfmodel.validate.host import against
    spec, hw, p, phases, t0, markers = predict_megakernel(run, hw_name)
    n = len(spec.layers)
    summary = trace_summary(run, n, source)
    c = against(summary, spec, hw, p, "megakernel")
    c = dataclasses.replace(c, model=f"{spec.name} {run['format']}",
                            predicted_step_s=megakernel_step_s(run, hw_name, p.step_s, t0))
    picks, traced_step_s = traced_picks(run), p.step_s
    if picks is not None and picks != run["distinct_experts"]:   # the trace predicted with its own steps' picks
        _, _, pt, phases, _, markers = predict_megakernel(dict(run, distinct_experts=picks), hw_name)
        c = dataclasses.replace(c, layers=against(summary, spec, hw, pt, "megakernel").layers)
        traced_step_s = pt.step_s
    traced = run.get("trace") is not None
    measured = measured_phases(run["trace"]["phases_s"]) if traced else {}
    phase_rows = [{"scope": k, "predicted_s": phases.get(k, 0.0), "measured_s": v,
                   "rel_error": rel(phases.get(k, 0.0), v)} for k, v in measured.items()]
    inside = measured_markers(run["trace"].get("sub_phases_s", {})) if traced else {}   # reported, not judged
    marker_rows = [{"scope": k, "predicted_s": markers[k], "measured_s": v, "rel_error": rel(markers[k], v)}
                   for k, v in inside.items() if k in markers]
    wall = run.get("wall_step_s")
    from perfmodel_kernels.layout import KernelConfig
    decode = run_decode(run, spec, KernelConfig(**run["config"]))
    return {"run": label(run), "kind": "megakernel", "slice": run["slice"], "format": run["format"],
            "batch": run["batch"], "sweep": bool(run.get("sweep")), "trace_only": bool(run.get("trace_only")),
            "config": run["config"], "commit": run.get("commit"), "kernel_source": run.get("kernel_source"),
            "expert_decode": decode,
            "traced": traced, "comparison": c,
            "phases": sorted(phase_rows, key=lambda r: _scope_order(r["scope"], n)),
            "markers": sorted(marker_rows, key=lambda r: (_scope_order(r["scope"].rpartition("/")[0], n),
                                                          list(MARKED).index(r["scope"].rpartition("/")[2]))),
            "traced_predicted_s": traced_step_s, "traced_picks": picks,
            "each_step_picks": bool(run.get("distinct_experts_steps")),
            "traced_step_error": rel(traced_step_s, c.traced_step_s) if traced else math.nan,
            "dispatch_s": t0, "predicted_wall_s": c.predicted_step_s + t0, "measured_wall_s": wall,
            "wall_error": rel(c.predicted_step_s + t0, wall) if wall else math.nan}


def _scope_order(scope: str, n: int) -> tuple:
    return (0, "") if scope == "embed" else (n + 1, "") if scope == "head" else (int(scope[6:8]), scope)


def compare_xla(run: dict, hw_name: str) -> dict:
    context = reference_context(run)
    device, wall = predict_xla(run, context, hw_name)
    return {"run": label(run), "kind": "xla", "slice": run["slice"], "format": run["format"], "batch": run["batch"],
            "context": context, "predicted_step_s": device, "measured_step_s": run["step_s"],
            "step_error": rel(device, run["step_s"]), "predicted_wall_s": wall,
            "measured_wall_s": run.get("wall_step_s"),
            "wall_error": rel(wall, run["wall_step_s"]) if run.get("wall_step_s") else math.nan}


def speedups(mk: list[dict], xla: list[dict]) -> list[dict]:
    """XLA step / megakernel step, predicted and measured, per slice, format and batch (the latest
    megakernel run of each that is not a sweep point: the current kernel)."""
    latest = {}
    for m in mk:
        if not m["sweep"] and not m["trace_only"]:
            latest[(m["slice"], m["format"], m["batch"])] = m
    out = []
    for x in xla:
        m = latest.get((x["slice"], x["format"], x["batch"]))
        if m is None:
            continue
        c = m["comparison"]
        pred, meas = x["predicted_step_s"] / c.predicted_step_s, x["measured_step_s"] / c.measured_step_s
        out.append({"slice": x["slice"], "format": x["format"], "batch": x["batch"], "predicted": pred,
                    "measured": meas, "rel_error": rel(pred, meas)})
    return out


def whatif(mk: list[dict]) -> list[dict]:
    """The sweeps on the chip against the model: per slice, format, batch, expert decode, kernel
    source and knob (ring depth, expert slots, bank rows), each family of runs (sweep points and
    speed runs alike) that vary that knob alone, the other knobs and the kernel's code held
    (`others`, `kernel_source`: runs of other code differ by more than the knob), with a sweep
    point among them; each point's predicted and measured step (the median of its runs: of those
    that kept each step's expert picks where every point has one, the others predicted at one
    step's picks only); the optimum of each; the gain from the knob's smallest value to the
    optimum, predicted against measured.
    `chip_spread` is the median spread of a point's runs of one kernel code (separate calls,
    often separate VMs) over every point run more than once: a predicted optimum measured within
    it of the measured one is a tie the chip does not resolve (`best_found`), and a measured gain
    under it is not judged."""
    point = lambda m: (m["slice"], m["format"], m["batch"], m["expert_decode"], m["kernel_source"])
    runs = [m for m in mk if not m["trace_only"]]
    out, repeats = [], {}
    for knob in KNOBS:
        others = [k for k in KNOBS if k != knob]
        families = {}
        for m in runs:
            families.setdefault((*point(m), *(m["config"].get(k) for k in others)), []).append(m)
        for key, fam in families.items():
            pts = {}
            for m in fam:
                pts.setdefault(m["config"][knob], []).append(m)
            if len(pts) < 2 or not any(m["sweep"] for m in fam):
                continue
            xs = sorted(pts)
            steps = {x: [m["comparison"].measured_step_s for m in pts[x]] for x in xs}
            repeats.update({tuple(m["index"] for m in pts[x]): steps[x] for x in xs if len(pts[x]) > 1})
            if all(any(m["each_step_picks"] for m in pts[x]) for x in xs):
                pts = {x: [m for m in pts[x] if m["each_step_picks"]] for x in xs}
                steps = {x: [m["comparison"].measured_step_s for m in pts[x]] for x in xs}
            pred = {x: statistics.median(m["comparison"].predicted_step_s for m in pts[x]) for x in xs}
            meas = {x: statistics.median(steps[x]) for x in xs}
            best_p, best_m = min(xs, key=pred.get), min(xs, key=meas.get)
            gain_p, gain_m = pred[xs[0]] - pred[best_p], meas[xs[0]] - meas[best_m]
            out.append({"slice": key[0], "format": key[1], "batch": key[2], "expert_decode": key[3],
                        "kernel_source": key[4], "commits": sorted({m["commit"] for x in xs for m in pts[x]} - {None}),
                        "knob": knob, "others": dict(zip(others, key[5:])), "values": xs,
                        "predicted_s": [pred[x] for x in xs], "measured_s": [meas[x] for x in xs],
                        "predicted_best": best_p, "measured_best": best_m,
                        "measured_at_predicted_best": meas[best_p] / meas[best_m] - 1,
                        "predicted_gain_s": gain_p, "measured_gain_s": gain_m,
                        "gain_error": rel(gain_p, gain_m) if gain_m > 0 else math.nan,
                        "runs_per_point": {x: len(pts[x]) for x in xs},
                        "measured_range_s": [[min(steps[x]), max(steps[x])] for x in xs],
                        "repeat_spread": max(max(v) / min(v) - 1 for v in steps.values())})
    spread = statistics.median(max(v) / min(v) - 1 for v in repeats.values()) if repeats else 0.0
    for w in out:
        best = min(w["measured_s"])
        w |= {"chip_spread": spread, "best_found": w["measured_at_predicted_best"] <= spread,
              "gain_judged": w["measured_gain_s"] > spread * best}
    return out


def best_words(w: dict) -> str:
    """A sweep's measured optimum against the predicted one: "" (the same), " (a tie)" within the
    chip's spread, else " (missed)"."""
    return "" if w["predicted_best"] == w["measured_best"] else " (a tie)" if w["best_found"] else " (missed)"


def gain_words(w: dict) -> str:
    """A sweep's gain error, or why it is not judged."""
    return f"{w['gain_error']:+.1%}" if w["gain_judged"] else "under the spread, not judged"


def sweep_name(w: dict) -> str:
    """A sweep in words: "depth at batch 1 (k3-tp32-core mxfp4 words; expert_slots 2, bank_rows
    32768; run at 6578c2f, a2402e8)", the commits its runs ran at naming the kernel's code."""
    words = " words" if w["expert_decode"] == "e2m1_words" else ""
    held = ", ".join(f"{k} {v}" for k, v in w["others"].items())
    at = f"; run at {', '.join(w['commits'])}" if w["commits"] else ""
    return f"{w['knob']} at batch {w['batch']} ({w['slice']} {w['format']}{words}; {held}{at})"


def summarise(mk: list[dict], xla: list[dict], failed: list[dict], sweeps: list[dict] = ()) -> dict:
    """The figures the tolerances are on, and which are missed."""
    layer = [abs(r.rel_error) for m in mk if m["traced"] for r in m["comparison"].layers if r.measured_s > 0]
    phase = [abs(r["rel_error"]) for m in mk for r in m["phases"] if r["measured_s"] > 0]
    step = [abs(m["comparison"].step_error) for m in mk]
    traced_step = [abs(m["traced_step_error"]) for m in mk if m["traced"]]
    xstep = [abs(x["step_error"]) for x in xla]
    med = lambda xs: statistics.median(xs) if xs else math.nan
    top = lambda xs: max(xs) if xs else math.nan
    s = {"runs": len(mk) + len(xla), "megakernel_runs": len(mk), "traced_runs": sum(m["traced"] for m in mk),
         "xla_runs": len(xla), "not_compared": len(failed),
         "median_abs_layer_error": med(layer), "max_abs_layer_error": top(layer),
         "max_abs_phase_error": top(phase), "median_abs_step_error": med(step), "max_abs_step_error": top(step),
         "max_abs_traced_step_error": top(traced_step), "median_abs_xla_error": med(xstep),
         "max_abs_xla_error": top(xstep), "tolerances": TOLERANCES}
    missed = []
    if layer and s["median_abs_layer_error"] > TOLERANCES["layer_median"]:
        missed.append(f"per-layer median {s['median_abs_layer_error']:.1%} > {TOLERANCES['layer_median']:.0%}")
    worst = top(layer + phase)
    if worst == worst and worst > TOLERANCES["layer_phase_max"]:
        missed.append(f"a layer or phase at {worst:.1%} > {TOLERANCES['layer_phase_max']:.0%}")
    worst = top(step + traced_step)
    if worst == worst and worst > TOLERANCES["step_max"]:
        missed.append(f"a step at {worst:.1%} > {TOLERANCES['step_max']:.0%}")
    if xstep and s["max_abs_xla_error"] > TOLERANCES["xla_step_max"]:
        missed.append(f"an XLA step at {s['max_abs_xla_error']:.1%} > {TOLERANCES['xla_step_max']:.0%}")
    for w in sweeps:
        what = sweep_name(w)
        if not w["best_found"]:
            missed.append(f"the best {what} predicted {w['predicted_best']}, measured {w['measured_best']}")
        if w["gain_judged"] and abs(w["gain_error"]) > TOLERANCES["whatif_gain"]:
            missed.append(f"the gain of {what} off by {w['gain_error']:+.1%}")
    if failed:
        missed.append(f"{len(failed)} run(s) not predicted")
    s["missed"] = missed
    return s


def summary_line(s: dict) -> str:
    pct = lambda x: f"{x:.1%}" if x == x else "n/a"
    return (f"validate_tpu: {s['runs']} runs ({s['megakernel_runs']} megakernel, {s['traced_runs']} traced; "
            f"{s['xla_runs']} XLA): per-layer median |error| {pct(s['median_abs_layer_error'])}, max "
            f"{pct(s['max_abs_layer_error'])} (phases max {pct(s['max_abs_phase_error'])}); step median |error| "
            f"{pct(s['median_abs_step_error'])}, max {pct(s['max_abs_step_error'])}; XLA median |error| "
            f"{pct(s['median_abs_xla_error'])}; "
            + ("tolerances met" if not s["missed"] else "MISSED: " + "; ".join(s["missed"])))


# ---- output ----------------------------------------------------------------------------------

def print_run(m: dict) -> None:
    from perfmodel.step.report import table
    c = m["comparison"]
    us = lambda x: x * 1e6 if x == x and x is not None else "-"
    pct = lambda x: f"{x:+.1%}" if x == x else "-"
    print(f"\n{m['run']}: context {c.context}, device time (host dispatch {m['dispatch_s'] * 1e6:.0f} us "
          "taken out of the prediction)" + (f"; the trace predicted with its own steps' expert picks "
                                            f"{m['traced_picks']}" if m.get("traced_picks") else ""))
    rows = [["step (step_s)", us(c.predicted_step_s), us(c.measured_step_s), pct(c.step_error)]]
    if m["traced"]:
        rows.append(["step (trace)", us(m["traced_predicted_s"]), us(c.traced_step_s), pct(m["traced_step_error"])])
        rows += [[f"layer {r.layer} {r.kind}", us(r.predicted_s), us(r.measured_s), pct(r.rel_error)]
                 for r in c.layers if r.measured_s > 0]
        rows += [[r["scope"], us(r["predicted_s"]), us(r["measured_s"]), pct(r["rel_error"])] for r in m["phases"]]
        rows += [[f"{r['scope']} (not judged)", us(r["predicted_s"]), us(r["measured_s"]), pct(r["rel_error"])]
                 for r in m["markers"]]
    rows.append(["one-step call, wall", us(m["predicted_wall_s"]), us(m["measured_wall_s"] or math.nan),
                 pct(m["wall_error"])])
    print(table(["", "predicted us", "measured us", "error"], rows))


def csv_rows(mk: list[dict], xla: list[dict], ups: list[dict]) -> list[list]:
    """validation_report's columns: a run's step and layers (its rows_of), then its traced step,
    phases and wall time; an XLA run's step; the speed-ups (layer column: what the row is)."""
    rows = []
    for m in mk:
        c = m["comparison"]
        base = [m["run"], c.model, "megakernel", c.batch, c.context]
        step, *layers = validation_report.rows_of(m["run"], [c])
        rows.append(step)
        if m["traced"]:
            rows.append(base + ["step_traced", "step", m["traced_predicted_s"], c.traced_step_s, "", "",
                                m["traced_step_error"], "", "", "", c.unattributed_share])
            rows += [r for r, lc in zip(layers, c.layers) if lc.measured_s > 0]
            rows += [base + [r["scope"], "phase", r["predicted_s"], r["measured_s"], "", "", r["rel_error"],
                             "", "", "", ""] for r in m["phases"]]
        rows.append(base + ["wall", "one-step call", m["predicted_wall_s"], m["measured_wall_s"] or "", "", "",
                            m["wall_error"], "", "", "", ""])
    for x in xla:
        base = [x["run"], f"{x['slice']} {x['format']}", "xla", x["batch"], x["context"]]
        rows.append(base + ["step", "step", x["predicted_step_s"], x["measured_step_s"], "", "", x["step_error"],
                            "", "", "", ""])
        rows.append(base + ["wall", "one-step call", x["predicted_wall_s"], x["measured_wall_s"] or "", "", "",
                            x["wall_error"], "", "", "", ""])
    for u in ups:
        rows.append([f"{u['slice']} {u['format']} b{u['batch']}", f"{u['slice']} {u['format']}", "speedup",
                     u["batch"], "", "speedup", "xla_over_megakernel", u["predicted"], u["measured"], "", "",
                     u["rel_error"], "", "", "", ""])
    return [[("" if isinstance(v, float) and v != v else v) for v in r] for r in rows]


def _json(v):
    """NaN as null (strict JSON)."""
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, dict):
        return {k: _json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json(x) for x in v]
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python experiments/validate_tpu.py", description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(DEFAULT_RESULTS), help="tpu_megakernel.py's results file")
    ap.add_argument("--hardware", default="tpu-v5e", help="hardware preset or .toml to predict on")
    ap.add_argument("--out", default=str(RESULTS), help="directory for tpu_validation.json and .csv")
    ap.add_argument("--quiet", action="store_true", help="only the summary line")
    a = ap.parse_args(argv)
    path = Path(a.results)
    try:
        from perfmodel.spec.hardware import load_hardware
        load_hardware(a.hardware)
        data = load(path)
    except SpecError as e:
        hint = " (run python experiments/tpu_megakernel.py on a TPU first)" if not path.exists() else ""
        print(f"validate_tpu: {e}{hint}", file=sys.stderr)
        return 2
    runs = data["runs"]
    notes, alone = attach_traces(runs)
    mk, xla, failed = [], [], []
    for i, r in [*enumerate(runs), *alone]:
        if r["kind"] not in ("megakernel", "xla"):
            continue
        try:
            with in_file(f"{shown(path)}: runs[{i}]"):
                if r["kind"] == "megakernel":
                    mk.append({**compare_megakernel(r, a.hardware, str(path)), "index": i})
                else:
                    xla.append({**compare_xla(r, a.hardware), "index": i})
        except SpecError as e:
            failed.append({"run": label(r), "kind": r["kind"], "why": str(e)})
    if not mk and not xla and not failed:
        print(f"validate_tpu: --results {path}: no megakernel or XLA run in it", file=sys.stderr)
        return 2
    layers = []
    for i, r in enumerate(runs):
        if r["kind"] == "xla_trace":
            try:
                with in_file(f"{shown(path)}: runs[{i}]"):
                    layers.append(compare_xla_layers(r, runs, a.hardware,
                                                     path.parent / f"tpu_{data.get('chip', 'v5e')}"))
            except SpecError as e:
                notes.append(f"{label(r)} (xla_trace): {e}")
    ups = speedups(mk, xla)
    sweeps = whatif(mk)
    s = summarise(mk, xla, failed, sweeps)
    if not a.quiet:
        for m in mk:
            print_run(m)
        from perfmodel.step.report import table
        if xla:
            print("\nXLA reference steps (multi-kernel engine), device time")
            print(table(["run", "context", "predicted us", "measured us", "error"],
                        [[x["run"], x["context"], x["predicted_step_s"] * 1e6, x["measured_step_s"] * 1e6,
                          f"{x['step_error']:+.1%}"] for x in xla]))
        for x in layers:
            print(f"\nXLA reference traced per layer, {x['run']} (device time of its ops in a step; "
                  f"{x['per_call_s'] * 1e6:.0f} us a call outside the step loop; {x['steps']} one-step calls)")
            print(table(["layer", "kind", "predicted us", "traced us", "error"],
                        [[r["layer"], r["kind"], r["predicted_s"] * 1e6, r["traced_s"] * 1e6,
                          f"{r['rel_error']:+.1%}"] for r in x["layers"]]))
        if ups:
            print("\nspeed-up of the megakernel over XLA (XLA step / megakernel step)")
            print(table(["slice", "format", "batch", "predicted", "measured", "error"],
                        [[u["slice"], u["format"], u["batch"], f"{u['predicted']:.2f}x", f"{u['measured']:.2f}x",
                          f"{u['rel_error']:+.1%}"] for u in ups]))
        for w in sweeps:
            print(f"\nwhat-if on the chip: {sweep_name(w)}")
            print(table([w["knob"], "predicted us", "measured us", "error", "runs", "measured range us"],
                        [[x, p * 1e6, m * 1e6, f"{rel(p, m):+.1%}", w["runs_per_point"][x],
                          f"{lo * 1e6:.0f}-{hi * 1e6:.0f}"]
                         for x, p, m, (lo, hi) in zip(w["values"], w["predicted_s"], w["measured_s"],
                                                      w["measured_range_s"])]))
            print(f"this sweep's points' runs spread up to {w['repeat_spread']:.1%}; a point's runs "
                  f"spread {w['chip_spread']:.1%} (median over every point run more than once)")
            tie = "" if w["predicted_best"] == w["measured_best"] else \
                f" ({w['measured_at_predicted_best']:+.1%} at the predicted best: " + \
                ("a tie within the spread)" if w["best_found"] else "more than the spread)")
            gain = gain_words(w)
            print(f"best: predicted {w['predicted_best']}, measured {w['measured_best']}{tie}; gain from "
                  f"{w['values'][0]} to the best: predicted {w['predicted_gain_s'] * 1e6:.0f} us, measured "
                  f"{w['measured_gain_s'] * 1e6:.0f} us ({gain})")
        for n in notes:
            print(f"not compared: {n}")
        for f in failed:
            print(f"not predicted: {f['run']} ({f['kind']}): {f['why']}")
        kinds = sorted({r["kind"] for r in runs} - {"megakernel", "xla", "trace", "xla_trace"})
        if kinds:
            print(f"not compared (no prediction of them): records of kind {', '.join(kinds)}")
    out = Path(a.out)
    meta = {"machine": data["machine"], "chip": data.get("chip"), "jax": data.get("jax"), "libtpu": data.get("libtpu"),
            "date": data["date"], "measured_by": data.get("command"), "results": shown(path),
            "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *(argv if argv is not None
                                                                                  else sys.argv[1:])]),
            "hardware_file": a.hardware, "load_average_1min": None,
            "note": "nothing is fitted on these runs: the hardware preset's components come from the chip's "
                    "micro-benchmarks only; device time (host dispatch taken out of the predictions)"}
    document = {"summary": s, "runs": [{**{k: v for k, v in m.items() if k != "comparison"},
                                        "comparison": m["comparison"].json()} for m in mk],
                "xla": xla, "xla_layers": layers, "speedups": ups, "whatif": sweeps, "not_predicted": failed,
                "not_compared": notes}
    try:
        validation_report.write(out / "tpu_validation.csv", out / "tpu_validation.json", meta,
                                csv_rows(mk, xla, ups), _json(document))
    except SpecError as e:
        print(f"validate_tpu: {e}", file=sys.stderr)
        return 2
    if not a.quiet:
        print(f"\nwrote {out / 'tpu_validation.csv'} and {out / 'tpu_validation.json'}")
    print(summary_line(s))
    return 1 if s["missed"] else 0


if __name__ == "__main__":
    sys.exit(main())
