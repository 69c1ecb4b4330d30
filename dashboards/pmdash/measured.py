"""Measured points: the published table, this project's own runs (the host results and any committed
measurement file), user uploads; which of them is the reference for a deployment; and where each
came from (its provenance: machine or chip, JAX version, date, command), one click away on the page.

Each source carries a plain-language name (its `origin`): "Inferact, 16x TPU v7, published", "host
CPU (AMD EPYC), host validation", "TPU v5e, measured (measured_tpu-v5e.csv)", "your upload: FILE",
and a kind ("published", "measured by this project", "your upload") that fixes its marker. A
measurement is the reference for a deployment only when every setting matches (`differences` is
empty); a setting a row leaves out takes perfmodel's default (tp and ep = devices, context 4096, no
speculative decoding, one step per device call, the generic multi-kernel engine, the model's KV
cache format, the default ring, expert slots and on-chip buffer), except the device count, which a
row may leave open. A default a row was compared at is an assumption, and the page says so
("assumed"), never "measured". Every row names its model: a file without a model column is refused.

Committed measurement files: `experiments/results/measured_*.csv`, the columns of an upload after
`# key: value` provenance lines (chip, jax, date, command, ...), e.g. a TPU v5e's results once one is
lent; each is drawn beside the predictions as a source of its own.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pandas as pd
import streamlit as st

from perfmodel.fit.measurements import seed_measurements
from perfmodel.util.errors import SpecError

from .common import GENERIC, HOST_HW, REPO, RESULTS_DIR, UPLOAD_PREFIX, read_csv_bytes, shown_path

HOST_VALIDATION_CSV = REPO / "experiments" / "results" / "host_validation.csv"
GPU_VALIDATION_CSV = REPO / "experiments" / "results" / "gpu_validation.csv"
TPU_RUNS_JSON = RESULTS_DIR / "tpu_megakernel.json"          # experiments/tpu_megakernel.py on a lent TPU
TPU_VALIDATION_JSON = RESULTS_DIR / "tpu_validation.json"    # experiments/validate_tpu.py: the model beside them
TPU_PROVENANCE = ("chip", "machine", "jax", "libtpu", "python", "date", "command", "note")
COMMITTED_GLOB = "measured_*.csv"  # this project's own measurement files, committed under experiments/results
COLUMNS = ["source", "model", "hardware", "engine", "devices", "tp", "ep", "batch", "context", "draft_rows",
           "acceptance_length", "steps_per_call", "serving_engine", "kv_cache", "prefetch_mib", "expert_slots",
           "vmem_mib", "tokens_per_s", "origin", "role", "kind"]
PUBLISHED, OURS, UPLOADED = "published", "measured by this project", "your upload"  # a source's kind
HELD_OUT = "held-out"  # a published point's role: nothing the dashboard predicts with was fitted to it
# optional columns of a measurements file, with their types
OPTIONAL = {"devices": int, "tp": int, "ep": int, "context": int, "draft_rows": int, "acceptance_length": float,
            "steps_per_call": int, "prefetch_mib": float, "expert_slots": int, "vmem_mib": float}
TEXT_OPTIONAL = ("serving_engine", "kv_cache")  # optional text columns (empty: the default)
SEED_MODEL = "kimi-k3"  # the published table is Kimi K3 decode
PUBLISHED_SOURCE = "Inferact, tpu-megakernels report (Sept 2026)"
PUBLISHED_NAMES = {("tpu-v7", "megakernel"): "Inferact, 16x TPU v7, published",
                   ("gb200", "multikernel"): "Inferact, 16x GB200 (vLLM), published"}
HOST_ORIGIN = "host CPU, host validation"  # the machine is in the results file's provenance
REQUIRED = ("model", "hardware", "engine", "batch", "tokens_per_s")
PUBLISHED_PROVENANCE = {
    "source": "Inferact's published benchmark report (Sept 2026), repeated in the Inferact/tpu-megakernels README "
              "(figure batch-decode-throughput)",
    "what": "Kimi K3 decode, aggregate tokens/s, 16 chips each; spec decode: DSpark, 7 draft rows, acceptance "
            "length 6",
    "states": "each run's layout and steps per call; for GB200 the serving engine (vLLM) and KV cache (fp8) of "
              "NVIDIA Dynamo's recipe",
    "does not state": "the context, the ring depth, the expert slots, the on-chip buffer: compared at perfmodel's "
                      "defaults (context 4096), as assumptions"}


@st.cache_data(show_spinner=False)
def published_table() -> pd.DataFrame:
    ms = seed_measurements()
    df = pd.DataFrame([dataclasses.asdict(m) for m in ms])
    df["origin"] = [PUBLISHED_NAMES.get((m.hardware, m.engine), f"Inferact, {m.hardware}, published") for m in ms]
    df["source"] = PUBLISHED_SOURCE
    df["role"] = HELD_OUT  # the presets hold no value fitted to a decode step
    df["kind"] = PUBLISHED
    df["model"] = SEED_MODEL
    for col in TEXT_OPTIONAL:  # "" in the table: the default
        df[col] = df[col].replace("", None)
    for col in ("context", "prefetch_mib", "expert_slots", "vmem_mib"):  # not published: the defaults
        df[col] = None
    return df[COLUMNS]


def normalise(df: pd.DataFrame, origin: str, source_kind: str = UPLOADED) -> pd.DataFrame:
    """Check and complete a measurements table; a missing column or a bad value raises SpecError. Every
    row names its model: a table without one would be taken for a measurement of every model."""
    df = df.rename(columns=str.strip)
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing == ["model"]:
        raise SpecError("measurements file", origin, "has no model column: say which model each row measured "
                        "(a column model, e.g. kimi-k3); without it the rows would be compared with every model")
    if missing:
        raise SpecError("measurements file", origin,
                        f"missing column(s) {', '.join(missing)}; need {', '.join(REQUIRED)} "
                        f"(optional: {', '.join(OPTIONAL)}, {', '.join(TEXT_OPTIONAL)}, source)")
    if df.empty:
        raise SpecError("measurements file", origin, "has no rows")
    model = df["model"].astype(str).str.strip().where(df["model"].notna(), "")
    if (model == "").any():
        i = int((model == "").to_numpy().nonzero()[0][0])
        raise SpecError("measurements file column model", "", f"row {i + 1}: no model (every row names its model)")
    out = pd.DataFrame({"hardware": df["hardware"].astype(str).str.strip(),
                        "engine": df["engine"].astype(str).str.strip()})
    for col, kind in (("batch", int), ("tokens_per_s", float), *OPTIONAL.items()):
        if col not in df.columns:
            out[col] = 0 if col == "draft_rows" else None
            continue
        vals = pd.to_numeric(df[col], errors="coerce")
        bad = vals.isna() & df[col].notna() if col in OPTIONAL else vals.isna()
        if bad.any():
            i = int(bad.to_numpy().nonzero()[0][0])
            raise SpecError(f"measurements file column {col}", df[col].iloc[i], f"row {i + 1}: not a number")
        out[col] = vals.astype(kind) if not vals.isna().any() else vals
    if (out["batch"] < 1).any() or (out["tokens_per_s"] <= 0).any():
        raise SpecError("measurements file", origin, "batch must be >= 1 and tokens_per_s > 0 in every row")
    bad_engine = ~out["engine"].isin(["megakernel", "multikernel"])
    if bad_engine.any():
        raise SpecError("measurements file column engine", out["engine"][bad_engine].iloc[0],
                        "must be megakernel or multikernel")
    out["model"] = model
    for col in TEXT_OPTIONAL:
        text = df[col].astype(str).str.strip() if col in df.columns else None
        out[col] = None if text is None else text.where(df[col].notna() & (text != ""), None)
    out["source"] = df["source"].astype(str) if "source" in df.columns else origin
    out["origin"] = origin
    out["role"] = ""
    out["kind"] = source_kind
    return out[COLUMNS]


def parse_upload(name: str, data: bytes) -> pd.DataFrame:
    if not name.lower().endswith(".csv"):
        raise SpecError("measurements file", name, "expected a .csv with columns "
                        "hardware, engine, batch, tokens_per_s")
    try:
        df = read_csv_bytes(data, name)
    except (UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise SpecError("measurements file", name, f"not a readable CSV ({type(e).__name__})") from None
    return normalise(df, f"{UPLOAD_PREFIX}{name}")


HOST_STEP_COLUMNS = {"variant", "model", "mode", "batch", "context", "layer", "measured_s"}


def host_points() -> tuple[pd.DataFrame | None, str]:
    """The host points, re-read only when the results file changes."""
    path = HOST_VALIDATION_CSV
    return _host_points(str(path), path.stat().st_mtime if path.exists() else None)


@st.cache_data(show_spinner=False, max_entries=4)
def _host_points(path: str, mtime: float | None) -> tuple[pd.DataFrame | None, str]:
    """Step-level host results from the host validation CSV, as measured tokens/s points.

    experiments/validate_host.py writes one "step" row per run. The points kept are the runs
    with the hardware file as written (variant "file") and op by op (mode "op_by_op": every op
    pays its dispatch, which is what the multikernel engine on the hostbench file predicts);
    tokens/s = batch / measured step time. They belong to the "host-cpu (hostbench)" hardware
    choice, multikernel, 1 device.
    """
    if mtime is None:
        return None, (f"No host validation results yet ({shown_path(HOST_VALIDATION_CSV)} is missing; "
                      "run `python experiments/validate_host.py` to produce it).")
    try:
        df = read_csv_bytes(Path(path).read_bytes())
    except Exception as e:  # noqa: BLE001 -- a broken results file must not break the page
        return None, f"{HOST_VALIDATION_CSV.name} could not be read: {e}"
    if HOST_STEP_COLUMNS <= set(df.columns):
        step = df[(df["layer"].astype(str) == "step") & (df["variant"] == "file") & (df["mode"] == "op_by_op")]
        if step.empty:
            return None, f"{HOST_VALIDATION_CSV.name} has no op-by-op step rows."
        batch = pd.to_numeric(step["batch"], errors="coerce")
        meas = pd.to_numeric(step["measured_s"], errors="coerce")
        pts = pd.DataFrame({"hardware": HOST_HW, "engine": "multikernel", "devices": 1, "batch": batch,
                            "context": step["context"], "model": step["model"],
                            "tokens_per_s": batch / meas, "draft_rows": 0})
        pts = pts[pts["tokens_per_s"].notna() & (pts["tokens_per_s"] > 0)]
        out = normalise(pts, HOST_ORIGIN, OURS)
        out["source"] = [f"{HOST_VALIDATION_CSV.name}: op by op, context {c}" for c in out["context"]]
        return out, ""
    if set(REQUIRED) <= set(df.columns):
        try:
            return normalise(df, HOST_ORIGIN, OURS), ""
        except SpecError as e:
            return None, f"{Path(path).name}: {e}"
    return None, f"{HOST_VALIDATION_CSV.name} has no step-level rows; its per-layer results are in the Validation view."


# the settings a measurement is matched on, as the page names them
SETTINGS = {"model": "model", "hardware": "hardware", "engine": "engine", "devices": "devices", "tp": "TP",
            "ep": "EP", "batch": "batch", "context": "context", "draft_rows": "draft rows",
            "acceptance_length": "acceptance length", "steps_per_call": "steps per call",
            "serving_engine": "serving engine", "kv_cache": "KV cache", "prefetch_mib": "prefetch depth", "expert_slots": "expert slots", "vmem_mib": "VMEM"}
OPEN = {"devices"}  # a row that leaves this out matches any value
DEFAULTS = {"context": 4096, "draft_rows": 0, "acceptance_length": None, "steps_per_call": 1,
            "serving_engine": GENERIC}


def settings(model: str, hardware: str, key: tuple, model_kv: str) -> tuple[dict, dict]:
    """A deployment (a pmdash.common.dep_key) as measurements state it (SETTINGS keys but the on-chip
    ones), and the defaults a row's missing KV cache format resolves to (`model_kv`, the model's)."""
    k = dict(key)
    mine = {"model": model, "hardware": hardware, **{f: k[f] for f in (
        "engine", "devices", "tp", "ep", "batch", "context", "draft_rows", "acceptance_length", "steps_per_call")},
        "serving_engine": k["serving_engine"] or GENERIC, "kv_cache": k["kv_cache"] or model_kv}
    return mine, {"kv_cache": model_kv}


def _value(row: dict, key: str):
    v = row.get(key)
    return None if v is None or (isinstance(v, float) and pd.isna(v)) else v


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(a)), abs(float(b)))
    return a == b


def differences(row: dict, mine: dict, defaults: dict | None = None) -> list[tuple[str, object, object, bool]]:
    """(setting, yours, the measurement's, whether the measurement states it) for each setting of `mine` the
    measured row differs in.

    `mine` holds the deployment's settings (SETTINGS keys; the KV cache format by name; prefetch_mib /
    expert_slots / vmem_mib as resolved, megakernel only); `defaults` the values the deployment's
    model and chip resolve the rest to by default (kv_cache, the on-chip settings), which a row that
    leaves them out is assumed to have been measured at (not stated: an assumption)."""
    out = []
    for key, label in SETTINGS.items():
        if key not in mine or (_value(row, key) is None and key in OPEN):
            continue
        theirs, stated = _theirs(row, key, mine, defaults)
        if not _same(mine[key], theirs):
            out.append((label, with_unit(key, mine[key]), with_unit(key, theirs), stated))
    return out


def _theirs(row: dict, key: str, mine: dict, defaults: dict | None) -> tuple[object, bool]:
    """A row's value of a setting and whether it states it (else the default it is assumed to have run at)."""
    theirs = _value(row, key)
    if theirs is not None:
        return theirs, True
    if key in ("tp", "ep"):
        return _value(row, "devices") or mine.get("devices"), False
    if key in DEFAULTS:
        return DEFAULTS[key], False
    return (defaults or {}).get(key), False


