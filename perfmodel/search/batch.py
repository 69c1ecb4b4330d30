"""Evaluate a chunk of configurations that share a model and a chip: one result row each.

`evaluate` receives every configuration of a chunk at once (same model, same chip preset;
deployment and hardware overrides differ) and simulates the megakernel ones in batches that share
an op graph (perfmodel.engine.megakernel_sim.run_many). A configuration that does not fit is a filtered
row naming the constraint: `memory` (weights + caches exceed a device's HBM), `vmem` (prefetch
ring or expert buffers exceed the on-chip buffer) or `layout` (the parallel layout or
spec-decode settings cannot run), with the one-line reason.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from perfmodel.engine import megakernel, megakernel_sim
from perfmodel.engine.terms import CAUSES, op_weights
from perfmodel.graph import ops
from perfmodel.search.design import CONSTRAINTS, SERVE_TRAFFIC, SETTINGS, Chunk
from perfmodel.spec import arch, hardware, loaders
from perfmodel.spec.deployment import Deployment, SpecDecode, resident_bytes_per_device, validate
from perfmodel.step.predict import predict, summarise
from perfmodel.util import interrupts, limits
from perfmodel.util.errors import SpecError

MiB = 2**20
SERVE_REQUESTS = 500   # requests a serving configuration simulates unless it says
VMEM_FIELDS = ("prefetch_bytes", "expert_slots")  # the simulator's on-chip budget errors
BREAKDOWN = CAUSES + ("draft",)
# result columns and their types
RESULTS = {"status": str, "constraint": str, "reason": str, "step_s": float, "token_latency_s": float,
           "tokens_per_s": float, "tokens_per_s_per_chip": float, "chips": int, "bound": str,
           "hbm_utilisation": float, "resident_bytes_per_device": float,
           **{f"{c}_s": float for c in BREAKDOWN}, **{c: float for c in CONSTRAINTS}}
COLUMNS = {"point": int, **{k: kind for k, (kind, _, _) in SETTINGS.items()}, **RESULTS}  # a row, in order
OBJECTIVES = {"tokens_per_s": "max", "tokens_per_s_per_chip": "max", "step_s": "min", "token_latency_s": "min"}


def configure(chip: hardware.Hardware, s: dict) -> tuple[Deployment, hardware.Hardware]:
    """The Deployment and the chip (with any hardware overrides) of one configuration's settings."""
    spec = None
    if s.get("draft_rows"):
        if s.get("acceptance_length") is None and s.get("acceptance_prob") is None:
            raise SpecError("acceptance_length", None, "speculative decoding needs an acceptance")
        spec = SpecDecode(s["draft_rows"], s.get("acceptance_prob"), s.get("acceptance_length"), s["draft_cost"])
    pf = s.get("prefetch_mib")
    d = Deployment(devices=s["devices"], tp=s["tp"], engine=s["engine"], ep=s.get("ep"), batch=s["batch"],
                   context=s["context"], prefetch_bytes=None if pf is None else pf * MiB,
                   expert_slots=s.get("expert_slots"), spec=spec, routing_skew=s.get("routing_skew"),
                   routing_correlation=s.get("routing_correlation"), steps_per_call=s.get("steps_per_call") or 1)
    changes = {}
    if s.get("vmem_mib") is not None:
        changes["onchip_bytes"] = s["vmem_mib"] * MiB
    if s.get("hbm_gbps") is not None:
        changes["hbm_bandwidth_bytes_per_s"] = s["hbm_gbps"] * 1e9
    if s.get("link_latency_us") is not None:
        changes["link_latency_s"] = s["link_latency_us"] * 1e-6
    if s.get("dma_sharing") is not None:
        changes["dma_sharing"] = s["dma_sharing"]
    return d, _changed(chip, changes) if changes else chip


_CHIPS: dict[tuple, tuple[hardware.Hardware, hardware.Hardware]] = {}  # (id(chip), changes) -> (chip, changed)


