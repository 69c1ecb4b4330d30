"""What-if view: tune prefetch depth, expert slots, VMEM, batch, context, engine (with a GPU serving
engine's kernels and the KV cache format), steps per call, speculative decoding.

Inputs are strict text fields; a bad one keeps the outputs of the last valid inputs, greyed out.
The headline (predicted tokens/s beside a measurement only when one matches every setting) sits
above five lazy tabs, one picture and one question each: where the step goes, which ring and
expert slots to pick, what the prefetch depth does, when each op runs, how close to the roofs.
Only the open tab runs and is drawn, so an input change redraws the headline and one chart.
A configuration the model refuses shows its on-chip budget in MiB and the nearest ones that run,
and the ring x slots map and the prefetch sweep (what fits) stay live.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import streamlit as st

from perfmodel.search.batch import evaluate

from . import charts
from . import common as c
from . import deployment, fit, measured
from .charts import LEGEND, STAR_SHAPE, color, colors, layer, nominal, quant, rows, show, tip
from .inputs import current_or_last, maybe_stale

KIND_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
VMEM_FIELDS = ("prefetch_bytes", "expert_slots", "onchip_bytes")
FIELD_KEYS = {k: f"wi_{name}" for k, name in deployment.KEY_NAMES.items()}
TABS = ("Step breakdown", "Ring x expert slots", "Prefetch depth", "Timeline", "Roofline")
RIGHT_EXTENT = 40  # px of the prefetch sweep's right axis (its labels; the title beside them)
HEAT_METRICS = {"tokens/s": ("tokens_per_s", False), "step time (ms)": ("step_ms", True)}  # column, reversed


# ----- inputs: the deployment form (pmdash.deployment, shared with Explain) ------------------------

def inputs() -> tuple[dict | None, list[str]]:
    c.init(wi_tab=TABS[0])
    return deployment.form("wi")


def refs(x: dict) -> tuple:
    return c.model_ref(x["model"]), c.hardware_ref(x["hw"]), x["key"], x["vmem"]


@c.callback
def apply(key: tuple, vmem: float | None) -> None:
    """Button callback: put a suggested configuration into the fields."""
    for k, v in dict(key).items():
        if k in FIELD_KEYS:
            st.session_state[FIELD_KEYS[k]] = "" if v is None else f"{v:g}"
    st.session_state["wi_vmem"] = "" if vmem is None else f"{vmem:g}"


@c.callback
def apply_measured(row: dict) -> None:
    """Button callback: the settings of a measurement (those it leaves out: the defaults)."""
    val = lambda k, d: d if measured._value(row, k) is None else measured._value(row, k)
    devices = int(val("devices", int(st.session_state["wi_devices"] or 1)))
    for k, v in (("devices", devices), ("tp", int(val("tp", devices))), ("ep", int(val("ep", devices))),
                 ("batch", int(row["batch"])), ("context", int(val("context", 4096))),
                 ("steps_per_call", int(val("steps_per_call", 1)))):
        st.session_state[FIELD_KEYS[k]] = str(v)
    st.session_state["wi_engine"] = row["engine"]
    st.session_state["wi_serving"] = row.get("serving_engine") or c.GENERIC
    st.session_state["wi_kv"] = row.get("kv_cache") or c.MODEL_KV
    for k, field in (("prefetch_mib", "wi_prefetch"), ("expert_slots", "wi_slots"), ("vmem_mib", "wi_vmem")):
        st.session_state[field] = "" if measured._value(row, k) is None else f"{measured._value(row, k):g}"
    draft = int(val("draft_rows", 0))
    st.session_state["wi_spec"] = draft > 0
    if draft:
        st.session_state["wi_draft"] = str(draft)
        st.session_state["wi_acc"] = float(val("acceptance_length", c.SPEC_ACCEPTANCE))


def infeasible(x: dict, r: dict) -> None:
    """One error box: why it cannot run, the on-chip budget in MiB, and the nearest configurations that run."""
    m_ref, h_ref, key, vmem = refs(x)
    lines = [f"**This configuration cannot run.** {r['error']}"]
    if r.get("field") in VMEM_FIELDS:
        b = fit.onchip_budget(m_ref, h_ref, key, vmem)
        if b:
            lines.append(fit.budget_text(b))
    st.error("\n\n".join(lines))
    near = fit.nearest_valid(m_ref, h_ref, key, vmem, r.get("field", ""))
    if near:
        st.markdown("**Nearest configurations that run:**")
        for i, n in enumerate(near):
            a, b = st.columns([3, 1])
            a.markdown(f"- {n['change']}: {n['tokens_per_s']:,.0f} tokens/s")
            b.button("Use this", key=f"wi_near_{i}", on_click=apply, args=(n["key"], n["vmem_mib"]))


# ----- the page -----------------------------------------------------------------------------------

def render() -> None:
    st.header("What-if: where the decode step goes")
    x, errs = inputs()
    reason = "; ".join(errs) if errs else None
    r = None
    if x is not None:
        with st.spinner("Running the model..."):
            r = c.predict_cached(*refs(x))
        if "error" in r:
            infeasible(x, r)
            reason = "this configuration cannot run"
    good, stale = current_or_last("wi", x if reason is None else None, reason)
    if good is None:
        st.info("No valid configuration yet: fix the inputs above.")
        return
    rg = c.predict_cached(*refs(good))
    rep = headline(good, rg, stale)
    # the ring x slots map and the prefetch sweep stay live for an on-chip budget error: they show what fits
    live = x if x is not None and r.get("field") in VMEM_FIELDS else good
    sections = {TABS[0]: lambda: breakdown_section(good, stale), TABS[1]: lambda: heat_section(live, stale if live is good else None),
                TABS[2]: lambda: prefetch_section(live, stale if live is good else None),
                TABS[3]: lambda: timeline_section(good, stale), TABS[4]: lambda: roofline_section(good, stale)}
    for tab, name in zip(st.tabs(TABS, key="wi_tab", on_change="rerun"), TABS):
        if tab.open:
            with tab:
                sections[name]()
    headline_files(good, rg, rep, stale)


def deployment_settings(x: dict) -> tuple[dict, dict | None]:
    """The deployment's settings as measurements state them (ring, slots, VMEM as resolved; megakernel
    only) and the values the model's KV cache and the on-chip settings resolve to by default."""
    m_ref, h_ref, key, vmem = refs(x)
    mine, defaults = measured.settings(x["model"], x["hw"], key, c.load_model_ref(m_ref).formats["kv_cache"].name)
    if dict(key)["engine"] != "megakernel":
        return mine, defaults
    b = fit.onchip_budget(m_ref, h_ref, key, vmem)
    b0 = fit.onchip_budget(m_ref, h_ref, c.with_key(key, prefetch_mib=None, expert_slots=None), None)
    if not (b and b0):
        return mine, defaults
    resolved = lambda bb: {"prefetch_mib": bb["ring_mib"], "expert_slots": bb["slots"], "vmem_mib": bb["onchip_mib"]}
    return mine | resolved(b), defaults | resolved(b0)


