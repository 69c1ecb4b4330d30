"""Fresh pages of a host program's temporary buffer (components.host_fresh_pages_time), worked
by hand, and where the multi-kernel engine charges them for a host run."""
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

MIB = 2**20
PAGES = {"host_mmap_threshold_bytes": 32 * MIB, "host_page_bytes": 4096, "host_page_fault_s": 1e-6}
HOST = Path(__file__).resolve().parent.parent / "experiments" / "results" / "host-cpu.toml"


def test_fresh_pages_by_hand():
    assert cm.host_fresh_pages_time(PAGES, 16 * MIB) == 0.0  # below the threshold: reused memory
    assert cm.host_fresh_pages_time(PAGES, 32 * MIB) == 0.0  # at it, too
    assert cm.host_fresh_pages_time(PAGES, 40 * MIB) == pytest.approx(10240e-6)  # 10240 pages x 1 us
    assert cm.host_fresh_pages_time(PAGES, 40 * MIB + 1) == pytest.approx(10241e-6)  # a started page


def test_temp_fill_by_hand():
    c = PAGES | {"host_call_s": 5e-6, "host_fill_bytes_per_s": 1e10}
    # 8 MiB: 5 us + 8 MiB at 10 GB/s; 48 MiB: the same + 12288 fresh pages x 1 us
    assert cm.host_temp_fill_time(c, 8 * MIB) == pytest.approx(5e-6 + 8 * MIB / 1e10)
    assert cm.host_temp_fill_time(c, 48 * MIB) == pytest.approx(5e-6 + 48 * MIB / 1e10 + 12288e-6)


def test_cache_bytes_per_layer_by_hand():
    """kimi-k3-host-small at batch 8, context 4096: a KDA layer holds 2 heads x (128 x 128 f32
    state + 3 x 128 x 3 bf16 conv window) per sequence, the MLA layer 4096 x 192 bf16 latents."""
    g = build(load_model("kimi-k3-host-small"), Deployment(devices=1, tp=1, engine="multikernel",
                                                           batch=8, context=4096))
    kda, mla = 8 * 2 * (128 * 128 * 4 + 3 * 128 * 3 * 2), 8 * 4096 * 192 * 2
    assert g.cache_bytes == {1: kda, 2: kda, 3: kda, 4: mla}


def host(pages: bool, launch: float):
    hw = load_hardware(str(HOST)).replace(launch_overhead_s=launch)
    c = {k: v for k, v in hw.components.items() if not k.startswith(("host_page_fault_s", "host_temp_per"))}
    if pages:
        c |= PAGES | {"host_temp_per_cache_byte": 2.5, "host_temp_per_cache_byte_attention_mla": 3.0}
    return dataclasses.replace(hw, components=c)


@pytest.mark.parametrize("batch,context", [(32, 256), (8, 4096), (4, 256)])
def test_one_program_pays_its_temporaries_pages_at_the_first_layer(batch, context):
    """Compiled (launch_overhead_s = 0): one program whose temporaries are 2.5 x all caches; their
    pages (if above 32 MiB) land on layer 1, nothing else moves."""
    spec = load_model("kimi-k3-host-small")
    d = Deployment(devices=1, tp=1, engine="multikernel", batch=batch, context=context)
    temp = 2.5 * sum(build(spec, d).cache_bytes.values())
    base, paged = (predict(spec, host(p, 0.0), d) for p in (False, True))
    extra = -(-temp // 4096) * 1e-6 if temp > 32 * MIB else 0.0
    assert paged.step_s - base.step_s == pytest.approx(extra, rel=1e-9, abs=1e-12)
    assert paged.layers[1].time_s - base.layers[1].time_s == pytest.approx(extra, rel=1e-9, abs=1e-12)
    if batch == 4:
        assert extra == 0.0  # 2.5 x 4 MB of caches: below the threshold
    else:
        assert extra > 5e-3


def test_op_by_op_each_attention_program_pays_its_own():
    """Op by op: each layer's attention phase is its own program; at batch 32, context 4096 only
    the MLA layer's temporaries (its kind's 3 x 50 MB) pass the threshold, the KDA layers' (no
    count of their own: the step's 2.5 x 4.3 MB) do not."""
    spec = load_model("kimi-k3-host-small")
    d = Deployment(devices=1, tp=1, engine="multikernel", batch=32, context=4096)
    cache = build(spec, d).cache_bytes
    base, paged = (predict(spec, host(p, 5e-6), d) for p in (False, True))
    diff = [a.time_s - b.time_s for a, b in zip(paged.layers, base.layers)]
    mla = -(-3.0 * cache[4] // 4096) * 1e-6
    assert diff[4] == pytest.approx(mla) and mla > 0.02
    assert diff[:4] + diff[5:] == pytest.approx([0.0] * 5, abs=1e-12)
