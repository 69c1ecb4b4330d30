"""Validation view: per-layer predicted vs measured (bundled host results, uploaded traces), MAPE:
a scatter of predicted against measured layer times with y = x and the per-layer target band,
the per-layer bars and table on demand, a real megakernel's published phase profile beside the model
(`perfmodel explain --profile`, on demand), and a trace of your own (its inputs open on demand).

The bundled results are experiments/results/host_validation.csv, written by
experiments/validate_host.py, and experiments/results/gpu_validation.csv (experiments/validate_gpu.py,
an H200), each with one row per layer and one "step" row per run (variant, model, mode, batch,
context). Each names the machine it was measured on in its header, shown as such (never as "this
machine": the dashboard may run elsewhere), with the rest of its provenance one click away; a large
step error comes with what the traces say about it. This project's megakernel and the XLA reference on a
real TPU (experiments/results/tpu_megakernel.json, written by experiments/tpu_megakernel.py on a lent chip,
and the model beside it in tpu_validation.json, experiments/validate_tpu.py) are drawn as tokens/s across
batch sizes, measured against predicted, with what they do not measure yet.
A trace the user gives is parsed and compared by `perfmodel.validate.host`
(`perfmodel.validate.traces` underneath), exactly as `perfmodel validate --trace ...` does.
"""
from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path, PurePosixPath

import pandas as pd
import streamlit as st

from perfmodel.util.errors import SpecError

from . import charts
from . import common as c
from . import measured
from .measured import GPU_VALIDATION_CSV, HOST_VALIDATION_CSV

