"""The serving simulator end to end: Little's law on its output, determinism under a seed,
arrival processes, trace files, KV capacity, disaggregated pools, the CLI and its JSON."""
import dataclasses
import json

import numpy as np
import pytest

from perfmodel.cli.main import main
from perfmodel.serve.costs import StepCosts, bracket
from perfmodel.serve.kv import kv_cache, weight_bytes_per_device
from perfmodel.serve.scheduler import Scheduler
from perfmodel.serve.simulate import kv_transfer_s, simulate
from perfmodel.serve.workload import Lengths, Workload, read_trace
from perfmodel.spec.deployment import Deployment, cache_bytes_per_seq
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.util.errors import SpecError
from test_cli import check_schema

M, HW = load_model("llama-3.2-1b"), load_hardware("h100")
D = Deployment(devices=1, tp=1, engine="multikernel")


def run(**kw):
    w = Workload(kw.pop("requests", 400), Lengths(*kw.pop("input", (256, 1024))), Lengths(*kw.pop("output", (16, 128))),
                 kw.pop("rate", None), kw.pop("concurrency", None), seed=kw.pop("seed", 3))
    return simulate(M, HW, kw.pop("d", D), w, **kw)


@pytest.mark.parametrize("kw", [{"rate": 30.0}, {"concurrency": 16},
                                {"rate": 200.0, "scheduler": Scheduler(memory_utilization=0.04)}])
def test_littles_law(kw):
    """L = lambda W: the time-average number of requests the pools hold (integrated from their
    queues step by step) equals throughput x mean latency (from each request's timestamps);
    both sides are computed independently, over a run that starts and ends empty."""
    r = run(**kw)
    ll = r.json(series=False)["littles_law"]
    assert ll["in_system_mean"] == pytest.approx(ll["throughput_x_mean_e2e"], rel=1e-9)
    assert ll["in_system_mean"] > 1
    if "scheduler" in kw:
        assert r.preemptions.sum() > 0  # the KV cache ran out and requests were recomputed


def test_every_request_completes_in_order_of_its_events():
    r = run(rate=50.0, scheduler=Scheduler(memory_utilization=0.04))
    assert np.all(r.arrival_s <= r.first_token_s) and np.all(r.first_token_s <= r.finish_s)
    assert np.all(np.isfinite(r.finish_s))
    assert r.json()["throughput_tokens_per_s"] == pytest.approx(r.output_len.sum() / r.duration_s)


def test_deterministic_under_a_seed():
    a, b, c = run(rate=20.0, seed=7), run(rate=20.0, seed=7), run(rate=20.0, seed=8)
    assert json.dumps(a.json()) == json.dumps(b.json())
    assert json.dumps(a.json()) != json.dumps(c.json())


def test_poisson_arrivals_at_the_rate():
    w = Workload(20000, Lengths(10, 10), Lengths(1, 1), rate=5.0, seed=1)
    _, _, t = w.draw()
    gaps = np.diff(np.r_[0.0, t])
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=3 / np.sqrt(len(gaps)))  # 3 sigma
    assert np.std(gaps) == pytest.approx(gaps.mean(), rel=0.05)  # exponential: sd = mean


def test_closed_loop_keeps_the_concurrency():
    r = run(concurrency=8, requests=200)
    series = r.pools[0].series
    assert max(s[2] + s[3] for s in series) == 8  # running + waiting never above the clients
    assert 7.5 < r.in_system_mean <= 8  # L = N, but for the drain at the end


def test_throughput_follows_the_offered_load_below_saturation():
    r = run(rate=5.0, requests=300, input=(512, 512), output=(64, 64))
    assert r.json()["requests_per_s"] == pytest.approx(5.0, rel=0.15)


def test_kv_capacity_from_memory_left_after_weights():
    kv = kv_cache(M, HW, D)
    assert kv.capacity_bytes == pytest.approx(0.9 * HW.core_hbm_bytes - weight_bytes_per_device(M, D))
    assert weight_bytes_per_device(M, D) == pytest.approx(M.weight_bytes(), rel=1e-6)
    assert kv.bytes_for(17) == pytest.approx(cache_bytes_per_seq(M, 32, 1))  # two blocks of 16
    with pytest.raises(SpecError, match="no room for a KV cache"):
        kv_cache(load_model("llama-3.3-70b"), HW, D)


def test_a_request_larger_than_the_cache_is_refused():
    with pytest.raises(SpecError, match="exceeds"):
        run(rate=1.0, requests=3, input=(3_000_000, 3_000_000), output=(10, 10))


def test_step_costs_interpolate_between_grid_shapes():
    assert bracket(16) == (16, 16, 0.0) and bracket(20) == (20, 20, 0.0) and bracket(22) == (20, 24, 0.5)
    c = StepCosts(M, HW, D)
    lo, hi, mid = c.seconds(80, 1024), c.seconds(96, 1024), c.seconds(88, 1024)
    assert mid == pytest.approx((lo + hi) / 2)
    from perfmodel.step.prefill import step_cost
    from perfmodel.graph.prefill import StepShape
    exact = step_cost(M, HW, D, StepShape(88, 1024)).step_s
    assert mid == pytest.approx(exact, rel=0.01)  # decode steps are close to linear in the rows


