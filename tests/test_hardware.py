"""Hardware presets: a source for every number, validation, and TPU figures checked against JAX."""
import dataclasses
import tomllib

import pytest

from perfmodel.spec.hardware import PRESET_DIR, from_dict, jax_chip_figures, list_presets, load_hardware
from perfmodel.util.errors import SpecError


def test_required_presets_exist():
    assert {"tpu-v7", "gb200", "b200", "h200", "h100", "tpu-v6e", "tpu-v5p"} <= set(list_presets())


@pytest.mark.parametrize("name", list_presets())
def test_every_number_has_a_source(name):
    data = tomllib.loads((PRESET_DIR / f"{name}.toml").read_text())
    hw = load_hardware(name)  # the loader refuses an unsourced number
    assert set(data["sources"]) >= {"hbm_bandwidth_bytes_per_s", "peak_flops_per_s", "onchip_bytes"}
    assert hw.core_hbm_bandwidth_bytes_per_s * hw.cores_per_chip == hw.hbm_bandwidth_bytes_per_s


def test_a_number_without_source_is_refused():
    data = tomllib.loads((PRESET_DIR / "gb200.toml").read_text())
    del data["sources"]["link_latency_s"]
    with pytest.raises(SpecError, match="link_latency_s"):
        from_dict(data)


@pytest.mark.parametrize("field,value", [("hbm_bandwidth_bytes_per_s", 0), ("dma_sharing", "lifo"),
                                         ("kind", "fpga"), ("link_latency_s", -1e-6),
                                         ("hbm_bandwidth_bytes_per_s", "fast"), ("peak_flops_per_s", 5),
                                         ("onchip_kind", 3)])
def test_bad_hardware_values_name_the_field(field, value):
    data = tomllib.loads((PRESET_DIR / "tpu-v7.toml").read_text())
    data[field] = value
    with pytest.raises(SpecError) as e:
        from_dict(data)
    assert e.value.field == field


def test_tpu_v7_per_core_figures():
    hw = load_hardware("tpu-v7")
    assert hw.cores_per_chip == 2 and hw.onchip_bytes == 64 * 2**20
    assert hw.core_flops_per_s["bf16"] == pytest.approx(1.155e15)
    assert hw.flops_rate("fp4") == hw.core_flops_per_s["bf16"]  # no FP4 on the v7 MXU


@pytest.mark.parametrize("name,tol", [("tpu-v7", 0.01), ("tpu-v6e", 0.01)])
def test_tpu_presets_agree_with_jax_tpu_info(name, tol):
    pytest.importorskip("jax")
    hw = load_hardware(name)
    jax_fig = jax_chip_figures(hw)
    assert jax_fig["onchip_bytes"] == hw.onchip_bytes
    assert jax_fig["hbm_bandwidth_bytes_per_s"] == pytest.approx(hw.hbm_bandwidth_bytes_per_s, rel=tol)
    assert jax_fig["bf16"] == pytest.approx(hw.peak_flops_per_s["bf16"], rel=tol)
    assert jax_fig["hbm_bytes"] == pytest.approx(hw.hbm_bytes, rel=0.1)


def test_efficiency_bounds_are_enforced():
    with pytest.raises(SpecError, match="efficiency.hbm"):
        from_dict({**tomllib.loads((PRESET_DIR / "gb200.toml").read_text()), "efficiency": {"hbm": 1.5}})
    hw = load_hardware("gb200")
    assert dataclasses.replace(hw.efficiency, hbm=0.5).hbm == 0.5
