"""A GPU serving engine's refusals carry their source, and never refuse what the engine is
published running: every deployment in an inventory's [[published]] list is accepted."""
from __future__ import annotations

import dataclasses

import pytest

from perfmodel.cli.main import main
from perfmodel.spec.deployment import Deployment, validate
from perfmodel.spec.engines import inventory, serving_engines
from perfmodel.spec.formats import get_format
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.predict import predict
from perfmodel.util.errors import SpecError

PUBLISHED = [(e, i) for e in serving_engines() for i in range(len(inventory(e).get("published", [])))]


def published_model(p: dict):
    m = load_model(p["model"])
    formats = {**m.formats, **{k: get_format(v) for k, v in p.get("formats", {}).items()}}
    if "kv_cache" in p:
        formats["kv_cache"] = get_format(p["kv_cache"])
    return dataclasses.replace(m, formats=formats)


def test_every_engine_lists_published_deployments_and_its_rule_source():
    for e in serving_engines():
        inv = inventory(e)
        assert inv.get("published"), e
        assert inv["sources"]["block_splits"], e


@pytest.mark.parametrize("engine,i", PUBLISHED, ids=[f"{e}-{i}" for e, i in PUBLISHED])
def test_published_deployments_are_accepted(engine, i):
    p = inventory(engine)["published"][i]
    model, hw = published_model(p), load_hardware(p["hardware"])
    d = Deployment(devices=p["devices"], tp=p["tp"], ep=p.get("ep"), engine="multikernel", serving_engine=engine)
    validate(model, hw, d)
    assert predict(model, hw, d).step_s > 0


def test_qwen35_fp8_tp8_on_sglang(tmp_path, capsys):
    """The published FP8 checkpoint keeps Gated DeltaNet's beta / alpha projection in bf16, and SGLang
    and vLLM serve it at TP8; the KV projections (2 heads) are replicated, not split 8 ways."""
    (tmp_path / "q.toml").write_text('base = "qwen3.5-397b-a17b"\nname = "q-fp8"\n[formats]\n'
                                     'attention = "fp8-block128"\ndense_ffn = "fp8-block128"\n'
                                     'shared_expert = "fp8-block128"\nrouted_expert = "fp8-block128"\n')
    for engine in ("sglang", "vllm"):
        assert main(["predict", "--model", str(tmp_path / "q.toml"), "--hardware", "h100", "--devices", "8", "--tp", "8",
                     "--engine", "multikernel", "--serving-engine", engine]) == 0
    m = load_model(str(tmp_path / "q.toml"))
    layer = next(l for l in m.layers if l.attention == "gdn")
    fmt = {mm.name: m.matmul_format(mm).name for mm in m.layer_matmuls(layer)}
    assert fmt["beta_alpha_proj"] == "bf16" and fmt["q_proj"] == "fp8-block128"
    bf16 = {mm.name: load_model("qwen3.5-397b-a17b").matmul_format(mm).name for mm in m.layer_matmuls(layer)}
    assert bf16["beta_alpha_proj"] == "bf16"


def test_a_refusal_names_its_source():
    m = dataclasses.replace(load_model("qwen3-235b-a22b"), formats={**load_model("qwen3-235b-a22b").formats,
                                                                   "routed_expert": get_format("fp8-block128")})
    d = Deployment(devices=8, tp=8, ep=1, engine="multikernel", serving_engine="sglang")
    with pytest.raises(SpecError) as e:
        validate(m, load_hardware("h200"), d)
    assert e.value.field == "ep" and "source:" in e.value.why and "block_n" in e.value.why
