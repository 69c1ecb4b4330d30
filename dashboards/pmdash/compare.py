"""Compare view: two platforms' predicted tokens/s across batch sizes, with measured points and errors.

A measured point is drawn for a platform only when every setting of the platform's deployment
matches it (pmdash.measured.differences); the others are listed with what differs. Under the
curves, predicted / measured per point against a +-10 % band, on the same batch range. The legend
above the chart says what each colour (a platform: A blue, B red, whatever their hardware), line
style (predicted, with spec decode dashed) and marker (the kind of a measured source: published,
measured by this project, your upload) means; none of them changes with what else is plotted. A
point above twice the chip's HBM roofline is flagged as implausible and left off the chart. Where
each source's numbers come from (machine or chip, JAX version, date, command) is one click away. A
layout the model refuses gives one error box per cause with the nearest layouts that run. The
tables open on demand.
"""
from __future__ import annotations

import pandas as pd
import streamlit as st

from perfmodel.util.errors import SpecError

from . import charts
from . import common as c
from . import fit, measured
from .inputs import batches_field, current_or_last, maybe_stale, number_field

SPEC_MODES = ("off", "on", "both")
PLATFORM_COLORS = {"A": "#1f77b4", "B": "#d62728"}
CURVES = {"predicted": [1, 0], "predicted, spec decode": [6, 4]}  # line style per curve
IMPLAUSIBLE = 2.0  # a measured point above this many times the HBM roofline is flagged
BAND = 0.10        # the ratio panel's band: predicted within +-10 % of measured


def published_layout(d: dict) -> str:
    """One platform of the published table in words (pmdash.common.CANONICAL)."""
    engine = d["engine"] if d["serving_engine"] == c.GENERIC else f"{d['serving_engine']} kernels"
    spec = f" ({d['spec_steps_per_call']} with spec decode)" if d["spec_steps_per_call"] != d["steps_per_call"] else ""
    kv = "" if d["kv_cache"] == c.MODEL_KV else f", KV cache {d['kv_cache']}"
    return (f"{d['hardware']} {engine}, {d['devices']} devices, tp {d['tp']}, ep {d['ep']}, "
            f"{d['steps_per_call']} step{'' if d['steps_per_call'] == 1 else 's'} per call{spec}{kv}")


def platform_inputs(col, tag: str, default: dict, errs: list) -> dict | None:
    hw_opts = c.hardware_options()
    c.init(**{f"cmp_{tag}_hw": default["hardware"], f"cmp_{tag}_engine": default["engine"],
              f"cmp_{tag}_serving": default["serving_engine"], f"cmp_{tag}_kv": default["kv_cache"]},
           **{f"cmp_{tag}_{k}": str(default[k]) for k in ("devices", "tp", "ep", "steps_per_call",
                                                            "spec_steps_per_call")})
    with col:
        st.markdown(f"**Platform {tag}**")
        h, e = st.columns(2)
        hw = h.selectbox("Hardware", hw_opts, key=f"cmp_{tag}_hw")
        engine = e.radio("Engine", ("megakernel", "multikernel"), horizontal=True, key=f"cmp_{tag}_engine")
        a, b, e = st.columns(3)
        devices = number_field(a, "Devices", f"cmp_{tag}_devices", errors=errs)
        tp = number_field(b, "TP", f"cmp_{tag}_tp", errors=errs)
        ep = number_field(e, "EP groups", f"cmp_{tag}_ep", errors=errs)
        # the kernels and steps per call, in a popover (mounted when opened) that names their values
        steps_now = [st.session_state[f"cmp_{tag}_{k}"] for k in ("steps_per_call", "spec_steps_per_call")]
        with c.kernel_menu(f"cmp_{tag}", hw, engine, ", {} steps/call ({} spec)".format(*steps_now)):
            serving, kv = c.kernel_choices(*st.columns(2), hw, engine, f"cmp_{tag}")
            f, g = st.columns(2)
            steps = number_field(f, "Steps per call", f"cmp_{tag}_steps_per_call", errors=errs,
                                 help="Decode steps one device call runs (its per-call cost is shared by them).")
            spec_steps = number_field(g, "... with spec decode", f"cmp_{tag}_spec_steps_per_call", errors=errs,
                                      help="Steps per device call of the speculative-decoding curve.")
    if None in (devices, tp, ep, steps, spec_steps):
        return None
    label = (f"{tag}: {hw} {engine if serving is None else serving + ' kernels'} ({devices} dev, tp {tp}, ep {ep}"
             + ("" if kv is None else f", KV {kv}") + ")")
    return dict(tag=tag, hw=hw, h_ref=c.hardware_ref(hw), engine=engine, devices=devices, tp=tp, ep=ep, label=label,
                steps=steps, spec_steps=spec_steps, serving=serving, kv=kv)  # h_ref: the hardware's cache key


