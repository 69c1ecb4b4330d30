"""Trace parsing: real CPU traces recorded here, a real H200 trace (tests/data), constructed TPU
and GPU traces, and bad files.

Most TPU traces below are CONSTRUCTED: XSpace protobufs written from text in the XPlane schema
(tensorflow/tsl profiler xplane.proto) for layouts no recorded trace covers. One is RECORDED on
a TPU v5e (tests/data/tpu_v5e_k3_b1.xplane.pb.gz, the megakernel on a Kimi K3 slice).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from perfmodel.cli.main import main
from perfmodel.util.errors import SpecError
from perfmodel.validate import traces
from perfmodel_jax import capture
from test_hostbench import bench  # a synthetic HostBench

ROOT = Path(__file__).resolve().parent.parent


# ----- constructed TPU traces ------------------------------------------------------------------

def xspace_text(steps: list[list[tuple[str, float, float]]], step_us: float,
                kernel: str = "megakernel.1", prefix: str = "") -> str:
    """A TPU device plane: one `Steps` event per step; per step the kernel's custom call over the
    whole step and markers (scope, start_us, duration_us) relative to the step start."""
    meta = {"step": 1, kernel: 2}
    step_events, op_events = [], []
    for i, markers in enumerate(steps):
        t0 = i * step_us * 1e6  # ps
        step_events.append(f"events {{ metadata_id: 1 offset_ps: {t0:.0f} duration_ps: "
                           f"{step_us * 1e6:.0f} stats {{ metadata_id: 1 int64_value: {i} }} }}")
        op_events.append(f"events {{ metadata_id: 2 offset_ps: {t0:.0f} duration_ps: "
                         f"{step_us * 1e6:.0f} stats {{ metadata_id: 2 str_value: "
                         f"\"jit(_step)/pallas_call\" }} }}")
        for name, start, dur in markers:
            mid = meta.setdefault(prefix + name, len(meta) + 1)
            op_events.append(f"events {{ metadata_id: {mid} offset_ps: {t0 + start * 1e6:.0f} "
                             f"duration_ps: {dur * 1e6:.0f} }}")
    md = "\n".join(f'event_metadata {{ key: {v} value {{ id: {v} name: "{k if k != "step" else "0"}" }} }}'
                   for k, v in meta.items())
    return f"""planes {{
  id: 1 name: "/device:TPU:0"
  lines {{ id: 1 name: "Steps" timestamp_ns: 1000 {' '.join(step_events)} }}
  lines {{ id: 2 name: "XLA Ops" timestamp_ns: 1000 {' '.join(op_events)} }}
  {md}
  stat_metadata {{ key: 1 value {{ id: 1 name: "step_num" }} }}
  stat_metadata {{ key: 2 value {{ id: 2 name: "tf_op" }} }}
}}
planes {{ id: 2 name: "/host:CPU" lines {{ id: 1 name: "python" timestamp_ns: 1000
  events {{ metadata_id: 1 offset_ps: 0 duration_ps: 5 }} }}
  event_metadata {{ key: 1 value {{ id: 1 name: "$run.py:10 main" }} }} }}
