"""The kernel lists of a serving-engine prediction, for `predict` and `explain` (JSON fields
`kernels` and per op `kernels`: name, class, seconds, measured or physical, source)."""
from __future__ import annotations

from perfmodel.cost.components import graph_overlap_time
from perfmodel.engine.serving import kernels, paid_seconds
from perfmodel.graph import ops as ops_mod


def kernel_rows(model, hw, d) -> tuple[list[dict], object]:
    g = ops_mod.build(model, d)
    ks = kernels(model, hw, d, g)
    rows = [{"op_index": k.op, "op": g.name[k.op], "layer": int(g.layer[k.op]), "kernel": k.name, "class": k.cls,
             "seconds": k.seconds, "measured": k.measured, "source": k.source, "shape": k.point,
             **({"levels": [{"scope": s, "seconds": t} for s, t in k.levels]} if k.levels else {}),
             "exposed_s": paid, **({"stream": "aux"} if k.stream == "aux" else {})}
            for k, paid in zip(ks, paid_seconds(ks, g, graph_overlap_time(hw.components)))]
    return rows, g


def kernel_summary(model, hw, d) -> dict:
    """Per step: kernel count, their summed time, what of it the step does not pay (`hidden_s`:
    shared experts on the second stream under the routed experts; `overlap_hidden_s`: each main-stream
    kernel's part under the one before it, components.graph_kernel_overlap_s), the share of the time
    from measured tables, and each distinct kernel's count and total time."""
    g = ops_mod.build(model, d)
    ks = kernels(model, hw, d, g)   # summed from the kernels themselves: no row per kernel
    paid = paid_seconds(ks, g, graph_overlap_time(hw.components))
    total = sum(k.seconds for k in ks) or 1.0
    by: dict[str, dict] = {}
    for k in ks:
        e = by.get(k.name)
        if e is None:
            e = by[k.name] = {"kernel": k.name, "class": k.cls, "count": 0, "seconds": 0.0,
                              "measured": k.measured, "source": k.source}
        e["count"] += 1
        e["seconds"] += k.seconds
        e["measured"] = e["measured"] and k.measured
    hidden = sum(k.seconds - p for k, p in zip(ks, paid) if k.stream == "aux")
    overlap = sum(k.seconds - p for k, p in zip(ks, paid) if k.stream != "aux")
    return {"count": len(ks), "seconds": total, "hidden_s": hidden, "overlap_hidden_s": overlap,
            "measured_share": sum(k.seconds for k in ks if k.measured) / total,
            "by_kernel": sorted(by.values(), key=lambda e: -e["seconds"])}
