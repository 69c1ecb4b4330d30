"""What a JAX program on the GPU pays on the host, one mechanism each, to account for the GPU
validation's wall step (docs/validation.md "GPU"):

    python experiments/gpu_jax_overheads.py [--out experiments/results/gpu_jax_overheads.json]

- `dispatch`: one jitted call that takes a host model's whole weight tree (f32, as the reference
  step is captured) and does one trivial op, per call (`keep_unused=True` keeps every argument);
- `loop_trip`: a `lax.while_loop` whose trip count is a device value (as the reference's expert
  loop over the distinct routed experts), trivial body: the slope per trip between 1 and 101
  trips (each trip copies the condition back to the host before the next launch).

Each figure is the median of `--repeats` calls after warm-up, by wall clock with
`block_until_ready`. The output names the device it ran on. It runs on any JAX device (on the
CPU the figures are the CPU's, and say so).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from perfmodel_jax.hostbench import _time as hostbench_time

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("kimi-k3-host-small", "kimi-k3-host-large")
TRIPS = (1, 101)


def per_call(fn, repeats: int) -> float:
    """Median wall seconds of `fn()` (which blocks), after three warm-up calls."""
    return statistics.median(hostbench_time(fn, repeats, warmup=3))


def dispatch(model: str, repeats: int) -> tuple[float, int]:
    """(seconds per call, weight arrays) of a trivial jitted call taking `model`'s weight tree."""
    import jax
    import jax.numpy as jnp
    from perfmodel_kernels import reference as R
    from perfmodel.spec.loaders import load_model
    weights = R.init_weights(load_model(model), 0, dtype=jnp.float32)
    x = jnp.zeros((8,), jnp.float32)
    f = jax.jit(lambda w, x: x + 1.0, keep_unused=True)
    return per_call(lambda: f(weights, x).block_until_ready(), repeats), len(jax.tree_util.tree_leaves(weights))


def loop_trip(repeats: int) -> dict:
    """Seconds per trip of a while loop whose trip count is a device value."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def loop(n, x):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 1.0001 + 1.0), (0, x))[1]

    x = jnp.zeros((8,), jnp.float32)
    t = {n: per_call(lambda n=n: loop(jnp.int32(n), x).block_until_ready(), repeats) for n in TRIPS}
    return {"per_trip_s": (t[TRIPS[1]] - t[TRIPS[0]]) / (TRIPS[1] - TRIPS[0]), "call_s": {str(n): v for n, v in t.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "gpu_jax_overheads.json"))
    ap.add_argument("--repeats", type=int, default=51)
    a = ap.parse_args(argv)
    import jax
    dev = jax.devices()[0]
    doc = {"device": f"{dev.platform}: {dev.device_kind}", "jax": jax.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python " + " ".join(["experiments/gpu_jax_overheads.py", *(argv or sys.argv[1:])]),
           "repeats": a.repeats, "dispatch": {}, "loop_trip": loop_trip(a.repeats)}
    for m in MODELS:
        s, n = dispatch(m, a.repeats)
        doc["dispatch"][m] = {"call_s": s, "arrays": n}
        print(f"dispatch, {m} ({n} weight arrays): {s * 1e6:.1f} us a call")
    print(f"loop trip: {doc['loop_trip']['per_trip_s'] * 1e6:.2f} us a trip ({doc['device']})")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