def plat_key(plat: dict, batch: int, spec_on: bool, context: int) -> tuple:
    return c.dep_key(plat["devices"], plat["tp"], plat["ep"], plat["engine"], batch=batch, context=context,
                     draft_rows=c.SPEC_DRAFT_ROWS if spec_on else 0,
                     acceptance_length=c.SPEC_ACCEPTANCE if spec_on else None,
                     steps_per_call=plat["spec_steps"] if spec_on else plat["steps"],
                     serving_engine=plat["serving"], kv_cache=plat["kv"])


def plat_settings(model: str, plat: dict, spec_on: bool, context: int) -> tuple[dict, dict | None]:
    """The platform's deployment as measurements state it (pmdash.measured.SETTINGS, batch aside) and the
    defaults a row's missing settings resolve to: the model's KV cache format and, for the megakernel,
    the ring, slots and on-chip buffer."""
    key, m_ref = plat_key(plat, 1, spec_on, context), c.model_ref(model)
    mine, defaults = measured.settings(model, plat["hw"], key, c.load_model_ref(m_ref).formats["kv_cache"].name)
    del mine["batch"]
    b = fit.onchip_budget(m_ref, plat["h_ref"], key, None) if plat["engine"] == "megakernel" else None
    if b is None:
        return mine, defaults
    onchip = {"prefetch_mib": b["ring_mib"], "expert_slots": b["slots"], "vmem_mib": b["onchip_mib"]}
    return mine | onchip, defaults | onchip


def predicted_rows(model: str, plat: dict, batches, spec_on: bool, context: int) -> tuple[list[dict], list]:
    rows, errors = [], []
    for b in batches:
        r = c.predict_cached(c.model_ref(model), plat["h_ref"], plat_key(plat, b, spec_on, context))
        if "error" in r:
            errors.append((b, r))
            continue
        bd = r["breakdown_s"]
        rows.append({"platform": plat["label"], "hardware": plat["hw"], "engine": plat["engine"],
                     "spec_decode": spec_on, "batch": b, "predicted_tokens_per_s": r["tokens_per_s"],
                     "step_ms": r["step_s"] * 1e3, "bound": r["bound"],
                     "hbm_utilisation": r["hbm_utilisation"],
                     "exposed_stall_ms": (bd["weight_streaming"] + bd["expert_fetch"]) * 1e3,
                     "collective_ms": bd["collective"] * 1e3})
    return rows, errors


