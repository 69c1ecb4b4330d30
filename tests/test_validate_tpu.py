"""experiments/validate_tpu.py on small synthetic results files (kimi-k3-mini on the tpu-v5e preset; no
TPU): device time, layers and phases from a trace, XLA steps, speed-ups, the tolerances, the exit status
and both result files."""
import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
ROOT = Path(__file__).resolve().parents[1]
CFG = dict(batch=2, max_context=256, depth=4, tile=128, expert_slots=2, cache_block=256, hierarchical=False,
           rows=1, bank_rows=1024, host_devices=0, wire="f32", chip="v5e")
MK = {"kind": "megakernel", "slice": "kimi-k3-mini", "format": "bf16", "batch": 2, "config": CFG,
      "positions": [100, 120], "distinct_experts": [4, 4, 3], "plan_bytes": 1}
HEADER = {"machine": "TPU v5 lite", "chip": "v5e", "jax": "0.10.2", "libtpu": "0.0.42.1", "python": "3.11.7",
          "date": "2026-12-06T00:00:00+00:00", "command": "synthetic (tests/test_validate_tpu.py)"}


@pytest.fixture(scope="module")
def vt():
    sys.path.insert(0, str(ROOT / "experiments"))  # its sibling validation_report
    spec = importlib.util.spec_from_file_location("validate_tpu", ROOT / "experiments" / "validate_tpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def predicted(vt):
    """The model's own figures for MK and its XLA twin: measuring exactly them is a perfect run."""
    spec, hw, p, phases, t0, _ = vt.predict_megakernel(dict(MK, step_s=1.0), "tpu-v5e")
    device, wall = vt.predict_xla({"slice": "kimi-k3-mini", "batch": 2}, 120, "tpu-v5e")
    return {"p": p, "phases": phases, "t0": t0, "xla": device, "xla_wall": wall, "n": len(spec.layers)}


def results(predicted, step=1.0, layer2=1.0, xla=1.0, trace_apart=False):
    """A results file measuring the predictions times the factors given: the megakernel's step_s
    (`step`), its layer 2 and phase layer_02/attention in the trace (`layer2`), the XLA step (`xla`).
    The trace splits layer_02/ffn into it and a nested marker, as the kernel's named scopes do."""
    p, phases = predicted["p"], dict(predicted["phases"])
    d = phases["layer_02/attention"] * (layer2 - 1)
    phases["layer_02/attention"] += d
    ffn = phases.pop("layer_02/ffn")
    phases |= {"layer_02/ffn": 0.25 * ffn, "layer_02/ffn/experts": 0.75 * ffn}
    trace = {"step_s": p.step_s + d, "phases_s": phases,
             "layers_s": {str(r.layer): r.time_s + (d if r.layer == 2 else 0.0) for r in p.layers}}
    mk = dict(MK, step_s=p.step_s * step, wall_step_s=p.step_s + predicted["t0"],
              trace=None if trace_apart else trace)
    runs = [mk, {"kind": "xla", "slice": "kimi-k3-mini", "format": "bf16", "batch": 2, "cache_tokens": 120,
                 "step_s": predicted["xla"] * xla, "wall_step_s": predicted["xla_wall"]},
            {"kind": "packing", "slice": "kimi-k3-mini", "format": "bf16", "init_s": 1.0, "pack_s": 1.0}]
    if trace_apart:  # the producer's separate trace record
        runs.append({"kind": "trace", "slice": "kimi-k3-mini", "format": "bf16", "batch": 2, "config": CFG,
                     "unattributed_share": 0.0, **trace})
    return dict(HEADER, runs=runs)


def run(vt, tmp_path, doc, capsys):
    f = tmp_path / "tpu_megakernel.json"
    f.write_text(json.dumps(doc))
    rc = vt.main(["--results", str(f), "--out", str(tmp_path)])
    return rc, capsys.readouterr()


def test_a_run_measured_as_predicted_meets_every_tolerance(vt, predicted, tmp_path, capsys):
    rc, out = run(vt, tmp_path, results(predicted, xla=1.08), capsys)
    assert rc == 0, out.out[-3000:]
    last = out.out.strip().splitlines()[-1]
    assert last.startswith("validate_tpu: 2 runs (1 megakernel, 1 traced; 1 XLA)") and last.endswith("tolerances met")
    assert "XLA median |error| 7.4%" in last  # 1 / 1.08 - 1
    doc = json.loads((tmp_path / "tpu_validation.json").read_text())
    s = doc["summary"]
    assert s["median_abs_layer_error"] == pytest.approx(0, abs=1e-9) and s["max_abs_phase_error"] < 1e-9
    r = doc["runs"][0]
    # the trace's nested marker summed into its scope; every scope of the model's step compared
    assert {x["scope"] for x in r["phases"]} == {"embed", "head"} | {
        f"layer_{i:02d}/{ph}" for i in range(1, predicted["n"] + 1) for ph in ("attention", "ffn")}
    assert r["comparison"]["measured_step_s"] == pytest.approx(predicted["p"].step_s)
    assert r["wall_error"] == pytest.approx(0, abs=1e-9)
    (u,) = doc["speedups"]
    assert u["predicted"] == pytest.approx(predicted["xla"] / predicted["p"].step_s)
    assert u["measured"] == pytest.approx(1.08 * u["predicted"])
    assert doc["meta"]["machine"] == "TPU v5 lite" and doc["meta"]["hardware_file"] == "tpu-v5e"
    lines = (tmp_path / "tpu_validation.csv").read_text().splitlines()
    assert lines[0].startswith("# machine: TPU v5 lite")
    for what in (",step,step,", ",step_traced,step,", ",layer_02/ffn,phase,", ",wall,one-step call,",
                 ",speedup,xla_over_megakernel,"):
        assert any(what in line for line in lines), what
    assert "not compared (no prediction of them): records of kind packing" in out.out


@pytest.mark.parametrize("factors, missed", [
    ({"layer2": 1.12}, "a layer or phase at"),      # layer 2 and its attention 12 % slower than predicted
    ({"step": 1.06}, "a step at"),                  # the untraced step 6 % slower
    ({"xla": 0.85}, "an XLA step at"),              # the XLA step 15 % faster
])
def test_a_missed_tolerance_exits_1_and_says_which(vt, predicted, tmp_path, capsys, factors, missed):
    rc, out = run(vt, tmp_path, results(predicted, **factors), capsys)
    last = out.out.strip().splitlines()[-1]
    assert rc == 1 and "MISSED: " in last and missed in last and last.count("\n") == 0


def test_a_separate_trace_record_is_the_runs_trace(vt, predicted, tmp_path, capsys):
    rc, out = run(vt, tmp_path, results(predicted, trace_apart=True), capsys)
    assert rc == 0 and "1 traced" in out.out.strip().splitlines()[-1]


def test_device_time_is_the_prediction_without_host_dispatch(vt, predicted):
    """The dispatch shifts the whole predicted timeline: taking it out of the step and the embedding
    layer is predicting with no dispatch at all."""
    from perfmodel_kernels import plan as kplan
    from perfmodel_kernels.layout import KernelConfig
    from perfmodel_kernels.specs import slice_spec
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.step.predict import plan_deployment, predict
    spec, cfg = slice_spec("kimi-k3-mini", "bf16"), KernelConfig(**CFG)
    the_plan = kplan.dma_plan(spec, cfg, MK["distinct_experts"], MK["positions"])
    kp = kplan.as_kernel_plan(spec, spec, cfg, the_plan, 120)
    hw = load_hardware("tpu-v5e")
    assert predicted["t0"] == hw.components["host_dispatch_s"]
    bare = predict(spec, hw.with_components(host_dispatch_s=0.0), plan_deployment(kp), plan=kp)
    p = predicted["p"]
    assert p.step_s == pytest.approx(bare.step_s, rel=1e-9)
    assert [r.time_s for r in p.layers] == pytest.approx([r.time_s for r in bare.layers], rel=1e-9, abs=1e-15)
    assert sum(predicted["phases"].values()) == pytest.approx(sum(r.time_s for r in p.layers), rel=1e-9)


def test_bad_or_missing_results_exit_2_with_one_line(vt, predicted, tmp_path, capsys):
    rc, out = run(vt, tmp_path, {"machine": "x", "runs": []}, capsys)
    assert rc == 2 and "date" in out.err and len(out.err.strip().splitlines()) == 1
    doc = results(predicted)
    doc["runs"][0]["step_s"] = -1.0
    rc, out = run(vt, tmp_path, doc, capsys)
    assert rc == 2 and "runs[0].step_s" in out.err
    assert vt.main(["--results", str(tmp_path / "none.json")]) == 2
    assert "tpu_megakernel.py on a TPU" in capsys.readouterr().err


def test_a_run_the_model_cannot_predict_is_listed_and_missed(vt, predicted, tmp_path, capsys):
    doc = copy.deepcopy(results(predicted))
    doc["runs"][0]["distinct_experts"] = [4, 4]  # one count short of the MoE layers
    rc, out = run(vt, tmp_path, doc, capsys)
    assert rc == 1 and "not predicted: kimi-k3-mini bf16 b2" in out.out
    assert "1 run(s) not predicted" in out.out.strip().splitlines()[-1]


def test_the_depth_sweep_is_judged_on_its_optimum_and_gain(vt, predicted, tmp_path, capsys):
    """Depth sweep points measured as the model predicts them: the optimum and the gain from the
    shallowest ring agree; the same points with the deepest measured slower move the optimum."""
    doc = results(predicted)
    mk = doc["runs"][0]
    for depth in (1, 2, 8):
        cfg = dict(mk["config"], depth=depth)
        p = vt.predict_megakernel(dict(mk, config=cfg), "tpu-v5e")[2]
        doc["runs"].append(dict(mk, config=cfg, sweep=True, trace=None, step_s=p.step_s))
    rc, out = run(vt, tmp_path, doc, capsys)
    assert "what-if on the chip: depth at batch 2" in out.out
    w, = json.loads((tmp_path / "tpu_validation.json").read_text())["whatif"]
    assert w["values"] == [1, 2, 4, 8] and w["predicted_s"][0] > w["predicted_s"][-1]
    assert w["predicted_best"] == w["measured_best"] and w["gain_error"] == pytest.approx(0, abs=1e-9)
    assert rc == 0, out.out[-2000:]
    slow = copy.deepcopy(doc)
    best = w["predicted_best"]
    for r in slow["runs"]:
        if r["kind"] == "megakernel" and r["config"]["depth"] == best:
            r["step_s"] *= 1.5
    rc, out = run(vt, tmp_path, slow, capsys)
    assert rc == 1 and f"the best depth at batch 2 (kimi-k3-mini bf16; expert_slots 2, bank_rows 1024) " \
        f"predicted {best}" in out.out


def test_a_sweep_holds_the_kernels_code(vt, predicted, tmp_path, capsys):
    """Points run by other kernel code (another `kernel_source`) are not one sweep: each code's
    runs make their own family, named by the commits they ran at."""
    doc = results(predicted)
    mk = doc["runs"][0]
    for depth, source, commit in ((1, "aaaa", "c1"), (8, "aaaa", "c1"), (1, "bbbb", "c2"), (8, "bbbb", "c2")):
        cfg = dict(mk["config"], depth=depth)
        p = vt.predict_megakernel(dict(mk, config=cfg), "tpu-v5e")[2]
        doc["runs"].append(dict(mk, config=cfg, sweep=True, trace=None, step_s=p.step_s, kernel_source=source,
                                commit=commit))
    rc, out = run(vt, tmp_path, doc, capsys)
    ws = json.loads((tmp_path / "tpu_validation.json").read_text())["whatif"]
    assert sorted((w["kernel_source"], w["values"], w["commits"]) for w in ws) == [
        ("aaaa", [1, 8], ["c1"]), ("bbbb", [1, 8], ["c2"])]
    assert "run at c1)" in out.out and "run at c2)" in out.out


def test_a_sweep_point_run_twice_is_judged_on_its_median_and_shows_its_range(vt, predicted, tmp_path, capsys):
    """A sweep point measured in two calls: its median is what the optimum and the gain use, and
    the comparison reports its runs, their range and the largest spread of a point's runs."""
    doc = results(predicted)
    mk = doc["runs"][0]
    steps = {}
    for depth in (1, 8):
        cfg = dict(mk["config"], depth=depth)
        steps[depth] = vt.predict_megakernel(dict(mk, config=cfg), "tpu-v5e")[2].step_s
        doc["runs"].append(dict(mk, config=cfg, sweep=True, trace=None, step_s=steps[depth]))
    cfg = dict(mk["config"], depth=8)
    doc["runs"].append(dict(mk, config=cfg, sweep=True, trace=None, step_s=steps[8] * 1.04))  # a second call
    rc, out = run(vt, tmp_path, doc, capsys)
    w, = json.loads((tmp_path / "tpu_validation.json").read_text())["whatif"]
    i = w["values"].index(8)
    assert w["runs_per_point"]["8"] == 2 and w["measured_range_s"][i] == pytest.approx([steps[8], steps[8] * 1.04])
    assert w["measured_s"][i] == pytest.approx(steps[8] * 1.02)   # the median of the two
    assert w["repeat_spread"] == pytest.approx(0.04)
    assert "spread up to 4.0%" in out.out


def test_a_run_is_predicted_with_the_decode_its_kernel_ran(vt):
    """A run records its routed-expert decode; one recorded before it did (all decoded e2m1 in
    f32) is predicted with the f32 decode (its own cost a weight; no pass cost measured for it),
    not the word decode it now runs."""
    mk = dict(MK, format="mxfp4", step_s=1.0)
    now = vt.predict_megakernel(dict(mk, expert_decode="e2m1_words"), "tpu-v5e")[2].step_s
    before = vt.predict_megakernel(mk, "tpu-v5e")[2].step_s
    from perfmodel_kernels.layout import KernelConfig
    from perfmodel_kernels.specs import slice_spec
    cfg = KernelConfig(**CFG)
    assert vt.run_decode(mk, slice_spec("kimi-k3-mini", "mxfp4"), cfg) == "e2m1"
    assert vt.run_decode(mk, slice_spec("kimi-k3-mini", "int8"), cfg) == "int8"
    assert vt.run_decode(dict(mk, expert_decode="e2m1_words"), slice_spec("kimi-k3-mini", "mxfp4"), cfg) \
        == "e2m1_words"
    assert vt.predict_megakernel(dict(mk, expert_decode="e2m1"), "tpu-v5e")[2].step_s == before
    assert now != pytest.approx(before, rel=1e-4)


def test_a_trace_is_predicted_with_its_own_steps_expert_picks(vt, predicted, tmp_path, capsys):
    """The traced steps run other tokens than the speed run: a trace keeping each step's distinct
    experts is predicted with their median per layer, the untraced step with the run's own."""
    picks = [1, 1, 1]   # fewer experts than MK's [4, 4, 3]: their layers take less time
    _, _, pt, phases, _, markers = vt.predict_megakernel(dict(MK, step_s=1.0, distinct_experts=picks), "tpu-v5e")
    trace = {"step_s": pt.step_s, "phases_s": phases, "layers_s": {str(r.layer): r.time_s for r in pt.layers},
             "distinct_experts_steps": [picks, [1, 2, 1], picks],
             "sub_phases_s": {**markers, "layer_01/attention/norm": 1e-6}}   # in no marked group
    for k in [k for k in markers if k.endswith("/projections")]:   # the kernel's markers of them, summed
        proj, scope = trace["sub_phases_s"].pop(k), k.rpartition("/")[0]
        trace["sub_phases_s"].update({f"{scope}/q_proj": proj - 1e-7, f"{scope}/decay": 1e-7})
    doc = results(predicted)
    doc["runs"][0]["trace"] = trace
    rc, out = run(vt, tmp_path, doc, capsys)
    assert rc == 0, out.out[-3000:]
    r = json.loads((tmp_path / "tpu_validation.json").read_text())["runs"][0]
    assert r["traced_picks"] == picks and r["traced_step_error"] == pytest.approx(0, abs=1e-9)
    assert max(abs(x["rel_error"]) for x in r["phases"]) < 1e-9
    # the marked ops (the KDA projections, recurrence, the MoE's router, experts...) reported
    # beside the phases, not judged
    assert sorted(x["scope"] for x in r["markers"]) == sorted(markers)
    assert {"layer_01/attention/recurrence", "layer_01/attention/projections", "layer_02/ffn/experts"} <= set(markers)
    assert max(abs(x["rel_error"]) for x in r["markers"]) < 1e-9 and "recurrence (not judged)" in out.out
    assert r["comparison"]["step_error"] == pytest.approx(0, abs=1e-9)   # the speed run's picks
    assert "predicted with its own steps' expert picks [1, 1, 1]" in out.out
    doc["runs"][0]["trace"] = {k: v for k, v in trace.items() if k != "distinct_experts_steps"}  # as before
    rc, out = run(vt, tmp_path, doc, capsys)
    r = json.loads((tmp_path / "tpu_validation.json").read_text())["runs"][0]
    assert rc == 1 and r["traced_picks"] is None and abs(r["traced_step_error"]) > 0.01


def test_a_trace_without_a_run_of_its_kernel_is_predicted_on_its_own(vt, predicted, tmp_path, capsys):
    """A trace that records its positions, decode and picks and has no speed run of its commit (or
    only one with another decode) is a run of its own, its traced step the measured one; it sets no
    speed-up. One without those fields still goes to a run of another commit, as before."""
    picks = [1, 1, 1]
    _, _, pt, phases, _, _ = vt.predict_megakernel(dict(MK, step_s=1.0, distinct_experts=picks,
                                                     positions=[100, 100]), "tpu-v5e")
    trace = {"kind": "trace", "slice": "kimi-k3-mini", "format": "bf16", "batch": 2, "config": CFG,
             "commit": "new", "step_s": pt.step_s, "phases_s": phases,
             "layers_s": {str(r.layer): r.time_s for r in pt.layers},
             "distinct_experts_steps": [picks, picks], "positions": [100, 100], "expert_decode": "other"}
    doc = results(predicted, trace_apart=True)
    doc["runs"][0]["commit"] = "old"
    doc["runs"] = [r for r in doc["runs"] if r["kind"] != "trace"] + [trace]
    rc, out = run(vt, tmp_path, doc, capsys)
    assert rc == 0, out.out[-3000:]
    runs = json.loads((tmp_path / "tpu_validation.json").read_text())["runs"]
    assert [r["trace_only"] for r in runs] == [False, True] and not runs[0]["traced"]
    alone = runs[1]
    assert alone["run"].endswith("(trace alone)") and alone["traced_picks"] == picks
    assert abs(alone["traced_step_error"]) < 1e-9 and max(abs(x["rel_error"]) for x in alone["phases"]) < 1e-9
    assert alone["measured_wall_s"] is None
    ups = json.loads((tmp_path / "tpu_validation.json").read_text())["speedups"]
    assert len(ups) == 1   # from the speed run, not the trace's fewer experts
    assert ups[0]["measured"] == pytest.approx(predicted["xla"] / predicted["p"].step_s)
    old = {k: v for k, v in trace.items() if k not in ("positions", "expert_decode")}
    doc["runs"][-1] = old
    rc, out = run(vt, tmp_path, doc, capsys)
    runs = json.loads((tmp_path / "tpu_validation.json").read_text())["runs"]
    assert len(runs) == 1 and runs[0]["traced"], out.out[-2000:]


def test_a_near_tie_within_the_chips_spread_is_not_a_miss(vt, predicted, tmp_path, capsys):
    """Sweep families are the runs that vary one knob with the others held, one family per held
    value. A predicted best measured within the chip's spread of a point's runs (the median over
    points run twice) of the measured best is a tie, and a gain under that spread is not judged;
    beyond the spread the miss stands."""
    doc = results(predicted)
    mk = doc["runs"][0]
    steps = {}
    for depth in (1, 4, 8):
        cfg = dict(mk["config"], depth=depth)
        steps[depth] = vt.predict_megakernel(dict(mk, config=cfg), "tpu-v5e")[2].step_s
    best = min(steps, key=steps.get)
    other = 8 if best == 4 else 4
    assert steps[1] > steps[best]   # the shallow ring is slower: a gain to judge

    def sweep(measured_other):
        d = copy.deepcopy(doc)
        for depth, t in steps.items():   # depth 4 is the speed run's (MK's), the others sweep points
            t = steps[best] * measured_other if depth == other else t
            if depth == mk["config"]["depth"]:
                d["runs"][0]["step_s"] = t
            else:
                d["runs"].append(dict(mk, config=dict(mk["config"], depth=depth), sweep=True, trace=None, step_s=t))
        d["runs"].append(dict(mk, config=dict(mk["config"], depth=1), sweep=True, trace=None,
                              step_s=steps[1] * 1.02))   # point 1 run twice: the chip's spread is 2 %
        d["runs"].append(dict(mk, config=dict(mk["config"], depth=1, expert_slots=1), sweep=True,
                              trace=None, step_s=1.0))   # another family (slots 1): not this one's point
        return d
    rc, out = run(vt, tmp_path, sweep(0.99), capsys)   # the other depth measured 1 % faster: a tie
    ws = [w for w in json.loads((tmp_path / "tpu_validation.json").read_text())["whatif"] if w["knob"] == "depth"]
    w, = [w for w in ws if w["others"]["expert_slots"] == 2]
    assert w["chip_spread"] == pytest.approx(0.02) and w["measured_best"] == other and w["best_found"]
    assert "a tie within the spread" in out.out and "the best depth" not in out.out.splitlines()[-1]
    rc, out = run(vt, tmp_path, sweep(0.95), capsys)   # 5 % faster: beyond the spread
    assert "the best depth at batch 2" in out.out.splitlines()[-1] and rc == 1


def test_a_run_keeping_each_steps_picks_is_predicted_as_their_mean(vt, predicted, tmp_path, capsys):
    """A speed run's time per step is the mean over the steps its slope spans, each with its own
    distinct experts: predicted as the mean of the predictions at each step's picks (each distinct
    picks once), not at its last step's; the XLA reference's alike. A run without them is
    predicted at its last step's picks, as before."""
    steps = [[1, 1, 1], [2, 3, 2], [1, 1, 1], [4, 4, 3]]   # the last MK's: its trace's picks
    at = {tuple(s): vt.predict_megakernel(dict(MK, step_s=1.0, distinct_experts=s), "tpu-v5e")[2].step_s
          for s in steps}
    mean = sum(at[tuple(s)] for s in steps) / len(steps)
    assert len(set(at.values())) == 3   # the picks move the step: the mean is not any one of them
    doc = results(predicted)
    doc["runs"][0] |= {"step_s": mean, "distinct_experts": steps[-1], "distinct_experts_steps": steps}
    import perfmodel
    from perfmodel_kernels.specs import slice_spec
    hw = perfmodel.load_hardware("tpu-v5e")
    d = perfmodel.Deployment(devices=1, tp=1, engine="multikernel", batch=2, context=120)
    xla = sum(perfmodel.predict(slice_spec("kimi-k3-mini", "bf16"), hw, d, experts=s).step_s
              for s in steps) / len(steps) - vt.dispatch_s(hw, d)
    doc["runs"][1] |= {"step_s": xla, "distinct_experts": steps[-1], "distinct_experts_steps": steps}
    rc, out = run(vt, tmp_path, doc, capsys)
    assert rc == 0, out.out[-3000:]
    res = json.loads((tmp_path / "tpu_validation.json").read_text())
    assert res["runs"][0]["comparison"]["step_error"] == pytest.approx(0, abs=1e-9)
    assert res["xla"][0]["step_error"] == pytest.approx(0, abs=1e-9)
    del doc["runs"][0]["distinct_experts_steps"]   # the last step's picks alone: predicted at those
    rc, out = run(vt, tmp_path, doc, capsys)
    r = json.loads((tmp_path / "tpu_validation.json").read_text())["runs"][0]
    assert r["comparison"]["step_error"] == pytest.approx(at[(4, 4, 3)] / mean - 1, abs=1e-9)
