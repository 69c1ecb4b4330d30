"""What-if sweeps: vary one or two deployment / hardware fields and predict each point."""
from __future__ import annotations

import dataclasses
import itertools

from .arch import ModelSpec
from .deployment import Deployment
from .errors import SpecError
from .hardware import Hardware
from .predict import predict

DEPLOYMENT_AXES = ("batch", "context", "prefetch_bytes", "expert_slots", "engine", "routing_skew")
HARDWARE_AXES = ("onchip_bytes", "hbm_bandwidth_bytes_per_s", "link_latency_s", "dma_sharing")
AXES = DEPLOYMENT_AXES + HARDWARE_AXES


def sweep(model: ModelSpec, hw: Hardware, d: Deployment, axes: dict[str, list]) -> list[dict]:
    """Predict every combination of `axes` values; a point that cannot run records its error."""
    for axis in axes:
        if axis not in AXES:
            raise SpecError("sweep axis", axis, f"must be one of {', '.join(AXES)}")
    rows = []
    names = list(axes)
    for values in itertools.product(*(axes[n] for n in names)):
        point = dict(zip(names, values))
        dd = dataclasses.replace(d, **{k: v for k, v in point.items() if k in DEPLOYMENT_AXES})
        hh = hw.replace(**{k: v for k, v in point.items() if k in HARDWARE_AXES})
        try:
            p = predict(model, hh, dd)
        except SpecError as e:
            rows.append({**point, "error": str(e)})
            continue
        rows.append({**point, "step_s": p.step_s, "tokens_per_s": p.tokens_per_s, "bound": p.bound,
                     "hbm_utilisation": p.hbm_utilisation, "breakdown_s": p.breakdown_s})
    return rows


def saturation(rows: list[dict], axis: str = "prefetch_bytes", within: float = 0.01) -> dict | None:
    """The smallest `axis` value whose step time is within `within` of the best in the sweep."""
    ok = [r for r in rows if "step_s" in r]
    if not ok:
        return None
    best = min(r["step_s"] for r in ok)
    return min((r for r in ok if r["step_s"] <= best * (1 + within)), key=lambda r: r[axis])
