"""Limits before work, options that would do nothing, and the inputs that broke the CLI contract:
each is refused with exit status 2 and one line naming the field and its value (and, for a limit,
the work and the limit), before any work; what is accepted spends no more than its limits allow
(perfmodel.util.limits counts the work as it is done)."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from perfmodel.cli.main import main
from perfmodel.graph.dmaplan import COLUMNS, FORMAT, VERSION
from perfmodel.util import limits

PROFILE = json.loads((Path(__file__).parents[1] / "perfmodel/data/phase_profiles/musespark.json").read_text())
LLAMA = ["--model", "llama-3.1-8b", "--hardware", "h100", "--devices", "1"]
SMALL = ["--model", "llama-3.2-1b", "--hardware", "h100", "--devices", "1"]
MINI = ["--model", "kimi-k3-mini", "--devices", "1"]


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def refused(argv: list[str], *needles: str) -> str:
    """Run `argv`: exit 2 with one line on stderr holding every needle (the field=value); no work done."""
    limits.reset()
    rc, _, err = run(argv)
    lines = err.strip("\n").split("\n")
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("perfmodel"), (argv, rc, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def plan_file(tmp: Path, copies: list | None = None, **over) -> Path:
    data = {"format": FORMAT, "version": VERSION, "model": "kimi-k3-mini",
            "deployment": {"devices": 1, "tp": 1, "batch": 1}, "kernel": {}, "columns": list(COLUMNS),
            "copies": copies or []} | over
    (tmp / "plan.json").write_text(json.dumps(data))
    return tmp / "plan.json"


# ----- hangs: sizes the user controls, refused before any work -----------------------------------

def test_serve_requests_over_the_limit():
    refused(["serve", *LLAMA, "--requests", "1048576", "--rate", "5", "--input-len", "8", "--output-len", "2"],
            "--requests", "1048576", "1000000")
    line = refused(["serve", *LLAMA, "--requests", "1000000", "--rate", "5", "--input-len", "8", "--output-len", "2"],
                   "requests=1000000", "serving steps", "over the limit")
    assert limits.SPENT == {"layer_steps": 0, "serve_steps": 0}, line


@pytest.mark.parametrize("vary,needle", [("requests=1000000", "requests=[1000000]"),
                                         ("output_len=16777216", "output_len=[16777216]")])
def test_sweep_serving_points_over_the_limit(vary, needle):
    refused(["sweep", *SMALL, "--vary", "rate=5", "--vary", vary, "--no-progress"], needle, "serving steps")
    assert limits.SPENT == {"layer_steps": 0, "serve_steps": 0}


def test_prefill_chunks_over_the_limit():
    refused(["predict", *MINI, "--prompt", "1048576", "--prefill-chunk", "1"], "--prefill-chunk=1", "layer steps",
            "over the limit")
    assert limits.SPENT["layer_steps"] == 0


def test_constraint_over_a_large_serving_design(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text('[base]\nmodel = "llama-3.2-1b"\nhardware = "h100"\ndevices = 1\n'
                 '[random]\nsamples = 5000\nrate = {min = 0.1, max = 100}\n')
    refused(["sweep", "--design", f, "--constraint", "ttft_p90_s=1", "--no-progress"], "sweep design='5000 points'",
            "serving steps")
    assert limits.SPENT["serve_steps"] == 0


def test_repeated_batches_are_predicted_once_and_too_many_refused():
    limits.reset()
    rc, out, _ = run(["predict", *MINI, "--batch", ",".join(["8"] * 40), "--json"])
    assert rc == 0 and len(json.loads(out)["results"]) == 40
    assert limits.SPENT["layer_steps"] <= 2 * (4 + 2)  # one step (and the expert tiling's) for the one batch
    refused(["predict", *MINI, "--batch", ",".join(map(str, range(1, 257))), "--prompt", "65536",
             "--prefill-chunk", "64", "--json"], "--prefill-chunk=64", "256 batch sizes")


def test_mutated_profile_over_the_limits(tmp_path):
    p = json.loads(json.dumps(PROFILE))
    p["harness"]["timed_steps"] = [{"context": 200 + i, "steps": 1} for i in range(64)]
    p["kernels"] |= {f"k{i}": p["kernels"]["first"] for i in range(6)}
    (tmp_path / "p.json").write_text(json.dumps(p))
    refused(["explain", "--profile", tmp_path / "p.json"], "harness.timed_steps='64 groups'", "layer steps")
    p = json.loads(json.dumps(PROFILE))
    p["harness"]["timed_steps"] = [{"context": 200, "steps": 1}] * 65
    (tmp_path / "p.json").write_text(json.dumps(p))
    refused(["explain", "--profile", tmp_path / "p.json"], "harness.timed_steps")
    p = json.loads(json.dumps(PROFILE))
    p["kernels"] = {f"k{i}": p["kernels"]["final"] for i in range(17)}
    (tmp_path / "p.json").write_text(json.dumps(p))
    refused(["explain", "--profile", tmp_path / "p.json"], "kernels='17 kernels'")
    p = json.loads(json.dumps(PROFILE))
    p["harness"]["deployment"]["batch"] = 2**31
    (tmp_path / "p.json").write_text(json.dumps(p))
    refused(["explain", "--profile", tmp_path / "p.json"], "harness.deployment.batch")
    assert limits.SPENT["layer_steps"] == 0


def test_plan_files_and_their_copies_are_bounded(tmp_path):
    row = [0, 1, "attention", "x", 8, False, True, 0, -1, ""]
    f = plan_file(tmp_path, [[i, *row[1:]] for i in range(limits.MAX_PLAN_COPIES + 1)])
    refused(["predict", "--kernel-plan", f], "copies")
    refused(["predict", *sum((["--kernel-plan", "x.json"] for _ in range(limits.MAX_PLANS + 1)), [])],
            "--kernel-plan", "plan files given")
    refused(["predict", "--kernel-plan", plan_file(tmp_path, deployment={"devices": 2**40, "tp": 1, "batch": 1})],
            "deployment.devices")


# ----- a model file's bank size, the serving clock ------------------------------------------------

@pytest.mark.parametrize("bank,needle", [(1, "megakernel.bank_bytes=1"), (0, "megakernel.bank_bytes=0")])
def test_model_file_bank_size(tmp_path, bank, needle):
    (tmp_path / "m.toml").write_text(f'base = "kimi-k3"\n[megakernel]\nbank_bytes = {bank}\n')
    refused(["predict", "--model", tmp_path / "m.toml", "--devices", "32", "--ep", "8"], needle)


@pytest.mark.parametrize("rate,extra", [("1e-20", []), ("5e-324", []), ("5e-324", ["--prefill-devices", "1"])])
def test_serve_rates_the_clock_cannot_hold(rate, extra):
    refused(["serve", *LLAMA, "--requests", "10", "--rate", rate, "--no-progress", *extra], f"rate={float(rate)!r}")


# ----- options that would do nothing --------------------------------------------------------------

@pytest.mark.parametrize("option", [["--model", "kimi-k3"], ["--batch", "2"], ["--devices", "4"],
                                    ["--prompt", "64"], ["--gain"], ["--engine", "multikernel"]])
def test_kernel_plan_refuses_the_options_it_would_ignore(tmp_path, option):
    refused(["predict", "--kernel-plan", plan_file(tmp_path), *option], option[0] + "=")
    if option[0] not in ("--prompt", "--gain"):  # explain has no such option (argparse refuses it)
        refused(["explain", "--kernel-plan", plan_file(tmp_path), *option], option[0] + "=")


@pytest.mark.parametrize("option", [["--context", "5"], ["--steps-per-call", "4"], ["--prefill-engine", "megakernel"]])
def test_serve_refuses_the_options_it_would_ignore(option):
    refused(["serve", *SMALL, "--requests", "5", "--rate", "1", "--no-progress", *option], option[0] + "=")


@pytest.mark.parametrize("vary,needle", [(["--vary", "prefill_tp=2"], "--vary prefill_tp=[2]"),
                                         (["--vary", "prefill_ep=2"], "--vary prefill_ep=[2]")])
def test_sweep_refuses_settings_a_point_would_ignore(vary, needle):
    refused(["sweep", *SMALL, "--vary", "rate=5", *vary, "--no-progress"], needle, "needs prefill_devices")
    refused(["sweep", *SMALL, "--vary", "requests=5", "--no-progress"], "--vary requests=[5]", "needs traffic")
    refused(["sweep", *SMALL, "--vary", "rate=5", "--context", "64", "--no-progress"], "--context=64")
    refused(["sweep", *SMALL, "--vary", "batch=1", "--pp", "2", "--no-progress"], "--pp=2")


# ----- serving traces ------------------------------------------------------------------------------

@pytest.mark.parametrize("name,text,needle", [
    ("t.csv", "input_len,output_len\n10,inf\n", "output_len = 'inf'"),
    ("t.csv", "input_len,output_len\n10,1e400\n", "output_len = '1e400'"),
    ("t.jsonl", "[" * 100_000 + "]" * 100_000 + "\n", "nested more than"),
    ("t.jsonl", '{"input_len": 8, "output_len": [1]}\n', "output_len = [1]"),
    ("t.csv", "input_len,output_len,arrival_s\n8,2,1e300\n", "arrival_s = '1e300'"),
])
def test_serve_trace_values(tmp_path, name, text, needle):
    (tmp_path / name).write_text(text)
    refused(["serve", *SMALL, "--trace", tmp_path / name, "--rate", "5", "--requests", "4", "--no-progress"],
            "--trace=", needle)


# ----- bundled data through the schema layer -------------------------------------------------------

@pytest.fixture
def bundled(tmp_path, monkeypatch):
    """Copies of the serving-engine inventories and H100's kernel tables that a test may corrupt;
    the loaders read them (their caches cleared before and after)."""
    from perfmodel.cost import gpu_kernels as gk
    from perfmodel.spec import engines
    inv = tmp_path / "serving_engines"
    shutil.copytree(engines.ENGINE_DIR, inv)
    kdir = tmp_path / "kernels"
    shutil.copytree(gk.KERNEL_DIR / "h100", kdir / "h100")
    monkeypatch.setattr(engines, "ENGINE_DIR", inv)
    monkeypatch.setattr(gk, "KERNEL_DIR", kdir)
    caches = (engines.inventory.cache_clear, gk.tables.cache_clear, gk.forget_fits,
              gk.gpus_with_tables.cache_clear)
    for clear in caches:
        clear()
    yield inv, kdir / "h100"
    for clear in caches:
        clear()


def _grid_zeroed(index: np.ndarray) -> np.ndarray:
    """A class index (JSON bytes) whose first grid starts at 0."""
    ix = json.loads(index.tobytes())
    ix["grids"][0][0] = 0
    return np.frombuffer(json.dumps(ix).encode(), np.uint8)


def _npz_rewrite(path: Path, change) -> None:
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    change(arrays)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


CORRUPT = {
    "inventory: kernel_tables a list": ("inv", "vllm.toml", lambda t: t.replace('kernel_tables = "vllm"', 'kernel_tables = ["vllm"]'),
                                        "kernel_tables=['vllm']"),
    "inventory: kernel_tables missing": ("inv", "vllm.toml", lambda t: t.replace('kernel_tables = "vllm"', ""),
                                         "kernel_tables=None"),
    "inventory: a path for a table": ("inv", "vllm.toml", lambda t: t.replace('kernel_tables = "vllm"', 'kernel_tables = "../x"'),
                                      "kernel_tables='../x'"),
    "inventory: values of an unknown name": ("inv", "vllm.toml", lambda t: t.replace('values = "2*hidden"', 'values = "2*zz"', 1),
                                             "values='2*zz'"),
    "inventory: not TOML": ("inv", "vllm.toml", lambda t: t[: len(t) // 2] + "\n[[[", "vllm.toml"),
    "table: truncated": ("npz", "vllm.npz", lambda b: b[: len(b) // 2], "vllm.npz"),
    "table: empty": ("npz", "vllm.npz", lambda b: b"", "vllm.npz"),
}


@pytest.mark.parametrize("name", CORRUPT)
def test_corrupt_bundled_data_names_the_file(bundled, name):
    inv, h100 = bundled
    where, file, change, needle = CORRUPT[name]
    path = (inv if where == "inv" else h100) / file
    if where == "inv":
        path.write_text(change(path.read_text()))
    else:
        path.write_bytes(change(path.read_bytes()))
    refused(["predict", "--model", "llama-3.1-8b", "--hardware", "h100", "--devices", "1", "--engine", "multikernel",
             "--serving-engine", "vllm"], needle)


@pytest.mark.parametrize("change,needle", [
    (lambda a: a.pop("log_s.gemm"), "index.classes='gemm'"),
    (lambda a: a.update(index=np.array([{"x": 1}], dtype=object)), "index='<array>'"),  # pickled: refused
    (lambda a: a.update(index=np.frombuffer(json.dumps({"files": [], "source": "x", "fastest_kernel_s": 1e-6,
                                                        "classes": []}).encode(), np.uint8)), "index.files=[]"),
    (lambda a: a.update({"index.gemm": np.frombuffer(b'{"files": 3}', np.uint8)}), "index.gemm.files=3"),
    (lambda a: a.update({"log_s.gemm": a["log_s.gemm"][:5]}), "index.gemm.tables"),
    (lambda a: a.update({"index.gemm": _grid_zeroed(a["index.gemm"])}), "index.gemm.grids[0]"),
])
def test_corrupt_kernel_table_arrays(bundled, change, needle):
    _, h100 = bundled
    _npz_rewrite(h100 / "vllm.npz", change)
    refused(["predict", "--model", "llama-3.1-8b", "--hardware", "h100", "--devices", "1", "--engine", "multikernel",
             "--serving-engine", "vllm"], needle, "vllm.npz")


def test_corrupt_fit_file(bundled):
    _, h100 = bundled
    f = h100 / "fit.json"
    data = json.loads(f.read_text())
    group = next(g for g in data["engines"]["vllm"] if g.startswith("gemm"))
    data["engines"]["vllm"][group]["bytes_per_s"] = 0
    f.write_text(json.dumps(data))
    refused(["predict", "--model", "llama-3.1-8b", "--hardware", "h100", "--devices", "1", "--engine", "multikernel",
             "--serving-engine", "vllm"], "fit.json", "bytes_per_s=0")


# ----- arithmetic on user values -------------------------------------------------------------------

def test_arithmetic_on_user_values(tmp_path):
    refused(["predict", "--model", "deepseek-v3", "--hardware", "b200", "--ep", "32"], "devices='default'")
    refused(["predict", "--model", "deepseek-v3", "--hardware", "b200", "--ep", "32", "--devices", "8"], "ep=32")
    refused(["sweep", "--design", ""], "--design=''", "empty path")
    refused(["sweep", "--design", "a" * 300 + ".toml"], "--design=", "longer than 255 bytes")
    refused(["sweep", *MINI, "--vary", "model=kimi-k3-mini\udcff", "--out", tmp_path / "r.parquet"], "--vary model=")
    refused(["validate", "--trace", "/", "--hardware", "tpu-v7"], "--trace='/'")
    assert [p.name for p in tmp_path.iterdir()] == []


def test_plan_without_copies_keeps_the_contract(tmp_path):
    rc, out, err = run(["predict", "--kernel-plan", plan_file(tmp_path), "--json"])
    assert (rc == 0 and json.loads(out)["kernel_plans"]) or (rc == 2 and len(err.splitlines()) == 1), err


def test_earlier_model_file_format_is_refused_not_reinterpreted(tmp_path):
    (tmp_path / "m.toml").write_text('base = "kimi-k3"\nname = "k"\n[formats]\nshared_expert = "int8"\n')
    refused(["predict", "--model", tmp_path / "m.toml", "--devices", "32", "--ep", "8"],
            "formats.shared_expert='int8'", "latent_projection")
    (tmp_path / "m.toml").write_text('base = "kimi-k3"\nname = "k"\n[formats]\nshared_expert = "int8"\n'
                                     'latent_projection = "int8"\n')
    assert run(["predict", "--model", tmp_path / "m.toml", "--devices", "32", "--ep", "8"])[0] == 0


def test_ray_executor_leaves_no_temporary_directory_when_refused(monkeypatch):
    pytest.importorskip("ray")
    from perfmodel.search import executors
    started = []
    monkeypatch.setattr(executors, "_ray", lambda *a: started.append(a) or iter(()))
    before = set(Path(tempfile.gettempdir()).glob("perfmodel-ray-*"))
    refused(["sweep", *MINI, "--vary", "batch=1", "--executor", "ray", "--chunk", "0"], "--chunk=0")
    refused(["sweep", *MINI, "--vary", "batch=1", "--executor", "ray", "--top", "-1"], "--top=-1")
    assert started == [] and set(Path(tempfile.gettempdir()).glob("perfmodel-ray-*")) == before


# ----- what is accepted spends no more than its limits allow ---------------------------------------

SCALED = {"MAX_LAYER_STEPS": 3_000, "MAX_SERVE_STEPS": 4_000, "MAX_SWEEP_SERVE_STEPS": 20_000}


@pytest.fixture
def small_limits(monkeypatch):
    """The limits scaled down, so that random inputs fall on both sides of them in a short test."""
    for k, v in SCALED.items():
        monkeypatch.setattr(limits, k, v)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(batches=st.lists(st.sampled_from([1, 2, 3, 8, 16, 64]), min_size=1, max_size=12),
       prompt=st.none() | st.integers(1, 4096), chunk=st.none() | st.integers(1, 512), gain=st.booleans(),
       engine=st.sampled_from(["megakernel", "multikernel"]))
def test_accepted_predictions_spend_within_their_limit(small_limits, batches, prompt, chunk, gain, engine):
    argv = ["predict", *MINI, "--engine", engine, "--batch", ",".join(map(str, batches))]
    argv += (["--prompt", str(prompt)] if prompt else []) + (["--prefill-chunk", str(chunk)] if chunk and prompt else [])
    argv += ["--gain"] if gain else []
    limits.reset()
    rc, _, err = run(argv + ["--json"])
    assert rc in (0, 2), err
    if rc == 0:
        assert limits.SPENT["layer_steps"] <= limits.MAX_LAYER_STEPS, (argv, limits.SPENT)
    else:
        assert limits.SPENT["layer_steps"] == 0 or "over the limit" not in err, (argv, err)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(requests=st.integers(1, 3000), rate=st.floats(0.05, 5000), inp=st.integers(1, 4096), out=st.integers(1, 600),
       concurrency=st.none() | st.integers(1, 300), chunk=st.none() | st.integers(16, 2048))
def test_accepted_serving_spends_within_its_limit(small_limits, requests, rate, inp, out, concurrency, chunk):
    argv = ["serve", *MINI, "--requests", requests, "--input-len", inp, "--output-len", out, "--no-progress", "--json"]
    argv += ["--concurrency", concurrency] if concurrency else ["--rate", repr(rate)]
    argv += ["--prefill-chunk", chunk] if chunk else []
    limits.reset()
    rc, _, err = run(argv)
    assert rc in (0, 2), err
    assert limits.SPENT["serve_steps"] <= limits.MAX_SERVE_STEPS, (argv, limits.SPENT)
    if rc == 2 and "over the limit" in err:
        assert limits.SPENT["serve_steps"] == 0, err  # refused before it ran


def test_accepted_profiles_spend_what_was_estimated():
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.step.explain import explain_profile
    from perfmodel.step.phases import load_profile, profile_work
    p = load_profile("musespark")
    limits.reset()
    explain_profile(p, load_hardware("tpu-v7"))
    assert limits.SPENT["layer_steps"] == profile_work(p)[1]


def test_accepted_sweeps_spend_within_their_limits(small_limits):
    limits.reset()
    rc, _, err = run(["sweep", *SMALL, "--vary", "concurrency=1,8", "--vary", "requests=20,40", "--vary", "output_len=16",
                      "--no-progress", "--json", "--jobs", "1"])
    assert rc == 0, err
    assert 0 < limits.SPENT["serve_steps"] <= limits.MAX_SWEEP_SERVE_STEPS


def test_closed_loop_one_token_requests_disaggregated_end():
    """Found by the extended fuzz: a one-token request ends at the prefill pool, and its client then
    sends the next one (the closed loop stalled, and the simulation never ended)."""
    limits.reset()
    rc, out, err = run(["serve", *MINI, "--requests", "20", "--concurrency", "1", "--output-len", "1",
                        "--block-tokens", "1", "--prefill-devices", "1", "--no-progress", "--json"])
    assert rc == 0 and json.loads(out)["requests"] == 20, err


def test_plan_copy_of_a_negative_layer(tmp_path):
    """Found by the extended fuzz: a ring copy of layer -1 read the model's last layer's bytes and
    then no op (IndexError)."""
    f = plan_file(tmp_path, [[0, -1, "attention", "bank 0", 512, False, True, 0, -1, ""]])
    refused(["predict", "--kernel-plan", f], "copies[0].layer=-1")
