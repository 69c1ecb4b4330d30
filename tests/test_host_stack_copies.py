"""Copies of the stacked caches in a host program (components.host_stack_copy_time): the HLO count,
the component by hand, and where the multi-kernel engine charges them."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from perfmodel.cost import components as cm
from perfmodel.graph.ops import build
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.predict import predict
from perfmodel_jax.hostbench import stack_copies

HOST = Path(__file__).resolve().parent.parent / "experiments" / "results" / "host-cpu.toml"

HLO = """HloModule m

%fused (p: f32[3,2,4]) -> f32[3,2,4] {
  %p = f32[3,2,4]{2,1,0} parameter(0)
  ROOT %c = f32[3,2,4]{2,1,0} copy(%p)
}

ENTRY %main (a: f32[3,2,4], b: bf16[1,2,8]) -> (f32[3,2,4], bf16[1,2,8]) {
  %cache__kda_state__.1 = f32[3,2,4]{2,1,0} parameter(0), metadata={op_name="cache['kda_state']"}
  %cache__mla_latent__.1 = bf16[1,2,8]{2,1,0} parameter(1)
  %copy.1 = f32[3,2,4]{2,1,0} copy(%cache__kda_state__.1)
  %f = f32[3,2,4]{2,1,0} fusion(%copy.1), kind=kLoop, calls=%fused
  %copy.2 = f32[3,2,4]{2,1,0} copy(%f)
  %copy.3 = f32[2,4]{1,0} copy(%f)
  %b = bf16[1,2,8]{2,1,0} bitcast(%cache__mla_latent__.1)
  ROOT %r = (f32[3,2,4]{2,1,0}, bf16[1,2,8]{2,1,0}) tuple(%copy.2, %b)
}
"""


def test_stack_copies_counts_entry_copies_of_a_cache_shape():
    """Two entry copies of the state stack's shape and one of a layer's slot (a third of the
    stack; not the fused body's copy), none of the latent; each cache's bytes from its shape."""
    n, nbytes = stack_copies(HLO)
    assert n == {"kda_state": pytest.approx(2 + 1 / 3), "mla_latent": 0}
    assert nbytes == {"kda_state": 3 * 2 * 4 * 4, "mla_latent": 2 * 8 * 2}


def test_stack_copy_by_hand():
    assert cm.host_stack_copy_time({"host_stack_copy_bytes_per_s": 2e10}, 4e6) == pytest.approx(2e-4)  # 4 MB at 20 GB/s


def host(copies: bool, launch: float):
    hw = load_hardware(str(HOST)).replace(launch_overhead_s=launch)
    c = {k: v for k, v in hw.components.items() if not k.startswith("host_stack_copies_")}
    c["host_stack_copy_bytes_per_s"] = 1e10
    if copies:
        c |= {"host_stack_copies_kda": 1.0, "host_stack_copies_mla": 0.5,
              "host_stack_copies_attention_kda": 0.1, "host_stack_copies_attention_mla": 0.8}
    return dataclasses.replace(hw, components=c)


def test_one_program_copies_each_kinds_stacks_once_per_layer_of_that_kind():
    """kimi-k3-host-small, batch 8, context 256, one program: each of the 3 KDA layers copies the
    3 KDA layers' caches (1.0), the MLA layer half its own (0.5), at 10 GB/s, at each layer."""
    spec = load_model("kimi-k3-host-small")
    d = Deployment(devices=1, tp=1, engine="multikernel", batch=8, context=256)
    cache = build(spec, d).cache_bytes
    kda = cache[1] + cache[2] + cache[3]
    base, copied = (predict(spec, host(x, 0.0), d) for x in (False, True))
    diff = [a.time_s - b.time_s for a, b in zip(copied.layers, base.layers)]
    assert diff[1:4] == pytest.approx([kda / 1e10] * 3)
    assert diff[4] == pytest.approx(0.5 * cache[4] / 1e10)
    assert copied.step_s - base.step_s == pytest.approx((3 * kda + 0.5 * cache[4]) / 1e10)


def test_op_by_op_each_attention_phase_copies_its_share_of_all_caches():
    spec = load_model("kimi-k3-host-small")
    d = Deployment(devices=1, tp=1, engine="multikernel", batch=8, context=256)
    total = sum(build(spec, d).cache_bytes.values())
    base, copied = (predict(spec, host(x, 5e-6), d) for x in (False, True))
    diff = [a.time_s - b.time_s for a, b in zip(copied.layers, base.layers)]
    assert diff[1:5] == pytest.approx([0.1 * total / 1e10] * 3 + [0.8 * total / 1e10])
    assert diff[0] == pytest.approx(0.0, abs=1e-12) and diff[5] == pytest.approx(0.0, abs=1e-12)
