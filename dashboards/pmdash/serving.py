"""Serving view: TTFT and TPOT (p50, p90) of one deployment against offered load, with the targets.

Each load is a `perfmodel serve` simulation (perfmodel.serving_curves: continuous batching over
paged KV blocks on the engines' step costs, docs/serving.md) of a few requests, cached on its
inputs, so a change of the targets redraws without simulating again. The highest load whose TTFT
and TPOT at the chosen percentile are both within their targets is marked; the commands beside
the chart reproduce it and the whole curve.
"""
from __future__ import annotations

import shlex

import pandas as pd
import streamlit as st

from perfmodel.serve.curves import load_curves
from perfmodel.util.errors import SpecError

from . import charts
from . import common as c
from .inputs import batches_field, current_or_last, maybe_stale, number_field, parse_values

ARRIVALS = {"Poisson rate (requests/s)": "rate", "concurrency (clients)": "concurrency"}
DEFAULT_LOADS = {"rate": "0.5, 1, 2, 4, 8", "concurrency": "1, 2, 4, 8, 16, 32"}
PERCENTILES = ("p50", "p90")
METRICS = (("ttft_s", "TTFT", "s", 1.0), ("tpot_s", "TPOT", "ms", 1e3))  # key, name, unit, scale
COLORS = {"p50": "#1f77b4", "p90": "#ff7f0e"}


@st.cache_data(show_spinner=False, max_entries=64)
def curves(m_ref: tuple, h_ref: tuple, key: tuple, arrivals: str, loads: tuple, requests: int, input_len: int,
           output_len: int, seed: int) -> dict:
    """perfmodel.serving_curves for one deployment, or {"error": message} for one the model refuses."""
    try:
        return load_curves(c.model_for(m_ref, key), c.load_hardware_ref(h_ref), c.make_deployment(key), list(loads),
                           arrivals=arrivals, input_len=input_len, output_len=output_len, requests=requests, seed=seed)
    except SpecError as e:
        return {"error": c.readable(str(e))}


def rows(points: list[dict], targets: dict) -> list[dict]:
    """One row per load: the percentiles, throughput and whether both targets are met."""
    out = []
    for p in points:
        r = {"load": p["load"]}
        for k in ("ttft_s", "tpot_s", "e2e_s"):
            r.update({f"{k[:-2]}_{q}_s": p[k][q] for q in ("p50", "p90", "p99", "mean")})
        r.update({k: p[k] for k in ("throughput_tokens_per_s", "tokens_per_s_per_chip", "requests_per_s",
                                    "kv_occupancy_mean", "preemptions", "saturated")})
        q = targets["percentile"]
        ttft, tpot = r[f"ttft_{q}_s"], r[f"tpot_{q}_s"]
        r["meets_targets"] = (ttft is not None and tpot is not None and ttft <= targets["ttft_s"]
                              and tpot <= targets["tpot_s"])
        out.append(r)
    return out


def best(table: list[dict]) -> dict | None:
    """The highest load meeting both targets (None when none does)."""
    ok = [r for r in table if r["meets_targets"]]
    return max(ok, key=lambda r: r["load"]) if ok else None


