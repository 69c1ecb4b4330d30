"""Design search view: a grid or random design swept with perfmodel.search.sweep.run_design (or the rows
a `perfmodel sweep --out` wrote), its Pareto front of tokens/s per chip against time per token,
a sortable table and the CLI command (with the sweep file) that reproduces it."""
from __future__ import annotations

import io
import tomllib

import pandas as pd
import streamlit as st

from perfmodel.search import design
from perfmodel.search.batch import OBJECTIVES
from perfmodel.search.sweep import Best, run_design
from perfmodel.spec import arch, hardware
from perfmodel.spec.deployment import ENGINES
from perfmodel.util.errors import require

from . import charts
from . import common as c

AXES = {"batch": [1, 2, 4, 8, 16, 32, 64, 128, 256], "context": [1024, 4096, 16384, 32768, 65536, 131072],
        "prefetch_mib": [2, 4, 8, 12, 16, 24, 32, 48], "expert_slots": [1, 2, 3, 4, 8],
        "vmem_mib": [16, 32, 48, 64, 96, 128]}
DEFAULT_AXES = {"batch": [1, 4, 16, 64], "context": [4096], "prefetch_mib": [8, 16, 32], "expert_slots": [2, 4],
                "vmem_mib": [64]}
SHOWN = ["point", "batch", "context", "prefetch_mib", "expert_slots", "vmem_mib", "engine", "devices", "tp", "ep",
         "step_ms", "token_latency_ms", "tokens_per_s", "tokens_per_s_per_chip", "bound", "hbm_utilisation",
         "constraint", "reason"]


def sweep_file(base: dict, axes: dict, samples: int | None, seed: int) -> str:
    """The design as a sweep file (docs/sweep.md)."""
    val = lambda v: f'"{v}"' if isinstance(v, str) else f"{v:g}" if isinstance(v, float) else str(v)
    lines = ["[base]"] + [f"{k} = {val(v)}" for k, v in base.items()]
    if samples is None:
        lines += ["", "[grid]"]
    else:
        lines += ["", "[random]", f"samples = {samples}", f"seed = {seed}", "", "[random.axes]"]
    lines += [f"{k} = [{', '.join(val(v) for v in vs)}]" for k, vs in axes.items()]
    return "\n".join(lines) + "\n"


@st.cache_data(show_spinner="Sweeping the design ...", max_entries=16)
def run_cached(text: str, top: int, objective: str) -> dict:
    return run_design(design.from_dict(tomllib.loads(text), source="design.toml"), top=top,
                      objective=objective, jobs=1, keep_rows=True, progress=False)


@st.cache_data(show_spinner="Reading the rows ...", max_entries=4)
def read_results(data: bytes, name: str, top: int, objective: str) -> dict:
    """A results file's summary (top K, fronts, filtered counts) and rows."""
    df = pd.read_parquet(io.BytesIO(data)) if name.endswith(".parquet") else pd.read_csv(io.BytesIO(data))
    missing = [k for k in ("point", "model", "status", "constraint", "reason", "token_latency_s",
                           "tokens_per_s_per_chip", objective) if k not in df]
    require(not missing, "results file", name, f"is not perfmodel sweep output: no column {', '.join(missing)}")
    rows = df.astype(object).where(df.notna(), None).to_dict("records")
    best = Best(top, objective)
    best.add(rows)
    return best.summary() | {"rows": rows, "elapsed_s": None}


def inputs() -> tuple[str, int, str]:
    c.init(ds_model="kimi-k3", ds_hw="tpu-v7", ds_devices=32, ds_tp=32, ds_ep=8, ds_engine="megakernel",
           ds_kind="grid", ds_samples=200, ds_seed=0, ds_top=10, ds_objective="tokens_per_s_per_chip",
           **{f"ds_{k}": v for k, v in DEFAULT_AXES.items()})
    with st.form("ds_form"):
        r1 = st.columns(6)
        base = {"model": r1[0].selectbox("Model", arch.list_presets(), key="ds_model"),
                "hardware": r1[1].selectbox("Hardware", hardware.list_presets(), key="ds_hw"),
                "devices": int(r1[2].number_input("Devices", 1, 4096, key="ds_devices")),
                "tp": int(r1[3].number_input("TP", 1, 4096, key="ds_tp")),
                "ep": int(r1[4].number_input("EP groups", 1, 4096, key="ds_ep")),
                "engine": r1[5].radio("Engine", ENGINES, key="ds_engine")}
        r2 = st.columns(len(AXES))
        axes = {k: r2[i].multiselect(k, AXES[k], key=f"ds_{k}") for i, k in enumerate(AXES)}
        r3 = st.container(horizontal=True, vertical_alignment="bottom")
        kind = r3.radio("Design", ("grid", "random"), horizontal=True, key="ds_kind",
                        help="grid: every combination; random: samples drawn from the values")
        # the ranking and the random draw: a popover (mounted when opened) labelled with their values
        v = {k: st.session_state[f"ds_{k}"] for k in ("top", "objective", "samples", "seed")}
        with r3, st.popover(f"top {v['top']} by {v['objective']}; random: {v['samples']} samples, seed {v['seed']}",
                            key="ds_rank_menu"):
            r = st.columns([2, 1, 1, 1])
            objective = r[0].selectbox("Objective (top K)", list(OBJECTIVES), key="ds_objective")
            top = int(r[1].number_input("K", 1, 1000, key="ds_top"))
            samples = int(r[2].number_input("Samples (random)", 1, 100_000, key="ds_samples"))
            seed = int(r[3].number_input("Seed (random)", 0, 2**31, key="ds_seed"))
        r3.form_submit_button("Run sweep")
    axes = {k: sorted(v) for k, v in axes.items() if v}
    if not axes:
        axes = {"batch": [1]}
    return sweep_file(base, axes, samples if kind == "random" else None, seed), top, objective


