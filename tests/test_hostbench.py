"""hostbench: the hardware file it writes (from synthetic figures) and one quick real run."""
from __future__ import annotations

import dataclasses
import json
import math
import tomllib

import pytest

from perfmodel.cli.main import main
from perfmodel.spec.hardware import load_hardware
from perfmodel_jax import hostbench
from perfmodel_jax.hostbench import HostBench, Stat


def bench() -> HostBench:
    """Synthetic figures (not a measurement) of the shape `hostbench.measure` returns."""
    s = lambda x: Stat(0.9 * x, x, 1.1 * x)
    return HostBench("Test CPU 9000", "2026-01-02", 5, {128: s(30e9), 1024: s(40e9)},
                     {128: s(50e9), 1024: s(60e9)}, {"bf16": s(400e9), "f32": s(200e9)},
                     {"bf16": s(300e9), "f32": s(150e9)},
                     {(dt, r): s(20e9 / r) for dt in ("f32", "bf16") for r in hostbench.MATVEC_ROWS},
                     s(5e-6), {t: s(4e-6 + t * 3e-7) for t in (32, 128, 512)}, 32 * 2**20, 24 * 2**30, 1,
                     expert_loop={(k, w, r): s(2e-6 + 3 * k * w * 4 * (5e-11 + 1e-12 * r))
                                  for k, w in hostbench.EXPERT_SHAPES for r in hostbench.EXPERT_ROWS},
                     convert_s={sh: s(math.prod(sh) / (1e9 if 4 * math.prod(sh) > 32 * 2**20 else 6e9))
                                for sh in hostbench.CONVERT_SHAPES},
                     argmax_s={sh: s(math.prod(sh) / 2.5e8) for sh in hostbench.ARGMAX_SHAPES},
                     reference_thunks={"attention_kda": 44.5, "ffn": 8.0, "moe": 36.0, "head": 7.0},
                     dot_chain={r: s(8e-6 + hostbench.DOT_CHAIN_K**2 * 4 * r / 20e9) for r in hostbench.MATVEC_ROWS},
                     absorb_s={sh: s(2e-5 + sh[0] * sh[1] * (sh[2] + sh[3]) * 4 / 2.5e9)
                               for sh in hostbench.ABSORB_SHAPES},
                     temp_pages_s={m: s(4e-6 + m * 2**20 / 1e10 + (m * 2**20 // 4096 * 8e-7 if m > 32 else 0))
                                   for m in hostbench.TEMP_PAGES_MIB},
                     temp_per_cache_byte={"step": 2.4, "attention_kda": 2.9, "attention_mla": 3.0},
                     stack_copies={"kda": 1.0, "mla": 1.0, "attention_kda": 0.014, "attention_mla": 0.79},
                     page_bytes=4096)


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
    assert hw.efficiency.op_overhead_s == 0  # inside a program: per thunk (components)
    assert hw.efficiency.flops == pytest.approx(0.75)
    assert hw.onchip_bytes == 32 * 2**20 and hw.hbm_bytes == 24 * 2**30
    src = tomllib.loads(path.read_text())["sources"]
    for key in ("peak_flops_per_s", "hbm_bandwidth_bytes_per_s", "launch_overhead_s"):
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
    assert b.dispatch_s.median > 0 and len(b.thunk_chain) == len(hostbench.THUNK_CHAIN_STEPS)
    assert min(b.thunk_chain) >= min(hostbench.THUNK_CHAIN_STEPS)  # at least one thunk per step
    assert {"attention_kda", "attention_mla", "ffn", "moe", "head"} <= set(b.reference_thunks)
    assert b.temp_per_cache_byte["step"] > 1 and set(b.temp_pages_s) == {8, 48}  # the caches, and more
    assert set(b.temp_per_cache_byte) == {"step", "attention_kda", "attention_mla"}
    assert set(b.stack_copies) == {"kda", "mla", "attention_kda", "attention_mla"}
    assert b.stack_copy_s and all(s.median > 0 for s in b.stack_copy_s.values())
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
    from perfmodel.fit.microbench import residual_table
    rows = [r for r in residual_table(data, hw) if r["mechanism"] == "host_expert_loop"]
    assert all(abs(r["error"]) < 0.02 for r in rows)


def test_cache_widening_is_a_component_fitted_to_its_own_figures(tmp_path):
    path = hostbench.write(bench(), tmp_path / "host.toml")
    hw = load_hardware(str(path))
    assert hw.components["host_convert_values_per_s"] == pytest.approx(1e9, rel=1e-3)
    assert hw.components["host_convert_reused_values_per_s"] == pytest.approx(6e9, rel=1e-3)
    assert "mallopt" in hw.sources["components.host_mmap_threshold_bytes"]
    assert "fitted by perfmodel calibrate" in hw.sources["components.host_convert_values_per_s"]


def test_thunk_chain_argmax_and_absorbed_kv_b_are_components_fitted_to_their_own_figures(tmp_path):
    """Synthetic figures of the components' form (4 us per call + 0.3 us per thunk; 2.5e8
    values/s; 20 us + 2.5 GB/s): the fit recovers them; the structural thunk counts are written, with a source."""
    path = hostbench.write(bench(), tmp_path / "host.toml")
    hw = load_hardware(str(path))
    assert hw.components["host_call_s"] == pytest.approx(4e-6, rel=1e-3)
    assert hw.components["host_thunk_s"] == pytest.approx(3e-7, rel=1e-3)
    assert bench().op_overhead_s.median == pytest.approx(3e-7)  # the JSON's per-op (per-thunk) figure
    assert hw.components["host_argmax_values_per_s"] == pytest.approx(2.5e8, rel=1e-3)
    assert hw.components["host_absorb_fixed_s"] == pytest.approx(2e-5, rel=1e-3)
    assert hw.components["host_absorb_bytes_per_s"] == pytest.approx(2.5e9, rel=1e-3)
    assert "host-thunk-chain-t512" in hw.sources["components.host_thunk_s"]
    assert hw.components["host_thunks_attention_kda"] == 44.5
    assert "compiled HLO" in hw.sources["components.host_thunks_moe"]


def test_temp_pages_are_a_component_fitted_to_their_own_figures(tmp_path):
    """Synthetic figures of the component's form (a 4 us call, 10 GB/s fill, 0.8 us per fresh
    4 KiB page above 32 MiB): the fit recovers the page cost; the structural ratio and the page
    size are written with their sources."""
    path = hostbench.write(bench(), tmp_path / "host.toml")
    hw = load_hardware(str(path))
    assert hw.components["host_page_fault_s"] == pytest.approx(8e-7, rel=1e-3)
    assert hw.components["host_fill_bytes_per_s"] == pytest.approx(1e10, rel=1e-3)
    assert hw.components["host_page_bytes"] == 4096 and hw.components["host_temp_per_cache_byte"] == 2.4
    assert hw.components["host_temp_per_cache_byte_attention_mla"] == 3.0
    assert "host-temp-pages-f32-192mib" in hw.sources["components.host_page_fault_s"]
    assert "memory_analysis" in hw.sources["components.host_temp_per_cache_byte"]
    assert "op-by-op attention_kda" in hw.sources["components.host_temp_per_cache_byte_attention_kda"]
    assert "SC_PAGE_SIZE" in hw.sources["components.host_page_bytes"]
    assert hw.components["host_stack_copies_kda"] == 1.0 and hw.components["host_stack_copies_attention_mla"] == 0.79
    assert "per kda layer" in hw.sources["components.host_stack_copies_kda"]


def test_count_thunks_reads_the_entry_computation_by_scope():
    """Hand-written HLO: parameters, constants, tuples, bitcasts and get-tuple-elements run no
    kernel; a while counts once; a fused computation's body is not the entry's."""
    hlo = """HloModule m

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %t = f32[4]{0} tanh(%p)
}

ENTRY %main (a: f32[4], b: f32[4]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0), metadata={op_name="jit(f)/layer_01/attention/x"}
  %b = f32[4]{0} parameter(1)
  %c = f32[] constant(1)
  %f = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(f)/layer_01/attention/tanh"}
  %d = f32[4]{0} dot(%f, %b), metadata={op_name="jit(f)/layer_01/moe/dot"}
  %w = (s32[], f32[4]{0}) while(%t0), condition=%cond, body=%body, metadata={op_name="jit(f)/layer_01/moe/while"}
  %g = f32[4]{0} get-tuple-element(%w), index=1
  %x = f32[4]{0} bitcast(%g)
  %y = f32[4]{0} copy(%x), metadata={op_name="jit(f)/head/copy"}
  ROOT %r = (f32[4]{0}, f32[4]{0}) tuple(%d, %y)
}
"""
    assert hostbench.count_thunks(hlo) == {"layer_01/attention": 1, "layer_01/moe": 2, "head": 1}


def test_dot_fixed_cost_is_fitted_with_the_large_dots(tmp_path):
    """The 4 MiB chain's dots (synthetic: 8 us + the 256 MiB dots' rate) carry the fixed cost per
    dot; the fit puts it in dot_fixed_s."""
    path = hostbench.write(bench(), tmp_path / "host.toml")
    hw = load_hardware(str(path))
    assert hw.components["dot_fixed_s"] == pytest.approx(8e-6, rel=0.1)
    assert "host-dot-chain-f32-r1" in hw.sources["components.dot_fixed_s"]
