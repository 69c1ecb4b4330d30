"""The design sweep's rows as a user gets them (chunks cut at op-graph boundaries, the forked
local pool, the Parquet file) equal the unbatched prediction of each configuration."""
import subprocess
import sys
from pathlib import Path

import pytest

from perfmodel.search import batch, design
from perfmodel.search.batch import COLUMNS, RESULTS
from perfmodel.search.design import _cuts
from perfmodel.search.sweep import run_design
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.predict import predict
from perfmodel.util.errors import SpecError

ROOT = Path(__file__).resolve().parent.parent
CAUSE_COLUMNS = {f"{c}_s" for c in batch.BREAKDOWN}
DESIGN = ROOT / "experiments" / "designs" / "kimi-k3-tpu-v7-10k.toml"


def test_rows_of_the_10k_design_equal_predict(tmp_path, monkeypatch):
    """300 configurations of the benchmark's design (its axes, fewer samples), small chunks so
    that op graphs span chunk limits, two workers and a Parquet file: every row is the scalar
    `predict` of its settings, or the SpecError it raises (filtered, same reason)."""
    pq = pytest.importorskip("pyarrow.parquet")
    import dataclasses
    from perfmodel.search import executors
    monkeypatch.setitem(executors.POOL_START_S, "fork", 0.0)  # workers from the second chunk on
    d = dataclasses.replace(design.load(str(DESIGN)), samples=300)
    out = tmp_path / "rows.parquet"
    s = run_design(d, jobs=2, chunk=16, out=str(out), keep_rows=True, progress=False)
    rows = s["rows"]
    assert pq.read_table(out).to_pylist() == rows
    assert sorted(r["point"] for r in rows) == list(range(300))
    assert {r["constraint"] for r in rows} == {None, "vmem", "memory"}
    model, chip = load_model("kimi-k3"), load_hardware("tpu-v7")
    for r in rows:
        dep, hw = batch.configure(chip, r)
        try:
            p = predict(model, hw, dep)
        except SpecError as e:
            assert r["status"] == "filtered" and r["reason"] == str(e), r
            continue
        assert r["status"] == "ok", r
        want = batch._row(model, dep, hw, p)
        for k in RESULTS:  # the cause totals are summed in another order (last bits)
            assert r[k] == (pytest.approx(want[k], rel=1e-12, abs=0) if k in CAUSE_COLUMNS else want[k]), (k, r["point"])


def test_chunks_end_at_op_graph_boundaries():
    d = design.from_dict({"random": {"samples": 500, "seed": 3, "axes": {
        "batch": [1, 2, 4], "context": [1024, 2048], "prefetch_mib": [4, 8], "expert_slots": [1, 2]}}})
    parts = list(design.chunks(d, 64))
    graph = lambda i: (d.columns["batch"][i], d.columns["context"][i])
    runs = {}
    for i in range(len(d)):
        runs[graph(i)] = runs.get(graph(i), 0) + 1
    for c in parts:
        assert 0 < len(c.points) <= 64
        if len({graph(i) for i in c.points}) > 1:  # several graphs: each of them whole
            assert all(sum(graph(i) == g for i in c.points) == runs[g] for g in {graph(i) for i in c.points})
    assert sorted(i for c in parts for i in c.points) == list(range(len(d)))
    assert [graph(i) for c in parts for i in c.points] == sorted(graph(i) for i in range(len(d)))


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_cuts_split_only_runs_longer_than_a_chunk(size):
    keys = list("aaabccccccdeeff")
    cuts = list(_cuts(keys, size))
    assert [i for a, b in cuts for i in range(a, b)] == list(range(len(keys)))
    for a, b in cuts:
        assert 0 < b - a <= size
        if b < len(keys) and keys[b] == keys[b - 1]:  # cut inside a run: the chunk is all that run
            assert set(keys[a:b]) == {keys[b - 1]}


def test_parquet_rows_without_pandas(tmp_path):
    """Writing Parquet rows does not import pandas (pyarrow's converters from Python objects do)."""
    pytest.importorskip("pyarrow")
    code = ("import sys; from perfmodel.search.sweep import RowFile\n"
            f"with RowFile({str(tmp_path / 'r.parquet')!r}) as f:\n"
            "    f.write([dict.fromkeys(" + repr(list(COLUMNS)) + ") | {'point': 1, 'status': 'ok', 'step_s': 1.5}])\n"
            "assert 'pandas' not in sys.modules\n"
            "import pyarrow.parquet as pq; t = pq.read_table(" + repr(str(tmp_path / "r.parquet")) + ").to_pylist()\n"
            "assert t[0]['point'] == 1 and t[0]['step_s'] == 1.5 and t[0]['batch'] is None, t")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