def headline(x: dict, r: dict, stale: str | None) -> dict | None:
    """The predicted numbers, and the measurement beside them when one matches every setting (else the
    nearest one and what differs); returns that measurement."""
    mine, defaults = deployment_settings(x)
    exact, near, diffs = measured.reference(measured.all_points(), mine, defaults)
    rep = exact[0] if exact else None
    with maybe_stale(stale, "wi_head"):
        m = st.columns([1, 1, 1, 2])
        m[0].metric("tokens/s (predicted)", f"{r['tokens_per_s']:,.0f}")
        if rep is not None:
            err = r["tokens_per_s"] / rep["tokens_per_s"] - 1
            m[1].metric("measured tokens/s", f"{rep['tokens_per_s']:,.0f}", delta=f"{err:+.1%} predicted",
                        delta_color="off", help=f"{rep['origin']} ({rep['source']}): every setting matches (those "
                        "it does not state at perfmodel's defaults, assumed).")
        else:
            m[1].metric("measured tokens/s", "none", help="No published or measured run matches every setting "
                        "of this deployment.")
        m[2].metric("step time", f"{r['step_s'] * 1e3:.3f} ms")
        m[3].markdown(f"bound: **{r['bound']}**  \nHBM floor: **{r['hbm_floor_s'] * 1e3:.3f} ms**  \n"
                      f"HBM utilisation: **{r['hbm_utilisation']:.0%}**")
        if rep is not None:
            a, b = st.columns([5, 1])
            told = measured.assumed(rep, mine, defaults)
            a.caption(f"Measured: {rep['tokens_per_s']:,.0f} tokens/s, {rep['origin']} ({rep['source']}); "
                      f"the prediction is {err:+.1%} off."
                      + (" Not stated by the measurement, assumed at perfmodel's defaults: "
                         + ", ".join(f"{label} {v}" for label, v in told) + "." if told else ""))
            provenance_menu(b, rep)
        elif near is not None:
            a, b, d = st.columns([4, 1, 1])
            a.caption(f"Nearest measurement: {near['tokens_per_s']:,.0f} tokens/s at batch {int(near['batch'])}, "
                      f"{near['origin']} ({near['source']}); yours differs in {measured.differs_text(diffs)}. "
                      "Not a reference for these settings.")
            b.button("Use its settings", key="wi_meas_btn", on_click=apply_measured, args=(near,))
            provenance_menu(d, near)
    return rep


def provenance_menu(col, row: dict) -> None:
    """Where a measurement comes from (machine or chip, JAX version, date, command), in a popover."""
    file, meta = measured.provenance(row["origin"], row["kind"])
    with col.popover("Provenance", key="wi_meas_src_menu"):
        st.markdown(f"**{row['origin']}** ({file})  \n" + measured.provenance_markdown(meta))


def headline_files(x: dict, r: dict, rep: dict | None, stale: str | None) -> None:
    """The headline's numbers as files and the command that prints them (under the tabs: the picture first)."""
    k = dict(x["key"])
    summary = {kk: r[kk] for kk in ("tokens_per_s", "step_s", "bound", "hbm_floor_s", "compute_floor_s",
                                    "hbm_utilisation", "bytes_per_device")}
    summary.update({f"{kk}_s": v for kk, v in r["breakdown_s"].items()})
    if rep is not None:
        summary.update(measured_tokens_per_s=rep["tokens_per_s"], measured_source=rep["origin"])
    with maybe_stale(stale, "wi_files"):
        st.markdown("**The headline numbers**")
        c.downloads(pd.DataFrame([summary]), "whatif_prediction", "wi_pred_dl",
                    {"model": x["model"], "hardware": x["hw"], "vmem_mib": x["vmem"], "inputs": k})
        c.show_command(c.cli_predict(x["model"], x["hw"], x["key"], [k["batch"]], x["vmem"]))


# ----- breakdown ----------------------------------------------------------------------------------

@st.cache_resource(show_spinner=False, max_entries=64)
def breakdown_figure(m_ref, h_ref, key, vmem, engine) -> tuple[dict, pd.DataFrame, dict, dict]:
    """A stacked bar per engine, one segment per cause (a cause the model adds later is drawn too)."""
    r = c.predict_cached(m_ref, h_ref, key, vmem)  # the headline's prediction, not another run
    other = "multikernel" if engine == "megakernel" else "megakernel"
    ro = c.predict_cached(m_ref, h_ref, c.with_key(key, engine=other, serving_engine=None), vmem)  # its generic self
    bars = {engine + " (selected)": r}
    if "error" not in ro:
        bars[other] = ro
    table = [{"engine": label, "cause": cause, "label": c.CAUSE_LABELS.get(cause, cause), "time_ms": s * 1e3,
              "share_of_step": s / res["step_s"] if res["step_s"] else 0.0}
             for label, res in bars.items() for cause, s in res["breakdown_s"].items()]
    causes = list(dict.fromkeys(list(c.CAUSE_LABELS) + [t["cause"] for t in table]))
    drawn = [cause for cause in causes if any(t["cause"] == cause and t["time_ms"] > 0 for t in table)]
    order = {cause: i for i, cause in enumerate(drawn)}
    data = [dict(t, series=t["label"], order=order[t["cause"]]) for t in table if t["cause"] in order]
    scale = colors({c.CAUSE_LABELS.get(k, k): color(k, causes.index(k)) for k in drawn})
    spec = {"height": 380, "config": {"legend": LEGEND}, "layer": [layer(
        data, "bar", x=nominal("engine", "", sort=list(bars), axis={"labelAngle": 0}),
        y=quant("time_ms", "time per decode step (ms)", stack="zero"),
        color=nominal("series", "", scale=scale, sort=scale["domain"]), order={"field": "order"},
        tooltip=tip(("engine", "engine"), ("time_ms", "ms", ".4f"), ("share_of_step", "of the step", ".1%")))]}
    return spec, pd.DataFrame(table), r, ro


