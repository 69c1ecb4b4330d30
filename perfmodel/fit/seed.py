"""Whole-step fit on the seed table and its reproduction (`perfmodel reproduce`).

Every term comes from the hardware presets as shipped: components fitted to micro-benchmarks by
`perfmodel calibrate`, physical-default efficiency. On top of them at most one whole-step parameter
per platform (none for the TPU), fitted only on batches 1 and 8 of the seed table; batches 2 and 4
and the speculative-decoding pair are held out. The fitted values live in the report only: a preset
keeps its kernel-level fits, so no other prediction rests on the seed's end-to-end steps.
`--no-fit` shows the errors of the presets as shipped.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.optimize import least_squares

from perfmodel.engine import megakernel_sim
from perfmodel.fit.measurements import Measurement, seed_measurements
from perfmodel.spec.arch import ModelSpec, derive
from perfmodel.spec.deployment import Deployment, SpecDecode
from perfmodel.spec.hardware import Hardware, load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.predict import predict
from perfmodel.step.report import SCHEMA_VERSION

MODEL = "kimi-k3"
FIT_BATCHES = (1, 8)
TARGETS = {"fitted": 0.08, "held-out": 0.10}


@dataclass(frozen=True)
class Param:
    """A fitted parameter: where it lives, fit bounds, and the range called physically plausible."""
    name: str
    scope: str        # the platform (hardware preset) whose component it refits
    bounds: tuple[float, float]
    plausible: tuple[float, float]
    why: str

    @property
    def key(self) -> str:
        return f"{self.scope}.{self.name}"


def fit_params(platforms: list[str]) -> list[Param]:
    """At most one whole-step parameter per platform. GPU: the overlap of consecutive kernels in the
    serving engine's CUDA graph (components.graph_kernel_overlap_s), refitted: its kernel-level fit
    (programmatic dependent launch on single kernel pairs, 0.60 us) leaves the replay's step above
    the reported one by about the same at batches 1 and 8, a cost per kernel, not per token. TPU:
    none; every term of its megakernel step comes from a component and the composition follows the
    real kernel's phase profile (perfmodel.step.phases). The router's skew stays at its physical
    default (uniform routing): nothing measures Kimi K3's expert popularity."""
    return [Param("graph_kernel_overlap_s", p, (0.0, 5e-6), (0.0, 2e-6),
                  "seconds of each replayed kernel hidden under the one before it in the CUDA graph; "
                  "plausible: up to a small kernel's whole time (the fastest in the GPU's tables, 1.9 us on GB200)")
            for p in platforms if p != "tpu-v7"]


def deployment_for(m: Measurement) -> Deployment:
    """The measurement's layout, with uniform routing (the physical default skew, not fitted), as
    the run's serving engine launches its kernels where the run names one (the GB200 rows: vLLM)."""
    spec = SpecDecode(m.draft_rows, acceptance_length=m.acceptance_length) if m.spec_decode else None
    return Deployment(devices=m.devices, tp=m.tp, ep=m.ep, engine=m.engine, batch=m.batch, spec=spec,
                      routing_skew=0.0, steps_per_call=m.steps_per_call, serving_engine=m.serving_engine or None)


def model_for(m: Measurement) -> ModelSpec:
    """The model as the measured run stored it (its KV cache format where the run names one)."""
    return _model(m.kv_cache)


@lru_cache(maxsize=None)
def _model(kv_cache: str) -> ModelSpec:
    return derive(MODEL, formats={"kv_cache": kv_cache}) if kv_cache else load_model(MODEL)


def role(m: Measurement) -> str:
    return "fitted" if not m.spec_decode and m.batch in FIT_BATCHES else "held-out"


def _apply(values: dict[str, float], hw: dict[str, Hardware], platform: str) -> Hardware:
    """The platform's preset with the fitted values in place of its components of those names."""
    fitted = {p.split(".", 1)[1]: v for p, v in values.items() if p.startswith(platform + ".")}
    return dataclasses.replace(hw[platform], components={**hw[platform].components, **fitted})


