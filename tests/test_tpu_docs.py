"""The figures docs/tpu.md quotes from the committed TPU v5e runs
(experiments/results/tpu_megakernel.json) are the ones the file holds, so prose cannot drift
from a re-run."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tpu_status_quotes_the_committed_runs():
    text = " ".join((ROOT / "docs" / "tpu.md").read_text().split())   # line breaks as spaces
    runs = json.loads((ROOT / "experiments/results/tpu_megakernel.json").read_text())["runs"]
    moe, dense = "k3-tp32-core", "k3-tp8-dense"
    mk = {(r["slice"], r["format"], r["batch"]): r for r in runs
          if r["kind"] == "megakernel" and not r.get("sweep")}
    xla = {(r["slice"], r["format"], r["batch"]): r["step_s"] for r in runs if r["kind"] == "xla"}
    checks = {r["format"]: r for r in runs if r["kind"] == "check" and r["slice"] == moe}
    # sweep points by their routed-expert decode: the f32 decode's ("e2m1", runs before the
    # field was recorded) and the word decode's are quoted apart
    point = lambda r: (r.get("expert_decode", "e2m1"), r["batch"], r["config"]["depth"],  # noqa: E731
                       r["config"]["expert_slots"], r["config"]["bank_rows"])
    swept = [r for r in runs if r["kind"] == "megakernel" and r.get("sweep") and r["slice"] == moe]
    sweep = {point(r)[1:]: r["step_s"] for r in swept if point(r)[0] == "e2m1"}
    words = {point(r)[1:]: r["step_s"] for r in swept
             if point(r)[0] == "e2m1_words"}   # the latest run of a point: the depth and slot sweep
    first, words_first = {}, {}  # a point measured in several calls: the first call's (the bank sweep's)
    for r in swept:
        (first if point(r)[0] == "e2m1" else words_first).setdefault(point(r)[1:], r["step_s"])
    us = lambda s: f"{s * 1e6:.1f}"  # noqa: E731
    speedup = lambda k: f"{xla[k] / mk[k]['step_s']:.2f}x"  # noqa: E731
    quoted = [*(f"{checks[f]['logit_error']:.4f} of the logits' spread" for f in ("mxfp4", "int8")),
              *(speedup((moe, "mxfp4", b)) for b in (1, 2, 4, 8)),
              ", ".join(us(mk[moe, "int8", b]["step_s"]) for b in (1, 2, 4)) + f", {us(mk[moe, 'int8', 8]['step_s'])}",
              ", ".join(speedup((moe, "int8", b)) for b in (1, 2, 4)) + f" and {speedup((moe, 'int8', 8))}",
              f"{us(mk[dense, 'bf16', 1]['step_s'])} and {us(mk[dense, 'bf16', 8]['step_s'])} us a step",
              f"({speedup((dense, 'bf16', 1))} and {speedup((dense, 'bf16', 8))})",
              f"{(mk[moe, 'mxfp4', 1]['lower_s'] + mk[moe, 'mxfp4', 1]['compile_s']):.1f} s at batch 1",
              f"{(mk[moe, 'mxfp4', 8]['lower_s'] + mk[moe, 'mxfp4', 8]['compile_s']):.1f} s at batch 8",
              f"{(mk[dense, 'bf16', 1]['lower_s'] + mk[dense, 'bf16', 1]['compile_s']):.1f} s at batch 1",
              f"TP8-core slice's {(mk['k3-tp8-core', 'mxfp4', 1]['lower_s'] + mk['k3-tp8-core', 'mxfp4', 1]['compile_s']):.1f} s",
              f"{us(mk['k3-tp8-core', 'mxfp4', 1]['step_s'])} us at batch 1 against XLA's "
              f"{us(xla['k3-tp8-core', 'mxfp4', 1])} ({speedup(('k3-tp8-core', 'mxfp4', 1))})",
              ", ".join(us(mk[moe, "mxfp4", b]["step_s"]) for b in (1, 2, 4)) + f", {us(mk[moe, 'mxfp4', 8]['step_s'])} us a step",
              ", ".join(us(first[1, d, 2, 8192]) for d in (1, 2, 4, 8, 16)) + f", {us(first[1, 32, 2, 8192])} us a step",
              ", ".join(us(first[1, 8, k, 8192]) for k in (1, 2)) + f", {us(first[1, 8, 4, 8192])} us",
              f"{us(first[1, 8, 2, 4096])}, {us(first[1, 8, 2, 16384])} us",
              f"depth 16 took {us(sweep[8, 16, 2, 8192])} us and 16384-row banks {us(sweep[8, 8, 2, 16384])} "
              f"us against {us(sweep[8, 8, 2, 8192])}",
              f"{us(words_first[1, 8, 2, 32768])} against {us(words_first[1, 8, 2, 16384])} us at batch 1 and "
              f"{us(words_first[8, 8, 2, 32768])} against {us(words_first[8, 8, 2, 16384])} at batch 8",
              ", ".join(us(words[1, d, 2, 32768]) for d in (1, 2, 4, 8)) + f", {us(words[1, 12, 2, 32768])} us",
              f"took {us(words[1, 8, 1, 32768])} and {us(words[1, 8, 4, 32768])} us"]
    missing = [q for q in quoted if q not in text]
    assert not missing, f"docs/tpu.md does not quote the committed runs: {missing}"


def test_readme_quotes_the_committed_stream_shares():
    text = " ".join((ROOT / "README.md").read_text().split())
    res = json.loads((ROOT / "experiments/results/tpu_megakernel.json").read_text())
    share = {r["format"]: r["plan_bytes_per_s"] / res["stream_bytes_per_s"] for r in res["runs"]
             if r["kind"] == "megakernel" and not r.get("sweep") and r["batch"] == 1 and r["slice"] == "k3-tp32-core"}
    assert f"int8 experts it moves {share['int8']:.1%}".replace("%", " %") in text
    assert f"MXFP4 experts {share['mxfp4']:.1%}".replace("%", " %") in text
    runs = res["runs"]
    pack = [r for r in runs if r["kind"] == "packing" and r["slice"] == "k3-tp8-core"][-1]
    mk = [r for r in runs if r["kind"] == "megakernel" and r["slice"] == "k3-tp8-core" and r["batch"] == 1
          and not r.get("sweep") and "compile_s" in r][-1]   # a program compiled past --budget-s has no time
    assert f"the largest slice packs in {pack['pack_s']:.1f} s and compiles in " \
           f"{mk['lower_s'] + mk['compile_s']:.1f} s" in text


def test_the_word_decode_trial_quotes_its_log():
    """The trial not kept (docs/tpu.md) quotes the call's log, its only record."""
    import re
    text = " ".join((ROOT / "docs" / "tpu.md").read_text().split())
    log = (ROOT / "experiments/results/tpu_v5e/calls_2026-12-06g_w.log").read_text()
    step = float(re.search(r"megakernel batch 1:\s+([\d.]+) us/step", log)[1])
    xla = float(re.search(r"xla batch 1:\s+([\d.]+) us/step", log)[1])
    share = re.search(r"batch-1 stream share (\d+)%", log)[1]
    assert f"TP8-core step {step:.1f} us ({xla / step:.2f}x over XLA, {share} % of the stream)" in text
    assert "FAILED tests/test_tpu_chip.py::test_mini_tokens_equal_the_reference_on_the_chip[1-mxfp4]" in log