def gain_text(mega: dict, multi: dict) -> str:
    """The megakernel's gain over the multi-kernel engine at the same settings, by cause."""
    gain = multi["step_s"] - mega["step_s"]
    causes = set(mega["breakdown_s"]) | set(multi["breakdown_s"])
    by = sorted(((multi["breakdown_s"].get(k, 0.0) - mega["breakdown_s"].get(k, 0.0), k) for k in causes),
                key=lambda t: -abs(t[0]))
    parts = ", ".join(f"{c.CAUSE_LABELS.get(k, k)} {d * 1e3:+.3f} ms" for d, k in by[:3] if abs(d) > 1e-9)
    return (f"Megakernel gain at these settings (multi-kernel step - megakernel step, `perfmodel predict --gain`): "
            f"**{gain * 1e3:+.3f} ms** ({gain / multi['step_s']:+.1%} of the multi-kernel step)"
            + (f"; by cause: {parts}." if parts else "."))


def breakdown_section(x: dict, stale: str | None) -> None:
    with maybe_stale(stale, "wi_bd"):
        with st.spinner("Running the other engine..."):
            spec, df, r, ro = breakdown_figure(*refs(x), x["engine"])
        show(spec, "wi_breakdown")
        if "error" not in ro:
            mega, multi = (r, ro) if x["engine"] == "megakernel" else (ro, r)
            st.caption(gain_text(mega, multi))
        else:
            other = "multikernel" if x["engine"] == "megakernel" else "megakernel"
            st.caption(f"{other} at these settings: {ro['error']}")
        c.downloads(df, "whatif_breakdown", "wi_bd_dl", {"inputs": dict(x["key"]), "model": x["model"],
                                                         "hardware": x["hw"], "vmem_mib": x["vmem"]})


# ----- ring depth x expert slots ------------------------------------------------------------------

def depths_for(hw, *extra_mib: float) -> tuple[float, ...]:
    """Ring-tile multiples up to the on-chip buffer, and the depths asked for."""
    tile = hw.dma_tile_bytes / c.MiB
    cap = hw.onchip_bytes / c.MiB
    ks = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 24, 32, 48, 64)
    return tuple(sorted({round(k * tile, 6) for k in ks if k * tile <= cap} | {round(x, 6) for x in extra_mib}))


def slot_counts(top_k: int, *extra: int) -> tuple[int, ...]:
    return tuple(sorted({s for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if s <= top_k} | {top_k, *extra}))


def settings_of(key: tuple, vmem: float | None) -> dict:
    """A deployment key as the settings of perfmodel.search.batch.evaluate."""
    k = dict(key)
    return dict(devices=k["devices"], tp=k["tp"], ep=k["ep"], engine=k["engine"], batch=k["batch"],
                context=k["context"], draft_rows=k["draft_rows"], acceptance_length=k["acceptance_length"],
                draft_cost=0.05, steps_per_call=k["steps_per_call"], prefetch_mib=k["prefetch_mib"],
                expert_slots=k["expert_slots"], vmem_mib=vmem)


@st.cache_data(show_spinner=False, max_entries=32)
def heat_grid(m_ref, h_ref, key, vmem) -> dict:
    """Step time and tokens/s for every ring depth x expert slot count (one batched simulation per op
    graph: perfmodel.search.batch.evaluate), with the current, default and best cells."""
    model, chip, hw = c.model_for(m_ref, key), c.load_hardware_ref(h_ref), c.resolve_hw(h_ref, vmem)
    k = dict(key)
    top_k = model.moe.top_k if model.moe else 1
    cur = fit.onchip_budget(m_ref, h_ref, key, vmem)
    dflt = fit.onchip_budget(m_ref, h_ref, c.with_key(key, prefetch_mib=None, expert_slots=None), vmem)
    half = hw.onchip_bytes / 2 / c.MiB
    cur_depth, cur_slots = k["prefetch_mib"] or half, k["expert_slots"] or (cur or dflt or {}).get("slots", top_k)
    def_slots = (dflt or {}).get("slots", top_k)
    depths, slots = depths_for(hw, cur_depth, half), slot_counts(top_k, cur_slots, def_slots)
    base = settings_of(key, vmem)
    rows = evaluate(model, chip, [dict(base, prefetch_mib=d, expert_slots=s) for s in slots for d in depths])
    step = np.array([r["step_s"] if r["status"] == "ok" else np.nan for r in rows], float).reshape(len(slots), -1)
    tps = np.array([r["tokens_per_s"] if r["status"] == "ok" else np.nan for r in rows], float).reshape(len(slots), -1)
    why = next((r["reason"] for r in rows if r["status"] != "ok" and r["constraint"] != "vmem"), None)
    best = np.unravel_index(np.nanargmin(step), step.shape) if np.isfinite(step).any() else None
    at = lambda d, s: (slots.index(s), depths.index(round(d, 6)))
    return {"depths": depths, "slots": slots, "step_s": step, "tokens_per_s": tps, "other_error": why,
            "current": at(cur_depth, cur_slots), "default": at(half, def_slots),
            "best": None if best is None else (int(best[0]), int(best[1]))}