def assumed(row: dict, mine: dict, defaults: dict | None = None) -> list[tuple[str, object]]:
    """(setting, value with its unit) for each setting of `mine` a row does not state and that matters to it: the
    defaults it is compared at (no acceptance length without draft rows, no serving engine on a megakernel)."""
    skip = {"acceptance_length"} if not mine.get("draft_rows") else set()
    if mine.get("engine") == "megakernel":
        skip.add("serving_engine")
    return [(label, with_unit(key, _theirs(row, key, mine, defaults)[0])) for key, label in SETTINGS.items()
            if key in mine and key not in OPEN | skip and _value(row, key) is None]


UNITS = {"prefetch_mib": "MiB", "vmem_mib": "MiB", "context": "tokens"}


def with_unit(key: str, v) -> str:
    return fmt_setting(v) + (f" {UNITS[key]}" if key in UNITS and v is not None else "")


def fmt_setting(v) -> str:
    return "default" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def differs_text(diffs: list[tuple]) -> str:
    """'EP (yours 16, measured 8), prefetch depth (yours 16 MiB; not stated, assumed 32 MiB)': a setting the
    measurement does not state is the default it was assumed to run at, not a measured one."""
    return ", ".join(f"{d[0]} (yours {d[1]}, measured {d[2]})" if d[3] else
                     f"{d[0]} (yours {d[1]}; not stated, assumed {d[2]})" for d in diffs)


