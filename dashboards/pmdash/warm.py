"""The simulator's compiled loops, ready before the first page: `python dashboards/pmdash/warm.py`
(run by `make setup`) or a background thread at server start (pmdash.common).

numba compiles a loop at its first call for the argument types it meets and caches the machine
code on disk (beside perfmodel/engine/megakernel_sim.py), so warming means calling each loop once
with the types the dashboard uses: a megakernel prediction without and with the step's events
(`megakernel_sim.run`) and a small batched sweep (`megakernel_sim.run_many`). The first time
after an install this takes about a minute; afterwards a process loads the cache in about a second.
"""
from __future__ import annotations

import time


def warm() -> float:
    """Compile (or load from numba's disk cache) the loops the dashboard calls; seconds taken."""
    t0 = time.perf_counter()
    from perfmodel.engine import megakernel_sim
    from perfmodel.search.batch import evaluate
    from perfmodel.spec.deployment import Deployment
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.spec.loaders import load_model
    from perfmodel.step.predict import predict
    megakernel_sim.compile_loops()
    model, hw = load_model("kimi-k3-mini"), load_hardware("tpu-v7")
    d = Deployment(devices=2, tp=2, ep=2, engine="megakernel")
    for record in (False, True):
        predict(model, hw, d, record=record)
    base = dict(devices=2, tp=2, ep=2, engine="megakernel", batch=1, context=4096, draft_rows=0, draft_cost=0.05)
    evaluate(model, hw, [dict(base, prefetch_mib=p) for p in (4, 8)])
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"perfmodel: the simulator's compiled loops are ready ({warm():.1f} s)")
