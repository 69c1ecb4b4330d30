"""The deployment form What-if and Explain share: model, hardware, engine, batch, layout, context, decode
steps per device call, the megakernel's ring, expert slots and on-chip buffer, speculative decoding, and on
a GPU's multi-kernel engine a serving engine's kernels and the KV cache format.

One form, one key (pmdash.common.dep_key) and one cached prediction: the same inputs give the same
numbers in both views. Its widgets' keys are PREFIX_NAME (wi_batch, ex_batch, ...). The ring, slots and
on-chip buffer are megakernel settings: with the multi-kernel engine their fields are disabled and left out
of the deployment (they change nothing there). A ring depth is a whole number of the ring's tiles; another
depth is refused beside the field, not rounded silently. In the compact layout (Explain) the settings after
the layout sit in a popover labelled with their values.
"""
from __future__ import annotations

import streamlit as st

from . import common as c
from . import fit
from .inputs import number_field

ENGINES = ("megakernel", "multikernel")
NAMES = ("model", "hw", "engine", "batch", "devices", "tp", "ep", "context", "steps", "prefetch", "slots", "vmem",
         "spec", "draft", "acc", "serving", "kv")
# deployment key field -> the form's name for it
KEY_NAMES = {"devices": "devices", "tp": "tp", "ep": "ep", "batch": "batch", "context": "context",
             "prefetch_mib": "prefetch", "expert_slots": "slots", "steps_per_call": "steps"}


def init(prefix: str) -> None:
    """The form's defaults (the published TPU v7 deployment of Kimi K3), once per session."""
    tpu = c.CANONICAL["tpu-v7"]
    c.init(**{f"{prefix}_{k}": v for k, v in dict(
        model="kimi-k3", hw="tpu-v7", engine=tpu["engine"], batch="1", devices=str(tpu["devices"]), tp=str(tpu["tp"]),
        ep=str(tpu["ep"]), context="4096", steps=str(tpu["steps_per_call"]), prefetch="", slots="", vmem="",
        spec=False, draft="7", serving=c.GENERIC, kv=c.MODEL_KV).items()})


def form(prefix: str, compact: bool = False) -> tuple[dict | None, list[str]]:
    """The form's widgets and the deployment they give: ({model, hw, key, vmem, engine}, []) or (None, the
    messages of the bad fields)."""
    init(prefix)
    k = lambda name: f"{prefix}_{name}"  # noqa: E731
    errs: list[str] = []
    if compact:
        r1 = st.columns([3, 3, 3, 2, 2, 2, 2])
        top, rest = r1[:4], r1[4:]
    else:
        top = st.columns(4)
    model = top[0].selectbox("Model", c.model_options(), key=k("model"))
    hw = top[1].selectbox("Hardware", c.hardware_options(), key=k("hw"))
    engine = top[2].radio("Engine", ENGINES, horizontal=True, key=k("engine"))
    batch = number_field(top[3], "Batch (sequences)", k("batch"), errors=errs)
    mega = engine == "megakernel"
    if compact:
        devices, tp, ep = (number_field(col, label, k(name), errors=errs)
                           for col, label, name in zip(rest, ("Devices", "TP", "EP groups"), ("devices", "tp", "ep")))
        more = st.popover(settings_label(prefix, mega), key=k("more_menu"))
        with more:
            context, steps = layout_more(st.columns(2), prefix, errs)
            ring_cols = st.columns(3)
            spec_col = st.container()
            kernel_cols = st.columns(2)
    else:
        r2 = st.columns(5)
        devices, tp, ep = (number_field(col, label, k(name), errors=errs)
                           for col, label, name in zip(r2, ("Devices", "TP", "EP groups"), ("devices", "tp", "ep")))
        context, steps = layout_more(r2[3:], prefix, errs)
        r3 = st.columns(4)
        ring_cols, spec_col = r3[:3], r3[3]
        kernel_cols = None
    hw_spec = c.load_hardware_ref(c.hardware_ref(hw))
    kind, preset_mib = hw_spec.onchip_kind, hw_spec.onchip_bytes / c.MiB
    off = "" if mega else " Off: a megakernel setting (the multi-kernel engine has no ring)."
    ring_errs: list[str] = []
    prefetch = number_field(ring_cols[0], "Prefetch depth (MiB per core)", k("prefetch"), integer=False, lo=0.001,
                            hi=1e7, allow_empty=True, errors=ring_errs, disabled=not mega,
                            placeholder=f"default: half the {kind}" if mega else "megakernel only",
                            help="Megakernel weight ring size (Deployment.prefetch_bytes), a whole number of ring "
                                 "tiles. Empty: the default." + off)
    slots = number_field(ring_cols[1], "Expert slots", k("slots"), lo=1, hi=4096, allow_empty=True, errors=ring_errs,
                         disabled=not mega, placeholder="default: as many as fit (<= top-k)" if mega else
                         "megakernel only", help="Megakernel expert buffers (Deployment.expert_slots). Empty: the "
                                                 "default." + off)
    vmem = number_field(ring_cols[2], f"{kind} per core (MiB)", k("vmem"), integer=False, lo=0.001, hi=1e7,
                        allow_empty=True, errors=ring_errs, disabled=not mega,
                        placeholder=f"preset: {preset_mib:g} MiB" if mega else "megakernel only",
                        help="On-chip buffer per core (Hardware.onchip_bytes). Empty: the preset's." + off)
    if mega:  # with the multi-kernel engine they are off: a bad text there keeps nothing stale
        errs += ring_errs
    else:
        prefetch = slots = vmem = None
    with spec_col:
        spec = st.toggle("Speculative decoding", key=k("spec"))
        draft = acc = None
        if spec:  # its settings only when it is on (the page stays short)
            a, b = st.columns(2)
            draft = number_field(a, "Draft rows", k("draft"), lo=1, hi=64, errors=errs)
            top_acc = float(draft or c.SPEC_DRAFT_ROWS) + 1
            # its value lives in the session state (a default beside a value set there makes Streamlit warn)
            acc_now = st.session_state.get(k("acc"), c.SPEC_ACCEPTANCE)
            st.session_state[k("acc")] = min(acc_now, top_acc)
            acc = b.slider("Acceptance length", 1.0, top_acc, step=0.5, key=k("acc"),
                           help="Tokens accepted per verification step (tau).")
    if kernel_cols is None:
        kernel_cols = st.columns(2)
    serving, kv = c.kernel_choices(*kernel_cols, hw, engine, prefix)
    if errs:
        if compact:
            st.error("; ".join(errs), icon=":material/error:")
        return None, errs
    key = c.dep_key(devices, tp, ep, engine, batch=batch, context=context, prefetch_mib=prefetch,
                    expert_slots=slots, draft_rows=draft if spec else 0, acceptance_length=acc if spec else None,
                    steps_per_call=steps, serving_engine=serving, kv_cache=kv)
    if prefetch is not None and (msg := ring_tiles_error(model, hw, key, vmem, prefetch)):
        ring_cols[0].error(msg, icon=":material/error:")
        if compact:
            st.error(msg, icon=":material/error:")
        return None, [msg]
    return dict(model=model, hw=hw, key=key, vmem=vmem, engine=engine), []