def test_tpu_status_quotes_the_xla_comparison():
    """The XLA errors docs/tpu.md quotes are tpu_validation.json's (python experiments/validate_tpu.py)."""
    text = " ".join((ROOT / "docs" / "tpu.md").read_text().split())
    v = json.loads((ROOT / "experiments/results/tpu_validation.json").read_text())
    err = {(x["slice"], x["batch"]): f"{x['step_error'] * 100:+.1f}".replace("+", "") for x in v["xla"]
           if x["format"] in ("mxfp4", "bf16")}
    quoted = [f"median |error| of {v['summary']['median_abs_xla_error'] * 100:.1f} %",
              f"batch 64 is {err['k3-tp32-core', 64]} %",
              f"({err['k3-tp8-dense', 32]} / {err['k3-tp8-dense', 64]} % at 32 / 64)"]
    missing = [q for q in quoted if q not in text]
    assert not missing, f"docs/tpu.md does not quote tpu_validation.json: {missing}"


def test_tpu_status_quotes_the_kernel_comparison():
    """The kernel errors docs/tpu.md quotes are tpu_validation.json's."""
    text = " ".join((ROOT / "docs" / "tpu.md").read_text().split())
    v = json.loads((ROOT / "experiments/results/tpu_validation.json").read_text())
    pct = lambda x: f"{x * 100:+.1f} %".replace("+", "") if x < 0 else f"+{x * 100:.1f} %"  # noqa: E731
    steps = [r["comparison"]["step_error"] for r in v["runs"] if not r["sweep"]]
    quoted = [f"median |error| of {v['summary']['median_abs_step_error'] * 100:.1f} %"]
    quoted += [pct(e) for e in sorted(steps, key=abs)[-2:]]   # the two worst steps
    missing = [q for q in quoted if q not in text]
    assert not missing, f"docs/tpu.md does not quote tpu_validation.json: {missing}"


def test_the_chip_runs_predicted_before_they_ran_quote_the_model_now():
    """Beside what the model said before each chip run (history, at the commit named), docs/tpu.md
    quotes what the model predicts now for the runs they start from (their own picks), in device
    time: the best slot count and its step for TP32-core at batches 1 and 8, and the TP8-core
    slot and depth points."""
    import dataclasses
    import importlib.util
    import sys
    import pytest
    pytest.importorskip("jax")
    from perfmodel.util.errors import SpecError
    from perfmodel_kernels.layout import KernelConfig
    sys.path.insert(0, str(ROOT / "experiments"))
    spec = importlib.util.spec_from_file_location("validate_tpu", ROOT / "experiments" / "validate_tpu.py")
    vt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vt)
    text = " ".join((ROOT / "docs" / "tpu.md").read_text().split())
    runs = json.loads((ROOT / "experiments/results/tpu_megakernel.json").read_text())["runs"]

    def stepper(run):
        def step(**over):
            cfg = dataclasses.replace(KernelConfig(**run["config"]), **over)
            return vt.predict_megakernel(dict(run, config=dataclasses.asdict(cfg)), "tpu-v5e")[2].step_s * 1e6
        return step

    for batch in (1, 8):
        step = stepper(next(r for r in runs if r["kind"] == "megakernel" and r.get("commit") == "b3e89de"
                            and r["batch"] == batch and not r.get("sweep")))
        steps = {}
        for k in range(2, 9):
            try:
                steps[k] = step(expert_slots=k)
            except SpecError:   # more slots than picks, or beyond the VMEM
                pass
        best = min(steps, key=steps.get)
        assert f"at {best} slots at batch {batch} ({steps[best]:.0f} us against {steps[2]:.0f} at 2" in text
    step = stepper(next(r for r in runs if r["kind"] == "megakernel" and r.get("commit") == "0d74499"
                        and r["slice"] == "k3-tp8-core" and r["batch"] == 1))
    slots = ", ".join(f"{step(expert_slots=k):.0f}" for k in (1, 2, 3))
    depths = ", ".join(f"{step(depth=d):.0f}" for d in (2, 4, 6))
    assert f"The model now puts the slots at {slots} us and the depths at {depths} us" in text