@st.cache_resource(show_spinner=False, max_entries=32)
def heat_figure(m_ref, h_ref, key, vmem, metric: str) -> dict:
    """Ring depth x expert slots, coloured by `metric`, cells beyond the on-chip buffer blank with a red line on
    the boundary; the current, default and best cells marked. A click on a cell or a mark selects it."""
    g = heat_grid(m_ref, h_ref, key, vmem)
    col, reverse = HEAT_METRICS[metric]
    z = g["step_s"] * 1e3 if col == "step_ms" else g["tokens_per_s"]
    xs, ys = [f"{d:g}" for d in g["depths"]], [str(s) for s in g["slots"]]
    ii, jj = np.nonzero(np.isfinite(g["step_s"]))
    cells = rows(series="cells", i0=jj - 0.5, i1=jj + 0.5, j0=ii - 0.5, j1=ii + 0.5, ring=[xs[k] for k in jj],
                 slots=[ys[k] for k in ii], value=z[ii, jj])
    # the on-chip boundary: right of the line the ring and the expert buffers do not fit
    edge = []
    for i in range(len(ys)):
        ok = np.flatnonzero(np.isfinite(g["step_s"][i]))
        e = (ok.max() if len(ok) else -1) + 0.5
        edge += [(e, i - 0.5), (e, i + 0.5)]
    marks = [(name, cell, shape) for name, cell, shape in (("default", g["default"], "circle"),
             ("current", g["current"], "diamond"), ("best", g["best"], STAR_SHAPE)) if cell is not None]
    at = rows(series=[m[0] for m in marks], shape=[m[2] for m in marks], i=[m[1][1] for m in marks],
              j=[m[1][0] for m in marks], ring=[xs[m[1][1]] for m in marks], slots=[ys[m[1][0]] for m in marks],
              value=[z[m[1]] for m in marks])
    named = [{"series": "label", "i": i, "j": j, "label": " = ".join(r["series"] for r in at if (r["i"], r["j"]) == (i, j))}
             for i, j in dict.fromkeys((r["i"], r["j"]) for r in at)]  # one label a cell: "default = current"
    labels = lambda names: {"labelExpr": f"{names}[datum.value]", "values": list(range(len(names))),  # noqa: E731
                            "grid": False}
    x = quant("i0", "prefetch depth (MiB of weight ring per core)", scale={"domain": [-0.5, len(xs) - 0.5], "nice": False,
              "zero": False}, axis=labels(xs))
    y = quant("j0", "expert slots", scale={"domain": [-0.5, len(ys) - 0.5], "nice": False, "zero": False},
              axis=labels(ys))
    where = tip(("ring", "ring (MiB)"), ("slots", "slots"), ("value", metric, ".4g"))  # not the axes' titles
    pick = lambda name: [{"name": name, "select": {"type": "point", "fields": ["ring", "slots"]}}]  # noqa: E731
    spec = {"height": 420, "config": {"legend": LEGEND}, "layer": [
        {**layer(cells, "rect", x=x, x2={"field": "i1"}, y=y, y2={"field": "j1"},
                 color=quant("value", metric, scale={"scheme": "viridis", "reverse": reverse},
                             legend={"orient": "right", "direction": "vertical"}),
                 tooltip=where), "params": pick("cell")},
        layer(rows(series="on-chip limit", e=[p[0] for p in edge], f=[p[1] for p in edge], k=list(range(len(edge)))),
              {"type": "line", "color": "#d62728", "strokeWidth": 3}, x={"field": "e", "type": "quantitative"},
              y={"field": "f", "type": "quantitative"}, order={"field": "k"}, tooltip=tip()),
        {**layer(at, {"type": "point", "size": 260, "filled": True, "stroke": "black", "strokeWidth": 2},
                 x={"field": "i", "type": "quantitative"}, y={"field": "j", "type": "quantitative"},
                 shape={"field": "shape", "type": "nominal", "scale": None},
                 fill={"field": "series", "type": "nominal", "scale": colors(
                     {"default": "#ffffff", "current": "#ffffff", "best": "#d62728"}), "legend": None},
                 tooltip=where), "params": pick("mark")},
        layer(named, {"type": "text", "dy": -18, "color": "black"}, x={"field": "i", "type": "quantitative"},
              y={"field": "j", "type": "quantitative"}, text={"field": "label"})]}
    return spec


@c.callback
def pick_cell() -> None:
    """Chart selection callback: the clicked cell's (or mark's) ring depth and slots go into the fields."""
    chosen = st.session_state["wi_heat_pick"].selection
    pts = [p for name in ("cell", "mark") for p in chosen.get(name, []) if "ring" in p and "slots" in p]
    if pts:
        st.session_state["wi_prefetch"], st.session_state["wi_slots"] = f"{float(pts[0]['ring']):g}", str(int(pts[0]["slots"]))


def heat_section(x: dict, stale: str | None) -> None:
    if x["engine"] != "megakernel":
        st.info("The ring and the expert slots are megakernel settings: select the megakernel engine to map them.")
        return
    m_ref, h_ref, key, vmem = refs(x)
    c.init(wi_heat_z="tokens/s")
    with maybe_stale(stale, "wi_heat"), st.spinner("Simulating every ring depth x expert slot count..."):
        g = heat_grid(m_ref, h_ref, key, vmem)
        if g["best"] is None:
            st.warning("No ring depth and expert slot count fits: " + (g["other_error"] or "see the message above."))
            return
        metric = st.radio("Colour", list(HEAT_METRICS), horizontal=True, key="wi_heat_z")
        show(heat_figure(m_ref, h_ref, key, vmem, metric), "wi_heat_pick", on_select=pick_cell,
             selection_mode=["cell", "mark"])
        (bs, bd), (cs, cd) = g["best"], g["current"]
        best_tps, cur_tps = g["tokens_per_s"][bs, bd], g["tokens_per_s"][cs, cd]
        st.caption(f"**Best: a {g['depths'][bd]:g} MiB ring with {g['slots'][bs]} expert slots, {best_tps:,.0f} "
                   f"tokens/s** ({best_tps / cur_tps - 1:+.1%} against the current {g['depths'][cd]:g} MiB / "
                   f"{g['slots'][cs]} slots). Right of the red line the ring and the expert buffers exceed the "
                   "on-chip buffer. Click a cell to use its ring and slots.")
        measured_sweep()
        rows = [{"prefetch_mib": d, "expert_slots": s, "step_s": g["step_s"][i, j], "tokens_per_s": g["tokens_per_s"][i, j]}
                for i, s in enumerate(g["slots"]) for j, d in enumerate(g["depths"])]
        c.downloads(pd.DataFrame(rows), "whatif_ring_slots", "wi_heat_dl", {"model": x["model"], "hardware": x["hw"],
                                                                           "vmem_mib": vmem, "inputs": dict(key)})
        c.show_command(c.cli_sweep(x["model"], x["hw"], c.with_key(key, expert_slots=None), g["depths"], vmem,
                                   slots=g["slots"]))