WORST = 5
KIND_COLORS = ("#1f77b4", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#bcbd22")
BAND = 0.25  # the per-layer target of the host validation (docs/validation.md): within +-25 %
RUN_KEYS = ("variant", "model", "mode", "batch", "context")
HOST_HW_FILE = c.HOST_HW_FILE
FROM_CAPTURE = "(from capture.json)"
PROFILE_NAME, PROFILE_HW = "musespark", "tpu-v7"  # the bundled phase profile and the chip it was measured on


def per_layer_table(df: pd.DataFrame) -> pd.DataFrame:
    """Normalise a per-layer comparison to layer, kind, predicted_us, measured_us, error.

    Takes a layer column and predicted / measured times in seconds (`predicted_s`), or in
    microseconds / milliseconds (`*_us`, `*_ms`). Rows whose layer is not a number (the
    host CSV's per-step rows) are left out.
    """
    cols = {k.lower(): k for k in df.columns}
    layer = next((cols[k] for k in ("layer", "layer_index", "layer_id") if k in cols), None)
    if layer is None:
        raise SpecError("per-layer table", list(df.columns), "needs a 'layer' column")

    def pick(word: str) -> tuple[str, float]:
        for suffix, scale in (("_s", 1.0), ("_us", 1e-6), ("_ms", 1e-3)):
            if word + suffix in cols:
                return cols[word + suffix], scale
        raise SpecError("per-layer table", list(df.columns),
                        f"needs a {word} time column ({word}_s, {word}_us or {word}_ms)")

    pc, ps = pick("predicted")
    mc, ms = pick("measured")
    lay = pd.to_numeric(df[layer], errors="coerce")
    keep = lay.notna()
    out = pd.DataFrame({"layer": lay[keep].astype(int)})
    kind = next((cols[k] for k in ("kind", "layer_kind") if k in cols), None)
    out["kind"] = df.loc[keep, kind].astype(str) if kind else ""
    out["predicted_us"] = pd.to_numeric(df.loc[keep, pc], errors="coerce") * ps * 1e6
    out["measured_us"] = pd.to_numeric(df.loc[keep, mc], errors="coerce") * ms * 1e6
    out = out[out["measured_us"].notna() & out["predicted_us"].notna() & (out["measured_us"] > 0)]
    out["error"] = out["predicted_us"] / out["measured_us"] - 1
    out["abs_error"] = out["error"].abs()
    return out.reset_index(drop=True)


def show_comparison(df: pd.DataFrame, title: str, key: str, command: str | None,
                    step: tuple[float, float] | None = None, why: str | None = None, unit: str = "layer") -> None:
    """MAPE, the per-layer chart with the worst layers in red, the table, downloads, the CLI; `why`: what the
    traces say about the step error, under the figures; `unit`: what a row is (a layer, or a run)."""
    if df.empty:
        st.warning(f"{title}: no layer has both a predicted and a measured time.")
        return
    mape = float(df["abs_error"].mean())
    pred_step, meas_step = step or (df["predicted_us"].sum() / 1e6, df["measured_us"].sum() / 1e6)
    m = st.columns(4)
    m[0].metric(f"MAPE over {unit}s", f"{mape:.1%}")
    m[1].metric("step error", f"{pred_step / meas_step - 1:+.1%}" if meas_step else "n/a",
                help="(predicted - measured) / measured for the whole step" if step else
                "sum of the layers (no separate step measurement)")
    m[2].metric("measured step", f"{meas_step * 1e3:.3f} ms")
    m[3].metric(f"{unit}s", f"{len(df)}")
    if why:
        st.info(why, icon=":material/lightbulb:")
    worst = df.nlargest(min(WORST, len(df)), "abs_error")
    is_worst = df.index.isin(worst.index)
    charts.show(scatter_figure(df, is_worst, unit), f"{key}_chart")
    inside = float((df["abs_error"] <= BAND).mean())
    st.caption(f"{inside:.0%} of the {unit}s lie inside the +-{BAND:.0%} band (the per-layer target). Red: the "
               f"{len(worst)} {unit}s with the largest absolute error "
               f"({', '.join(f'{unit} {int(r.layer)} {r.error:+.0%}' for r in worst.itertuples())}).")
    if unit != "layer":
        return c.downloads(df, f"validation_{key}", f"{key}_dl", {"title": title, "mape": mape})
    bars = st.expander("Per layer: measured bars, predicted marks", key=f"{key}_bars_exp", on_change="rerun")
    if bars.open:
        with bars:
            charts.show(bars_figure(df, is_worst), f"{key}_layers")
    table = st.expander("Per-layer table (the worst layers red)", key=f"{key}_table_exp", on_change="rerun")
    if table.open:
        with table:
            styled = df.style.format({"predicted_us": "{:.2f}", "measured_us": "{:.2f}", "error": "{:+.1%}",
                                      "abs_error": "{:.1%}"}).apply(
                lambda r: ["background-color: #f8d7da" if is_worst[r.name] else "" for _ in r], axis=1)
            st.dataframe(styled, hide_index=True, key=f"{key}_table")
    c.downloads(df, f"validation_{key}", f"{key}_dl", {"title": title, "mape": mape})
    if command:
        c.show_command(command)


def layer_rows(df: pd.DataFrame, series: str) -> list[dict]:
    """Inline chart data of per-layer rows."""
    return charts.rows(series=series, layer=df["layer"].to_numpy(), kind=df["kind"].to_numpy(),
                       measured_us=df["measured_us"].to_numpy(), predicted_us=df["predicted_us"].to_numpy(),
                       error=df["error"].to_numpy())


LAYER_TIP = charts.tip(("layer", "layer"), ("kind", "kind"), ("measured_us", "measured (us)", ".2f"),
                       ("predicted_us", "predicted (us)", ".2f"), ("error", "error", "+.1%"))


def scatter_figure(df: pd.DataFrame, is_worst, unit: str = "layer") -> dict:
    """Predicted against measured layer (or run) time (log-log), one colour per layer kind, y = x and the band,
    the worst layers red and numbered."""
    lo = float(min(df["measured_us"].min(), df["predicted_us"].min())) / 1.5
    hi = float(max(df["measured_us"].max(), df["predicted_us"].max())) * 1.5
    decades = {"type": "log", "domain": [lo, hi], "nice": False}
    x = charts.quant("measured_us", f"measured time per {unit} (us, log)", scale=decades)
    y = charts.quant("predicted_us", f"predicted time per {unit} (us, log)", scale=decades)
    band, exact = f"+-{BAND:.0%} (per-layer target)", "y = x (exact)"
    names = {band: "#2ca02c", exact: "#2ca02c"}
    points = []
    for i, (kind, g) in enumerate(df[~is_worst].groupby("kind", sort=True)):
        names[kind or "layers"] = KIND_COLORS[i % len(KIND_COLORS)]
        points += layer_rows(g, kind or "layers")
    w = df[is_worst]
    worst = f"{len(w)} worst {unit}s"
    names[worst] = "#d62728"
    color = charts.nominal("series", "", scale=charts.colors(names))
    return {"height": 440, "config": {"legend": charts.LEGEND}, "layer": [
        charts.layer(charts.rows(series=band, measured_us=[lo, hi], predicted_us=[lo * (1 - BAND), hi * (1 - BAND)],
                                 top=[lo * (1 + BAND), hi * (1 + BAND)]),
                     {"type": "area", "opacity": 0.15}, x=x, y=y, y2={"field": "top"}, color=color,
                     tooltip=charts.tip()),
        charts.layer(charts.rows(series=exact, measured_us=[lo, hi], predicted_us=[lo, hi]),
                     {"type": "line", "strokeDash": [2, 2]}, x=x, y=y, color=color, tooltip=charts.tip()),
        charts.layer(points, {"type": "point", "filled": True, "size": 80}, x=x, y=y, color=color, tooltip=LAYER_TIP),
        charts.layer(layer_rows(w, worst), {"type": "point", "shape": charts.X_SHAPE, "size": 120, "strokeWidth": 2.5},
                     x=x, y=y, color=color, tooltip=LAYER_TIP),
        charts.layer([dict(r, label=str(r["layer"])) for r in layer_rows(w, worst)],
                     {"type": "text", "dy": -12, "color": "#d62728"}, x=x, y=y, text={"field": "label"})]}


def bars_figure(df: pd.DataFrame, is_worst) -> dict:
    """Per layer: measured bars (the worst in red) and predicted marks."""
    worst = f"measured, {int(is_worst.sum())} worst layers"
    color = charts.nominal("series", "", scale=charts.colors({"measured": "#9ecae1", worst: "#d62728",
                                                              "predicted": "#08306b"}))
    x = charts.quant("layer", "layer (0 = embedding, last = head)", axis={"tickMinStep": 1},
                     scale={"domain": [float(df["layer"].min()) - 0.5, float(df["layer"].max()) + 0.5], "nice": False})
    width = {"expr": f"0.85 * width / {len(df)}"}
    return {"height": 380, "config": {"legend": charts.LEGEND}, "layer": [
        charts.layer(layer_rows(df[~is_worst], "measured") + layer_rows(df[is_worst], worst),
                     {"type": "bar", "width": width}, x=x, y=charts.quant("measured_us", "time per layer (us)"),
                     color=color, tooltip=LAYER_TIP),
        charts.layer(layer_rows(df, "predicted"), {"type": "tick", "orient": "horizontal", "thickness": 4, "size": {"expr": f"width / {len(df)}"}},
                     x=x, y=charts.quant("predicted_us", "time per layer (us)"), color=color, tooltip=LAYER_TIP)]}


@st.cache_data(show_spinner=False, max_entries=4)
def read_host_csv(path: str, mtime: float) -> pd.DataFrame:
    return c.read_csv_bytes(Path(path).read_bytes())


def provenance_line(path: Path, prefix: str, meta: dict[str, str] | None = None) -> None:
    """Where a results file's numbers were measured (the machine its header names, the date), with its whole
    provenance (command, hardware file, load, note) in a popover."""
    meta = measured.file_header(path) if meta is None else meta
    date = meta.get("date", "").replace("T", " ")[:16]
    a, b = st.columns([4, 1])
    a.caption(f"Measured on {measured.machine_of(meta)}" + (f", {date} UTC" if date else "")
              + f" ({c.shown_path(path)}); not necessarily the machine this dashboard runs on.")
    with b.popover("Provenance", key=f"{prefix}_prov_menu"):
        st.markdown(measured.provenance_markdown(meta))


def bundled(path: Path, what: str, command: str, prefix: str, key: str, why=None) -> None:
    """A bundled validation results CSV (the layout experiments/validation_report.py writes): every
    run's step error and layer MAPE, then one run's layers (`key`: its comparison's widgets). `why(step row)`:
    what the traces say about that run's step error, or None."""
    if not path.exists():
        st.info(f"No {what} results yet: {c.shown_path(path)} is missing. `{command}` produces them; this "
                "view then shows them.")
        return
    note = None
    try:
        raw = read_host_csv(str(path), path.stat().st_mtime)
        provenance_line(path, prefix)
        runs = [k for k in RUN_KEYS if k in raw.columns]
        step_pair = None
        if runs:
            ids = raw[runs].astype(str).agg(" / ".join, axis=1)
            raw = raw.assign(run=ids)
            summary = run_summary(raw, runs)
            if not summary.empty:  # a table of every run, drawn only when opened (about 100 rows)
                every = st.expander(f"All runs ({len(summary)}): step error, layer MAPE, worst layer",
                                    key=f"{prefix}_runs_exp", on_change="rerun")
                if every.open:
                    with every:
                        c.static_table(summary, {"step_error": "+.1%", "layer_mape": ".1%",
                                                 "predicted_step_ms": ".3f", "measured_step_ms": ".3f"})
                c.downloads(summary, f"{path.stem}_runs", f"{prefix}_runs_dl")
            choice = st.selectbox("Run (" + " / ".join(runs) + ")", list(dict.fromkeys(ids)), key=f"{prefix}_run")
            raw = raw[raw["run"] == choice]
            step_rows = raw[raw["layer"].astype(str) == "step"] if "layer" in raw.columns else raw.iloc[0:0]
            if len(step_rows) == 1:
                step_pair = (float(step_rows["predicted_s"].iloc[0]), float(step_rows["measured_s"].iloc[0]))
                note = why(step_rows.iloc[0]) if why else None
        df = per_layer_table(raw)
    except SpecError as e:
        st.error(f"{path.name} has an unexpected layout: {e}")
        return
    except Exception as e:  # noqa: BLE001 -- a broken results file must not break the page
        st.error(f"{path.name} could not be read ({type(e).__name__}: {e}).")
        return
    show_comparison(df, what, key, command, step_pair, note)


GPU_RUNS_JSON = GPU_VALIDATION_CSV.with_suffix(".json")


@st.cache_data(show_spinner=False, max_entries=2)
def gpu_runs(path: str, mtime: float) -> dict[tuple, dict]:
    """The GPU results' per-run figures (idle share, kernel time) by (model, mode, batch, context)."""
    runs = json.loads(Path(path).read_text()).get("runs", [])
    return {(r["model"], r["mode"], int(r["batch"]), int(r["context"])): r for r in runs}


def gpu_step_why(step: pd.Series) -> str | None:
    """What the H200's traces say about a run's step error (docs/validation.md, "The H200 runs"): the GPU
    mostly waits on the host, and the model prices another program (a serving engine's op graph, not the
    reference's XLA:GPU kernels)."""
    pred, meas = float(step["predicted_s"]), float(step["measured_s"])
    err = pred / meas - 1 if meas else 0.0
    if abs(err) < 0.25:
        return None
    run = {}
    if GPU_RUNS_JSON.exists():
        key = (step["model"], step["mode"], int(step["batch"]), int(step["context"]))
        run = gpu_runs(str(GPU_RUNS_JSON), GPU_RUNS_JSON.stat().st_mtime).get(key, {})
    busy, idle = run.get("traced_busy_s"), run.get("idle_share")
    kernels, ops = step.get("traced_ops"), step.get("model_ops")
    parts = [f"**Why the step error is {err:+.0%}.** The measured step is the wall time of a step "
             f"({meas * 1e3:.3f} ms), untraced."]
    if idle is not None:
        parts.append(f"In a traced step the GPU was idle {idle:.0%} of the time, waiting on the host: the Python "
                     "call's dispatch and a host round trip on every trip of the reference's expert loop, host work "
                     "the model does not price.")
    if busy:
        parts.append(f"The GPU's kernels took {busy * 1e3:.3f} ms; the model's step is {pred / busy - 1:+.0%} of "
                     "that" + (f": XLA:GPU ran {int(kernels):,} kernels where the model prices the {int(ops)} ops of "
                               "a serving engine's graph" if pd.notna(kernels) and pd.notna(ops) else "") + ".")
    parts.append("The measured costs of the dispatch and of a loop trip, and what would close the gap: "
                 "docs/validation.md, \"The H200 runs\". Nothing is fitted to these runs.")
    return " ".join(parts)


def run_summary(raw: pd.DataFrame, runs: list[str]) -> pd.DataFrame:
    """One line per run: step predicted / measured / error and the layers' MAPE."""
    rows = []
    for _, g in raw.groupby("run", sort=False):
        layers = per_layer_table(g)
        step = g[g["layer"].astype(str) == "step"] if "layer" in g.columns else g.iloc[0:0]
        row = dict(zip(runs, g.iloc[0][runs]))
        if len(step) == 1:
            ps, ms = float(step["predicted_s"].iloc[0]), float(step["measured_s"].iloc[0])
            row.update(predicted_step_ms=ps * 1e3, measured_step_ms=ms * 1e3,
                       step_error=ps / ms - 1 if ms else float("nan"))
        row["layer_mape"] = float(layers["abs_error"].mean()) if not layers.empty else float("nan")
        if not layers.empty:
            w = layers.loc[layers["abs_error"].idxmax()]
            row["worst_layer"] = f"{int(w.layer)} ({w.kind}, {w.error:+.0%})"
        rows.append(row)
    return pd.DataFrame(rows)


def comparisons_table(results) -> pd.DataFrame:
    rows = []
    for comp in results:
        for r in comp.layers:
            rows.append({"run": comp.run, "layer": r.layer, "kind": r.kind, "predicted_s": r.predicted_s,
                         "measured_s": r.measured_s})
    return pd.DataFrame(rows)


def compare_trace(path: Path, x: dict) -> list:
    """Parse a trace (run dir, directory of runs or .xplane.pb) and compare it with the model."""
    from perfmodel.validate import host as validate
    try:
        return validate.validate(path, model=x["model"], hardware=x["hardware"], batch=x["batch"],
                                 context=x["context"], mode=x["mode"])
    except SpecError:
        raise
    except Exception as e:  # noqa: BLE001 -- a foreign or corrupt file must give a message, not a traceback
        raise SpecError("trace", Path(path).name, f"could not be parsed as a profiler trace "
                        f"({type(e).__name__}: {e})") from None


def check_trace_upload(files) -> None:
    names = [f.name for f in files]
    if not any(n.endswith(".pb") for n in names):
        raise SpecError("trace upload", ", ".join(names[:3]),
                        "not a profiler trace: expected a .xplane.pb file or a jax.profiler trace directory")


def safe_relpath(name: str) -> Path:
    parts = [p for p in PurePosixPath(name.replace("\\", "/")).parts if p not in ("", "/", ".", "..")]
    if not parts:
        raise SpecError("trace upload", name, "empty file name")
    return Path(*parts)


def trace_inputs() -> dict:
    """Hardware and, for a trace without capture.json, the model, batch, context and mode."""
    hw_opts = ([str(HOST_HW_FILE)] if HOST_HW_FILE.exists() else []) + c.hardware_options()
    r = st.columns(5)
    hw = r[0].selectbox("Hardware the trace ran on", hw_opts, key="val_hw",
                        format_func=lambda s: c.shown_path(Path(s)) if s.endswith(".toml") else s,
                        help="The host CPU file comes from `perfmodel hostbench` (experiments/results/host-cpu.toml).")
    if hw.startswith(c.UPLOAD_PREFIX):
        raise SpecError("hardware", hw, "trace comparison takes a preset or the hostbench file")
    models = [FROM_CAPTURE] + c.model_options()
    model = r[1].selectbox("Model", models, key="val_model")
    if model.startswith(c.UPLOAD_PREFIX):
        raise SpecError("model", model, "trace comparison takes a preset model (or the capture's)")
    batch = r[2].number_input("Batch", 1, 4096, value=None, placeholder=FROM_CAPTURE, key="val_batch")
    context = r[3].number_input("Context", 0, 10_000_000, value=None, placeholder=FROM_CAPTURE, key="val_context")
    mode = r[4].selectbox("Mode", [FROM_CAPTURE, "compiled", "op_by_op", "megakernel"], key="val_mode",
                        help="compiled / op_by_op: the host reference step; megakernel: a TPU trace of the kernel")
    if not HOST_HW_FILE.exists():
        st.caption(f"{c.shown_path(HOST_HW_FILE)} is missing: run `perfmodel hostbench --out "
                   f"{c.shown_path(HOST_HW_FILE)}` to measure the machine the dashboard runs on.")
    return {"hardware": hw, "model": None if model == FROM_CAPTURE else model, "batch": batch,
            "context": context, "mode": None if mode == FROM_CAPTURE else mode}


def cli_validate(path: str, x: dict) -> str:
    hw = x["hardware"]
    args = ["perfmodel", "validate", "--trace", path, "--hardware", c.shown_path(Path(hw)) if hw.endswith(".toml") else hw]
    for k in ("model", "batch", "context", "mode"):
        if x[k] is not None:
            args += [f"--{k}", str(x[k])]
    return shlex.join(args + ["--json"])


def uploaded() -> None:
    st.caption("A `.xplane.pb` file, or a trace directory from `perfmodel capture` / `jax.profiler` (upload the "
               "directory's files, or give its path on the machine the dashboard runs on). Layers are attributed from the named "
               "scopes in the HLO dump beside the trace (`hlo/`); `capture.json` supplies model, batch and "
               "context.")
    x = trace_inputs()
    files = st.file_uploader("Trace file(s)", accept_multiple_files=True, key="val_upload")
    path_text = st.text_input("...or a trace path on the dashboard's machine", key="val_path",
                              placeholder="e.g. traces/kimi-k3-host-small_b1_c64_compiled or run.xplane.pb",
                              help="Inside the directories this dashboard was opened on: " + c.roots_text() + ".")
    if files:
        check_trace_upload(files)
        with st.spinner("Parsing the uploaded trace and running the model on it (several seconds for a large "
                        "trace)..."):
            results = compare_upload(tuple((f.name, f.getvalue()) for f in files), tuple(x.items()))
        show_results(results, "uploaded trace", "val_upload", None)
    elif path_text:
        p = c.confined_path(path_text)
        if not p.exists():
            raise SpecError("trace path", path_text, "does not exist")
        if p.is_file() and not p.name.endswith(".pb"):
            raise SpecError("trace path", path_text, "expected a .xplane.pb file or a trace directory")
        with st.spinner(f"Parsing {path_text} and running the model on it (several seconds for a large trace)..."):
            results = compare_path(str(p), p.stat().st_mtime, tuple(x.items()))
        show_results(results, "trace", "val_path", cli_validate(path_text, x))


@st.cache_data(show_spinner=False, max_entries=8)
def compare_upload(files: tuple[tuple[str, bytes], ...], x: tuple) -> list:
    """An uploaded trace (a file or a capture directory's files) compared, once per content and inputs;
    messages name the uploaded files, not the server's temporary copy."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files:
            dest = Path(tmp) / safe_relpath(name)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        pbs = list(Path(tmp).rglob("*.pb"))
        target = pbs[0] if len(files) == 1 else Path(tmp)
        shown = "your upload: " + ", ".join(n for n, _ in files[:3]) + (" ..." if len(files) > 3 else "")
        try:
            return compare_trace(target, dict(x))
        except SpecError as e:
            value = shown if tmp in str(e.value) or str(e.value) == target.name else e.value
            raise SpecError(e.field, value, str(e.why).replace(str(target), shown).replace(tmp, shown)) from None


@st.cache_data(show_spinner=False, max_entries=8)
def compare_path(path: str, mtime: float, x: tuple) -> list:
    """A trace on this machine compared, once per path, modification time and inputs."""
    return compare_trace(Path(path), dict(x))


def show_results(results: list, title: str, key: str, command: str | None) -> None:
    if not results:
        st.warning("No captured run found there.")
        return
    if len(results) > 1:
        names = [r.run for r in results]
        pick = st.selectbox("Run", names, key=f"{key}_run")
        comp = results[names.index(pick)]
    else:
        comp = results[0]
    st.caption(f"{comp.run}: {comp.model} on {comp.hardware}, {comp.mode}, batch {comp.batch}, context "
               f"{comp.context}; unattributed {comp.unattributed_share:.1%} of traced op time")
    df = per_layer_table(comparisons_table([comp]))
    if df.empty:
        st.warning("No traced time could be attributed to a layer. A bare .xplane.pb from the CPU carries no "
                   "layer names: give the whole capture directory (with its `hlo/` dump and `capture.json`).")
        return
    show_comparison(df, title, key, command, (comp.predicted_step_s, comp.measured_step_s))


def gpu_header() -> dict[str, str]:
    """The bundled GPU results' provenance lines (machine, date, command, hardware_file, ...)."""
    return measured.file_header(GPU_VALIDATION_CSV)


def tpu_name(meta: dict[str, str]) -> str:
    """The TPU a results file names: 'TPU v5e' (its chip), else its machine."""
    return f"TPU {meta['chip']}" if meta.get("chip") else measured.machine_of(meta)


def trace_coverage(gpu: dict[str, str]) -> str:
    """Which hardware has trace validation (`gpu`: the bundled GPU results' gpu_header), which only
    the published table, which nothing; the host results named by the machine they were measured on."""
    from perfmodel.spec import hardware
    from .measured import published_table
    published = sorted(set(published_table()["hardware"]))
    traced = [gpu["hardware_file"]] if "hardware_file" in gpu else []
    others = [h for h in hardware.list_presets() if h not in published + traced]
    host = measured.machine_of(measured.file_header(HOST_VALIDATION_CSV), "a host CPU")
    on_gpu = (f" and {measured.machine_of(gpu, traced[0])} as `{traced[0]}` (the same reference step with XLA:GPU, "
              "its kernels per layer; below, on demand)") if traced else ""
    t = measured.tpu_results()
    tpu = (f"This project's megakernel on a real TPU: {len(t['rows'])} timed runs on {tpu_name(t['meta'])}, whole "
           "steps only (below)." if t is not None else "This project's megakernel on a real TPU: no run committed "
           "yet (below).")
    return ("**Which platforms have trace validation.** Per layer, from profiler traces: the host CPU "
            f"({host}: traces of the pure-JAX reference step; bundled results below){on_gpu}. "
            f"**{', '.join(published)}: no trace validation yet**; their predictions are checked only against the "
            "published tokens/s table (Inferact, tpu-megakernels report, Sept 2026; see Compare). "
            f"{', '.join(others)}: no step or trace measurement. {tpu} {PROFILE_HW} has one published "
            "phase-by-phase profile of a real megakernel (Inferact's Muse Spark kernel: training data, which its "
            "DMA engine's settings are fitted to; below).")


TPU_ENGINES = {"megakernel": "#d62728", "xla": "#1f77b4"}  # this project's megakernel; the XLA reference step


def tpu_figure(rows: pd.DataFrame) -> dict:
    """Tokens/s per batch on the TPU: measured (squares: this project's runs) and predicted (lines), per engine."""
    names = {e: f"{e}, measured" for e in TPU_ENGINES} | {e: f"{e}, predicted" for e in TPU_ENGINES}
    scale = charts.colors({names[e]: col for e, col in TPU_ENGINES.items()}
                          | {f"{e}, predicted": col for e, col in TPU_ENGINES.items()})
    x = charts.quant("batch", "batch (sequences per step)", scale={"type": "log", "base": 2},
                     axis={"values": sorted(set(rows["batch"])), "format": "d"})
    y = charts.quant("tokens_per_s", "tokens/s (batch / device step time)")
    tooltip = charts.tip(("batch", "batch"), ("tokens_per_s", "tokens/s", ",.0f"), ("step_us", "step (us)", ".1f"),
                         ("error", "prediction's step error", "+.1%"))
    color = charts.nominal("series", "", scale=scale)
    layers = []
    for kind, mark in (("predicted", {"type": "line", "point": False, "strokeDash": [6, 3]}),
                       ("measured", {"type": "point", "shape": charts.SOURCE_SHAPES["measured by this project"],
                                     "filled": True, "size": 90})):
        data = [r for e in TPU_ENGINES for r in charts.rows(
            series=f"{e}, {kind}", batch=list(rows.loc[rows.engine == e, "batch"]),
            tokens_per_s=list(rows.loc[rows.engine == e, f"{kind}_tokens_per_s"]),
            step_us=list(rows.loc[rows.engine == e, f"{kind}_step_s"] * 1e6),
            error=list(rows.loc[rows.engine == e, "step_error"])) if r["tokens_per_s"] is not None]
        layers.append(charts.layer(data, mark, x=x, y=y, color=color, tooltip=tooltip))
    return {"height": 260, "config": {"legend": charts.LEGEND}, "layer": layers}


def tpu_section() -> None:
    """This project's megakernel and the XLA reference step on a real TPU: measured tokens/s across batch sizes
    beside the model's predictions (experiments/validate_tpu.py), the error, the correctness checks, what is not
    measured yet, and the provenance one click away; or what is there until such a file is committed."""
    t = measured.tpu_results()
    if t is None:
        st.info(f"No TPU run of this project's megakernel is committed yet. `python experiments/tpu_megakernel.py` "
                f"on a lent TPU writes {c.shown_path(measured.TPU_RUNS_JSON)} (the chip, JAX and libtpu versions, "
                "the date, the command; one record a run) and `python experiments/validate_tpu.py` puts the model "
                f"beside it ({c.shown_path(measured.TPU_VALIDATION_JSON)}); each run is drawn here once committed.")
        return
    meta, rows = t["meta"], t["rows"]
    date = meta.get("date", "").replace("T", " ")[:16]
    a, b = st.columns([4, 1])
    a.caption(f"Measured on {tpu_name(meta)}" + (f", {date} UTC" if date else "") + f" ({t['file']}; the model "
              f"beside it: {t['validation'] or 'not compared yet, `python experiments/validate_tpu.py`'}).")
    with b.popover("Provenance", key="val_tpu_prov_menu"):
        st.markdown(measured.provenance_markdown(meta))
    main = rows[~rows["sweep"]] if not rows.empty else rows
    if main.empty:
        st.info(f"{t['file']} holds no timed run (step_s) yet.")
    else:
        run = main["slice"] + " " + main["format"]   # one curve a slice and expert format
        runs = run.value_counts().index.tolist()     # the most measured first
        pick = st.radio("Slice and routed experts drawn", runs, horizontal=True, key="val_tpu_format") \
            if len(runs) > 1 else runs[0]
        charts.show(tpu_figure(measured.tpu_latest(main[run == pick])),
                    key="val_tpu_chart")
        sm = t["summary"]
        figs = [(f"{e} step error (median, max)", f"{sm[f'median_abs_{k}error']:.1%}, {sm[f'max_abs_{k}error']:.1%}")
                for e, k in (("megakernel", "step_"), ("XLA", "xla_")) if sm.get(f"median_abs_{k}error") is not None]
        if figs:
            c.figures_line(figs)
        table = main.assign(step_us=main["measured_step_s"] * 1e6, predicted_us=main["predicted_step_s"] * 1e6)[
            ["engine", "slice", "format", "batch", "measured_tokens_per_s", "predicted_tokens_per_s", "step_us",
             "predicted_us", "step_error", "commit"]].rename(columns={
                "measured_tokens_per_s": "measured tokens/s", "predicted_tokens_per_s": "predicted tokens/s",
                "step_us": "measured step us", "predicted_us": "predicted step us", "step_error": "step error"})
        c.static_table(table, {"measured tokens/s": ",.0f", "predicted tokens/s": ",.0f", "measured step us": ".1f",
                               "predicted step us": ".1f", "step error": "+.1%"})
        st.caption("Device time per step (the slope of a call's wall time over the steps it runs: the host dispatch "
                   "cancels); tokens/s = batch / step. Squares: measured by this project; dashed lines: predicted "
                   "from the chip's micro-benchmarks, nothing fitted to these runs.")
    if t["checks"]:
        st.caption("Correctness against the XLA reference: " + "; ".join(
            f"{k['slice']} {k['format']}: {'ok' if k.get('ok') else 'FAILED'} (logit error {k['logit_error']:.3g}"
            + (f", {k['logit_error_decided']:.3g} where routing is decided" if k.get("logit_error_decided") is not None
               else "") + f", bound {k['logit_tolerance']:g})" for k in t["checks"]) + ".")
    st.warning("**Not measured yet:** " + "; ".join(measured.tpu_not_measured(t)) + ".")
    c.show_command("python experiments/tpu_megakernel.py --report && python experiments/validate_tpu.py")


@st.cache_data(show_spinner=False, max_entries=1)
def phase_profile() -> dict:
    """The bundled real megakernel's phase profile beside the model, as `perfmodel explain --profile` gives it."""
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.step.explain import explain_profile
    from perfmodel.step.phases import load_profile
    return explain_profile(load_profile(PROFILE_NAME), load_hardware(PROFILE_HW))["phase_profile"]


def phase_chart(rows: list[dict]) -> dict:
    """One kernel's per-layer phases: measured as bars, predicted as marks."""
    shown = [r for r in rows if r["per"] == "layer" and r["phase"] != "layer"]
    names = [r["phase"] for r in shown]
    x = charts.nominal("phase", "phase (per decoder layer)", sort=names, axis={"labelAngle": 0})
    y = charts.quant("us", "us per decoder layer")
    tooltip = charts.tip(("phase", "phase"), ("us", "us", ".3g"), ("error", "prediction's error", "+.1%"))
    color = charts.nominal("series", "", scale=charts.colors({"measured": "#9ecae1", "predicted": "#08306b"}))
    data = {kind: charts.rows(series=kind, phase=names, us=[r[f"{kind}_us"] for r in shown],
                              error=[r["error"] for r in shown]) for kind in ("measured", "predicted")}
    return {"height": 240, "config": {"legend": charts.LEGEND}, "layer": [
        charts.layer(data["measured"], {"type": "bar", "width": {"band": 0.6}}, x=x, y=y, color=color, tooltip=tooltip),
        charts.layer(data["predicted"], {"type": "tick", "orient": "horizontal", "thickness": 4,
                                         "size": {"expr": f"0.6 * width / {len(shown)}"}},
                     x=x, y=y, color=color, tooltip=tooltip)]}


def profile_section() -> None:
    from perfmodel.step.phases import attention_parts_text, harness_text, settings_text
    pp = phase_profile()
    st.caption(f"Source: {pp['source']}. {harness_text(pp['harness']).capitalize()}. A phase's time is what "
               "the step saves when the kernel's profiling-only skip option leaves it out (the dense ring's: the "
               "ring alone, every other layer phase skipped); per decoder layer, the lm_head and the fixed cost per "
               "step; each the mean over the timed steps. Bars: measured; marks: predicted.")
    for name, k in pp["kernels"].items():
        settings = settings_text(k["megakernel"]) or "the preset's kernel"
        met = sum(r["within"] for r in k["phases"])
        c.figures_line([(f"{name} kernel", f"{k['model']} ({settings})"),
                        ("phases within tolerance", f"{met} of {len(k['phases'])}"),
                        ("predicted step", f"{k['step_us'] / 1e3:.3f} ms")])
        charts.show(phase_chart(k["phases"]), key=f"val_profile_{name}")
        df = pd.DataFrame([{"phase": r["phase"], "per": r["per"], "measured us": r["measured_us"],
                            "predicted us": r["predicted_us"], "error": r["error"],
                            "within": f"{'yes' if r['within'] else 'no'} ({r['tolerance']:.0%})"} for r in k["phases"]])
        c.static_table(df, {"measured us": "g", "predicted us": ".3g", "error": "+.1%"})
        st.caption(attention_parts_text(k["attention_parts_us"]).capitalize() + ".")
    if pp["checks"]:
        st.markdown("**Stated gains of single changes** (checks, nothing fitted to them)")
        c.static_table(pd.DataFrame([{
            "change": x["what"], "measured on": ", ".join(filter(None, [f"{x['kernel']} kernel", settings_text(x["megakernel"])])),
            "per": x["per"], "measured us": x["measured_us"], "predicted us": x["predicted_us"], "error": x["error"]}
            for x in pp["checks"]]), {"measured us": "g", "predicted us": ".3g", "error": "+.1%"})
    c.show_command(f"perfmodel explain --profile {PROFILE_NAME} --hardware {PROFILE_HW}")


def render() -> None:
    st.header("Validation: per-layer predicted vs measured")
    gpu_results = gpu_header()
    st.info(trace_coverage(gpu_results))
    host = measured.machine_of(measured.file_header(HOST_VALIDATION_CSV), "a host CPU")
    st.subheader(f"Bundled host validation: the reference step on {host}")
    bundled(HOST_VALIDATION_CSV, "host validation", "python experiments/validate_host.py", "val", "val_host")
    machine = measured.machine_of(gpu_results, "a GPU")
    gpu = st.expander(f"A real GPU: the reference step traced on {machine} (each layer's kernel time; the step "
                      "is the wall time)", key="val_gpu_exp", on_change="rerun")
    if gpu.open:  # drawn only when opened
        with gpu:
            bundled(GPU_VALIDATION_CSV, "GPU validation", "python experiments/validate_gpu.py", "val_gpu", "val_gpu",
                    why=gpu_step_why)
    t = measured.tpu_results()
    tpu = st.expander("A real TPU: this project's megakernel and the XLA reference, tokens/s by batch (" + (
        f"{len(t['rows'])} runs on {tpu_name(t['meta'])})" if t is not None else "none committed yet)"),
        key="val_tpu_exp", on_change="rerun")
    if tpu.open:
        with tpu:
            tpu_section()
    profile = st.expander(f"A real megakernel, phase by phase: Inferact's Muse Spark kernel on {PROFILE_HW} "
                          "(training data)", key="val_profile_exp", on_change="rerun")
    if profile.open:  # drawn only when opened
        with profile:
            profile_section()
    yours = st.expander("Your trace: a path on the dashboard's machine or an upload, compared with the model",
                        key="val_trace_exp", on_change="rerun")
    if yours.open:  # its inputs and uploader are drawn only when opened
        with yours:
            try:
                uploaded()
            except SpecError as e:
                st.error(f"Cannot use this trace: {e}")
