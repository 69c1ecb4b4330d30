"""The `perfmodel` command line: outputs, the JSON contract, and errors without tracebacks."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from perfmodel.cli.main import main


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_predict_json_schema(capsys):
    out = run_json(capsys, "predict", "--model", "kimi-k3", "--hardware", "tpu-v7", "--devices", "32", "--tp", "32",
                   "--ep", "8", "--engine", "megakernel", "--batch", "1,2,4,8")
    assert out["schema_version"] == 2 and out["inputs"]["batch"] == [1, 2, 4, 8]
    assert out["inputs"]["model"] == "kimi-k3" and out["inputs"]["ep"] == 8
    tps = [r["tokens_per_s"] for r in out["results"]]
    assert tps == sorted(tps)  # more sequences, more aggregate tokens/s
    r = out["results"][0]
    assert {"step_s", "tokens_per_s", "bytes_per_device", "hbm_floor_s", "bound", "breakdown_s", "layers"} <= set(r)
    assert len(r["layers"]) == 95 and r["bound"] in ("memory", "compute", "latency")
    assert r["tokens_per_s"] == pytest.approx(1 / r["step_s"])


def test_predict_text_and_gb200_counterpart(capsys):
    assert main(["predict", "--hardware", "gb200", "--devices", "16", "--engine", "multikernel",
                 "--batch", "1,8"]) == 0
    text = capsys.readouterr().out
    assert "kda+moe" in text and "tokens/s" in text and "multikernel" in text


def test_spec_decode_predict(capsys):
    out = run_json(capsys, "predict", "--ep", "8", "--draft-rows", "7", "--acceptance-length", "6")
    r = out["results"][0]
    assert r["tokens_per_s"] == pytest.approx(6 / r["step_s"]) and "draft" in r["breakdown_s"]


def test_list_sweep_and_trace(capsys, tmp_path):
    out = run_json(capsys, "list")
    assert "kimi-k3" in {m["name"] for m in out["models"]} and "gb200" in {h["name"] for h in out["hardware"]}
    out = run_json(capsys, "sweep", "--ep", "8", "--vary", "prefetch_mib=8,16,32", "--vary", "batch=1,8")
    assert len(out["rows"]) == 6 and len(out["saturation"]) == 2
    path = tmp_path / "t.json"
    out = run_json(capsys, "trace", "--ep", "8", "--out", str(path))
    trace = json.loads(path.read_text())
    lanes = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert lanes == {1, 2, 3} and out["events"] == len(trace["traceEvents"])


@pytest.mark.parametrize("argv,needle", [
    (["predict", "--model", "gpt-17"], "model='gpt-17'"),
    (["predict", "--batch", "0"], "--batch"),
    (["predict", "--tp", "5"], "tp=5"),
    (["predict", "--devices", "1", "--hardware", "h100"], "does not fit"),
    (["predict", "--prefetch-mib", "100"], "prefetch_bytes"),
    (["sweep", "--vary", "prefetch_mib=8", "--draft-rows", "3"], "acceptance"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_default_devices_are_the_fewest_that_hold_the_model(capsys):
    """Without --devices: the fewest, a power of two (times a given tp), whose memory the weights
    and the largest batch's caches fill to at most 90 %: one H100 for an 8B model, two for 16 of
    its 32k-token caches (84.8 GB at one), 16 GB200 for Kimi K3 (196 GB at 8), 32 TPU v7 cores for
    it (98.7 GB of 103 at 16)."""
    def devices(*argv):
        return run_json(capsys, "predict", *argv)["inputs"]["devices"]
    assert devices("--model", "llama-3.1-8b", "--hardware", "h100", "--engine", "multikernel") == 1
    assert devices("--hardware", "gb200", "--engine", "multikernel", "--ep", "1") == 16
    assert devices("--ep", "8") == 32
    assert devices("--model", "llama-3.1-8b", "--hardware", "h100", "--engine", "multikernel",
                   "--batch", "1,16", "--context", "32768") == 2
    assert devices("--model", "llama-3.1-8b", "--hardware", "h100", "--engine", "multikernel", "--tp", "2") == 2
    assert main(["predict", "--model", "llama-3.1-8b", "--hardware", "h100", "--batch", "64",
                 "--context", "100000"]) == 2
    assert "no power of two up to 16384 devices holds llama-3.1-8b at batch 64" in capsys.readouterr().err


def test_a_kernel_that_names_its_expert_groups_gives_the_default_ep(capsys):
    """Muse Spark's kernel splits every expert over its tp ranks ([megakernel] expert_groups = 1),
    Kimi K3's owns them in 8 groups: the command's ep when it names none and they divide its devices,
    for the megakernel engine only; --ep overrides it."""
    ep = lambda *argv: run_json(capsys, "predict", *argv)["inputs"]["ep"]
    assert ep("--model", "muse-spark") == 1 and ep("--model", "muse-spark", "--engine", "multikernel") == 8
    assert ep("--model", "kimi-k3") == 8
    assert ep("--model", "kimi-k3-mini", "--devices", "2") == 2  # 8 groups do not divide 2 devices
    assert main(["predict", "--model", "muse-spark", "--ep", "8"]) == 2
    assert "ep = 8 splits each expert over 1 of the 8 devices" in capsys.readouterr().err


def test_bad_files_and_topk_errors(capsys, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{ not json")
    assert main(["predict", "--model", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    toml = tmp_path / "m.toml"
    toml.write_text('name="x"\nhidden=64\nvocab=10\nlayers=1\n[gqa]\nheads=4\nkv_heads=4\nhead_dim=16\n'
                    '[ffn]\ndense_layers=[]\ndense_width=64\n[moe]\nexperts=4\ntop_k=8\nexpert_width=8\n')
    assert main(["predict", "--model", str(toml), "--devices", "1"]) == 2
    assert "moe.top_k=8" in capsys.readouterr().err


def test_console_script_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "perfmodel.cli", "predict", "--hardware", "nope"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "hardware='nope'" in r.stderr and "Traceback" not in r.stderr


def test_prefetch_gain_by_cause(capsys):
    out = run_json(capsys, "predict", "--ep", "8", "--batch", "1,8", "--gain")
    g1, g8 = (r["prefetch_gain"] for r in out["results"])
    for g in (g1, g8):
        assert g["gain_s"] == pytest.approx(sum(g["by_cause_s"].values()), rel=1e-6)
        assert g["by_cause_s"]["launch"] > 0  # the megakernel launches nothing per op
    assert g1["speedup"] > g8["speedup"] > 1  # prefetching matters less as batches grow


# ----- every command's --json against docs/json-schema.json ---------------------------------------

SCHEMA = json.loads((Path(__file__).resolve().parent.parent / "docs" / "json-schema.json").read_text())


def check_schema(out: dict) -> None:
    import jsonschema
    jsonschema.validate(out, {**SCHEMA, "$ref": f"#/$defs/{out['command']}"})


def json_of(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    out = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON output"))
    check_schema(out)
    return out


@pytest.mark.parametrize("argv", [
    ["list"],
    ["predict", "--ep", "8", "--batch", "1,8", "--gain"],
    ["predict", "--model", "kimi-k3-mini", "--devices", "1", "--draft-rows", "3", "--acceptance-prob", "0.6"],
    ["sweep", "--ep", "8", "--vary", "prefetch_mib=8,16", "--vary", "batch=1,2"],
    ["sweep", "--ep", "8", "--vary", "prefetch_mib=8,1000"],  # a point that cannot run: its error
    ["reproduce", "--no-fit"],
    ["explain", "--ep", "8", "--layer", "4"],
    ["explain", "--profile", "musespark"],
    ["calibrate", "--microbench", str(Path(__file__).parents[1] / "perfmodel/data/microbench/tpu7x.json")],
])
def test_json_matches_schema(capsys, argv):
    json_of(capsys, *argv)


def test_trace_json_and_atomic_write(capsys, tmp_path):
    path = tmp_path / "t.json"
    out = json_of(capsys, "trace", "--ep", "8", "--out", str(path))
    assert out["out"] == str(path) and json.loads(path.read_text())["traceEvents"]
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left behind
    assert main(["trace", "--ep", "8", "--out", str(tmp_path / "missing" / "t.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_trace_of_a_serving_engine_has_its_second_stream(capsys, tmp_path):
    """vLLM's shared experts on their own stream get their own thread in the trace."""
    path = tmp_path / "t.json"
    json_of(capsys, "trace", "--model", "kimi-k3", "--hardware", "gb200", "--devices", "16", "--tp", "16",
            "--engine", "multikernel", "--serving-engine", "vllm", "--out", str(path))
    events = json.loads(path.read_text())["traceEvents"]
    aux = [e for e in events if e.get("tid") == 4 and e["ph"] == "X"]
    assert aux and {e["name"] for e in aux} >= {"shared_gate_up_gemm", "shared_down_gemm"}


