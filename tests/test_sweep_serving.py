"""Design search under latency targets: serving points (a rate or a concurrency) are serving
simulations, filtered by TTFT / TPOT / E2E percentile constraints, ranked by tokens/s per chip."""
import json
from pathlib import Path

import pytest

from perfmodel.cli.main import main
from perfmodel.search import design
from perfmodel.search.batch import COLUMNS, run_chunk
from perfmodel.search.sweep import run_design
from perfmodel.serve.scheduler import Scheduler
from perfmodel.serve.simulate import simulate
from perfmodel.serve.workload import Lengths, Workload
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.util.errors import SpecError

SERVING = {"base": {"model": "llama-3.2-1b", "hardware": "h100", "engine": "multikernel", "requests": 150,
                    "input_len": 512, "output_len": 64},
           "grid": {"devices": [1, 2], "concurrency": [1, 16, 128]},
           "constraints": {"ttft_p90_s": 0.1, "tpot_p90_s": 0.004}}


def test_serving_rows_are_the_simulation_and_constraints_filter():
    d = design.from_dict(SERVING)
    out = run_design(d, jobs=1, progress=False)
    rows = {(r["devices"], r["concurrency"]): r for r in out["rows"]}
    r = rows[1, 16]
    sim = simulate(load_model("llama-3.2-1b"), load_hardware("h100"), Deployment(devices=1, tp=1, engine="multikernel"),
                   Workload(150, Lengths(512, 512), Lengths(64, 64), concurrency=16), Scheduler()).json(series=False)
    assert r["tokens_per_s_per_chip"] == pytest.approx(sim["tokens_per_s_per_chip"])
    assert r["ttft_p90_s"] == pytest.approx(sim["ttft_s"]["p90"]) and r["tpot_p99_s"] == pytest.approx(sim["tpot_s"]["p99"])
    assert r["token_latency_s"] == pytest.approx(sim["tpot_s"]["p50"])
    for row in out["rows"]:
        over = [c for c, lim in SERVING["constraints"].items() if row[c] > lim]
        assert (row["status"] == "filtered") == bool(over)
        if over:
            assert row["constraint"] == over[0].split("_")[0]
    assert out["filtered"] and out["top"]
    best = max((r for r in out["rows"] if r["status"] == "ok"), key=lambda r: r["tokens_per_s_per_chip"])
    assert out["top"][0]["point"] == best["point"]
    assert set(COLUMNS) >= set(design.CONSTRAINTS)


def test_disaggregated_points_in_a_design():
    d = design.from_dict({"base": {**SERVING["base"], "devices": 1, "concurrency": 8},
                          "grid": {"prefill_devices": [1]}})
    (row,) = run_design(d, jobs=1, progress=False)["rows"]
    assert row["status"] == "ok" and row["chips"] == 2


def test_constraints_need_traffic_and_known_names():
    with pytest.raises(SpecError, match="need serving traffic"):
        design.from_dict({"grid": {"batch": [1]}, "constraints": {"ttft_p90_s": 1}})
    with pytest.raises(SpecError, match="unknown constraint"):
        design.from_dict({**SERVING, "constraints": {"ttft_p95_s": 1}})
    with pytest.raises(SpecError, match="seconds > 0"):
        design.from_dict({**SERVING, "constraints": {"ttft_p90_s": -1}})


def test_cli_constraint_flag_and_json(capsys, tmp_path):
    from test_cli import check_schema
    f = tmp_path / "d.toml"
    f.write_text('[base]\nmodel = "llama-3.2-1b"\nhardware = "h100"\nengine = "multikernel"\ndevices = 1\n'
                 'requests = 100\ninput_len = 256\noutput_len = 32\n[grid]\nconcurrency = [1, 64]\n')
    assert main(["sweep", "--design", str(f), "--constraint", "tpot_p90_s=0.0025", "--json", "--jobs", "1",
                 "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    check_schema(out)
    assert out["design"]["constraints"] == {"tpot_p90_s": 0.0025}
    assert [r["status"] for r in sorted(out["rows"], key=lambda r: r["concurrency"])] == ["ok", "filtered"]
    assert main(["sweep", "--design", str(f), "--constraint", "ttft=1"]) == 2


def test_run_chunk_carries_the_constraints():
    d = design.from_dict(SERVING)
    chunk = next(design.chunks(d, 2))
    assert chunk.constraints == SERVING["constraints"]
    assert len(run_chunk(chunk)) == 2


@pytest.mark.slow
def test_ray_serving_sweep_matches_local():
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'perfmodel[ray]'")
    d = design.from_dict(SERVING)
    local = run_design(d, jobs=1, chunk=2, progress=False)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        remote = run_design(d, executor="ray", chunk=2, progress=False)
    finally:
        ray.shutdown()
    assert remote["rows"] == local["rows"] and remote["top"] == local["top"]


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "experiments" / "designs").glob("*.toml")),
                         ids=lambda p: p.stem)
def test_shipped_designs_load_from_their_files(path):
    """Every design file the experiments run loads through the schema, its [constraints] included."""
    d = design.load(str(path))
    assert d.axes
    if "serve" in path.stem:
        assert d.constraints