def all_points() -> pd.DataFrame:
    """The published table, the host results and the committed measurement files."""
    host, _ = host_points()
    committed, _ = committed_points()
    return pd.concat([published_table()] + ([host] if host is not None else []) + [f["rows"] for f in committed],
                     ignore_index=True)


# ----- provenance: where a source's numbers come from ----------------------------------------------

def file_header(path: Path) -> dict[str, str]:
    """header(path), read again only when the file changes ({} for a file that is not there)."""
    return _header(str(path), path.stat().st_mtime) if path.exists() else {}


@st.cache_data(show_spinner=False, max_entries=16)
def _header(path: str, mtime: float) -> dict[str, str]:
    return header(Path(path))


def header(path: Path) -> dict[str, str]:
    """A results file's leading `# key: value` lines (machine or chip, date, command, ...)."""
    out = {}
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            key, sep, value = line[1:].strip().partition(": ")
            if sep:
                out[key.strip()] = value.strip()
    return out


TEMP_DIR = re.compile(r"(?<![\w./-])/tmp/\S+")


def provenance_rows(meta: dict[str, str]) -> list[tuple[str, str]]:
    """A header as (what, value) lines a person reads: a load average dict as two numbers, a temporary
    directory a command was given as DIR (it was not kept)."""
    out = []
    for k, v in meta.items():
        if k.startswith("load_average"):
            nums = re.findall(r"'(\w+)': ([\d.]+|None)", v)
            v = ", ".join(f"{float(x):.2f} at the {w}" for w, x in nums if x != "None") or "not recorded"
            k = "load average (1 min)"
        elif k == "command" and TEMP_DIR.search(v):
            v = TEMP_DIR.sub("DIR", v) + "  (DIR: a temporary directory of traces, not kept)"
        elif k == "hardware_file":
            k = "hardware file"
        out.append((k, v))
    return out


