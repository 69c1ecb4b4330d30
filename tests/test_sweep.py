"""perfmodel sweep at scale: designs, filtered constraints, top K / Pareto, output files, executors."""
import json
import math

import pytest

from perfmodel.cli.main import main
from perfmodel.search import design, sweep
from perfmodel.search.batch import COLUMNS, run_chunk
from perfmodel.search.sweep import Best, pareto, run_design
from perfmodel.util.errors import SpecError

# a cheap MoE model (well under 1 ms a prediction) on two chips, both engines, layouts that do
# and do not divide its 2 heads, VMEM sizes that do and do not hold its ring and expert buffers
MIXED = {"base": {"model": "kimi-k3-mini"},
         "random": {"samples": 1000, "seed": 7, "axes": {
             "hardware": ["tpu-v7", "tpu-v6e"], "devices": [1, 2, 4], "engine": ["megakernel", "multikernel"],
             "batch": [1, 2, 4, 8, 16, 64], "context": {"min": 128, "max": 65536, "log": True},
             "prefetch_mib": [0.5, 1, 4, 16], "expert_slots": [1, 2, 4], "vmem_mib": [0.25, 1, 16, 64]}}}


def mixed(samples):
    return design.from_dict({**MIXED, "random": {**MIXED["random"], "samples": samples}})


def test_grid_expands_every_combination_and_ranges():
    d = design.from_dict({"grid": {"batch": [1, 8], "prefetch_mib": {"min": 4, "max": 32, "steps": 4, "log": True}}})
    assert len(d) == 8
    assert sorted(set(d.columns["prefetch_mib"])) == [4.0, 8.0, 16.0, 32.0]
    assert {(b, p) for b, p in zip(d.columns["batch"], d.columns["prefetch_mib"])} == \
        {(b, p) for b in (1, 8) for p in (4.0, 8.0, 16.0, 32.0)}
    s = d.settings(0)
    assert s["tp"] == s["devices"] == 32 and s["model"] == "kimi-k3"


def test_random_is_seeded_typed_and_in_range():
    a, b = mixed(500), mixed(500)
    assert a.columns == b.columns
    ctx = a.columns["context"]
    assert all(isinstance(c, int) and 128 <= c <= 65536 for c in ctx)
    assert min(ctx) < 1024 and max(ctx) > 16384  # log-uniform reaches both decades
    assert set(a.columns["hardware"]) == {"tpu-v7", "tpu-v6e"}
    c = design.from_dict({**MIXED, "random": {**MIXED["random"], "samples": 500, "seed": 8}})
    assert c.columns != a.columns


@pytest.mark.parametrize("data,needle", [
    ({"grid": {"batchh": [1]}}, "unknown setting"),
    ({"grid": {"batch": [1.5]}}, "an integer"),
    ({"grid": {"batch": [0]}}, "> 0"),
    ({"grid": {"engine": ["fused"]}}, "engine must be one of"),
    ({"grid": {"batch": []}}, "at least one value"),
    ({"grid": {"batch": {"min": 1, "max": 8}}}, "steps"),
    ({"grid": {"engine": {"min": 1, "max": 8, "steps": 2}}}, "only numeric"),
    ({"random": {"samples": 10, "context": {"min": 0, "max": 8, "log": True}}}, "min > 0"),
    ({"random": {"samples": 0, "batch": [1]}}, "random.samples"),
    ({"grid": {"batch": [1]}, "random": {"samples": 1, "batch": [1]}}, "exactly one"),
    ({"grid": {"draft_rows": [0, 3]}}, "needs acceptance"),
    ({"base": {"hbm_gbps": -1}, "grid": {"batch": [1]}}, "base.hbm_gbps"),
    ({"base": ["kimi-k3"], "grid": {"batch": [1]}}, "must be a table"),
    ({"random": {"samples": 2, "batch": [1], "axes": {"context": [1]}}}, "not both"),
])
def test_bad_designs_name_the_field(data, needle):
    with pytest.raises(SpecError, match=needle):
        design.from_dict(data)