"""


def write_xspace(path: Path, text: str) -> Path:
    from jax.profiler import ProfileData
    path.write_bytes(ProfileData.text_proto_to_serialized_xspace(text))
    return path


# kimi-k3-mini: 4 layers; per step (us): embed, per layer attention + ffn/moe (with a nested
# router marker inside layer 2's moe), head; gaps between markers are kernel time too.
MINI_STEP = [("embed", 0.0, 1.0),
             ("layer_01/attention", 1.0, 3.0), ("layer_01/ffn", 4.0, 2.0),
             ("layer_02/attention", 6.0, 3.0), ("layer_02/moe", 9.0, 4.0),
             ("layer_02/moe/router", 9.0, 1.0),
             ("layer_03/attention", 13.0, 3.0), ("layer_03/moe", 16.0, 4.0),
             ("layer_04/attention", 20.0, 5.0), ("layer_04/moe", 25.5, 4.0),  # 0.5 us gap
             ("head", 29.5, 0.5)]


def test_constructed_tpu_trace_layers_and_steps(tmp_path):
    f = write_xspace(tmp_path / "tpu.xplane.pb", xspace_text([MINI_STEP] * 3, step_us=30.0))
    t = traces.parse_trace(f, n_layers=4)
    assert len(t.steps) == 3
    assert t.step_s.median == pytest.approx(30e-6)
    # the enclosing custom call takes no share where a marker runs; the 0.5 us inside the
    # kernel but outside any marker is unattributed
    assert t.unattributed_share == pytest.approx(0.5 / 30)
    expect = {0: 1.0, 1: 5.0, 2: 7.0, 3: 7.0, 4: 9.0, 5: 0.5}
    for layer, us in expect.items():
        assert t.layer_s[layer].median == pytest.approx(us * 1e-6, rel=1e-6), layer
    assert sum(t.layer_s[k].median for k in expect) == pytest.approx(29.5e-6)
    assert t.layer_s[2].min == t.layer_s[2].max  # identical steps: no spread


# the same step as the layer-loop kernel marks it: the loop body is traced once, so its markers
# carry no layer number (the n-th `layer/attention` of a step is layer n); nested markers (the
# router inside the FFN, a nested scope inside attention) do not start a layer
LOOP_STEP = [(n if n in ("embed", "head") else
              "layer/" + n.split("/", 1)[1].replace("moe", "ffn"), a, d)
             for n, a, d in MINI_STEP] + [("layer/attention/nested", 14.0, 1.0)]


def test_constructed_loop_kernel_trace_numbers_layers_in_order(tmp_path):
    f = write_xspace(tmp_path / "loop.xplane.pb", xspace_text([LOOP_STEP] * 3, step_us=30.0))
    t = traces.parse_trace(f, n_layers=4)
    loop = traces.parse_trace(write_xspace(tmp_path / "l.xplane.pb",
                                           xspace_text([MINI_STEP] * 3, step_us=30.0)), n_layers=4)
    assert len(t.steps) == 3
    for layer, us in {0: 1.0, 1: 5.0, 2: 7.0, 3: 7.0, 4: 9.0, 5: 0.5}.items():
        assert t.layer_s[layer].median == pytest.approx(us * 1e-6, rel=1e-6), layer
        assert t.layer_s[layer] == loop.layer_s[layer]
    assert set(t.phase_s) == {"embed", "head"} | {f"layer_{i:02d}/{p}" for i in range(1, 5)
                                                  for p in ("attention", "ffn")}
    # runtime-prefixed loop markers on the device plane are read the same way
    text = xspace_text([LOOP_STEP] * 2, step_us=30.0, prefix="megakernel/")
    p = traces.parse_trace(write_xspace(tmp_path / "p.xplane.pb", text), n_layers=4)
    assert p.layer_s[4].median == pytest.approx(9e-6) and p.layer_s[2].median == pytest.approx(7e-6)


def offset_clock_text(steps: int, step_us: float, period_us: float, device_lag_us: float,
                      steps_per_call: int = 1) -> str:
    """A TPU VM's trace as the v5e records it: on the device plane one `XLA Modules` event per
    call of `steps_per_call` steps and the kernel's markers (LOOP_STEP) on the `XLA TraceMe` line;
    on the host plane a `decode_step` annotation a step; the device's clock reads `device_lag_us`
    behind the host's."""
    names = {"module": 1, "decode_step": 2}
    mods, marks, host = [], [], []
    for i in range(steps):
        t0 = i * period_us * 1e6
        if i % steps_per_call == 0:
            span = (steps_per_call - 1) * period_us + step_us
            mods.append(f"events {{ metadata_id: 1 offset_ps: {t0:.0f} duration_ps: {span * 1e6:.0f} }}")
        host.append(f"events {{ metadata_id: 2 offset_ps: {t0 + device_lag_us * 1e6:.0f} duration_ps: "
                    f"{(period_us - 1) * 1e6:.0f} stats {{ metadata_id: 1 int64_value: {i} }} }}")
        for name, start, dur in LOOP_STEP:
            mid = names.setdefault(name, len(names) + 1)
            marks.append(f"events {{ metadata_id: {mid} offset_ps: {t0 + start * 1e6:.0f} "
                         f"duration_ps: {dur * 1e6:.0f} }}")
    md = "\n".join(f'event_metadata {{ key: {v} value {{ id: {v} name: "{k}" }} }}' for k, v in names.items())
    return f"""planes {{
  id: 1 name: "/device:TPU:0"
  lines {{ id: 1 name: "XLA Modules" timestamp_ns: 1000 {' '.join(mods)} }}
  lines {{ id: 2 name: "{traces.KERNEL_MARKERS}" timestamp_ns: 1000 {' '.join(marks)} }}
  {md}
}}
planes {{ id: 2 name: "/host:CPU" lines {{ id: 1 name: "python3" timestamp_ns: 1000 {' '.join(host)} }}
  {md}
  stat_metadata {{ key: 1 value {{ id: 1 name: "step_num" }} }} }}
"""


def test_tpu_steps_cut_by_the_devices_program_runs_not_the_hosts_clock(tmp_path):
    """On the lent v5e the device's clock read 0.1 ms behind the host's, so each host step
    window held the end of one step and the start of the next (the embed phase read 0.9 ms):
    a kernel's steps are the device's own program runs that hold its markers."""
    f = write_xspace(tmp_path / "offset.xplane.pb", offset_clock_text(3, 30.0, 50.0, device_lag_us=12.0))
    t = traces.parse_trace(f, n_layers=4)
    assert len(t.steps) == 3 and t.step_s.median == pytest.approx(30e-6)
    # in-kernel markers: the 0.5 us gap before layer 4's FFN is its time
    for layer, us in {0: 1.0, 1: 5.0, 2: 7.0, 3: 7.0, 4: 9.5, 5: 0.5}.items():
        assert t.layer_s[layer].median == pytest.approx(us * 1e-6, rel=1e-6), layer
    assert any("program runs" in n for n in t.notes)
    # a call of two steps: its run holds two steps, the host's annotations cut them
    f = write_xspace(tmp_path / "two.xplane.pb", offset_clock_text(4, 30.0, 50.0, 0.0, steps_per_call=2))
    t = traces.parse_trace(f, n_layers=4)
    assert len(t.steps) == 4 and t.step_s.median == pytest.approx(30e-6)
    assert not any("program runs" in n for n in t.notes)