def render() -> None:
    st.header("Design search: throughput per chip against latency")
    source = st.radio("Source", ("Sweep a design", "Open a results file"), horizontal=True, key="ds_source",
                      help="A results file is what `perfmodel sweep --out FILE` wrote (any executor, any size).")
    if source == "Sweep a design":
        text, top, objective = inputs()
        show(run_cached(text, top, objective), top, objective)
        sweep = st.expander("Sweep file (save as design.toml)", key="ds_file_exp", on_change="rerun")
        if sweep.open:  # drawn only when opened
            with sweep:
                st.code(text, language="toml")
        c.show_command(f"perfmodel sweep --design design.toml --out design.parquet --top {top} --objective {objective}")
        return
    # defaults into the session state once: a widget given a default while its kept value is set again (the
    # inputs kept across views) makes Streamlit warn in the server log
    c.init(ds_file_objective="tokens_per_s_per_chip", ds_file_top=10)
    r = st.columns([3, 1, 1])
    up = r[0].file_uploader("Rows written by perfmodel sweep --out", type=["parquet", "csv"], key="ds_upload")
    objective = r[1].selectbox("Objective (top K)", list(OBJECTIVES), key="ds_file_objective")
    top = int(r[2].number_input("K", 1, 1000, key="ds_file_top"))
    if up is None:
        st.info("Upload a .parquet or .csv written by `perfmodel sweep --design FILE --out ROWS`.")
        return
    show(read_results(up.getvalue(), up.name, top, objective), top, objective)
    c.show_command(f"perfmodel sweep --design <the sweep file> --out {up.name} --top {top} --objective {objective}")


def show(s: dict, top: int, objective: str) -> None:
    f = s["filtered"]
    m = st.columns(4)
    m[0].metric("configurations", f"{s['points']:,}")
    m[1].metric("evaluated", f"{s['ok']:,}")
    m[2].metric("filtered (memory / VMEM / layout)",
                " / ".join(str(f.get(k, 0)) for k in ("memory", "vmem", "layout")))
    if s["elapsed_s"] is not None:
        m[3].metric("sweep time", f"{s['elapsed_s']:.2f} s")
    for k, reason in s["filtered_reason"].items():
        st.caption(f"{k}: {f[k]} filtered, e.g. {reason}")
    df = pd.DataFrame(s["rows"])
    df["step_ms"], df["token_latency_ms"] = df["step_s"] * 1e3, df["token_latency_s"] * 1e3
    front = {r["point"] for r in s["pareto"]}
    ok = df[df["status"] == "ok"]
    if ok.empty:
        st.warning("No configuration of this design fits: see the filtered reasons above.")
    else:
        charts.show(pareto_figure(ok, front), "ds_pareto")
    rows = st.expander("Rows: the front, the top K, all or the filtered (a sortable table)", key="ds_rows_exp",
                       on_change="rerun")
    if rows.open:  # drawn only when opened
        with rows:
            which = st.radio("Rows", ("Pareto front", f"top {top} by {objective}", "all", "filtered"), horizontal=True,
                             key="ds_rows")
            shown = {"Pareto front": df[df["point"].isin(front)], "all": df,
                     "filtered": df[df["status"] != "ok"]}.get(which, df[df["point"].isin([r["point"] for r in s["top"]])])
            st.dataframe(shown[[k for k in SHOWN if k in shown]], hide_index=True, key="ds_table")  # click a header to sort
    c.downloads(df.drop(columns=["step_ms", "token_latency_ms"]), "design_search", "ds_dl", {"objective": objective})


def pareto_figure(ok: pd.DataFrame, front: set) -> dict:
    """Tokens/s per chip against time per token: every configuration grey, the Pareto front red and joined."""
    on = ok["point"].isin(front)
    x = charts.quant("latency_ms", "time per token per sequence (ms)", scale={"zero": False})
    y = charts.quant("tokens_per_s_per_chip", "tokens/s per chip", scale={"zero": False})
    color = charts.nominal("series", "", scale=charts.colors({"configurations": "#bbbbbb", "Pareto front": "#d62728"}))
    tip = charts.tip(("point", "point"), ("batch", "batch"), ("context", "context"), ("prefetch_mib", "prefetch (MiB)"),
                     ("expert_slots", "slots"), ("vmem_mib", "VMEM (MiB)"), ("bound", "bound"),
                     ("latency_ms", "ms per token", ".4g"), ("tokens_per_s_per_chip", "tokens/s per chip", ",.1f"))
    data = lambda d, name: charts.rows(  # noqa: E731
        series=name, latency_ms=(d["token_latency_s"] * 1e3).to_numpy(), **{
            k: d[k].to_numpy() for k in ("tokens_per_s_per_chip", "point", "batch", "context", "prefetch_mib",
                                         "expert_slots", "vmem_mib", "bound") if k in d})
    return {"height": 420, "config": {"legend": charts.LEGEND}, "layer": [
        charts.layer(data(ok[~on], "configurations"), {"type": "point", "filled": True, "size": 36}, x=x, y=y,
                     color=color, tooltip=tip),
        charts.layer(data(ok[on].sort_values("token_latency_s"), "Pareto front"),
                     {"type": "line", "point": {"size": 70}}, x=x, y=y, color=color, order={"field": "latency_ms"},
                     tooltip=tip)]}