def _changed(chip: hardware.Hardware, changes: dict) -> hardware.Hardware:
    """`chip.replace(**changes)`, one object per chip and changes in this process (Hardware is
    frozen; a sweep's points share a few on-chip sizes and bandwidths)."""
    key = (id(chip), tuple(changes.items()))
    if key not in _CHIPS:
        if len(_CHIPS) >= 4096:
            _CHIPS.clear()
        _CHIPS[key] = (chip, chip.replace(**changes))  # the chip kept alive: its id stays its own
    return _CHIPS[key][1]


def evaluate(model: arch.ModelSpec, chip: hardware.Hardware, settings: list[dict],
             constraints: dict | None = None) -> list[dict]:
    """Result columns (RESULTS) for each configuration; all share `model` and the `chip` preset.

    Megakernel configurations that share an op graph and the hardware terms of its timeline
    (differing in ring depth, expert slots, on-chip size or DMA mode) are simulated together
    (megakernel_sim.run_many on one set of arrays); the others one by one with `predict`.
    Serving configurations (a rate or a concurrency) are serving simulations (`serve_row`),
    filtered by the latency `constraints`."""
    megakernel_sim.compile_loops()  # many timelines: worth the compiler's 0.3 s start
    rows: list[dict | None] = [None] * len(settings)
    groups: dict[tuple, list] = {}
    top_k = model.moe.top_k if model.moe else 1
    for i, s in enumerate(settings):
        d = hw = None
        try:
            d, hw = configure(chip, s)
            if any(s.get(k) is not None for k in SERVE_TRAFFIC):
                rows[i] = serve_row(model, d, hw, s, constraints or {})
                continue
            if d.engine != "megakernel":
                rows[i] = _row(model, d, hw, predict(model, hw, d))
                continue
            validate(model, hw, d)
            g = ops.build(model, d)
            size = megakernel.sizing(g, hw, d, top_k)
            banks, slots, pieces = size.banks, size.slots, size.tiles_per_expert
        except SpecError as e:
            rows[i] = _filtered(model, d, hw, e)
            continue
        key = (id(g), s.get("hbm_gbps"), s.get("link_latency_us"), d.steps_per_call)  # the arrays' inputs
        groups.setdefault(key, [g, hw, []])[2].append((i, d, hw, banks, slots, pieces))
    for g, hw0, members in groups.values():
        try:
            a = megakernel.megakernel_arrays(g, hw0, megakernel.uniform_stream(g, float(megakernel.bank_bytes(g, hw0))),
                                             op_weights(g, model.formats["routed_expert"].bytes_per_value))
        except SpecError as e:  # e.g. a format the chip cannot compute in
            for i, d, hw, *_ in members:
                rows[i] = _filtered(model, d, hw, e)
            continue
        # one timeline per distinct (banks, slots, pieces, shared): e.g. on-chip sizes that leave
        # the same ring and buffers give the same timeline
        runs = {(banks, slots, pieces, hw.dma_sharing == "shared"): None
                for _, _, hw, banks, slots, pieces in members}
        cols = np.array(list(runs), np.int64).T
        t0 = a.t0 / members[0][1].steps_per_call  # the group shares its steps per call (key)
        limits.spend("layer_steps", cols.shape[1] * (int(g.layer[-1]) + 1 if len(g) else 0))
        with interrupts.deferred():  # compiled: a signal inside is raised when it returns
            steps, hbm, totals = megakernel_sim.run_many(a.eng, t0, a.overhead, cols[0], cols[1], cols[2],
                                                         cols[3].astype(float), *a.args())
        for key, step, nbytes, tot in zip(runs, steps.tolist(), hbm.tolist(), totals.tolist()):
            runs[key] = (step, nbytes, dict(zip(megakernel_sim.TOTALS, tot)))
        for i, d, hw, banks, slots, pieces in members:
            rows[i] = _row(model, d, hw, summarise(hw, d, *runs[banks, slots, pieces, hw.dma_sharing == "shared"]))
    return rows