SWEPT = {"depth": ("depth", "ring depth (banks)", "wi_sweep_measured"),
         "expert_slots": ("slots", "expert slots", "wi_slots_measured")}


def measured_sweep() -> None:
    """This project's ring depth and expert slot sweeps on a real TPU (experiments/validate_tpu.py's sweep
    families: one knob varied, the others held): measured tokens/s per ring
    depth and per slot count, a series per family, beside the model's prediction for each; or a line
    saying none is measured yet."""
    t = measured.tpu_results()
    sweeps = t["sweeps"] if t is not None else []
    where = c.shown_path(measured.TPU_RUNS_JSON)
    if not sweeps:
        st.caption(f"Measured: no ring depth x expert slot sweep on a real chip yet ({where} has no sweep record "
                   "compared by `python experiments/validate_tpu.py`; `python experiments/tpu_megakernel.py --only "
                   "sweep` on a lent TPU measures one, and it is drawn here beside the map). Until then the map is "
                   "the model's alone.")
        return
    for knob, (field, title, key) in SWEPT.items():
        fams = [w for w in sweeps if w["knob"] == knob]
        if not fams:
            continue
        x, y = quant(field, title), quant("tokens_per_s", "tokens/s")
        tooltip = tip((field, title), ("tokens_per_s", "tokens/s", ",.0f"))
        layers = []
        for kind, mark in (("predicted", {"type": "line", "strokeDash": [6, 3]}),
                           ("measured", {"type": "point", "shape": charts.SOURCE_SHAPES["measured by this project"],
                                         "filled": True, "size": 80})):
            data = [r for w in fams for r in rows(
                series=f"{sweep_label(w)}, {kind}", **{field: list(w["values"])},
                tokens_per_s=[w["batch"] / s for s in w[f"{kind}_s"]])]
            layers.append(layer(data, mark, x=x, y=y, color=nominal("series", ""), tooltip=tooltip))
        show({"height": 220, "layer": layers, "config": {"legend": LEGEND}}, key)
    kinds = ", ".join(dict.fromkeys(f"{w['slice']} {w['format']}" for w in sweeps))
    st.caption(f"Measured on TPU {t['meta'].get('chip', '')} ({where}, up to {t['meta'].get('date', '')[:10]}): "
               f"{kinds}, each series one knob varied with the others held (squares: measured "
               "by this project, a point's median over its runs; dashed: predicted; `python "
               "experiments/validate_tpu.py` prints each with its optimum and gain).")


def sweep_label(w: dict) -> str:
    """A sweep family in a legend: "k3-tp32-core, batch 1, 2 slots, 32768-row banks, word decode,
    at 6578c2f/a2402e8" (the commits its runs ran at: one kernel's code)."""
    held = {"depth": f"depth {w['others'].get('depth')}", "expert_slots": f"{w['others'].get('expert_slots')} slots",
            "bank_rows": f"{w['others'].get('bank_rows')}-row banks"}
    parts = [w["slice"], f"batch {w['batch']}", *(held[k] for k in w["others"])]
    parts += ["word decode"] if w.get("expert_decode") == "e2m1_words" else []
    return ", ".join(parts + ([f"at {'/'.join(w['commits'])}"] if w.get("commits") else []))


# ----- timeline -----------------------------------------------------------------------------------

@st.fragment
def timeline_section(x: dict, stale: str | None) -> None:
    m_ref, h_ref, key, vmem = refs(x)
    r = c.predict_cached(m_ref, h_ref, key, vmem)
    layers = [row["layer"] for row in r["layers"]]
    first = layers[1] if len(layers) > 1 else layers[0]
    with maybe_stale(stale, "wi_tl"):
        lo, hi = st.select_slider(f"Layers shown (op by op up to {charts.EVENT_LAYERS} layers, one bar per layer "
                                  "beyond)", options=layers,
                                  value=(first, layers[min(layers.index(first) + charts.DEFAULT_LAYERS - 1,
                                                           len(layers) - 1)]),
                                  key=f"wi_layers_{len(layers)}")  # another model: a fresh range
        with st.spinner("Drawing the timeline..."):
            spec, n, by_op = charts.gantt(m_ref, h_ref, key, vmem, lo, hi)
        show(spec, "wi_timeline")
        unit = "op bars (a weight stream's tile copies merged)" if by_op else \
            "layer spans (one bar per layer and lane; narrow the range for ops)"
        st.caption(f"{n} {unit} in layers {lo}..{hi}; scroll to zoom, drag to pan, double-click to reset.")
        menu = c.download_menu("wi_tl_dl", "Download trace / events")
        menu.download_button("Download Perfetto trace (JSON)", lambda: c.chrome_trace_json(m_ref, h_ref, key, vmem),
                           file_name="whatif_timeline.trace.json", mime="application/json", key="wi_trace_dl",
                           on_click="ignore")
        menu.download_button("Download events (CSV)", lambda: events_csv(m_ref, h_ref, key, vmem, lo, hi),
                           file_name="whatif_events.csv", mime="text/csv", key="wi_events_dl", on_click="ignore")
        c.show_command(c.cli_trace(x["model"], x["hw"], key, vmem))


def events_csv(m_ref, h_ref, key, vmem, lo, hi) -> str:
    df = pd.DataFrame(c.predict_cached(m_ref, h_ref, key, vmem, record=True)["events"])
    return c.csv_download(df[(df["layer"] >= lo) & (df["layer"] <= hi)])