def test_filtered_points_name_the_constraint():
    d = design.from_dict({"grid": {"devices": [8, 32], "vmem_mib": [4, 64]}, "base": {"ep": 8}})
    got = {(r["devices"], r["vmem_mib"]): r for r in run_design(d, progress=False)["rows"]}
    assert got[8, 64]["constraint"] == "memory" and "does not fit" in got[8, 64]["reason"]
    assert got[32, 4]["constraint"] == "vmem" and "VMEM" in got[32, 4]["reason"]
    ok = got[32, 64]
    assert ok["status"] == "ok" and ok["constraint"] is None and ok["chips"] == 16
    assert ok["tokens_per_s_per_chip"] == pytest.approx(ok["tokens_per_s"] / 16)
    assert ok["resident_bytes_per_device"] < 192e9 / 2  # it fits in one TensorCore's half of the HBM
    layout = run_design(design.from_dict({"grid": {"tp": [5]}}), progress=False)["rows"][0]
    assert layout["constraint"] == "layout" and "tp=5" in layout["reason"]


def test_rows_have_every_column_and_match_predict():
    rows = run_chunk(next(design.chunks(mixed(40), 40)))
    assert all(list(r) == list(COLUMNS) for r in rows)
    assert {r["status"] for r in rows} == {"ok", "filtered"}
    from perfmodel.search.batch import configure
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.spec.loaders import load_model
    from perfmodel.step.predict import predict
    r = next(r for r in rows if r["status"] == "ok")
    d, hw = configure(load_hardware(r["hardware"]), r)
    p = predict(load_model("kimi-k3-mini"), hw, d)
    assert r["step_s"] == p.step_s and r["tokens_per_s"] == p.tokens_per_s


def test_pareto_front_is_exactly_the_undominated_rows():
    import random
    rng = random.Random(1)
    rows = [{"point": i, "token_latency_s": rng.choice([1, 2, 3, 4]) * rng.random(),
             "tokens_per_s_per_chip": rng.random()} for i in range(300)]
    front = pareto(rows)
    dominated = lambda r: any(o["token_latency_s"] <= r["token_latency_s"] and
                              o["tokens_per_s_per_chip"] >= r["tokens_per_s_per_chip"] and
                              (o["token_latency_s"], o["tokens_per_s_per_chip"]) !=
                              (r["token_latency_s"], r["tokens_per_s_per_chip"]) for o in rows)
    assert front and all(not dominated(r) for r in front)
    assert all(dominated(r) for r in rows if r not in front)
    # chunk by chunk gives the same front and top K as all at once
    best = Best(5, "tokens_per_s_per_chip")
    for a in range(0, 300, 37):
        best.add([dict(r, status="ok", model="m") for r in rows[a:a + 37]])
    assert [r["point"] for r in best.summary()["pareto"]] == [r["point"] for r in front]
    assert [r["point"] for r in best.top] == [r["point"] for r in
                                              sorted(rows, key=lambda r: -r["tokens_per_s_per_chip"])[:5]]


def test_parquet_and_csv_hold_the_same_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import csv
    d = mixed(120)
    a = run_design(d, out=str(tmp_path / "r.parquet"), chunk=50, jobs=1, keep_rows=True, progress=False)
    run_design(d, out=str(tmp_path / "r.csv"), chunk=50, jobs=1, progress=False)
    table = pq.read_table(tmp_path / "r.parquet")
    assert table.column_names == list(COLUMNS) and table.to_pylist() == a["rows"]
    with open(tmp_path / "r.csv") as f:
        got = list(csv.DictReader(f))
    assert [int(r["point"]) for r in got] == [r["point"] for r in a["rows"]]
    assert all(float(g["step_s"]) == r["step_s"] for g, r in zip(got, a["rows"]) if r["step_s"] is not None)
    assert sorted(r["point"] for r in a["rows"]) == list(range(120))


