"""Phase attribution of a megakernel step, the way a kernel's profiling-only skip options measure it:
a phase's time is what the step saves when that phase is skipped (its DMAs and its compute, in every
decoder layer), per layer for the layer phases and per step for the head; the per-layer marginal is
a decoder layer's time on the timeline, and the fixed cost what is left of the step beside it.
The dense ring is the exception: a kernel has no option that skips its ring (Muse Spark's
decode_megakernel.py SKIPPABLE: collectives, attention, experts, route, lm_head and the dots), so its
phase is what remains of a decoder layer with every other layer phase skipped (RING_ALONE).

`phases(model, hw, d)` predicts them; `compare(profile, ...)` sets them beside a published profile
(perfmodel/data/phase_profiles/*.json) for each of its kernels. `perfmodel explain --profile NAME`
prints both, `stated_checks` (the gains the profile's source states for single changes of a
kernel beside the model's: checks nothing is fitted to) and `attention_parts` (what leaving out
only the attention's compute, or only its write-back, saves: a diagnostic of the attention phase).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from perfmodel.engine.megakernel import ATTENTION_CORES, kernel_terms, simulate_megakernel
from perfmodel.engine.terms import op_weights
from perfmodel.graph import ops as ops_mod
from perfmodel.graph.ops import OpGraph
from perfmodel.spec.arch import ModelSpec, derive, from_dict, preset_data
from perfmodel.spec.deployment import Deployment, validate
from perfmodel.spec.hardware import Hardware
from perfmodel.util import limits, schema
from perfmodel.util.checks import STR, ListOf, Num, OneOf, Req
from perfmodel.util.errors import SpecError, in_file, require
from perfmodel.util.files import check_path

PROFILE_DIR = Path(__file__).parents[1] / "data" / "phase_profiles"
# phase -> what skipping it removes from each decoder layer (or the head)
SKIPPED = {"dense_ring": "every other layer phase (the ring and its matmuls alone)", "collectives": "the collectives",
           "expert_stream": "the routed experts: their DMAs and matmuls",
           "attention": "the attention cores: their KV / state reads and compute", "routing": "the top-k",
           "lm_head": "the head's weights: their DMAs and matmuls"}
LAYER_PHASES = ("dense_ring", "collectives", "expert_stream", "attention", "routing")
RING_ALONE = ("collectives", "expert_stream", "attention", "routing")  # skipped to time the dense ring
TOLERANCE = {"phase": 0.10, "total": 0.05}  # per phase; the layer total and the fixed cost
# every phase a profile may give (perfmodel.step.phases.phases' keys but the step) -> what it is per
PER = {**dict.fromkeys(("layer", *LAYER_PHASES), "layer"),
       **dict.fromkeys(("fixed", "lm_head", "dispatch_glue_barrier_prime", "xla_embedding"), "step")}


def skip(g: OpGraph, phase: str) -> OpGraph:
    """The op graph with `phase` skipped (SKIPPED) in every decoder layer (the head for lm_head);
    not the dense ring, which a kernel cannot skip."""
    names = np.array(g.name)
    n_layers = int(g.layer.max()) - 1
    inner = (g.layer >= 1) & (g.layer <= n_layers)
    static, routed, kv, flops, group = (g.static_bytes.copy(), g.routed_bytes.copy(), g.kv_bytes.copy(),
                                        g.flops.copy(), g.coll_group.copy())
    if phase == "collectives":
        group[inner & g.is_collective] = 1
    elif phase == "expert_stream":
        sel = routed > 0
        routed[sel], flops[sel] = 0.0, 0.0
    elif phase == "attention":
        sel = inner & np.isin(names, ATTENTION_CORES)
        kv[sel], flops[sel] = 0.0, 0.0
    elif phase == "routing":
        flops[inner & (names == "top_k")] = 0.0
    elif phase == "lm_head":
        sel = (g.layer == n_layers + 1) & (static > 0)
        static[sel], flops[sel] = 0.0, 0.0
    else:
        raise SpecError("phase", phase, f"one of {', '.join(p for p in SKIPPED if p != 'dense_ring')}")
    return dataclasses.replace(g, static_bytes=static, routed_bytes=routed, kv_bytes=kv, flops=flops,
                               coll_group=group)


def _runner(model: ModelSpec, hw: Hardware, d: Deployment):
    """(the step's op graph, a function simulating a variant of it on `hw`): megakernels only."""
    require(d.engine == "megakernel", "engine", d.engine, "phase attribution is of a megakernel step")
    validate(model, hw, d)
    g = ops_mod.build(model, d)
    top_k = model.moe.top_k if model.moe else 1
    w = op_weights(g, model.formats["routed_expert"].bytes_per_value)
    return g, lambda graph: simulate_megakernel(graph, hw, d, top_k, weights=w)


def phases(model: ModelSpec, hw: Hardware, d: Deployment) -> dict[str, float]:
    """Seconds: each layer phase (per decoder layer; the dense ring alone, RING_ALONE), lm_head (per
    step), the per-layer marginal `layer`, `fixed` (step - layers x marginal),
    `dispatch_glue_barrier_prime` (fixed - lm_head) and `xla_embedding` (the glue term), and `step`.
    Megakernel deployments only."""
    g, run = _runner(model, hw, d)
    n = len(model.layers)

    def marginal(graph: OpGraph) -> tuple[float, float]:
        """(step, a decoder layer on its timeline: the mean of all but the first and the last)."""
        tl = run(graph)
        ends = np.array([tl.end_s[graph.layer == l].max() for l in range(n + 1)])
        return tl.step_s, float(np.mean(np.diff(ends)[1:-1] if n > 2 else np.diff(ends)))

    step, layer = marginal(g)
    out = {p: (step - run(skip(g, p)).step_s) / n for p in RING_ALONE}
    alone = g
    for p in RING_ALONE:
        alone = skip(alone, p)
    out["dense_ring"] = marginal(alone)[1]
    out["lm_head"] = step - run(skip(g, "lm_head")).step_s
    out["layer"] = layer
    out["fixed"] = step - n * layer
    out["dispatch_glue_barrier_prime"] = out["fixed"] - out["lm_head"]
    out["xla_embedding"] = float(kernel_terms(g, hw).get("xla_embedding", np.zeros(1)).sum())
    out["step"] = step
    return out


def rounded(seconds: float) -> float:
    """A difference of two step times, 0 below 1 ps (float rounding, not a saving)."""
    return 0.0 if abs(seconds) < 1e-12 else seconds


def attention_parts(model: ModelSpec, hw: Hardware, d: Deployment) -> dict[str, float]:
    """Seconds per decoder layer the step saves when one part of the attention alone is left out:
    `compute` (its cores' FLOPs and fixed latency; their copies stay) and `writeback` (the cache
    write-back and the wait for it; the reads and compute stay). Beside `phases`' attention (all of
    it skipped), they say which part the layer waits on: a diagnostic no kernel option measures."""
    g, run = _runner(model, hw, d)
    sel = (g.layer >= 1) & np.isin(np.array(g.name), ATTENTION_CORES)
    variants = {"compute": dataclasses.replace(g, flops=np.where(sel, 0.0, g.flops)),
                "writeback": dataclasses.replace(g, writeback={})}
    step = run(g).step_s
    saved = {part: (step - run(v).step_s) / len(model.layers) for part, v in variants.items()}
    return {part: rounded(v) for part, v in saved.items()}


def load_profile(name_or_path: str) -> dict:
    """A phase profile: a bundled name (perfmodel/data/phase_profiles/NAME.json) or a file."""
    p = check_path("--profile", name_or_path)
    if p.suffix != ".json":
        known = sorted(q.stem for q in PROFILE_DIR.glob("*.json"))
        require(name_or_path in known, "--profile", name_or_path, f"unknown profile; known: {', '.join(known)}")
        p = PROFILE_DIR / f"{name_or_path}.json"
    count = lambda lo, hi=2**20: Num(lo, hi, integer=True)
    timed = ListOf({"context": Req(count(0, 2**30)), "steps": Req(count(1, 2**31)), "*": None}, 1,
                   limits.MAX_PROFILE_GROUPS)
    deployment = {"devices": Req(count(1)), "tp": Req(count(1)), "ep": count(1), "batch": count(1),
                  "context": count(0, 2**30), "steps_per_call": count(1)}
    stated = {"kv_prefetch_gain_us_per_layer": Num(0, lo_open=True),
              "kv_prefetch_gain_kernel": {"kernel": Req((STR,)), "megakernel": {"*": None}}, "*": None}
    harness = {"deployment": Req(deployment), "timed_steps": timed, "*": None}
    rule = {"what": (STR,), "source": (STR,), "stated": stated, "harness": Req(harness),
            "kernels": Req({"*": {"model": Req((STR,)), "megakernel": {"*": None}, "phases": Req(ListOf(
                {"phase": Req(OneOf(*PER)), "per": Req(OneOf("layer", "step")), "value_us": Req(Num(0, lo_open=True)),
                 "source": Req((STR,)), "megakernel": {"*": None}, "reading": (STR,), "*": None}, 1)), "*": None}})}
    data = schema.load(p, rule, "--profile", fmt="json")
    with in_file(p):
        require(data["kernels"], "kernels", {}, "needs at least one kernel")
        limits.refuse("kernels", f"{len(data['kernels'])} kernels", "kernels in the profile", len(data["kernels"]),
                      limits.MAX_PROFILE_KERNELS, "kernels")
        for name, entry in data["kernels"].items():
            n = len(_settings(entry))
            limits.refuse(f"kernels.{name}.phases", f"{n} settings", "distinct [megakernel] settings of its rows",
                          n, limits.MAX_PROFILE_SETTINGS, "settings")
        for name, entry in data["kernels"].items():
            kernel_model(entry)  # its preset and settings load, or the error names this file
            for i, e in enumerate(entry["phases"]):
                require(e["per"] == PER[e["phase"]], f"kernels.{name}.phases[{i}].per", e["per"],
                        f"the {e['phase']} phase is per {PER[e['phase']]}")
                if e.get("megakernel"):  # a row's own settings on top load too
                    kernel_model(entry, e["megakernel"])
        gain = (data.get("stated") or {}).get("kv_prefetch_gain_kernel")
        if "kv_prefetch_gain_us_per_layer" in (data.get("stated") or {}):
            require(gain is not None, "stated.kv_prefetch_gain_kernel", None,
                    "a stated gain needs the kernel it was measured on")
        if gain is not None:
            require(gain["kernel"] in data["kernels"], "stated.kv_prefetch_gain_kernel.kernel", gain["kernel"],
                    f"one of the profile's kernels: {', '.join(data['kernels'])}")
            kernel_model(data["kernels"][gain["kernel"]], gain.get("megakernel"))
        timelines, layer_steps = profile_work(data)
        limits.refuse("harness.timed_steps", f"{len(data['harness'].get('timed_steps') or [1])} groups",
                      f"{len(data['kernels'])} kernels x their settings x the timed groups: {timelines:,} step "
                      "timelines of their models' layers", layer_steps, limits.MAX_LAYER_STEPS, "layer steps",
                      "fewer kernels, settings or groups of timed steps")
    return data


PHASE_TIMELINES = 7      # step timelines one `phases` call simulates (the step and its skipped variants)
ATTENTION_TIMELINES = 3  # and one `attention_parts` call


def _settings(entry: dict) -> set[str]:
    """The distinct [megakernel] settings a profile kernel's rows are predicted with (its own included)."""
    return {"{}"} | {json.dumps(e.get("megakernel") or {}, sort_keys=True) for e in entry["phases"]}


def profile_work(profile: dict) -> tuple[int, int]:
    """(step timelines, layer steps) that `explain --profile` simulates for `profile`: per kernel,
    its rows' distinct settings' phases and its attention parts at each group of timed steps,
    and the stated gain's two settings (perfmodel.util.limits)."""
    groups = len(profile["harness"].get("timed_steps") or [1])
    timelines = steps = 0
    for entry in profile["kernels"].values():
        n = groups * (PHASE_TIMELINES * len(_settings(entry)) + ATTENTION_TIMELINES)
        timelines += n
        steps += n * (len(kernel_model(entry).layers) + 2)
    stated = profile.get("stated") or {}
    if "kv_prefetch_gain_us_per_layer" in stated:
        n = 2 * groups * PHASE_TIMELINES
        timelines += n
        steps += n * (len(kernel_model(profile["kernels"][stated["kv_prefetch_gain_kernel"]["kernel"]]).layers) + 2)
    return timelines, steps


def kernel_model(entry: dict, extra: dict | None = None) -> ModelSpec:
    """The model a profile's kernel runs: its preset with the kernel's [megakernel] settings, and
    `extra` settings on top (a row's own, a stated change's)."""
    over = {**(entry.get("megakernel") or {}), **(extra or {})}
    return derive(entry["model"], megakernel=over) if over else from_dict(preset_data(entry["model"]))


def profile_deployments(profile: dict) -> list[tuple[Deployment, float]]:
    """The profiled deployment at each group of the harness's timed steps (`harness.timed_steps`:
    the cached tokens the group's steps read, on average, and how many steps; one group at the
    deployment's own context when the profile lists none), each with its share of the steps. A
    profile's phase is a mean over the timed steps, so the model's is the mean over the groups
    (over_harness)."""
    base = profile["harness"]["deployment"]
    groups = profile["harness"].get("timed_steps") or [{"steps": 1}]
    total = sum(g["steps"] for g in groups)
    return [(Deployment(engine="megakernel", **{**base, **({"context": g["context"]} if "context" in g else {})}),
             g["steps"] / total) for g in groups]


def profile_deployment(profile: dict) -> Deployment:
    """The profiled deployment at its largest group of timed steps (profile_deployments): for what
    takes one deployment (a sweep, a mechanism's test)."""
    return max(profile_deployments(profile), key=lambda dw: dw[1])[0]


def over_harness(profile: dict, fn):
    """`fn(deployment)` (a float or a dict of floats) averaged over the harness's timed steps."""
    runs = [(fn(d), w) for d, w in profile_deployments(profile)]
    if isinstance(runs[0][0], dict):
        return {k: sum(r[k] * w for r, w in runs) for k in runs[0][0]}
    return sum(r * w for r, w in runs)


def harness_text(harness: dict) -> str:
    """A profile's harness as one line: its deployment and the timed steps' groups."""
    dep = ", ".join(f"{k} {v}" for k, v in harness.get("deployment", {}).items())
    timed = ", ".join(f"{g['steps']} at {g['context']} cached tokens" for g in harness.get("timed_steps", []))
    return f"deployment {dep}" + (f"; timed steps: {timed}" if timed else "")


def settings_text(megakernel: dict) -> str:
    """A kernel's [megakernel] settings as one line, `key = value, ...` (empty for none)."""
    return ", ".join(f"{key} = {v}" for key, v in megakernel.items())


def attention_parts_text(parts_us: dict) -> str:
    """A kernel's attention parts (explain_profile's `attention_parts_us`) as one sentence."""
    return (f"attention by part (a diagnostic): leaving out its compute alone saves {parts_us['compute']:.2f} us, "
            f"its cache write-back and the wait for it alone {parts_us['writeback']:.2f} us")


def kv_prefetch_gain(profile: dict, hw: Hardware) -> float:
    """Seconds a decoder layer gains from issuing the attention's KV tiles at the layer's start
    instead of inside the attention (`[megakernel] kv_prefetch`), on the kernel the profile's stated
    gain was measured on (`stated.kv_prefetch_gain_kernel`: one of its kernels and settings on top)."""
    on = profile["stated"]["kv_prefetch_gain_kernel"]
    model = {kv: kernel_model(profile["kernels"][on["kernel"]], {**on.get("megakernel", {}), "kv_prefetch": kv})
             for kv in (True, False)}
    layer = {kv: over_harness(profile, lambda d, kv=kv: phases(model[kv], hw, d)["layer"]) for kv in (True, False)}
    return layer[False] - layer[True]


def stated_checks(profile: dict, hw: Hardware) -> list[dict]:
    """The changes of a kernel whose gain the profile's source states (`stated`), each beside the
    model's gain: checks that nothing is fitted to. Today the KV prefetch's (kv_prefetch_gain)."""
    stated = profile.get("stated") or {}
    if "kv_prefetch_gain_us_per_layer" not in stated:
        return []
    on, measured = stated["kv_prefetch_gain_kernel"], stated["kv_prefetch_gain_us_per_layer"]
    predicted = kv_prefetch_gain(profile, hw) * 1e6
    return [{"check": "kv_prefetch_gain", "per": "layer",
             "what": "issuing the attention's KV tiles at the layer's start instead of inside the attention",
             "kernel": on["kernel"], "megakernel": on.get("megakernel", {}), "measured_us": measured,
             "predicted_us": predicted, "error": predicted / measured - 1, "source": stated.get("source", "")}]


def compare(profile: dict, hw: Hardware) -> dict:
    """Per kernel of the profile: each measured phase beside the prediction (perfmodel.step.phases),
    the error and whether it is within TOLERANCE. A phase row with its own `megakernel` settings
    was measured with those on top of its kernel's (its `reading` says why); it is predicted so."""
    out = {}
    mean = lambda model: over_harness(profile, lambda d: phases(model, hw, d))
    for name, entry in profile["kernels"].items():
        preds = {"{}": mean(kernel_model(entry))}  # by the row's own settings, as JSON
        rows = []
        for e in entry["phases"]:
            own = e.get("megakernel") or {}
            key = json.dumps(own, sort_keys=True)
            if key not in preds:
                preds[key] = mean(kernel_model(entry, own))
            p = rounded(preds[key][e["phase"]]) * 1e6
            tol = TOLERANCE["total" if e["phase"] in ("layer", "fixed") else "phase"]
            rows.append({"phase": e["phase"], "per": e["per"], "measured_us": e["value_us"], "predicted_us": p,
                         "error": p / e["value_us"] - 1, "tolerance": tol,
                         "within": abs(p / e["value_us"] - 1) <= tol, "source": e["source"],
                         **({"megakernel": own, "reading": e.get("reading", "")} if own else {})})
        out[name] = {"model": entry["model"], "megakernel": entry.get("megakernel") or {},
                     "step_us": preds["{}"]["step"] * 1e6, "phases": rows}
    return out
