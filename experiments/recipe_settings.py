"""What each of a kernel's own choices ([megakernel] settings) does to the predicted step, against a
generic megakernel (no [megakernel] table: every field at its default, docs/models.md):

    python experiments/recipe_settings.py [--model muse-spark] [--batch 1,8]

For the profiled model (Muse Spark on one TPU7x host, TP8, the phase profile's deployment at its
larger group of timed steps) it predicts the generic kernel, each setting of the preset's table
alone on top of it, and the preset's whole table, at each batch, and prints the step and each
setting's change. The settings interact (the whole is not the sum of the rows). `expert_groups`
is left out: it only chooses a command's --ep default, and the deployment here gives its ep.
A model file written without the table is predicted as the generic kernel: for Muse Spark that
is the row a user gets without `base = "muse-spark"`.
"""
import argparse
import dataclasses

from perfmodel.engine import megakernel_sim
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.spec.recipe import Megakernel, from_table, to_table
from perfmodel.step.phases import load_profile, profile_deployment
from perfmodel.step.predict import predict
from perfmodel.step.report import table

SKIPPED = ("expert_groups",)  # a deployment default, not a cost


def settings_effect(model_name: str, batches: tuple[int, ...]) -> dict:
    """{"generic": {batch: step s}, "whole": {...}, "settings": {name: (value, {batch: step s})}}."""
    model, hw = load_model(model_name), load_hardware("tpu-v7")
    base = profile_deployment(load_profile("musespark"))
    step = lambda m, b: predict(m, hw, dataclasses.replace(base, batch=b)).step_s
    generic = dataclasses.replace(model, megakernel=Megakernel())
    chosen = {k: v for k, v in to_table(model.megakernel).items() if k not in SKIPPED}
    return {"generic": {b: step(generic, b) for b in batches}, "whole": {b: step(model, b) for b in batches},
            "settings": {k: (v, {b: step(dataclasses.replace(model, megakernel=from_table({k: v})), b)
                                 for b in batches}) for k, v in chosen.items()}}


def rows(out: dict, batches: tuple[int, ...], value=str) -> list[list[str]]:
    """settings_effect's table: the generic step, each setting's step and change against it, the
    whole table's; `value` renders a setting's value."""
    g = out["generic"]
    rel = lambda steps: [f"{1e3 * steps[b]:.3f} ({100 * (steps[b] / g[b] - 1):+.1f} %)" for b in batches]
    return ([["generic megakernel", "-"] + [f"{1e3 * g[b]:.3f}" for b in batches]]
            + [[k, value(v)] + rel(steps) for k, (v, steps) in out["settings"].items()]
            + [["all of them (the preset)", "-"] + rel(out["whole"])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="muse-spark")
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    a = ap.parse_args()
    batches = tuple(int(b) for b in a.batch.split(","))
    megakernel_sim.compile_loops()
    print(f"{a.model} on tpu-v7, step ms (change against the generic megakernel)")
    print(table(["setting alone", "value"] + [f"batch {b}" for b in batches],
                rows(settings_effect(a.model, batches), batches)))


if __name__ == "__main__":
    main()