def fit(measurements: list[Measurement], hw: dict[str, Hardware]) -> dict[str, float]:
    """Least squares on log(predicted / reported) over the training points, from the presets' values."""
    params = fit_params(sorted(hw))
    train = [m for m in measurements if role(m) == "fitted" and m.platform in {p.scope for p in params}]
    unit = np.array([1e-6 if p.name.endswith("_s") else 1.0 for p in params])  # fit times in us
    lo, hi = np.array([p.bounds[0] for p in params]) / unit, np.array([p.bounds[1] for p in params]) / unit
    # from the presets' values, a hundredth of the range inside a bound (trust-region-reflective stalls on one)
    x0 = np.clip([hw[p.scope].components.get(p.name, 0.0) for p in params] / unit, lo + 0.01 * (hi - lo), hi)

    def residuals(x):
        values = dict(zip((p.key for p in params), x * unit))
        out = []
        for m in train:
            out.append(np.log(predict(model_for(m), _apply(values, hw, m.platform), deployment_for(m)).tokens_per_s
                              / m.tokens_per_s))
        return out

    res = least_squares(residuals, x0, bounds=(lo, hi), diff_step=1e-3)
    return dict(zip((p.key for p in params), map(float, res.x * unit)))


def reproduce(fit_parameters: bool = True) -> dict:
    """The seed table predicted next to the reported values (schema in docs/json-schema.md).

    With fit_parameters=False the presets stay as shipped. A point whose run
    names its serving engine (`serving_engine`) is that engine's kernel list, costed from measured
    kernel tables (perfmodel.engine.serving); its `kernels` entry is that list with nothing fitted."""
    megakernel_sim.compile_loops()  # the fit simulates hundreds of steps
    ms = seed_measurements()
    hw = {m.platform: load_hardware(m.hardware) for m in ms}
    values = fit(ms, hw) if fit_parameters else {}
    fitted = {p.key: {"value": values[p.key], "scope": p.scope, "why": p.why,
                      "plausible_range": list(p.plausible),
                      "plausible": p.plausible[0] <= values[p.key] <= p.plausible[1]}
              for p in fit_params(sorted(hw)) if p.key in values}
    points = []
    for m in ms:
        p = predict(model_for(m), _apply(values, hw, m.platform), deployment_for(m))
        err = p.tokens_per_s / m.tokens_per_s - 1
        r = role(m) if fit_parameters else "held-out"
        points.append({"platform": m.platform, "batch": m.batch,
                       "spec_decode": {"draft_rows": m.draft_rows, "acceptance_length": m.acceptance_length}
                       if m.spec_decode else None,
                       "predicted_tokens_per_s": p.tokens_per_s, "reported_tokens_per_s": m.tokens_per_s,
                       "error": err, "role": r, "within_target": abs(err) <= TARGETS[r],
                       "predicted_step_ms": p.step_s * 1e3, "source": m.source,
                       **({"serving_engine": m.serving_engine} if m.serving_engine else {})})
    if fit_parameters:  # the same points with nothing fitted, beside the fitted errors
        for pt, raw in zip(points, reproduce(fit_parameters=False)["points"]):
            pt["no_fit_error"] = raw["error"]
            if "serving_engine" in raw:  # the engine's kernels as their tables time them, nothing fitted
                pt["kernels"] = {"serving_engine": raw["serving_engine"], "error": raw["error"],
                                 **{k: raw[k] for k in ("predicted_tokens_per_s", "predicted_step_ms")}}
    return {"schema_version": SCHEMA_VERSION, "model": MODEL, "fitted_parameters": fitted,
            "fit_on": "seed table batches 1 and 8 of both platforms (no speculative decoding)",
            "targets": TARGETS, "points": points, "trend": trend(points)}


def trend(points: list[dict]) -> list[dict]:
    """TPU / GB200 tokens/s ratio per batch, predicted and reported."""
    get = lambda plat, b, key: next(p[key] for p in points
                                    if p["platform"] == plat and p["batch"] == b and not p["spec_decode"])
    batches = sorted({p["batch"] for p in points if not p["spec_decode"]})
    return [{"batch": b,
             "predicted_ratio": get("tpu-v7", b, "predicted_tokens_per_s") / get("gb200", b, "predicted_tokens_per_s"),
             "reported_ratio": get("tpu-v7", b, "reported_tokens_per_s") / get("gb200", b, "reported_tokens_per_s")}
            for b in batches]
