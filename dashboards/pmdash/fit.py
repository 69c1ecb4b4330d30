"""For a configuration the model refuses: what fits on chip (in MiB) and the nearest one that runs.

The on-chip budget per core is the megakernel's: a weight ring of `banks` DMA tiles (prefetch
depth, by default half the buffer) beside `slots` expert buffers of one routed expert's bytes
each (perfmodel.engine.megakernel.onchip_request). Every suggestion is checked by running the
model on it; only configurations that run are offered.
"""
from __future__ import annotations

import math

import streamlit as st

from perfmodel.engine.megakernel import onchip_request
from perfmodel.graph import ops
from perfmodel.spec.deployment import validate
from perfmodel.util.errors import SpecError

from . import common as c


@st.cache_data(show_spinner=False, max_entries=2048)
def onchip_budget(m_ref: tuple, h_ref: tuple, key: tuple, vmem_mib: float | None) -> dict | None:
    """Ring, expert buffers and capacity per core in MiB, for a megakernel deployment."""
    k = dict(key)
    if k["engine"] != "megakernel":
        return None
    model, hw = c.load_model_ref(m_ref), c.resolve_hw(h_ref, vmem_mib)
    d = c.make_deployment(key)
    try:
        validate(model, hw, d)  # a layout that cannot run has no on-chip budget to show
    except SpecError:
        return None
    s = onchip_request(ops.build(model, d), hw, d, model.moe.top_k if model.moe else 1)
    return {"onchip_mib": hw.onchip_bytes / c.MiB, "onchip_kind": hw.onchip_kind, "tile_mib": s.tile_bytes / c.MiB,
            "banks": s.banks, "ring_mib": s.depth_bytes / c.MiB, "expert_mib": s.expert_bytes / c.MiB,
            "slots": s.slots, "top_k": model.moe.top_k if model.moe else 1, "need_mib": s.need_bytes / c.MiB}


def budget_text(b: dict) -> str:
    over = b["need_mib"] - b["onchip_mib"]
    return (f"{b['onchip_kind']} per core: {b['onchip_mib']:,.1f} MiB. Asked: a ring of {b['banks']} x "
            f"{b['tile_mib']:g} MiB tiles ({b['ring_mib']:,.1f} MiB) + {b['slots']} expert slot(s) x "
            f"{b['expert_mib']:,.2f} MiB = {b['need_mib']:,.1f} MiB"
            + (f", {over:,.1f} MiB too much." if over > 0 else "."))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(m_ref: tuple, h_ref: tuple, key: tuple, vmem_mib: float | None, field: str) -> list[tuple[str, tuple, float | None]]:
    """Nearby configurations, as (what changes, deployment key, VMEM MiB), for the field refused."""
    k = dict(key)
    out = []
    if field in ("prefetch_bytes", "expert_slots", "onchip_bytes"):  # the on-chip budget
        b = onchip_budget(m_ref, h_ref, key, vmem_mib)
        if b is None:
            return out
        cap, tile, per, top_k = b["onchip_mib"], b["tile_mib"], b["expert_mib"], b["top_k"]
        asked = k["expert_slots"]
        banks = int((cap - (asked or 1) * per) // tile)
        if banks >= 1:
            out.append((f"prefetch depth {banks * tile:g} MiB ({banks} tiles) beside {asked or 1} expert slot(s)",
                        c.with_key(key, prefetch_mib=banks * tile), vmem_mib))
        for ring, what in ((b["ring_mib"], "the asked ring"), (tile, f"a one-tile ring ({tile:g} MiB)")):
            most = min(top_k, int((cap - ring) // per)) if per else 0
            if most >= 1 and asked is not None:
                out.append((f"expert slots {most} beside {what}",
                            c.with_key(key, expert_slots=most, prefetch_mib=k["prefetch_mib"] if ring == b["ring_mib"]
                                       else tile), vmem_mib))
        need = math.ceil(b["need_mib"] * 8) / 8
        if need > cap:
            out.append((f"{b['onchip_kind']} {need:g} MiB per core (keeps the asked ring and slots)", key, need))
    elif field in ("tp", "ep"):
        n = k["devices"]
        want = k[field] or 1
        for v in sorted(_divisors(n), key=lambda d: (abs(math.log(d / want)), -d))[:6]:
            if v != want:
                out.append((f"{field.upper()} {v}", c.with_key(key, **{field: v}), vmem_mib))
        if field == "tp" and want > n:
            out.append((f"devices {want} (tp {want})", c.with_key(key, devices=want), vmem_mib))
    elif field == "devices":
        n = k["devices"]
        for f in (2, 4, 8, 16):
            out.append((f"devices {n * f} (tp {k['tp']})", c.with_key(key, devices=n * f), vmem_mib))
        for v in sorted(_divisors(n), key=lambda d: abs(math.log(d / k["tp"])))[:4]:
            out.append((f"tp {v}", c.with_key(key, tp=v), vmem_mib))
    return out


def nearest_valid(m_ref: tuple, h_ref: tuple, key: tuple, vmem_mib: float | None, field: str,
                  most: int = 3) -> list[dict]:
    """The candidates that the model runs, with their predicted tokens/s."""
    found = []
    for what, k2, v2 in candidates(m_ref, h_ref, key, vmem_mib, field):
        r = c.predict_cached(m_ref, h_ref, k2, v2)
        if "error" not in r:
            found.append({"change": what, "key": k2, "vmem_mib": v2, "tokens_per_s": r["tokens_per_s"]})
        if len(found) >= most:
            break
    return found