def test_constructed_tpu_trace_prefixed_markers_and_unscoped_time(tmp_path):
    """Markers prefixed by the runtime are still read; kernel time outside any marker is
    reported as unattributed, not hidden."""
    step = [("layer_01/attention", 0.0, 6.0), ("layer_01/ffn", 6.0, 2.0)]
    text = xspace_text([step], step_us=10.0, prefix="megakernel/")
    t = traces.parse_trace(write_xspace(tmp_path / "p.xplane.pb", text), n_layers=1)
    assert t.layer_s[1].median == pytest.approx(8e-6)
    assert t.unattributed_share == pytest.approx(0.2)


def test_megakernel_comparison_on_constructed_trace(tmp_path):
    spec = importlib.util.spec_from_file_location("profile_megakernel",
                                                  ROOT / "experiments" / "profile_megakernel.py")
    pm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pm)
    f = write_xspace(tmp_path / "tpu.xplane.pb", xspace_text([MINI_STEP] * 2, step_us=30.0))
    t = traces.parse_trace(f, n_layers=4)
    c = pm.compare_run(t, "kimi-k3-mini", "tpu-v7", batch=1, context=32, depth=4,
                       bank_bytes=2 * 128 * 128, slots=2)
    assert [r.layer for r in c.layers] == list(range(6))
    assert all(r.predicted_s > 0 and r.measured_s > 0 for r in c.layers)
    assert c.measured_step_s == pytest.approx(30e-6)
    deeper = pm.compare_run(t, "kimi-k3-mini", "tpu-v7", 1, 32, 12, 2 * 128 * 128, 2)
    assert deeper.predicted_step_s <= c.predicted_step_s  # a deeper ring never slows the model
    verify = pm.compare_run(t, "kimi-k3-mini", "tpu-v7", 1, 32, 4, 2 * 128 * 128, 2, rows=4,
                            accepted=2)  # verify blocks of 4 rows: more work per step
    assert verify.predicted_step_s > c.predicted_step_s
    rows = pm.rows_of(c, 4)
    assert rows[0][2] == "step" and len(rows) == 7


def test_profile_megakernel_without_tpu_exits_clearly(capsys):
    spec = importlib.util.spec_from_file_location("profile_megakernel",
                                                  ROOT / "experiments" / "profile_megakernel.py")
    pm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pm)
    assert pm.main(["--batch", "1", "--depths", "1"]) == 2
    assert "no TPU" in capsys.readouterr().err


# ----- attribution ----------------------------------------------------------------------------

def test_attribute_splits_overlap_and_gives_gaps_to_the_next_op():
    E = traces.OpEvent
    ops = [E(0, 10, "layer_01/attention", "p"), E(5, 15, "layer_01/ffn", "p"),  # overlap 5
           E(20, 30, "head", "p"), E(30, 32, None, "p")]
    s = traces.attribute(ops, 0, 40, 0)
    ns = {k: v * 1e9 for k, v in s.scope_s.items()}
    assert ns["layer_01/attention"] == pytest.approx(7.5)
    assert ns["layer_01/ffn"] == pytest.approx(7.5)
    assert ns["head"] == pytest.approx(15.0)        # 5 ns gap before it + 10 ns
    assert s.unattributed_s * 1e9 == pytest.approx(2.0 + 8.0)  # its 2 ns + the tail after it
    assert s.busy_s * 1e9 == pytest.approx(27.0)
    assert sum(s.scope_s.values()) + s.unattributed_s == pytest.approx(s.window_s)


HLO = """HloModule jit_step, entry_computation_layout={()->f32[]}

%fused_computation.1 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} exponential(%p), metadata={op_name="jit(step)/layer_03/moe/router/exp"}
}

ENTRY %main.9 (w: f32[4,4], x: f32[1,4]) -> f32[4] {
  %w = f32[4,4]{1,0} parameter(0), metadata={op_name="weights"}
  %x = f32[1,4]{1,0} parameter(1)
  %a = f32[1,4]{1,0} add(%x, %x), metadata={op_name="jit(step)/layer_03/attention/add"}
  %dot.5 = f32[1,4]{1,0} dot(%a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %bitcast.2 = f32[4]{0} bitcast(%dot.5)
  %fusion.1 = f32[4]{0} fusion(%bitcast.2), kind=kLoop, calls=%fused_computation.1
  ROOT %h = f32[4]{0} negate(%fusion.1), metadata={op_name="jit(step)/head/neg"}
}
"""