def provenance_markdown(meta: dict[str, str]) -> str:
    """Provenance lines as a markdown list, the command as code."""
    from .common import code_span
    return "\n".join(f"- {k}: {code_span(v) if k == 'command' else v}" for k, v in provenance_rows(meta))


def machine_of(meta: dict[str, str], default: str = "an unnamed machine") -> str:
    """The machine or chip a results file names, without its host's details: 'AMD EPYC', 'NVIDIA H200'."""
    return (meta.get("chip") or meta.get("machine") or default).split(" (")[0]


def committed_points() -> tuple[list[dict], str]:
    """This project's committed measurement files (experiments/results/measured_*.csv): per file its rows,
    name and provenance, and a note on what is there (or that none is yet)."""
    files = sorted(RESULTS_DIR.glob(COMMITTED_GLOB))
    return _committed(tuple((str(f), f.stat().st_mtime) for f in files))


@st.cache_data(show_spinner=False, max_entries=4)
def _committed(files: tuple[tuple[str, float], ...]) -> tuple[list[dict], str]:
    out, bad = [], []
    for path, _ in files:
        p = Path(path)
        meta = header(p)
        origin = f"{machine_of(meta, p.stem)}, measured ({p.name})"
        try:
            rows = normalise(read_csv_bytes(p.read_bytes(), p.name), origin, OURS)
        except (SpecError, ValueError, pd.errors.ParserError) as e:
            bad.append(f"{p.name} could not be used: {e}")
            continue
        rows["source"] = [s if s != origin else p.name for s in rows["source"]]
        out.append({"origin": origin, "file": shown_path(p), "meta": meta, "rows": rows})
    where = f"{shown_path(RESULTS_DIR)}/{COMMITTED_GLOB}"
    note = (f"Committed measurement files ({where}): " + ", ".join(f["file"] for f in out) if out else
            f"No measurement of this project's own runs on an accelerator is committed yet ({where}: the columns of "
            "an upload after `# chip:`, `# jax:`, `# date:` and `# command:` lines); once one is, its points are "
            "drawn here beside the predictions, with that provenance.")
    return out, note + ("" if not bad else " " + " ".join(bad))