# ----- prefetch sweep -----------------------------------------------------------------------------

@st.cache_data(show_spinner=False, max_entries=128)
def sweep_rows(m_ref, h_ref, key, vmem) -> tuple[list[dict], dict | None, float, list[str]]:
    """The sweep, each depth with its ring banks and expert slots; the saturation point; the current depth; the
    step's causes (each row's time of cause C in its column C_s)."""
    hw = c.resolve_hw(h_ref, vmem)
    current = dict(key)["prefetch_mib"] or hw.onchip_bytes / 2 / c.MiB
    rows, sat, causes = c.prefetch_sweep(m_ref, h_ref, key, vmem, depths_for(hw, current))
    for row in rows:
        b = fit.onchip_budget(m_ref, h_ref, c.with_key(key, prefetch_mib=row["prefetch_mib"]), vmem)
        row.update(banks=b["banks"], expert_slots=b["slots"])
    return rows, sat, current, causes


@st.cache_resource(show_spinner=False, max_entries=64)
def sweep_figure(m_ref, h_ref, key, vmem, log_x: bool) -> tuple[dict, dict]:
    """Step time against the depth (with the expert slots on a second axis, the current depth and the
    saturation point) over each depth's step by cause: two panels on one depth axis."""
    all_rows, sat, current, step_causes = sweep_rows(m_ref, h_ref, key, vmem)
    ok = [r for r in all_rows if "step_s" in r]
    # both panels on the same depth range (their layers draw different extents: a line, bars)
    depth = quant("prefetch_mib", "prefetch depth (MiB of weight ring per core" + (", log)" if log_x else ")"),
                  scale=charts.shared_x([r["prefetch_mib"] for r in ok], log=log_x, pad=0.04))
    where = ("prefetch_mib", "prefetch (MiB)", "g")
    line = rows(series="step time", prefetch_mib=[r["prefetch_mib"] for r in ok], step_ms=[r["step_s"] * 1e3 for r in ok],
                tokens_per_s=[r["tokens_per_s"] for r in ok], banks=[r["banks"] for r in ok],
                expert_slots=[r["expert_slots"] for r in ok])
    step = quant("step_ms", "step time (ms)", scale={"zero": False})
    points = [dict(r, series="current", label="current") for r in line if math.isclose(r["prefetch_mib"], current)]
    if sat:
        points.append({"series": "saturation", "prefetch_mib": sat["prefetch_mib"], "step_ms": sat["step_s"] * 1e3,
                       "label": f"saturates at {sat['prefetch_mib']:g} MiB"})
    top = max((r["expert_slots"] for r in ok), default=1)
    slots = [dict(r, series="expert slots") for r in line]
    # one colour scale for the lines and the marks; the legend names the two lines (the marks carry labels)
    lines = {"step time": "#1f77b4", "expert slots": "#7f7f7f", "current": "#2ca02c", "saturation": "#d62728"}
    hue = {"field": "series", "type": "nominal", "scale": colors(lines), "title": None,
           "legend": {"values": ["step time", "expert slots"], "symbolType": "stroke", "symbolStrokeWidth": 2,
                      "labelExpr": "datum.label == 'step time' ? 'step time (left axis)' : "
                                   "'expert slots at that depth (right axis)'"}}
    upper = charts.panel([
        {"layer": [
            layer(line, {"type": "line", "point": True}, x=depth, y=step, color=hue,
                  tooltip=tip(where, ("banks", "ring banks"), ("expert_slots", "expert slots"),
                              ("step_ms", "step (ms)", ".4f"), ("tokens_per_s", "tokens/s", ",.0f"))),
            layer(points, {"type": "point", "size": 220, "filled": True, "stroke": "black"}, x=depth, y=step,
                  shape={"field": "series", "type": "nominal", "scale": colors({"current": "diamond",
                                                                                  "saturation": STAR_SHAPE}),
                         "legend": None},
                  color=hue, tooltip=tip(where, ("step_ms", "step (ms)", ".4f"))),
            layer(points, {"type": "text", "dy": 18, "fontSize": 11}, x=depth, y=step, text={"field": "label"})]},
        layer(slots, {"type": "line", "point": {"shape": "square", "size": 30}, "strokeDash": [2, 3],
                      "interpolate": "step-after"}, x=depth, color=hue,
              y=quant("expert_slots", "expert slots", scale={"domain": [0, top * 1.15 + 0.5]},
                      axis={"orient": "right", "grid": False, "tickMinStep": max(1, math.ceil(top / 5))}),
              tooltip=tip(where, ("expert_slots", "expert slots")))], 340,
        legend={**charts.TOP_LEGEND, "direction": "horizontal", "columns": 2}, resolve={"scale": {"y": "independent"}})
    upper["config"]["axisRight"] = {"minExtent": RIGHT_EXTENT, "maxExtent": RIGHT_EXTENT}
    causes = list(dict.fromkeys(list(c.CAUSE_LABELS) + step_causes))  # the page's order, then any the model adds
    drawn = [k for k in causes if k in step_causes and any(r.get(f"{k}_s", 0) > 0 for r in ok)]
    bars = [{"series": c.CAUSE_LABELS.get(k, k), "prefetch_mib": r["prefetch_mib"], "ms": r[f"{k}_s"] * 1e3,
             "order": i} for i, k in enumerate(drawn) for r in ok if f"{k}_s" in r]
    scale = colors({c.CAUSE_LABELS.get(k, k): color(k, causes.index(k)) for k in drawn})
    # the panel above has a right axis (the expert slots): an invisible one here of the same extent and title, so
    # both plots are as wide and their depths at the same x
    ghost = layer(rows(series="right axis", v=0), {"type": "rule", "opacity": 0, "aria": False},
                  y=quant("v", "expert slots", axis={"orient": "right", "grid": False, "labelOpacity": 0,
                                                     "titleOpacity": 0, "ticks": False, "domain": False}))
    lower = charts.panel([layer(
        bars, {"type": "bar", "width": 9}, x=depth, y=quant("ms", "time by cause (ms)", stack="zero"),
        color=nominal("series", "", scale=scale, sort=scale["domain"]), order={"field": "order"},
        tooltip=tip(where, ("ms", "ms", ".4f"))), ghost], 280, resolve={"scale": {"y": "independent"}})
    lower["config"]["axisRight"] = {"minExtent": RIGHT_EXTENT, "maxExtent": RIGHT_EXTENT}
    return upper, lower


