"""Held-back ring refills ([megakernel] defer_refills_rows; Muse Spark's kernel, decode_megakernel.py
`defer=next`, `flush=last`): at few rows a MoE layer's gemvs before the routed experts keep the
refills they would issue for the next layer's tiles, and the experts issue them after their last
dots, so the expert copies meet no next-layer weights on the DMA engine."""
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from perfmodel.engine import megakernel_sim as ms
from perfmodel.engine.megakernel import simulate_megakernel
from perfmodel.engine.terms import op_weights
from perfmodel.graph import ops
from perfmodel.spec.arch import derive
from perfmodel.spec.hardware import load_hardware
from perfmodel.step.phases import load_profile, profile_deployment
from perfmodel.util.errors import SpecError

HW = load_hardware("tpu-v7")
D = profile_deployment(load_profile("musespark"))
LAYER = 30


def timeline(rows_held: int, d=D, record=True):
    m = derive("muse-spark", megakernel={"defer_refills_rows": rows_held})
    g = ops.build(m, d)
    w = op_weights(g, m.formats["routed_expert"].bytes_per_value)
    return g, w, simulate_megakernel(g, HW, d, m.moe.top_k, record=record, weights=w)


def overlap_with_next_layer(tl) -> float:
    """Seconds during which a layer's expert copies and a ring tile of the next layer are both in
    flight on the DMA engine (LAYER's experts)."""
    dma = [e for e in tl.events if e[0] == "dma"]
    experts = [(b, e) for _, name, layer, b, e in dma if name == "routed_experts" and layer == LAYER]
    tiles = [(b, e) for _, name, layer, b, e in dma if layer == LAYER + 1 and name != "kv_cache/state"]
    assert experts and tiles
    return sum(max(0.0, min(e1, e2) - max(b1, b2)) for b1, e1 in experts for b2, e2 in tiles)


def test_expert_copies_meet_no_next_layer_tile():
    assert overlap_with_next_layer(timeline(0)[2]) > 1e-6  # without: next-layer refills share the engine
    assert overlap_with_next_layer(timeline(4)[2]) == 0.0


def test_held_refills_are_issued_after_the_experts_last_dots():
    g, _, tl = timeline(4)
    names = np.array(g.name)
    routed = np.flatnonzero((names == "routed_experts") & (g.layer == LAYER))[0]
    router = np.flatnonzero((names == "router") & (g.layer == LAYER))[0]
    issued = [b for lane, name, layer, b, _ in tl.events if lane == "dma" and layer == LAYER + 1
              and name != "kv_cache/state"]
    # every next-layer tile starts after the experts' end (its first-byte latency later), none
    # between the router and it
    assert min(issued) >= tl.end_s[routed] and not any(tl.start_s[router] <= b < tl.end_s[routed] for b in issued)


def test_more_rows_than_the_setting_hold_nothing():
    d = dataclasses.replace(D, batch=8)
    assert timeline(4, d, record=False)[2].step_s == timeline(0, d, record=False)[2].step_s
    assert timeline(8, d, record=False)[2].step_s != timeline(0, d, record=False)[2].step_s


def test_plain_python_and_compiled_loops_agree():
    """The held refills in both modes of the loops: plain Python in a fresh process, compiled here."""
    code = ("from perfmodel.spec.arch import derive; from perfmodel.spec.hardware import load_hardware; "
            "from perfmodel.step.phases import load_profile, profile_deployment; "
            "from perfmodel.step.predict import predict; from perfmodel.engine import megakernel_sim as ms; "
            "m = derive('muse-spark', megakernel={'defer_refills_rows': 4}); "
            "print(repr(predict(m, load_hardware('tpu-v7'), profile_deployment(load_profile('musespark'))).step_s),"
            " ms.is_compiled())")
    env = {**os.environ, "PERFMODEL_LOOPS": "python"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    assert ms.is_compiled() and out[1] == "False"
    assert float(out[0]) == pytest.approx(timeline(4, record=False)[2].step_s, rel=1e-9)


@pytest.mark.parametrize("value", [-1, 1.5, True, 5000])
def test_bad_setting_names_the_field(value):
    with pytest.raises(SpecError) as e:
        derive("muse-spark", megakernel={"defer_refills_rows": value})
    assert e.value.field == "megakernel.defer_refills_rows"
