"""hostbench: the hardware file it writes (from synthetic figures) and one quick real run."""
from __future__ import annotations

import dataclasses
import json
import math
import tomllib

import pytest

from perfmodel_jax import hostbench
from perfmodel.cli import main
from perfmodel.hardware import load_hardware
from perfmodel_jax.hostbench import HostBench, Stat


def bench() -> HostBench:
    """Synthetic figures (not a measurement) of the shape `hostbench.measure` returns."""
    s = lambda x: Stat(0.9 * x, x, 1.1 * x)
    return HostBench("Test CPU 9000", "2026-01-02", 5, {128: s(30e9), 1024: s(40e9)},
                     {128: s(50e9), 1024: s(60e9)}, {"bf16": s(400e9), "f32": s(200e9)},
                     {"bf16": s(300e9), "f32": s(150e9)},
                     {(dt, r): s(20e9 / r) for dt in ("f32", "bf16") for r in hostbench.MATVEC_ROWS},
                     s(5e-6), s(1e-6), 32 * 2**20, 24 * 2**30, 1,
                     expert_loop={(k, w, r): s(2e-6 + 3 * k * w * 4 * (5e-11 + 1e-12 * r))
                                  for k, w in hostbench.EXPERT_SHAPES for r in hostbench.EXPERT_ROWS},
                     convert_s={sh: s(math.prod(sh) / 1e9) for sh in hostbench.CONVERT_SHAPES})


def test_stat_rate_swaps_min_and_max():
    r = Stat(1.0, 2.0, 4.0).scaled(8.0)
    assert (r.min, r.median, r.max) == (2.0, 4.0, 8.0)


def test_hardware_file_loads_with_a_source_for_every_number(tmp_path):
    path = hostbench.write(bench(), tmp_path / "host.toml")
    hw = load_hardware(str(path))  # the loader enforces a source per numeric field
    assert hw.kind == "cpu" and hw.cores_per_chip == 1
    assert hw.hbm_bandwidth_bytes_per_s == pytest.approx(40e9)  # the largest size's median
    assert hw.peak_flops_per_s == {"bf16": pytest.approx(400e9), "f32": pytest.approx(200e9)}
    assert hw.launch_overhead_s == pytest.approx(5e-6)
    assert hw.efficiency.op_overhead_s == pytest.approx(1e-6)
    assert hw.efficiency.flops == pytest.approx(0.75)
    assert hw.onchip_bytes == 32 * 2**20 and hw.hbm_bytes == 24 * 2**30
    src = tomllib.loads(path.read_text())["sources"]
    for key in ("peak_flops_per_s", "hbm_bandwidth_bytes_per_s", "launch_overhead_s",
                "efficiency.op_overhead_s"):
        assert src[key].startswith("measured by hostbench on Test CPU 9000, 2026-01-02")
        assert "min/median/max" in src[key]
    assert "assumption" in src["dma_latency_s"]
    raw = json.loads(path.with_suffix(".json").read_text())
    assert raw["matvec_bandwidth_bytes_per_s"]["f32/1"]["median"] == pytest.approx(20e9)


def test_cli_rejects_a_non_toml_output(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(hostbench, "measure", lambda *a, **k: bench())
    assert main(["hostbench", "--out", str(tmp_path / "host.txt")]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["hostbench", "--out", str(tmp_path / "h.toml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware_file"].endswith("h.toml") and out["cpu"] == "Test CPU 9000"


@pytest.mark.slow
def test_quick_measurement_runs(tmp_path):
    """A real (quick, small-size) run: figures are positive and the file loads. Not a benchmark."""
    b = hostbench.measure(repeats=2, quick=True, progress=False)
    assert all(s.min > 0 for s in b.read_bandwidth.values())
    assert all(s.min <= s.median <= s.max for s in b.matmul_flops.values())
    assert b.dispatch_s.median > 0 and b.op_overhead_s.min >= 0
    load_hardware(str(hostbench.write(b, tmp_path / "quick.toml")))


def test_dispatch_cost_against_argument_count_is_a_line_through_the_medians():
    b = bench()
    assert b.dispatch_s_for(10) == b.dispatch_s.median  # not measured: the one-array figure
    s = lambda x: Stat(x, x, x)
    b = dataclasses.replace(b, dispatch_by_args={1: s(5e-6), 65: s(37e-6)})
    assert b.dispatch_s_for(33) == pytest.approx(21e-6)


def test_expert_loop_is_a_component_fitted_to_its_own_figures(tmp_path):
    """hostbench writes the expert-loop figures as micro-benchmarks and fits
    components.host_expert_time to them alone (synthetic figures of its form: exact)."""
    path = hostbench.write(bench(), tmp_path / "host.toml")
    data = json.loads(path.with_suffix(".microbench.json").read_text())
    loops = [e for e in data["entries"] if e["mechanism"] == "host_expert_loop"]
    assert len(loops) == len(hostbench.EXPERT_SHAPES) * len(hostbench.EXPERT_ROWS)
    hw = load_hardware(str(path))
    assert "fitted by perfmodel calibrate" in hw.sources["components.host_expert_fixed_s"]
    from perfmodel.microbench import residual_table
    rows = [r for r in residual_table(data, hw) if r["mechanism"] == "host_expert_loop"]
    assert all(abs(r["error"]) < 0.02 for r in rows)


def test_cache_widening_is_a_component_fitted_to_its_own_figures(tmp_path):
    path = hostbench.write(bench(), tmp_path / "host.toml")
    hw = load_hardware(str(path))
    assert hw.components["host_convert_values_per_s"] == pytest.approx(1e9, rel=1e-3)
    assert "fitted by perfmodel calibrate" in hw.sources["components.host_convert_values_per_s"]