def bend_explanation(rows: list[dict], sat: dict | None, current: float, hw) -> str | None:
    """Why the step time rises past the best depth: the cause that grows and its mechanism."""
    ok = [r for r in rows if "step_s" in r]
    if not ok or sat is None:
        return None
    best = min(ok, key=lambda r: r["step_s"])
    worse = [r for r in ok if r["prefetch_mib"] > best["prefetch_mib"] and r["step_s"] > best["step_s"] * 1.01]
    if not worse:
        return None
    w = max(worse, key=lambda r: r["step_s"])
    grow = {k: w.get(f"{k}_s", 0.0) - best.get(f"{k}_s", 0.0) for k in c.CAUSE_LABELS}
    cause = max(grow, key=grow.get)
    k = hw.dma_concurrent_copies
    sharing = ("serves copies in the order they were issued (dma_sharing = fifo)" if hw.dma_sharing != "shared"
               else f"serves at most {k} copies at once, round-robin among them, the rest in the order they were "
                    f"issued (dma_concurrent_copies = {k})" if k
               else "shares its bandwidth equally among all outstanding copies (dma_sharing = shared)")
    why = {"expert_fetch": (f"the ring takes the {hw.onchip_kind} the expert buffers need: {best['expert_slots']} "
                            f"expert slots at {best['prefetch_mib']:g} MiB, {w['expert_slots']} at "
                            f"{w['prefetch_mib']:g} MiB; the expert copies after routing share the DMA engine with the "
                            "ring, so how many are in flight changes when they land"),
           "weight_streaming": (f"a ring of {w['banks']} tiles issues weights for layers far ahead; the DMA engine "
                                f"{sharing}, so the tile needed next, and each layer's expert and KV copies, wait "
                                "behind tiles for later layers"),
           "collective": (f"a ring of {w['banks']} tiles issues weights for layers far ahead; the DMA engine "
                          f"{sharing}, so each collective's remote copies wait behind tiles for later layers")}
    text = why.get(cause, f"{c.CAUSE_LABELS[cause]} grows")
    return (f"Deeper than {best['prefetch_mib']:g} MiB the step gets slower: at {w['prefetch_mib']:g} MiB it is "
            f"{(w['step_s'] - best['step_s']) * 1e3:+.3f} ms, mostly {c.CAUSE_LABELS[cause]} "
            f"({grow[cause] * 1e3:+.3f} ms): {text}.")


@st.fragment
def prefetch_section(x: dict, stale: str | None) -> None:
    if x["engine"] != "megakernel":
        st.info("The prefetch depth is a megakernel setting (a multi-kernel engine cannot prefetch across "
                "kernel boundaries): select the megakernel engine to sweep it.")
        return
    m_ref, h_ref, key, vmem = refs(x)
    hw = c.resolve_hw(h_ref, vmem)
    with maybe_stale(stale, "wi_pf"), st.spinner("Sweeping the prefetch depth..."):
        rows, sat, current, _ = sweep_rows(m_ref, h_ref, key, vmem)
        ok = [r for r in rows if "step_s" in r]
        c.init(wi_pf_logx=False)
        far = current > 64 * hw.dma_tile_bytes / c.MiB  # beyond the tile multiples: only a log axis shows both
        if far:  # the axis is log whatever the choice: the toggle shown says so (the choice is kept for later)
            st.toggle("Log depth axis", value=True, disabled=True, key="wi_pf_logx_forced",
                      help=f"On: the current depth ({current:g} MiB) is far beyond the ring-tile multiples, which a "
                           "linear axis would squeeze into its first pixels.")
            log_x = True
        else:
            log_x = st.toggle("Log depth axis", key="wi_pf_logx")
        if ok:
            upper, lower = sweep_figure(m_ref, h_ref, key, vmem, log_x)
            show(upper, "wi_prefetch_chart")
            show(lower, "wi_prefetch_causes")
        bad = [r for r in rows if "error" in r]
        b = fit.onchip_budget(m_ref, h_ref, key, vmem)
        if sat:
            best = min(ok, key=lambda r: r["step_s"])
            st.caption(f"The gain saturates at **{sat['prefetch_mib']:g} MiB** (smallest depth within 1 % of the "
                       f"best step time swept); the best depth swept is **{best['prefetch_mib']:g} MiB with "
                       f"{best['expert_slots']} expert slots** ({best['tokens_per_s']:,.0f} tokens/s). Green "
                       f"diamond: the current depth ({current:g} MiB). Hover a point for its ring banks and expert "
                       "slots; the bars below split each depth's step by cause.")
        why = bend_explanation(rows, sat, current, hw)
        if why:
            st.info(why)
        if bad and b:
            deepest = max((r["prefetch_mib"] for r in ok), default=None)
            st.caption(f"{len(bad)} depth(s) do not fit in {hw.onchip_kind} {b['onchip_mib']:g} MiB beside "
                       f"{b['slots'] if dict(key)['expert_slots'] else 'one'} {b['expert_mib']:.2f} MiB expert "
                       "buffer(s): "
                       + ", ".join(f"{r['prefetch_mib']:g}" for r in bad) + " MiB"
                       + (f" (deepest that fits: {deepest:g} MiB)." if deepest else "."))
        if not ok and b:
            n = dict(key)["expert_slots"] or 1
            st.warning(f"No prefetch depth fits: the smallest ring (one {b['tile_mib']:g} MiB tile) and {n} "
                       f"{b['expert_mib']:.2f} MiB expert buffer(s) need {b['tile_mib'] + n * b['expert_mib']:.2f} MiB "
                       f"of {hw.onchip_kind}; this core has {b['onchip_mib']:g} MiB.")
        df = pd.DataFrame(rows)
        c.downloads(df, "whatif_prefetch_sweep", "wi_pf_dl", {"saturation": sat, "model": x["model"],
                                                               "hardware": x["hw"], "current_mib": current})
        c.show_command(c.cli_sweep(x["model"], x["hw"], key, [r["prefetch_mib"] for r in rows], vmem))