def layout_more(cols, prefix: str, errs: list) -> tuple[int | None, int | None]:
    context = number_field(cols[0], "Context (tokens in cache)", f"{prefix}_context", lo=0, hi=10_000_000, errors=errs)
    steps = number_field(cols[1], "Steps per device call", f"{prefix}_steps", lo=1, hi=4096, errors=errs,
                         help="Decode steps one device call runs; its per-call cost is shared by them "
                              "(Deployment.steps_per_call; the published TPU runs: 64, with spec decode 24).")
    return context, steps


def settings_label(prefix: str, mega: bool) -> str:
    """The compact form's popover label: the settings it holds, with their values."""
    v = lambda name: st.session_state.get(f"{prefix}_{name}", "")  # noqa: E731
    parts = [f"context {v('context')}", f"{v('steps')} steps/call"]
    if mega:
        parts += [f"ring {v('prefetch') + ' MiB' if v('prefetch') else 'default'}",
                  f"slots {v('slots') or 'default'}", f"VMEM {v('vmem') + ' MiB' if v('vmem') else 'preset'}"]
    parts.append("spec decode" if v("spec") else "no spec decode")
    if v("serving") != c.GENERIC:
        parts.append(f"{v('serving')} engine")
    if v("kv") != c.MODEL_KV:
        parts.append(f"KV {v('kv')}")
    return ", ".join(parts)


def ring_tiles_error(model: str, hw: str, key: tuple, vmem: float | None, prefetch: float) -> str | None:
    """The message for a ring depth that is not a whole number of the ring's tiles (the model would round it
    down to whole tiles, at least one), or None."""
    b = fit.onchip_budget(c.model_ref(model), c.hardware_ref(hw), key, vmem)
    if b is None:
        return None
    tile = b["tile_mib"]
    tiles = prefetch / tile
    if abs(tiles - round(tiles)) <= 1e-9 * max(1.0, tiles) and round(tiles) >= 1:
        return None
    runs = max(1, int(tiles + 1e-9)) * tile
    return (f"Prefetch depth (MiB per core): the ring holds whole {tile:g} MiB tiles; {prefetch:g} MiB would run as "
            f"{runs:g} MiB. Type a multiple of {tile:g}.")


def copy_from(src: str, dst: str) -> None:
    """Button callback: form `dst` takes form `src`'s values (e.g. Explain takes What-if's deployment)."""
    init(src)
    for name in NAMES:
        if f"{src}_{name}" in st.session_state:
            st.session_state[f"{dst}_{name}"] = st.session_state[f"{src}_{name}"]