def error_rows(model: str, plat: dict, points: pd.DataFrame, spec_on: bool, context: int) -> list[dict]:
    """Each measured point that matches every setting of this platform (batch aside) with the
    prediction, its error and the HBM-roofline check."""
    rows = []
    mine, onchip = plat_settings(model, plat, spec_on, context)
    exact, _, _ = measured.reference(points, mine, onchip, ignore=("batch",))
    for m in exact:
        key = plat_key(plat, int(m["batch"]), spec_on, context)
        r = c.predict_cached(c.model_ref(model), plat["h_ref"], key)
        pred = r.get("tokens_per_s")
        # the HBM roofline: the step's tokens if the step took only its HBM bytes at peak bandwidth
        roof = pred * r["step_s"] / r["hbm_floor_s"] if pred and r.get("hbm_floor_s") else None
        flag = roof is not None and m["tokens_per_s"] > IMPLAUSIBLE * roof
        rows.append({"platform": plat["label"], "tag": plat["tag"], "spec_decode": spec_on, "batch": int(m["batch"]),
                     "measured_tokens_per_s": float(m["tokens_per_s"]), "predicted_tokens_per_s": pred,
                     "error": (pred / m["tokens_per_s"] - 1) if pred else None,
                     "hbm_roofline_tokens_per_s": roof,
                     "check": f"implausible: above {IMPLAUSIBLE:g}x the HBM roofline" if flag else "",
                     "role": m["role"], "source": m["origin"], "kind": m["kind"],
                     "reference": m["source"]})
    return rows


def not_compared(model: str, plat: dict, points: pd.DataFrame, spec_states: list, context: int) -> list[tuple]:
    """(platform tag, row, differences) for the measurements of this platform's model and hardware that
    differ from its deployment in some setting (speculative-decoding points only when asked for)."""
    out = []
    settings = {s: plat_settings(model, plat, s, context) for s in spec_states}
    for r in points.to_dict("records"):
        spec = bool(r["draft_rows"])
        if r["hardware"] != plat["hw"] or r["model"] != model or spec not in spec_states:
            continue
        mine, onchip = settings[spec]
        if d := measured.differences(r, mine, onchip):
            out.append((plat["tag"], r, d))
    return out


def load_points() -> tuple[pd.DataFrame, str]:
    points = [measured.published_table()]
    host, host_note = measured.host_points()
    if host is not None:
        points.append(host)
    committed, committed_note = measured.committed_points()
    points += [f["rows"] for f in committed]
    row = st.container(horizontal=True)
    with row, st.popover("Load your own measurements (CSV)", icon=":material/upload:", key="cmp_upload_menu"):
        st.caption("Columns: model, hardware, engine, batch, tokens_per_s; optional devices, tp, ep, context, "
                   "draft_rows, acceptance_length, steps_per_call, serving_engine, kv_cache, prefetch_mib, "
                   "expert_slots, vmem_mib, source. Every row names its model. A setting left out is perfmodel's "
                   "default (tp = ep = devices, context 4096, one step per call, the generic engine, the model's KV "
                   "cache format, the default ring, slots and on-chip buffer), assumed, not measured; a point is "
                   "drawn for a platform only when every setting matches. Lines starting with # are ignored.")
        up = st.file_uploader("Measurements CSV", type=None, key="cmp_upload")
        if up is not None:
            try:
                user = measured.parse_upload(up.name, up.getvalue())
                points.append(user)
                st.success(f"Loaded {len(user)} measured point(s) from {up.name}.")
            except SpecError as e:
                st.error(f"Could not use {up.name}: {e}")
    allpoints = pd.concat(points, ignore_index=True)
    srcs = measured.sources(allpoints)
    with row, st.popover(f"Where the measured points come from ({len(srcs)} sources)", icon=":material/info:",
                         key="cmp_sources_menu"):
        sources_text(srcs, committed_note)
    return allpoints, host_note


def sources_text(srcs: list[dict], committed_note: str) -> None:
    """Each measured source: its marker, how many points, and its provenance (drawn when the popover opens)."""
    for src in srcs:
        st.markdown(f"**{src['origin']}** ({charts.SOURCE_SHAPES[src['kind']]} marker: {src['kind']}; "
                    f"{src['points']} point{'s' if src['points'] != 1 else ''}; {src['file']})  \n"
                    + measured.provenance_markdown(src["meta"]))
    st.caption(committed_note)


@c.callback
def use_layout(tag: str, key: tuple) -> None:
    k = dict(key)
    for f in ("devices", "tp", "ep"):
        st.session_state[f"cmp_{tag}_{f}"] = str(k[f])