def serving_work(design) -> tuple[int, float]:
    """(serving points, serving steps they take) of a design, estimated from each point's settings
    before any runs (perfmodel.serve.simulate.estimate_steps on the mean lengths, a point's steps
    at most MAX_SERVE_STEPS: one estimated over it is refused when it runs); SpecError when the
    design asks for more than MAX_SERVE_POINTS serving points or MAX_SWEEP_SERVE_STEPS steps."""
    from perfmodel.search.design import MAX_SERVE_POINTS
    from perfmodel.serve.scheduler import MAX_BATCH, MAX_TOKENS_PER_STEP
    from perfmodel.serve.simulate import step_floor_s
    from perfmodel.spec.deployment import validate as check
    cols, base = design.columns, design.base
    if not any(k in cols or base.get(k) is not None for k in SERVE_TRAFFIC):
        return 0, 0.0
    n = len(design)
    limits.refuse("sweep design", f"{n} points", "serving points (each a serving simulation)", n,
                  MAX_SERVE_POINTS, "points", "fewer points, or split the design")
    floors: dict[tuple, float] = {}
    total = 0.0
    for i in range(n):
        s = design.settings(i)
        key = tuple(s.get(k) for k in ("model", "hardware", "devices", "tp", "ep", "engine", "hbm_gbps",
                                      "prefill_devices", "prefill_tp", "prefill_ep", "vmem_mib"))
        if key not in floors:
            try:
                model, chip = _load("model", s["model"]), _load("hardware", s["hardware"])
                d, hw = configure(chip, {**s, "draft_rows": 0})
                pools = [d] + ([Deployment(devices=s["prefill_devices"], tp=s.get("prefill_tp") or s["prefill_devices"],
                                           ep=s.get("prefill_ep"), engine="multikernel")]
                               if s.get("prefill_devices") else [])
                one = [dataclasses.replace(p, batch=1, context=0, spec=None, steps_per_call=1) for p in pools]
                for p in one:
                    check(model, hw, p)
                floors[key] = min(step_floor_s(model, hw, p) for p in one)
            except SpecError:
                floors[key] = None  # the point is filtered when it runs, at no cost
        floor = floors[key]
        if floor is None:
            continue
        cap = min(s.get("prefill_chunk") or s.get("max_tokens_per_step") or MAX_TOKENS_PER_STEP,
                  s.get("max_tokens_per_step") or MAX_TOKENS_PER_STEP)
        alone = math.ceil((s.get("input_len") or 1024) / cap) + (s.get("output_len") or 256)
        requests = s.get("requests") or SERVE_REQUESTS
        flight = s["concurrency"] if s.get("concurrency") else s["rate"] * alone * floor
        flight = min(max(flight, 1.0), s.get("max_batch") or MAX_BATCH, requests)
        steps = requests * alone / flight
        if steps > limits.MAX_SERVE_STEPS:
            k = next((k for k in ("requests", "output_len", "input_len", "rate", "concurrency", "prefill_chunk")
                      if k in cols or base.get(k) is not None), "requests")
            design.refuse(k, f"point {i} ({requests} requests of {s.get('input_len') or 1024} + "
                          f"{s.get('output_len') or 256} tokens, about {flight:.3g} in flight) takes about "
                          f"{steps:,.0f} serving steps (estimated), over the limit of {limits.MAX_SERVE_STEPS:,}; "
                          "fewer requests or output tokens, or more traffic at once")
        total += steps
    limits.refuse("sweep design", f"{n} points", f"{n} serving simulations", total, limits.MAX_SWEEP_SERVE_STEPS,
                  "serving steps (estimated)", "fewer points, requests or output tokens")
    return n, total


