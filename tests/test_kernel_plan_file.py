"""A kernel's DMA plan as a file (perfmodel.graph.dmaplan.KernelPlan): written by the kernel side
(`python -m perfmodel_kernels.run ... --plan-out`), read by `perfmodel predict --kernel-plan`, its bytes
checked against the op graph, replayed by the engine on a sharded deployment with the kernel's
own settings beside the model's own megakernel."""
import functools
import json

import pytest

from perfmodel.cli.main import main
from perfmodel.graph import ops
from perfmodel.graph.dmaplan import Copy, KernelPlan, load_plan, plan_json, save_plan
from perfmodel.step.explain import kernel_plan_comparison
from perfmodel.step.predict import plan_deployment, plan_model, predict
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.util.errors import SpecError

HW = load_hardware("tpu-v7")
CTX, TP = 48, 2  # a whole number of 16-token cache blocks


@functools.cache
def mini_plan() -> tuple[KernelPlan, dict]:
    """The MINI kernel's plan on device 0 of 2 (tp 2, 2 expert groups), batch 2, as perfmodel_kernels.run
    --plan-out writes it, and the kernel's own count of its padding and vectors."""
    from perfmodel_kernels import layout, plan, shard
    spec = load_model("kimi-k3-mini")
    dspec = shard.device_spec(spec, TP, TP)
    cfg = layout.KernelConfig(batch=2, max_context=64, depth=6, expert_slots=2, cache_block=16)
    g = ops.build(spec, Deployment(devices=TP, tp=TP, ep=TP, batch=2, context=CTX))
    distinct = [round(g.distinct_experts)] * spec.count(ffn="moe")
    copies = plan.dma_plan(dspec, cfg, distinct, [CTX] * 2)
    kp = KernelPlan("kimi-k3-mini", {"devices": TP, "tp": TP, "ep": TP, "batch": 2, "context": CTX},
                    {"bank_bytes": cfg.bank_bytes, "depth": 6, "expert_slots": 2, "wire": "f32", "all_reduce": "rs_ag",
                     "collective_rows": cfg.padded_batch, "expert_feed": "bf16"}, tuple(copies), "test")
    return kp, plan.overhead_bytes(copies)


def test_plan_file_round_trip(tmp_path):
    kp, _ = mini_plan()
    path = tmp_path / "p.json"
    save_plan(path, kp)
    assert load_plan(path) == kp
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


@pytest.mark.parametrize("change,field", [
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d["deployment"].pop("tp"), "deployment.tp"),
    (lambda d: d["kernel"].update(wire=2), "kernel.wire"),
    (lambda d: d["kernel"].update(ring=3), "kernel.ring"),
    (lambda d: d["copies"][3].__setitem__(4, -1), "copies[3].bytes"),
    (lambda d: d["copies"][5].__setitem__(0, 9), "copies[5].order"),
    (lambda d: d["copies"].append([1, 2]), "copies[" ),
])
def test_bad_plan_files_name_the_field(tmp_path, change, field):
    data = plan_json(mini_plan()[0])
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError) as e:
        load_plan(path)
    assert field in e.value.field


def test_plan_bytes_are_the_op_graphs_and_the_kernels_overhead():
    """Device 0's HBM copies = the op graph's static and KV bytes per device and its routed bytes
    for the plan's (whole) distinct experts, plus what the kernel adds (tile padding, small
    vectors); the engine moves exactly them on the sharded deployment."""
    kp, over = mini_plan()
    spec = load_model("kimi-k3-mini")
    d = plan_deployment(kp)
    g = ops.build(spec, d)
    per_expert = g.routed_bytes.max() / g.distinct_experts  # one expert's bytes on this device
    fetched = round(g.distinct_experts) * spec.count(ffn="moe")
    want = g.static_bytes.sum() + g.kv_bytes.sum() + fetched * per_expert + over["padding"] + over["vectors"] + \
        over["cache_window"]
    plan_bytes = sum(c.bytes for c in kp.hbm_copies)
    assert plan_bytes == pytest.approx(want, rel=1e-12)
    assert sum(c.bytes - c.padding for c in kp.hbm_copies
               if c.family in ("kv_cache", "state")) == g.kv_bytes.sum()
    assert predict(spec, HW, d, plan=kp).bytes_per_device == plan_bytes


def test_the_engine_replays_the_kernels_settings():
    """The plan's kernel reduces in f32 over 8 padded rows by reduce-scatter + all-gather: its
    collectives cost more than the model's own megakernel's (bf16, one row, the fastest
    algorithm); its ring is its own banks."""
    kp, _ = mini_plan()
    spec = load_model("kimi-k3-mini")
    km = plan_model(spec, kp)
    assert (km.megakernel.collective_wire, km.megakernel.all_reduce, km.megakernel.bank_bytes,
            km.megakernel.ring_banks) == ("f32", "rs_ag", kp.kernel["bank_bytes"], 6)
    c = kernel_plan_comparison(spec, HW, kp)
    assert c["by_cause_s"]["collective"]["kernel"] > c["by_cause_s"]["collective"]["recipe"]
    rows = {r["what"]: r for r in c["differences"]}
    assert rows["all-reduce"]["kernel"] == "rs_ag" and rows["HBM descriptors per step"]["kernel"] == len(kp.hbm_copies)
    with pytest.raises(SpecError) as e:
        predict(spec, HW, Deployment(devices=TP, tp=TP, ep=TP, batch=4, context=CTX), plan=kp)
    assert e.value.field == "plan.deployment.batch"


def test_cli_prints_both_predictions(tmp_path, capsys):
    kp, _ = mini_plan()
    path = tmp_path / "p.json"
    save_plan(path, kp)
    assert main(["predict", "--kernel-plan", str(path), "--json"]) == 0
    (out,) = json.loads(capsys.readouterr().out)["kernel_plans"]
    assert out["kernel_step_s"] > 0 and out["recipe_step_s"] > 0 and out["plan_source"] == "test"
    assert main(["explain", "--kernel-plan", str(path), "--json"]) == 0
    explained = json.loads(capsys.readouterr().out)
    assert explained["kernel_step_s"] == out["kernel_step_s"] and explained["differences"] == out["differences"]
    import jsonschema
    from pathlib import Path
    schema = json.loads((Path(__file__).parents[1] / "docs" / "json-schema.json").read_text())
    for got in ({"schema_version": 2, "command": "predict", "kernel_plans": [out]}, explained):
        jsonschema.validate(got, {**schema, "$ref": f"#/$defs/{got['command']}"})
    path.write_text("{")
    assert main(["predict", "--kernel-plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON" in err and len(err.strip().splitlines()) == 1


def test_a_copy_record_without_the_new_fields_is_a_plain_hbm_copy():
    c = Copy(0, 1, "attention", "q", 10)
    assert (c.padding, c.peer, c.collective) == (0, -1, "")
