"""perfmodel: decode performance of LLMs on TPU v7, GB200 and other chips, from physics.

The Python API (docs/api.md); each name is imported on first use, so `import perfmodel` is cheap:

    import perfmodel
    model = perfmodel.load_model("kimi-k3")            # a preset, a .toml or an HF config.json
    chip = perfmodel.load_hardware("tpu-v7")           # a preset or a .toml
    d = perfmodel.Deployment(devices=32, tp=32, ep=8, batch=1)
    p = perfmodel.predict(model, chip, d)               # step_s, tokens_per_s, layers, breakdown_s
    perfmodel.explain(model, chip, d, layer=4)          # one layer term by term
    perfmodel.sweep(model, chip, d, {"batch": [1, 8]})  # every combination of the axes
    perfmodel.prefill(model, chip, d, prompt=4096).ttft_s   # time to first token of a prompt
    perfmodel.serving_curves(model, chip, d, loads=[1, 2, 4])  # TTFT / TPOT / throughput vs load
"""
from __future__ import annotations

import importlib

# public name -> (module, attribute)
API = {
    "load_model": ("perfmodel.spec.loaders", "load_model"),
    "load_hardware": ("perfmodel.spec.hardware", "load_hardware"),
    "derive": ("perfmodel.spec.arch", "derive"),
    "Deployment": ("perfmodel.spec.deployment", "Deployment"),
    "SpecDecode": ("perfmodel.spec.deployment", "SpecDecode"),
    "predict": ("perfmodel.step.predict", "predict"),
    "prefetch_gain": ("perfmodel.step.predict", "prefetch_gain"),
    "explain": ("perfmodel.step.explain", "explain"),
    "sweep": ("perfmodel.search.sweep", "sweep"),
    "prefill": ("perfmodel.step.prefill", "prefill"),
    "simulate_serving": ("perfmodel.serve.simulate", "simulate"),
    "serving_curves": ("perfmodel.serve.curves", "load_curves"),
    "Workload": ("perfmodel.serve.workload", "Workload"),
    "Lengths": ("perfmodel.serve.workload", "Lengths"),
    "Scheduler": ("perfmodel.serve.scheduler", "Scheduler"),
    "SpecError": ("perfmodel.util.errors", "SpecError"),
}
__all__ = sorted(API)


def __getattr__(name: str):
    if name not in API:
        raise AttributeError(f"module 'perfmodel' has no attribute {name!r}")
    module, attr = API[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(API))