def refused(model: str, plat: dict, errors: list, context: int, spec_on: bool) -> tuple[list, list]:
    """(where, batch, message) per refused batch, and the nearest layouts that run for the first one."""
    if not errors:
        return [], []
    b, r = errors[0]
    near = fit.nearest_valid(c.model_ref(model), plat["h_ref"], plat_key(plat, b, spec_on, context),
                             None, r.get("field", ""))
    spec = " + spec decode" if spec_on else ""
    return [(f"platform {plat['tag']}{spec}", bb, rr["error"]) for bb, rr in errors], near


def nearest_buttons(tag: str, near: list) -> None:
    cols = st.columns([3] + [2] * len(near))
    cols[0].caption(f"Platform {tag}: nearest layouts that run")
    for i, n in enumerate(near):
        cols[i + 1].button(f"{n['change']}: {n['tokens_per_s']:,.0f} tok/s", key=f"cmp_near_{tag}_{i}",
                           on_click=use_layout, args=(tag, n["key"]))


def render() -> None:
    st.header("Compare platforms: predicted vs measured tokens/s")
    st.caption("Kimi K3 decode by default, the deployments of the published table (Inferact, tpu-megakernels "
               "report, Sept 2026): " + " vs ".join(published_layout(d) for d in c.CANONICAL.values()) + ".")
    c.init(cmp_model="kimi-k3", cmp_batches=", ".join(map(str, c.DEFAULT_BATCHES)), cmp_context="4096",
           cmp_spec="off", cmp_logy=False)
    errs: list[str] = []
    c0, c1, c3, c2, c4 = st.columns([2, 2, 1, 2, 1])
    model = c0.selectbox("Model", c.model_options(), key="cmp_model")
    batches = batches_field(c1, "Batch sizes (comma-separated)", "cmp_batches", errors=errs)
    context = number_field(c3, "Context (tokens)", "cmp_context", lo=0, hi=10_000_000, errors=errs)
    spec_mode = c2.radio(f"Speculative decoding ({c.SPEC_DRAFT_ROWS} draft rows, acceptance length "
                         f"{c.SPEC_ACCEPTANCE:g})", SPEC_MODES, horizontal=True, key="cmp_spec")
    log_y = c4.toggle("Log y axis", key="cmp_logy")
    ca, cb = st.columns(2)
    pa = platform_inputs(ca, "A", c.CANONICAL["tpu-v7"], errs)
    pb = platform_inputs(cb, "B", c.CANONICAL["gb200"], errs)
    chart_slot = st.container()  # the chart goes here, above the upload that feeds it
    allpoints, host_note = load_points()
    if host_note:
        st.info(host_note)
    current = None if errs else dict(model=model, pa=pa, pb=pb, batches=tuple(batches), context=context,
                                     spec_mode=spec_mode)
    x, stale = current_or_last("cmp", current, "; ".join(errs) if errs else None)
    if x is None:
        chart_slot.info("Fix the inputs above to draw the comparison.")
        return
    spec_states = {"off": [False], "on": [True], "both": [False, True]}[x["spec_mode"]]
    pred, errs_rows, refusals, nearest, others = [], [], [], {}, []
    with st.spinner("Running the model..."):
        collect(x, spec_states, allpoints, stale, pred, errs_rows, refusals, nearest, others)
    c.errors_by_cause(refusals)
    for tag, near in nearest.items():
        nearest_buttons(tag, near)
    pdf, edf = pd.DataFrame(pred), pd.DataFrame(errs_rows)
    with chart_slot, maybe_stale(stale, "cmp"):
        draw(x, pred, errs_rows, log_y)
        not_compared_note(others)
        tpu_note(x)
    with maybe_stale(stale, "cmp_tables"):
        tables(x, pdf, edf, spec_states)


def collect(x: dict, spec_states, allpoints, stale, pred, errs_rows, refusals, nearest, others) -> None:
    """Predictions, matching measured points with their errors, the other measurements, refusals and
    nearest layouts, per platform."""
    for plat in (x["pa"], x["pb"]):
        for s in spec_states:
            rows, e = predicted_rows(x["model"], plat, x["batches"], s, x["context"])
            pred += rows
            if not stale:
                items, near = refused(x["model"], plat, e, x["context"], s)
                refusals += items
                if near:
                    nearest.setdefault(plat["tag"], near)
            errs_rows += error_rows(x["model"], plat, allpoints, s, x["context"])
        others += not_compared(x["model"], plat, allpoints, spec_states, x["context"])