def provenance(origin: str, kind: str) -> tuple[str, dict[str, str]]:
    """Where a source's numbers come from: (its file, its provenance lines)."""
    if kind == PUBLISHED:
        return "the published table bundled with perfmodel", PUBLISHED_PROVENANCE
    if origin == HOST_ORIGIN:
        return shown_path(HOST_VALIDATION_CSV), file_header(HOST_VALIDATION_CSV)
    for f in committed_points()[0]:
        if f["origin"] == origin:
            return f["file"], f["meta"]
    return origin.removeprefix(UPLOAD_PREFIX), {"source": "a file you uploaded in this session"}


def sources(points: pd.DataFrame) -> list[dict]:
    """Each measured source among `points`: origin, kind, points, where it comes from (provenance lines)."""
    out = []
    for origin, kind in dict.fromkeys(zip(points["origin"], points["kind"])):
        file, meta = provenance(origin, kind)
        out.append({"origin": origin, "kind": kind, "points": int((points["origin"] == origin).sum()),
                    "file": file, "meta": meta})
    return out


def reference(points: pd.DataFrame, mine: dict, defaults: dict | None = None,
              ignore: tuple[str, ...] = ()) -> tuple[list[dict], dict | None, list]:
    """The measured rows that match `mine` in every setting but those in `ignore`, and when none
    does, the nearest row of the same model and hardware with its differences (fewest differing
    settings, then the closest batch)."""
    if points is None or points.empty:
        return [], None, []
    mine_cmp = {k: v for k, v in mine.items() if k not in ignore}
    rows = points.to_dict("records")
    exact = [r for r in rows if not differences(r, mine_cmp, defaults)]
    if exact:
        return exact, None, []
    near = [r for r in rows if r["hardware"] == mine.get("hardware")
            and (_value(r, "model") is None or r["model"] == mine.get("model"))]
    if not near:
        return [], None, []
    scored = [(len(d := differences(r, mine_cmp, defaults)),
               abs(float(r["batch"]) - float(mine.get("batch", r["batch"]))), i, r, d) for i, r in enumerate(near)]
    _, _, _, best, diffs = min(scored, key=lambda t: t[:3])
    return [], best, diffs