def test_hlo_scopes_from_metadata_calls_and_dataflow():
    s = traces.hlo_scopes(HLO)
    assert s["a"] == "layer_03/attention"
    assert s["fusion.1"] == "layer_03/moe"          # from the computation it calls
    assert s["dot.5"] == "layer_03/attention"       # no metadata: from its operand
    assert s["h"] == "head"
    assert "w" not in s or s["w"] == "layer_03/attention"  # a parameter takes its users' scope


def test_hlo_scopes_through_a_call_chain_deeper_than_the_interpreter_stack():
    """20,000 computations each calling the next, the innermost with a scope: the outermost
    fusion takes it (no recursion limit, nothing printed)."""
    n = 20_000
    comps = [f"%c{i} (p: f32[4]) -> f32[4] {{\n  ROOT %r{i} = f32[4]{{0}} fusion(%p), kind=kLoop, calls=%c{i + 1}\n}}"
             for i in range(n)]
    comps.append(f'%c{n} (p: f32[4]) -> f32[4] {{\n  ROOT %r{n} = f32[4]{{0}} negate(%p), '
                 f'metadata={{op_name="jit(step)/layer_02/moe/neg"}}\n}}')
    text = "\n".join(comps) + "\nENTRY %main (x: f32[4]) -> f32[4] {\n  ROOT %top = f32[4]{0} fusion(%x), calls=%c0\n}\n"
    assert traces.hlo_scopes(text)["top"] == "layer_02/moe"


@pytest.mark.parametrize("text,scope", [
    ("jit(_decode_step_jit)/layer_07/moe/experts/dot_general", ("layer_07/moe", 7, "moe")),
    ("jit(embed)/embed/take", ("embed", None, "embed")),
    ("jit(head)/head/argmax", ("head", None, "head")),
    ("jit(step)/heads/softmax", None), ("cache['kda_state']", None)])
def test_scope_of(text, scope):
    assert traces.scope_of(text) == scope


# ----- bad files ------------------------------------------------------------------------------