def not_compared_note(others: list[tuple]) -> None:
    """One line per platform and difference: the measurements of its hardware left out, and why."""
    groups: dict[tuple, list] = {}
    for tag, row, diffs in others:
        groups.setdefault((tag, row["origin"], measured.differs_text(diffs)), []).append(row)
    for (tag, origin, why), rows in groups.items():
        pts = ", ".join(f"{r['tokens_per_s']:,.0f} at batch {int(r['batch'])}" for r in rows[:8])
        st.caption(f"Not a reference for platform {tag}: {origin} ({pts}{' ...' if len(rows) > 8 else ''}); "
                   f"platform {tag} differs in {why}.")


TPU_HW = "tpu-v5e"  # the chip of this project's committed megakernel runs (experiments/tpu_megakernel.py)


def tpu_note(x: dict) -> None:
    """For a platform on TPU v5e: this project's measured series there (tokens/s across batches, megakernel and
    the XLA reference). One slice of the model on one chip, so never a point against a whole deployment: a line
    naming its file, with the comparison on Validation."""
    tags = [p["tag"] for p in (x["pa"], x["pb"]) if p["hw"] == TPU_HW]
    if not tags:
        return
    t = measured.tpu_results()
    if t is None or t["rows"].empty:
        st.caption(f"{charts.SOURCE_SHAPES['measured by this project'].capitalize()} markers (this project's runs) on "
                   f"{TPU_HW}: none committed yet ({c.shown_path(measured.TPU_RUNS_JSON)}).")
        return
    rows = measured.tpu_latest(t["rows"]).sort_values("batch", kind="stable")
    series = "; ".join(
        f"{e} on {', '.join(sorted(set(g['slice'])))} {', '.join(sorted(set(g['format'])))}: "
        + ", ".join(f"{v:,.0f} at batch {b}" for b, v in zip(g["batch"], g["measured_tokens_per_s"]))
        for e, g in rows.groupby("engine", sort=False))
    st.caption(f"This project's runs on {TPU_HW} ({t['file']}, {t['meta'].get('date', '')[:10]}), tokens/s: {series}. "
               f"One slice of the model on one chip, not platform {' / '.join(tags)}'s deployment, so not drawn "
               "against it; Validation draws them against the model's predictions for that slice.")


