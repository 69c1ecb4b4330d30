"""`perfmodel explain` and the dashboard's Explain view."""
import json

import pytest

from streamlit.testing.v1 import AppTest

from perfmodel.cli.main import main


def test_explain_routed_experts_names_mechanisms_and_the_resource(capsys):
    # batch 8 with two expert slots: the experts' copies cannot keep ahead of their dots (with the
    # kernel's slots tpu-v7's DMA engine lands them before the dots reach them)
    assert main(["explain", "--ep", "8", "--layer", "4", "--op", "routed_experts", "--batch", "8",
                 "--expert-slots", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (op,) = out["ops"]
    assert op["routed_bytes"] > 0 and op["flops"] > 0
    mechanisms = {t["mechanism"]: t for t in op["terms"]}
    assert {"components.matmul_time", "components.dma_stream_time"} <= set(mechanisms)
    assert set(mechanisms) == {"components.matmul_time", "components.dma_stream_time"}  # no whole-step term
    assert "mxfp4 fed as fp8 its fallback" in mechanisms["components.matmul_time"]["term"]
    assert "16 LHS rows per batch row" in mechanisms["components.matmul_time"]["term"]
    assert "descriptors" in mechanisms["components.dma_stream_time"]["term"]
    assert "fitted by perfmodel calibrate" in mechanisms["components.matmul_time"]["source"]
    assert op["waited_on"].startswith("DMA engine (routed experts")


def test_explain_collective_shows_its_algorithm(capsys):
    assert main(["explain", "--ep", "8", "--layer", "4", "--op", "attn_all_reduce", "--json"]) == 0
    (term,) = json.loads(capsys.readouterr().out)["ops"][0]["terms"]
    # 32 devices on 4 hosts, 14 KB: one-shot within each host, then across hosts
    assert term["mechanism"] == "components.collective_time" and "one_shot" in term["term"]
    assert "2 phases" in term["term"]


@pytest.mark.parametrize("batch,algorithm", [(4, "one_shot: the model's kernel"), (8, ": the fastest for the payload")])
def test_explain_names_the_kernels_own_all_reduce(capsys, batch, algorithm):
    """Kimi K3's megakernel scatters tokens only at 8 rows: at batch 4 its 57 KB all-reduce is
    one-shot although a shard algorithm would be faster; at batch 8 the fastest is taken."""
    assert main(["explain", "--ep", "8", "--batch", str(batch), "--layer", "4", "--op", "moe_all_reduce",
                 "--json"]) == 0
    (term,) = json.loads(capsys.readouterr().out)["ops"][0]["terms"]
    assert algorithm in term["term"]


def test_explain_unknown_op_is_one_line(capsys):
    assert main(["explain", "--ep", "8", "--layer", "4", "--op", "nope"]) == 2
    err = capsys.readouterr().err
    assert "routed_experts" in err and len(err.strip().splitlines()) == 1


def test_dashboard_explain_view_renders():
    at = AppTest.from_file("../dashboards/app.py", default_timeout=120)
    at.run()
    at.sidebar.radio(key="view").set_value("Explain").run()
    at.text_input(key="ex_layer").input("4").run()
    assert not at.exception and not at.error
    terms = [md.value for md in at.markdown if md.value.startswith("| op |")]  # a static markdown table
    assert not at.dataframe and len(terms) == 1  # the terms; the ops on demand
    assert "| routed\\_experts |" in terms[0]  # underscores escaped (pmdash.common.static_table)