def test_empty_corrupt_truncated_and_foreign_files(tmp_path):
    good = write_xspace(tmp_path / "good.xplane.pb", xspace_text([MINI_STEP], 30.0)).read_bytes()
    cases = {"empty": b"", "corrupt": b"\x00garbage\xff" * 20, "truncated": good[: len(good) // 2]}
    for name, data in cases.items():
        f = tmp_path / f"{name}.xplane.pb"
        f.write_bytes(data)
        with pytest.raises(SpecError, match="empty|corrupt|truncated"):
            traces.parse_trace(f)
    foreign = 'planes { id: 1 name: "/host:CPU" lines { id: 1 name: "python" events { ' \
              'metadata_id: 1 offset_ps: 0 duration_ps: 10 } } event_metadata { key: 1 value ' \
              '{ id: 1 name: "$train.py:3 fit" } } }'
    with pytest.raises(SpecError, match="no XLA op or named-scope events"):
        traces.parse_trace(write_xspace(tmp_path / "foreign.xplane.pb", foreign))
    (tmp_path / "no-trace").mkdir()
    with pytest.raises(SpecError, match="no .xplane.pb"):
        traces.parse_trace(tmp_path / "no-trace")


def test_validate_cli_errors(tmp_path, capsys):
    assert main(["validate", "--trace", str(tmp_path / "missing")]) == 2
    assert "no such file" in capsys.readouterr().err
    f = tmp_path / "bad.xplane.pb"
    f.write_bytes(b"junk")
    assert main(["validate", "--trace", str(f), "--model", "kimi-k3-mini", "--hardware",
                 "tpu-v7", "--batch", "1", "--context", "8", "--mode", "compiled"]) == 2
    assert "corrupt" in capsys.readouterr().err


# ----- real CPU traces, recorded here -------------------------------------------------------------

@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    runs = capture.capture_reference("kimi-k3-host-small", out, batches=(2,), contexts=(16,),
                                     steps=3)
    return out, runs


@pytest.mark.slow  # a real capture: about 30 s on 2 cores
def test_recorded_cpu_traces_attribute_95_percent(recorded):
    out, runs = recorded
    assert [r.name for r in runs] == ["kimi-k3-host-small_b2_c16_compiled",
                                      "kimi-k3-host-small_b2_c16_op_by_op"]
    for r in runs:
        meta = json.loads((r / "capture.json").read_text())
        assert meta["batch"] == 2 and meta["steps"] == 3 and len(meta["host_step_s"]) == 3 * capture.UNTRACED_STEPS_PER_STEP
        t = traces.parse_trace(r)
        print(f"{r.name}: unattributed share {t.unattributed_share:.3%}")
        assert t.unattributed_share <= 0.05
        assert len(t.steps) == 3 and t.n_layers == 4
        assert set(range(1, 6)) <= set(t.layer_s)  # every layer and the head
        for s in t.steps:  # per-layer times (gaps included) add up to the step window
            assert sum(s.scope_s.values()) + s.unattributed_s == pytest.approx(s.window_s, rel=1e-6)
    (hlo,) = out.glob("hlo_*")
    assert all(f.name.endswith(traces.HLO_SUFFIX) for f in hlo.iterdir())


@pytest.mark.slow  # a real capture: about 30 s on 2 cores
def test_validate_on_recorded_traces(recorded, tmp_path, capsys):
    out, _ = recorded
    from perfmodel_jax import hostbench
    hw = tmp_path / "host.toml"
    hostbench.write(bench(), hw)
    assert main(["validate", "--trace", str(out), "--hardware", str(hw), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["summary"]["runs"] == 2 and len(res["summary"]["gaps"]) == 1
    for c in res["results"]:
        assert [r["layer"] for r in c["layers"]] == list(range(6))
        assert c["measured_step_s"] > 0 and c["predicted_step_s"] > 0
    assert main(["validate", "--trace", str(out), "--hardware", str(hw),
                 "--matched-efficiency"]) == 0
    assert "median |step error|" in capsys.readouterr().out


def test_validate_cli_on_a_constructed_tpu_trace(tmp_path, capsys):
    f = write_xspace(tmp_path / "tpu.xplane.pb", xspace_text([MINI_STEP] * 2, step_us=30.0))
    assert main(["validate", "--trace", str(f), "--model", "kimi-k3-mini", "--hardware", "tpu-v7",
                 "--batch", "1", "--context", "32", "--mode", "megakernel", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    (c,) = res["results"]
    assert c["mode"] == "megakernel" and c["measured_step_s"] == pytest.approx(30e-6)
    assert len(c["layers"]) == 6 and c["unattributed_share"] == pytest.approx(0.5 / 30)


def test_a_prefill_runs_capture_file_is_read(tmp_path):
    """capture.json of `perfmodel capture --modes prefill`: its prompt length and its program's
    counted structure are part of the schema (the decode fields alone otherwise)."""
    import json
    meta = {"model": "kimi-k3-host-small", "batch": 1, "context": 128, "mode": "prefill", "steps": 3,
            "host_step_s": [0.02, 0.021, 0.02], "hlo_dir": "../hlo", "weights_dtype": "f32", "machine": "x86_64",
            "jax": "0.12", "command": "perfmodel capture", "load_average_1min": 1.0, "date": "2026-12-02",
            "prompt": 128, "structure": {"host_thunks_prefill": 412.0, "host_loop_bytes_prefill": 1.5e6}}
    f = tmp_path / "capture.json"
    f.write_text(json.dumps(meta))
    assert traces.capture_meta(f)["structure"]["host_thunks_prefill"] == 412.0
    f.write_text(json.dumps(meta | {"prompts": 1}))
    with pytest.raises(SpecError, match="prompts=1: unknown key"):
        traces.capture_meta(f)


# ----- GPU traces -------------------------------------------------------------------------------

GPU_HLO = """HloModule jit_step, is_scheduled=true

%body.1 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %loop_fusion.3 = f32[4]{0} fusion(%p), kind=kLoop, calls=%f, metadata={op_name="jit(step)/layer_01/moe/experts/mul"}
}

%body.1.clone (p: f32[4]) -> f32[4] {
  %p.1 = f32[4]{0} parameter(0)
  ROOT %loop_fusion.3.clone = f32[4]{0} fusion(%p.1), kind=kLoop, calls=%f, metadata={op_name="jit(step)/layer_01/moe/experts/mul" deduplicated_name="loop_fusion.3"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %reduce_fusion.1 = f32[4]{0} fusion(%x), kind=kInput, calls=%g, metadata={op_name="jit(step)/layer_01/attention/dot_general"}
  %while.1 = f32[4]{0} while(%reduce_fusion.1), condition=%c, body=%body.1, metadata={op_name="jit(step)/layer_01/moe/experts/while"}
  %reduce_fusion.2 = f32[4]{0} fusion(%while.1), kind=kInput, calls=%g, metadata={op_name="jit(step)/layer_02/attention/dot_general" deduplicated_name="reduce_fusion.1"}
  %while.2 = f32[4]{0} while(%reduce_fusion.2), condition=%c, body=%body.1.clone, metadata={op_name="jit(step)/layer_02/moe/experts/while"}
  ROOT %head_fusion = f32[4]{0} fusion(%while.2), kind=kLoop, calls=%f, metadata={op_name="jit(step)/head/dot_general"}
}
"""

# one step as XLA:GPU runs it from command buffers (us): every kernel carries the buffer's hlo_op;
# the attention's kernel is shared by both layers (deduplicated), and so is the loop body's,
# cloned per layer with layer 1's metadata; the gaps are the GPU waiting on the host
GPU_STEP = [("reduce_fusion_1", 2.0, 3.0), ("loop_fusion_3", 6.0, 2.0), ("loop_fusion_3", 10.0, 2.0),
            ("reduce_fusion_1", 20.0, 3.0), ("loop_fusion_3", 24.0, 2.0), ("head_fusion", 30.0, 1.0)]


def gpu_xspace_text(steps: int, step_us: float = 40.0) -> str:
    meta = {"decode_step": 1, "cuLaunchKernel": 2}
    kernels, host = [], []
    for i in range(steps):
        t0 = i * step_us * 1e6  # ps
        host.append(f"events {{ metadata_id: 1 offset_ps: {t0:.0f} duration_ps: {step_us * 1e6:.0f} "
                    f"stats {{ metadata_id: 1 int64_value: {i} }} }}")
        # a launch on the host with the buffer's hlo_op: not an op of the GPU's timeline
        host.append(f"events {{ metadata_id: 2 offset_ps: {t0 + 1e6:.0f} duration_ps: {30e6:.0f} "
                    f"stats {{ metadata_id: 2 str_value: \"command_buffer_1\" }} "
                    f"stats {{ metadata_id: 3 int64_value: 7 }} }}")
        for name, start, dur in GPU_STEP:
            mid = meta.setdefault(name, len(meta) + 1)
            kernels.append(f"events {{ metadata_id: {mid} offset_ps: {t0 + start * 1e6:.0f} "
                           f"duration_ps: {dur * 1e6:.0f} stats {{ metadata_id: 2 str_value: "
                           f"\"command_buffer_1\" }} stats {{ metadata_id: 3 int64_value: 7 }} "
                           f"stats {{ metadata_id: 4 str_value: \"XlaModule:\" }} }}")
    md = "\n".join(f'event_metadata {{ key: {v} value {{ id: {v} name: "{k}" }} }}' for k, v in meta.items())
    stats = ('stat_metadata { key: 1 value { id: 1 name: "step_num" } } '
             'stat_metadata { key: 2 value { id: 2 name: "hlo_op" } } '
             'stat_metadata { key: 3 value { id: 3 name: "program_id" } } '
             'stat_metadata { key: 4 value { id: 4 name: "tf_op" } }')
    return f"""planes {{ id: 1 name: "/device:GPU:0"
  lines {{ id: 1 name: "Stream #14(Compute)" timestamp_ns: 1000 {' '.join(kernels)} }}
  {md} {stats} }}
planes {{ id: 2 name: "/host:CPU"
  lines {{ id: 1 name: "python3" timestamp_ns: 1000 {' '.join(host)} }}
  {md} {stats} }}
"""


def test_constructed_gpu_trace_kernels_by_name_and_idle_gaps(tmp_path):
    (tmp_path / "hlo").mkdir()
    (tmp_path / "hlo" / "module_0007.jit_step.sm_9.0a_gpu_after_optimizations.txt").write_text(GPU_HLO)
    write_xspace(tmp_path / "gpu.xplane.pb", gpu_xspace_text(3))
    t = traces.parse_trace(tmp_path, n_layers=2)
    assert t.platform == "gpu" and len(t.steps) == 3
    # each layer's own kernels (the shared ones placed by their neighbours), no host gap
    for layer, us in {1: 3 + 2 + 2, 2: 3 + 2, 3: 1}.items():
        assert t.layer_s[layer].median == pytest.approx(us * 1e-6), layer
    assert t.phase_s["layer_02/moe"].median == pytest.approx(2e-6)
    assert t.unattributed_share == 0
    assert t.idle_share == pytest.approx((40 - 13) / 40)  # the host launch is not GPU time
    for s in t.steps:
        assert sum(s.scope_s.values()) + s.idle_s == pytest.approx(s.window_s)


def test_recorded_h200_trace_is_attributed(h200_runs):
    """A real trace recorded on an NVIDIA H200 (the h200_runs fixture)."""
    run = h200_runs / "kimi-k3-host-small_b1_c256_compiled"
    t = traces.parse_trace(run)
    assert t.platform == "gpu" and len(t.steps) == 5 and t.n_layers == 4
    assert t.unattributed_share < 0.06  # the loops' condition copies carry no scope
    assert set(range(1, 6)) <= set(t.layer_s)
    assert 0.5 < t.idle_share < 1  # the GPU mostly waits on the host in this small step
    for s in t.steps:
        assert sum(s.scope_s.values()) + s.unattributed_s + s.idle_s == pytest.approx(s.window_s, rel=1e-6)
    from perfmodel.validate import host
    c = host.compare(t, hardware="h200")
    assert c.measured_step_s > c.traced_busy_s > 0 and c.idle_share == t.idle_share
    assert [r.layer for r in c.layers] == list(range(6))


# ----- a real TPU trace ------------------------------------------------------------------------

def test_recorded_tpu_v5e_megakernel_trace(tmp_path):
    """A trace recorded on a TPU v5e (experiments/tpu_megakernel.py --only trace: the Kimi K3
    TP32-core slice, MXFP4 experts, batch 1, five one-step calls): the kernel's in-kernel markers
    (line `XLA TraceMe`) give each step, every layer's phases and the markers nested in them; the
    traced step agrees with the step timed by slope in another call on the chip; the device ops
    outside the kernel (a relayout copy of the embedding table) are named, not counted."""
    import gzip
    f = tmp_path / "k3_b1.xplane.pb"
    f.write_bytes(gzip.decompress((ROOT / "tests" / "data" / "tpu_v5e_k3_b1.xplane.pb.gz").read_bytes()))
    t = traces.parse_trace(f, n_layers=4)
    assert t.platform == "tpu" and len(t.steps) == 5
    assert set(t.layer_s) == set(range(6))
    assert t.unattributed_share < 0.01
    assert sum(v.median for v in t.layer_s.values()) == pytest.approx(t.step_s.median, rel=0.02)
    runs = json.loads((ROOT / "experiments" / "results" / "tpu_megakernel.json").read_text())["runs"]
    slope = next(r["step_s"] for r in runs if r["kind"] == "megakernel" and r["batch"] == 1)
    assert t.step_s.median == pytest.approx(slope, rel=0.05)
    # each MoE layer's experts, router and shared expert inside its ffn phase
    for layer in (2, 3, 4):
        ffn = t.phase_s[f"layer_{layer:02d}/ffn"].median
        parts = [t.sub_phase_s[f"layer_{layer:02d}/ffn/{p}"].median for p in ("router", "experts", "shared")]
        assert 0.5 * ffn < sum(parts) <= ffn
    assert any("outside" in n for n in t.notes)


MARKERS = ROOT / "tests" / "data" / "tpu_v5e_k3_b1_markers.txt"


def markers_xspace_text(path: Path) -> str:
    """An XSpace (text proto) holding the events of a recorded trace's marker listing: sections
    `## <plane> | <line>`, then `start_us duration_us name` a row; host `decode_step` rows get
    their step number."""
    planes: dict[str, dict[str, list]] = {}
    line = None
    for row in path.read_text().splitlines():
        if row.startswith("## "):
            plane, _, name = row[3:].partition(" | ")
            line = planes.setdefault(plane, {}).setdefault(name, [])
        elif row.strip() and not row.startswith("#"):
            start, dur, name = row.split(None, 2)
            line.append((float(start), float(dur), name))
    out = []
    for pid, (plane, lines) in enumerate(planes.items(), 1):
        names = {n: i for i, n in enumerate(dict.fromkeys(n for evs in lines.values() for *_, n in evs), 1)}
        body = []
        for lid, (lname, evs) in enumerate(lines.items(), 1):
            ev = " ".join(
                f"events {{ metadata_id: {names[n]} offset_ps: {a * 1e6:.0f} duration_ps: {d * 1e6:.0f}"
                + (f" stats {{ metadata_id: 1 int64_value: {k} }}" if n == traces.STEP_NAME else "") + " }"
                for k, (a, d, n) in enumerate(evs))
            body.append(f'lines {{ id: {lid} name: "{lname}" timestamp_ns: 0 {ev} }}')
        md = " ".join(f'event_metadata {{ key: {i} value {{ id: {i} name: {json.dumps(n)} }} }}'
                      for n, i in names.items())
        out.append(f'planes {{ id: {pid} name: "{plane}" {" ".join(body)} {md} '
                   f'stat_metadata {{ key: 1 value {{ id: 1 name: "step_num" }} }} }}')
    return "\n".join(out)


def test_recorded_tpu_v5e_markers_after_the_embedding_fix(tmp_path):
    """The markers of a trace recorded on a TPU v5e after the kernel waited for its embedding rows
    before starting the ring (Kimi K3 TP32-core, MXFP4, batch 1, five one-step calls): the host's
    step annotations and the device's clock are 0.1 ms apart, the steps are the device's program runs;
    the embed phase is 5.5 us (27.8 us before the fix); the committed run's phases are this parse."""
    f = write_xspace(tmp_path / "k3_b1.xplane.pb", markers_xspace_text(MARKERS))
    t = traces.parse_trace(f, n_layers=4)
    assert len(t.steps) == 5 and set(t.layer_s) == set(range(6))
    assert t.phase_s["embed"].median == pytest.approx(5.5e-6, abs=0.1e-6)
    assert sum(v.median for v in t.layer_s.values()) == pytest.approx(t.step_s.median, rel=0.01)
    runs = json.loads((ROOT / "experiments" / "results" / "tpu_megakernel.json").read_text())["runs"]
    rec = next(r for r in runs if r["kind"] == "trace" and r.get("commit") == "acf1eae" and r["batch"] == 1)
    assert rec["step_s"] == pytest.approx(t.step_s.median, rel=1e-9)
    assert rec["phases_s"] == pytest.approx({k: v.median for k, v in t.phase_s.items()}, rel=1e-9)


def test_recorded_tpu_v5e_batch4_trace_is_its_committed_record(tmp_path):
    """The current kernel traced on a TPU v5e at batch 4 (Kimi K3 TP32-core, MXFP4, five one-step
    calls, commit b3e89de; experiments/results/tpu_v5e/k3-tp32-core_mxfp4_b4.xplane.pb.gz): the
    committed record's step, layers and phases are this parse, and each KDA layer's attention
    holds its wait for the state."""
    import gzip
    f = tmp_path / "k3_b4.xplane.pb"
    f.write_bytes(gzip.decompress((ROOT / "experiments/results/tpu_v5e/k3-tp32-core_mxfp4_b4.xplane.pb.gz")
                                  .read_bytes()))
    t = traces.parse_trace(f, n_layers=4)
    assert t.platform == "tpu" and len(t.steps) == 5 and set(t.layer_s) == set(range(6))
    runs = json.loads((ROOT / "experiments" / "results" / "tpu_megakernel.json").read_text())["runs"]
    rec = next(r for r in runs if r["kind"] == "trace" and r.get("commit") == "b3e89de" and r["batch"] == 4)
    assert rec["step_s"] == pytest.approx(t.step_s.median, rel=1e-9)
    assert rec["phases_s"] == pytest.approx({k: v.median for k, v in t.phase_s.items()}, rel=1e-9)
    assert rec["layers_s"] == pytest.approx({str(k): v.median for k, v in t.layer_s.items()}, rel=1e-9)
    for layer in (1, 2, 3):
        assert 30e-6 < t.sub_phase_s[f"layer_{layer:02d}/attention/state_wait"].median < 50e-6


def test_recorded_tpu_v5e_xla_trace_op_table(tmp_path):
    """The XLA reference traced on a TPU v5e (tpu_megakernel.py --only xla_trace, batch 64, three
    one-step calls): op_table names each op from its event (this libtpu puts the HLO text in the
    name), the step's while loop first, then the three MoE layers' expert loops, whose trips run
    once per distinct expert the step picked."""
    import gzip
    f = tmp_path / "xla_b64.xplane.pb"
    f.write_bytes(gzip.decompress((ROOT / "experiments" / "results" / "tpu_v5e" /
                                   "xla_k3-tp32-core_mxfp4_b64.xplane.pb.gz").read_bytes()))
    ops = traces.op_table(f, top=20)
    assert ops[0].name.startswith("while") and ops[0].count == 3
    loops = [o for o in ops[1:4] if o.name.startswith("while")]
    assert len(loops) == 3 and all("bf16[112,3584,1536]" in o.hlo for o in loops)
    # each loop's gate|up dot (the stacked experts' dynamic slice fused in) runs once a trip
    runs = json.loads((ROOT / "experiments" / "results" / "tpu_megakernel.json").read_text())["runs"]
    picked = next(r["distinct_experts"] for r in runs if r["kind"] == "xla_trace" and r["batch"] == 64)
    gate_up = [o for o in ops if o.name.startswith("fusion") and "f32[64,1536]" in o.hlo
               and "bf16[112,3584,1536]" in o.hlo]
    assert len(gate_up) == 3
    trips = sum(o.count for o in gate_up) / 3   # a step (routing moves a little from step to step)
    assert trips == pytest.approx(sum(picked), rel=0.1)
    assert sum(o.total_s for o in loops) < ops[0].total_s


def test_recorded_tpu_v5e_xla_trace_per_layer(tmp_path):
    """The batch-64 XLA trace read per layer with the program's HLO compiled ahead of time for a
    v5e by the chip's libtpu (experiments/xla_reference_hlo.py): the instruction names match the
    trace's, every layer gets its ops, a step's ops sum to the step timed by slope on the chip
    (within 5 %: the gaps between ops are not counted), the MLA layer carries the two copies of
    its 151 MB latent cache (over 1 ms more than a KDA layer), and the loop's copies of the cache
    in and out come once a call, apart."""
    import gzip
    res = ROOT / "experiments" / "results"
    f = tmp_path / "xla_b64.xplane.pb"
    f.write_bytes(gzip.decompress((res / "tpu_v5e" / "xla_k3-tp32-core_mxfp4_b64.xplane.pb.gz").read_bytes()))
    hlo = gzip.decompress((res / "tpu_v5e" / "xla_k3-tp32-core_b64.hlo.txt.gz").read_bytes()).decode()
    layers, per_call, steps = traces.xla_layer_times(f, hlo, n_layers=4)
    assert steps == 3 and set(layers) == set(range(6))
    runs = json.loads((res / "tpu_megakernel.json").read_text())["runs"]
    slope = next(r["step_s"] for r in runs if r["kind"] == "xla" and r["batch"] == 64 and r["format"] == "mxfp4")
    assert sum(layers.values()) == pytest.approx(slope, rel=0.05)
    assert layers[4] - layers[3] > 1e-3
    assert per_call > 0.8e-3


def test_parse_trace_reads_hlo_named_ops_with_the_one_module_given(tmp_path):
    """parse_trace with the AOT-compiled module as its HLO dump: the ops named by their HLO text
    take their instruction's scope (loops left out), so nearly nothing is unattributed."""
    import gzip
    res = ROOT / "experiments" / "results" / "tpu_v5e"
    f = tmp_path / "xla_b8.xplane.pb"
    f.write_bytes(gzip.decompress((res / "xla_k3-tp32-core_mxfp4_b8.xplane.pb.gz").read_bytes()))
    hlo = tmp_path / "hlo"
    hlo.mkdir()
    (hlo / f"module_0001.jit_loop{traces.HLO_SUFFIX}").write_bytes(
        gzip.decompress((res / "xla_k3-tp32-core_b8.hlo.txt.gz").read_bytes()))
    t = traces.parse_trace(f, hlo_dir=hlo, n_layers=4)
    assert len(t.steps) == 3 and set(t.layer_s) == set(range(6))
    assert t.unattributed_share < 0.01
