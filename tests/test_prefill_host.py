"""The host check of prefill: the structure counted in a compiled prefill program (loops
expanded), a recorded prefill trace attributed per layer, and its comparison with the model."""
import json

import jax.numpy as jnp
import pytest

from perfmodel_kernels import prefill as P
from perfmodel_kernels import reference as R
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.validate import host
from perfmodel_jax import capture
from perfmodel_jax.capture import _shape_bytes, prefill_structure


def test_shape_bytes_counts_one_slice_of_stacked_arrays():
    assert _shape_bytes("f32[2,128,128]{2,1,0}") == 2 * 128 * 128 * 4
    assert _shape_bytes("(f32[4]{0}, bf16[3,2]{1,0})") == 16 + 12
    assert _shape_bytes("f32[64,2,8]{2,1,0}", stacked=64) == 2 * 8 * 4


def test_prefill_structure_expands_the_kda_scan():
    """The KDA recurrence runs its body once per token: thunks and loop bytes grow with the
    prompt, per token the same; MLA, FFN and MoE have no loop of a known trip count."""
    spec = load_model("kimi-k3-host-small")
    w = R.init_weights(spec, 0, dtype=jnp.float32)
    s = {c: prefill_structure(P.compiled_prefill(w, jnp.zeros((1, c), jnp.int32), c).as_text(), spec)
         for c in (16, 64)}
    kda = lambda c, k: s[c][f"host_{k}_attention_kda"]
    per_token = (kda(64, "thunks") - kda(16, "thunks")) / 48
    assert per_token > 3 and kda(64, "loop_bytes") / 64 == pytest.approx(kda(16, "loop_bytes") / 16)
    state = spec.kda.heads * spec.kda.head_dim ** 2 * 4
    assert kda(16, "loop_bytes") / 16 > 2 * state  # the state read and written every token, at least
    assert s[16]["host_loop_bytes_attention_mla"] == s[16]["host_loop_bytes_moe"] == 0
    assert s[64]["host_thunks_moe"] < 1.5 * s[16]["host_thunks_moe"]  # the expert loop counts once (its own term)


def test_prefill_structure_replaces_the_decode_programs():
    hw = load_hardware("experiments/results/host-cpu.toml")
    p = host.with_prefill_structure(hw, {"host_thunks_attention_kda": 999.0, "host_loop_bytes_attention_kda": 1e6})
    assert p.components["host_thunks_attention_kda"] == 999.0 and "host_thunks_moe" not in p.components
    assert p.components["host_stack_copies_kda"] == 0 and p.components["host_temp_per_cache_byte"] == 0
    assert p.components["host_thunk_s"] == hw.components["host_thunk_s"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("prefill")
    return capture.capture_reference("kimi-k3-host-small", out, batches=(1,), contexts=(32,), modes=("prefill",),
                                     steps=2)


@pytest.mark.slow  # a real capture: about 40 s on 2 cores
def test_recorded_prefill_trace_compares_per_layer(recorded):
    (run,) = recorded
    meta = json.loads((run / "capture.json").read_text())
    assert meta["mode"] == "prefill" and meta["prompt"] == 32 and meta["structure"]["host_thunks_attention_kda"] > 32
    (c,) = host.validate(run, hardware="experiments/results/host-cpu.toml")
    assert c.mode == "prefill" and c.unattributed_share < 0.05
    assert {l.layer for l in c.layers if l.measured_s > 0} == set(range(6))  # embed, 4 layers, head
    assert c.predicted_step_s > 0 and c.measured_step_s > 0