def test_reproduce_json_keeps_its_fit_out_of_the_presets(capsys):
    """The fit's JSON is plain (numpy scalars leaked once); its one whole-step value (nothing is fitted
    for tpu-v7) stays in the report: the gb200 preset keeps its kernel-level overlap, and a later
    prediction is the same as before the fit."""
    from perfmodel.spec.hardware import load_hardware
    out = json_of(capsys, "reproduce")
    assert set(out["fitted_parameters"]) == {"gb200.graph_kernel_overlap_s"}
    shipped = load_hardware("gb200").components["graph_kernel_overlap_s"]
    assert out["fitted_parameters"]["gb200.graph_kernel_overlap_s"]["value"] != pytest.approx(shipped, rel=0.05)
    assert main(["reproduce", "--write", "x"]) == 2  # no such option any more


def test_validate_json_matches_schema(capsys, tmp_path):
    pytest.importorskip("jax")
    from test_traces import MINI_STEP, write_xspace, xspace_text
    f = write_xspace(tmp_path / "tpu.xplane.pb", xspace_text([MINI_STEP] * 2, step_us=30.0))
    json_of(capsys, "validate", "--trace", str(f), "--model", "kimi-k3-mini", "--hardware", "tpu-v7",
            "--batch", "1", "--context", "32", "--mode", "megakernel")