# ----- roofline -----------------------------------------------------------------------------------

@st.cache_resource(show_spinner=False, max_entries=32)
def roofline_figure(m_ref, h_ref, key, vmem) -> tuple[dict, pd.DataFrame]:
    """Per-layer points (FLOPs and HBM bytes over the layer's time) under the per-core roofs, and the step."""
    r = c.predict_cached(m_ref, h_ref, key, vmem)
    hw = c.resolve_hw(h_ref, vmem)
    df = pd.DataFrame(r["layers"])
    df["bytes"] = df[["static_bytes", "routed_bytes", "kv_bytes", "act_bytes"]].sum(axis=1)
    df["intensity_flops_per_byte"] = df["flops"] / df["bytes"].where(df["bytes"] > 0)
    df["achieved_flops_per_s"] = df["flops"] / df["time_s"].where(df["time_s"] > 0)
    bw, peaks = hw.core_hbm_bandwidth_bytes_per_s, hw.core_flops_per_s
    pts = df[df["intensity_flops_per_byte"].notna() & df["achieved_flops_per_s"].gt(0)]
    lo = max(1e-3, float(pts["intensity_flops_per_byte"].min()) / 4) if not pts.empty else 0.01
    hi = max(float(pts["intensity_flops_per_byte"].max()) * 4 if not pts.empty else 1e3, max(peaks.values()) / bw * 4)
    decades = {"type": "log"}
    x = quant("intensity", "arithmetic intensity (FLOP per HBM byte)", scale=decades)
    y = quant("tflops", "achieved TFLOP/s per device", scale=decades)
    roofs, names = [], {}
    for i, (dt, peak) in enumerate(sorted(peaks.items(), key=lambda kv: kv[1])):
        xs = np.array(sorted({lo, min(max(peak / bw, lo), hi), hi}))  # straight in log-log: the ridge and the ends
        roofs += rows(series=f"roof ({dt})", intensity=xs, tflops=np.minimum(peak, bw * xs) / 1e12, dash=i,
                      what=f"{dt} peak {peak / 1e12:,.0f} TFLOP/s, HBM {bw / 1e12:.2f} TB/s")
        names[f"roof ({dt})"] = "#555555"
    layers_ = []
    for i, (kind, g) in enumerate(pts.groupby("kind")):
        layers_ += rows(series=f"{kind} layers", intensity=g["intensity_flops_per_byte"].to_numpy(),
                        tflops=(g["achieved_flops_per_s"] / 1e12).to_numpy(), layer=g["layer"].to_numpy(),
                        time_us=(g["time_s"] * 1e6).to_numpy(), gflop=(g["flops"] / 1e9).to_numpy(),
                        mib=(g["bytes"] / c.MiB).to_numpy())
        names[f"{kind} layers"] = KIND_COLORS[i % len(KIND_COLORS)]
    step = []
    tot_f, tot_b = df["flops"].sum(), r["bytes_per_device"]
    if tot_b > 0 and r["step_s"] > 0:
        step = rows(series="whole step", intensity=tot_f / tot_b, tflops=tot_f / r["step_s"] / 1e12)
        names["whole step"] = "black"
    scale = colors(names)
    spec = {"height": 440, "config": {"legend": LEGEND}, "layer": [
        layer(roofs, {"type": "line", "strokeWidth": 1.5}, x=x, y=y, detail={"field": "series"},
              color=nominal("series", "", scale=scale),
              strokeDash={"field": "dash", "type": "ordinal", "legend": None,
                          "scale": {"domain": [0, 1, 2, 3], "range": [[2, 2], [6, 3], [6, 3, 2, 3], [10, 4]]}},
              tooltip=tip(("what", "roof"))),
        layer(layers_, {"type": "point", "filled": True, "size": 60}, x=x, y=y, color=nominal("series", "", scale=scale),
              tooltip=tip(("layer", "layer"), ("intensity", "FLOP/byte", ".3g"), ("tflops", "TFLOP/s", ".3g"),
                          ("time_us", "time (us)", ".2f"), ("gflop", "GFLOP", ".3g"), ("mib", "MiB", ".3g"))),
        layer(step, {"type": "point", "filled": True, "size": 250, "shape": STAR_SHAPE}, x=x, y=y,
              color=nominal("series", "", scale=scale),
              tooltip=tip(("intensity", "FLOP/byte", ".3g"), ("tflops", "TFLOP/s", ".3g")))]}
    return spec, df


LAYER_COLUMNS = ["layer", "kind", "time_s", "compute_s", "stall_s", "collective_s", "overhead_s", "flops",
                 "static_bytes", "routed_bytes", "kv_bytes", "act_bytes", "intensity_flops_per_byte",
                 "achieved_flops_per_s"]


@st.fragment
def roofline_section(x: dict, stale: str | None) -> None:
    with maybe_stale(stale, "wi_roof"):
        spec, df = roofline_figure(*refs(x))
        show(spec, "wi_roofline")
        st.caption("A layer's point is its FLOPs and HBM bytes over its time in the step. With the megakernel a "
                   "layer can sit above the HBM roof: part of its weights streamed in during earlier layers "
                   "(prefetch across layer boundaries). Far below the roofs: the layer waits on collectives or "
                   "launches.")
        cols = [k for k in LAYER_COLUMNS if k in df] + [k for k in df if k not in LAYER_COLUMNS and k != "bytes"]
        table = st.expander("Per-layer table", key="wi_layers_exp", on_change="rerun")
        if table.open:  # drawn only when opened
            with table:
                st.dataframe(df[cols], hide_index=True, key="wi_layers_table")
        c.downloads(df[cols], "whatif_layers", "wi_layers_dl", {"model": x["model"], "hardware": x["hw"]})
