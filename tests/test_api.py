"""The documented Python API (docs/api.md): every name resolves, `import perfmodel` is cheap,
and the example runs."""
import subprocess
import sys

import pytest

import perfmodel


def test_every_api_name_resolves():
    for name in perfmodel.__all__:
        assert getattr(perfmodel, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        perfmodel.nope


def test_import_perfmodel_loads_no_numpy():
    code = "import sys, perfmodel; assert 'numpy' not in sys.modules, 'numpy'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_documented_example():
    model, chip = perfmodel.load_model("kimi-k3"), perfmodel.load_hardware("tpu-v7")
    d = perfmodel.Deployment(devices=32, tp=32, ep=8, engine="megakernel", batch=1, context=4096)
    p = perfmodel.predict(model, chip, d)
    assert 0 < p.step_s < 1 and p.tokens_per_s == pytest.approx(1 / p.step_s)
    e = perfmodel.explain(model, chip, d, layer=4)
    assert e["layer_time_s"] == pytest.approx(p.layers[4].time_s)
    rows = perfmodel.sweep(model, chip, d, {"batch": [1, 8]})
    assert rows[0]["step_s"] == pytest.approx(p.step_s) and rows[1]["tokens_per_s"] > rows[0]["tokens_per_s"]
    with pytest.raises(perfmodel.SpecError) as err:
        perfmodel.Deployment(devices=32, tp=3)
        perfmodel.predict(model, chip, perfmodel.Deployment(devices=32, tp=3))
    assert err.value.field == "tp"