def test_disaggregated_pools_and_the_kv_transfer():
    pre = Deployment(devices=1, tp=1, engine="multikernel")
    r = run(rate=20.0, requests=200, d=dataclasses.replace(D, devices=1), prefill=pre)
    j = r.json()
    assert [p["role"] for p in j["pools"]] == ["prefill", "decode"] and j["chips"] == 2
    one = kv_transfer_s(M, HW, pre, D, 1000)
    assert one == pytest.approx(HW.link_latency_s + cache_bytes_per_seq(M, 1000, 1) / HW.link_bandwidth_bytes_per_s)
    assert j["pools"][0]["mean_decode_rows"] == 0  # the prefill pool only prefills
    assert j["kv_transfer_s_mean"] > 0
    assert j["littles_law"]["in_system_mean"] == pytest.approx(j["littles_law"]["throughput_x_mean_e2e"], rel=1e-9)


def test_trace_files(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("ContextTokens,GeneratedTokens,arrival_s\n100,5,0\n200,7,0.5\n300,9,0.5\n")
    t = read_trace(str(f))
    assert t.input_len.tolist() == [100, 200, 300] and t.arrival_s.tolist() == [0, 0.5, 0.5]
    inp, out, arr = Workload(3, trace=t).draw()
    assert inp.tolist() == [100, 200, 300] and out.tolist() == [5, 7, 9] and arr.tolist() == [0, 0.5, 0.5]
    j = tmp_path / "t.jsonl"
    j.write_text('{"input_len": 10, "output_len": 2}\n{"input_len": 20, "output_len": 3}\n')
    inp, out, arr = Workload(5, trace=read_trace(str(j)), rate=2.0).draw()
    assert inp.tolist() == [10, 20, 10, 20, 10] and len(arr) == 5  # rows cycled, Poisson arrivals
    for text, needle in [("input_len,output_len\n10,x\n", "output_len"), ("a,b\n1,2\n", "needs a column"),
                         ("input_len,output_len,arrival_s\n1,1,2\n1,1,1\n", "non-decreasing"),
                         ("input_len,output_len\n1.5,2\n", "input_len")]:
        f.write_text(text)
        with pytest.raises(SpecError, match=needle):
            read_trace(str(f))


def test_lengths_parse():
    assert Lengths.parse("128", "--input-len") == Lengths(128, 128)
    assert Lengths.parse("10:20", "--input-len") == Lengths(10, 20)
    for bad in ("0", "20:10", "x", "1:"):
        with pytest.raises(SpecError, match="--input-len"):
            Lengths.parse(bad, "--input-len")


def test_cli_serve_json(capsys):
    argv = ["serve", "--model", "llama-3.2-1b", "--hardware", "h100", "--devices", "1", "--engine", "multikernel",
            "--requests", "200", "--rate", "10", "--input-len", "256:512", "--output-len", "32", "--seed", "1", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    check_schema(out)
    for k in ("ttft_s", "tpot_s", "e2e_s"):
        assert set(out[k]) >= {"p50", "p90", "p99"} and out[k]["p50"] <= out[k]["p90"] <= out[k]["p99"]
    assert out["throughput_tokens_per_s"] > 0 and out["pools"][0]["kv"]["series"]["t_s"]


def test_cli_serve_disaggregated_with_comparison(capsys):
    argv = ["serve", "--model", "llama-3.2-1b", "--hardware", "h100", "--devices", "1", "--engine", "multikernel",
            "--requests", "100", "--concurrency", "8", "--prefill-devices", "1", "--compare-aggregated", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    check_schema(out)
    assert out["aggregated"]["devices"] == 2 and out["chips"] == 2


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--rate", "1", "--concurrency", "2"], "not allowed with"),
    (["serve", "--model", "llama-3.2-1b", "--hardware", "h100", "--devices", "1"], "--rate"),
    (["serve", "--model", "llama-3.2-1b", "--hardware", "h100", "--devices", "1", "--rate", "1", "--input-len", "5:1"],
     "--input-len"),
    (["serve", "--model", "llama-3.2-1b", "--hardware", "h100", "--devices", "1", "--rate", "1", "--prefill-tp", "2"],
     "--prefill-devices"),
    (["serve", "--model", "llama-3.2-1b", "--hardware", "h100", "--devices", "1", "--rate", "1", "--trace", "/nope.csv"],
     "--trace"),
])
def test_cli_serve_bad_input(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_serving_curves_for_a_layout():
    import perfmodel
    c = perfmodel.serving_curves(M, HW, D, loads=[2, 40, 400], input_len=512, output_len=64, requests=300)
    pts = c["points"]
    assert [p["load"] for p in pts] == [2, 40, 400] and c["chips"] == 1
    assert pts[0]["ttft_s"]["p90"] < pts[-1]["ttft_s"]["p90"]  # queueing grows with the load
    assert pts[0]["throughput_tokens_per_s"] < pts[1]["throughput_tokens_per_s"]
    assert not pts[0]["saturated"] and pts[-1]["saturated"]  # 400 requests/s is more than one H100 serves
    closed = perfmodel.serving_curves(M, HW, D, loads=[1, 8], arrivals="concurrency", requests=100)
    assert closed["points"][1]["tokens_per_s_per_chip"] > closed["points"][0]["tokens_per_s_per_chip"]


@pytest.mark.parametrize("traffic", [["--concurrency", "4"], ["--rate", "5"]])
def test_cli_serve_text(capsys, traffic):
    argv = ["serve", "--model", "llama-3.2-1b", "--hardware", "h100", "--devices", "1", "--engine", "multikernel",
            "--requests", "50", "--no-progress", *traffic]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "TTFT s" in out and "TPOT ms" in out and "Little's law" in out