@pytest.mark.slow
def test_capture_and_hostbench_json_match_schema(capsys, tmp_path):
    pytest.importorskip("jax")
    json_of(capsys, "capture", "--out", str(tmp_path / "traces"), "--steps", "2", "--modes", "compiled",
            "--context", "16")
    json_of(capsys, "hostbench", "--quick", "--repeats", "2", "--out", str(tmp_path / "host.toml"))


def test_perfmodel_imports_neither_jax_nor_kernels():
    """Layering: the model and its CLI (every subcommand registered) load without JAX or the kernels."""
    code = ("import sys, pkgutil, importlib, perfmodel, perfmodel.cli.main\n"
            "perfmodel.cli.main.build_parser()\n"
            "for m in pkgutil.walk_packages(perfmodel.__path__, 'perfmodel.'):\n    m.name.endswith('__main__') or importlib.import_module(m.name)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'perfmodel_kernels'))\n"
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_missing_optional_dependency_is_a_one_line_hint(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)  # import jax -> ModuleNotFoundError
    assert main(["capture", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'perfmodel[jax]'" in err and len(err.strip().splitlines()) == 1


def test_a_failed_write_keeps_the_old_file(capsys, tmp_path, monkeypatch):
    """Disk full half-way: the old file stays whole, no temporary file is left, exit 2."""
    import os
    path = tmp_path / "t.json"
    path.write_text("old")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert main(["trace", "--model", "kimi-k3-mini", "--devices", "1", "--out", str(path)]) == 2
    assert "No space left" in capsys.readouterr().err
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["t.json"]
