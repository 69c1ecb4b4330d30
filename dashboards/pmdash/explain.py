"""Explain view: the step layer by layer (a stacked bar of each layer's compute, DMA stall,
collectives and overhead), one layer's ops on the DMA, compute and link lanes (a Gantt chart), and
that layer term by term as `perfmodel explain` gives it (bytes, FLOPs, each latency term with its
mechanism and source), with the command beside it.

The deployment comes from the form What-if uses (pmdash.deployment: the same inputs, the same cached
prediction), so Explain's step is What-if's for the same inputs. The terms are a compact table, each
term's source a numbered reference whose text opens on demand (a source is a few hundred characters,
shared by many terms).

Built from the prediction's per-layer rows and explain's JSON without naming their fields: a
per-layer time part or a term the model adds later appears without a change here.
"""
from __future__ import annotations

import shlex

import pandas as pd
import streamlit as st

from perfmodel.step.explain import explain

from . import charts
from . import common as c
from . import deployment
from .inputs import number_field

PART_LABELS = {"compute_s": "compute", "stall_s": "DMA stall", "collective_s": "collectives",
               "overhead_s": "launch / overhead"}
PART_COLORS = {"compute_s": "#1f77b4", "stall_s": "#ff7f0e", "collective_s": "#2ca02c", "overhead_s": "#9467bd"}
NOT_PARTS = ("time_s",)


def parts(layers: list[dict]) -> list[str]:
    """The per-layer time fields (seconds) that add up to a layer's time: every `*_s` but the total."""
    return [k for k in layers[0] if k.endswith("_s") and k not in NOT_PARTS] if layers else []


def label(part: str) -> str:
    return PART_LABELS.get(part, part.removesuffix("_s").replace("_", " "))


@st.cache_data(show_spinner=False, max_entries=64)
def explained(m_ref: tuple, h_ref: tuple, key: tuple, vmem: float | None, layer: int) -> dict:
    """`perfmodel explain` of one layer, as its JSON."""
    return explain(c.model_for(m_ref, key), c.resolve_hw(h_ref, vmem), c.make_deployment(key), layer)


@st.cache_resource(show_spinner=False, max_entries=32)
def layers_figure(m_ref, h_ref, key, vmem, layer: int) -> dict:
    """A stacked bar per layer of its time parts, the explained layer marked; a click on a bar picks it."""
    rows = c.predict_cached(m_ref, h_ref, key, vmem)["layers"]
    drawn = [p for p in parts(rows) if any(r[p] > 0 for r in rows)]
    bars = [{"series": label(p), "layer": r["layer"], "kind": r["kind"], "us": r[p] * 1e6, "order": i}
            for i, p in enumerate(drawn) for r in rows if r[p] > 0]  # a part of no time draws nothing
    scale = charts.colors({label(p): PART_COLORS.get(p, charts.color(p, i)) for i, p in enumerate(drawn)})
    x = charts.quant("layer", "layer (0 = embedding, last = head); click a bar to explain it",
                     scale={"domain": [rows[0]["layer"] - 0.5, rows[-1]["layer"] + 0.5], "nice": False, "zero": False},
                     axis={"tickMinStep": 1})
    mark = [{"series": "explained below", "layer": layer, "us": r["time_s"] * 1e6, "label": f"layer {layer}"}
            for r in rows if r["layer"] == layer]
    width = {"expr": f"0.9 * width / {len(rows)}"}
    return {"height": 340, "config": {"legend": charts.LEGEND}, "layer": [
        {**charts.layer(bars, {"type": "bar", "width": width}, x=x,
                        y=charts.quant("us", "time in the step (us)", stack="zero"),
                        color=charts.nominal("series", "", scale=scale, sort=scale["domain"]), order={"field": "order"},
                        tooltip=charts.tip(("layer", "layer"), ("kind", "kind"), ("us", "us", ".2f"))),
         "params": [{"name": "bar", "select": {"type": "point", "fields": ["layer"]}}]},
        charts.layer(mark, {"type": "point", "shape": "triangle-down", "size": 200, "filled": True, "color": "black",
                            "yOffset": -10}, x=x, y=charts.quant("us", "time in the step (us)")),
        charts.layer(mark, {"type": "text", "dy": -26}, x=x, y=charts.quant("us", "time in the step (us)"),
                     text={"field": "label"})]}


@c.callback
def pick_layer() -> None:
    """Chart selection callback: the clicked layer is the one explained."""
    pts = st.session_state["ex_layers_pick"].selection.get("bar", [])
    if pts:
        st.session_state["ex_layer"] = str(int(pts[0]["layer"]))


