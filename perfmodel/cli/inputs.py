"""The arguments every deployment-taking command shares (model, hardware, layout, engine, ring,
slots, routing, speculative decoding) and the model, hardware and Deployment they name."""
from __future__ import annotations

import argparse
import dataclasses

from perfmodel.cli.args import context, count, integer, mib, nonnegative, number, positive, skew
from perfmodel.spec import hardware, loaders
from perfmodel.spec.deployment import ENGINES, Deployment, SpecDecode, resident_bytes_per_device, validate
from perfmodel.spec.formats import get_format
from perfmodel.step.report import deployment_json
from perfmodel.util.errors import SpecError, require


def routing_arg(text: str) -> float:
    named = {"independent": 0.0, "identical": 1.0}
    return named[text] if text in named else number(text, hi=1.0)


FEWEST_DEVICES = ("the fewest, a power of two, whose memory the weights and the largest batch's caches fill "
                  "to at most 90 %%")


def add_deployment_args(p: argparse.ArgumentParser, devices_default: str = FEWEST_DEVICES) -> None:
    p.add_argument("--model", default="kimi-k3", help="preset name or .toml / config.json path")
    p.add_argument("--hardware", default="tpu-v7", help="preset name or .toml path")
    p.add_argument("--devices", type=count, default=None,
                   help=f"JAX devices (TPU v7: 2 per chip) or GPUs (default: {devices_default})")
    p.add_argument("--tp", type=count, default=None, help="tensor parallel degree (default: devices)")
    p.add_argument("--ep", type=count, default=None,
                   help="expert-parallel groups (default: 1 with --serving-engine, as the engines split every "
                        "expert over the tp ranks unless told otherwise; the megakernel's own where the model's "
                        "[megakernel] table names it and it divides the devices; else devices)")
    p.add_argument("--engine", choices=ENGINES, default="megakernel")
    p.add_argument("--context", type=context, default=4096, help="tokens already in each sequence's cache")
    p.add_argument("--prefetch-mib", type=mib, default=None,
                   help="megakernel ring depth in MiB (default: half the on-chip buffer)")
    p.add_argument("--expert-slots", type=count, default=None,
                   help="megakernel expert buffers (default: as many as fit, at most top-k)")
    p.add_argument("--vmem-mib", type=mib, default=None,
                   help="override the on-chip buffer per core (VMEM / shared memory), MiB")
    p.add_argument("--routing-skew", type=skew, default=None,
                   help="Zipf exponent of expert popularity (default: the model preset's)")
    p.add_argument("--routing", dest="routing_correlation", type=routing_arg, default=None,
                   help="rows of a batch: independent, identical (every row the same experts) or a "
                        "correlation in [0, 1] (default: the model preset's)")
    p.add_argument("--steps-per-call", type=count, default=1,
                   help="decode steps one device call runs (its host dispatch is shared by them)")
    p.add_argument("--draft-rows", type=lambda t: integer(t, 0), default=0,
                   help="speculative decoding: drafted rows per step")
    acc = p.add_mutually_exclusive_group()
    acc.add_argument("--acceptance-length", type=positive, default=None, help="tokens per step (tau)")
    acc.add_argument("--acceptance-prob", type=nonnegative, default=None, help="per-token acceptance a")
    p.add_argument("--draft-cost", type=lambda v: number(v, hi=100), default=None,
                   help=f"drafter time / verification time (default {SpecDecode.draft_cost_fraction})")
    p.add_argument("--serving-engine", choices=("vllm", "sglang", "trtllm"), default=None,
                   help="GPU multi-kernel engine whose measured kernels to replay (docs/gpu.md)")
    p.add_argument("--attention-dp", type=count, default=None,
                   help="attention data-parallel replicas (tp = devices / (attention-dp x pp) unless given)")
    p.add_argument("--pp", type=count, default=1, help="pipeline-parallel stages")
    p.add_argument("--kv-cache", default=None,
                   help="store the KV cache in this format (e.g. fp8-kv, as vLLM's --kv-cache-dtype fp8; "
                        "default: the model's)")
    p.add_argument("--ep-comm", dest="moe_comm", choices=("all_reduce", "all_to_all"), default="all_reduce",
                   help="how tokens reach the experts: all-reduce (replicated / gathered) or all-to-all (DeepEP)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def add_prefill_args(p: argparse.ArgumentParser, prompt: bool = True) -> None:
    """Prefill: the prompt (predict's TTFT) and the largest chunk of a prompt one step takes."""
    if prompt:
        p.add_argument("--prompt", type=count, default=None,
                       help="prompt tokens: also predict the time to first token (TTFT) of the batch's prompts")
    p.add_argument("--prefill-chunk", type=count, default=None,
                   help="chunked prefill: at most this many prompt tokens of a sequence per step "
                        "(default: " + ("the whole prompt)" if prompt else "the step's token budget)"))


def load_inputs(a: argparse.Namespace):
    """The model, hardware and deployment the deployment arguments name."""
    model, hw = loaders.load_model(a.model), hardware.load_hardware(a.hardware)
    if a.kv_cache is not None:
        model = dataclasses.replace(model, formats={**model.formats, "kv_cache": get_format(a.kv_cache, "--kv-cache")})
    if a.vmem_mib is not None:
        hw = hw.replace(onchip_bytes=a.vmem_mib * 2**20)
    check_spec_flags(a)
    spec = None
    if a.draft_rows:
        if a.acceptance_length is None and a.acceptance_prob is None:
            raise SpecError("--acceptance-length", None, "speculative decoding needs an acceptance")
        spec = SpecDecode(a.draft_rows, a.acceptance_prob, a.acceptance_length,
                          **({} if a.draft_cost is None else {"draft_cost_fraction": a.draft_cost}))
    kernel_ep = model.megakernel.expert_groups if a.engine == "megakernel" else 0

    def on(devices: int) -> Deployment:
        # the model's kernel's own expert groups where the command names none and they divide the devices
        ep = a.ep or (kernel_ep if kernel_ep and devices % kernel_ep == 0 else None)
        tp = a.tp or devices // ((a.attention_dp or 1) * a.pp) or 1
        if a.attention_dp is not None and tp * a.attention_dp * a.pp != devices:
            raise SpecError("--attention-dp", a.attention_dp,
                            f"tp x attention-dp x pp ({tp} x {a.attention_dp} x {a.pp}) must equal devices ({devices})")
        return Deployment(devices=devices, tp=tp, engine=a.engine, ep=ep,
                          serving_engine=a.serving_engine, pp=a.pp, moe_comm=a.moe_comm,
                          context=a.context, spec=spec, routing_skew=a.routing_skew,
                          routing_correlation=a.routing_correlation, expert_slots=a.expert_slots,
                          steps_per_call=a.steps_per_call,
                          prefetch_bytes=a.prefetch_mib * 2**20 if a.prefetch_mib is not None else None)

    if a.devices is not None:
        return model, hw, on(a.devices)
    batches = getattr(a, "batch", 1)
    unit = (a.tp or 1) * a.pp * (a.attention_dp or 1)  # the device counts the given layout can take
    fields = LAYOUT_FIELDS if a.tp is None else tuple(f for f in LAYOUT_FIELDS if f != "tp")
    return model, hw, fewest_devices(on, model, hw, max(batches) if isinstance(batches, list) else batches,
                                     unit, fields)


MAX_DEFAULT_DEVICES = 2**14
LAYOUT_FIELDS = ("devices", "tp", "ep", "--attention-dp")  # what a device count decides
# the share of a device's memory the default layout fills at most: vLLM's default
# --gpu-memory-utilization (0.9), the rest left to activations, scratch and the runtime
DEFAULT_MEMORY_SHARE = 0.9


def fewest_devices(on, model, hw, batch: int, unit: int = 1, fields=LAYOUT_FIELDS) -> Deployment:
    """The deployment `on(n)` of the fewest devices n, `unit` times a power of two, that validate
    accepts at `batch` (tp and ep divide what they split) and whose weights and caches fill at
    most DEFAULT_MEMORY_SHARE of each device's memory; batch stays the command's own. Errors of a
    field outside `fields` (those no device count mends) are raised at once."""
    n, last = unit, None  # the last memory shortfall: (devices, why)
    while n <= MAX_DEFAULT_DEVICES:
        try:
            d = on(n)
            at = dataclasses.replace(d, batch=batch)
            validate(model, hw, at)
            need, cap = resident_bytes_per_device(model, at), DEFAULT_MEMORY_SHARE * hw.core_hbm_bytes
            require(need <= cap, "devices", n, f"{need / 1e9:.1f} GB per device, over "
                    f"{100 * DEFAULT_MEMORY_SHARE:.0f} % of {hw.name}'s {hw.core_hbm_bytes / 1e9:.1f} GB")
            return d
        except SpecError as e:
            if e.field not in fields:
                raise
            last = (n, e.why if e.field == "devices" else f"{e.field}={e.value}: {e.why}")
        n *= 2
    short = f" (at {last[0]} devices: {last[1]})" if last else ""
    raise SpecError("devices", "default", f"no power of two up to {MAX_DEFAULT_DEVICES} devices holds {model.name} "
                    f"at batch {batch} on {hw.name}{short}; give --devices")


def check_spec_flags(a: argparse.Namespace, drafts_elsewhere: bool = False) -> None:
    """The speculative-decoding options need --draft-rows (or, in a sweep, a draft_rows axis)."""
    if a.draft_rows or drafts_elsewhere:
        return
    for flag in ("acceptance_length", "acceptance_prob", "draft_cost"):
        v = getattr(a, flag)
        require(v is None, "--" + flag.replace("_", "-"), v, "needs --draft-rows N (speculative decoding)")


def inputs_json(a, model, hw, d, **extra) -> dict:
    return {"model": model.name, "hardware": hw.name, **deployment_json(d), "kv_cache": model.formats["kv_cache"].name,
            **extra}