def serve_row(model, d: Deployment, hw: hardware.Hardware, s: dict, constraints: dict) -> dict:
    """The result columns of one serving configuration: the simulation's throughput (tokens/s,
    per chip over both pools), TPOT p50 as the time per token, the mean step, the latency
    percentiles; filtered (constraint ttft / tpot / e2e) when a percentile exceeds its limit."""
    from perfmodel.serve.scheduler import Scheduler
    from perfmodel.serve.simulate import simulate
    from perfmodel.serve.workload import Lengths, Workload
    w = Workload(s.get("requests") or SERVE_REQUESTS, Lengths.parse(s.get("input_len") or 1024, "input_len"),
                 Lengths.parse(s.get("output_len") or 256, "output_len"), s.get("rate"), s.get("concurrency"),
                 seed=s.get("serve_seed") or 0)
    sched = Scheduler(**{k: s[k] for k in ("max_batch", "max_tokens_per_step", "prefill_chunk") if s.get(k)})
    prefill = None
    if s.get("prefill_devices"):
        prefill = Deployment(devices=s["prefill_devices"], tp=s.get("prefill_tp") or s["prefill_devices"],
                             ep=s.get("prefill_ep"), engine="multikernel", routing_skew=d.routing_skew,
                             routing_correlation=d.routing_correlation)
    r = simulate(model, hw, d, w, sched, prefill).json(series=False)
    pools = r["pools"]
    steps = sum(p["steps"] for p in pools)
    row = {"status": "ok", "constraint": None, "reason": None,
           "step_s": sum(p["busy_s"] for p in pools) / steps,
           "token_latency_s": r["tpot_s"]["p50"] if r["tpot_s"]["p50"] is not None else r["ttft_s"]["p50"],
           "tokens_per_s": r["throughput_tokens_per_s"], "tokens_per_s_per_chip": r["tokens_per_s_per_chip"],
           "chips": r["chips"], "bound": "serving", "hbm_utilisation": None,
           "resident_bytes_per_device": resident_bytes_per_device(model, d),
           **dict.fromkeys(f"{c}_s" for c in BREAKDOWN),
           **{c: r[c.split("_")[0] + "_s"][c.split("_")[1]] for c in CONSTRAINTS}}
    for name, limit in constraints.items():
        v = row[name]
        if v is None or v > limit:
            metric, q, _ = name.split("_")
            return row | {"status": "filtered", "constraint": metric,
                          "reason": f"{metric.upper()} {q} {v:.4g} s > {limit:g} s" if v is not None
                          else f"{metric.upper()} {q}: no request had two output tokens"}
    return row


def _filtered(model, d, hw, e: SpecError) -> dict:
    """The row of a configuration that does not fit, naming the constraint."""
    if e.field in VMEM_FIELDS:
        constraint = "vmem"
    elif d is not None and e.field == "devices" and resident_bytes_per_device(model, d) > hw.core_hbm_bytes:
        constraint = "memory"
    else:
        constraint = "layout"
    return dict.fromkeys(RESULTS) | {"status": "filtered", "constraint": constraint, "reason": str(e)}


def _row(model, d: Deployment, hw: hardware.Hardware, p) -> dict:
    """The result columns of a Prediction or a predict.Summary."""
    chips = math.ceil(d.devices / hw.cores_per_chip)
    per_seq = d.spec.tokens_per_step if d.spec else 1.0
    return dict.fromkeys(RESULTS) | {"status": "ok", "constraint": None, "reason": None, "step_s": p.step_s,
            "token_latency_s": p.step_s / per_seq, "tokens_per_s": p.tokens_per_s,
            "tokens_per_s_per_chip": p.tokens_per_s / chips, "chips": chips, "bound": p.bound,
            "hbm_utilisation": p.hbm_floor_s / p.step_s if p.step_s else 0.0,
            "resident_bytes_per_device": resident_bytes_per_device(model, d),
            **{f"{c}_s": p.breakdown_s.get(c, 0.0) for c in BREAKDOWN}}


_LOADED: dict[tuple[str, str], object] = {}  # per process: presets and files loaded once


def _load(kind: str, ref: str):
    if (kind, ref) not in _LOADED:
        _LOADED[kind, ref] = loaders.load_model(ref) if kind == "model" else hardware.load_hardware(ref)
    return _LOADED[kind, ref]


def run_chunk(chunk: Chunk) -> list[dict]:
    """A chunk's rows: point number, every setting (None: the default) and the results. Runs in
    any process (the executors send it chunks); model and chip are loaded once per process."""
    model, chip = _load("model", chunk.model), _load("hardware", chunk.hardware)
    results = evaluate(model, chip, chunk.settings, chunk.constraints)
    return [{"point": i, **{k: s.get(k) for k in SETTINGS}, **r}
            for i, s, r in zip(chunk.points, chunk.settings, results)]