def ops_table(out: dict) -> pd.DataFrame:
    """One row per op: every number explain gives (bytes in KB, FLOPs in MFLOP, times in us)."""
    rows = []
    for o in out["ops"]:
        row = {"op": o["op"], "time_us": (o["end_s"] - o["start_s"]) * 1e6, "waited on": o["waited_on"]}
        for k, v in o.items():
            if isinstance(v, (int, float)) and k not in ("start_s", "end_s"):
                row[k.replace("_bytes", " KB") if k.endswith("_bytes") else "MFLOP" if k == "flops" else k] = (
                    v / 1e3 if k.endswith("_bytes") else v / 1e6 if k == "flops" else v * 1e6 if k.endswith("_s") else v)
        for k, v in o.get("waits_s", {}).items():
            row[f"wait {k} us"] = v * 1e6
        rows.append(row)
    return pd.DataFrame(rows)


def terms_table(out: dict) -> pd.DataFrame:
    """One row per latency term of each op, with every field explain gives for it (the download)."""
    rows = []
    for o in out["ops"]:
        for t in o["terms"]:
            row = {"op": o["op"], "term": t["term"], "us (alone)": t["seconds"] * 1e6}
            row.update({k: v for k, v in t.items() if k not in ("term", "seconds")})
            rows.append(row)
    return pd.DataFrame(rows)


def compact_terms(terms: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The terms table for the page, a line a term: every field but long texts (a source is hundreds of
    characters), each source a numbered reference "[n] what" into the list returned beside it."""
    short = terms.copy()
    sources: list[str] = []
    if "source" in short:
        short["source"], sources = c.numbered_sources(list(short["source"].fillna("")))
    long = [k for k in short if k not in ("op", "term", "source") and short[k].astype(str).str.len().max() > 80]
    return short.drop(columns=long), sources


@c.callback
def use_whatif() -> None:
    """Button callback: Explain takes What-if's deployment (its form's values)."""
    deployment.copy_from("wi", "ex")


def render() -> None:
    st.header("Explain: the step layer by layer, each term with its mechanism")
    st.caption("The deployment is set as in What-if (the same form, the same prediction): the same inputs give the "
               "same step time in both.")
    x, errs = deployment.form("ex", compact=True)
    st.button("Use What-if's deployment", key="ex_use_wi_btn", on_click=use_whatif,
              help="Copy every setting of the What-if view's deployment here.")
    if x is None:
        return
    model, hw, key, vmem = x["model"], x["hw"], x["key"], x["vmem"]
    m_ref, h_ref = c.model_ref(model), c.hardware_ref(hw)
    with st.spinner("Running the model..."):
        p = c.predict_cached(m_ref, h_ref, key, vmem)
    if "error" in p:
        st.error(f"This deployment cannot run: {p['error']}")
        return
    c.init(ex_layer="1")
    last = p["layers"][-1]["layer"]
    layer = number_field(st.columns(4)[0], f"Layer to explain (0 = embedding, {last} = head)", "ex_layer", lo=0,
                         hi=last, errors=errs)
    if layer is None:
        return
    row = next(r for r in p["layers"] if r["layer"] == layer)
    c.figures_line([
        ("step time", f"{p['step_s'] * 1e3:.3f} ms"), ("tokens/s", f"{p['tokens_per_s']:,.0f}"),
        (f"layer {layer} ({row['kind']}) in the step", f"{row['time_s'] * 1e6:.2f} us"),
        ("share of the step", f"{row['time_s'] / p['step_s']:.1%}"),
        ("largest part", label(max(parts([row]), key=lambda k: row[k], default="-")))])
    charts.show(layers_figure(m_ref, h_ref, key, vmem, layer), "ex_layers_pick", on_select=pick_layer,
                selection_mode="bar")
    st.subheader(f"Layer {layer} ({row['kind']}): its ops on the DMA, compute and link lanes")
    with st.spinner("Simulating the step's events..."):
        spec, n, _ = charts.gantt(m_ref, h_ref, key, vmem, layer, layer, height=260)
    charts.show(spec, "ex_gantt")
    st.caption(f"{n} bars (a weight stream's tile copies merged into one); hover for each op's start and length.")
    out = explained(m_ref, h_ref, key, vmem, layer)
    cmd = ["perfmodel", "explain"] + c.cli_args(model, hw, key, vmem) + [
        "--batch", str(dict(key)["batch"]), "--layer", str(layer), "--json"]
    st.markdown("**Terms: each op's latency terms alone, their mechanism and source**")
    st.caption("An op's terms are its costs in isolation; in the step they overlap (the Gantt above), so they "
               "do not add up to the layer's time. Each source is a numbered reference; their texts open below.")
    c.show_command(shlex.join(cmd))
    terms = terms_table(out)
    c.downloads(terms, f"explain_layer{layer}_terms", "ex_terms_dl", {"explain": out})
    short, sources = compact_terms(terms)
    c.static_table(short, {"us (alone)": ".3f"})
    c.sources_expander("ex_sources_exp", sources, "Sources of these terms")
    ops = st.expander("Ops: bytes, FLOPs, time and what each waited on", key="ex_ops_exp", on_change="rerun")
    if ops.open:
        with ops:
            st.dataframe(ops_table(out), hide_index=True, key="ex_ops")