def inputs(errs: list) -> dict | None:
    gb = c.CANONICAL["gb200"]  # by default the published GB200 deployment (perfmodel/data/seed_measurements.csv)
    c.init(sv_model="kimi-k3", sv_hw=gb["hardware"], sv_engine=gb["engine"], sv_serving=gb["serving_engine"],
           sv_kv=gb["kv_cache"], sv_devices=str(gb["devices"]), sv_tp=str(gb["tp"]), sv_ep=str(gb["ep"]),
           sv_arrivals=list(ARRIVALS)[0], sv_loads=DEFAULT_LOADS["rate"], sv_requests="100", sv_input="1024",
           sv_output="256", sv_seed="0", sv_ttft="1", sv_tpot="30", sv_pct="p90")
    r1 = st.columns([2, 2, 2, 1, 1, 1])
    model = r1[0].selectbox("Model", c.model_options(), key="sv_model")
    hw = r1[1].selectbox("Hardware", c.hardware_options(), key="sv_hw")
    engine = r1[2].radio("Engine", ("megakernel", "multikernel"), horizontal=True, key="sv_engine")
    devices = number_field(r1[3], "Devices", "sv_devices", errors=errs)
    tp = number_field(r1[4], "TP", "sv_tp", errors=errs)
    ep = number_field(r1[5], "EP groups", "sv_ep", errors=errs)
    r2 = st.columns([2, 3, 1, 1, 1])
    label = r2[0].radio("Offered load", list(ARRIVALS), key="sv_arrivals", on_change=reset_loads)
    arrivals = ARRIVALS[label]
    integer = arrivals == "concurrency"
    loads = batches_field(r2[1], "Loads (comma-separated)", "sv_loads", errors=errs,
                          parse=lambda t: parse_values(t, "Loads", integer=integer, lo=1 if integer else 1e-3,
                                                       hi=4096 if integer else 1e5, most=12,
                                                       example=DEFAULT_LOADS[arrivals]))
    ttft = number_field(r2[2], "TTFT target (s)", "sv_ttft", integer=False, lo=1e-6, hi=1e6, errors=errs)
    tpot = number_field(r2[3], "TPOT target (ms)", "sv_tpot", integer=False, lo=1e-6, hi=1e9, errors=errs)
    pct = r2[4].radio("Targets at", PERCENTILES, horizontal=True, key="sv_pct")
    # the kernels and the traffic's details: popovers (mounted when opened) labelled with their values
    r3 = st.container(horizontal=True)
    with r3, c.kernel_menu("sv", hw, engine):
        serving, kv = c.kernel_choices(*st.columns(2), hw, engine, "sv")
    now = {k: st.session_state[f"sv_{k}"] for k in ("requests", "input", "output", "seed")}
    with r3, st.popover(f"{now['requests']} requests per load, {now['input']} prompt / {now['output']} output tokens, "
                        f"seed {now['seed']}", key="sv_traffic_menu"):
        t = st.columns(4)
        requests = number_field(t[0], "Requests per load", "sv_requests", lo=2, hi=100_000, errors=errs,
                                help="Requests simulated at each load (more: smoother percentiles, slower).")
        input_len = number_field(t[1], "Prompt tokens", "sv_input", hi=1_000_000, errors=errs)
        output_len = number_field(t[2], "Output tokens", "sv_output", lo=2, hi=1_000_000, errors=errs)
        seed = number_field(t[3], "Seed", "sv_seed", lo=0, hi=2**32 - 1, errors=errs)
    if errs:
        return None
    return dict(model=model, hw=hw, key=c.dep_key(devices, tp, ep, engine, serving_engine=serving, kv_cache=kv),
                arrivals=arrivals, loads=tuple(loads), requests=requests, input_len=input_len, output_len=output_len,
                seed=seed, targets={"ttft_s": ttft, "tpot_s": tpot / 1e3, "percentile": pct})


def reset_loads() -> None:
    """Another kind of load: its default loads (a rate of 32/s and 32 clients are different traffic)."""
    st.session_state["sv_loads"] = DEFAULT_LOADS[ARRIVALS[st.session_state["sv_arrivals"]]]


