"""The `perfmodel` command line: outputs, the JSON contract, and errors without tracebacks."""
import json
import subprocess
import sys

import pytest

from perfmodel.cli import main


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
    (["predict", "--batch", "0"], "batch=0"),
    (["predict", "--tp", "5"], "tp=5"),
    (["predict", "--devices", "1", "--hardware", "h100"], "does not fit"),
    (["predict", "--prefetch-mib", "100"], "prefetch_bytes"),
    (["sweep", "--vary", "prefetch_mib=8", "--draft-rows", "3"], "acceptance"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bad_files_and_topk_errors(capsys, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{ not json")
    assert main(["predict", "--model", str(bad)]) == 2
    assert "not a readable JSON config" in capsys.readouterr().err
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