def groups(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    """Rows grouped by the values of `keys`, in order of appearance (plain Python: a pandas groupby of a
    few dozen rows costs more than the chart)."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def draw(x: dict, pred: list[dict], measured_rows: list[dict], log_y: bool) -> None:
    """Tokens/s per batch (curves predicted, hollow markers measured) over a panel of predicted / measured per
    point with the +-BAND band, on the same batch range; Vega-Lite specs of plain dicts. Colour: the platform;
    line style: the curve; marker: the kind of the measured source (charts.SOURCE_SHAPES). Each row keeps its
    `series` (its platform and curve or source) for the hover."""
    plats = {p["label"]: PLATFORM_COLORS[p["tag"]] for p in (x["pa"], x["pb"])}
    lines = []
    for (label, spec), g in groups(pred, "platform", "spec_decode").items():
        curve = "predicted, spec decode" if spec else "predicted"
        lines += [{"series": f"{label} predicted" + (" + spec decode" if spec else ""), "platform": label,
                   "curve": curve, "batch": r["batch"], "tokens_per_s": r["predicted_tokens_per_s"],
                   "step_ms": r["step_ms"], "bound": r["bound"], "hbm": r["hbm_utilisation"]} for r in g]
    plotted = [r for r in measured_rows if r["check"] == "" and r["predicted_tokens_per_s"]]
    points = []
    for (label, spec, source), g in groups(plotted, "platform", "spec_decode", "source").items():
        name = f"{source}" + (" + spec decode" if spec else "") + f" (platform {label.split(':')[0]})"
        points += [{"series": name, "platform": label, "kind": r["kind"], "batch": r["batch"],
                    "tokens_per_s": r["measured_tokens_per_s"], "predicted": r["predicted_tokens_per_s"],
                    "error": r["error"], "reference": r["reference"],
                    "ratio": r["predicted_tokens_per_s"] / r["measured_tokens_per_s"]} for r in g]
    curves = [k for k in CURVES if any(r["curve"] == k for r in lines)]
    kinds = [k for k in charts.SOURCE_SHAPES if any(r["kind"] == k for r in points)]
    batch = charts.quant("batch", "batch (sequences)", scale=charts.shared_x(x["batches"], log=True),
                         axis={"values": list(x["batches"]), "format": "d"})
    color = charts.nominal("platform", "platform (colour)", scale=charts.colors(plats))
    dash = charts.nominal("curve", "line", scale={"domain": curves, "range": [CURVES[k] for k in curves]},
                          # both colours set: with only the stroke's, Vega-Lite draws this legend's symbols blank
                          legend={"symbolType": "stroke", "symbolStrokeWidth": 2, "symbolSize": 300,
                                  "symbolStrokeColor": "#444", "symbolFillColor": "#444"})
    shape = charts.nominal("kind", "measured (hollow marker)",
                           scale={"domain": kinds, "range": [charts.SOURCE_SHAPES[k] for k in kinds]})
    hollow = {"type": "point", "filled": False, "size": 140, "strokeWidth": 2}
    tps = charts.quant("tokens_per_s", "aggregate decode tokens/s" + (" (log)" if log_y else ""),
                       scale={"type": "log" if log_y else "linear"})
    upper = [charts.layer(lines, {"type": "line", "point": {"size": 30}}, x=batch, y=tps, color=color,
                          strokeDash=dash, detail={"field": "series"},
                          tooltip=charts.tip(("batch", "batch"), ("tokens_per_s", "predicted tokens/s", ",.0f"),
                                             ("step_ms", "step (ms)", ".3f"), ("bound", "bound"),
                                             ("hbm", "HBM utilisation", ".0%")))]
    if points:
        upper.append(charts.layer(points, hollow, x=batch, y=tps, color=color, shape=shape,
                                  tooltip=charts.tip(("batch", "batch"), ("tokens_per_s", "measured tokens/s", ",.0f"),
                                                     ("predicted", "predicted tokens/s", ",.0f"),
                                                     ("error", "error", "+.1%"), ("reference", "reference"))))
    ratio_title = "predicted / measured"
    ratio = charts.quant("ratio", ratio_title, scale={"zero": False, **({} if plotted else {"domain": [0.8, 1.2]})})
    lower = [charts.layer(charts.rows(series=f"+-{BAND:.0%} band", lo=1 - BAND, hi=1 + BAND),
                          {"type": "rect", "color": "#2ca02c", "opacity": 0.15}, y=charts.quant("lo", ratio_title),
                          y2={"field": "hi"}),
             charts.layer(charts.rows(series="predicted = measured", ratio=1.0),
                          {"type": "rule", "color": "#2ca02c", "strokeDash": [2, 2]}, y=ratio),
             charts.layer(charts.rows(series="labels", ratio=[1 + BAND, 1.0],
                                      text=[f"+-{BAND:.0%} band", "predicted = measured"]),
                          {"type": "text", "align": "right", "baseline": "bottom", "x": {"expr": "width - 4"},
                           "fontSize": 11, "color": "#2a7a2a"}, y=ratio, text={"field": "text"})]
    if points:
        lower.append(charts.layer(points, hollow, x=batch, y=ratio, color=dict(color, legend=None),
                                  shape=dict(shape, legend=None),
                                  tooltip=charts.tip(("batch", "batch"), ("ratio", "predicted / measured", ".3f"),
                                                     ("predicted", "predicted tokens/s", ",.0f"),
                                                     ("tokens_per_s", "measured tokens/s", ",.0f"))))
    else:  # the batch axis all the same, so the panel lines up with the one above
        lower.append(charts.layer(charts.rows(series="batch range", batch=list(x["batches"]), ratio=1.0),
                                  {"type": "point", "opacity": 0, "aria": False}, x=batch, y=ratio))
    notes = []
    if not plotted:
        notes.append("no measurement matches every setting of either platform")
    if not pred:
        notes.append("No platform can run this model at these layouts: see the messages above (and the nearest "
                     "layouts that run).")
    for text in notes:
        lower.append(charts.layer(charts.rows(series="note", text=text),
                                  {"type": "text", "fontSize": 13, "x": {"expr": "width / 2"}, "y": {"expr": "height / 2"}},
                                  text={"field": "text"}))
    charts.show(charts.panel(upper, 470, legend=charts.TOP_LEGEND), "cmp_chart")
    charts.show(charts.panel(lower, 210), "cmp_ratio")
    bad = [r for r in measured_rows if r["check"]]
    if bad:
        st.warning(f"{len(bad)} measured point(s) left off the chart: above {IMPLAUSIBLE:g}x the chip's HBM roofline "
                   "(tokens/s if the step moved only its HBM bytes at peak bandwidth): "
                   + "; ".join(f"{r['source']}, batch {r['batch']}: {r['measured_tokens_per_s']:,.4g} tokens/s vs "
                               f"roofline {r['hbm_roofline_tokens_per_s']:,.0f}" for r in bad))


def tables(x: dict, pdf: pd.DataFrame, edf: pd.DataFrame, spec_states: list) -> None:
    if edf.empty:
        st.info("No measured point matches these platforms in every setting (the published table: Kimi K3 on "
                + "; ".join(published_layout(d) for d in c.CANONICAL.values()) + ", at the default context 4096; "
                f"the host results: the kimi-k3-host-* models on '{c.HOST_HW}', multikernel, 1 device, at their "
                "contexts; or load your own CSV above).")
    else:
        ok = edf[edf["check"] == ""]
        mape = ok["error"].abs().mean() if not ok.empty else float("nan")
        inside = (ok["error"].abs() <= BAND).mean() if not ok.empty else float("nan")
        c.figures_line([("Mean absolute error over the points shown", f"{mape:.1%}"),
                        (f"points within +-{BAND:.0%}", f"{inside:.0%}"), ("measured points", f"{len(ok)}")])
        errors = st.expander(f"Per-point errors ({len(edf)} points)", key="cmp_errors_exp", on_change="rerun")
        if errors.open:  # drawn only when opened
            with errors:
                if (edf["role"] == measured.HELD_OUT).any():
                    st.caption("role: 'held-out', no value of the presets was fitted to a published decode step "
                               "(`perfmodel reproduce` fits GB200's one whole-step parameter on batches 1 and 8 in its "
                               "own report only).")
                tps = st.column_config.NumberColumn(format="%.0f")
                st.dataframe(edf.drop(columns=["tag"]), key="cmp_errors", hide_index=True, column_config={
                    "measured_tokens_per_s": tps, "predicted_tokens_per_s": tps, "hbm_roofline_tokens_per_s": tps,
                    "error": st.column_config.NumberColumn(format="percent")})
        c.downloads(edf.drop(columns=["tag"]), "compare_errors", "cmp_err_dl",
                    {"model": x["model"], "mean_abs_error": mape})
    curves = st.expander("Predicted curves (table)", key="cmp_pred_exp", on_change="rerun")
    if curves.open:
        with curves:
            st.dataframe(pdf, hide_index=True, key="cmp_pred")
    c.downloads(pdf, "compare_predicted", "cmp_pred_dl", {"model": x["model"]})
    for plat in (x["pa"], x["pb"]):
        for s in spec_states:
            c.show_command(c.cli_predict(x["model"], plat["hw"], plat_key(plat, 1, s, x["context"]), x["batches"]))
