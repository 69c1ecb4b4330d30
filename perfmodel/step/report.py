"""Plain-text tables and the stable JSON form of predictions (schema in docs/json-schema.md)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from perfmodel.step.predict import Prediction

SCHEMA_VERSION = 2  # 2: sweep rows are flat (docs/sweep.md)


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def layer_summary(p: Prediction) -> str:
    """Per-layer-kind summary: count, mean time and bytes per layer, where the time goes."""
    kinds: dict[str, list] = {}
    for r in p.layers:
        kinds.setdefault(r.kind, []).append(r)
    rows = []
    for kind, rs in kinds.items():
        n = len(rs)
        mean = lambda f: sum(getattr(r, f) for r in rs) / n
        rows.append([kind, n, mean("time_s") * 1e6, mean("compute_s") * 1e6, mean("stall_s") * 1e6,
                     mean("collective_s") * 1e6, mean("overhead_s") * 1e6,
                     mean("static_bytes") / 1e6, mean("routed_bytes") / 1e6, mean("kv_bytes") / 1e6])
    return table(["layer kind", "n", "time us", "compute us", "dma stall us", "collective us",
                  "overhead us", "static MB", "routed MB", "kv MB"], rows)


def prediction_json(p: Prediction, layers: bool = True) -> dict:
    out = {"batch": p.deployment.batch, "step_s": p.step_s, "tokens_per_s": p.tokens_per_s,
           "bytes_per_device": p.bytes_per_device, "hbm_floor_s": p.hbm_floor_s,
           "compute_floor_s": p.compute_floor_s, "bound": p.bound,
           "hbm_utilisation": p.hbm_utilisation, "breakdown_s": p.breakdown_s}
    if p.ttft_s is not None:
        out["ttft_s"] = p.ttft_s
    if layers:
        out["layers"] = [dataclasses.asdict(r) for r in p.layers]
    return out


def deployment_json(d) -> dict:
    out = dataclasses.asdict(d)
    out["ep"] = d.expert_groups
    return out


def plain(x):
    """`x` as plain JSON types: numpy scalars and arrays become Python numbers and lists, tuples
    lists, keys strings; a non-finite number (an undefined ratio, say) becomes None (null)."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [plain(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if x is None or isinstance(x, (str, bool, int, float)):
        return x
    raise TypeError(f"{type(x).__name__} in JSON output")


def json_text(out: dict) -> str:
    """The --json form of a command's result: plain JSON (no NaN / Infinity), one object."""
    import json   # imported here: a command's plain output needs none
    return json.dumps(plain(out), indent=1, allow_nan=False) + "\n"