# ----- this project's megakernel on a real TPU (experiments/tpu_megakernel.py, validate_tpu.py) ---------

def tpu_results() -> dict | None:
    """The committed TPU runs (None when none is): `rows` one a timed run (engine megakernel or xla, slice,
    format, batch, depth, slots, sweep, measured and predicted step and tokens/s, the step's error as
    experiments/validate_tpu.py gives it, the commit it ran), `checks` (the correctness records), `summary` (validate_tpu's),
    `sweeps` (validate_tpu's sweep families: one knob varied, the others held, each point's measured and
    predicted step), `meta` (chip, JAX, libtpu, date, command) and the two files."""
    if not TPU_RUNS_JSON.exists():
        return None
    val = TPU_VALIDATION_JSON
    return _tpu_results(str(TPU_RUNS_JSON), TPU_RUNS_JSON.stat().st_mtime,
                        str(val), val.stat().st_mtime if val.exists() else None)


@st.cache_data(show_spinner=False, max_entries=2)
def _tpu_results(path: str, mtime: float, val_path: str, val_mtime: float | None) -> dict:
    full = json.loads(Path(path).read_text())
    val = json.loads(Path(val_path).read_text()) if val_mtime is not None else {}
    # validate_tpu's comparisons name the run they compare by its place in the results file
    predicted = {r.get("index"): (r["comparison"]["predicted_step_s"], r["comparison"]["step_error"])
                 for r in val.get("runs", []) if r.get("comparison")}
    predicted.update({r.get("index"): (r["predicted_step_s"], r["step_error"]) for r in val.get("xla", [])})
    rows = []
    for i, r in enumerate(full.get("runs", [])):
        if r.get("kind") not in ("megakernel", "xla") or not r.get("step_s"):
            continue
        cfg = r.get("config") or {}
        pred, err = predicted.get(i, (None, None))
        fmt = "none (dense)" if r.get("distinct_experts") == [] else r["format"]   # no MoE layer: no experts
        rows.append({"engine": r["kind"], "slice": r["slice"], "format": fmt, "batch": int(r["batch"]),
                     "depth": cfg.get("depth"), "slots": cfg.get("expert_slots"), "sweep": bool(r.get("sweep")),
                     "measured_step_s": r["step_s"], "measured_tokens_per_s": r["batch"] / r["step_s"],
                     "predicted_step_s": pred, "predicted_tokens_per_s": r["batch"] / pred if pred else None,
                     "step_error": err, "commit": r.get("commit") or ""})
    meta = {k: str(full[k]) for k in TPU_PROVENANCE if k in full}
    return {"rows": pd.DataFrame(rows), "checks": [r for r in full.get("runs", []) if r.get("kind") == "check"],
            "summary": val.get("summary", {}), "sweeps": val.get("whatif", []), "meta": meta,
            "file": shown_path(Path(path)),
            "validation": shown_path(Path(val_path)) if val_mtime is not None else None}


def tpu_latest(rows: pd.DataFrame) -> pd.DataFrame:
    """The timed runs that are not sweep points, the latest of each engine, slice, format and batch
    (the current kernel, as the README's table), in file order."""
    return rows[~rows["sweep"]].drop_duplicates(["engine", "slice", "format", "batch"], keep="last")


def tpu_not_measured(t: dict) -> list[str]:
    """What the committed TPU runs do not measure yet, read from them."""
    rows, out = t["rows"], []
    if not t["summary"].get("traced_runs"):
        out.append("no in-kernel trace (the step is timed whole: no layer or phase of it is measured)")
    for col, what in (("slice", "slice"), ("format", "expert format")):
        vals = sorted(set(rows[col])) if not rows.empty else []
        if len(vals) == 1:
            out.append(f"one {what} ({vals[0]})")
    if rows.empty or not rows["sweep"].any():
        out.append("no ring depth x expert slot sweep")
    return out