def render() -> None:
    st.header("Serving: TTFT and TPOT against load")
    st.caption("Requests arrive (Poisson at a rate, or a closed loop of clients) and are served by continuous "
               "batching over a paged KV cache on the model's step costs (`perfmodel serve`, docs/serving.md). "
               "By default the published GB200 deployment of Kimi K3.")
    errs: list[str] = []
    x = inputs(errs)
    good, stale = current_or_last("sv", x, "; ".join(errs) if errs else None)
    if good is None:
        st.info("Fix the inputs above to simulate.")
        return
    n = len(good["loads"])
    with st.spinner(f"Simulating {good['requests']} requests at each of {n} load{'s' if n > 1 else ''} "
                    "(seconds; cached afterwards)..."):
        res = curves(c.model_ref(good["model"]), c.hardware_ref(good["hw"]), good["key"], good["arrivals"],
                     good["loads"], good["requests"], good["input_len"], good["output_len"], good["seed"])
    if "error" in res:
        st.error(f"This deployment cannot serve: {res['error']}")
        return
    table = rows(res["points"], good["targets"])
    top = best(table)
    with maybe_stale(stale, "sv"):
        headline(good, table, top, res["chips"])
        draw(good, table, top)
        if any(r["saturated"] for r in table):
            st.caption("Hollow markers: saturated loads (requests served at under 95 % of the rate they arrived "
                       "at; the queue grows, so their latencies grow with the requests simulated).")
        files(good, table, top, res["chips"])


def headline(x: dict, table: list[dict], top: dict | None, chips: int) -> None:
    """The highest load meeting both targets and its figures, as one line (common.figures_line)."""
    q, t = x["targets"]["percentile"], x["targets"]
    if top is None:
        st.markdown(f"highest load meeting both targets: **none** (no load has TTFT {q} <= {t['ttft_s']:g} s "
                    f"and TPOT {q} <= {t['tpot_s'] * 1e3:g} ms)")
        return
    unit = "requests/s" if x["arrivals"] == "rate" else "client" if top["load"] == 1 else "clients"
    c.figures_line([
        ("highest load meeting both targets", f"{top['load']:g} {unit}"),
        (f"TTFT {q} there", f"{top[f'ttft_{q}_s']:.3g} s"), (f"TPOT {q} there", f"{top[f'tpot_{q}_s'] * 1e3:.3g} ms"),
        ("throughput there", f"{top['throughput_tokens_per_s']:,.0f} tokens/s"),
        ("per chip", f"{top['tokens_per_s_per_chip']:,.1f} tokens/s ({chips} chips)")])


