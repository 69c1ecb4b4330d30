"""Each host model's own compiled structure (stack copies, temporaries per cache byte) and the
copy of a cache stack into a reused buffer (components.host_stack_copy_time): written by
hostbench with their sources, fitted to their own micro-benchmarks, applied by the validation."""
from __future__ import annotations

import dataclasses
import math

import pytest

from perfmodel.fit.microbench import residual_table
from perfmodel.spec.hardware import load_hardware
from perfmodel.validate.host import own_structure
from perfmodel_jax import hostbench
from test_hostbench import bench

LARGE = "kimi-k3-host-large"


def with_own(b):
    """Synthetic figures of the component's form: a 4 us call (the thunk chain's) + 25 GB/s;
    the large model's own counts differ from the probe model's."""
    return dataclasses.replace(
        b, stack_copy_s={sh: Stat(t, t, t) for sh in hostbench.STACK_COPY_SHAPES
                         for t in [4e-6 + 4 * math.prod(sh) / 25e9]},
        model_memory={LARGE: ({"step": 2.2, "attention_kda": 2.9, "attention_mla": 4.3},
                              {"kda": 0.84, "mla": 0.0, "attention_kda": 0.06, "attention_mla": 0.0})})


Stat = hostbench.Stat


def test_stack_copy_rate_is_fitted_to_its_own_figures(tmp_path):
    path = hostbench.write(with_own(bench()), tmp_path / "host.toml")
    hw = load_hardware(str(path))
    assert hw.components["host_stack_copy_bytes_per_s"] == pytest.approx(25e9, rel=1e-3)
    assert "host-stack-copy-f32-6x16x8x128x128" in hw.sources["components.host_stack_copy_bytes_per_s"]
    import json
    data = json.loads(path.with_suffix(".microbench.json").read_text())
    rows = [r for r in residual_table(data, hw) if r["mechanism"] == "host_stack_copy"]
    assert len(rows) == len(hostbench.STACK_COPY_SHAPES) and all(abs(r["error"]) < 0.01 for r in rows)


def test_each_models_own_counts_are_written_and_applied(tmp_path):
    hw = load_hardware(str(hostbench.write(with_own(bench()), tmp_path / "host.toml")))
    suffix = hostbench.model_suffix(LARGE)
    assert hw.components["host_stack_copies_kda" + suffix] == 0.84
    assert hw.components["host_temp_per_cache_byte_attention_mla" + suffix] == 4.3
    assert LARGE in hw.sources["components.host_stack_copies_kda" + suffix]
    large = own_structure(hw, LARGE).components
    assert large["host_stack_copies_kda"] == 0.84 and large["host_temp_per_cache_byte"] == 2.2
    assert not any("__" in k for k in large)
    small = own_structure(hw, "kimi-k3-host-small").components  # the probe model's own: unsuffixed
    assert small["host_stack_copies_kda"] == 1.0 and small["host_temp_per_cache_byte"] == 2.4
    assert not any("__" in k for k in small)
