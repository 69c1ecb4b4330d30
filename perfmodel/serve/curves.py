"""TTFT, TPOT, E2E and throughput of one layout against load: the curves a serving view plots."""
from __future__ import annotations

from perfmodel.serve.scheduler import Scheduler
from perfmodel.serve.simulate import simulate
from perfmodel.serve.workload import Lengths, Workload
from perfmodel.spec.arch import ModelSpec
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import Hardware
from perfmodel.util.errors import require

SATURATED = 0.95  # served requests/s below this share of the arrivals': the queue grows without bound


def load_curves(model: ModelSpec, hw: Hardware, d: Deployment, loads: list[float], arrivals: str = "rate",
                input_len: Lengths | int = 1024, output_len: Lengths | int = 256, requests: int = 500,
                seed: int = 0, scheduler: Scheduler = Scheduler(), prefill: Deployment | None = None) -> dict:
    """Serve the same traffic on deployment `d` (with `prefill` as a separate prefill pool, if
    given) at every load: `arrivals` "rate" (Poisson, requests/s) or "concurrency" (closed-loop
    clients). Returns {"arrivals", "chips", "points": [per load: "load", "ttft_s", "tpot_s",
    "e2e_s" (each p50 / p90 / p99 / mean), "throughput_tokens_per_s", "tokens_per_s_per_chip",
    "requests_per_s", "kv_occupancy_mean", "preemptions", "saturated" (a Poisson load served at
    under 95 % of the rate its requests arrived at)]}. A layout that cannot run raises SpecError.
    The step costs are shared between the loads, so a curve of n loads costs about one
    simulation's shapes and n simulations' scheduling."""
    require(arrivals in ("rate", "concurrency"), "arrivals", arrivals, "rate or concurrency")
    require(len(loads) > 0, "loads", loads, "needs at least one load")
    as_lengths = lambda v: v if isinstance(v, Lengths) else Lengths(v, v)
    points, chips = [], None
    for x in loads:
        w = Workload(requests, as_lengths(input_len), as_lengths(output_len),
                     rate=float(x) if arrivals == "rate" else None,
                     concurrency=int(x) if arrivals == "concurrency" else None, seed=seed)
        r = simulate(model, hw, d, w, scheduler, prefill).json(series=False)
        chips = r["chips"]
        occupancy = [p["kv"]["occupancy_mean"] for p in r["pools"]]
        points.append({"load": x, **{k: r[k] for k in ("ttft_s", "tpot_s", "e2e_s", "throughput_tokens_per_s",
                                                       "tokens_per_s_per_chip", "requests_per_s", "preemptions")},
                       "kv_occupancy_mean": max(occupancy),
                       "saturated": arrivals == "rate" and r["requests_per_s"] < SATURATED * r["offered_requests_per_s"]})
    return {"arrivals": arrivals, "chips": chips, "points": points}