def draw(x: dict, table: list[dict], top: dict | None) -> None:
    """TTFT over TPOT against load, p50 solid and p90 dashed (the legend above says so; hollow markers: saturated
    loads), the target lines and the highest load meeting both, each labelled: TTFT (chart sv_chart) over TPOT
    (sv_tpot_chart) on the same load range, Vega-Lite specs of plain dicts."""
    xlabel = "offered load (" + ("Poisson arrivals, requests/s" if x["arrivals"] == "rate" else "concurrent clients") + ")"
    loads = [r["load"] for r in table]
    load = charts.quant("load", xlabel, scale=charts.shared_x(loads, log=True), axis={"values": loads, "format": "~g"})
    pct = {"field": "pct", "type": "nominal", "title": "percentile (both panels)", "scale": charts.colors(COLORS)}
    for i, (k, name, unit, scale) in enumerate(METRICS):
        y = charts.quant("y", f"{name} ({unit})", scale={"type": "log"})
        curve = [{"series": f"{name} {q}", "pct": q, "load": r["load"], "saturated": r["saturated"],
                  "y": None if r[f"{k[:-2]}_{q}_s"] is None else r[f"{k[:-2]}_{q}_s"] * scale}
                 for q in PERCENTILES for r in table]
        legend = {} if i == 0 else {"legend": None}  # the TPOT panel under it reads the same legend
        target = x["targets"][k] * scale
        line = charts.rows(series=f"{name} target", y=target,
                           text=f"{name} target {target:g} {unit} ({x['targets']['percentile']})")
        marks = [charts.layer(curve, {"type": "line"}, x=load, y=y, color={**pct, **legend}, strokeDash={
                     **pct, "scale": {"domain": list(PERCENTILES), "range": [[1, 0], [6, 4]]},
                     **({"legend": {"symbolType": "stroke", "symbolStrokeWidth": 2}} if i == 0 else legend)}),
                 charts.layer(curve, {"type": "point", "size": 70, "strokeWidth": 2}, x=load, y=y,
                              color={**pct, **legend},  # a layer's legend None would drop the merged legend
                              fill={"condition": {"test": "datum.saturated", "value": "white"}, **pct, **legend},
                              tooltip=charts.tip(("load", "load", "g"), ("y", f"{name} ({unit})", ".4g"),
                                                 ("saturated", "saturated"))),
                 # each curve named at its last load (p90 above p50), so a panel reads without the legend
                 *(charts.layer([dict(r, label=q) for r in curve if r["load"] == loads[-1] and r["pct"] == q
                                 and r["y"] is not None],
                                {"type": "text", "align": "left", "dx": 8, "dy": dy, "baseline": base, "fontSize": 11,
                                 "fontWeight": "bold"}, x=load, y=y, color={**pct, **legend}, text={"field": "label"})
                   for q, base, dy in (("p50", "top", 1), ("p90", "bottom", -1))),
                 charts.layer(line, {"type": "rule", "color": "#d62728", "strokeWidth": 1.5, "strokeDash": [2, 2]},
                              y=y),
                 charts.layer(line, {"type": "text", "align": "left", "baseline": "bottom", "x": 4, "dy": -2,
                               "color": "#d62728", "fontSize": 11}, y=y, text={"field": "text"})]
        if top is not None:
            best = charts.rows(series="highest load meeting both", load=top["load"],
                               text=f"highest load meeting both: {top['load']:g}")
            marks.append(charts.layer(best, {"type": "rule", "color": "#2ca02c", "strokeWidth": 2}, x=load))
            marks.append(charts.layer(best, {"type": "text", "align": "left", "baseline": "top", "dx": 4, "y": 4,
                                             "color": "#2ca02c", "fontSize": 12}, x=load, text={"field": "text"}))
        top_legend = {**charts.TOP_LEGEND, "direction": "horizontal", "columns": 2}
        charts.show(charts.panel(marks, 300 if i == 0 else 260, legend=top_legend),
                    "sv_chart" if i == 0 else "sv_tpot_chart")


def files(x: dict, table: list[dict], top: dict | None, chips: int) -> None:
    df = pd.DataFrame(table)
    ex = st.expander(f"Per-load results ({len(df)} loads)", key="sv_table_exp", on_change="rerun")
    if ex.open:  # drawn only when opened
        with ex:
            st.dataframe(df, hide_index=True, key="sv_table")
    c.downloads(df, "serving_curve", "sv_dl", {"model": x["model"], "hardware": x["hw"], "chips": chips,
                                               "arrivals": x["arrivals"], "targets": x["targets"],
                                               "highest_load_meeting_targets": None if top is None else top["load"]})
    one, loop = cli_serve(x, top["load"] if top else x["loads"][0])
    c.show_command(one, "Reproduce " + ("the marked load" if top else "the first load") + " with the CLI, then the whole "
                   "curve:")
    st.markdown(c.code_span(loop))


def cli_serve(x: dict, load) -> tuple[str, str]:
    """`perfmodel serve` at one load, and a shell loop over the curve's loads."""
    flag = "--rate" if x["arrivals"] == "rate" else "--concurrency"
    args = ["perfmodel", "serve"] + c.cli_args(x["model"], x["hw"], x["key"])
    traffic = ["--requests", str(x["requests"]), "--input-len", str(x["input_len"]), "--output-len",
               str(x["output_len"]), "--seed", str(x["seed"]), "--json"]
    one = shlex.join(args + [flag, f"{load:g}"] + traffic)
    loop = (f"for load in {' '.join(f'{v:g}' for v in x['loads'])}; do "
            + shlex.join(args) + f' {flag} "$load" ' + shlex.join(traffic) + "; done")
    return one, loop