def test_a_failed_sweep_leaves_no_file(tmp_path, monkeypatch):
    calls = []

    def flaky(chunk):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("worker lost")
        return run_chunk(chunk)

    monkeypatch.setattr(sweep, "run_chunk", flaky)
    with pytest.raises(RuntimeError):
        run_design(mixed(100), out=str(tmp_path / "r.parquet"), chunk=30, jobs=1, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_cli_design_file_json_is_plain_numbers(capsys, tmp_path):
    f = tmp_path / "d.toml"
    f.write_text('[base]\nmodel = "kimi-k3-mini"\ndevices = 2\n[grid]\nbatch = [1, 4, 16]\n'
                 'vmem_mib = [0.25, 16]\nengine = ["megakernel", "multikernel"]\n')
    assert main(["sweep", "--design", str(f), "--top", "2", "--objective", "step_s", "--json"]) == 0

    def no_nan(x):
        raise AssertionError(f"{x} in JSON")
    out = json.loads(capsys.readouterr().out, parse_constant=no_nan)
    assert out["points"] == 12 and out["ok"] + sum(out["filtered"].values()) == 12
    assert out["filtered"] == {"vmem": 3} and "VMEM" in out["filtered_reason"]["vmem"]
    ok = [r for r in out["rows"] if r["status"] == "ok"]
    assert [r["point"] for r in out["top"]] == [r["point"] for r in sorted(ok, key=lambda r: r["step_s"])[:2]]
    assert out["pareto"] and out["design"]["source"] == "d.toml"
    assert main(["sweep", "--design", str(f)]) == 0
    assert "Pareto front" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["sweep", "--design", "nope.toml"], "file not found"),
    (["sweep", "--vary", "batch=1", "--out", "r.xlsx"], "--out"),
    (["sweep", "--vary", "batch=1", "--address", "ray://x:1"], "needs --executor ray"),
    (["sweep", "--vary", "model=gpt-17"], "gpt-17"),
    (["sweep", "--vary", "batch=1", "--jobs", "0"], "--jobs"),
])
def test_cli_bad_input_exits_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_yaml_design(tmp_path):
    pytest.importorskip("yaml", reason="PyYAML is not installed (YAML sweep files are optional)")
    f = tmp_path / "d.yaml"
    f.write_text("base: {model: kimi-k3-mini, devices: 2}\nrandom:\n  samples: 5\n  axes:\n    batch: [1, 2]\n")
    d = design.load(str(f))
    assert len(d) == 5 and set(d.columns["batch"]) <= {1, 2} and d.base["devices"] == 2


def test_process_pool_matches_one_process(monkeypatch):
    from perfmodel.search import executors
    monkeypatch.setitem(executors.POOL_START_S, "fork", 0.0)  # the pool from the second chunk on
    monkeypatch.setitem(executors.POOL_START_S, "spawn", 0.0)
    d = mixed(200)
    one = run_design(d, jobs=1, chunk=40, progress=False)
    two = run_design(d, jobs=2, chunk=40, progress=False)
    assert two["rows"] == one["rows"] and two["pareto"] == one["pareto"] and two["top"] == one["top"]


def test_a_short_sweep_starts_no_pool(monkeypatch):
    from perfmodel.search import executors
    started = []
    monkeypatch.setattr("concurrent.futures.ProcessPoolExecutor", lambda *a, **k: started.append(1))
    rows = run_design(mixed(40), jobs=2, chunk=10, progress=False)["rows"]
    assert len(rows) == 40 and not started and executors.POOL_START_S["fork"] > 0


@pytest.mark.slow
def test_ray_sweep_of_1000_matches_local():
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'perfmodel[ray]'")
    d = mixed(1000)
    local = run_design(d, jobs=1, chunk=100, progress=False)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        remote = run_design(d, executor="ray", chunk=100, progress=False)
    finally:
        ray.shutdown()
    assert remote["points"] == local["points"] == 1000
    assert remote["rows"] == local["rows"]  # every value, exactly
    assert remote["top"] == local["top"] and remote["pareto"] == local["pareto"]
    assert set(local["filtered"]) == {"vmem", "layout"} and local["ok"] > 400
    assert all(math.isfinite(r["step_s"]) for r in local["rows"] if r["status"] == "ok")


def test_routing_correlation_is_a_sweep_axis(capsys):
    """Identical rows touch top-k experts at any batch: batch 8 then costs far less than independent rows."""
    assert main(["sweep", "--ep", "8", "--vary", "batch=8", "--vary", "routing_correlation=0,1", "--json",
                 "--jobs", "1", "--no-progress"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    independent, identical = sorted(rows, key=lambda r: r["routing_correlation"])
    assert identical["step_s"] < independent["step_s"]
